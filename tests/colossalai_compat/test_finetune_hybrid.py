"""The ColossalAI-style fine-tuning script with `--plugin hybrid_parallel` on 2 processes, as
ColossalAI's BERT example configures it (pp=2 interleaved with 2 chunks, microbatch_size, ZeRO-1,
fp16 from initial_scale=1, enable_all_optimization; evaluation through execute_pipeline with
return_outputs and the last stage's broadcast over pg_mesh's pp ranks), and the tp=2, pp=1 variant:
the loss falls and held-out accuracy passes 0.75."""

import pytest
from _finetune import check_trained, run_finetune


@pytest.mark.parametrize("layout", [("--tp", "1", "--pp", "2"), ("--tp", "2", "--pp", "1")],
                         ids=["pp2_interleaved", "tp2"])
def test_colossalai_style_script_hybrid_parallel(layout):
    check_trained(run_finetune("--plugin", "hybrid_parallel", *layout), dp_size=1, steps=32)
