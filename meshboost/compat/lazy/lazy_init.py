"""ColossalAI's path `lazy.lazy_init.LazyInitContext`: `meshboost.lazy.LazyInitContext` (the same class)."""

from meshboost.lazy import LazyInitContext

__all__ = ["LazyInitContext"]
