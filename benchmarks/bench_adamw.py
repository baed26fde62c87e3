"""The graphed training step's optimizer update, alone: AdamW over a BERT classifier's parameters as the product
runs it (`bertaccel::adamw_bf16_copies_` for the Linear weights from their bf16 copies' gradients, writing the
refreshed copies, and `bertaccel::adamw_` for the rest from fp32 gradients; modules/train_step.py) against
PyTorch's fused AdamW (`torch._fused_adamw_`, the kernel of `AdamW(fused=True)`) over the same parameters from
fp32 gradients, in one process.

    python -m benchmarks.bench_adamw --models minilm bert-base --chunks 65536 16384 4096

Both move 28 bytes per parameter (ours: bf16 gradient 2 + master, exp_avg, exp_avg_sq 12 read, 12 written +
bf16 copy 2; PyTorch's: fp32 gradient 4 + 12 read, 12 written), so GB/s and the share of the device-to-device
copy ceiling compare them directly. Each of our rows sets the kernel's elements per block (BERTACCEL_ADAMW_CHUNK;
`default` = the kernel's own). Times: CUDA-graph replays of `--calls` updates (the product replays its update in
the step's graph), median over replays. `max_diff`: our parameters after one update against PyTorch's from the
same state and the same gradient values (fp32 arithmetic of the same formula: ~1e-7 of the parameters' scale).
`--device cpu` runs the harness on a tiny model (the CPU reference ops; no timing).
"""

from __future__ import annotations

import argparse

import torch
from transformers import BertConfig, BertForSequenceClassification

from benchmarks.common import copy_bandwidth_gbs, environment, graph_time_ms, kernel_env, print_table, write_json

MODELS = {
    "bert-base": dict(),
    "minilm": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536),
    "tiny": dict(vocab_size=1000, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                 max_position_embeddings=64),
}
BETAS, WD, EPS = (0.9, 0.999), 0.01, 1e-8
BYTES_PER_PARAM = 28


class Problem:
    """A model's parameters split as the product splits them (Bf16WeightCopies: the Linear weights get bf16
    copies), random gradients, AdamW state after one step's worth of moments."""

    def __init__(self, model_name: str, device: str, seed: int = 0):
        import bertaccel.ops.adamw  # noqa: F401 - the ops
        from bertaccel.modules.weight_copies import Bf16WeightCopies

        torch.manual_seed(seed)
        model = BertForSequenceClassification(BertConfig(**MODELS[model_name], num_labels=2)).to(device)
        copies = Bf16WeightCopies(model)
        copied = {id(p) for p in copies.masters}
        self.masters = [p.detach() for p in copies.masters]
        self.copies = [c.detach() for c in copies.copies]
        self.others = [p.detach() for p in model.parameters() if id(p) not in copied]
        g = torch.Generator(device=device).manual_seed(seed + 1)
        self.copy_grads = [1e-3 * torch.randn(p.shape, device=device, generator=g).bfloat16() for p in self.masters]
        self.other_grads = [1e-3 * torch.randn(p.shape, device=device, generator=g) for p in self.others]
        self.params = self.masters + self.others
        self.m = [1e-4 * torch.randn(p.shape, device=device, generator=g) for p in self.params]
        self.v = [1e-8 * torch.rand(p.shape, device=device, generator=g) for p in self.params]
        self.steps = [torch.full((), 10.0, device=device) for _ in self.params]
        self.lr = torch.tensor(2e-5, device=device)
        self.numel = sum(p.numel() for p in self.params)
        # PyTorch's fused AdamW reads fp32 gradients: the same values widened
        self.fp32_grads = [x.float() for x in self.copy_grads] + self.other_grads

    def ours(self) -> None:
        n = len(self.masters)
        torch.ops.bertaccel.adamw_bf16_copies_(self.masters, self.copy_grads, self.m[:n], self.v[:n], self.steps[:n],
                                               self.copies, self.lr, *BETAS, WD, EPS)
        torch.ops.bertaccel.adamw_(self.others, self.other_grads, self.m[n:], self.v[n:], self.steps[n:], self.lr,
                                   *BETAS, WD, EPS)

    def pytorch(self) -> None:
        torch._fused_adamw_(self.params, self.fp32_grads, self.m, self.v, [], self.steps, lr=self.lr, beta1=BETAS[0],
                            beta2=BETAS[1], weight_decay=WD, eps=EPS, amsgrad=False, maximize=False)

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in self.params + self.m + self.v]

    def restore(self, saved: list[torch.Tensor]) -> None:
        for t, s in zip(self.params + self.m + self.v, saved):
            t.copy_(s)


def max_diff(problem: Problem, env: dict | None) -> float:
    """Largest |ours - PyTorch's| over the parameters after one update from the same state."""
    saved = problem.snapshot()
    with kernel_env(env):
        problem.ours()
    mine = [p.clone() for p in problem.params]
    problem.restore(saved)
    problem.pytorch()
    theirs = [p.clone() for p in problem.params]
    problem.restore(saved)
    return max((a - b).abs().max().item() for a, b in zip(mine, theirs))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["minilm", "bert-base"], choices=list(MODELS))
    ap.add_argument("--chunks", nargs="+", default=["default", "65536"],
                    help="our kernel's elements per block (BERTACCEL_ADAMW_CHUNK), 'default' for its own")
    ap.add_argument("--calls", type=int, default=5, help="updates per captured graph")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the harness only (no timing)")
    ap.add_argument("--out", default="bench_results/adamw.json")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda:
        from bertaccel.ops import build

        if not build.load():
            raise SystemExit(f"bench_adamw: the CUDA ops did not build or load: {build.unavailable_reason()}")
    ceiling = copy_bandwidth_gbs() if cuda else None
    if ceiling:
        print(f"device-to-device copy ceiling: {ceiling:.0f} GB/s")
    rows = []
    for name in args.models:
        problem = Problem(name, args.device)
        nbytes = BYTES_PER_PARAM * problem.numel
        impls = {f"bertaccel chunk={c}": (problem.ours, None if c == "default" else {"BERTACCEL_ADAMW_CHUNK": c})
                 for c in args.chunks}
        impls["pytorch fused"] = (problem.pytorch, None)
        saved = problem.snapshot()
        for impl, (fn, env) in impls.items():
            row = {"model": name, "params_M": round(problem.numel / 1e6, 2), "impl": impl}
            if impl.startswith("bertaccel"):
                row["max_diff"] = f"{max_diff(problem, env):.2e}"
            if cuda:
                with kernel_env(env):  # the chunk is read at capture
                    ms = graph_time_ms(fn, [()], calls=args.calls, replays=args.replays)
                problem.restore(saved)
                row.update(us=round(ms * 1e3, 1), GBps=round(nbytes / ms / 1e6), pct_copy=round(100 * nbytes / ms / 1e6 / ceiling))
            rows.append(row)
        problem = None
        if cuda:
            torch.cuda.empty_cache()
    print_table(rows, ["model", "params_M", "impl", "us", "GBps", "pct_copy", "max_diff"])
    write_json(args.out, {"environment": environment(), "copy_ceiling_GBs": round(ceiling) if ceiling else None,
                          "bytes_per_param": BYTES_PER_PARAM, "rows": rows})


if __name__ == "__main__":
    main()
