"""bf16 copies of a model's Linear weights beside their fp32 masters, for bf16-mixed steps.

Under autocast every `nn.Linear` casts its fp32 weight to bf16 in each forward (one kernel per
weight), and the backward widens each bf16 weight gradient back to fp32 (another kernel per
weight) before accumulating it into the fp32 `.grad`. With the copies:

- the forward runs with the bf16 copies swapped into the Linear modules (autocast has nothing to
  cast), and the backward leaves bf16 gradients on the copies;
- one multi-tensor copy (`torch._foreach_copy_`, which converts dtypes in its fast path) writes
  them into the masters' fp32 gradients (an add under gradient accumulation);
- the optimizer updates the fp32 masters, and one multi-tensor copy refreshes the copies.

The values are the ones autocast computes (the same round-to-nearest of the same fp32 weights,
the same widening of the same bf16 gradients): a step with copies gives the same parameters, bit
for bit, as the step with autocast's casts (tests/modules/test_step_engine.py). Outside the step
the model holds its fp32 masters, so checkpoints, the optimizer and evaluation without graphs see
nothing of the copies.

Only weights that no other kind of module reads get a copy: a decoder weight tied to the word
embeddings stays fp32 (the embedding lookup reads the same Parameter).

The copies of a self-attention's `query`, `key` and `value` weights (same input width, each read by
that Linear only) are three Parameters over one [q + k + v, hidden] block, back to back: the fused Q/K/V
projection (`bertaccel.ops.qkv.adjacent_rows`) reads the block as it is instead of concatenating the
three per forward.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch import nn


class Bf16WeightCopies:
    """The bf16 copies of `model`'s Linear weights (made now, from the current masters)."""

    def __init__(self, model: nn.Module) -> None:
        others = {id(p) for m in model.modules() if not isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
        self.targets: list[tuple[nn.Module, int]] = []
        self.masters: list[nn.Parameter] = []
        index: dict[int, int] = {}
        for m in model.modules():
            w = m._parameters.get("weight") if isinstance(m, nn.Linear) else None
            if w is None or w.dtype != torch.float32 or id(w) in others:
                continue
            if id(w) not in index:
                index[id(w)] = len(self.masters)
                self.masters.append(w)
            self.targets.append((m, index[id(w)]))
        # normal tensors even when made under inference mode (an evaluation that comes first): a
        # training step differentiates through the same copies later
        with torch.inference_mode(False), torch.no_grad():
            self.copies: list[nn.Parameter | None] = [None] * len(self.masters)
            for block in _qkv_blocks(model, self.masters, self.targets):  # the block's three copies over one buffer
                whole = torch.cat([self.masters[j].detach() for j in block]).to(torch.bfloat16)
                for j, part in zip(block, whole.split([self.masters[j].shape[0] for j in block])):
                    self.copies[j] = nn.Parameter(part, requires_grad=self.masters[j].requires_grad)
            for i, w in enumerate(self.masters):
                if self.copies[i] is None:
                    self.copies[i] = nn.Parameter(w.detach().to(torch.bfloat16), requires_grad=w.requires_grad)

    def __len__(self) -> int:
        return len(self.copies)

    def refresh(self) -> None:
        """Copies := masters rounded to bf16 (after the optimizer step, or when the masters changed)."""
        if self.copies:
            with torch.inference_mode(False), torch.no_grad():
                torch._foreach_copy_(self.copies, self.masters)

    def masters_version(self) -> int:
        """The sum of the masters' version counters: it moves with every in-place change made to them through
        autograd-visible ops (an optimizer's step, a `clamp_` under no_grad; not through `.data`), and not with a
        CUDA graph's replay, which no counter sees."""
        return sum(m._version for m in self.masters)

    @contextlib.contextmanager
    def swapped_in(self):
        """Inside: the Linear modules hold the bf16 copies in place of their fp32 weights."""
        for m, i in self.targets:
            m._parameters["weight"] = self.copies[i]
        try:
            yield
        finally:
            for m, i in self.targets:
                m._parameters["weight"] = self.masters[i]

    def grads_to_masters(self, accumulate: bool) -> None:
        """After a backward: the copies' bf16 gradients into the masters' fp32 `.grad` buffers (which
        must exist: static gradients), overwriting them, or adding to them when `accumulate`; a
        master whose copy got no gradient is zeroed (overwrite mode). The copies' gradients are
        dropped, so the next backward hands its fresh gradient tensors over without an add."""
        pairs = [(m.grad, c.grad) for m, c in zip(self.masters, self.copies) if c.grad is not None and m.grad is not None]
        if pairs:
            dst, src = (list(x) for x in zip(*pairs))
            if accumulate:
                torch._foreach_add_(dst, src)
            else:
                torch._foreach_copy_(dst, src)
        if not accumulate:
            unused = [m.grad for m, c in zip(self.masters, self.copies) if c.grad is None and m.grad is not None]
            if unused:
                torch._foreach_zero_(unused)
        for c in self.copies:
            c.grad = None


def _qkv_blocks(model: nn.Module, masters: list[nn.Parameter], targets: list[tuple[nn.Module, int]]) -> list[tuple[int, ...]]:
    """Index triples (into `masters`) of the query / key / value weights that can share one copy buffer: the
    children `query`, `key`, `value` of one module, nn.Linear with one input width, each master read by that Linear
    alone (not tied) and in no other triple."""
    readers = Counter(i for _, i in targets)
    index = {id(w): i for i, w in enumerate(masters)}
    blocks, taken = [], set()
    for m in model.modules():
        layers = [getattr(m, n, None) for n in ("query", "key", "value")]
        if not all(isinstance(layer, nn.Linear) for layer in layers):
            continue
        ids = [index.get(id(layer._parameters.get("weight"))) for layer in layers]
        if (None in ids or len(set(ids)) != 3 or any(readers[i] != 1 or i in taken for i in ids)
                or len({layer.in_features for layer in layers}) != 1):
            continue
        blocks.append(tuple(ids))
        taken.update(ids)
    return blocks
