"""The ColossalAI-style Llama benchmark (colossalai_style_llama_benchmark.py: ColossalAI's imports,
LazyInitContext, HybridAdam, execute_pipeline) under torchrun on 2 processes, for gemini_auto (the
static configuration, tests/plugins/test_fsdp.py), 3d at tp=2 with ZeRO-1 and cpu_offload (3d_cpu),
and 3d at pp=2 with ZeRO-2 and checkpointing: every
step's loss equals one process training the same lazily initialised model with AdamW on the whole
batch (fp32, 1e-5)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
import colossalai_style_llama_benchmark as script  # noqa: E402

from meshboost.lazy import LazyInitContext  # noqa: E402

STEPS, BATCH, SEQ = 3, 4, 16


def _run(*args: str) -> list[float]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script.__file__,
           "-s", str(STEPS), "-b", str(BATCH), "-l", str(SEQ), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, proc.stdout[-3000:]
    return json.loads(lines[0][len("RESULT "):])["losses"]


@pytest.fixture(scope="module")
def reference() -> list[float]:
    with LazyInitContext(seed=script.SEED):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**script.CONFIG))
    LazyInitContext.materialize(model)
    opt = torch.optim.AdamW(model.parameters(), lr=script.LR, weight_decay=0.0)
    losses = []
    for ids in script.batches(STEPS, BATCH, SEQ):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step(), opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("args", [("-p", "gemini_auto"), ("-p", "3d_cpu", "--tp", "2", "--zero", "1"),
                                  ("-p", "3d", "--pp", "2", "--zero", "2", "--mbs", "1", "-g")],
                         ids=["gemini_auto", "3d_cpu_tp2_zero1", "3d_pp2_zero2_ckpt"])
def test_llama_benchmark_style_script(args, reference):
    losses = _run(*args)
    assert len(losses) == STEPS
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=0, atol=1e-5)
