"""Compile the CUDA ops on a machine without a GPU: errors, and registers / spills per kernel.

    python scripts/compile_check.py [--arch sm_90] [--only layer_norm_bwd.cu] [--filter Li8E]
    python scripts/compile_check.py --only layer_norm_fwd.cu --ptx /tmp/before   # then, after a change:
    python scripts/compile_check.py --only layer_norm_fwd.cu --ptx /tmp/after
    python scripts/compile_check.py --compare-ptx /tmp/before /tmp/after

What the JIT build does on the GPU host (`bertaccel.ops.build`), minus the link, with `nvcc -c
--resource-usage` per translation unit. A CPU-only torch wheel ships no cuBLAS/cuSPARSE/cuSOLVER
headers, which ATen's CUDA headers include for their handle types: small stand-ins are written to a
temporary folder (the kernels never call those libraries). No cuRAND header is needed: the
dropouts draw from their own Philox4x32 (`csrc/philox.cuh`).

`--ptx DIR` also writes each source's PTX to DIR/<source>.ptx with what does not change what the GPU
runs taken out (debug line records, the per-translation-unit hashes in internal names), so that a
refactor meant to change no instruction can be checked without a GPU: identical files after the
change mean identical kernels. `--loads-in-flight` (needs nvdisasm: $NVDISASM, on PATH, or the `nvidia-cuda-nvdisasm` wheel's, found by itself)
also builds a cubin and prints, per kernel, how many 16-byte global loads a thread has in flight at
most (a load counts from its issue until an instruction reads or overwrites one of its registers): a
row kernel meant to issue all of a row's loads before using any should show that many.
`--sass DIR` writes each source's SASS to DIR/<source>.sass (nvdisasm, as above). `--instructions` prints each
kernel's static SASS instruction count and its most frequent opcodes (every path counted once, the dropout branch
too: compare instantiations or versions of one kernel, not kernels with each other).
`--compare-ptx BEFORE AFTER` says per kernel whether its PTX is
identical, the same instructions in another order (the same count of every opcode), or different
(the opcodes whose counts moved).
`--compare-loops BEFORE.sass AFTER.sass [--filter NAME]` (two --sass listings of one source) gives per
kernel its main loop's instruction count (the largest range a branch jumps back over) before -> after,
and the opcodes that moved: e.g. a per-element test the compiler if-converted into every iteration.

The sm_90a sources (the GEMM; attention when --arch is sm_90, as a Hopper builds it) also report
ptxas's warpgroup-MMA advisories with the kernels they name: C7514 (every wgmma of the kernel
serialized, e.g. a wgmma wait under a run-time condition, or a non-wgmma instruction touching an
accumulator inside the pipeline stage) and C7519 (a warpgroup.arrive injected). ptxas prints them as
"info", not as warnings, so a build log shows them only when asked.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src")]

NEEDS_CUBLAS = {"dense_wgrad.cu"}  # sources that call cuBLAS's API, not just name its handle types
STUBS = {
    "cusparse.h": "#pragma once\ntypedef struct cusparseContext* cusparseHandle_t;\ntypedef int cusparseStatus_t;\n",
    "cublas_v2.h": "#pragma once\n#include <cuda_runtime.h>\ntypedef struct cublasContext* cublasHandle_t;\ntypedef int cublasStatus_t;\n",
    "cublasLt.h": "#pragma once\ntypedef struct cublasLtContext* cublasLtHandle_t;\n",
    "cusolver_common.h": "#pragma once\ntypedef int cusolverStatus_t;\n",
    "cusolverDn.h": "#pragma once\n#include \"cusolver_common.h\"\ntypedef struct cusolverDnContext* cusolverDnHandle_t;\n",
    "c10/cuda/impl/cuda_cmake_macros.h": "#pragma once\n",
}


def demangle(symbol: str) -> str:
    """The kernel's C++ name (c++filt when there is one), without its parameter list."""
    filt = shutil.which("c++filt")
    if filt is None:
        return symbol
    name = subprocess.run([filt, symbol], capture_output=True, text=True).stdout.strip() or symbol
    return name.replace("(anonymous namespace)::", "").split("(")[0]


