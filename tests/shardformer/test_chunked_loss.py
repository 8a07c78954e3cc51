"""Issue 60 point 1: the chunked linear cross-entropy (`ShardConfig(loss_chunk_tokens=N)`, layers/chunked_loss.py).

One process, fp32, against transformers' own loss (`model(**batch).loss`) from the same weights and batch: the
loss within 1e-6 relative and every gradient within 1e-5, at chunk sizes of one token, one not dividing the
token count, exactly the token count and more than it; with ignored labels, with `num_items_in_batch`, and
per token (`chunked_linear_cross_entropy` against F.cross_entropy(reduction="none") under an uneven incoming
gradient, bias and padded vocabulary rows included); GPT-2, Qwen2, Gemma, OPT, BLOOM and Falcon too. No tensor the autograd graph saves holds a chunk's
logits, nor does the forward return them: the training output's logits are an empty [B, S, 0] stand-in,
eval and label-free forwards return the whole logits as before; post_training's `token_logprobs` scores
through the same chunks (log-probs 1e-6, gradients 1e-5). Refusals: a chunk size <= 0 (or not an int),
a model whose forward transforms the logits (Gemma-2's softcapping), one without a causal-LM loss.

One spawn of world 2 through HybridParallelPlugin, each layout against one process training the unchunked
model (`testing.sharded_training.train_and_check`: every step's loss, the first step's gradients, the last
weights): tp=2 (vocab-parallel chunks, the vocabulary padded 96 -> 128), tp=2 with Megatron sequence
parallelism, cp=2 (each rank's piece of the sequence, the global token count), pp=2 (the last stage), dp=2 (DDP)
and dp=2 with ZeRO-3 (FSDP2 gathers the head; `num_items_in_batch` the global token count); every
training forward's logits are the empty stand-in, and under tp `token_logprobs` of the trained model equals
one process's from the reference's trained weights.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn.functional as F
import transformers as tfm

from meshboost.plugins import HybridParallelConfig, PipelineConfig, ZeroConfig
from meshboost.post_training.logprobs import token_logprobs
from meshboost.shardformer import ShardConfig, ShardFormer
from meshboost.shardformer.layers.chunked_loss import ChunkedLinearHead, chunked_linear_cross_entropy
from meshboost.testing import assert_close, spawn
from meshboost.testing.models import build_model, tiny_batch, tiny_config
from meshboost.testing.moe import causal_batches
from meshboost.testing.sharded_training import reference_run, train_and_check

LLAMA = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=96,
             max_position_embeddings=64, intermediate_size=64, use_cache=False, tie_word_embeddings=False)


def _llama(seed: int = 0, **overrides) -> tfm.LlamaForCausalLM:
    torch.manual_seed(seed)
    return tfm.LlamaForCausalLM(tfm.LlamaConfig(**{**LLAMA, **overrides})).float().train()


def _chunked(model, chunk: int):
    return ShardFormer(ShardConfig(loss_chunk_tokens=chunk)).shard(model)[0]


def _batch(seq: int = 19, vocab: int = 96) -> dict:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (2, seq), generator=g)
    labels = ids.clone()
    labels[0, :6] = -100                       # a prompt
    labels[1, -2:] = -100                      # padding
    return {"input_ids": ids, "labels": labels}


def _loss_and_grads(model, batch: dict):
    model.zero_grad()
    out = model(**batch)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("chunk", [1, 5, 38, 1000])        # 2 x 19 = 38 tokens
@pytest.mark.parametrize("tied", [False, True])
def test_matches_transformers(chunk, tied):
    ref = _llama(tie_word_embeddings=tied)
    model = _chunked(copy.deepcopy(ref), chunk)
    assert isinstance(model.lm_head, ChunkedLinearHead)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    batch = _batch()
    for extra in ({}, {"num_items_in_batch": torch.tensor(50.0)}):   # HF's gradient-accumulation normalisation
        want, want_grads = _loss_and_grads(ref, {**batch, **extra})
        got, got_grads = _loss_and_grads(model, {**batch, **extra})
        assert abs(got.loss.item() - want.loss.item()) <= 1e-6 * abs(want.loss.item()), (got.loss, want.loss)
        assert got.logits.shape == (2, 19, 0)              # the logits were never whole
        for name, grad in want_grads.items():
            torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("cls,family", [("GPT2LMHeadModel", "gpt2"), ("Qwen2ForCausalLM", "qwen2"),
                                        ("GemmaForCausalLM", "gemma"), ("OPTForCausalLM", "opt"),
                                        ("BloomForCausalLM", "bloom"), ("FalconForCausalLM", "falcon")])
def test_families(cls, family):
    """The zoo's causal LMs (GPT-2's and Gemma's heads tied to a scaled / plain embedding, OPT's projections)."""
    config = tiny_config(family)
    ref = build_model(cls, config).train()
    model = _chunked(copy.deepcopy(ref), 5)                  # 32 tokens: the last chunk of 2
    batch = tiny_batch(cls, config)
    want, want_grads = _loss_and_grads(ref, batch)
    got, got_grads = _loss_and_grads(model, batch)
    assert got.logits.shape[-1] == 0
    assert abs(got.loss.item() - want.loss.item()) <= 1e-6 * abs(want.loss.item()), (got.loss, want.loss)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)


def test_per_token_losses_and_gradients():
    """The function alone: per-token losses and the gradients of x, weight and bias under an uneven incoming
    gradient; rows 40.. of the weight are padding (vocab_size=40), never counted."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(23, 16, generator=g, requires_grad=True)
    weight = torch.randn(48, 16, generator=g, requires_grad=True)
    bias = torch.randn(48, generator=g, requires_grad=True)
    target = torch.randint(0, 40, (23,), generator=g)
    target[[0, 7, 22]] = -100
    upstream = torch.rand(23, generator=g)
    losses = chunked_linear_cross_entropy(x, weight, bias, target, chunk_tokens=6, vocab_size=40)
    (losses * upstream).sum().backward()
    got = [t.grad.clone() for t in (x, weight, bias)]
    for t in (x, weight, bias):
        t.grad = None
    want = F.cross_entropy(F.linear(x, weight[:40], bias[:40]), target, reduction="none")
    (want * upstream).sum().backward()
    torch.testing.assert_close(losses, want, rtol=1e-6, atol=1e-6)
    assert torch.all(losses[[0, 7, 22]] == 0)
    want_grads = [x.grad, torch.cat([weight.grad[:40], torch.zeros(8, 16)]),
                  torch.cat([bias.grad[:40], torch.zeros(8)])]
    for name, a, b in zip(("x", "weight", "bias"), got, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_logits_never_saved_nor_returned():
    """No tensor the graph saves is as large as a chunk count's logits [tokens, vocab]: with 38 tokens and
    chunks of 5, the largest logits-shaped thing alive is a chunk's, freed inside the forward."""
    batch = _batch(vocab=4096)
    for model, bound in ((_chunked(_llama(vocab_size=4096), 5), lambda n: n < 38 * 4096 / 4),
                         (_llama(vocab_size=4096), lambda n: n >= 38 * 4096)):    # unchunked: saves the logits
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(          # activations only: the weights are saved as such
                lambda t: sizes.append(0 if isinstance(t, torch.nn.Parameter) else t.numel()) or t, lambda t: t):
            model(**batch).loss.backward()
        assert bound(max(sizes)), max(sizes)


def test_eval_and_label_free_forwards_keep_whole_logits():
    ref = _llama()
    model = _chunked(copy.deepcopy(ref), 5)
    batch = _batch()
    ids = {"input_ids": batch["input_ids"]}
    assert torch.equal(model(**ids).logits, ref(**ids).logits)           # training, no labels: post-training reads them
    ref.eval(), model.eval()
    with torch.no_grad():
        got, want = model(**batch), ref(**batch)                          # eval with labels: the loss and the logits
    assert torch.equal(got.logits, want.logits)
    assert abs(got.loss.item() - want.loss.item()) <= 1e-6 * want.loss.item()


def test_token_logprobs_chunked():
    """post_training's log-probs through the chunked head (no labels passed to the model): the same per-token
    log-probs and gradients as the whole logits give, the logits never whole; the entropy reads whole logits."""
    ref = _llama()
    model = _chunked(copy.deepcopy(ref), 5)
    batch = _batch()
    widths = []
    model.register_forward_hook(lambda _m, _i, out: widths.append(out.logits.shape[-1]))
    want, got = token_logprobs(ref, batch), token_logprobs(model, batch)
    assert widths == [0]
    assert torch.equal(got.mask, want.mask)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=1e-6, atol=1e-6)
    want.logprobs.sum().backward(), got.logprobs.sum().backward()
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5, msg=name)
    with_entropy = token_logprobs(model, batch, entropy=True)
    assert widths[-1] == 96 and with_entropy.entropy is not None
    torch.testing.assert_close(with_entropy.logprobs, want.logprobs, rtol=1e-6, atol=1e-6)


