"""ColossalAI's import paths resolve to meshboost's own objects (aliases, not second copies):
`meshboost.booster.plugin` and its plugin submodules, `dp_plugin_base.DPPluginBase`,
`meshboost.cluster`, `meshboost.accelerator`, `meshboost.nn.optimizer`, and the paths meshboost.compat
adds (`interface`, `logging`, `checkpoint_io`, `pipeline.stage_manager`...). The concrete plugins are
provided lazily by compat's `booster.plugin` module (importing meshboost does not import them), a plugin
that meshboost.plugins does not export fails with a message saying what to use, and every
keyword of ColossalAI's HybridParallelPlugin and TorchDDPPlugin is in meshboost's signatures."""

import importlib
import os
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


# ColossalAI's plugin -> the core plugin its keyword constructor maps onto (and ColossalAI's views it adds)
COMPAT_SUBCLASSES = {"HybridParallelPlugin": ("HybridParallelPlugin", {"sp_size"}),   # ColossalAI's name of cp
                     "LowLevelZeroPlugin": ("LowLevelZeroPlugin", set()),
                     # Gemini's boosted model and optimizer: ColossalAI's GeminiDDP / GeminiOptimizer state dicts
                     "GeminiPlugin": ("FSDPPlugin", {"tp_size", "model_class", "optimizer_class"}),
                     "TorchFSDPPlugin": ("FSDPPlugin", set())}


def test_plugin_paths_are_meshboost_plugins():
    from meshboost.booster.plugin import Plugin, TorchDDPPlugin
    from meshboost.booster.plugin.dp_plugin_base import DPPluginBase
    from meshboost.booster.plugin.plugin_base import Plugin as BasePlugin

    # ColossalAI's keyword signatures: compat's subclass of a core plugin (which takes a typed config),
    # adding only its constructor and ColossalAI's views
    for name, (core, views) in COMPAT_SUBCLASSES.items():
        served = getattr(importlib.import_module("meshboost.booster.plugin"), name)
        assert served is not getattr(meshboost.plugins, core) and issubclass(served, getattr(meshboost.plugins, core))
        assert {k for k in vars(served) if not k.startswith("_")} == views, name     # no behaviour of its own
        assert "__init__" in vars(served)
        assert getattr(importlib.import_module(f"meshboost.booster.plugin.{PLUGIN_MODULES[name]}"), name) is served
        assert not hasattr(meshboost.plugins, name) or getattr(meshboost.plugins, name) is not served
    assert TorchDDPPlugin is meshboost.plugins.TorchDDPPlugin
    assert importlib.import_module("meshboost.booster.plugin.torch_ddp_plugin").TorchDDPPlugin is TorchDDPPlugin
    assert Plugin is BasePlugin is meshboost.booster.Plugin is DPPluginBase
    for name in ("HybridParallelPlugin", "LowLevelZeroPlugin", "TorchDDPPlugin", "FSDPPlugin"):
        assert issubclass(getattr(meshboost.plugins, name), DPPluginBase)


def test_core_plugins_refuse_colossalai_keywords():
    """The core plugins take typed configs (and a few shortcuts); a ColossalAI keyword names compat's path."""
    with pytest.raises(TypeError, match="meshboost.booster.plugin import LowLevelZeroPlugin"):
        meshboost.plugins.LowLevelZeroPlugin(stage=2, initial_scale=2**5)
    with pytest.raises(TypeError, match="GeminiPlugin, TorchFSDPPlugin"):
        meshboost.plugins.FSDPPlugin(placement_policy="static")
    with pytest.raises(ValueError, match="stage 1 or 2"):
        meshboost.plugins.LowLevelZeroConfig.of(stage=3)


def test_a_plugin_meshboost_lacks_says_so(monkeypatch):
    import meshboost.booster.plugin as paths

    monkeypatch.delattr(meshboost.plugins, "TorchDDPPlugin", raising=False)
    with pytest.raises(ImportError, match="TorchDDPPlugin is not available"):
        from meshboost.booster.plugin import TorchDDPPlugin  # noqa: F401
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
    params = inspect.signature(getattr(importlib.import_module("meshboost.booster.plugin"), cls).__init__).parameters
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


def test_launch_from_torch_ignores_colossalai_config(monkeypatch):
    """`launch_from_torch(config={})` (older ColossalAI tutorials, keyword or first positional) warns once
    that the config is ignored, then starts as usual (here: refuses the missing torchrun environment)."""
    import warnings

    import pytest

    import meshboost
    launch_module = importlib.import_module("meshboost.distributed.launch")   # the package exports the function
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    launch_module._warn_config_ignored.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for call in (lambda: meshboost.launch_from_torch(config={}), lambda: meshboost.launch_from_torch({}),
                     lambda: meshboost.launch_from_torch(config="./config.py", seed=3)):
            with pytest.raises(RuntimeError, match="torchrun"):
                call()
    ignored = [w for w in caught if "config=...) is ignored" in str(w.message)]
    assert len(ignored) == 1 and issubclass(ignored[0].category, FutureWarning), [str(w.message) for w in caught]


def test_launch_takes_colossalai_positional_order():
    """ColossalAI's `launch(rank, world_size, host, port, backend, local_rank, seed, verbose)`: the same
    order here, so a positional call means the same; nonsense is refused before any rendezvous."""
    order = list(inspect.signature(meshboost.launch).parameters)
    assert order[:8] == ["rank", "world_size", "host", "port", "backend", "local_rank", "seed", "verbose"]
    with pytest.raises(TypeError, match="rank='127.0.0.1' must be an int"):
        meshboost.launch("127.0.0.1", 2, "localhost", 29500)
    with pytest.raises(ValueError, match="rank=3 is outside world_size=2"):
        meshboost.launch(3, 2, "localhost", 29500)


