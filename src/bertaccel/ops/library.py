"""The `bertaccel` op namespace: schemas, reference CPU implementations, fake (meta) implementations
and autograd formulas. The CUDA implementations come from `csrc/*.cu` (`TORCH_LIBRARY_IMPL(bertaccel,
CUDA, ...)`), loaded by `bertaccel.ops.build.load()`.

Defining the schemas here, in Python, means the ops exist on every machine: on CPU they run the
PyTorch reference below, so `torch.library.opcheck` and the autograd formulas are tested in CI
even without a GPU.

Autocast: the ops are not autocast-aware. They compute in fp32 internally and return the dtype of
their activation input; LayerNorm weights are passed as fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

NS = "bertaccel"
lib = torch.library.Library(NS, "DEF")
# ops that draw dropout masks: tagged so that torch.compile never merges or reorders two calls
SEEDED = (torch.Tag.nondeterministic_seeded,)
lib.define(
    "layer_norm_fwd(Tensor x, Tensor? bias, Tensor? residual, Tensor weight, Tensor ln_bias, float p, float eps)"
    " -> (Tensor y, Tensor z, Tensor mean, Tensor rstd, Tensor rng)",
    tags=SEEDED,
)
lib.define(
    "layer_norm_bwd(Tensor dy, Tensor z, Tensor weight, Tensor mean, Tensor rstd, Tensor rng, float p, bool want_dh)"
    " -> (Tensor dz, Tensor dh, Tensor dweight, Tensor dln_bias, Tensor dbias)"
)
lib.define("bias_gelu_fwd(Tensor x, Tensor? bias, bool tanh) -> Tensor")
lib.define("bias_gelu_bwd(Tensor dy, Tensor x, Tensor? bias, bool tanh) -> (Tensor, Tensor)")
lib.define("rms_norm_fwd(Tensor x, Tensor weight, float eps) -> (Tensor y, Tensor rstd)")
lib.define("rms_norm_bwd(Tensor dy, Tensor x, Tensor weight, Tensor rstd) -> (Tensor dx, Tensor dweight)")
lib.define(
    "embedding_layer_norm_fwd(Tensor ids, Tensor position_ids, Tensor token_type_ids, Tensor word, Tensor position,"
    " Tensor token_type, Tensor weight, Tensor ln_bias, float p, float eps, bool out_bf16, int padding_idx)"
    " -> (Tensor y, Tensor z, Tensor mean, Tensor rstd, Tensor rng)",
    tags=SEEDED,
)
lib.define(
    "embedding_layer_norm_bwd(Tensor dy, Tensor z, Tensor weight, Tensor mean, Tensor rstd, Tensor rng, float p)"
    " -> (Tensor dz, Tensor dweight, Tensor dln_bias)"
)
lib.define("softmax_fwd(Tensor x, Tensor? mask, float scale) -> Tensor")
lib.define("softmax_bwd(Tensor dy, Tensor y, float scale) -> Tensor")


# ---------------------------------------------------------------------------- CPU reference
def check_dropout(p: float) -> None:
    """Dropout probabilities outside [0, 1) would give a silently wrong 1/(1-p) scale in the kernels."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}.")


def _cpu_dropout_keep(shape, p: float, rng: Tensor) -> Tensor:
    g = torch.Generator().manual_seed(int(rng[0]))
    return torch.rand(shape, generator=g) >= p


@torch.library.impl(lib, "layer_norm_fwd", "CPU")
def _ln_fwd_cpu(x, bias, residual, weight, ln_bias, p, eps):
    check_dropout(p)
    fused = bias is not None or residual is not None or p > 0
    h = x.float()
    rng = torch.zeros(2, dtype=torch.long)
    if bias is not None:
        h = h + bias.float()
    if p > 0:
        rng[0] = int(torch.randint(0, 2**62, (1,)))
        h = h * _cpu_dropout_keep(h.shape, p, rng) / (1 - p)
    if residual is not None:
        h = h + residual.float()
    if fused:
        h = h.to(x.dtype).float()  # z is saved in the input dtype; normalise what is saved
    var, mean = torch.var_mean(h, dim=-1, correction=0)
    rstd = torch.rsqrt(var + eps)
    y = ((h - mean[..., None]) * rstd[..., None] * weight + ln_bias).to(x.dtype)
    z = h.to(x.dtype) if fused else x.new_empty(0)
    return y, z, mean.reshape(-1), rstd.reshape(-1), rng


