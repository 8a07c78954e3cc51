"""float8 training (`float8=Float8Config(...)`, ColossalAI's `use_fp8=True`; shardformer/float8.py) against
torchao's float8 on one process, from the same weights and data: one process group of 2, the layouts
looped inside. torchao emulates float8 on this CPU (the same casts and scales). Each data-parallel
replica and each micro-batch scales its own activations, so the one-process reference runs the same
pieces of the batch one after another and averages their losses (gradient accumulation): the per-step
losses then agree to accumulation order, and a ZeRO-3 checkpoint (float8 all-gather) holds fp32 weights
equal to the reference's after the last step. Under tp, Megatron sequence parallelism and context
parallelism (both recipes) each sharded operand is cast with the scales of the whole tensor (amaxes
all-reduced over the ranks holding its other pieces, along the axis each scale is taken on): first each
of torchao's six casts and three products on pieces of tensors spread over 2^-12..2^12 against the whole
(a piece's own amax, or one reduced along the wrong axis, fails them; rowwise's power-of-two scales hide
such an error from a tiny model's loss), then the layouts' losses and saved weights (with each rank's
own scale, tp=2 tensorwise step 1's loss is off by 7e-5 relative)."""

import copy
import os
import sys

import pytest
import torch
import torch.distributed as dist

from meshboost import Booster
from meshboost.optim import ZeroConfig
from meshboost.pipeline import PipelineConfig
from meshboost.plugins import HybridParallelConfig, HybridParallelPlugin
from meshboost.shardformer import ShardConfig
from meshboost.shardformer.compile import CompileConfig
from meshboost.shardformer.float8 import Float8Config, convert_float8
from meshboost.testing import spawn
from meshboost.testing.compare import booster_step, train_reference
from meshboost.testing.models import build_model, tiny_config, token_batches

pytest.importorskip("torchao")
STEPS, BATCH, SEQ = 3, 4, 8


def _model():
    return build_model("LlamaForCausalLM", tiny_config("llama"))


def _run_layout(what, config: HybridParallelConfig, pieces: int, save_to=None):
    from torchao.float8.float8_linear import Float8Linear

    from meshboost.shardformer.float8_parallel import Float8Product, ScaledFloat8Linear

    model = _model()
    batches = token_batches(model.config, STEPS, BATCH, SEQ, seed=3)
    # torchao's float8 on one process: each step the batch's `pieces` run one after another, mean loss
    ref_model = _model()
    convert_float8(ref_model, config.float8, "cpu")
    ref = train_reference(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=1e-3, eps=1e-4), batches,
                          pieces=pieces).losses
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    plugin = HybridParallelPlugin(config)
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, opt)
    inner = model.unwrap()
    if config.dims.tp > 1 or config.dims.cp > 1:    # parallel linears keep their class (a Float8Product inside)
        assert sum(isinstance(getattr(m, "product", None), Float8Product) for m in inner.modules()) == 14, what
        assert all(isinstance(m, ScaledFloat8Linear) for m in inner.modules()
                   if type(m) is torch.nn.Linear and m is not inner.get_output_embeddings()) or config.dims.cp == 1, what
    else:
        assert any(isinstance(m, Float8Linear) for m in inner.modules()), what
    assert not isinstance(inner.get_output_embeddings(), Float8Linear), f"{what}: the LM head is float8"
    if config.zero.stage == 3 and config.float8.recipe == "tensorwise":   # FSDP2 gathers float8 (torchao's wrapper)
        weight = inner.model.layers[0].mlp.up_proj.weight
        assert type(weight.to_local()).__name__ == "WeightWithDynamicFloat8CastTensor", (what, type(weight))
    mesh = plugin.mesh
    for step, batch in enumerate(batches):
        mine = {k: v.chunk(mesh.dp_size)[mesh.dp_rank] for k, v in batch.items()}
        loss = booster_step(booster, model, opt, mine).detach().float().reshape(1)
        opt.zero_grad()
        if plugin.pp_size == 1:
            dist.all_reduce(loss, group=mesh.dp_group)
            loss /= mesh.dp_size
        assert abs(loss.item() - ref[step]) <= 1e-5 * abs(ref[step]), f"{what} step {step}: {loss.item()} vs {ref[step]}"
    if save_to is not None:          # the checkpoint holds the weights in their own dtype, not float8
        from safetensors.torch import load_file
        booster.save_model(model, save_to, shard=True, use_safetensors=True)
        dist.barrier()
        saved = {}
        for name in os.listdir(save_to):
            if name.endswith(".safetensors"):
                saved.update(load_file(os.path.join(save_to, name)))
        expected = dict(ref_model.named_parameters())
        assert set(saved) == set(expected), f"{what}: {sorted(set(saved) ^ set(expected))}"
        for name, tensor in saved.items():
            assert tensor.dtype == torch.float32, (what, name, tensor.dtype)
            torch.testing.assert_close(tensor, expected[name].detach(), rtol=1e-4, atol=1e-5, msg=f"{what}: {name}")


