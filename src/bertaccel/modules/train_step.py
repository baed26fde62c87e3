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

Several processes (DDP): the step sums the gradients over the ranks itself (`grad_sync`, `all_reduce_grads`: the
bf16 gradients and any of 2^20+ elements (a whole word table) all-reduced in place, coalesced into one NCCL group a
dtype, the small fp32 ones through one flat buffer -
captured with the rest of the step as NCCL kernels),
after the backward and before clipping and the update; the loss is scaled by 1 / world size first, so
the sum is the mean DDP would hand the optimizer. Under accumulation only the last micro-step syncs.
The gradients are reduced in the dtype they have: the bf16 copies' gradients in bf16 (as DDP's
`bf16_compress_hook` does), the rest in fp32. The word embeddings' gradient is summed by the rows the ranks'
token ids touch instead of the whole table (`EmbeddingRowSync`; on by default, BERTACCEL_EMBEDDING_ROW_SYNC=0
turns it off), and BERTACCEL_GRAD_SYNC_OVERLAP=1 (opt-in) sends the fused path's gradients bucket by bucket from
the backward's gradient hooks (`OverlappedGradSync`); both are read when the step is built.

AdamW on the copied weights in one pass (`fused_copies_update`): with bf16 copies, no accumulation,
no clipping and PyTorch's AdamW (no amsgrad, not maximize), the masters are updated by
`bertaccel::adamw_bf16_copies_` straight from their copies' bf16 gradients, and the same kernel
writes the refreshed copies: the widening copy into the masters' `.grad`, their share of PyTorch's
fused AdamW and the refresh become one kernel that moves 28 instead of 40 bytes per parameter.
PyTorch's AdamW still steps every other parameter, and the moments and step counts live in the
optimizer's own state (the checkpoint and an eager resume see PyTorch's AdamW state).
The other parameters too are updated by our kernel (`bertaccel::adamw_`, from their fp32 gradients, no copy)
instead of PyTorch's fused AdamW: the word embeddings (read in fp32 by the embedding kernel, so not copied) are
most of them. BERTACCEL_ADAMW_ALL=0 (read when the step is built) leaves them to PyTorch's fused AdamW: BERT-base
32x512 graphed step on an H200 (session 48, same call, two rounds) 23.348 / 23.436 ms with ours, 23.532 / 23.452 ms
with PyTorch's.
"""

from __future__ import annotations

import contextlib
import os
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
    fused_copies_update: bool = True,
    grad_sync: Callable[[list[torch.Tensor]], None] | None = None,
    world_size: int = 1,
    grad_norm: bool = False,
    overlap_order: list[torch.Tensor] | None = None,
    bucket_bytes: int = 25 * 2**20,
    row_ids_input: str | None = "input_ids",
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
    fused_copies_update: update the copied masters with `adamw_bf16_copies_` where it applies (see
        the module's docs; False: widen, PyTorch's AdamW, refresh).
    grad_sync: sums a list of gradients over the ranks in place (`all_reduce_grads`); None: one process.
    world_size: the ranks `grad_sync` sums over (the loss is scaled by its inverse).
    grad_norm: also return "grad_norm" from a step that updates: the total 2-norm of the gradients the update
        reads (summed over ranks and micro-batches, before clipping; fp32), as Lightning's `grad_norm` in
        `on_before_optimizer_step` would see them.
    overlap_order: the model's parameters in their registration order. Given, with `grad_sync`, on the
        fused path (bf16 copies and `adamw_bf16_copies_`: no accumulation, no clipping), the gradients are
        synced bucket by bucket while the backward still runs (`OverlappedGradSync`, buckets of
        `bucket_bytes`) instead of in one call after it. The step function then has a `close()` that
        removes the gradient hooks.
    row_ids_input: the input holding the batch's token ids, recorded by a `grad_sync` that is an `EmbeddingRowSync`
        before each micro-batch's backward (one instance shared by the step functions of one update).

    Every parameter of `optimizer` that requires grad must have its static `.grad` buffer already.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    missing = sum(p.requires_grad and p.grad is None for p in params)
    if missing:
        raise RuntimeError(f"build_train_step: {missing} parameters have no static .grad buffer; "
                           "make them (zeros) before building the step")
    if isinstance(grad_sync, EmbeddingRowSync) and grad_sync.micro_batches != accumulate:
        raise ValueError(f"EmbeddingRowSync built for {grad_sync.micro_batches} micro-batches an update, the step "
                         f"accumulates {accumulate}: the table's gradient would hold rows the ids do not name")
    scale = 1.0 / (accumulate * world_size)
    fused = fused_copies_update and copies and accumulate == 1 and clip is None and fusable_adamw(optimizer, copies)
    copied = {id(m) for m in copies.masters} if copies else set()
    # the uncopied parameters in our kernel too (unless BERTACCEL_ADAMW_ALL=0; see the module's docs)
    all_ours = bool(fused) and os.environ.get("BERTACCEL_ADAMW_ALL", "1") != "0" and all(
        p.dtype == torch.float32 and p.is_contiguous() for p in params if id(p) not in copied)
    transient = [p for p in params if p.grad is not None and id(p) not in copied] if accumulate == 1 else []
    if not transient_grads:
        transient = []
    statics = [p.grad for p in transient]
    master_grads = [m.grad for m in copies.masters] if fused else []
    # zeroed after the update: all buffers under accumulation; else those that were added into
    handed_over = {id(p) for p in transient}
    to_zero = [p.grad for p in params if p.grad is not None and (accumulate > 1 or id(p) not in copied)
               and id(p) not in handed_over]
    overlap = None
    if fused and grad_sync is not None and overlap_order is not None:
        # what the fused path syncs: the copies' bf16 gradients and the uncopied parameters' own
        synced = [c for c in copies.copies if c.requires_grad] + [p for p in params if id(p) not in copied and p.requires_grad]
        position = {id(p): i for i, p in enumerate(overlap_order)}
        position.update({id(c): position.get(id(m), len(position)) for m, c in zip(copies.masters, copies.copies)})
        overlap = OverlappedGradSync(synced, grad_sync, [position.get(id(t), len(position)) for t in synced], bucket_bytes)

    def step(**inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        for p in transient:
            p.grad = None
        if fused:
            for m in copies.masters:  # PyTorch's AdamW skips them; the fused update takes them
                m.grad = None
        with copies.swapped_in() if copies else contextlib.nullcontext(), autocast():
            out = forward(**inputs)
        if overlap is not None:
            overlap.start()
        if row_ids_input is not None and isinstance(grad_sync, EmbeddingRowSync):
            grad_sync.record(inputs[row_ids_input])
        (out["loss"] * scale if scale != 1.0 else out["loss"]).backward()
        if fused:
            if overlap is not None:
                overlap.finish()
            elif grad_sync is not None:
                grad_sync([p.grad for p in params if p.grad is not None] + [c.grad for c in copies.copies if c.grad is not None])
            if grad_norm:  # the copies' bf16 gradients and the uncopied parameters' (the masters' are dropped here)
                out = {**out, "grad_norm": total_grad_norm([c.grad for c in copies.copies if c.grad is not None]
                                                           + [p.grad for p in params if p.grad is not None])}
            if not (all_ours and adamw_uncopied_step(optimizer, copied)):
                optimizer.step()
            adamw_copies_step(optimizer, copies)
            for m, g in zip(copies.masters, master_grads):
                m.grad = g
            if to_zero:
                torch._foreach_zero_(to_zero)
        elif copies:
            copies.grads_to_masters(accumulate=accumulate > 1)
        if last and not fused:
            grads = [p.grad for p in params if p.grad is not None]
            if grad_sync is not None:
                grad_sync(grads)
            if grad_norm:
                out = {**out, "grad_norm": total_grad_norm(grads)}
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

    step.close = overlap.close if overlap is not None else (lambda: None)  # type: ignore[attr-defined]
    step.overlap = overlap  # type: ignore[attr-defined]
    return step


def grad_sync_overlap_wanted() -> bool:
    """BERTACCEL_GRAD_SYNC_OVERLAP=1: a DDP step syncs its gradients bucket by bucket during the backward
    (`OverlappedGradSync`). Off by default: on 2 H200s it made MiniLM's graphed DDP step 0.06-0.17 ms faster and
    BERT-base's 0.24-0.38 ms slower (`benchmarks/bench_ddp_step.py`; docs/multi-gpu.md)."""
    return os.environ.get("BERTACCEL_GRAD_SYNC_OVERLAP", "0") == "1"


