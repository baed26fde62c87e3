// Fused bias + GELU (erf form, as HF's "gelu" - bf16 through a branch-free erf within 1.5e-7 - or the
// tanh approximation), forward and backward.
//
// Forward: a flat elementwise kernel, 256 threads, each with 1 or 2 (up to 4) independent 16-byte loads in flight.
// Backward: grid (ceil(cols / VEC / 128), row chunks), 128 threads. Thread t of block (bx, by) owns
// the column vector bx * 128 + t and walks the rows of chunk by, 4 rows at a time, so a warp
// touches 32 consecutive 16-byte vectors of one row (coalesced) and the bias vector is loaded once;
// it keeps its column's dbias partial in registers across the chunk and writes one partial row per
// chunk; `column_sums_kernel` adds them (no atomics). Bytes: forward reads x, writes y; backward reads dy
// and x, writes dx. FLOPs: ~20 per element (erf or tanh dominate).
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "common.cuh"
#include "erf_fast.cuh"

namespace bertaccel {
namespace {

constexpr int kThreads = 128;     // backward block: 128 column vectors
constexpr int kFwdThreads = 256;  // forward block
constexpr int kUnroll = 4;        // rows in flight per thread (backward; the forward's vectors: fwd_unroll)
constexpr float kInvSqrt2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;
constexpr float kSqrt2OverPi = 0.79788456080286535588f;


// FAST: erf_fast (bf16 launches, unless BERTACCEL_GELU_ERF=libm), else erff. A template parameter,
// not a runtime choice: a select between the two let the compiler evaluate both.
template <bool FAST>
__device__ __forceinline__ float erf_of(float x) { return FAST ? erf_fast(x) : erff(x); }

template <bool FAST>
__device__ __forceinline__ float gelu(float x, bool tanh_form) {
  if (tanh_form) {
    float u = kSqrt2OverPi * (x + 0.044715f * x * x * x);
    return 0.5f * x * (1.f + tanhf(u));
  }
  return 0.5f * x * (1.f + erf_of<FAST>(x * kInvSqrt2));
}

template <bool FAST>
__device__ __forceinline__ float gelu_grad(float x, bool tanh_form) {
  if (tanh_form) {
    float u = kSqrt2OverPi * (x + 0.044715f * x * x * x);
    float t = tanhf(u);
    return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * kSqrt2OverPi * (1.f + 3.f * 0.044715f * x * x);
  }
  return 0.5f * (1.f + erf_of<FAST>(x * kInvSqrt2)) + x * kInvSqrt2Pi * __expf(-0.5f * x * x);
}

// The fast erf for bf16 launches unless BERTACCEL_GELU_ERF=libm (comparing both in one run).
inline bool gelu_fast_erf(bool bf16) {
  static const bool libm = env_is("BERTACCEL_GELU_ERF", "libm");
  return bf16 && !libm;
}

// The bias: in the input's dtype, or fp32 (a master bias beside bf16 activations, read as it is: no cast kernel
// before the call, and the backward's fp32 column sums returned without a bf16 rounding). `f32` is one value per
// launch: every thread takes the same branch.
struct BiasView {
  const void* p = nullptr;
  bool f32 = false;
};

// The bias vector of column vector cv, or zeros without a bias.
template <typename T, int VEC>
__device__ __forceinline__ void load_bias(const BiasView bias, int cv, float (&b)[VEC]) {
  if (bias.p != nullptr) {
    if (bias.f32) load_f<float, VEC>(static_cast<const float*>(bias.p) + cv * VEC, b);
    else load_f<T, VEC>(static_cast<const T*>(bias.p) + cv * VEC, b);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) b[j] = 0.f;
  }
}

// Forward: an elementwise kernel over the flat tensor, seen as nvec vectors of VEC elements
// (VEC divides the row, so a vector never straddles rows and its bias vector is (i % cpr)).
// Each thread loads UNROLL vectors, kFwdThreads apart, before it computes any: several
// independent 16-byte loads in flight per thread are what keeps HBM busy (see fwd_unroll).
template <typename T, int VEC, typename Index, int UNROLL, bool FAST>
__global__ void __launch_bounds__(kFwdThreads) bias_gelu_fwd_kernel(const T* __restrict__ x, const BiasView bias,
                                                                    T* __restrict__ y, Index nvec, Index cpr,
                                                                    bool tanh_form) {
  begin_dependent_kernel();
  const Index base = (Index)blockIdx.x * (kFwdThreads * UNROLL) + threadIdx.x;
  // x as loaded (packs), every row load issued before any is converted: converting x as it arrived
  // let ptxas keep 2 loads in flight (SASS, the 32-bit-index bf16 kernel every BERT shape runs).
  Pack<T, VEC> xr[UNROLL];
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const Index i = base + (Index)u * kFwdThreads;
    if (i < nvec) xr[u] = *reinterpret_cast<const Pack<T, VEC>*>(x + i * VEC);
  }
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const Index i = base + (Index)u * kFwdThreads;
    if (i < nvec) {
      float v[VEC], b[VEC];
      load_bias<T, VEC>(bias, (int)(i % cpr), b);
#pragma unroll
      for (int j = 0; j < VEC; ++j) v[j] = gelu<FAST>(to_f(xr[u].v[j]) + b[j], tanh_form);
      store_f<T, VEC>(y + i * VEC, v);
    }
  }
}

