// Backward of LayerNorm, RMSNorm, the fused residual LayerNorm (layer_norm_fwd.cu) and the fused
// embeddings (embeddings.cu: dropout *after* the LayerNorm, so the incoming gradient is masked).
// One kernel template, instantiated per form (Mode) in its op's file, so each form carries only
// the accumulators it needs: layer_norm_bwd.cu (plain and fused LayerNorm), rms_norm_bwd.cu,
// embeddings_bwd.cu.
//
// Launch: as many blocks as fit on the GPU at once (occupancy query), each looping over groups of
// rows. A thread owns the same columns in every row it visits, so dgamma / dbeta / dbias accumulate
// in registers; the block parks them in shared memory, sums its row slots and writes one partial
// row, and `column_sums_kernel` adds the partial rows up (one launch for all three): no atomics. Bytes: read dy and z, write dz
// (+ dh for the fused form).
//
// Registers: the row is held as the raw 16-byte packs it was loaded as (a 768-wide bf16 row: 12
// registers for z and 12 for dy, against 48 for the fp32 values), and the second pass recomputes
// x-hat and weight * dy from them, re-reading the weight from L1. Holding fp32 values took 212-255
// registers (one block of 256 threads per SM); the packs keep the plain LayerNorm form near 128.
// The fused form's bf16 rows up to 1024 wide run the prefetching kernel below (ln_bwd_prefetch_kernel; at 776-1024
// wide the one-gradient form below kPrefetch1024Rows rows runs the row ring, ln_bwd_ring_kernel).
#pragma once
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>

#include "common.cuh"

namespace bertaccel {
namespace {

constexpr int kBwdThreads = 256;

// kPlain: LayerNorm (dz, dgamma, dbeta). kFused: LayerNorm(dropout(x + bias) + residual) (also dh,
// the dropout-masked gradient of x + bias, and dbias). kRms: RMSNorm (no centring, no beta).
// kEmb: y = dropout(LayerNorm(z)), the embeddings (dy is masked).
enum Mode : int { kPlain = 0, kFused = 1, kRms = 2, kEmb = 3 };

// Reduce the per-thread column partials over a block's row slots, one accumulator at a time (kernels
// whose threads own `tpr`-wide row slots: local_row, t, rpb, nvec, H, ITEMS, VEC in scope): every
// thread parks its columns in shared memory PARK ([row slot][column], rpb x H floats), then all
// threads sum the slots of strided columns and write one coalesced partial row per block. Two
// barriers per accumulator. A macro, not a function taking the arrays: every index stays
// compile-time, so the accumulators stay in registers.
#define BA_PARK_AND_SUM(ACC, PART, PARK)                                                                    \
do {                                                                                                  \
  __syncthreads();                                                                                    \
  _Pragma("unroll") for (int k = 0; k < ITEMS; ++k) {                                                 \
    const int c = t + k * tpr;                                                                        \
    if (c < nvec) {                                                                                   \
      float* dst = PARK + local_row * H + c * VEC;                                                    \
      if constexpr (VEC % 4 == 0) { /* 16-byte stores: 2-way bank conflicts instead of 8-way */      \
        _Pragma("unroll") for (int j = 0; j < VEC; j += 4)                                            \
          *reinterpret_cast<float4*>(dst + j) = make_float4(ACC[k][j], ACC[k][j + 1], ACC[k][j + 2], ACC[k][j + 3]); \
      } else {                                                                                        \
        _Pragma("unroll") for (int j = 0; j < VEC; ++j) dst[j] = ACC[k][j];                           \
      }                                                                                               \
    }                                                                                                 \
  }                                                                                                   \
  __syncthreads();                                                                                    \
  for (int col = threadIdx.x; col < H; col += kBwdThreads) {                                          \
    float s = 0.f;                                                                                    \
    for (int r = 0; r < rpb; ++r) s += PARK[r * H + col];                                             \
    PART[(int64_t)blockIdx.x * H + col] = s;                                                          \
  }                                                                                                   \
} while (0)

// The two passes over one vector (VEC columns) of a row, shared by both kernels below: dv (dy) and zv
// (z) as loaded (converted to float per element where used: converting the whole vector first cost
// the one-row kernel up to 21 registers, e.g. 128 -> 149 at 768 wide), g (gamma) as floats; the
// vector's keep bits start at bit0 of `kept`.
// First pass: the row sums s1 = sum(gamma * d), s2 = sum(gamma * d * xhat) and the columns' dgamma /
// dbeta. kEmb masks d here (dropout came after the norm); the second pass reads the masked d.
template <int MODE, typename T, int VEC>
__device__ __forceinline__ void bwd_first_pass(const Pack<T, VEC>& dv, const Pack<T, VEC>& zv, const float (&g)[VEC],
                                               float mu, float rs, uint32_t kept, int bit0, float scale, float& s1,
                                               float& s2, float (&acc_g)[VEC], float (&acc_b)[VEC]) {
  float zf[VEC], df[VEC];
  unpack_f(zv, zf);
  unpack_f(dv, df);
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const float xh = (zf[j] - mu) * rs;
    float d = df[j];
    if constexpr (MODE == kEmb) d = kept_bit(kept, bit0 + j) ? d * scale : 0.f;
    const float gd = g[j] * d;
    s1 += gd;
    s2 += gd * xh;
    acc_g[j] += d * xh;
    if constexpr (MODE != kRms) acc_b[j] += d;
  }
}

// Second pass: dz = rstd * (gamma * d - s1 - xhat * s2), stored at dz + off; kFused also stores dh at
// dh + off (dz through the dropout mask, in T) and sums the rounded dh into dbias, as a separate
// bias-grad kernel would.
template <int MODE, typename T, int VEC>
__device__ __forceinline__ void bwd_second_pass(const Pack<T, VEC>& dv, const Pack<T, VEC>& zv, const float (&g)[VEC],
                                                float mu, float rs, float s1, float s2, uint32_t kept, int bit0,
                                                float scale, float p, T* __restrict__ dz, T* __restrict__ dh,
                                                int64_t off, float (&acc_h)[VEC]) {
  float o[VEC], zf[VEC], df[VEC];
  unpack_f(zv, zf);
  unpack_f(dv, df);
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const float xh = (zf[j] - mu) * rs;
    float d = df[j];
    if constexpr (MODE == kEmb) d = kept_bit(kept, bit0 + j) ? d * scale : 0.f;
    o[j] = rs * (g[j] * d - s1 - xh * s2);
  }
  store_f<T, VEC>(dz + off, o);
  if constexpr (MODE == kFused) {
    if (p > 0.f) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) o[j] = kept_bit(kept, bit0 + j) ? o[j] * scale : 0.f;
    }
    Pack<T, VEC> h;  // rounded once: the stored values, and what dbias sums
#pragma unroll
    for (int j = 0; j < VEC; ++j) h.v[j] = from_f<T>(o[j]);
    unpack_f(h, o);
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc_h[j] += o[j];
    *reinterpret_cast<Pack<T, VEC>*>(dh + off) = h;
  }
}

