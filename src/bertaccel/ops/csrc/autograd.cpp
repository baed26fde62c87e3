// Autograd for the public bertaccel ops on CUDA, in C++: an eager call costs one dispatcher trip,
// as a PyTorch op does, instead of a Python autograd.Function. Registered at AutogradCUDA, which
// takes precedence over the Python formulas registered at the Autograd alias (those serve the CPU
// reference kernels, and so CI).
//
// Each forward runs the op's `*_fwd` form (the outputs the backward needs: the pre-norm sum, row
// statistics, the dropout seed/offset) below the autograd layer; calls that record no backward (grad
// mode off, or no input that requires grad) and draw no dropout run the public op's own CUDA kernel
// instead, which writes only its output (evaluation and prediction; with dropout too: the same masks
// from the same generator state, but no saved sum). It normalises the fp32 sum where the saving form
// normalises the stored bf16 sum, so the two can differ by one bf16 rounding (tests/ops/
// test_layer_norm.py checks both against each other). Under torch.compile these Functions are traced like any aten op's
// autograd: the forward graph holds `*_fwd`, the backward graph `*_bwd`.
#include <torch/autograd.h>
#include <torch/library.h>

#include "dispatch.h"

namespace bertaccel {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;
using OptTensor = std::optional<Tensor>;
using Tensor5 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;

// Whether a call must record a backward: grad mode on and some input that requires grad. When not
// (inference, evaluation), the public op's own CUDA kernel runs, writing only the output.
bool needs_grad(std::initializer_list<const Tensor*> ts) {
  if (!at::GradMode::is_enabled()) return false;
  for (const Tensor* t : ts)
    if (t != nullptr && t->defined() && t->requires_grad()) return true;
  return false;
}

const Tensor* opt(const OptTensor& t) { return t.has_value() ? &*t : nullptr; }

// A gradient in the dtype of the tensor it belongs to (fp32 accumulations for bf16 parameters).
Tensor like(const Tensor& grad, const Tensor& ref) {
  return grad.scalar_type() == ref.scalar_type() ? grad : grad.to(ref.scalar_type());
}

// ----------------------------------------------------------------- LayerNorm (+ bias, dropout, residual)
// the saving forward and the backwards, shared by LayerNormFn and ResidualLayerNormFanOutFn
using LayerNormFwdSig = Tensor5(const Tensor&, const OptTensor&, const OptTensor&, const Tensor&, const Tensor&, double,
                                double);
using LayerNormBwdSig = Tensor5(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                const Tensor&, double, bool);
using LayerNormBwd2Sig = Tensor5(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                 const Tensor&, const Tensor&, double);

struct LayerNormFn : public Function<LayerNormFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const OptTensor& bias, const OptTensor& residual,
                        const Tensor& weight, const Tensor& ln_bias, double p, double eps) {
    static auto fwd = op<LayerNormFwdSig>("bertaccel::layer_norm_fwd");
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, z, mean, rstd, rng] = fwd.call(x, bias, residual, weight, ln_bias, p, eps);
    const bool fused = bias.has_value() || residual.has_value() || p > 0;
    // (ln_bias is not saved: its gradient takes the weight's dtype, which the kernel checked is ln_bias's)
    ctx->save_for_backward({fused ? z : x, weight, mean, rstd, rng});
    ctx->saved_data["p"] = p;
    ctx->saved_data["fused"] = fused;
    ctx->saved_data["bias_dtype"] = bias ? c10::IValue(bias->scalar_type()) : c10::IValue();
    ctx->saved_data["has_residual"] = residual.has_value();
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto bwd = op<LayerNormBwdSig>("bertaccel::layer_norm_bwd");
    auto s = ctx->get_saved_variables();
    const bool fused = ctx->saved_data["fused"].toBool();
    auto [dz, dh, dweight, dln_bias, dbias] = bwd.call(grads[0], s[0], s[1], s[2], s[3], s[4],
                                                       ctx->saved_data["p"].toDouble(), fused);
    auto bias_dtype = ctx->saved_data["bias_dtype"];
    return {fused ? dh : dz,
            bias_dtype.isNone() ? Tensor() : dbias.to(bias_dtype.toScalarType()),
            ctx->saved_data["has_residual"].toBool() ? dz : Tensor(),
            like(dweight, s[1]), like(dln_bias, s[1]), Tensor(), Tensor()};
  }
};

