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
// statistics per row; ~8 FLOPs per element. The linear bias (one row, read through L1) is of the
// LayerNorm weight's type W, as the weight and its bias are: BERT's fp32 master biases are read as
// they are, with no cast kernel per call (linear_bias_as).
//
// Two kernels: rows up to 1024 wide with 16-byte aligned tensors run the persistent row ring
// (`ln_fwd_ring_kernel`, below: 78-91% of the copy ceiling on the H100 against 73-82% for the one-row
// kernel); wider rows and unaligned or odd-width views run the one-row-per-thread-group kernel
// (`ln_fwd_kernel`), which the description above is of. Both compute the same statistics the same way.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <type_traits>

#include "common.cuh"

namespace bertaccel {
namespace {

constexpr int kThreads = 256;

// ROWS rows per thread group at once: the loads of all ROWS rows are in flight before the first
// reduction. The weight, its bias and the linear bias are of type W (float32, or the activation type
// under bf16-true). RMS: RMSNorm (no centring, no bias); it reads its weight into registers once, while
// the row's loads are in flight. LayerNorm reads weight and bias after the statistics, from L1:
// holding both in registers (48 more for a 768-wide row) cost occupancy and measured slower
// (16384 x 768 bf16: 66% of the copy ceiling against RMSNorm's 86% in the same run).
template <typename T, typename W, int VEC, int ITEMS, int ROWS, bool RMS>
__global__ void __launch_bounds__(kThreads) ln_fwd_kernel(
    const T* __restrict__ x, const W* __restrict__ bias, const T* __restrict__ residual,
    const W* __restrict__ gamma, const W* __restrict__ beta, T* __restrict__ y, T* __restrict__ z,
    float* __restrict__ mean_out, float* __restrict__ rstd_out, int64_t rows, int H, int tpr, float eps,
    float p, at::PhiloxCudaState philox, int64_t* __restrict__ rng_out) {
  __shared__ float red[ROWS * (kThreads / 32)];
  begin_dependent_kernel();
  const int nvec = H / VEC;
  const int rpb = kThreads / tpr;  // row slots per block
  const int local_row = threadIdx.x / tpr;
  const int t = threadIdx.x % tpr;
  const DropoutSeed rng = launch_dropout_seed(p, philox, rng_out);
  const uint64_t seed = rng.seed, offset = rng.offset;
  const float scale = p > 0.f ? 1.f / (1.f - p) : 1.f;

  int64_t row[ROWS];
  bool active[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    row[r] = ((int64_t)blockIdx.x * ROWS + r) * rpb + local_row;
    active[r] = row[r] < rows;
  }
  float v[ROWS][ITEMS][VEC];
  constexpr bool kHoist = RMS;  // RMSNorm reads its weights with the row, before the statistics
  float g[kHoist ? ITEMS : 1][VEC];
  if constexpr (kHoist && VEC * sizeof(T) == 16) {
    // Every 16-byte load (row and weights) is issued before any is converted. Converting each as it
    // was loaded let ptxas give three of the four row loads of a 4096-wide RMSNorm one register
    // quad, each waiting for the conversion of the one before (SASS via nvdisasm: 9 of 12 loads in
    // flight with fp32 weights, 2 of 8 with bf16 weights; that build measured 145.5 us at 16384 x 4096
    // against 111.5 for an earlier build with all 12). LayerNorm (weights read after the
    // statistics) had all its row loads in flight already, and narrower vectors are left as they were.
    Pack<T, VEC> raw[ROWS][ITEMS];
    Pack<W, VEC> graw[ITEMS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
      for (int k = 0; k < ITEMS; ++k) {
        const int c = t + k * tpr;
        if (active[r] && c < nvec) raw[r][k] = *reinterpret_cast<const Pack<T, VEC>*>(x + row[r] * H + (int64_t)c * VEC);
      }
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int c = t + k * tpr;
      if (c < nvec) graw[k] = *reinterpret_cast<const Pack<W, VEC>*>(gamma + c * VEC);
    }
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
#pragma unroll
      for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[r][k][j] = to_f(raw[r][k].v[j]);
#pragma unroll
      for (int j = 0; j < VEC; ++j) g[k][j] = to_f(graw[k].v[j]);
    }
  } else {
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
      for (int k = 0; k < ITEMS; ++k) {
        const int c = t + k * tpr;
        if (active[r] && c < nvec) load_f<T, VEC>(x + row[r] * H + (int64_t)c * VEC, v[r][k]);
      }
    if constexpr (kHoist) {
#pragma unroll
      for (int k = 0; k < ITEMS; ++k) {
        const int c = t + k * tpr;
        if (c < nvec) load_f<W, VEC>(gamma + c * VEC, g[k]);
      }
    }
  }
  float sum[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    sum[r] = 0.f;
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int c = t + k * tpr;
      if (!(active[r] && c < nvec)) continue;
      const int64_t off = row[r] * H + (int64_t)c * VEC;
      if (bias != nullptr) {
        float bb[VEC];
        load_f<W, VEC>(bias + c * VEC, bb);
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[r][k][j] += bb[j];
      }
      if (p > 0.f) {
        bool keep[VEC];
        dropout_keep<VEC>(seed, offset, off, p, keep);
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[r][k][j] = keep[j] ? v[r][k][j] * scale : 0.f;
      }
      if (residual != nullptr) {
        float rr[VEC];
        load_f<T, VEC>(residual + off, rr);
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[r][k][j] += rr[j];
      }
      if (z != nullptr || p > 0.f) {
        // The backward sees z in T: normalise exactly what is saved, so both passes agree; with dropout the
        // output-only form (no z) rounds the same way, so a no-grad call gives the training forward's bits.
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[r][k][j] = to_f(from_f<T>(v[r][k][j]));
        if (z != nullptr) store_f<T, VEC>(z + off, v[r][k]);
      }
#pragma unroll
      for (int j = 0; j < VEC; ++j) sum[r] += v[r][k][j];
    }
  }
  const float inv_h = 1.f / (float)H;
  float mean[ROWS];
  if (RMS) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) mean[r] = 0.f;
  } else {
    row_reduce_rows<ROWS>(sum, tpr, red, local_row, SumOp());
#pragma unroll
    for (int r = 0; r < ROWS; ++r) mean[r] = sum[r] * inv_h;
  }
  float sq[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    sq[r] = 0.f;
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int c = t + k * tpr;
      if (active[r] && c < nvec)
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float d = v[r][k][j] - mean[r];
          sq[r] += d * d;
        }
    }
  }
  row_reduce_rows<ROWS>(sq, tpr, red, local_row, SumOp());
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    if (!active[r]) continue;
    const float rstd = rsqrtf(sq[r] * inv_h + eps);
    if (t == 0) {
      if (mean_out != nullptr) mean_out[row[r]] = mean[r];
      if (rstd_out != nullptr) rstd_out[row[r]] = rstd;
    }
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int c = t + k * tpr;
      if (c < nvec) {
        float o[VEC];
        if constexpr (kHoist) {
#pragma unroll
          for (int j = 0; j < VEC; ++j) o[j] = v[r][k][j] * rstd * g[k][j];
        } else {
          float gg[VEC], bb[VEC];
          load_f<W, VEC>(gamma + c * VEC, gg);
          load_f<W, VEC>(beta + c * VEC, bb);
#pragma unroll
          for (int j = 0; j < VEC; ++j) o[j] = (v[r][k][j] - mean[r]) * rstd * gg[j] + bb[j];
        }
        store_f<T, VEC>(y + row[r] * H + (int64_t)c * VEC, o);
      }
    }
  }
}

