"""A ColossalAI-style fine-tuning script (shaped like ColossalAI's examples/language/bert/finetune.py)
that imports meshboost names only, in ColossalAI's paths. It fine-tunes a tiny BERT built from a
config on a tiny in-memory task (the label is whether the first token is in the upper half of the
vocabulary), then evaluates accuracy and F1, and prints one JSON line `RESULT {...}` on rank 0.

    torchrun --nproc_per_node 2 colossalai_style_finetune.py --plugin hybrid_parallel     # tp=1, pp=2 interleaved
    torchrun --nproc_per_node 2 colossalai_style_finetune.py --plugin hybrid_parallel --tp 2 --pp 1
    torchrun --nproc_per_node 2 colossalai_style_finetune.py --plugin low_level_zero       # or torch_ddp
"""

import argparse
import json

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification, get_linear_schedule_with_warmup

import meshboost
from meshboost.accelerator import get_accelerator
from meshboost.booster import Booster
from meshboost.booster.plugin import HybridParallelPlugin, LowLevelZeroPlugin, TorchDDPPlugin
from meshboost.booster.plugin.dp_plugin_base import DPPluginBase
from meshboost.cluster import DistCoordinator
from meshboost.nn.optimizer import HybridAdam

VOCAB, SEQ, NUM_LABELS = 64, 16, 2


class FirstTokenTask(Dataset):
    """Random token sequences; label 1 when the first token is in the upper half of the vocabulary."""

    def __init__(self, size: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(1, VOCAB, (size, SEQ), generator=g)
        self.labels = (self.input_ids[:, 0] >= VOCAB // 2).long()

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.input_ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long),
                "labels": self.labels[i]}


