"""ColossalAI's `logging` package: a logger that writes on chosen ranks only.

`get_dist_logger(name)` gives a `DistributedLogger`, a thin view of the standard library's
`logging.getLogger(name)`: `info(msg, ranks=[0])` (and `warning`, `debug`, `error`) writes only on the
listed global ranks (every rank when `ranks` is None), each message preceded by its caller's
file:line function as ColossalAI does. The logger's state (level, handlers) lives in the standard
library's registry, so two `get_dist_logger("x")` calls answer alike; the view holds nothing.
`disable_existing_loggers` quiets other libraries' loggers down to WARNING.

Must not decide ranks by anything but `torch.distributed` (rank 0 when no process group exists).
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path

import torch.distributed as dist

__all__ = ["get_dist_logger", "DistributedLogger", "disable_existing_loggers"]

LEVELS = ("INFO", "DEBUG", "WARNING", "ERROR")
FORMAT = "meshboost - %(name)s - %(levelname)s: %(message)s"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _check_level(level: str) -> int:
    if level not in LEVELS:
        raise ValueError(f"logging level {level!r}; expected one of {LEVELS}")
    return getattr(logging, level)


class _ConsoleHandler(logging.StreamHandler):
    """The console handler a DistributedLogger adds once to its standard logger (its type marks it)."""


class DistributedLogger:
    """ColossalAI's distributed logger over `logging.getLogger(name)` (INFO by default, not propagated
    to the root logger, one console handler)."""

    def __init__(self, name: str = "meshboost"):
        self.name = name
        self.logger = logging.getLogger(name)
        if not any(isinstance(h, _ConsoleHandler) for h in self.logger.handlers):
            handler = _ConsoleHandler()
            handler.setFormatter(logging.Formatter(FORMAT))
            self.logger.addHandler(handler)
            self.logger.setLevel(logging.INFO)
            self.logger.propagate = False

    @staticmethod
    def get_instance(name: str) -> DistributedLogger:
        """ColossalAI's constructor path: the logger named `name`."""
        return DistributedLogger(name)

    @property
    def rank(self) -> int:
        """This process's global rank (0 without a process group)."""
        return _rank()

    def set_level(self, level: str) -> None:
        """Only messages at `level` ("INFO", "DEBUG", "WARNING", "ERROR") or above are written."""
        self.logger.setLevel(_check_level(level))

    def log_to_file(self, path: str | Path, mode: str = "a", level: str = "INFO", suffix: str | None = None) -> None:
        """Also write this rank's messages to `path/rank_<rank>[_<suffix>].log` (the folder is created)."""
        file_level = _check_level(level)
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        stem = f"rank_{self.rank}" + (f"_{suffix}" if suffix is not None else "")
        handler = logging.FileHandler(folder / f"{stem}.log", mode)
        handler.setLevel(file_level)
        handler.setFormatter(logging.Formatter(FORMAT))
        self.logger.addHandler(handler)

    def _log(self, level: int, message: str, ranks) -> None:
        if ranks is not None and self.rank not in ranks:
            return
        caller = inspect.currentframe().f_back.f_back     # info/warning/... called us; the script called it
        self.logger.log(level, f"{caller.f_code.co_filename}:{caller.f_lineno} {caller.f_code.co_name}")
        self.logger.log(level, message)

    def info(self, message: str, ranks: list[int] | None = None) -> None:
        self._log(logging.INFO, message, ranks)

    def warning(self, message: str, ranks: list[int] | None = None) -> None:
        self._log(logging.WARNING, message, ranks)

    def debug(self, message: str, ranks: list[int] | None = None) -> None:
        self._log(logging.DEBUG, message, ranks)

    def error(self, message: str, ranks: list[int] | None = None) -> None:
        self._log(logging.ERROR, message, ranks)


def get_dist_logger(name: str = "meshboost") -> DistributedLogger:
    """The distributed logger named `name` (ColossalAI's default name is "colossalai")."""
    return DistributedLogger(name)


def disable_existing_loggers(include: list[str] | None = None, exclude: tuple[str, ...] = ("meshboost", "colossalai")
                             ) -> None:
    """Set every logger that exists now to WARNING: those named in `include`, or when it is None every one
    not named in `exclude`."""
    for name in list(logging.Logger.manager.loggerDict):
        if (name in include) if include is not None else (name not in exclude):
            logging.getLogger(name).setLevel(logging.WARNING)
