"""scripts/step_gemms.py records one training step's GEMM calls (CPU: the op path on the reference GEMM)."""
import warnings
from collections import Counter

from scripts.step_gemms import record_step


def test_records_every_linears_three_gemms_with_bf16_weight_gradients():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calls = Counter(record_step("tiny", 2, 16, False, "cpu"))
    by_layout = {}
    for key, count in calls.items():
        layout = (key[5], key[6])  # trans_a, trans_b
        by_layout[layout] = by_layout.get(layout, 0) + count
        assert key[0][2] == "bfloat16" and key[1][2] == "bfloat16"  # autocast's operands
        if layout == (True, True):
            assert key[7] is False  # the bf16 copies' gradients: bf16 out
    fwd, dgrad, wgrad = by_layout.get((False, False), 0), by_layout.get((False, True), 0), by_layout.get((True, True), 0)
    assert fwd >= 6 and wgrad == fwd and dgrad == fwd  # every input needs a gradient (trainable embeddings below)


def test_order_lists_every_call_in_the_steps_order():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        order = record_step("tiny", 2, 16, False, "cpu")
    calls = Counter(order)
    assert len(order) == sum(calls.values())
    assert all(order.count(key) == count for key, count in calls.items())
    first_wgrad = next(i for i, key in enumerate(order) if key[5] and key[6])
    assert all(not (key[5] and key[6]) for key in order[:first_wgrad]) and first_wgrad > 0  # forwards come first
