"""End-to-end BERT step times: HF eager fp32, HF eager bf16-mixed, HF bf16 SDPA, HF + torch.compile,
and this project's presets, all in one process on the same inputs.

    python -m benchmarks.e2e --out bench_results/e2e.json
    python -m benchmarks.e2e --models bert-base --shapes 16x128 --variants hf-sdpa-bf16 fused

"train" = forward + backward + fused AdamW step; "infer" = forward under no_grad; "mlm" = a masked-LM train step
(`bertaccel.modules.BertMLM`'s: 15% of the real tokens masked, the head on the selected positions - under graphs and
compile the static budget). Random-init `BertForSequenceClassification` (`BertForMaskedLM` for "mlm"), attention
mask all ones; with `--lengths uniform` each row's length
is uniform in [0.2, 1] x seq (ByteTransformer's setting; fixed seed), where the `*-unpadded-*`
variants run the encoder on the real tokens only (bertaccel.modules.unpadded, packed once with
`packed_layout`): our varlen attention kernel, or PyTorch's FlashAttention varlen (`-flash`). Each cell: warm-up (compilation
included), then the median of CUDA-event step times. Speed-up is over HF bf16 SDPA.
"""

from __future__ import annotations

import argparse
import gc
import statistics

import torch
from transformers import BertConfig, BertForSequenceClassification

from benchmarks.plots import plot_file
from benchmarks.common import environment, print_table, step_times_ms, write_json
from bertaccel.modules.flops import bert_step_flops
from bertaccel.ops.swap import DEFAULT, swap