def test_utils_and_v_schedule_paths():
    """`colossalai.utils.get_current_device` is meshboost's; `colossalai.pipeline.schedule.v_schedule`
    imports (llama/benchmark.py does at module level) and planning the zero-bubble V schedule is refused
    naming the schedules meshboost runs; the pipeline schedule itself is unchanged."""
    from meshboost.distributed import get_current_device
    from meshboost.pipeline import PipelineSchedule
    from meshboost.pipeline.schedule import PipelineSchedule as Schedule
    from meshboost.pipeline.schedule.v_schedule import PipelineGraph
    from meshboost.utils import conditional_context, set_seed
    from meshboost.utils import get_current_device as utils_device

    assert utils_device is get_current_device and Schedule is PipelineSchedule and set_seed is meshboost.set_seed
    with conditional_context(pytest.raises(ZeroDivisionError), enable=True):
        1 / 0
    with pytest.raises(NotImplementedError, match="zero-bubble V schedule.*pp_style='1f1b'.*'interleaved'"):
        PipelineGraph(n_stage=2, n_micro=4, f_cost=1, b_cost=1, w_cost=1, c_cost=1, f_mem=1, b_mem=1, w_mem=1)


def test_booster_checkpoint_methods_take_colossalai_keywords():
    """ColossalAI's save/load keywords are in the signatures and checked (the work is tested in
    tests/checkpoint); a bad value is refused before any file is touched."""
    from meshboost.booster import Booster

    for method, keywords in (("save_model", ["use_async", "use_safetensors", "size_per_shard", "prefix"]),
                             ("load_model", ["strict", "low_cpu_mem_mode", "num_threads"]),
                             ("save_optimizer", ["use_async", "size_per_shard", "prefix"]),
                             ("load_optimizer", ["low_cpu_mem_mode", "num_threads"])):
        params = inspect.signature(getattr(Booster, method)).parameters
        assert [k for k in keywords if k not in params] == [], method
    booster = Booster()
    with pytest.raises(ValueError, match="num_threads=0 must be a positive integer"):
        booster.load_model(torch.nn.Linear(2, 2), "/nonexistent", num_threads=0)
    with pytest.raises(TypeError, match="use_async='yes' must be True or False"):
        booster.save_model(torch.nn.Linear(2, 2), "/nonexistent/x", use_async="yes")


def test_lora_entry_points_check_their_arguments():
    """enable_lora / save_lora_as_pretrained keep ColossalAI's signatures; without a plugin, or on a
    model enable_lora did not wrap, they say what to do (tests/plugins/test_lora.py trains with them)."""
    pytest.importorskip("peft")
    from meshboost.booster import Booster

    with pytest.raises(ValueError, match="needs a plugin"):
        Booster().enable_lora(torch.nn.Linear(2, 2), lora_config=None)
    with pytest.raises(TypeError, match="needs the model returned by booster.enable_lora"):
        Booster().save_lora_as_pretrained(torch.nn.Linear(2, 2), "/nonexistent")


def test_paths_meshboost_compat_adds_are_meshboost_objects():
    """The ColossalAI module paths served by meshboost.compat for names meshboost has elsewhere are those
    objects (`is`): HybridParallelModule, PipelineStageManager, LazyInitContext, ModelWrapper,
    OptimizerWrapper; the new names import (their behaviour: test_colossalai_names.py)."""
    import meshboost.booster.plugin as paths
    from meshboost.booster import ModelWrapper as BoostedModel
    from meshboost.booster.accelerator import Accelerator  # noqa: F401
    from meshboost.booster.mixed_precision import FP16TorchMixedPrecision  # noqa: F401
    from meshboost.booster.plugin.hybrid_parallel_plugin import HybridParallelModule
    from meshboost.checkpoint_io import CheckpointIO, GeneralCheckpointIO
    from meshboost.cluster import PipelineStageManager as StageManager
    from meshboost.interface import ModelWrapper, OptimizerWrapper
    from meshboost.interface.pretrained import get_pretrained_path, set_pretrained_path  # noqa: F401
    from meshboost.lazy import LazyInitContext as Lazy
    from meshboost.lazy.lazy_init import LazyInitContext
    from meshboost.logging import DistributedLogger, disable_existing_loggers, get_dist_logger  # noqa: F401
    from meshboost.nn.lr_scheduler import CosineAnnealingWarmupLR  # noqa: F401
    from meshboost.optim import OptimizerWrapper as BoostedOptimizer
    from meshboost.pipeline.stage_manager import PipelineStageManager
    from meshboost.plugins.hybrid_parallel import HybridParallelModule as Module

    assert HybridParallelModule is Module and issubclass(HybridParallelModule, ModelWrapper)
    assert PipelineStageManager is StageManager and LazyInitContext is Lazy
    assert ModelWrapper is BoostedModel and OptimizerWrapper is BoostedOptimizer
    assert issubclass(GeneralCheckpointIO, CheckpointIO)
    # served from meshboost/compat, each module once, under its ColossalAI name only
    assert paths.__file__.endswith(os.path.join("compat", "booster", "plugin", "__init__.py"))
    assert not any(name.startswith("meshboost.compat.") and name != "meshboost.compat.paths" for name in sys.modules)
