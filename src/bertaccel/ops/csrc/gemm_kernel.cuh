// bf16 tensor-core GEMM for Hopper (sm_90a), without cuBLAS: out[M, N] = epilogue(A[M, K] B[N, K]^T).
//
//   * TMA (cp.async.bulk.tensor) loads 128-byte-swizzled tiles into a ring of STAGES shared-memory
//     stages; each stage has a "full" mbarrier (the copy engine completes its byte count) and an
//     "empty" one (the consumers release it).
//   * Warp specialisation: warpgroup 0 is the producer (one thread issues the copies, its registers
//     given back with setmaxnreg); warpgroups 1 and 2 are consumers, 64 rows of the 128-row tile each,
//     issuing wgmma.m64nBNk16 from shared memory with fp32 accumulators in registers. Schedule 4 has
//     three consumers and 192-row tiles (see Team): BERT's M = 2048 problems then fill 132 SMs.
//   * Persistent: min(work units, SMs) blocks walk the (tile, k-split) units; the producer runs ahead
//     into the next unit while the consumers finish the epilogue of the current one.
//   * Either operand may be K-major (nn.Linear's x and W in the forward) or MN-major (W in the
//     input gradient, dy and x in the weight gradient): wgmma reads both through its transpose bits,
//     so no operand is ever transposed in memory.
//   * Epilogues on the fp32 accumulators: bias, bias + GELU (erf / tanh, optionally writing the
//     pre-activation), bias + residual, dGELU (times gelu'(saved pre-activation)); fp32 or bf16 out.
//   * Outputs leave through the copy engine: each consumer warpgroup applies the epilogue in registers,
//     writes 64-row chunks into swizzled shared memory (bf16: 64 columns with stmatrix; fp32 and split-K
//     slices: 32 columns with float2 stores) and one thread issues an asynchronous TMA store
//     (cp.async.bulk.tensor), so the stores drain while the next tile's MMAs run. When N is not a
//     multiple of 8 (rows not whole 16-byte runs) the threads store, staged through shared memory.
//   * Split-K (weight gradients, whose M x N is small and K = tokens is long), summed one of two ways,
//     both in a fixed split order (deterministic, the same bits): each split writes an fp32 slice of a
//     workspace and a second kernel sums the slices; or (cooperative and 192-row schedules) the last
//     split of a tile to finish adds the others' partials and runs the epilogue itself. The cost model
//     picks per call (neither wins everywhere: see estimate_us); BERTACCEL_GEMM_SPLIT=workspace|kernel
//     forces one.
//   * Stream-K (cooperative schedule; opt-in, schedule 3, slower at BERT's shapes - see
//     estimate_streamk_us): block b takes the b-th equal share of all (tile, K-block) iterations, so a
//     tile may be shared by consecutive blocks. The block holding a tile's first K-blocks finishes it:
//     it adds the fp32 partial sums the later blocks left in a workspace (each flags its slot), in K
//     order, so the result does not depend on timing, then runs the epilogue.
//
// Rows past M, columns past N and the K tail are zero-filled by the copy engine and never stored.
// The host side (gemm()) checks what TMA needs: bf16, 16-byte aligned bases and leading dimensions.
//
// This header holds the kernel (and its launch templates) so that its instantiations can be spread over
// several translation units, which the build compiles in parallel: gemm.cu (single-CTA kernels and the
// host side) and gemm_cluster_*.cu (the 2-CTA cluster kernels).
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "check.h"
#include "async_copy.cuh"
#include "gelu_math.cuh"
#include "pdl.cuh"
#include "wgmma.cuh"