// ------------------------------------------------------------------------ the row ring (persistent)
// For the widths BERT uses (a row of at most 32 vectors of 16 bytes per lane: 1024 bf16 or fp32) and
// 16-byte aligned tensors. A persistent grid (as many blocks as fit); each warp owns one row at a
// time and walks the rows first, first + W, ... (W warps in the grid). The warp's rows reach shared
// memory through a ring of S stages of cp.async copies, issued S rows ahead, so S rows per warp are
// in flight without holding them in registers (16 warps per SM x 2 rows x 1.5 KB = 48 KB in flight on
// an SM for a 768-wide bf16 row, against one row per warp in the one-row-per-thread-group kernel
// above; S = fwd_ring_stages, below). Weight and bias are read into registers once per warp, before
// the row loop. Each lane reads back only the 16-byte slots it copied itself: no barrier anywhere,
// warps run free.
// TPR: lanes per row, 32 or 16. With 16 each half-warp owns its own rows (a warp works on two at a
// time, the shuffles of both reductions in the same instructions): a 384-wide bf16 row is 48 vectors,
// 3 per lane on 16 lanes against 2 on 32 with a quarter of them idle, and each row's chain of
// reductions is one shuffle shorter (the residual form from a row count: see the dispatch). Both halves
// run every trip of the loop (the reductions' shuffles need the whole warp); a half past the last row
// copies and stores nothing.
constexpr int kRingWarps = kThreads / 32;

template <int ITEMS, bool RES>
constexpr int ring_stage_bytes() { return kRingWarps * ITEMS * kRingItemBytes * (RES ? 2 : 1); }
// Two ring stages: two rows in flight per warp (four for half-warp rows, a stage holding two), except the float32
// LayerNorm and RMSNorm of 768-1024-wide rows (below). More asked for too much of the input at once: with four,
// 2,112 warps of an H200 requested 8,448 whole-warp rows (half of a 16384-row input) or 16,896 half-warp rows (all of
// it) before the first row was written, and reads and writes stopped overlapping. Measured (H200, bf16, no grad,
// 16384 rows, two alternated rounds, us, 4 / 3 / 2 stages; h200/ln_fwd_sweep_stages_d48e50f.log,
// h200/ln_fwd_sweep_half_warp_stages_cddd886.log): the residual form 768 wide 26.0-26.1 / 24.9-25.1 / 23.4, with
// p = 0.1 30.8 / 28.9-29.6 / 26.7-26.8; 1024 wide 33.3 / 33.2-33.3 / 31.5-31.6; RMSNorm 768 13.4-13.5 / 13.5-13.6 /
// 13.2-13.3, 1024 19.0 / 18.4-18.6 / 18.4; LayerNorm 768 13.9 / 13.8-14.0 / 13.6, 384 on half warps 8.6-8.7 /
// 8.0-8.2 / 7.4; at 2,048-8,192 rows level. The softmax ring runs two stages too (softmax.cu).
constexpr int kFwdRingStages = 2;
// float32 rows (session 75, h200/ln_fwd_sweep_fp32_stages_s75b.log, us, up to four / two stages): the residual form
// gains from two (384 wide 23.3 / 21.2-21.3, p = 0.1 26.0-26.1 / 23.4-23.6; 768 and 1024 level), as do LayerNorm and
// RMSNorm at 384 (13.2 / 13.0-13.1, 12.6 / 12.5), but those two lose at 768-1024 (LayerNorm 1024 35.0 / 36.4, RMSNorm
// 1024 34.2-34.5 / 36.0, RMSNorm 768 25.9-26.1 / 26.7): there they keep up to four stages in 96 KB a block (24-32 KB
// stages: four at 768, three at 1024), the rule before session 74. Checked against two everywhere in one call
// (h200/ln_fwd_sweep_fp32_wide_four_stages_8a4a32e.log, us, this rule / two): LayerNorm 1024 35.4 / 35.9-36.4,
// RMSNorm 1024 34.7-34.9 / 36.1-36.7, RMSNorm 768 26.0-26.3 / 26.6, LayerNorm 768 26.2-26.5 / 26.6.
constexpr int kFp32WideRingBudget = 96 * 1024;

