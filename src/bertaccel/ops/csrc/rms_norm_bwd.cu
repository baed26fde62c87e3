// Backward of RMSNorm: the kernel of layer_norm_bwd.cuh in its kRms form (no centring, no beta).
#include <torch/library.h>

#include "layer_norm_bwd.cuh"

namespace bertaccel {
namespace {

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor& dy_in, const at::Tensor& x, const at::Tensor& gamma,
                                                const at::Tensor& rstd) {
  at::Tensor dy = checked_grad(dy_in, x);
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor dx = at::empty_like(x);
  at::Tensor dgamma = at::empty({x.size(-1)}, x.options().dtype(at::kFloat));
  at::Tensor none, rng;
  launch_bwd_any<kRms>(dy, x, gamma, none, rstd, dx, none, dgamma, none, none, 0.0, rng);
  return {dx, dgamma};
}

}  // namespace
}  // namespace bertaccel

TORCH_LIBRARY_IMPL(bertaccel, CUDA, m) { m.impl("rms_norm_bwd", &bertaccel::rms_norm_bwd); }