namespace bertaccel::gemm::kernel {

using bf16 = __nv_bfloat16;
constexpr int BK = 64;           // 64 bf16 = 128 bytes: one swizzle row
constexpr int kChunk = 32;                       // accumulator columns staged per epilogue round
constexpr int kChunkStride = kChunk + 8;          // floats per staged row: +8 keeps the float2 writes conflict-free
constexpr int kStoreBufs = 2;                    // TMA-store chunk buffers per consumer warpgroup
constexpr int kStoreBufBytes = 64 * 64 * 2;       // one 64 x 64 bf16 chunk (128-byte rows, swizzled)
constexpr int kSmemLimit = 227 * 1024;            // Hopper's per-block maximum

// The block's warpgroups: one producer and CONS consumers. Two consumers: 128-row tiles (cooperative,
// 64 rows each, or ping-pong, whole tiles in turn); three: 192-row tiles (cooperative), which fit BERT's
// M = 2048 problems into 132 SMs (2048 x 2304 in 11 x 12 tiles of 192 x 192) and read fewer operand
// bytes per FLOP. Registers: 65536 per SM shared by the block, rebalanced with setmaxnreg.
template <int CONS>
struct Team {
  static_assert(CONS == 2 || CONS == 3, "two or three consumer warpgroups");
  static constexpr int kConsumers = CONS;
  static constexpr int BM = 64 * CONS;  // tile rows (cooperative; ping-pong tiles are 128 rows with two)
  static constexpr int kThreads = 128 * (1 + CONS);
  static constexpr int kProducerRegs = CONS == 2 ? 40 : 32;
  static constexpr int kConsumerRegs = CONS == 2 ? 232 : 160;  // 128 (40 + 2 x 232) or 128 (32 + 3 x 160) x 128 <= 65536
  static constexpr int kStagingBytes = (CONS * 64 * kChunkStride * 4) > (CONS * kStoreBufs * kStoreBufBytes)
                                           ? CONS * 64 * kChunkStride * 4 : CONS * kStoreBufs * kStoreBufBytes;
  static constexpr int kSmemBudget = kSmemLimit - kStagingBytes - 2048;  // operand stages (the rest: barriers, alignment)
};

enum Epilogue : int {
  kNone = 0,
  kBias = 1,
  kBiasGeluErf = 2,
  kBiasGeluTanh = 3,
  kBiasResidual = 4,  // + aux[M, N]
  kDGeluErf = 5,      // * gelu'(aux[M, N]), aux the saved pre-activation
  kDGeluTanh = 6,
};

struct Params {
  int M, N, K;
  int tiles_m, tiles_n, splits, kblocks_per_split;
  void* out;            // [M, N] row-major (or the split-K workspace [splits, M, N] fp32)
  bool out_f32;
  int epilogue;
  const void* bias;     // [N], bf16 or fp32
  bool bias_f32;
  const bf16* aux;      // [M, N] residual or saved pre-activation
  bf16* pre;            // [M, N] pre-activation output of the GELU epilogues, or null
  bool tma_store;       // N % 8 == 0: the epilogue stores through the copy engine (bf16 or fp32 boxes)
  bool streamk;         // units are equal shares of the (tile, K-block) iterations (cooperative only)
  float* sk_partial;    // stream-K: [grid][BM * BN] fp32, one partial tile per block
  int* sk_flags;        // stream-K: [grid], zero at launch; block b sets its flag once its partial is written
  // Split-K summed in the kernel (splits > 1 and fixup): per (tile, consumer slot) an arrival count and
  // one flag per split (zero at launch), and the partial sums [tile][slot][split][128 threads x values].
  bool fixup;
  int* fix_counts;      // [tiles][slots]
  int* fix_flags;       // [tiles][slots][splits]
  float* fix_partial;
};
// A split-K slice of the workspace (raw fp32 sums, summed by split_reduce_kernel) rather than the output.
__device__ __forceinline__ bool slice_out(const Params& p) { return p.splits > 1 && !p.fixup; }

// Kernel specialisations: the general kernel reads every option from Params at run time and holds the code of
// all of them (6,528-23,952 SASS instructions); a specialisation has some options fixed at compile time
// (apply_spec) and holds one path (PLAIN: 424-792). A launch fetches its kernel's code into cold instruction
// caches, and in a training step every GEMM follows other kernels: with the general kernels the step's GEMMs
// ran 0.65 ms slower per BERT-base 16x128 step than their own warm times (H100, scripts/step_gemms.py, session
// 31); the PLAIN kernels removed that for plain calls. kSpecBias and kSpecBiasGelu do the same for the forward's
// bias and bias + GELU (erf) epilogues (GELU's saved pre-activation stays a run-time option), kSpecSplitK for
// K splits without an epilogue (the weight gradients at many tokens; how the splits are summed and the output
// dtype stay run-time options), kSpecResidual for the residual epilogue without a bias (the fused FFN's dgrad).
enum Spec : int {
  kSpecGeneral = 0,
  kSpecPlain = 1,     // no epilogue
  kSpecBias = 2,      // + bias (fp32 or bf16)
  kSpecBiasGelu = 3,  // GELU(. + bias), erf form, the pre-activation written or not
  kSpecSplitK = 4,    // K splits, no epilogue: fp32 workspace slices or summed in the kernel, bf16 or fp32 out
  kSpecResidual = 5,  // + aux[M, N], no bias (the fused FFN's input gradient plus the residual's gradient)
};
// The specialisations built for every operand layout: all but the bias and GELU ones (the forward's epilogues),
// which are built for K-major operands only (launch_layout and spec_fits read this).
constexpr bool spec_every_layout(int spec) { return spec != kSpecBias && spec != kSpecBiasGelu; }
// The options a specialisation fixes: stores through TMA, no stream-K, no auxiliary input (but kSpecResidual's),
// and its epilogue; all but kSpecSplitK a bf16 output and one K split.
template <int SPEC>
__host__ __device__ __forceinline__ void apply_spec(Params& p) {
  static_assert(SPEC >= kSpecPlain && SPEC <= kSpecResidual, "a specialisation");
  p.tma_store = true, p.streamk = false;
  if constexpr (SPEC != kSpecResidual) p.aux = nullptr;
  if constexpr (SPEC == kSpecResidual) p.epilogue = kBiasResidual, p.bias = nullptr, p.bias_f32 = false, p.pre = nullptr;
  if constexpr (SPEC != kSpecSplitK) p.out_f32 = false, p.fixup = false, p.splits = 1;
  if constexpr (SPEC == kSpecPlain || SPEC == kSpecSplitK) p.epilogue = kNone, p.bias = nullptr, p.bias_f32 = false, p.pre = nullptr;
  if constexpr (SPEC == kSpecBias) p.epilogue = kBias, p.pre = nullptr;
  if constexpr (SPEC == kSpecBiasGelu) p.epilogue = kBiasGeluErf;
}

// The i-th unit of this block: a tile and its K-blocks [kb0, kb1). Units are (tile, K-split) pairs
// dealt round-robin to the blocks, or (stream-K) the pieces of this block's share of the iterations.
struct Unit {
  int tile, split, kb0, kb1;
};
__device__ __forceinline__ int64_t streamk_begin(const Params& p, int kblocks, int block) {  // first iteration of `block`
  return (int64_t)p.tiles_m * p.tiles_n * kblocks * block / gridDim.x;
}
// This block's stream-K iterations [g0, g1) and the tile of g0 (computed once, outside the loops).
struct StreamKRange {
  int64_t g0, g1;
  int tile0;
};
// kMayStreamK: the kernel can be launched for stream-K (the cooperative schedule of two consumers).
// CLU = 2: the blocks run in clusters of two (blocks 2c and 2c + 1, ranks 0 and 1), and cluster c takes
// the pair units c, c + clusters, ...: tile rows 2 i and 2 i + 1 (one per block, by rank) of one tile
// column and K split, so the pair reads the same B tile (loaded half by each, multicast to both).
// p.tiles_m is even then (a last odd row of tiles is paired with rows past M: zeros, never stored).
template <bool kMayStreamK, int CLU>
__device__ __forceinline__ bool unit_at(const Params& p, int kblocks, int i, Unit& w, const StreamKRange& r) {
  if constexpr (CLU == 2) {
    const int u = blockIdx.x / 2 + i * (gridDim.x / 2);
    if (u >= p.tiles_m / 2 * p.tiles_n * p.splits) return false;
    const int pair = u / p.splits, tn = pair % p.tiles_n, tm = 2 * (pair / p.tiles_n) + (int)(blockIdx.x % 2);
    w.split = u % p.splits, w.tile = tm * p.tiles_n + tn;
    w.kb0 = w.split * p.kblocks_per_split;
    w.kb1 = min(kblocks, w.kb0 + p.kblocks_per_split);
    return true;
  }
  if (kMayStreamK && p.streamk) {
    const int64_t g0 = r.g0, g1 = r.g1;
    const int tile = r.tile0 + i;
    const int64_t start = i == 0 ? g0 : (int64_t)tile * kblocks;
    const int64_t end = min(g1, (int64_t)(tile + 1) * kblocks);
    if (start >= end) return false;
    w.tile = tile, w.split = 0;
    w.kb0 = (int)(start - (int64_t)tile * kblocks), w.kb1 = (int)(end - (int64_t)tile * kblocks);
    return true;
  }
  const int u = blockIdx.x + i * gridDim.x;
  if (u >= p.tiles_m * p.tiles_n * p.splits) return false;
  w.split = u % p.splits, w.tile = u / p.splits;
  w.kb0 = w.split * p.kblocks_per_split;
  w.kb1 = min(kblocks, w.kb0 + p.kblocks_per_split);
  return true;
}

// ------------------------------------------------------------------------------ PTX helpers
using async_copy::fence_mbar_init;
using async_copy::mbar_expect_tx;
using async_copy::mbar_init;
using async_copy::mbar_wait;
using async_copy::smem_u32;
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// 2-D tile copy global -> shared, completing `bar`'s transaction count; c0 is the inner coordinate.
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, int c0, int c1, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
      ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_u32(bar)) : "memory");
}
// The same copy multicast to the CTAs of the cluster in `cta_mask`: the box lands at the same shared-memory
// offset in each, completing the byte count of the mbarrier at `bar`'s offset in each.
__device__ __forceinline__ void tma_load_multicast(void* dst, const CUtensorMap* map, int c0, int c1, uint64_t* bar,
                                                   uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3}], [%4], %5;\n"
      ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_u32(bar)), "h"(cta_mask)
      : "memory");
}
// Thread-block clusters: this CTA's rank, a barrier over every thread of the cluster (release / acquire:
// what a CTA wrote to shared memory before it, e.g. mbarrier inits, is visible to the others after it),
// and an arrival on the mbarrier at `bar`'s offset in CTA `cta` of the cluster. The arrival has the
// default semantics (as CUTLASS's ClusterBarrier): written `.release.cluster` it compiled to MEMBAR.ALL.CTA,
// MEMBAR.ALL.GPU, ERRBAR and CGAERRBAR before each arrive, and every cluster GEMM ran at about half speed
// (16384 x 3072 x 3072: 711 us against 413 single; gemm_cluster_probe_release_cluster_0ca128a.txt). The
// stage's readers are wgmmas already waited for: nothing of this thread needs ordering before the peer's
// next TMA write.
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t* bar, uint32_t cta) {
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n"
      ::"r"(smem_u32(bar)), "r"(cta) : "memory");
}
// 2-D tile copy shared -> global (the tensor map clips rows and columns past the matrix), as one
// bulk async-group of the issuing thread.
__device__ __forceinline__ void tma_store(const CUtensorMap* map, const void* src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n"
               ::"l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_u32(src)) : "memory");
}
// The same into a 3-D map (fp32 outputs: columns, rows, split-K slice), so each slice clips its own rows.
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, const void* src, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];\n"
               ::"l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(src)) : "memory");
}
// Four 8 x 8 bf16 matrices to shared memory: lanes 8i..8i+7 give the row addresses of matrix i, and
// each lane's r[i] holds two consecutive elements (row lane / 4, columns 2 (lane % 4), +1) of matrix i -
// the layout of a wgmma accumulator fragment.
__device__ __forceinline__ void stmatrix_x4(void* dst, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
               ::"r"(smem_u32(dst)), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}
__device__ __forceinline__ void flag_release(int* flag, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(flag), "r"(v) : "memory");
}
__device__ __forceinline__ int flag_acquire(const int* flag) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(flag) : "memory");
  return v;
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
template <int R>
__device__ __forceinline__ void regs_up() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R)); }
template <int R>
__device__ __forceinline__ void regs_down() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R)); }

// Shared-memory matrix descriptor, 128-byte swizzle. K-major tiles: rows of 64 K-elements (128 B),
// 8-row atoms 1024 B apart (SBO); the leading offset is unused. MN-major tiles: rows of 64
// MN-elements per K index, 8-K-row groups 1024 B apart (SBO), 64-wide MN chunks `lbo` bytes apart.
__device__ __forceinline__ uint64_t smem_desc(const void* p, uint32_t lbo) {
  uint64_t d = 0;
  d |= (uint64_t)((smem_u32(p) & 0x3FFFF) >> 4);
  d |= (uint64_t)((lbo & 0x3FFFF) >> 4) << 16;
  d |= (uint64_t)(1024 >> 4) << 32;
  d |= 1ull << 62;  // 128-byte swizzle
  return d;
}

