"""Several processes through Lightning's DDP, on CPU (gloo, 2 processes): fit, test and predict
finish with the throughput meter and the profiler on (no rank-0-only collective hangs), throughput
is global, and every prediction row is written exactly once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

from tests.conftest import sample_rows, write_jsonl

DDP = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp"]


def bertaccel(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "bertaccel", *args], cwd=cwd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        failed(out)
    return out


def failed(out: subprocess.CompletedProcess) -> None:
    """Fail with the command's exit status and the ends of its output, whole: an assertion message is cut to a line
    by pytest, which hides what a child process printed before it died."""
    pytest.fail(f"exit {out.returncode}: {' '.join(map(str, out.args[1:]))}\n--- stdout (end)\n{out.stdout[-3000:]}"
                f"\n--- stderr (end)\n{out.stderr[-8000:]}", pytrace=False)


def _subprocess_env(**extra: str) -> dict[str, str]:
    """This process's environment for a `bertaccel` subprocess that imports the tests' callbacks (the repository on
    PYTHONPATH), plus `extra`."""
    import os

    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")]), **extra)


def printed_metrics(stdout: str) -> dict[str, float]:
    """The metrics of Lightning's printed results table (`test/acc  0.51...`)."""
    import re

    return {m[1]: float(m[2]) for m in re.finditer(r"(test/[a-z0-9_]+)\W+([-+0-9.eE]+)", stdout)}


@pytest.mark.slow
def test_ddp_fit_test_predict_with_meter_and_profiler(tiny_config, tmp_path):
    # an odd number of test rows: DistributedSampler pads one rank's share with a repeated row
    data = tmp_path / "odd"
    write_jsonl(data / "train.jsonl", sample_rows("train", 160))
    write_jsonl(data / "test.jsonl", sample_rows("test", 47))
    cfg = tiny_config("ddp", epochs=1, dataset=str(data))
    meter = ["--throughput.enabled", "true", "--throughput.warmup_steps", "1", "--throughput.log_every_n_steps", "2"]
    profiler = ["--profiler.enabled", "true", "--profiler.skip_first", "0", "--profiler.warmup", "1", "--profiler.active", "1"]
    bertaccel("fit", "-c", cfg, *DDP, *meter, *profiler, cwd=tmp_path)
    run = tmp_path / "runs" / "ddp" / "version_0"
    stats = json.loads((run / "benchmark_stats.json").read_text())["train"]
    assert stats["world_size"] == 2 and len(stats["step_ms_p50_per_rank"]) == 2
    # global samples: 128 training rows over 2 ranks, 4 steps of 16 per rank; 1 warm-up step left out per rank
    assert stats["steps"] == 3 and stats["samples_per_s"] > 0
    assert (run / "profiler" / "profile_summary.json").is_file()

    ddp_test = bertaccel("test", "-c", cfg, *DDP, *meter, "--ckpt_path", "last", cwd=tmp_path)
    # the test metrics count each of the 47 rows once: the same numbers as one process evaluating all of them
    # (PyTorch's DistributedSampler would repeat one row on the second rank: 48 rows counted)
    one_test = bertaccel("test", "-c", cfg, "--trainer.accelerator", "cpu", "--trainer.devices", "1",
                         "--ckpt_path", "last", cwd=tmp_path)
    ddp_metrics, one_metrics = printed_metrics(ddp_test.stdout), printed_metrics(one_test.stdout)
    assert {"test/acc", "test/loss"} <= set(one_metrics), one_test.stdout[-2000:]
    for name in ("test/acc", "test/loss", "test/f1"):
        assert ddp_metrics[name] == pytest.approx(one_metrics[name], rel=1e-5, abs=1e-6), name
    out = tmp_path / "preds.jsonl"
    bertaccel("predict", "-c", cfg, *DDP, *meter, "--ckpt_path", "last", "--predictions.output_path", str(out), cwd=tmp_path)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(47))  # every row once, in dataset order
    assert all(r["label"] in (0, 1) and r["prediction"] in (0, 1) for r in rows)
    assert not list(tmp_path.glob("*.partial"))