// MIN_BLOCKS: blocks per SM the registers must allow (2: at most 128 registers, for rows of 32 elements per thread,
// which otherwise take 142-188 registers and one block per SM; see bwd_two_blocks).
template <typename T, typename W, int VEC, int ITEMS, int MODE, int MIN_BLOCKS = 1>
__global__ void __launch_bounds__(kBwdThreads, MIN_BLOCKS) ln_bwd_kernel(
    const T* __restrict__ dy, const T* __restrict__ z, const W* __restrict__ gamma,
    const float* __restrict__ mean, const float* __restrict__ rstd, T* __restrict__ dz, T* __restrict__ dh,
    float* __restrict__ dgamma_part, float* __restrict__ dbeta_part, float* __restrict__ dbias_part,
    int64_t rows, int H, int tpr, float p, const int64_t* __restrict__ rng) {
  constexpr bool kBeta = MODE != kRms;
  constexpr bool kDh = MODE == kFused;
  constexpr bool kCentre = MODE != kRms;
  static_assert(ITEMS * VEC <= 32, "the dropout keep bits of a thread's columns fit one 32-bit word");
  __shared__ float red[kBwdThreads / 32];
  begin_dependent_kernel();  // (the column sums may launch now: they wait for this grid)
  const int nvec = H / VEC;
  const int rpb = kBwdThreads / tpr;
  const int local_row = threadIdx.x / tpr;
  const int t = threadIdx.x % tpr;
  const uint64_t seed = p > 0.f ? (uint64_t)rng[0] : 0, offset = p > 0.f ? (uint64_t)rng[1] : 0;
  const float scale = p > 0.f ? 1.f / (1.f - p) : 1.f;

  float acc_g[ITEMS][VEC], acc_b[kBeta ? ITEMS : 1][VEC], acc_h[kDh ? ITEMS : 1][VEC];
#pragma unroll
  for (int k = 0; k < ITEMS; ++k)
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      acc_g[k][j] = 0.f;
      if constexpr (kBeta) acc_b[k][j] = 0.f;
      if constexpr (kDh) acc_h[k][j] = 0.f;
    }

  const int64_t row_groups = (rows + rpb - 1) / rpb;
  for (int64_t grp = blockIdx.x; grp < row_groups; grp += gridDim.x) {
    const int64_t row = grp * rpb + local_row;
    const bool active = row < rows;
    Pack<T, VEC> zp[ITEMS], dp[ITEMS];
    float s1 = 0.f, s2 = 0.f;  // sum(gamma * dy), sum(gamma * dy * xhat)
    const float mu = active && kCentre ? mean[row] : 0.f, rs = active ? rstd[row] : 0.f;
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int c = t + k * tpr;
      if (active && c < nvec) {
        const int64_t off = row * H + (int64_t)c * VEC;
        zp[k] = *reinterpret_cast<const Pack<T, VEC>*>(z + off);
        dp[k] = *reinterpret_cast<const Pack<T, VEC>*>(dy + off);
      }
    }
    // The dropout mask (kEmb: of dy; kFused: of dh), drawn while the loads are in flight: the Philox
    // state is not live beside the second pass's values.
    uint32_t kept = 0xffffffffu;  // with dropout: bit k * VEC + j set where column (k, j) is kept
    if constexpr (MODE == kEmb || MODE == kFused) {
      if (p > 0.f) {
#pragma unroll
        for (int k = 0; k < ITEMS; ++k) {
          const int c = t + k * tpr;
          if (active && c < nvec) {
            bool keep[VEC];
            dropout_keep<VEC>(seed, offset, row * H + (int64_t)c * VEC, p, keep);
#pragma unroll
            for (int j = 0; j < VEC; ++j)
              if (!keep[j]) kept &= ~(1u << (k * VEC + j));
          }
        }
      }
    }
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int c = t + k * tpr;
      if (active && c < nvec) {
        float g[VEC];
        load_f<W, VEC>(gamma + c * VEC, g);
        bwd_first_pass<MODE>(dp[k], zp[k], g, mu, rs, kept, k * VEC, scale, s1, s2, acc_g[k], acc_b[kBeta ? k : 0]);
      }
    }
    const float inv_h = 1.f / (float)H;
    s1 = kCentre ? row_reduce(s1, tpr, red, local_row, SumOp()) * inv_h : 0.f;
    s2 = row_reduce(s2, tpr, red, local_row, SumOp()) * inv_h;
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int c = t + k * tpr;
      if (active && c < nvec) {
        float g[VEC];
        load_f<W, VEC>(gamma + c * VEC, g);
        bwd_second_pass<MODE>(dp[k], zp[k], g, mu, rs, s1, s2, kept, k * VEC, scale, p, dz, dh,
                              row * H + (int64_t)c * VEC, acc_h[kDh ? k : 0]);
      }
    }
  }
  // The column partials of the block's row slots -> one partial row per block (rpb x H <= 256 x 32 floats).
  __shared__ __align__(16) float park[kBwdThreads * kMaxElemsPerThread];
  BA_PARK_AND_SUM(acc_g, dgamma_part, park);
  if constexpr (kBeta) BA_PARK_AND_SUM(acc_b, dbeta_part, park);
  if constexpr (kDh) BA_PARK_AND_SUM(acc_h, dbias_part, park);
}

// ------------------------------------------------------------------------ the row ring (persistent)
// The backward of rows a warp holds (tpr <= 32: up to 1024 bf16 or fp32) with 16-byte aligned
// tensors, as the forward's ring (layer_norm_fwd.cu): each warp owns 32 / tpr rows at a time and
// walks every W-th such group; dy, z, mean and rstd of its next groups stream into shared memory
// through a ring of cp.async stages, and both passes read the row from there (nothing of the row
// is held in registers, which leaves them to the column accumulators: the kernel above, holding the
// row's packs, needed 128-184 registers, one or two blocks per SM and one row in flight per warp).
// Each lane reads back only what it copied; the block's column partials go through the ring's shared
// memory once the rows are done.
constexpr int kBwdRingWarps = kBwdThreads / 32;
constexpr int kBwdRingBudget = 112 * 1024;  // two blocks per SM on Hopper (228 KB)

template <int ITEMS>
constexpr int bwd_ring_stage_bytes() { return kBwdRingWarps * (2 * ITEMS * 32 * 16 + 2 * 32 * 4); }  // dy, z, mean, rstd
template <int ITEMS>
constexpr int bwd_ring_stages() {
  constexpr int st = kBwdRingBudget / bwd_ring_stage_bytes<ITEMS>();
  return st > 4 ? 4 : (st < 2 ? 2 : st);
}

// Two blocks per SM (<= 128 registers), except the forms whose accumulators do not fit beside the
// row's values there (the fused form at 768-1024 wide spilled 140-200 bytes): one block, more registers.
template <int MODE, int VEC, int ITEMS>
constexpr int bwd_ring_min_blocks() {
  return (MODE == kFused && ITEMS * VEC >= 24) || (MODE == kEmb && ITEMS * VEC == 32 && VEC == 4) ? 1 : 2;
}

template <typename T, typename W, int VEC, int ITEMS, int MODE>
__global__ void __launch_bounds__(kBwdThreads, bwd_ring_min_blocks<MODE, VEC, ITEMS>()) ln_bwd_ring_kernel(
    const T* __restrict__ dy, const T* __restrict__ z, const W* __restrict__ gamma,
    const float* __restrict__ mean, const float* __restrict__ rstd, T* __restrict__ dz, T* __restrict__ dh,
    float* __restrict__ dgamma_part, float* __restrict__ dbeta_part, float* __restrict__ dbias_part,
    int64_t rows, int H, int tpr, float p, const int64_t* __restrict__ rng) {
  constexpr bool kBeta = MODE != kRms;
  constexpr bool kDh = MODE == kFused;
  constexpr bool kCentre = MODE != kRms;
  constexpr int S = bwd_ring_stages<ITEMS>();
  constexpr int kItem = 32 * 16;
  constexpr int kStage = bwd_ring_stage_bytes<ITEMS>() / kBwdRingWarps;  // one warp's slice of a stage
  static_assert(VEC * sizeof(T) == 16, "the ring copies 16-byte vectors");
  static_assert(ITEMS * VEC <= 32, "the dropout keep bits of a thread's columns fit one 32-bit word");
  extern __shared__ __align__(16) unsigned char bwd_ring_smem[];
  begin_dependent_kernel();  // (the column sums may launch now: they wait for this grid)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  unsigned char* ring = bwd_ring_smem + warp * S * kStage;
  const int nvec = H / VEC;
  const int rpw = 32 / tpr;                  // rows per warp at a time
  const int rpb = kBwdThreads / tpr;         // row slots per block (for the column partials)
  const int local_row = threadIdx.x / tpr;   // this thread's row slot in the block
  const int t = lane % tpr, slot = lane / tpr;
  const int64_t groups = (rows + rpw - 1) / rpw;
  const int64_t first = (int64_t)blockIdx.x * kBwdRingWarps + warp, stride = (int64_t)gridDim.x * kBwdRingWarps;
  const uint64_t seed = p > 0.f ? (uint64_t)rng[0] : 0, offset = p > 0.f ? (uint64_t)rng[1] : 0;
  const float scale = p > 0.f ? 1.f / (1.f - p) : 1.f;

  auto issue = [&](int64_t grp, int stage) {  // copy group `grp` (if any) into `stage`; one commit group either way
    const int64_t row = grp * rpw + slot;
    if (grp < groups && row < rows) {
      unsigned char* dst = ring + stage * kStage;
#pragma unroll
      for (int k = 0; k < ITEMS; ++k) {
        const int c = t + k * tpr;
        if (c < nvec) {
          cp_async16(dst + k * kItem + lane * 16, dy + row * H + (int64_t)c * VEC);
          cp_async16(dst + (ITEMS + k) * kItem + lane * 16, z + row * H + (int64_t)c * VEC);
        }
      }
      if constexpr (kCentre) cp_async4(dst + 2 * ITEMS * kItem + lane * 4, mean + row);
      cp_async4(dst + 2 * ITEMS * kItem + 128 + lane * 4, rstd + row);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int st = 0; st < S; ++st) issue(first + st * stride, st);

  float acc_g[ITEMS][VEC], acc_b[kBeta ? ITEMS : 1][VEC], acc_h[kDh ? ITEMS : 1][VEC];
#pragma unroll
  for (int k = 0; k < ITEMS; ++k)
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      acc_g[k][j] = 0.f;
      if constexpr (kBeta) acc_b[k][j] = 0.f;
      if constexpr (kDh) acc_h[k][j] = 0.f;
    }
  const float inv_h = 1.f / (float)H;
  int stage = 0;
  for (int64_t grp = first; grp < groups; grp += stride) {
    const int64_t row = grp * rpw + slot;
    const bool active = row < rows;
    uint32_t kept = 0xffffffffu;  // with dropout: bit k * VEC + j set where column (k, j) is kept
    if constexpr (MODE == kEmb || MODE == kFused) {
      if (p > 0.f && active) {  // drawn while the group lands
#pragma unroll
        for (int k = 0; k < ITEMS; ++k) {
          const int c = t + k * tpr;
          if (c < nvec) {
            bool keep[VEC];
            dropout_keep<VEC>(seed, offset, row * H + (int64_t)c * VEC, p, keep);
#pragma unroll
            for (int j = 0; j < VEC; ++j)
              if (!keep[j]) kept &= ~(1u << (k * VEC + j));
          }
        }
      }
    }
    cp_async_wait<S - 1>();
    const unsigned char* src = ring + stage * kStage;
    const float mu = active && kCentre ? *reinterpret_cast<const float*>(src + 2 * ITEMS * kItem + lane * 4) : 0.f;
    const float rs = active ? *reinterpret_cast<const float*>(src + 2 * ITEMS * kItem + 128 + lane * 4) : 0.f;
    float s1 = 0.f, s2 = 0.f;  // sum(gamma * dy), sum(gamma * dy * xhat)
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int c = t + k * tpr;
      if (active && c < nvec) {
        const Pack<T, VEC> dv = *reinterpret_cast<const Pack<T, VEC>*>(src + k * kItem + lane * 16);
        const Pack<T, VEC> zv = *reinterpret_cast<const Pack<T, VEC>*>(src + (ITEMS + k) * kItem + lane * 16);
        float g[VEC];
        load_f<W, VEC>(gamma + c * VEC, g);
        bwd_first_pass<MODE>(dv, zv, g, mu, rs, kept, k * VEC, scale, s1, s2, acc_g[k], acc_b[kBeta ? k : 0]);
      }
    }
    s1 = kCentre ? row_reduce(s1, tpr, nullptr, 0, SumOp()) * inv_h : 0.f;  // tpr <= 32: shuffles only
    s2 = row_reduce(s2, tpr, nullptr, 0, SumOp()) * inv_h;
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int c = t + k * tpr;
      if (active && c < nvec) {
        const Pack<T, VEC> dv = *reinterpret_cast<const Pack<T, VEC>*>(src + k * kItem + lane * 16);
        const Pack<T, VEC> zv = *reinterpret_cast<const Pack<T, VEC>*>(src + (ITEMS + k) * kItem + lane * 16);
        float g[VEC];
        load_f<W, VEC>(gamma + c * VEC, g);
        bwd_second_pass<MODE>(dv, zv, g, mu, rs, s1, s2, kept, k * VEC, scale, p, dz, dh,
                              row * H + (int64_t)c * VEC, acc_h[kDh ? k : 0]);
      }
    }
    // Both passes have read the stage (their stores consumed every value): refill it.
    issue(grp + S * stride, stage);
    stage = stage + 1 == S ? 0 : stage + 1;
  }
  cp_async_wait<0>();
  float* park = reinterpret_cast<float*>(bwd_ring_smem);  // rpb x H floats <= the ring (BA_PARK_AND_SUM syncs first)
  BA_PARK_AND_SUM(acc_g, dgamma_part, park);
  if constexpr (kBeta) BA_PARK_AND_SUM(acc_b, dbeta_part, park);
  if constexpr (kDh) BA_PARK_AND_SUM(acc_h, dbias_part, park);
}

