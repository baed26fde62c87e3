"""Pictures of the benchmark JSON (PNG next to it): the op table and the end-to-end step times.

    python -m benchmarks.plots benchmarks/results/h100/ops.json benchmarks/results/h100/e2e_graphs.json

`bench_ops` and `e2e` draw theirs when they write their JSON; this redraws committed results."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

IMPL_COLORS = {"pytorch": "#8c8c8c", "compile": "#dd8452", "bertaccel": "#4c72b0"}


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None without matplotlib (pictures are optional)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_ops(payload: dict, path: Path) -> Path | None:
    """Forward and backward effective bandwidth (% of the copy ceiling) per op and shape, one bar
    per implementation."""
    plt = pyplot()
    if plt is None:
        return None
    cases: dict[tuple[str, str], dict[str, dict]] = defaultdict(dict)
    for r in payload["rows"]:
        cases[(r["op"], r["shape"])][r["impl"]] = r
    labels = [f"{op} {shape.replace(' bfloat16', '').replace(' float32', ' fp32')}" for op, shape in cases]
    impls = [i for i in IMPL_COLORS if any(i in v for v in cases.values())]
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.32 * len(cases) * len(impls) / 2 + 2), sharey=True)
    height = 0.8 / len(impls)
    for ax, key, title in ((axes[0], "fwd_%copy", "forward"), (axes[1], "bwd_%copy", "backward")):
        for j, impl in enumerate(impls):
            ys = [i + j * height for i in range(len(cases))]
            xs = [v.get(impl, {}).get(key, 0) or 0 for v in cases.values()]
            ax.barh(ys, xs, height=height, color=IMPL_COLORS[impl], label=impl)
        ax.axvline(100, color="black", lw=0.6, ls=":")
        ax.set_title(f"{title}, % of the copy ceiling ({payload.get('copy_ceiling_GBs', '?')} GB/s)", fontsize=9)
        ax.set_yticks([i + 0.4 - height / 2 for i in range(len(cases))], labels, fontsize=7)
    axes[0].invert_yaxis()  # shared: once for both, first case on top
    axes[0].legend(fontsize=8, loc="upper right")
    env = payload.get("environment", {})
    fig.suptitle(f"{env.get('gpu', '')}, torch {env.get('torch', '')}, commit {env.get('commit', '?')}: "
                 "bertaccel ops vs PyTorch and torch.compile", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_e2e(payload: dict, path: Path) -> Path | None:
    """Step time (ms) per model, shape and workload, one bar per variant, with the speed-up over HF SDPA."""
    plt = pyplot()
    if plt is None:
        return None
    groups: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in payload["rows"]:
        groups[f"{r['model']} {r['shape']} {r['workload']}"][r["variant"]] = r
    variants = list(dict.fromkeys(r["variant"] for r in payload["rows"]))
    fig, axes = plt.subplots(1, len(groups), figsize=(3.2 * len(groups), 3.2), squeeze=False)
    for ax, (name, rows) in zip(axes[0], groups.items()):
        values = [rows.get(v, {}).get("ms", 0) for v in variants]
        bars = ax.bar(range(len(variants)), values, color="#4c72b0")
        for bar, v in zip(bars, variants):
            s = rows.get(v, {}).get("speedup_vs_sdpa")
            if s:
                ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{s:.2f}x", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(variants)), variants, rotation=40, ha="right", fontsize=7)
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("ms per step", fontsize=8)
    env = payload.get("environment", {})
    fig.suptitle(f"{env.get('gpu', '')}, commit {env.get('commit', '?')}: step time, x = speed-up over HF SDPA bf16",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_file(path: Path) -> Path | None:
    payload = json.loads(Path(path).read_text())
    rows = payload.get("rows", [])
    if rows and "impl" in rows[0]:
        return plot_ops(payload, Path(path).with_suffix(".png"))
    if rows and "variant" in rows[0]:
        return plot_e2e(payload, Path(path).with_suffix(".png"))
    return None


if __name__ == "__main__":
    for f in sys.argv[1:]:
        print(plot_file(Path(f)) or f"{f}: nothing to draw (matplotlib missing or an unknown layout)")