// --------------------------------------------------------------------------------- epilogue
// GELU forms: gelu_math.cuh, the erf form through normal_cdf_fast (erf within 1.5e-7, no branches; erff's two
// polynomial ranges diverge inside a warp): the products come from bf16 operands and the outputs are stored bf16.

// Eight consecutive values as fp32: one 16-byte load when `whole` (8 in range, 16-byte aligned), else
// element by element with zeros past the first n.
__device__ __forceinline__ void load8(const bf16* src, int n, bool whole, float (&a)[8]) {
  if (whole) {
    const uint4 raw = *reinterpret_cast<const uint4*>(src);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) { const float2 f = __bfloat1622float2(h[i]); a[2 * i] = f.x; a[2 * i + 1] = f.y; }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) a[i] = i < n ? __bfloat162float(src[i]) : 0.f;
  }
}
__device__ __forceinline__ void load8(const float* src, int n, bool whole, float (&a)[8]) {
  if (whole) {
    const float4 lo = reinterpret_cast<const float4*>(src)[0], hi = reinterpret_cast<const float4*>(src)[1];
    a[0] = lo.x, a[1] = lo.y, a[2] = lo.z, a[3] = lo.w, a[4] = hi.x, a[5] = hi.y, a[6] = hi.z, a[7] = hi.w;
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) a[i] = i < n ? src[i] : 0.f;
  }
}

// The first n of eight values as bf16: one 16-byte store when `whole`, else element by element.
__device__ __forceinline__ void store8(bf16* dst, int n, bool whole, const float (&v)[8]) {
  if (whole) {
    __align__(16) __nv_bfloat162 h[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(h);
  } else {
    for (int i = 0; i < n; ++i) dst[i] = __float2bfloat16(v[i]);
  }
}

// Eight consecutive columns [col, col + 8) of one row from the staged accumulators: the epilogue, then
// one 16-byte (bf16) or 32-byte (fp32) store when the run is whole and aligned, else element by element.
// `raw`: a split-K slice (fp32 partial sums, no epilogue). Run in a loop that is not unrolled, once
// per staged chunk: the kernel's code stays small enough for the instruction cache (an epilogue
// unrolled per accumulator register, with every epilogue's branches, was ~100x larger).
__device__ __forceinline__ void finish8(const Params& p, void* out, bool raw, int row, int col, const float* v_in) {
  float v[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = v_in[i];
  const int N = p.N;
  const int n = min(8, N - col);
  const bool whole = n == 8 && (N % 8 == 0);
  const int64_t at = (int64_t)row * N + col;
  const int e = p.epilogue;
  if (!raw && e != kNone) {  // else a split-K slice or no epilogue: the raw sums
    if (e < kDGeluErf && p.bias != nullptr) {  // (the residual epilogue may come without a bias)
      float b[8];
      if (p.bias_f32) load8(static_cast<const float*>(p.bias) + col, n, whole, b);
      else load8(static_cast<const bf16*>(p.bias) + col, n, whole, b);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] += b[i];
    }
    if (e == kBiasGeluErf || e == kBiasGeluTanh) {
      if (p.pre != nullptr) store8(p.pre + at, n, whole, v);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = e == kBiasGeluErf ? gelu_erf<true>(v[i]) : gelu_tanh(v[i]);
    } else if (e >= kBiasResidual) {
      float a[8];
      load8(p.aux + at, n, whole, a);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if (e == kBiasResidual) v[i] += a[i];
        else v[i] *= e == kDGeluErf ? dgelu_erf<true>(a[i]) : dgelu_tanh(a[i]);
      }
    }
  }
  if (p.out_f32 || raw) {
    float* o = static_cast<float*>(out) + at;
    if (whole) {
      *reinterpret_cast<float4*>(o) = make_float4(v[0], v[1], v[2], v[3]);
      *reinterpret_cast<float4*>(o + 4) = make_float4(v[4], v[5], v[6], v[7]);
    } else {
      for (int i = 0; i < n; ++i) o[i] = v[i];
    }
  } else {
    store8(static_cast<bf16*>(out) + at, n, whole, v);
  }
}

// ------------------------------------------------------------- epilogue through the copy engine
// One consumer warpgroup's 64 rows of a tile, 64 columns at a time. Its accumulator fragment: d[4j + c]
// is row warp * 16 + lane / 4 + 8 (c / 2), column 8j + 2 (lane % 4) + c % 2 of the warpgroup's rows.
struct StoreRing {
  uint8_t* bufs;  // this warpgroup's kStoreBufs chunk buffers, 1024-byte aligned (the swizzle's period)
  int issued;     // chunks stored so far (the same in every thread): picks the next buffer
};

// v (one W-column chunk of the fragment: v[4 jj + c] for its column groups jj < W / 8) as bf16 to the
// matrix behind `map` at (row0, col0): stmatrix into the next buffer, in the swizzle the tensor map
// expects, then one TMA store. W = 64: 128-byte rows, 128-byte swizzle (16-byte group g of row r at
// g ^ (r % 8)); W = 32 (the last chunk of a 96-wide tile, through a map of 32-column boxes): 64-byte
// rows, 64-byte swizzle (g ^ (r / 2 % 4)). Conflict-free either way.
template <int W>
__device__ __forceinline__ void store_chunk(StoreRing& ring, const CUtensorMap* map, const float (&v)[W / 2], int row0,
                                            int col0, int cw, int t) {
  static_assert(W == 64 || W == 32, "64- or 32-column chunks");
  uint8_t* buf = ring.bufs + (ring.issued % kStoreBufs) * kStoreBufBytes;
  if (t == 0) async_copy::bulk_wait_read<kStoreBufs - 1>();  // the store that used this buffer last has read it
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
  const int warp = t / 32, lane = t % 32, i = lane / 8, rr = lane % 8;
  const int row = warp * 16 + (i % 2) * 8 + rr;  // matrix i: the warp's rows 0-7 (i even) or 8-15
#pragma unroll
  for (int q = 0; q < W / 16; ++q) {  // column groups 2q (matrices 0, 1) and 2q + 1 (matrices 2, 3)
    const int group = 2 * q + i / 2;
    uint8_t* dst = W == 64 ? buf + row * 128 + ((group ^ rr) << 4) : buf + row * 64 + ((group ^ ((row >> 1) & 3)) << 4);
    stmatrix_x4(dst, pack_bf16(v[8 * q], v[8 * q + 1]),
                pack_bf16(v[8 * q + 2], v[8 * q + 3]), pack_bf16(v[8 * q + 4], v[8 * q + 5]),
                pack_bf16(v[8 * q + 6], v[8 * q + 7]));
  }
  async_copy::fence_proxy_async();
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
  if (t == 0) {
    tma_store(map, buf, col0, row0);
    async_copy::bulk_commit();
  }
  ++ring.issued;
}

// fp32 out (split-K slices, or an fp32 output): the chunk's W columns as 32-column halves (128-byte
// rows, the same swizzle), each written with float2 stores - a warp's 256 bytes per store in two
// conflict-free wavefronts - and stored by one TMA store into slice `split` of a 3-D map.
template <int W>
__device__ __forceinline__ void store_chunk_f32(StoreRing& ring, const CUtensorMap* map, const float (&v)[W / 2], int row0,
                                                int col0, int split, int cw, int t) {
  const int lane = t % 32, rt = (t / 32) * 16 + lane / 4, q = lane % 4;
#pragma unroll
  for (int h = 0; h < W / 32; ++h) {
    uint8_t* buf = ring.bufs + (ring.issued % kStoreBufs) * kStoreBufBytes;
    if (t == 0) async_copy::bulk_wait_read<kStoreBufs - 1>();
    asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {  // column groups 4h + jj: columns 8 jj + 2q, +1 of this half
      const int group = 2 * jj + q / 2, within = (q % 2) * 8;  // 16-byte group of the 128-byte row
#pragma unroll
      for (int bottom = 0; bottom < 2; ++bottom) {
        const int row = rt + 8 * bottom;  // row % 8 == lane / 4 either way
        *reinterpret_cast<float2*>(buf + row * 128 + ((group ^ (lane / 4)) << 4) + within) =
            make_float2(v[16 * h + 4 * jj + 2 * bottom], v[16 * h + 4 * jj + 2 * bottom + 1]);
      }
    }
    async_copy::fence_proxy_async();
    asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
    if (t == 0) {
      tma_store_3d(map, buf, col0 + 32 * h, row0, split);
      async_copy::bulk_commit();
    }
    ++ring.issued;
  }
}

