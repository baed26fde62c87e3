// fp32 GEMM on the CUDA cores (SIMT; no tensor cores, no TF32): out[M, N] = epilogue(op(A) op(B)^T),
// the fp32 path of `bertaccel::gemm` (gemm.cu hands fp32 operands here).
//
// The founding documents' technique: a block computes a BM x BN tile of the output (128 x 128 with
// 256 threads or 128 x 64 with 128), stepping through K 16 at a time. Each step's A and B slices go
// to shared memory K-major (As[k][m], Bs[k][n]: an operand stored K-major in memory is transposed on
// the way in), double-buffered: the next slices are loaded into registers while the current ones are
// multiplied, then stored into the other buffer, one barrier per step. Each thread owns 8 x 8 outputs
// as four 4 x 4 blocks (rows ty*4 and BM/2 + ty*4, columns tx*4 and BN/2 + tx*4), a warp's threads a
// 4 x 8 grid of them, so that a thread's shared-memory reads are four float4 per k for 64 FMAs and a
// warp's reads of a k-row take one wavefront for A and one for B. Loads are predicated (zero-filled
// past M, N and K), stores are guarded: M, N and K need not be multiples of a tile. The contiguous
// dimension of each operand must be a multiple of 4 with 16-byte aligned data (float4 loads); the
// Python side sends anything else to cuBLAS. Where the tiles are too few for the GPU (the weight
// gradient, K = tokens; 2,048-row layers) the K range is split over `splits` blocks writing fp32
// partial tiles, summed in a fixed order by a second kernel that applies the epilogue (any of them:
// it is elementwise): deterministic. Where the tiles overrun the last full wave of blocks, only the
// rows of tiles past it can be split (a tail split: a second launch on those rows, so that the tail
// fills a wave instead of leaving most SMs idle). `plan` picks the tile and split from a model of
// waves and split traffic.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <utility>

#include "check.h"
#include "gelu_math.cuh"
#include "gemm.h"

