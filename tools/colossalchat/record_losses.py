"""Put on PYTHONPATH as `sitecustomize` by run.sh: records, at full precision, the values ColossalChat's
trainers report each step, one JSON line per call in $COLOSSALCHAT_LOSSES.<rank>: their TensorBoard scalars
(`SummaryWriter.add_scalar`, written on rank 0 when the script gets --log_dir) and their progress-bar
postfixes (`tqdm.set_postfix`: the pipeline paths report there only, on the last rank). It observes only:
nothing of the scripts, coati or meshboost is changed. Also appends $COLOSSALCHAT_PYDEPS (what ColossalChat
imports that the environment lacks: jsonlines, loralib, wandb, installed there by run.sh) to the END of sys.path,
so the environment's own packages always win."""

import json
import os
import sys

if os.environ.get("COLOSSALCHAT_PYDEPS"):
    sys.path.append(os.environ["COLOSSALCHAT_PYDEPS"])

path = os.environ.get("COLOSSALCHAT_LOSSES")


def _write(source: str, row: dict) -> None:
    with open(f"{path}.{os.environ.get('RANK', '0')}", "a") as f:
        f.write(json.dumps({"source": source, **row}) + "\n")


if path:
    import tqdm

    set_postfix = tqdm.tqdm.set_postfix

    def recording_set_postfix(self, ordered_dict=None, refresh=True, **kwargs):
        values = dict(ordered_dict or {}, **kwargs)
        row = {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) or hasattr(v, "item")}
        if row:
            _write("postfix", row)
        return set_postfix(self, ordered_dict, refresh, **kwargs)

    tqdm.tqdm.set_postfix = recording_set_postfix

    from torch.utils.tensorboard import SummaryWriter

    add_scalar = SummaryWriter.add_scalar

    def recording_add_scalar(self, tag, scalar_value, global_step=None, *args, **kwargs):
        _write("scalar", {"tag": tag, "value": float(scalar_value), "step": global_step})
        return add_scalar(self, tag, scalar_value, global_step, *args, **kwargs)

    SummaryWriter.add_scalar = recording_add_scalar
