// Softmax over the last dimension with a scale and a mask, as attention scores need it:
//   y = softmax(x * scale + mask)         mask additive (float32), or boolean (true = attend),
//                                         broadcast over [batch, heads, query, key] through strides
//   dx = scale * y * (dy - sum(dy * y))   (backward; the mask gets no gradient)
// A row whose keys are all masked out gives zeros (PyTorch gives NaN).
//
// Launch: like the LayerNorm kernels, `tpr` threads per row (a power of two; 16 for a 128-key bf16
// row, so two rows share a warp and reduce with width-16 shuffles; up to 256 for 8192 keys), each
// holding ITEMS 16-byte vectors in registers: one read and one write of the scores, max and sum by
// shuffles (block reduction through shared memory when a row spans several warps). The mask is read
// through L1/L2 (a key-padding mask is one row per sequence) in its own dtype (float32, bfloat16 or
// float16: a 16-bit mask, as a bf16 model builds it, is not converted by a kernel of its own first): an
// additive mask 4 keys per load (16 bytes, or 8 for a 16-bit mask) where its rows are aligned for it
// (they are for HF's [batch, 1, 1, key] masks, key % 4 == 0), else one key per load, as the boolean
// mask always is. Bytes: forward 2 x sizeof(T) per element, backward 3 x.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "common.cuh"
#include "erf_fast.cuh"  // ex2_approx_ftz

namespace bertaccel {
namespace {

constexpr int kThreads = 256;

enum class AddKind : int { kFloat, kBFloat16, kHalf };

struct MaskView {
  const void* add = nullptr;   // additive mask (its dtype: add_kind), or
  const bool* keep = nullptr;  // boolean mask (true = attend)
  int64_t sb = 0, sh = 0, sq = 0;  // element strides of batch, head, query (0: broadcast)
  int heads = 1, q_len = 1;
  AddKind add_kind = AddKind::kFloat;
  bool add_vec4 = false;  // the additive mask aligned for 4 keys per load at every row start

  // key i of the additive mask (add != nullptr); add_kind is the same for every thread: no divergence
  __device__ __forceinline__ float add_at(int64_t i) const {
    if (add_kind == AddKind::kFloat) return static_cast<const float*>(add)[i];
    const unsigned short h = static_cast<const unsigned short*>(add)[i];
    return add_kind == AddKind::kBFloat16 ? __uint_as_float((unsigned)h << 16)
                                          : __half2float(__ushort_as_half(h));
  }
  // four bf16 keys read as two 32-bit words, widened (exact: the words shifted up or their low halves cleared)
  __device__ __forceinline__ static float4 bf16x4(uint2 w) {
    return make_float4(__uint_as_float(w.x << 16), __uint_as_float(w.x & 0xFFFF0000u), __uint_as_float(w.y << 16),
                       __uint_as_float(w.y & 0xFFFF0000u));
  }
  // keys i .. i + 3 (add_vec4: i % 4 == 0 and the row start aligned)
  __device__ __forceinline__ float4 add4_at(int64_t i) const {
    if (add_kind == AddKind::kFloat) return *reinterpret_cast<const float4*>(static_cast<const float*>(add) + i);
    const uint2 w = *reinterpret_cast<const uint2*>(static_cast<const unsigned short*>(add) + i);
    if (add_kind == AddKind::kBFloat16) return bf16x4(w);
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&w.x));
    const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&w.y));
    return make_float4(a.x, a.y, b.x, b.y);
  }

  // The mask offsets of rows first, first + stride, ... without a division per row (the ring's warps walk their
  // rows so): the (batch, head, query) of `first` once, then advanced by those of `stride` with carries.
  // The stride's (batch, head, query) steps are the same for every warp: set by the launch (set_walk_stride), so
  // that they are kernel parameters rather than registers.
  int walk_dq = 0, walk_dh = 0;
  int64_t walk_db = 0;
  void set_walk_stride(int64_t stride) {
    const int64_t dbh = stride / q_len;
    walk_dq = (int)(stride % q_len);
    walk_dh = (int)(dbh % heads);
    walk_db = dbh / heads;
  }
  struct Walk {
    int q, h;
    int64_t b;
  };
  __device__ __forceinline__ Walk walk(int64_t first) const {
    const int64_t bh = first / q_len;
    return Walk{(int)(first % q_len), (int)(bh % heads), bh / heads};
  }
  __device__ __forceinline__ int64_t offset(const Walk& w) const { return w.b * sb + w.h * sh + w.q * sq; }
  __device__ __forceinline__ void advance(Walk& w) const {
    w.q += walk_dq;
    const int cq = w.q >= q_len;
    w.q -= cq ? q_len : 0;
    w.h += walk_dh + cq;
    const int ch = w.h >= heads;
    w.h -= ch ? heads : 0;
    w.b += walk_db + ch;
  }

  __device__ __forceinline__ int64_t row_offset(int64_t row) const {
    if (row <= 0xFFFFFFFFll) {  // 32-bit divisions where the row index fits (a 64-bit one is a ~70-instruction call)
      const unsigned r = (unsigned)row, q = r % (unsigned)q_len, bh = r / (unsigned)q_len;
      return (int64_t)(bh / (unsigned)heads) * sb + (int64_t)(bh % (unsigned)heads) * sh + (int64_t)q * sq;
    }
    const int64_t q = row % q_len, bh = row / q_len;
    return (bh / heads) * sb + (bh % heads) * sh + q * sq;
  }
};

