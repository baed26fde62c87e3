"""The `bertaccel` command: LightningCLI with this project's defaults, links and checks.

    bertaccel fit -c configs/quickstart.yaml
    bertaccel test -c configs/imdb.yaml --ckpt_path best
    bertaccel export -c configs/imdb.yaml --ckpt_path best --output_dir my-imdb-bert
    python -m bertaccel validate -c configs/ag_news.yaml --ckpt_path runs/ag_news/checkpoints/last.ckpt
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import LearningRateMonitor, RichProgressBar
from jsonargparse import ArgumentError
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from lightning.pytorch.utilities import rank_zero_info
from lightning.fabric.utilities.exceptions import MisconfigurationException

from bertaccel.callbacks.checkpoint import AtomicCheckpointIO, LatestCheckpoint
from bertaccel.callbacks.kernel_swap import KernelSwap
from bertaccel.callbacks.prediction_writer import JsonlPredictionWriter
from bertaccel.callbacks.profiler import ProfilerCallback
from bertaccel.callbacks.throughput import ThroughputMeter
from bertaccel.errors import BertAccelError, CheckpointError
from bertaccel.modules.base import BertModule


def default_precision() -> str:
    """bf16-mixed where the GPU supports it, fp32 elsewhere (CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16-mixed"
    return "32-true"


def best_checkpoint_in(dirpath: Path) -> Path:
    """The best checkpoint recorded by ModelCheckpoint in `dirpath`'s last.ckpt."""
    last = dirpath / "last.ckpt"
    state = load_checkpoint(last)
    for key, cb in state.get("callbacks", {}).items():
        if isinstance(cb, dict) and cb.get("best_model_path"):  # a ModelCheckpoint's state (any subclass)
            best = Path(cb["best_model_path"])
            if not best.is_file():  # the run directory may have moved since
                best = dirpath / best.name
            return best
    raise CheckpointError(f"{last} records no best checkpoint (was `checkpoint.monitor` set?); pass a file path.")


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """torch.load(weights_only=True) with missing or damaged files turned into clear errors."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist. Pass an existing .ckpt file, 'last' or 'best'.")
    try:
        ckpt = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - zip, pickle and EOF errors all mean the same to the user
        raise CheckpointError(
            f"checkpoint {path} cannot be read ({type(e).__name__}); it is damaged or not a Lightning checkpoint."
        ) from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise CheckpointError(f"{path} is not a Lightning checkpoint (no state_dict).")
    if "pytorch-lightning_version" not in ckpt or not ckpt["state_dict"]:
        raise CheckpointError(f"{path} is not a checkpoint written by Lightning (no version, or no weights); "
                              "pass a .ckpt file that `bertaccel fit` saved.")
    return ckpt


def check_config_against_checkpoint(ckpt: dict[str, Any], model_config, path) -> None:
    """Fail, naming the fields, when the config asks for another model than the checkpoint holds
    (Lightning would otherwise replace the config's values with the checkpoint's, silently)."""
    saved = ckpt.get("bertaccel", {})
    class_path = str(model_config.get("class_path", "")) if model_config is not None else ""
    if saved.get("class") and class_path and class_path.rsplit(".", 1)[-1] != saved["class"]:
        raise CheckpointError(f"{path} holds a {saved['class']} but the config builds a {class_path}; "
                              "use the config the checkpoint was trained with.")
    init = (model_config.get("init_args") if model_config is not None else None) or {}
    mine = dict(init.get("config") or {})
    theirs = dict((ckpt.get("hyper_parameters") or {}).get("config") or {})
    diffs = {k: (theirs[k], mine[k]) for k in sorted(mine.keys() & theirs.keys()) if mine[k] != theirs[k]}
    if diffs:
        detail = ", ".join(f"{k}: checkpoint {a} vs config {b}" for k, (a, b) in diffs.items())
        raise CheckpointError(f"{path} does not match the config's model ({detail}); use the config it was "
                              "trained with, or drop these fields from model.init_args.config.")


def check_writable(directory: Path, what: str, fix: str) -> None:
    """Create `directory` if needed and write a probe file in it; one clear error if that fails."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise BertAccelError(f"{what} {directory} cannot be written ({e.strerror or type(e).__name__}); {fix}.") from None


class ExperimentLock:
    """`<checkpoint dir>/.fit.lock` while a `fit` writes into an experiment's checkpoint folder: a
    second fit into the same folder is refused (both would write last.ckpt) instead of silently
    interleaving. A lock left by a process that no longer runs (kill -9) is taken over, with a line."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / ".fit.lock"
        self.held = False

    def acquire(self) -> None:
        # found now, not after an epoch of training when the first checkpoint is saved
        check_writable(self.path.parent, "the checkpoint directory",
                       "set --checkpoint.dirpath or --trainer.logger.init_args.save_dir to a writable place")
        me = f"{socket.gethostname()} {os.getpid()}"
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                owner = self.path.read_text().strip() if self.path.is_file() else ""
                host, _, pid = owner.partition(" ")
                if owner == me:  # left by an earlier fit of this very process that ended in an error
                    self.path.unlink(missing_ok=True)
                    continue
                if host == socket.gethostname() and pid.isdigit() and not _alive(int(pid)):
                    print(f"bertaccel: {self.path} was left by process {pid}, which is gone; taking it over.")
                    self.path.unlink(missing_ok=True)
                    continue
                raise BertAccelError(
                    f"another fit ({owner or 'unknown process'}) is writing into {self.path.parent}; wait for it, "
                    "or give this run its own experiment (--trainer.logger.init_args.name NAME). If no fit is "
                    f"running there, delete {self.path}."
                ) from None
            with os.fdopen(fd, "w") as f:
                f.write(me)
            self.held = True
            atexit.register(self.release)
            return

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SaveConfigOfRun(SaveConfigCallback):
    """Lightning's `SaveConfigCallback` (config.yaml in the run's log folder), which also removes that
    folder again when the run fails before it logged or saved anything: failed attempts do not leave
    a trail of empty `version_N` folders."""

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        logger = trainer.logger
        if not trainer.is_global_zero or logger is None or getattr(logger, "log_dir", None) is None:
            return
        folder = Path(logger.log_dir)

        def nothing_logged(p: Path) -> bool:  # the saved config, or a TensorBoard file with only its header
            if not p.is_file():
                return False
            return p.name in ("config.yaml", "hparams.yaml") or (p.name.startswith("events.out.tfevents") and p.stat().st_size < 512)

        if folder.is_dir() and all(nothing_logged(p) for p in folder.iterdir()):
            shutil.rmtree(folder, ignore_errors=True)


class BertAccelCLI(LightningCLI):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("save_config_callback", SaveConfigOfRun)
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        # parse errors raise (and `main` prints them in a few lines) instead of printing the whole usage
        quiet = {"default_env": True, "exit_on_error": False}
        kwargs.setdefault("parser_kwargs", {**quiet, **{cmd: dict(quiet) for cmd in ("fit", "validate", "test", "predict")}})
        kwargs.setdefault(
            "trainer_defaults",
            {
                "precision": default_precision(),
                "logger": {
                    "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                    "init_args": {"save_dir": "runs", "name": "default"},
                },
            },
        )
        super().__init__(BertModule, LightningDataModule, *args, **kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.num_labels", "model.init_args.num_labels", apply_on="instantiate")
        parser.link_arguments("data.vocab_size", "model.init_args.vocab_size", apply_on="instantiate")
        # Always-present callbacks, each configurable under its own key (e.g. --checkpoint.monitor).
        parser.add_lightning_class_args(LatestCheckpoint, "checkpoint")
        parser.set_defaults(
            {
                "checkpoint.monitor": "val/acc",
                "checkpoint.mode": "max",
                "checkpoint.save_last": True,
                "checkpoint.save_top_k": 1,
                "checkpoint.filename": "epoch{epoch}-step{step}",
                "checkpoint.auto_insert_metric_name": False,
                # one last.ckpt per experiment: a second fit replaces it rather than writing last-v1.ckpt
                "checkpoint.enable_version_counter": False,
            }
        )
        parser.add_lightning_class_args(JsonlPredictionWriter, "predictions")
        parser.add_lightning_class_args(LearningRateMonitor, "lr_monitor")
        parser.add_lightning_class_args(RichProgressBar, "progress_bar")
        # Lightning redraws the rich bars up to 100 times a second (its default refresh_rate, per second), each
        # redraw ~0.9 ms of Python holding the GIL the loop's thread needs to launch steps: a host-bound loop
        # ran 272 steps/s against 352 at 4 redraws a second (scripts/progress_bar_cost.py, CPU, median of 3)
        parser.set_defaults({"progress_bar.refresh_rate": 4})
        parser.add_lightning_class_args(KernelSwap, "kernel_swap")
        parser.add_lightning_class_args(ThroughputMeter, "throughput")
        parser.add_lightning_class_args(ProfilerCallback, "profiler")
        parser.add_argument(
            "--test_after_fit", type=bool, default=False,
            help="After `fit`, run `test` on the best checkpoint in the same process.",
        )

    # ------------------------------------------------------------------------ checkpoint paths
    def _checkpoint_dir(self) -> Path:
        cfg = self.config[self.config.subcommand] if self.config.get("subcommand") else self.config
        if cfg.get("checkpoint") and cfg.checkpoint.get("dirpath"):
            return Path(cfg.checkpoint.dirpath)
        logger = cfg.trainer.get("logger")
        init = getattr(logger, "init_args", None) or {}
        save_dir = init.get("save_dir", "runs") if hasattr(init, "get") else "runs"
        name = init.get("name", "default") if hasattr(init, "get") else "default"
        return Path(save_dir) / (name or "default") / "checkpoints"

    def _parse_ckpt_path(self) -> None:
        if not self.config.get("subcommand"):
            return
        cfg = self.config[self.config.subcommand]
        # A fixed checkpoint folder per experiment (not per logger version), so that
        # `fit --ckpt_path last` and `test --ckpt_path best` find the checkpoints of earlier runs.
        if "checkpoint" in cfg and not cfg.checkpoint.get("dirpath"):
            cfg.checkpoint.dirpath = str(self._checkpoint_dir())
        ckpt_path = cfg.get("ckpt_path")
        if ckpt_path in ("best", "last") and self.config.subcommand != "fit":
            directory = self._checkpoint_dir()
            resolved = best_checkpoint_in(directory) if ckpt_path == "best" else directory / "last.ckpt"
            cfg.ckpt_path = ckpt_path = str(resolved)
            print(f"bertaccel: --ckpt_path {'best' if 'last' not in resolved.name else 'last'} is {resolved}")
        if ckpt_path == "last" and self.config.subcommand == "fit":
            last = self._checkpoint_dir() / "last.ckpt"
            if last.is_file():
                cfg.ckpt_path = ckpt_path = str(last)  # one rule for "last" in every subcommand
            else:
                print(f"bertaccel: --ckpt_path last: no {last} yet; training from the start.")
                cfg.ckpt_path = ckpt_path = None
        if ckpt_path and ckpt_path not in ("best", "last", "hpc", "registry"):
            # fails with a clear message when missing, damaged, or for another model than the config's
            check_config_against_checkpoint(load_checkpoint(ckpt_path), cfg.get("model"), ckpt_path)
        super()._parse_ckpt_path()

    def instantiate_trainer(self, **kwargs: Any):
        try:
            trainer = super().instantiate_trainer(**kwargs)
        except (ValueError, MisconfigurationException) as e:
            # Lightning's own checks of trainer settings (strategy vs accelerator, devices, precision)
            # explain the problem and the fix: one line, not a traceback
            raise BertAccelError(f"the trainer settings do not work together: {str(e).strip()}") from None
        # checkpoints written next to their target and renamed into place (never half-written)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        return trainer

    def _check_log_dir(self) -> None:
        """The logger's folder must be writable before the run starts: TensorBoard creates it on first
        use, mid-setup, and a read-only or file-blocked path ended in a traceback."""
        logger = self.trainer.logger
        save_dir = getattr(logger, "save_dir", None) if logger is not None else None
        if save_dir and self.trainer.is_global_zero and "://" not in str(save_dir):
            check_writable(Path(save_dir), "the logger's save_dir",
                           "set --trainer.logger.init_args.save_dir to a writable place")

    def before_validate(self) -> None:
        self._check_log_dir()

    def before_test(self) -> None:
        self._check_log_dir()

    def before_predict(self) -> None:
        self._check_log_dir()

    def before_fit(self) -> None:
        self._check_log_dir()
        directory = self._checkpoint_dir()
        if self.trainer.is_global_zero:
            self._lock = ExperimentLock(directory)
            self._lock.acquire()
        earlier = sorted(directory.glob("*.ckpt")) if directory.is_dir() else []
        if earlier and not self.config.fit.get("ckpt_path") and self.trainer.is_global_zero:
            print(f"bertaccel: {directory} holds {len(earlier)} checkpoint(s) of an earlier run; this run replaces "
                  "last.ckpt and records its own best (to continue the earlier run instead: --ckpt_path last).")

    def after_fit(self) -> None:
        lock = getattr(self, "_lock", None)
        if lock is not None:
            lock.release()
        if self.config.fit.get("test_after_fit") and not self.trainer.interrupted:
            ckpt = "best" if self.trainer.checkpoint_callback and self.trainer.checkpoint_callback.best_model_path else None
            from lightning.pytorch.strategies import FSDPStrategy

            if isinstance(self.trainer.strategy, FSDPStrategy):
                # Measured on 2 H200s: trainer.test(ckpt_path=best) after an FSDP fit in the same process
                # fails restoring into the sharded model ("size mismatch ... torch.Size([0])",
                # Lightning-AI/pytorch-lightning#20373); loading the full state dict ourselves inside
                # FSDP.state_dict_type(FULL_STATE_DICT) then fails in the test forward ("'weight' must be
                # 2-D"), and so does testing the final weights without any checkpoint (ckpt_path=None,
                # 5ed5730: the embedding sees its flat shard). The fit's checkpoints are complete: test
                # them in a new process.
                where = self.trainer.checkpoint_callback.best_model_path if ckpt else "last.ckpt"
                rank_zero_info("bertaccel: test_after_fit is skipped under FSDP (Lightning #20373); run "
                               f"`bertaccel test -c <this config> --ckpt_path {where}`.")
                return
            self.trainer.test(self.model, datamodule=self.datamodule, ckpt_path=ckpt)


SHIPPED_CONFIGS = Path(__file__).resolve().parent / "configs"


def resolve_config(value: str) -> str:
    """A `-c` path as given if it exists; otherwise the shipped config it names (`configs/imdb.yaml`,
    `imdb.yaml`, `imdb`, `presets/graphs`), so the commands work from any directory once installed."""
    if Path(value).is_file() or value.lstrip().startswith(("{", "[")):  # a file, or an inline YAML/JSON config
        return value
    name = value[len("configs/"):] if value.startswith("configs/") else value
    for candidate in (name, f"{name}.yaml"):
        path = SHIPPED_CONFIGS / candidate
        if path.is_file():
            return str(path)
    shipped = sorted(str(p.relative_to(SHIPPED_CONFIGS)) for p in SHIPPED_CONFIGS.rglob("*.yaml"))
    raise BertAccelError(f"config {value} does not exist, here or among the shipped configs ({', '.join(shipped)}).")


def resolve_config_args(args: list[str]) -> list[str]:
    out, i = [], 0
    while i < len(args):
        a = args[i]
        if a in ("-c", "--config") and i + 1 < len(args):
            out += [a, resolve_config(args[i + 1])]
            i += 2
            continue
        if a.startswith("--config="):
            a = "--config=" + resolve_config(a.split("=", 1)[1])
        out.append(a)
        i += 1
    return out


EXPORT_HELP = """usage: bertaccel export -c CONFIG [-c CONFIG ...] [--ckpt_path best|last|FILE] [--output_dir DIR] [--onnx] [options]