class DataBuilder:
    """Like ColossalAI's GLUEDataBuilder: the plugin makes the (data-parallel) loaders."""

    def __init__(self, plugin: DPPluginBase, train_size: int, eval_size: int, batch_size: int):
        self.plugin, self.batch_size = plugin, batch_size
        self.train, self.eval = FirstTokenTask(train_size, seed=0), FirstTokenTask(eval_size, seed=1)

    def train_dataloader(self):
        return self.plugin.prepare_dataloader(self.train, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def test_dataloader(self):
        return self.plugin.prepare_dataloader(self.eval, batch_size=self.batch_size)


def move_to_device(batch):
    return {k: v.to(get_accelerator().get_current_device()) for k, v in batch.items()}


def criterion(outputs, inputs):
    return outputs.loss


def train_epoch(epoch, model, optimizer, lr_scheduler, train_dataloader, booster, coordinator, args):
    use_pipeline = isinstance(booster.plugin, HybridParallelPlugin) and booster.plugin.pp_size > 1
    is_pp_last_device = use_pipeline and booster.plugin.stage_manager.is_last_stage(ignore_chunk=True)
    model.train()
    optimizer.zero_grad()
    it = iter(train_dataloader)
    losses = []
    for _ in range(len(train_dataloader)):
        if use_pipeline:
            outputs = booster.execute_pipeline(it, model, criterion, optimizer, return_loss=True)
            loss = outputs["loss"]
        else:
            outputs = model(**move_to_device(next(it)))
            loss = criterion(outputs, None)
            booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        lr_scheduler.step()
        losses.append(loss.item())
    if (coordinator.is_master() and not use_pipeline) or is_pp_last_device:
        print(f"epoch {epoch + 1}/{args.epochs}: mean loss {sum(losses) / len(losses):.4f}", flush=True)
    return losses


@torch.no_grad()
def evaluate(model, test_dataloader, booster, coordinator):
    """Accuracy and F1 over the whole eval set: each rank counts its predictions, the counts are summed
    over the world and divided by the ranks that saw the same samples (tp x pp of one dp replica)."""
    model.eval()
    plugin = booster.plugin
    use_pipeline = isinstance(plugin, HybridParallelPlugin) and plugin.pp_size > 1
    device = get_accelerator().get_current_device()
    counts = torch.zeros(4, dtype=torch.float64, device=device)        # tp, fp, fn, tn
    loss_sum = torch.zeros(1, device=device)
    for batch in test_dataloader:
        batch = move_to_device(batch)
        labels = batch["labels"]
        if use_pipeline:
            pp_group = plugin.pp_group
            pp_ranks = plugin.pg_mesh.get_ranks_in_group(pp_group)
            outputs = booster.execute_pipeline(iter([batch]), model, criterion, return_loss=True, return_outputs=True)
            if plugin.stage_manager.is_last_stage(ignore_chunk=True):
                preds = torch.argmax(outputs["outputs"]["logits"], dim=-1)
                shared = [preds, outputs["loss"]]
            else:
                shared = [None, None]
            dist.broadcast_object_list(shared, src=pp_ranks[-1], group=pp_group)
            preds, loss = shared[0].to(device), shared[1].to(device)
        else:
            outputs = model(**batch)
            preds, loss = torch.argmax(outputs.logits, dim=-1), outputs.loss
        loss_sum += loss.float()
        counts += torch.stack([(preds == 1) & (labels == 1), (preds == 1) & (labels == 0),
                               (preds == 0) & (labels == 1), (preds == 0) & (labels == 0)]).sum(dim=1).double()
    dist.all_reduce(counts)
    dist.all_reduce(loss_sum)
    sharing = coordinator.world_size // plugin.dp_size
    tp, fp, fn, tn = (counts / sharing).tolist()
    return {"accuracy": (tp + tn) / (tp + fp + fn + tn), "f1": 2 * tp / max(2 * tp + fp + fn, 1.0),
            "loss": loss_sum.item() / coordinator.world_size / len(test_dataloader), "samples": int(tp + fp + fn + tn)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("-p", "--plugin", default="torch_ddp",
                        choices=["torch_ddp", "torch_ddp_fp16", "low_level_zero", "hybrid_parallel"])
    parser.add_argument("--tp", type=int, default=1, help="hybrid_parallel: tensor-parallel size")
    parser.add_argument("--pp", type=int, default=2, help="hybrid_parallel: pipeline stages (interleaved, 2 chunks)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--train_size", type=int, default=128)
    parser.add_argument("--eval_size", type=int, default=64)
    parser.add_argument("--all_optimization", type=int, default=1, help="hybrid_parallel: enable_all_optimization")
    parser.add_argument("--target_accuracy", type=float, default=None)
    args = parser.parse_args()

    meshboost.launch_from_torch(seed=42)
    coordinator = DistCoordinator()
    get_accelerator().manual_seed(42)

    booster_kwargs = {}
    if args.plugin == "torch_ddp_fp16":
        booster_kwargs["mixed_precision"] = "fp16"
    if args.plugin.startswith("torch_ddp"):
        plugin = TorchDDPPlugin(fp8_communication=False)
    elif args.plugin == "low_level_zero":
        plugin = LowLevelZeroPlugin(initial_scale=2**5)
    else:
        pipeline = dict(pp_style="interleaved", num_model_chunks=2, num_microbatches=None,
                        microbatch_size=args.batch_size // 2) if args.pp > 1 else {}
        plugin = HybridParallelPlugin(tp_size=args.tp, pp_size=args.pp, zero_stage=1, precision="fp16",
                                      initial_scale=1, enable_all_optimization=bool(args.all_optimization),
                                      fp8_communication=False, **pipeline)
    booster = Booster(plugin=plugin, **booster_kwargs)

    with coordinator.priority_execution():             # rank 0 first, as a download would be
        data_builder = DataBuilder(plugin, args.train_size, args.eval_size, args.batch_size)
    train_dataloader = data_builder.train_dataloader()
    test_dataloader = data_builder.test_dataloader()

    torch.manual_seed(42)
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=SEQ, num_labels=NUM_LABELS,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForSequenceClassification(config).to(get_accelerator().get_current_device())

    no_decay = ["bias", "LayerNorm.weight"]
    grouped = [{"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
                "weight_decay": 0.01},
               {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
                "weight_decay": 0.0}]
    optimizer = HybridAdam(grouped, lr=args.lr, eps=1e-8)
    total_steps = len(train_dataloader) * args.epochs
    lr_scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=int(0.1 * total_steps),
                                                   num_training_steps=total_steps)

    model, optimizer, _, _, lr_scheduler = booster.boost(model, optimizer, criterion=criterion,
                                                         lr_scheduler=lr_scheduler)

    losses = []
    for epoch in range(args.epochs):
        losses += train_epoch(epoch, model, optimizer, lr_scheduler, train_dataloader, booster, coordinator, args)
    results = evaluate(model, test_dataloader, booster, coordinator)
    results.update(first_loss=losses[0], last_loss=losses[-1], steps=len(losses), dp_size=plugin.dp_size,
                   accelerator=get_accelerator().name,
                   max_memory_allocated=get_accelerator().max_memory_allocated())
    coordinator.print_on_master("RESULT " + json.dumps(results))
    if args.target_accuracy is not None:
        assert results["accuracy"] >= args.target_accuracy, f"accuracy {results['accuracy']} < {args.target_accuracy}"


if __name__ == "__main__":
    main()