// v = v * scale + mask for the VEC keys of vector c of a row whose mask starts at moff, and mx = the max
// of mx and them: the additive mask 4 keys per 16-byte load where aligned (add_vec4), else one key per
// load; a boolean mask's dropped keys become -inf. Shared by both forwards. Offline ptxas: the max
// folded into the scalar loop (computed after it, the <bf16, 2, 16> kernel spilled 12 bytes) and the mask
// taken by value (by reference, the <bf16, 8, 3> kernel spilled 8) keep the one-row kernel's registers.
template <int VEC>
__device__ __forceinline__ void scale_and_mask(float (&v)[VEC], const MaskView mask, int64_t moff, int c, float scale,
                                               float& mx) {
  bool vec_mask = false;  // the additive mask of these VEC keys in 16-byte loads, when aligned
  if constexpr (VEC % 4 == 0) {
    // add_vec4 implies add != nullptr; without the redundant test the <bf16, 8, 3> kernel spills 8 bytes
    if (mask.add != nullptr && mask.add_vec4) {
      vec_mask = true;
#pragma unroll
      for (int j = 0; j < VEC; j += 4) {
        const float4 m4 = mask.add4_at(moff + c * VEC + j);
        v[j] = v[j] * scale + m4.x;
        v[j + 1] = v[j + 1] * scale + m4.y;
        v[j + 2] = v[j + 2] * scale + m4.z;
        v[j + 3] = v[j + 3] * scale + m4.w;
      }
#pragma unroll
      for (int j = 0; j < VEC; ++j) mx = fmaxf(mx, v[j]);
    }
  }
  if (!vec_mask) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const int64_t mi = moff + c * VEC + j;
      float s = v[j] * scale;
      if (mask.add != nullptr) s += mask.add_at(mi);
      else if (mask.keep != nullptr && !mask.keep[mi]) s = -INFINITY;
      v[j] = s;
      mx = fmaxf(mx, s);
    }
  }
}