def normalized_ptx(text: str) -> str:
    """PTX without what varies between two compiles of equivalent sources: `.loc` / `.file` records and
    the `.debug_*` sections, comments, the translation unit's hash in internal-linkage names, and the numbering of virtual
    registers and branch labels (renumbered per function in order of first appearance: a reordering
    that changes no instruction then changes nothing here)."""
    keep, names, in_debug = [], {}, False
    for line in text.splitlines():
        if line.startswith((".entry", ".visible .entry", ".func", ".visible .func")):
            names = {}  # virtual registers are numbered per function, in order of first use
        stripped = line.strip()
        # -lineinfo's .debug_* sections: byte strings that spell the hashed names out
        if stripped.startswith(".section") and ".debug" in stripped:
            in_debug = True
        if in_debug:
            in_debug = stripped != "}"
            continue
        if stripped.startswith((".loc", ".file", "//")) or not stripped:
            continue
        # <hash>_<n>_<source>_cu_<hash>_<nvcc's process id>: the digits after it (the id, and the
        # length of the next name component) go too - alike in both compiles
        line = re.sub(r"_INTERNAL_[0-9a-f]{8}_\d+_[A-Za-z0-9_]+?_cu_[0-9a-f]{8}_?\d*", "_INTERNAL_", line)
        line = re.sub(r"_GLOBAL__N__[0-9a-f]{8}_\d+_[A-Za-z0-9_]+?_cu_[0-9a-f]{8}_?\d*", "_GLOBAL__N_", line)
        line = re.sub(r"%(?:rd|fd|rs|hh|r|f|p|h)\d+\b", lambda m: names.setdefault(m.group(0), f"%v{len(names)}"), line)
        line = re.sub(r"\$L__BB\d+_\d+", lambda m: names.setdefault(m.group(0), f"$L{len(names)}"), line)
        keep.append(line)
    return "\n".join(keep) + "\n"


def ptx_kernels(text: str) -> dict[str, list[str]]:
    """A normalized PTX file's functions: name -> lines."""
    kernels, current = {}, None
    for line in text.splitlines():
        if re.match(r"^(\.visible )?\.(entry|func)\b", line):
            current = line.split("(")[0].split()[-1]
            kernels[current] = []
        if current is not None:
            kernels[current].append(line)
    return kernels


def opcode_counts(lines: list[str]) -> Counter:
    counts = Counter()
    for line in lines:
        text = re.sub(r"^@!?%\S+\s+", "", line.strip())
        if text and not text.startswith((".", "$", "{", "}", ")", "//")):
            counts[text.split()[0].rstrip(";")] += 1
    return counts


SASS_INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]+)\*/\s*(.*?);")  # /*address*/ instruction ;


def sass_listings(text: str) -> dict[str, list[str]]:
    """nvdisasm -c output: function name -> its raw lines (labels and addresses kept)."""
    functions, current = {}, None
    for line in text.splitlines():
        m = re.match(r"\s*\.text\.(\S+):", line)
        if m:
            current = functions.setdefault(m.group(1), [])
        elif current is not None:
            current.append(line)
    return functions


def sass_functions(text: str) -> dict[str, list[str]]:
    """nvdisasm -c output: function name -> its instructions (predicate kept, no addresses)."""
    return {name: [m.group(2).strip() for line in lines if (m := SASS_INSTRUCTION.match(line))]
            for name, lines in sass_listings(text).items()}


def main_loop(lines: list[str]) -> list[str]:
    """The instructions of a function's largest loop: from a label to the last branch back to it (the
    kernels' main loops; unrolled inner loops leave no branch). Empty when there is no backward branch.
    The out-of-line retry blocks of an mbarrier wait (try_wait, a branch back to itself, a branch back to
    where the wait was) are not loops: ptxas places them after the function's body, so the branch that
    resumes would otherwise make the span from the wait to the function's end look like the largest loop.
    Nor is any other block placed after the body that branches back into it (e.g. a divergent shuffle's
    BRA.DIV fallback): a span holding an unpredicated EXIT is skipped."""
    instructions, label_at, pending = [], {}, []
    for line in lines:
        m = re.match(r"\s*\.?(L_x_\d+|\$L\w+):", line)
        if m:
            pending.append(m.group(1))
            continue
        m = SASS_INSTRUCTION.match(line)
        if m:
            for name in pending:
                label_at[name] = len(instructions)
            pending = []
            instructions.append(m.group(2).strip())
    best = (0, -1)
    for i, ins in enumerate(instructions):
        m = re.search(r"BRA\s+(?:`\()?\.?(L_x_\d+|\$L\w+)", ins)
        if not m or m.group(1) not in label_at or label_at[m.group(1)] > i:
            continue
        if any("SYNCS.PHASECHK" in x for x in instructions[max(0, i - 2):i]):  # an mbarrier wait's retry block
            continue
        if any(x.split()[0] == "EXIT" for x in instructions[label_at[m.group(1)]:i]):  # placed after the body's end
            continue
        if i - label_at[m.group(1)] > best[1] - best[0]:
            best = (label_at[m.group(1)], i)
    return instructions[best[0]:best[1] + 1]


