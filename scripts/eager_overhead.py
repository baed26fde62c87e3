"""Host time per eager call of the row ops, next to the PyTorch op each replaces, and of the parts of our
Python wrappers (issue 9's "eager per-call time within 1.3x of the PyTorch op").

    python scripts/eager_overhead.py [--shapes 16x128x768 16x128x384] [--calls 2000] [--rounds 3]

Each callable runs `--calls` times back to back (after a warm-up), then one synchronize: at these shapes the
kernels take a few us and the host a few tens, so wall time / calls is the host's cost per call (the GPU
never holds the loop up: a column `gpu_us` gives each callable's kernels' time from CUDA-graph replays to check
that). Rows: `pytorch` (F.layer_norm / F.rms_norm / bias + F.gelu; for the residual LayerNorm an add, a dropout,
an add and F.layer_norm; `bert_output`: HF's BertSelfOutput module under bf16 autocast against the swapped one), `bertaccel` (the public function the swapped modules call; `fanout`: the residual
LayerNorm's form a training forward runs by default, a Python autograd.Function), `op` (the registered op called through torch.ops on the same tensors, no Python wrapper),
and the wrapper's parts alone (`why_not`, the Python eligibility test the wrappers ran on every call before the
direct entry of csrc/eager.cpp; `direct_entry`, what they run now before that entry's C++ test and call). Inference (no_grad) and training (inputs that
require grad: the forward records the C++ autograd node). Median of `--rounds` rounds, interleaved.
bf16 activations, PyTorch's ops with bf16 weights (F.layer_norm refuses fp32 ones
beside bf16 outside autocast, F.rms_norm computes in fp32 beside them), ours with the fp32 master weights a
swapped model passes under autocast."""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.common import graph_time_ms
from bertaccel.ops.eligibility import why_not

try:
    from bertaccel.ops.eligibility import direct_entry
except ImportError:  # a tree before the direct entry (an A/B run, scripts/ab_runs.sh)
    direct_entry = None
from bertaccel.ops.gelu import bias_gelu
from bertaccel.ops.layer_norm import layer_norm
from bertaccel.ops.residual_layer_norm import bias_dropout_add_layer_norm, bias_dropout_add_layer_norm_fanout
from bertaccel.ops.rms_norm import rms_norm


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_us(fn, calls: int) -> float:
    for _ in range(50):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) / calls * 1e6


