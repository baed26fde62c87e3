"""compute-sanitizer memcheck over odd shapes of the row kernels session 78 changed (LayerNorm / RMSNorm forward, the
embeddings forward and its scatter, column sums, the bias + GELU backward) and session 81's FAST residual LayerNorm:
    compute-sanitizer --tool memcheck python scripts/memcheck_row_ops.py
(session 80, H200, before they landed: 0 errors, benchmarks/results/h200/pending_memcheck_s80.log)."""
import torch
from bertaccel.ops.layer_norm import layer_norm
from bertaccel.ops.rms_norm import rms_norm
import bertaccel.ops.embeddings  # noqa: F401
import bertaccel.ops.bias_grad  # noqa: F401
for dt in (torch.bfloat16, torch.float32):
    for n, h in ((1, 768), (37, 384), (130, 768), (301, 1024), (4099, 768)):
        x = torch.randn(n, h, device="cuda", dtype=dt); w = torch.randn(h, device="cuda"); b = torch.randn(h, device="cuda")
        with torch.no_grad():
            layer_norm(x, w, b, 1e-12); rms_norm(x, w, 1e-6)
# the residual forms (session 81's FAST residual kernels at the exact widths; 776 on the general kernel), odd row
# counts, with and without dropout and the saved sum
for dt in (torch.bfloat16, torch.float32):
    for n, h in ((4099, 384), (37, 384), (1031, 768), (515, 1024), (33, 776)):
        x, r = torch.randn(n, h, device="cuda", dtype=dt), torch.randn(n, h, device="cuda", dtype=dt)
        w, b, lb = torch.randn(h, device="cuda"), torch.randn(h, device="cuda"), torch.randn(h, device="cuda")
        with torch.no_grad():
            for p in (0.0, 0.1):
                torch.ops.bertaccel.layer_norm_fwd(x, lb, r, w, b, p, 1e-12)
                torch.ops.bertaccel.layer_norm(x, lb, r, w, b, p, 1e-12)
for bsz, seq, h in ((3, 37, 768), (2, 5, 384), (4, 129, 1024), (7, 129, 512), (3, 41, 1000)):
    ids = torch.randint(1, 30522, (bsz, seq), device="cuda"); pos = torch.arange(seq, device="cuda").expand(bsz, seq).contiguous()
    a = (ids, pos, torch.randint(0, 2, (bsz, seq), device="cuda"), torch.randn(30522, h, device="cuda"), torch.randn(512, h, device="cuda"),
         torch.randn(2, h, device="cuda"), torch.randn(h, device="cuda"), torch.randn(h, device="cuda"))
    with torch.no_grad():
        torch.ops.bertaccel.embedding_layer_norm(*a, 0.0, 1e-12, True, 0); torch.ops.bertaccel.embedding_layer_norm_fwd(*a, 0.1, 1e-12, True, 0)
        torch.ops.bertaccel.embedding_layer_norm_fwd(*a, 0.1, 1e-12, False, 0)
for n, c, dt in ((16383, 384, torch.bfloat16), (9831, 1152, torch.bfloat16), (16385, 2304, torch.bfloat16), (5001, 64, torch.float32), (333, 37, torch.float32)):
    torch.ops.bertaccel.column_sum(torch.randn(n, c, device="cuda").to(dt))
import bertaccel.ops.gelu  # noqa: F401,E402
for n, f in ((1023, 3072), (7, 1000), (2047, 4096), (5, 4097)):
    x = torch.randn(n, f, device="cuda", dtype=torch.bfloat16)
    torch.ops.bertaccel.bias_gelu_bwd(torch.randn_like(x), x, torch.randn(f, device="cuda"), False)
for shape, h in (((32, 64), 768), ((17, 33), 384), ((9, 40), 1024), ((300,), 384), ((5, 7), 37)):
    ids = torch.randint(1, 1000, shape, device="cuda")
    pos = torch.arange(shape[-1], device="cuda").expand(shape).contiguous()
    dz = torch.randn(*shape, h, device="cuda", dtype=torch.bfloat16)
    torch.ops.bertaccel.embedding_tables_bwd(dz, ids, pos, torch.zeros_like(ids), 1000, 1024, 2, 0)
torch.cuda.synchronize(); print("memcheck script ok")
