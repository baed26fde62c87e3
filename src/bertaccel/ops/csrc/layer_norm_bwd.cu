// Backward of LayerNorm, RMSNorm, the fused residual LayerNorm (layer_norm_fwd.cu) and the fused
// embeddings (embeddings.cu: dropout *after* the LayerNorm, so the incoming gradient is masked).
//
// Launch: as many blocks as fit on the GPU at once (occupancy query), each looping over groups of
// rows. A thread owns the same columns in every row it visits, so dgamma / dbeta / dbias accumulate
// in registers; the block parks them in shared memory, sums its row slots and writes one partial
// row, and `column_sum_kernel` adds the partial rows up: no atomics. Bytes: read dy and z, write dz
// (+ dh for the fused form).
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "common.cuh"

namespace bertaccel {
namespace {

constexpr int kThreads = 256;

// Dropout placement: kBefore masks dh (the gradient of x + bias in LayerNorm(dropout(x + bias) +
// residual)); kAfter masks dy (y = dropout(LayerNorm(z)), the embeddings).
enum DropoutAt : int { kBefore = 0, kAfter = 1 };

template <typename T, typename W, int VEC, int ITEMS>
__global__ void __launch_bounds__(kThreads) ln_bwd_kernel(
    const T* __restrict__ dy, const T* __restrict__ z, const W* __restrict__ gamma,
    const float* __restrict__ mean, const float* __restrict__ rstd, T* __restrict__ dz, T* __restrict__ dh,
    float* __restrict__ dgamma_part, float* __restrict__ dbeta_part, float* __restrict__ dbias_part,
    int64_t rows, int H, int tpr, float p, const int64_t* __restrict__ rng, int dropout_at) {
  __shared__ float red[kThreads / 32];
  const int nvec = H / VEC;
  const int rpb = kThreads / tpr;
  const int local_row = threadIdx.x / tpr;
  const int t = threadIdx.x % tpr;
  const uint64_t seed = p > 0.f ? (uint64_t)rng[0] : 0, offset = p > 0.f ? (uint64_t)rng[1] : 0;
  const float scale = p > 0.f ? 1.f / (1.f - p) : 1.f;
  const bool rms = mean == nullptr;  // RMSNorm: no centring, no beta

  float acc_g[ITEMS][VEC], acc_b[ITEMS][VEC], acc_h[ITEMS][VEC];
#pragma unroll
  for (int k = 0; k < ITEMS; ++k)
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc_g[k][j] = acc_b[k][j] = acc_h[k][j] = 0.f;

  const int64_t row_groups = (rows + rpb - 1) / rpb;
  for (int64_t grp = blockIdx.x; grp < row_groups; grp += gridDim.x) {
    const int64_t row = grp * rpb + local_row;
    const bool active = row < rows;
    float xh[ITEMS][VEC], gdy[ITEMS][VEC];
    float s1 = 0.f, s2 = 0.f;  // sum(gamma * dy), sum(gamma * dy * xhat)
    const float mu = active && !rms ? mean[row] : 0.f, rs = active ? rstd[row] : 0.f;
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int c = t + k * tpr;
      if (active && c < nvec) {
        const int64_t off = row * H + (int64_t)c * VEC;
        float d[VEC], g[VEC];
        load_f<T, VEC>(z + off, xh[k]);
        load_f<T, VEC>(dy + off, d);
        load_f<W, VEC>(gamma + c * VEC, g);
        if (p > 0.f && dropout_at == kAfter) {
          bool keep[VEC];
          dropout_keep<VEC>(seed, offset, off, p, keep);
#pragma unroll
          for (int j = 0; j < VEC; ++j) d[j] = keep[j] ? d[j] * scale : 0.f;
        }
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          xh[k][j] = (xh[k][j] - mu) * rs;
          gdy[k][j] = g[j] * d[j];
          s1 += gdy[k][j];
          s2 += gdy[k][j] * xh[k][j];
          acc_g[k][j] += d[j] * xh[k][j];
          acc_b[k][j] += d[j];
        }
      }
    }
    const float inv_h = 1.f / (float)H;
    s1 = rms ? 0.f : row_reduce(s1, tpr, red, local_row, SumOp()) * inv_h;
    s2 = row_reduce(s2, tpr, red, local_row, SumOp()) * inv_h;
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int c = t + k * tpr;
      if (active && c < nvec) {
        const int64_t off = row * H + (int64_t)c * VEC;
        float o[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) o[j] = rs * (gdy[k][j] - s1 - xh[k][j] * s2);
        store_f<T, VEC>(dz + off, o);
        if (dh != nullptr) {
          if (p > 0.f && dropout_at == kBefore) {
            bool keep[VEC];
            dropout_keep<VEC>(seed, offset, off, p, keep);
#pragma unroll
            for (int j = 0; j < VEC; ++j) o[j] = keep[j] ? o[j] * scale : 0.f;
          }
          // dh is stored in T; dbias sums the rounded values, as a separate bias-grad kernel would.
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            o[j] = to_f(from_f<T>(o[j]));
            acc_h[k][j] += o[j];
          }
          store_f<T, VEC>(dh + off, o);
        }
      }
    }
  }
  // Reduce the per-thread column partials over the block's row slots, one accumulator at a time:
  // every thread parks its columns in shared memory ([row slot][column], rpb x H <= 256 x 32
  // floats), then all threads sum the slots of strided columns and write one coalesced partial row
  // per block. Two barriers per accumulator.
  __shared__ __align__(16) float park[kThreads * kMaxElemsPerThread];
