"""Weak references from what meshboost attaches (hooks, pairings, records) to the objects that own it.

Owns: `weak_method` (a hook that calls a bound method while its object lives, and does nothing after),
`remove_when_freed` (hook handles removed when their owner is freed), `WeakAttribute` (an attribute
held by weak reference). Why: a hook registered on a parameter or module is held by torch, partly in
C++ autograd state Python's cycle collector cannot see into; a hook that held its owner strongly would
keep the owner (an optimizer with its fp32 masters and states, a whole model) alive for the life of
the process. With these, a boosted model, optimizer and booster the user drops are freed when their
last reference goes. Must not hold anything strongly itself.
"""

from __future__ import annotations

import weakref
from typing import Callable, Iterable

from torch.utils.hooks import RemovableHandle


def weak_method(method) -> Callable:
    """A callable running bound `method` with the arguments it is given while `method.__self__` lives;
    None afterwards. Register it as a hook instead of the bound method: the hook then never keeps its
    object alive."""
    ref = weakref.WeakMethod(method)

    def call(*args, **kwargs):
        bound = ref()
        return None if bound is None else bound(*args, **kwargs)

    call.__qualname__ = f"weak_method({method.__qualname__})"
    return call


def remove_when_freed(owner: object, handles: Iterable[RemovableHandle]) -> None:
    """Remove `handles` (hooks whose work belongs to `owner`) once `owner` is freed, so the objects
    they were registered on (parameters the user keeps) carry no dead hooks."""
    finalizer = weakref.finalize(owner, _remove, tuple(handles))
    finalizer.atexit = False


def _remove(handles: tuple[RemovableHandle, ...]) -> None:
    for handle in handles:
        handle.remove()


class WeakAttribute:
    """A class attribute whose value each instance holds by weak reference: reading it gives the
    object, or None once that object was freed (or none was set). For pairings such as a boosted
    model and its optimizer, where either side may be dropped on its own."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = f"_weak_{name}"

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        ref = obj.__dict__.get(self.slot)
        return None if ref is None else ref()

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.slot] = None if value is None else weakref.ref(value)
