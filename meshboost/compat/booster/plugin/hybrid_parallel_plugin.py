"""ColossalAI's path `booster.plugin.hybrid_parallel_plugin`: `HybridParallelPlugin` is meshboost.plugins'
class (served by this package's `__getattr__`), `HybridParallelModule` the model wrapper it returns from
`boost` (ColossalAI's tests check `isinstance(model, HybridParallelModule)` and call `model.unwrap()`)."""

from meshboost.booster.plugin import HybridParallelPlugin
from meshboost.plugins.hybrid_parallel import HybridParallelModule

__all__ = ["HybridParallelPlugin", "HybridParallelModule"]
