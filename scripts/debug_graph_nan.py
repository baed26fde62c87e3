"""Debug: where does a bf16 graphed tiny fit turn NaN? Variants: shared pool, separate pools, eval eager."""
import sys, torch, lightning.pytorch as pl
from lightning.pytorch import Callback
sys.path.insert(0, ".")
from tests.conftest import TINY_BERT, sample_rows, write_jsonl
from src.data import TextClassificationDataModule
from src.modules import BertClassifier
from src.modules import base as basemod
from pathlib import Path
d = Path("/tmp/tiny_data"); write_jsonl(d / "train.jsonl", sample_rows("train", 160)); write_jsonl(d / "test.jsonl.gz", sample_rows("test", 48), gz=True)
SMALL = {**TINY_BERT, "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128}

class Watch(Callback):
    def on_train_batch_end(self, trainer, m, outputs, batch, i):
        bad = [n for n, p in m.named_parameters() if not torch.isfinite(p).all()]
        if bad and not getattr(self, "told", False):
            self.told = True
            print(f"  NaN params at epoch {trainer.current_epoch} batch {i}: {bad[:3]} ; stats {m.graph_stats()}", flush=True)
    def on_validation_epoch_end(self, trainer, m):
        s = m.metrics["val_metrics"]
        print(f"  epoch {trainer.current_epoch} val loss_sum {s.loss_sum.item():.4f} n {s.confmat.sum().item()}", flush=True)

def run(name, patch=None, precision="bf16-mixed"):
    print(name, flush=True)
    pl.seed_everything(5)
    m = BertClassifier(config={**SMALL, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}, vocab_size=256, num_labels=2, lr=2e-3, cuda_graphs=True)
    if patch: patch(m)
    dm = TextClassificationDataModule(dataset=str(d), tokenizer="sample:sentiment", max_length=48, batch_size=16, val_size=0.2, static_shapes=True, length_buckets=16)
    t = pl.Trainer(accelerator="gpu", devices=1, precision=precision, max_epochs=3, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, log_every_n_steps=4, callbacks=[Watch()], enable_checkpointing=False)
    t.fit(m, datamodule=dm)
    print("  final val/loss", t.callback_metrics.get("val/loss"), flush=True)

for trial in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    run(f"trial {trial} fp32", precision="32-true")
    run(f"trial {trial} bf16")
