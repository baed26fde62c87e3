// Backward of the fused embeddings' LayerNorm and dropout (y = dropout(LayerNorm(z))): the kernel
// of layer_norm_bwd.cuh in its kEmb form (the incoming gradient is masked). The scatter into the
// tables is PyTorch's embedding backward (csrc/autograd.cpp).
#include <torch/library.h>

#include "layer_norm_bwd.cuh"

namespace bertaccel {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> embedding_layer_norm_bwd(
    const at::Tensor& dy_in, const at::Tensor& z, const at::Tensor& gamma, const at::Tensor& mean,
    const at::Tensor& rstd, const at::Tensor& rng, double p) {
  at::Tensor dy = checked_grad(dy_in, z);
  c10::cuda::CUDAGuard guard(z.device());
  const int64_t H = z.size(-1);
  at::Tensor dz = at::empty_like(z);
  auto fopts = z.options().dtype(at::kFloat);
  at::Tensor dgamma = at::empty({H}, fopts), dbeta = at::empty({H}, fopts);
  at::Tensor none;
  launch_bwd_any<kEmb>(dy, z, gamma, mean, rstd, dz, none, dgamma, dbeta, none, p, rng);
  return {dz, dgamma, dbeta};
}

}  // namespace
}  // namespace bertaccel

TORCH_LIBRARY_IMPL(bertaccel, CUDA, m) { m.impl("embedding_layer_norm_bwd", &bertaccel::embedding_layer_norm_bwd); }
