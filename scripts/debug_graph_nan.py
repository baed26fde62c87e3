"""Debug: which part of the graphed step makes a tiny GPU fit turn NaN now and then?

    for v in eager graphs nopin mainwarm evaleager poolper; do python scripts/debug_graph_nan.py 4 $v; done

Variants: eager (control), graphs (as shipped), nopin (DataLoader pin_memory off), mainwarm (eager
warm-up on the current stream), evaleager (eval steps eager), poolper (a memory pool per graph).
Prints one line per trial and a count of NaN trials per variant.
"""
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback

sys.path[:0] = ["src", "."]
from bertaccel.data import TextClassificationDataModule  # noqa: E402
from bertaccel.modules import BertClassifier  # noqa: E402
from bertaccel.modules import graphs as graphs_mod  # noqa: E402
from bertaccel.modules.base import BertModule  # noqa: E402
from tests.conftest import TINY_BERT, sample_rows, write_jsonl  # noqa: E402

d = Path("/tmp/tiny_data")
write_jsonl(d / "train.jsonl", sample_rows("train", 160))
write_jsonl(d / "test.jsonl.gz", sample_rows("test", 48), gz=True)
SMALL = {**TINY_BERT, "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128}


class Watch(Callback):
    def __init__(self):
        self.first_bad = None

    def on_train_batch_end(self, trainer, m, outputs, batch, i):
        if self.first_bad is None:
            bad = [n for n, p in m.named_parameters() if not torch.isfinite(p).all()]
            if bad:
                self.first_bad = (trainer.current_epoch, i, bad[:2], m.graph_stats().get("train", {}).get("captured"))


def run(variant: str, precision: str) -> tuple[bool, str]:
    pl.seed_everything(5)
    graphs = variant != "eager"
    m = BertClassifier(config={**SMALL, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
                       vocab_size=256, num_labels=2, lr=2e-3, cuda_graphs=graphs)
    dm = TextClassificationDataModule(dataset=str(d), tokenizer="sample:sentiment", max_length=48, batch_size=16,
                                      val_size=0.2, static_shapes=True, length_buckets=16,
                                      pin_memory=variant != "nopin")
    w = Watch()
    t = pl.Trainer(accelerator="gpu", devices=1, precision=precision, max_epochs=3, logger=False,
                   enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=4, callbacks=[w],
                   enable_checkpointing=False)
    t.fit(m, datamodule=dm)
    return w.first_bad is not None, f"{w.first_bad} val/loss {float(t.callback_metrics.get('val/loss', float('nan'))):.4f}"


def patch(variant: str):
    if variant == "mainwarm":
        orig = graphs_mod.StepGraphs._eager
        graphs_mod.StepGraphs._eager = lambda self, fn, inputs, side_stream: orig(self, fn, inputs, False)
    if variant == "evaleager":
        BertModule.eval_outputs = lambda self, batch: self.step_outputs(**self.step_inputs(batch))
    if variant == "poolper":
        orig_cap = graphs_mod.StepGraphs._capture

        def cap(self, key, fn, inputs):
            self.pool = None
            return orig_cap(self, key, fn, inputs)

        graphs_mod.StepGraphs._capture = cap


if __name__ == "__main__":
    import logging
    logging.getLogger("lightning").setLevel(logging.ERROR)
    trials, variant = int(sys.argv[1]), sys.argv[2]
    patch(variant)
    for precision in ("32-true", "bf16-mixed"):
        bad_trials = 0
        for trial in range(trials):
            t0 = time.time()
            bad, info = run(variant, precision)
            bad_trials += bad
            print(f"{variant:10s} {precision:10s} trial {trial}: {'NaN' if bad else 'ok '} {info} ({time.time()-t0:.1f}s)", flush=True)
        print(f"SUMMARY {variant:10s} {precision:10s} NaN in {bad_trials}/{trials} trials", flush=True)
