"""Expert parallelism: every MoE layer's experts split over the ep ranks, each token sent to its experts.

Owns: checking that a model's experts can be split over `ep_size` ranks (pure, before anything
changes: `check_expert_parallel`), splitting each packed experts module on its expert dim (rank j
of the ep group keeps experts [j E/ep, (j+1) E/ep), whole, or with tensor parallelism inside them
its tp slice of each: `layers/experts.py`), the records its weights carry (the expert split in
their `TensorParallelInfo`, kind "expert": averaged over the experts' own data-parallel replicas,
the edp axis), and the dispatching forward (`ExpertParallelForward`), which `layers/experts.py`'s
`set_experts_forward` makes the module's, with tensor parallelism's record when tp cut inside the
experts: one record decides the forward for tp, ep and tp x ep, nothing is taken off and replayed.

The forward, on the tokens of this rank: every (token, expert) pair, sorted by expert, goes to the
rank holding the expert by one all-to-all with uneven per-rank counts (the counts first, by a small
all-to-all); the module's own HF forward (eager or any `_experts_implementation`) runs on the rows
received, with local expert ids and unit weights; a second all-to-all sends the outputs back, where
the routing weights combine them, so the router's gradient stays on the rank that routed. Under
sequence parallelism the tp ranks' chunks are gathered over tp first (layers/experts.py), so tp
siblings dispatch the same rows, their experts' partial sums (no g) travel back and are combined, and
the sum over tp is one reduce-scatter onto each rank's chunk. Both
exchanges are differentiable (`comm.all_to_all`): a rank that receives no token still joins both
backward exchanges, and its experts get zero gradients, never none, so every reducer sees the same
buckets on every rank (the ZeRO-2 hang of ColossalAI's MoE plugin when an expert gets no token).

Gradients: the experts of an ep group see the tokens of all its ep ranks, so an expert's local
gradient is the sum of ep replicas' contributions; a gradient hook divides it by ep and the
reducers average it over edp, which makes it the mean over all dp replicas, as a dense weight's.
Must not know a model family or route tokens itself (the model's router does).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from functools import partial

import torch
import torch.nn as nn

from meshboost.distributed import comm
from meshboost.distributed.param_info import (
    EXPERT,
    GradReduction,
    TensorParallelInfo,
    get_tp_info,
    register_grad_hook,
    set_grad_reduction,
    set_tp_info,
)
from meshboost.shardformer.layers.experts import TensorParallelExperts, is_packed_experts, set_experts_forward


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of every packed experts module of `model`, each module once."""
    seen, out = set(), []
    for path, module in model.named_modules():
        if id(module) not in seen and is_packed_experts(module):
            seen.add(id(module))
            out.append((path, module))
    return out


def check_expert_parallel(model: nn.Module, ep_size: int) -> list[tuple[str, nn.Module]]:
    """The experts modules `ep_size` ranks split, or an error naming the value and the fix. Pure: the
    same answer on every rank, before any collective."""
    found = experts_modules(model)
    name = type(model).__name__
    if not found:
        raise ValueError(f"ep_size={ep_size}: {name} has no mixture-of-experts layer meshboost can split (packed "
                         "experts: 3-D gate_up_proj / up_proj and down_proj, as transformers 5 stores them); use "
                         "ep_size=1 for this model")
    for path, module in found:
        experts = module.down_proj.shape[0]
        if experts % ep_size:
            raise ValueError(f"ep_size={ep_size} does not divide the {experts} experts of {path}; choose an ep_size "
                             f"dividing {experts}")
        counts = {n: p.shape[0] for n, p in module.named_parameters(recurse=False)}
        if any(c != experts for c in counts.values()):
            raise NotImplementedError(
                f"ep_size={ep_size}: the parameters of {path} disagree on the number of experts ({counts}: identity "
                "or zero experts the router may pick beyond the packed ones), so its experts cannot be dealt out over "
                "ep ranks; use ep_size=1 (tensor parallelism splits inside every expert)")
        shared = sorted({n.rpartition(".")[0] for n, _ in module.named_parameters() if "." in n})
        if shared:
            raise NotImplementedError(
                f"ep_size={ep_size}: {path} holds {', '.join(shared)}, weights every expert shares inside the experts "
                "module; an ep rank sees only the tokens routed to its experts, so their gradient would be partial; "
                "use ep_size=1 (tensor parallelism splits inside every expert)")
        params = _forward_params(module)
        if len(params) not in (1, 3):
            raise NotImplementedError(
                f"{path} ({type(module).__name__}.forward({', '.join(params)})) takes neither (hidden_states, expert "
                "ids, routing weights) nor one row block per expert (Llama-4's hidden_states [E * tokens, H]); "
                "meshboost cannot dispatch its tokens: use ep_size=1")
    return found


