"""Issue 13, item 7: dropout random streams under tensor parallelism (tp=2, fp32, one spawn).

(a) Inside the split regions (attention probabilities on this rank's heads, T5's DenseReluDense
dropout) each tp rank draws its own masks; without `install_tp_rank_rng` they repeat across ranks.
Every dropout of a replicated region (embeddings, residual and hidden dropouts) draws the same mask
on both ranks, so hidden states, loss and the replicated weights after an optimizer step stay
bitwise identical across ranks, in every family of the tiny zoo. (b) With dropout on, HF activation
checkpointing replays the masks: gradients are bitwise equal with and without
`gradient_checkpointing_enable()` (GPT-2, BERT, Llama, T5; non-reentrant and reentrant), also with
the per-rank stream held across the whole layer stack (sequence parallelism's use), and with the
layers checkpointed around their call, hooks included (as transformers 4 did). (c) With
dropout off the hooks change no number: bitwise equal to the sharded model without them, close to
the unsharded model, and the shared stream is left exactly one draw further per region entered. An
exception inside a region does not leave a rank astray.
"""

import contextlib
import copy
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint

from meshboost.distributed.param_info import get_tp_info
from meshboost.shardformer import ShardConfig, ShardFormer
from meshboost.shardformer.rng import HELD, REGION, get_tp_rank_rng, install_tp_rank_rng, remove_tp_rank_rng
from meshboost.testing import LOSS_ATOL, assert_close, spawn
from meshboost.testing.compare import gathered
from meshboost.testing.models import MODEL_CLASSES, build_model, tiny_batch, tiny_config

GPT2_DROPOUT = {"attn_pdrop": 0.5, "resid_pdrop": 0.3, "embd_pdrop": 0.3}
CHECKPOINT_CASES = (   # class, family, dropout on, checkpointing kwargs
    ("GPT2LMHeadModel", "gpt2", GPT2_DROPOUT, {}),
    ("GPT2LMHeadModel", "gpt2", GPT2_DROPOUT, {"use_reentrant": True}),
    ("GPT2LMHeadModel", "gpt2", GPT2_DROPOUT, "call"),           # hooks inside the checkpoint (transformers 4)
    ("BertForMaskedLM", "bert", {"hidden_dropout_prob": 0.3, "attention_probs_dropout_prob": 0.3}, {}),
    ("LlamaForCausalLM", "llama", {"attention_dropout": 0.3}, {}),
    ("T5ForConditionalGeneration", "t5", {"dropout_rate": 0.3}, {}),
)


def _sharded(cls: str, config, group, rng: bool = True, attention: str | None = None):
    """A tp-sharded model in training mode, with the per-rank streams (rng) or without them (whether or
    not ShardFormer installs them itself)."""
    model = build_model(cls, copy.deepcopy(config))
    if attention is not None:
        model.set_attn_implementation(attention)
    ShardFormer(ShardConfig(tensor_parallel_process_group=group)).optimize(model)
    if rng:
        install_tp_rank_rng(model, group)
    else:
        remove_tp_rank_rng(model)
    return model.train()


def _all(t: torch.Tensor, group) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _same_on_all_ranks(t: torch.Tensor, group) -> bool:
    """One answer on every rank (a collective: call it on all of them)."""
    flags = torch.tensor([float(all(torch.equal(t, o) for o in _all(t, group)))])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
    return bool(flags.item())


@contextlib.contextmanager
def _recorded_masks():
    """Every dropout (module or functional) in order, as its keep-mask; the same numbers as F.dropout."""
    original, masks = F.dropout, []

    def dropout(input, p=0.5, training=True, inplace=False):
        if not training or p == 0:
            return original(input, p, training, inplace)
        keep = original(torch.ones_like(input), p, True)        # the same draws as dropping `input`
        masks.append(keep != 0)
        return input * keep
    with mock.patch.object(F, "dropout", dropout):
        yield masks


