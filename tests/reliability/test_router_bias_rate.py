"""`moe_router_bias_update_rate` that is not a finite number >= 0 is refused when the config is built
(issue 56 item 4): NaN or inf passed the old `rate < 0` test and, after one step, turned every
`e_score_correction_bias` NaN while the loss looked normal (the bias only picks experts).

Every door the rate comes in by: the typed `HybridParallelConfig` field and its `of()` shortcut, the
core plugin's keyword, ColossalAI's `HybridParallelPlugin` and `MoeHybridParallelPlugin` keywords, and
`boost()`'s model check (a config changed after it was built). Pure checks: one process, no group.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from meshboost.booster.plugin import HybridParallelPlugin as ColossalHybrid
from meshboost.booster.plugin.moe_hybrid_parallel_plugin import MoeHybridParallelPlugin
from meshboost.plugins import HybridParallelConfig, HybridParallelPlugin
from meshboost.plugins.router_bias import check_model
from meshboost.testing.models import build_model, tiny_config

DOORS = {
    "HybridParallelConfig": lambda r: HybridParallelConfig(moe_router_bias_update_rate=r),
    "HybridParallelConfig.of": lambda r: HybridParallelConfig.of(moe_router_bias_update_rate=r),
    "HybridParallelPlugin": lambda r: HybridParallelPlugin(moe_router_bias_update_rate=r),
    "colossalai HybridParallelPlugin": lambda r: ColossalHybrid(tp_size=1, pp_size=1, moe_router_bias_update_rate=r),
    "colossalai MoeHybridParallelPlugin": lambda r: MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=1,
                                                                             moe_router_bias_update_rate=r),
}
BAD = [float("nan"), float("inf"), float("-inf"), np.float64("nan"), -1e-3, "1e-3", True]


@pytest.mark.parametrize("door", DOORS)
def test_bad_rate_refused_at_every_door(door):
    for rate in BAD:
        with pytest.raises(ValueError, match=re.escape(f"moe_router_bias_update_rate={rate!r} must be a finite number >= 0")):
            DOORS[door](rate)


def test_good_rates_kept():
    for rate in (0, 0.0, 1e-3, np.float32(0.5)):
        value = HybridParallelConfig(moe_router_bias_update_rate=rate).moe_router_bias_update_rate
        assert type(value) is float and value == float(rate)


def test_rate_changed_after_the_config_refused_at_boost():
    config = HybridParallelConfig()
    config.moe_router_bias_update_rate = float("nan")
    model = build_model("GPT2LMHeadModel", tiny_config("gpt2"))
    with pytest.raises(ValueError, match="moe_router_bias_update_rate=nan must be a finite number"):
        check_model(model, config.moe_router_bias_update_rate)
