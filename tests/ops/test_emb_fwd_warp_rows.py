"""The embeddings forward's warp-row kernels (embeddings.cu: embedding_ln_fwd_kernel<..., WARP_ROW = true>): rows of
exactly 1-8 16-byte vectors a lane (hidden 128, 256, 384, 512, 768, 1024), a warp each, their width and threads fixed at
compile time - no per-item width tests, no division by the threads a row, no block barrier. `BERTACCEL_EMB_WARP_ROWS=0`
keeps the general kernel; the switch is read once per process, so each setting runs in a child process, which saves
its outputs for the comparison here. The warp-row kernel must run exactly where the rule says (not at 1000 or 1152
wide, nor with an unaligned table), be as accurate as PyTorch against float64, leave no row unwritten when the last
block's warps run past the end (odd token counts), and agree with the general kernel - bf16 outputs to one unit in
the last place, float32 outputs and the saved mean and rstd to four - with the same dropout mask (the same Philox
offsets)."""

from __future__ import annotations

import functools
import os
import re

import torch

from tests.ops.conftest import cuda_test, outputs_in_child

# (batch, seq, hidden, output dtype): token counts that leave the last block part-filled (3 x 37 = 111 rows)
CASES = [(3, 37, 768, "bfloat16"), (2, 5, 384, "bfloat16"), (1, 1, 1024, "bfloat16"), (7, 129, 512, "bfloat16"),
         (5, 77, 256, "float32"), (4, 33, 128, "float32"), (9, 61, 768, "float32"), (3, 41, 1000, "bfloat16"),
         (2, 19, 1152, "float32")]
WARP_WIDTHS = (128, 256, 384, 512, 768, 1024)


def warp_row_outputs(path: str) -> None:
    """Run in a child process with BERTACCEL_EMB_WARP_ROWS set or not (see the test below); saves to `path`."""
    import torch.nn.functional as F

    from bertaccel.ops import build
    import bertaccel.ops.embeddings  # noqa: F401 - defines the embedding ops
    from tests.ops.conftest import check, cuda_kernel_names, poison

    assert build.load(), build.unavailable_reason()
    on = os.environ.get("BERTACCEL_EMB_WARP_ROWS") != "0"
    ops = torch.ops.bertaccel

    def fwd_kernel(fn) -> str:
        names = [n for n in cuda_kernel_names(fn) if "embedding_ln_fwd_kernel" in n]
        assert len(names) == 1, names
        return names[0]

    def is_warp_row(name: str) -> bool:
        m = re.search(r"embedding_ln_fwd_kernel<.*, (true|false)>", name)
        assert m is not None, name
        return m.group(1) == "true"

    g = torch.Generator(device="cuda").manual_seed(0)
    saved = {}
    V, P = 30522, 512
    for bsz, seq, H, dtype in CASES:
        dt = getattr(torch, dtype)
        bf16 = dt == torch.bfloat16
        ids = torch.randint(1, V, (bsz, seq), device="cuda", generator=g)
        pos = torch.arange(seq, device="cuda").expand(bsz, seq).contiguous()
        tt = torch.randint(0, 2, (bsz, seq), device="cuda", generator=g)
        tables = [torch.randn(n, H, device="cuda", generator=g) for n in (V, P, 2)]
        w, b = torch.randn(H, device="cuda", generator=g), torch.randn(H, device="cuda", generator=g)
        args = (ids, pos, tt, *tables, w, b)
        key = f"{bsz}x{seq}x{H} {dtype}"

        def hf(word, position, token_type, w, b):
            h = F.embedding(ids, word) + F.embedding(tt, token_type) + F.embedding(pos, position)
            return F.layer_norm(h, (H,), w, b, 1e-12)

        with torch.no_grad():
            kernel = fwd_kernel(lambda: ops.embedding_layer_norm(*args, 0.0, 1e-12, bf16, 0))
            assert is_warp_row(kernel) == (on and H in WARP_WIDTHS), (key, kernel)
            poison()
            y = ops.embedding_layer_norm(*args, 0.0, 1e-12, bf16, 0)
            check(y, hf(*(t.to(dt) for t in (*tables, w, b))), hf(*(t.double() for t in (*tables, w, b))), dt, key)
            saved[f"y {key}"] = y.cpu()
            # the training form: y, the saved sum z, mean and rstd, with dropout (the mask from the same offsets)
            torch.manual_seed(7)
            poison()
            yd, z, mean, rstd, _ = ops.embedding_layer_norm_fwd(*args, 0.1, 1e-12, bf16, 0)
            for k, t in (("dropout y", yd), ("z", z), ("mean", mean), ("rstd", rstd)):
                assert not torch.isnan(t).any(), f"{k} {key}: unwritten elements"
                saved[f"{k} {key}"] = t.cpu()
        if H in WARP_WIDTHS:
            # a word table whose rows are not 16-byte aligned: narrower vectors, the general kernel
            shifted = torch.randn(V * H + 1, device="cuda", generator=g)[1:].view(V, H)
            kernel = fwd_kernel(lambda: ops.embedding_layer_norm(ids, pos, tt, shifted, *tables[1:], w, b, 0.0, 1e-12,
                                                                 bf16, 0))
            assert not is_warp_row(kernel), (key, kernel)
    torch.save(saved, path)


@functools.lru_cache(maxsize=None)
def child_outputs(setting: str | None, folder: str) -> dict[str, torch.Tensor]:
    return outputs_in_child("tests.ops.test_emb_fwd_warp_rows", "warp_row_outputs",
                            {"BERTACCEL_EMB_WARP_ROWS": setting}, os.path.join(folder, f"warp_rows_{setting}.pt"))


@cuda_test
def test_emb_fwd_warp_rows_agree_with_the_general_kernel(tmp_path):
    warp, general = child_outputs(None, str(tmp_path)), child_outputs("0", str(tmp_path))
    assert warp.keys() == general.keys() and len(warp) == 5 * len(CASES)
    for key, a in warp.items():
        b = general[key]
        assert a.dtype == b.dtype and a.shape == b.shape, key
        if key.startswith("dropout"):
            assert torch.equal(a == 0, b == 0), f"{key}: another dropout mask"
        eps = torch.finfo(a.dtype).eps
        rtol = eps if a.dtype == torch.bfloat16 else 4 * eps
        torch.testing.assert_close(a, b, rtol=rtol, atol=1e-6, msg=lambda m: f"{key}: {m}")
