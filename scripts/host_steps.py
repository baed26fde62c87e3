"""Where the host's time goes in steady-state training steps of `bertaccel fit` (GPU host).

    python scripts/host_steps.py fit -c configs/imdb_minilm.yaml -c configs/presets/graphs.yaml ...

Runs the CLI in this process with one extra callback that, between training steps `START` and
`STOP` (env, default 60 and 260), profiles the main thread with cProfile and times the window; with `PLAIN=N`,
the N steps before `START` are timed without the profiler too (wall and the main thread's CPU time per step).
Writes `$OUT/host_steps.txt` (under DDP one `host_steps_rank<R>.txt` per rank): ms per step (wall), host ms per step spent inside Lightning's hooks,
and the functions taking the host's time, by own and cumulative time.
"""
import cProfile
import io
import os
import pstats
import sys
import time

import lightning.pytorch as pl
import torch

sys.path[:0] = ["src", "."]
START, STOP = int(os.environ.get("START", 60)), int(os.environ.get("STOP", 260))
# PLAIN > 0: also time the PLAIN steps before START without the profiler - wall per step, and the main thread's own
# CPU time per step (`time.thread_time`: the host's work, waits excluded; a CUDA sync that spins counts, and the
# window's only syncs are Lightning's every log_every_n_steps)
PLAIN = int(os.environ.get("PLAIN", 0))
OUT = os.environ.get("OUT", ".")


def _sync() -> None:
    if torch.cuda.is_available():  # on a CPU-only machine there is no queue to drain
        torch.cuda.synchronize()


class HostSteps(pl.Callback):
    def __init__(self):
        self.prof = cProfile.Profile()
        self.t0 = None
        self.plain = None  # (wall, main thread's CPU time) at PLAIN steps before START
        self.plain_line = ""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if PLAIN and trainer.global_step == START - PLAIN and self.plain is None:
            _sync()
            self.plain = (time.perf_counter(), time.thread_time())
        if trainer.global_step == START and self.plain is not None and not self.plain_line:
            _sync()
            wall, cpu = time.perf_counter() - self.plain[0], time.thread_time() - self.plain[1]
            self.plain_line = (f"steps {START - PLAIN}..{START} without the profiler: {1e3 * wall / PLAIN:.3f} ms per step "
                               f"wall, {1e3 * cpu / PLAIN:.3f} ms of the main thread's CPU time per step\n")
        if trainer.global_step == START and self.t0 is None:
            _sync()
            self.t0 = time.perf_counter()
            self.prof.enable()
        elif trainer.global_step == STOP and self.t0 is not None and self.prof is not None:
            self.prof.disable()
            _sync()
            wall = time.perf_counter() - self.t0
            s = io.StringIO()
            st = pstats.Stats(self.prof, stream=s)
            st.sort_stats("tottime").print_stats(30)
            st.sort_stats("cumulative").print_stats(70)
            n = STOP - START
            head = f"steps {START}..{STOP}: {1e3 * wall / n:.2f} ms per step wall (profiled; cProfile adds overhead)\n"
            name = "host_steps.txt" if trainer.world_size == 1 else f"host_steps_rank{trainer.global_rank}.txt"
            with open(os.path.join(OUT, name), "w") as f:
                f.write(self.plain_line + head + s.getvalue())
            print(self.plain_line + head, flush=True)
            self.prof = None


from lightning.pytorch.cli import LightningCLI  # noqa: E402

_instantiate = LightningCLI._instantiate_trainer


def instantiate(self, config, callbacks):
    return _instantiate(self, config, [*callbacks, HostSteps()])


LightningCLI._instantiate_trainer = instantiate
from bertaccel.cli import main  # noqa: E402

main(sys.argv[1:])