namespace bertaccel::gemm {
namespace {

constexpr int kPad = 4;  // floats after each shared-memory row: the transposed stores spread over banks
constexpr int kSplitAlign = 16;  // a K split's length is a multiple of every configuration's BK
enum Epilogue { kNone = 0, kBias = 1, kBiasGeluErf = 2, kBiasGeluTanh = 3, kBiasResidual = 4, kDGeluErf = 5, kDGeluTanh = 6 };

struct Args {
  const float* a;
  const float* b;
  float* out;           // [M, N]
  float* ws;            // the split tiles' partial sums: [split tile][split][BM * BN]
  const float* bias;    // [N] or null
  const float* aux;     // [M, N]: the residual, or the saved pre-activation of the dGELU epilogues
  float* pre;           // [M, N] pre-activation written by the GELU epilogues, or null
  int M, N, K;
  int64_t lda, ldb;     // row strides (elements) of a and b as stored
  int epilogue;         // applied by this kernel to whole tiles, by sgemm_split_reduce to split ones
  int tiles_n;          // tiles along N (tile t is row t / tiles_n, column t % tiles_n of tiles)
  int splits;           // blocks per split tile, each over a K range of
  int k_per_split;      //   k_per_split (a multiple of kSplitAlign)
};

// A kernel configuration: a BM x BN block tile stepping through K BK at a time; each thread owns TM x TN
// outputs as (TM / 4) x (TN / 4) blocks of 4 x 4, spaced kRowStride / kColStride apart. A warp's threads
// form a 4 x 8 grid, so that its float4 reads of a k-row of shared memory cover 4 distinct vectors of A
// and 8 of B: one shared-memory wavefront each (a warp of 2 x 16 threads needs two for B).
template <int BM_, int BN_, int BK_, int TM_, int TN_>
struct Config {
  static constexpr int BM = BM_, BN = BN_, BK = BK_, TM = TM_, TN = TN_;
  static constexpr int kTX = BN / TN, kTY = BM / TM, kThreads = kTX * kTY, kWarps = kThreads / 32;
  static constexpr int kRowStride = kTY * 4, kColStride = kTX * 4;  // between a thread's 4 x 4 blocks
  // at most 128 registers a thread for 8 x 8 outputs, 255 for more; as many blocks per SM as that allows
  static constexpr int kMinBlocks = 65536 / (kThreads * (TM * TN > 64 ? 256 : 128));
  static_assert(TM % 4 == 0 && TN % 4 == 0 && BK % 4 == 0 && kSplitAlign % BK == 0, "4 x 4 blocks, float4 K steps");
  static_assert(kTX % 8 == 0 && kTY % 4 == 0, "a warp is 4 x 8 threads");
  static_assert(2 * BK * (BM + BN + 2 * kPad) * 4 <= 48 * 1024, "static shared memory");
};

__device__ __forceinline__ float finish(const Args& p, float v, int row, int col) {
  const int e = p.epilogue;
  if (e >= kBias && e <= kBiasResidual && p.bias != nullptr) v += p.bias[col];  // residual: bias optional
  const int64_t at = (int64_t)row * p.N + col;
  if (e == kBiasGeluErf || e == kBiasGeluTanh) {
    if (p.pre != nullptr) p.pre[at] = v;
    v = e == kBiasGeluErf ? gelu_erf<false>(v) : gelu_tanh(v);
  } else if (e == kBiasResidual) {
    v += p.aux[at];
  } else if (e == kDGeluErf || e == kDGeluTanh) {
    v *= e == kDGeluErf ? dgelu_erf<false>(p.aux[at]) : dgelu_tanh(p.aux[at]);
  }
  return v;
}

// One operand's BK-deep slice of a tile, ROWS wide (BM for A, BN for B), as float4 loads: K-major
// (stored [rows, K]) or MN-major (stored [K, rows]).
template <int ROWS, int BK, int THREADS, bool MN>
struct Slice {
  static constexpr int kVecs = ROWS * BK / 4, kRowVecs = BK / 4;
  static constexpr int kPerThread = (kVecs + THREADS - 1) / THREADS;
  float4 v[kPerThread];

  __device__ __forceinline__ void load(const float* src, int64_t ld, int row0, int rows, int k0, int kend, int tid) {
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int idx = tid + i * THREADS;
      v[i] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (kVecs % THREADS != 0 && idx >= kVecs) continue;
      if (!MN) {  // [rows, K]: a float4 of 4 consecutive k of one row
        const int r = idx / kRowVecs, k = k0 + (idx % kRowVecs) * 4;
        if (row0 + r < rows && k < kend) v[i] = *reinterpret_cast<const float4*>(src + (int64_t)(row0 + r) * ld + k);
      } else {    // [K, rows]: a float4 of 4 consecutive rows at one k
        const int k = k0 + idx / (ROWS / 4), r = (idx % (ROWS / 4)) * 4;
        if (k < kend && row0 + r < rows) v[i] = *reinterpret_cast<const float4*>(src + (int64_t)k * ld + row0 + r);
      }
    }
  }

  __device__ __forceinline__ void store(float (*dst)[ROWS + kPad], int tid) const {
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int idx = tid + i * THREADS;
      if (kVecs % THREADS != 0 && idx >= kVecs) continue;
      if (!MN) {
        const int r = idx / kRowVecs, k = (idx % kRowVecs) * 4;
        dst[k][r] = v[i].x, dst[k + 1][r] = v[i].y, dst[k + 2][r] = v[i].z, dst[k + 3][r] = v[i].w;
      } else {
        const int k = idx / (ROWS / 4), r = (idx % (ROWS / 4)) * 4;
        *reinterpret_cast<float4*>(&dst[k][r]) = v[i];
      }
    }
  }
};

