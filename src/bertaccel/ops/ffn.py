"""BERT's feed-forward block on our GEMM with its elementwise work in the GEMMs' epilogues.

HF's block (`BertLayer.feed_forward_chunk`: `BertIntermediate` then `BertOutput`) is
    pre = x W1^T + b1;  act = GELU(pre);  y = LayerNorm(dropout(act W2^T + b2) + x)
and under autocast runs five kernels forward (GEMM, GELU, GEMM, dropout + add, LayerNorm) and more
backward. The fused block runs
    forward   GEMM 1 with bias + GELU in its epilogue, writing act and the pre-activation;
              GEMM 2 (no bias); our bias + dropout + residual + LayerNorm kernel (b2 added there)
    backward  that kernel's backward (d of GEMM 2's output, db2, dgamma, dbeta);
              GEMM 2's dgrad, then one pass for d(pre) = d(act) gelu'(pre) and db1 (bias_gelu_bwd), or
              (BERTACCEL_FFN_DGELU=epilogue) the dgrad with gelu'(pre) in its epilogue, then db1's column sums;
              dW2 = dy^T act;  dW1 = d(pre)^T x;  dx = d(pre) W1 + d(residual), the residual's gradient
              added in that GEMM's epilogue (x feeds the GEMMs and the residual: as one op, the block
              gets both gradients together, and autograd's separate add of the two goes)
so the forward's GELU is no pass over the 4H-wide activation of its own. The dGELU epilogue measured
slower than the separate pass on an H100 (docs/gemm.md, "The fused feed-forward block"): the erf and exp of 50M elements in the
epilogue are not hidden behind the MMAs, and the bias gradient then needs its own reduction.

`feed_forward(x, w1, b1, w2)` is the two GEMMs' op and `feed_forward_layer_norm(...)` the whole block's
(composites over `bertaccel::gemm` and the residual LayerNorm op, so CPU runs the same formulas through the
references); the swap family `ffn` (opt-in, Hopper) replaces each HF
`BertLayer` by the same layer whose `feed_forward_chunk` runs it: same Parameters, same state_dict
keys, the attention sub-tree left to the other families.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import bertaccel.ops.layer_norm  # noqa: F401 - defines layer_norm_fwd / layer_norm_bwd
from bertaccel.ops import gemm as _gemm  # noqa: F401 - defines bertaccel::gemm
from bertaccel.ops.bias_grad import column_sum
from bertaccel.ops.eligibility import compute_dtype, note_fallback, why_not
from bertaccel.ops.gelu import activation_kind
from bertaccel.ops.registration import NS, SEEDED, SwapEntry, check_dropout, lib
from bertaccel.ops.residual_layer_norm import layer_norm_bwd_of_parts, leave_residual_alias, residual_fanout_active

CUDA_SOURCES: list[str] = []  # GEMMs (the sm_90a extension), the bias_gelu and residual LayerNorm kernels

_GEMM = torch.ops.bertaccel.gemm.default


def dgelu_in_epilogue() -> bool:
    """Where the backward applies gelu'(pre): BERTACCEL_FFN_DGELU=epilogue puts it in GEMM 2's dgrad
    epilogue (no d(act) tensor, but the bias gradient is a separate column sum); the default, `kernel`,
    runs a plain dgrad and one bias_gelu_bwd pass (dGELU and the bias gradient together). On an H100 at
    16384 x 768 x 3072 the kernel form measured faster (benchmarks/bench_ffn.py, docs/gemm.md)."""
    return os.environ.get("BERTACCEL_FFN_DGELU", "kernel") == "epilogue"
_EPILOGUE = {False: (2, 5), True: (3, 6)}  # tanh -> (bias + GELU, dGELU): gemm.EPILOGUES
_RESIDUAL = _gemm.EPILOGUES["bias_residual"]  # (given no bias: + the auxiliary input only)

# ------------------------------------------------------------------------------------------ op
lib.define("feed_forward_fwd(Tensor x, Tensor w1, Tensor b1, Tensor w2, bool tanh) -> (Tensor, Tensor, Tensor)")


@torch.library.impl(lib, "feed_forward_fwd", "CompositeExplicitAutograd")
def _feed_forward_fwd(x, w1, b1, w2, tanh):
    """(GELU(x W1^T + b1) W2^T, the activation, the pre-activation): what the backward reads."""
    act, pre = _GEMM(x, w1, b1, None, _EPILOGUE[tanh][0], False, False, False, True)
    return _GEMM(act, w2, None, None, 0, False, False, False, False)[0], act, pre


@torch.library.register_fake(f"{NS}::feed_forward_fwd")
def _feed_forward_fwd_fake(x, w1, b1, w2, tanh):
    T, inner = x.shape[0], w1.shape[0]
    return x.new_empty(T, w2.shape[0]), x.new_empty(T, inner), x.new_empty(T, inner)


def _setup(ctx, inputs, output):
    x, w1, b1, w2, tanh = inputs
    _, act, pre = output
    ctx.tanh, ctx.b1_dtype = tanh, b1.dtype
    ctx.mark_non_differentiable(act, pre)  # saved for the backward; the public op returns neither
    ctx.set_materialize_grads(False)  # no zero-filled [T, I] gradients for them (two fills per step)
    ctx.save_for_backward(x, w1, w2, act, pre)


def _block_grads(needs, tanh: bool, b1_dtype, dy, x, w1, w2, act, pre, residual_grad=None):
    """(dx, dw1, db1, dw2) of GELU(x W1^T + b1) W2^T from d(output) `dy`; with `residual_grad` (x's gradient
    through the block's residual), dx = d(pre) W1 + residual_grad in the dgrad's epilogue (no add kernel)."""
    need_x, need_w1, need_b1, need_w2 = needs
    dx = dw1 = db1 = dw2 = None
    if need_w2:
        dw2 = _GEMM(dy, act, None, None, 0, True, True, w2.dtype == torch.float32, False)[0]
    if need_x or need_w1 or need_b1:
        if dgelu_in_epilogue():
            # GEMM 2's input gradient times gelu'(pre) in its epilogue: d(pre) directly, then its column sums
            dpre = _GEMM(dy, w2, None, pre, _EPILOGUE[tanh][1], False, True, False, False)[0]
            db1 = column_sum(dpre) if need_b1 else None
        else:
            # GEMM 2's input gradient, then one memory-bound pass for gelu'(pre) and the bias gradient
            # (the bias_gelu family's kernel; pre already holds b1, so it is handed a zero bias)
            dact = _GEMM(dy, w2, None, None, 0, False, True, False, False)[0]
            dpre, db1 = torch.ops.bertaccel.bias_gelu_bwd(dact, pre, pre.new_zeros(pre.shape[1]), tanh)
        if need_x:
            if residual_grad is None:
                dx = _GEMM(dpre, w1, None, None, 0, False, True, False, False)[0]
            else:  # the residual epilogue without a bias: + residual_grad as each tile leaves
                dx = _GEMM(dpre, w1, None, residual_grad, _RESIDUAL, False, True, False, False)[0]
        if need_w1:
            dw1 = _GEMM(dpre, x, None, None, 0, True, True, w1.dtype == torch.float32, False)[0]
        db1 = db1.to(b1_dtype) if need_b1 else None
    return dx, dw1, db1, dw2


def _backward(ctx, dy, _dact, _dpre):
    x, w1, w2, act, pre = ctx.saved_tensors
    if dy is None:  # the output took no part in the loss
        return None, None, None, None, None
    # (.contiguous(): the copy engine reads unit-stride rows)
    return (*_block_grads(ctx.needs_input_grad[:4], ctx.tanh, ctx.b1_dtype, dy.contiguous(), x, w1, w2, act, pre), None)


torch.library.register_autograd(f"{NS}::feed_forward_fwd", _backward, setup_context=_setup)
_FEED_FORWARD = torch.ops.bertaccel.feed_forward_fwd.default

# --------------------------------------------------------------- the block with its residual LayerNorm
# The whole block, y = LayerNorm(dropout(GELU(x W1^T + b1) W2^T + b2) + x), as one op, so that x's two
# gradients (through the GEMMs and through the residual) meet inside its backward: the residual's gradient
# goes into GEMM 1's dgrad epilogue instead of autograd adding the two afterwards (one [T, H] add kernel -
# a read of two tensors and a write of one - per layer). Forward: feed_forward_fwd's two GEMMs, then the
# residual LayerNorm kernel (layer_norm_fwd, b2 and dropout there); backward: layer_norm_bwd, then the
# GEMMs' gradients above with the residual's gradient folded in. The outputs past y are what the backward
# reads (act, pre, the saved sum z, mean, rstd, the dropout seed).
lib.define("feed_forward_layer_norm_fwd(Tensor x, Tensor w1, Tensor b1, Tensor w2, Tensor b2, Tensor weight, "
           "Tensor ln_bias, float p, float eps, bool tanh) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
           tags=SEEDED)


def residual_grad_in_epilogue() -> bool:
    """BERTACCEL_FFN_RESIDUAL=add (read per call; for comparison runs) adds the residual's gradient to GEMM 1's
    input gradient in a separate kernel, as autograd did with the block as two ops; the default, `epilogue`,
    adds it in that GEMM's epilogue."""
    return os.environ.get("BERTACCEL_FFN_RESIDUAL", "epilogue") != "add"


@torch.library.impl(lib, "feed_forward_layer_norm_fwd", "CompositeExplicitAutograd")
def _feed_forward_layer_norm_fwd(x, w1, b1, w2, b2, weight, ln_bias, p, eps, tanh):
    h, act, pre = _feed_forward_fwd(x, w1, b1, w2, tanh)
    # the row kernel reads b2 in the LayerNorm weight's dtype (an fp32 master bias as it is); its gradient comes back in fp32
    y, z, mean, rstd, rng = torch.ops.bertaccel.layer_norm_fwd(h, b2.to(weight.dtype), x, weight, ln_bias, p, eps)
    return y, act, pre, z, mean, rstd, rng


@torch.library.register_fake(f"{NS}::feed_forward_layer_norm_fwd")
def _feed_forward_layer_norm_fwd_fake(x, w1, b1, w2, b2, weight, ln_bias, p, eps, tanh):
    check_dropout(p)
    T, H, inner = x.shape[0], x.shape[1], w1.shape[0]
    stats = x.new_empty(T, dtype=torch.float32)
    return (x.new_empty(T, H), x.new_empty(T, inner), x.new_empty(T, inner), x.new_empty(T, H), stats,
            torch.empty_like(stats), x.new_empty(2 if p > 0 else 0, dtype=torch.long))


def _block_setup(ctx, inputs, output, outputs_returned=True):
    x, w1, b1, w2, b2, weight, ln_bias, p, eps, tanh = inputs
    _, act, pre, z, mean, rstd, rng = output
    ctx.tanh, ctx.p = tanh, p
    ctx.dtypes = (b1.dtype, b2.dtype, weight.dtype, ln_bias.dtype)
    if outputs_returned:  # (the op returns them; the fan-out Function does not)
        ctx.mark_non_differentiable(act, pre, z, mean, rstd, rng)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, w1, w2, act, pre, z, weight, mean, rstd, rng)