template <typename T, int ITEMS, bool RES>
constexpr int fwd_ring_stages() {
  if constexpr (sizeof(T) == 4 && !RES && ITEMS >= 6) {
    constexpr int st = kFp32WideRingBudget / ring_stage_bytes<ITEMS, RES>();  // 4 at 6 items, 3 at 8
    static_assert(st >= 2 && st <= 4, "float32 wide rows: two to four stages in the budget");
    return st;
  }
  return kFwdRingStages;
}

// FAST: a row of exactly ITEMS vectors a lane (every BERT width: 384 on half warps, 768, 1024), so that no item is
// tested against the row's width, with the dropout and the saved sum known at compile time (FEATS: kFastDropout |
// kFastZ) instead of tested per item: the LayerNorm and RMSNorm forward (FEATS 0) and, since session 81, BERT's
// residual forms - bias + residual (inference), + the saved sum (training), + dropout. The linear bias stays a per-row
// test: known at compile time, ptxas hoisted its loads and the 1024-wide residual kernels spilled 88 bytes at 128
// registers (offline, nvcc 13), where they now fit (see fast_residual_fits for the few that still do not).
constexpr int kFastDropout = 1, kFastZ = 2;

// The FAST residual kernels that fit 128 registers without spilling (offline, nvcc 13, sm_90): not the 1024-wide
// rows with dropout (bf16 12 bytes spilled, float32 56), the float32 1024-wide inference form (12) or float32 768-wide
// dropout without the saved sum (4); those keep the general kernel.
template <typename T, int ITEMS, int FEATS>
constexpr bool fast_residual_fits() {
  constexpr bool dropout = (FEATS & kFastDropout) != 0, z = (FEATS & kFastZ) != 0;
  if constexpr (sizeof(T) == 2) return !(ITEMS == 4 && dropout);
  else return !(ITEMS == 8 && (dropout || !z)) && !(ITEMS == 6 && dropout && !z);
}
template <typename T, typename W, int VEC, int ITEMS, bool RMS, bool RES, int TPR, bool FAST = false, int FEATS = 0>
__global__ void __launch_bounds__(kThreads, 2) ln_fwd_ring_kernel(
    const T* __restrict__ x, const W* __restrict__ bias, const T* __restrict__ residual,
    const W* __restrict__ gamma, const W* __restrict__ beta, T* __restrict__ y, T* __restrict__ z,
    float* __restrict__ mean_out, float* __restrict__ rstd_out, int64_t rows, int H, float eps,
    float p, at::PhiloxCudaState philox, int64_t* __restrict__ rng_out) {
  static_assert(VEC * sizeof(T) == 16, "the ring copies 16-byte vectors");
  static_assert(TPR == 32 || TPR == 16, "a row on a warp or on half of one");
  static_assert(FAST || FEATS == 0, "FEATS names a FAST kernel's parts");
  const int Hr = FAST ? ITEMS * TPR * VEC : H;  // the row's width, a constant for FAST rows
  // what a FAST row carries, known at compile time (the general kernel tests the arguments where they are used, as
  // before session 81: its code is unchanged); the plain FAST kernels have no bias, the residual ones test it
  constexpr bool kDropout = (FEATS & kFastDropout) != 0, kZ = (FEATS & kFastZ) != 0;
  constexpr int kRowsPerWarp = 32 / TPR;
  constexpr int S = fwd_ring_stages<T, ITEMS, RES>();
  constexpr int kStage = ITEMS * kRingItemBytes * (RES ? 2 : 1);  // one warp's rows (and residual rows)
  extern __shared__ __align__(16) unsigned char ring_smem[];
  begin_dependent_kernel();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int li = lane % TPR, sub = lane / TPR;  // lane within the row, the warp's row slot
  unsigned char* ring = ring_smem + warp * S * kStage + lane * 16;
  const int nvec = Hr / VEC;
  const int64_t first = ((int64_t)blockIdx.x * kRingWarps + warp) * kRowsPerWarp + sub;
  const int64_t stride = (int64_t)gridDim.x * kRingWarps * kRowsPerWarp;
  const DropoutSeed rng = launch_dropout_seed(p, philox, rng_out);
  const uint64_t seed = rng.seed, offset = rng.offset;
  const float scale = p > 0.f ? 1.f / (1.f - p) : 1.f;

  auto issue = [&](int64_t row, int stage) {  // copy row `row` (if any) into `stage`; one group either way
    if (row < rows) {
      unsigned char* dst = ring + stage * kStage;
#pragma unroll
      for (int k = 0; k < ITEMS; ++k) {
        const int c = li + k * TPR;
        if (FAST || c < nvec) {
          cp_async16(dst + k * kRingItemBytes, x + row * Hr + (int64_t)c * VEC);
          if constexpr (RES) cp_async16(dst + (ITEMS + k) * kRingItemBytes, residual + row * Hr + (int64_t)c * VEC);
        }
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int s = 0; s < S; ++s) issue(first + s * stride, s);

  float g[ITEMS][VEC], b[RMS ? 1 : ITEMS][VEC];  // weights: once per warp, while the first rows arrive
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    const int c = li + k * TPR;
    if (FAST || c < nvec) {
      load_f<W, VEC>(gamma + c * VEC, g[k]);
      if constexpr (!RMS) load_f<W, VEC>(beta + c * VEC, b[k]);
    }
  }
  const float inv_h = 1.f / (float)Hr;
  int stage = 0;
  const uint32_t threshold = dropout_threshold(p);
  // The loop runs while the warp's first slot has a row (the second's row is one more, or none).
  for (int64_t row = first; row - sub < rows; row += stride) {
    const bool active = kRowsPerWarp == 1 || row < rows;
    // The row's dropout draws depend on no data: make them while the row is still landing. Vector k's VEC
    // draws are 16-bit halves of one Philox call's words (dropout_keep's). Up to 3 vectors per lane (768-wide
    // bf16 rows, 384-wide fp32) the words are kept and each element's half compared where the element is used
    // (kDrawWords: packing keep bits first and testing them again cost two more integer instructions per
    // element, as in the attention kernels' draw_kept); wider rows keep one bit per element (the words, 4
    // registers per vector, made the 1024-wide kernels spill at the 128-register cap).
    constexpr bool kDrawWords = ITEMS <= 3;
    uint4 draws[kDrawWords ? ITEMS : 1];  // VEC == 4: the vector's two words in .x and .y
    uint32_t kept = 0xffffffffu;          // !kDrawWords: bit k * VEC + j: element j of vector k is kept
    if (FAST ? kDropout : p > 0.f) {
#pragma unroll
      for (int k = 0; k < ITEMS; ++k) {
        const int c = li + k * TPR;
        if (FAST || c < nvec) {
          const int64_t i0 = row * Hr + (int64_t)c * VEC;
          if constexpr (kDrawWords) {
            draws[k] = dropout_draws(seed, offset, (uint64_t)i0 >> 3);
            if constexpr (VEC == 4) {  // draws 0-3 or 4-7 of the group (H is a multiple of 4)
              if (i0 & 7) draws[k].x = draws[k].z, draws[k].y = draws[k].w;
            }
          } else {
            bool keep[VEC];
            dropout_keep<VEC>(seed, offset, i0, p, keep);
#pragma unroll
            for (int j = 0; j < VEC; ++j)
              if (!keep[j]) kept &= ~(1u << (k * VEC + j));
          }
        }
      }
    }
    cp_async_wait<S - 1>();  // this row's group (the oldest pending) has landed
    const unsigned char* src = ring + stage * kStage;
    float v[ITEMS][VEC];
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int c = li + k * TPR;
      if (!FAST && c >= nvec) continue;
      const int64_t off = row * Hr + (int64_t)c * VEC;
      load_f<T, VEC>(reinterpret_cast<const T*>(src + k * kRingItemBytes), v[k]);
      if ((!FAST || RES) && bias != nullptr) {
        float bb[VEC];
        load_f<W, VEC>(bias + c * VEC, bb);
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[k][j] += bb[j];
      }
      if (FAST ? kDropout : p > 0.f)
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          bool keep;
          if constexpr (kDrawWords) keep = half_draw(draws[kDrawWords ? k : 0], j) >= threshold;  // j known at compile time
          else keep = kept_bit(kept, k * VEC + j);
          v[k][j] = keep ? v[k][j] * scale : 0.f;
        }
      if constexpr (RES) {
        float rr[VEC];
        load_f<T, VEC>(reinterpret_cast<const T*>(src + (ITEMS + k) * kRingItemBytes), rr);
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[k][j] += rr[j];
      }
      if (FAST ? kZ || kDropout : z != nullptr || p > 0.f) {  // normalise exactly what is saved (with dropout also without z: see above)
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[k][j] = to_f(from_f<T>(v[k][j]));
        if ((FAST ? kZ : z != nullptr) && active) {
          if constexpr (FAST) store_f_v4<T, VEC>(z + off, v[k]);  // whole: see store_f_v4
          else store_f<T, VEC>(z + off, v[k]);
        }
      }
#pragma unroll
      for (int j = 0; j < VEC; ++j) sum += v[k][j];
    }
    // The stage is free once its values are consumed (the sum depends on all of them): refill it.
    issue(row + S * stride, stage);
    stage = stage + 1 == S ? 0 : stage + 1;
    const float mean = RMS ? 0.f : row_reduce(sum, TPR, nullptr, 0, SumOp()) * inv_h;
    float sq = 0.f;
#pragma unroll
    for (int k = 0; k < ITEMS; ++k)
      if (FAST || li + k * TPR < nvec)
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float d = v[k][j] - mean;
          sq += d * d;
        }
    const float rstd = rsqrtf(row_reduce(sq, TPR, nullptr, 0, SumOp()) * inv_h + eps);
    if (li == 0 && active) {
      if (mean_out != nullptr) mean_out[row] = mean;
      if (rstd_out != nullptr) rstd_out[row] = rstd;
    }
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int c = li + k * TPR;
      if ((FAST || c < nvec) && active) {
        float o[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          if constexpr (RMS)
            o[j] = v[k][j] * rstd * g[k][j];
          else
            o[j] = (v[k][j] - mean) * rstd * g[k][j] + b[k][j];
        }
        if constexpr (FAST) store_f_words<T, VEC>(y + row * Hr + (int64_t)c * VEC, o);
        else store_f<T, VEC>(y + row * Hr + (int64_t)c * VEC, o);
      }
    }
  }
  cp_async_wait<0>();
}