MODELS = {
    "bert-base": dict(),
    "minilm": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536),
    # For smoke runs of the harness on CPU.
    "tiny": dict(vocab_size=1000, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                 max_position_embeddings=128),
}
# name: (attention implementation, autocast bf16, kernel swap (True: `ops: [all]`; "gemm": with `linear`;
#        "ffn": with `linear` and `ffn`; "ffn-only": with `ffn` alone),
#        torch.compile, whole-step CUDA graph)
VARIANTS = {
    "hf-eager-fp32": ("eager", False, False, False, False),
    "hf-eager-bf16": ("eager", True, False, False, False),
    "hf-sdpa-bf16": ("sdpa", True, False, False, False),
    "hf-compile": ("sdpa", True, False, True, False),
    "fused": ("sdpa", True, True, False, False),
    "fused-compile": ("sdpa", True, True, True, False),
    # `fused` without the residual LayerNorms' fan-out (BERTACCEL_RESIDUAL_FANOUT=0): its autograd.Functions' host
    # cost in an eager step
    "fused-no-fanout": ("sdpa", True, True, False, False),
    # eager attention, with the softmax family (scale + mask + softmax in one kernel) swapped in too
    "fused-eager": ("eager", True, True, False, False),
    # the product's graphed step (src/bertaccel/modules/graphs.py, as `model.cuda_graphs` runs it): forward,
    # backward and capturable fused AdamW captured once and replayed, with bf16 weight copies
    # (src/bertaccel/modules/weight_copies.py)
    "graphs": ("sdpa", True, False, False, True),
    "fused-graphs": ("sdpa", True, True, False, True),
    # the same with autocast casting the fp32 weights in each step (`model.bf16_weight_copies: false`)
    "fused-graphs-cast": ("sdpa", True, True, False, True),
    # the kernel swap without its `qkv` family (three Q, K, V projection GEMMs per layer, as HF)
    "fused-graphs-noqkv": ("sdpa", True, "noqkv", False, True),
    # + the opt-in `linear` family: every BERT nn.Linear on our own TMA + wgmma GEMM (Hopper)
    "gemm-fused": ("sdpa", True, "gemm", False, False),
    "gemm-fused-graphs": ("sdpa", True, "gemm", False, True),
    # + the opt-in `ffn` family too: BERT's feed-forward block with GELU / dGELU in our GEMM's epilogues
    "ffn-gemm-fused-graphs": ("sdpa", True, "ffn", False, True),
    # `attn_implementation: bertaccel` (our attention kernel reading the padded batch in place, padded blocks skipped):
    # with the default swap, and with everything swapped (every nn.Linear and the feed-forward block on our GEMM)
    "attn-fused-graphs": ("bertaccel", True, True, False, True),
    "attn-ffn-gemm-fused-graphs": ("bertaccel", True, "ffn", False, True),
    # our GEMM in the feed-forward block only (GELU in GEMM 1's epilogue, the residual's gradient in its dgrad's):
    # the attention projections and the pooler stay on cuBLAS
    "attn-ffn-fused-graphs": ("bertaccel", True, "ffn-only", False, True),
    # attn-fused-graphs with the parameters without bf16 copies (mostly the word embeddings) updated by PyTorch's
    # fused AdamW (BERTACCEL_ADAMW_ALL=0) instead of our kernel `bertaccel::adamw_` (the default since session 48)
    "attn-fused-graphs-adamw-pytorch": ("bertaccel", True, True, False, True),
    # the two without the residual LayerNorms' fan-out (BERTACCEL_RESIDUAL_FANOUT=0; on by default since session 48):
    # the two gradients of each output added by autograd's add kernel instead of in the LayerNorm backward's kernel
    "attn-fused-graphs-no-fanout": ("bertaccel", True, True, False, True),
    "attn-ffn-gemm-fused-graphs-no-fanout": ("bertaccel", True, "ffn", False, True),
    # the same with the feed-forward block's residual gradient added by a separate kernel (BERTACCEL_FFN_RESIDUAL=add)
    # instead of in its input-gradient GEMM's epilogue
    "attn-ffn-gemm-fused-graphs-residual-add": ("bertaccel", True, "ffn", False, True),
    # the same two with BERTACCEL_GEMM_TUNE=1: each GEMM problem's first (eager, warm-up) call times the cost
    # model's closest tile configurations and keeps the fastest
    "gemm-tuned-fused-graphs": ("sdpa", True, "gemm", False, True),
    "ffn-gemm-tuned-fused-graphs": ("sdpa", True, "ffn", False, True),
    # the encoder on real tokens only (`model.unpadded`), our varlen attention / FlashAttention varlen
    "fused-unpadded-graphs": ("sdpa", True, True, False, True),
    "fused-unpadded-graphs-flash": ("sdpa", True, True, False, True),
    # everything swapped on real tokens: the unpadded encoder with every nn.Linear and the feed-forward block on our GEMM
    "ffn-gemm-fused-unpadded-graphs": ("sdpa", True, "ffn", False, True),
    # the product's graphed step with the last layer at the [CLS] position only (`model.last_layer_cls_only`,
    # bertaccel.modules.last_layer): its TFLOP/s from the FLOPs that run (fewer), as the throughput meter counts them
    "attn-fused-graphs-cls-only": ("bertaccel", True, True, False, True),
    # its [CLS] query's attention by SDPA instead of our query-rows kernel (BERTACCEL_QUERY_ROWS_ATTENTION=0)
    "attn-fused-graphs-cls-only-sdpa": ("bertaccel", True, True, False, True),
    "fused-graphs-cls-only": ("sdpa", True, True, False, True),
    "fused-unpadded-graphs-cls-only": ("sdpa", True, True, False, True),
    # the masked-LM's graphed step with its last layer at the masked positions only (`model.last_layer_masked_only`,
    # workload "mlm" only; attn-fused-graphs is the whole layer there)
    "attn-fused-graphs-masked-last": ("bertaccel", True, True, False, True),
}
CLS_ONLY = {"attn-fused-graphs-cls-only", "attn-fused-graphs-cls-only-sdpa", "fused-graphs-cls-only",
            "fused-unpadded-graphs-cls-only"}
