"""The README's first snippet, whole: a tiny causal LM trained with 2-way tensor parallelism, offline (a
random Llama of 2 layers, the bytes of this file as its text). The README shows this file below the
docstring, line for line (tests/examples/test_quickstart.py checks both and runs it).

    torchrun --nproc_per_node 2 examples/quickstart/train.py     # tp=2; 4 processes: tp=2 x dp=2
"""
from pathlib import Path

import torch
import transformers

import meshboost
from meshboost import Booster
from meshboost.plugins import HybridParallelPlugin

meshboost.launch_from_torch(seed=42)          # NCCL on CUDA, gloo on CPU
plugin = HybridParallelPlugin(tp_size=2)      # dp = world_size / (tp * pp)
booster = Booster(plugin=plugin)
config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2)     # tiny, random weights
model = transformers.AutoModelForCausalLM.from_config(config)   # or .from_pretrained(path) for real ones
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)      # built before boost: stays valid
lr_scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=20)
text = torch.tensor(list(Path(__file__).read_bytes()))          # one token per byte: no tokenizer needed
train_ds = [{"input_ids": row, "labels": row} for row in text[: len(text) // 64 * 64].view(-1, 64)]
train_loader = plugin.prepare_dataloader(train_ds, batch_size=8, shuffle=True)   # samples over dp only
model, optimizer, _, _, lr_scheduler = booster.boost(model, optimizer, lr_scheduler=lr_scheduler)
device, losses = meshboost.get_current_device(), []
for epoch in range(4):
    train_loader.sampler.set_epoch(epoch)     # a new shuffle each epoch
    for batch in train_loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        loss = model(**batch).loss
        booster.backward(loss, optimizer)
        optimizer.step(); optimizer.zero_grad(); lr_scheduler.step()
        losses.append(loss.item())
if torch.distributed.get_rank() == 0:
    print(f"{len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
