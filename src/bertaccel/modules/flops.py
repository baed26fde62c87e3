"""Matmul FLOPs of a BERT step, counted from the model's config (what MFU is computed from).

Per sequence of T tokens, per layer: Q, K, V and output projections 4 * 2*T*H*H; attention scores
and the weighted sum 2 * 2*T*T*H; the feed-forward block 2 * 2*T*H*F (a last layer at some rows only:
K and V on every token, the rest on those rows). Heads: the classifier's pooler
2*H*H and classifier 2*H*C per sequence; the masked-LM head 2*H*H + 2*H*V per predicted token.
Elementwise work (LayerNorm, GELU, softmax, embeddings) is under 1% at BERT sizes and not counted,
as in the usual MFU convention. Training = 3x forward (backward = 2x forward).
"""

from __future__ import annotations


def _last_layer_at_rows(H: int, F: int, kv_rows, query_rows, seq: int, attention_queries=None):
    """The forward matmul FLOPs of a last layer at some rows only (bertaccel.modules.last_layer): K and V projections
    on `kv_rows` rows; Q, output and feed-forward matmuls on `query_rows` rows (one per sequence at [CLS] only); its
    attention: `attention_queries` (default: `query_rows`) queries over `seq` keys each."""
    attention_queries = query_rows if attention_queries is None else attention_queries
    return 2 * kv_rows * 2 * H * H + query_rows * 2 * (2 * H * H + 2 * H * F) + attention_queries * 4 * seq * H


def bert_forward_flops(config, batch: int, seq: int, head: str = "classifier", predicted_tokens: int | None = None,
                       cls_only_last_layer: bool = False, last_layer_rows=None, last_layer_queries=None) -> int:
    """`cls_only_last_layer` (bertaccel.modules.last_layer): the last layer's K and V projections on every token,
    its Q, output and feed-forward matmuls and its attention for the [CLS] query only; `last_layer_rows` (an int or
    a 0-d tensor): the same for that many rows in all (a masked-LM's last layer at the masked positions), its attention
    for `last_layer_queries` queries (default: as many)."""
    H, L, F = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    per_layer = 2 * seq * (4 * H * H + 2 * H * F) + 4 * seq * seq * H
    flops = batch * L * per_layer
    if cls_only_last_layer:
        last_layer_rows = batch
    if last_layer_rows is not None:
        flops = flops + _last_layer_at_rows(H, F, batch * seq, last_layer_rows, seq, last_layer_queries) - batch * per_layer
    if head == "classifier":
        flops += batch * (2 * H * H + 2 * H * config.num_labels)
    elif head == "mlm":
        m = batch * seq if predicted_tokens is None else predicted_tokens
        flops += m * (2 * H * H + 2 * H * config.vocab_size)
    elif head != "none":
        raise ValueError(f"unknown head {head!r}")
    return flops


def bert_step_flops(config, batch: int, seq: int, head: str = "classifier", predicted_tokens: int | None = None,
                    training: bool = True, cls_only_last_layer: bool = False, last_layer_rows=None,
                    last_layer_queries=None) -> int:
    fwd = bert_forward_flops(config, batch, seq, head, predicted_tokens, cls_only_last_layer, last_layer_rows,
                             last_layer_queries)
    return 3 * fwd if training else fwd


def bert_step_flops_unpadded(config, batch: int, seq: int, real_tokens, training: bool = True, attention_pairs=None,
                             cls_only_last_layer: bool = False):
    """The classifier step as `model.unpadded` executes it: every projection and feed-forward matmul
    on the `real_tokens` only (an int or a 0-d tensor), pooler and classifier per sequence. Attention:
    with `attention_pairs` (the sum over the sequences of length^2, an int or a 0-d tensor) on the
    packed sequences, as the varlen kernels run it; without, on the padded [batch, seq] (the re-padded
    SDPA fallback). `cls_only_last_layer`: as `bert_forward_flops` says, on the packed rows."""
    H, L, F = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    attention = batch * seq * seq if attention_pairs is None else attention_pairs
    per_layer = 2 * real_tokens * (4 * H * H + 2 * H * F) + 4 * attention * H
    fwd = L * per_layer
    if cls_only_last_layer:  # K, V on the packed rows; the rest per sequence, its attention on the re-padded keys
        fwd = fwd - per_layer + _last_layer_at_rows(H, F, real_tokens, batch, seq)
    fwd = fwd + batch * (2 * H * H + 2 * H * config.num_labels)
    return 3 * fwd if training else fwd