// The auxiliary input of one W-column chunk (residual, or the saved pre-activation of the dGELU
// epilogue), in the accumulator fragment's order: aux[i] = the bf16 pair at row (warp * 16 + lane / 4 +
// 8 (i % 2)), columns 8 (i / 2) + 2 (lane % 4), +1 of the chunk; zero past M or N (aux[W / 4..] untouched).
// Loaded a chunk ahead (the first chunk of a unit before its MMAs): the loads' latency hides behind the
// MMAs and the previous chunk's work.
template <int W = 64>
__device__ __forceinline__ void load_aux(const Params& p, uint32_t (&aux)[16], int row0, int col0, int t) {
  const int lane = t % 32, r_top = row0 + (t / 32) * 16 + lane / 4, c_lane = col0 + 2 * (lane % 4);
#pragma unroll
  for (int i = 0; i < W / 4; ++i) {
    const int row = r_top + 8 * (i % 2), col = c_lane + 8 * (i / 2);
    aux[i] = row < p.M && col < p.N ? __ldg(reinterpret_cast<const unsigned int*>(p.aux + (int64_t)row * p.N + col)) : 0u;
  }
}

// The tile's bias columns [col0, col0 + BN) into this warpgroup's shared slice, by cp.async (8 bytes a thread,
// zero-filled past N: N % 8 == 0 on this path, so an 8-byte piece is wholly in or out), while the MMAs run; the
// epilogue waits for them (bias_ready). Copies a thread left in flight (a unit that ended before its epilogue)
// are waited for first: they write the same slice.
template <int BN>
__device__ __forceinline__ void load_bias_async(const Params& p, uint8_t* dst, int col0, int t) {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  const int esize = p.bias_f32 ? 4 : 2;
  for (int off = 8 * t; off < BN * esize; off += 8 * 128) {
    const int col = col0 + off / esize;
    const bool in = col < p.N;
    const char* src = static_cast<const char*>(p.bias) + (in ? (int64_t)col * esize : 0);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem_u32(dst + off)), "l"(src), "r"(in ? 8 : 0)
                 : "memory");
  }
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// every thread's copies landed and are visible to the warpgroup
__device__ __forceinline__ void bias_ready(int cw) {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
}

// The GELU and dGELU epilogues' math on one chunk's values, inlined and unrolled in every chunk of the unrolled
// chunk loops. Measured against the alternatives (session 30, H100, 16384x3072x768 bias + GELU: 229 us inlined):
// one out-of-line copy (__noinline__, values through local memory) 329 us, the value loop not unrolled 554 us;
// the erf form's cost is its instructions per value (normal_cdf_fast), not the code's size.
template <int N>
__device__ __forceinline__ void gelu_values(float (&v)[N], bool erf_form) {
  if (erf_form) {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = gelu_erf<true>(v[i]);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = gelu_tanh(v[i]);
  }
}
template <int N>
__device__ __forceinline__ void dgelu_values(float (&v)[N], const float (&a)[N], bool erf_form) {
  if (erf_form) {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] *= dgelu_erf<true>(a[i]);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] *= dgelu_tanh(a[i]);
  }
}

// The epilogue of one W-column chunk in registers (the branches are per chunk, each body unrolled over
// its W / 2 values), then its TMA store(s). N % 8 == 0 here, so a column pair is either in range or past
// N. `aux`: the chunk's auxiliary input (load_aux), read by the residual and dGELU epilogues; with
// kAuxHere it is read here instead (where registers are short: the 256-wide cooperative tile). W = 32:
// the last chunk of a 96-wide tile, stored through the 32-column maps (map_out / map_pre are those).
template <bool kAuxHere, int W = 64>
__device__ __forceinline__ void epilogue_chunk(const Params& p, const CUtensorMap* map_out, const CUtensorMap* map_pre,
                                               StoreRing& ring, float (&v)[W / 2], const uint32_t (&aux)[16], int row0,
                                               int col0, int split, int cw, int t, const uint8_t* bias_s) {
  constexpr int kV = W / 2;  // values per thread
  const int lane = t % 32, e = slice_out(p) ? kNone : p.epilogue;  // a split-K slice: the raw sums
  const int r_top = row0 + (t / 32) * 16 + lane / 4, c_lane = col0 + 2 * (lane % 4);
  if (e >= kBias && e <= kBiasResidual && p.bias != nullptr) {  // (the residual epilogue may come without a bias)
#pragma unroll
    for (int jj = 0; jj < W / 8; ++jj) {
      const int col = c_lane + 8 * jj;
      float2 b = make_float2(0.f, 0.f);
      if (bias_s != nullptr) {  // the chunk's bias in shared memory (zeros past N)
        const int at = 2 * (lane % 4) + 8 * jj;
        b = p.bias_f32 ? *reinterpret_cast<const float2*>(bias_s + 4 * at)
                       : __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(bias_s + 2 * at));
      } else if (col < p.N) {
        b = p.bias_f32 ? *reinterpret_cast<const float2*>(static_cast<const float*>(p.bias) + col)
                       : __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(static_cast<const bf16*>(p.bias) + col));
      }
      v[4 * jj] += b.x, v[4 * jj + 1] += b.y, v[4 * jj + 2] += b.x, v[4 * jj + 3] += b.y;
    }
  }
  if (e == kBiasGeluErf || e == kBiasGeluTanh) {
    if (p.pre != nullptr) store_chunk<W>(ring, map_pre, v, row0, col0, cw, t);
    gelu_values<kV>(v, e == kBiasGeluErf);
  } else if (e >= kBiasResidual) {
    float a[kV];
#pragma unroll
    for (int i = 0; i < kV / 2; ++i) {  // i = 2 jj + (bottom row)
      float2 f;
      if constexpr (kAuxHere) {
        const int row = r_top + 8 * (i % 2), col = c_lane + 8 * (i / 2);
        f = make_float2(0.f, 0.f);
        if (row < p.M && col < p.N) f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p.aux + (int64_t)row * p.N + col));
      } else {
        f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&aux[i]));
      }
      a[4 * (i / 2) + 2 * (i % 2)] = f.x, a[4 * (i / 2) + 2 * (i % 2) + 1] = f.y;
    }
    if (e == kBiasResidual) {
#pragma unroll
      for (int i = 0; i < kV; ++i) v[i] += a[i];
    } else {
      dgelu_values<kV>(v, a, e == kDGeluErf);
    }
  }
  if (p.out_f32 || slice_out(p)) store_chunk_f32<W>(ring, map_out, v, row0, col0, slice_out(p) ? split : 0, cw, t);
  else store_chunk<W>(ring, map_out, v, row0, col0, cw, t);
}

// ----------------------------------------------------------------------------------- kernel
template <int BN, int CONS>
struct Config : Team<CONS> {
  using T = Team<CONS>;
  static constexpr int kABytes = T::BM * BK * 2;
  static constexpr int kBBytes = BN * BK * 2;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kStages = T::kSmemBudget / kStageBytes > 8 ? 8 : T::kSmemBudget / kStageBytes;
  static constexpr int kBaseBytes = kStages * kStageBytes + T::kStagingBytes + 2 * kStages * 8 + 16 + 1024;  // + barriers, words, alignment
  // The tile's bias slice per consumer warpgroup (fp32 or bf16), copied in (cp.async) while the MMAs run, where
  // it fits next to the stages (every tile but the cooperative 128 x 256, 80 bytes short: it reads the bias in
  // the epilogue). Against the bias read in the epilogue (H100, gemm_epilogue_sweep at 1624464, 54 configurations
  // each): bias epilogue median x0.969 of the time (x0.81-1.04), GELU x0.991, dGELU x1.006, none x1.005.
  static constexpr int kBiasBytes = T::kConsumers * BN * 4;
  static constexpr bool kBiasInSmem = kBaseBytes + kBiasBytes <= kSmemLimit;
  static constexpr int kSmemBytes = kBaseBytes + (kBiasInSmem ? kBiasBytes : 0);
  static_assert(kSmemBytes <= kSmemLimit, "shared memory over the per-block limit");
};

