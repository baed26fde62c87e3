// LayerNorm and the fused tail of BERT's sub-layers: y = LayerNorm(dropout(x + bias) + residual).
//
// Forward launch: blocks of 256 threads; a row is handled by `tpr` threads (32 for hidden <= 1024
// bf16, up to 1024 for hidden 32768), 256 / tpr rows per block. Each thread loads up to ITEMS
// 16-byte vectors of its row into registers (one read of x, bias, residual), folds them into a
// Welford state, the row's threads merge their states (warp shuffles, then shared memory when a
// row spans several warps), and the thread normalises its registers and writes y (and z, the
// pre-norm sum the backward needs, for the fused form). Bytes: read x (+ residual), write y (+ z),
// 8 bytes of statistics per row; ~8 FLOPs per element.
//
// Backward launch: min(row groups, 2 blocks per SM) blocks, each looping over rows. A thread owns
// the same columns in every row it visits, so dgamma / dbeta / dbias accumulate in registers; the
// block reduces them in shared memory and writes one partial row, and `column_sum_kernel` adds the
// partial rows up: no atomics. Bytes: read dy and z, write dz (+ dh for the fused form).
#include <ATen/core/Tensor.h>
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
// Each thread caches up to 32 elements of its row in registers (ITEMS vectors of VEC): with 256
// threads per row at most, rows up to 8192 elements fit.
constexpr int kElemsPerThread = 32;

template <typename T, int VEC, int ITEMS>
__global__ void __launch_bounds__(kThreads) ln_fwd_kernel(
    const T* __restrict__ x, const T* __restrict__ bias, const T* __restrict__ residual,
    const float* __restrict__ gamma, const float* __restrict__ beta, T* __restrict__ y, T* __restrict__ z,
    float* __restrict__ mean_out, float* __restrict__ rstd_out, int64_t rows, int H, int tpr, float eps,
    float p, at::PhiloxCudaState philox, int64_t* __restrict__ rng_out) {
  __shared__ Welford red[kThreads / 32];
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
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      rng_out[0] = (int64_t)seed;
      rng_out[1] = (int64_t)offset;
    }
  }
  const float scale = p > 0.f ? 1.f / (1.f - p) : 1.f;

  float v[ITEMS][VEC];
  Welford w{0.f, 0.f, 0.f};
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
      for (int j = 0; j < VEC; ++j) {
        w.n += 1.f;
        float d = v[k][j] - w.mean;
        w.mean += d / w.n;
        w.m2 += d * (v[k][j] - w.mean);
      }
    }
  }
  // Merge the Welford states of the row's threads.
  const int width = tpr < 32 ? tpr : 32;
  for (int m = width / 2; m > 0; m >>= 1) w = welford_shfl_xor(w, m, width);
  if (tpr > 32) {
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = w;
    __syncthreads();
    const int first = (local_row * tpr) >> 5;
    w = red[first];
    for (int i = 1; i < tpr / 32; ++i) w = welford_merge(w, red[first + i]);
  }
  const float mean = w.mean;
  const float rstd = rsqrtf(w.m2 / (float)H + eps);
  if (!active) return;
  if (t == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    const int c = t + k * tpr;
    if (c < nvec) {
      float g[VEC], b[VEC], o[VEC];
      load_f<float, VEC>(gamma + c * VEC, g);
      load_f<float, VEC>(beta + c * VEC, b);
#pragma unroll
      for (int j = 0; j < VEC; ++j) o[j] = (v[k][j] - mean) * rstd * g[j] + b[j];
      store_f<T, VEC>(y + row * H + (int64_t)c * VEC, o);
    }
  }
}