@pytest.mark.slow
def test_ddp_resume_in_the_middle_of_an_epoch_equals_an_uninterrupted_run(tiny_config, tmp_path):
    """Two processes: a fit that crashes in the middle of epoch 0 (checkpoint at step 5 of 8), resumed
    with `--ckpt_path last`, ends with the weights of an uninterrupted 2-epoch fit (dropout on): each
    rank continues its own shard of the same order with the batch after the checkpoint."""
    import torch

    data = tmp_path / "even"
    write_jsonl(data / "train.jsonl", sample_rows("train", 320))  # 256 train rows: 8 steps of 16 per rank
    write_jsonl(data / "test.jsonl", sample_rows("test", 16))
    env = _subprocess_env()
    common = [*DDP, "--test_after_fit", "false", "--model.init_args.config",
              json.dumps({"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
                          "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1})]

    def fit(name: str, *extra: str, ok: bool = True) -> Path:
        cfg = tiny_config(name, epochs=2, dataset=str(data), val_size=64)
        out = subprocess.run([sys.executable, "-m", "bertaccel", "fit", "-c", cfg, *common, *extra], cwd=tmp_path,
                             capture_output=True, text=True, timeout=600, env=env)
        if (out.returncode == 0) != ok:
            failed(out)
        return tmp_path / "runs" / name / "checkpoints" / "last.ckpt"

    straight = torch.load(fit("ddp_straight"), weights_only=True)
    crashed = fit("ddp_resumed", "--trainer.callbacks", "tests.test_cli.CrashAtStep6",
                  "--checkpoint.every_n_train_steps", "5", ok=False)
    assert torch.load(crashed, weights_only=True)["global_step"] == 5  # in the middle of epoch 0
    resumed = torch.load(fit("ddp_resumed", "--ckpt_path", "last"), weights_only=True)
    assert resumed["global_step"] == straight["global_step"] == 16
    for k, v in straight["state_dict"].items():
        torch.testing.assert_close(resumed["state_dict"][k], v, rtol=1e-5, atol=1e-6, msg=k)


class GraphLoopOnCPU(Callback):
    """Runs the graph-mode training loop (module-driven optimizer step, gradients synced by the step
    itself) eagerly on CPU, as `model.cuda_graphs` does on a GPU; set before the module's setup."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        pl_module._capture_without_gpu = True
        pl_module._graph_decisions.clear()  # Lightning asked `automatic_optimization` before this hook

    def on_train_end(self, trainer, pl_module) -> None:
        import os

        from bertaccel.modules.sigterm_check import LaggedSigtermCheck

        steps = pl_module.graph_stats().get("train", {}).get("eager_steps")
        # one step function call a batch: the optimizer steps, or under accumulation the micro-batches
        expected = trainer.global_step if pl_module._accumulate == 1 else trainer.fit_loop.epoch_loop.total_batch_idx + 1
        if pl_module.automatic_optimization or steps != expected:
            raise RuntimeError(f"the graph-mode loop did not run every step ({steps} of {expected})")
        lagged = isinstance(trainer.fit_loop.epoch_loop.__dict__.get("_broadcast_sigterm_tensor"), LaggedSigtermCheck)
        if lagged != (os.environ.get("BERTACCEL_LAGGED_SIGTERM", "1") != "0"):
            raise RuntimeError(f"the lagged SIGTERM check installed: {lagged}, asked for: {not lagged}")


@pytest.mark.slow
def test_ddp_graph_mode_steps_sync_gradients_like_ddp(tiny_config, tmp_path):
    """2 processes, the graph-mode step (the captured one on a GPU: it all-reduces the gradients itself,
    Lightning's DDP reducer idle) trains to the weights of Lightning's DDP automatic optimization, with
    gradient clipping (which must see the global gradients). Without the step's all-reduce each rank
    would train on its own shard alone. The graph-mode fit runs with the lagged SIGTERM check
    (BERTACCEL_LAGGED_SIGTERM=1: the ranks' per-batch broadcast read one batch late)."""
    import torch

    data = tmp_path / "even"
    write_jsonl(data / "train.jsonl", sample_rows("train", 320))  # 256 train rows: 8 steps of 16 per rank
    write_jsonl(data / "test.jsonl", sample_rows("test", 16))
    env = _subprocess_env()
    common = [*DDP, "--test_after_fit", "false", "--trainer.gradient_clip_val", "0.5",
              "--data.init_args.static_shapes", "true", "--data.init_args.length_buckets", "16",
              "--model.init_args.config",
              json.dumps({"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
                          "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0})]

    def fit(name: str, *extra: str, lagged_sigterm: bool = False) -> tuple[dict, str]:
        cfg = tiny_config(name, epochs=1, dataset=str(data), val_size=64)
        out = subprocess.run([sys.executable, "-m", "bertaccel", "fit", "-c", cfg, *common, *extra], cwd=tmp_path,
                             capture_output=True, text=True, timeout=600,
                             env=dict(env, BERTACCEL_LAGGED_SIGTERM="1" if lagged_sigterm else "0"))
        if out.returncode != 0:
            failed(out)
        ckpt = torch.load(tmp_path / "runs" / name / "checkpoints" / "last.ckpt", weights_only=True)
        return ckpt, out.stdout + out.stderr

    eager, _ = fit("ddp_eager")
    graph, _ = fit("ddp_graph_loop", "--model.init_args.cuda_graphs", "true",
                     "--trainer.callbacks", "tests.test_ddp.GraphLoopOnCPU", lagged_sigterm=True)
    assert graph["global_step"] == eager["global_step"] == 8
    for k, v in eager["state_dict"].items():
        torch.testing.assert_close(graph["state_dict"][k], v, rtol=1e-4, atol=1e-5, msg=k)


class RecordRowLengths(Callback):
    """Appends, per rank, each training batch's real row lengths (longest first) to ROW_LENGTHS_DIR/rank{r}.jsonl."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        import os

        lengths = sorted(batch["attention_mask"].sum(1).tolist(), reverse=True)
        with (Path(os.environ["ROW_LENGTHS_DIR"]) / f"rank{trainer.global_rank}.jsonl").open("a") as f:
            f.write(json.dumps(lengths) + "\n")


@pytest.mark.slow
def test_ddp_ranks_train_on_rows_of_one_length_group_at_each_step(tiny_config, tmp_path):
    """With `data.group_by_length` under DDP (2 processes) each step's batches on the two ranks are the two
    halves of one group of rows sorted by length, dealt alternately (Lightning's distributed sampler wrapper
    gives rank r every second row): rank 0's longest row >= rank 1's longest >= rank 0's second longest, at
    every step. Grouped per rank instead, a step's two batches come from differently long groups, and both
    ranks wait for the longer one."""
    data = tmp_path / "data"
    write_jsonl(data / "train.jsonl", sample_rows("train", 320))
    write_jsonl(data / "test.jsonl", sample_rows("test", 16))
    marks = tmp_path / "lengths"
    marks.mkdir()
    cfg = tiny_config("ddp_grouped", epochs=1, dataset=str(data), val_size=64, group_by_length=True, batch_size=8)
    env = _subprocess_env(ROW_LENGTHS_DIR=str(marks))
    out = subprocess.run([sys.executable, "-m", "bertaccel", "fit", "-c", cfg, *DDP, "--test_after_fit", "false",
                          "--trainer.callbacks", "tests.test_ddp.RecordRowLengths"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    if out.returncode != 0:
        failed(out)
    steps = [[json.loads(line) for line in (marks / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    assert len(steps[0]) == len(steps[1]) == 16  # 256 training rows, 8 per rank and step
    spread = 0
    for k, (a, b) in enumerate(zip(*steps)):
        assert a[0] >= b[0] >= a[1], (k, a, b)
        spread += a[0] - a[-1]
    assert spread > 0  # the rows' lengths differ: the check above means something


@pytest.mark.slow
@pytest.mark.parametrize("switches, said, accumulate", [
    (["BERTACCEL_GRAD_SYNC_OVERLAP"], "bucket by bucket during the backward", 1),
    (["BERTACCEL_EMBEDDING_ROW_SYNC"], "by the rows of the batch's token ids", 1),
    (["BERTACCEL_GRAD_SYNC_OVERLAP", "BERTACCEL_EMBEDDING_ROW_SYNC"], "by the rows of the batch's token ids", 1),
    (["BERTACCEL_EMBEDDING_ROW_SYNC"], "by the rows of the batch's token ids", 3),
], ids=["overlapped", "embedding-rows", "overlapped-embedding-rows", "embedding-rows-accumulate-3"])
def test_ddp_graph_mode_steps_with_the_sync_overlapped_equal_the_sync_after_the_backward(tiny_config, tmp_path, switches,
                                                                                         said, accumulate):
    """2 processes, bf16-mixed (bf16 weight copies, our fused AdamW: the path `BERTACCEL_GRAD_SYNC_OVERLAP=1`
    changes): the gradient all-reduce sent bucket by bucket from the backward's gradient hooks trains to the same
    weights, bit for bit, as the one all-reduce after the backward (each gradient is summed once either way). So
    does `BERTACCEL_EMBEDDING_ROW_SYNC=1`: the word embeddings' gradient summed by the rows the ranks' ids touch
    (on 2 ranks each row's sum is a + b either way; the ranks' batches have different lengths), and both together
    (the table's bucket, the last, summed by its rows from the backward's hooks), and the rows sync under gradient
    accumulation (3 micro-batches an update, the epoch's 8 ending in a short one: the rows of every micro-batch)."""
    data = tmp_path / "even"
    write_jsonl(data / "train.jsonl", sample_rows("train", 320))
    write_jsonl(data / "test.jsonl", sample_rows("test", 16))
    env = _subprocess_env()
    common = [*DDP, "--test_after_fit", "false", "--trainer.precision", "bf16-mixed",
              "--data.init_args.static_shapes", "true", "--data.init_args.length_buckets", "16",
              "--model.init_args.cuda_graphs", "true", "--trainer.callbacks", "tests.test_ddp.GraphLoopOnCPU",
              "--model.init_args.config",
              json.dumps({"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
                          "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0})]

    def fit(name: str, overlap: bool) -> dict:
        cfg = tiny_config(name, epochs=1, dataset=str(data), val_size=64)
        out = subprocess.run([sys.executable, "-m", "bertaccel", "fit", "-c", cfg, *common,
                              "--trainer.accumulate_grad_batches", str(accumulate)], cwd=tmp_path,
                             capture_output=True, text=True, timeout=600, env={**env, **{k: ("always" if k == "BERTACCEL_EMBEDDING_ROW_SYNC" else "1") if overlap else "0"
                                                for k in switches}})
        if out.returncode != 0:
            failed(out)
        assert (said in out.stdout + out.stderr) == overlap, (out.stdout[-2000:], out.stderr[-3000:])
        return torch.load(tmp_path / "runs" / name / "checkpoints" / "last.ckpt", weights_only=True)

    after, overlapped = fit("sync_after", False), fit("sync_overlapped", True)
    assert overlapped["global_step"] == after["global_step"] == (8 if accumulate == 1 else 3)
    for k, v in after["state_dict"].items():
        torch.testing.assert_close(overlapped["state_dict"][k], v, rtol=0, atol=0, msg=k)


@pytest.mark.slow
def test_ddp_graph_mode_sums_the_embedding_rows_by_default_where_they_pay(tiny_config, tmp_path):
    """With BERTACCEL_EMBEDDING_ROW_SYNC unset, a graph-mode DDP fit (2 processes, bf16-mixed) whose ranks' ids are
    few against the vocabulary (4 x 16 ids a rank, 2 ranks: 128 < 2 x the tokenizer's 253 rows) sums the word
    embeddings' gradient by its rows without being asked, says so, and trains to the weights of the fit with it off
    (=0), bit for bit; with 16 x 48 ids a rank (1,536 > 506) it keeps the whole table, saying why."""
    data = tmp_path / "even"
    write_jsonl(data / "train.jsonl", sample_rows("train", 320))
    write_jsonl(data / "test.jsonl", sample_rows("test", 16))
    env = _subprocess_env()
    env.pop("BERTACCEL_EMBEDDING_ROW_SYNC", None)
    common = [*DDP, "--test_after_fit", "false", "--trainer.precision", "bf16-mixed", "--trainer.limit_train_batches", "6",
              "--data.init_args.static_shapes", "true", "--model.init_args.cuda_graphs", "true",
              "--trainer.callbacks", "tests.test_ddp.GraphLoopOnCPU"]

    def fit(name: str, rows: str | None, batch: int, length: int) -> tuple[dict, str]:
        cfg = tiny_config(name, epochs=1, dataset=str(data), val_size=64, batch_size=batch, max_length=length,
                          length_buckets=length)
        out = subprocess.run([sys.executable, "-m", "bertaccel", "fit", "-c", cfg, *common], cwd=tmp_path,
                             capture_output=True, text=True, timeout=600,
                             env=env if rows is None else {**env, "BERTACCEL_EMBEDDING_ROW_SYNC": rows})
        if out.returncode != 0:
            failed(out)
        return (torch.load(tmp_path / "runs" / name / "checkpoints" / "last.ckpt", weights_only=True),
                out.stdout + out.stderr)

    rows_said = "summed over the ranks by the rows of the batch's token ids (64 a rank)"
    default, said = fit("default", None, 4, 16)
    assert rows_said in said, said[-3000:]
    off, said_off = fit("off", "0", 4, 16)
    assert "by the rows" not in said_off, said_off[-3000:]
    assert default["global_step"] == off["global_step"] == 6
    for k, v in off["state_dict"].items():
        torch.testing.assert_close(default["state_dict"][k], v, rtol=0, atol=0, msg=k)
    _, said_wide = fit("wide", None, 16, 48)
    assert "all-reduced whole: 2 ranks x 768 ids a rank" in said_wide and rows_said not in said_wide, said_wide[-3000:]


@pytest.mark.slow
def test_ddp_masked_lm_with_the_embedding_rows_sync_all_reduces_the_tied_table_whole(tmp_path):
    """A masked-LM's word embeddings are tied to its decoder, whose gradient reaches every row: with
    `BERTACCEL_EMBEDDING_ROW_SYNC=always` (the tiny vocabulary would otherwise keep the whole table) the first sync finds rows outside the batch's ids, says so, and all-reduces the
    table whole - the graph-mode DDP fit (2 processes) ends with the weights of the fit without the switch, bit for bit
    (summing only the batch's rows would have dropped the decoder's gradient elsewhere)."""
    import yaml

    from tests.conftest import TINY_BERT

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"the film number {i} was {'good' if i % 2 else 'bad'} and long, said the critic"
                                for i in range(400)))
    cfg = {
        "seed_everything": 5,
        "trainer": {"max_epochs": 1, "log_every_n_steps": 1, "enable_model_summary": False, "limit_train_batches": 6,
                    "limit_val_batches": 0, "callbacks": [{"class_path": "tests.test_ddp.GraphLoopOnCPU"}]},
        "model": {"class_path": "bertaccel.modules.BertMLM",
                  "init_args": {"config": TINY_BERT, "lr": 3e-3, "warmup_ratio": 0.1, "cuda_graphs": True}},
        "data": {"class_path": "bertaccel.data.MLMDataModule",
                 "init_args": {"train_files": [str(corpus)], "tokenizer": "sample:sentiment", "block_size": 32,
                               "batch_size": 8, "val_size": 0.1}},
    }
    path = tmp_path / "mlm.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = _subprocess_env()
    states, said = {}, {}
    for rows in ("0", "1"):
        name = f"mlm_rows{rows}"
        out = subprocess.run([sys.executable, "-m", "bertaccel", "fit", "-c", str(path), *DDP,
                              "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
                              "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
                              "--trainer.logger.init_args.name", name], cwd=tmp_path, capture_output=True, text=True,
                             timeout=600, env={**env, "BERTACCEL_EMBEDDING_ROW_SYNC": "always" if rows == "1" else "0"})
        if out.returncode != 0:
            failed(out)
        said[rows] = out.stdout + out.stderr
        states[rows] = torch.load(tmp_path / "runs" / name / "checkpoints" / "last.ckpt", weights_only=True)
    assert "all-reduced whole" in said["1"] and "all-reduced whole" not in said["0"]
    assert states["1"]["global_step"] == states["0"]["global_step"] > 0
    for k, v in states["0"]["state_dict"].items():
        torch.testing.assert_close(states["1"]["state_dict"][k], v, rtol=0, atol=0, msg=k)


class SigtermOnRank0(Callback):
    """Sends SIGTERM to rank 0's own process at its third training batch (as a scheduler's preemption
    notice would) and records, per rank, every training batch that started (SIGTERM_TEST_DIR). With
    SIGTERM_RANK0_ONLY=1 rank 0's launcher first forgets the rank it started, so that the handler cannot
    pass the signal on (as under torchrun or SLURM, where rank 0 launches no rank): the other rank then
    hears of it only through the per-batch agreement."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        import os
        import signal

        out = Path(os.environ["SIGTERM_TEST_DIR"]) / f"rank{trainer.global_rank}.txt"
        with out.open("a") as f:
            f.write(f"{batch_idx}\n")
        if trainer.global_rank == 0 and batch_idx == 2:
            if os.environ.get("SIGTERM_RANK0_ONLY") == "1":
                trainer.strategy.launcher.procs = []
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow
@pytest.mark.parametrize("lagged, rank0_only", [(True, False), (True, True), (False, False)],
                         ids=["lagged-passed-on", "lagged-rank0-only", "lightning-passed-on"])
def test_ddp_sigterm_on_rank_0_stops_every_rank_at_the_same_batch(tiny_config, tmp_path, lagged, rank0_only):
    """A SIGTERM delivered to rank 0 in the middle of an epoch stops both ranks of a 2-process DDP fit after
    the same batches: no rank hangs in a collective the other never joins, none trains on to the end of the
    epoch. With the lagged check (the default, modules/sigterm_check.py) also where the signal reaches rank
    0 alone; Lightning's own handling hangs there (its handler broadcasts from inside the signal handler), so
    that case is run with the lagged check only."""
    data = tmp_path / "even"
    write_jsonl(data / "train.jsonl", sample_rows("train", 640))  # 512 train rows: 16 steps of 16 per rank
    write_jsonl(data / "test.jsonl", sample_rows("test", 16))
    marks = tmp_path / "marks"
    marks.mkdir()
    env = _subprocess_env(SIGTERM_TEST_DIR=str(marks), BERTACCEL_LAGGED_SIGTERM="1" if lagged else "0",
                          SIGTERM_RANK0_ONLY="1" if rank0_only else "0")
    cfg = tiny_config("ddp_sigterm", epochs=1, dataset=str(data), val_size=128)
    out = subprocess.run([sys.executable, "-m", "bertaccel", "fit", "-c", cfg, *DDP, "--test_after_fit", "false",
                          "--trainer.callbacks", "tests.test_ddp.SigtermOnRank0"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert "Received SIGTERM" in out.stderr + out.stdout, out.stderr[-3000:]
    started = {r: [int(x) for x in (marks / f"rank{r}.txt").read_text().split()] for r in (0, 1)}
    assert started[0] == started[1], (started, out.stderr[-3000:])  # the same batches on both ranks
    assert started[0][:3] == [0, 1, 2] and max(started[0]) < 15, started  # stopped within the epoch
    if lagged:
        # every rank raises Lightning's SIGTERMException (a SystemExit without a code) after the same batch
        if out.returncode != 0:
            failed(out)
    # (Lightning's own handling: its handler's broadcast and the launcher's kill race the other rank's exit,
    # and about one run in four rank 0 ends in a gloo "Connection reset by peer", status 1)


@pytest.mark.slow
def test_ddp_fit_with_the_last_layer_at_cls_only(tiny_config, tmp_path):
    """`model.last_layer_cls_only` under DDP (2 processes): the fit finishes (every parameter still gets a gradient:
    DDP's reducer raises on one that does not) and its checkpoint tests to the same metrics on 2 processes as on one.
    (That the option computes the whole layer's function: tests/modules/test_cls_only.py.)"""
    data = tmp_path / "data"
    write_jsonl(data / "train.jsonl", sample_rows("train", 96))
    write_jsonl(data / "test.jsonl", sample_rows("test", 31))
    cfg = tiny_config("ddp_cls", epochs=1, dataset=str(data))
    bertaccel("fit", "-c", cfg, *DDP, "--model.init_args.last_layer_cls_only", "true", "--test_after_fit", "false",
              cwd=tmp_path)
    ckpt = torch.load(tmp_path / "runs" / "ddp_cls" / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    assert ckpt["hyper_parameters"]["last_layer_cls_only"] is True  # (the test runs take it from the checkpoint)
    two = printed_metrics(bertaccel("test", "-c", cfg, *DDP, "--ckpt_path", "last", cwd=tmp_path).stdout)
    one = printed_metrics(bertaccel("test", "-c", cfg, "--trainer.accelerator", "cpu", "--trainer.devices", "1",
                                    "--ckpt_path", "last", cwd=tmp_path).stdout)
    assert {"test/acc", "test/loss"} <= set(one)
    for name in ("test/acc", "test/loss"):
        assert two[name] == pytest.approx(one[name], rel=1e-5, abs=1e-6), name


@pytest.mark.slow
def test_ddp_masked_lm_fit_with_the_last_layer_at_the_masked_positions(tmp_path):
    """`model.last_layer_masked_only` under DDP (2 processes, no dropout): the fit finishes (every parameter gets a
    gradient on every rank) and validates to the same loss as the same DDP fit with the whole last layer, and its
    checkpoint validates to that loss on one process too (the option restored from the checkpoint)."""
    import re

    import yaml

    from tests.conftest import TINY_BERT

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"the film number {i} was {'good' if i % 2 else 'bad'} and long, said the critic"
                                for i in range(400)))
    cfg = {
        "seed_everything": 5,
        "trainer": {"max_epochs": 1, "accelerator": "cpu", "devices": 1, "log_every_n_steps": 1,
                    "enable_model_summary": False, "limit_train_batches": 8,
                    "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                               "init_args": {"save_dir": str(tmp_path / "runs"), "name": "mlm"}}},
        "model": {"class_path": "bertaccel.modules.BertMLM",
                  "init_args": {"config": TINY_BERT, "lr": 3e-3, "warmup_ratio": 0.1}},
        "data": {"class_path": "bertaccel.data.MLMDataModule",
                 "init_args": {"train_files": [str(corpus)], "tokenizer": "sample:sentiment", "block_size": 32,
                               "batch_size": 8, "val_size": 0.1}},
    }
    path = tmp_path / "mlm.yaml"
    path.write_text(yaml.safe_dump(cfg))

    def val_loss(stdout: str) -> float:
        return float(re.findall(r"val/loss\W+([-+0-9.eE]+)", stdout)[-1])

    losses = {}
    for option in ("false", "true"):
        name = f"mlm_{option}"
        bertaccel("fit", "-c", str(path), *DDP, "--model.init_args.last_layer_masked_only", option,
                  "--trainer.logger.init_args.name", name, cwd=tmp_path)
        ckpt = tmp_path / "runs" / name / "checkpoints" / "last.ckpt"
        assert torch.load(ckpt, weights_only=False, map_location="cpu")["hyper_parameters"]["last_layer_masked_only"] is (
            option == "true")
        losses[option] = val_loss(bertaccel("validate", "-c", str(path), *DDP, "--ckpt_path", str(ckpt),
                                            "--trainer.logger.init_args.name", name, cwd=tmp_path).stdout)
    assert losses["true"] == pytest.approx(losses["false"], rel=1e-4)
    one = val_loss(bertaccel("validate", "-c", str(path), "--ckpt_path",
                             str(tmp_path / "runs" / "mlm_true" / "checkpoints" / "last.ckpt"), cwd=tmp_path).stdout)
    assert one == pytest.approx(losses["true"], rel=1e-5)


class RecordGraphStats(Callback):
    """Writes each rank's `graph_stats()` at the end of the fit, and rank 0's initial weights (fp32, CPU), into
    GRAPH_STATS_DIR: what ran captured and what the training moved."""

    def on_train_start(self, trainer, pl_module) -> None:
        import os

        if trainer.global_rank == 0:
            init = {k: v.detach().float().cpu() for k, v in pl_module.state_dict().items()}
            torch.save(init, Path(os.environ["GRAPH_STATS_DIR"]) / f"init_{os.environ['GRAPH_STATS_RUN']}.pt")

    def on_train_end(self, trainer, pl_module) -> None:
        import os

        out = Path(os.environ["GRAPH_STATS_DIR"]) / f"stats_{os.environ['GRAPH_STATS_RUN']}_rank{trainer.global_rank}.json"
        out.write_text(json.dumps(pl_module.graph_stats(), default=str))


def _two_gpu_fit(tmp_path: Path, name: str, graphs: bool, precision: str = "32-true", accumulate: int = 1,
                 clip: float | None = None, env_extra: dict | None = None) -> tuple[dict, list[dict]]:
    """A 3-epoch DDP fit of the tiny classifier on 2 GPUs (NCCL) through the CLI; its last checkpoint and its
    CSV rows. Each rank's graph_stats and rank 0's initial weights go to tmp_path / "stats"."""
    import csv

    import yaml

    from tests.conftest import TINY_BERT

    data = tmp_path / "even"
    if not data.exists():
        write_jsonl(data / "train.jsonl", sample_rows("train", 320))  # 256 train rows: 8 micro-batches of 16 per rank
        write_jsonl(data / "test.jsonl", sample_rows("test", 16))
    stats_dir = tmp_path / "stats"
    stats_dir.mkdir(exist_ok=True)
    env = _subprocess_env(GRAPH_STATS_DIR=str(stats_dir), GRAPH_STATS_RUN=name, **(env_extra or {}))
    cfg = {
        "seed_everything": 7,
        "trainer": {"max_epochs": 3, "accelerator": "gpu", "devices": 2, "strategy": "ddp", "precision": precision,
                    "log_every_n_steps": 1, "enable_model_summary": False,
                    "accumulate_grad_batches": accumulate, "gradient_clip_val": clip,
                    "callbacks": [{"class_path": "tests.test_ddp.RecordGraphStats"}],
                    "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                               "init_args": {"save_dir": str(tmp_path / "runs"), "name": name}}},
        "model": {"class_path": "bertaccel.modules.BertClassifier",
                  "init_args": {"config": {**TINY_BERT, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
                                "lr": 3e-3, "warmup_ratio": 0.1, "cuda_graphs": graphs, "log_grad_norm": True}},
        "data": {"class_path": "bertaccel.data.TextClassificationDataModule",
                 "init_args": {"dataset": str(data), "tokenizer": "sample:sentiment", "max_length": 48, "batch_size": 16,
                               "val_size": 64, "static_shapes": True, "length_buckets": 16}},
        "test_after_fit": False,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = subprocess.run([sys.executable, "-m", "bertaccel", "fit", "-c", str(path)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600, env=env)
    if out.returncode != 0:
        failed(out)
    (tmp_path / f"{name}.log").write_text(out.stdout + out.stderr)
    ckpt = torch.load(tmp_path / "runs" / name / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    (metrics,) = (tmp_path / "runs" / name).rglob("metrics.csv")
    with open(metrics) as f:
        rows = list(csv.DictReader(f))
    return ckpt, rows


def _replayed_on_both_ranks(tmp_path: Path, name: str) -> None:
    for rank in (0, 1):
        train = json.loads((tmp_path / "stats" / f"stats_{name}_rank{rank}.json").read_text())["train"]
        assert train["disabled"] is None and train["captured"] and train["replays"] > 0, (name, rank, train)


def _assert_same_training(tmp_path: Path, init_run: str, a: dict, b: dict) -> None:
    """a's weights equal b's within 5% of each parameter's update (Adam turns rounding noise into updates)."""
    init = torch.load(tmp_path / "stats" / f"init_{init_run}.pt", weights_only=True)
    for k, v in a["state_dict"].items():
        if not v.is_floating_point() or k.endswith("attention.self.key.bias"):  # (its exact gradient is 0: noise)
            continue
        update = (v.float() - init[k]).norm()
        diff = (b["state_dict"][k].float() - v.float()).norm()
        assert diff <= 0.05 * update + 1e-6, f"{k}: |a - b| {diff:.3g} vs the update {update:.3g}"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_ddp_graphed_steps_on_two_gpus_train_and_log_as_eager_ddp(tmp_path):
    """2 GPUs, NCCL: a DDP fit whose training steps replay CUDA graphs (the gradient all-reduce captured in the
    step) ends with the weights of Lightning's eager DDP fit, and logs the same train/loss and train/grad_norm
    rows at the same steps, under gradient accumulation (2 micro-batches; only the last one syncs) and
    clipping. Both ranks really replay graphs (no silent fall-back to eager steps)."""
    eager, eager_rows = _two_gpu_fit(tmp_path, "eager", graphs=False, accumulate=2, clip=0.5)
    graphed, graphed_rows = _two_gpu_fit(tmp_path, "graphed", graphs=True, accumulate=2, clip=0.5)
    _replayed_on_both_ranks(tmp_path, "graphed")
    assert graphed["global_step"] == eager["global_step"] == 12  # 3 epochs of 4 optimizer steps

    def logged(rows: list[dict], key: str) -> list[tuple[int, float]]:
        return [(int(r["step"]), float(r[key])) for r in rows if r.get(key)]

    for key in ("train/loss", "train/grad_norm"):
        e, g = logged(eager_rows, key), logged(graphed_rows, key)
        assert len(e) >= 6 and [s for s, _ in g] == [s for s, _ in e], (key, e, g)
        assert [v for _, v in g] == pytest.approx([v for _, v in e], rel=2e-2), key
    _assert_same_training(tmp_path, "eager", eager, graphed)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("switch, value, said, accumulate", [
    ("BERTACCEL_GRAD_SYNC_OVERLAP", "1", "bucket by bucket during the backward", 1),
    ("BERTACCEL_EMBEDDING_ROW_SYNC", "always", "summed over the ranks by the rows of the batch's token ids", 1),
    ("BERTACCEL_EMBEDDING_ROW_SYNC", "always", "summed over the ranks by the rows of the batch's token ids", 2),
], ids=["overlapped", "embedding-rows", "embedding-rows-accumulate-2"])
def test_ddp_graphed_bf16_steps_with_a_sync_variant_on_two_gpus(tmp_path, switch, value, said, accumulate):
    """2 GPUs, bf16-mixed (bf16 weight copies, our fused AdamW): each gradient sync variant trains as the one
    all-reduce after the backward does, both replaying graphs on both ranks - `BERTACCEL_GRAD_SYNC_OVERLAP=1` (the
    all-reduce bucket by bucket on a side stream from the backward's gradient hooks, captured into the step's graph)
    and the word embeddings' gradient summed by the rows the ranks' ids touch (`BERTACCEL_EMBEDDING_ROW_SYNC`, on by
    default; two all-gathers captured into the step's graph; `always`: the tiny vocabulary would keep the whole table),
    also under gradient accumulation (2 micro-batches an update: the ids of both, in slots a captured device counter
    picks)."""
    plain, _ = _two_gpu_fit(tmp_path, "sync_plain", graphs=True, precision="bf16-mixed", accumulate=accumulate,
                            env_extra={switch: "0"})
    variant, _ = _two_gpu_fit(tmp_path, "sync_variant", graphs=True, precision="bf16-mixed", accumulate=accumulate,
                              env_extra={switch: value})
    for name in ("sync_plain", "sync_variant"):
        _replayed_on_both_ranks(tmp_path, name)
    assert said in (tmp_path / "sync_variant.log").read_text() and said not in (tmp_path / "sync_plain.log").read_text()
    assert variant["global_step"] == plain["global_step"] == 24 // accumulate
    _assert_same_training(tmp_path, "sync_plain", plain, variant)
