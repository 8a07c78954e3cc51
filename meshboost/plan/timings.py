"""The calibration's measurements on this machine (calibrate.py's `measure` calls them; each returns
seconds, a rate or a fitted line, on every rank at once where a process group is up).

Owns: timing a callable (`timed`: a median after a warm-up), the square matmul's and a Llama decoder
layer's achieved flop/s with the layer's fixed cost (`layer_timings`: a line through two token counts),
the ends' fixed cost, meshboost's own 1F1B schedule's cost per micro-batch slot (`pipeline_overhead`),
AdamW's elements per second, the rate of writing into newly allocated memory (`fresh_rate`), and every
measured collective's latency and bus bandwidth (`collectives`, least squares `fit` over SIZES). Must
not build CostConstants (calibrate.py does) nor model time (cost.py does).
"""

from __future__ import annotations

import time

def llama_config(hidden: int, layers: int = 1, positions: int = 64):
    """The calibration's Llama shape: `hidden` wide (heads of 64), a 4 x hidden MLP, a 64-token vocabulary,
    sdpa attention."""
    import transformers as tfm

    heads = max(1, hidden // 64)
    cfg = tfm.LlamaConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_attention_heads=heads,
                          num_key_value_heads=heads, num_hidden_layers=layers, vocab_size=64,
                          max_position_embeddings=positions)
    cfg._attn_implementation = "sdpa"
    return cfg


def timed(fn, repeats: int, sync, warm_up: bool = True) -> float:
    """Median seconds of `fn()` over `repeats` runs (after one warm-up unless `warm_up=False`)."""
    if warm_up:
        fn(), sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(), sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def matmul_flops(dtype, device, n: int, repeats: int, sync) -> float:
    import torch
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n ** 3 / timed(lambda: a @ b, repeats, sync)


