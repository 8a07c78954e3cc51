"""Random generators across pipeline stages: every rank leaves a pipeline step where every other rank does.

Owns: `generators_in_step`, the context a pipeline step runs in. Must not communicate nor know
models or schedules.

Why: a pipeline rank runs only its own stages' modules, so whatever a forward draws at random
advances its generators by its own amount: dropout masks with p > 0, and meshboost's per-tp-rank
dropout streams (shardformer/rng.py), which draw one number from the shared stream at every split
region a stage runs (an encoder stage runs other regions than a decoder stage with cross-attention).
After one step the ranks of different stages then hold different generator states, and anything
the user draws afterwards differs by stage: a second model built without reseeding (ColossalAI's
tests build one per configuration) gets other weights on each stage, is boosted as one model
(boost compares the models' shapes, not their values) and trains to a silently wrong loss (issue
37: T5 at tp=2 x pp=2 x dp=2, loss 11.16 for 10.81).

What: the CPU generator and the device's are saved when the step begins and put back when it
ends (also when it raises), then reseeded with one number drawn from the restored CPU generator.
Every rank that began the step in the same state ends it in the same state, whatever its stages
drew, and the next step starts its dropout masks from a fresh stream, not this step's again. No
collective: the restored state is the agreement.
"""

from __future__ import annotations

import contextlib

import torch

from meshboost.distributed.generators import device_generators

# The reseed is drawn below 2**32: the CPU generator reads only the low 32 bits of a seed, and a
# seed this small carries none of the top-bit tags with which shardformer/rng.py marks its
# per-rank streams, so the rank is on the shared stream again.
_SEED_RANGE = 1 << 32


@contextlib.contextmanager
def generators_in_step(device: torch.device):
    """Run a pipeline step; afterwards this rank's generators (CPU and `device`'s) are in the state
    every rank that began it in the same state ends in (see the module docstring)."""
    generators = device_generators(device)
    saved = [(g, g.get_state()) for g in generators]
    try:
        yield
    finally:
        for generator, state in saved:
            generator.set_state(state)
        seed = int(torch.randint(_SEED_RANGE, (1,), generator=torch.default_generator).item())
        for generator in generators:
            generator.manual_seed(seed)
