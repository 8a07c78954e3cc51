"""The planner's inputs checked before a model is read or a layout enumerated.

Owns the refusals of a cluster, sequence length or batch the planner cannot plan for (no devices, more
nodes than devices, a non-positive memory or sequence, a sequence past the model's learned positions or
so long that its sizes overflow), each a one-line ValueError naming the value and the fix, in the
command line's flag names (`python -m meshboost.plan` prints them as its errors; `Planner(...)` raises
them). Must not estimate anything.
"""

from __future__ import annotations

import torch.nn as nn

# Longest sequence planned for: 16 Mi tokens, past every released context window (Llama 4 Scout: 10 M),
# and far enough below where a layer's sizes (tokens x tokens x heads elements of eager attention's
# scores) overflow int64 that every shape the fake-tensor pass builds stays representable.
MAX_SEQ = 2 ** 24


def check_cluster(gpus, nodes, memory_gb, global_batch) -> None:
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"--gpus {gpus}: the world needs at least one device (pass --gpus 1 or more)")
    if not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"--nodes {nodes}: pass --nodes 1 or more")
    if gpus % nodes:
        near = [n for n in range(1, gpus + 1) if gpus % n == 0]
        raise ValueError(f"--gpus {gpus} is not divisible by --nodes {nodes} (every node holds as many devices); "
                         f"pass --nodes one of {near}, or --gpus a multiple of {nodes}")
    if not memory_gb > 0:
        raise ValueError(f"--memory-gb {memory_gb:g}: the device memory in GiB must be positive (an H100 has 80)")
    if not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"--global-batch {global_batch}: pass at least one sequence per step")


def check_sequence(meta: nn.Module, seq) -> None:
    """`seq` is positive, at most MAX_SEQ, and within the rows of the model's learned position table
    (GPT-2's `wpe`, BERT's `position_embeddings`: a longer sequence fails inside the embedding)."""
    if not isinstance(seq, int) or seq < 1:
        raise ValueError(f"--seq {seq}: the sequence length must be at least 1 token")
    if seq > MAX_SEQ:
        raise ValueError(f"--seq {seq} is past the longest sequence the planner models ({MAX_SEQ} tokens); "
                         "pass a shorter --seq")
    inputs = meta.get_input_embeddings() if hasattr(meta, "get_input_embeddings") else None
    for name, module in meta.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if module is inputs or not isinstance(module, nn.Embedding) or not ("position" in leaf or leaf == "wpe"):
            continue
        rows = module.num_embeddings - int(getattr(module, "offset", 0) or 0)
        if seq > rows:
            field = "n_positions" if hasattr(meta.config, "n_positions") else "max_position_embeddings"
            raise ValueError(f"--seq {seq} is longer than the model's learned positions ({name}: {rows} rows); "
                             f"pass --seq {rows} or less, or --set {field}={seq}")
