"""Point-to-point traffic between pipeline stages, and the loss broadcast.

Owns: sending activations forward and gradients backward between the ranks of one pipeline group
(`ParallelMesh.pp_group`; each tensor-parallel rank talks to its counterpart), and broadcasting
the loss from the last stage. Every transfer is reported to `meshboost.distributed.profiling`.
Must not know about schedules or models.

Sends are asynchronous (their handles are kept until `wait_sends`), receives block: with any
valid schedule this cannot deadlock. A boundary may carry several tensors (a decoder stage
also needs the encoder output). Activations carry a small header (count, dtypes and shapes;
`ACTIVATION_HEADER_BYTES`, which the planner reads) so micro-batches may change shape from one
step to the next (dynamic padding, evaluation batches); gradients have the shape of the activation
they answer, which the receiver already knows.
Each (receiving virtual stage, direction) pair has its own tag, so interleaved streams sharing a
link never mix (gloo matches on tags; NCCL keeps per-pair issue order).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshboost.distributed.comm import broadcast, run_collective
from meshboost.distributed.profiling import record_collective

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_MAX_DIMS = 8
_MAX_TENSORS = 8
_HEADER_NUMEL = 1 + _MAX_TENSORS * (2 + _MAX_DIMS)      # the count, then (dtype, ndim, shape) per tensor
# bytes of the int64 header sent before each activation (the planner's p2p traffic reads it)
ACTIVATION_HEADER_BYTES = _HEADER_NUMEL * torch.int64.itemsize


class StageComm:
    """p2p between the pipeline ranks of `pp_group`; virtual stage v lives on pipeline rank v % size."""

    def __init__(self, pp_group, device: torch.device):
        self.group = pp_group
        self.ranks = dist.get_process_group_ranks(pp_group)
        self.size = len(self.ranks)
        self.device = device
        self._pending: list[tuple[object, torch.Tensor]] = []

    def _peer(self, virtual: int) -> int:
        return self.ranks[virtual % self.size]

    def _send(self, tensor: torch.Tensor, to_virtual: int, tag: int) -> None:
        tensor = tensor.detach().contiguous()
        record_collective("send", self.group, tensor)
        work = dist.isend(tensor, dst=self._peer(to_virtual), group=self.group, tag=tag)
        self._pending.append((work, tensor))          # keep the buffer alive until sent

    def _recv(self, buffer: torch.Tensor, from_virtual: int, tag: int) -> torch.Tensor:
        work = dist.irecv(buffer, src=self._peer(from_virtual), group=self.group, tag=tag)
        run_collective("recv", self.group, work.wait)
        return buffer

    # -- activations: virtual stage v-1 -> v ----------------------------------------------------
    def send_activation(self, tensors: list[torch.Tensor], to_virtual: int) -> None:
        """Send the tensors crossing a stage boundary (the hidden states; with an encoder-decoder
        also the encoder output, and what the layout carries): one header, then each tensor."""
        if not 1 <= len(tensors) <= _MAX_TENSORS:
            raise TypeError(f"pipeline stages pass 1 to {_MAX_TENSORS} tensors between them, got {len(tensors)}")
        header = torch.zeros(_HEADER_NUMEL, dtype=torch.int64, device=self.device)
        header[0] = len(tensors)
        for i, tensor in enumerate(tensors):
            if not torch.is_tensor(tensor) or tensor.dtype not in _DTYPES or tensor.dim() > _MAX_DIMS:
                what = f"{tensor.dtype} of shape {tuple(tensor.shape)}" if torch.is_tensor(tensor) else type(tensor)
                raise TypeError(f"pipeline stages pass float tensors of at most {_MAX_DIMS} dims between them, "
                                f"got {what}")
            at = 1 + i * (2 + _MAX_DIMS)
            header[at], header[at + 1] = _DTYPES.index(tensor.dtype), tensor.dim()
            header[at + 2:at + 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        self._send(header, to_virtual, tag=2 * to_virtual)
        for tensor in tensors:
            self._send(tensor, to_virtual, tag=2 * to_virtual)

    def recv_activation(self, at_virtual: int) -> list[torch.Tensor]:
        header = self._recv(torch.empty(_HEADER_NUMEL, dtype=torch.int64, device=self.device),
                            at_virtual - 1, tag=2 * at_virtual)
        tensors = []
        for i in range(int(header[0])):
            at = 1 + i * (2 + _MAX_DIMS)
            dtype, ndim = _DTYPES[int(header[at])], int(header[at + 1])
            shape = [int(d) for d in header[at + 2:at + 2 + ndim]]
            tensors.append(self._recv(torch.empty(shape, dtype=dtype, device=self.device), at_virtual - 1,
                                      tag=2 * at_virtual))
        return tensors

    # -- gradients: virtual stage v+1 -> v, one per tensor sent forward -----------------------------
    def send_grad(self, grads: list[torch.Tensor], to_virtual: int) -> None:
        for grad in grads:
            self._send(grad, to_virtual, tag=2 * to_virtual + 1)

    def recv_grad(self, at_virtual: int, like: list[torch.Tensor]) -> list[torch.Tensor]:
        return [self._recv(torch.empty(t.shape, dtype=t.dtype, device=self.device), at_virtual + 1,
                           tag=2 * at_virtual + 1) for t in like]

    def wait_sends(self) -> None:
        for work, _ in self._pending:
            run_collective("send", self.group, work.wait)
        self._pending.clear()

    # -- the loss, from the last stage to every stage ----------------------------------------------
    def broadcast_from_last(self, tensor: torch.Tensor) -> torch.Tensor:
        return broadcast(tensor, self.ranks[-1], self.group)