// exp(v - base) for a row whose max is base, on the MUFU's exp2 with denormal results flushed (__expf wraps the same
// MUFU in a range fix-up: FSETP and two predicated FMULs per value, 6 instructions against 2-3 here; a probability
// under 2^-126 becomes 0). For 16-bit outputs one FFMA, v * log2(e) - base * log2(e) (its rounding, |base| x 2^-24
// relative, is far inside bf16's 2^-9); float32 outputs subtract first, as __expf's argument was, then scale.
constexpr float kLog2e = 1.4426950408889634f;
template <typename T>
__device__ __forceinline__ float exp_from_max(float v, float base, float base_log2e) {
  if constexpr (sizeof(T) == 2) return ex2_approx_ftz(fmaf(v, kLog2e, -base_log2e));
  else return ex2_approx_ftz((v - base) * kLog2e);
}

template <typename T, int VEC, int ITEMS>
__global__ void __launch_bounds__(kThreads) softmax_fwd_kernel(const T* __restrict__ x, T* __restrict__ y,
                                                               MaskView mask, int64_t rows, int S, int tpr, float scale) {
  __shared__ float red[kThreads / 32];
  begin_dependent_kernel();
  const int nvec = S / VEC;
  const int local_row = threadIdx.x / tpr;
  const int t = threadIdx.x % tpr;
  const int64_t row = (int64_t)blockIdx.x * (kThreads / tpr) + local_row;
  const bool active = row < rows;
  const int64_t moff = active ? mask.row_offset(row) : 0;
  // Loads as they go (SASS: one row load in flight per thread). Issuing the row's ITEMS 16-byte loads
  // first (commit 4154a19) was measured slower on the H100 and reverted: 32x12x512x512 bf16 167.4 ->
  // 180.4 us, 8x12x1024x1024 168.8 -> 176.8 us (benchmarks/bench_ops.py, same machine kind).
  float v[ITEMS][VEC];
  float mx = -INFINITY;
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    const int c = t + k * tpr;
    if (active && c < nvec) {
      load_f<T, VEC>(x + row * S + (int64_t)c * VEC, v[k]);
      scale_and_mask<VEC>(v[k], mask, moff, c, scale, mx);
    }
  }
  mx = row_reduce(mx, tpr, red, local_row, MaxOp());
  const float base = mx == -INFINITY ? 0.f : mx;  // all keys masked: exp(-inf) = 0 everywhere
  const float base_log2e = base * kLog2e;
  float sum = 0.f;
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    const int c = t + k * tpr;
    if (active && c < nvec)
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        v[k][j] = exp_from_max<T>(v[k][j], base, base_log2e);
        sum += v[k][j];
      }
  }
  sum = row_reduce(sum, tpr, red, local_row, SumOp());
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  if (!active) return;
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    const int c = t + k * tpr;
    if (c < nvec) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) v[k][j] *= inv;
      store_f<T, VEC>(y + row * S + (int64_t)c * VEC, v[k]);
    }
  }
}

// The forward of rows one warp holds (512-1024 bf16 keys, 256-1024 fp32; 16-byte aligned, S a multiple of
// VEC), as the LayerNorm forward's row ring (layer_norm_fwd.cu): a persistent grid, each warp owns a row
// at a time and walks every W-th row (W warps in the grid); its next rows stream into shared memory
// through a ring of cp.async stages issued S_RING rows ahead, so several rows per warp are in flight
// without holding them in registers. Each lane reads back only the 16-byte slots it copied: no barrier.
// The mask is read as in the kernel above (consecutive rows of a warp's block share a mask row: L1 hits).
constexpr int kRingWarps = kThreads / 32;
template <int ITEMS>
constexpr int ring_stage_bytes() { return kRingWarps * ITEMS * kRingItemBytes; }

// Two ring stages (two rows in flight per warp), as the LayerNorm family's forward ring (layer_norm_fwd.cu,
// kFwdRingStages). Up to four (96 KB a block, the rule before session 75) measured slower on an H200 (no grad, us,
// 4 / 2 stages, two alternated rounds each, h200/softmax_fwd_sweep_stages_rowoff_s75b.log): bf16 64x12x256x256
// 75.4-76.3 / 73.8-73.9, 32x12x512x512 118.3-119.3 / 116.7-116.8, 8x12x1024x1024 117.8-119.0 / 116.2-118.1; float32
// 1024 keys 252.3-261.8 / 227.4-227.5, 256 keys 106.4-106.7 / 102.7-102.8, 512 keys level (217.4-217.9 / 219.4-220.0).
constexpr int kSoftmaxRingStages = 2;

