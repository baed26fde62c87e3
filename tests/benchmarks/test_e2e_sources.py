"""benchmarks/e2e.py's kernel attribution (`--profile-sources`): kernels summed by the op, shapes and source that
launched them, forward ops by their Python frame, backward ops by their autograd node."""

from __future__ import annotations

from types import SimpleNamespace as NS

from benchmarks.e2e import kernel_sources


def _kernel(name, us):
    return NS(name=name, duration=us)


def test_kernels_are_summed_per_launching_call_and_split_by_source():
    node = NS(name="autograd::engine::evaluate_function: ToCopyBackward0", cpu_parent=None)
    copy_bwd = NS(name="aten::copy_", cpu_parent=NS(name="aten::_to_copy", cpu_parent=node), stack=[],
                  input_shapes=[[16, 768], [16, 768]], kernels=[_kernel("bfloat16_copy_kernel", 4.0)])
    fwd_frame = "/x/site-packages/transformers/models/bert/modeling_bert.py(123): forward"
    lib_frame = "/opt/torch/nn/functional.py(9): linear"
    copy_fwd = [NS(name="aten::copy_", cpu_parent=None, stack=[lib_frame, fwd_frame], input_shapes=[[16, 768], [16, 768]],
                   kernels=[_kernel("bfloat16_copy_kernel", 3.0)]) for _ in range(2)]
    fill = NS(name="aten::fill_", cpu_parent=None, stack=[], input_shapes=[[8]], kernels=[_kernel("FillFunctor", 1.0),
                                                                                           _kernel("nvjet_gemm", 50.0)])
    # the Python frame as a parent event (how torch.profiler's with_stack records it), above a built-in's event
    py = NS(name="/w/src/bertaccel/ops/qkv.py(47): qkv_projection", cpu_parent=None)
    cat = NS(name="aten::cat", cpu_parent=NS(name="<built-in method cat of type object>", cpu_parent=py), stack=[],
             input_shapes=[[], []], kernels=[_kernel("CatArrayBatchedCopy", 2.0)])
    no_kernels = NS(name="aten::empty", cpu_parent=None, stack=[], input_shapes=[[8]], kernels=[])
    rows = kernel_sources([copy_bwd, *copy_fwd, fill, no_kernels, cat], keep=lambda k: "gemm" not in k, calls=2)
    by_source = {r["source"]: r for r in rows}
    assert set(by_source) == {"backward: ToCopyBackward0", "transformers/models/bert/modeling_bert.py(123): forward", "?",
                              "bertaccel/ops/qkv.py(47): qkv_projection"}
    assert by_source["bertaccel/ops/qkv.py(47): qkv_projection"]["op"] == "aten::cat"
    fwd = by_source["transformers/models/bert/modeling_bert.py(123): forward"]
    assert (fwd["us"], fwd["launches"], fwd["op"]) == (3.0, 1.0, "aten::copy_")  # two launches of 3 us over 2 calls
    assert by_source["backward: ToCopyBackward0"]["us"] == 2.0
    assert by_source["?"]["kernel"] == "FillFunctor"  # the GEMM kernel of the same op was not kept
    assert [r["us"] for r in rows] == sorted((r["us"] for r in rows), reverse=True)


def test_breakdown_counts_a_pdl_wait_once():
    """Two steps of a GEMM followed by a LayerNorm launched early (it waits for the GEMM inside its own time): the
    categories hold exposed time and add up to the busy time; total_ms keeps the kernels' own times."""
    from types import SimpleNamespace

    from benchmarks.e2e import breakdown_of

    def kernel(name, start, end):
        return SimpleNamespace(name=name, device_index=0, time_range=SimpleNamespace(start=start, end=end))

    acts = []
    for t0 in (0.0, 1000.0):  # us
        acts += [kernel("nvjet_sm90_tst_128x256_gemm", t0, t0 + 600.0), kernel("layer_norm_fwd_kernel", t0 + 100.0, t0 + 700.0)]
    b = breakdown_of(acts, steps=2)
    assert b["busy_ms"] == 0.7 and b["total_ms"] == 1.2
    assert b["categories"] == {"gemm": 0.6, "layernorm": 0.1}
    assert b["categories_own"] == {"gemm": 0.6, "layernorm": 0.6}
    assert b["top_kernels"] == {"nvjet_sm90_tst_128x256_gemm": 0.6, "layer_norm_fwd_kernel": 0.1}
    assert b["top_kernel_launches"] == {"nvjet_sm90_tst_128x256_gemm": 1.0, "layer_norm_fwd_kernel": 1.0}
    assert list(b["gemm_kernels"].values()) == [0.6]


def test_sources_count_a_pdl_wait_as_the_kernel_before_it():
    """A column-sum kernel launched early (programmatic dependent launch) by the same op as the kernel it waits for:
    its row holds its exposed time (what it ran past that kernel), its own time beside it."""
    from torch.autograd import DeviceType

    def device(name, start, end, corr):
        return NS(name=name, key=name, device_type=DeviceType.CUDA, device_index=0, is_user_annotation=False,
                  time_range=NS(start=start, end=end), linked_correlation_id=corr)

    op = NS(name="bertaccel::bias_gelu_bwd", id=7, cpu_parent=None, stack=[], input_shapes=[[16, 3072]],
            kernels=[_kernel("bias_gelu_bwd_kernel", 30.0), _kernel("column_sums_kernel", 28.0)])
    events = [op, device("bias_gelu_bwd_kernel", 0.0, 30.0, 7), device("column_sums_kernel", 4.0, 32.0, 7)]
    rows = kernel_sources(events, keep=lambda k: "column_sums" in k)
    assert len(rows) == 1 and (rows[0]["us"], rows[0]["own_us"], rows[0]["launches"]) == (2.0, 28.0, 1.0)