// ------------------------------------------------- the prefetching kernel (column partials in shared memory)
// The kernels above hold the column accumulators (dgamma, dbeta, dbias: ITEMS x VEC floats each) in
// registers: 48-72 of a 768-wide bf16 row's 128-184 registers, which leaves room for one row per warp
// in flight and one or two blocks per SM (Nsight Compute: 44-50% of cycles stalled on the loads).
// Here the accumulators live in shared memory, each thread's in its own slots (no barrier until the
// end, lane-consecutive float4s: no bank conflicts), and the registers they freed hold the warp's
// *next* rows: their loads are issued before the current rows' two passes, so a warp always has a
// row group in flight (two blocks per SM at <= 128 registers). Each warp walks every (grid x 8)-th
// group of 32 / tpr rows: warps never wait for each other. Costs one shared-memory read-modify-write
// per accumulator and element (16-24 bytes against 6 of global traffic). Used for the fused residual
// form up to 768 wide (see launch_bwd); BERTACCEL_LN_BWD_PREFETCH=0 runs the kernels above instead.
// Measured and not kept (H100, 16384 rows, bf16; scripts/ln_bwd_sweep.py, bench_ops, session 21):
// (1) the passes branch-free (zeros past the row) with the weight from shared memory: residual form
// 35.5 / 58.8 us at 384 / 768 against 32.7 / 53.0 here; (2) the column sums inside this kernel (the
// last blocks to take a ticket sum the partial rows in block order, the counter zeroed by a memset
// node): LayerNorm 25.6 / 41.9 / 51.5 us against 23.5 / 40.8 / 51.3 with the column-sums launch -
// the memset (0.7-1.1 us) and the wait for the last block cost more than the launch saves, as the
// cooperative-launch version did (column_sums_kernel, common.cuh); (3) the sums in thread-block clusters, one partial
// row per cluster through distributed shared memory, the last cluster adding those (session 68, H200): 2.5-5 us more
// per call, 20% more at 1024 wide (docs/row-ops.md, docs/tried/ln-bwd-cluster-sums.patch). The sweep's fit of time against
// rows gives the backward a per-call cost of 6-17 us (LayerNorm 8 / 14 / 14 at 384 / 768 / 1024)
// beside a streaming rate of 80-96% of copy: the first loads, the last rows' two passes and the
// column sums, which more bytes in flight do not shorten.
template <int MODE>
constexpr int bwd_prefetch_accs() { return 1 + (MODE != kRms) + (MODE == kFused); }
// the accumulators, and with DY2 a 16-byte slot per thread and vector where the next group's second gradient lands
template <int MODE, int VEC, int ITEMS, bool DY2 = false>
constexpr int bwd_prefetch_smem() { return bwd_prefetch_accs<MODE>() * kBwdThreads * ITEMS * VEC * 4 + (DY2 ? ITEMS * kBwdThreads * 16 : 0); }
// (Also at 32 elements a thread, 776-1024 wide: 128 registers without spilling, offline ptxas, sm_90, session 72 -
// 142-146 unheld - and two blocks' shared memory fits an SM's 228 KiB: 2 x (96 KiB of accumulators + 16 KiB of dy2
// slots + 1 KiB the runtime reserves a block) = 226 KiB.)
template <int VEC, int ITEMS>
constexpr int bwd_prefetch_min_blocks() { return 2; }
inline bool bwd_prefetch_enabled() {
  static const bool on = env_switch("BERTACCEL_LN_BWD_PREFETCH", 1) != 0;
  return on;
}
// BERTACCEL_LN_BWD_PREFETCH_PLAIN=1 (off by default; built in session 81, not yet measured): the plain LayerNorm's
// and RMSNorm's bf16 rows within a warp (384-1024 wide) through the prefetching kernel too - the next row group's
// loads in flight through this group's two passes, the accumulators in shared memory - in place of the register
// kernel. Measured even on the H100 in session 15 (before the two-block register kernels and the word unpacking:
// LayerNorm 23.1 / 23.3, 40.7 / 40.3 us; RMSNorm 36.6 / 36.3); the H200's higher bandwidth needs more bytes in flight
// (session 81: the wide rows' backward gained 26-35% from a second block per SM), so it is measured again there.
inline bool bwd_prefetch_plain() {
  static const bool on = env_switch("BERTACCEL_LN_BWD_PREFETCH_PLAIN", 0) == 1;
  return on;
}
// The fused form's bf16 rows 776-1024 wide (one a warp) through the prefetching kernel too, two blocks per SM, in place
// of the ring kernel (one block per SM at 180-185 registers), which takes one gradient only - the two-gradient form
// there (layer_norm_bwd2, BERT-large's) adds dy + dy2 in a kernel of its own first, a pass over three tensors the
// prefetching kernel folds into its loads. Built in session 72 (128 registers, no spill), measured in session 73 (H200,
// bf16, two alternated rounds, ring -> prefetching, us; h200/ln_bwd_sweep_prefetch_1024_pending.log):
//   two gradients 800 wide: 2048 rows 18.8 / 19.1 -> 16.4 / 16.7, 8192 45.8 / 46.1 -> 37.4 / 38.3, 32768 137.5 /
//     138.4 -> 105.1 / 106.0; 1024 wide: 2048 21.4 / 20.8 -> 18.1 / 18.5, 16384 84.7 / 85.1 -> 66.4 / 66.2 (rate 61 ->
//     81% of copy);
//   one gradient 800 wide: 2048 13.1 / 13.1 -> 13.8 / 13.7, 4096 20.5 / 20.4 -> 20.1 / 20.0, 16384 57.7 / 57.9 -> 51.2
//     / 51.1; 1024 wide: 2048 15.3 / 14.9 -> 16.1 / 16.4, 4096 24.0 / 23.5 -> 23.3 / 23.9, 16384 59.6 / 58.8 -> 55.7 /
//     57.2, 32768 102.0 / 102.8 -> 95.1 / 96.3 (its per-call part is 1-2 us larger: two blocks' grid of row groups).
// So by default: the two-gradient form at every row count, the one-gradient form from kPrefetch1024Rows rows.
// BERTACCEL_LN_BWD_PREFETCH_1024=1: always (at 776-1024 wide); =0: never (the ring kernel). Read once per process.
constexpr int64_t kPrefetch1024Rows = 4096;
inline bool bwd_prefetch_1024(bool two_gradients, int64_t rows) {
  static const int setting = env_switch("BERTACCEL_LN_BWD_PREFETCH_1024", -1);
  if (setting >= 0) return setting != 0;
  return two_gradients || rows >= kPrefetch1024Rows;
}