// PP (ping-pong): each consumer warpgroup takes whole 128-row tiles, alternating units with the other,
// so one warpgroup's epilogue runs while the other's MMAs do (the cooperative schedule, PP = false,
// splits every tile's rows between the two and leaves the tensor cores idle during the epilogue).
// The producer fills the ring unit after unit in either schedule; with PP only the warpgroup that
// owns a unit consumes (and releases) its stages.
//
// CLU = 2 (clusters of two blocks along M, the shape cuBLAS runs at BERT's sizes): the blocks of a cluster
// compute vertically adjacent tiles of the same K range (unit_at), so they need the same B tile. Each
// producer loads its own A tile and half of B (K-major: BN / 2 rows; MN-major: 32 of the 64 K-rows of
// each 64-column chunk) multicast to both blocks: per stage a block reads A + B / 2 from L2 instead of
// A + B (a 128 x 256 tile: a third fewer bytes). Each full barrier still expects the whole stage; a
// stage is refilled only when the consumers of both blocks have released it (their lanes arrive on
// both blocks' empty barriers), since either producer's half lands in both.
template <int BN, bool A_MN, bool B_MN, bool PP, int CONS, int CLU = 1, int SPEC = kSpecGeneral>
__global__ void __launch_bounds__(Team<CONS>::kThreads, 1)
gemm_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
            const __grid_constant__ CUtensorMap map_out, const __grid_constant__ CUtensorMap map_pre,
            const __grid_constant__ CUtensorMap map_out_tail, const __grid_constant__ CUtensorMap map_pre_tail,
            const Params p_arg) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // SPEC (apply_spec): a specialised kernel has the call's options fixed at compile time, so the compiler drops
  // every other path (the PLAIN kernels: 424-792 SASS instructions against 6,528-23,952 for the general one).
  // (the general kernels read the parameter itself, as before: a copy there cost the 192 x 192 tile 108 bytes more spill)
  std::conditional_t<SPEC != kSpecGeneral, Params, const Params&> p = p_arg;
  if constexpr (SPEC != kSpecGeneral) apply_spec<SPEC>(p);
  static_assert(!PP || CONS == 2, "ping-pong: two consumer warpgroups");
  // 96-wide tiles (cuBLAS's shape for 2048 x 768: 128 tiles on 132 SMs): a 64-column chunk and a 32-column
  // tail (map_out_tail / map_pre_tail: bf16 maps of 32-column boxes); B K-major only (its MN-major boxes
  // are 64 columns wide), two consumers with the auxiliary input loaded ahead.
  static_assert(BN % 64 == 0 || (BN == 96 && !B_MN && CONS == 2 && !PP), "tile widths: multiples of 64, or 96");
  static_assert(CLU == 1 || CLU == 2, "clusters of one or two blocks");
  using C = Config<BN, CONS>;
  constexpr int S = C::kStages, BM = C::BM, kConsumers = CONS;
  extern __shared__ uint8_t smem_raw[];
  // Aligned by an offset from smem_raw, not through an integer: the pointer stays one the compiler knows to be
  // shared, so each smem_u32 below is plain arithmetic. (Rounded as a uintptr_t, every conversion in the loops
  // re-read the shared window's base - S2UR SR_CgaCtaId / SR_SWINHI - at the top of each K-block and chunk.)
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  uint8_t* tiles_a = smem;
  uint8_t* tiles_b = smem + S * C::kABytes;
  // [kConsumers][64][kChunkStride] floats (staged stores), or [kConsumers][kStoreBufs] 64 x 64 bf16 chunks (TMA stores)
  float* staging = reinterpret_cast<float*>(smem + S * C::kStageBytes);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + S * C::kStageBytes + C::kStagingBytes);
  uint64_t* empty = full + S;
  uint8_t* bias_region = reinterpret_cast<uint8_t*>(empty + S) + 16;  // after the barriers and the words (kBiasInSmem)

  // the warpgroup, broadcast from lane 0 so that the compiler knows it is warp-uniform (what is derived from it,
  // e.g. this consumer's offset into the A stage, can then live in uniform registers)
  const int wg = __shfl_sync(0xffffffffu, (int)threadIdx.x / 128, 0);
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], (PP ? 4 : kConsumers * 4) * CLU);  // lane 0 of each warp that consumes the stage, in each block
    }
    fence_mbar_init();
  }
  if constexpr (CLU == 2) cluster_sync();  // both blocks' barriers initialised before any multicast or remote arrival
  else __syncthreads();
  // Programmatic dependent launch (launch(), BERTACCEL_PDL): this grid may start while the previous kernel on the
  // stream finishes, so the set-up above overlaps its tail; nothing in global memory is read or written before
  // the previous grid has completed and its writes are visible. Then the next kernel launched this way may start
  // its own set-up on SMs this grid leaves (it waits likewise; the grid is persistent, all of it already resident).
  begin_dependent_kernel();
  const uint32_t peer = CLU == 2 ? cluster_rank() ^ 1u : 0u;
  // a consumer warp's release of a stage: to this block's producer and, in a cluster, to the other's
  auto release_stage = [](uint64_t* bar, uint32_t other) {
    mbar_arrive(bar);
    if constexpr (CLU == 2) mbar_arrive_cluster(bar, other);
  };

  const int kblocks_total = (p.K + BK - 1) / BK;
  StreamKRange sk{0, 0, 0};
  constexpr bool kMayStreamK = !PP && CONS == 2 && CLU == 1;
  if (kMayStreamK && p.streamk) {
    sk.g0 = streamk_begin(p, kblocks_total, blockIdx.x), sk.g1 = streamk_begin(p, kblocks_total, blockIdx.x + 1);
    sk.tile0 = (int)(sk.g0 / kblocks_total);
  }

  if (wg == 0) {  // ------------------------------------------------------------ producer
    regs_down<C::kProducerRegs>();
    if (threadIdx.x == 0) {
      int it = 0;
      Unit w;
      for (int i = 0; unit_at<kMayStreamK, CLU>(p, kblocks_total, i, w, sk); ++i) {
        const int tm = w.tile / p.tiles_n, tn = w.tile % p.tiles_n;  // neighbours share the A rows
        for (int kb = w.kb0; kb < w.kb1; ++kb, ++it) {
          const int s = it % S;
          mbar_wait(&empty[s], ((it / S) & 1) ^ 1);
          mbar_expect_tx(&full[s], C::kStageBytes);
          uint8_t* a = tiles_a + s * C::kABytes;
          uint8_t* b = tiles_b + s * C::kBBytes;
          if constexpr (A_MN) {
#pragma unroll
            for (int c = 0; c < BM / 64; ++c) tma_load(a + c * 64 * BK * 2, &map_a, tm * BM + c * 64, kb * BK, &full[s]);
          } else {
            tma_load(a, &map_a, kb * BK, tm * BM, &full[s]);
          }
          if constexpr (CLU == 2) {  // this block's half of B, multicast to both blocks of the cluster
            const int half = (int)(peer ^ 1u);
            if constexpr (B_MN) {
#pragma unroll
              for (int c = 0; c < BN / 64; ++c)
                tma_load_multicast(b + c * 64 * BK * 2 + half * (BK / 2) * 128, &map_b, tn * BN + c * 64,
                                   kb * BK + half * (BK / 2), &full[s], 0x3);
            } else {
              tma_load_multicast(b + half * (BN / 2) * BK * 2, &map_b, kb * BK, tn * BN + half * (BN / 2), &full[s], 0x3);
            }
          } else if constexpr (B_MN) {
#pragma unroll
            for (int c = 0; c < BN / 64; ++c) tma_load(b + c * 64 * BK * 2, &map_b, tn * BN + c * 64, kb * BK, &full[s]);
          } else {
            tma_load(b, &map_b, kb * BK, tn * BN, &full[s]);
          }
        }
      }
    }
  } else {  // ----------------------------------------------------------------- consumers
    regs_up<C::kConsumerRegs>();
    const int cw = wg - 1;  // cooperative: which 64 rows of each tile; ping-pong: which units
    constexpr int kHalves = PP ? 2 : 1;  // 64-row halves of the tile this warpgroup accumulates
    const int t = threadIdx.x % 128, warp = t / 32, lane = t % 32;
    float acc[kHalves][BN / 2];
    int it = 0;
    StoreRing ring{smem + S * C::kStageBytes + cw * kStoreBufs * kStoreBufBytes, 0};
    // stage 0's operand descriptors (this warpgroup's 64 rows of A in the cooperative schedules; both
    // layouts hold 8 KB per 64 rows), offset per stage and K step in the loop
    const uint64_t desc_a0 = smem_desc(tiles_a + (PP ? 0 : cw * 64 * BK * 2), 64 * BK * 2);
    const uint64_t desc_b0 = smem_desc(tiles_b, 64 * BK * 2);
    Unit w, next;
    for (int local = 0; unit_at<kMayStreamK, CLU>(p, kblocks_total, local, w, sk); ++local) {
      const int split = w.split, tm = w.tile / p.tiles_n, tn = w.tile % p.tiles_n;
      const int kb0 = w.kb0, kb1 = w.kb1;
      if (PP && (local & 1) != cw) {  // the other warpgroup's unit: skip its stages in the ring
        it += max(0, kb1 - kb0);
        continue;
      }
      // Ping-pong turn-taking: wait until the other warpgroup has passed every full-barrier wait of the
      // previous unit. Without it this warpgroup, having skipped a whole unit of stages, could wait on a
      // full barrier two phases behind, whose parity matches, and read a stage not yet loaded.
      if (PP && local > 0) asm volatile("bar.sync %0, 256;\n" ::"r"(3 + cw) : "memory");
      int prev = -1;
      const bool bias_smem = C::kBiasInSmem && p.tma_store && !slice_out(p) && p.epilogue >= kBias &&
                             p.epilogue <= kBiasResidual && p.bias != nullptr;  // the same in the whole block
      uint8_t* bias_s = bias_region + cw * BN * 4;
      if (bias_smem) load_bias_async<BN>(p, bias_s, tn * BN, t);
      // The epilogue's auxiliary input (TMA-store epilogues) is loaded a chunk ahead, the first chunk's
      // before the MMAs, where the registers allow (ptxas, 168 per thread): the cooperative 192-wide tile
      // loads its first chunk's after the last MMAs are issued (before them: 8 bytes of spill), the
      // 256-wide one each chunk's at the chunk, and so does every tile of three consumers (160 registers each).
      // The 128 x 256 tile loading it a chunk ahead too (compiles without spill since 7f86ad8) was timed at
      // a425860 (gemm_aux_ahead_256_a425860.json, H100, bench_gemm --gelu-only + bench_ffn, two rounds): neutral to
      // worse (ffn fwd 16384x768x3072 0.350 -> 0.360 ms, fwd+bwd 1.041 -> 1.048; GEMM + GELU cells 0.98-1.04x),
      // so it stays at the chunk.
      constexpr bool kAuxAhead = CONS == 2 && (PP || BN <= 192), kAuxBeforeMmas = CONS == 2 && (PP || BN <= 128);
      const bool with_aux = p.tma_store && p.aux != nullptr && !slice_out(p);
      uint32_t aux_next[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) aux_next[i] = 0u;
      if (kAuxBeforeMmas && with_aux) load_aux(p, aux_next, tm * BM + (PP ? 0 : cw) * 64, tn * BN, t);
      for (int kb = kb0; kb < kb1; ++kb, ++it) {
        const int s = it % S;
        mbar_wait(&full[s], (it / S) & 1);
        // the stage's descriptors: the base ones plus the stage's offset (addresses sit in the low 14 bits,
        // in 16-byte units; shared memory is under 256 KB, so the sum never carries out of the field)
        const uint64_t da_s = desc_a0 + (uint64_t)((s * C::kABytes) >> 4), db_s = desc_b0 + (uint64_t)((s * C::kBBytes) >> 4);
        wgmma::fence();
#pragma unroll
        for (int k = 0; k < BK / 16; ++k) {
          // K-major: the next 16 K-elements are 32 bytes along the swizzled row; MN-major: 16 K-rows down.
          const uint64_t db = db_s + (uint64_t)((B_MN ? k * 16 * 128 : k * 32) >> 4);
#pragma unroll
          for (int h = 0; h < kHalves; ++h) {
            const uint64_t da = da_s + (uint64_t)((h * 64 * BK * 2 + (A_MN ? k * 16 * 128 : k * 32)) >> 4);
            wgmma::mma<BN, A_MN ? 1 : 0, B_MN ? 1 : 0>(acc[h], da, db, (kb > kb0 || k > 0) ? 1 : 0);
          }
        }
        wgmma::commit();
        wgmma::wait<1>();  // the previous stage's MMAs are done: release it
        if (prev >= 0 && lane == 0) release_stage(&empty[prev], peer);
        prev = s;
      }
      if (PP && unit_at<kMayStreamK, CLU>(p, kblocks_total, local + 1, next, sk)) asm volatile("bar.arrive %0, 256;\n" ::"r"(4 - cw) : "memory");  // your turn
      if (kAuxAhead && !kAuxBeforeMmas && with_aux) load_aux(p, aux_next, tm * BM + cw * 64, tn * BN, t);
      wgmma::wait<0>();
      if (prev >= 0 && lane == 0) release_stage(&empty[prev], peer);
      if (kb1 <= kb0) {
#pragma unroll
        for (int h = 0; h < kHalves; ++h)
#pragma unroll
          for (int i = 0; i < BN / 2; ++i) acc[h][i] = 0.f;
      }
      if (!PP && p.splits > 1 && p.fixup) {  // (not built into ping-pong: its registers are short - 52 bytes of spill)
        // Split-K summed here: the last split of this tile's rows (this warpgroup's slot) to arrive adds the
        // others' partial sums and runs the epilogue; the others leave their partials and go on. Arriving
        // comes before writing, so the last one only waits for splits already running (no co-residency
        // needed). The sum is p0 + p1 + ... in split order whoever arrives last: bitwise repeatable.
        constexpr int kVals = BN / 2;  // fp32 sums per thread (one 64-row half: not ping-pong)
        const int ts = w.tile * kConsumers + cw;
        int* word = reinterpret_cast<int*>(empty + S) + cw;  // this warpgroup's broadcast word
        if (t == 0) *word = atomicAdd(&p.fix_counts[ts], 1);
        asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
        const bool last = *word == p.splits - 1;
        float4* part = reinterpret_cast<float4*>(p.fix_partial) + (int64_t)ts * p.splits * 128 * (kVals / 4);
        float4* mine = part + (int64_t)split * 128 * (kVals / 4);
        if (!last || (p.splits > 2 && split != 0)) {  // the last one writes its own only to re-read it in order
#pragma unroll
          for (int q = 0; q < BN / 8; ++q)
            __stcg(&mine[q * 128 + t], make_float4(acc[0][4 * q], acc[0][4 * q + 1], acc[0][4 * q + 2], acc[0][4 * q + 3]));
        }
        if (!last) {
          __threadfence();
          asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
          if (t == 0) flag_release(&p.fix_flags[ts * p.splits + split], 1);
          continue;
        }
        if (t == 0) {
          for (int s2 = 0; s2 < p.splits; ++s2)
            if (s2 != split)
              while (flag_acquire(&p.fix_flags[ts * p.splits + s2]) == 0) __nanosleep(32);
        }
        asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
        for (int s2 = 0; s2 < p.splits; ++s2) {
          // two splits: mine + the other (a + b == b + a); more: p0 (re-read unless mine), then + p1, + p2, ...
          if (p.splits == 2 ? s2 == split : (s2 == 0 && split == 0)) continue;
          const float4* theirs = part + (int64_t)s2 * 128 * (kVals / 4);
          const bool first = p.splits > 2 && s2 == 0;
#pragma unroll
          for (int q = 0; q < BN / 8; ++q) {
            const float4 v = __ldcg(&theirs[q * 128 + t]);
            const float keep = first ? 0.f : 1.f;  // p0 replaces the registers, later splits add to them
            acc[0][4 * q] = fmaf(acc[0][4 * q], keep, v.x), acc[0][4 * q + 1] = fmaf(acc[0][4 * q + 1], keep, v.y);
            acc[0][4 * q + 2] = fmaf(acc[0][4 * q + 2], keep, v.z), acc[0][4 * q + 3] = fmaf(acc[0][4 * q + 3], keep, v.w);
          }
        }
      }
      if (kMayStreamK && p.streamk && !(kb0 == 0 && kb1 == kblocks_total)) {  // a piece of a shared tile
        // The partial tile in fragment order ([warpgroup][i / 4][thread][4] floats: each warp's float4
        // stores are 512 contiguous bytes), read back by the finishing block in the same order.
        float4* slot = reinterpret_cast<float4*>(p.sk_partial) + ((int64_t)blockIdx.x * BM * BN + cw * 64 * BN) / 4;
        if (kb0 > 0) {  // not the tile's first K-blocks: leave the partial sums, flag them, no epilogue
#pragma unroll
          for (int q = 0; q < BN / 8; ++q)
            __stcg(&slot[q * 128 + t], make_float4(acc[0][4 * q], acc[0][4 * q + 1], acc[0][4 * q + 2], acc[0][4 * q + 3]));
          __threadfence();
          asm volatile("bar.sync 5, 256;\n" ::: "memory");  // both consumer warpgroups
          if (threadIdx.x == 128) flag_release(&p.sk_flags[blockIdx.x], 1);
          continue;
        }
        // The tile's first K-blocks: add the later blocks' partials (they hold the rest of the tile), in order.
        const int64_t tile_end = (int64_t)(w.tile + 1) * kblocks_total;
        for (int c = blockIdx.x + 1; c < (int)gridDim.x && streamk_begin(p, kblocks_total, c) < tile_end; ++c) {
          if (t == 0) {
            while (flag_acquire(&p.sk_flags[c]) == 0) __nanosleep(32);
          }
          // both warpgroups have seen the flag: put it back to zero for the next launch (the flags
          // live in a buffer kept per stream, zero between launches: no memset before each)
          asm volatile("bar.sync 5, 256;\n" ::: "memory");
          if (threadIdx.x == 128) p.sk_flags[c] = 0;
          const float4* theirs = reinterpret_cast<const float4*>(p.sk_partial) + ((int64_t)c * BM * BN + cw * 64 * BN) / 4;
#pragma unroll
          for (int q = 0; q < BN / 8; ++q) {
            const float4 v = __ldcg(&theirs[q * 128 + t]);
            acc[0][4 * q] += v.x, acc[0][4 * q + 1] += v.y, acc[0][4 * q + 2] += v.z, acc[0][4 * q + 3] += v.w;
          }
        }
      }
      static_assert(BN % 64 == 0 || kAuxAhead, "the 32-column tail chunk is only in the aux-ahead loop below");
      if (bias_smem) bias_ready(cw);
      // the chunk at tile column c: its bias in shared memory, or null (read from global memory)
      auto bias_at = [&](int c) -> const uint8_t* { return bias_smem ? bias_s + c * (p.bias_f32 ? 4 : 2) : nullptr; };
      if (!kAuxAhead && p.tma_store) {  // epilogue in registers, stores through the copy engine
#pragma unroll
        for (int h = 0; h < kHalves; ++h) {
          const int row0 = tm * BM + (PP ? h : cw) * 64;
          if (row0 >= p.M) continue;  // the same in the whole warpgroup
#pragma unroll  // unrolled: each chunk names its accumulator registers at compile time (below)
          for (int c = 0; c < BN / 64; ++c) {
            if (tn * BN + 64 * c >= p.N) break;  // the same in the whole warpgroup
            float v[32];
#pragma unroll
            for (int cc = 0; cc < BN / 64; ++cc) {  // c is known at compile time (unrolled): a copy, not a select
              if (cc == c) {
#pragma unroll
                for (int k = 0; k < 32; ++k) v[k] = acc[h][32 * cc + k];
              }
            }
            epilogue_chunk<true>(p, &map_out, &map_pre, ring, v, aux_next, row0, tn * BN + 64 * c, split, cw, t, bias_at(64 * c));
          }
        }
        continue;
      }
      if (p.tma_store) {  // the same, with the auxiliary input loaded a chunk ahead
        // chunks q = h * kPerHalf + c: 64 rows (half h, or this warpgroup's rows) x 64 columns c, and with a
        // 96-wide tile a last 32-column chunk c = BN / 64 of each half
        constexpr int kFull = BN / 64, kPerHalf = kFull + (BN % 64 ? 1 : 0), kChunks = kHalves * kPerHalf;
#pragma unroll  // unrolled: each chunk names its accumulator registers at compile time (below)
        for (int q = 0; q < kChunks; ++q) {
          const int h = q / kPerHalf, c = q % kPerHalf;
          const int row0 = tm * BM + (PP ? h : cw) * 64, col0 = tn * BN + 64 * c;
          uint32_t aux_now[16];
          if constexpr (kAuxAhead) {
#pragma unroll
            for (int i = 0; i < 16; ++i) aux_now[i] = aux_next[i];
            if (with_aux && q + 1 < kChunks) {  // the next chunk's, while this one is finished
              const int hn = (q + 1) / kPerHalf, cn = (q + 1) % kPerHalf;
              if (kPerHalf > kFull && cn == kFull) load_aux<32>(p, aux_next, tm * BM + (PP ? hn : cw) * 64, tn * BN + 64 * cn, t);
              else load_aux(p, aux_next, tm * BM + (PP ? hn : cw) * 64, tn * BN + 64 * cn, t);
            }
          }
          if (row0 >= p.M || col0 >= p.N) continue;  // the same in the whole warpgroup
          if constexpr (kPerHalf > kFull) {
            if (c == kFull) {  // the 32-column tail: acc[h][32 kFull ..], through the 32-column bf16 maps
              float v[16];
#pragma unroll
              for (int hh = 0; hh < kHalves; ++hh) {
                if (hh == h) {
#pragma unroll
                  for (int k = 0; k < 16; ++k) v[k] = acc[hh][32 * kFull + k];
                }
              }
              const bool f32 = p.out_f32 || slice_out(p);  // fp32 maps already take 32-column boxes
              epilogue_chunk<false, 32>(p, f32 ? &map_out : &map_out_tail, &map_pre_tail, ring, v, aux_now, row0, col0,
                                        split, cw, t, bias_at(64 * c));
              continue;
            }
          }
          float v[32];
#pragma unroll
          for (int hh = 0; hh < kHalves; ++hh) {  // h, c known at compile time (unrolled): a copy, not a select
#pragma unroll
            for (int cc = 0; cc < kFull; ++cc) {
              if (hh == h && cc == c) {
#pragma unroll
                for (int k = 0; k < 32; ++k) v[k] = acc[hh][32 * cc + k];
              }
            }
          }
          epilogue_chunk<false>(p, &map_out, &map_pre, ring, v, aux_now, row0, col0, split, cw, t, bias_at(64 * c));
        }
        continue;
      }
      // Epilogue, kChunk columns at a time: the accumulator fragment (d[4j + c] is row warp*16 + lane/4
      // + 8*(c/2), column 8j + 2*(lane%4) + c%2) goes to this warpgroup's staging rows, then each thread
      // finishes runs of 8 consecutive columns of a row (coalesced 16-byte stores).
      void* out = slice_out(p) ? static_cast<void*>(static_cast<float*>(p.out) + (int64_t)split * p.M * p.N) : p.out;
      float* stage = staging + cw * 64 * kChunkStride;
      const int r0 = warp * 16 + lane / 4, c0 = 2 * (lane % 4);
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
        const int row_base = tm * BM + (PP ? h : cw) * 64;
#pragma unroll
        for (int chunk = 0; chunk < BN / kChunk; ++chunk) {
          const int col_base = tn * BN + chunk * kChunk;
#pragma unroll
          for (int jj = 0; jj < kChunk / 8; ++jj) {
            const int j = chunk * (kChunk / 8) + jj;
            *reinterpret_cast<float2*>(&stage[r0 * kChunkStride + 8 * jj + c0]) = make_float2(acc[h][4 * j], acc[h][4 * j + 1]);
            *reinterpret_cast<float2*>(&stage[(r0 + 8) * kChunkStride + 8 * jj + c0]) =
                make_float2(acc[h][4 * j + 2], acc[h][4 * j + 3]);
          }
          asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
          if (col_base < p.N) {
#pragma unroll 1
            for (int i = t; i < 64 * (kChunk / 8); i += 128) {
              const int r = i / (kChunk / 8), seg = i % (kChunk / 8);
              const int row = row_base + r, col = col_base + seg * 8;
              if (row < p.M && col < p.N) finish8(p, out, slice_out(p), row, col, &stage[r * kChunkStride + seg * 8]);
            }
          }
          asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
        }
      }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");  // no bias copy in flight (a unit that ended before its epilogue)
    if (t == 0) async_copy::bulk_wait_all();  // the last TMA stores have read this block's shared memory
  }
  // neither block of a cluster exits while the other may still arrive on its barriers
  if constexpr (CLU == 2) {
    __syncwarp();
    cluster_sync();
  }