def _bert_outputs(H: int, training: bool, device: str):
    """An HF BertSelfOutput of width H (fp32 weights, dropout 0.1, train() when `training`) and the swapped module
    over the same parameters."""
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertSelfOutput

    from bertaccel.ops.residual_layer_norm import FusedBertOutput

    hf = BertSelfOutput(BertConfig(hidden_size=H, num_attention_heads=max(1, H // 64))).to(device).train(training)
    return hf, FusedBertOutput(hf)


def _autocast(device: str, module, x, r):
    with torch.autocast(device, dtype=torch.bfloat16):
        return module(x, r)


def cases(shape: tuple[int, ...], grad: bool, device: str) -> dict:
    H = shape[-1]
    x = torch.randn(*shape, device=device, dtype=torch.bfloat16, requires_grad=grad)
    w, b = (torch.randn(H, device=device, requires_grad=grad) for _ in range(2))
    # PyTorch's norms take the activation dtype's weights (F.layer_norm refuses fp32 beside bf16 outside autocast,
    # F.rms_norm computes in fp32); ours take the fp32 master weights, as a swapped model under autocast passes them
    wb, bb = (torch.randn(H, device=device, dtype=torch.bfloat16, requires_grad=grad) for _ in range(2))
    hb = torch.randn(H, device=device, dtype=torch.bfloat16, requires_grad=grad)
    hb32 = torch.randn(H, device=device, requires_grad=grad)  # ours: the fp32 master linear bias, as the swap passes it
    r = torch.randn(*shape, device=device, dtype=torch.bfloat16, requires_grad=grad)
    gb = torch.randn(4 * H, device=device, dtype=torch.bfloat16, requires_grad=grad)
    g = torch.randn(*shape[:-1], 4 * H, device=device, dtype=torch.bfloat16, requires_grad=grad)
    x2 = x.view(-1, H)
    ops = torch.ops.bertaccel
    hf_output, fused_output = _bert_outputs(H, grad, device)
    return {
        "layer_norm": {
            "pytorch": lambda: F.layer_norm(x, (H,), wb, bb, 1e-12),
            "bertaccel": lambda: layer_norm(x, w, b, 1e-12),
            "op": lambda: ops.layer_norm.default(x2, None, None, w, b, 0.0, 1e-12),
        },
        "rms_norm": {
            "pytorch": lambda: F.rms_norm(x, (H,), wb, 1e-6),
            "bertaccel": lambda: rms_norm(x, w, 1e-6),
            "op": lambda: ops.rms_norm.default(x2, w, 1e-6),
        },
        "residual_ln": {  # BertSelfOutput / BertOutput's tail: LayerNorm(dropout(h + bias) + residual), p = 0.1
            "pytorch": lambda: F.layer_norm(F.dropout(x + hb, 0.1) + r, (H,), wb, bb, 1e-12),
            "bertaccel": lambda: bias_dropout_add_layer_norm(x, hb32, r, w, b, 0.1, 1e-12),
            # what a training forward runs by default (the fan-out: a Python autograd.Function, y and its alias)
            "fanout": lambda: bias_dropout_add_layer_norm_fanout(x, hb32, r, w, b, 0.1, 1e-12),
        },
        "bias_gelu": {
            "pytorch": lambda: F.gelu(g + gb),
            "bertaccel": lambda: bias_gelu(g, gb),
        },
        # a BERT sub-layer's tail as the model calls it: HF's BertSelfOutput (dense, dropout, add, LayerNorm; fp32
        # weights under bf16 autocast, as bf16-mixed training runs it) against the swapped FusedBertOutput (the matmul
        # without its bias, then the fused kernel; in training the fan-out form) - the matmul's host time included
        "bert_output": {
            "pytorch": lambda: _autocast(device, hf_output, x, r),
            "bertaccel": lambda: _autocast(device, fused_output, x, r),
        },
        "wrapper parts": {
            "why_not": lambda: why_not(x, params=(w, b)),  # (the Python check, now only where the entry is None)
            **({"direct_entry": lambda: direct_entry(x, w, b)} if direct_entry else {}),
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["16x128x768", "16x128x384", "32x512x768"])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a check of the harness only")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    assert not cuda or torch.cuda.is_available(), "needs a CUDA GPU (it times kernel launches); --device cpu checks the harness"
    print(f"{torch.cuda.get_device_name() if cuda else 'CPU'}, torch {torch.__version__}")
    print(f"{'shape':<12} {'mode':<6} {'op':<14} {'impl':<16} {'host_us':>8} {'gpu_us':>7} {'x_pytorch':>9}")
    for s in args.shapes:
        shape = tuple(int(v) for v in s.split("x"))
        for grad in (False, True):
            table = cases(shape, grad, args.device)
            times: dict[tuple[str, str], list[float]] = {}
            with torch.set_grad_enabled(grad):
                for _ in range(args.rounds):
                    for op, impls in table.items():
                        for name, fn in impls.items():
                            times.setdefault((op, name), []).append(host_us(fn, args.calls))
                gpu = {}
                with torch.no_grad():
                    if not cuda:
                        table = {}
                    for op, impls in table.items():
                        for name, fn in impls.items():
                            if op != "wrapper parts":
                                try:  # (a failed capture leaves the column empty; the host time stands)
                                    gpu[(op, name)] = graph_time_ms(lambda *_a, fn=fn: fn(), [()]) * 1e3
                                except Exception as e:  # noqa: BLE001
                                    print(f"{s} {op} {name}: not captured ({type(e).__name__})")
            for (op, name), ts in times.items():
                t = statistics.median(ts)
                base = statistics.median(times[(op, "pytorch")]) if (op, "pytorch") in times else None
                g = f"{gpu[(op, name)]:7.1f}" if (op, name) in gpu else " " * 7
                ratio = f"{t / base:9.2f}" if base and name != "pytorch" else " " * 9
                print(f"{s:<12} {'train' if grad else 'infer':<6} {op:<14} {name:<16} {t:8.1f} {g} {ratio}")


if __name__ == "__main__":
    main()