#pragma unroll
  for (int which = 0; which < 3; ++which) {
    float* part = which == 0 ? dgamma_part : which == 1 ? dbeta_part : dbias_part;
    if (part == nullptr) continue;  // uniform across the block
    __syncthreads();
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int c = t + k * tpr;
      if (c < nvec) {
        float* dst = park + local_row * H + c * VEC;
        // Selected by compile-time indices only, so the accumulators stay in registers.
#define BA_PARK(ACC)                                                                                  \
  if constexpr (VEC % 4 == 0) { /* 16-byte stores: 2-way bank conflicts instead of 8-way */          \
    _Pragma("unroll") for (int j = 0; j < VEC; j += 4)                                               \
      *reinterpret_cast<float4*>(dst + j) = make_float4(ACC[k][j], ACC[k][j + 1], ACC[k][j + 2], ACC[k][j + 3]); \
  } else {                                                                                            \
    _Pragma("unroll") for (int j = 0; j < VEC; ++j) dst[j] = ACC[k][j];                              \
  }
        if (which == 0) { BA_PARK(acc_g) } else if (which == 1) { BA_PARK(acc_b) } else { BA_PARK(acc_h) }
#undef BA_PARK
      }
    }
    __syncthreads();
    for (int col = threadIdx.x; col < H; col += kThreads) {
      float s = 0.f;
      for (int r = 0; r < rpb; ++r) s += park[r * H + col];
      part[(int64_t)blockIdx.x * H + col] = s;
    }
  }
}

// dz (and dh), dgamma, dbeta (LayerNorm only), dbias (with dh). mean undefined: RMSNorm.
template <typename T, typename W>
void launch_bwd(const at::Tensor& dy, const at::Tensor& z, const at::Tensor& gamma, const at::Tensor& mean,
                const at::Tensor& rstd, at::Tensor& dz, at::Tensor& dh, at::Tensor& dgamma, at::Tensor& dbeta,
                at::Tensor& dbias, double p, const at::Tensor& rng, int dropout_at) {
  const int64_t H = z.size(-1);
  const int64_t rows = H > 0 ? z.numel() / H : 0;
  if (rows == 0) {
    for (at::Tensor* t : {&dgamma, &dbeta, &dbias})
      if (t->defined()) t->zero_();
    return;
  }
  constexpr int max_vec = 16 / sizeof(T);
  const int vec = pick_vec(H, max_vec, {&dy, &z, &dz, &dh, &gamma});
  const int items = pick_items((int)(H / vec), vec, max_vec);
  const int tpr = pick_tpr((int)(H / vec), items);
  TORCH_CHECK(tpr <= kThreads, "bertaccel layer_norm: hidden size ", H, " is above ", kThreads * kMaxElemsPerThread);
  const int rpb = kThreads / tpr;
  const int64_t groups = (rows + rpb - 1) / rpb;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  auto opts = z.options().dtype(at::kFloat);
  auto stream = at::cuda::getCurrentCUDAStream();
  T* dhp = dh.defined() ? (T*)dh.data_ptr() : nullptr;
  const float* meanp = mean.defined() ? mean.data_ptr<float>() : nullptr;
  const int64_t* rngp = p > 0 ? rng.data_ptr<int64_t>() : nullptr;
  int blocks = 0;
  at::Tensor pg, pb, ph;
#define BA_LN_BWD(V, I)                                                                                          \
  do {                                                                                                           \
    static const int per_sm = [] { /* resident blocks per SM: registers and shared memory decide */            \
      int n = 1;                                                                                                 \
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, ln_bwd_kernel<T, W, V, I>, kThreads, 0));    \
      return n;                                                                                                  \
    }();                                                                                                         \
    blocks = (int)std::min<int64_t>(groups, (int64_t)sms * std::max(per_sm, 1));                                \
    pg = at::empty({blocks, H}, opts);                                                                           \
    if (dbeta.defined()) pb = at::empty({blocks, H}, opts);                                                      \
    if (dbias.defined()) ph = at::empty({blocks, H}, opts);                                                      \
    ln_bwd_kernel<T, W, V, I><<<blocks, kThreads, 0, stream>>>(                                                     \
        (const T*)dy.data_ptr(), (const T*)z.data_ptr(), (const W*)gamma.data_ptr(), meanp, rstd.data_ptr<float>(), \
        (T*)dz.data_ptr(), dhp, pg.data_ptr<float>(), pb.defined() ? pb.data_ptr<float>() : nullptr,            \
        ph.defined() ? ph.data_ptr<float>() : nullptr, rows, (int)H, tpr, (float)p, rngp, dropout_at);          \
  } while (0)
  BA_DISPATCH_VEC_ITEMS(sizeof(T), vec, items, BA_LN_BWD);
