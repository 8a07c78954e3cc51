"""ColossalAI's import paths resolve to meshboost's own objects (aliases, not second copies):
`meshboost.booster.plugin` and its plugin submodules, `dp_plugin_base.DPPluginBase`,
`meshboost.cluster`, `meshboost.accelerator`, `meshboost.nn.optimizer`. The concrete plugins are
provided lazily by the top-level package (importing meshboost does not import them), a plugin
that meshboost.plugins does not export fails with a message saying what to use, and every
keyword of ColossalAI's HybridParallelPlugin and TorchDDPPlugin is in meshboost's signatures."""

import importlib
import inspect
import subprocess
import sys

import pytest
import torch

import meshboost
import meshboost.plugins

PLUGIN_MODULES = {"HybridParallelPlugin": "hybrid_parallel_plugin", "LowLevelZeroPlugin": "low_level_zero_plugin",
                  "TorchDDPPlugin": "torch_ddp_plugin", "GeminiPlugin": "gemini_plugin",
                  "TorchFSDPPlugin": "torch_fsdp_plugin"}

# ColossalAI's keyword names (booster/plugin/hybrid_parallel_plugin.py and torch_ddp_plugin.py, 2026-04)
COLOSSALAI_HYBRID_KEYWORDS = """tp_size pp_size sp_size precision zero_stage enable_all_optimization
    enable_fused_normalization enable_flash_attention enable_jit_fused enable_sequence_parallelism
    sequence_parallelism_mode parallel_output num_microbatches microbatch_size initial_scale min_scale growth_factor
    backoff_factor growth_interval hysteresis max_scale max_norm broadcast_buffers ddp_bucket_cap_mb
    find_unused_parameters check_reduction gradient_as_bucket_view static_graph zero_bucket_size_in_m cpu_offload
    communication_dtype overlap_communication custom_policy pp_style num_model_chunks scheduler_nodes
    num_layers_per_stage gradient_checkpoint_config enable_metadata_cache make_vocab_size_divisible_by dp_outside
    overlap_p2p overlap_allgather fp8_communication use_fp8 inner_ring_size""".split()
COLOSSALAI_DDP_KEYWORDS = """broadcast_buffers bucket_cap_mb find_unused_parameters check_reduction
    gradient_as_bucket_view static_graph fp8_communication""".split()


def test_plugin_paths_are_meshboost_plugins():
    from meshboost.booster.plugin import HybridParallelPlugin, LowLevelZeroPlugin, Plugin, TorchDDPPlugin
    from meshboost.booster.plugin.dp_plugin_base import DPPluginBase
    from meshboost.booster.plugin.plugin_base import Plugin as BasePlugin

    assert HybridParallelPlugin is meshboost.plugins.HybridParallelPlugin
    assert LowLevelZeroPlugin is meshboost.plugins.LowLevelZeroPlugin
    assert TorchDDPPlugin is meshboost.plugins.TorchDDPPlugin
    assert Plugin is BasePlugin is meshboost.booster.Plugin is DPPluginBase
    for name in ("HybridParallelPlugin", "LowLevelZeroPlugin", "TorchDDPPlugin"):
        assert issubclass(getattr(meshboost.plugins, name), DPPluginBase)
    for name, module in PLUGIN_MODULES.items():
        if not hasattr(meshboost.plugins, name):
            continue                                  # being added: its absence is tested below
        sub = importlib.import_module(f"meshboost.booster.plugin.{module}")
        assert getattr(sub, name) is getattr(meshboost.plugins, name)
        assert getattr(importlib.import_module("meshboost.booster.plugin"), name) is getattr(meshboost.plugins, name)


def test_a_plugin_meshboost_lacks_says_what_to_use(monkeypatch):
    import meshboost.booster.plugin as paths

    monkeypatch.delattr(meshboost.plugins, "GeminiPlugin", raising=False)
    with pytest.raises(ImportError, match="GeminiPlugin is not available.*LowLevelZeroPlugin"):
        from meshboost.booster.plugin import GeminiPlugin  # noqa: F401
    monkeypatch.delitem(sys.modules, "meshboost.booster.plugin.gemini_plugin", raising=False)
    monkeypatch.delattr(paths, "gemini_plugin", raising=False)
    with pytest.raises(ImportError, match="GeminiPlugin is not available"):
        importlib.import_module("meshboost.booster.plugin.gemini_plugin")
    assert not hasattr(paths, "NoSuchPlugin")


def test_importing_meshboost_does_not_import_the_plugins():
    code = ("import sys, meshboost; assert 'meshboost.plugins' not in sys.modules, 'eager'; "
            "from meshboost.booster.plugin import TorchDDPPlugin; assert 'meshboost.plugins' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_cluster_accelerator_and_optimizer_paths():
    from meshboost.accelerator import BaseAccelerator, CpuAccelerator, CudaAccelerator, get_accelerator
    from meshboost.cluster import DistCoordinator, PipelineStageManager, ProcessGroupMesh
    from meshboost.cluster.dist_coordinator import DistCoordinator as DC
    from meshboost.nn.optimizer import CPUAdam, FusedAdam, HybridAdam
    from meshboost.nn.optimizer.adam import HybridAdam as HA

    assert DC is DistCoordinator and HA is HybridAdam and ProcessGroupMesh and PipelineStageManager
    assert issubclass(CpuAccelerator, BaseAccelerator) and issubclass(CudaAccelerator, BaseAccelerator)
    assert isinstance(get_accelerator(), BaseAccelerator) and meshboost.accelerator.get_accelerator is get_accelerator
    assert all(issubclass(c, torch.optim.Adam) for c in (HybridAdam, FusedAdam, CPUAdam))


@pytest.mark.parametrize("cls, keywords", [("HybridParallelPlugin", COLOSSALAI_HYBRID_KEYWORDS),
                                           ("TorchDDPPlugin", COLOSSALAI_DDP_KEYWORDS)])
def test_every_colossalai_keyword_is_in_the_signature(cls, keywords):
    """Each is honoured or refused by name (test_plugin_attributes.py checks the refusals), never
    a bare 'unexpected keyword argument'."""
    params = inspect.signature(getattr(meshboost.plugins, cls).__init__).parameters
    assert [k for k in keywords if k not in params] == []


def test_launch_and_booster_take_colossalai_keywords():
    """`launch_from_torch(verbose=...)` and `Booster(device=...)` as ColossalAI scripts pass them; a device
    the environment did not choose is refused."""
    import inspect

    import pytest

    import meshboost
    from meshboost.booster import Booster
    assert "verbose" in inspect.signature(meshboost.launch_from_torch).parameters
    Booster(device=meshboost.get_current_device().type)
    with pytest.raises(ValueError, match="device="):
        Booster(device="meta")