// BF16_MASK: the mask is additive bf16 and aligned for 4 keys a load (add_vec4; HF's mask of a bf16 model), so the
// kernel converts it without testing its kind per load (a runtime kind issues both kinds' conversions, predicated).
// Measured against the generic kernel on an H200 (session 76, no grad, us, two alternated rounds, HF's [b,1,1,k] bf16
// mask, h200/softmax_fwd_sweep_bf16_mask_kernel_s76a.log): 64x12x256x256 57.3-57.5 -> 53.9-54.4 (89% of copy),
// 32x12x512x512 115.6-115.7 -> 114.5, 8x12x1024x1024 112.5-113.5 -> 110.5-112.6. bf16 scores only: beside float32
// scores the specialisation cost registers (70 -> 89 at 1024 keys, offline).
template <typename T, int VEC, int ITEMS, bool BF16_MASK>
__global__ void __launch_bounds__(kThreads, 2) softmax_fwd_ring_kernel(const T* __restrict__ x, T* __restrict__ y,
                                                                       MaskView mask, int64_t rows, int S, float scale) {
  static_assert(VEC * sizeof(T) == 16, "the ring copies 16-byte vectors");
  constexpr int ST = kSoftmaxRingStages;
  constexpr int kStage = ITEMS * kRingItemBytes;  // one warp's row
  extern __shared__ __align__(16) unsigned char ring_smem[];
  begin_dependent_kernel();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  unsigned char* ring = ring_smem + warp * ST * kStage + lane * 16;
  const int nvec = S / VEC;
  const int64_t first = (int64_t)blockIdx.x * kRingWarps + warp, stride = (int64_t)gridDim.x * kRingWarps;
  auto issue = [&](int64_t row, int stage) {  // copy row `row` (if any) into `stage`; one group either way
    if (row < rows) {
#pragma unroll
      for (int k = 0; k < ITEMS; ++k) {
        const int c = lane + k * 32;
        if (c < nvec) cp_async16(ring + stage * kStage + k * kRingItemBytes, x + row * S + (int64_t)c * VEC);
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int st = 0; st < ST; ++st) issue(first + st * stride, st);
  int stage = 0;
  // The mask row of each of the warp's rows: bf16 rows walk it (no division per row: 256-key rows 71.6-71.9 -> 57.7-58.1
  // us, 32x12x512x512 118.7-119.4 -> 116.9-117.4 with the exp2 below, Nsight Compute 86.2M -> 67.4M instructions);
  // float32 rows divide (32-bit) per row: the walk's registers cost them a block per SM (1024 keys: 79 -> 90
  // registers, 3 -> 2 blocks, 228.8-229.9 -> 252.3-259.4 us; 256 keys 104 -> 109).
  constexpr bool kWalk = sizeof(T) == 2;
  MaskView::Walk at{};
  if constexpr (kWalk) at = mask.walk(first);  // the launch set mask.walk_* for this stride
  for (int64_t row = first; row < rows; row += stride) {
    int64_t moff;
    if constexpr (kWalk) {
      moff = mask.offset(at);
      mask.advance(at);
    } else {
      moff = mask.row_offset(row);
    }
    cp_async_wait<ST - 1>();  // this row's group (the oldest pending) has landed
    const unsigned char* src = ring + stage * kStage;
    float v[ITEMS][VEC];
    float mx = -INFINITY;
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int c = lane + k * 32;
      if (c >= nvec) continue;
      load_f<T, VEC>(reinterpret_cast<const T*>(src + k * kRingItemBytes), v[k]);
      if constexpr (BF16_MASK) {
        const unsigned short* m = static_cast<const unsigned short*>(mask.add) + moff + c * VEC;
#pragma unroll
        for (int j = 0; j < VEC; j += 4) {
          const float4 a = MaskView::bf16x4(*reinterpret_cast<const uint2*>(m + j));
          v[k][j] = v[k][j] * scale + a.x;
          v[k][j + 1] = v[k][j + 1] * scale + a.y;
          v[k][j + 2] = v[k][j + 2] * scale + a.z;
          v[k][j + 3] = v[k][j + 3] * scale + a.w;
        }
#pragma unroll
        for (int j = 0; j < VEC; ++j) mx = fmaxf(mx, v[k][j]);
      } else {
        scale_and_mask<VEC>(v[k], mask, moff, c, scale, mx);
      }
    }
    // The stage is free once its values are read (the max depends on all of them): refill it.
    issue(row + ST * stride, stage);
    stage = stage + 1 == ST ? 0 : stage + 1;
    mx = row_reduce(mx, 32, nullptr, 0, MaxOp());
    const float base = mx == -INFINITY ? 0.f : mx;  // all keys masked: exp(-inf) = 0 everywhere
    const float base_log2e = base * kLog2e;
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < ITEMS; ++k)
      if (lane + k * 32 < nvec)
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          v[k][j] = exp_from_max<T>(v[k][j], base, base_log2e);
          sum += v[k][j];
        }
    sum = row_reduce(sum, 32, nullptr, 0, SumOp());
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int c = lane + k * 32;
      if (c < nvec) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[k][j] *= inv;
        store_f<T, VEC>(y + row * S + (int64_t)c * VEC, v[k]);
      }
    }
  }
  cp_async_wait<0>();
}