// The weight's VEC values (as floats) at p, read where they are used, every row: a volatile load the
// compiler cannot hoist out of the row loop (it did: ITEMS x VEC more registers held across the loop,
// 139 instead of 115 at 768 wide) - the weight stays in L1, the registers go to the next rows.
// kWords 32-bit words at p by volatile 16-byte loads, issued where they stand (ptxas does not move them)
template <int kWords>
__device__ __forceinline__ void load_words_in_place(const void* p, uint32_t (&w)[kWords]) {
  static_assert(kWords % 4 == 0, "whole 16-byte vectors");
#pragma unroll
  for (int i = 0; i < kWords; i += 4)
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(w[i]), "=r"(w[i + 1]), "=r"(w[i + 2]), "=r"(w[i + 3])
                 : "l"(reinterpret_cast<const char*>(p) + 4 * i));
}

template <typename W, int VEC>
__device__ __forceinline__ void load_weight_in_loop(const W* p, float (&out)[VEC]) {
  static_assert(VEC * sizeof(W) % 16 == 0, "whole 16-byte vectors");
  uint32_t w[VEC * sizeof(W) / 4];
  load_words_in_place(p, w);
  const W* v = reinterpret_cast<const W*>(w);
#pragma unroll
  for (int j = 0; j < VEC; ++j) out[j] = to_f(v[j]);
}

// Per-row partials that bwd_first_pass / bwd_second_pass add into start at -0, not +0: -0 + x is x for every x, so the
// compiler drops the first add, where +0 + x (which turns a -0 into +0) cost an FADD per element and partial - two
// FADDs an element in the fused form's row loop (SASS, session 71). The sums are the same bits: the shared-memory
// accumulators they go into start at +0, and +0 + -0 is +0.
template <int N>
__device__ __forceinline__ void fill_negative_zero(float (&a)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) a[j] = -0.f;
}

// the sum of two gradient packs, rounded to T: what adding the two tensors first (PyTorch's add) would hand over
template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> add_packs(const Pack<T, VEC>& a, const Pack<T, VEC>& b) {
  Pack<T, VEC> o;
  float fa[VEC], fb[VEC];
  unpack_f(a, fa);
  unpack_f(b, fb);
#pragma unroll
  for (int j = 0; j < VEC; ++j) o.v[j] = from_f<T>(fa[j] + fb[j]);
  return o;
}

// DY2 (the fused form, layer_norm_bwd2): the output's gradient comes in two parts, dy + dy2 (the LayerNorm output's
// two consumers: the next sub-layer and the next residual), summed as each row is used - the add kernel autograd
// would run before the backward, folded into its loads (the same bits: the sum is rounded to T as the add rounds it).
// NEXT = false: the accumulators in shared memory as above, but no next rows held: each group is loaded where it is
// used (the register kernel's loads with fewer registers: at 1024 wide 123-127, two blocks per SM where the register
// kernel's 185-188 fit one; at 768 wide 80 (16 bytes spilled), three blocks where it fits two at 128;
// BERTACCEL_LN_BWD_SMEM_ACC=1, see launch_bwd).
template <typename T, typename W, int VEC, int ITEMS, int MODE, bool DY2 = false, bool NEXT = true>
__global__ void __launch_bounds__(kBwdThreads, NEXT ? bwd_prefetch_min_blocks<VEC, ITEMS>() : (ITEMS * VEC <= 24 ? 3 : 2)) ln_bwd_prefetch_kernel(
    const T* __restrict__ dy, const T* __restrict__ z, const W* __restrict__ gamma,
    const float* __restrict__ mean, const float* __restrict__ rstd, T* __restrict__ dz, T* __restrict__ dh,
    float* __restrict__ dgamma_part, float* __restrict__ dbeta_part, float* __restrict__ dbias_part,
    int64_t rows, int H, int tpr, float p, const int64_t* __restrict__ rng, const T* __restrict__ dy2) {
  constexpr bool kBeta = MODE != kRms;
  constexpr bool kDh = MODE == kFused;
  constexpr bool kCentre = MODE != kRms;
  constexpr int kAccs = bwd_prefetch_accs<MODE>();
  constexpr int kQ = VEC / 4;  // float4s per vector of accumulators
  static_assert(VEC % 4 == 0, "accumulators are kept as float4s");
  static_assert(ITEMS * VEC <= 32, "the dropout keep bits of a thread's columns fit one 32-bit word");
  extern __shared__ float4 bwd_acc_smem[];  // [accumulator][k][q][thread]
  begin_dependent_kernel();  // (the column sums may launch now: they wait for this grid)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int nvec = H / VEC;
  const int rpw = 32 / tpr;  // rows per warp at a time
  const int rpb = kBwdThreads / tpr;
  const int t = lane % tpr, slot = lane / tpr;
  const int64_t groups = (rows + rpw - 1) / rpw;
  const int64_t first = (int64_t)blockIdx.x * kBwdRingWarps + warp, stride = (int64_t)gridDim.x * kBwdRingWarps;
  const uint64_t seed = p > 0.f ? (uint64_t)rng[0] : 0, offset = p > 0.f ? (uint64_t)rng[1] : 0;
  const float scale = p > 0.f ? 1.f / (1.f - p) : 1.f;
  const float inv_h = 1.f / (float)H;
#pragma unroll
  for (int i = 0; i < kAccs * ITEMS * kQ; ++i) bwd_acc_smem[i * kBwdThreads + threadIdx.x] = make_float4(0.f, 0.f, 0.f, 0.f);
  // acc[a][k][j..j+3] += v[j..j+3] for accumulator a of vector k
  auto add_to = [&](int a, int k, const float(&v)[VEC]) {
#pragma unroll
    for (int q = 0; q < kQ; ++q) {
      float4& s = bwd_acc_smem[((a * ITEMS + k) * kQ + q) * kBwdThreads + threadIdx.x];
      float4 x = s;
      x.x += v[4 * q];
      x.y += v[4 * q + 1];
      x.z += v[4 * q + 2];
      x.w += v[4 * q + 3];
      s = x;
    }
  };
  auto load = [&](int64_t grp, Pack<T, VEC>(&dp)[ITEMS], Pack<T, VEC>(&zp)[ITEMS], float& mu, float& rs) {
    const int64_t row = grp * rpw + slot;
    if (grp < groups && row < rows) {
#pragma unroll
      for (int k = 0; k < ITEMS; ++k) {
        const int c = t + k * tpr;
        if (c < nvec) {
          const int64_t off = row * H + (int64_t)c * VEC;
          zp[k] = *reinterpret_cast<const Pack<T, VEC>*>(z + off);
          dp[k] = *reinterpret_cast<const Pack<T, VEC>*>(dy + off);
        }
      }
      if constexpr (kCentre) mu = mean[row];
      rs = rstd[row];
    }
  };

  // DY2: group grp's second gradient, copied by cp.async into this thread's slots of shared memory when the group's
  // dy and z are loaded (a group ahead, in flight through the current group's two passes, holding no registers), and
  // added into its dy packs after the current group's passes, when their packs are dead. (Held in registers a group
  // ahead the extra packs spilled at the 128-register cap at 768 wide; loaded where they are added, by volatile loads,
  // the load's latency was exposed: 16384x768, bf16, H200, add + bwd 64.5 us, bwd2 63.2, bwd alone 44.6. Copied
  // here: bwd2 55.7 / 56.2 us against 64.0 / 64.5 for that kernel, same call; 16384x384 33.0 against 36.3.)
  uint4* dy2_slots = reinterpret_cast<uint4*>(bwd_acc_smem + kAccs * ITEMS * kQ * kBwdThreads);  // [k][thread]
  auto stage_dy2 = [&](int64_t grp) {
    const int64_t row = grp * rpw + slot;
    if (grp < groups && row < rows) {
#pragma unroll
      for (int k = 0; k < ITEMS; ++k)
        if (t + k * tpr < nvec)
          cp_async16(dy2_slots + k * kBwdThreads + threadIdx.x, dy2 + row * H + (int64_t)(t + k * tpr) * VEC);
    }
    cp_async_commit();
  };
  auto fold = [&](int64_t grp, Pack<T, VEC>(&dp)[ITEMS]) {
    cp_async_wait<0>();  // this thread's copies: its own slots, no other thread's
    const int64_t row = grp * rpw + slot;
    if (grp < groups && row < rows) {
#pragma unroll
      for (int k = 0; k < ITEMS; ++k)
        if (t + k * tpr < nvec) {
          const uint4 w = dy2_slots[k * kBwdThreads + threadIdx.x];
          dp[k] = add_packs<T, VEC>(dp[k], *reinterpret_cast<const Pack<T, VEC>*>(&w));
        }
    }
  };

  static_assert(NEXT || !DY2, "dy2 is staged a group ahead");
  Pack<T, VEC> dcur[ITEMS], zcur[ITEMS];
  float mu = 0.f, rs = 0.f;
  if constexpr (NEXT) load(first, dcur, zcur, mu, rs);
  if constexpr (DY2) {
    stage_dy2(first);
    fold(first, dcur);
  }
  for (int64_t grp = first; grp < groups; grp += stride) {
    const int64_t row = grp * rpw + slot;
    const bool active = row < rows;
    if constexpr (!NEXT) load(grp, dcur, zcur, mu, rs);
    Pack<T, VEC> dnext[NEXT ? ITEMS : 1], znext[NEXT ? ITEMS : 1];
    float mu_next = 0.f, rs_next = 0.f;
    if constexpr (NEXT) load(grp + stride, dnext, znext, mu_next, rs_next);  // in flight through this group's two passes
    if constexpr (DY2) stage_dy2(grp + stride);
    uint32_t kept = 0xffffffffu;  // with dropout: bit k * VEC + j set where column (k, j) is kept
    if constexpr (MODE == kEmb || MODE == kFused) {
      if (p > 0.f && active) {
#pragma unroll
        for (int k = 0; k < ITEMS; ++k) {
          const int c = t + k * tpr;
          if (c < nvec) {
            bool keep[VEC];
            dropout_keep<VEC>(seed, offset, row * H + (int64_t)c * VEC, p, keep);
#pragma unroll
            for (int j = 0; j < VEC; ++j)
              if (!keep[j]) kept &= ~(1u << (k * VEC + j));
          }
        }
      }
    }
    float s1 = 0.f, s2 = 0.f;  // sum(gamma * dy), sum(gamma * dy * xhat)
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int c = t + k * tpr;
      if (active && c < nvec) {
        float g[VEC], pg[VEC], pb[VEC];
        fill_negative_zero(pg);  // (see fill_negative_zero)
        fill_negative_zero(pb);
        load_weight_in_loop<W, VEC>(gamma + c * VEC, g);
        bwd_first_pass<MODE>(dcur[k], zcur[k], g, mu, rs, kept, k * VEC, scale, s1, s2, pg, pb);
        add_to(0, k, pg);
        if constexpr (kBeta) add_to(1, k, pb);
      }
    }
    s1 = kCentre ? row_reduce(s1, tpr, nullptr, 0, SumOp()) * inv_h : 0.f;  // tpr <= 32: shuffles only
    s2 = row_reduce(s2, tpr, nullptr, 0, SumOp()) * inv_h;
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int c = t + k * tpr;
      if (active && c < nvec) {
        float g[VEC], ph[VEC];
        fill_negative_zero(ph);
        load_weight_in_loop<W, VEC>(gamma + c * VEC, g);
        bwd_second_pass<MODE>(dcur[k], zcur[k], g, mu, rs, s1, s2, kept, k * VEC, scale, p, dz, dh,
                              row * H + (int64_t)c * VEC, ph);
        if constexpr (kDh) add_to(kAccs - 1, k, ph);
      }
    }
    if constexpr (DY2) fold(grp + stride, dnext);
    if constexpr (NEXT) {
#pragma unroll
      for (int k = 0; k < ITEMS; ++k) {
        dcur[k] = dnext[k];
        zcur[k] = znext[k];
      }
      mu = mu_next;
      rs = rs_next;
    }
  }
  // One partial row per block and accumulator: the sum over the block's row slots (thread s * tpr + t
  // holds columns (t + k * tpr) * VEC + j of slot s).
  __syncthreads();
  const float* acc = reinterpret_cast<const float*>(bwd_acc_smem);
