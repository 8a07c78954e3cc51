"""LazyInitContext (issue 14 item 1, issue 15 item 3): a model built under it stays on the meta device,
and `booster.boost` materialises only what each rank holds (its tensor-parallel shards of its pipeline
stages) with the model's own init, one unit at a time. The values do not depend on the layout: every
rank's shards, gathered, equal the unsharded model materialised from the same seed, bit for bit, under
tp=2 x pp=2, tp=2 x dp=2 with ZeRO-1 and plain DDP (dp=4, materialised whole by the Booster); buffers
(rotary frequencies, position ids) equal those of an eagerly built model; and a training step from
there equals single-process AdamW from the unsharded materialisation. Moves and casts written inside
the context (`.cpu()`, `.to(device)`, `.to(dtype)`, `.half()`, `.cuda()`) are recorded and applied at
materialisation: the numbers equal those of the model materialised first and moved after."""

import copy

import torch
import torch.distributed as dist
import transformers

from meshboost import Booster
from meshboost.lazy import LazyInitContext, lazy_seed
from meshboost.booster.plugin import HybridParallelPlugin
from meshboost.plugins import TorchDDPPlugin
from meshboost.testing import assert_close, spawn
from meshboost.testing.compare import booster_step, gathered
from meshboost.testing.models import build_model, tiny_batch, tiny_config

CLS = "LlamaForCausalLM"
# (plugin, the move the user writes inside the context: issue 37 item 4, once refused by torch with
# "Cannot copy out of meta tensor")
CASES = ((lambda: HybridParallelPlugin(tp_size=2, pp_size=2, num_microbatches=2), lambda m: m.cpu()),
         (lambda: HybridParallelPlugin(tp_size=2, zero_stage=1), lambda m: m.to("cpu")),
         (lambda: TorchDDPPlugin(), lambda m: m.to(torch.device("cpu"), torch.float32)))


def _lazy(config, move=None):
    with LazyInitContext(seed=11):
        model = getattr(transformers, CLS)(copy.deepcopy(config))
        return move(model) if move is not None else model


def _body(rank: int, world: int) -> None:
    config = tiny_config("llama", num_hidden_layers=4)
    batch = tiny_batch(CLS, config, batch=4, seed=5)
    ref = LazyInitContext.materialize(_lazy(config))
    eager = build_model(CLS, copy.deepcopy(config))
    for name, buffer in eager.named_buffers():
        assert torch.equal(dict(ref.named_buffers())[name], buffer), name
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-4)
    ref(**batch).loss.backward()
    ref_opt.step()
    stepped = dict(ref.named_parameters())
    for make, move in CASES:
        model = _lazy(config, move)
        assert lazy_seed(model) == 11 and all(p.is_meta for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)      # built on meta, stays valid
        plugin = make()
        booster = Booster(plugin=plugin)
        model, opt, *_ = booster.boost(model, opt)
        held = dict(model.unwrap().named_parameters())
        assert held and not any(p.is_meta for p in held.values())
        assert not any(b.is_meta for b in model.unwrap().buffers())
        for name, p in held.items():
            assert torch.equal(gathered(p), start[name]), f"{type(plugin).__name__}: {name} differs after boost"
        if plugin.dp_size == 1:                                      # one replica sees the whole batch
            booster_step(booster, model, opt, batch)
            for name, p in held.items():
                assert_close(gathered(p), stepped[name].detach(), msg=f"{type(plugin).__name__} step: {name}")
        dist.barrier()


def test_lazy_init_materialises_each_ranks_part_equal_to_the_unsharded_init():
    spawn(_body, 4)


