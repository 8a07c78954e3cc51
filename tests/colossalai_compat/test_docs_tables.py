"""docs/colossalai.md's keyword tables read against the plugins, so the docs cannot drift from the code
(issue 43): every row of "HybridParallelPlugin keywords" and "MoeHybridParallelPlugin keywords" is a call,
and its status must be what the plugin's config mapping does with it (pure, no process group): **runs**
builds the config, **refused** raises (NotImplementedError, ValueError or TypeError), **CUDA only**
builds the config (the plugin then refuses it on a CPU process, when it learns its device:
test_plugin_attributes). Every keyword of HybridParallelPlugin's ColossalAI signature appears in some
row, and every MoE-only keyword of MoeHybridParallelPlugin's.
configs.md's shortcut count is read against the core plugin's shortcuts."""

import inspect
import re
from pathlib import Path

import pytest
import torch

from meshboost.booster.plugin.hybrid_parallel_plugin import HybridParallelPlugin, colossalai_config
from meshboost.booster.plugin.moe_hybrid_parallel_plugin import MoeHybridParallelPlugin, moe_colossalai_config
from meshboost.plugins.hybrid_parallel import SHORTCUTS
from meshboost.shardformer import PipelineGradientCheckpointConfig, Policy

DOCS = Path(__file__).resolve().parents[2] / "docs"
ROW = re.compile(r"^\| `([^`]*)` \| (runs|refused|CUDA only) \|")
NAMES = {"torch": torch, "Policy": Policy, "PipelineGradientCheckpointConfig": PipelineGradientCheckpointConfig}
REFUSALS = (NotImplementedError, ValueError, TypeError)

TABLES = {   # heading -> (plugin class, the mapping under test, keywords every row starts from)
    "## HybridParallelPlugin keywords": (HybridParallelPlugin, colossalai_config, {"tp_size": 1}),
    "## MoeHybridParallelPlugin keywords": (MoeHybridParallelPlugin, moe_colossalai_config,
                                            {"tp_size": 1, "pp_size": 1, "ep_size": 1}),
}


def _rows(heading: str) -> list[tuple[dict, str, str]]:
    """(keywords, status, the row's text) of every row of the table under `heading`."""
    text = (DOCS / "colossalai.md").read_text()
    assert heading in text, f"docs/colossalai.md lost its section {heading!r}"
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        m = ROW.match(line)
        if m:
            rows.append((eval(f"dict({m.group(1)})", {"__builtins__": {"dict": dict}}, NAMES), m.group(2), line))
    assert rows, f"no call rows under {heading!r}"
    return rows


def _defaults(cls) -> dict:
    return {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
            if k not in ("self",) and p.default is not inspect.Parameter.empty}


@pytest.mark.parametrize("heading", list(TABLES))
def test_docs_keyword_tables_match_the_plugins(heading):
    cls, mapping, base = TABLES[heading]
    rows = _rows(heading)
    for keywords, status, line in rows:
        unknown = set(keywords) - set(inspect.signature(cls.__init__).parameters)
        assert not unknown, f"{heading}: {sorted(unknown)} is not a keyword of {cls.__name__}: {line}"
        call = {**_defaults(cls), **base, **keywords}
        if status == "refused":
            with pytest.raises(REFUSALS):
                mapping(call)
                pytest.fail(f"{heading}: the docs say refused, the plugin builds it: {line}")
        else:
            mapping(call)           # builds: raises here if the docs call it running and the code refuses it
    listed = {k for keywords, _, _ in rows for k in keywords} | set(base)
    colossalai_keywords = set(inspect.signature(cls.__init__).parameters) - {"self"}
    if cls is MoeHybridParallelPlugin:       # the keywords it shares mean what they mean in the other table
        colossalai_keywords -= set(inspect.signature(HybridParallelPlugin.__init__).parameters)
    assert colossalai_keywords <= listed, f"{heading}: no row shows {sorted(colossalai_keywords - listed)}"


def test_configs_md_counts_the_shortcuts():
    text = (DOCS / "configs.md").read_text()
    words = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}
    assert f"The {words[len(SHORTCUTS)]} shortcuts" in text
    for name in SHORTCUTS:
        assert f"`{name}`" in text.split(f"The {words[len(SHORTCUTS)]} shortcuts", 1)[1].split("\n\n", 1)[0]
