"""The uninterrupted one-node run of a configuration is the reference of both the restart and the
multi-node tests: launched once per session (each 4-process launch costs ~15 s of the suite)."""

from __future__ import annotations

import pytest
from torchrun_launch import ONE_NODE, launch


@pytest.fixture(scope="session")
def one_node_run(tmp_path_factory):
    """family, precision -> the record of an uninterrupted 4-process run on one node (launched once)."""
    runs: dict[tuple[str, str], dict] = {}

    def get(family: str, precision: str) -> dict:
        if (family, precision) not in runs:
            tmp = tmp_path_factory.mktemp(f"clean-{family}-{precision}")
            attempts = launch(tmp, "clean", [ONE_NODE], ["--family", family, "--precision", precision])
            assert list(attempts) == [".attempt0"], attempts
            runs[family, precision] = attempts[".attempt0"]
        return runs[family, precision]

    return get