def _block_backward(ctx, dy, *_saved):
    return _block_grads_from_output(ctx, dy, None)


def _block_grads_from_output(ctx, dy, dy_alias):
    """The block's ten input gradients from its output's gradient - given in two parts (dy, dy_alias: the
    fan-out's two consumers, residual_layer_norm.py) when both came, summed in the LayerNorm backward's kernel."""
    x, w1, w2, act, pre, z, weight, mean, rstd, rng = ctx.saved_tensors
    needs = ctx.needs_input_grad
    if dy is None and dy_alias is None:
        return (None,) * 10
    b1_dtype, b2_dtype, weight_dtype, ln_bias_dtype = ctx.dtypes
    # d(residual) = d(sum); dh = d(GEMM 2's output): the sum's gradient through the dropout mask
    dres, dh, dweight, dln_bias, db2 = layer_norm_bwd_of_parts(dy, dy_alias, z, weight, mean, rstd, rng, ctx.p)
    fold = residual_grad_in_epilogue()
    dx, dw1, db1, dw2 = _block_grads(needs[:4], ctx.tanh, b1_dtype, dh, x, w1, w2, act, pre, dres if fold else None)
    if dx is not None and not fold:
        dx = dx + dres
    return (dx, dw1, db1, dw2, db2.to(b2_dtype) if needs[4] else None, dweight.to(weight_dtype) if needs[5] else None,
            dln_bias.to(ln_bias_dtype) if needs[6] else None, None, None, None)