@torch.library.impl(lib, "layer_norm_bwd", "CPU")
def _ln_bwd_cpu(dy, z, weight, mean, rstd, rng, p, want_dh):
    H = z.shape[-1]
    zf, dyf = z.float().reshape(-1, H), dy.float().reshape(-1, H)
    xhat = (zf - mean[:, None]) * rstd[:, None]
    g = dyf * weight
    dz = rstd[:, None] * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    dweight, dln_bias = (dyf * xhat).sum(0), dyf.sum(0)
    dz = dz.to(z.dtype).reshape(z.shape)
    if not want_dh:
        return dz, z.new_empty(0), dweight, dln_bias, dweight.new_empty(0)
    dh = dz.float()
    if p > 0:
        dh = dh * _cpu_dropout_keep(z.shape, p, rng) / (1 - p)
    dh = dh.to(z.dtype)
    return dz, dh, dweight, dln_bias, dh.float().reshape(-1, H).sum(0)


def gelu_reference(x: Tensor, tanh: bool) -> Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh" if tanh else "none")


@torch.library.impl(lib, "bias_gelu_fwd", "CPU")
def _gelu_fwd_cpu(x, bias, tanh):
    h = x.float() if bias is None else x.float() + bias.float()
    return gelu_reference(h, tanh).to(x.dtype)


@torch.library.impl(lib, "bias_gelu_bwd", "CPU")
def _gelu_bwd_cpu(dy, x, bias, tanh):
    h = (x.float() if bias is None else x.float() + bias.float()).requires_grad_(True)
    with torch.enable_grad():
        (dx,) = torch.autograd.grad(gelu_reference(h, tanh), h, dy.float())
    dx = dx.to(x.dtype)
    dbias = dx.float().reshape(-1, x.shape[-1]).sum(0) if bias is not None else dx.new_empty(0, dtype=torch.float32)
    return dx, dbias


@torch.library.impl(lib, "rms_norm_fwd", "CPU")
def _rms_fwd_cpu(x, weight, eps):
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    return (xf * rstd[..., None] * weight).to(x.dtype), rstd.reshape(-1)


@torch.library.impl(lib, "rms_norm_bwd", "CPU")
def _rms_bwd_cpu(dy, x, weight, rstd):
    H = x.shape[-1]
    xf, dyf = x.float().reshape(-1, H), dy.float().reshape(-1, H)
    xhat = xf * rstd[:, None]
    g = dyf * weight
    dx = rstd[:, None] * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx.to(x.dtype).reshape(x.shape), (dyf * xhat).sum(0)


@torch.library.impl(lib, "embedding_layer_norm_fwd", "CPU")
def _emb_fwd_cpu(ids, position_ids, token_type_ids, word, position, token_type, weight, ln_bias, p, eps, out_bf16,
                 padding_idx):
    check_dropout(p)
    dtype = torch.bfloat16 if out_bf16 else torch.float32
    z = (word[ids] + token_type[token_type_ids] + position[position_ids]).to(dtype)
    var, mean = torch.var_mean(z.float(), dim=-1, correction=0)
    rstd = torch.rsqrt(var + eps)
    y = (z.float() - mean[..., None]) * rstd[..., None] * weight + ln_bias
    rng = torch.zeros(2, dtype=torch.long)
    if p > 0:
        rng[0] = int(torch.randint(0, 2**62, (1,)))
        y = y * _cpu_dropout_keep(y.shape, p, rng) / (1 - p)
    return y.to(dtype), z, mean.reshape(-1), rstd.reshape(-1), rng