def layer_timings(device, sync, dtype, hidden: int, tokens: tuple[int, int], ceiling: float) -> tuple[float, float]:
    """(fixed seconds, flop/s) of a Llama decoder layer's forward+backward in `dtype`: a line through two
    token counts (each the median of 15 rounds that time both), flops as cost.py counts them; held to
    the square matmul's `ceiling` flop/s, twice it on a CPU (on a loaded machine the larger run can time
    no slower than the smaller, a flat line; the matmul's own figure is noisy on shared cores: a bound
    at 1x clamped the fixed cost to 0 in 2 of 8 CPU calibrations on 2026-12-06)."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = llama_config(hidden, positions=max(tokens))
    layer = LlamaDecoderLayer(cfg, 0).to(device=device, dtype=dtype)
    rotary = LlamaRotaryEmbedding(cfg).to(device)
    numel = sum(p.numel() for p in layer.parameters())
    runs = []
    for n in tokens:
        x = torch.randn(1, n, hidden, device=device, dtype=dtype, requires_grad=True)
        positions = torch.arange(n, device=device)[None]
        embeddings = tuple(e.to(dtype) for e in rotary(x, positions))

        def one_layer(x=x, positions=positions, embeddings=embeddings):
            out = layer(x, position_embeddings=embeddings, position_ids=positions)
            out = out[0] if isinstance(out, tuple) else out
            out.float().sum().backward()
        one_layer(), sync()
        runs.append(one_layer)
    # rounds of one run of each token count (a change in load falls on both), the median of 15 each
    rounds = [[timed(run, 1, sync, warm_up=False) for run in runs] for _ in range(15)]
    points = [(6 * numel * n + 12 * n * n * hidden, sorted(r[i] for r in rounds)[7]) for i, n in enumerate(tokens)]
    overhead, rate = fit(points)
    # a flat line (the larger run slowed by load) is held to the square matmuls' rate: on a GPU that figure
    # is steady and a layer cannot beat it (at 2x, an H100 gave 1e15 flop/s, above its datasheet peak);
    # on a CPU's shared cores the matmuls' own figure is noisy, so there the bound is twice it
    bound = ceiling * (1 if device.type == "cuda" else 2)
    if rate > bound:
        rate, overhead = bound, max(0.0, min(t - x / bound for x, t in points))
    return overhead, rate


def ends_overhead(device, sync) -> float:
    """Seconds of a tiny embedding + norm + head + loss forward+backward (the per-micro-batch fixed cost)."""
    import torch
    import transformers as tfm

    embed, norm, head = (torch.nn.Embedding(64, 64).to(device), tfm.models.llama.modeling_llama.LlamaRMSNorm(64).to(device),
                         torch.nn.Linear(64, 64, bias=False).to(device))
    ids = torch.randint(0, 64, (1, 8), device=device)

    def ends():
        logits = head(norm(embed(ids)))
        torch.nn.functional.cross_entropy(logits.view(-1, 64), ids.view(-1)).backward()
    return timed(ends, 15, sync)


def pipeline_overhead(world: int, sync, hidden: int = 64, tokens: int = 8, precision: str = "fp32") -> float:
    """Seconds per micro-batch slot of meshboost's 1F1B schedule (its layers' own cost included): a
    Llama of one `hidden` layer per stage over pp=world stages, micro-batches of one `tokens`-token
    sequence, at 2 and 16 micro-batches, 21 steps of each alternated (a change in load falls on both);
    (t16 - t2) / 14 of their medians (at 2 and 8, until 2026-12-06, the figure spread 1.8-10.3 ms)."""
    import torch
    import torch.distributed as dist
    import transformers as tfm

    from meshboost.booster import Booster
    from meshboost.plan.layout import Layout, plugin_config
    from meshboost.plugins import HybridParallelPlugin

    cfg = llama_config(hidden, layers=world, positions=max(64, tokens))
    steps = {}
    for m in (2, 16):
        plugin = HybridParallelPlugin(plugin_config(Layout.of(pp=world, microbatches=m, precision=precision)))
        torch.manual_seed(0)
        model = tfm.LlamaForCausalLM(cfg)
        booster = Booster(plugin=plugin)
        model, optimizer, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.0))
        ids = torch.randint(1, 64, (m, tokens))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

        def step(booster=booster, model=model, optimizer=optimizer, batch=batch):
            dist.barrier()
            booster.execute_pipeline(iter([batch]), model, lambda out, _: out.loss, optimizer)
        steps[m] = step
    for step in steps.values():    # a warm-up each, then their steps alternated: a load change falls on both
        step(), sync()
    samples = [(m, timed(steps[m], 1, sync, warm_up=False)) for _ in range(21) for m in (2, 16)]
    t2, t16 = (sorted(t for k, t in samples if k == m)[10] for m in (2, 16))
    return max(0.0, (t16 - t2) / 14)


def optimizer_rate(device, sync, hidden: int) -> float:
    """AdamW's elements per second over a Llama decoder layer's parameters (`hidden`; the shapes a model
    steps: one 1 M-element tensor, as until 2026-12-06, stepped 3x slower per element on a CPU, its
    temporaries new pages each time, and over-predicted the ranking's full-model steps 2x)."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    params = list(LlamaDecoderLayer(llama_config(hidden), 0).to(device).parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4)
    return sum(p.numel() for p in params) / timed(opt.step, 21, sync)


def fresh_rate(device, sync) -> float:
    """Bytes/s of a clone of a 64 MiB fp32 tensor, the copy freed each time: new pages every time on a
    CPU (glibc maps blocks above its 32 MiB threshold afresh and unmaps them when freed, as it often
    does ZeRO's smaller flat buffers), a reused block on a GPU (the caching allocator)."""
    import torch
    x = torch.randn(1 << 24, device=device)
    return x.numel() * x.element_size() / timed(lambda: x.clone(), 9, sync)


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(latency s, bytes/s) of t = latency + x / rate, least squares over (x, t), both kept positive."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    mt = sum(t for _, t in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (t - mt) for x, t in points) / sxx if sxx else 0.0
    slope = max(slope, 1e-15)
    latency = max(mt - slope * mx, min(t for _, t in points) * 0.05)
    return latency, 1.0 / slope


SIZES = (1 << 10, 1 << 15, 1 << 19, 1 << 21, 1 << 23)       # message bytes


def layer_forward(device, hidden: int, tokens: int):
    """A no-grad forward of transformers' Llama decoder layer (`hidden`, `tokens` tokens), as a callable."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = llama_config(hidden, positions=max(64, tokens))
    layer = LlamaDecoderLayer(cfg, 0).to(device)
    x = torch.randn(1, tokens, hidden, device=device)
    positions = torch.arange(tokens, device=device)[None]
    embeddings = LlamaRotaryEmbedding(cfg).to(device)(x, positions)

    def forward():
        with torch.no_grad():
            layer(x, position_embeddings=embeddings, position_ids=positions)
    return forward


MEASURED_OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send")
PASSES = 3          # of every collective's measurement; each point is the median of its passes


def collectives(device, sync, world: int, hidden: int, tokens: int) -> dict:
    """{op: (latency s, bus bytes/s)} for MEASURED_OPS (ring factors
    applied). Each call follows a decoder layer's forward (`hidden`, `tokens`) on every rank, as in
    training, and that forward's own time is taken off: the figure includes the ranks' arrival skew
    after real work, which back-to-back calls would hide. Each point is the median of PASSES passes."""
    import torch
    import torch.distributed as dist

    from meshboost.plan.cost import ring_factor
    rank = dist.get_rank()
    work = layer_forward(device, hidden, tokens)
    _reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    calls = {}
    for op in MEASURED_OPS:
        for size in SIZES:
            t = torch.ones(size // 4, device=device)
            if op == "all_reduce":
                def fn(t=t):
                    work()
                    dist.all_reduce(t)
            elif op == "reduce_scatter":
                shard = torch.empty(t.numel() // world, device=device)

                def fn(t=t, shard=shard):
                    work()
                    _reduce_scatter(shard, t)
            elif op == "all_gather":
                parts = [torch.empty_like(t) for _ in range(world)]

                def fn(t=t, parts=parts):
                    work()
                    dist.all_gather(parts, t)
            elif op == "all_to_all":          # context parallelism's and expert parallelism's exchange
                received = torch.empty_like(t)

                def fn(t=t, received=received):
                    work()
                    dist.all_to_all_single(received, t)
            else:             # ping-pong between ranks 0 and 1 after rank 0's matmul: two one-way trips
                def fn(t=t):
                    if rank == 0:
                        work()
                        dist.send(t, 1)
                        dist.recv(t, 1)
                    elif rank == 1:
                        dist.recv(t, 0)
                        dist.send(t, 0)
            calls[op, size] = fn
    # PASSES passes over every op and size, the forward alone timed again before each op's sizes (a
    # change in load falls on both); each point the median of its passes, then one line per op
    seconds: dict = {}
    for _ in range(PASSES):
        for op in MEASURED_OPS:
            dist.barrier()
            work_s = timed(work, 15, sync)
            for size in SIZES:
                dist.barrier()
                seconds.setdefault((op, size), []).append(max(timed(calls[op, size], 15, sync) - work_s, 1e-7))
    out = {}
    for op in MEASURED_OPS:
        points = []
        for size in SIZES:
            t = sorted(seconds[op, size])[PASSES // 2] / (2 if op == "send" else 1)
            # all_gather's payload is the gathered tensor (comm_counter's units): world x the input
            points.append((size * (world if op == "all_gather" else 1) * ring_factor(op, world), t))
        # every rank takes rank 0's figures (one answer, one file)
        line = torch.tensor(fit(points), dtype=torch.float64, device=device)
        dist.broadcast(line, 0)
        out[op] = (float(line[0]), float(line[1]))
    return out
