"""The `bertaccel` command end to end on tiny configs: fit / validate / test / predict, resume,
checkpoint evaluation, and that every shipped YAML parses and instantiates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

from bertaccel.cli import SHIPPED_CONFIGS, BertAccelCLI, main
from tests.conftest import TINY_BERT

REPO = Path(__file__).resolve().parents[1]


def cli(*args: str) -> BertAccelCLI:
    return BertAccelCLI(args=list(args))


def test_fit_checkpoints_and_tests_the_best(tiny_config, tmp_path):
    run = cli("fit", "-c", tiny_config("fit"), "--test_after_fit", "true")
    ckpt = run.trainer.checkpoint_callback
    assert Path(ckpt.best_model_path).is_file()
    assert (tmp_path / "runs" / "fit" / "checkpoints" / "last.ckpt").is_file()
    metrics = run.trainer.callback_metrics
    assert {"test/acc", "test/f1", "test/loss"} <= set(metrics)
    assert 0.0 <= float(metrics["test/acc"]) <= 1.0


def test_validate_from_best_checkpoint_reproduces_the_in_run_metric(tiny_config):
    cfg = tiny_config("repro")
    run = cli("fit", "-c", cfg)
    best_score = float(run.trainer.checkpoint_callback.best_model_score)
    # a fresh process-like run: the CLI resolves "best" from the experiment's checkpoint folder
    again = cli("validate", "-c", cfg, "--ckpt_path", "best")
    assert float(again.trainer.callback_metrics["val/acc"]) == best_score
    tested = cli("test", "-c", cfg, "--ckpt_path", "best")
    assert "test/acc" in tested.trainer.callback_metrics


class CrashAtStep6(Callback):
    """Crashes a run in the middle of its first epoch (8 batches); its last checkpoint is step 5's."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == 6:
            raise RuntimeError("simulated crash")


class StopAfterEpochs(Callback):
    """Stops a run after `epochs` epochs, as an interruption would (the config stays the same)."""

    def __init__(self, epochs: int = 1) -> None:
        self.epochs = epochs

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch + 1 >= self.epochs:
            trainer.should_stop = True


@pytest.mark.parametrize(("dropout", "stop", "optimizer"),
                         [(0.0, "StopAfterEpochs", "adamw"), (0.1, "StopAfterEpochs", "adamw"),
                          (0.1, "CrashAtStep6", "adamw"), (0.0, "CrashAtStep6", "adamw"), (0.1, "CrashAtStep6", "normuon")],
                         ids=["epoch-end", "epoch-end-dropout", "mid-epoch-crash-dropout", "mid-epoch-crash",
                              "mid-epoch-crash-normuon"])
def test_resume_from_last_equals_an_uninterrupted_run(tiny_config, dropout, stop, optimizer):
    """With dropout on, equality needs the random states in the checkpoint (dropout masks); in the
    middle of an epoch, also the loader's position; with NorMuon, its momentum and second moments."""
    model = ["--model.init_args.config", json.dumps({**TINY_BERT, "hidden_dropout_prob": dropout,
                                                      "attention_probs_dropout_prob": dropout}),
             "--model.init_args.optimizer", optimizer]
    straight = cli("fit", "-c", tiny_config("straight", epochs=2), *model)
    cfg = tiny_config("resumed", epochs=2)
    if stop == "CrashAtStep6":
        with pytest.raises(RuntimeError, match="simulated crash"):
            cli("fit", "-c", cfg, *model, "--trainer.callbacks", f"tests.test_cli.{stop}",
                "--checkpoint.every_n_train_steps", "5")
        last = torch.load(Path(cfg).parent / "runs" / "resumed" / "checkpoints" / "last.ckpt", weights_only=True)
        assert last["global_step"] == 5  # in the middle of epoch 0
    else:
        first = cli("fit", "-c", cfg, *model, "--trainer.callbacks", f"tests.test_cli.{stop}")
        assert first.trainer.global_step == straight.trainer.global_step // 2
    resumed = cli("fit", "-c", cfg, *model, "--ckpt_path", "last")
    assert resumed.trainer.global_step == straight.trainer.global_step
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)
    lr_a = straight.trainer.optimizers[0].param_groups[0]["lr"]
    lr_b = resumed.trainer.optimizers[0].param_groups[0]["lr"]
    assert lr_a == pytest.approx(lr_b)