@torch.library.impl(lib, "embedding_layer_norm_bwd", "CPU")
def _emb_bwd_cpu(dy, z, weight, mean, rstd, rng, p):
    H = z.shape[-1]
    dyf = dy.float()
    if p > 0:
        dyf = dyf * _cpu_dropout_keep(z.shape, p, rng) / (1 - p)
    zf, dyf = z.float().reshape(-1, H), dyf.reshape(-1, H)
    xhat = (zf - mean[:, None]) * rstd[:, None]
    g = dyf * weight
    dz = rstd[:, None] * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    return dz.to(z.dtype).reshape(z.shape), (dyf * xhat).sum(0), dyf.sum(0)


def softmax_reference(x: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """softmax(x * scale + mask) in fp32; boolean masks mark the keys to attend; rows with every key
    masked give zeros."""
    v = x.float() * scale
    if mask is not None:
        v = v.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else v + mask.float()
    return torch.softmax(v, dim=-1).nan_to_num(0.0)


@torch.library.impl(lib, "softmax_fwd", "CPU")
def _softmax_fwd_cpu(x, mask, scale):
    return softmax_reference(x, mask, scale).to(x.dtype)


@torch.library.impl(lib, "softmax_bwd", "CPU")
def _softmax_bwd_cpu(dy, y, scale):
    yf, dyf = y.float(), dy.float()
    return (scale * yf * (dyf - (dyf * yf).sum(-1, keepdim=True))).to(y.dtype)


# --------------------------------------------------------------------------------- fake
@torch.library.register_fake(f"{NS}::layer_norm_fwd")
def _ln_fwd_fake(x, bias, residual, weight, ln_bias, p, eps):
    check_dropout(p)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    fused = bias is not None or residual is not None or p > 0
    f = x.new_empty(rows, dtype=torch.float32)
    return (torch.empty_like(x), torch.empty_like(x) if fused else x.new_empty(0), f, torch.empty_like(f),
            x.new_empty(2, dtype=torch.long))


@torch.library.register_fake(f"{NS}::layer_norm_bwd")
def _ln_bwd_fake(dy, z, weight, mean, rstd, rng, p, want_dh):
    H = z.shape[-1]
    w = z.new_empty(H, dtype=torch.float32)
    if want_dh:
        return torch.empty_like(z), torch.empty_like(z), w, torch.empty_like(w), torch.empty_like(w)
    return torch.empty_like(z), z.new_empty(0), w, torch.empty_like(w), z.new_empty(0, dtype=torch.float32)


@torch.library.register_fake(f"{NS}::bias_gelu_fwd")
def _gelu_fwd_fake(x, bias, tanh):
    return torch.empty_like(x)


@torch.library.register_fake(f"{NS}::bias_gelu_bwd")
def _gelu_bwd_fake(dy, x, bias, tanh):
    return torch.empty_like(x), x.new_empty(x.shape[-1] if bias is not None else 0, dtype=torch.float32)


@torch.library.register_fake(f"{NS}::rms_norm_fwd")
def _rms_fwd_fake(x, weight, eps):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return torch.empty_like(x), x.new_empty(rows, dtype=torch.float32)


@torch.library.register_fake(f"{NS}::rms_norm_bwd")
def _rms_bwd_fake(dy, x, weight, rstd):
    return torch.empty_like(x), x.new_empty(x.shape[-1], dtype=torch.float32)


@torch.library.register_fake(f"{NS}::embedding_layer_norm_fwd")
def _emb_fwd_fake(ids, position_ids, token_type_ids, word, position, token_type, weight, ln_bias, p, eps, out_bf16,
                  padding_idx):
    check_dropout(p)
    dtype = torch.bfloat16 if out_bf16 else torch.float32
    shape = (*ids.shape, word.shape[-1])
    f = word.new_empty(ids.numel(), dtype=torch.float32)
    return (word.new_empty(shape, dtype=dtype), word.new_empty(shape, dtype=dtype), f, torch.empty_like(f),
            word.new_empty(2, dtype=torch.long))


@torch.library.register_fake(f"{NS}::embedding_layer_norm_bwd")
def _emb_bwd_fake(dy, z, weight, mean, rstd, rng, p):
    w = z.new_empty(z.shape[-1], dtype=torch.float32)
    return torch.empty_like(z), w, torch.empty_like(w)


@torch.library.register_fake(f"{NS}::softmax_fwd")
def _softmax_fwd_fake(x, mask, scale):
    return torch.empty_like(x)


@torch.library.register_fake(f"{NS}::softmax_bwd")
def _softmax_bwd_fake(dy, y, scale):
    return torch.empty_like(y)


# ------------------------------------------------------------------------------ autograd
def _ln_setup(ctx, inputs, output):
    x, bias, residual, weight, ln_bias, p, eps = inputs
    y, z, mean, rstd, rng = output
    ctx.fused = bias is not None or residual is not None or p > 0
    ctx.has_bias, ctx.has_residual, ctx.p = bias is not None, residual is not None, p
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.save_for_backward(z if ctx.fused else x, weight, mean, rstd, rng)


def _ln_backward(ctx, dy, _dz, _dmean, _drstd, _drng):
    z, weight, mean, rstd, rng = ctx.saved_tensors
    dz, dh, dweight, dln_bias, dbias = torch.ops.bertaccel.layer_norm_bwd(
        dy, z, weight, mean, rstd, rng, ctx.p, ctx.fused
    )
    dx = dh if ctx.fused else dz
    return (
        dx,
        dbias.to(ctx.bias_dtype) if ctx.has_bias else None,
        dz if ctx.has_residual else None,
        dweight,
        dln_bias,
        None,
        None,
    )


def _gelu_setup(ctx, inputs, output):
    x, bias, tanh = inputs
    ctx.tanh = tanh
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.save_for_backward(x, bias)


def _gelu_backward(ctx, dy):
    x, bias = ctx.saved_tensors
    dx, dbias = torch.ops.bertaccel.bias_gelu_bwd(dy, x, bias, ctx.tanh)
    return dx, (dbias.to(ctx.bias_dtype) if bias is not None else None), None


def _rms_setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rms_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dweight = torch.ops.bertaccel.rms_norm_bwd(dy, x, weight, rstd)
    return dx, dweight.to(weight.dtype), None


def _emb_setup(ctx, inputs, output):
    ids, position_ids, token_type_ids, word, position, token_type, weight, ln_bias, p, eps, out_bf16, padding_idx = inputs
    y, z, mean, rstd, rng = output
    ctx.p, ctx.padding_idx = p, padding_idx
    ctx.tables = [(t.shape[0], t.dtype) for t in (word, position, token_type)]
    ctx.save_for_backward(ids, position_ids, token_type_ids, z, weight, mean, rstd, rng)


def _emb_backward(ctx, dy, _dz, _dmean, _drstd, _drng):
    ids, position_ids, token_type_ids, z, weight, mean, rstd, rng = ctx.saved_tensors
    dz, dweight, dln_bias = torch.ops.bertaccel.embedding_layer_norm_bwd(dy, z, weight, mean, rstd, rng, ctx.p)
    dz = dz.float()
    # The scatter into the tables is PyTorch's nn.Embedding backward; the word table's padding row
    # gets no gradient, as with nn.Embedding(padding_idx=...).
    grads = [
        torch.ops.aten.embedding_dense_backward(dz, idx, n, pad, False).to(dtype)
        for idx, (n, dtype), pad in zip((ids, position_ids, token_type_ids), ctx.tables, (ctx.padding_idx, -1, -1))
    ]
    return (None, None, None, *grads, dweight, dln_bias, None, None, None, None)


def _softmax_setup(ctx, inputs, output):
    ctx.scale = inputs[2]
    ctx.save_for_backward(output)


def _softmax_backward(ctx, dy):
    (y,) = ctx.saved_tensors
    return torch.ops.bertaccel.softmax_bwd(dy, y, ctx.scale), None, None


torch.library.register_autograd(f"{NS}::layer_norm_fwd", _ln_backward, setup_context=_ln_setup)
torch.library.register_autograd(f"{NS}::bias_gelu_fwd", _gelu_backward, setup_context=_gelu_setup)
torch.library.register_autograd(f"{NS}::rms_norm_fwd", _rms_backward, setup_context=_rms_setup)
torch.library.register_autograd(f"{NS}::embedding_layer_norm_fwd", _emb_backward, setup_context=_emb_setup)
torch.library.register_autograd(f"{NS}::softmax_fwd", _softmax_backward, setup_context=_softmax_setup)


# ------------------------------------------------------------------------- eager entry points
# The registered autograd formula above is what torch.compile traces. In eager mode, going through
# it costs a Python autograd kernel per call (~100 us on a slow CPU; a CPU-bound training step calls
# these ops dozens of times), so eager calls use a plain autograd.Function that runs the op below
# the autograd layer and reuses the same setup/backward formulas.
class _LayerNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, residual, weight, ln_bias, p, eps):
        with torch._C._AutoDispatchBelowADInplaceOrView():
            out = torch.ops.bertaccel.layer_norm_fwd(x, bias, residual, weight, ln_bias, p, eps)
        _ln_setup(ctx, (x, bias, residual, weight, ln_bias, p, eps), out)
        ctx.mark_non_differentiable(*out[1:])
        return out

    @staticmethod
    def backward(ctx, dy, dz, dmean, drstd, drng):
        return _ln_backward(ctx, dy, dz, dmean, drstd, drng)


