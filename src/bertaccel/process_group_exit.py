"""Destroy the default process group when the interpreter exits, on every rank and for every backend.

Lightning registers this for NCCL only (`lightning.fabric.utilities.distributed._init_dist_connection`). A
gloo group still alive at exit is torn down during interpreter finalization, where the group's worker threads
can still hold finished work (tensors with Python references): the process aborts with "terminate called
without an active exception" (SIGABRT; pytorch/pytorch#190489, #179291). Under Lightning's subprocess
launcher a rank that dies that way takes the others down with it (`_ChildProcessObserver` kills them all): a
2-process CPU fit that had finished its work failed at exit once in 26 runs (and once in CI). Two processes
that exit right after three all-reduces (`scripts/gloo_exit_abort.py`, torch 2.13 CPU, 2 cores): 33 of 100
trials aborted with the group left to finalization, 0 of 100 with it destroyed here.

`atexit` handlers run while the interpreter is whole; destroying the group there is local for gloo (its
`shutdown` joins its own threads, no collective), and a group destroyed earlier by anyone is left alone.
"""

from __future__ import annotations

import atexit

import torch

_registered = False


def destroy_process_group_at_exit() -> bool:
    """Register, once per process, the destruction of the default process group at interpreter exit.
    Returns whether it is registered (False where no process group is initialized yet)."""
    global _registered
    if _registered:
        return True
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    atexit.register(_destroy_default_group)
    _registered = True
    return True


def _destroy_default_group() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
