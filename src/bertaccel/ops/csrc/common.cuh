// Shared device helpers for bertaccel's kernels: 16-byte vector packs, bf16/fp32 conversion (vec.cuh),
// Welford merging, Philox dropout draws, and the column-sum kernel used by every backward.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/PhiloxUtils.cuh>
#include <c10/cuda/CUDAException.h>
#include <cstdlib>
#include <string>
#include "check.h"
#include "pdl.cuh"
#include "philox.cuh"
#include "switches.h"
#include "vec.cuh"
#include <cuda_bf16.h>
#include <cstdint>
#include <initializer_list>

namespace bertaccel {

// Row reductions for kernels whose rows are handled by `tpr` consecutive threads of a block
// (tpr a power of two): xor shuffles within groups of min(tpr, 32) lanes, then, when a row spans
// several warps, one value per warp through shared memory `red` (one float per warp of the block).
// Every thread of the block must call them (they may synchronise the block).
template <typename Op>
__device__ __forceinline__ float row_reduce(float v, int tpr, float* red, int local_row, Op op) {
  const int width = tpr < 32 ? tpr : 32;
  for (int m = width / 2; m > 0; m >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, m, width));
  if (tpr > 32) {
    __syncthreads();  // `red` may still be read by a previous reduction
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    const int first = (local_row * tpr) >> 5;
    v = red[first];
    for (int i = 1; i < tpr / 32; ++i) v = op(v, red[first + i]);
  }
  return v;
}

// row_reduce for R rows per thread group at once (slot r of the group's rows): the shuffles of the
// R rows interleave, and rows spanning several warps share one pair of barriers. `red` holds
// R x (threads / 32) floats.
template <int R, typename Op>
__device__ __forceinline__ void row_reduce_rows(float (&v)[R], int tpr, float* red, int local_row, Op op) {
  const int width = tpr < 32 ? tpr : 32;
  for (int m = width / 2; m > 0; m >>= 1)
#pragma unroll
    for (int r = 0; r < R; ++r) v[r] = op(v[r], __shfl_xor_sync(0xffffffffu, v[r], m, width));
  if (tpr > 32) {
    const int warps = blockDim.x >> 5;
    __syncthreads();
    if ((threadIdx.x & 31) == 0)
#pragma unroll
      for (int r = 0; r < R; ++r) red[r * warps + (threadIdx.x >> 5)] = v[r];
    __syncthreads();
    const int first = (local_row * tpr) >> 5;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float a = red[r * warps + first];
      for (int i = 1; i < tpr / 32; ++i) a = op(a, red[r * warps + first + i]);
      v[r] = a;
    }
  }
}

// Ampere-style asynchronous copies, global -> shared, 16 bytes per thread (L1 bypassed): the row
// rings of the forward kernels keep several rows in flight per warp without holding them in registers.
// A thread that reads back only the bytes it copied itself needs no barrier after cp_async_wait.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {  // through L1 (.ca: 4 bytes)
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>  // wait until at most N of this thread's groups are pending
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// The row rings (persistent kernels streaming rows into shared memory with cp.async: the LayerNorm
// family's forward in layer_norm_fwd.cu, their backward in layer_norm_bwd.cuh, the softmax forward in
// softmax.cu). BERTACCEL_LN_RING=0 turns them off (the one-row kernels run every width), for comparing
// both in one run (scripts/ln_fwd_sweep.py).
inline bool ring_enabled() {
  static const bool on = env_switch("BERTACCEL_LN_RING", 1) != 0;
  return on;
}

// The forward rings (a row per warp or half-warp, each lane copying 16-byte items into shared memory): both run two
// stages, two rows in flight per warp (layer_norm_fwd.cu kFwdRingStages, softmax.cu kSoftmaxRingStages). Up to four
// (within 96 KB a block) was the rule until sessions 74-75, which measured two faster on an H200 for both (with four,
// 2,112 warps asked for half of a 16384-row LayerNorm input before writing a row); six for the 384-wide bf16
// LayerNorm row measured slower on the H100 still earlier (16384 rows: 11.9 against 11.0 us).
constexpr int kRingItemBytes = 32 * 16;  // one item of a row: 16 bytes per lane