MASKED_LAST = {"attn-fused-graphs-masked-last"}
UNPADDED = {"fused-unpadded-graphs": "bertaccel", "fused-unpadded-graphs-flash": "flash", "fused-unpadded-graphs-cls-only": "bertaccel",
            "ffn-gemm-fused-unpadded-graphs": "bertaccel"}
VARIANT_ENV = {"gemm-tuned-fused-graphs": {"BERTACCEL_GEMM_TUNE": "1"}, "ffn-gemm-tuned-fused-graphs": {"BERTACCEL_GEMM_TUNE": "1"},
               "attn-ffn-gemm-fused-graphs-residual-add": {"BERTACCEL_FFN_RESIDUAL": "add"},
               "attn-fused-graphs-adamw-pytorch": {"BERTACCEL_ADAMW_ALL": "0"},
               "attn-fused-graphs-no-fanout": {"BERTACCEL_RESIDUAL_FANOUT": "0"},
               "attn-fused-graphs-cls-only-sdpa": {"BERTACCEL_QUERY_ROWS_ATTENTION": "0"},
               "fused-no-fanout": {"BERTACCEL_RESIDUAL_FANOUT": "0"},
               "attn-ffn-gemm-fused-graphs-no-fanout": {"BERTACCEL_RESIDUAL_FANOUT": "0"}}
BASELINE = "hf-sdpa-bf16"
COLUMNS = ["model", "shape", "workload", "variant", "ms", "samples/s", "speedup_vs_sdpa", "TFLOP/s"]


def batch_mask(batch: int, seq: int, lengths: str, device: str) -> torch.Tensor:
    """The attention mask: all ones (`full`), or right-padded rows of lengths uniform in [0.2, 1] x seq (`uniform`;
    `uniform-sorted`: the same lengths, longest row first - as `group_by_length`'s batches come - so the attention
    kernels' batch-major grids start the longest sequences first)."""
    if lengths == "full":
        return torch.ones(batch, seq, dtype=torch.long, device=device)
    g = torch.Generator().manual_seed(0)
    n = (torch.rand(batch, generator=g) * 0.8 * seq + 0.2 * seq).long().clamp(1, seq)
    if lengths == "uniform-sorted":
        n = n.sort(descending=True).values
    return (torch.arange(seq)[None] < n[:, None]).long().to(device)


PROFILES: dict[tuple, dict] = {}
FLOPS: dict[tuple, float] = {}  # a masked-LM cell's step FLOPs (they depend on its masked positions)


def kernel_breakdown(one_step, steps: int = 5, top: int = 12) -> dict:
    """GPU time per step by kernel category (the profiler callback's categories) and the top kernels,
    from a torch.profiler pass over `steps` steps (`breakdown_of` its GPU activities)."""
    from torch.profiler import ProfilerActivity, profile

    from bertaccel.callbacks.profiler import device_activities

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(steps):
            one_step()
        end.record()
        torch.cuda.synchronize()
    # the profiled pass's own step time: a breakdown is read against it, not against the timed steps (a pass that ran
    # slower - tracing, clocks - inflates every kernel alike)
    return {"wall_ms": round(start.elapsed_time(end) / steps, 3), **breakdown_of(device_activities(prof.events()), steps, top)}