// Vectors per forward thread: 1 unless the tensor fills the GPU's resident threads 4 times over,
// then 2. Measured on the H100 (bf16, scripts/elementwise_sweep.py, us at 1 / 2 / 4 vectors):
// 2048x1536 7.5 / 7.9 / 8.3, 2048x3072 12.2 / 13.0 / 14.1, 2048x4096 15.8 / 16.1 / 17.8 (a small
// tensor gives few threads; at 4 each most SMs sat idle behind a few blocks); 16384x1536 42.0 /
// 41.4 / 43.7, 16384x3072 79.3 / 78.0 / 79.2, 16384x4096 104.7 / 102.6 / 103.6 (4 was the default
// before). BERTACCEL_GELU_UNROLL=1|2|4 forces one (scripts/elementwise_sweep.py compares them).
int fwd_unroll(int64_t nvec, const cudaDeviceProp& prop) {
  static const int forced = [] {
    const int u = env_switch("BERTACCEL_GELU_UNROLL", 0);
    return u == 1 || u == 2 || u == 4 ? u : 0;
  }();
  if (forced) return forced;
  const int64_t resident = (int64_t)prop.multiProcessorCount * prop.maxThreadsPerMultiProcessor;
  return nvec >= 4 * resident ? 2 : 1;
}

// Backward: thread t of block (bx, by) owns column vector bx * 128 + t and walks the rows of chunk
// by, kUnroll rows at a time (all loads of a group issued before the math), keeping its dbias
// partial in registers.
template <typename T, int VEC, bool FAST>
__global__ void __launch_bounds__(kThreads) bias_gelu_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                                                 const BiasView bias, T* __restrict__ dx,
                                                                 float* __restrict__ dbias_part, int64_t rows, int cols,
                                                                 int rows_per_chunk, bool tanh_form) {
  begin_dependent_kernel();  // (the column sums may launch now: they wait for this grid)
  const int cv = blockIdx.x * kThreads + threadIdx.x;
  if (cv * VEC >= cols) return;
  float b[VEC], acc[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) acc[j] = 0.f;
  load_bias<T, VEC>(bias, cv, b);
  const int64_t r0 = (int64_t)blockIdx.y * rows_per_chunk;
  const int64_t r1 = min(rows, r0 + rows_per_chunk);
  auto grad = [&](float (&v)[VEC], const float (&d)[VEC]) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      v[j] = to_f(from_f<T>(d[j] * gelu_grad<FAST>(v[j] + b[j], tanh_form)));
      acc[j] += v[j];
    }
  };
  int64_t r = r0;
  for (; r + kUnroll <= r1; r += kUnroll) {
    float v[kUnroll][VEC], d[kUnroll][VEC];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t off = (r + u) * cols + (int64_t)cv * VEC;
      load_f<T, VEC>(x + off, v[u]);
      load_f<T, VEC>(dy + off, d[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      grad(v[u], d[u]);
      store_f<T, VEC>(dx + (r + u) * cols + (int64_t)cv * VEC, v[u]);
    }
  }
  for (; r < r1; ++r) {
    const int64_t off = r * cols + (int64_t)cv * VEC;
    float v[VEC], d[VEC];
    load_f<T, VEC>(x + off, v);
    load_f<T, VEC>(dy + off, d);
    grad(v, d);
    store_f<T, VEC>(dx + off, v);
  }
  if (dbias_part != nullptr)
#pragma unroll
    for (int j = 0; j < VEC; ++j) dbias_part[(int64_t)blockIdx.y * cols + cv * VEC + j] = acc[j];
}

