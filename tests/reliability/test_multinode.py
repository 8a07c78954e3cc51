"""Multi-node launches, emulated with two torchrun "nodes" of 2 processes on loopback: static
(--node_rank, --master_addr/--master_port) and c10d rendezvous (--rdzv-backend c10d). Each trains
like one node of 4 processes (GPT-2 fp32, tp=2 x dp=2, ZeRO-1), bitwise, with every tensor-parallel
group inside one node (tp is the innermost mesh axis). The commands are the ones docs/reliability.md
shows."""

from __future__ import annotations

from torchrun_launch import launch

from meshboost.testing import free_port


def test_two_nodes_train_like_one(tmp_path, one_node_run):
    one = one_node_run("gpt2", "fp32")
    port = free_port()
    static = launch(tmp_path, "static", [["--nnodes", "2", "--nproc_per_node", "2", "--node_rank", str(n),
                                          "--master_addr", "127.0.0.1", "--master_port", str(port)]
                                         for n in (0, 1)], ["--family", "gpt2", "--precision", "fp32"])
    port = free_port()
    c10d = launch(tmp_path, "c10d", [["--nnodes", "2", "--nproc_per_node", "2", "--rdzv-backend", "c10d",
                                      "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "meshboost-test"]
                                     for _ in (0, 1)], ["--family", "gpt2", "--precision", "fp32"])
    assert one["nodes"] == ["0"]
    for name, attempts in (("static", static), ("c10d", c10d)):
        assert list(attempts) == [".attempt0"], f"{name}: {list(attempts)}"
        run = attempts[".attempt0"]
        assert run["nodes"] == ["0", "1"], f"{name}: {run['nodes']}"
        assert run["tp_within_node"], f"{name}: a tensor-parallel group spans two nodes"
        assert run["losses"] == one["losses"], f"{name}: {run['losses']} vs one node {one['losses']}"
