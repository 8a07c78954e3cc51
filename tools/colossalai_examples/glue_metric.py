"""An offline stand-in for the `glue` metric of `evaluate` (accuracy and F1, as GLUE's MRPC/QQP
report them): copied to `glue/glue.py` in the run directory so `evaluate.load("glue", task)` loads it
from disk instead of the hub."""

import datasets
import evaluate


class Glue(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(description="accuracy and F1 (offline)", citation="", inputs_description="",
                                   features=datasets.Features({"predictions": datasets.Value("int64"),
                                                               "references": datasets.Value("int64")}))

    def _compute(self, predictions, references):
        pairs = list(zip(predictions, references))
        tp = sum(1 for p, r in pairs if p == 1 and r == 1)
        fp = sum(1 for p, r in pairs if p == 1 and r == 0)
        fn = sum(1 for p, r in pairs if p == 0 and r == 1)
        accuracy = sum(1 for p, r in pairs if p == r) / max(len(pairs), 1)
        f1 = 2 * tp / max(2 * tp + fp + fn, 1)
        return {"accuracy": accuracy, "f1": f1}
