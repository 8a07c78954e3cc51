"""Every tensor-parallel layer against its native module, from the same weights and inputs:
output, input gradient and weight gradients (gathered along the split dim). One process group per
world size; configurations loop inside."""

import copy
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from transformers.pytorch_utils import Conv1D

from meshboost.distributed.param_info import gather_tensor, get_tp_info
from meshboost.distributed.profiling import comm_counter
from meshboost.shardformer.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    vocab_parallel_cross_entropy,
)
from meshboost.testing import assert_close, spawn
from meshboost.testing.models import vocab_edge_ids


def _full(p, t=None):
    return gather_tensor(p.detach() if t is None else t, get_tp_info(p))


def _check_pair(native, parallel_fn, x, name, out_transform=lambda y: y):
    """Run native and parallel on the same input; compare output, input grad, weight grads."""
    ref = copy.deepcopy(native)
    x_ref = x.clone().requires_grad_(True)
    x_par = x.clone().requires_grad_(True)
    same_objects = {n: p for n, p in native.named_parameters()}
    par = parallel_fn(native)
    for n, p in par.named_parameters():
        assert p is same_objects[n], f"{name}: parameter {n} is not the original object"
    y_ref = ref(x_ref)
    y_par = out_transform(par(x_par))
    assert_close(y_par, y_ref, msg=f"{name} output")
    g = torch.randn_like(y_ref)
    y_ref.backward(g)
    y_par.backward(g)
    assert_close(x_par.grad, x_ref.grad, msg=f"{name} input grad")
    for n, p in par.named_parameters():
        assert_close(_full(p, p.grad), dict(ref.named_parameters())[n].grad, msg=f"{name} grad {n}")