template <typename T, int VEC, int ITEMS>
__global__ void __launch_bounds__(kThreads) softmax_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ y,
                                                               T* __restrict__ dx, int64_t rows, int S, int tpr, float scale) {
  __shared__ float red[kThreads / 32];
  begin_dependent_kernel();
  const int nvec = S / VEC;
  const int local_row = threadIdx.x / tpr;
  const int t = threadIdx.x % tpr;
  const int64_t row = (int64_t)blockIdx.x * (kThreads / tpr) + local_row;
  const bool active = row < rows;
  // y and dy held as the 16-byte packs they were loaded as, all loads issued before any is used, and
  // converted where read (twice): converting as they arrived kept one vector's two loads in flight
  // (SASS), and the packs take half the registers of fp32 values for bf16.
  Pack<T, VEC> yp[ITEMS], dp[ITEMS];
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    const int c = t + k * tpr;
    if (active && c < nvec) {
      const int64_t off = row * S + (int64_t)c * VEC;
      yp[k] = *reinterpret_cast<const Pack<T, VEC>*>(y + off);
      dp[k] = *reinterpret_cast<const Pack<T, VEC>*>(dy + off);
    }
  }
  float dot = 0.f;
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    const int c = t + k * tpr;
    if (active && c < nvec) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) dot += to_f(yp[k].v[j]) * to_f(dp[k].v[j]);
    }
  }
  dot = row_reduce(dot, tpr, red, local_row, SumOp());
  if (!active) return;
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    const int c = t + k * tpr;
    if (c < nvec) {
      float o[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) o[j] = scale * to_f(yp[k].v[j]) * (to_f(dp[k].v[j]) - dot);
      store_f<T, VEC>(dx + row * S + (int64_t)c * VEC, o);
    }
  }
}

struct RowLaunch {
  int vec, items, tpr;
  dim3 grid;
};

