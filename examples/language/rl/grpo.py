"""RL with verifiable rewards (GRPO, DAPO, Dr. GRPO) on a causal LM through the meshboost Booster, at any layout.

    torchrun --nproc_per_node 2 examples/language/rl/grpo.py --model-config llama --size tiny --tp 2 \
        --task target-token

Model flags are the causal-LM example's (examples/language/causal_lm/model_setup.py: --model or --model-config x
--size, the layout flags, --lora). Each step draws --prompts-per-step prompts per replica from the task
(rl_tasks.py: generated from --seed and the step, no download), samples --num-generations completions of each
from the policy itself (`generate_rollouts`), scores them with the task's exact-match reward or yours (`--reward
module:function`, a callable `reward(prompts, completions) -> one float per completion` on token-id lists), then
takes --grpo-steps optimisation steps on them (`prepare_grpo` once, `grpo_step` per step). --beta > 0 adds the KL
to a frozen reference: a copy of the starting policy boosted like it, or with --lora the policy's own base.
Per-step records (reward mean/std, loss, KL, clip fraction, entropy, response length, tokens/s: generated tokens
per second of the whole step) go to <output-dir>/metrics.jsonl and TensorBoard (`--report-to`); `--save-every N`
writes checkpoints (policy, optimizer, schedule, generators; the prompts and sampling seeds are functions of the
seed and the step) that `--resume` continues with the same reward stream. Rollouts run transformers' generate on
the boosted policy, which --pp and --sp (context parallelism) cannot: they are refused before anything runs.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "causal_lm"), str(HERE.parents[1])]
import model_setup  # noqa: E402  (examples/language/causal_lm)
import rl_tasks  # noqa: E402  (beside this script)
from common import flags, train_log, train_loop  # noqa: E402  (examples/common)
from common.train_loop import UsageError  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = flags.Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)

    def arg(name, **kw):
        train_loop.add_flag(p, name, **kw)

    arg("--task", default="target-token", choices=sorted(rl_tasks.TASKS), help="the generated task (rl_tasks.py)")
    arg("--reward", default=None, help="module:function or file.py:function: your reward(prompts, completions) "
        "instead of the task's (token-id lists in, one float per completion out)")
    arg("--seed", type=int, default=42, help="the model's init, the prompts and the sampling")
    arg("--output-dir", default="outputs/grpo")
    train_log.add_report_arguments(p)
    arg("--model", default=None, help="HF folder of a causal LM (its weights are loaded)")
    arg("--model-config", default="llama", choices=sorted(model_setup.FAMILIES))
    arg("--size", default="tiny", choices=sorted(model_setup.SIZES))
    arg("--vocab", type=int, default=32, help="without --model: the random model's vocabulary")
    for name in ("--tp", "--pp", "--sp", "--ep", "--dp-replicate"):
        arg(name, type=int, default=1, help="as in examples/language/causal_lm/finetune.py (--pp, --sp: refused)")
    arg("--zero", type=int, default=0, choices=(0, 1, 2, 3))
    arg("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    arg("--checkpointing", action="store_true")
    flags.add_lora_flags(arg, "train LoRA adapters; the KL reference is the base (adapters disabled)")
    arg("--num-generations", type=int, default=8, help="completions per prompt (one group)")
    arg("--prompts-per-step", type=int, default=4, help="prompts per data-parallel replica and step")
    arg("--max-new-tokens", type=int, default=4)
    arg("--temperature", type=float, default=1.0)
    arg("--grpo-steps", type=int, default=1, help="optimisation steps per rollout batch")
    arg("--beta", type=float, default=0.0, help="the KL coefficient (k3 estimator; > 0 needs a reference)")
    arg("--epsilon-low", type=float, default=0.2)
    arg("--epsilon-high", type=float, default=None, help="default: --epsilon-low (DAPO: 0.28)")
    arg("--normalization", default="token", choices=("token", "sequence", "constant"))
    arg("--scale-rewards", default="group", choices=("group", "batch", "none"))
    arg("--lr", type=float, default=None, help="learning rate (default 1e-3, with --lora 5e-3)")
    arg("--max-grad-norm", type=float, default=1.0)
    arg("--max-steps", type=int, default=20, help="rollout steps")
    arg("--stop-after", type=int, default=0, help="stop at this step (the schedule still plans --max-steps)")
    arg("--save-every", type=int, default=0, help="booster.save_checkpoint every N steps into <output-dir>/checkpoints")
    arg("--resume", action="store_true", help="continue from <output-dir>/checkpoints (the same reward stream)")
    return p


NUMBERS = {
    **dict.fromkeys(("tp", "pp", "ep", "sp", "dp_replicate", "lora_r", "prompts_per_step", "max_new_tokens",
                     "grpo_steps", "max_steps"), flags.AT_LEAST_1),
    "num_generations": (lambda v: isinstance(v, int) and v >= 2, ">= 2 (a group-relative advantage needs two)"),
    "vocab": (lambda v: isinstance(v, int) and v >= rl_tasks.MIN_VOCAB, f">= {rl_tasks.MIN_VOCAB} (the tasks' tokens)"),
    "temperature": flags.POSITIVE, "lr": flags.POSITIVE, "lora_alpha": flags.POSITIVE, "beta": flags.NON_NEGATIVE,
    "epsilon_low": (lambda v: 0 <= v < 1, ">= 0 and < 1"), "epsilon_high": flags.NON_NEGATIVE,
    **flags.LOOP_NUMBERS,
}


def spell(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_args(args) -> None:
    """Pure checks, the same on every rank, before any collective."""
    flags.check_numbers(args, NUMBERS, spell)
    flags.check_model_source("--model", args.model, needs="config.json")
    flags.check_output_dir("--output-dir", args.output_dir)
    flags.check_lora_targets(args, spell, example="q_proj,v_proj")
    for flag, value in (("--pp", args.pp), ("--sp", args.sp)):
        if value > 1:
            raise UsageError(f"{flag}={value}: rollouts run transformers' generate on the boosted policy, which "
                             f"{'pipeline stages' if flag == '--pp' else 'context parallelism'} cannot (each decoded "
                             "token runs the whole model on whole sequences); drop it, or generate on an exported "
                             "copy (booster.export_weights, docs/post_training.md)")
    if args.resume and not (Path(args.output_dir) / "checkpoints").is_dir():
        raise UsageError(f"--resume: no checkpoints under {args.output_dir}/checkpoints (write them with --save-every)")
    train_log.check_report_to(args.report_to)


def reward_function(args):
    if args.reward is None:
        return rl_tasks.TASKS[args.task][1]
    try:
        return rl_tasks.load_reward(args.reward)
    except ValueError as e:
        raise UsageError(str(e)) from None


def model_config(args):
    config = model_setup.model_config(args, args.vocab)
    if not args.model:
        config.pad_token_id, config.eos_token_id, config.bos_token_id = rl_tasks.PAD, rl_tasks.EOS, None
    return config


def boost(args, booster, config):
    """(policy, optimizer, schedule, reference): the reference (beta > 0 without LoRA) boosted first, frozen,
    from the policy's own init (LazyInitContext's seed) or --model's weights; with LoRA the policy's base."""
    from transformers import get_constant_schedule

    from meshboost.post_training import BASE, boost_reference
    reference = None
    if args.beta > 0 and not args.lora:
        reference = boost_reference(booster, model_setup.build_model(args, copy.deepcopy(config)))
        if args.model:
            booster.load_model(reference, args.model)
    policy = model_setup.build_model(args, config)
    if args.lora:
        policy = booster.enable_lora(policy, lora_config=model_setup.lora_config(args))
        reference = BASE if args.beta > 0 else None
    args.lr = args.lr if args.lr is not None else (5e-3 if args.lora else 1e-3)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=args.lr)
    model, optimizer, _, _, schedule = booster.boost(policy, optimizer, lr_scheduler=get_constant_schedule(optimizer))
    if args.model:
        booster.load_model(model, args.model)
    return model, optimizer, schedule, reference


def rollout_step(args, model, mesh, step: int, reward):
    """This replica's rollouts of step `step` and their rewards (the prompts cut from the global batch)."""
    from meshboost.post_training import generate_rollouts
    n = args.prompts_per_step
    prompts = rl_tasks.step_prompts(args.task, args.seed, step, n * mesh.dp_size, args.vocab)
    mine = prompts[mesh.dp_rank * n:(mesh.dp_rank + 1) * n]
    seed = int(np.random.SeedSequence([args.seed, step]).generate_state(1)[0])
    config = model.unwrap().config
    rollout = generate_rollouts(model, mine, args.num_generations, args.max_new_tokens, args.temperature, seed=seed,
                                pad_token_id=config.pad_token_id)
    rows = [p for p in mine for _ in range(args.num_generations)]
    ends = set(np.atleast_1d(config.eos_token_id).tolist()) if config.eos_token_id is not None else set()
    completions = [[t for t in c if t not in ends] for c in rollout.completions()]       # the end token dropped
    rewards = torch.as_tensor(list(reward(rows, completions)), dtype=torch.float32, device=rollout.input_ids.device)
    if rewards.shape != (rollout.rows,):
        raise UsageError(f"the reward function returned {tuple(rewards.shape)} values for {rollout.rows} completions: "
                         "one float per completion")
    return rollout, rewards


