"""LayerNorm / RMSNorm / residual LayerNorm forward time at BERT shapes for one setting of
BERTACCEL_LN_ROWS (rows per thread group in the forward kernel), beside a clone of the same bytes.
Run once per setting: `for r in 1 2; do BERTACCEL_LN_ROWS=$r python scripts/ln_rows_sweep.py; done`."""
import os, torch
from benchmarks.common import graph_time_ms, copy_bandwidth_gbs, rotations
from bertaccel.ops.layer_norm import layer_norm
from bertaccel.ops.rms_norm import rms_norm
from bertaccel.ops.residual_layer_norm import bias_dropout_add_layer_norm
ceil = copy_bandwidth_gbs()
rows = os.environ.get("BERTACCEL_LN_ROWS", "auto")
for n, h in [(2048, 768), (16384, 384), (16384, 768), (16384, 1024)]:
    sets = [(torch.randn(n, h, device="cuda", dtype=torch.bfloat16), torch.randn(h, device="cuda"),
             torch.randn(h, device="cuda"), torch.randn(h, device="cuda", dtype=torch.bfloat16))
            for _ in range(rotations(4 * n * h))]
    copy_us = graph_time_ms(lambda x, w, b, lb: x.clone(), sets) * 1e3
    with torch.no_grad():
        ln = graph_time_ms(lambda x, w, b, lb: layer_norm(x, w, b, 1e-12), sets) * 1e3
        rms = graph_time_ms(lambda x, w, b, lb: rms_norm(x, w, 1e-6), sets) * 1e3
        res = graph_time_ms(lambda x, w, b, lb: bias_dropout_add_layer_norm(x, lb, x, w, b, 0.0, 1e-12), sets) * 1e3
    gb = lambda us, k: k * n * h * 2 / us / 1e3
    print(f"SWEEP rows={rows} {n}x{h}: clone {copy_us:.1f}us ({100*gb(copy_us,2)/ceil:.0f}%) | LN {ln:.1f}us {100*gb(ln,2)/ceil:.0f}% | RMS {rms:.1f}us {100*gb(rms,2)/ceil:.0f}% | resLN(no drop) {res:.1f}us {100*gb(res,3)/ceil:.0f}%")
