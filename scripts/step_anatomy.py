"""Where the GPU time of one graphed training step goes, and what a different parameter layout would buy.

    python scripts/step_anatomy.py --out $OUT/step_anatomy.json

For each model/shape, the product's graphed step (`StepGraphs`, kernel swap, bf16 autocast with the
fp32 weights, capturable fused AdamW) is timed with CUDA events over graph replays, beside variants
that take parts away or change how parameters are held:

- `full`:           forward + backward + fused AdamW, autocast casting the fp32 weights; the product's
                    step body (bertaccel.modules.train_step)
                    (what `model.cuda_graphs` runs with `bf16_weight_copies: false`)
- `copies`:         `full` with bf16 copies of the Linear weights beside the fp32 masters
                    (src/bertaccel/modules/weight_copies.py; `model.cuda_graphs`' default)
- `<variant>-static`: the variant with every gradient added into its static `.grad` buffer and
                    zeroed after the update (the step before transient gradients, train_step.py)
- `copies-unfused`: `copies` with the copied weights' gradients widened into fp32, PyTorch's fused
                    AdamW and a refresh of the copies, instead of `adamw_bf16_copies_` (one kernel)
- `no-optimizer`:   forward + backward + zero_grad
- `forward`:        the training forward alone (dropout on, no backward)
- `flat`:           `full` with every fp32 parameter and gradient a view of one flat buffer per
                    parameter group, so AdamW and zero_grad each run over two tensors
- `bf16-params`:    the model's parameters in bf16 (no autocast casts), fused AdamW on them: the
                    floor of a bf16-weights + fp32-master layout (it does not keep fp32 masters)
- `<variant>-noqkv`: the variant with the kernel swap's `qkv` family left out (three projection
                    GEMMs per layer, as HF runs them)
- `attn-<backend>`: `full` with SDPA held to one backend (cudnn, efficient, flash, math) while
                    the step is captured

Rows are padded like IMDB reviews at max_length 256 (`--padded`: the fraction of rows shorter
than the batch, with uniform lengths), so SDPA gets an attention mask.

Then one torch.profiler pass over replays of `full` lists the kernels of one step by category.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import functools
import json
import sys
from pathlib import Path

import torch
from transformers import BertConfig, BertForSequenceClassification

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "src"), str(Path(__file__).resolve().parents[1])]
from benchmarks.common import cuda_time_ms  # noqa: E402
from bertaccel.callbacks.profiler import categorize  # noqa: E402
from bertaccel.modules.graphs import StepGraphs  # noqa: E402
from bertaccel.modules.train_step import build_train_step  # noqa: E402
from bertaccel.modules.weight_copies import Bf16WeightCopies  # noqa: E402
from bertaccel.ops.swap import DEFAULT, swap  # noqa: E402

MODELS = {
    "minilm": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536),
    "bert-base": dict(),
}


def flatten_(params: list[torch.nn.Parameter]) -> tuple[torch.Tensor, torch.Tensor]:
    """Make params (and fresh zero grads) views of one flat buffer each."""
    n = sum(p.numel() for p in params)
    flat = torch.empty(n, device=params[0].device, dtype=params[0].dtype)
    flat_grad = torch.zeros_like(flat)
    off = 0
    for p in params:
        k = p.numel()
        flat[off:off + k].copy_(p.detach().reshape(-1))
        p.data = flat[off:off + k].view_as(p)
        p.grad = flat_grad[off:off + k].view_as(p)
        off += k
    return flat, flat_grad


def build(model_name: str, variant: str, ops: list[str]):
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(num_labels=2, **MODELS[model_name])).cuda()
    model.set_attn_implementation("sdpa")
    swap(model, ops)
    model.train()
    if variant == "bf16-params":
        model.to(torch.bfloat16)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    flats = None
    if variant == "flat":
        (fd, gd), (fn, gn) = flatten_(decay), flatten_(no_decay)
        flats = [fd, fn], [gd, gn]
        fd.grad, fn.grad = gd, gn
        groups = [{"params": [fd], "weight_decay": 0.01}, {"params": [fn], "weight_decay": 0.0}]
    else:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=torch.tensor(1e-5, device="cuda"), fused=True, capturable=True)
    if variant == "copies":
        flats = Bf16WeightCopies(model)  # (the variant's parameter layout)
    return model, opt, flats


BACKENDS = {"cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "flash": "FLASH_ATTENTION", "math": "MATH"}


def step_fn(model, opt, flats, variant: str):
    """The variant's step. `full`, `copies`, `bf16-params`, `-noqkv` and `attn-*` run the product's
    graphed step body (bertaccel.modules.train_step.build_train_step, as `bertaccel fit` builds it);
    `forward`, `no-optimizer` and `flat` are the experiments that take parts away or re-lay the memory."""
    base = variant.removesuffix("-unfused").removesuffix("-static")
    autocast = base != "bf16-params"
    copies = flats if base == "copies" else None
    if copies is not None:
        flats = None
    backend = variant.removeprefix("attn-") if variant.startswith("attn-") else None

    def step(ids, mask, labels):
        if backend is not None:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(getattr(SDPBackend, BACKENDS[backend])):
                return inner(ids, mask, labels)
        return inner(ids, mask, labels)

    if variant not in ("forward", "no-optimizer", "flat"):
        product = build_train_step(
            lambda ids, mask, labels: {"loss": model(input_ids=ids, attention_mask=mask, labels=labels).loss}, opt,
            copies=copies, transient_grads="-static" not in variant, fused_copies_update="-unfused" not in variant, autocast=(lambda: torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False))
            if autocast else contextlib.nullcontext)

        def inner(ids, mask, labels):
            return product(ids=ids, mask=mask, labels=labels)

        return step

    def inner(ids, mask, labels):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast, cache_enabled=False):
            if variant == "forward":
                with torch.no_grad():
                    return {"loss": model(input_ids=ids, attention_mask=mask, labels=labels).loss.detach()}
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        if variant != "no-optimizer":
            opt.step()
        if flats is not None:
            for g in flats[1]:
                g.zero_()
        else:
            opt.zero_grad(set_to_none=False)
        return {"loss": loss.detach()}

    return step


def time_variant(model_name: str, batch: int, seq: int, variant: str, steps: int, profile: bool, padded: float):
    # "<variant>-noqkv": the kernel swap without the fused Q, K, V projection (three GEMMs, as HF)
    ops = [f for f in DEFAULT if not (variant.endswith("-noqkv") and f == "qkv")]
    variant = variant.removesuffix("-noqkv")
    model, opt, flats = build(model_name, variant.removesuffix("-unfused").removesuffix("-static"), ops)
    g = torch.Generator(device="cuda").manual_seed(1)
    lengths = torch.full((batch,), seq, device="cuda")
    short = torch.rand(batch, device="cuda", generator=g) < padded
    lengths[short] = torch.randint(16, seq, (int(short.sum()),), device="cuda", generator=g)
    mask = (torch.arange(seq, device="cuda")[None, :] < lengths[:, None]).long()
    inputs = {"ids": torch.randint(1000, 30522, (batch, seq), device="cuda", generator=g),
              "mask": mask,
              "labels": torch.randint(0, 2, (batch,), device="cuda", generator=g)}
    runner = StepGraphs(variant)
    fn = step_fn(model, opt, flats, variant)
    ms = cuda_time_ms(functools.partial(runner.run, "k", fn, inputs), [()], warmup=6, repeats=steps)
    kernels = None
    if profile:
        n = 5
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                runner.run("k", fn, inputs)
            torch.cuda.synchronize()
        per = collections.defaultdict(lambda: [0.0, 0])
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
                per[e.name][0] += e.device_time_total / n
                per[e.name][1] += 1
        kernels = sorted(({"name": k, "us_per_step": v[0], "calls_per_step": v[1] / n, "category": categorize(k)}
                          for k, v in per.items()), key=lambda r: -r["us_per_step"])
    del model, opt, runner
    torch.cuda.empty_cache()
    return ms, kernels


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", nargs="+", default=["minilm:32x256", "bert-base:16x128"])
    ap.add_argument("--variants", nargs="+", default=["full", "copies", "no-optimizer", "forward", "flat", "bf16-params"])
    ap.add_argument("--profile-variants", nargs="+", default=["copies"], help="variants whose kernels are listed")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--padded", type=float, default=0.5, help="fraction of rows shorter than the batch")
    ap.add_argument("--out", default="step_anatomy.json")
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    args = ap.parse_args()
    import logging

    logging.getLogger("bertaccel.ops.swap").setLevel(logging.ERROR)  # its per-module lines
    rows, profiles = [], {}
    for cell in args.cells:
        name, shape = cell.split(":")
        b, s = (int(x) for x in shape.split("x"))
        for v in args.variants:
            try:
                ms, kernels = time_variant(name, b, s, v, args.steps, profile=v in args.profile_variants and args.profile,
                                          padded=args.padded)
            except Exception as e:  # e.g. a backend that cannot take an attention mask
                print(f"{name:9s} {shape:7s} {v:13s} failed: {str(e).splitlines()[0][:150]}", flush=True)
                torch.cuda.empty_cache()
                continue
            rows.append({"model": name, "shape": shape, "variant": v, "ms": round(ms, 3)})
            print(f"{name:9s} {shape:7s} {v:13s} {ms:7.3f} ms", flush=True)
            if kernels:
                profiles[f"{cell}:{v}"] = kernels
                cats = collections.Counter()
                for k in kernels:
                    cats[k["category"]] += k["us_per_step"]
                total = sum(cats.values())
                print(f"  profiled kernels {total / 1e3:.3f} ms/step, {sum(k['calls_per_step'] for k in kernels):.0f} kernels/step")
                for c, us in cats.most_common():
                    print(f"    {c:18s} {us / 1e3:7.3f} ms  {us / total:6.1%}")
                for k in kernels[:int(os.environ.get("ANATOMY_KERNELS", 22))]:
                    print(f"    {k['us_per_step']:8.1f} us {k['calls_per_step']:5.0f}x  {k['category']:12s} {k['name'][:90]}")
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "kernels": profiles}, f, indent=1)


if __name__ == "__main__":
    main()