def _wide(shape, generator) -> torch.Tensor:
    """Random values spread over 2^-12..2^12: a scale taken from the wrong amax (a piece's own, or along the
    wrong axis) moves some of them across float8's range, even when scales are powers of two (rowwise)."""
    return torch.randn(shape, generator=generator) * 2.0 ** torch.randint(-12, 13, shape, generator=generator)


# per split: the dim of each 2-D operand cut over the group (input [tokens, in], weight_t [in, out],
# grad_output [tokens, out]); column: output features over tp, row: input features, tokens: over cp
SPLITS = {"column": {"weight_t": 1, "grad_output": 1}, "row": {"input": 1, "weight_t": 0},
          "tokens": {"input": 0, "grad_output": 0}}


def _piece(t: torch.Tensor, dim, rank: int) -> torch.Tensor:
    return t if dim is None or t.dim() == 0 or t.shape[dim] == 1 else t.chunk(2, dim)[rank]


def _split_product(config, split: str):
    from torchao.float8.float8_linear import Float8Linear

    from meshboost.shardformer.float8 import ShardGroups
    from meshboost.shardformer.float8_parallel import Float8Product
    mm_config = Float8Linear(16, 16, bias=False, device="meta", config=config).linear_mm_config
    groups = ShardGroups() if split is None else ShardGroups(cp=dist.group.WORLD) if split == "tokens" \
        else ShardGroups(tp=dist.group.WORLD)
    return Float8Product.build(config, mm_config, groups, row=split == "row", column=split == "column",
                               tokens_split=split == "tokens")


def _casts_match_torchao(rank: int):
    """Each of torchao's six casts, on this rank's piece of an operand split each way, equals (its float8
    bytes and its scales) the piece of the same cast of the whole operand, both recipes."""
    from meshboost.shardformer.float8 import linear_config
    from meshboost.shardformer.float8_parallel import CASTS
    g = torch.Generator().manual_seed(5)
    operands = {"input": _wide((32, 32), g), "weight_t": _wide((32, 48), g), "grad_output": _wide((32, 48), g)}
    for recipe in ("tensorwise", "rowwise"):
        config = linear_config(Float8Config(recipe=recipe), "cpu", fsdp_all_gather=False)
        whole = _split_product(config, None)
        for split, cuts in SPLITS.items():
            product = _split_product(config, split)
            for name, (operand, _) in CASTS.items():
                dim, full = cuts.get(operand), whole.cast(operands[operand], name)
                mine = product.cast(_piece(operands[operand], dim, rank), name)
                what = f"{recipe} {split} {name}"
                assert torch.equal(mine._scale, _piece(full._scale, dim, rank)), f"{what}: scales"
                assert torch.equal(mine._data.view(torch.uint8), _piece(full._data, dim, rank).view(torch.uint8)), what


