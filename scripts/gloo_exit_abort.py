"""How often a gloo rank aborts at exit when its process group is left to interpreter finalization, and
whether `bertaccel.process_group_exit.destroy_process_group_at_exit` stops it.

Each trial starts two processes (gloo, world size 2) that all-reduce a few tensors whose only Python
reference dies when the call returns, then exit: the group's worker thread can still be dropping the
last work object - and with it a tensor whose Python object needs the GIL - while the interpreter is
being finalized, and the process dies with "terminate called without an active exception" (SIGABRT,
exit 134; pytorch/pytorch#190489). That is the CPU DDP fit's rare failure at exit (CI, session 79).
Trials alternate between the two settings (left to finalization / destroyed at exit):

    python scripts/gloo_exit_abort.py --trials 100
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap

from lightning.fabric.plugins.environments.lightning import find_free_network_port

CHILD = textwrap.dedent(
    """
    import os
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=2)
    if os.environ["DESTROY_AT_EXIT"] == "1":
        from bertaccel.process_group_exit import destroy_process_group_at_exit
        destroy_process_group_at_exit()

    def last_collectives(n):
        for _ in range(n):
            dist.all_reduce(torch.ones(1 << 12))  # the tensor's only Python reference dies on return

    last_collectives(int(os.environ["COLLECTIVES"]))
    """
)


def trial(destroy_at_exit: bool, collectives: int) -> tuple[int, int, str]:
    """The two ranks' exit codes and the stderr of one that failed."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_network_port()),
               DESTROY_AT_EXIT=str(int(destroy_at_exit)), COLLECTIVES=str(collectives))
    procs = [subprocess.Popen([sys.executable, "-c", CHILD], env=dict(env, RANK=str(r)), stderr=subprocess.PIPE,
                              text=True) for r in range(2)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    codes = [p.returncode for p in procs]
    failed = next((e for c, e in zip(codes, errs) if c != 0), "")
    return codes[0], codes[1], failed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=50, help="trials of each setting (alternated)")
    ap.add_argument("--collectives", type=int, default=3, help="all-reduces right before the exit")
    args = ap.parse_args()
    failures = {False: 0, True: 0}
    seen: dict[str, int] = {}
    for i in range(args.trials):
        for destroy in (False, True):
            c0, c1, err = trial(destroy, args.collectives)
            if c0 or c1:
                failures[destroy] += 1
                line = next((x for x in err.splitlines() if x.strip()), f"exit {c0} / {c1}")
                seen[line] = seen.get(line, 0) + 1
        print(f"\rtrial {i + 1}/{args.trials}: aborted left to finalization {failures[False]}, "
              f"destroyed at exit {failures[True]}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    print(f"torch {__import__('torch').__version__}, {os.cpu_count()} CPUs, {args.collectives} all-reduces before exit")
    print(f"group left to finalization: {failures[False]} of {args.trials} trials had a rank fail")
    print(f"group destroyed at exit:    {failures[True]} of {args.trials} trials had a rank fail")
    for line, n in seen.items():
        print(f"  {n}x {line}")


if __name__ == "__main__":
    main()