template <typename T, typename W, int VEC, int ITEMS, bool RMS, bool RES, int TPR, bool FAST = false, int FEATS = 0>
void launch_ring(const at::Tensor& x, const W* bp, const T* rp, const at::Tensor& gamma, const W* betap, at::Tensor& y,
                 T* zp, float* mp, float* rsp, int64_t rows, int H, double eps, double p,
                 const at::PhiloxCudaState& philox, int64_t* rngp, cudaStream_t stream) {
  auto kernel = ln_fwd_ring_kernel<T, W, VEC, ITEMS, RMS, RES, TPR, FAST, FEATS>;
  constexpr int stages = fwd_ring_stages<T, ITEMS, RES>();
  constexpr int smem = stages * ring_stage_bytes<ITEMS, RES>();
  const int device = x.get_device();
  const int sms = at::cuda::getDeviceProperties(device)->multiProcessorCount;
  static int blocks_per_sm[64] = {};  // this instantiation's, per device
  const int64_t fit = (int64_t)sms * ring_blocks_per_sm(kernel, kThreads, smem, device, blocks_per_sm);
  constexpr int kRowsPerBlock = kRingWarps * (32 / TPR);
  // balanced (common.cuh ring_grid_blocks) for rows wider than 768 on two stages, where it measured faster
  const int64_t blocks = ring_grid_blocks(rows, kRowsPerBlock, fit, H > 768 && stages == 2);
  launch_dependent(kernel, dim3((unsigned)blocks), dim3(kThreads), smem, stream, (const T*)x.data_ptr(), bp, rp,
                   (const W*)gamma.data_ptr(), betap, (T*)y.data_ptr(), zp, mp, rsp, rows, H, (float)eps, (float)p, philox,
                   rngp);
}