class _BiasGeluFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, tanh):
        with torch._C._AutoDispatchBelowADInplaceOrView():
            y = torch.ops.bertaccel.bias_gelu_fwd(x, bias, tanh)
        _gelu_setup(ctx, (x, bias, tanh), y)
        return y

    @staticmethod
    def backward(ctx, dy):
        return _gelu_backward(ctx, dy)


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        with torch._C._AutoDispatchBelowADInplaceOrView():
            out = torch.ops.bertaccel.rms_norm_fwd(x, weight, eps)
        _rms_setup(ctx, (x, weight, eps), out)
        ctx.mark_non_differentiable(out[1])
        return out

    @staticmethod
    def backward(ctx, dy, drstd):
        return _rms_backward(ctx, dy, drstd)


class _EmbeddingLayerNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *inputs):
        with torch._C._AutoDispatchBelowADInplaceOrView():
            out = torch.ops.bertaccel.embedding_layer_norm_fwd(*inputs)
        _emb_setup(ctx, inputs, out)
        ctx.mark_non_differentiable(*out[1:])
        return out

    @staticmethod
    def backward(ctx, *grads):
        return _emb_backward(ctx, *grads)


class _SoftmaxFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mask, scale):
        with torch._C._AutoDispatchBelowADInplaceOrView():
            y = torch.ops.bertaccel.softmax_fwd(x, mask, scale)
        _softmax_setup(ctx, (x, mask, scale), y)
        return y

    @staticmethod
    def backward(ctx, dy):
        return _softmax_backward(ctx, dy)