def test_from_pretrained_inside_the_context_loads_the_checkpoint(tmp_path):
    """ColossalAI's GPT example calls `from_pretrained` inside LazyInitContext (transformers refuses a
    meta default device): it loads the checkpoint's values for real, and the context restores
    transformers afterwards; a model built from config in the same context stays lazy."""
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    expected = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    before = transformers.PreTrainedModel.__dict__["from_pretrained"]
    with LazyInitContext():
        loaded = transformers.GPT2ForSequenceClassification.from_pretrained(tmp_path, num_labels=2)
        lazy = transformers.GPT2LMHeadModel(config)
    assert transformers.PreTrainedModel.__dict__["from_pretrained"] is before
    assert lazy_seed(loaded) is None and lazy_seed(lazy) is not None
    assert not any(p.is_meta for p in loaded.parameters())
    for name, p in expected.transformer.named_parameters():
        assert torch.equal(loaded.transformer.get_parameter(name), p), name


def test_moves_and_casts_inside_the_context_apply_at_materialisation():
    """Issue 37 item 4: `with LazyInitContext(): model = Model(cfg).cpu()` (or `.to("cpu")`, `.to(dtype)`,
    ColossalAI's `.cuda()`) failed with "Cannot copy out of meta tensor". A cast applies at once on meta
    (the initialiser still runs in the dtype the model was built in, then the value is cast, as for an eager
    model); a move is applied when the model is materialised."""
    config = tiny_config("llama", num_hidden_layers=2)
    plain = LazyInitContext.materialize(_lazy(config))
    cases = [("cpu()", lambda m: m.cpu(), lambda m: m.cpu()),
             ("to('cpu')", lambda m: m.to("cpu"), lambda m: m.to("cpu")),
             ("to(bfloat16)", lambda m: m.to(torch.bfloat16), lambda m: m.to(torch.bfloat16)),
             ("to('cpu', float64)", lambda m: m.to("cpu", torch.float64), lambda m: m.to("cpu", torch.float64)),
             ("half()", lambda m: m.half(), lambda m: m.half()),
             ("a part cast, then all moved", lambda m: (m.lm_head.to(torch.float64), m.cpu())[-1],
              lambda m: (m.lm_head.to(torch.float64), m.cpu())[-1])]
    if torch.cuda.is_available():
        cases.append(("cuda()", lambda m: m.cuda(), lambda m: m.cuda()))
    for name, move, eager_move in cases:
        lazy = _lazy(config, move)
        assert lazy_seed(lazy) == 11 and all(p.is_meta for p in lazy.parameters()), name
        # a deep copy keeps each module's one record (seed, built dtypes, recorded move): the same values
        copied = LazyInitContext.materialize(copy.deepcopy(lazy))
        got = LazyInitContext.materialize(lazy)
        expected = eager_move(copy.deepcopy(plain))
        expected_sd = expected.state_dict()
        for what, got_sd in ((name, got.state_dict()), (f"{name}, deep copy", copied.state_dict())):
            assert list(got_sd) == list(expected_sd), what
            for key, tensor in expected_sd.items():
                value = got_sd[key]
                assert (value.dtype, value.device) == (tensor.dtype, tensor.device), f"{what}: {key}"
                assert torch.equal(value, tensor), f"{what}: {key} differs from the eagerly moved model"
    # outside the context a module with real tensors moves as torch moves it
    assert LazyInitContext.materialize(_lazy(config)).to(torch.float64).lm_head.weight.dtype == torch.float64


def test_materialised_parameter_keeps_meshboosts_gradient_hooks():
    """A hook meshboost put on a meta parameter (expert parallelism's 1/ep, the sums over tp) still runs
    after the parameter gets its values: torch's swap_tensors carries the hook table but leaves it wired
    to no autograd node, which under LazyInitContext and ep_size=2 doubled every expert gradient (the
    losses of Adam hid it; the gradient norm and clipping did not)."""
    from meshboost.distributed.param_info import register_grad_hook, replace_keeping_object
    param = torch.nn.Parameter(torch.empty(3, device="meta"))
    register_grad_hook(param, lambda grad: grad * 0.5)
    with torch.no_grad():
        replace_keeping_object(param, torch.ones(3))
    param.sum().backward()
    assert torch.equal(param.grad, torch.full((3,), 0.5))
