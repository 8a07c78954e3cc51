"""The model sweep: every model type of the installed transformers whose config ships
`base_model_tp_plan`, built tiny, sharded over a tp group and compared with the unsharded model
(or, the variant {"expert_parallel": True}, its packed MoE experts split over the group as ep ranks).

Owns: building a tiny config for any model type (sizes that divide by 2 and 4, small vocab, two
layers, small MoE), choosing the class (causal LM when there is one, else the base model), the
inputs (a padded batch), and the verdict per type:
    ok            loss, eval output and every gathered gradient match the unsharded model (fp32)
    refused       meshboost raised a clear error at sharding time, before changing anything (or,
                  for a parameter fed split activations the plan does not cover, at the first call)
    not run       the tiny model could not be built or run unsharded on input_ids alone
                  (multimodal inputs, unusual config constraints): nothing to compare
    FAIL          anything else: a crash after sharding, or numbers that differ
    no experts    (expert-parallel variant) the model has no packed experts to split
The expert-parallel variant feeds every ep rank the same batch: each expert then sees its tokens once
per rank, and its gradient (summed over the ranks, divided by ep) is the unsharded one.
Used by tests/shardformer/test_model_sweep.py (no FAIL allowed) and tools/sweep_models.py (writes
docs/models.md). Must run identically on every rank of the group (the comparison communicates).
"""

from __future__ import annotations

import copy
import traceback
from dataclasses import dataclass

import torch

from meshboost.distributed.param_info import gather_tensor, get_tp_info
from meshboost.shardformer import ShardConfig, ShardFormer
from meshboost.shardformer.layers.expert_parallel import experts_modules, shard_expert_parallel_
from meshboost.shardformer.layers.linear import SequenceLayoutError
from meshboost.shardformer.sharder import UncoveredParameterError

TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            num_hidden_layers=2, vocab_size=160, max_position_embeddings=64, moe_intermediate_size=32,
            num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            shared_expert_intermediate_size=64, first_k_dense_replace=1, n_group=1, topk_group=1,
            use_cache=False, tie_word_embeddings=False)
MAX_PARAMS = 20_000_000
DROPOUTS = ("hidden_dropout", "attention_dropout", "hidden_dropout_prob", "attention_probs_dropout_prob",
            "dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "embedding_dropout", "mlp_dropout",
            "residual_dropout")


@dataclass
class Verdict:
    model_type: str
    cls: str
    status: str          # ok | refused | not run | FAIL | no experts
    detail: str = ""


def plan_model_types() -> list[str]:
    """Every model type whose default config ships a non-empty `base_model_tp_plan`."""
    from transformers import CONFIG_MAPPING
    out = []
    for model_type in sorted(CONFIG_MAPPING.keys()):
        try:
            config = CONFIG_MAPPING[model_type]()
        except Exception:  # noqa: BLE001 - a config that needs arguments has no default plan to read
            continue
        if getattr(config, "base_model_tp_plan", None):
            out.append(model_type)
    return out


def tiny_config(model_type: str, shrink_head_dim: bool = False):
    """The default config of `model_type` shrunk to TINY where it has the fields (sub-configs too).
    shrink_head_dim: a head_dim that only restates hidden / heads (ESM-C, Helium) follows the shrink
    (tried when the plain shrink cannot run: other configs keep an independent head_dim)."""
    from transformers import CONFIG_MAPPING
    default = CONFIG_MAPPING[model_type]()
    fields = default.to_dict()
    # only fields the config has, with the type it gives them (an int stays an int, a list a list)
    overrides = {k: v for k, v in TINY.items() if k in fields and type(fields[k]) is type(v)}
    overrides.update({k: 0.0 for k in DROPOUTS if isinstance(fields.get(k), float)})
    heads, hidden, head_dim = fields.get("num_attention_heads"), fields.get("hidden_size"), fields.get("head_dim")
    if shrink_head_dim and isinstance(head_dim, int) and isinstance(heads, int) and isinstance(hidden, int) \
            and head_dim * heads == hidden:
        overrides["head_dim"] = TINY["hidden_size"] // TINY["num_attention_heads"]
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(fields.get(key), int) and fields[key] >= TINY["vocab_size"]:
            overrides[key] = TINY["vocab_size"] - 1
    layers, n = fields.get("num_hidden_layers"), TINY["num_hidden_layers"]
    for key, value in fields.items():          # per-layer lists and tables follow the layer count
        if isinstance(value, list) and isinstance(layers, int) and len(value) == layers and layers > n:
            overrides[key] = value[:n]
        elif key == "per_layer_config" and isinstance(value, dict):
            overrides[key] = {k: v for k, v in value.items() if str(k).isdigit() and int(k) < n}
    try:
        config = CONFIG_MAPPING[model_type](**{**fields, **overrides})
    except Exception:  # noqa: BLE001 - e.g. ESM-C: no grouped-query attention; retry with kv heads = heads
        if "num_key_value_heads" not in overrides:
            raise
        overrides["num_key_value_heads"] = TINY["num_attention_heads"]
        config = CONFIG_MAPPING[model_type](**{**fields, **overrides})
    for name in ("text_config", "language_config", "decoder_config"):
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "model_type") and sub.model_type in CONFIG_MAPPING:
            setattr(config, name, tiny_config(sub.model_type, shrink_head_dim))
    return config