torch.library.register_autograd(f"{NS}::feed_forward_layer_norm_fwd", _block_backward, setup_context=_block_setup)
_FEED_FORWARD_LAYER_NORM = torch.ops.bertaccel.feed_forward_layer_norm_fwd.default


class _FeedForwardLayerNormFanOut(torch.autograd.Function):
    """The block returning (y, an alias of y) for the residual fan-out (BERTACCEL_RESIDUAL_FANOUT, see
    residual_layer_norm.py): the next layer's residual LayerNorm takes the alias, so y's two gradients come back
    apart and the block's LayerNorm backward sums them in its kernel (layer_norm_bwd2)."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, weight, ln_bias, p, eps, tanh):
        y, act, pre, z, mean, rstd, rng = _FEED_FORWARD_LAYER_NORM(x, w1, b1, w2, b2, weight, ln_bias, p, eps, tanh)
        _block_setup(ctx, (x, w1, b1, w2, b2, weight, ln_bias, p, eps, tanh), (y, act, pre, z, mean, rstd, rng), False)
        return y, y.detach()  # (the same memory, not a view)

    @staticmethod
    def backward(ctx, dy, dy_alias):
        return _block_grads_from_output(ctx, dy, dy_alias)


def feed_forward_reference(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, approximate: str = "none") -> Tensor:
    """Plain PyTorch: GELU(x W1^T + b1) W2^T."""
    return torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(x, w1, b1),
                                                               approximate=approximate), w2)


def feed_forward(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, approximate: str = "none") -> Tensor:
    """GELU(x W1^T + b1) W2^T for x [T, H], w1 [I, H], b1 [I], w2 [H, I] (one dtype; b1 may also be
    fp32): the two GEMMs of BERT's feed-forward block without the second bias (the LayerNorm kernel
    after it adds it)."""
    return _FEED_FORWARD(x, w1, b1, w2, approximate == "tanh")[0]


def feed_forward_layer_norm_reference(x, w1, b1, w2, b2, weight, ln_bias, p, eps, approximate="none", training=True):
    """Plain PyTorch: HF's BertIntermediate + BertOutput, LayerNorm(dropout(GELU(x W1^T + b1) W2^T + b2) + x)."""
    h = feed_forward_reference(x, w1, b1, w2, approximate) + b2
    return F.layer_norm(F.dropout(h, p, training) + x, (x.shape[-1],), weight, ln_bias, eps)