def test_positional_labels_and_kept_logits():
    """Labels passed positionally arm the chunked loss too; logits_to_keep with labels is refused, naming it."""
    ref = _llama()
    model = _chunked(copy.deepcopy(ref), 5)
    batch = _batch()
    names = list(inspect.signature(ref.forward).parameters)
    args = [None] * (names.index("labels") + 1)
    args[0], args[-1] = batch["input_ids"], batch["labels"]
    got, want = model(*args), ref(*args)
    assert got.logits.shape[-1] == 0 and abs(got.loss.item() - want.loss.item()) <= 1e-6 * want.loss.item()
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(**batch, logits_to_keep=1)


def test_bf16_matches_transformers():
    """bf16 weights: the head's chunks in bf16 upcast to fp32 as transformers' loss upcasts its logits; the
    gradients reach the bf16 weights in their dtype (the weight's summed in fp32, rounded once)."""
    ref = _llama(vocab_size=64).to(torch.bfloat16)
    model = _chunked(copy.deepcopy(ref), 7)
    batch = _batch(seq=9, vocab=64)
    want, want_grads = _loss_and_grads(ref, batch)
    got, got_grads = _loss_and_grads(model, batch)
    assert abs(got.loss.item() - want.loss.item()) <= 1e-3 * abs(want.loss.item()), (got.loss, want.loss)
    for name, grad in want_grads.items():
        assert got_grads[name].dtype == torch.bfloat16, name
        assert_close(got_grads[name], grad, dtype=torch.bfloat16, msg=name)


