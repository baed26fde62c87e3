"""Every call of our GEMM in one BERT training step, recorded and timed alone - warm (operands left in L2 by the
previous call, as bench_gemm times) and cold (L2 flushed before each call) - and summed per step, beside cuBLAS
on the same products: to compare with the step's own GEMM time (`python -m benchmarks.e2e --profile`, category
gemm). Session 30 found our kernels 29% slower inside the graphed step than the bench predicts (cuBLAS's: 1%).

    python scripts/step_gemms.py --model bert-base --shape 16x128 [--ffn] --out bench_results/step_gemms.json
    python scripts/step_gemms.py --device cpu --model tiny --shape 2x16   # the recording only (reference GEMM)

The step is the graphed one's body run eagerly: bf16 weight copies swapped in for the forward (so weight
gradients come out bf16), bf16 autocast, backward. Calls with the same arguments (shapes, strides, dtypes,
epilogue, layout, options) are timed once and counted. Then the whole sequence, in the step's order with
every call on its own operands, replayed as one graph (time_sequence): the step's GEMMs without the kernels
between them. Session 31 (H100, BERT-base 16x128), ours / cuBLAS ms per step: alone warm 2.19 / 1.95, cold
2.94 / 2.37, rewarmed 3.11 / 2.37, sequence 2.76 / 2.03 (in the step, profiler: 2.84 / 1.96) - the cost was the
general kernels' code (instruction fetch), not the data; with the PLAIN kernels: 1.98 warm, 2.09 in sequence.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from transformers import BertConfig, BertForSequenceClassification

from benchmarks.common import environment, write_json
from benchmarks.e2e import MODELS

EPILOGUE_NAMES = {0: "none", 1: "bias", 2: "gelu", 3: "gelu-tanh", 4: "bias+residual", 5: "dgelu", 6: "dgelu-tanh"}


def _spec(t):
    return None if t is None else (tuple(t.shape), tuple(t.stride()), str(t.dtype).replace("torch.", ""))


def record_step(model_name: str, batch: int, seq: int, ffn: bool, device: str) -> list[tuple]:
    """One step's calls in the order the step makes them, each as its key: (a, b, bias, aux specs, epilogue,
    trans_a, trans_b, out_fp32, save_pre, rest). `Counter(...)` of it: the distinct calls and their counts."""
    from bertaccel.modules.weight_copies import Bf16WeightCopies
    from bertaccel.ops import ffn as ffn_ops
    from bertaccel.ops import gemm as gemm_ops
    from bertaccel.ops.swap import DEFAULT, swap

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(num_labels=2, **MODELS[model_name])).to(device)
    model.set_attn_implementation("sdpa")
    report = swap(model, DEFAULT + ["linear"] + (["ffn"] if ffn else []))
    assert report.replaced, "the swap replaced nothing"
    model.train()
    copies = Bf16WeightCopies(model)
    ids = torch.randint(model.config.vocab_size // 2, model.config.vocab_size, (batch, seq), device=device)
    labels = torch.randint(0, 2, (batch,), device=device)
    calls: list[tuple] = []
    originals = (gemm_ops._GEMM, ffn_ops._GEMM)

    def recording(*args):
        a, b, bias, aux, epilogue, ta, tb, out_fp32, save_pre, *rest = args
        calls.append((_spec(a), _spec(b), _spec(bias), _spec(aux), int(epilogue), bool(ta), bool(tb), bool(out_fp32),
                      bool(save_pre), tuple(int(r) for r in rest)))
        return originals[0](*args)

    gemm_ops._GEMM = ffn_ops._GEMM = recording
    eligible = gemm_ops.why_not
    if device == "cpu":  # the op path on CPU (the reference GEMM), so the recording itself can be tested without a GPU
        gemm_ops.why_not = lambda *args, **kwargs: None
    try:
        with copies.swapped_in(), torch.autocast(device, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(input_ids=ids).logits, labels)
        loss.backward()
    finally:
        gemm_ops._GEMM, ffn_ops._GEMM = originals
        gemm_ops.why_not = eligible
    return calls


def _tensor(spec, device):
    if spec is None:
        return None
    shape, stride, dtype = spec
    t = torch.empty_strided(shape, stride, dtype=getattr(torch, dtype), device=device)
    return t.normal_() if t.is_floating_point() else t.zero_()


def time_calls(calls: Counter, rounds: int) -> list[dict]:
    """Each distinct call alone: warm (the same call repeated), cold (after an L2 flush), rewarmed (after the flush
    and a read of its operands: the data back in L2, the kernel's code and the TLB as cold as after the flush),
    and alternating with the next distinct call of the step (both warm in L2: what a switch of kernels costs)."""
    from benchmarks.bench_gemm import ColdL2, config_label, interleaved_ms

    cold = ColdL2("cuda", rounds)
    prepared = {key: _call_fns(key, "cuda") for key in calls}
    keys = list(calls)
    rows = []
    for i, key in enumerate(keys):
        epilogue, ta, tb, out_fp32, save_pre = key[4:9]
        a, b, ours, cublas = prepared[key]
        nxt = prepared[keys[(i + 1) % len(keys)]]

        def rewarm(fn):
            return lambda: (cold.buf.sum(), a.sum(), b.sum(), fn())[-1]

        def flush_and_reads():
            return cold.buf.sum(), a.sum(), b.sum()

        warm_ours, warm_cublas, cold_ours, cold_cublas, re_ours, re_cublas, re_alone, nxt_ours, alt_ours, nxt_cublas, \
            alt_cublas = interleaved_ms(
                [ours, cublas, cold(ours), cold(cublas), rewarm(ours), rewarm(cublas), flush_and_reads, nxt.ours,
                 lambda: (ours(), nxt.ours()), nxt.cublas, lambda: (cublas(), nxt.cublas())], (), "cuda", rounds)
        M, K = (a.shape[1], a.shape[0]) if ta else a.shape
        N = b.shape[1] if tb else b.shape[0]
        cfg = torch.ops.bertaccel.gemm_config(a, b, epilogue, ta, tb, out_fp32, save_pre)
        layout = {(False, False): "fwd", (False, True): "dgrad", (True, True): "wgrad"}.get((ta, tb), f"ta={ta} tb={tb}")
        us = lambda ms: round(ms * 1e3, 2)  # noqa: E731
        rows.append({"MxNxK": f"{M}x{N}x{K}", "layout": layout, "epilogue": EPILOGUE_NAMES.get(epilogue, epilogue),
                     "out": "fp32" if out_fp32 else "bf16", "save_pre": save_pre, "count": calls[key],
                     "config": config_label(cfg), "warm_us": us(warm_ours), "cold_us": us(cold_ours - cold.flush_ms),
                     "rewarmed_us": us(re_ours - re_alone), "switch_us": us(alt_ours - warm_ours - nxt_ours),
                     "cublas_warm_us": us(warm_cublas), "cublas_cold_us": us(cold_cublas - cold.flush_ms),
                     "cublas_rewarmed_us": us(re_cublas - re_alone),
                     "cublas_switch_us": us(alt_cublas - warm_cublas - nxt_cublas)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


class Call(NamedTuple):
    """One recorded call on fresh operands: its first two operands, and the call through ours and through cuBLAS."""
    a: torch.Tensor
    b: torch.Tensor
    ours: Callable[[], torch.Tensor]
    cublas: Callable[[], torch.Tensor]


def _call_fns(key, device: str) -> Call:
    """Fresh operands for one recorded call, and the call through ours and through cuBLAS (same product)."""
    a_spec, b_spec, bias_spec, aux_spec, epilogue, ta, tb, out_fp32, save_pre, rest = key
    a, b, bias, aux = (_tensor(s, device) for s in (a_spec, b_spec, bias_spec, aux_spec))
    bias_c = bias.to(a.dtype) if bias is not None else None  # cuBLAS's, cast outside the timed calls
    GEMM = torch.ops.bertaccel.gemm.default

    def ours():
        return GEMM(a, b, bias, aux, epilogue, ta, tb, out_fp32, save_pre, *rest)[0]

    def cublas():  # GELU / dGELU epilogues not included
        if bias is not None and not ta and not tb:
            return F.linear(a, b, bias_c)
        y = (a.t() if ta else a) @ (b if tb else b.t())
        return y + bias_c if bias is not None else y

    return Call(a, b, ours, cublas)


def time_sequence(order: list, rounds: int) -> dict:
    """The step's GEMM calls in the step's order, each on its own operands (12 layers of weights and activations
    do not fit the L2, as in the step), replayed as one graph: "plain" back to back; "touched" with each call's
    first operand (the forward's and the data gradient's activation or output gradient, the weight gradient's
    output gradient: what the kernel before it wrote in the step) rewritten just before the call, the touches'
    own time (timed alone, the same way) subtracted. ms per step."""
    from benchmarks.bench_gemm import interleaved_ms

    prepared = [_call_fns(key, "cuda") for key in order]

    def seq(impl: str | None, touch: bool):  # impl None: the touches alone
        def run():
            for call in prepared:
                if touch:
                    call.a.mul_(1)
                if impl is not None:
                    getattr(call, impl)()
        return run

    plain_ours, plain_cublas, t_ours, t_cublas, t_alone = interleaved_ms(
        [seq("ours", False), seq("cublas", False), seq("ours", True), seq("cublas", True), seq(None, True)], (),
        "cuda", rounds)
    return {"calls": len(order), "ours_ms": round(plain_ours, 3), "cublas_ms": round(plain_cublas, 3),
            "touched_ours_ms": round(t_ours - t_alone, 3), "touched_cublas_ms": round(t_cublas - t_alone, 3),
            "touches_alone_ms": round(t_alone, 3)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bert-base", choices=list(MODELS))
    ap.add_argument("--shape", default="16x128", help="batch x seq")
    ap.add_argument("--ffn", action="store_true", help="the ffn family too (GELU / dGELU in the GEMM epilogues)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench_results/step_gemms.json")
    args = ap.parse_args(argv)
    batch, seq = (int(v) for v in args.shape.split("x"))
    order = record_step(args.model, batch, seq, args.ffn, args.device)
    calls = Counter(order)
    print(f"{sum(calls.values())} GEMM calls per step, {len(calls)} distinct")
    if args.device != "cuda":
        for key, count in calls.items():
            print(f"  x{count} a {key[0][0]} b {key[1][0]} epilogue {EPILOGUE_NAMES.get(key[4])} trans {key[5]}/{key[6]}"
                  f" fp32 out {key[7]}")
        return
    from bertaccel.ops import build

    assert build.load_gemm(), build.gemm_reason()
    rows = time_calls(calls, args.rounds)
    totals = {k: round(sum(r[k] * r["count"] for r in rows) / 1e3, 3)
              for k in ("warm_us", "cold_us", "rewarmed_us", "switch_us", "cublas_warm_us", "cublas_cold_us",
                        "cublas_rewarmed_us", "cublas_switch_us")}
    sequence = time_sequence(order, args.rounds)
    write_json(args.out, {"environment": environment(), "model": args.model, "shape": args.shape, "ffn": args.ffn,
                          "rows": rows, "per_step_ms": totals, "sequence": sequence})
    print("STEP GEMMs per step (ms): ours warm {warm_us} cold {cold_us} rewarmed {rewarmed_us} (+switch {switch_us});"
          " cuBLAS warm {cublas_warm_us} cold {cublas_cold_us} rewarmed {cublas_rewarmed_us} (+switch {cublas_switch_us})"
          .format(**totals))
    print("STEP GEMMs in the step's order, own operands (ms per step): ours {ours_ms} cuBLAS {cublas_ms}; first operand "
          "rewritten before each: ours {touched_ours_ms} cuBLAS {touched_cublas_ms} (touches {touches_alone_ms})"
          .format(**sequence))


if __name__ == "__main__":
    main()
