"""The default process group is destroyed at interpreter exit on every backend (Lightning does it for NCCL
only; a gloo group left to finalization can abort a rank at exit), registered once, and only once a group
exists. Each case runs in its own process (PG_EXIT_CASE names it): the group and the atexit handler are
process-wide."""

from __future__ import annotations

import textwrap

from tests.conftest import run_in_child

CHILD = textwrap.dedent(
    """
    import os, tempfile
    import torch
    import torch.distributed as dist
    from bertaccel.process_group_exit import destroy_process_group_at_exit

    real = dist.destroy_process_group
    def destroy(group=None):
        print("destroyed", flush=True)
        real(group)
    dist.destroy_process_group = destroy

    print("before init:", destroy_process_group_at_exit(), flush=True)
    store = tempfile.mkdtemp()
    dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
    case = os.environ["PG_EXIT_CASE"]
    if case == "module_setup":  # every bertaccel LightningModule registers it in its setup
        import bertaccel.process_group_exit as pge
        from bertaccel.modules import BertClassifier
        from tests.conftest import TINY_BERT
        BertClassifier(config=TINY_BERT, num_labels=2).setup("fit")
        print("after setup:", pge._registered, flush=True)
    else:
        print("after init:", destroy_process_group_at_exit(), destroy_process_group_at_exit(), flush=True)
    t = torch.ones(3)
    dist.all_reduce(t, async_op=True).wait()
    if case == "destroy_first":  # the program destroyed it itself: the handler leaves it alone
        real()
    print("exiting", flush=True)
    """
)


def run_child(case: str):
    return run_in_child(CHILD, {"PG_EXIT_CASE": case}, timeout=300)


def test_the_group_is_destroyed_once_at_exit():
    r = run_child("leave")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == ["before init: False", "after init: True True", "exiting", "destroyed"], r.stdout


def test_a_group_the_program_destroyed_is_left_alone():
    r = run_child("destroy_first")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == ["before init: False", "after init: True True", "exiting"], r.stdout


def test_every_module_setup_registers_it():
    r = run_child("module_setup")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == ["before init: False", "after setup: True", "exiting", "destroyed"], r.stdout
