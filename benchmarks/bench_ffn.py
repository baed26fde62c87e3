"""BERT's feed-forward block (BertLayer.feed_forward_chunk: Linear + GELU, Linear + dropout + residual
+ LayerNorm), forward and forward + backward, under bf16 autocast with fp32 master weights, training
mode (dropout on):

    python -m benchmarks.bench_ffn --out bench_results/ffn.json
    python -m benchmarks.bench_ffn --device cpu --tokens 64 --hidden 32 --inner 64   # the harness only

Implementations, each on the same layer and inputs in one process:
    hf            HF's modules, eager (cuBLAS GEMMs, PyTorch's GELU, dropout, add, LayerNorm)
    hf-compile    torch.compile of the same block (Inductor fuses the elementwise work; cuBLAS GEMMs)
    fused         the default kernel swap's families for the block: bias_gelu + residual_layer_norm
                  (cuBLAS GEMMs without bias, our bias+GELU and bias+dropout+residual+LayerNorm kernels)
    fused-gemm    the same with the `linear` family: both GEMMs on our GEMM (sm_90a)
    ffn           the `ffn` family: bias + GELU in GEMM 1's epilogue; backward: dgrad, then dGELU + db1 in one pass
    ffn-dgelu-epilogue   the same with dGELU in GEMM 2's dgrad epilogue (BERTACCEL_FFN_DGELU=epilogue)
GPU time per call from CUDA-graph replays (interleaved rounds, median). FLOPs: 2 GEMMs forward,
4 backward, 2 * T * H * I each.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from transformers import BertConfig
from transformers.models.bert.modeling_bert import BertLayer

from benchmarks.common import (
    compile_static, environment, graph_time_ms, kernel_env, kernel_times_us, print_table, write_json,
)

SHAPES = [(2048, 768, 3072), (16384, 768, 3072), (16384, 384, 1536)]  # tokens, hidden, inner (BERT-base, MiniLM)
FAMILIES = {"hf": None, "hf-compile": None, "fused": ["residual_layer_norm", "bias_gelu"],
            "fused-gemm": ["linear", "residual_layer_norm", "bias_gelu"], "ffn": ["linear", "ffn"],
            "ffn-dgelu-epilogue": ["linear", "ffn"]}
ENV = {"ffn-dgelu-epilogue": {"BERTACCEL_FFN_DGELU": "epilogue"}}  # set while that implementation runs


def make_block(name: str, hidden: int, inner: int, device: str):
    """fn(x) -> y of one implementation, on a layer built from seed 0 (the same weights for all)."""
    from bertaccel.ops.swap import swap

    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=hidden, intermediate_size=inner, num_attention_heads=hidden // 64 or 1)
    layer = torch.nn.Sequential(BertLayer(cfg).to(device).train())
    if FAMILIES[name]:
        report = swap(layer, FAMILIES[name])
        assert report.replaced, f"{name}: the swap replaced nothing"
    fn = layer[0].feed_forward_chunk
    if name == "hf-compile":
        fn = compile_static(fn)
    params = [p for n, p in layer.named_parameters() if "attention" not in n]
    return fn, params


def run(shapes, device: str, rounds: int, names, kernels: bool = False) -> list[dict]:
    rows = []
    for T, H, inner in shapes:
        x = torch.randn(T, H, device=device).bfloat16()
        dy = torch.randn(T, H, device=device).bfloat16()
        blocks = {n: make_block(n, H, inner, device) for n in names}

        def fwd(fn):
            def f(x):
                with torch.autocast(device, dtype=torch.bfloat16):
                    return fn(x)
            return f

        def train(fn, params, env=None):
            def f(x):
                x = x.detach().requires_grad_(True)
                with kernel_env(env):
                    with torch.autocast(device, dtype=torch.bfloat16):
                        y = fn(x)
                    return torch.autograd.grad(y, [x, *params], dy.to(y.dtype))
            return f

        times: dict[str, dict[str, list[float]]] = {n: {"fwd": [], "train": []} for n in names}
        for _ in range(rounds):  # in turn, so clock drift under load spreads over every implementation
            for n, (fn, params) in blocks.items():
                times[n]["fwd"].append(_time(fwd(fn), x, device))
                times[n]["train"].append(_time(train(fn, params, ENV.get(n)), x, device))
        flops_fwd = 2 * 2 * T * H * inner
        base = statistics.median(times["hf"]["train"]) if "hf" in times else None
        for n in names:
            f_ms, t_ms = statistics.median(times[n]["fwd"]), statistics.median(times[n]["train"])
            rows.append({"shape": f"{T}x{H}x{inner}", "impl": n, "fwd_ms": round(f_ms, 4), "fwd+bwd_ms": round(t_ms, 4),
                         "fwd+bwd_TFLOP/s": round(3 * flops_fwd / t_ms / 1e9, 1),
                         "speedup_vs_hf": round(base / t_ms, 3) if base else None,
                         "rounds_fwd+bwd_ms": [round(v, 4) for v in times[n]["train"]]})
        if kernels and device == "cuda":  # where each implementation's fwd+bwd time goes, by kernel (eager calls)
            for n, (fn, params) in blocks.items():
                step = train(fn, params, ENV.get(n))
                step(x)
                per = kernel_times_us(lambda: [step(x) for _ in range(5)], 5)
                print(f"KERNELS {T}x{H}x{inner} {n}: total {sum(per.values()):.1f} us")
                for k, us in sorted(per.items(), key=lambda kv: -kv[1])[:12]:
                    print(f"KERNELS   {us:8.1f} us  {k[:110]}")
        del blocks
    return rows


def _time(fn, x, device: str) -> float:
    if device == "cuda":
        return graph_time_ms(fn, [(x,)], calls=5, replays=10)
    import time

    fn(x)
    t0 = time.perf_counter()
    fn(x)
    return (time.perf_counter() - t0) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tokens", type=int, help="one shape: tokens x --hidden x --inner instead of the defaults")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--inner", type=int, default=3072)
    ap.add_argument("--impls", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kernels", action="store_true", help="also print each implementation's fwd+bwd time by kernel")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    shapes = [(args.tokens, args.hidden, args.inner)] if args.tokens else SHAPES
    names = [n for n in args.impls if args.device == "cuda" or n in ("hf", "fused", "ffn")]
    rows = run(shapes, args.device, args.rounds, names, args.kernels)
    print_table(rows, ["shape", "impl", "fwd_ms", "fwd+bwd_ms", "fwd+bwd_TFLOP/s", "speedup_vs_hf"])
    if args.out:
        write_json(args.out, {"environment": environment(), "rows": rows})


if __name__ == "__main__":
    main()
