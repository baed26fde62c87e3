"""The last encoder layer computed at the rows its head reads only: [CLS] for a sequence classifier, the masked
positions for a masked-LM.

A BERT sequence classifier reads one vector of the encoder's output: the pooler takes position 0 ([CLS]) of the last
layer. A masked-LM's head reads the ~15% of positions that were masked. Every other position of the last layer is
computed and thrown away - and in training its gradient is zero, so its backward is wasted too. What a read row of
the last layer needs: the keys and values of every position (the layer's attention reads them all), and its own
query, attention output, residual LayerNorm and feed-forward block. So the last layer runs exactly that: the K and V
projections on all tokens, the rest on the read rows. The outputs and every gradient are those of the whole layer
(the same formulas; the rows left out contribute exact zeros); the floating-point rounding of the kept rows may
differ (other GEMM shapes), and attention dropout draws other random numbers for them.

- `last_layer_cls_only(model)` (classifiers, `model.last_layer_cls_only`): the encoder's `last_hidden_state` is
  [batch, 1, hidden] (the pooler reads it as before). The unpadded encoder (`model.unpadded`) has its own form
  (`cls_layer_forward_packed`).
- `last_layer_at_rows(model)` (masked-LMs, `model.last_layer_masked_only`): inside `handle.at(rows)` (rows: [batch,
  Q] positions per sequence, `masked_rows` picks them) the encoder's `last_hidden_state` is [batch, Q, hidden], the
  last layer's output at those positions; outside it the whole layer runs.

What it saves, per sequence of S tokens of which R are read, hidden size H (intermediate F = 4H): the last layer's Q,
attention output and feed-forward GEMMs on S - R rows (10 of its 12 H^2 matmul units), its attention's S - R query
rows, and the LayerNorms, GELU and dropouts of those rows - up to 1/L of a BERT step of L layers, less the K / V GEMMs
kept (measured numbers: README "Last layer at the rows the head reads").

Asking for hidden states or attention weights, giving cross-attention inputs or a cache runs the whole layer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import types

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

ATTR = "_bertaccel_last_layer"  # on the encoder while its forward is replaced: "cls", or the RowsHandle


def _key_mask(attention_mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """The key mask of the kept query rows in the form SDPA takes, broadcast over the queries: a 2-D padding mask
    (bool or 0/1, what `attn_implementation: bertaccel` passes) as bool [B, 1, 1, S]; a 4-D mask (SDPA's bool
    [B, 1, S, S], eager's additive floats) its first query row, additive floats in the queries' dtype (clamped to its
    range) - a BERT encoder's 4-D mask is its key-padding mask repeated for every query.
    A row with no key at all (the empty rows that pad a static-shape batch) may attend to position 0: a softmax
    over nothing is NaN on some SDPA backends, and a NaN row poisons the K / V gradients even where its loss is 0."""
    if attention_mask is None:
        return None
    if attention_mask.dim() == 2:
        row = attention_mask.bool()[:, None, None, :]
    elif attention_mask.dim() == 4:
        row = attention_mask[:, :, :1, :]
    else:
        raise ValueError(f"last layer at some rows (last_layer_cls_only / last_layer_masked_only): an attention mask "
                         f"of {attention_mask.dim()} dimensions")
    first = torch.arange(row.shape[-1], device=row.device) == 0
    if row.dtype == torch.bool:
        return row | (first & ~row.any(-1, keepdim=True))
    row = row.clamp(min=torch.finfo(dtype).min).to(dtype)
    none = row.amax(-1, keepdim=True) <= torch.finfo(dtype).min / 2
    return row.masked_fill(first & none, 0.0)


def _keys_values(sa: nn.Module, rows: Tensor) -> Tensor:
    """The K and V projections of rows [..., H] as [..., 2 * heads * d] (K then V): one GEMM where the two can fuse
    (the bf16 weight copies' K and V rows read in place), else the module's own two (QK-norm's wrapped key)."""
    from bertaccel.ops.qkv import can_fuse, fused_projection

    if can_fuse(sa.key, sa.value) is None:
        return fused_projection((sa.key, sa.value), rows)
    return torch.cat((sa.key(rows), sa.value(rows)), -1)


def _attend(sa: nn.Module, q: Tensor, kv: Tensor, mask: Tensor | None) -> Tensor:
    """q [B, Q, H], kv [B, S, 2H] -> the attention output [B, Q, H], Q queries per sequence. Up to 4 queries (the
    [CLS] row) on a GPU: our kernel (`bertaccel.ops.attention.query_rows_attention`: one CTA per sequence and head
    reads each K / V row once; SDPA's kernels tile 64 queries - for one query with dropout cuDNN has no kernel and
    PyTorch runs its memory-efficient ones. Forward + backward with dropout at BERT-base heads on an H200: 32x1x512
    57 us ours against SDPA's 317, 32x4x512 135 against cuDNN's 171), unless BERTACCEL_QUERY_ROWS_ATTENTION=0 or
    the mask is additive; SDPA otherwise (the masked-LM's 56 or 152 queries per sequence)."""
    B, S = kv.shape[:2]
    Q = q.shape[1]
    heads, d = sa.num_attention_heads, sa.attention_head_size
    dropout_p = sa.dropout.p if sa.training else 0.0
    key_mask = _key_mask(mask, q.dtype)
    if q.is_cuda and (key_mask is None or key_mask.dtype == torch.bool) and \
            os.environ.get("BERTACCEL_QUERY_ROWS_ATTENTION", "1") != "0":
        from bertaccel.ops.attention import query_rows_attention, query_rows_unavailable

        if query_rows_unavailable(q, kv, heads) is None:
            keys = key_mask[:, 0, 0, :] if key_mask is not None else q.new_ones(B, S, dtype=torch.bool)
            return query_rows_attention(q, kv, keys, heads, dropout_p, sa.scaling)
    k, v = kv.view(B, S, 2, heads, d).unbind(2)
    q = q.view(B, Q, heads, d).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=key_mask,
                                         dropout_p=dropout_p, scale=sa.scaling)
    return out.transpose(1, 2).reshape(B, Q, heads * d)


def _attend_packed(sa: nn.Module, q: Tensor, kv: Tensor, layout) -> Tensor:
    """q [B, Q, H], kv [T, 2H] the packed rows of `layout` (`bertaccel.modules.unpadded.Unpadded`) -> [B, Q, H]:
    our kernel reads K and V in place on a GPU; elsewhere (or where it cannot run) `_attend` on the re-padded rows
    (BERTACCEL_QUERY_ROWS_VARLEN=0: the re-padded rows on a GPU too, the path before the varlen form - for A/B runs)."""
    if q.is_cuda and os.environ.get("BERTACCEL_QUERY_ROWS_ATTENTION", "1") != "0" and \
            os.environ.get("BERTACCEL_QUERY_ROWS_VARLEN", "1") != "0":
        from bertaccel.ops.attention import query_rows_attention_varlen, query_rows_unavailable

        heads = sa.num_attention_heads
        if query_rows_unavailable(q, kv, heads, layout.max_seqlen) is None:
            return query_rows_attention_varlen(q, kv, layout.cu_seqlens, layout.max_seqlen, heads,
                                               sa.dropout.p if sa.training else 0.0, sa.scaling)
    return _attend(sa, q, layout.unpack(kv), layout.key_padding)


def rows_attention(sa: nn.Module, rows: Tensor, hidden: Tensor, attention_mask: Tensor | None) -> Tensor:
    """Self-attention's output at the kept rows: rows [B, Q, H] (queries), hidden [B, S, H] (keys, values) ->
    [B, Q, H]. The module's own projection modules (nn.Linear, the kernel swap's, QK-norm's) make q, k, v."""
    return _attend(sa, sa.query(rows), _keys_values(sa, hidden), attention_mask)


def cls_layer_forward_packed(layer: nn.Module, h: Tensor, layout, region=contextlib.nullcontext) -> Tensor:
    """The unpadded encoder's last layer (`model.unpadded`) at each sequence's [CLS] only: packed rows h [T, H] ->
    [B, H] (zeros for empty rows, as `Unpadded.first_tokens` gives). K and V on the packed rows, read there by our
    query-rows kernel (`query_rows_attention_varlen`); where it cannot run (CPU, BERTACCEL_QUERY_ROWS_ATTENTION=0),
    put back in the padded [B, S] order for SDPA with the key-padding mask.
    `region()`: the context the attention part runs in (the unpadded encoder's profiler label)."""
    attention = layer.attention
    sa = attention.self
    with region():
        cls = layout.first_tokens(h)  # [B, H]
        a = attention.output(_attend_packed(sa, sa.query(cls)[:, None], _keys_values(sa, h), layout)[:, 0], cls)
    out = layer.feed_forward_chunk(a)  # (its modules' hooks label the feed-forward block)
    empty = (layout.cu_seqlens[1:] == layout.cu_seqlens[:-1])[:, None]
    return out.masked_fill(empty, 0)


def rows_layer_forward(layer: nn.Module, hidden: Tensor, attention_mask: Tensor | None, rows: Tensor | None = None,
                       region=contextlib.nullcontext) -> Tensor:
    """A `BertLayer` (HF's or the kernel swap's) at some rows only: hidden [B, S, H] -> [B, Q, H], its output at
    positions `rows` [B, Q] (int64, per sequence), or at the [CLS] row (Q = 1) when `rows` is None. `region()`: the
    context the attention part runs in (the profiler's `layer{i}.attention` label, which the skipped
    `BertAttention` call would have opened through its hooks)."""
    if rows is None:
        kept = hidden[:, :1]
    else:
        kept = hidden.gather(1, rows[..., None].expand(-1, -1, hidden.shape[-1]))
    attention = layer.attention
    with region():
        a = attention.output(rows_attention(attention.self, kept, hidden, attention_mask), kept)  # dense, dropout, LN
    return layer.feed_forward_chunk(a)  # HF's intermediate + output (or the ffn family's block): hooks label it


@dataclasses.dataclass
class KeptRows:
    """The masked-LM's kept rows in two layouts: the output rows, flat (`flat` [M]: positions b * S + s, in the head's
    order), and the attention's queries per sequence (`rows` [B, Q]: positions s). `to_rows` [B, Q] picks each query's
    row of the flat outputs (M: a zero row, for the slots a sequence does not fill), `to_flat` [M] each flat row's
    attention output in the [B * Q] layout. Only the attention runs on the per-sequence layout; the Q projection, the
    output projection, the LayerNorms and the feed-forward block run on the M flat rows."""

    rows: Tensor
    flat: Tensor
    to_rows: Tensor
    to_flat: Tensor


def masked_kept_rows(selected: Tensor, per_row: int | None = None, budget: int | None = None) -> tuple[KeptRows, Tensor]:
    """The kept rows of `selected` [B, S] (bool) and which flat rows are real ([M] bool). `per_row`: a static number of
    queries per sequence (None: the largest count, a host read); `budget`: a static number of flat rows M (None: the
    count, a host read). A selected position past its sequence's `per_row` or past the `budget` is not real (left out of
    the loss by the caller), as is an unfilled slot."""
    B, S = selected.shape
    rows, used = masked_rows(selected, per_row)  # [B, Q]
    Q = rows.shape[1]
    flat_selected = selected.flatten()
    if budget is None:
        flat = flat_selected.nonzero().squeeze(1)
        real = torch.ones_like(flat, dtype=torch.bool)
    else:
        flat = torch.nonzero_static(flat_selected, size=budget, fill_value=-1).squeeze(1)
        real = flat >= 0
        flat = flat.clamp(min=0)
    M = flat.shape[0]
    rank = selected.long().cumsum(1) - 1  # a selected position's place among its sequence's
    b = flat // S
    q = rank.flatten().index_select(0, flat)
    real = real & (q < Q) & (q >= 0)
    to_flat = torch.where(real, b * Q + q, 0)
    slot = (flat_selected.long().cumsum(0) - 1).view(B, S).gather(1, rows)  # each query's flat row
    to_rows = torch.where(used & (slot < M), slot, M)
    return KeptRows(rows, flat, to_rows, to_flat), real


def kept_layer_forward(layer: nn.Module, hidden: Tensor, attention_mask: Tensor | None, kept: KeptRows,
                       region=contextlib.nullcontext) -> Tensor:
    """A `BertLayer` at the `kept` rows: hidden [B, S, H] -> [M, H], its output at the flat rows `kept.flat`."""
    B, S, H = hidden.shape
    Q = kept.rows.shape[1]
    attention = layer.attention
    sa = attention.self
    rows = hidden.reshape(B * S, H).index_select(0, kept.flat)  # [M, H]
    with region():
        q = sa.query(rows)
        q = torch.cat((q, q.new_zeros(1, q.shape[1]))).index_select(0, kept.to_rows.flatten()).view(B, Q, -1)
        a = _attend(sa, q, _keys_values(sa, hidden), attention_mask)  # [B, Q, H]
        a = attention.output(a.reshape(B * Q, -1).index_select(0, kept.to_flat), rows)  # dense, dropout, LN
    return layer.feed_forward_chunk(a)


def _encoder_forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None,
                     encoder_attention_mask=None, cache=None, use_cache=None, **kwargs):
    """`BertEncoder.forward` with the last layer at the [CLS] row or the rows of the active `RowsHandle.at` only; the
    class's own forward where that does not apply (cross-attention inputs, a cache, attention weights asked for, a
    rows handle outside `at`)."""
    mode = getattr(self, ATTR)
    rows = None if mode == "cls" else mode.rows
    full = (encoder_hidden_states is not None or cache is not None or use_cache
            or kwargs.get("output_attentions") or kwargs.get("output_hidden_states") or (mode != "cls" and rows is None))
    if full:
        return type(self).forward(self, hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask,
                                  cache=cache, use_cache=use_cache, **kwargs)
    from bertaccel.modules.unpadded import _region  # (unpadded imports this module)

    *rest, last = self.layer
    for layer in rest:
        hidden_states = layer(hidden_states, attention_mask, None, encoder_attention_mask=None, cache=None, **kwargs)
    region = lambda: _region(f"layer{len(rest)}.attention")  # noqa: E731
    if isinstance(rows, KeptRows):
        hidden_states = kept_layer_forward(last, hidden_states, attention_mask, rows, region)
    else:
        hidden_states = rows_layer_forward(last, hidden_states, attention_mask, rows, region)
    return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=hidden_states)


