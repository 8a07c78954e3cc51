"""Test support: spawn helper, tolerance table, tiny model zoo."""

from meshboost.testing.spawn import free_port, spawn
from meshboost.testing.tolerance import LOSS_ATOL, TOLERANCE, assert_close

__all__ = ["spawn", "free_port", "TOLERANCE", "LOSS_ATOL", "assert_close"]