Tensor layer_norm_autograd(const Tensor& x, const OptTensor& bias, const OptTensor& residual, const Tensor& weight,
                           const Tensor& ln_bias, double p, double eps) {
  // (with dropout the output-only kernel normalises the bf16-rounded sum, as the saving form does: the same
  // bits from the same generator state, without writing what a backward would read)
  if (!needs_grad({&x, opt(bias), opt(residual), &weight, &ln_bias})) {
    static auto fwd = op<Tensor(const Tensor&, const OptTensor&, const OptTensor&, const Tensor&, const Tensor&, double,
                                double)>("bertaccel::layer_norm");
    at::AutoDispatchBelowADInplaceOrView guard;
    return fwd.call(x, bias, residual, weight, ln_bias, p, eps);
  }
  return LayerNormFn::apply(x, bias, residual, weight, ln_bias, p, eps);
}

// ------------------------------------------------------- residual LayerNorm with its output's fan-out
// residual_layer_norm.py's fan-out (the _ResidualLayerNormFanOut autograd.Function there, in C++ for eager calls:
// residual_layer_norm_fanout below, reached through csrc/eager.cpp): y and an alias of y for its second consumer,
// whose gradients reach the backward apart and are summed in the kernel (layer_norm_bwd2). Not a registered op: it
// runs only outside torch.compile (residual_fanout_active), where the Python Function serves the other cases.
struct ResidualLayerNormFanOutFn : public Function<ResidualLayerNormFanOutFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& bias, const Tensor& residual,
                               const Tensor& weight, const Tensor& ln_bias, double p, double eps) {
    static auto fwd = op<LayerNormFwdSig>("bertaccel::layer_norm_fwd");
    Tensor y, z, mean, rstd, rng;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(y, z, mean, rstd, rng) = fwd.call(x, bias, residual, weight, ln_bias, p, eps);
    }
    ctx->save_for_backward({z, weight, mean, rstd, rng});
    ctx->saved_data["p"] = p;
    ctx->saved_data["bias_dtype"] = bias.scalar_type();
    ctx->set_materialize_grads(false);
    return {y, y.detach()};  // (detach: the same memory, not a view - no reference from the alias back to y)
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto bwd = op<LayerNormBwdSig>("bertaccel::layer_norm_bwd");
    static auto bwd2 = op<LayerNormBwd2Sig>("bertaccel::layer_norm_bwd2");
    const Tensor &dy = grads[0], &dy_alias = grads[1];
    if (!dy.defined() && !dy_alias.defined()) return variable_list(7);
    auto s = ctx->get_saved_variables();
    const double p = ctx->saved_data["p"].toDouble();
    Tensor dz, dh, dweight, dln_bias, dbias;
    if (dy.defined() && dy_alias.defined())
      std::tie(dz, dh, dweight, dln_bias, dbias) =
          bwd2.call(dy.contiguous(), dy_alias.contiguous(), s[0], s[1], s[2], s[3], s[4], p);
    else
      std::tie(dz, dh, dweight, dln_bias, dbias) =
          bwd.call((dy.defined() ? dy : dy_alias).contiguous(), s[0], s[1], s[2], s[3], s[4], p, true);
    // (weight and ln_bias have one dtype: the kernel checked)
    return {dh, dbias.to(ctx->saved_data["bias_dtype"].toScalarType()), dz, like(dweight, s[1]),
            like(dln_bias, s[1]), Tensor(), Tensor()};
  }
};