def run(args, booster, model, optimizer, schedule, reference, mesh, logger, step, ckpt_dir, reward):
    """The loop from `step` to --max-steps (or --stop-after) -> (the last record or None, the last saved step)."""
    from meshboost.post_training import GRPOConfig, grpo_step, prepare_grpo
    config = GRPOConfig(epsilon_low=args.epsilon_low, epsilon_high=args.epsilon_high, beta=args.beta,
                        normalization=args.normalization, scale_rewards=args.scale_rewards,
                        max_length=args.max_new_tokens if args.normalization == "constant" else None)
    stop = min(args.max_steps, args.stop_after) if args.stop_after else args.max_steps
    model.train()
    logger.restart_clock()
    last = saved = None
    while step < stop:
        step += 1
        rollout, rewards = rollout_step(args, model, mesh, step, reward)
        prepared = prepare_grpo(model, rollout, rewards, config, reference=reference, booster=booster)
        for _ in range(args.grpo_steps):
            out = grpo_step(booster, model, optimizer, prepared, config)
            optimizer.step()
            optimizer.zero_grad()
            lr = schedule.get_last_lr()[0]
            schedule.step()
        metrics = dict(out.metrics)
        tokens = int(prepared.tokens.item())                     # the step's generated tokens, every replica's
        last = logger.log(step, metrics.pop("loss"), lr, tokens, grad_norm=optimizer.get_grad_norm(),
                          loss_scale=train_loop.loss_scale(optimizer, args.precision),
                          **{k.replace("/", "_"): v for k, v in metrics.items()})
        if logger.reporter:
            print(f"step {step}: reward {last['reward_mean']:.3f} (std {last['reward_std']:.3f}), loss "
                  f"{last['loss']:.4f}, kl {last['kl']:.4f}, clip {last['clip_fraction']:.3f}, entropy "
                  f"{last['entropy']:.3f}, {last['tokens_per_s']:.0f} tokens/s", flush=True)
        if args.save_every and step % args.save_every == 0:
            booster.save_checkpoint(ckpt_dir, model, optimizer, schedule, step=step)
            saved = step
            logger.restart_clock()
    return last, saved


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    # what model_setup reads and this script does not offer
    args.plugin, args.fp8, args.compile, args.lora_experts, args.quantize = "hybrid_parallel", False, False, False, None
    args.sp_mode, args.microbatch_size, args.seq, args.memory_gb = "all_to_all", 1, 128, 0
    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    say = print if rank == 0 else (lambda *a, **k: None)
    try:
        check_args(args)
        reward = reward_function(args)
        config = model_config(args)
    except (UsageError, OSError) as e:
        say(f"grpo.py: {e}", file=sys.stderr)
        return 2
    if args.model:
        args.vocab = config.vocab_size
    torch.set_num_threads(train_loop.local_threads())
    from meshboost import Booster
    device = train_loop.launch(args.seed)
    try:
        plugin, _ = model_setup.build_plugin(args, config, world_size)
        mesh, booster = plugin.mesh, Booster(plugin=plugin)
        model, optimizer, schedule, reference = boost(args, booster, config)
    except (ValueError, NotImplementedError, TypeError) as e:
        say(f"grpo.py: this layout cannot run: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    train_loop.track_grad_norm(optimizer)
    reporter = mesh.dp_rank == 0 and mesh.tp_rank == 0
    log = print if reporter else (lambda *a, **k: None)
    log(f"layout: tp={mesh.tp_size} dp={mesh.dp_size} ep={args.ep} zero={args.zero} {args.precision} | task "
        f"{args.task}{' (reward ' + args.reward + ')' if args.reward else ''}, {args.prompts_per_step} prompts x "
        f"{mesh.dp_size} replicas x {args.num_generations} completions of {args.max_new_tokens} tokens, "
        f"{args.grpo_steps} optimisation steps each, beta {args.beta}{', lora' if args.lora else ''}, "
        f"{args.max_steps} steps", flush=True)
    ckpt_dir, step = str(Path(args.output_dir) / "checkpoints"), 0
    stop = min(args.max_steps, args.stop_after) if args.stop_after else args.max_steps
    if args.resume:
        try:
            step = train_loop.resume_step(booster, ckpt_dir, (model, optimizer, schedule), stop, log)
        except UsageError as e:
            say(f"grpo.py: {e}", file=sys.stderr)
            return 2
    logger = train_log.StepLogger(args.output_dir, args.report_to, reporter, device, args.precision, world_size,
                                  resume_step=step if args.resume else None)
    try:
        last, saved = run(args, booster, model, optimizer, schedule, reference, mesh, logger, step, ckpt_dir, reward)
    except UsageError as e:                 # the reward function's answer has the wrong shape (alike on every rank)
        say(f"grpo.py: {e}", file=sys.stderr)
        return 2
    logger.close()
    log(closing_line(args, last, logger, ckpt_dir, saved), flush=True)
    return 0


def closing_line(args, last, logger, ckpt_dir: str, saved) -> str:
    if last is None:
        return "done: no step trained"
    stopped = last["step"] < args.max_steps
    parts = [f"{'stopped' if stopped else 'done'} at step {last['step']} of {args.max_steps}, reward mean "
             f"{last['reward_mean']:.3f} (std {last['reward_std']:.3f})"]
    parts.append(logger.where(args.report_to))
    if saved:
        parts.append(f"checkpoints: {ckpt_dir} (latest step {saved})"
                     + ("; continue with the same command and --resume" if stopped else ""))
    return " | ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