#endif
}

struct Maps {
  CUtensorMap a, b, out, pre;  // out / pre: only read by the TMA-store epilogue (copies of a otherwise)
  CUtensorMap out_tail, pre_tail;  // bf16 out / pre in 32-column boxes: 96-wide tiles' last chunks (else copies of a)
};

// Launches gemm_kernel on `grid` blocks (CLU = 2: in clusters of two, the grid capped at twice the clusters
// that fit at once, as the kernel is persistent), as a programmatic dependent launch unless BERTACCEL_PDL=0.
template <int BN, bool A_MN, bool B_MN, bool PP, int CONS, int CLU = 1, int SPEC = kSpecGeneral>
void launch(const Maps& m, const Params& p, int grid, cudaStream_t stream) {
  using C = Config<BN, CONS>;
  auto* kernel = gemm_kernel<BN, A_MN, B_MN, PP, CONS, CLU, SPEC>;
  static const int max_clusters = [kernel] {  // per instantiation: raise the dynamic shared-memory limit once
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes));
    if (CLU == 1) return 0;
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 0));
    cudaLaunchConfig_t cfg{};
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = CLU, attr.val.clusterDim.y = 1, attr.val.clusterDim.z = 1;
    cfg.gridDim = dim3(CLU), cfg.blockDim = dim3(C::kThreads), cfg.dynamicSmemBytes = C::kSmemBytes;
    cfg.attrs = &attr, cfg.numAttrs = 1;
    int clusters = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg));
    BERTACCEL_CHECK(clusters > 0, "bertaccel gemm: no cluster of %d blocks of this GEMM kernel fits on the GPU", CLU);
    return clusters;
  }();
  cudaLaunchConfig_t cfg{};
  cudaLaunchAttribute attrs[2]{};
  int n = 0;
  if (dependent_launch_attribute(attrs[n], /*read_switch_now=*/true)) ++n;  // BERTACCEL_PDL=0 (read at each call): plain
  int blocks = grid;
  if constexpr (CLU > 1) {
    attrs[n].id = cudaLaunchAttributeClusterDimension;
    attrs[n].val.clusterDim.x = CLU, attrs[n].val.clusterDim.y = 1, attrs[n++].val.clusterDim.z = 1;
    // BERTACCEL_GEMM_MAX_CLUSTERS=n (read at each call; for experiments) caps the clusters below what fits
    int clusters = max_clusters;
    if (const char* env = std::getenv("BERTACCEL_GEMM_MAX_CLUSTERS")) clusters = std::max(1, std::min(clusters, std::atoi(env)));
    blocks = std::min(grid, CLU * clusters);
  }
  cfg.gridDim = dim3(blocks), cfg.blockDim = dim3(C::kThreads);
  cfg.dynamicSmemBytes = C::kSmemBytes, cfg.stream = stream;
  cfg.attrs = attrs, cfg.numAttrs = n;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, m.a, m.b, m.out, m.pre, m.out_tail, m.pre_tail, p));
}