// The grid: (tiles along N, rows of tiles, splits). With one split the blocks finish their tiles
// (epilogue included); with more, each writes its K slice's partial tile.
template <class C, bool A_MN, bool B_MN>
__global__ void __launch_bounds__(C::kThreads, C::kMinBlocks) sgemm_kernel(const Args p) {
  constexpr int BM = C::BM, BN = C::BN, BK = C::BK, TM = C::TM, TN = C::TN;
  __shared__ __align__(16) float As[2][BK][BM + kPad];
  __shared__ __align__(16) float Bs[2][BK][BN + kPad];
  const int tid = threadIdx.x;
  const int lane = tid % 32, warp = tid / 32;
  const int tx = (warp % (C::kTX / 8)) * 8 + lane % 8, ty = (warp / (C::kTX / 8)) * 4 + lane / 8;
  const bool raw = gridDim.z > 1;  // a K slice: its partial sums, no epilogue
  const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
  // (written so, not as blockIdx.z * k_per_split alone: this form compiled to a K loop without spills
  // for more of the layouts - the loop sits at the 128-register limit)
  const int kbegin = raw ? blockIdx.z * p.k_per_split : 0, kend = raw ? min(p.K, kbegin + p.k_per_split) : p.K;

  float acc[TM][TN];
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = 0.f;

  Slice<BM, BK, C::kThreads, A_MN> sa;
  Slice<BN, BK, C::kThreads, B_MN> sb;
  const int steps = kend > kbegin ? (kend - kbegin + BK - 1) / BK : 0;
  if (steps > 0) {
    sa.load(p.a, p.lda, m0, p.M, kbegin, kend, tid);
    sb.load(p.b, p.ldb, n0, p.N, kbegin, kend, tid);
    sa.store(As[0], tid);
    sb.store(Bs[0], tid);
  }
  __syncthreads();
  for (int s = 0; s < steps; ++s) {
    const int cur = s & 1;
    const bool more = s + 1 < steps;
    if (more) {  // the next slices into registers while this one is multiplied
      const int k0 = kbegin + (s + 1) * BK;
      sa.load(p.a, p.lda, m0, p.M, k0, kend, tid);
      sb.load(p.b, p.ldb, n0, p.N, k0, kend, tid);
    }
#pragma unroll
    for (int k = 0; k < BK; ++k) {
      float a[TM], b[TN];
#pragma unroll
      for (int r = 0; r < TM / 4; ++r) {
        const float4 v = *reinterpret_cast<const float4*>(&As[cur][k][r * C::kRowStride + ty * 4]);
        a[4 * r] = v.x, a[4 * r + 1] = v.y, a[4 * r + 2] = v.z, a[4 * r + 3] = v.w;
      }
#pragma unroll
      for (int c = 0; c < TN / 4; ++c) {
        const float4 v = *reinterpret_cast<const float4*>(&Bs[cur][k][c * C::kColStride + tx * 4]);
        b[4 * c] = v.x, b[4 * c + 1] = v.y, b[4 * c + 2] = v.z, b[4 * c + 3] = v.w;
      }
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    if (more) {  // the other buffer was last read before the previous barrier
      sa.store(As[cur ^ 1], tid);
      sb.store(Bs[cur ^ 1], tid);
    }
    __syncthreads();
  }

  // a whole tile into out; a K slice into its own BM x BN block of ws (the split tiles in order)
  const int64_t split_tile = (int64_t)blockIdx.y * p.tiles_n + blockIdx.x;  // (a split launch's tiles all are)
  float* const slice = raw ? p.ws + (split_tile * p.splits + blockIdx.z) * BM * BN : nullptr;
  const bool vec = raw || p.N % 4 == 0;
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const int row = m0 + (i / 4) * C::kRowStride + ty * 4 + i % 4;
    if (row >= p.M) continue;
#pragma unroll
    for (int h = 0; h < TN / 4; ++h) {
      const int col = n0 + h * C::kColStride + tx * 4;
      if (col >= p.N) continue;
      float v[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] = (raw || col + j >= p.N) ? acc[i][4 * h + j] : finish(p, acc[i][4 * h + j], row, col + j);
      float* o = raw ? slice + (row - m0) * BN + (col - n0) : p.out + (int64_t)row * p.N + col;
      if (vec && col + 3 < p.N) {
        *reinterpret_cast<float4*>(o) = make_float4(v[0], v[1], v[2], v[3]);
      } else {
        for (int j = 0; j < 4 && col + j < p.N; ++j) o[j] = v[j];
      }
    }
  }
}