def base_opcodes(instructions: list[str]) -> Counter:
    """SASS opcodes without predicate and modifiers (ISETP.GE.AND -> ISETP), counted."""
    return Counter(re.sub(r"^@!?U?P\w+\s+", "", i).split()[0].split(".")[0] for i in instructions)


def compare_loops(before: Path, after: Path, name_filter: str) -> int:
    """Per kernel of two SASS listings (--sass) whose name contains name_filter: its main loop's
    instruction count before -> after, and the opcodes whose counts moved (or the ten most frequent).
    A static count: an instruction behind a branch the loop usually skips counts as one that runs."""
    def by_name(text: str) -> dict[str, tuple[str, list[str]]]:  # keyed without the translation unit's hash
        return {re.sub(r"_GLOBAL__N__[0-9a-f]{8}_\d+_[A-Za-z0-9_]+?_cu_[0-9a-f]{8}_?\d*", "_GLOBAL__N_", n): (n, lines)
                for n, lines in sass_listings(text).items()}

    a, b = by_name(before.read_text()), by_name(after.read_text())
    for key in sorted(set(a) & set(b)):
        name = a[key][0]
        if name_filter not in name or "kernel" not in name:
            continue
        la, lb = main_loop(a[key][1]), main_loop(b[key][1])
        ca, cb = base_opcodes(la), base_opcodes(lb)
        moved = {op: f"{ca[op]}->{cb[op]}" for op in sorted(set(ca) | set(cb), key=lambda o: -(ca[o] + cb[o])) if ca[op] != cb[op]}
        print(f"  main loop {len(la):5d} -> {len(lb):5d}  {demangle(name).replace('void bertaccel::', '')[:100]}")
        print(f"      {dict(list(moved.items())[:12]) or dict(cb.most_common(10))}")
    return 0


def loads_in_flight(instructions: list[str]) -> int:
    """The most 16-byte global loads (LDG.E.128) pending at once, in program order: a load is pending
    from its issue until an instruction reads one of its four destination registers, or writes one."""
    pending, most = set(), 0
    for ins in instructions:
        body = re.sub(r"^@!?U?P\w+\s+", "", ins)
        parts = body.split(None, 1)
        if len(parts) < 2:
            continue
        opcode, operands = parts
        regs = [int(r) for r in re.findall(r"\bR(\d+)\b", operands)]
        if not regs:
            continue
        stores = opcode.startswith(("ST", "RED", "ATOM"))
        reads = regs if stores else regs[1:]
        written = None if stores or opcode.startswith(("ISETP", "FSETP", "BRA")) else regs[0]
        for base in list(pending):
            quad = range(base, base + 4)
            if any(r in quad for r in reads) or (written is not None and written in quad):
                pending.discard(base)
        if opcode.startswith("LDG.E.128"):
            pending.add(regs[0])
            most = max(most, len(pending))
    return most


def wheel_nvdisasm() -> str | None:
    """nvdisasm from the `nvidia-cuda-nvdisasm` wheel (nvidia/cu*/bin/nvdisasm in site-packages), if installed."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for path in sorted(Path(root).glob("cu*/bin/nvdisasm")) + sorted(Path(root).glob("cuda_nvdisasm/bin/nvdisasm")):
            if os.access(path, os.X_OK):
                return str(path)
    return None


def disassemble(cubin: Path) -> str | None:
    """The cubin's SASS (`nvdisasm -c`), or None (with a message) when there is no nvdisasm."""
    nvdisasm = os.environ.get("NVDISASM") or shutil.which("nvdisasm") or wheel_nvdisasm()
    if nvdisasm is None:
        print("  (no nvdisasm: `pip install nvidia-cuda-nvdisasm`, set NVDISASM or put it on PATH)")
        return None
    return subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True).stdout