class OverlappedGradSync:
    """A DDP step's gradient sum over the ranks, started while the backward still runs, as DDP's reducer does.

    `leaves` (the tensors whose `.grad` is synced) are cut into buckets of at most `bucket_bytes`, one dtype
    each, in the reverse of `positions` (the parameters' registration order: the backward reaches the last
    layers first). A hook on each leaf (`register_post_accumulate_grad_hook`) counts its gradient in; when a
    bucket is complete and every bucket before it has gone, `reduce` (`all_reduce_grads`) runs on it - on a
    side stream on a GPU, forked from and joined back into the backward's stream, so that the all-reduce of
    the last layers overlaps the backward of the first (captured into the step's CUDA graph like the rest).
    `finish()`, after the backward, sends what is left (in order) and joins the side stream; after the first
    backward the buckets are made again without the leaves it gave no gradient. Buckets always go in the same
    order on every rank (NCCL needs it): a bucket waits for the ones before it.

    The word embeddings' gradient, most of a small model's gradient bytes, is ready only at the very end of
    the backward: what can overlap is the rest.
    """

    def __init__(self, leaves: list[torch.Tensor], reduce: Callable[[list[torch.Tensor]], None], positions: list[int],
                 bucket_bytes: int = 25 * 2**20) -> None:
        self.reduce = reduce
        self.leaves = leaves
        self.bucket_bytes = bucket_bytes
        self._order = sorted(range(len(leaves)), key=lambda i: -positions[i])
        self._make_buckets(self._order)
        self._learned = False  # whether a backward has shown which leaves get no gradient
        self._seen: set[int] = set()
        self._armed = False
        self._stream: torch.cuda.Stream | None = None
        self._main: torch.cuda.Stream | None = None
        self.launched_in_backward = 0  # buckets sent by the hooks during the last backward (tests, benchmarks)
        self._handles = [t.register_post_accumulate_grad_hook(self._hook(i)) for i, t in enumerate(leaves)]

    def _make_buckets(self, order: list[int]) -> None:
        leaves, bucket_bytes = self.leaves, self.bucket_bytes
        open_bucket: dict[torch.dtype, list[int]] = {}
        size: dict[torch.dtype, int] = {}
        buckets: list[list[int]] = []
        for i in order:
            t = leaves[i]
            b = open_bucket.get(t.dtype)
            if b is None or (b and size[t.dtype] + t.numel() * t.element_size() > bucket_bytes):
                b = open_bucket[t.dtype] = []
                size[t.dtype] = 0
                buckets.append(b)
            b.append(i)
            size[t.dtype] += t.numel() * t.element_size()
        self.buckets = [b for b in buckets if b]
        self._bucket_of = {i: k for k, b in enumerate(self.buckets) for i in b}
        self._ready = [0] * len(self.buckets)
        self._next = 0

    def _hook(self, i: int):
        def hook(_t: torch.Tensor) -> None:
            if not self._armed:
                return
            self._seen.add(i)
            k = self._bucket_of.get(i)
            if k is None:
                return
            self._ready[k] += 1
            while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next]):
                self._send(self._next)
                self.launched_in_backward += 1
                self._next += 1
        return hook

    def start(self) -> None:
        """Before the backward of a step that syncs."""
        self._ready = [0] * len(self.buckets)
        self._next = 0
        self.launched_in_backward = 0
        self._main = None
        self._seen = set()
        self._armed = True

    def _send(self, k: int) -> None:
        grads = [self.leaves[i].grad for i in self.buckets[k] if self.leaves[i].grad is not None]
        if not grads:
            return
        if not grads[0].is_cuda:
            self.reduce(grads)
            return
        current = torch.cuda.current_stream(grads[0].device)
        if self._main is None:
            self._main = current
        if self._stream is None:
            self._stream = torch.cuda.Stream(grads[0].device)
        self._stream.wait_stream(current)  # the bucket's gradients are written
        with torch.cuda.stream(self._stream):
            self.reduce(grads)

    def finish(self) -> None:
        """After the backward: the buckets not sent yet, in order; the backward's stream waits for all of them."""
        self._armed = False
        while self._next < len(self.buckets):
            self._send(self._next)
            self._next += 1
        if self._stream is not None and self._main is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
        if not self._learned:
            # A leaf the first backward gave no gradient (a layer the forward does not use) would hold its bucket,
            # and every later one, back to the end of each backward: the buckets are made again without it. Which
            # leaves get a gradient depends on the model, not the batch: the same on every rank and every step.
            self._learned = True
            if len(self._seen) < len(self.leaves):
                self._make_buckets([i for i in self._order if i in self._seen])

    def close(self) -> None:
        """Remove the gradient hooks (the step that made them is dropped)."""
        for h in self._handles:
            h.remove()
        self._handles = []