// A split launch's tiles: out = epilogue(sum over the splits of their partial tiles), in split order,
// four columns per thread (float4; a scalar form took 10 us at 2048 x 768 with 2 splits, ~10% of the GEMM).
template <int BM, int BN>
__global__ void sgemm_split_reduce(const Args p, int tiles) {
  static_assert(BN % 4 == 0, "float4 groups within a tile row");
  const int64_t count = (int64_t)tiles * BM * BN / 4;
  const bool vec_out = p.N % 4 == 0 && reinterpret_cast<uintptr_t>(p.out) % 16 == 0;  // rows of 16-byte groups
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < count; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t t = i * 4 / (BM * BN);
    const int at = (int)(i * 4 % (BM * BN)), tile = (int)t;
    const int row = tile / p.tiles_n * BM + at / BN, col = tile % p.tiles_n * BN + at % BN;
    if (row >= p.M || col >= p.N) continue;
    const float4* src = reinterpret_cast<const float4*>(p.ws + t * p.splits * BM * BN + at);
    float4 v = src[0];
    for (int s = 1; s < p.splits; ++s) {
      const float4 u = src[(int64_t)s * BM * BN / 4];
      v.x += u.x, v.y += u.y, v.z += u.z, v.w += u.w;
    }
    float r[4] = {v.x, v.y, v.z, v.w};
    float* o = p.out + (int64_t)row * p.N + col;
    if (vec_out && col + 3 < p.N) {
#pragma unroll
      for (int j = 0; j < 4; ++j) r[j] = finish(p, r[j], row, col + j);
      *reinterpret_cast<float4*>(o) = make_float4(r[0], r[1], r[2], r[3]);
    } else {
      for (int j = 0; j < 4 && col + j < p.N; ++j) o[j] = finish(p, r[j], row, col + j);
    }
  }
}

