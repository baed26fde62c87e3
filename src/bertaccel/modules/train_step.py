"""The body of a graphed training step: forward, backward, gradient handling and the optimizer update,
as one function that `StepGraphs` captures and replays.

`BertModule` builds its graphed step here, and so do the benchmarks that time that step outside
Lightning (`benchmarks/e2e.py`, `scripts/step_anatomy.py`): what they measure is what `bertaccel fit`
runs, not a copy of it that could drift.

Gradients. Every parameter the optimizer holds has a static `.grad` buffer (made before the first
capture, kept for the whole fit: a captured kernel writes to fixed addresses). Inside the step:

- bf16 weight copies (`Bf16WeightCopies`, bf16-mixed): the forward runs on the copies, their
  bf16 gradients go into the masters' static fp32 buffers in one multi-tensor copy (an add under
  accumulation), and one multi-tensor copy refreshes the copies after the update.
- Without accumulation, every other parameter's `.grad` is set aside (None) for the backward, so
  autograd hands it the fresh gradient tensor instead of adding it into the buffer (one add
  kernel per parameter saved: ~70 per MiniLM step, the word embeddings' 47 MB among them); the
  optimizer and the clipping read those, and the static buffers (zeros) are put back after the
  update. Parameters the forward did not use get no gradient and no update, as in Lightning's
  eager loop, whose `zero_grad` sets None.
- With accumulation (`accumulate > 1`) the static buffers collect the micro-batches' gradients
  (the loss is scaled by 1 / accumulate), and the last micro-step zeroes them after the update.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from bertaccel.modules.weight_copies import Bf16WeightCopies


def build_train_step(
    forward: Callable[..., dict[str, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    *,
    copies: Bf16WeightCopies | None = None,
    accumulate: int = 1,
    last: bool = True,
    clip: tuple[float, str] | None = None,
    autocast: Callable[[], Any] = contextlib.nullcontext,
    transient_grads: bool = True,
) -> Callable[..., dict[str, torch.Tensor]]:
    """A step function `step(**inputs) -> {name: detached tensor}` for `StepGraphs`.

    forward: `forward(**inputs)` returns a dict holding "loss" (and whatever else the step reports).
    copies: bf16 weight copies to run the forward on (None: the model's own weights).
    accumulate, last: micro-batches per update, and whether this step function ends one (updates).
    clip: (value, "norm" | "value") gradient clipping before the update, or None.
    autocast: a context factory the forward runs in (e.g. bf16 autocast).
    transient_grads: without accumulation, hand autograd's fresh gradients to the optimizer instead of
        adding them into the static buffers (False: add and zero, the step before this change; kept for
        `scripts/step_anatomy.py`'s comparison).

    Every parameter of `optimizer` that requires grad must have its static `.grad` buffer already.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    missing = [i for i, p in enumerate(params) if p.requires_grad and p.grad is None]
    if missing:
        raise RuntimeError(f"build_train_step: {len(missing)} parameters have no static .grad buffer; "
                           "make them (zeros) before building the step")
    scale = 1.0 / accumulate
    copied = {id(m) for m in copies.masters} if copies else set()
    transient = [p for p in params if p.grad is not None and id(p) not in copied] if accumulate == 1 else []
    if not transient_grads:
        transient = []
    statics = [p.grad for p in transient]
    # zeroed after the update: all buffers under accumulation; else those that were added into
    to_zero = [p.grad for p in params if p.grad is not None and (accumulate > 1 or id(p) not in copied)
               and not any(p is t for t in transient)]

    def step(**inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        for p in transient:
            p.grad = None
        with copies.swapped_in() if copies else contextlib.nullcontext(), autocast():
            out = forward(**inputs)
        (out["loss"] * scale if scale != 1.0 else out["loss"]).backward()
        if copies:
            copies.grads_to_masters(accumulate=accumulate > 1)
        if last:
            if clip is not None:
                value, algorithm = clip
                if algorithm == "value":
                    torch.nn.utils.clip_grad_value_(params, value, foreach=True)
                else:
                    torch.nn.utils.clip_grad_norm_(params, value, foreach=True)
            optimizer.step()
            if copies:
                copies.refresh()
            if to_zero:
                torch._foreach_zero_(to_zero)
        for p, g in zip(transient, statics):
            p.grad = g
        return {k: v.detach() for k, v in out.items()}

    return step


def make_static_grads(params) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """Zero `.grad` buffers for the parameters that require grad and have none; returns (param, grad)."""
    out = []
    for p in params:
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append((p, p.grad))
    return out
