// Direct Python entry points for the eager calls of the public row ops (the `bertaccel_ops_<key>` module's
// functions; eligibility.direct_entry() hands them out). A call through `torch.ops.bertaccel.<op>.default` converts
// its Python arguments into a boxed stack matched against the schema and back (1.3 us more than a pybind call of
// the same op on a desktop CPU, more on a server's), and the Python wrapper's eligibility test reads the tensors'
// device and dtype attributes one Python object at a time. Each function here does both in C++: the same test as
// eligibility.why_not (a CUDA tensor of a kernel dtype, last dimension <= 8192, norm parameters fp32 or the input's
// dtype on its device) and, when it passes, one unboxed dispatcher call of the op (every dispatch key still applies:
// autograd, TorchDispatchModes, FakeTensor). When it does not pass, the function returns None and the Python wrapper
// takes its own path (the reason, the fallback). The wrapper uses these only outside torch.compile and when no
// __torch_function__ override or mode is active (what torch.ops would have honoured first).
#include <torch/extension.h>

#include <limits>

#include "dispatch.h"

namespace bertaccel {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

constexpr int64_t kMaxHidden = 8192;  // eligibility.MAX_HIDDEN

// eligibility.why_not(x) is None
bool rows_ok(const Tensor& x) {
  return x.is_cuda() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) && x.dim() >= 1 &&
         x.size(-1) <= kMaxHidden;
}

// a norm parameter why_not accepts beside x
bool param_ok(const Tensor& x, const Tensor& p) {
  return (p.scalar_type() == at::kFloat || p.scalar_type() == x.scalar_type()) && p.device() == x.device();
}

using LayerNormSig = Tensor(const Tensor&, const OptTensor&, const OptTensor&, const Tensor&, const Tensor&, double,
                            double);

// layer_norm.layer_norm
OptTensor layer_norm(const Tensor& x, const OptTensor& weight, const OptTensor& bias, double eps) {
  if (!weight || !bias || !rows_ok(x) || !param_ok(x, *weight) || !param_ok(x, *bias)) return std::nullopt;
  static auto call = op<LayerNormSig>("bertaccel::layer_norm");
  pybind11::gil_scoped_release no_gil;  // (as torch.ops and PyTorch's own bindings do)
  return call.call(x.contiguous(), std::nullopt, std::nullopt, *weight, *bias, 0.0, eps);
}

// The residual form's kernel arguments (residual_layer_norm._kernel_args): x as it is shaped, the residual in x's
// dtype and shape, the bias in the LayerNorm weight's dtype.
struct ResidualArgs {
  Tensor x, bias, residual;
  ResidualArgs(const Tensor& x_in, const Tensor& bias_in, const Tensor& residual_in, const Tensor& weight)
      : x(x_in.contiguous()),
        bias(bias_in.to(weight.scalar_type()).contiguous()),  // in the LayerNorm weight's dtype, as the kernel reads it
        residual((residual_in.sizes() == x_in.sizes() ? residual_in : residual_in.reshape(x_in.sizes()))
                     .to(x_in.scalar_type())
                     .contiguous()) {}
};

bool residual_ok(const Tensor& x, const Tensor& weight, const Tensor& ln_bias) {
  return rows_ok(x) && param_ok(x, weight) && param_ok(x, ln_bias);
}

// residual_layer_norm.bias_dropout_add_layer_norm (p already 0 outside training)
OptTensor bias_dropout_add_layer_norm(const Tensor& x, const Tensor& bias, const Tensor& residual,
                                      const Tensor& weight, const Tensor& ln_bias, double p, double eps) {
  if (!residual_ok(x, weight, ln_bias)) return std::nullopt;
  static auto call = op<LayerNormSig>("bertaccel::layer_norm");
  pybind11::gil_scoped_release no_gil;
  const ResidualArgs a(x, bias, residual, weight);
  return call.call(a.x, a.bias, a.residual, weight, ln_bias, p, eps);
}

// residual_layer_norm.bias_dropout_add_layer_norm_fanout: (y, an alias of y for its second consumer)
std::optional<std::tuple<Tensor, Tensor>> bias_dropout_add_layer_norm_fanout(
    const Tensor& x, const Tensor& bias, const Tensor& residual, const Tensor& weight, const Tensor& ln_bias, double p,
    double eps) {
  if (!residual_ok(x, weight, ln_bias)) return std::nullopt;
  pybind11::gil_scoped_release no_gil;
  const ResidualArgs a(x, bias, residual, weight);
  return residual_layer_norm_fanout(a.x, a.bias, a.residual, weight, ln_bias, p, eps);
}

// rms_norm.rms_norm (eps None: the input dtype's machine epsilon, as F.rms_norm)
OptTensor rms_norm(const Tensor& x, const OptTensor& weight, std::optional<double> eps) {
  if (!weight || !rows_ok(x) || !param_ok(x, *weight)) return std::nullopt;
  static auto call = op<Tensor(const Tensor&, const Tensor&, double)>("bertaccel::rms_norm");
  const double e = eps ? *eps
                       : (x.scalar_type() == at::kBFloat16 ? (double)std::numeric_limits<c10::BFloat16>::epsilon()
                                                            : (double)std::numeric_limits<float>::epsilon());
  pybind11::gil_scoped_release no_gil;
  return call.call(x.contiguous(), *weight, e);
}

// gelu.bias_gelu
OptTensor bias_gelu(const Tensor& x, const OptTensor& bias, bool tanh_form) {
  if (!rows_ok(x)) return std::nullopt;
  static auto call = op<Tensor(const Tensor&, const OptTensor&, bool)>("bertaccel::bias_gelu");
  pybind11::gil_scoped_release no_gil;
  // an fp32 bias as it is (the kernel reads it so), another in x's dtype
  OptTensor b = !bias ? std::nullopt
                      : OptTensor((bias->scalar_type() == at::kFloat ? *bias : bias->to(x.scalar_type())).contiguous());
  return call.call(x.contiguous(), b, tanh_form);
}

}  // namespace
}  // namespace bertaccel

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "bertaccel's direct eager entry points (see csrc/eager.cpp); None where the kernel cannot take the inputs";
  m.def("layer_norm", &bertaccel::layer_norm);
  m.def("bias_dropout_add_layer_norm", &bertaccel::bias_dropout_add_layer_norm);
  m.def("bias_dropout_add_layer_norm_fanout", &bertaccel::bias_dropout_add_layer_norm_fanout);
  m.def("rms_norm", &bertaccel::rms_norm);
  m.def("bias_gelu", &bertaccel::bias_gelu);
}