def _products_match_torchao(rank: int):
    """The Float8Product's three products against torchao's Float8Linear: on whole tensors bit for bit (the
    same casts, along the same axes, in the same order); on each split's pieces the output, input gradient
    and weight gradient, gathered or summed, to accumulation order."""
    from torchao.float8.float8_linear import Float8Linear

    from meshboost.shardformer.float8 import linear_config
    g = torch.Generator().manual_seed(6)
    x, w, grad = _wide((2, 16, 32), g), _wide((48, 32), g), _wide((2, 16, 48), g)
    for recipe in ("tensorwise", "rowwise"):
        config = linear_config(Float8Config(recipe=recipe), "cpu", fsdp_all_gather=False)
        whole = Float8Linear.from_float(torch.nn.Linear(32, 48, bias=False), config=config)
        with torch.no_grad():
            whole.weight.copy_(w)
        xr = x.clone().requires_grad_()
        y = whole(xr)
        y.backward(grad)
        # (x dim, weight [out, in] dim, output dim) cut over the group
        for split, (xd, wd, yd) in {None: (None, None, None), "column": (None, 0, 2), "row": (2, 1, None),
                                    "tokens": (1, None, 1)}.items():
            xs, ws = _piece(x, xd, rank).clone().requires_grad_(), _piece(w, wd, rank).clone().requires_grad_()
            ys = _split_product(config, split)(xs, ws, None)
            ys.backward(_piece(grad, yd, rank))
            ys, gw, gx = ys.detach().clone(), ws.grad.clone(), xs.grad.clone()
            for total, reduced in ((ys, "row"), (gw, "tokens"), (gx, "column")):
                if split == reduced:          # partial sums over the split's ranks
                    dist.all_reduce(total)
            # the sums' order differs where pieces are summed: within 1e-6 of the largest value
            tolerance = 0.0 if split is None else 1e-6
            for got, expected, of in ((ys, y, "output"), (gw, whole.weight.grad, "weight gradient"),
                                      (gx, xr.grad, "input gradient")):
                expected = _piece(expected.detach(), {"output": yd, "weight gradient": wd}.get(of, xd), rank)
                error = (got - expected).abs().max().item()
                assert error <= tolerance * expected.abs().max().item(), (recipe, split, of, error)


def _local_dims_left_whole():
    """Under tp the float8 matmul runs on this rank's shard: an MLP of 48 features (a multiple of 16) is cut
    into 24 per rank, which torchao cannot run, so those linears stay in high precision, the others not."""
    model = build_model("LlamaForCausalLM", tiny_config("llama", intermediate_size=48))
    model, *_ = Booster(plugin=HybridParallelPlugin(HybridParallelConfig(tp_size=2, float8=True))).boost(model)
    products = {n.rsplit(".", 1)[-1]: m.product is not None for n, m in model.unwrap().named_modules()
                if n.startswith("model.layers.0.") and hasattr(m, "product")}
    assert products == {"q_proj": True, "k_proj": True, "v_proj": True, "o_proj": True, "gate_proj": False,
                        "up_proj": False, "down_proj": False}, products