// Rows per thread group: 1, or the override BERTACCEL_LN_ROWS=2 (for tuning on other GPUs with
// scripts/ln_fwd_sweep.py). On the H100 (16384 rows, bf16, weights read after the statistics) two
// rows lost at every width: LayerNorm 1024 wide 32.6 us against 29.2, RMSNorm 38.5 against 27.9;
// four rows lost everywhere and are not built.
int pick_rows() {
  static const int rows = env_switch("BERTACCEL_LN_ROWS", 1) == 2 ? 2 : 1;
  return rows;
}

// Whether the forward ring puts a row on half a warp where its width allows (the dispatch): LayerNorm and
// RMSNorm always, the residual form from kHalfWarpResidualRows rows. BERTACCEL_LN_RING_HALF_WARP=0: never (every
// row on a whole warp, as before session 74); =1: the residual form at every row count too (for comparing; read
// once per process).
constexpr int64_t kHalfWarpResidualRows = 4096;
bool ring_half_warp(bool residual, int64_t rows) {
  static const int mode = env_switch("BERTACCEL_LN_RING_HALF_WARP", -1);
  if (mode == 0 || mode == 1) return mode == 1;
  return !residual || rows >= kHalfWarpResidualRows;
}

// -------------------------------------------------------------------------------- dispatch
// Outputs: y always; z (the pre-norm sum, fused form), mean (LayerNorm) and rstd when defined.
template <typename T, typename W, bool RMS>
void launch_fwd(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& residual, const at::Tensor& gamma,
                const at::Tensor& beta, at::Tensor& y, at::Tensor& z, at::Tensor& mean, at::Tensor& rstd, double eps,
                double p, at::Tensor& rng) {
  const int64_t H = x.size(-1);
  if (H == 0 || x.numel() == 0) {
    if (rng.defined()) rng.zero_();
    return;
  }
  const int64_t rows = x.numel() / H;
  constexpr int max_vec = 16 / sizeof(T);
  // Every vector access is checked: a weight sliced out of a flat fp32 buffer may be only 4-byte
  // aligned, and the kernel reads it VEC elements at a time.
  const int vec = pick_vec(H, max_vec, {&x, &bias, &residual, &y, &z, &gamma, &beta});
  const int items = pick_items((int)(H / vec), vec, max_vec);
  const int tpr = pick_tpr((int)(H / vec), items);
  BERTACCEL_CHECK(tpr <= kThreads, "bertaccel layer_norm: hidden size %lld is above %d", (long long)H,
                  (int)(kThreads * kMaxElemsPerThread));
  at::PhiloxCudaState philox;
  if (p > 0) {
    auto gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(std::nullopt, at::cuda::detail::getDefaultCUDAGenerator());
    std::lock_guard<std::mutex> lock(gen->mutex_);
    philox = gen->philox_cuda_state((uint64_t)((x.numel() + 3) / 4) * 4);
  }
  const int rpb = kThreads / tpr;
  const int nrows = vec == max_vec ? pick_rows() : 1;
  auto stream = at::cuda::getCurrentCUDAStream();
  const W* bp = bias.defined() ? (const W*)bias.data_ptr() : nullptr;  // in the weight's dtype (linear_bias_as)
  const T* rp = residual.defined() ? (const T*)residual.data_ptr() : nullptr;
  T* zp = z.defined() ? (T*)z.data_ptr() : nullptr;
  float* mp = mean.defined() ? mean.data_ptr<float>() : nullptr;
  float* rsp = rstd.defined() ? rstd.data_ptr<float>() : nullptr;
  const W* betap = beta.defined() ? (const W*)beta.data_ptr() : nullptr;
  int64_t* rngp = rng.defined() ? rng.data_ptr<int64_t>() : nullptr;

  // The ring: rows a warp holds (<= 32 vectors of 16 bytes per lane), every tensor 16-byte aligned.
  const int64_t nvec = H / vec;
  if (vec == max_vec && nvec <= 32 * (kMaxElemsPerThread / max_vec) && nrows == 1 && ring_enabled()) {
    const int need = (int)((nvec + 31) / 32);  // vectors per lane
    // A row on half a warp where that leaves fewer lanes idle and takes at most 3 vectors a lane: 384-wide bf16 rows
    // (48 vectors: 3 on 16 lanes, not 2 on 32 with 16 of the 64 slots empty), 128 and 320 wide; the residual form from
    // kHalfWarpResidualRows rows (ring_half_warp). Measured (H200, bf16, no grad, us, half / whole warp, both on four
    // stages then; h200/ln_fwd_sweep_half_warp_{03a2cfa,variants_aad2053}.log): 16384 x 384 LayerNorm 8.5-8.9 against
    // 9.1-9.3, RMSNorm 7.1-7.4 against 7.5-7.8; on two stages the half-warp rows run 7.3-7.4 and 6.8-7.0, whole-warp
    // rows 8.7-8.9 and 7.3-7.4 (session 75, h200/ln_fwd_sweep_whole_warp_two_stages_s75a.log: the two changes gain
    // together what neither does alone). The residual form on half warps (two stages) against whole
    // warps: 2,048 rows 4.0-4.2 against 3.5-3.6 (half as many warps, each with a longer chain: on whole warps below
    // kHalfWarpResidualRows); 4,096 rows 5.2 against 5.2-5.3 and 8,192 rows 7.7 against 8.3-8.4 (whole warps on four
    // stages; with p = 0.1 6.3-6.4 against 7.0-7.3 and 9.8-9.9 against 11.2-11.7;
    // h200/ln_fwd_sweep_stages_d48e50f.log).
    const int half_need = (int)((nvec + 15) / 16);
    const bool half = half_need <= 3 && half_need * 16 < need * 32 && ring_half_warp(rp != nullptr, rows);
#define BA_LN_RING(I, RES, TPR)                                                                                  \
  launch_ring<T, W, max_vec, I, RMS, RES, TPR>(x, bp, rp, gamma, betap, y, zp, mp, rsp, rows, (int)H, eps, p,    \
                                               philox, rngp, stream)
#define BA_LN_RING_ITEMS(RES)                                                                                    \
  do {                                                                                                           \
    if (half) {                                                                                                  \
      if (half_need == 1) BA_LN_RING(1, RES, 16);                                                                \
      else if (half_need == 2) BA_LN_RING(2, RES, 16);                                                           \
      else BA_LN_RING(3, RES, 16);                                                                               \
    } else if (need == 1) BA_LN_RING(1, RES, 32);                                                                \
    else if (need == 2) BA_LN_RING(2, RES, 32);                                                                  \
    else if (need == 3) BA_LN_RING(3, RES, 32);                                                                  \
    else if (need == 4 || max_vec == 8) BA_LN_RING(4, RES, 32);                                                  \
    else if constexpr (max_vec == 4) {                                                                           \
      if (need <= 6) BA_LN_RING(6, RES, 32); else BA_LN_RING(8, RES, 32);                                        \
    }                                                                                                            \
  } while (0)
    // Rows that fill their lanes' items exactly - every BERT width - through a FAST kernel (ln_fwd_ring_kernel): the
    // plain LayerNorm / RMSNorm (no residual, bias, dropout or saved sum), and BERT's residual LayerNorm with float32
    // weights - bias + residual, with the saved sum (training) or without (inference), with dropout or without.
    // BERTACCEL_LN_RING_FAST=0: never; =plain: the plain forms only (the rule before session 81).
    static const int fast_mode = [] {  // 0 never, 1 the plain forms, 2 the residual forms too
      const int choice = env_choice("BERTACCEL_LN_RING_FAST", {"1", "0", "plain"}, "setting (1, the default)");
      return choice == 0 ? 2 : choice == 1 ? 0 : 1;
    }();
#define BA_LN_RING_FAST(I, TPR, RES, FEATS)                                                                      \
  do {                                                                                                           \
    if constexpr (!RES || fast_residual_fits<T, I, FEATS>()) {                                                   \
      launch_ring<T, W, max_vec, I, RMS, RES, TPR, true, FEATS>(x, bp, rp, gamma, betap, y, zp, mp, rsp, rows,     \
                                                                (int)H, eps, p, philox, rngp, stream);           \
      C10_CUDA_KERNEL_LAUNCH_CHECK();                                                                            \
      return;                                                                                                    \
    }                                                                                                            \
  } while (0)
// the exact widths: I vectors a lane on TPR lanes (bf16 384 on half warps, 768, 1024; float32 384, 768, 1024)
#define BA_LN_RING_FAST_WIDTHS(RES, FEATS, HALF_OK)                                                              \
  do {                                                                                                           \
    if ((HALF_OK) && half && nvec == 3 * 16) BA_LN_RING_FAST(3, 16, RES, FEATS);                                 \
    if (!half && nvec == 3 * 32) BA_LN_RING_FAST(3, 32, RES, FEATS);                                             \
    if constexpr (max_vec == 8) {                                                                                \
      if (!half && nvec == 4 * 32) BA_LN_RING_FAST(4, 32, RES, FEATS);                                           \
    } else {                                                                                                     \
      if (!half && nvec == 6 * 32) BA_LN_RING_FAST(6, 32, RES, FEATS);                                           \
      if (!half && nvec == 8 * 32) BA_LN_RING_FAST(8, 32, RES, FEATS);                                           \
    }                                                                                                            \
  } while (0)
    if (fast_mode > 0 && rp == nullptr && bp == nullptr && zp == nullptr && p == 0) {
      // bf16 RMSNorm 384 (half warps) keeps the general kernel: on the H200 in session 80 FAST took 7.0-7.1 us at
      // 16384 rows against 6.8-7.0 (LayerNorm 384: 6.7-6.8 against 7.3; benchmarks/results/h200/ln_fwd_fast_sweep_s80.log)
      BA_LN_RING_FAST_WIDTHS(false, 0, !RMS);
    }
    if constexpr (!RMS && std::is_same_v<W, float>) {
      if (fast_mode > 1 && rp != nullptr && bp != nullptr) {
        if (zp != nullptr && p > 0) BA_LN_RING_FAST_WIDTHS(true, kFastDropout | kFastZ, true);
        if (zp != nullptr && p == 0) BA_LN_RING_FAST_WIDTHS(true, kFastZ, true);
        if (zp == nullptr && p > 0) BA_LN_RING_FAST_WIDTHS(true, kFastDropout, true);  // training mode, no grad
        if (zp == nullptr && p == 0) BA_LN_RING_FAST_WIDTHS(true, 0, true);
      }
    }
#undef BA_LN_RING_FAST_WIDTHS
#undef BA_LN_RING_FAST
    if constexpr (!RMS) {
      if (rp != nullptr) BA_LN_RING_ITEMS(true); else BA_LN_RING_ITEMS(false);
    } else {
      BA_LN_RING_ITEMS(false);
    }
#undef BA_LN_RING_ITEMS
#undef BA_LN_RING
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
#define BA_LN_FWD_R(V, I, R)                                                                                     \
  launch_dependent(ln_fwd_kernel<T, W, V, I, R, RMS>, dim3((unsigned)((rows + rpb * R - 1) / (rpb * R))),        \
                   dim3(kThreads), 0, stream, (const T*)x.data_ptr(), bp, rp, (const W*)gamma.data_ptr(), betap, \
                   (T*)y.data_ptr(), zp, mp, rsp, rows, (int)H, tpr, (float)eps, (float)p, philox, rngp)
#define BA_LN_FWD(V, I)                                                                                          \
  do {                                                                                                           \
    if constexpr (V == max_vec) {                                                                                \
      if (nrows == 2) BA_LN_FWD_R(V, I, 2); else BA_LN_FWD_R(V, I, 1);                                           \
    } else {                                                                                                     \
      BA_LN_FWD_R(V, I, 1);                                                                                      \
    }                                                                                                            \
  } while (0)
  BA_DISPATCH_VEC_ITEMS(sizeof(T), vec, items, BA_LN_FWD);
#undef BA_LN_FWD
#undef BA_LN_FWD_R
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void check_inputs(const at::Tensor& x, const at::Tensor& gamma, const at::Tensor* beta, const char* op) {
  check_cuda_contiguous(x, "input");
  BERTACCEL_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
                  "bertaccel %s: input must be bfloat16 or float32, got %s", op, c10::toString(x.scalar_type()));
  BERTACCEL_CHECK(gamma.scalar_type() == at::kFloat || gamma.scalar_type() == x.scalar_type(),
                  "bertaccel %s: weight must be float32 or the input's dtype, got %s", op, c10::toString(gamma.scalar_type()));
  BERTACCEL_CHECK(!beta || beta->scalar_type() == gamma.scalar_type(), "bertaccel %s: weight and bias must have one dtype, got %s and %s",
                  op, c10::toString(gamma.scalar_type()), c10::toString(beta->scalar_type()));
  BERTACCEL_CHECK(gamma.numel() == x.size(-1) && (!beta || beta->numel() == x.size(-1)),
                  "bertaccel %s: weight/bias size mismatch", op);
  check_cuda_contiguous(gamma, "weight");
  if (beta) check_cuda_contiguous(*beta, "bias");
  BERTACCEL_CHECK(gamma.device() == x.device() && (!beta || beta->device() == x.device()),
                  "bertaccel %s: weight and bias must be on the input's device %s", op, x.device().str().c_str());
}

void check_optional_inputs(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                           const std::optional<at::Tensor>& residual, double p) {
  // outside [0, 1) the 1 / (1 - p) scale would be silently wrong
  BERTACCEL_CHECK(p >= 0 && p < 1, "bertaccel layer_norm: dropout probability must be in [0, 1), got %g", p);
  if (bias) {
    check_cuda_contiguous(*bias, "bias");
    TORCH_CHECK((bias->scalar_type() == x.scalar_type() || bias->scalar_type() == at::kFloat) &&
                    bias->numel() == x.size(-1) && bias->device() == x.device(),
                "bertaccel: the linear bias must be float32 or the input's dtype, of the input's size, on its device");
  }
  if (residual) {
    check_cuda_contiguous(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type() &&
                residual->device() == x.device(), "bertaccel: residual must match the input in shape, dtype and device");
  }
}

// The linear bias in the kernel's weight type W (gamma's dtype), as the kernels read it: an fp32 master bias as it is
// (no cast kernel per call, and its gradient comes back in fp32 unrounded); a bias of another dtype widened or
// narrowed to W here (exact for a bf16 bias beside fp32 weights).
at::Tensor linear_bias_as(const std::optional<at::Tensor>& bias, const at::Tensor& gamma) {
  if (!bias) return at::Tensor();
  return bias->scalar_type() == gamma.scalar_type() ? *bias : bias->to(gamma.scalar_type()).contiguous();
}

template <bool RMS, typename... Args>
void launch_any(const at::Tensor& x, const at::Tensor& gamma, Args&&... args) {
  // The empty tensor arguments are bias, residual and beta; gamma's dtype picks the weight type.
  if (x.scalar_type() == at::kBFloat16) {
    if (gamma.scalar_type() == at::kFloat)
      launch_fwd<__nv_bfloat16, float, RMS>(x, std::forward<Args>(args)...);
    else
      launch_fwd<__nv_bfloat16, __nv_bfloat16, RMS>(x, std::forward<Args>(args)...);
  } else {
    launch_fwd<float, float, RMS>(x, std::forward<Args>(args)...);
  }
}

// With the tensors the backward needs: y, z (the pre-norm sum; fused form, else empty), mean, rstd
// and the dropout seed/offset (p > 0, else empty).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd(
    const at::Tensor& x, const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual,
    const at::Tensor& gamma, const at::Tensor& beta, double p, double eps) {
  check_inputs(x, gamma, &beta, "layer_norm");
  check_optional_inputs(x, bias, residual, p);
  const bool fused = bias.has_value() || residual.has_value() || p > 0;
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t H = x.size(-1), rows = x.numel() / std::max<int64_t>(H, 1);
  at::Tensor y = at::empty_like(x);
  at::Tensor z = fused ? at::empty_like(x) : at::Tensor();
  auto fopts = x.options().dtype(at::kFloat);
  at::Tensor mean = at::empty({rows}, fopts), rstd = at::empty({rows}, fopts);
  // (seed, offset), written by the kernel, when there is dropout; empty (no allocation) otherwise
  at::Tensor rng = at::empty({p > 0 ? 2 : 0}, x.options().dtype(at::kLong));
  at::Tensor b = linear_bias_as(bias, gamma), r = residual ? *residual : at::Tensor();
  launch_any<false>(x, gamma, b, r, gamma, beta, y, z, mean, rstd, eps, p, rng);
  if (!fused) z = at::empty({0}, x.options());
  return {y, z, mean, rstd, rng};
}