def breakdown_of(acts, steps: int, top: int = 12) -> dict:
    """ms per step of the GPU activities `acts` (profiler FunctionEvents): `busy_ms` (the time the GPU ran any kernel)
    and `total_ms` (the kernels' own times summed: more where kernels overlap, as one launched by programmatic dependent
    launch does, waiting inside its own time for the kernel before it); `categories` and `top_kernels` by exposed time
    (bertaccel.callbacks.profiler.exposed_us: what a kernel ran past every kernel that began before it; they add up to
    `busy_ms`; before session 53 they held own times), `top_kernel_launches` their launches per step, `categories_own`
    by own time, `gemm_kernels` every GEMM kernel's own time with its template arguments (tile, layouts, schedule)."""
    from bertaccel.callbacks.profiler import activity_exposed_us, categorize, idle_gaps_us

    exposed = activity_exposed_us(acts)
    gaps = sorted(idle_gaps_us([(e.device_index, e.time_range.start, e.time_range.end) for e in acts]))
    cats: dict[str, float] = {}
    own_cats: dict[str, float] = {}
    kernels: dict[str, float] = {}
    launches: dict[str, int] = {}
    gemms: dict[str, float] = {}
    for e, x in zip(acts, exposed):
        name, own, x = e.name, (e.time_range.end - e.time_range.start) / steps / 1e3, x / steps / 1e3
        cat = categorize(name)
        cats[cat] = cats.get(cat, 0.0) + x
        own_cats[cat] = own_cats.get(cat, 0.0) + own
        kernels[name[:90]] = kernels.get(name[:90], 0.0) + x
        launches[name[:90]] = launches.get(name[:90], 0) + 1
        if cat == "gemm":
            short = name.split("(")[0][:160]
            gemms[short] = gemms.get(short, 0.0) + own
    by_value = lambda d: sorted(d.items(), key=lambda kv: -kv[1])  # noqa: E731
    return {"busy_ms": round(sum(cats.values()), 3), "total_ms": round(sum(own_cats.values()), 3),
            # the GPU's idle time between its first and last activity, as gaps: many sub-microsecond ones are the
            # launches between kernels (a replayed graph's nodes), a few long ones the host
            "idle_gaps_ms": round(sum(gaps) / steps / 1e3, 3), "idle_gaps_per_step": round(len(gaps) / steps, 1),
            "idle_gap_median_us": round(statistics.median(gaps), 2) if gaps else 0.0,
            "idle_gaps_over_5us_per_step": round(sum(g > 5 for g in gaps) / steps, 1),
            "categories": {k: round(v, 3) for k, v in by_value(cats)},
            "categories_own": {k: round(v, 3) for k, v in by_value(own_cats)},
            "top_kernels": {k: round(v, 3) for k, v in by_value(kernels)[:top]},
            "top_kernel_launches": {k: round(launches[k] / steps, 2) for k, _ in by_value(kernels)[:top]},
            "gemm_kernels": {k: round(v, 4) for k, v in by_value(gemms)}}


# The kernel categories `--profile-sources` attributes to the call that launched them: what is left once the
# GEMMs, attention, the row ops and the optimizer are counted (copies, casts, fills, adds, cats, reductions).
SOURCE_CATEGORIES = ("elementwise", "memcpy/memset", "reduction", "other")


_OUR_CODE = ("bertaccel/", "transformers/", "benchmarks/")


def _short_frame(frame: str) -> str:
    return frame.split("site-packages/")[-1].split("/src/")[-1]


def _source_frame(evt) -> str:
    """Where a profiled op came from: the innermost Python frame in bertaccel, transformers or benchmarks (forward
    ops; with `with_stack` the profiler records each Python call as a parent event named "file(line): function",
    and may also list them in the op's `stack`), else the autograd node that ran it (backward ops run on the
    engine's thread, without Python frames)."""
    for frame in getattr(evt, "stack", None) or []:
        if any(k in frame for k in _OUR_CODE):
            return _short_frame(frame)
    parent = getattr(evt, "cpu_parent", None)
    while parent is not None:
        if parent.name.startswith("autograd::engine::evaluate_function: "):
            return "backward: " + parent.name.split(": ", 1)[1]
        if "): " in parent.name and any(k in parent.name for k in _OUR_CODE):
            return _short_frame(parent.name)
        parent = getattr(parent, "cpu_parent", None)
    return "?"


def _take(pending: list[tuple[str, float]], name: str, default: float) -> float:
    """The exposed time of the first pending activity named `name` (removed from `pending`), else `default`."""
    for i, (n, x) in enumerate(pending):
        if n == name:
            del pending[i]
            return x
    return default