def _layers_body(rank, world):
    _check_dim_mappings(rank, world)
    group = dist.group.WORLD
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16)

    # Column-parallel nn.Linear: gathered output, and split output gathered by hand.
    _check_pair(nn.Linear(16, 8 * world), lambda m: ColumnParallelLinear.from_native(m, group, gather_output=True),
                x, "column gather_output")
    _check_pair(nn.Linear(16, 8 * world), lambda m: ColumnParallelLinear.from_native(m, group), x, "column split",
                out_transform=lambda y: _gather_last(y, group))
    # Row-parallel nn.Linear, input split by the layer itself; bias added once.
    _check_pair(nn.Linear(8 * world, 16), lambda m: RowParallelLinear.from_native(m, group, input_is_parallel=False),
                torch.randn(3, 5, 8 * world), "row")
    # Column -> row, the Megatron MLP: input parallel between them.
    mlp = nn.Sequential(nn.Linear(16, 4 * world), nn.GELU(), nn.Linear(4 * world, 16))
    _check_pair(mlp, lambda m: nn.Sequential(ColumnParallelLinear.from_native(m[0], group), m[1],
                                             RowParallelLinear.from_native(m[2], group)), x, "column->row MLP")
    # GPT-2 Conv1D in both roles.
    _check_pair(Conv1D(8 * world, 16), lambda m: ColumnParallelLinear.from_native(m, group, gather_output=True), x,
                "Conv1D column")
    _check_pair(Conv1D(16, 8 * world), lambda m: RowParallelLinear.from_native(m, group, input_is_parallel=False),
                torch.randn(3, 5, 8 * world), "Conv1D row")
    # Fused [q | k | v]: every third split by heads; gathering with the record restores the layout.
    fused = Conv1D(3 * 8 * world, 16)
    _check_pair(fused, lambda m: ColumnParallelLinear.from_native(m, group, num_fused=3),
                x, "Conv1D fused qkv", out_transform=lambda y: _unfuse(y, group, world))
    # A contiguous split of the fused weight runs but is wrong: prove the test would see it.
    fused = Conv1D(3 * 8 * world, 16)
    ref_out = fused(x)
    wrong = ColumnParallelLinear.from_native(copy.deepcopy(fused), group, num_fused=1)
    assert not torch.allclose(_unfuse(wrong(x), group, world), ref_out, atol=1e-3), "contiguous split not detected"

    # Vocab-parallel embedding with a padding row (its grad must stay zero) and vocab padding; every
    # shard's first and last id, and the last real id, looked up (random ids seldom hit a shard edge).
    for vocab, pad_idx, multiple in ((101, 0, 8), (64, None, 1), (37, 5, 64)):
        emb = nn.Embedding(vocab, 16, padding_idx=pad_idx)
        ids = torch.randint(0, vocab, (3, 7))
        ids[0, 0] = pad_idx if pad_idx is not None else 1
        edges = vocab_edge_ids(vocab, world, multiple)
        ids.view(-1)[1:1 + len(edges)] = torch.tensor(edges)
        ref = copy.deepcopy(emb)
        par = VocabParallelEmbedding.from_native(emb, group, multiple)
        assert par.weight is emb.weight and get_tp_info(par.weight).padded_size % (multiple * world) == 0
        assert par.vocab_start >= vocab or {par.vocab_start, min(par.vocab_end, vocab) - 1} <= set(edges), edges
        y_ref, y_par = ref(ids), par(ids)
        assert_close(y_par, y_ref, msg=f"embedding vocab={vocab} output")
        g = torch.randn_like(y_ref)
        y_ref.backward(g)
        y_par.backward(g)
        assert_close(_full(par.weight, par.weight.grad), ref.weight.grad, msg=f"embedding vocab={vocab} grad")

    # Vocab-parallel LM head + cross-entropy (ignore_index, mean over non-ignored) vs F.cross_entropy;
    # the targets hold every shard's first and last id and the last real id (each owned by one rank).
    for vocab in (101, 128):
        head = nn.Linear(16, vocab, bias=True)
        ref = copy.deepcopy(head)
        par = VocabParallelLMHead.from_native(head, group, make_vocab_size_divisible_by=8, parallel_output=True)
        target = torch.randint(0, vocab, (3, 5))
        target[0, :2] = -100
        edges = vocab_edge_ids(vocab, world, 8)
        start = get_tp_info(par.weight).local_size * rank
        assert start >= vocab or start in edges, (start, edges)
        target.view(-1)[2:2 + len(edges)] = torch.tensor(edges)
        xr, xp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        logits_ref = ref(xr)
        loss_ref = F.cross_entropy(logits_ref.reshape(-1, vocab), target.reshape(-1), ignore_index=-100)
        par.train()
        local = par(xp)
        assert local.shape[-1] == get_tp_info(par.weight).local_size, "training logits should stay vocab-split"
        loss_par = vocab_parallel_cross_entropy(local, target, group, vocab)
        assert abs(loss_par.item() - loss_ref.item()) < 1e-5, f"vocab CE {loss_par.item()} vs {loss_ref.item()}"
        # the loss neither changes the logits it is given nor spends its saved softmax (a retained graph)
        before = local.detach().clone()
        g1, = torch.autograd.grad(loss_par, local, retain_graph=True)
        g2, = torch.autograd.grad(loss_par, local, retain_graph=True)
        assert torch.equal(g1, g2) and torch.equal(local.detach(), before), f"vocab={vocab}: CE inputs changed"
        loss_ref.backward()
        loss_par.backward()
        assert_close(xp.grad, xr.grad, msg=f"LM head vocab={vocab} input grad")
        assert_close(_full(par.weight, par.weight.grad), ref.weight.grad, msg=f"LM head vocab={vocab} weight grad")
        assert_close(_full(par.bias, par.bias.grad), ref.bias.grad, msg=f"LM head vocab={vocab} bias grad")
        par.eval()
        with torch.no_grad():
            full = par(x)
        assert full.shape[-1] == vocab, "eval logits must be trimmed to the real vocabulary"
        assert_close(full, logits_ref.detach(), msg=f"LM head vocab={vocab} eval logits")
        # sum reduction and num_items_in_batch (transformers' gradient-accumulation path)
        s_ref = F.cross_entropy(logits_ref.detach().reshape(-1, vocab), target.reshape(-1), reduction="sum")
        s_par = vocab_parallel_cross_entropy(local.detach(), target, group, vocab, reduction="sum")
        assert abs(s_par.item() - s_ref.item()) < 1e-4
        n_par = vocab_parallel_cross_entropy(local.detach(), target, group, vocab, num_items_in_batch=7)
        assert abs(n_par.item() - s_ref.item() / 7) < 1e-5


def _check_dim_mappings(rank, world):
    """The four autograd mappings along a dim (tp split/gather, sequence gather/reduce-scatter):
    forward values and the gradient each rank receives, against the collective written by hand."""
    from meshboost.distributed import comm
    group = dist.group.WORLD
    torch.manual_seed(0)
    full, weight = torch.randn(2, 4 * world, 3), torch.randn(2, 4 * world, 3)      # same on every rank
    mine = slice(4 * rank, 4 * (rank + 1))
    local = (full[:, mine] * (rank + 1)).requires_grad_()                           # differs per rank
    every = torch.cat([full[:, slice(4 * r, 4 * (r + 1))] * (r + 1) for r in range(world)], dim=1)
    x = full.clone().requires_grad_()
    y = comm.split_to_tp(x, group, dim=1)
    assert torch.equal(y, full[:, mine])
    (y * weight[:, mine]).sum().backward()
    assert torch.equal(x.grad, weight), "split backward: the gradient gathered from every rank"
    for gather in (comm.gather_from_tp, comm.gather_from_seq):
        local.grad = None
        y = gather(local, group, dim=1)
        assert torch.equal(y, every)
        (y * weight).sum().backward()
        expected = weight[:, mine] * (world if gather is comm.gather_from_seq else 1)   # reduce-scatter sums
        assert_close(local.grad, expected, msg=f"{gather.__name__} backward")
    x = (full * (rank + 1)).requires_grad_()
    y = comm.reduce_scatter_to_seq(x, group, dim=1)
    assert_close(y, full[:, mine] * sum(range(1, world + 1)), msg="reduce_scatter_to_seq forward")
    (y * weight[:, mine]).sum().backward()
    assert torch.equal(x.grad, weight), "reduce-scatter backward: the gradient gathered from every rank"