def _forward_params(module: nn.Module) -> list[str]:
    return [p for p in inspect.signature(type(module).forward).parameters if p != "self"]


def shard_expert_parallel_(model: nn.Module, group, ep_size: int, ep_rank: int) -> list[str]:
    """Split every experts module of `model` over the ep `group` in place (after tensor-parallel
    sharding, which cut inside the experts) and install the dispatching forward; returns the paths."""
    found = check_expert_parallel(model, ep_size)
    for _, module in found:
        num_experts = module.down_proj.shape[0]
        local = num_experts // ep_size
        for p in module.parameters(recurse=False):
            info = get_tp_info(p) or TensorParallelInfo(dim=p.dim() - 1, full_shape=tuple(p.shape),
                                                        padded_size=p.shape[-1], tp_rank=0, tp_size=1)
            info = dataclasses.replace(info, expert_size=ep_size, expert_rank=ep_rank, expert_group=group)
            with torch.no_grad():
                p.data = p.data[ep_rank * local:(ep_rank + 1) * local].clone()
            set_tp_info(p, info)
            set_grad_reduction(p, GradReduction(EXPERT))
            if p.requires_grad:
                register_grad_hook(p, _ExpertGradScale(ep_size))
        if hasattr(module, "num_experts"):
            module.num_experts = local            # the HF forward one-hot encodes the local ids with it
        set_experts_forward(module, ep=ExpertParallelForward(group, ep_size, num_experts, type(module).forward,
                                                              len(_forward_params(module)) == 1))
    return [path for path, _ in found]


class _ExpertGradScale:
    """An expert weight's gradient summed the ep ranks' contributions: 1/ep of it, so averaging over
    the experts' replicas (edp) gives the mean over every dp replica."""

    def __init__(self, ep_size: int):
        self.factor = 1.0 / ep_size

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        return grad * self.factor