#undef BA_LN_BWD
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  dim3 cgrid((unsigned)((H + 31) / 32)), cblock(32, 8);
  column_sum_kernel<<<cgrid, cblock, 0, stream>>>(pg.data_ptr<float>(), blocks, (int)H, dgamma.data_ptr<float>());
  if (dbeta.defined())
    column_sum_kernel<<<cgrid, cblock, 0, stream>>>(pb.data_ptr<float>(), blocks, (int)H, dbeta.data_ptr<float>());
  if (dbias.defined())
    column_sum_kernel<<<cgrid, cblock, 0, stream>>>(ph.data_ptr<float>(), blocks, (int)H, dbias.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// gamma is the second argument after dy; its dtype (float32, or bf16 under bf16-true) picks W.
template <typename... Args>
void launch_any(const at::Tensor& dy, const at::Tensor& z, const at::Tensor& gamma, Args&&... args) {
  TORCH_CHECK(gamma.scalar_type() == at::kFloat || gamma.scalar_type() == z.scalar_type(),
              "bertaccel: weight must be float32 or the input's dtype, got ", gamma.scalar_type());
  check_cuda_contiguous(gamma, "weight");
  TORCH_CHECK(gamma.numel() == z.size(-1), "bertaccel: weight size mismatch");
  if (dy.scalar_type() == at::kBFloat16) {
    if (gamma.scalar_type() == at::kFloat)
      launch_bwd<__nv_bfloat16, float>(dy, z, gamma, std::forward<Args>(args)...);
    else
      launch_bwd<__nv_bfloat16, __nv_bfloat16>(dy, z, gamma, std::forward<Args>(args)...);
  } else {
    launch_bwd<float, float>(dy, z, gamma, std::forward<Args>(args)...);
  }
}

at::Tensor checked_grad(const at::Tensor& dy_in, const at::Tensor& z) {
  at::Tensor dy = dy_in.contiguous();
  check_cuda_contiguous(z, "saved input");
  TORCH_CHECK(z.scalar_type() == at::kBFloat16 || z.scalar_type() == at::kFloat,
              "bertaccel: saved input must be bfloat16 or float32");
  TORCH_CHECK(dy.sizes() == z.sizes() && dy.scalar_type() == z.scalar_type(), "bertaccel: grad must match the input");
  return dy;
}

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
  launch_any(dy, z, gamma, mean, rstd, dz, dh, dgamma, dbeta, dbias, p, rng, (int)kBefore);
  if (!want_dh) {
    dh = at::empty({0}, z.options());
    dbias = at::empty({0}, fopts);
  }
  return {dz, dh, dgamma, dbeta, dbias};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor& dy_in, const at::Tensor& x, const at::Tensor& gamma,
                                                const at::Tensor& rstd) {
  at::Tensor dy = checked_grad(dy_in, x);
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor dx = at::empty_like(x);
  at::Tensor dgamma = at::empty({x.size(-1)}, x.options().dtype(at::kFloat));
  at::Tensor none, rng;
  launch_any(dy, x, gamma, none, rstd, dx, none, dgamma, none, none, 0.0, rng, (int)kBefore);
  return {dx, dgamma};
}

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
  launch_any(dy, z, gamma, mean, rstd, dz, none, dgamma, dbeta, none, p, rng, (int)kAfter);
  return {dz, dgamma, dbeta};
}

}  // namespace
}  // namespace bertaccel

TORCH_LIBRARY_IMPL(bertaccel, CUDA, m) {
  m.impl("layer_norm_bwd", &bertaccel::layer_norm_bwd);
  m.impl("rms_norm_bwd", &bertaccel::rms_norm_bwd);
  m.impl("embedding_layer_norm_bwd", &bertaccel::embedding_layer_norm_bwd);
}
