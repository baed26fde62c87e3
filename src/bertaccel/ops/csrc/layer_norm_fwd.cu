// LayerNorm, RMSNorm and the fused tail of BERT's sub-layers, forward:
//   y = LayerNorm(dropout(x + bias) + residual)       (bias, dropout, residual optional)
//   y = x * rsqrt(mean(x^2) + eps) * weight            (RMSNorm)
//
// Launch: blocks of 256 threads; a row is handled by `tpr` threads (a power of two: 32 for a BERT
// row of 768 bf16, fewer for short rows, up to 256 for 8192), 256 / tpr rows per block. Each thread
// loads ITEMS 16-byte vectors of its row into registers (one read of x, bias, residual). Statistics
// are two-pass over the registers, in fp32: the row sum gives the mean, then the sum of squared
// deviations gives the variance (no per-element division as in Welford, and no cancellation as in
// E[x^2] - E[x]^2). The thread then normalises its registers and writes y (and z, the pre-norm sum
// the backward needs, for the fused form). Bytes: read x (+ residual), write y (+ z), 8 bytes of
// statistics per row; ~8 FLOPs per element.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/PhiloxUtils.cuh>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "common.cuh"

namespace bertaccel {
namespace {

constexpr int kThreads = 256;

template <typename T, int VEC, int ITEMS>
__global__ void __launch_bounds__(kThreads) ln_fwd_kernel(
    const T* __restrict__ x, const T* __restrict__ bias, const T* __restrict__ residual,
    const float* __restrict__ gamma, const float* __restrict__ beta, T* __restrict__ y, T* __restrict__ z,
    float* __restrict__ mean_out, float* __restrict__ rstd_out, int64_t rows, int H, int tpr, float eps,
    float p, at::PhiloxCudaState philox, int64_t* __restrict__ rng_out, bool rms) {
  __shared__ float red[kThreads / 32];
  const int nvec = H / VEC;
  const int local_row = threadIdx.x / tpr;
  const int t = threadIdx.x % tpr;
  const int64_t row = (int64_t)blockIdx.x * (kThreads / tpr) + local_row;
  const bool active = row < rows;
  uint64_t seed = 0, offset = 0;
  if (p > 0.f) {
    auto s = at::cuda::philox::unpack(philox);
    seed = std::get<0>(s);
    offset = std::get<1>(s);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {  // (0, 0) without dropout: no separate fill kernel
    rng_out[0] = (int64_t)seed;
    rng_out[1] = (int64_t)offset;
  }
  const float scale = p > 0.f ? 1.f / (1.f - p) : 1.f;

  float v[ITEMS][VEC];
  float sum = 0.f;
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    const int c = t + k * tpr;
    if (active && c < nvec) {
      const int64_t off = row * H + (int64_t)c * VEC;
      load_f<T, VEC>(x + off, v[k]);
      if (bias != nullptr) {
        float b[VEC];
        load_f<T, VEC>(bias + c * VEC, b);
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[k][j] += b[j];
      }
      if (p > 0.f) {
        bool keep[VEC];
        dropout_keep<VEC>(seed, offset, off, p, keep);
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[k][j] = keep[j] ? v[k][j] * scale : 0.f;
      }
      if (residual != nullptr) {
        float r[VEC];
        load_f<T, VEC>(residual + off, r);
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[k][j] += r[j];
      }
      if (z != nullptr) {
        // The backward sees z in T: normalise exactly what is saved, so both passes agree.
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[k][j] = to_f(from_f<T>(v[k][j]));
        store_f<T, VEC>(z + off, v[k]);
      }
#pragma unroll
      for (int j = 0; j < VEC; ++j) sum += v[k][j];
    }
  }
  const float inv_h = 1.f / (float)H;
  const float mean = rms ? 0.f : row_reduce(sum, tpr, red, local_row, SumOp()) * inv_h;
  float sq = 0.f;
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    const int c = t + k * tpr;
    if (active && c < nvec)
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float d = v[k][j] - mean;
        sq += d * d;
      }
  }
  const float rstd = rsqrtf(row_reduce(sq, tpr, red, local_row, SumOp()) * inv_h + eps);
  if (!active) return;
  if (t == 0) {
    if (mean_out != nullptr) mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    const int c = t + k * tpr;
    if (c < nvec) {
      float g[VEC], b[VEC], o[VEC];
      load_f<float, VEC>(gamma + c * VEC, g);
      if (beta != nullptr) {
        load_f<float, VEC>(beta + c * VEC, b);
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) b[j] = 0.f;
      }
#pragma unroll
      for (int j = 0; j < VEC; ++j) o[j] = (v[k][j] - mean) * rstd * g[j] + b[j];
      store_f<T, VEC>(y + row * H + (int64_t)c * VEC, o);
    }
  }
}

