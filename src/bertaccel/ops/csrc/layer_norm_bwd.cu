// Backward of LayerNorm and of the fused LayerNorm(dropout(x + bias) + residual): the kernel of
// layer_norm_bwd.cuh in its kPlain and kFused forms.
#include <torch/library.h>

#include "layer_norm_bwd.cuh"

namespace bertaccel {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd(
    const at::Tensor& dy_in, const at::Tensor& z, const at::Tensor& gamma, const at::Tensor& mean,
    const at::Tensor& rstd, const at::Tensor& rng, double p, bool want_dh) {
  at::Tensor dy = checked_grad(dy_in, z);
  c10::cuda::CUDAGuard guard(z.device());
  const int64_t H = z.size(-1);
  at::Tensor dz = at::empty_like(z);
  at::Tensor dh = want_dh ? at::empty_like(z) : at::Tensor();
  auto fopts = z.options().dtype(at::kFloat);
  at::Tensor dgamma = at::empty({H}, fopts), dbeta = at::empty({H}, fopts);
  at::Tensor dbias = want_dh ? at::empty({H}, fopts) : at::Tensor();
  if (want_dh)
    launch_bwd_any<kFused>(dy, z, gamma, mean, rstd, dz, dh, dgamma, dbeta, dbias, p, rng);
  else
    launch_bwd_any<kPlain>(dy, z, gamma, mean, rstd, dz, dh, dgamma, dbeta, dbias, 0.0, rng);
  if (!want_dh) {
    dh = at::empty({0}, z.options());
    dbias = at::empty({0}, fopts);
  }
  return {dz, dh, dgamma, dbeta, dbias};
}

// The fused form's backward with the output's gradient in two parts (dy + dy2, the output's two consumers:
// residual_layer_norm.py's fan-out), summed as the rows are loaded (launch_bwd).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd2(
    const at::Tensor& dy_in, const at::Tensor& dy2_in, const at::Tensor& z, const at::Tensor& gamma,
    const at::Tensor& mean, const at::Tensor& rstd, const at::Tensor& rng, double p) {
  at::Tensor dy = checked_grad(dy_in, z), dy2 = checked_grad(dy2_in, z);
  c10::cuda::CUDAGuard guard(z.device());
  const int64_t H = z.size(-1);
  at::Tensor dz = at::empty_like(z), dh = at::empty_like(z);
  auto fopts = z.options().dtype(at::kFloat);
  at::Tensor dgamma = at::empty({H}, fopts), dbeta = at::empty({H}, fopts), dbias = at::empty({H}, fopts);
  launch_bwd_any<kFused>(dy, z, gamma, mean, rstd, dz, dh, dgamma, dbeta, dbias, p, rng, dy2);
  return {dz, dh, dgamma, dbeta, dbias};
}

}  // namespace
}  // namespace bertaccel

TORCH_LIBRARY_IMPL(bertaccel, CUDA, m) {
  m.impl("layer_norm_bwd", &bertaccel::layer_norm_bwd);
  m.impl("layer_norm_bwd2", &bertaccel::layer_norm_bwd2);
}