def _gather_last(y, group):
    from meshboost.distributed.comm import gather_from_tp
    return gather_from_tp(y, group, dim=-1)


def _unfuse(y, group, world):
    """Gather a fused-qkv column output [.., q_r k_r v_r] from all ranks into [.., q k v]."""
    from meshboost.distributed.comm import gather_from_tp
    full = gather_from_tp(y, group, dim=-1)
    per_rank = full.chunk(world, dim=-1)
    thirds = [r.chunk(3, dim=-1) for r in per_rank]
    return torch.cat([thirds[r][f] for f in range(3) for r in range(world)], dim=-1)


def _block_comm_body(rank, world):
    """A BERT/Llama layer costs exactly 2 all-reduces forward and 2 backward (Megatron minimum):
    q, k, v (and gate, up) share one input-gradient all-reduce."""
    from meshboost.shardformer import ShardConfig, ShardFormer
    from meshboost.testing.models import build_model, tiny_config

    for cls, family in (("BertModel", "bert"), ("LlamaModel", "llama"), ("GPT2Model", "gpt2")):
        config = tiny_config(family, num_hidden_layers=1)
        model = build_model(cls, config)
        ShardFormer(ShardConfig(tensor_parallel_process_group=dist.group.WORLD)).optimize(model)
        ids = torch.randint(1, config.vocab_size, (2, 6))
        with comm_counter() as fwd:
            out = model(input_ids=ids).last_hidden_state
        with comm_counter() as bwd:
            out.float().pow(2).mean().backward()
        f, b = fwd.summary()["world"]["calls"], bwd.summary()["world"]["calls"]
        # forward: embedding 1 + layer 2; backward: layer 2 (embedding grads need no comm).
        assert (f, b) == (3, 2), f"{cls}: {f} forward / {b} backward all-reduces, expected 3 / 2"
        h = config.hidden_size
        assert fwd.summary()["world"]["payload_bytes"] == 3 * 2 * 6 * h * 4


def _overlap_body(rank, world):
    """The block's input-gradient collective runs asynchronously behind the weight gradients of the
    columns reading that input (q/k/v, gate/up; c_attn, c_fc): with and without sequence parallelism,
    the input and weight gradients equal the unsharded layer's, the collectives are the same (calls and
    bytes), and the asynchronous ones were in flight while the weight gradients were computed (gloo runs them
    on its own threads, as NCCL runs them on its own stream)."""
    from meshboost.distributed.profiling import wait_timer
    from meshboost.shardformer import ShardConfig, ShardFormer
    from meshboost.testing.models import build_model, tiny_config

    for (cls, family), sp in itertools.product((("BertModel", "bert"), ("LlamaModel", "llama"),
                                                ("GPT2Model", "gpt2")), (False, True)):
        where = f"{cls} sp={sp}"
        config = tiny_config(family, num_hidden_layers=2)
        model = build_model(cls, config)
        ref = copy.deepcopy(model)
        ShardFormer(ShardConfig(tensor_parallel_process_group=dist.group.WORLD,
                                enable_sequence_parallelism=sp)).optimize(model)
        torch.manual_seed(1)
        ids = torch.randint(1, config.vocab_size, (2, 8))
        with comm_counter() as counted, wait_timer() as waits:
            model(input_ids=ids).last_hidden_state.pow(2).mean().backward()
        ref(input_ids=ids).last_hidden_state.pow(2).mean().backward()
        assert waits.overlapped_s > 0, f"{where}: no collective ran behind compute"
        ops = counted.summary()["world"]["by_op"]
        assert ops.get("all_reduce", 0) + ops.get("reduce_scatter", 0) >= 4, (where, ops)
        refs = dict(ref.named_parameters())
        for n, p in model.named_parameters():
            if refs[n].grad is None:             # unused by this loss (BERT's pooler)
                continue
            assert p.grad is not None, f"{where}: {n} got no gradient"
            if get_tp_info(p) is not None:
                assert_close(_full(p, p.grad), refs[n].grad, msg=f"{where}: grad {n}")


@pytest.mark.parametrize("world", [2, 4])
def test_parallel_layers_match_native(world):
    spawn(_layers_body, world)


def test_layer_communication_is_megatron_minimum():
    spawn(_block_comm_body, 2)


def test_block_input_collective_overlaps_weight_gradients():
    spawn(_overlap_body, 2)