@pytest.mark.parametrize("bad", [0, -4, 1.5, True, "1024"])
def test_bad_chunk_size_refused(bad):
    with pytest.raises(ValueError, match="loss_chunk_tokens"):
        ShardConfig(loss_chunk_tokens=bad)


def test_refused_where_not_exact():
    gemma2 = tfm.Gemma2ForCausalLM(tfm.Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                    num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                                    vocab_size=64, final_logit_softcapping=30.0))
    with pytest.raises(NotImplementedError, match="final_logit_softcapping"):
        _chunked(gemma2, 8)
    bert = tfm.BertForSequenceClassification(tfm.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                            intermediate_size=64, vocab_size=64))
    with pytest.raises(NotImplementedError, match="causal-LM loss"):
        _chunked(bert, 8)


# -- world 2 ---------------------------------------------------------------------------------------------------
CHUNK = 5           # divides neither a rank's 32 tokens (16 under cp)
LAYOUTS = (
    ("tp=2", dict(tp_size=2)),
    ("tp=2 sp", dict(tp_size=2, sequence_parallel=True)),
    ("cp=2", dict(cp_size=2)),
    ("pp=2", dict(pp_size=2, pipeline=PipelineConfig(num_microbatches=2))),
    ("dp=2", dict()),                                       # torch DDP over dp
    ("dp=2 zero3", dict(zero=ZeroConfig(stage=3))),        # FSDP2's gathered head, the global token count over dp
)


def _layouts(rank: int, world: int) -> None:
    batches = causal_batches(tfm.LlamaConfig(**LLAMA), 2)
    ref = reference_run(_llama(), batches)                   # one process, transformers' unchunked loss
    for what, settings in LAYOUTS:
        config = HybridParallelConfig(sharding=ShardConfig(loss_chunk_tokens=CHUNK), **settings)
        widths = []         # the logits' width of each training forward: 0, the chunked loss's stand-in

        def make_model():
            model = _llama()
            model.register_forward_hook(lambda _m, _i, out: widths.append(out.logits.shape[-1]))
            return model

        plugin, _, model, _ = train_and_check(config, make_model, batches, ref, what)
        if plugin.pp_size == 1 or plugin.mesh.pp_rank == 1:     # the head lives on the last stage
            assert widths and set(widths) == {0}, f"{what}: the head's training logits were computed whole: {widths}"
        if plugin.tp_size > 1:              # the log-probs through the vocab-parallel chunks, the trained weights
            whole = _llama()
            whole.load_state_dict(ref[2])
            torch.testing.assert_close(token_logprobs(model, batches[0]).logprobs,
                                       token_logprobs(whole, batches[0]).logprobs, rtol=1e-5, atol=1e-5)
            assert widths[-1] == 0, f"{what}: token_logprobs computed the logits whole"


def test_layouts_world2():
    spawn(_layouts, 2)