def _eager(fn_class, op, dropout_arg: int | None = None):
    """The entry point for one op: the registered op under torch.compile; in eager mode without
    grad, the op *below* the autograd layer (the registered Python autograd kernel would cost a
    Python call per op even under no_grad); with grad, the lean autograd.Function."""
    below_autograd = torch._C._AutoDispatchBelowADInplaceOrView

    def call(*args):
        if torch.compiler.is_compiling():
            return op(*args)  # the fake kernel checks p
        if dropout_arg is not None:
            check_dropout(args[dropout_arg])  # the CUDA kernels take p as given
        if not torch.is_grad_enabled():
            with below_autograd():
                return op(*args)
        return fn_class.apply(*args)

    call.__doc__ = f"`{op}` with autograd: the registered op under torch.compile, lean eager paths otherwise."
    return call


layer_norm_fwd = _eager(_LayerNormFn, torch.ops.bertaccel.layer_norm_fwd.default, dropout_arg=5)
bias_gelu_fwd = _eager(_BiasGeluFn, torch.ops.bertaccel.bias_gelu_fwd.default)
rms_norm_fwd = _eager(_RMSNormFn, torch.ops.bertaccel.rms_norm_fwd.default)
embedding_layer_norm_fwd = _eager(_EmbeddingLayerNormFn, torch.ops.bertaccel.embedding_layer_norm_fwd.default,
                                  dropout_arg=8)
softmax_fwd = _eager(_SoftmaxFn, torch.ops.bertaccel.softmax_fwd.default)