def _encoder(model: nn.Module, option: str = "last_layer_cls_only") -> nn.Module:
    bert = getattr(model, "bert", model)
    encoder = getattr(bert, "encoder", None)
    if encoder is None or not isinstance(getattr(encoder, "layer", None), nn.ModuleList) or not len(encoder.layer):
        raise ValueError(f"{option}: {type(model).__name__} has no BERT encoder with layers")
    return encoder


class LastLayerHandle:
    """What `last_layer_cls_only` / `last_layer_at_rows` changed; `revert()` puts the encoder's own forward back."""

    def __init__(self, encoder: nn.Module) -> None:
        self.encoder = encoder

    def revert(self) -> None:
        self.encoder.__dict__.pop("forward", None)
        self.encoder.__dict__.pop(ATTR, None)


def _install(encoder: nn.Module, mode, option: str) -> None:
    if ATTR in encoder.__dict__:
        raise ValueError(f"{option}: the encoder's last layer is already computed at some rows only (revert first)")
    encoder.forward = types.MethodType(_encoder_forward, encoder)
    setattr(encoder, ATTR, mode)


def last_layer_cls_only(model: nn.Module) -> LastLayerHandle:
    """Make `model`'s (a `BertForSequenceClassification`, or its `BertModel`) last encoder layer compute the [CLS]
    position only (module docstring). In place and reversible (`.revert()`); Parameters and state_dict keys are
    unchanged, and the kernel swap may run before or after (the layer's modules are looked up at each call)."""
    encoder = _encoder(model)
    _install(encoder, "cls", "last_layer_cls_only")
    return LastLayerHandle(encoder)