// Rows per chunk of the backward: enough chunks to give every SM ~8 blocks, but at least 8 rows a
// chunk (two unrolled groups) so the dbias partials stay a small fraction of the traffic.
int rows_per_chunk(int64_t rows, int col_blocks) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  int64_t chunks = std::max<int64_t>(1, (int64_t)sms * 8 / std::max(col_blocks, 1));
  int64_t rpc = (rows + chunks - 1) / chunks;
  return (int)std::max<int64_t>(2 * kUnroll, rpc);
}

void check(const at::Tensor& x, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous(), "bertaccel bias_gelu: input must be a contiguous CUDA tensor");
  BERTACCEL_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
                  "bertaccel bias_gelu: input must be bfloat16 or float32, got %s", c10::toString(x.scalar_type()));
  if (bias) {
    BERTACCEL_CHECK(bias->is_contiguous() && (bias->scalar_type() == x.scalar_type() || bias->scalar_type() == at::kFloat) &&
                        bias->numel() == x.size(-1),
                    "bertaccel bias_gelu: bias must be contiguous, float32 or of the input's dtype, and of size %lld",
                    (long long)x.size(-1));
    BERTACCEL_CHECK(bias->device() == x.device(), "bertaccel bias_gelu: bias is on %s, input on %s",
                    bias->device().str().c_str(), x.device().str().c_str());
  }
}

