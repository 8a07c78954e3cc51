"""ColossalAI's `colossalai.pipeline.schedule.v_schedule` path (served as
`meshboost.pipeline.schedule.v_schedule` by compat/paths.py), so scripts that import `PipelineGraph` at
module level (examples/language/llama/benchmark.py) load.

Owns: the refusal only. meshboost runs 1F1B and interleaved 1F1B (`meshboost.pipeline.schedule`);
the zero-bubble V schedule (which splits backward into input- and weight-gradient passes) is not
built, so planning one is refused where it is asked for, naming the schedules that exist. Must not
pretend to plan a schedule.
"""

from __future__ import annotations


class PipelineGraph:
    """ColossalAI's zero-bubble V-schedule planner: refused at construction (every rank alike, before
    any collective), so a script reaches it only on its `pp_style="zbv"` path."""

    def __init__(self, n_stage, n_micro, f_cost, b_cost, w_cost, c_cost, f_mem, b_mem, w_mem, max_mem=None):
        raise NotImplementedError(
            f"PipelineGraph (the zero-bubble V schedule, n_stage={n_stage}, n_micro={n_micro}) is not implemented "
            "in meshboost; use HybridParallelPlugin(pp_style='1f1b') or pp_style='interleaved' with "
            "num_model_chunks=2 (which also shrinks the pipeline bubble) and no scheduler_nodes")
