"""Bad input and faults end in one clear line (`bertaccel: error: ...`, exit code 2), never a
traceback or a silently different run. One test per fault; the README's Errors section lists them."""

from __future__ import annotations

import json

import pytest
import torch

from bertaccel.cli import main
from tests.conftest import TINY_BERT

QUICK = ["--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1",
         "--test_after_fit", "false", "--progress_bar.refresh_rate", "0"]


def fails(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as e:
        main(list(args))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "bertaccel: error:" in err
    assert len(err.strip().splitlines()) <= 6, err
    return err


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--model.init_args.nope", "1", "Option 'nope' is not accepted"),
        ("--trainer.max_epochs", "abc", "Expected a <class 'int'>"),
        ("--data.init_args.batch_size", "0", "data.batch_size must be a positive integer, got 0"),
        ("--data.init_args.eval_batch_size", "-4", "data.eval_batch_size must be a positive integer, got -4"),
        ("--model.init_args.lr", "-0.1", "model.lr must be positive, got -0.1"),
        ("--model.init_args.weight_decay", "-1", "model.weight_decay must be at least 0"),
        ("--model.init_args.warmup_steps", "-5", "model.warmup_steps must be at least 0"),
    ],
    ids=["unknown-key", "not-an-int", "batch-size-0", "eval-batch-negative", "negative-lr", "negative-weight-decay",
         "negative-warmup-steps"],
)
def test_bad_option_is_one_line(tiny_config, capsys, option, value, message):
    err = fails(capsys, "fit", "-c", tiny_config("bad"), *QUICK, option, value)
    assert message in err


def test_checkpoint_that_is_not_from_lightning(tiny_config, tmp_path, capsys):
    path = tmp_path / "empty.ckpt"
    torch.save({"state_dict": {}}, path)
    err = fails(capsys, "test", "-c", tiny_config("empty"), "--ckpt_path", str(path))
    assert "is not a checkpoint written by Lightning" in err


def test_checkpoint_of_another_architecture_fails_naming_the_fields(tiny_config, capsys):
    cfg = tiny_config("arch", epochs=1)
    main(["fit", "-c", cfg, *QUICK])
    other = json.dumps({**TINY_BERT, "hidden_size": 64})
    for command in ("test", "validate", "predict", "fit"):
        err = fails(capsys, command, "-c", cfg, *QUICK, "--model.init_args.config", other, "--ckpt_path", "last")
        assert "hidden_size: checkpoint 32 vs config 64" in err


def test_resume_last_without_a_run_says_so(tiny_config, tmp_path, capsys):
    main(["fit", "-c", tiny_config("fresh", epochs=1), *QUICK, "--ckpt_path", "last"])
    out = capsys.readouterr().out
    assert "--ckpt_path last: no " in out and "training from the start" in out
    assert (tmp_path / "runs" / "fresh" / "checkpoints" / "last.ckpt").is_file()


def test_shortened_run_with_a_long_val_check_interval_validates_at_epoch_end(tiny_config, caplog):
    import logging

    with caplog.at_level(logging.INFO):
        main(["fit", "-c", tiny_config("short", epochs=1), *QUICK, "--trainer.val_check_interval", "500"])
    assert "val_check_interval 500 is more than the 2 training batches" in caplog.text


def test_evaluation_order_is_shuffled_once_so_limited_batches_see_every_class(tmp_path):
    """Data files sorted by label (IMDB's are) gave single-class validation/test sets under
    `limit_val_batches` / `limit_test_batches`; evaluation now reads one fixed shuffled order."""
    from bertaccel.data import TextClassificationDataModule
    from tests.conftest import sample_rows, write_jsonl

    rows = sorted(sample_rows("train", 160), key=lambda r: r["label"])
    write_jsonl(tmp_path / "train.jsonl", rows)
    write_jsonl(tmp_path / "test.jsonl", sorted(sample_rows("test", 64), key=lambda r: r["label"]))
    dm = TextClassificationDataModule(dataset=str(tmp_path), tokenizer="sample:sentiment", max_length=32,
                                      batch_size=16, val_size=0.2)
    dm.prepare_data()
    dm.setup("fit")
    dm.setup("test")
    for loader in (dm.val_dataloader(), dm.test_dataloader()):
        first = next(iter(loader))["labels"]
        assert set(first.tolist()) == {0, 1}
        again = next(iter(loader))["labels"]
        assert torch.equal(first, again)  # the same order every pass