@dataclasses.dataclass(frozen=True)
class ExpertParallelForward:
    """The experts module's forward under expert parallelism (see the module docstring), fixed per
    module; `run` gets the module and tensor parallelism's record (None: experts whole) with each call.
    Two input layouts: routed (hidden_states [tokens, H], expert ids and routing weights [tokens, k]:
    Qwen3-MoE, Mixtral, DeepSeek, GPT-OSS, ...), and one row block per expert (`blocks`: hidden_states
    [E * tokens, H], block e already scaled by each token's score for expert e: Llama-4), where every ep
    rank sends each expert's whole block to the rank holding it: the same all-to-all, with equal blocks."""

    group: object
    ep_size: int
    num_experts: int
    inner: Callable                 # the HF forward, on the local experts
    blocks: bool

    @property
    def local(self) -> int:
        return self.num_experts // self.ep_size

    def run(self, module: nn.Module, tp: TensorParallelExperts | None, args: tuple, kwargs: dict) -> torch.Tensor:
        if self.blocks:
            hidden = next(t for t in (*args, *kwargs.values()) if torch.is_tensor(t))
            return self._blocks(module, tp, hidden)
        hidden, ids, weights = self._routed(module, args, kwargs)
        if tp is not None and tp.seq_parallel:   # every tp rank's chunk, so tp siblings dispatch alike
            (hidden, ids, weights), _ = tp.gather_tokens((hidden, ids, weights), {})
            return tp.scatter_tokens(self._dispatch(module, tp, hidden, ids, weights))
        return self._dispatch(module, tp, hidden, ids, weights)

    def _blocks(self, module: nn.Module, tp, hidden: torch.Tensor) -> torch.Tensor:
        """Llama-4's layout: rank j gets block [j E/ep, (j+1) E/ep) of every rank's [E, tokens, H]; its
        experts run on [E/ep, all ranks' tokens, H]; the outputs go back the same way."""
        width = hidden.shape[-1]
        tokens = hidden.shape[0] // self.num_experts
        send_sizes = [self.local * tokens] * self.ep_size
        recv_sizes = self._block_sizes(hidden, send_sizes)                     # the one host sync
        received = self._exchange(hidden.reshape(-1, width), recv_sizes, send_sizes)
        per_rank = [n // self.local for n in recv_sizes]                        # each rank's token count
        x = torch.cat([b.view(self.local, n, width) for b, n in zip(received.split(recv_sizes), per_rank)], dim=1)
        out = self._run_local(module, tp, (x.reshape(-1, width),)).view(self.local, sum(per_rank), width)
        out = torch.cat([b.reshape(-1, width) for b in out.split(per_rank, dim=1)])
        return self._exchange(out, send_sizes, recv_sizes)

    # The exchanges, each a method of its own: the planner's fake run (plan/ep_dispatch.py) replays this
    # forward with shape-only ones, so what it measures is what this code allocates and saves.
    def _exchange(self, x: torch.Tensor, output_sizes: list[int], input_sizes: list[int]) -> torch.Tensor:
        """Rows `input_sizes[r]` of `x` to ep rank r; the rows every rank sent here (differentiable)."""
        return comm.all_to_all(x, self.group, output_sizes, input_sizes)

    def _block_sizes(self, hidden: torch.Tensor, send_sizes: list[int]) -> list[int]:
        """The blocks' rows each ep rank sends here (their token counts may differ)."""
        sizes = torch.tensor(send_sizes, dtype=torch.long, device=hidden.device)
        return comm.all_to_all_single(sizes, self.group).tolist()

    def _routed_sizes(self, module: nn.Module, ids: torch.Tensor, flat: torch.Tensor,
                      bad: torch.Tensor) -> tuple[list[int], list[int], torch.Tensor]:
        """(rows sent to each ep rank, rows received from each, the received rows' count per (sending
        rank, local expert)) of the routed layout: the counts' all-to-all and the layer's one host sync.
        An id outside the experts (`bad`) is flagged, not counted (transformers' experts would skip id E
        silently); the flag rides with the counts, so every ep rank learns it and raises together."""
        counts = torch.bincount(flat, minlength=self.num_experts).view(self.ep_size, self.local)
        header = torch.cat([counts, bad.any().to(counts.dtype).expand(self.ep_size, 1)], dim=1)
        received_header = comm.all_to_all_single(header.reshape(-1), self.group).view(self.ep_size, self.local + 1)
        recv_counts = received_header[:, :self.local].reshape(-1)   # [from rank r: its count per local expert]
        send_sizes, recv_sizes, flags = torch.stack(
            [counts.sum(1), recv_counts.view(self.ep_size, self.local).sum(1), received_header[:, -1]]).tolist()
        if any(flags):
            self._refuse(module, ids, flags)
        return send_sizes, recv_sizes, recv_counts

    def _run_local(self, module: nn.Module, tp, args: tuple) -> torch.Tensor:
        """The HF forward on this rank's experts; with tp inside them, f before and g after (every tp
        rank received the same rows)."""
        kwargs = {}
        if tp is not None:
            args, kwargs = tp.copy_inputs(module, args, kwargs)
        out = self.inner(module, *args, **kwargs)
        if tp is not None:
            out = tp.reduce_output(module, args, kwargs, out)
        return out

    def _routed(self, module: nn.Module, args, kwargs):
        tensors = [t for t in (*args, *kwargs.values()) if torch.is_tensor(t)]
        ids = [t for t in tensors if not t.is_floating_point() and t.dtype != torch.bool]
        floats = [t for t in tensors if t.is_floating_point()]
        if len(ids) != 1 or len(floats) != 2 or floats[1].shape != ids[0].shape:
            raise TypeError(f"{type(module).__name__} under expert parallelism expects (hidden_states, expert "
                            f"ids [tokens, k], routing weights [tokens, k]); got tensors of shapes "
                            f"{[tuple(t.shape) for t in tensors]}")
        return floats[0], ids[0], floats[1]

    def _dispatch(self, module: nn.Module, tp, hidden: torch.Tensor, ids: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
        """The routed layout's exchange, local experts and combine (see the module docstring)."""
        shape = hidden.shape
        hidden = hidden.reshape(-1, shape[-1])
        ids = ids.reshape(hidden.shape[0], -1)
        tokens, k = ids.shape
        flat = ids.reshape(-1)
        bad = (flat < 0) | (flat >= self.num_experts)
        flat = flat.clamp(0, self.num_experts - 1)
        order = torch.argsort(flat, stable=True)           # by expert, hence by the rank holding it
        send = hidden[order // k]
        send_sizes, recv_sizes, recv_counts = self._routed_sizes(module, ids, flat, bad)
        received = self._exchange(send, recv_sizes, send_sizes)
        local_ids = torch.arange(self.local, device=flat.device).repeat(self.ep_size)
        local_ids = local_ids.repeat_interleave(recv_counts, output_size=sum(recv_sizes)).unsqueeze(-1)
        out = self._local_experts(module, tp, received, local_ids)
        back = self._exchange(out, send_sizes, recv_sizes)
        back = back[torch.argsort(order)].view(tokens, k, -1)         # each (token, slot) pair in place again
        combined = (back * weights.reshape(tokens, k, 1).to(back.dtype)).sum(dim=1)
        combined = combined.to(hidden.dtype)
        # not a view when the shape is already right: FSDP2 (zero_stage=3) hooks its unit's outputs for
        # backward, and a view's hook would be lost to an in-place op on it
        return combined if combined.shape == shape else combined.reshape(shape)

    def _refuse(self, module: nn.Module, ids: torch.Tensor, flags: list[int]) -> None:
        ranks = [r for r, f in enumerate(flags) if f]
        own = ids[(ids < 0) | (ids >= self.num_experts)]
        mine = f" (here: expert id {int(own[0])})" if own.numel() else ""
        raise ValueError(f"{type(module).__name__}: ep rank(s) {ranks} routed a token to an expert id outside the "
                         f"{self.num_experts} experts [0, {self.num_experts}){mine}; the router (or a custom one) is "
                         "wrong. Raised on every rank of the expert-parallel group, before the tokens are exchanged")

    def _local_experts(self, module: nn.Module, tp, x: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """This rank's experts on the rows it received (top-1 each, unit weights); with tensor
        parallelism inside the experts, f before and g after, as `shard_experts_` would hook them (every
        tp rank received the same rows). No row: a zero output still joined to the graph."""
        if x.shape[0] == 0:
            out = x * 0
        else:
            out = self._run_local(module, tp, (x, local_ids, torch.ones(local_ids.shape, dtype=x.dtype,
                                                                        device=x.device)))
        # Every local expert weight gets a gradient (zero where no row reached it), so the reducers
        # hold the same tensors on every replica whatever the router did. Read by name: a tensor peft
        # parametrizes for the call (LoRA on experts) is then the adapted one, reaching its adapters.
        names = [*dict(module.named_parameters(recurse=False)), *getattr(module, "parametrizations", {})]
        anchor = sum(t.reshape(-1)[:1].sum() for t in map(partial(getattr, module), names) if t.requires_grad)
        return out + (anchor * 0).to(out.dtype) if torch.is_tensor(anchor) else out