#pragma unroll
  for (int a = 0; a < kAccs; ++a) {
    float* part = a == 0 ? dgamma_part : (a == 1 && kBeta ? dbeta_part : dbias_part);
    for (int col = threadIdx.x; col < H; col += kBwdThreads) {
      const int c = col / VEC, j = col % VEC, k = c / tpr, tt = c % tpr;
      const float* src = acc + (((a * ITEMS + k) * kQ + j / 4) * kBwdThreads + tt) * 4 + (j & 3);
      float s = 0.f;
      for (int r = 0; r < rpb; ++r) s += src[r * tpr * 4];
      part[(int64_t)blockIdx.x * H + col] = s;
    }
  }
}

// Whether ln_bwd_kernel at `elems` (24 or 32) elements per thread runs held to 128 registers, two blocks per SM.
// - 32 elements: by default the RMSNorm backward of bf16 rows of 8-element vectors within one warp (776-1024 wide),
//   which fits them without spilling: 16384x1024, H200, two alternated rounds, 42.1 / 42.0 -> 38.1 / 38.3 us
//   (streaming rate 76% -> 87% of copy; session 68, benchmarks/results/h200/ln_bwd_sweep_two_blocks_89462a8.log).
//   LayerNorm there spilled 322 bytes at 128 registers and lost (46.1 / 46.0 -> 56.2 / 56.0 us), as the embeddings'
//   form would (352 bytes). Since session 72's word unpacking LayerNorm fits 128 registers without spilling and runs
//   there from kTwoBlocks32RowsPlain rows (below); the embeddings' form (84 bytes) keeps one block.
//   BERTACCEL_LN_BWD_TWO_BLOCKS=1: every form with 32 elements per thread (for comparing); =0: none.
// - 24 elements (bf16 rows 384 wide, two a warp, and 768 wide, one a warp), the plain LayerNorm's
//   and the embeddings' form: LayerNorm 146 -> 128 registers without spilling, the embeddings' form 181 -> 128 with 52
//   bytes spilled (offline ptxas, session 70). Its streaming rate is higher and its per-call part too: H200, bf16, two
//   alternated rounds, one block -> two (session 71, benchmarks/results/h200/ln_bwd_sweep_two_blocks_24_f8d014b.log), us:
//     LayerNorm 384 wide: 4096 rows 7.7 / 7.7 -> 9.1 / 9.1, 8192 10.6 / 10.6 -> 11.6 / 11.6, 16384 21.2 / 21.0 -> 19.2 /
//       19.2 (rate 42-43% -> 59% of copy, per-call part 0-0.2 -> 3.9-4.0 us); embeddings (dropout 0.1) 8192x384 13.4 /
//       13.3 -> 14.1 / 14.1, 16384x384 24.9 / 24.7 -> 22.3 / 22.3;
//     768 wide: LayerNorm 2048 rows 9.7 / 9.6 -> 10.4 / 10.4, 4096 13.5 / 13.3 -> 13.0 / 13.1, 8192 23.6 / 23.4 -> 21.0 /
//       21.1; embeddings 2048 10.3 / 10.3 -> 11.3 / 11.3, 4096 15.1 / 15.0 -> 14.8 / 14.8, 8192 26.9 / 26.5 -> 23.7 / 23.7.
//   A second call (700c458, ln_bwd_sweep_two_blocks_24_rule_700c458.log; =0 -> =1, rows between): LayerNorm 384 wide
//   10240 rows 13.0 / 13.1 -> 13.8 / 13.9, 12288 16.0 / 16.0 -> 15.8 / 15.8, 14336 18.8 / 18.9 -> 18.3 / 18.3, 24576
//   30.7 / 30.9 -> 26.6 / 26.2; embeddings 10240x384 15.6 / 15.6 -> 17.0 / 17.0, 12288x384 19.3 / 19.2 -> 18.5 / 18.5;
//   768 wide: LayerNorm 3072 rows 11.3 / 11.4 -> 11.8 / 11.8, 4096 13.4 / 13.5 -> 13.1 / 13.1, 6144 18.6 / 18.8 -> 17.8
//   / 17.8; embeddings 3072x768 12.5 / 13.0 -> 13.9 / 14.0, 4096 15.3 / 15.2 -> 14.9 / 15.0, 6144 21.1 / 21.3 -> 19.5 /
//   19.6. So by default two blocks from kTwoBlocks24Rows384 rows at 384 wide (tpr 16) and from kTwoBlocks24Rows768 at
//   768 (tpr 32), the first row counts where they led in both forms. BERTACCEL_LN_BWD_TWO_BLOCKS_24=1: at every row
//   count (for comparing); =0: never.
// Read once per process. Asked only where launch_bwd's BA_LN_BWD instantiates the two-block kernel (bwd_two_blocks_form).
template <int MODE, typename T>
constexpr bool bwd_two_blocks_form(int elems) {
  return (elems == 32 && MODE != kFused) || (elems == 24 && (MODE == kPlain || MODE == kEmb) && sizeof(T) == 2);
}
// Session 72 (with the bf16 words unpacked whole, 27b06ef; h200/ln_bwd_sweep_27b06ef.log, two rounds, one block ->
// two): the plain LayerNorm 384 wide 4096 rows 7.6 / 7.7 -> 8.8 / 8.8 us, 8192 13.3 / 12.9 -> 11.3 / 11.3, 16384 23.5 /
// 23.7 -> 18.8 / 18.6; the embeddings' form 8192x384 13.0 / 12.8 -> 13.2 / 13.6, 16384 23.5 / 23.0 -> 20.8 / 21.2.
// Rows between (30df3a8, h200/ln_bwd_sweep_thresholds_30df3a8.log, three rounds, one block -> two): LayerNorm 384 wide
// 5120 rows 9.0 / 9.0 / 9.0 -> 9.9 / 10.0 / 10.0, 6144 11.3 / 11.3 / 11.4 -> 10.5 / 10.7 / 10.6, 7168 12.4 / 12.4 / 12.4
// -> 10.7 / 11.0 / 10.8; embeddings 10240x384 14.1 / 14.2 / 14.2 -> 14.9 / 14.9 / 15.1, 12288 17.0 / 17.1 / 17.0 ->
// 16.4 / 16.5 / 16.6. Two more calls at 87f8180 on other machines (h200/ln_bwd_sweep_384_threshold_{a,b}_87f8180.log,
// one round, then two) disagreed at 6,144 rows only: one block 9.4, 9.1 / 9.2 against two blocks 10.5, 10.5 / 10.4
// (one block at 6,144 rows is bimodal, 9.1-9.4 or 11.3-11.4 us, two blocks 10.4-10.7 on all three machines); 5120
// 9.2, 9.0 / 9.0 -> 10.0, 10.1 / 9.8; 7168 12.4 / 12.6 -> 10.8 / 10.7; 8192 12.6 / 12.5 -> 11.5 / 11.2. So the
// LayerNorm's threshold at 384 wide fell to 7,168 rows (kTwoBlocks24Rows384), the first row count where two blocks led
// on every machine; the embeddings' stays at 12,288.
constexpr int64_t kTwoBlocks24Rows384 = 7168, kTwoBlocks24Rows384Emb = 12288, kTwoBlocks24Rows768 = 4096;
// The plain LayerNorm's register kernel at 32 elements a thread (776-1024-wide bf16 rows) held to 128 registers, two
// blocks per SM, in place of the shared-memory accumulators (bwd_smem_acc) from this many rows: it spilled 322 bytes
// there before session 72's word unpacking and none after (h200/ln_bwd_sweep_27b06ef.log, two rounds, shared-memory
// accumulators -> two-block register kernel, us: 2048x1024 11.4 / 12.0 -> 12.9 / 12.5, 4096 17.2 / 18.0 -> 17.9 / 17.5,
// 8192 27.2 / 28.0 -> 27.0 / 26.7, 16384 42.6 / 43.4 -> 41.6 / 40.9, 32768 69.9 / 71.4 -> 67.1 / 66.2). Three rounds
// at 30df3a8 (h200/ln_bwd_sweep_thresholds_30df3a8.log; BERTACCEL_LN_BWD_SMEM_ACC=1 -> this rule): 8192x1024 26.8 / 26.7
// / 26.7 -> 26.2 / 26.0 / 26.4, 12288 34.6 / 34.5 / 34.5 -> 34.0 / 34.1 / 34.0, 16384 41.6 / 41.5 / 42.0 -> 40.5 / 40.8
// / 40.7 (a 2-3% gain). The embeddings' form (84 bytes spilled) lost or tied there below 32,768 rows and keeps the
// accumulators.
constexpr int64_t kTwoBlocks32RowsPlain = 8192;
// Rows wider than a warp (bf16 1032-8192 wide: 32 elements a thread on 64-256 threads a row, two barriers a row
// reduction) ran one block - 8 warps - per SM until session 81, though the two-block instantiation fits 128 registers
// without a spill (RMSNorm 111); two blocks hide the loads behind the other block's barriers. Measured (H200, session
// 81, ln_bwd_sweep --widths 4096, BERTACCEL_LN_BWD_TWO_BLOCKS=1 against the default, alternated, two rounds,
// h200/ln_bwd_sweep_4096_two_blocks_s81.log), us: RMSNorm 16384x4096 184.0-185.1 -> 119.8-121.0 (52 -> 81-83% of
// copy; torch.compile's 136.4 in session 76), 8192 98.8-99.3 -> 67.3-67.4; LayerNorm 16384x4096 193.3-194.5 ->
// 142.9-143.5, 8192 106.2-107.2 -> 84.6-84.8. So from kTwoBlocksWideRows rows (the row counts measured) the plain
// LayerNorm and RMSNorm take two blocks there; the other forms and float32 keep one (not measured).
constexpr int64_t kTwoBlocksWideRows = 8192;
template <int MODE, typename T>
inline bool bwd_two_blocks(int elems, int vec, int tpr, int64_t rows) {
  if (elems == 24) {
    static const int setting = env_switch("BERTACCEL_LN_BWD_TWO_BLOCKS_24", -1);
    if (setting >= 0) return setting != 0;
    return rows >= (tpr == 32 ? kTwoBlocks24Rows768 : MODE == kEmb ? kTwoBlocks24Rows384Emb : kTwoBlocks24Rows384);
  }
  static const int setting = env_switch("BERTACCEL_LN_BWD_TWO_BLOCKS", -1);
  if (setting >= 0) return setting != 0;
  if (sizeof(T) != 2 || vec != 8) return false;
  if (tpr > 32) return (MODE == kRms || MODE == kPlain) && rows >= kTwoBlocksWideRows;
  return MODE == kRms || (MODE == kPlain && rows >= kTwoBlocks32RowsPlain);
}