template <class C>
void launch_grid(bool a_mn, bool b_mn, const Args& p, int rows, int splits, cudaStream_t stream) {
  const dim3 grid(p.tiles_n, rows, splits);
  if (!a_mn && !b_mn) sgemm_kernel<C, false, false><<<grid, C::kThreads, 0, stream>>>(p);
  else if (!a_mn && b_mn) sgemm_kernel<C, false, true><<<grid, C::kThreads, 0, stream>>>(p);
  else if (a_mn && !b_mn) sgemm_kernel<C, true, false><<<grid, C::kThreads, 0, stream>>>(p);
  else sgemm_kernel<C, true, true><<<grid, C::kThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The rows of whole tiles (tiles 0 .. whole-1, a multiple of tiles_n); then the split tiles' rows as a
// GEMM of their own (operand A, out, aux and pre moved on to their first row), `splits` blocks per
// tile, and the sum of its partial tiles.
template <class C>
void launch(bool a_mn, bool b_mn, const Args& p, int tiles, int whole, int sms, cudaStream_t stream) {
  const int whole_rows = whole / p.tiles_n, rows = tiles / p.tiles_n;
  if (whole_rows > 0) launch_grid<C>(a_mn, b_mn, p, whole_rows, 1, stream);
  if (whole_rows == rows) return;
  Args q = p;
  const int64_t r = (int64_t)whole_rows * C::BM;  // first row of the split part
  q.a += a_mn ? r : r * p.lda;
  q.out += r * p.N;
  if (q.aux != nullptr) q.aux += r * p.N;
  if (q.pre != nullptr) q.pre += r * p.N;
  q.M = p.M - (int)r;
  launch_grid<C>(a_mn, b_mn, q, rows - whole_rows, p.splits, stream);
  const int64_t count = (int64_t)(tiles - whole) * C::BM * C::BN / 4;  // float4 groups
  const int reduce_blocks = (int)std::min<int64_t>((count + 255) / 256, (int64_t)sms * 8);
  sgemm_split_reduce<C::BM, C::BN><<<reduce_blocks, 256, 0, stream>>>(q, tiles - whole);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The configurations `tile` names (0: chosen by `plan`). Both 256 / 128 threads at <= 128 registers, two /
// four blocks per SM. Session 22's sweep (benchmarks/results/h100/gemm_fp32_configs_5aec575.json) also
// timed K steps of 8, the 2 x 16 warp layout and 8 x 16 outputs per thread at 255 registers (128 x 128 and
// 128 x 256 tiles): all slower than these two at every BERT shape.
using Tile1 = Config<128, 128, 16, 8, 8>;
using Tile2 = Config<128, 64, 16, 8, 8>;
constexpr int kTiles = 2;

struct TileShape {
  int bm, bn, resident, warps;  // resident: blocks of it an SM holds (registers bound)
  double speed;                 // work rate of a full SM relative to Tile1
};
constexpr TileShape kTileShapes[kTiles + 1] = {
    {0, 0, 0, 0, 0.0},
    {Tile1::BM, Tile1::BN, Tile1::kMinBlocks, Tile1::kWarps, 1.0},
    {Tile2::BM, Tile2::BN, Tile2::kMinBlocks, Tile2::kWarps, 0.85},
};

void launch_tile(int tile, bool a_mn, bool b_mn, const Args& p, int tiles, int whole, int sms, cudaStream_t stream) {
  if (tile == 1) launch<Tile1>(a_mn, b_mn, p, tiles, whole, sms, stream);
  else launch<Tile2>(a_mn, b_mn, p, tiles, whole, sms, stream);
}

// How a GEMM is cut into blocks: the tile configuration; tiles 0 .. whole-1 computed whole, each of the
// others by `splits` blocks over K ranges (whole = tiles: no split; whole = 0: every tile split).
struct Schedule {
  int tile, whole, splits;
};

// Predicted time (seconds) of a schedule on `sms` SMs - the model behind `plan`, fitted to the H100
// sweep of tiles x uniform splits (benchmarks/results/h100/gemm_fp32_aea30fa.json: it picks the
// measured best of 2 tiles x 8 splits, or within 2% of it, in every BERT GEMM). Blocks run in waves
// of `resident` per SM; a wave's time is that of its most loaded SM, whose rate grows with its
// resident warps as (warps / 16)^0.3; the whole tiles' blocks run first, then the split ones; a split
// adds its partial tiles' traffic (written, then read and summed by the second kernel) and that
// kernel's launch.
double predicted_seconds(int64_t M, int64_t N, int64_t K, const Schedule& s, int sms) {
  constexpr double kFmaPerSecond = 2e11, kBytesPerSecond = 2.5e12, kLaunch = 3e-6, kWarpExponent = 0.3;
  const TileShape& t = kTileShapes[s.tile];
  const int64_t tiles = ((M + t.bm - 1) / t.bm) * ((N + t.bn - 1) / t.bn), split_tiles = tiles - s.whole;
  const int64_t k_per_split = ((K + s.splits - 1) / s.splits + kSplitAlign - 1) / kSplitAlign * kSplitAlign;
  auto rate = [&](int64_t n) { return std::pow(std::min(1.0, (double)(n * t.warps) / 16.0), kWarpExponent); };
  auto fmas = [&](int64_t blocks, int64_t k) {  // most-loaded-SM FMAs of `blocks` blocks of k each, in waves
    const double work = (double)t.bm * t.bn * k / t.speed;
    const int64_t per_wave = (int64_t)t.resident * sms, full = blocks / per_wave, rest = blocks % per_wave;
    double units = (double)full * t.resident * work / rate(t.resident);
    if (rest > 0) {
      const int64_t n = (rest + sms - 1) / sms;
      units += n * work / rate(n);
    }
    return units;
  };
  double seconds = (fmas(s.whole, K) + fmas(split_tiles * s.splits, k_per_split)) / kFmaPerSecond;
  if (split_tiles > 0) seconds += (2.0 * s.splits + 1.0) * split_tiles * t.bm * t.bn * 4.0 / kBytesPerSecond + kLaunch;
  return seconds;
}

int tile_count(int64_t M, int64_t N, int tile) {
  const TileShape& t = kTileShapes[tile];
  return (int)(((M + t.bm - 1) / t.bm) * ((N + t.bn - 1) / t.bn));
}

// A tail split's whole tiles: the rows of tiles that fit in the full waves of blocks.
int tail_whole(int64_t M, int64_t N, int tile, int sms) {
  const int tiles_n = (int)((N + kTileShapes[tile].bn - 1) / kTileShapes[tile].bn);
  const int per_wave = kTileShapes[tile].resident * sms, tiles = tile_count(M, N, tile);
  return tiles / per_wave * per_wave / tiles_n * tiles_n;
}

// The schedule with the least predicted time: each tile configuration with no split, every tile split
// 2-16 ways, or - where the tiles overrun the last full wave - only the rows of tiles past it split
// 2-16 ways (the tail then fills a wave instead of leaving most SMs idle). At least 128 of K per split (also
// fewer roundings than one long sum). `tile` > 0 keeps that configuration.
Schedule plan(int64_t M, int64_t N, int64_t K, int sms, int tile) {
  Schedule best{tile > 0 ? tile : 1, tile_count(M, N, tile > 0 ? tile : 1), 1};
  double best_seconds = predicted_seconds(M, N, K, best, sms);
  auto consider = [&](const Schedule& s) {
    const double seconds = predicted_seconds(M, N, K, s, sms);
    if (seconds < best_seconds) best = s, best_seconds = seconds;
  };
  for (int t = 1; t <= kTiles; ++t) {
    if (tile > 0 && t != tile) continue;
    const int tiles = tile_count(M, N, t), whole = tail_whole(M, N, t, sms);
    consider({t, tiles, 1});
    for (int s = 2; s <= 16 && K / s >= 128; ++s) {
      consider({t, 0, s});
      if (whole > 0 && whole < tiles) consider({t, whole, s});
    }
  }
  return best;
}

}  // namespace

// The fp32 path of `bertaccel::gemm` (same arguments; `out_fp32` is implied). `tile` picks the block
// tile for tests and sweeps (0: chosen here; 1: 128 x 128, 2: 128 x 64, 3: 64 x 64), `splits_k` the K
// split (0: chosen here).
std::tuple<at::Tensor, at::Tensor> gemm_fp32(const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& bias,
                                             const c10::optional<at::Tensor>& aux, int64_t epilogue, bool trans_a,
                                             bool trans_b, bool save_pre, int64_t tile, int64_t splits_k) {
  TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat, "bertaccel gemm (fp32): operands must be float32");
  const auto [M, N, K] = dims(a, b, trans_a, trans_b);
  for (const at::Tensor* t : {&a, &b}) {
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0 && t->stride(0) % 4 == 0 && t->size(1) % 4 == 0,
                "bertaccel gemm (fp32): operands need 16-byte aligned data and rows that are multiples of 4 elements");
  }
  TORCH_CHECK(M < (int64_t)1 << 31 && N < (int64_t)1 << 31 && K < (int64_t)1 << 31, "bertaccel gemm: a dimension is too large");
  BERTACCEL_CHECK(epilogue >= kNone && epilogue <= kDGeluTanh, "bertaccel gemm: unknown epilogue %lld", (long long)epilogue);
  const bool needs_bias = epilogue >= kBias && (epilogue < kBiasResidual || (epilogue == kBiasResidual && bias.has_value()));
  BERTACCEL_CHECK(!needs_bias || (bias.has_value() && bias->numel() == N && bias->is_contiguous() && bias->scalar_type() == at::kFloat),
                  "bertaccel gemm (fp32): this epilogue needs a contiguous fp32 bias of %lld elements", (long long)N);
  const bool needs_aux = epilogue >= kBiasResidual;
  BERTACCEL_CHECK(!needs_aux || (aux.has_value() && aux->scalar_type() == at::kFloat && aux->is_contiguous() &&
                                 aux->dim() == 2 && aux->size(0) == M && aux->size(1) == N),
                  "bertaccel gemm (fp32): this epilogue needs a contiguous fp32 [%lld, %lld] auxiliary input", (long long)M,
                  (long long)N);
  TORCH_CHECK(tile >= 0 && tile <= kTiles, "bertaccel gemm (fp32): tile is 0 (chosen), 1 (128 x 128) or 2 (128 x 64)");
  const bool gelu = epilogue == kBiasGeluErf || epilogue == kBiasGeluTanh;
  const c10::cuda::CUDAGuard guard(a.device());
  auto out = at::empty({M, N}, a.options());
  auto pre = (gelu && save_pre) ? at::empty({M, N}, a.options()) : at::empty({0}, a.options());
  if (M == 0 || N == 0) return {out, pre};

  // The schedule: `plan`'s pick, or the one asked for (tests and sweeps): splits_k > 0 splits every
  // tile that many ways (1: none), splits_k < 0 only the tiles past the last full wave, -splits_k ways.
  const int sms = sm_count(a.get_device());
  Schedule sched = plan(M, N, K, sms, (int)tile);
  const int tiles = tile_count(M, N, sched.tile);
  if (splits_k != 0) {
    sched.splits = (int)std::max<int64_t>(1, std::abs(splits_k));
    sched.whole = splits_k == 1 ? tiles : splits_k > 0 ? 0 : tail_whole(M, N, sched.tile, sms);
  }
  int64_t per_split = ((K + sched.splits - 1) / sched.splits + kSplitAlign - 1) / kSplitAlign * kSplitAlign;
  sched.splits = (int)((K + per_split - 1) / per_split);  // none empty
  if (sched.splits == 1) sched.whole = tiles, per_split = K;
  const TileShape& shape = kTileShapes[sched.tile];

  Args p{};
  p.a = a.data_ptr<float>(), p.b = b.data_ptr<float>();
  p.bias = needs_bias ? bias->data_ptr<float>() : nullptr;
  p.aux = needs_aux ? aux->data_ptr<float>() : nullptr;
  p.pre = (gelu && save_pre) ? pre.data_ptr<float>() : nullptr;
  p.M = (int)M, p.N = (int)N, p.K = (int)K, p.lda = a.stride(0), p.ldb = b.stride(0);
  p.epilogue = (int)epilogue, p.out = out.data_ptr<float>();
  p.tiles_n = (int)((N + shape.bn - 1) / shape.bn), p.splits = sched.splits;
  p.k_per_split = (int)per_split;
  at::Tensor ws;
  if (sched.whole < tiles) {
    ws = at::empty({(int64_t)(tiles - sched.whole) * sched.splits * shape.bm * shape.bn}, a.options());
    p.ws = ws.data_ptr<float>();
  }
  launch_tile(sched.tile, trans_a, trans_b, p, tiles, sched.whole, sms, at::cuda::getCurrentCUDAStream());
  return {out, pre};
}

}  // namespace bertaccel::gemm
