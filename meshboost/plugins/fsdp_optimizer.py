"""The path `meshboost.plugins.fsdp_optimizer`, kept for the tests that import it: `FSDPOptimizer`
lives in the FSDP2 engine (meshboost/fsdp/optimizer.py)."""

from meshboost.fsdp import FSDPOptimizer

__all__ = ["FSDPOptimizer"]