// ------------------------------------------------------------------------------------- RMSNorm
struct RMSNormFn : public Function<RMSNormFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, double eps) {
    static auto fwd = op<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, double)>("bertaccel::rms_norm_fwd");
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, rstd] = fwd.call(x, weight, eps);
    ctx->save_for_backward({x, weight, rstd});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto bwd = op<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&)>(
        "bertaccel::rms_norm_bwd");
    auto s = ctx->get_saved_variables();
    auto [dx, dweight] = bwd.call(grads[0], s[0], s[1], s[2]);
    return {dx, like(dweight, s[1]), Tensor()};
  }
};

Tensor rms_norm_autograd(const Tensor& x, const Tensor& weight, double eps) {
  if (!needs_grad({&x, &weight})) {
    static auto fwd = op<Tensor(const Tensor&, const Tensor&, double)>("bertaccel::rms_norm");
    at::AutoDispatchBelowADInplaceOrView guard;
    return fwd.call(x, weight, eps);
  }
  return RMSNormFn::apply(x, weight, eps);
}

// ------------------------------------------------------------------------------------ bias + GELU
struct BiasGeluFn : public Function<BiasGeluFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const OptTensor& bias, bool tanh_form) {
    static auto fwd = op<Tensor(const Tensor&, const OptTensor&, bool)>("bertaccel::bias_gelu");
    at::AutoDispatchBelowADInplaceOrView guard;
    Tensor y = fwd.call(x, bias, tanh_form);
    ctx->save_for_backward({x, bias.value_or(Tensor())});
    ctx->saved_data["tanh"] = tanh_form;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto bwd = op<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const OptTensor&, bool)>(
        "bertaccel::bias_gelu_bwd");
    auto s = ctx->get_saved_variables();
    const bool has_bias = s[1].defined();
    auto [dx, dbias] = bwd.call(grads[0], s[0], has_bias ? OptTensor(s[1]) : std::nullopt,
                                ctx->saved_data["tanh"].toBool());
    return {dx, has_bias ? like(dbias, s[1]) : Tensor(), Tensor()};
  }
};

Tensor bias_gelu_autograd(const Tensor& x, const OptTensor& bias, bool tanh_form) {
  return BiasGeluFn::apply(x, bias, tanh_form);
}

// ---------------------------------------------------------------------------------------- softmax
struct SoftmaxFn : public Function<SoftmaxFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const OptTensor& mask, double scale) {
    static auto fwd = op<Tensor(const Tensor&, const OptTensor&, double)>("bertaccel::softmax");
    at::AutoDispatchBelowADInplaceOrView guard;
    Tensor y = fwd.call(x, mask, scale);
    ctx->save_for_backward({y});
    ctx->saved_data["scale"] = scale;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto bwd = op<Tensor(const Tensor&, const Tensor&, double)>("bertaccel::softmax_bwd");
    auto s = ctx->get_saved_variables();
    return {bwd.call(grads[0], s[0], ctx->saved_data["scale"].toDouble()), Tensor(), Tensor()};
  }
};

Tensor softmax_autograd(const Tensor& x, const OptTensor& mask, double scale) {
  return SoftmaxFn::apply(x, mask, scale);
}