at::Tensor bias_gelu_fwd(const at::Tensor& x, const std::optional<at::Tensor>& bias, bool tanh_form) {
  check(x, bias);
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty_like(x);
  const int64_t cols = x.size(-1), rows = x.numel() / std::max<int64_t>(cols, 1);
  if (rows == 0) return y;
  at::Tensor b = bias ? *bias : at::Tensor();
  auto stream = at::cuda::getCurrentCUDAStream();
  auto run = [&](auto type_tag) {
    using T = decltype(type_tag);
    constexpr bool kBf16 = sizeof(T) == 2;  // the fast-erf kernels exist for bf16 only
    int vec = pick_vec((int)cols, 16 / sizeof(T), {&x, &b, &y});
    const int64_t nvec = rows * cols / vec, cpr = cols / vec;
    const int unroll = fwd_unroll(nvec, *at::cuda::getCurrentDeviceProperties());
    const BiasView bp{b.defined() ? b.data_ptr() : nullptr, b.defined() && b.scalar_type() == at::kFloat};
    const bool fast = gelu_fast_erf(sizeof(T) == 2);
    // 32-bit indices (cheaper i % cpr) when every element offset i * VEC fits, not just the vector count
    const bool narrow = rows * cols < (int64_t{1} << 31);
#define BA_GELU_FWD_K(V, U, I, FAST)                                                                           \
  launch_dependent(bias_gelu_fwd_kernel<T, V, I, U, FAST>, grid, dim3(kFwdThreads), 0, stream,                 \
                   (const T*)x.data_ptr(), bp, (T*)y.data_ptr(), (I)nvec, (I)cpr, tanh_form)
#define BA_GELU_FWD_U(V, U)                                                                                    \
  do {                                                                                                         \
    const dim3 grid((unsigned)((nvec + kFwdThreads * U - 1) / (kFwdThreads * U)));                             \
    if (narrow && fast) BA_GELU_FWD_K(V, U, uint32_t, kBf16);                                                  \
    else if (narrow) BA_GELU_FWD_K(V, U, uint32_t, false);                                                     \
    else if (fast) BA_GELU_FWD_K(V, U, int64_t, kBf16);                                                        \
    else BA_GELU_FWD_K(V, U, int64_t, false);                                                                  \
  } while (0)
#define BA_GELU_FWD(V)                                                                                         \
  if (unroll == 4) BA_GELU_FWD_U(V, 4);                                                                        \
  else if (unroll == 2) BA_GELU_FWD_U(V, 2);                                                                   \
  else BA_GELU_FWD_U(V, 1)
    if (vec == 8) { if constexpr (sizeof(T) == 2) { BA_GELU_FWD(8); } }
    else if (vec == 4) { BA_GELU_FWD(4); }
    else if (vec == 2) { BA_GELU_FWD(2); }
    else { BA_GELU_FWD(1); }
#undef BA_GELU_FWD
#undef BA_GELU_FWD_U
#undef BA_GELU_FWD_K
  };
  if (x.scalar_type() == at::kBFloat16) run(__nv_bfloat16{});
  else run(float{});
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

std::tuple<at::Tensor, at::Tensor> bias_gelu_bwd(const at::Tensor& dy_in, const at::Tensor& x,
                                                 const std::optional<at::Tensor>& bias, bool tanh_form) {
  check(x, bias);
  at::Tensor dy = dy_in.contiguous();
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type(), "bertaccel bias_gelu: grad must match input");
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor dx = at::empty_like(x);
  const int64_t cols = x.size(-1), rows = x.numel() / std::max<int64_t>(cols, 1);
  at::Tensor dbias = at::empty({bias ? cols : 0}, x.options().dtype(at::kFloat));
  if (rows == 0) {
    dbias.zero_();
    return {dx, dbias};
  }
  at::Tensor b = bias ? *bias : at::Tensor();
  auto stream = at::cuda::getCurrentCUDAStream();
  auto run = [&](auto type_tag) {
    using T = decltype(type_tag);
    constexpr bool kBf16 = sizeof(T) == 2;  // the fast-erf kernels exist for bf16 only
    int vec = pick_vec((int)cols, 16 / sizeof(T), {&x, &b, &dy, &dx});
    int col_blocks = (int)((cols / vec + kThreads - 1) / kThreads);
    int rpc = rows_per_chunk(rows, col_blocks);
    int chunks = (int)((rows + rpc - 1) / rpc);
    dim3 grid(col_blocks, chunks);
    at::Tensor part = bias ? at::empty({chunks, cols}, x.options().dtype(at::kFloat)) : at::Tensor();
    const BiasView bp{b.defined() ? b.data_ptr() : nullptr, b.defined() && b.scalar_type() == at::kFloat};
    float* pp = part.defined() ? part.data_ptr<float>() : nullptr;
    const bool fast = gelu_fast_erf(sizeof(T) == 2);
#define BA_GELU_BWD(V)                                                                                     \
  do {                                                                                                     \
    if (fast)                                                                                              \
      launch_dependent(bias_gelu_bwd_kernel<T, V, kBf16>, grid, dim3(kThreads), 0, stream, (const T*)dy.data_ptr(), \
                       (const T*)x.data_ptr(), bp, (T*)dx.data_ptr(), pp, rows, (int)cols, rpc, tanh_form);   \
    else                                                                                                   \
      launch_dependent(bias_gelu_bwd_kernel<T, V, false>, grid, dim3(kThreads), 0, stream, (const T*)dy.data_ptr(), \
                       (const T*)x.data_ptr(), bp, (T*)dx.data_ptr(), pp, rows, (int)cols, rpc, tanh_form);   \
  } while (0)
    if (vec == 8) { if constexpr (sizeof(T) == 2) BA_GELU_BWD(8); }
    else if (vec == 4) BA_GELU_BWD(4);
    else if (vec == 2) BA_GELU_BWD(2);
    else BA_GELU_BWD(1);
#undef BA_GELU_BWD
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (bias) {
      launch_column_sums({{&part, &dbias}}, (int)chunks, (int)cols, stream);
    }
  };
  if (x.scalar_type() == at::kBFloat16) run(__nv_bfloat16{});
  else run(float{});
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {dx, dbias};
}

}  // namespace
}  // namespace bertaccel

TORCH_LIBRARY_IMPL(bertaccel, CUDA, m) {
  m.impl("bias_gelu", &bertaccel::bias_gelu_fwd);
  m.impl("bias_gelu_bwd", &bertaccel::bias_gelu_bwd);
}