template <typename T>
RowLaunch plan(int64_t S, int64_t rows, std::initializer_list<const at::Tensor*> ts) {
  constexpr int max_vec = 16 / sizeof(T);
  RowLaunch l;
  l.vec = pick_vec(S, max_vec, ts);
  l.items = pick_items((int)(S / l.vec), l.vec, max_vec);
  l.tpr = pick_tpr((int)(S / l.vec), l.items);
  BERTACCEL_CHECK(l.tpr <= kThreads, "bertaccel softmax: rows of %lld are above %d", (long long)S,
                  (int)(kThreads * kMaxElemsPerThread));
  const int rpb = kThreads / l.tpr;
  l.grid = dim3((unsigned)((rows + rpb - 1) / rpb));
  return l;
}

void check_scores(const at::Tensor& x, const char* name) {
  check_cuda_contiguous(x, name);
  BERTACCEL_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
                  "bertaccel softmax: %s must be bfloat16 or float32, got %s", name, c10::toString(x.scalar_type()));
}

at::Tensor softmax_fwd(const at::Tensor& x, const std::optional<at::Tensor>& mask_in, double scale) {
  check_scores(x, "input");
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty_like(x);
  const int64_t S = x.dim() ? x.size(-1) : 1;
  if (x.numel() == 0 || S == 0) return y;
  const int64_t rows = x.numel() / S;
  MaskView mv;
  at::Tensor mask;  // keeps a converted mask alive during the launch
  if (mask_in) {
    BERTACCEL_CHECK(x.dim() == 4, "bertaccel softmax: a mask needs 4-d scores [batch, heads, query, key], got %d-d",
                    (int)x.dim());
    mask = *mask_in;
    BERTACCEL_CHECK(mask.is_cuda() && mask.dim() == 4, "bertaccel softmax: the mask must be a 4-d CUDA tensor broadcastable to %s",
                    shape_str(x.sizes()).c_str());
    BERTACCEL_CHECK(mask.device() == x.device(), "bertaccel softmax: mask is on %s, scores on %s",
                    mask.device().str().c_str(), x.device().str().c_str());
    const auto mt = mask.scalar_type();
    if (mt != at::kBool && mt != at::kFloat && mt != at::kBFloat16 && mt != at::kHalf) mask = mask.to(at::kFloat);
    mask = mask.expand(x.sizes());
    if (mask.stride(3) != 1) mask = mask.contiguous();
    mv.sb = mask.size(0) > 1 ? mask.stride(0) : 0;
    mv.sh = mask.size(1) > 1 ? mask.stride(1) : 0;
    mv.sq = mask.size(2) > 1 ? mask.stride(2) : 0;
    mv.heads = (int)x.size(1);
    mv.q_len = (int)x.size(2);
    if (mask.scalar_type() == at::kBool) {
      mv.keep = mask.data_ptr<bool>();
    } else {
      mv.add = mask.data_ptr();
      mv.add_kind = mask.scalar_type() == at::kFloat      ? AddKind::kFloat
                    : mask.scalar_type() == at::kBFloat16 ? AddKind::kBFloat16
                                                          : AddKind::kHalf;
      mv.add_vec4 = reinterpret_cast<uintptr_t>(mv.add) % (4 * mask.element_size()) == 0 && mv.sb % 4 == 0 &&
                    mv.sh % 4 == 0 && mv.sq % 4 == 0;
    }
  }
  auto stream = at::cuda::getCurrentCUDAStream();
  auto run = [&](auto type_tag) {
    using T = decltype(type_tag);
    RowLaunch l = plan<T>(S, rows, {&x, &y});
    constexpr int max_vec = 16 / sizeof(T);
    // The ring (a persistent grid) for rows a whole warp holds with 16-byte vectors; BERTACCEL_LN_RING=0
    // (the LayerNorms' switch) keeps the kernel above.
    if (l.vec == max_vec && l.tpr == 32 && ring_enabled()) {
      const int device = x.get_device();
      const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
#define BA_SOFTMAX_RING(V, I)                                                                            \
  do {                                                                                                   \
    if constexpr (V == max_vec) {                                                                        \
      bool bf16_mask = false; /* bf16 scores only: beside float32 scores it cost registers */            \
      auto kernel = softmax_fwd_ring_kernel<T, V, I, false>;                                             \
      if constexpr (sizeof(T) == 2) {                                                                    \
        bf16_mask = mv.add != nullptr && mv.add_vec4 && mv.add_kind == AddKind::kBFloat16;               \
        if (bf16_mask) kernel = softmax_fwd_ring_kernel<T, V, I, true>;                                  \
      }                                                                                                  \
      constexpr int smem = kSoftmaxRingStages * ring_stage_bytes<I>();                                \
      static int per_sm[2][64] = {};                                                                     \
      const int64_t fit = (int64_t)sms * ring_blocks_per_sm(kernel, kThreads, smem, device, per_sm[bf16_mask]); \
      const int64_t blocks = ring_grid_blocks(rows, kRingWarps, fit, false); /* fill: balanced lost */    \
      MaskView walked = mv;                                                                              \
      walked.set_walk_stride(blocks * kRingWarps);                                                       \
      launch_dependent(kernel, dim3((unsigned)blocks), dim3(kThreads), smem, stream, (const T*)x.data_ptr(), \
                       (T*)y.data_ptr(), walked, rows, (int)S, (float)scale);                            \
    }                                                                                                    \
  } while (0)
      BA_DISPATCH_VEC_ITEMS(sizeof(T), l.vec, l.items, BA_SOFTMAX_RING);
#undef BA_SOFTMAX_RING
      return;
    }
#define BA_SOFTMAX_FWD(V, I)                                                                             \
  launch_dependent(softmax_fwd_kernel<T, V, I>, l.grid, dim3(kThreads), 0, stream, (const T*)x.data_ptr(),      \
                   (T*)y.data_ptr(), mv, rows, (int)S, l.tpr, (float)scale)
    BA_DISPATCH_VEC_ITEMS(sizeof(T), l.vec, l.items, BA_SOFTMAX_FWD);
#undef BA_SOFTMAX_FWD
  };
  if (x.scalar_type() == at::kBFloat16) run(__nv_bfloat16{});
  else run(float{});
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

at::Tensor softmax_bwd(const at::Tensor& dy_in, const at::Tensor& y, double scale) {
  check_scores(y, "saved output");
  at::Tensor dy = dy_in.contiguous();
  TORCH_CHECK(dy.sizes() == y.sizes() && dy.scalar_type() == y.scalar_type(), "bertaccel softmax: grad must match the output");
  c10::cuda::CUDAGuard guard(y.device());
  at::Tensor dx = at::empty_like(y);
  const int64_t S = y.dim() ? y.size(-1) : 1;
  if (y.numel() == 0 || S == 0) return dx;
  const int64_t rows = y.numel() / S;
  auto stream = at::cuda::getCurrentCUDAStream();
  auto run = [&](auto type_tag) {
    using T = decltype(type_tag);
    RowLaunch l = plan<T>(S, rows, {&y, &dy, &dx});
#define BA_SOFTMAX_BWD(V, I)                                                                              \
  launch_dependent(softmax_bwd_kernel<T, V, I>, l.grid, dim3(kThreads), 0, stream, (const T*)dy.data_ptr(),      \
                   (const T*)y.data_ptr(), (T*)dx.data_ptr(), rows, (int)S, l.tpr, (float)scale)
    BA_DISPATCH_VEC_ITEMS(sizeof(T), l.vec, l.items, BA_SOFTMAX_BWD);
#undef BA_SOFTMAX_BWD
  };
  if (y.scalar_type() == at::kBFloat16) run(__nv_bfloat16{});
  else run(float{});
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return dx;
}

}  // namespace
}  // namespace bertaccel

TORCH_LIBRARY_IMPL(bertaccel, CUDA, m) {
  m.impl("softmax", &bertaccel::softmax_fwd);
  m.impl("softmax_bwd", &bertaccel::softmax_bwd);
}