def total_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all `grads` together, in fp32 (bf16 gradients' norms too), as a 0-d device tensor: two
    launches (one multi-tensor norm, one norm of the norms), no host read - capturable."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))


def grads_by_dtype(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`grads` in one list per dtype, in the order of each dtype's first gradient (what `all_reduce_grads` flattens
    into one buffer each)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    return list(by_dtype.values())


IN_PLACE_NUMEL = 1 << 20  # `all_reduce_grads`: gradients this large go in place whatever their dtype (BERT's word table)


def all_reduce_grads(grads: list[torch.Tensor], group: Any = None,
                     in_place: tuple[torch.dtype, ...] = (torch.bfloat16,),
                     in_place_numel: int | None = IN_PLACE_NUMEL) -> None:
    """Sum `grads` over the ranks of `group` (None: all) in place, capturable in a CUDA graph: one coalesced NCCL
    group for a dtype's gradients all-reduced where they are, one NCCL call for those through its flat buffer. The
    gradients of a dtype in `in_place` (default: the bf16 weight copies' - BERT's Linear weights, most of the bytes)
    are all-reduced where they are, one call each, coalesced into one NCCL group; those of any other dtype (fp32:
    norms, biases, embeddings) are copied into one flat buffer, all-reduced in one call and copied back. On 2
    H200s the bf16 gradients in place took the graphed sum of BERT-base's gradients (word table left out, as the rows
    sync leaves it) from 0.945 to 0.701 ms (NCCL alone on flat buffers: 0.688) and its graphed 32x256 step from
    19.46 / 19.39 to 19.14 / 19.20 ms; MiniLM's did not move (session 66, `benchmarks.bench_grad_sync`,
    `bench_ddp_step`). Coalescing the fp32 ones too was slower with the word table in (1.71 against 1.60 ms).
    `in_place_numel` (default 2^20; None: off): a gradient of any dtype with at least this many elements is
    all-reduced in place as well, coalesced with its dtype's others - in BERT only the fp32 word table, whole where
    the rows sync does not take it (a tied masked-LM head, more ranks than the rows pay for), which then skips its
    copies into and out of the flat buffer: graphed sum with the table, 2 H200s, BERT-base 1.371 -> 1.029 ms (NCCL
    alone on flat buffers 0.959), MiniLM 0.547 -> 0.358 (0.333-0.352) (session 67, `bench_grad_sync`).
    A dtype with a non-contiguous gradient (NCCL takes contiguous tensors only), or a torch without the (private)
    coalescing manager, goes through the flat buffer. Every rank must pass the same shapes in the same order, which the
    step guarantees: which parameters get a gradient depends on the model, not the batch."""
    import torch.distributed as dist

    coalescing = getattr(dist.distributed_c10d, "_coalescing_manager", None)
    for same in grads_by_dtype(grads):
        coalescable = coalescing is not None and all(g.is_contiguous() for g in same)
        stays = [coalescable and (g.dtype in in_place or (in_place_numel is not None and g.numel() >= in_place_numel))
                 for g in same]
        where_they_are = [g for g, s in zip(same, stays) if s]
        flat_grads = [g for g, s in zip(same, stays) if not s]
        if where_they_are:
            with coalescing(group=group):
                for g in where_they_are:
                    dist.all_reduce(g, group=group)
        if flat_grads:
            flat = torch.cat([g.reshape(-1) for g in flat_grads])
            dist.all_reduce(flat, group=group)
            torch._foreach_copy_(flat_grads, [v.view_as(g) for v, g in
                                              zip(flat.split([g.numel() for g in flat_grads]), flat_grads)])


def embedding_row_sync_wanted() -> str | None:
    """Whether a graphed DDP step sums the word embeddings' gradient over the ranks by the rows its batch's token ids
    touch (`EmbeddingRowSync`) instead of all-reducing the whole table: on by default ("1": where that moves fewer
    bytes, `embedding_rows_pay`), BERTACCEL_EMBEDDING_ROW_SYNC=0 turns it off (None), =always ("always") uses it also
    where it moves more (tests with a tiny vocabulary). On 2 H200s it made MiniLM's 2-GPU fit 5.6% and BERT-base's
    4.0% faster (session 65; docs/multi-gpu.md)."""
    value = os.environ.get("BERTACCEL_EMBEDDING_ROW_SYNC", "1").strip().lower()
    if value in ("0", "off", "false"):
        return None
    if value in ("1", "on", "true", ""):
        return "1"
    if value == "always":
        return "always"
    raise ValueError(f"BERTACCEL_EMBEDDING_ROW_SYNC={value!r}: expected 1 (the default: the word embeddings' gradient "
                     "summed by the batch's rows where that moves fewer bytes), 0 (all-reduce the whole table) or "
                     "always (the rows even where they move more bytes)")


def embedding_rows_pay(world: int, rows: int, vocab: int) -> bool:
    """Whether gathering `rows` ids' rows from each of `world` ranks moves fewer bytes than all-reducing the
    `vocab`-row table: a ring all-reduce sends 2 (W - 1) / W tables a rank, the all-gather (W - 1) x rows rows, so the
    rows pay while W x rows < 2 x vocab (BERT's 30,522 rows, 8,192 ids a rank: up to 7 ranks)."""
    return world * rows < 2 * vocab


class EmbeddingRowSync:
    """`all_reduce_grads` for a step whose largest gradient is an embedding table's: the table's gradient is summed
    over the ranks by the rows the batch's token ids touch; the other gradients go to `reduce` as before.

    A rank's gradient of a word-embedding table that only the embedding lookup reads is zero outside the rows of
    its batch's ids: 8,192 ids (32 x 256) touch at most 8,192 of BERT's 30,522 rows, and the table's fp32 gradient
    is most of a small model's gradient bytes (47 of MiniLM's 69 MB). Each rank gathers every rank's ids and those
    rows (two all-gathers of `max_ids` x `micro_batches` ids and rows: the same sizes on every rank and at every
    step, as a captured collective needs; a shorter batch's ids are padded with its first id, whose row is then sent
    twice and written twice with the same value), zeroes its own rows, and adds the ranks' rows in rank order: the
    same fp32 sums on every rank, each row summed once.

    The step calls `record(ids)` before each micro-batch's backward. Under gradient accumulation (`micro_batches`
    > 1) the table's gradient holds the rows of every micro-batch since the last update, so each micro-batch's ids
    go into its own slot (a device counter picks it: the same captured step serves every non-last micro-batch) and
    the sync sends all the slots; a slot not written since the last update (an epoch's short last accumulation)
    still holds earlier ids - rows sent in addition, whose sums are as correct as any other row's.

    Whether the table's gradient really is zero outside the ids (a table tied to an output layer, as a masked-LM's
    decoder, gets a gradient in every row) is checked on the first sync outside a CUDA-graph capture, the ranks
    agreeing (one all-reduce, one host read); where it is not, or where that first sync is a capture, every later
    sync all-reduces the whole table as before.
    """

    def __init__(self, weight: torch.Tensor, max_ids: int, reduce: Callable[[list[torch.Tensor]], None] | None = None,
                 group: Any = None, micro_batches: int = 1) -> None:
        self.weight, self.max_ids, self.group, self.micro_batches = weight, int(max_ids), group, int(micro_batches)
        self.reduce = reduce or (lambda grads: all_reduce_grads(grads, group))
        self.ids: torch.Tensor | None = None  # what the next sync sends: micro_batches x max_ids ids
        self._slot: torch.Tensor | None = None  # the next micro-batch's slot (device counter; micro_batches > 1)
        self.rows_only: bool | None = None  # decided at the first sync (None: not yet)

    def record(self, ids: torch.Tensor) -> None:
        """A micro-batch's token ids, before its backward."""
        if self.rows_only is False:
            return
        ids = ids.reshape(-1)
        if ids.numel() > self.max_ids:
            raise RuntimeError(f"EmbeddingRowSync: a batch of {ids.numel()} token ids, more than the {self.max_ids} "
                               "the step was built for (batch size x max length); every rank must send the same count")
        if ids.numel() < self.max_ids:  # pad with the first id: its row is sent again and written again with the same sum
            ids = torch.cat([ids, ids[:1].expand(self.max_ids - ids.numel())])
        if self.micro_batches == 1:
            self.ids = ids.contiguous()
            return
        if self.ids is None:  # made on the first (eager) step, kept: the captured steps write into it
            self.ids = ids.new_zeros(self.micro_batches * self.max_ids)
            self._slot = torch.zeros(1, dtype=torch.long, device=ids.device)
        self.ids.view(self.micro_batches, self.max_ids).index_copy_(0, self._slot, ids.view(1, -1))
        self._slot.add_(1)

    def __call__(self, grads: list[torch.Tensor]) -> None:
        g = self.weight.grad
        rest = [x for x in grads if x is not g]
        if self._slot is not None:
            self._slot.zero_()  # the next update's first micro-batch writes slot 0
        if g is None or self.ids is None or len(rest) == len(grads) or self.rows_only is False:
            self.reduce(grads)
            return
        if self.rows_only is None:
            self.rows_only = self._decide(g, self.ids)
            if not self.rows_only:
                self.reduce(grads)
                return
        if rest:
            self.reduce(rest)
        self._sum_rows(g, self.ids)

    def _decide(self, g: torch.Tensor, ids: torch.Tensor) -> bool:
        import torch.distributed as dist

        if g.is_cuda and torch.cuda.is_current_stream_capturing():
            if dist.get_rank(self.group) == 0:  # (a step runs eagerly before its capture: not seen in our loop)
                print("bertaccel: the word embeddings' gradient is all-reduced whole: its first sync ran inside a "
                      "CUDA-graph capture, where whether it has rows outside the batch's ids cannot be checked", flush=True)
            return False
        outside = torch.ones(g.shape[0], dtype=torch.bool, device=g.device)
        outside[ids] = False
        ok = torch.tensor([float(g.dim() == 2 and not bool(g[outside].any()))], device=g.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
        rows_only = bool(ok.item())
        if dist.get_rank(self.group) == 0:
            print("bertaccel: the word embeddings' gradient is summed over the ranks by the rows of the batch's token "
                  f"ids ({ids.numel()} a rank)" if rows_only else "bertaccel: the word embeddings' gradient has rows "
                  "outside the batch's token ids (a tied output layer, as a masked-LM's decoder): it is all-reduced whole", flush=True)
        return rows_only

    def _sum_rows(self, g: torch.Tensor, ids: torch.Tensor) -> None:
        import torch.distributed as dist

        world = dist.get_world_size(self.group)
        n = ids.numel()
        rows = g.index_select(0, ids)
        all_ids = torch.empty(world * n, dtype=ids.dtype, device=ids.device)
        all_rows = torch.empty(world * n, g.shape[1], dtype=g.dtype, device=g.device)
        dist.all_gather_into_tensor(all_ids, ids, group=self.group)
        dist.all_gather_into_tensor(all_rows, rows, group=self.group)
        g.index_fill_(0, ids, 0)
        for r in range(world):  # rank order on every rank: the same sums everywhere
            i = all_ids[r * n:(r + 1) * n]
            g.index_copy_(0, i, g.index_select(0, i) + all_rows[r * n:(r + 1) * n])


def make_static_grads(params) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """Zero `.grad` buffers for the parameters that require grad and have none; returns (param, grad)."""
    out = []
    for p in params:
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append((p, p.grad))
    return out


def fusable_adamw(optimizer: torch.optim.Optimizer, copies: Bf16WeightCopies) -> bool:
    """Whether `adamw_copies_step` can update the copied masters: PyTorch's AdamW without amsgrad,
    maximize or differentiable, masters contiguous fp32 in its groups, and the kernel available
    (the CUDA extension on a GPU; the reference op on CPU)."""
    if type(optimizer) is not torch.optim.AdamW or not copies.masters:
        return False
    if any(g.get("amsgrad") or g.get("maximize") or g.get("differentiable") for g in optimizer.param_groups):
        return False
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    masters = copies.masters
    if not all(id(m) in held and m.dtype == torch.float32 and m.is_contiguous() for m in masters):
        return False
    if masters[0].is_cuda:
        from bertaccel.ops import build

        if not build.load():
            return False
    import bertaccel.ops.adamw  # noqa: F401 - the op's schema and CPU reference

    return True


def _adamw_state(optimizer: torch.optim.AdamW, p: torch.Tensor, group: dict) -> dict:
    """p's AdamW state, made as PyTorch's AdamW makes it on its first step (a float32 step tensor on
    p's device when fused or capturable, zero moments)."""
    state = optimizer.state[p]
    if len(state) == 0:
        on_device = bool(group.get("fused") or group.get("capturable"))
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device) if on_device else torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def _advance_group(optimizer: torch.optim.AdamW, group: dict, params: list[torch.Tensor]) -> tuple[list, list]:
    """What both AdamW ops take for `params` of `group` around their tensors: ([exp_avgs, exp_avg_sqs, steps],
    [lr, beta1, beta2, weight_decay, eps]), the step counts advanced by one as PyTorch's AdamW does first."""
    states = [_adamw_state(optimizer, p, group) for p in params]
    steps = [s["step"] for s in states]
    torch._foreach_add_(steps, 1)
    # a float learning rate (eager CPU steps) as float64, so the reference op sees its exact value
    lr = group["lr"] if isinstance(group["lr"], torch.Tensor) else torch.tensor(float(group["lr"]), dtype=torch.float64)
    beta1, beta2 = (float(b) for b in group["betas"])
    return ([[s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], steps],
            [lr, beta1, beta2, float(group["weight_decay"]), float(group["eps"])])


def adamw_uncopied_step(optimizer: torch.optim.AdamW, copied: set[int]) -> bool:
    """AdamW on the parameters not in `copied` that got a gradient, by `bertaccel::adamw_` (fp32 gradients), in
    place of PyTorch's AdamW (which then must not step them). False, having done nothing, where a gradient is
    not a contiguous fp32 tensor or a learning rate is a float on a GPU (the kernel reads it from the device)."""
    work = []
    for g in optimizer.param_groups:
        ps = [p for p in g["params"] if id(p) not in copied and p.grad is not None]
        if not ps:
            continue
        if any(p.grad.dtype != torch.float32 or not p.grad.is_contiguous() for p in ps):
            return False
        if ps[0].is_cuda and not isinstance(g["lr"], torch.Tensor):
            return False
        work.append((g, ps))
    with torch.no_grad():
        for g, ps in work:
            state, scalars = _advance_group(optimizer, g, ps)
            torch.ops.bertaccel.adamw_(ps, [p.grad for p in ps], *state, *scalars)
    return True


def adamw_copies_step(optimizer: torch.optim.AdamW, copies: Bf16WeightCopies) -> None:
    """AdamW on the copied masters whose copies got a gradient, from those bf16 gradients, writing
    the refreshed copies; the copies' gradients are dropped after."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    by_group: dict[int, list[int]] = {}
    for i, (m, c) in enumerate(zip(copies.masters, copies.copies)):
        if c.grad is not None:
            by_group.setdefault(id(group_of[id(m)]), []).append(i)
    with torch.no_grad():
        for g in optimizer.param_groups:
            idx = by_group.get(id(g))
            if not idx:
                continue
            masters = [copies.masters[i] for i in idx]
            state, scalars = _advance_group(optimizer, g, masters)
            torch.ops.bertaccel.adamw_bf16_copies_(masters, [copies.copies[i].grad for i in idx], *state,
                                                   [copies.copies[i] for i in idx], *scalars)
    for c in copies.copies:
        c.grad = None
