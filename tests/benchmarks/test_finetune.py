"""benchmarks/finetune.py's rounds: each variant's numbers are its median round's, every round kept."""

from benchmarks.finetune import summarize_rounds


def test_a_variant_is_its_median_round_with_every_round_kept():
    runs = [{"train_samples_per_s": 9.0, "test_acc": 0.8, "extra": "a"},
            {"train_samples_per_s": 4.0, "test_acc": 0.7, "extra": "b"},
            {"error": "rc=1: boom"},
            {"train_samples_per_s": 11.0, "test_acc": 0.9, "extra": "c"}]
    out = summarize_rounds(runs)
    assert out["extra"] == "a" and out["train_samples_per_s"] == 9.0  # the median of 4, 9, 11 (failed round left out)
    assert [r.get("train_samples_per_s") for r in out["rounds"]] == [9.0, 4.0, None, 11.0]
    assert out["rounds"][2] == {"error": "rc=1: boom"}
    two = summarize_rounds(runs[:2])
    assert two["extra"] == "b"  # an even count: the lower middle round
    one = summarize_rounds(runs[:1])
    assert one == runs[0] and "rounds" not in one
    assert summarize_rounds([{"error": "x"}]) == {"error": "x"}
