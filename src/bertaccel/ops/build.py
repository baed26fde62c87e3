"""Build the CUDA extension on first use and load it into the `bertaccel` op namespace.

`torch.utils.cpp_extension.load` + ninja compiles `csrc/*.cu` into a folder keyed by a hash of
the sources, the flags, the torch/CUDA versions and the GPU arch, so a change to any of them
rebuilds and nothing stale is loaded. Builds are serialised by a lock file that records the PID of
its holder: a lock whose holder is dead (a build killed half-way) is removed instead of waited on
forever (pytorch #189245). Under DDP, local rank 0 builds first and the other ranks load after.

When there is no GPU, no CUDA compiler, or the build fails, `load()` returns False once with a
clear message, and every op falls back to PyTorch.

Three extensions: `bertaccel_ops` (the memory-bound op families, built for the GPU's own arch) and
`bertaccel_gemm` (the tensor-core GEMM, Hopper only: its wgmma and setmaxnreg need the sm_90a
target, so it is a separate build with its own `-gencode`, loaded by `load_gemm()`; a failure there
leaves the other ops running), and `bertaccel_attention` (the fused attention, sm_80+, loaded by
`load_attention()`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import socket
import time
import warnings
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
# Autograd of every public op on CUDA (csrc/autograd.cpp) and the direct eager entry points (csrc/eager.cpp),
# host code only; the op families' own sources come from bertaccel.ops.registry, the other ops' (the
# optimizer's) from OTHER_OP_MODULES.
SHARED_SOURCES = ["autograd.cpp", "eager.cpp"]
# ops that are not kernel-swap families (modules whose schemas must exist before the kernels register)
OTHER_OP_MODULES = ["adamw", "bias_grad"]


def _other_op_modules():
    import importlib

    return [importlib.import_module(f"bertaccel.ops.{name}") for name in OTHER_OP_MODULES]


def sources() -> list[str]:
    from bertaccel.ops import registry

    return registry.cuda_sources() + [s for m in _other_op_modules() for s in m.CUDA_SOURCES] + SHARED_SOURCES



def included_headers(srcs: list[str]) -> list[str]:
    """The csrc headers that `srcs` include (`#include "..."`), directly or through other headers, sorted: hashed
    with the sources into an extension's build key, so that editing any of them rebuilds it (found, not listed by
    hand: a header left off a hand-kept list let a stale build serve edited code)."""
    pattern = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
    seen: set[str] = set()
    todo = list(srcs)
    while todo:
        for name in pattern.findall((CSRC / todo.pop()).read_text()):
            if name not in seen and (CSRC / name).is_file():
                seen.add(name)
                todo.append(name)
    return sorted(seen - set(srcs))


# the GEMM extension: sm_90a only (wgmma, setmaxnreg); TORCH_CUDA_ARCH_LIST "9.0a" gives its -gencode
GEMM_SOURCES = ["gemm.cu", "gemm_plain.cu", "gemm_bias.cu", "gemm_gelu.cu", "gemm_splitk.cu", "gemm_residual.cu", "gemm_cluster_cooperative.cu", "gemm_cluster_rows.cu", "gemm_fp32.cu"]
GEMM_ARCH = "9.0a"
# the fused attention extension (mma.sync, sm_80+; its sources: bertaccel.ops.attention.CUDA_SOURCES),
# built for the GPU's own arch and loaded by `load_attention()` when attention first needs it; a
# failure there leaves the other ops running
# on a Hopper GPU it is built for sm_90a, with its warpgroup-MMA forward and backward
ATTENTION_SM90A_FLAGS = ["-DBERTACCEL_ATTENTION_SM90A"]


def attention_sources() -> list[str]:
    from bertaccel.ops import attention

    return list(attention.CUDA_SOURCES)
# --resource-usage prints registers / shared memory / spills per kernel into the (verbose) build log.
# C++20, as torch's own cpp_extension defaults and as libtorch is built: torch's headers use C++20 (nvcc
# warned under C++17), and an extension whose inline torch code is compiled to another standard than
# libtorch risks mismatched definitions (session 5: a failing TORCH_CHECK with a number segfaulted).
CUDA_FLAGS = ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo", "--resource-usage"]

_state: dict[str, object] = {"loaded": None, "reason": ""}
# bertaccel_ops imported as a Python module once loaded: csrc/eager.cpp's direct entry points for eager calls
# (eligibility.direct_entry); None before, or where that import failed (the ops then run through torch.ops)
entry = None
_gemm_state: dict[str, object] = {"loaded": None, "reason": ""}
_attention_state: dict[str, object] = {"loaded": None, "reason": ""}


def cache_root() -> Path:
    """Where the compiled extensions live: $BERTACCEL_EXTENSIONS, else $BERTACCEL_CACHE/extensions (default
    ~/.cache/bertaccel/extensions). Each build has its own folder named by a hash of its sources, flags,
    versions and arch, so one folder can serve every checkout and process (the test suite points its
    per-test data caches elsewhere but keeps one extensions folder, so a `pytest -m cuda` run builds once)."""
    explicit = os.environ.get("BERTACCEL_EXTENSIONS")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("BERTACCEL_CACHE", Path.home() / ".cache" / "bertaccel")) / "extensions"


def _arch() -> str:
    env = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if env:
        return env
    major, minor = torch.cuda.get_device_capability()
    return f"{major}.{minor}"


def build_key(files: list[str] | None = None, arch: str | None = None, extra_cuda_flags: list[str] | None = None) -> str:
    h = hashlib.sha256()
    for name in files if files is not None else sources() + included_headers(sources()):
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    h.update(" ".join(CUDA_FLAGS + list(extra_cuda_flags or [])).encode())
    h.update(f"{torch.__version__}|{torch.version.cuda}|{arch or _arch()}".encode())
    return h.hexdigest()[:12]


class BuildLock:
    """An exclusive lock file holding `host:pid`; a lock left by a dead process is broken."""

    def __init__(self, path: Path, poll: float = 1.0, timeout: float = 1800.0) -> None:
        self.path, self.poll, self.timeout = path, poll, timeout

    def _holder_alive(self) -> bool:
        try:
            host, pid = self.path.read_text().strip().split(":")
        except (OSError, ValueError):
            # unreadable or half-written: alive only if very fresh (the holder may be writing it now)
            return self.path.exists() and time.time() - self.path.stat().st_mtime < 5
        if host != socket.gethostname():
            return time.time() - self.path.stat().st_mtime < self.timeout
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def __enter__(self) -> BuildLock:
        start = time.time()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                os.write(fd, f"{socket.gethostname()}:{os.getpid()}".encode())
                os.close(fd)
                return self
            except FileExistsError:
                if not self._holder_alive():
                    log.warning("removing a stale build lock %s (its process is gone)", self.path)
                    self.path.unlink(missing_ok=True)
                    continue
                if time.time() - start > self.timeout:
                    raise TimeoutError(f"waited {self.timeout:.0f}s for the build lock {self.path}") from None
                time.sleep(self.poll)

    def __exit__(self, *exc) -> None:
        self.path.unlink(missing_ok=True)


def _why_not() -> str | None:
    if os.environ.get("BERTACCEL_DISABLE_CUDA_OPS") == "1":
        return "BERTACCEL_DISABLE_CUDA_OPS=1"
    if not torch.cuda.is_available():
        return "no CUDA GPU is available"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None or shutil.which("nvcc", path=os.path.join(CUDA_HOME, "bin")) is None:
        return "no CUDA compiler (nvcc) was found; install the CUDA toolkit or set CUDA_HOME"
    return None


def _settle(state: dict[str, object], reason: str | None, build, what: str, fallback: str) -> bool:
    """Run `build` unless there is already a `reason` not to; record the outcome in `state` and say
    once, as a warning, why `what` is off and what runs instead. True when it is on."""
    if reason is None:
        try:
            build()
        except Exception as e:  # noqa: BLE001 - any build failure means: use PyTorch
            last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
            reason = f"the build failed ({type(e).__name__}: {last})"
    state["loaded"] = reason is None
    state["reason"] = reason or ""
    if reason:
        warnings.warn(f"bertaccel {what} are off: {reason}. {fallback}", stacklevel=3)
    return reason is None


def load(verbose: bool = False) -> bool:
    """Build (if needed) and load the kernels. True when the CUDA ops are registered."""
    if _state["loaded"] is not None:
        return bool(_state["loaded"])
    return _settle(_state, _why_not(), lambda: _build_and_load(verbose), "CUDA ops", "Falling back to PyTorch ops.")


def unavailable_reason() -> str:
    load()
    return str(_state["reason"])


def loaded() -> bool | None:
    """Whether the ops are loaded: None before the first `load()` has settled it."""
    return _state["loaded"]  # type: ignore[return-value]


def reason() -> str:
    """Why the ops are off ("" while loaded or not yet tried); never starts a build."""
    return str(_state["reason"])


def load_gemm(verbose: bool = False) -> bool:
    """Build (if needed) and load the Hopper GEMM. True when `bertaccel::gemm` has its CUDA kernel."""
    if _gemm_state["loaded"] is not None:
        return bool(_gemm_state["loaded"])
    reason = _why_not()
    if reason is None and torch.cuda.get_device_capability() != (9, 0):
        major, minor = torch.cuda.get_device_capability()
        reason = f"the GEMM kernels use Hopper (sm_90a) instructions; this GPU is sm_{major}{minor}"

    defines = gemm_defines()  # a malformed setting is an error, not a silent fallback to cuBLAS

    def build() -> None:
        _build_and_load_extension("bertaccel_gemm", GEMM_SOURCES, GEMM_SOURCES + included_headers(GEMM_SOURCES), GEMM_ARCH, verbose,
                                  defines)

    return _settle(_gemm_state, reason, build, "GEMM kernels", "Linear layers use cuBLAS.")


def gemm_defines(value: str | None = None) -> list[str]:
    """`BERTACCEL_GEMM_DEFINES="NAME NAME=1"`: preprocessor macros for the GEMM build (`-DNAME`), for comparing
    kernel variants that the sources select with `#if` (each set of macros builds into its own cached folder).
    """
    value = os.environ.get("BERTACCEL_GEMM_DEFINES", "") if value is None else value
    flags = []
    for item in value.split():
        if not re.fullmatch(r"BERTACCEL_[A-Z0-9_]+(=[A-Za-z0-9_]+)?", item):
            raise ValueError(f"BERTACCEL_GEMM_DEFINES: {item!r} is not NAME or NAME=VALUE with NAME starting "
                             "BERTACCEL_ (letters, digits, _); e.g. BERTACCEL_GEMM_DEFINES=BERTACCEL_GEMM_HEAVY_EPILOGUE=0")
        flags.append(f"-D{item}")
    return flags


def gemm_loaded() -> bool | None:
    """Whether the GEMM is loaded: None before the first `load_gemm()` has settled it."""
    return _gemm_state["loaded"]  # type: ignore[return-value]


def gemm_reason() -> str:
    return str(_gemm_state["reason"])


def load_attention(verbose: bool = False) -> bool:
    """Build (if needed) and load the fused attention. True when `bertaccel::varlen_attention_fwd`
    has its CUDA kernel."""
    if _attention_state["loaded"] is not None:
        return bool(_attention_state["loaded"])
    reason = _why_not()
    if reason is None and torch.cuda.get_device_capability() < (8, 0):
        major, minor = torch.cuda.get_device_capability()
        reason = f"the attention kernels use sm_80 tensor-core instructions; this GPU is sm_{major}{minor}"

    def build() -> None:
        srcs = attention_sources()
        arch = _attention_arch()
        flags = ATTENTION_SM90A_FLAGS if arch == "9.0a" else []
        _build_and_load_extension("bertaccel_attention", srcs, srcs + included_headers(srcs), arch, verbose, flags)

    return _settle(_attention_state, reason, build, "attention kernels",
                   "Attention uses PyTorch's (FlashAttention varlen or SDPA).")


def _attention_arch() -> str:
    """The attention extension's arch: the GPU's own, "9.0a" on a Hopper (sm_90a: wgmma), unless
    TORCH_CUDA_ARCH_LIST names one."""
    arch = _arch()
    return "9.0a" if arch == "9.0" and not os.environ.get("TORCH_CUDA_ARCH_LIST") else arch


def attention_loaded() -> bool | None:
    """Whether the attention kernels are loaded: None before the first `load_attention()`."""
    return _attention_state["loaded"]  # type: ignore[return-value]


def attention_reason() -> str:
    return str(_attention_state["reason"])


def _build_and_load(verbose: bool) -> None:
    global entry
    library_file = _build_and_load_extension("bertaccel_ops", sources(), sources() + included_headers(sources()), _arch(), verbose)
    entry = _import_entry(library_file)


def _import_entry(library_file: Path):
    """The loaded library as a Python module (its PYBIND11_MODULE, csrc/eager.cpp): the same shared object, so
    nothing registers twice. None, with a warning, when that fails; the ops stay on through torch.ops."""
    import importlib.util

    try:
        spec = importlib.util.spec_from_file_location(library_file.stem, library_file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except Exception as e:  # noqa: BLE001 - the direct entry is an optimisation, not a requirement
        warnings.warn(f"bertaccel: the ops' direct eager entry did not import ({type(e).__name__}: {e}); "
                      "eager calls go through torch.ops", stacklevel=2)
        return None


def _build_and_load_extension(name: str, srcs: list[str], hashed: list[str], arch: str, verbose: bool,
                              extra_cuda_flags: list[str] | None = None) -> Path:
    """Build `name` (unless this key's build is done) and load it into torch.ops; the library's path."""
    from torch.utils.cpp_extension import load as cpp_load

    from bertaccel.ops import registry

    registry.modules()  # the schemas must exist before the kernels register
    _other_op_modules()
    import bertaccel.ops.attention  # noqa: F401

    extra_cuda_flags = list(extra_cuda_flags or [])
    key = build_key(hashed, arch, extra_cuda_flags)
    build_dir = cache_root() / f"{name}_{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    done = build_dir / "BUILT"
    if local_rank != 0:  # rank 0 builds; the others wait for it, then load the same library
        deadline = time.time() + 1800
        while not done.exists() and time.time() < deadline:
            time.sleep(1.0)
    t0 = time.time()
    library_file = build_dir / f"{name}_{key}.so"
    if done.exists() and library_file.exists():
        # The folder is keyed by sources, flags, versions and arch: a finished build is current.
        torch.ops.load_library(str(library_file))
        log.info("%s loaded from %s", name, library_file)
        return library_file
    with BuildLock(build_dir / "bertaccel.lock"):
        # torch's own baton file: we hold our lock, so any baton left here is from a dead build.
        (build_dir / "lock").unlink(missing_ok=True)
        if not done.exists():
            print(f"bertaccel: building {name} (first use, about a minute) in {build_dir}", flush=True)
        previous = os.environ.get("TORCH_CUDA_ARCH_LIST")
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch
        try:
            cpp_load(
                name=f"{name}_{key}",
                sources=[str(CSRC / s) for s in srcs],
                extra_cflags=["-O3", "-std=c++20"],
                extra_cuda_cflags=CUDA_FLAGS + extra_cuda_flags,
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=verbose,
            )
        finally:
            if previous is None:
                os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
            else:
                os.environ["TORCH_CUDA_ARCH_LIST"] = previous
        done.touch()
    log.info("%s loaded in %.1fs from %s", name, time.time() - t0, build_dir)
    return library_file
