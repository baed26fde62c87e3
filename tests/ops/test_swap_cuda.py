"""The kernel swap in real models on the GPU (marked `cuda`).

Accuracy: a swapped model in bf16 autocast is compared with HF in fp32; its error must be at most
3x the error of HF's own bf16 autocast run. Training: 300 steps of an IMDB fine-tune with and
without the swap reach the same loss curve (windowed means) within a tolerance. The MiniLM and IMDB
checks need the staged model and data (`.carry/minilm`, `.carry/imdb`, see ../shared/gpu).
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification

from bertaccel.ops import build
from bertaccel.ops.swap import ORDER, swap

pytestmark = pytest.mark.cuda
ROOT = Path(__file__).resolve().parents[2]
MINILM = Path(os.environ.get("BERTACCEL_MINILM", ROOT / ".carry" / "minilm"))
IMDB = Path(os.environ.get("BERTACCEL_IMDB", ROOT / ".carry" / "imdb"))


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    assert build.load(), build.unavailable_reason()


def models():
    yield "bert-base", lambda: BertForSequenceClassification(BertConfig(num_labels=2))
    if MINILM.is_dir():
        yield "minilm", lambda: BertForSequenceClassification.from_pretrained(MINILM, num_labels=2, dtype=torch.float32)


@pytest.mark.parametrize("name,make", list(models()), ids=lambda v: v if isinstance(v, str) else "")
def test_swapped_model_matches_hf_fp32(name, make):
    torch.manual_seed(0)
    model = make().cuda().eval()
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(1000, 30000, (8, 128), device="cuda", generator=g)
    mask = torch.ones_like(ids)
    mask[3, 70:] = 0

    def hidden():
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        return out.hidden_states[-1].float()

    with torch.no_grad():
        ref = hidden()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            hf_bf16 = hidden()
            report = swap(model, ORDER)
            ours = hidden()
        report.revert()
    err = lambda a: ((a - ref).norm() / ref.norm()).item()  # noqa: E731
    assert err(ours) <= 3 * err(hf_bf16), f"{name}: swapped {err(ours):.2e} vs HF bf16 {err(hf_bf16):.2e}"


def imdb_batches(tokenizer, n_steps, batch, max_length):
    rows = [json.loads(l) for l in gzip.open(IMDB / "train.jsonl.gz", "rt", encoding="utf-8")]
    assert len(rows) >= batch, f"{IMDB} has {len(rows)} training rows, fewer than one batch of {batch}"
    for i in range(n_steps):  # (past the staged subset's end it starts over: a second epoch)
        chunk = [rows[j % len(rows)] for j in range(i * batch, (i + 1) * batch)]
        enc = tokenizer([r["text"] for r in chunk], truncation=True, max_length=max_length, padding=True, return_tensors="pt")
        yield {k: v.cuda() for k, v in enc.items()}, torch.tensor([r["label"] for r in chunk], device="cuda")


@pytest.mark.skipif(not (MINILM.is_dir() and IMDB.is_dir()), reason="needs the staged MiniLM and IMDB subset")
def test_training_with_and_without_the_swap_follows_the_same_loss_curve():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MINILM)
    steps, batch = 300, 32

    def train(with_swap: bool) -> list[float]:
        torch.manual_seed(0)
        model = BertForSequenceClassification.from_pretrained(MINILM, num_labels=2, dtype=torch.float32).cuda().train()
        if with_swap:
            swap(model, ORDER)
        opt = torch.optim.AdamW(model.parameters(), lr=5e-5, fused=True)
        losses = []
        for inputs, labels in imdb_batches(tok, steps, batch, 128):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**inputs, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses

    plain, fused = train(False), train(True)
    window = 50
    for start in range(0, steps, window):
        a = sum(plain[start : start + window]) / window
        b = sum(fused[start : start + window]) / window
        assert abs(a - b) < 0.08, f"steps {start}-{start + window}: plain {a:.3f} vs swapped {b:.3f}"
    assert sum(fused[-window:]) / window < sum(fused[:window]) / window - 0.1, "the swapped model did not learn"