// A kernel for each layout the specialisation is built for (spec_every_layout): both operands K-major (the forward:
// x and nn.Linear's W), B MN-major (input gradients) or both MN-major (weight gradients).
template <int BN, bool PP, int CONS = 2, int CLU = 1, int SPEC = kSpecGeneral>
void launch_layout(bool a_mn, bool b_mn, const Maps& m, const Params& p, int grid, cudaStream_t stream) {
  if (!a_mn && !b_mn) launch<BN, false, false, PP, CONS, CLU, SPEC>(m, p, grid, stream);
  else if constexpr (spec_every_layout(SPEC)) {
    if (!a_mn && b_mn) launch<BN, false, true, PP, CONS, CLU, SPEC>(m, p, grid, stream);
    else if (a_mn && b_mn) launch<BN, true, true, PP, CONS, CLU, SPEC>(m, p, grid, stream);
    else TORCH_CHECK(false, "bertaccel gemm: an MN-major A with a K-major B is not built (transpose b too)");
  } else {
    TORCH_CHECK(false, "bertaccel gemm: the epilogue specialisations are built for K-major operands only");
  }
}

// The single-block kernel of a schedule and tile width: rows192 (three consumers, widths 64, 128, 192), ping-pong
// (64, 128) or cooperative (64, 96, 128, 192, 256). The general kernels are instantiated by gemm.cu's call
// (SPEC = kSpecGeneral), the specialised ones by launch_plain / _bias / _bias_gelu / _splitk (a translation unit each).
template <int SPEC>
void launch_single(bool pingpong, bool rows192, int bn, bool a_mn, bool b_mn, const Maps& m, const Params& p, int grid,
                   cudaStream_t stream) {
  if (rows192) {
    switch (bn) {
      case 192: launch_layout<192, false, 3, 1, SPEC>(a_mn, b_mn, m, p, grid, stream); break;
      case 128: launch_layout<128, false, 3, 1, SPEC>(a_mn, b_mn, m, p, grid, stream); break;
      default: launch_layout<64, false, 3, 1, SPEC>(a_mn, b_mn, m, p, grid, stream); break;
    }
  } else if (pingpong) {
    if (bn == 128) launch_layout<128, true, 2, 1, SPEC>(a_mn, b_mn, m, p, grid, stream);
    else launch_layout<64, true, 2, 1, SPEC>(a_mn, b_mn, m, p, grid, stream);
  } else {
    switch (bn) {
      case 96:  // K-major B only (candidates() offers it for those)
        TORCH_CHECK(!a_mn && !b_mn, "bertaccel gemm: 96-wide tiles need K-major operands");
        launch<96, false, false, false, 2, 1, SPEC>(m, p, grid, stream);
        break;
      case 256: launch_layout<256, false, 2, 1, SPEC>(a_mn, b_mn, m, p, grid, stream); break;
      case 192: launch_layout<192, false, 2, 1, SPEC>(a_mn, b_mn, m, p, grid, stream); break;
      case 128: launch_layout<128, false, 2, 1, SPEC>(a_mn, b_mn, m, p, grid, stream); break;
      default: launch_layout<64, false, 2, 1, SPEC>(a_mn, b_mn, m, p, grid, stream); break;
    }
  }
}