# -- (a) per-rank masks in split regions, shared masks elsewhere -------------------------------------
def _gpt2_masks(group) -> None:
    cls, config = "GPT2LMHeadModel", tiny_config("gpt2", **GPT2_DROPOUT)
    batch = tiny_batch(cls, config)
    for hooked in (False, True):
        model = _sharded(cls, config, group, rng=hooked, attention="eager")
        torch.manual_seed(5)
        with _recorded_masks() as masks:
            out = model(**batch, output_hidden_states=True)
        heads = [m for m in masks if m.dim() == 4]            # [batch, this rank's heads, q, k]
        hidden = [m for m in masks if m.dim() == 3]           # embeddings, attention and MLP residual dropouts
        assert len(heads) == config.n_layer and len(hidden) == 1 + 2 * config.n_layer, [m.shape for m in masks]
        differ = [not _same_on_all_ranks(m, group) for m in heads]
        assert all(differ) if hooked else not any(differ), f"hooked={hooked}: attention masks differ {differ}"
        assert all(_same_on_all_ranks(m, group) for m in hidden), f"hooked={hooked}: a replicated mask differs"
    assert not torch.equal(heads[0], heads[1]), "layers 0 and 1 drew the same per-rank attention mask"
    for i, h in enumerate(out.hidden_states):
        assert _same_on_all_ranks(h.detach(), group), f"hidden state {i} differs across tp ranks"
    assert _same_on_all_ranks(out.loss.detach(), group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out.loss.backward()
    opt.step()
    replicated = [(n, p) for n, p in model.named_parameters() if get_tp_info(p) is None]
    assert len(replicated) > 10
    for name, p in replicated:
        assert _same_on_all_ranks(p.detach(), group), f"replicated weight {name} differs across tp ranks after AdamW"


def _t5_masks(group) -> None:
    """T5's DenseReluDense dropout sits between wi and wo: on this rank's d_ff slice, per rank."""
    cls, config = "T5ForConditionalGeneration", tiny_config("t5", dropout_rate=0.3, d_ff=128)
    model = _sharded(cls, config, group, attention="eager")
    torch.manual_seed(6)
    with _recorded_masks() as masks:
        loss = model(**tiny_batch(cls, config)).loss
    local_ff = config.d_ff // dist.get_world_size(group)
    split = [m for m in masks if m.dim() == 4 or m.shape[-1] == local_ff]
    replicated = [m for m in masks if m.dim() == 3 and m.shape[-1] == config.d_model]
    assert len(split) == 2 * 2 + 3 * 2 and len(split) + len(replicated) == len(masks), [m.shape for m in masks]
    assert sum(m.shape[-1] == local_ff for m in split) == 4            # one DenseReluDense per block
    assert not any(_same_on_all_ranks(m, group) for m in split), "a T5 split-region mask repeats across ranks"
    assert all(_same_on_all_ranks(m, group) for m in replicated), "a T5 replicated mask differs across ranks"
    assert _same_on_all_ranks(loss.detach(), group)


def _dropout_on(config, p: float = 0.3):
    """Every dropout probability of `config` and of its sub-configs set to p."""
    for key, value in list(vars(config).items()):
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            setattr(config, key, p)
        elif hasattr(value, "model_type") and hasattr(value, "to_dict"):
            _dropout_on(value, p)
    return config


def _zoo_stays_replicated(group) -> None:
    """No family of the zoo leaves a replicated dropout on a per-rank stream: with every dropout on,
    the last hidden states (a replicated region) are bitwise the same on both ranks."""
    for family, classes in MODEL_CLASSES.items():
        cls = classes[0]
        config = _dropout_on(tiny_config(family))
        model = _sharded(cls, config, group)
        torch.manual_seed(9)
        out = model(**tiny_batch(cls, config), output_hidden_states=True)
        out = getattr(out, "language_model_outputs", None) or out            # BLIP-2: the language model's
        hidden = getattr(out, "decoder_hidden_states", None) or out.hidden_states
        assert get_tp_rank_rng(model).draws > 0, f"{cls}: no split region entered"
        assert _same_on_all_ranks(hidden[-1].detach(), group), f"{cls}: last hidden states differ across tp ranks"


# -- (b) activation checkpointing replays the masks --------------------------------------------------
class _CheckpointedCall(torch.nn.Module):
    """A GPT-2 block checkpointed around its __call__, module hooks included (transformers 4 did so)."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        return torch.utils.checkpoint.checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def _grads(model, batch, checkpoint: dict | str | None, hold: bool = False) -> tuple[dict, int]:
    """Gradients after one step ({name: grad}, with "call" naming them as without the wrapper) and
    the per-rank streams started; checkpoint: HF's kwargs, "call" (GPT-2 only) or None."""
    rng = get_tp_rank_rng(model)
    if hold:
        layers = model.transformer.h
        rng.hold_across(layers[0], layers[-1])
    if checkpoint == "call":
        for i, block in enumerate(model.transformer.h):
            model.transformer.h[i] = _CheckpointedCall(block)
    elif checkpoint is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint)
    torch.manual_seed(11)
    model(**batch).loss.backward()
    assert rng.stream() is None, f"left the forward on the {rng.stream()} stream"
    return {n.replace(".block.", "."): p.grad for n, p in model.named_parameters() if p.grad is not None}, rng.draws


