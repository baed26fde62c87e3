// Backward of LayerNorm and of the fused LayerNorm(dropout(x + bias) + residual): the kernel of
// layer_norm_bwd.cuh in its kPlain and kFused forms.
#include <torch/library.h>

#include "layer_norm_bwd.cuh"

namespace bertaccel {
namespace {

using Grads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// dz, dh (fused form), dgamma, dbeta, dbias (fused form); the output's gradient is dy, or dy + dy2 when dy2 is
// defined (fused form only: the kernel sums them as it loads the rows). The plain form returns empty dh / dbias.
Grads backward(const at::Tensor& dy, const at::Tensor& dy2, const at::Tensor& z, const at::Tensor& gamma,
               const at::Tensor& mean, const at::Tensor& rstd, const at::Tensor& rng, double p, bool want_dh) {
  c10::cuda::CUDAGuard guard(z.device());
  const int64_t H = z.size(-1);
  auto fopts = z.options().dtype(at::kFloat);
  at::Tensor dz = at::empty_like(z);
  at::Tensor dgamma = at::empty({H}, fopts), dbeta = at::empty({H}, fopts);
  if (!want_dh) {
    at::Tensor none;
    launch_bwd_any<kPlain>(dy, z, gamma, mean, rstd, dz, none, dgamma, dbeta, none, 0.0, rng);
    return {dz, at::empty({0}, z.options()), dgamma, dbeta, at::empty({0}, fopts)};
  }
  at::Tensor dh = at::empty_like(z), dbias = at::empty({H}, fopts);
  launch_bwd_any<kFused>(dy, z, gamma, mean, rstd, dz, dh, dgamma, dbeta, dbias, p, rng, dy2);
  return {dz, dh, dgamma, dbeta, dbias};
}

Grads layer_norm_bwd(const at::Tensor& dy, const at::Tensor& z, const at::Tensor& gamma, const at::Tensor& mean,
                     const at::Tensor& rstd, const at::Tensor& rng, double p, bool want_dh) {
  return backward(checked_grad(dy, z), at::Tensor(), z, gamma, mean, rstd, rng, p, want_dh);
}

// The fused form's backward with the output's gradient in two parts (dy + dy2, the output's two consumers:
// residual_layer_norm.py's fan-out), summed as the rows are loaded (launch_bwd).
Grads layer_norm_bwd2(const at::Tensor& dy, const at::Tensor& dy2, const at::Tensor& z, const at::Tensor& gamma,
                      const at::Tensor& mean, const at::Tensor& rstd, const at::Tensor& rng, double p) {
  return backward(checked_grad(dy, z), checked_grad(dy2, z), z, gamma, mean, rstd, rng, p, true);
}

}  // namespace
}  // namespace bertaccel

TORCH_LIBRARY_IMPL(bertaccel, CUDA, m) {
  m.impl("layer_norm_bwd", &bertaccel::layer_norm_bwd);
  m.impl("layer_norm_bwd2", &bertaccel::layer_norm_bwd2);
}