def kernel_sources(events, keep, calls: int = 1) -> list[dict]:
    """The kernels `keep(kernel name)` selects, summed by (kernel, launching op, its input shapes, source frame):
    GPU us per call - exposed time (what a kernel ran past the kernels that began before it: a kernel launched by
    programmatic dependent launch, e.g. our column_sums_kernel, waits for its predecessor inside its own time), own
    time beside it - and launches per call. `events`: torch.profiler FunctionEvents (CPU ops, each with the kernels it
    launched, its input shapes, Python stack and parent op; and the GPU activities), from `calls` eager calls."""
    from bertaccel.callbacks.profiler import exposed_by_launch

    exposed = exposed_by_launch(events) or {}  # (empty where this torch lacks the links: own times then)
    acc: dict[tuple, list[float]] = {}
    for evt in events:
        pending = list(exposed.get(getattr(evt, "id", None), []))
        for k in getattr(evt, "kernels", None) or []:
            x = _take(pending, k.name, k.duration)
            if not keep(k.name):
                continue
            key = (k.name[:70], evt.name, str(getattr(evt, "input_shapes", ""))[:90], _source_frame(evt))
            a = acc.setdefault(key, [0.0, 0.0, 0])
            a[0] += x / calls
            a[1] += k.duration / calls
            a[2] += 1 / calls
    rows = [{"kernel": k[0], "op": k[1], "shapes": k[2], "source": k[3], "us": round(v[0], 1), "own_us": round(v[1], 1),
             "launches": round(v[2], 2)} for k, v in acc.items()]
    return sorted(rows, key=lambda r: -r["us"])


def profile_sources(fn, calls: int = 2) -> list[dict]:
    """kernel_sources of `calls` eager calls of fn (a step body) on the GPU: the small kernels and who launched them."""
    from torch.profiler import ProfilerActivity, profile

    from bertaccel.callbacks.profiler import categorize

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True, with_stack=True) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return kernel_sources(prof.events(), lambda name: categorize(name) in SOURCE_CATEGORIES, calls)


def step_times(variant: str, *args, **kwargs) -> list[float]:
    """Step times in ms of one variant: CUDA events on a GPU, a wall clock on CPU (smoke runs only); the
    variant's kernel switches (VARIANT_ENV) set for its run only."""
    from benchmarks.common import kernel_env

    with kernel_env(VARIANT_ENV.get(variant)):
        return _step_times(variant, *args, **kwargs)


