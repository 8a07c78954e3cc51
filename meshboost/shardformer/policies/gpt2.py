"""GPT-2 (`GPT2Model`, `GPT2LMHeadModel`, `GPT2For*`). Paths are relative to `GPT2Model`.

c_attn is a Conv1D whose output is [all q | all k | all v]: each rank must take its heads from
each third (colwise_fused(3)); a contiguous split runs and is silently wrong.
"""

from meshboost.shardformer.policies.base import Policy

GPT2_POLICY = Policy(
    name="gpt2",
    plan={
        "h.*.attn.c_attn": "colwise_fused(3)",
        "h.*.attn.c_proj": "rowwise",
        "h.*.mlp.c_fc": "colwise",
        "h.*.mlp.c_proj": "rowwise",
    },
    # The forward splits c_attn's output with split_size: it must be the per-rank width.
    attributes={"h.*.attn": {"split_size": "divide", "num_heads": "divide"}},
    divisible=("num_attention_heads",),
    pipeline_layout={"embeddings": ("wte", "wpe"), "layers": "h", "tail": ("ln_f",)},
)
