"""One training step per configuration: plain PyTorch, meshboost (tp, dp, ZeRO) and DTensor.

Owns: building each configuration from the same seeded model and batch, and exposing the step in
three parts (forward+backward, optimizer step, zero_grad) so the harness can time the whole step
and read memory between the parts. Every runner uses AdamW and fp32. Must not time or count
anything itself (that is `harness.py`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from benchmarks.models import ModelSpec, build_model, make_batch
from meshboost.distributed.launch import get_current_device

LR = 1e-4


@dataclass(frozen=True)
class ConfigSpec:
    """One row of the benchmark: which framework, on how many processes."""

    key: str
    label: str
    kind: str            # "plain" | "meshboost" | "dtensor"
    world: int
    tp: int = 1
    zero_stage: int = 0
    solo: bool = False   # one process's run placed in a larger group: rank 0 computes, the others idle at the
                         # step barrier, so it takes turns step by step with that group's configurations

    @property
    def dp(self) -> int:
        return 1 if self.solo else self.world // self.tp


CONFIGS = {c.key: c for c in (
    ConfigSpec("plain", "plain PyTorch", "plain", 1),
    ConfigSpec("tp1", "meshboost tp=1", "meshboost", 1, tp=1),
    ConfigSpec("tp2", "meshboost tp=2", "meshboost", 2, tp=2),
    ConfigSpec("dtensor", "DTensor tp=2", "dtensor", 2, tp=2),
    ConfigSpec("plain2", "plain PyTorch (in the tp=2 group)", "plain", 2, solo=True),
    ConfigSpec("dp2", "meshboost tp=2 dp=2", "meshboost", 4, tp=2),
    ConfigSpec("zero1", "meshboost tp=2 dp=2 ZeRO-1", "meshboost", 4, tp=2, zero_stage=1),
)}


class Runner:
    """Holds a model, its optimizer and its batch; subclasses say how a step runs."""

    mesh = None           # a meshboost ParallelMesh (labels groups tp/dp/pp) when there is one
    group_names: dict = {}
    records_collectives = False   # True when every collective calls meshboost's record_collective

    def __init__(self, config: ConfigSpec, spec: ModelSpec):
        self.config, self.spec = config, spec
        self.device = get_current_device()

    def loss_context(self):
        return contextlib.nullcontext()

    def forward_backward(self) -> float:
        with self.loss_context():
            loss = self.model(**self.batch).loss
            self._backward(loss)
        return float(loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach())

    def _backward(self, loss) -> None:
        loss.backward()

    def optimizer_step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


class PlainRunner(Runner):
    def __init__(self, config, spec):
        super().__init__(config, spec)
        self.model = build_model(spec).to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.batch = make_batch(spec, device=self.device)


class MeshboostRunner(Runner):
    records_collectives = True

    def __init__(self, config, spec):
        super().__init__(config, spec)
        from meshboost import Booster
        from meshboost.booster.plugin import HybridParallelPlugin

        # Raises NotImplementedError on every rank, before any collective, while a feature is missing.
        # check_inputs="first": the step's traffic is the model's, compared with Megatron's formula; the
        # per-step input check (one all-gather of 6 numbers over tp) is measured by benchmarks/input_check.py.
        plugin = HybridParallelPlugin(tp_size=config.tp, zero_stage=config.zero_stage, check_inputs="first")
        self.booster = Booster(plugin=plugin)
        self.mesh = plugin.mesh
        model = build_model(spec)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        self.model, self.optimizer, *_ = self.booster.boost(model, optimizer)
        self.batch = make_batch(spec, self.mesh.dp_size, self.mesh.dp_rank, device=self.device)

    def _backward(self, loss) -> None:
        self.booster.backward(loss, self.optimizer)


class DTensorRunner(Runner):
    def __init__(self, config, spec):
        super().__init__(config, spec)
        from torch.distributed.device_mesh import init_device_mesh

        from benchmarks.dtensor_tp import parallelize_hf

        if dist.get_world_size() != config.tp:
            raise ValueError(f"DTensor runner expects world size {config.tp}, got {dist.get_world_size()}")
        tp_mesh = init_device_mesh(self.device.type, (config.tp,), mesh_dim_names=("tp",))
        self.group_names = {tp_mesh.get_group(): "tp"}
        self.model = parallelize_hf(build_model(spec).to(self.device), spec.family, tp_mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.batch = make_batch(spec, device=self.device)

    def loss_context(self):
        if not self.spec.causal_lm:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel
        return loss_parallel()


def make_runner(config: ConfigSpec, spec: ModelSpec) -> Runner:
    return {"plain": PlainRunner, "meshboost": MeshboostRunner, "dtensor": DTensorRunner}[config.kind](config, spec)