def _layouts(rank, world, folder):
    tensorwise, rowwise = Float8Config(), Float8Config(recipe="rowwise")
    _casts_match_torchao(rank)
    _products_match_torchao(rank)
    _local_dims_left_whole()
    _run_layout("dp=2 DDP, tensorwise", HybridParallelConfig(float8=tensorwise), pieces=2)
    _run_layout("dp=2 ZeRO-1, rowwise", HybridParallelConfig(zero=ZeroConfig(stage=1), float8=rowwise), pieces=2)
    _run_layout("dp=2 ZeRO-3, tensorwise, float8 all-gather", HybridParallelConfig(zero=ZeroConfig(stage=3),
                                                                                   float8=tensorwise),
                pieces=2, save_to=folder)
    _run_layout("tp=2, tensorwise, scales over the tp group", HybridParallelConfig(tp_size=2, float8=tensorwise),
                pieces=1, save_to=folder + "_tp")
    _run_layout("tp=2 ZeRO-3 + compile", HybridParallelConfig(tp_size=2, zero=ZeroConfig(stage=3), float8=tensorwise,
                                                              compile=CompileConfig(backend="aot_eager")),
                pieces=1, save_to=folder + "_tp_zero3_compile")
    _run_layout("pp=2 1f1b", HybridParallelConfig(pp_size=2, pipeline=PipelineConfig(num_microbatches=2), float8=tensorwise),
                pieces=2)
    sp = ShardConfig(sequence_parallelism_mode="split_gather")
    _run_layout("tp=2, rowwise, row scales over the tp group", HybridParallelConfig(tp_size=2, float8=rowwise),
                pieces=1, save_to=folder + "_tp_rowwise")
    _run_layout("tp=2 sequence parallel, rowwise + compile",
                HybridParallelConfig(tp_size=2, sequence_parallel=True, sharding=sp, float8=rowwise, compile=CompileConfig(backend="aot_eager")),
                pieces=1, save_to=folder + "_sp_rowwise")
    _run_layout("tp=2 sequence parallel, tensorwise", HybridParallelConfig(tp_size=2, sequence_parallel=True, sharding=sp, float8=tensorwise),
                pieces=1, save_to=folder + "_sp")
    _run_layout("tp=2 ZeRO-3, tensorwise, float8 all-gather of tp shards (whole weight's scale)",
                HybridParallelConfig(tp_size=2, zero=ZeroConfig(stage=3), float8=tensorwise), pieces=1,
                save_to=folder + "_tp_zero3")
    _run_layout("cp=2 ZeRO-3, tensorwise, float8 all-gather", HybridParallelConfig(cp_size=2, zero=ZeroConfig(stage=3),
                                                                                   float8=tensorwise),
                pieces=1, save_to=folder + "_cp_zero3")
    for mode in ("all_to_all", "ring_attn"):
        for float8 in (tensorwise, rowwise):
            _run_layout(f"cp=2 {mode}, {float8.recipe}, scales over the cp group",
                        HybridParallelConfig(cp_size=2, cp_mode=mode, float8=float8), pieces=1,
                        save_to=f"{folder}_cp_{mode}_{float8.recipe}")
    _run_layout("cp=2 ring_attn, rowwise, ZeRO-2 + compile",
                HybridParallelConfig(cp_size=2, cp_mode="ring_attn", zero=ZeroConfig(stage=2), float8=rowwise,
                                     compile=CompileConfig(backend="aot_eager")), pieces=1, save_to=folder + "_cp_z2")


def test_float8_matches_torchao_on_one_process(tmp_path):
    spawn(_layouts, 2, str(tmp_path / "zero3"))


def test_float8_conversion_and_refusals(monkeypatch):
    model = build_model("LlamaForCausalLM", tiny_config("llama", intermediate_size=40))
    left = convert_float8(model, Float8Config(), "cpu")
    # the MLP's 32 -> 40 and 40 -> 32 are not multiples of 16: left in fp32, listed
    assert sorted(n.split(" ")[0] for n in left) == sorted(f"model.layers.{i}.mlp.{p}" for i in range(2)
                                                          for p in ("gate_proj", "up_proj", "down_proj"))
    chosen = build_model("LlamaForCausalLM", tiny_config("llama"))
    convert_float8(chosen, Float8Config(filter=lambda m, name: name.endswith("q_proj")), "cpu")
    kinds = {n: type(m).__name__ for n, m in chosen.named_modules() if n.endswith(("q_proj", "k_proj"))}
    assert kinds == {"model.layers.0.self_attn.q_proj": "Float8Linear", "model.layers.0.self_attn.k_proj": "Linear",
                     "model.layers.1.self_attn.q_proj": "Float8Linear", "model.layers.1.self_attn.k_proj": "Linear"}
    with pytest.raises(ValueError, match="recipe='blockwise'"):
        Float8Config(recipe="blockwise")
    with pytest.raises(NotImplementedError, match="tp_size=2 and cp_size=2.*tp_size=1"):
        HybridParallelConfig(tp_size=2, cp_size=2, float8=True)
    assert HybridParallelConfig(tp_size=2, float8=True).float8 == Float8Config()
    assert HybridParallelConfig(float8=True).float8 == Float8Config()
    assert copy.deepcopy(Float8Config()) == Float8Config()
    monkeypatch.setitem(sys.modules, "torchao.float8", None)          # torchao missing: say how to install it
    with pytest.raises(ImportError, match=r"pip install torchao"):
        HybridParallelConfig(float8=True)