template <typename T, int VEC, int ITEMS>
__global__ void __launch_bounds__(kThreads) ln_bwd_kernel(
    const T* __restrict__ dy, const T* __restrict__ z, const float* __restrict__ gamma,
    const float* __restrict__ mean, const float* __restrict__ rstd, T* __restrict__ dz, T* __restrict__ dh,
    float* __restrict__ dgamma_part, float* __restrict__ dbeta_part, float* __restrict__ dbias_part,
    int64_t rows, int H, int tpr, float p, const int64_t* __restrict__ rng) {
  __shared__ float red2[2][kThreads / 32];
  const int nvec = H / VEC;
  const int rpb = kThreads / tpr;
  const int local_row = threadIdx.x / tpr;
  const int t = threadIdx.x % tpr;
  const uint64_t seed = p > 0.f ? (uint64_t)rng[0] : 0, offset = p > 0.f ? (uint64_t)rng[1] : 0;
  const float scale = p > 0.f ? 1.f / (1.f - p) : 1.f;

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
    const float mu = active ? mean[row] : 0.f, rs = active ? rstd[row] : 0.f;
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int c = t + k * tpr;
      if (active && c < nvec) {
        const int64_t off = row * H + (int64_t)c * VEC;
        float d[VEC], g[VEC];
        load_f<T, VEC>(z + off, xh[k]);
        load_f<T, VEC>(dy + off, d);
        load_f<float, VEC>(gamma + c * VEC, g);
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
    const int width = tpr < 32 ? tpr : 32;
    for (int m = width / 2; m > 0; m >>= 1) {
      s1 += __shfl_xor_sync(0xffffffffu, s1, m, width);
      s2 += __shfl_xor_sync(0xffffffffu, s2, m, width);
    }
    if (tpr > 32) {
      __syncthreads();  // red2 is reused across iterations
      if ((threadIdx.x & 31) == 0) {
        red2[0][threadIdx.x >> 5] = s1;
        red2[1][threadIdx.x >> 5] = s2;
      }
      __syncthreads();
      const int first = (local_row * tpr) >> 5;
      s1 = s2 = 0.f;
      for (int i = 0; i < tpr / 32; ++i) {
        s1 += red2[0][first + i];
        s2 += red2[1][first + i];
      }
    }
    const float inv_h = 1.f / (float)H;
    s1 *= inv_h;
    s2 *= inv_h;
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
          if (p > 0.f) {
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
  // every thread parks its columns in shared memory ([row slot][column], at most 256 / tpr x H <=
  // 8192 floats), then all threads sum the slots of strided columns and write one coalesced partial
  // row per block. Two barriers per accumulator.
  __shared__ __align__(16) float park[kThreads * kElemsPerThread];
  const bool with_bias = dbias_part != nullptr;
#pragma unroll
  for (int which = 0; which < 3; ++which) {
    if (which == 2 && !with_bias) break;
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
    float* part = which == 0 ? dgamma_part : which == 1 ? dbeta_part : dbias_part;
    for (int col = threadIdx.x; col < H; col += kThreads) {
      float s = 0.f;
      for (int r = 0; r < rpb; ++r) s += park[r * H + col];
      part[(int64_t)blockIdx.x * H + col] = s;
    }
  }
}

int pick_vec(int H, int64_t max_vec, std::initializer_list<const at::Tensor*> ts) {
  int vec = (int)max_vec;
  while (vec > 1) {
    bool ok = H % vec == 0;
    for (auto* t : ts)
      if (t->defined() && t->numel() > 0 && reinterpret_cast<uintptr_t>(t->data_ptr()) % (vec * t->element_size()) != 0) ok = false;
    if (ok) break;
    vec /= 2;
  }
  return vec;
}

int pick_tpr(int nvec, int items) {
  int need = (nvec + items - 1) / items;
  int tpr = 1;
  while (tpr < need) tpr <<= 1;
  return tpr < 32 ? 32 : tpr;  // a warp per row at least: rows never share a warp's shuffles
}

template <typename T>
int max_vec_for() { return 16 / (int)sizeof(T); }

void check_row_major(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "bertaccel: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.is_contiguous(), "bertaccel: ", name, " must be contiguous");
}

// -------------------------------------------------------------------------------- dispatch
template <typename T>
void launch_fwd(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& residual, const at::Tensor& gamma,
                const at::Tensor& beta, at::Tensor& y, at::Tensor& z, at::Tensor& mean, at::Tensor& rstd, double eps,
                double p, at::Tensor& rng) {
  const int64_t H = x.size(-1), rows = x.numel() / H;
  if (rows == 0) return;
  int vec = pick_vec((int)H, max_vec_for<T>(), {&x, &bias, &residual, &y, &z});
  int tpr = pick_tpr((int)(H / vec), kElemsPerThread / vec);
  TORCH_CHECK(tpr <= kThreads, "bertaccel layer_norm: hidden size ", H, " is above ", kThreads * kElemsPerThread);
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
#define BA_LN_FWD(V, I)                                                                                          \
  ln_fwd_kernel<T, V, I><<<grid, kThreads, 0, stream>>>(                                                         \
      (const T*)x.data_ptr(), bp, rp, gamma.data_ptr<float>(), beta.data_ptr<float>(), (T*)y.data_ptr(), zp,     \
      mean.data_ptr<float>(), rstd.data_ptr<float>(), rows, (int)H, tpr, (float)eps, (float)p, philox,          \
      rng.data_ptr<int64_t>())
  if (vec == 8) { if constexpr (sizeof(T) == 2) BA_LN_FWD(8, 4); }
  else if (vec == 4) BA_LN_FWD(4, 8);
  else if (vec == 2) BA_LN_FWD(2, 16);
  else BA_LN_FWD(1, 32);
#undef BA_LN_FWD
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_bwd(const at::Tensor& dy, const at::Tensor& z, const at::Tensor& gamma, const at::Tensor& mean,
                const at::Tensor& rstd, at::Tensor& dz, at::Tensor& dh, at::Tensor& dgamma, at::Tensor& dbeta,
                at::Tensor& dbias, double p, const at::Tensor& rng) {
  const int64_t H = z.size(-1), rows = z.numel() / H;
  if (rows == 0) {
    dgamma.zero_();
    dbeta.zero_();
    if (dbias.defined()) dbias.zero_();
    return;
  }
  int vec = pick_vec((int)H, max_vec_for<T>(), {&dy, &z, &dz, &dh});
  int tpr = pick_tpr((int)(H / vec), kElemsPerThread / vec);
  TORCH_CHECK(tpr <= kThreads, "bertaccel layer_norm: hidden size ", H, " is above ", kThreads * kElemsPerThread);
  const int rpb = kThreads / tpr;
  const int64_t groups = (rows + rpb - 1) / rpb;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int blocks = (int)std::min<int64_t>(groups, 2 * (int64_t)sms);
  auto opts = z.options().dtype(at::kFloat);
  at::Tensor pg = at::empty({blocks, H}, opts), pb = at::empty({blocks, H}, opts);
  at::Tensor ph = dbias.defined() ? at::empty({blocks, H}, opts) : at::Tensor();
  auto stream = at::cuda::getCurrentCUDAStream();
  T* dhp = dh.defined() ? (T*)dh.data_ptr() : nullptr;
  float* php = ph.defined() ? ph.data_ptr<float>() : nullptr;
  const int64_t* rngp = p > 0 ? rng.data_ptr<int64_t>() : nullptr;
#define BA_LN_BWD(V, I)                                                                                        \
  ln_bwd_kernel<T, V, I><<<blocks, kThreads, 0, stream>>>(                                                     \
      (const T*)dy.data_ptr(), (const T*)z.data_ptr(), gamma.data_ptr<float>(), mean.data_ptr<float>(),        \
      rstd.data_ptr<float>(), (T*)dz.data_ptr(), dhp, pg.data_ptr<float>(), pb.data_ptr<float>(), php, rows,   \
      (int)H, tpr, (float)p, rngp)
  if (vec == 8) { if constexpr (sizeof(T) == 2) BA_LN_BWD(8, 4); }
  else if (vec == 4) BA_LN_BWD(4, 8);
  else if (vec == 2) BA_LN_BWD(2, 16);
  else BA_LN_BWD(1, 32);
#undef BA_LN_BWD
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  dim3 cgrid((unsigned)((H + 31) / 32)), cblock(32, 8);
  column_sum_kernel<<<cgrid, cblock, 0, stream>>>(pg.data_ptr<float>(), blocks, (int)H, dgamma.data_ptr<float>());
  column_sum_kernel<<<cgrid, cblock, 0, stream>>>(pb.data_ptr<float>(), blocks, (int)H, dbeta.data_ptr<float>());
  if (dbias.defined())
    column_sum_kernel<<<cgrid, cblock, 0, stream>>>(ph.data_ptr<float>(), blocks, (int)H, dbias.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void check_inputs(const at::Tensor& x, const at::Tensor& gamma, const at::Tensor& beta) {
  check_row_major(x, "input");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "bertaccel layer_norm: input must be bfloat16 or float32, got ", x.scalar_type());
  TORCH_CHECK(gamma.scalar_type() == at::kFloat && beta.scalar_type() == at::kFloat,
              "bertaccel layer_norm: weight and bias must be float32");
  TORCH_CHECK(gamma.numel() == x.size(-1) && beta.numel() == x.size(-1), "bertaccel layer_norm: weight/bias size mismatch");
  check_row_major(gamma, "weight");
  check_row_major(beta, "bias");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_fwd(
    const at::Tensor& x, const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual,
    const at::Tensor& gamma, const at::Tensor& beta, double p, double eps) {
  check_inputs(x, gamma, beta);
  const bool fused = bias.has_value() || residual.has_value() || p > 0;
  if (bias) {
    check_row_major(*bias, "bias");
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->numel() == x.size(-1), "bertaccel: bias must match input");
  }
  if (residual) {
    check_row_major(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "bertaccel: residual must match input in shape and dtype");
  }
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t H = x.size(-1), rows = x.numel() / std::max<int64_t>(H, 1);
  at::Tensor y = at::empty_like(x);
  at::Tensor z = fused ? at::empty_like(x) : at::Tensor();
  auto fopts = x.options().dtype(at::kFloat);
  at::Tensor mean = at::empty({rows}, fopts), rstd = at::empty({rows}, fopts);
  at::Tensor rng = at::zeros({2}, x.options().dtype(at::kLong));
  at::Tensor b = bias ? *bias : at::Tensor(), r = residual ? *residual : at::Tensor();
  if (x.scalar_type() == at::kBFloat16)
    launch_fwd<__nv_bfloat16>(x, b, r, gamma, beta, y, z, mean, rstd, eps, p, rng);
  else
    launch_fwd<float>(x, b, r, gamma, beta, y, z, mean, rstd, eps, p, rng);
  if (!fused) z = at::empty({0}, x.options());
  return {y, z, mean, rstd, rng};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_bwd(
    const at::Tensor& dy_in, const at::Tensor& z, const at::Tensor& gamma, const at::Tensor& mean,
    const at::Tensor& rstd, const at::Tensor& rng, double p, bool want_dh) {
  at::Tensor dy = dy_in.contiguous();
  check_row_major(z, "saved input");
  TORCH_CHECK(dy.sizes() == z.sizes() && dy.scalar_type() == z.scalar_type(), "bertaccel: grad must match the input");
  c10::cuda::CUDAGuard guard(z.device());
  const int64_t H = z.size(-1);
  at::Tensor dz = at::empty_like(z);
  at::Tensor dh = want_dh ? at::empty_like(z) : at::Tensor();
  auto fopts = z.options().dtype(at::kFloat);
  at::Tensor dgamma = at::empty({H}, fopts), dbeta = at::empty({H}, fopts);
  at::Tensor dbias = want_dh ? at::empty({H}, fopts) : at::Tensor();
  if (z.scalar_type() == at::kBFloat16)
    launch_bwd<__nv_bfloat16>(dy, z, gamma, mean, rstd, dz, dh, dgamma, dbeta, dbias, p, rng);
  else
    launch_bwd<float>(dy, z, gamma, mean, rstd, dz, dh, dgamma, dbeta, dbias, p, rng);
  if (!want_dh) {
    dh = at::empty({0}, z.options());
    dbias = at::empty({0}, fopts);
  }
  return {dz, dh, dgamma, dbeta, dbias};
}

}  // namespace
}  // namespace bertaccel

TORCH_LIBRARY_IMPL(bertaccel, CUDA, m) {
  m.impl("layer_norm_fwd", &bertaccel::fused_fwd);
  m.impl("layer_norm_bwd", &bertaccel::fused_bwd);
}
