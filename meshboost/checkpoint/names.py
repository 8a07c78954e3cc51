"""The names a model's parameters go by in checkpoints.

Owns: one name per parameter for keying saved state, and every name a parameter may be found under
when reading (its own names in this model, then the names of the weights the model ties it to).
A weight the model ties (transformers 5: `all_tied_weights_keys = {target: source}`, e.g. the LM
head tied to the embedding when `config.tie_word_embeddings`) is keyed by its source name even on
a pipeline stage that holds only the target, so every stage and layout agrees on one key; an
untied LM head keeps its own name. Must not read files.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def tied_weights(model: nn.Module) -> dict[str, str]:
    """{tied copy: source} for the weights this model really ties: transformers 5.x's
    `all_tied_weights_keys`, which honours `config.tie_word_embeddings` (the class attribute
    `_tied_weights_keys` lists what the class *may* tie: an untied Llama lists its LM head too)."""
    tied = getattr(model, "all_tied_weights_keys", None)
    return dict(tied) if isinstance(tied, dict) else {}


class ParamNames:
    """key(param): the name its state is saved under; names(param): every name to look it up by,
    its own names first."""

    def __init__(self, model: nn.Module):
        tied = tied_weights(model)
        self._key: dict[int, str] = {}
        self._names: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            self._key.setdefault(id(p), tied.get(name, name))
            names = self._names.setdefault(id(p), [])
            if name not in names:
                names.append(name)
        for p_id, names in self._names.items():
            names.extend(t for t in [tied[n] for n in names if n in tied] if t not in names)

    def key(self, param: torch.Tensor) -> str:
        return self._key[id(param)]

    def names(self, param: torch.Tensor) -> list[str]:
        return self._names[id(param)]

    def key_of(self, params) -> dict:
        """{param: key} for `params` (what an optimizer's export is keyed by)."""
        return {p: self.key(p) for p in params}

    def aliases(self) -> dict[str, str]:
        """Every name (and key) -> the key it is saved under: stored with optimizer states so that a
        layout holding only a tied copy finds the state."""
        return {n: self._key[i] for i, names in self._names.items() for n in [self._key[i], *names]}
