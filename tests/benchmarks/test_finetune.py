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


def test_round_lines_give_each_rounds_ratio_against_the_same_rounds_plain_loop():
    """The table's ratio is of median rounds; the round lines pair each round with the plain loop of that round."""
    from benchmarks.finetune import round_lines

    results = {"plain": summarize_rounds([{"train_samples_per_s": 1000.0}, {"train_samples_per_s": 1500.0}]),
               "fast": summarize_rounds([{"train_samples_per_s": 9000.0}, {"error": "rc=1"}])}
    lines = round_lines(results, ["fast", "plain"])
    assert lines[1].split() == ["fast", "9,000", "failed"] and lines[2].split() == ["plain", "1,000", "1,500"]
    assert lines[-1].split() == ["fast", "9.00", "-"]  # 9,000 / round 1's 1,000; round 2 failed
    assert not any("x plain" in line for line in round_lines({"fast": results["fast"]}, ["fast"]))


def test_compile_stats_count_the_graphs_and_seconds_torch_compile_spends():
    """The plain compiled loop's compile work inside its timed steps is the difference of two readings: a call with
    a new shape compiles another graph and adds compile seconds; a call with a seen shape adds neither."""
    import torch

    from benchmarks.finetune import compile_stats

    torch._dynamo.reset()
    f = torch.compile(lambda x: torch.sin(x) * 2, dynamic=False)
    f(torch.randn(3))
    graphs0, secs0 = compile_stats()
    f(torch.randn(3))
    assert compile_stats() == (graphs0, secs0)
    f(torch.randn(5))
    graphs1, secs1 = compile_stats()
    assert graphs1 == graphs0 + 1 and secs1 > secs0


def test_the_table_gives_ratios_to_both_plain_loops_and_dashes_for_what_was_not_measured(monkeypatch, tmp_path, capsys):
    """The headline's table (run on the GPU host after every variant ran): each run against the eager and the compiled
    plain loop, and '-' (not 0) for a test rate the meter did not measure."""
    import torch

    from benchmarks import finetune

    fake = {"plain": {"train_samples_per_s": 2000.0, "test_samples_per_s": 3000.0, "test_acc": 0.88},
            "plain-compile": {"train_samples_per_s": 8000.0, "test_samples_per_s": 250.0, "test_acc": 0.89},
            "cli-recommended": {"train_samples_per_s": 12000.0, "test_samples_per_s": None, "test_acc": 0.888,
                                "train_step_ms_p50": 2.5, "train_slowest_steps_ms": [3.1]}}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "FakeGPU")
    monkeypatch.setattr(finetune, "run_variant", lambda args, v: dict(fake[v]))
    finetune.main(["--data", str(tmp_path), "--model", str(tmp_path), "--runs", str(tmp_path),
                   "--variants", "cli-recommended", "plain", "plain-compile"])
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()
            if line.split() and line.split()[0] in fake}
    assert rows["cli-recommended"][1:5] == ["12,000", "6.00", "1.50", "-"], rows
    assert rows["plain"][1:5] == ["2,000", "1.00", "0.25", "3,000"], rows
