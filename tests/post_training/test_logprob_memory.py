"""Issue 58 point 1's memory promise, on 2 processes at tp=2 (fp32, tiny Llama with a 4096-token vocabulary, so
the logits dwarf everything else): `token_logprobs` never holds a [batch, seq, vocab] tensor beyond the logits
shard, training (the policy, with its backward) and in eval under no_grad (a frozen reference).

- every tensor an op makes during the call (a TorchDispatchMode sees each output) holds at most one shard of
  the logits' elements (batch x seq x vocab / 2): a gather of the vocabulary, or a log_softmax of it, would
  make one of twice that;
- torch's MemTracker: the peak of live tensor bytes during the call, over what was live before it, stays under
  the whole logits' bytes plus one shard (measured here: 5.1 MB training, 4.2 MB in eval, the bound 6.3 MB;
  a gather would hold the whole logits and the shard they came from at
  once, besides the hidden states, so it lands above);
- the log-probs equal the unsharded log_softmax gather (the memory saved is not paid for in numbers).
"""

import copy

import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode

from meshboost import Booster
from meshboost.plugins import HybridParallelConfig, HybridParallelPlugin
from meshboost.post_training import shifted_labels, token_logprobs
from meshboost.testing import spawn
from meshboost.testing.models import build_model, tiny_config

VOCAB, BATCH, SEQ = 4096, 4, 64
_MADE = ("Activation", "Temp", "Gradient", "Other")      # MemTracker's kinds the call makes (not weights, buffers)


class _Largest(TorchDispatchMode):
    """The most elements of any tensor an op returned inside the mode."""

    def __init__(self):
        super().__init__()
        self.largest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if torch.is_tensor(t) and t.numel() > self.largest:
                self.largest, self.op = t.numel(), str(func)
        return out


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[:, :5] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _body(rank, world_size):
    config = tiny_config("llama", num_key_value_heads=2, vocab_size=VOCAB)
    config.use_cache = False
    whole = build_model("LlamaForCausalLM", copy.deepcopy(config))
    batch = _batch()
    logits = whole(input_ids=batch["input_ids"]).logits.float()
    target = shifted_labels(batch["labels"])
    want = F.log_softmax(logits, -1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    want = want.masked_fill(target == -100, 0.0).detach()
    booster = Booster(plugin=HybridParallelPlugin(HybridParallelConfig(tp_size=2)))
    model, *_ = booster.boost(copy.deepcopy(whole))
    shard = BATCH * SEQ * VOCAB // 2
    for mode in ("train", "eval"):
        getattr(model, mode)()
        token_logprobs(model, batch)                       # warm: lazy state built outside the measurement
        tracker, largest = MemTracker(), _Largest()
        tracker.track_external(model)
        with torch.set_grad_enabled(mode == "train"), tracker, largest:
            got = token_logprobs(model, batch)
            if mode == "train":
                got.logprobs.sum().backward()
        model.zero_grad(set_to_none=True)
        torch.testing.assert_close(got.logprobs.detach(), want, rtol=1e-5, atol=1e-5)
        assert largest.largest <= shard, f"{mode}: {largest.op} made {largest.largest} elements, a shard holds {shard}"
        snapshot = tracker.get_tracker_snapshot("peak")
        peak = max(sum(v for k, v in stats.items() if getattr(k, "value", k) in _MADE) for stats in snapshot.values())
        whole_bytes = 4 * 2 * shard
        assert peak < whole_bytes + 4 * shard, f"{mode}: peak {peak} bytes, the whole logits hold {whole_bytes}"


def test_logprobs_memory_tp2():
    spawn(_body, 2)
