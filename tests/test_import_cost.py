"""`import meshboost` stays light: it imports no transformers model family, no transformers modeling
machinery and no DTensor package (each family's policy table is loaded when a model of that family is
looked up). Measured by the modules a fresh interpreter holds, not by time (a shared machine's clock
proves nothing). The lazy registry still answers every family, each table under its own name."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import json, sys
import meshboost
from meshboost import Booster, launch_from_torch
loaded = sorted(sys.modules)
print(json.dumps(loaded))
"""


def test_import_meshboost_loads_no_model_family():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = set(json.loads(proc.stdout.strip().splitlines()[-1]))
    families = sorted(m for m in loaded if m.startswith("transformers.models."))
    assert families == [], f"import meshboost imported transformers model families: {families[:10]}"
    heavy = sorted(loaded & {"transformers.modeling_utils", "torch.distributed.tensor", "peft", "torchao"})
    assert heavy == [], f"import meshboost imported {heavy}"
    # docs/colossalai.md says so (it once said the opposite, issue 56 item 10): no transformers module at all
    assert sorted(m for m in loaded if m.split(".")[0] == "transformers") == []
    assert "`import meshboost` itself imports no transformers module at all" in \
        " ".join((ROOT / "docs" / "colossalai.md").read_text().split())


def test_family_tables_load_on_lookup():
    from meshboost.shardformer.policies import POLICIES
    assert {"bert", "gpt2", "falcon", "t5", "blip-2"} <= set(POLICIES)
    for model_type in POLICIES:
        assert POLICIES[model_type].name == model_type
    assert POLICIES.get("llama") is None        # no table: transformers' own plan is read instead