// Whether the plain LayerNorm and the embeddings' backward of 768-1024-wide bf16 rows (24-32 elements a thread, one
// warp a row) keep their accumulators in shared memory (ln_bwd_prefetch_kernel with NEXT = false: three blocks per SM
// at 768 wide, two at 1024, where the register kernel holds two and one). Its streaming rate is higher and its
// per-call part too (more partial rows to add, every block's accumulators zeroed and written back). H200, bf16, same
// calls, alternated rounds (session 69, benchmarks/results/h200/ln_bwd_sweep_smem_acc_454918c.log and
// ln_bwd_sweep_emb_030bdab.log), register kernel -> shared-memory accumulators, us:
//   LayerNorm 768 wide: 8192 rows 23.7 / 23.4 -> 25.0 / 25.1, 16384 40.3 / 39.3 -> 37.2 / 37.3, 32768 70.2 / 69.6 ->
//     60.5 / 59.6 (rate 2,446-2,458 -> 3,199-3,299 GB/s, per-call part 8.3-8.7 -> 13.3-13.9 us);
//   LayerNorm 1024 wide: 2048 rows 13.7 -> 13.9 (bench_ops), 8192 29.3 / 28.8 -> 28.4 / 28.4, 16384 47.2 / 46.9 ->
//     44.0 / 43.8, 32768 80.7 / 79.9 -> 72.4 / 72.7;
//   embeddings (dropout 0.1) 768 wide: 2048 rows 11.1 / 11.1 -> 13.6 / 13.7, 8192 26.6 / 26.5 -> 28.3 / 28.5, 12288
//     36.7 / 36.8 -> 34.8 / 35.0, 16384 46.2 / 45.9 -> 40.8 / 40.7; 1024 wide: 2048 rows 14.1 / 14.2 -> 13.8 / 14.4,
//     8192 37.3 / 37.5 -> 32.6 / 32.8, 16384 64.2 / 64.6 -> 53.1 / 54.2.
// So by default from session 69: 32 elements a thread (776-1024 wide) at every row count, 24 (768 wide) from 10,240
// rows (a second call, b2b23e2, rows between: LayerNorm 10240x768 28.5 / 29.3 -> 28.1 / 28.5, embeddings 32.7 / 34.2 ->
// 29.9 / 29.9; ln_bwd_sweep_colsum_b2b23e2.log). At 768 wide the register kernel on two blocks per SM (bwd_two_blocks,
// session 71) then beat it at every row count from 8,192 to 32,768: H200, three alternated rounds, shared-memory
// accumulators -> two-block register kernel (ln_bwd_sweep_smem_acc_vs_two_blocks_b2b1adc.log), us: LayerNorm 10240x768
// 27.5 / 27.8 / 27.4 -> 23.9 / 23.9 / 23.9, 16384 36.2 / 36.2 / 35.6 -> 32.9 / 32.7 / 32.7, 32768 58.0 / 59.2 / 58.1 ->
// 54.8 / 55.0 / 55.0 (rate 3,060-3,166 -> 3,278-3,314 GB/s, per-call part 11.3-11.6 -> 9.7-9.9 us); embeddings
// (dropout 0.1) 10240x768 32.3 / 32.4 / 31.5 -> 27.9 / 27.7 / 27.8, 16384 42.0 / 42.7 / 41.6 -> 38.2 / 38.3 / 38.4,
// 32768 72.1 / 72.4 / 71.2 -> 64.2 / 64.4 / 64.4. So by default now at 32 elements a thread only (776-1024 wide, every
// row count). RMSNorm's register kernel already streams at 85-91% of copy: not taken. BERTACCEL_LN_BWD_SMEM_ACC=1: at
// 24 elements too and at every row count (for comparing); =0: never. Read once per process.
// Tried for 384-wide rows too (two a warp, where the register kernel holds one block per SM at 146 registers and
// streams at 43% of copy; session 70, docs/tried/ln-bwd-smem-acc-384.patch, h200/ln_bwd_sweep_smem_acc_384_744b3b0.log):
// the rate rose to 46-52% and the per-call part by 4.5-6 us - LayerNorm 16384x384 21.4 / 21.1 -> 21.9 / 21.8 us,
// 8192x384 10.7 / 10.5 -> 13.2 / 13.2, embeddings 24.8 / 25.2 -> 26.0 / 25.7. Not kept.
// From session 72 the plain LayerNorm's rows of 32 elements a thread take the two-block register kernel instead from
// kTwoBlocks32RowsPlain rows (see there).
template <int MODE>
inline bool bwd_smem_acc(int elems_per_thread, int64_t rows) {
  static const int setting = env_switch("BERTACCEL_LN_BWD_SMEM_ACC", -1);
  if (setting >= 0) return setting != 0;
  return elems_per_thread >= 32 && !(MODE == kPlain && rows >= kTwoBlocks32RowsPlain);
}