Write the model of a checkpoint (and its tokenizer) with `save_pretrained`, loadable by
`AutoModelFor...from_pretrained(DIR)` and by `--model.init_args.pretrained DIR` (e.g. an MLM
pretrained with bertaccel, then fine-tuned as a classifier). The config is the experiment's (the
same -c files and overrides as for `fit`). --ckpt_path defaults to best; --output_dir to
<save_dir>/<name>/export. --onnx also writes DIR/model.onnx (inputs input_ids, attention_mask,
token_type_ids, int64 [batch, sequence], both axes dynamic; output logits), checked against the
PyTorch model with onnxruntime when it is installed (`pip install 'bertaccel[onnx]'`).
"""


def export_onnx(hf, out: Path, vocab_size: int) -> Path:
    """`torch.onnx.export` (the dynamo exporter) of an HF BERT classifier or masked-LM in eval mode;
    compares onnxruntime's logits with PyTorch's on a fresh batch of another shape when onnxruntime
    is there. Returns the file."""
    try:
        import onnx  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as e:
        raise BertAccelError(f"--onnx needs the onnx and onnxscript packages ({e.name} is missing): "
                             "pip install 'bertaccel[onnx]'.") from None

    class LogitsOf(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).logits

    def sample(batch: int, seq: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab_size, (batch, seq), generator=g)
        mask = torch.ones_like(ids)
        mask[0, seq // 2:] = 0  # one padded row
        return ids, mask, torch.zeros_like(ids)

    model = LogitsOf(hf.float().eval().cpu())
    path = out / "model.onnx"
    batch, sequence = torch.export.Dim("batch"), torch.export.Dim("sequence")
    axes = {0: batch, 1: sequence}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's notes on axis names and deprecations
        torch.onnx.export(model, sample(2, 16, 0), str(path), dynamo=True, verbose=False,
                          input_names=["input_ids", "attention_mask", "token_type_ids"], output_names=["logits"],
                          dynamic_shapes={"input_ids": axes, "attention_mask": axes, "token_type_ids": axes})
    try:
        import onnxruntime as ort
    except ImportError:
        print(f"bertaccel: wrote {path} (not checked: onnxruntime is not installed)")
        return path
    inputs = sample(3, 23, 1)
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        None, dict(zip(("input_ids", "attention_mask", "token_type_ids"), (t.numpy() for t in inputs))))[0]
    with torch.no_grad():
        want = model(*inputs)
    err = float((torch.from_numpy(got) - want).abs().max())
    if not torch.allclose(torch.from_numpy(got), want, rtol=1e-3, atol=1e-4):
        raise BertAccelError(f"the ONNX model at {path} disagrees with PyTorch (max abs difference {err:.2e} on a "
                             "3 x 23 batch); do not use it, and report the model config.")
    print(f"bertaccel: wrote {path}; onnxruntime matches PyTorch on a 3 x 23 batch (max abs difference {err:.1e})")
    return path


def export(args: list[str]) -> Path:
    """`bertaccel export`: the checkpoint's HF model and tokenizer, written with `save_pretrained`."""
    if any(a in ("-h", "--help") for a in args):
        print(EXPORT_HELP)
        raise SystemExit(0)
    ckpt_path, output_dir, rest, i = "best", None, [], 0
    onnx = "--onnx" in args
    args = [a for a in args if a != "--onnx"]
    while i < len(args):
        key, _, inline = args[i].partition("=")
        if key in ("--ckpt_path", "--output_dir"):
            value = inline or (args[i + 1] if i + 1 < len(args) else "")
            i += 1 if inline else 2
            if key == "--ckpt_path":
                ckpt_path = value
            else:
                output_dir = value
            continue
        rest.append(args[i])
        i += 1
    cli = BertAccelCLI(args=rest, run=False)
    directory = cli._checkpoint_dir()
    if ckpt_path == "best":
        path = best_checkpoint_in(directory)
    elif ckpt_path == "last":
        path = directory / "last.ckpt"
    else:
        path = Path(ckpt_path)
    ckpt = load_checkpoint(path)
    check_config_against_checkpoint(ckpt, cli.config.get("model"), path)
    module = cli.model
    module.load_state_dict(ckpt["state_dict"])
    out = Path(output_dir) if output_dir else directory.parent / "export"
    names = getattr(cli.datamodule, "class_names", None)
    hf = module.model
    if getattr(hf.config, "qk_norm", None):
        raise BertAccelError(
            f"the model has qk_norm ({hf.config.qk_norm}), which transformers' BERT classes do not have: "
            "its save_pretrained folder would load without the norms. Use the .ckpt with bertaccel instead."
        )
    if names and getattr(hf.config, "num_labels", None) == len(names):
        hf.config.id2label = dict(enumerate(names))
        hf.config.label2id = {n: i for i, n in enumerate(names)}
    hf.save_pretrained(out)
    tokenizer = getattr(cli.datamodule, "tokenizer", None)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    print(f"bertaccel: exported {path} to {out} ({type(hf).__name__}; load it with "
          f"transformers.AutoModel...from_pretrained('{out}') or --model.init_args.pretrained {out})")
    if onnx:
        export_onnx(hf, out, hf.config.vocab_size)
    return out