// Blocks per SM of one ring kernel on `device` (the attribute for its dynamic shared memory set
// there first), queried once per kernel and device into `cached` (the caller's: one per kernel
// instantiation - kernels of one signature share a function-pointer type, so a cache keyed by type
// would set the attribute of the first kernel only).
template <typename Kernel>
int ring_blocks_per_sm(Kernel kernel, int threads, int smem, int device, int (&cached)[64]) {
  if (device < 0 || device >= 64) device = 0;
  if (cached[device] == 0) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    int n = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem));
    cached[device] = n > 0 ? n : 1;
  }
  return cached[device];
}

// The forward rings' grid. Two persistent forms: `fill` - as many blocks as fit, so that the warps of the last round
// are partly idle (16384 rows of 8 a block on 264 slots: 7.76 rounds, 1,600 warps walking 8 rows and 512 walking 7) -
// and `balanced` - k = ceil(row groups / slots) rounds a block, then ceil(row groups / k) blocks, every warp walking
// k rows (the last block's fewer; 256 blocks there, some SMs holding one block less). The caller's rule picks one
// (`balanced_by_default`); BERTACCEL_RING_ROWS_PER_WARP (read once per process) overrides it for comparing: 0 balanced
// everywhere, -1 fill everywhere, R > 0 ceil(row groups / R) blocks - more than fit at once, the hardware handing a
// finished SM the next block. The kernels are the same grid-stride loops under every form.
// Measured on an H200 (session 76, no grad, us, two alternated rounds, h200/ln_fwd_sweep_rows_per_warp_s76c.log,
// h200/ln_fwd_sweep_balanced_s76d.log, softmax_fwd_sweep_balanced_s76d.log; balanced / fill): bf16 16384 x 1024 LayerNorm
// 18.7 / 19.1, RMSNorm 18.0-18.1 / 18.3, the residual form 29.1-29.2 / 31.2-31.3, with p = 0.1 34.3-34.4 / 36.2-36.8;
// float32 residual 1024 54.3 / 60.4 (p = 0.1 64.4 / 71.7); at 384-768 wide within +-0.3 either way; the softmax ring
// lost (bf16 64x12x256x256 57.7-58.0 / 53.7-53.9, 8x12x1024x1024 113.9-114.3 / 110.2-111.9, float32 256 keys 114.5 /
// 102.2) and the float32 LayerNorm / RMSNorm at 1024 wide on three stages (one round: 35.5 / 35.0, 35.0 / 34.2).
// R = 1 / 2 lost 1.5-7 us at 768-1024 wide (a warp pays its prologue and weight loads for one or two rows).
inline int64_t ring_grid_blocks(int64_t rows, int rows_per_block, int64_t fit, bool balanced_by_default) {
  static const int setting = env_switch("BERTACCEL_RING_ROWS_PER_WARP", -2);  // -2: unset
  const int64_t need = (rows + rows_per_block - 1) / rows_per_block;
  if (setting > 0) return std::max<int64_t>(1, (need + setting - 1) / setting);
  const bool balanced = setting == 0 || (setting == -2 && balanced_by_default);
  if (need <= fit || !balanced) return std::min<int64_t>(need, fit);
  const int64_t rounds = (need + fit - 1) / fit;
  return (need + rounds - 1) / rounds;
}

struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// Dropout: element i of a launch keeps its value when its 16-bit Philox draw >= round(p * 65536):
// draw i is half i % 2 of word (i % 8) / 2 of Philox4x32-7 (philox.cuh) at counter (i / 8 low, i / 8 high,
// offset low, offset high) under the key `seed`. A pure function of (seed, offset, i): the backward
// regenerates the same mask whatever its launch shape, and one Philox call serves eight elements
// (curand_uniform4 served four, behind a curand_init per call). Measured on the H100 at 16384 x 768
// bf16: the residual LayerNorm backward, which regenerates the mask, 61.8 us against 79 before (with
// other changes in between); the forward with dropout stays ~11 us above the one without (the Philox
// rounds make it issue-bound). Python mirror: bertaccel.ops.registration.row_dropout_keep.
__device__ __forceinline__ uint32_t half_draw(const uint4& w, int e) {  // draw e (0..7) of one call
  const uint32_t word = e < 4 ? (e < 2 ? w.x : w.y) : (e < 6 ? w.z : w.w);
  return (e & 1) ? word >> 16 : word & 0xFFFFu;
}