def build(model_type: str, seed: int = 0, shrink_head_dim: bool = False):
    """(class name, model) for the tiny config: the causal LM when the type has one, else the base."""
    import transformers as tfm
    config = tiny_config(model_type, shrink_head_dim)
    for auto in (tfm.AutoModelForCausalLM, tfm.AutoModel):
        if type(config) in auto._model_mapping:
            with torch.device("meta"):              # count first: a config the shrink missed stays huge
                size = sum(p.numel() for p in auto.from_config(copy.deepcopy(config)).parameters())
            if size > MAX_PARAMS:
                raise ValueError(f"the shrunk config still has {size / 1e6:.0f}M parameters")
            torch.manual_seed(seed)
            model = auto.from_config(copy.deepcopy(config)).float()
            return type(model).__name__, model
    raise ValueError(f"no causal-LM or base model class for {model_type}")


def _loss(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    out = model(**batch)
    if getattr(out, "loss", None) is not None:
        return out.loss, out.logits
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden.float().pow(2).mean(), hidden


def batch_for(model) -> dict:
    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, min(vocab, 150), (2, 8), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if type(model).__name__.endswith("ForCausalLM"):
        labels = ids.clone()
        labels[1, :3] = -100
        batch["labels"] = labels
    return batch


def _eval_and_train(model, batch):
    """The eval output (no grad), then the training loss with its gradients computed."""
    model.eval()
    with torch.no_grad():
        _, eval_out = _loss(model, batch)
    model.train()
    loss, _ = _loss(model, batch)
    loss.backward()
    return eval_out, loss


def check(model_type: str, group, atol: float = 1e-5, shard_options: dict | None = None) -> Verdict:
    """The verdict for one model type (call on every rank of `group`; the comparison communicates).
    shard_options: more `ShardConfig` fields (enable_sequence_parallelism=True for the SP sweep)."""
    return check_variants(model_type, group, [shard_options or {}], atol)[0]


def check_variants(model_type: str, group, variants: list[dict], atol: float = 1e-5) -> list[Verdict]:
    """One verdict per entry of `variants` (`ShardConfig` options each), all against one unsharded
    reference built and run once (the sweep with and without sequence parallelism)."""
    first_error = None
    for shrink_head_dim in (False, True):
        try:
            cls, ref = build(model_type, shrink_head_dim=shrink_head_dim)
            batch = batch_for(ref)
            ref_eval, ref_loss = _eval_and_train(ref, batch)
            break
        except Exception as e:  # noqa: BLE001 - not meshboost's: nothing to compare
            first_error = first_error or e
    else:
        return [Verdict(model_type, "?", "not run", f"{type(first_error).__name__}: "
                        f"{str(first_error).splitlines()[0][:160]}") for _ in variants]
    if not torch.isfinite(ref_loss):
        return [Verdict(model_type, cls, "not run", "the unsharded tiny model gives a non-finite loss")
                for _ in variants]
    reference = (ref, batch, ref_eval, ref_loss)
    return [_check_sharded(model_type, cls, shrink_head_dim, reference, group, options, atol) for options in variants]


def _check_sharded(model_type: str, cls: str, shrink_head_dim: bool, reference: tuple, group, shard_options: dict,
                   atol: float) -> Verdict:
    ref, batch, ref_eval, ref_loss = reference
    shard_options = dict(shard_options)
    expert_parallel = shard_options.pop("expert_parallel", False)
    if expert_parallel and not experts_modules(ref):
        return Verdict(model_type, cls, "no experts")
    _, par = build(model_type, shrink_head_dim=shrink_head_dim)
    try:
        if expert_parallel:
            shard_expert_parallel_(par, group, torch.distributed.get_world_size(group), torch.distributed.get_rank(group))
        else:
            ShardFormer(ShardConfig(tensor_parallel_process_group=group, **shard_options)).optimize(par)
    except (ValueError, TypeError, NotImplementedError) as e:
        return Verdict(model_type, cls, "refused", str(e).splitlines()[0][:240])
    try:
        par_eval, par_loss = _eval_and_train(par, batch)
        problems = []
        if par_eval.shape != ref_eval.shape or not torch.allclose(par_eval, ref_eval, rtol=1e-4, atol=atol):
            problems.append("eval output")
        if abs(par_loss.item() - ref_loss.item()) > atol:
            problems.append(f"loss {par_loss.item():.6f} vs {ref_loss.item():.6f}")
        ref_params = dict(ref.named_parameters())
        for name, p in par.named_parameters():
            r = ref_params.get(name)
            if r is None or (r.grad is None) != (p.grad is None):
                problems.append(f"grad presence {name}")
            elif r.grad is not None:
                full = gather_tensor(p.grad, get_tp_info(p))
                if full.shape != r.grad.shape or not torch.allclose(full, r.grad, rtol=1e-4, atol=atol):
                    problems.append(f"grad {name}")
        if problems:
            return Verdict(model_type, cls, "FAIL", "; ".join(problems[:4]))
        return Verdict(model_type, cls, "ok")
    except (UncoveredParameterError, SequenceLayoutError) as e:            # a clear refusal, at the first call
        return Verdict(model_type, cls, "refused", f"at the first call: {str(e).splitlines()[0][:200]}")
    except Exception as e:  # noqa: BLE001 - meshboost accepted the model, then it broke: a defect
        where = traceback.extract_tb(e.__traceback__)[-1]
        return Verdict(model_type, cls, "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0][:160]} "
                                                f"({where.filename.rsplit('/', 1)[-1]}:{where.lineno})")
