"""What a training step should cost: Megatron 1D tensor-parallel communication, data-parallel
gradient reduction and per-rank memory. Pure arithmetic; the benchmark divides measured by these.

Tensor parallelism over P ranks, local batch b, sequence s, hidden h, L layers (fp32 = 4 bytes):
  per layer     4 all-reduces of b*s*h  (forward: after attention and MLP row-parallel linears;
                                         backward: input grad of the attention and MLP blocks)
  embedding     1 all-reduce of b*s*h forward (vocab-parallel lookup)
  LM head       1 all-reduce of b*s*h backward (Megatron f on the head's input)
  loss          1 all-reduce MAX of b*s fp32 + 1 all-reduce SUM of 2*b*s fp32 (vocab-parallel CE:
                row maxima, then target logit and softmax denominator stacked in one call)
Classification heads are replicated and add nothing. Each all-reduce sends 2(P-1)/P of its bytes
per rank (ring).
"""

from __future__ import annotations

from benchmarks.models import ModelSpec


def ring_factor(op: str, size: int) -> float:
    return {"all_reduce": 2 * (size - 1) / size, "all_gather": (size - 1) / size,
            "reduce_scatter": (size - 1) / size}.get(op, 1.0)


def tp_comm_terms(spec: ModelSpec, tp: int, dp: int = 1, elem_bytes: int = 4) -> list[tuple[str, int, int]]:
    """(term, calls, payload bytes per call) of one training step's tensor-parallel all-reduces."""
    if tp == 1:
        return []
    b, s, h = spec.batch // dp, spec.seq, spec.hidden
    act = b * s * h * elem_bytes
    terms = [("layers fwd (row-parallel outputs)", 2 * spec.layers, act),
             ("layers bwd (block input grads)", 2 * spec.layers, act),
             ("embedding fwd", 1, act)]
    if spec.causal_lm:
        terms += [("lm head bwd (input grad)", 1, act),
                  ("cross-entropy max (fp32)", 1, b * s * 4),
                  ("cross-entropy sums (fp32)", 1, 2 * b * s * 4)]
    return terms


def tp_comm_theory(spec: ModelSpec, tp: int, dp: int = 1, elem_bytes: int = 4) -> dict:
    """Calls, payload bytes and ring bytes sent per rank by tensor parallelism in one step."""
    terms = tp_comm_terms(spec, tp, dp, elem_bytes)
    calls = sum(c for _, c, _ in terms)
    payload = sum(c * n for _, c, n in terms)
    return {"calls": calls, "payload_bytes": payload,
            "sent_bytes": ring_factor("all_reduce", tp) * payload if tp > 1 else 0.0,
            "terms": [{"term": t, "calls": c, "bytes_each": n} for t, c, n in terms]}


def dp_comm_theory(grad_bytes: int, dp: int) -> dict:
    """Gradient reduction over dp replicas: one all-reduce of every local gradient (or the
    equivalent reduce-scatter + all-gather of ZeRO): 2(D-1)/D of the local gradient bytes."""
    return {"payload_bytes": grad_bytes if dp > 1 else 0,
            "sent_bytes": ring_factor("all_reduce", dp) * grad_bytes if dp > 1 else 0.0}


def memory_theory(num_params: int, tp: int, dp: int, zero_stage: int, elem_bytes: int = 4) -> dict:
    """Ideal per-rank bytes with every parameter split over tp (DESIGN.md, fp32 here): weights and
    grads 4*Psi/P, AdamW moments 8*Psi/P (divided by D under ZeRO-1/2), fp32 masters none (the
    working weights are fp32; ZeRO's fp32 master shard is a view of the weights' flat buffer)."""
    local = num_params / tp
    return {"weights": elem_bytes * local,
            "grads": elem_bytes * local / (dp if zero_stage >= 2 else 1),
            "masters": 0.0,
            "optimizer_states": 8 * local / (dp if zero_stage >= 1 else 1)}