def test_mlm_resume_in_the_middle_of_an_epoch_equals_an_uninterrupted_run(tmp_path, tiny_data):
    """Masked-LM pretraining: crash at step 6 (checkpoint at step 5, mid-epoch), resume with
    `--ckpt_path last`; the weights equal an uninterrupted run's (masks are drawn per (epoch, block),
    dropout from the restored random streams)."""
    import yaml

    def config(name: str) -> str:
        cfg = {
            "seed_everything": 3,
            "trainer": {"max_epochs": 2, "accelerator": "cpu", "devices": 1, "enable_model_summary": False,
                        "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                                   "init_args": {"save_dir": str(tmp_path / "runs"), "name": name}}},
            "model": {"class_path": "bertaccel.modules.BertMLM",
                      "init_args": {"config": {**TINY_BERT, "hidden_dropout_prob": 0.1}, "lr": 3e-3}},
            "data": {"class_path": "bertaccel.data.MLMDataModule",
                     "init_args": {"train_files": [str(tiny_data / "train.jsonl")], "tokenizer": "sample:sentiment",
                                   "block_size": 32, "batch_size": 8, "val_size": 0.1}},
        }
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return str(path)

    quick = ["--trainer.limit_val_batches", "2"]
    straight = cli("fit", "-c", config("mlm_straight"), *quick)
    cfg = config("mlm_resumed")
    with pytest.raises(RuntimeError, match="simulated crash"):
        cli("fit", "-c", cfg, *quick, "--trainer.callbacks", "tests.test_cli.CrashAtStep6",
            "--checkpoint.every_n_train_steps", "5")
    last = torch.load(tmp_path / "runs" / "mlm_resumed" / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 5 and last["loops"]["fit_loop"]["epoch_progress"]["current"]["completed"] == 0
    resumed = cli("fit", "-c", cfg, *quick, "--ckpt_path", "last")
    assert resumed.trainer.global_step == straight.trainer.global_step > 6
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


def test_predict_writes_labels_and_probabilities(tiny_config, tmp_path):
    cfg = tiny_config("pred", epochs=1)
    cli("fit", "-c", cfg)
    out = tmp_path / "preds.jsonl"
    cli("predict", "-c", cfg, "--ckpt_path", "last", "--predictions.output_path", str(out))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 48  # every test row, once
    assert sorted(r["index"] for r in rows) == list(range(48))
    for r in rows:
        assert r["prediction"] == max(range(2), key=lambda i: r["probs"][i])
        assert sum(r["probs"]) == pytest.approx(1.0, abs=1e-4)
        assert r["text"] and r["label"] in (0, 1)  # the true class of the labelled test split
    assert sum(r["prediction"] == r["label"] for r in rows) > 0
    assert not list(out.parent.glob("*.partial"))


def test_python_dash_m_entry_point_errors_cleanly(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["fit", "-c", str(SHIPPED_CONFIGS / "quickstart.yaml"), "--data.init_args.dataset", str(tmp_path / "nope")])
    assert e.value.code == 2
    assert "does not exist" in capsys.readouterr().err


SHIPPED = sorted(p for p in (SHIPPED_CONFIGS).glob("*.yaml"))


@pytest.mark.parametrize("config", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_parses_and_instantiates(config, tiny_data, tiny_config):
    """Each experiment config instantiates; Hub models/datasets are swapped for tiny local ones so the
    test runs offline, everything else (trainer, callbacks, links) is the config's own. Configs that
    only add options (profile.yaml) are composed with a tiny experiment."""
    import yaml

    cfg = yaml.safe_load(config.read_text())
    if "model" not in cfg:
        run = BertAccelCLI(args=["-c", tiny_config("composed"), "-c", str(config)], run=False)
        assert run.trainer is not None
        return
    is_mlm = "MLM" in cfg["model"]["class_path"]
    overrides = ["--model.init_args.pretrained", "null", "--model.init_args.config", json.dumps(TINY_BERT),
                 "--data.init_args.tokenizer", "sample:sentiment", "--trainer.accelerator", "cpu"]
    if is_mlm:
        overrides += ["--data.init_args.train_files", json.dumps([str(tiny_data / "train.jsonl")]),
                      "--data.init_args.val_files", "null", "--data.init_args.exclude_files", "null"]
    else:
        overrides += ["--data.init_args.dataset", str(tiny_data)]
    run = BertAccelCLI(args=["-c", str(config), *overrides], run=False)
    assert run.model is not None and run.datamodule is not None
    if not is_mlm:
        assert run.model.num_labels == 2


def test_presets_compose_with_an_experiment(tiny_config):
    presets = {p.stem: p for p in (SHIPPED_CONFIGS / "presets").glob("*.yaml")}
    assert {"baseline", "bf16"} <= set(presets)
    run = BertAccelCLI(args=["-c", tiny_config("preset"), "-c", str(presets["baseline"])], run=False)
    assert run.model.model.config._attn_implementation == "eager"
    assert run.trainer.precision == "32-true"
    assert run.model.lr == 3e-3  # the experiment's own settings survive the preset
    run = BertAccelCLI(args=["-c", tiny_config("preset"), "-c", str(presets["bf16"])], run=False)
    assert run.model.model.config._attn_implementation == "sdpa"
    assert run.trainer.precision == "bf16-mixed"


def test_every_preset_composes_and_graphs_fall_back_on_cpu(tiny_config):
    for preset in sorted((SHIPPED_CONFIGS / "presets").glob("*.yaml")):
        run = BertAccelCLI(args=["-c", tiny_config("preset"), "-c", str(preset)], run=False)
        assert run.model is not None, preset.name
    graphs = BertAccelCLI(args=["-c", tiny_config("graphs"), "-c", str(SHIPPED_CONFIGS / "presets" / "graphs.yaml"),
                                "--trainer.precision", "32-true"], run=False)
    assert graphs.model.cuda_graphs
    graphs.trainer.fit(graphs.model, datamodule=graphs.datamodule)
    assert graphs.model.automatic_optimization  # CPU: eager steps, said in one line


def test_progress_bar_redraws_a_few_times_a_second_unless_asked(tiny_config):
    """Lightning's RichProgressBar redraws up to 100 times a second (refresh_rate is per second), each redraw
    Python holding the GIL the training loop needs: bertaccel's default is 4; the option still sets it."""
    from lightning.pytorch.callbacks import RichProgressBar

    def bar(*args):
        run = BertAccelCLI(args=["-c", tiny_config("bar"), *args], run=False)
        return next(c for c in run.trainer.callbacks if isinstance(c, RichProgressBar))

    assert bar().refresh_rate == 4
    assert bar("--progress_bar.refresh_rate", "10").refresh_rate == 10


def test_shipped_configs_resolve_from_any_directory(tmp_path, monkeypatch):
    """The package is `bertaccel` (src layout) and ships its configs: `-c configs/quickstart.yaml`,
    `-c quickstart` and `-c presets/graphs` work outside the repository; a wrong name lists them."""
    import subprocess
    import sys

    from bertaccel.cli import SHIPPED_CONFIGS, resolve_config
    from bertaccel.errors import BertAccelError

    monkeypatch.chdir(tmp_path)
    assert resolve_config("configs/quickstart.yaml") == str(SHIPPED_CONFIGS / "quickstart.yaml")
    assert resolve_config("quickstart") == str(SHIPPED_CONFIGS / "quickstart.yaml")
    assert resolve_config("presets/graphs") == str(SHIPPED_CONFIGS / "presets" / "graphs.yaml")
    (tmp_path / "mine.yaml").write_text("trainer: {max_epochs: 1}\n")
    assert resolve_config("mine.yaml") == "mine.yaml"  # a file that exists is taken as given
    with pytest.raises(BertAccelError, match=r"configs/nope.yaml does not exist.*quickstart.yaml"):
        resolve_config("configs/nope.yaml")
    out = subprocess.run([sys.executable, "-m", "bertaccel", "fit", "-c", "configs/quickstart.yaml", "--print_config"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "class_path: bertaccel.modules.BertClassifier" in out.stdout


def test_last_checkpoint_is_always_the_latest_state(tiny_config, tmp_path):
    """Lightning writes last.ckpt only with a new top-k file: with a diverging lr (no improvement)
    and validation every 3 batches, the steps after the last save were lost. Now last.ckpt holds the
    final step, a second fit replaces it (no last-v1.ckpt), and says so."""
    cfg = tiny_config("latest", epochs=2)
    args = ["--trainer.val_check_interval", "3", "--model.init_args.lr", "0.5"]
    run = cli("fit", "-c", cfg, *args)
    ckpt_dir = tmp_path / "runs" / "latest" / "checkpoints"
    last = torch.load(ckpt_dir / "last.ckpt", weights_only=True)
    assert last["global_step"] == run.trainer.global_step == 16
    again = cli("fit", "-c", cfg, *args, "--trainer.max_epochs", "1")
    assert not list(ckpt_dir.glob("last-v*.ckpt"))
    assert torch.load(ckpt_dir / "last.ckpt", weights_only=True)["global_step"] == again.trainer.global_step == 8
    assert not list(ckpt_dir.glob(".*.partial"))  # written next to the target and renamed


def test_checkpoint_save_is_atomic(tmp_path, monkeypatch):
    """A save that dies midway leaves the previous checkpoint intact and no temporary file."""
    from bertaccel.callbacks.checkpoint import AtomicCheckpointIO

    io = AtomicCheckpointIO()
    target = tmp_path / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}}, target)

    def dies(obj, f, *a, **k):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", dies)
    with pytest.raises(OSError):
        io.save_checkpoint({"state_dict": {"w": torch.zeros(3)}}, target)
    monkeypatch.undo()
    assert torch.equal(torch.load(target, weights_only=True)["state_dict"]["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_export_onnx_runs_in_onnxruntime_like_the_checkpoint(tiny_config, tmp_path, capsys):
    """`export --onnx`: model.onnx with dynamic batch and sequence axes gives the checkpoint's logits
    in onnxruntime, at a batch shape it was not traced with."""
    import onnxruntime as ort

    cfg = tiny_config("onnx", epochs=1)
    run = cli("fit", "-c", cfg)
    out = tmp_path / "exported"
    main(["export", "-c", cfg, "--ckpt_path", "last", "--output_dir", str(out), "--onnx"])
    assert "onnxruntime matches PyTorch" in capsys.readouterr().out
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    ids = torch.randint(5, 100, (5, 11))
    mask = torch.ones_like(ids)
    mask[2, 4:] = 0
    (logits,) = session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy(),
                                   "token_type_ids": torch.zeros_like(ids).numpy()})
    with torch.no_grad():
        expected = run.model.eval()(ids, mask, torch.zeros_like(ids))
    torch.testing.assert_close(torch.from_numpy(logits), expected, rtol=1e-3, atol=1e-4)


def test_export_writes_a_model_that_transformers_loads_and_bertaccel_fine_tunes(tiny_config, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    cfg = tiny_config("exp", epochs=1)
    run = cli("fit", "-c", cfg)
    out = tmp_path / "exported"
    main(["export", "-c", cfg, "--ckpt_path", "last", "--output_dir", str(out)])
    hf = AutoModelForSequenceClassification.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    enc = tok(["a wonderful film", "dull and long"], return_tensors="pt", padding=True)
    mine = run.model.eval()
    with torch.no_grad():
        expected = mine(enc["input_ids"], enc["attention_mask"], enc.get("token_type_ids"))
        torch.testing.assert_close(hf(**enc).logits, expected)
    # the folder is a `pretrained` for a new fine-tune (e.g. after MLM pretraining)
    again = cli("fit", "-c", tiny_config("from_export", epochs=1), "--model.init_args.pretrained", str(out),
                "--model.init_args.config", "{}", "--trainer.limit_train_batches", "2")
    assert again.trainer.global_step == 2