// The 2-block cluster kernels, instantiated in their own translation units (compiled in parallel with
// gemm.cu): gemm_cluster_cooperative.cu (two consumers, widths 64, 96, 128, 192, 256) and
// gemm_cluster_rows.cu (ping-pong 64 and 128; 192-row tiles 64, 128 and 192). `grid`: twice the pair
// units (the launch caps it); p.tiles_m even.
void launch_pair_cooperative(int bn, bool a_mn, bool b_mn, const Maps& m, const Params& p, int grid, cudaStream_t stream);
void launch_pair_rows(bool pingpong, int bn, bool a_mn, bool b_mn, const Maps& m, const Params& p, int grid,
                      cudaStream_t stream);

// The specialised kernel that computes exactly what the general one would for these parameters, or kSpecGeneral:
// the first SPEC whose apply_spec leaves them unchanged (byte for byte: p is copied as bytes, so padding compares
// equal, and apply_spec writes named fields only), so the host's choice and the kernel's forced fields cannot
// drift apart. Single blocks only (the cluster kernels are not specialised); each specialisation only for the layouts
// it is built for (spec_every_layout).
template <int SPEC>
bool spec_fits(const Params& p, bool a_mn, bool b_mn) {
  if (!spec_every_layout(SPEC) && (a_mn || b_mn)) return false;
  Params q;
  std::memcpy(&q, &p, sizeof(Params));
  apply_spec<SPEC>(q);
  return std::memcmp(&q, &p, sizeof(Params)) == 0;
}
inline int spec_of(const Params& p, bool pair, bool a_mn, bool b_mn) {
  if (pair) return kSpecGeneral;
  if (spec_fits<kSpecPlain>(p, a_mn, b_mn)) return kSpecPlain;
  // kSpecSplitK leaves the split count a run-time option: it takes only calls that split (one split and no
  // epilogue is kSpecPlain's, or, with an fp32 output, the general kernel's)
  if (p.splits > 1 && spec_fits<kSpecSplitK>(p, a_mn, b_mn)) return kSpecSplitK;
  if (spec_fits<kSpecBias>(p, a_mn, b_mn)) return kSpecBias;
  if (spec_fits<kSpecBiasGelu>(p, a_mn, b_mn)) return kSpecBiasGelu;
  if (p.aux != nullptr && spec_fits<kSpecResidual>(p, a_mn, b_mn)) return kSpecResidual;
  return kSpecGeneral;
}
// launch_single<SPEC> of each specialisation, in its own translation unit (gemm_plain.cu, gemm_bias.cu,
// gemm_gelu.cu, gemm_splitk.cu, gemm_residual.cu: compiled in parallel with gemm.cu).
void launch_plain(bool pingpong, bool rows192, int bn, bool a_mn, bool b_mn, const Maps& m, const Params& p, int grid,
                  cudaStream_t stream);
void launch_bias(bool pingpong, bool rows192, int bn, bool a_mn, bool b_mn, const Maps& m, const Params& p, int grid,
                 cudaStream_t stream);
void launch_bias_gelu(bool pingpong, bool rows192, int bn, bool a_mn, bool b_mn, const Maps& m, const Params& p, int grid,
                      cudaStream_t stream);
void launch_splitk(bool pingpong, bool rows192, int bn, bool a_mn, bool b_mn, const Maps& m, const Params& p, int grid,
                   cudaStream_t stream);
void launch_residual(bool pingpong, bool rows192, int bn, bool a_mn, bool b_mn, const Maps& m, const Params& p, int grid,
                     cudaStream_t stream);

}  // namespace bertaccel::gemm::kernel