// ------------------------------------------------------------------------- embeddings + LayerNorm
struct EmbeddingLayerNormFn : public Function<EmbeddingLayerNormFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& ids, const Tensor& pos_ids, const Tensor& type_ids,
                        const Tensor& word, const Tensor& pos, const Tensor& type, const Tensor& weight,
                        const Tensor& ln_bias, double p, double eps, bool out_bf16, int64_t padding_idx) {
    static auto fwd = op<Tensor5(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                 const Tensor&, const Tensor&, const Tensor&, double, double, bool, int64_t)>(
        "bertaccel::embedding_layer_norm_fwd");
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, z, mean, rstd, rng] =
        fwd.call(ids, pos_ids, type_ids, word, pos, type, weight, ln_bias, p, eps, out_bf16, padding_idx);
    ctx->save_for_backward({ids, pos_ids, type_ids, z, weight, mean, rstd, rng});
    ctx->saved_data["p"] = p;
    ctx->saved_data["padding_idx"] = padding_idx;
    ctx->saved_data["rows"] = std::vector<int64_t>{word.size(0), pos.size(0), type.size(0)};
    ctx->saved_data["dtypes"] = std::vector<int64_t>{(int64_t)word.scalar_type(), (int64_t)pos.scalar_type(),
                                                     (int64_t)type.scalar_type()};
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto bwd = op<std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                            const Tensor&, const Tensor&, double)>(
        "bertaccel::embedding_layer_norm_bwd");
    auto s = ctx->get_saved_variables();
    auto [dz, dweight, dln_bias] = bwd.call(grads[0], s[3], s[4], s[5], s[6], s[7], ctx->saved_data["p"].toDouble());
    static auto tables = op<std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                               const Tensor&, int64_t, int64_t, int64_t, int64_t)>(
        "bertaccel::embedding_tables_bwd");
    auto rows = ctx->saved_data["rows"].toIntVector();
    auto dtypes = ctx->saved_data["dtypes"].toIntVector();
    // the scatter into the three tables (fp32); the word table's padding row gets no gradient, as
    // with nn.Embedding(padding_idx=...)
    auto [dword, dpos, dtype] =
        tables.call(dz, s[0], s[1], s[2], rows[0], rows[1], rows[2], ctx->saved_data["padding_idx"].toInt());
    variable_list out(12);
    const Tensor* g[3] = {&dword, &dpos, &dtype};
    for (int i = 0; i < 3; ++i) out[3 + i] = g[i]->to((at::ScalarType)dtypes[i]);
    out[6] = like(dweight, s[4]);
    out[7] = like(dln_bias, s[4]);
    return out;
  }
};

Tensor embedding_layer_norm_autograd(const Tensor& ids, const Tensor& pos_ids, const Tensor& type_ids,
                                     const Tensor& word, const Tensor& pos, const Tensor& type, const Tensor& weight,
                                     const Tensor& ln_bias, double p, double eps, bool out_bf16, int64_t padding_idx) {
  if (p == 0.0 && !needs_grad({&word, &pos, &type, &weight, &ln_bias})) {
    static auto fwd = op<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                const Tensor&, const Tensor&, double, double, bool, int64_t)>(
        "bertaccel::embedding_layer_norm");
    at::AutoDispatchBelowADInplaceOrView guard;
    return fwd.call(ids, pos_ids, type_ids, word, pos, type, weight, ln_bias, p, eps, out_bf16, padding_idx);
  }
  return EmbeddingLayerNormFn::apply(ids, pos_ids, type_ids, word, pos, type, weight, ln_bias, p, eps, out_bf16,
                                     padding_idx);
}

}  // namespace

// (dispatch.h; csrc/eager.cpp's entry for the fan-out)
std::tuple<Tensor, Tensor> residual_layer_norm_fanout(const Tensor& x, const Tensor& bias, const Tensor& residual,
                                                      const Tensor& weight, const Tensor& ln_bias, double p,
                                                      double eps) {
  auto out = ResidualLayerNormFanOutFn::apply(x, bias, residual, weight, ln_bias, p, eps);
  return {out[0], out[1]};
}

}  // namespace bertaccel

TORCH_LIBRARY_IMPL(bertaccel, AutogradCUDA, m) {
  m.impl("layer_norm", &bertaccel::layer_norm_autograd);
  m.impl("rms_norm", &bertaccel::rms_norm_autograd);
  m.impl("bias_gelu", &bertaccel::bias_gelu_autograd);
  m.impl("softmax", &bertaccel::softmax_autograd);
  m.impl("embedding_layer_norm", &bertaccel::embedding_layer_norm_autograd);
}