__device__ __forceinline__ uint4 dropout_draws(uint64_t seed, uint64_t offset, uint64_t group) {
  return dropout_philox(make_uint4((uint32_t)group, (uint32_t)(group >> 32), (uint32_t)offset, (uint32_t)(offset >> 32)),
                        (uint32_t)seed, (uint32_t)(seed >> 32));
}

// keep[j] for elements i0 .. i0 + VEC - 1; i0 is a multiple of VEC (VEC a power of two <= 8), so the
// VEC elements lie in one group of eight and take one Philox call.
template <int VEC>
__device__ __forceinline__ void dropout_keep(uint64_t seed, uint64_t offset, int64_t i0, float p, bool (&keep)[VEC]) {
  static_assert(VEC <= 8 && (VEC & (VEC - 1)) == 0, "a vector lies within one group of eight draws");
  const uint32_t threshold = dropout_threshold(p);
  const uint4 w = dropout_draws(seed, offset, (uint64_t)i0 >> 3);
  const int e0 = VEC == 8 ? 0 : (int)(i0 & 7);
#pragma unroll
  for (int j = 0; j < VEC; ++j) keep[j] = half_draw(w, e0 + j) >= threshold;
}

// Bit `bit` of a thread's keep bits (bit k * VEC + j: element j of its k-th vector is kept). The
// kernels draw those bits inline: the same loop as a shared device function changed the code around
// it (the residual LayerNorm backward's and the forward ring's register counts moved by up to 26).
__device__ __forceinline__ bool kept_bit(uint32_t kept, int bit) { return (kept >> bit) & 1u; }

// A row op's dropout stream: the launch's Philox (seed, offset), unpacked on the device (under a CUDA
// graph the offset is read from device memory at replay), and written by thread 0 of block 0 to
// rng_out (when given) for the backward to regenerate the mask. (0, 0) without dropout.
struct DropoutSeed {
  uint64_t seed, offset;
};

__device__ __forceinline__ DropoutSeed launch_dropout_seed(float p, const at::PhiloxCudaState& philox,
                                                           int64_t* rng_out) {
  DropoutSeed s{0, 0};
  if (p > 0.f) {
    auto u = at::cuda::philox::unpack(philox);
    s.seed = std::get<0>(u);
    s.offset = std::get<1>(u);
  }
  if (rng_out != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
    rng_out[0] = (int64_t)s.seed;
    rng_out[1] = (int64_t)s.offset;
  }
  return s;
}

// out[m][c] = sum_r part[m][r, c] for up to 3 (parts, cols) fp32 matrices of one shape (a LayerNorm
// backward's dgamma, dbeta and dbias partials; the bias gradients' chunk sums) in one launch: grid
// (cols / COLS, matrices), COLS columns x SLICES row slices a block; each thread sums every SLICES-th row of
// its column (BATCH independent loads before the adds: one trip to L2 for up to BATCH * SLICES rows), then the
// slices meet through shuffles (those of a warp) and shared memory (the warps). The sums run after the
// backward's last block, in every LayerNorm-family backward's per-call part, and are latency-bound.
// Measured (H200, session 70, `ln_bwd_sweep.py`, two rounds): 8 columns x 64 slices (96 blocks a matrix at 768
// wide, so the few hundred partial rows are read by nearly every SM) against 32 x 32 (24 blocks): LayerNorm
// backward 2048x768 10.2 / 10.4 -> 9.2 / 9.2 us, 16384x768 36.9 / 37.2 -> 35.8 / 35.7, 16384x1024 44.9 / 45.2 ->
// 43.2 / 43.0, RMSNorm 2048x768 9.3 / 9.2 -> 8.6 / 8.0 (docs/row-ops.md).
// (One launch of all the matrices instead of one per matrix: the sums were ~4 us each, 44 per MiniLM training
// step.) Tried and measured slower (H100, 16384 rows, bf16, same run): the sums inside the backward's own grid,
// launched cooperatively, one grid barrier, each warp summing a 4-column slice - LayerNorm backward 26.3 / 43.1 /
// 54.9 us at 384 / 768 / 1024 wide against 24.3 / 40.1 / 54.5 with this second launch (residual form 37.2 / 57.7 /
// 69.0 against 34.1 / 55.9 / 65.6): the cooperative launch and the barrier cost more than the launch they save.
struct ColumnSums {
  const float* part[3];
  float* out[3];
};