def test_a_run_that_fails_in_setup_leaves_no_empty_version_folder(tiny_config, tmp_path, capsys):
    cfg = tiny_config("failing", epochs=1)
    # the data asks for more positions than the model has: refused in the model's setup, after the
    # config was saved into the run's folder
    fails(capsys, "fit", "-c", cfg, *QUICK, "--data.init_args.max_length", "128")
    runs = tmp_path / "runs" / "failing"
    assert not runs.exists() or not list(runs.glob("version_*"))


# ------------------------------------------------------------------------------------- data faults
def _dm(path, **kw):
    from bertaccel.data import TextClassificationDataModule

    return TextClassificationDataModule(dataset=str(path), tokenizer="sample:sentiment", max_length=32,
                                        batch_size=8, val_size=0.25, **kw)


def test_non_utf8_data_names_the_file_and_line(tmp_path):
    from bertaccel.errors import DataError

    (tmp_path / "train.jsonl").write_bytes(b'{"text": "fine", "label": 0}\n{"text": "caf\xe9", "label": 1}\n')
    (tmp_path / "test.jsonl").write_text('{"text": "fine", "label": 0}\n')
    with pytest.raises(DataError, match=r"train.jsonl:2: not UTF-8 text \(byte 0xe9 at column 14\)"):
        _dm(tmp_path).prepare_data()


def test_string_labels_get_the_fix(tmp_path):
    from bertaccel.errors import DataError

    (tmp_path / "train.jsonl").write_text('{"text": "fine", "label": "positive"}\n')
    (tmp_path / "test.jsonl").write_text('{"text": "fine", "label": 0}\n')
    with pytest.raises(DataError, match=r"label 'positive' is not an integer class index. Map the names to 0..K-1.*classes.txt"):
        _dm(tmp_path).prepare_data()


def test_labels_with_a_gap_warn_that_classes_never_occur(tmp_path):
    from tests.conftest import sample_rows, write_jsonl

    rows = sample_rows("train", 40)
    rows[3]["label"] = 4  # classes 2 and 3 never occur
    write_jsonl(tmp_path / "train.jsonl", rows)
    write_jsonl(tmp_path / "test.jsonl", sample_rows("test", 8))
    dm = _dm(tmp_path, cache_dir=str(tmp_path / "cache"))
    with pytest.warns(UserWarning, match=r"5 classes inferred from the largest label \(4\), but classes \[2, 3\] never occur"):
        dm.prepare_data()
        dm.setup("fit")


def test_cache_that_is_a_file_is_refused(tmp_path, monkeypatch):
    from bertaccel.data.tokenized import default_cache_dir
    from bertaccel.errors import DataError

    (tmp_path / "cachefile").write_text("x")
    monkeypatch.setenv("BERTACCEL_CACHE", str(tmp_path / "cachefile"))
    with pytest.raises(DataError, match="is a file; point BERTACCEL_CACHE at a directory"):
        default_cache_dir()


def test_damaged_or_edited_cache_entries_are_made_again(tmp_path, caplog):
    import logging

    from bertaccel.data.tokenized import tokenize_texts
    from bertaccel.pretrained import load_tokenizer

    tok = load_tokenizer("sample:sentiment")
    texts = ["a wonderful film", "dull and far too long", "fine"]
    good = tokenize_texts(texts, tok, 16, cache_dir=tmp_path)
    (entry,) = (tmp_path / "tokenized").glob("*.pt")
    for damage in ("out of range", "in range"):
        d = torch.load(entry, weights_only=True)
        d["ids"] = d["ids"].clone()
        d["ids"][1] = len(tok) + 7 if damage == "out of range" else (int(d["ids"][1]) + 1) % len(tok)
        torch.save(d, entry)
        with caplog.at_level(logging.WARNING):
            again = tokenize_texts(texts, tok, 16, cache_dir=tmp_path)
        assert torch.equal(again.ids, good.ids) and torch.equal(again.offsets, good.offsets)
        assert "is not usable" in caplog.text
        caplog.clear()


def test_read_only_cache_trains_without_it(tmp_path, caplog):
    import logging
    import os

    from bertaccel.data.tokenized import tokenize_texts
    from bertaccel.pretrained import load_tokenizer

    if os.geteuid() == 0:
        pytest.skip("root writes into read-only directories")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    with caplog.at_level(logging.WARNING):
        out = tokenize_texts(["a film"], load_tokenizer("sample:sentiment"), 16, cache_dir=ro)
    assert len(out) == 1 and "could not write the tokenization cache" in caplog.text


