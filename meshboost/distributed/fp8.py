"""fp8-compressed gradient all-reduce (ColossalAI's `fp8_communication`), and the DDP hook that uses it.

Owns: per-tensor scaled e4m3 quantisation (`quantize` / `dequantize`), `all_reduce_fp8` (each rank
quantises its tensor with its own scale; an all-to-all sends every rank the chunk it reduces; the
chunks are summed in fp32; the reduced chunk is quantised again and all-gathered: 2 (P-1)/P bytes per
element on the wire, a quarter of fp32's), and `fp8_allreduce_hook` for torch DDP buckets. fp8
payloads travel as uint8 (the bytes of float8_e4m3fn), which every backend moves, scales as fp32.
This is lossy by design: each element keeps 3 mantissa bits relative to its tensor's largest value
(relative error <= 2^-4 of the max per quantisation, two quantisations per all-reduce). A non-finite
input (an fp16 overflow) makes the whole result non-finite, so loss scalers still see it. Must not
decide when fp8 is used (the plugins do).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshboost.distributed.comm import all_gather, all_gather_into, run_collective
from meshboost.distributed.profiling import record_collective

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max            # 448
RELATIVE_STEP = 2.0 ** -4                 # e4m3: 3 mantissa bits, rounding to nearest


def quantize(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 payload holding e4m3 values, fp32 scale [1]) with t ~= payload * scale; the largest
    |t| maps to FP8_MAX. A non-finite t gives a NaN scale (the result stays non-finite)."""
    t32 = t.float()
    amax = t32.abs().max() if t32.numel() else torch.zeros((), device=t.device)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scale = torch.where(torch.isfinite(amax), scale, torch.full_like(amax, float("nan")))
    payload = (t32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)
    return payload, scale.reshape(1)


def dequantize(payload: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of a `quantize` payload (scale broadcast over its leading dims)."""
    return payload.view(FP8).float() * scale


def all_reduce_fp8(tensor: torch.Tensor, group, average: bool = False) -> torch.Tensor:
    """In-place sum (or mean) of `tensor` over `group`, moved in fp8 (see the module). Returns it."""
    size = dist.get_world_size(group)
    if size == 1:
        return tensor
    flat = tensor.view(-1)
    n = flat.numel()
    chunk = -(-n // size)
    padded = torch.zeros(chunk * size, dtype=torch.float32, device=tensor.device)
    padded[:n] = flat
    payload, scale = quantize(padded)
    received = torch.empty_like(payload)
    record_collective("all_to_all", group, payload)
    run_collective("all_to_all", group, lambda: dist.all_to_all_single(received, payload, group=group))
    scales = all_gather(scale, group, dim=0)                       # [size]: the sender of each chunk
    part = dequantize(received.view(size, chunk), scales.unsqueeze(-1)).sum(0)
    if average:
        part /= size
    mine, my_scale = quantize(part)
    gathered = torch.empty(chunk * size, dtype=torch.uint8, device=tensor.device)
    all_gather_into(gathered, mine, group)
    owners = all_gather(my_scale, group, dim=0)
    result = dequantize(gathered.view(size, chunk), owners.unsqueeze(-1)).view(-1)[:n]
    flat.copy_(result.to(flat.dtype))
    return tensor


def fp8_allreduce_hook(process_group, bucket):  # no annotations: DDP compares them as objects
    """A torch DDP communication hook: the bucket's mean over `process_group` (None: the world),
    moved in fp8. Runs its collectives before returning (no overlap with the rest of backward)."""
    buffer = bucket.buffer()
    all_reduce_fp8(buffer, process_group if process_group is not None else dist.group.WORLD, average=True)
    future = torch.futures.Future()
    future.set_result(buffer)
    return future