def report_loads_in_flight(sass: str, name_filter: str) -> None:
    for name, instructions in sorted(sass_functions(sass).items()):
        if name_filter in name and "kernel" in name:
            print(f"  {loads_in_flight(instructions):>3} loads in flight  {demangle(name).replace('void bertaccel::', '')[:110]}")


def report_instructions(sass: str, name_filter: str) -> None:
    for name, instructions in sorted(sass_functions(sass).items()):
        if name_filter in name and "kernel" in name:
            top = ", ".join(f"{op} {n}" for op, n in base_opcodes(instructions).most_common(8))
            print(f"  {len(instructions):>5} instructions  {demangle(name).replace('void bertaccel::', '')[:100]}  ({top})")


def compare_ptx(before: Path, after: Path) -> int:
    """Per kernel of each PTX file in both folders: identical / reordered / different."""
    different = 0
    for old in sorted(before.glob("*.ptx")):
        new = after / old.name
        if not new.exists():
            print(f"== {old.name}: not in {after}")
            continue
        a, b = ptx_kernels(old.read_text()), ptx_kernels(new.read_text())
        tally = Counter()
        for name in sorted(set(a) | set(b)):
            if name not in a or name not in b:
                tally["only in one"] += 1
                print(f"  only in {'after' if name in b else 'before'}: {demangle(name)[:110]}")
            elif a[name] == b[name]:
                tally["identical"] += 1
            elif opcode_counts(a[name]) == opcode_counts(b[name]):
                tally["reordered"] += 1
            else:
                tally["different"] += 1
                ca, cb = opcode_counts(a[name]), opcode_counts(b[name])
                moved = {op: cb[op] - ca[op] for op in sorted(set(ca) | set(cb)) if ca[op] != cb[op]}
                print(f"  different: {demangle(name)[:110]}  {moved}")
        different += tally["different"] + tally["only in one"]
        print(f"== {old.name}: " + ", ".join(f"{n} {k}" for k, n in tally.items()))
    return 1 if different else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--only", nargs="*", help="source files (default: the build's)")
    ap.add_argument("--filter", default="", help="show kernels whose mangled name contains this")
    ap.add_argument("--cublas-include", default="", help="a real cuBLAS include folder (default $CUBLAS_INCLUDE); "
                    "without one the sources that call cuBLASLt are skipped")
    ap.add_argument("--ptx", type=Path, help="also write each source's normalized PTX into this folder")
    ap.add_argument("--loads-in-flight", action="store_true",
                    help="also report each kernel's most 16-byte loads in flight (SASS, needs nvdisasm)")
    ap.add_argument("--instructions", action="store_true",
                    help="also report each kernel's static SASS instruction count and top opcodes (needs nvdisasm)")
    ap.add_argument("--sass", type=Path, help="also write each source's SASS (nvdisasm) into this folder (implies a cubin)")
    ap.add_argument("--compare-ptx", nargs=2, type=Path, metavar=("BEFORE", "AFTER"),
                    help="compare two --ptx folders kernel by kernel (no compiling)")
    ap.add_argument("--compare-loops", nargs=2, type=Path, metavar=("BEFORE", "AFTER"),
                    help="compare two --sass listings of one source: each kernel's main-loop instructions (no compiling)")
    args = ap.parse_args()
    cubin = args.loads_in_flight or args.instructions or args.sass is not None
    if args.compare_ptx:
        return compare_ptx(*args.compare_ptx)
    if args.compare_loops:
        return compare_loops(*args.compare_loops, args.filter)
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("no nvcc on PATH", file=sys.stderr)
        return 2
    import torch.utils.cpp_extension as ext

    from bertaccel.ops import build

    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        for name, text in STUBS.items():
            (scratch / name).parent.mkdir(parents=True, exist_ok=True)
            (scratch / name).write_text(text)
        # a real cuBLAS include folder (e.g. the nvidia-cublas wheel's nvidia/cu13/include) goes before the
        # stand-ins: dense_wgrad.cu calls cuBLASLt's API, which the stand-ins do not declare
        cublas = args.cublas_include or os.environ.get("CUBLAS_INCLUDE")
        includes = [f"-I{p}" for p in ext.include_paths()] + ([f"-I{cublas}"] if cublas else []) + [f"-I{scratch}"]
        failed = 0
        attention = build.attention_sources()
        for source in args.only or [s for s in build.sources() + build.GEMM_SOURCES + attention if s.endswith(".cu")]:
            # the GEMM is its own sm_90a build (wgmma, setmaxnreg): the -gencode form, as the JIT build passes it;
            # attention too, with its warpgroup-MMA forward, as built on a Hopper GPU
            if source in NEEDS_CUBLAS and not cublas:
                print(f"{source}: skipped (calls cuBLASLt: pass --cublas-include, e.g. the nvidia-cublas wheel's include folder)")
                continue
            sm90a = source in build.GEMM_SOURCES or (source in attention and args.arch == "sm_90")
            arch = ["-gencode=arch=compute_90a,code=sm_90a"] if sm90a else [f"-arch={args.arch}"]
            if source in attention and sm90a:
                arch += build.ATTENTION_SM90A_FLAGS
            # a cubin (device code only) when its SASS is to be read; ptxas reports registers either way
            out = scratch / (f"{source}.cubin" if cubin else f"{source}.o")
            defines = build.gemm_defines() if source in build.GEMM_SOURCES else []  # BERTACCEL_GEMM_DEFINES, as built
            cmd = [nvcc, "-cubin" if cubin else "-c", *arch, *build.CUDA_FLAGS, *defines, *includes,
                   "-DTORCH_EXTENSION_NAME=check", str(build.CSRC / source), "-o", str(out)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            print(f"== {source}: {'ok' if proc.returncode == 0 else 'FAILED'}")
            if proc.returncode != 0:
                failed += 1
                print("\n".join(line for line in proc.stderr.splitlines() if "error" in line)[:4000])
                continue
            sass = disassemble(out) if cubin else None
            if sass is not None and args.loads_in_flight:
                report_loads_in_flight(sass, args.filter)
            if sass is not None and args.instructions:
                report_instructions(sass, args.filter)
            if sass is not None and args.sass is not None:
                args.sass.mkdir(parents=True, exist_ok=True)
                (args.sass / f"{source}.sass").write_text(sass)
            if args.ptx is not None:
                args.ptx.mkdir(parents=True, exist_ok=True)
                ptx = scratch / f"{source}.ptx"
                ptx_arch = "-arch=sm_90a" if sm90a else f"-arch={args.arch}"
                gen = subprocess.run([nvcc, "-ptx", ptx_arch, *cmd[3:cmd.index("-o")], "-o", str(ptx)],
                                     capture_output=True, text=True)
                if gen.returncode == 0:
                    (args.ptx / f"{source}.ptx").write_text(normalized_ptx(ptx.read_text()))
            # warnings, and ptxas's performance advisories (C7514: wgmma serialized; C7519: an injected
            # warpgroup.arrive) with the kernels they name
            found = {(c, re.sub(r" (in )?around line \d+", "", t)) for c, t in re.findall(r"\((C75\d\d)\) (.*?) in (?:the )?function", proc.stderr)}
            for code, text in sorted(found):
                names = sorted({demangle(f) for f in re.findall(rf"\({code}\) .*? in (?:the )?function '(\S+)'", proc.stderr)})
                print(f"  {code} {text[:150]}: {len(names)} kernels, e.g. {names[0][:90] if names else '?'}")
            for line in sorted({line for line in proc.stderr.splitlines() if "warning" in line.lower()})[:20]:
                print("  " + line[-220:])
            kernel, previous = None, ""  # ptxas prints a kernel's spill line just before its register line
            for line in proc.stderr.splitlines():
                m = re.search(r"Function properties for (\S+)", line)
                if m:
                    kernel = m.group(1)
                m = re.search(r"Used (\d+) registers", line)
                if m and kernel and args.filter in kernel and "kernel" in kernel:
                    spill = re.search(r"(\d+) bytes spill stores", previous)
                    name = demangle(kernel).replace("void bertaccel::", "")
                    print(f"  {int(m.group(1)):>3} registers  {spill.group(1) if spill else '?':>4} B spilled  {name[:110]}")
                previous = line
        return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