def test_a_second_fit_into_a_running_experiment_is_refused(tiny_config, tmp_path, capsys):
    import os
    import socket

    cfg = tiny_config("busy", epochs=1)
    lock = tmp_path / "runs" / "busy" / "checkpoints" / ".fit.lock"
    lock.parent.mkdir(parents=True)
    lock.write_text(f"{socket.gethostname()} {os.getppid()}")  # a live process holds it
    err = fails(capsys, "fit", "-c", cfg, *QUICK)
    assert "another fit" in err and "is writing into" in err
    # a lock whose process is gone is taken over, and released at the end
    lock.write_text(f"{socket.gethostname()} 999999999")
    main(["fit", "-c", cfg, *QUICK])
    assert "which is gone; taking it over" in capsys.readouterr().out
    assert not lock.exists()


def test_unwritable_checkpoint_directory_fails_before_training(tiny_config, tmp_path, capsys):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the runs folder should be")
    err = fails(capsys, "fit", "-c", tiny_config("ro", epochs=1), *QUICK,
                "--checkpoint.dirpath", str(blocker / "checkpoints"))
    assert "cannot be written" in err and "--checkpoint.dirpath" in err


def test_relative_path_that_does_not_exist_is_not_taken_for_a_hub_name(tmp_path, monkeypatch):
    from bertaccel.errors import DataError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for name in ("data/imdb", "data/sub/imdb", "./imdb"):
        with pytest.raises(DataError, match=rf"local dataset directory {name} does not exist.*resolves to"):
            _dm(name).prepare_data()


def test_bf16_true_says_it_has_no_fp32_master_weights(tiny_config):
    with pytest.warns(UserWarning, match="bf16-true keeps the weights and AdamW's updates in bf16"):
        main(["fit", "-c", tiny_config("bf16true", epochs=1), *QUICK, "--trainer.precision", "bf16-true"])


def test_several_files_for_a_split_advise_what_each_data_module_allows(tmp_path):
    from bertaccel.data import MLMDataModule
    from bertaccel.errors import DataError

    (tmp_path / "train.jsonl").write_text('{"text": "a", "label": 0}\n')
    (tmp_path / "train_extra.jsonl").write_text('{"text": "b", "label": 1}\n')
    (tmp_path / "test.jsonl").write_text('{"text": "c", "label": 0}\n')
    with pytest.raises(DataError, match=r"several files for the 'train' split.*Keep one file per split in the folder"):
        _dm(tmp_path).prepare_data()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "train.txt").write_text("some text\n")
    (corpus / "train.extra.txt").write_text("more text\n")
    with pytest.raises(DataError, match=r"data.train_files"):
        MLMDataModule(dataset=str(corpus), tokenizer="sample:sentiment", block_size=32).setup("fit")


def test_resuming_with_a_longer_schedule_says_the_learning_rate_jumps(tiny_config):
    cfg = tiny_config("extend", epochs=1)
    main(["fit", "-c", cfg])
    with pytest.warns(UserWarning, match=r"schedule ran over 8 steps; this run's runs over 16"):
        main(["fit", "-c", cfg, "--trainer.max_epochs", "2", "--ckpt_path", "last"])


KILLED_SAVER = r"""
import os, sys, time
import torch
from bertaccel.callbacks.checkpoint import AtomicCheckpointIO

target, marker, moment = sys.argv[1:4]


def stop_here():
    open(marker, "w").close()
    time.sleep(600)  # killed here


class StopsWhilePickled:
    def __reduce__(self):
        stop_here()
        return (int, (0,))


checkpoint = {"state_dict": {"w": torch.zeros(4096)}}
if moment == "while-writing":
    checkpoint["blocker"] = StopsWhilePickled()
else:  # every byte written, not yet renamed
    os.fsync = lambda fd: stop_here()
AtomicCheckpointIO().save_checkpoint(checkpoint, target)
"""