// Blocks for a backward kernel's grid-stride loop over `units` work units (a warp's row group, or the register kernel's
// block row group), `per_block` units a block takes a step: as many as fit (`fit` resident blocks). Tried (session 70,
// H200, docs/tried/ln-bwd-balanced-grid.patch): the fewest blocks with the same number of steps (16384x768 shared-
// memory kernel: 342 blocks, every warp six rows, instead of 396 where 536 warps take a sixth row alone) - the
// embeddings' backward 16384x768 41.9 / 41.1 -> 44.9 / 46.1 us, the rest within the spread: fewer warps in flight
// cost more than the ragged last step.
// Also tried (session 70, docs/tried/ln-bwd-grid-percent.patch): half or a quarter of the resident blocks at
// 2,048-16,384 rows, for fewer partial rows to sum where the per-call part is most of the call - slower nearly
// everywhere (LayerNorm 2048x768 9.7 / 10.2 -> 11.6 at half, 16384x768 36.9 / 37.6 -> 50.7): rows in flight win.
inline int64_t bwd_blocks(int64_t units, int64_t fit, int per_block) {
  return std::min<int64_t>((units + per_block - 1) / per_block, std::max<int64_t>(fit, 1));
}

// dz (and dh: kFused), dgamma, dbeta (not kRms), dbias (kFused).
// dy2 (defined: layer_norm_bwd2, the fused form): a second part of the output's gradient, summed into dy as the
// prefetching kernel loads it, or added to dy first where another kernel runs.
template <int MODE, typename T, typename W>
void launch_bwd(const at::Tensor& dy, const at::Tensor& z, const at::Tensor& gamma, const at::Tensor& mean,
                const at::Tensor& rstd, at::Tensor& dz, at::Tensor& dh, at::Tensor& dgamma, at::Tensor& dbeta,
                at::Tensor& dbias, double p, const at::Tensor& rng, const at::Tensor& dy2 = at::Tensor()) {
  const int64_t H = z.size(-1);
  const int64_t rows = H > 0 ? z.numel() / H : 0;
  if (rows == 0) {
    for (at::Tensor* t : {&dgamma, &dbeta, &dbias})
      if (t->defined()) t->zero_();
    return;
  }
  constexpr int max_vec = 16 / sizeof(T);
  const int vec = pick_vec(H, max_vec, {&dy, &z, &dz, &dh, &gamma, &dy2});  // (dy2 read by 16-byte copies too)
  // The fused form's register-held accumulators took the fewest vectors per thread (see pick_items);
  // the prefetching kernel keeps them in shared memory and takes the usual rule.
  const bool prefetch = MODE == kFused && sizeof(T) == 2 && vec == max_vec &&
                        H <= (bwd_prefetch_1024(dy2.defined(), rows) ? 1024 : 768) && bwd_prefetch_enabled();
  const int items = pick_items((int)(H / vec), vec, max_vec, MODE == kFused && !prefetch);
  const int tpr = pick_tpr((int)(H / vec), items);
  BERTACCEL_CHECK(tpr <= kBwdThreads, "bertaccel layer_norm: hidden size %lld is above %d", (long long)H,
                  (int)(kBwdThreads * kMaxElemsPerThread));
  const bool prefetching = prefetch && tpr <= 32 && items <= 4;  // the prefetching kernel runs (below)
  if (dy2.defined() && !prefetching) {  // (only it sums dy2 as it loads)
    launch_bwd<MODE, T, W>(dy.add(dy2), z, gamma, mean, rstd, dz, dh, dgamma, dbeta, dbias, p, rng);
    return;
  }
  const int rpb = kBwdThreads / tpr;
  const int64_t groups = (rows + rpb - 1) / rpb;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  auto opts = z.options().dtype(at::kFloat);
  auto stream = at::cuda::getCurrentCUDAStream();
  T* dhp = dh.defined() ? (T*)dh.data_ptr() : nullptr;
  const float* meanp = mean.defined() ? mean.data_ptr<float>() : nullptr;
  const int64_t* rngp = p > 0 ? rng.data_ptr<int64_t>() : nullptr;
  // Every backward kernel takes the same arguments and writes one fp32 partial row per block for each
  // weight gradient: `run` allocates those, launches `kernel` on `blocks` blocks and adds the rows up.
  // (`extra`: the prefetching kernel's dy2 pointer)
  auto run = [&](auto kernel, int smem, int blocks, auto... extra) {
    at::Tensor pg = at::empty({blocks, H}, opts), pb, ph;
    if (dbeta.defined()) pb = at::empty({blocks, H}, opts);
    if (dbias.defined()) ph = at::empty({blocks, H}, opts);
    launch_dependent(kernel, dim3(blocks), dim3(kBwdThreads), smem, stream, (const T*)dy.data_ptr(),
                     (const T*)z.data_ptr(), (const W*)gamma.data_ptr(), meanp, rstd.data_ptr<float>(), (T*)dz.data_ptr(),
                     dhp, pg.data_ptr<float>(), pb.defined() ? pb.data_ptr<float>() : nullptr,
                     ph.defined() ? ph.data_ptr<float>() : nullptr, rows, (int)H, tpr, (float)p, rngp, extra...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    launch_column_sums({{&pg, &dgamma}, {&pb, &dbeta}, {&ph, &dbias}}, blocks, (int)H, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
// KERNEL, with SMEM bytes of dynamic shared memory, over UNITS warp row groups on as many blocks as are resident at once
// (bwd_blocks; its own occupancy cache: one per expansion); the rest: the kernel's arguments after the common ones
#define BA_LN_BWD_RUN_SMEM(KERNEL, SMEM, UNITS, ...)                                                      \
  do {                                                                                                    \
    static int per_sm[64] = {};                                                                           \
    const int64_t fit = (int64_t)sms * ring_blocks_per_sm(KERNEL, kBwdThreads, SMEM, z.get_device(), per_sm); \
    run(KERNEL, SMEM, (int)bwd_blocks(UNITS, fit, kBwdRingWarps), ##__VA_ARGS__);                         \
  } while (0)
  // The prefetching kernel where it measured faster (H100, 16384 rows, bf16, same run, 528e565): the
  // fused residual form at 384 and 768 wide, 32.7 vs 34.5 us and 53.0 vs 55.9 (the ring). Plain
  // LayerNorm and RMSNorm measured even (23.1 vs 23.3, 40.7 vs 40.3; 36.6 vs 36.3) and keep the
  // kernels below - unless BERTACCEL_LN_BWD_PREFETCH_PLAIN=1 (bwd_prefetch_plain), bf16 rows within a warp; at 1024
  // wide (4 vectors per thread) it spilled at 128 registers and lost (75.4 vs 70.2).
  if constexpr ((MODE == kFused || MODE == kPlain || MODE == kRms) && sizeof(T) == 2) {  // bf16 rows, 16-byte vectors
    if (prefetching || (MODE != kFused && vec == max_vec && tpr <= 32 && items <= 4 && bwd_prefetch_plain())) {
#define BA_LN_BWD_PREFETCH_K(V, I, DY2)                                                                   \
  do {                                                                                                    \
    auto kernel = ln_bwd_prefetch_kernel<T, W, V, I, MODE, DY2>;                                          \
    constexpr int smem = bwd_prefetch_smem<MODE, V, I, DY2>();                                            \
    const int64_t warp_groups = (rows + 32 / tpr - 1) / (32 / tpr);                                       \
    BA_LN_BWD_RUN_SMEM(kernel, smem, warp_groups, DY2 ? (const T*)dy2.data_ptr() : (const T*)nullptr);   \
  } while (0)
#define BA_LN_BWD_PREFETCH(V, I)                                                                          \
  do {                                                                                                    \
    if constexpr (V == max_vec && I <= 4) {                                                               \
      if constexpr (MODE == kFused) { /* (only the fused form takes a second gradient) */                 \
        if (dy2.defined()) BA_LN_BWD_PREFETCH_K(V, I, true);                                              \
        else BA_LN_BWD_PREFETCH_K(V, I, false);                                                           \
      } else {                                                                                            \
        BA_LN_BWD_PREFETCH_K(V, I, false);                                                                \
      }                                                                                                   \
    }                                                                                                     \
  } while (0)
      BA_DISPATCH_VEC_ITEMS(sizeof(T), vec, items, BA_LN_BWD_PREFETCH);
#undef BA_LN_BWD_PREFETCH
#undef BA_LN_BWD_PREFETCH_K
      return;
    }
  }
  // The plain LayerNorm's (and the embeddings') 768-1024-wide bf16 rows (24-32 elements a thread, one warp a row)
  // through the prefetching kernel without its next rows (NEXT = false): the accumulators in shared memory, two blocks
  // per SM at 1024 wide where the register kernel below holds one (three at 768, where the two-block register kernel
  // measured faster); where bwd_smem_acc says (measured there).
  if constexpr ((MODE == kPlain || MODE == kEmb) && sizeof(T) == 2) {
    if (vec == max_vec && items * vec >= 24 && tpr == 32 && bwd_smem_acc<MODE>(items * vec, rows)) {
#define BA_LN_BWD_SMEM_ACC(V, I)                                                                          \
  do {                                                                                                    \
    if constexpr (V == max_vec && I * V >= 24) {                                                          \
      auto kernel = ln_bwd_prefetch_kernel<T, W, V, I, MODE, false, false>;                               \
      constexpr int smem = bwd_prefetch_smem<MODE, V, I, false>();                                        \
      BA_LN_BWD_RUN_SMEM(kernel, smem, rows, (const T*)nullptr); /* one row a warp (tpr == 32) */         \
    }                                                                                                     \
  } while (0)
      BA_DISPATCH_VEC_ITEMS(sizeof(T), vec, items, BA_LN_BWD_SMEM_ACC);
#undef BA_LN_BWD_SMEM_ACC
      return;
    }
  }
  // The ring where it measured faster (H100, 16384 rows, bf16, same run, rings on vs off): the fused
  // residual form at 768 and 1024 wide (56.3 vs 61.8 us, 70.8 vs 73.6). It lost for plain LayerNorm
  // (43.5 vs 42.0 at 768), RMSNorm (39.9 vs 37.0) and the fused form at 384 (36.9 vs 34.4): those keep
  // the kernel above, which holds the row in registers instead of reading it twice from shared memory.
  if constexpr (MODE == kFused && sizeof(T) == 2) {  // (only these forms are instantiated)
    if (vec == max_vec && tpr == 32 && items * vec >= 24 && ring_enabled()) {  // one 768-1024-wide row per warp
#define BA_LN_BWD_RING(V, I)                                                                              \
  do {                                                                                                    \
    if constexpr (V == max_vec && I * V >= 24) {                                                          \
      auto kernel = ln_bwd_ring_kernel<T, W, V, I, MODE>;                                                 \
      constexpr int smem = bwd_ring_stages<I>() * bwd_ring_stage_bytes<I>();                              \
      static_assert(smem >= kBwdThreads * I * V * 4, "the column partials are parked in the ring");      \
      BA_LN_BWD_RUN_SMEM(kernel, smem, rows); /* one row a warp (tpr == 32) */                            \
    }                                                                                                     \
  } while (0)
      BA_DISPATCH_VEC_ITEMS(sizeof(T), vec, items, BA_LN_BWD_RING);
#undef BA_LN_BWD_RING
      return;
    }
  }
// the register kernel KERNEL on as many blocks as are resident at once, at most MAX_PER_SM a SM (its own static:
// one per expansion; kAnyBlocksPerSm: no cap)
  constexpr int kAnyBlocksPerSm = 1 << 30;
#define BA_LN_BWD_RESIDENT(KERNEL, MAX_PER_SM)                                                            \
  do {                                                                                                    \
    static const int per_sm = [] { /* resident blocks per SM: registers and shared memory decide */     \
      int n = 1;                                                                                          \
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, KERNEL, kBwdThreads, 0));          \
      return n;                                                                                           \
    }();                                                                                                  \
    run(KERNEL, 0, (int)bwd_blocks(groups, (int64_t)sms * std::min(std::max(per_sm, 1), MAX_PER_SM), 1)); \
  } while (0)
  // Where bwd_two_blocks decides (bwd_two_blocks_form), it decides blocks per SM, not only registers: the plain
  // LayerNorm's one-block instantiation at 24 elements fits two blocks by itself since the bf16 words are unpacked
  // whole (120 registers), and below the two-block thresholds one block per SM is what measured faster (session 72).
#define BA_LN_BWD(V, I)                                                                                   \
  do {                                                                                                    \
    if constexpr (bwd_two_blocks_form<MODE, T>(I * V)) {                                                  \
      if (bwd_two_blocks<MODE, T>(I * V, V, tpr, rows)) {                                                 \
        BA_LN_BWD_RESIDENT((ln_bwd_kernel<T, W, V, I, MODE, 2>), 2);                                      \
      } else {                                                                                            \
        BA_LN_BWD_RESIDENT((ln_bwd_kernel<T, W, V, I, MODE>), 1);                                         \
      }                                                                                                   \
      break;                                                                                              \
    }                                                                                                     \
    BA_LN_BWD_RESIDENT((ln_bwd_kernel<T, W, V, I, MODE>), kAnyBlocksPerSm);                               \
  } while (0)
  BA_DISPATCH_VEC_ITEMS(sizeof(T), vec, items, BA_LN_BWD);
#undef BA_LN_BWD
#undef BA_LN_BWD_RESIDENT
#undef BA_LN_BWD_RUN_SMEM
}

// gamma's dtype (float32, or bf16 beside bf16 activations) picks W. kEmb takes float32 only.
template <int MODE, typename... Args>
void launch_bwd_any(const at::Tensor& dy, const at::Tensor& z, const at::Tensor& gamma, Args&&... args) {
  BERTACCEL_CHECK(gamma.scalar_type() == at::kFloat || gamma.scalar_type() == z.scalar_type(),
                  "bertaccel: weight must be float32 or the input's dtype, got %s", c10::toString(gamma.scalar_type()));
  check_cuda_contiguous(gamma, "weight");
  TORCH_CHECK(gamma.numel() == z.size(-1) && gamma.device() == z.device(),
              "bertaccel: the weight must have the input's last size and device");
  if (dy.scalar_type() == at::kBFloat16) {
    if (gamma.scalar_type() == at::kFloat) {
      launch_bwd<MODE, __nv_bfloat16, float>(dy, z, gamma, std::forward<Args>(args)...);
    } else {
      if constexpr (MODE != kEmb) launch_bwd<MODE, __nv_bfloat16, __nv_bfloat16>(dy, z, gamma, std::forward<Args>(args)...);
      else TORCH_CHECK(false, "bertaccel embeddings: the LayerNorm weight must be float32");
    }
  } else {
    launch_bwd<MODE, float, float>(dy, z, gamma, std::forward<Args>(args)...);
  }
}

inline at::Tensor checked_grad(const at::Tensor& dy_in, const at::Tensor& z) {
  at::Tensor dy = dy_in.contiguous();
  check_cuda_contiguous(z, "saved input");
  TORCH_CHECK(z.scalar_type() == at::kBFloat16 || z.scalar_type() == at::kFloat,
              "bertaccel: saved input must be bfloat16 or float32");
  TORCH_CHECK(dy.sizes() == z.sizes() && dy.scalar_type() == z.scalar_type() && dy.device() == z.device(),
              "bertaccel: grad must match the input");
  return dy;
}

}  // namespace
}  // namespace bertaccel

#undef BA_PARK_AND_SUM