def _option_error_lines(text: str) -> list[str]:
    """The informative lines of a jsonargparse message: the key and the specific complaints
    (not the "Expected a NoneType" of every optional field, nor the dump of the given values)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    keys = [line for line in lines if line.startswith("Parser key")]
    specific = [line.lstrip("- ") for line in lines
                if line.startswith("- ") and "NoneType" not in line and not line.startswith("- Problem with given class_path")]
    specific += [line for line in lines if "is not accepted" in line and not line.startswith("- ")]
    return (keys[:1] + specific[:4]) or lines[:3]


def main(args: list[str] | None = None) -> None:
    import warnings

    # `args` is sys.argv with the shipped config paths resolved: not a mistake, as Lightning suspects
    warnings.filterwarnings("ignore", message=".*args parameter is intended to run from within Python.*")
    args = list(sys.argv[1:] if args is None else args)
    command = next((a for a in args if a in ("fit", "validate", "test", "predict", "export")), "")
    try:
        args = resolve_config_args(args)
        if args[:1] == ["export"]:
            export(args[1:])
            return
        BertAccelCLI(args=args)
    except BertAccelError as e:
        print(f"bertaccel: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except (ArgumentError, ValueError) as e:
        # a bad option or value (parser), or a class rejecting its arguments while jsonargparse builds it
        text = str(e)
        if not isinstance(e, ArgumentError) and "Does not validate against any of the Union subtypes" not in text:
            raise
        shown = "\n  ".join(_option_error_lines(text))
        print(f"bertaccel: error: {shown}\n(all options: bertaccel {command} --help)", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