class RowsHandle(LastLayerHandle):
    """`last_layer_at_rows`'s handle: `with handle.at(rows):` the encoder's last layer runs at `rows` only."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__(encoder)
        self.rows: Tensor | None = None

    @contextlib.contextmanager
    def at(self, rows: Tensor | KeptRows):
        """rows: [B, Q] int64 positions per sequence (`masked_rows` gives them; the encoder's output is then
        [B, Q, H]), or `KeptRows` (`masked_kept_rows`; the output is [M, H], the flat rows)."""
        if not isinstance(rows, KeptRows) and (rows.dim() != 2 or rows.dtype != torch.long):
            raise ValueError(f"last layer rows: a [batch, Q] int64 tensor of positions, got {rows.dtype} {tuple(rows.shape)}")
        self.rows = rows
        try:
            yield self
        finally:
            self.rows = None


def last_layer_at_rows(model: nn.Module) -> RowsHandle:
    """Make `model`'s (a `BertForMaskedLM`, or its `BertModel`) last encoder layer compute only the positions given
    to `handle.at(rows)` while inside it (module docstring); the whole layer outside it. In place and reversible."""
    encoder = _encoder(model, "last_layer_masked_only")
    handle = RowsHandle(encoder)
    _install(encoder, handle, "last_layer_masked_only")
    return handle


def masked_rows(selected: Tensor, per_row: int | None = None) -> tuple[Tensor, Tensor]:
    """The positions of the True entries of `selected` [B, S] (bool), per row, in order: (rows [B, Q] int64, used
    [B, Q] bool - False for slots past a row's count, which hold other positions). Q = `per_row` (a static bound:
    a row's True entries past it are left out), or the largest row count (a host read; at least 1)."""
    if per_row is None:
        per_row = max(int(selected.sum(1).max()), 1) if selected.numel() else 1
    per_row = min(per_row, selected.shape[1])
    # a stable sort of the "not selected" flags puts each row's selected positions first, in order; no host read
    order = torch.argsort((~selected).to(torch.uint8), dim=1, stable=True)[:, :per_row]
    return order, selected.gather(1, order)


def is_cls_only(model: nn.Module) -> bool:
    """Whether `last_layer_cls_only` is on for `model`'s encoder."""
    try:
        return getattr(_encoder(model), ATTR, None) == "cls"
    except ValueError:
        return False