// -------------------------------------------------------------------------------- dispatch
template <typename T>
void launch_fwd(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& residual, const at::Tensor& gamma,
                const at::Tensor& beta, at::Tensor& y, at::Tensor& z, at::Tensor& mean, at::Tensor& rstd, double eps,
                double p, at::Tensor& rng, bool rms) {
  const int64_t H = x.size(-1);
  if (H == 0 || x.numel() == 0) {
    rng.zero_();
    return;
  }
  const int64_t rows = x.numel() / H;
  constexpr int max_vec = 16 / sizeof(T);
  const int vec = pick_vec(H, max_vec, {&x, &bias, &residual, &y, &z});
  const int items = pick_items((int)(H / vec), vec, max_vec);
  const int tpr = pick_tpr((int)(H / vec), items);
  TORCH_CHECK(tpr <= kThreads, "bertaccel layer_norm: hidden size ", H, " is above ", kThreads * kMaxElemsPerThread);
  at::PhiloxCudaState philox;
  if (p > 0) {
    auto gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(std::nullopt, at::cuda::detail::getDefaultCUDAGenerator());
    std::lock_guard<std::mutex> lock(gen->mutex_);
    philox = gen->philox_cuda_state((uint64_t)((x.numel() + 3) / 4) * 4);
  }
  const int rpb = kThreads / tpr;
  dim3 grid((unsigned)((rows + rpb - 1) / rpb));
  auto stream = at::cuda::getCurrentCUDAStream();
  const T* bp = bias.defined() ? (const T*)bias.data_ptr() : nullptr;
  const T* rp = residual.defined() ? (const T*)residual.data_ptr() : nullptr;
  T* zp = z.defined() ? (T*)z.data_ptr() : nullptr;
  float* mp = mean.defined() ? mean.data_ptr<float>() : nullptr;
  const float* betap = beta.defined() ? beta.data_ptr<float>() : nullptr;
#define BA_LN_FWD(V, I)                                                                                          \
  ln_fwd_kernel<T, V, I><<<grid, kThreads, 0, stream>>>(                                                         \
      (const T*)x.data_ptr(), bp, rp, gamma.data_ptr<float>(), betap, (T*)y.data_ptr(), zp, mp,                 \
      rstd.data_ptr<float>(), rows, (int)H, tpr, (float)eps, (float)p, philox, rng.data_ptr<int64_t>(), rms)
  BA_DISPATCH_VEC_ITEMS(sizeof(T), vec, items, BA_LN_FWD);
#undef BA_LN_FWD
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void check_inputs(const at::Tensor& x, const at::Tensor& gamma, const at::Tensor* beta, const char* op) {
  check_cuda_contiguous(x, "input");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "bertaccel ", op, ": input must be bfloat16 or float32, got ", x.scalar_type());
  TORCH_CHECK(gamma.scalar_type() == at::kFloat && (!beta || beta->scalar_type() == at::kFloat),
              "bertaccel ", op, ": weight and bias must be float32");
  TORCH_CHECK(gamma.numel() == x.size(-1) && (!beta || beta->numel() == x.size(-1)),
              "bertaccel ", op, ": weight/bias size mismatch");
  check_cuda_contiguous(gamma, "weight");
  if (beta) check_cuda_contiguous(*beta, "bias");
}

template <typename... Args>
void launch_any(const at::Tensor& x, Args&&... args) {
  if (x.scalar_type() == at::kBFloat16)
    launch_fwd<__nv_bfloat16>(x, std::forward<Args>(args)...);
  else
    launch_fwd<float>(x, std::forward<Args>(args)...);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd(
    const at::Tensor& x, const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual,
    const at::Tensor& gamma, const at::Tensor& beta, double p, double eps) {
  check_inputs(x, gamma, &beta, "layer_norm");
  const bool fused = bias.has_value() || residual.has_value() || p > 0;
  if (bias) {
    check_cuda_contiguous(*bias, "bias");
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->numel() == x.size(-1), "bertaccel: bias must match input");
  }
  if (residual) {
    check_cuda_contiguous(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "bertaccel: residual must match input in shape and dtype");
  }
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t H = x.size(-1), rows = x.numel() / std::max<int64_t>(H, 1);
  at::Tensor y = at::empty_like(x);
  at::Tensor z = fused ? at::empty_like(x) : at::Tensor();
  auto fopts = x.options().dtype(at::kFloat);
  at::Tensor mean = at::empty({rows}, fopts), rstd = at::empty({rows}, fopts);
  at::Tensor rng = at::empty({2}, x.options().dtype(at::kLong));  // written by the kernel
  at::Tensor b = bias ? *bias : at::Tensor(), r = residual ? *residual : at::Tensor();
  launch_any(x, b, r, gamma, beta, y, z, mean, rstd, eps, p, rng, false);
  if (!fused) z = at::empty({0}, x.options());
  return {y, z, mean, rstd, rng};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor& x, const at::Tensor& gamma, double eps) {
  check_inputs(x, gamma, nullptr, "rms_norm");
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.numel() / std::max<int64_t>(x.size(-1), 1);
  at::Tensor y = at::empty_like(x);
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  at::Tensor none, rng = at::empty({2}, x.options().dtype(at::kLong));
  launch_any(x, none, none, gamma, none, y, none, none, rstd, eps, 0.0, rng, true);
  return {y, rstd};
}

}  // namespace
}  // namespace bertaccel

TORCH_LIBRARY_IMPL(bertaccel, CUDA, m) {
  m.impl("layer_norm_fwd", &bertaccel::layer_norm_fwd);
  m.impl("rms_norm_fwd", &bertaccel::rms_norm_fwd);
}