def _checkpoint_replay(group) -> None:
    for cls, family, dropout, kwargs in CHECKPOINT_CASES:
        # use_cache=False in both runs: checkpointing turns the cache off, and a cache changes the key/value
        # layout (GPT-2: last-bit differences even without dropout), which is not what this compares.
        config = tiny_config(family, use_cache=False, **dropout)
        batch = tiny_batch(cls, config)
        plain, plain_draws = _grads(_sharded(cls, config, group), batch, None)
        replayed, replay_draws = _grads(_sharded(cls, config, group), batch, kwargs)
        where = f"{cls} checkpointing {kwargs}"
        assert plain.keys() == replayed.keys() and len(plain) > 10, where
        for name, g in plain.items():
            assert torch.equal(g, replayed[name]), f"{where}: grad {name} differs by {(g - replayed[name]).abs().max()}"
        # every region was entered again while recomputing, drawing the same per-rank seeds
        assert plain_draws > 0 and replay_draws == 2 * plain_draws, (where, plain_draws, replay_draws)
    # the per-rank stream held across the whole stack (sequence parallelism's use) replays too
    cls, config = "GPT2LMHeadModel", tiny_config("gpt2", use_cache=False, **GPT2_DROPOUT)
    batch = tiny_batch(cls, config)
    plain, plain_draws = _grads(_sharded(cls, config, group), batch, None, hold=True)
    for checkpoint, draws in (({}, 1), ("call", 2)):      # "call": the hold's own hook is recomputed too
        replayed, replay_draws = _grads(_sharded(cls, config, group), batch, checkpoint, hold=True)
        assert plain_draws == 1 and replay_draws == draws, (checkpoint, plain_draws, replay_draws)
        for name, g in plain.items():
            assert torch.equal(g, replayed[name]), f"held stream: grad {name} differs under checkpointing {checkpoint}"
    model = _sharded(cls, config, group, attention="eager")
    get_tp_rank_rng(model).hold_across(model.transformer.h[0], model.transformer.h[-1])
    with _recorded_masks() as masks:
        model(**batch)
    embedding, *inside = masks
    assert _same_on_all_ranks(embedding, group) and not any(_same_on_all_ranks(m, group) for m in inside), \
        "held across the stack: every dropout inside draws per rank, the embedding dropout before it is shared"


# -- (c) no dropout: no number changes ----------------------------------------------------------------
def _no_dropout_no_change(group) -> None:
    for cls, family in (("GPT2LMHeadModel", "gpt2"), ("BertForMaskedLM", "bert")):
        config = tiny_config(family)                   # every dropout probability 0
        batch = tiny_batch(cls, config)
        ref = build_model(cls, copy.deepcopy(config)).train()
        bare, hooked = _sharded(cls, config, group, rng=False), _sharded(cls, config, group)
        models = (ref, bare, hooked)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-4) for m in models]
        losses = []
        for model, opt in zip(models, opts):
            torch.manual_seed(3)
            losses.append(model(**batch).loss)
            start = torch.get_rng_state()
            losses[-1].backward()
            opt.step()
        rng = get_tp_rank_rng(hooked)
        assert rng.draws > 0, f"{cls}: no region was entered"
        torch.manual_seed(3)
        torch.randint(1 << 40, (rng.draws,))          # one draw per region from the shared stream, nothing else
        assert torch.equal(start, torch.get_rng_state()), f"{cls}: the shared stream was not restored exactly"
        assert torch.equal(losses[1], losses[2]), f"{cls}: loss {losses[2]} with the hooks, {losses[1]} without"
        assert abs(losses[0].item() - losses[2].item()) <= LOSS_ATOL[torch.float32], f"{cls}: loss vs unsharded"
        want, bare_p = dict(ref.named_parameters()), dict(bare.named_parameters())
        for name, p in hooked.named_parameters():
            assert torch.equal(p, bare_p[name]), f"{cls}: weight {name} after AdamW changed by the hooks"
            assert_close(gathered(p), want[name].detach(), msg=f"{cls} weight after AdamW {name}")


def _exception_inside_region(group) -> None:
    cls, config = "GPT2LMHeadModel", tiny_config("gpt2", **GPT2_DROPOUT)
    model = _sharded(cls, config, group)
    rng = get_tp_rank_rng(model)
    handle = model.transformer.h[0].attn.c_attn.register_forward_hook(lambda *a: 1 / 0)   # after the rng's hook
    with pytest.raises(ZeroDivisionError):
        model(**tiny_batch(cls, config))
    assert rng.stream() == REGION
    handle.remove()
    with _recorded_masks() as masks:
        model(**tiny_batch(cls, config))           # reset on entry: the embedding dropout is shared again
    assert rng.stream() is None and _same_on_all_ranks(masks[0], group)
    with rng.hold():
        assert rng.stream() == HELD
        rng.leave()                                 # a row-parallel linear inside a hold does not end it
        with rng.hold():
            rng.enter()
        assert rng.stream() == HELD
    assert rng.stream() is None
    assert install_tp_rank_rng(model, group) is rng
    draws = rng.draws
    remove_tp_rank_rng(model)
    model(**tiny_batch(cls, config))
    assert get_tp_rank_rng(model) is None and rng.draws == draws, "hooks left after remove_tp_rank_rng"


def _body(rank: int, world: int) -> None:
    group = dist.group.WORLD
    _gpt2_masks(group)
    _t5_masks(group)
    _zoo_stays_replicated(group)
    _checkpoint_replay(group)
    _no_dropout_no_change(group)
    _exception_inside_region(group)


def test_dropout_streams_per_tp_rank():
    spawn(_body, 2)