def feed_forward_layer_norm(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, weight: Tensor, ln_bias: Tensor,
                            p: float, eps: float, approximate: str = "none", training: bool = True) -> Tensor:
    """BERT's whole feed-forward block on [T, H] rows: LayerNorm(dropout(GELU(x W1^T + b1) W2^T + b2) + x),
    w1 [I, H], w2 [H, I] in x's dtype; b1, b2 and the LayerNorm's weight and bias fp32 or x's dtype."""
    return _FEED_FORWARD_LAYER_NORM(x, w1, b1, w2, b2, weight, ln_bias, float(p) if training else 0.0, eps,
                                    approximate == "tanh")[0]


# ---------------------------------------------------------------------------------------- modules
def _gemm_reason(x: Tensor, layer: nn.Module, dtype: torch.dtype) -> str | None:
    from bertaccel.ops.gemm import why_not as gemm_why_not

    inter, out = layer.intermediate.dense, layer.output.dense
    return gemm_why_not(x, inter.weight, dtype) or gemm_why_not(x.new_empty(0, inter.out_features), out.weight, dtype)


class FusedFeedForward(nn.Module):
    """The feed-forward block of one `BertLayer` (its `intermediate` and `output`, read in place: they
    stay the layer's children, so this module owns no Parameters and adds no state_dict keys). A
    child of the swapped layer so that hooks on it (the profiler's `layer{i}.ffn` region) see the block;
    HF's modules run where the kernels cannot (CPU, fp32, another GPU), said once."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "layer", layer)  # not a submodule: the layer holds this module
        self.approximate = activation_kind(layer.intermediate.intermediate_act_fn)
        self.train(layer.training)

    def forward(self, x: Tensor) -> Tensor:
        inter, out = self.layer.intermediate, self.layer.output
        ln = out.LayerNorm
        dtype = compute_dtype(x)
        reason = why_not(x, x.shape[-1], dtype, (ln.weight, ln.bias)) or _gemm_reason(x, self.layer, dtype)
        if reason is None:
            with torch.autocast(x.device.type, enabled=False):
                shape = x.shape
                x2 = x.to(dtype).reshape(-1, shape[-1]).contiguous()
                w1, w2 = inter.dense.weight.to(dtype), out.dense.weight.to(dtype)
                b1 = inter.dense.bias  # the epilogue reads an fp32 bias as it is (no cast kernel)
                b1 = b1 if b1.dtype == torch.float32 else b1.to(dtype)
                # traced by torch.compile there is no address to check: the GEMM op refuses a misaligned one
                if torch.compiler.is_compiling() or not any(t.data_ptr() % 16 for t in (x2, w1, w2)):
                    if residual_fanout_active():
                        # an alias of the output for the next layer's residual LayerNorm (its gradient comes back apart)
                        y, alias = _FeedForwardLayerNormFanOut.apply(
                            x2, w1, b1, w2, out.dense.bias, ln.weight, ln.bias,
                            float(out.dropout.p) if self.training else 0.0, ln.eps, self.approximate == "tanh")
                        return leave_residual_alias(y.view(shape), alias.view(shape))
                    y = feed_forward_layer_norm(x2, w1, b1, w2, out.dense.bias, ln.weight, ln.bias, out.dropout.p,
                                                ln.eps, self.approximate, self.training)
                    return y.view(shape)
                reason = "operands are not 16-byte aligned"
        note_fallback("ffn", reason)
        return out(inter(x), x)


class _FeedForwardLayer:
    """Mixed in before an HF layer class: its feed-forward chunk runs the layer's `feed_forward` child."""

    def feed_forward_chunk(self, attention_output: Tensor) -> Tensor:
        return self.feed_forward(attention_output)


