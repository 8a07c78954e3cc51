"""Elastic restart: under `torchrun --max-restarts 1`, a rank killed mid-run (SIGKILL at step 5) makes
torchrun restart every worker; the script's booster.load_checkpoint resumes from the last committed
step (4), and the per-step losses of the restarted attempt equal the uninterrupted run's bitwise, for
a tied (GPT-2) and an untied (Llama) LM head, in fp32 and fp16, at tp=2 x dp=2 with ZeRO-1.
(torch's default restart reuses the agent's TCP store and would meet the dead attempt's keys:
launch_from_torch gives each attempt its own prefix.)"""

from __future__ import annotations

import pytest
from torchrun_launch import ONE_NODE, launch


# Each factor once (tied/untied head x fp32/fp16 crossed): every restart costs ~35 s of the suite.
# GPT-2 fp32 is also the multi-node test's configuration: its uninterrupted run is shared.
@pytest.mark.parametrize("family,precision", [("gpt2", "fp32"), ("llama", "fp16")])
def test_killed_rank_resumes_exactly(tmp_path, one_node_run, family, precision):
    common = ["--family", family, "--precision", precision]
    expected = one_node_run(family, precision)["losses"]
    killed = launch(tmp_path, "killed", [ONE_NODE], common + ["--kill-rank", "3", "--kill-at", "5"])
    assert list(killed) == [".attempt1"], f"the first attempt must die and the second finish: {list(killed)}"
    resumed = killed[".attempt1"]
    assert resumed["first_step"] == 5, resumed       # steps 1-4 committed before the kill
    assert resumed["losses"] == {k: v for k, v in expected.items() if int(k) >= 5}, \
        f"{family} {precision}: resumed {resumed['losses']} vs uninterrupted {expected}"
