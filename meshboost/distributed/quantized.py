"""Frozen 4-bit NF4 weights (torchao's `NF4Tensor`, QLoRA's format) cut into tensor-parallel shards exactly.

Owns: recognising an NF4 tensor (by class name, so torchao is imported only where one exists), casting a model
to its working dtype without dequantizing one (`cast_keeping_nf4`), swapping a parameter's data (`set_data_`), and `nf4_shard`,
which builds this rank's shard from the full tensor's own quantized bytes, never by quantizing the shard again.
Quantizing a shard on its own would give other numbers: NF4's double quantization subtracts the mean of all
the tensor's block scales before quantizing them, so a shard's scales would use its own mean. A shard made
here holds the same 4-bit codes, the same int8 scales, the same scale factors and the same mean. So it
dequantizes to exactly the slice of the full tensor's dequantized values, bitwise.

A piece must be made of whole quantization blocks (`block_size` consecutive elements of the row-major tensor):
rows of a dim-0 split start on a block, and a dim-1 split's columns start and end on blocks. The int8 scales
are then regrouped: each group of the shard shares one scale factor, and a shard whose blocks cross the full
tensor's scale groups gets smaller groups with the factor repeated. This changes no value.
"""

from __future__ import annotations

import torch
import torch.nn as nn

NF4_CLASS = "NF4Tensor"


def is_nf4(tensor) -> bool:
    return type(tensor).__name__ == NF4_CLASS


def dequantized(tensor: torch.Tensor) -> torch.Tensor:
    """The values an NF4 tensor computes with (in its dtype); any other tensor as it is."""
    return tensor.get_original_weight() if is_nf4(tensor) else tensor


def set_data_(param: torch.Tensor, value: torch.Tensor) -> None:
    """`param.data = value`, for an NF4 parameter too: its 4-bit data, scales and block sizes are attributes of
    the Python object, which `.data =` leaves as they were, so they are carried over (its records stay)."""
    param.data = value
    if is_nf4(value):
        param.__dict__.update(vars(value))


def cast_keeping_nf4(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model.to(dtype)` (in place) except for NF4 weights: torchao's `.to(dtype)` dequantizes, which would
    silently drop the quantization (the failure axolotl #2992 describes); they keep their 4-bit data and
    dequantize into the input's dtype in each product."""
    hidden = [(m, n, p) for m in model.modules() for n, p in m._parameters.items() if p is not None and is_nf4(p)]
    for module, name, _ in hidden:
        module._parameters[name] = None
    try:
        model.to(dtype)
    finally:
        for module, name, param in hidden:
            module._parameters[name] = param
    return model


def _block_indices(full, index: tuple) -> torch.Tensor:
    """The quantization blocks (in the full tensor's order) that `full[index]` covers, or a ValueError when
    a piece would cut a block."""
    rows, cols = full.shape if full.dim() == 2 else (1, full.shape[0])
    index = tuple(index) + (slice(None),) * (2 - len(index)) if full.dim() == 2 else (slice(None), *index)
    r0, r1, _ = index[0].indices(rows)
    c0, c1, _ = index[1].indices(cols)
    b = full.block_size
    if (c0, c1) == (0, cols):
        if (r0 * cols) % b or (r1 * cols) % b:
            raise ValueError(f"rows {r0}:{r1} of a [{rows}, {cols}] NF4 weight do not start and end on its "
                             f"quantization blocks of {b} elements")
        return torch.arange(r0 * cols // b, r1 * cols // b)
    if cols % b or c0 % b or c1 % b:
        raise ValueError(f"columns {c0}:{c1} of a [{rows}, {cols}] NF4 weight cut its quantization blocks of {b} "
                         f"elements (a row of {cols} must be a multiple of {b}, and so must each shard's)")
    per_row = cols // b
    return (torch.arange(r0, r1)[:, None] * per_row + torch.arange(c0 // b, c1 // b)[None, :]).reshape(-1)


def _group_size(groups: torch.Tensor, full_group: int) -> int:
    """The largest divisor of `full_group` that cuts the shard's blocks into runs sharing one scale group."""
    n = groups.numel()
    for size in sorted((d for d in range(1, full_group + 1) if full_group % d == 0), reverse=True):
        if n % size == 0 and bool((groups.view(-1, size) == groups.view(-1, size)[:, :1]).all()):
            return size
    return 1


def nf4_shard(full, pieces: list[tuple]) -> torch.Tensor:
    """The NF4 tensor `torch.cat([full[index] for index in pieces], dim)` would be if NF4 could be sliced
    anywhere: pieces of whole quantization blocks, taken from `full`'s own quantized data (see the module
    docstring). All pieces cut the same dim (the tp split's); dim 1 pieces concatenate along columns."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, construct_nf4_args

    if full.dim() not in (1, 2):
        raise ValueError(f"an NF4 weight of shape {tuple(full.shape)}: only 1-D and 2-D weights are split")
    blocks = [_block_indices(full, index) for index in pieces]
    shapes = [torch.empty(full.shape, device="meta")[index].shape for index in pieces]
    if full.dim() == 2 and len(pieces) > 1 and shapes[0][0] != full.shape[0]:
        shape = (sum(s[0] for s in shapes), full.shape[1])
        order = torch.cat(blocks)
    elif full.dim() == 2 and len(pieces) > 1:          # column pieces side by side: interleave row by row
        shape = (full.shape[0], sum(s[1] for s in shapes))
        order = torch.cat([b.view(full.shape[0], -1) for b in blocks], dim=1).reshape(-1)
    else:
        shape, order = tuple(shapes[0]), blocks[0]
    b, group = full.block_size, full.scaler_block_size
    data = full.quantized_data.view(full.n_blocks, b // 2)[order].reshape(-1)
    scalers = full.quantized_scalers[order]
    factors = full.quantization_factor.repeat_interleave(group)[order]
    size = _group_size(order // group, group)
    attrs = dict(size=torch.Size(shape), stride=torch.empty(shape, device="meta").stride(), storage_offset=0,
                 n_blocks=order.numel(), scaler_block_size=size, quantized_scalers=scalers.contiguous(),
                 quantization_factor=factors.view(-1, size)[:, 0].contiguous(), quantized_data=data.contiguous(),
                 scaler_mean=full.scaler_mean.clone(), nf4=full.nf4)
    return NF4Tensor(*construct_nf4_args(full, attrs))
