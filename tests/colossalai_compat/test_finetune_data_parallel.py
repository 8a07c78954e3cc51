"""The ColossalAI-style fine-tuning script (colossalai_style_finetune.py: ColossalAI's import paths,
meshboost names only) trains and evaluates a tiny BERT with `--plugin torch_ddp` and
`--plugin low_level_zero` on 2 processes (dp=2): the loss falls and held-out accuracy passes 0.75."""

import pytest
from _finetune import check_trained, run_finetune


@pytest.mark.parametrize("plugin", ["torch_ddp", "low_level_zero"])
def test_colossalai_style_script_data_parallel(plugin):
    check_trained(run_finetune("--plugin", plugin), dp_size=2, steps=16)      # 128 samples / (2 x 8) x 2 epochs