@pytest.mark.parametrize("moment", ["while-writing", "before-rename"])
def test_kill_9_during_a_checkpoint_save_keeps_the_previous_one(tmp_path, moment):
    """A real SIGKILL in the middle of a save (no `finally`, no handler runs): the previous
    checkpoint is intact under its name, and the leftover hidden partial file is removed by the
    next fit's checkpoint callback."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from bertaccel.callbacks.checkpoint import AtomicCheckpointIO, remove_partial_checkpoints

    target, marker = tmp_path / "last.ckpt", tmp_path / "stopped"
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(4096)}}, target)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SAVER, str(target), str(marker), moment], env=env)
    try:
        deadline = time.time() + 120
        while not marker.exists():
            assert proc.poll() is None, "the saver exited before the kill"
            assert time.time() < deadline, "the saver never reached the kill point"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    assert torch.equal(torch.load(target, weights_only=True)["state_dict"]["w"], torch.ones(4096))
    partial = tmp_path / ".last.ckpt.partial"
    assert partial.exists()  # the killed process could not clean up
    if moment == "before-rename":
        assert partial.stat().st_size > 4096 * 4  # the new checkpoint was complete, only unrenamed
    assert remove_partial_checkpoints(tmp_path) == [partial]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "stopped"]


def test_next_fit_removes_partial_checkpoints_of_a_killed_run(tiny_config, tmp_path):
    cfg = tiny_config("killed", epochs=1)
    main(["fit", "-c", cfg, *QUICK])
    ckpt_dir = next(tmp_path.rglob("checkpoints"))
    (ckpt_dir / ".last.ckpt.partial").write_bytes(b"half a checkpoint")
    with pytest.warns(UserWarning, match=r"removed 1 partial checkpoint file\(s\) left by a save that was killed"):
        main(["fit", "-c", cfg, *QUICK])
    assert not list(ckpt_dir.glob(".*.partial"))


def test_export_onnx_without_the_exporter_packages_says_what_to_install(tiny_config, capsys, monkeypatch):
    import sys

    cfg = tiny_config("onnx_missing", epochs=1)
    main(["fit", "-c", cfg, *QUICK])
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # as if it were not installed
    err = fails(capsys, "export", "-c", cfg, "--ckpt_path", "last", "--onnx")
    assert "--onnx needs the onnx and onnxscript packages (onnxscript is missing)" in err
    assert "pip install 'bertaccel[onnx]'" in err


@pytest.mark.parametrize("subcommand", ["fit", "test"])
def test_unwritable_logger_directory_fails_before_the_run(tiny_config, tmp_path, capsys, subcommand):
    """A logger save_dir that cannot be created (a file in the way; read-only the same way) is one
    line before anything runs, not a NotADirectoryError traceback from TensorBoard mid-setup."""
    cfg = tiny_config("ro_logs", epochs=1)
    if subcommand == "test":
        main(["fit", "-c", cfg, *QUICK])
    blocker = tmp_path / "logs_blocked"
    blocker.write_text("a file where the logs folder should be")
    extra = ["--checkpoint.dirpath", str(tmp_path / "ck")] if subcommand == "fit" else []
    extra += ["--ckpt_path", str(next(tmp_path.rglob("last.ckpt")))] if subcommand == "test" else []
    err = fails(capsys, subcommand, "-c", cfg, *(QUICK if subcommand == "fit" else []), *extra,
                "--trainer.logger.init_args.save_dir", str(blocker / "runs"))
    assert "the logger's save_dir" in err and "cannot be written" in err
    assert "--trainer.logger.init_args.save_dir" in err


@pytest.mark.parametrize(("option", "value", "message"), [
    ("--trainer.strategy", "fsdp", "The strategy `fsdp` requires a GPU accelerator"),
    ("--trainer.devices", "0", "`Trainer(devices='0')` value is not a valid input"),
    ("--trainer.num_nodes", "0", "`num_nodes` must be a positive integer"),
], ids=["fsdp-on-cpu", "zero-devices", "zero-nodes"])
def test_trainer_settings_that_do_not_fit_are_one_line(tiny_config, capsys, option, value, message):
    """Lightning's own checks of trainer settings end in one line naming the problem, not a traceback."""
    err = fails(capsys, "fit", "-c", tiny_config("trainer_bad", epochs=1), *QUICK, option, value)
    assert "the trainer settings do not work together" in err and message in err


def test_missing_local_model_or_tokenizer_path_is_named_as_such(tiny_config, capsys):
    """An absolute or ./ path that does not exist is a missing local directory, not a bad Hub id."""
    for option in ("--model.init_args.pretrained", "--data.init_args.tokenizer"):
        err = fails(capsys, "fit", "-c", tiny_config("nopath", epochs=1), *QUICK, option, "/nonexistent/bert")
        assert "local model/tokenizer path /nonexistent/bert does not exist" in err


@pytest.mark.parametrize("value", ["1.5", "-0.2", "0"])
def test_val_size_that_is_neither_a_fraction_nor_a_count_is_refused(tiny_config, capsys, value):
    err = fails(capsys, "fit", "-c", tiny_config("valsize", epochs=1), *QUICK, "--data.init_args.val_size", value)
    assert f"val_size {float(value)} is neither a fraction in (0, 1) nor a whole number of rows" in err