def _step_times(variant: str, model_name: str, batch: int, seq: int, workload: str, warmup: int, steps: int,
                device: str = "cuda", lengths: str = "full", profile: int = 0, sources: bool = False,
                token_budget: int | None = None) -> list[float]:
    """profile > 0: also record this variant's kernel breakdown (PROFILES), keeping its `profile` top kernels;
    sources: and which calls of one eager run of the step body launched its small kernels (profile_sources);
    token_budget: an unpadded variant's packed token count padded to this many (`packed_layout`'s fillers; the
    collator's `data.token_buckets`), instead of the real tokens only."""
    import os

    attn, bf16, fused, compiled, graphed = VARIANTS[variant]
    if variant in UNPADDED:
        os.environ["BERTACCEL_VARLEN_ATTENTION"] = UNPADDED[variant]
    cuda = device == "cuda"
    graphed = graphed and cuda
    mlm = workload == "mlm"
    if mlm and (variant in UNPADDED or variant in CLS_ONLY):
        raise ValueError(f"{variant} is a classifier's variant (workload train / infer)")
    if not mlm and variant in MASKED_LAST:
        raise ValueError(f"{variant} is the masked-LM's variant (workload mlm)")
    torch.manual_seed(0)
    cfg = BertConfig(num_labels=2, **MODELS[model_name])
    module = None
    if mlm:
        from bertaccel.modules.mlm import BertMLM

        # static shapes (the masked positions' fixed budget) under graphs and compile, as the product runs them
        module = BertMLM(config=MODELS[model_name], vocab_size=cfg.vocab_size, cuda_graphs=graphed or compiled,
                         last_layer_masked_only=variant in MASKED_LAST).to(device)
        model = module.model
    else:
        model = BertForSequenceClassification(cfg).to(device)
    if attn == "bertaccel":
        from bertaccel.modules.hf_attention import register

        register()
    model.set_attn_implementation(attn)
    if fused:
        ops = {"gemm": DEFAULT + ["linear"], "ffn": DEFAULT + ["linear", "ffn"], "ffn-only": DEFAULT + ["ffn"]}.get(
            fused, [f for f in DEFAULT if fused != "noqkv" or f != "qkv"])
        swap(model, ops)
    if variant in CLS_ONLY:
        from bertaccel.modules.last_layer import last_layer_cls_only

        last_layer_cls_only(model)
    train = workload in ("train", "mlm")
    model.train(train)
    if compiled and mlm:  # BertMLM calls the encoder and the head, not the model's own forward
        model.bert.compile(mode="reduce-overhead")
        model.cls.compile(mode="reduce-overhead")
    elif compiled:
        model.compile(mode="reduce-overhead")  # in place: state_dict keys unchanged
    opt = None
    if train:
        lr = torch.tensor(1e-5, device=device) if graphed else 1e-5
        opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=cuda, capturable=graphed)
    g = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(min(1000, cfg.vocab_size // 2), cfg.vocab_size, (batch, seq), device=device, generator=g)
    mask = batch_mask(batch, seq, lengths, device)
    labels = torch.randint(0, 2, (batch,), device=device, generator=g)
    if mlm:  # 15% of the real tokens masked (their ids as labels), the rest -100
        labels = torch.where((torch.rand(batch, seq, device=device, generator=g) < 0.15) & mask.bool(), ids, -100)
        FLOPS[(model_name, f"{batch}x{seq}", workload, variant)] = float(module.flops_per_batch(
            {"input_ids": ids, "attention_mask": mask, "labels": labels}, True))
    if variant in UNPADDED:
        from bertaccel.data.collate import packed_layout
        from bertaccel.modules.unpadded import Unpadded, classifier_logits

        if token_budget is not None and token_budget < int(mask.sum()):
            raise ValueError(f"token budget {token_budget} is below the batch's {int(mask.sum())} real tokens")
        indices, cu = packed_layout(mask.cpu(), token_sizes=[token_budget] if token_budget else None)
        layout = Unpadded.from_packed(indices.to(device), cu.to(device), mask)

        def logits_of(ids, mask):
            return classifier_logits(model, ids, mask, None, layout)
    else:
        def logits_of(ids, mask):
            return model(input_ids=ids, attention_mask=mask).logits

    def loss_of(ids, mask, labels):
        if mlm:
            return module.step_outputs(ids, mask, labels)["loss"]
        return torch.nn.functional.cross_entropy(logits_of(ids, mask), labels)

    if graphed:
        import contextlib

        from bertaccel.modules.graphs import StepGraphs
        from bertaccel.modules.train_step import build_train_step, make_static_grads
        from bertaccel.modules.weight_copies import Bf16WeightCopies

        runner = StepGraphs(variant)
        copies = Bf16WeightCopies(model) if bf16 and not variant.endswith("-cast") else None

        def autocast():
            return torch.autocast(device, dtype=torch.bfloat16, enabled=bf16, cache_enabled=False)

        if train:
            make_static_grads(model.parameters())  # the product's static gradient buffers
            # the product's graphed step body (bertaccel.modules.train_step), as `bertaccel fit` builds it
            graph_step = build_train_step(
                lambda ids, mask, labels: {"loss": loss_of(ids, mask, labels)},
                opt, copies=copies, autocast=autocast)
        else:
            def graph_step(ids, mask, labels):
                with copies.swapped_in() if copies else contextlib.nullcontext(), autocast(), torch.no_grad():
                    return {"logits": logits_of(ids, mask)}

    def one_step():
        if graphed:
            return runner.run("step", graph_step, {"ids": ids, "mask": mask, "labels": labels})
        if compiled:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            if train:
                loss = loss_of(ids, mask, labels)
            else:
                with torch.no_grad():
                    return logits_of(ids, mask)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        one_step()
    times = step_times_ms(one_step, steps, cuda)
    if profile and cuda:
        key = (model_name, f"{batch}x{seq}", workload, variant)
        PROFILES[key] = kernel_breakdown(one_step, top=profile)
        if sources:  # the graphed step's body run eagerly: the same kernels, each with the call that launched it
            body = (lambda: graph_step(ids=ids, mask=mask, labels=labels)) if graphed else one_step
            PROFILES[key]["sources"] = profile_sources(body)
    model = module = opt = None  # (not del: the step closures above refer to them) - frees the GPU memory below
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    torch._dynamo.reset()
    os.environ.pop("BERTACCEL_VARLEN_ATTENTION", None)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", nargs="+", default=["bert-base", "minilm"], choices=list(MODELS))
    ap.add_argument("--shapes", nargs="+", default=["16x128", "32x512"], help="batch x seq")
    ap.add_argument("--workloads", nargs="+", default=["train", "infer"], choices=["train", "infer", "mlm"],
                    help="mlm: the masked-LM train step (BertForMaskedLM; not with the classifier-only variants)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lengths", default="full", choices=["full", "uniform", "uniform-sorted"],
                    help="uniform: row lengths uniform in [0.2, 1] x seq (ByteTransformer's setting); uniform-sorted: "
                         "the same lengths, longest row first")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: smoke runs of the harness only")
    ap.add_argument("--profile", action="store_true", help="also list each variant's GPU time by kernel category")
    ap.add_argument("--profile-top", type=int, default=12,
                    help="how many of each profiled variant's kernels (by GPU time) the JSON and the table keep")
    ap.add_argument("--profile-sources", action="store_true",
                    help="with --profile: also attribute each variant's copy / cast / fill / add / reduction kernels to the "
                         "op, input shapes and source line (or autograd node) that launched them, from eager runs of its step")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every variant of a cell this many times, the variants interleaved (each round builds and "
                         "captures anew); a cell's time is the median of its rounds' medians, each round's kept in the JSON")
    ap.add_argument("--token-budgets", nargs="+", type=int, default=[],
                    help="the unpadded variants again with the packed token count padded to each of these (filler tokens "
                         "through the encoder, as `data.token_buckets` pads a batch): the step's cost per padding token")
    ap.add_argument("--out", default="bench_results/e2e.json")
    args = ap.parse_args()
    rows = []
    for model_name in args.models:
        cfg = BertConfig(num_labels=2, **MODELS[model_name])
        for shape in args.shapes:
            batch, seq = map(int, shape.split("x"))
            for workload in args.workloads:
                # (variant, token budget): every variant as it is, the unpadded ones also at each --token-budgets count
                runs = [(v, None) for v in args.variants] + [
                    (v, t) for t in args.token_budgets for v in args.variants if v in UNPADDED]
                name = {(v, t): v if t is None else f"{v}@{t}" for v, t in runs}
                per_round: dict[str, list[float]] = {name[k]: [] for k in runs}
                for r in range(args.rounds):
                    for variant, budget in runs:
                        try:
                            t = step_times(variant, model_name, batch, seq, workload, args.warmup, args.steps, args.device,
                                           args.lengths, args.profile_top if args.profile and r == 0 and budget is None else 0,
                                           args.profile and args.profile_sources and r == 0 and budget is None,
                                           token_budget=budget)
                            per_round[name[variant, budget]].append(statistics.median(t))
                        except Exception as e:  # noqa: BLE001 - report the failure in the table, go on
                            print(f"{model_name} {shape} {workload} {name[variant, budget]}: FAILED {type(e).__name__}: {e}")
                            per_round[name[variant, budget]].append(float("nan"))
                cell = {v: statistics.median(ts) for v, ts in per_round.items()}
                base = cell.get(BASELINE)
                for key, (variant, budget) in zip(cell, runs):
                    ms = cell[key]
                    flops = FLOPS.get((model_name, shape, workload, variant)) if workload == "mlm" else bert_step_flops(
                        cfg, batch, seq, training=workload == "train", cls_only_last_layer=variant in CLS_ONLY)
                    extra = {"ms_rounds": [round(x, 3) for x in per_round[key]]} if args.rounds > 1 else {}
                    rows.append({
                        "model": model_name, "shape": shape, "lengths": args.lengths, "workload": workload, "variant": key,
                        "ms": round(ms, 3), "samples/s": round(batch / ms * 1e3, 1) if ms == ms else "",
                        "speedup_vs_sdpa": round(base / ms, 2) if base and ms == ms else "",
                        "TFLOP/s": round(flops / ms / 1e9, 1) if ms == ms and flops else "", **extra,
                        **({"token_budget": budget} if budget is not None else {}),
                    })
                print_table([r for r in rows if r["model"] == model_name and r["shape"] == shape and r["workload"] == workload],
                            COLUMNS)
    profiles = [{"model": k[0], "shape": k[1], "workload": k[2], "variant": k[3], **v} for k, v in PROFILES.items()]
    write_json(args.out, {"environment": environment(), "baseline": BASELINE, "rows": rows, "profiles": profiles})
    if profiles:  # categories side by side, ms per step
        cats = sorted({c for p in profiles for c in p["categories"]}, key=lambda c: -max(p["categories"].get(c, 0) for p in profiles))
        print("\nGPU ms per step by kernel category (exposed time: overlapping kernels counted once; they add up to busy_ms)")
        print(f"{'category':24}" + "".join(f"{p['variant'][:22]:>24}" for p in profiles))
        print(f"{'wall_ms (profiled pass)':24}" + "".join(f"{p.get('wall_ms', float('nan')):24.3f}" for p in profiles))
        print(f"{'busy_ms':24}" + "".join(f"{p['busy_ms']:24.3f}" for p in profiles))
        print(f"{'total_ms (own times)':24}" + "".join(f"{p['total_ms']:24.3f}" for p in profiles))
        print(f"{'idle gaps ms':24}" + "".join(f"{p.get('idle_gaps_ms', float('nan')):24.3f}" for p in profiles))
        print(f"{'idle gaps per step':24}" + "".join(f"{p.get('idle_gaps_per_step', float('nan')):24.1f}" for p in profiles))
        print(f"{'  median gap us':24}" + "".join(f"{p.get('idle_gap_median_us', float('nan')):24.2f}" for p in profiles))
        print(f"{'  gaps over 5 us':24}" + "".join(f"{p.get('idle_gaps_over_5us_per_step', float('nan')):24.1f}"
                                                    for p in profiles))
        for c in cats:
            print(f"{c:24}" + "".join(f"{p['categories'].get(c, 0.0):24.3f}" for p in profiles))
        for p in profiles:
            print(f"\n{p['variant']} top kernels (exposed ms per step, launches per step):")
            for k, v in p["top_kernels"].items():
                print(f"  {v:7.3f} {p.get('top_kernel_launches', {}).get(k, float('nan')):6.1f}  {k}")
            if p.get("sources"):
                print(f"\n{p['variant']} small kernels by launching call (eager run of the step body; exposed us per step, own us"
                      " - a kernel launched by programmatic dependent launch, e.g. column_sums_kernel, waits for the kernel"
                      " before it inside its own time -, launches):")
                for src in p["sources"][:40]:
                    print(f"  {src['us']:8.1f} {src.get('own_us', src['us']):8.1f} {src['launches']:5.1f}  {src['kernel'][:50]:50}  "
                          f"{src['op']}  {src['shapes'][:60]}  {src['source']}")
    picture = plot_file(args.out)  # PNG next to the JSON (with matplotlib)
    if picture:
        print(f"picture: {picture}")
    print()
    print_table(rows, COLUMNS)


if __name__ == "__main__":
    main()