// Inference form: y only, nothing saved for a backward.
at::Tensor layer_norm(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                      const std::optional<at::Tensor>& residual, const at::Tensor& gamma, const at::Tensor& beta,
                      double p, double eps) {
  check_inputs(x, gamma, &beta, "layer_norm");
  check_optional_inputs(x, bias, residual, p);
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty_like(x);
  at::Tensor none, b = linear_bias_as(bias, gamma), r = residual ? *residual : at::Tensor();
  launch_any<false>(x, gamma, b, r, gamma, beta, y, none, none, none, eps, p, none);
  return y;
}

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor& x, const at::Tensor& gamma, double eps) {
  check_inputs(x, gamma, nullptr, "rms_norm");
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.numel() / std::max<int64_t>(x.size(-1), 1);
  at::Tensor y = at::empty_like(x);
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  at::Tensor none;
  launch_any<true>(x, gamma, none, none, gamma, none, y, none, none, rstd, eps, 0.0, none);
  return {y, rstd};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& gamma, double eps) {
  check_inputs(x, gamma, nullptr, "rms_norm");
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty_like(x);
  at::Tensor none;
  launch_any<true>(x, gamma, none, none, gamma, none, y, none, none, none, eps, 0.0, none);
  return y;
}

}  // namespace
}  // namespace bertaccel

TORCH_LIBRARY_IMPL(bertaccel, CUDA, m) {
  m.impl("layer_norm_fwd", &bertaccel::layer_norm_fwd);
  m.impl("rms_norm_fwd", &bertaccel::rms_norm_fwd);
  m.impl("layer_norm", &bertaccel::layer_norm);
  m.impl("rms_norm", &bertaccel::rms_norm);
}