// v summed over the lanes of a warp that hold the same column (lane % COLS), the result in each of them.
template <int COLS>
__device__ __forceinline__ float sum_column_lanes(float v) {
#pragma unroll
  for (int o = COLS; o < 32; o *= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <int COLS, int SLICES, int BATCH>
static __global__ void __launch_bounds__(COLS * SLICES) column_sums_kernel(ColumnSums m, int parts, int cols) {
  static_assert(32 % COLS == 0 && COLS * SLICES % 32 == 0 && COLS * SLICES <= 1024, "whole warps, a column per lane group");
  constexpr int kWarps = COLS * SLICES / 32;
  __shared__ float red[kWarps][COLS];
  begin_dependent_kernel();  // the partial rows are the previous kernel's output
  const float* __restrict__ part = m.part[blockIdx.y];
  const int x = threadIdx.x % COLS, y = threadIdx.x / COLS;  // lane = (y % (32 / COLS)) * COLS + x
  const int c = blockIdx.x * COLS + x;
  float s = 0.f;
  if (c < cols) {
    for (int r0 = y; r0 < parts; r0 += BATCH * SLICES) {
      float v[BATCH];  // every load issued before the first add
#pragma unroll
      for (int k = 0; k < BATCH; ++k) {
        const int r = r0 + k * SLICES;
        v[k] = r < parts ? part[(int64_t)r * cols + c] : 0.f;
      }
#pragma unroll
      for (int k = 0; k < BATCH; ++k) s += v[k];
    }
  }
  s = sum_column_lanes<COLS>(s);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane < COLS) red[warp][lane] = s;
  __syncthreads();
  if (warp == 0) {  // lane = j * COLS + x sums warps j, j + 32 / COLS, ... of column x, then the lane groups meet
    float t = 0.f;
#pragma unroll
    for (int w = lane / COLS; w < kWarps; w += 32 / COLS) t += red[w][lane % COLS];
    t = sum_column_lanes<COLS>(t);
    const int col = blockIdx.x * COLS + lane;
    if (lane < COLS && col < cols) m.out[blockIdx.y][col] = t;
  }
}

// The column sums of the defined (part, out) pairs, on `stream`, in a block shape (columns x row slices) the caller
// picks: `narrow` 8 x 64, 8 loads a thread (one round up to 512 partial rows) - every LayerNorm-family backward's
// few hundred partial rows; `wide` 32 x 32, 12 loads a thread up to 384 partial rows, 16 above (the shape before
// session 70); `few` 32 x 8, 16 loads a thread - one round up to 128 partial rows, what column_sum leaves (session 81).
// BERTACCEL_COLSUM=narrow|wide|32x8 (read once per process) takes one shape everywhere, for comparing; so do the shapes
// 16x32, 16x64, 32x16 and 8x32 (8 loads a thread at 64 slices, 12 at 32, 16 at 16); `by-width` keeps column_sum's
// rule before session 81 (narrow below 2,048 columns, wide from). Measured (H200, session 81, colsum_sweep, two rounds,
// h200/colsum_shapes_s81.log) on column_sum's 32-132 partial rows, by-width -> 32 x 8: 2048x768 4.2 -> 3.7-3.8 us,
// 2048x2304 6.8 -> 5.3-5.4, 9830x384 5.3 -> 4.6-4.7, 9830x1152 9.9 -> 8.8-8.9, 16384x768 9.8-9.9 -> 9.1-9.2, 16384x2304
// 23.8-24.0 -> 23.4-23.6, 16384x3072 30.1-30.4 -> 29.3-29.4, but 16384x1536 (132 partial rows: a second round of
// loads) 17.2-17.3 -> 17.5-17.7; 16x64 was second, 16x32, 32x16, 8x32 between. On the LayerNorm-family backward
// (ln_bwd_sweep at 2,048 and 16,384 rows, one round) 32 x 8 was the slowest shape (median 1.087x narrow; 16x64 0.991,
// wide 1.010) and narrow stays. Nsight Compute in session 80: column_sum's 88-row partials took 5.2-5.8 us in 8 x 64
// where inductor's own second kernel took 2.9-3.1. (4 x 128 and 8 x 128, 4 loads a thread, were slower than both nearly
// everywhere in session 70's sweep and were taken out.)
// (in BERTACCEL_COLSUM's order: the setting's index is the shape)
enum class ColumnSumsShape { unset, narrow, wide, c16x32, c16x64, c32x16, few /* 32 x 8 */, c8x32, by_width };
constexpr int kColumnSumsFewRows = 8 * 16;  // partial rows `few` reads in one round
// The shape BERTACCEL_COLSUM takes everywhere (read once per process); `unset` where none is, `by_width` where a caller
// with a rule before session 81 (column_sum) is to keep it - every other caller's shape stays its own.
inline ColumnSumsShape column_sums_setting() {
  static const auto setting = (ColumnSumsShape)env_choice(
      "BERTACCEL_COLSUM", {"", "narrow", "wide", "16x32", "16x64", "32x16", "32x8", "8x32", "by-width"},
      "column-sums shape (columns x row slices; narrow 8 x 64, wide 32 x 32; by-width)");
  return setting;
}
inline void launch_column_sums(std::initializer_list<std::pair<const at::Tensor*, const at::Tensor*>> pairs, int parts,
                               int cols, cudaStream_t stream, ColumnSumsShape here = ColumnSumsShape::narrow) {
  ColumnSums m{};
  int n = 0;
  for (auto [part, out] : pairs)
    if (part->defined() && out->defined()) {
      m.part[n] = part->data_ptr<float>();
      m.out[n] = out->data_ptr<float>();
      ++n;
    }
  if (n == 0 || cols == 0) return;
  const ColumnSumsShape setting = column_sums_setting();
  const ColumnSumsShape shape =
      setting == ColumnSumsShape::unset || setting == ColumnSumsShape::by_width ? here : setting;
#define BA_COLSUM_RUN(COLS, SLICES, BATCH)                                                                           \
  launch_dependent(column_sums_kernel<COLS, SLICES, BATCH>, dim3((unsigned)((cols + COLS - 1) / COLS), (unsigned)n), \
                   dim3(COLS * SLICES), 0, stream, m, parts, cols)
  switch (shape) {
    case ColumnSumsShape::wide: if (parts <= 12 * 32) BA_COLSUM_RUN(32, 32, 12); else BA_COLSUM_RUN(32, 32, 16); break;
    case ColumnSumsShape::c16x32: BA_COLSUM_RUN(16, 32, 12); break;
    case ColumnSumsShape::c16x64: BA_COLSUM_RUN(16, 64, 8); break;
    case ColumnSumsShape::c32x16: BA_COLSUM_RUN(32, 16, 16); break;
    case ColumnSumsShape::few: BA_COLSUM_RUN(32, 8, 16); break;
    case ColumnSumsShape::c8x32: BA_COLSUM_RUN(8, 32, 12); break;
    default: BA_COLSUM_RUN(8, 64, 8);  // narrow
  }
#undef BA_COLSUM_RUN
}

// ------------------------------------------------------------------------- host-side launch helpers
// The widest vector (elements) in {max_vec, max_vec / 2, ..., 1} that divides H and that every
// tensor's data pointer is aligned to.
inline int pick_vec(int64_t H, int max_vec, std::initializer_list<const at::Tensor*> ts) {
  int vec = max_vec;
  while (vec > 1) {
    bool ok = H % vec == 0;
    for (auto* t : ts)
      if (t->defined() && t->numel() > 0 && reinterpret_cast<uintptr_t>(t->data_ptr()) % (vec * t->element_size()) != 0)
        ok = false;
    if (ok) break;
    vec /= 2;
  }
  return vec;
}

// Row kernels keep up to 32 elements per thread in registers: ITEMS vectors of VEC. At the widest
// vector, of the ITEMS (1-4) that let one warp (or fewer threads) hold the row, the one whose
// power-of-two thread group leaves the fewest lanes idle, the fewer ITEMS on a tie: a BERT row (768
// bf16 = 96 vectors of 8) takes 3 vectors on 32 threads, a MiniLM row (384 = 48 vectors) 3 on 16
// threads, two rows per warp, where 2 on 32 threads left a quarter of the lanes idle and half the
// bytes in flight. Narrower vectors (odd sizes, unaligned views) take 32 / VEC.
// `fewest` (and BERTACCEL_ROW_ITEMS=fewest, for comparing both in one run) keeps the earlier rule,
// the fewest ITEMS that fit a warp: the fused residual LayerNorm backward takes it, as its third
// accumulator puts 3 vectors per thread at 184 registers, one block per SM (H100, 16384 x 384: 35.9
// us against 33.7 with 2 vectors on 32 threads at 128 registers; plain LayerNorm 23.0 against 24.5).
constexpr int kMaxElemsPerThread = 32;
inline bool row_items_fewest() {
  static const bool fewest = env_is("BERTACCEL_ROW_ITEMS", "fewest");
  return fewest;
}
inline int pick_items(int nvec, int vec, int max_vec, bool fewest = false) {
  if (vec != max_vec) return kMaxElemsPerThread / vec;
  const int max_items = kMaxElemsPerThread / vec;
  int best = 0, best_lanes = 0;  // lanes of the best so far: nvec / (items * tpr) compared as fractions
  for (int items : {1, 2, 3, 4}) {
    const int need = (nvec + items - 1) / items;
    if (items > max_items || need > 32) continue;
    if (fewest || row_items_fewest()) return items;
    int tpr = 1;
    while (tpr < need) tpr <<= 1;
    // busy share nvec / (items * tpr) above the best's nvec / best_lanes
    if (best == 0 || items * tpr < best_lanes) best = items, best_lanes = items * tpr;
  }
  return best != 0 ? best : max_items;
}

// Threads per row: the power of two that covers the row's vectors with `items` each.
inline int pick_tpr(int nvec, int items) {
  const int need = (nvec + items - 1) / items;
  int tpr = 1;
  while (tpr < need) tpr <<= 1;
  return tpr;
}

// Calls LAUNCH(VEC, ITEMS) for the pair picked above. ACT_BYTES: bytes of the type the 16-byte
// vectors are made of (2: up to 8 per vector; 4: up to 4).
#define BA_DISPATCH_VEC_ITEMS(ACT_BYTES, vec, items, LAUNCH)                                            \
  do {                                                                                                  \
    if constexpr ((ACT_BYTES) == 2) {                                                                   \
      if ((vec) == 8) {                                                                                 \
        if ((items) == 1) LAUNCH(8, 1); else if ((items) == 2) LAUNCH(8, 2);                            \
        else if ((items) == 3) LAUNCH(8, 3); else LAUNCH(8, 4);                                         \
      } else if ((vec) == 4) LAUNCH(4, 8); else if ((vec) == 2) LAUNCH(2, 16); else LAUNCH(1, 32);       \
    } else {                                                                                            \
      if ((vec) == 4) {                                                                                 \
        if ((items) == 1) LAUNCH(4, 1); else if ((items) == 2) LAUNCH(4, 2);                            \
        else if ((items) == 3) LAUNCH(4, 3); else if ((items) == 4) LAUNCH(4, 4); else LAUNCH(4, 8);    \
      } else if ((vec) == 2) LAUNCH(2, 16); else LAUNCH(1, 32);                                         \
    }                                                                                                   \
  } while (0)

inline void check_cuda_contiguous(const at::Tensor& t, const char* name) {
  BERTACCEL_CHECK(t.is_cuda(), "bertaccel: %s must be a CUDA tensor", name);
  BERTACCEL_CHECK(t.is_contiguous(), "bertaccel: %s must be contiguous", name);
}

}  // namespace bertaccel