_LAYER_CLASSES: dict[type, type] = {}


def fused_layer(layer: nn.Module) -> nn.Module:
    """The same layer (an instance of a subclass of its class, so `isinstance` checks, HF's gradient
    checkpointing and its forward are unchanged) sharing its children, Parameters and hooks, plus a
    `feed_forward` child (`FusedFeedForward`) that its `feed_forward_chunk` calls."""
    base = type(layer)
    cls = _LAYER_CLASSES.get(base)
    if cls is None:
        cls = _LAYER_CLASSES[base] = type(f"FusedFFN{base.__name__}", (_FeedForwardLayer, base), {"__module__": __name__})
    new = cls.__new__(cls)
    new.__dict__.update(layer.__dict__)
    for d in ("_parameters", "_buffers", "_modules"):  # own dictionaries: the original's stay as they were
        new.__dict__[d] = dict(layer.__dict__[d])
    new._modules["feed_forward"] = FusedFeedForward(new)
    return new


def _skip_reason(m: nn.Module) -> str | None:
    if type(m).__name__ != "BertLayer" or not all(hasattr(m, a) for a in ("intermediate", "output", "feed_forward_chunk")):
        return ""
    inter, out = m.intermediate, m.output
    if not (hasattr(inter, "dense") and hasattr(inter, "intermediate_act_fn")
            and all(hasattr(out, a) for a in ("dense", "dropout", "LayerNorm"))):
        return "its intermediate / output are not BERT's dense + GELU / dense + dropout + LayerNorm"
    if activation_kind(inter.intermediate_act_fn) is None:
        return f"activation {type(inter.intermediate_act_fn).__name__} is not a GELU"
    if not isinstance(out.LayerNorm, nn.LayerNorm):
        return f"its output normalisation is {type(out.LayerNorm).__name__}, not nn.LayerNorm"
    if not all(isinstance(d, nn.Linear) for d in (inter.dense, out.dense)) or inter.dense.bias is None or out.dense.bias is None:
        return "its dense layers are not nn.Linear with biases"
    if inter.dense.in_features % 8 or inter.dense.out_features % 8:
        return f"hidden / intermediate sizes {inter.dense.in_features}/{inter.dense.out_features} are not multiples of 8"
    return None


SWAP = SwapEntry("ffn", _skip_reason, fused_layer,
                 "BertLayer's feed-forward -> FusedFeedForward (GEMM + bias + GELU, GEMM, residual LN; dGELU "
                 "in the dgrad; own GEMM, Hopper; opt-in)", opt_in=True, claims=("intermediate", "output", "feed_forward"))
