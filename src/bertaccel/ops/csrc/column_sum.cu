// Column sums of a [rows, cols] matrix in fp32: a linear layer's bias gradient (dy summed over the
// tokens). PyTorch's `dy.sum(0)` on a [tokens, 384] bf16 gradient reaches ~15% of the copy bandwidth
// on an H100 (few output columns: its reduction splits the rows over blocks with a global semaphore
// and a narrow grid); the padded and unpadded MiniLM steps spent 0.21 / 0.30 ms per step in it.
//
// Grid (ceil(cols / VEC / LANES), row chunks), block (LANES, 256 / LANES): LANES = 32, or 16 where the column
// vectors are a multiple of 16 but not of 32 (MiniLM's 384 and 1,152: with 32 a block, the last column block had
// half its lanes idle - a fifth of the blocks at 1,152 wide, half at 384 - and the wave's blocks uneven work).
// Thread (x, y) of block (bx, by) owns the column vector bx * LANES + x (VEC columns, one 16-byte load) and walks
// rows y, y + ROW_LANES, ... of chunk by, kUnroll rows at a time with every load issued before the adds, the last
// part-round too (its missing rows read as zeros: the same sums in the same order as row by row, where the rows left
// over after the whole rounds - 1 to 3 a thread, 16384 x 1152 / 2304 - were read one at a time, each waiting on the
// last): a warp reads 512 contiguous bytes of one row (256 of two rows at 16 lanes), a block 8 (16) rows, one wave of
// blocks over the GPU with 4 loads in flight per thread. The row lanes meet in shared memory; each chunk writes one fp32 partial row, and `column_sums_kernel` (common.cuh,
// launched dependently) adds the partial rows: deterministic, no atomics. With one chunk the kernel
// writes the sums themselves. Bytes: rows x cols x sizeof(T) read, cols x 4 x (2 x chunks + 1) for the
// partials and the sums (~4% at 9,830 x 1,152).
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "common.cuh"

namespace bertaccel {
namespace {

constexpr int kThreads = 256;  // a block: LANES column vectors x kThreads / LANES rows at once
constexpr int kUnroll = 4;     // rows in flight per thread

template <typename T, int VEC, int LANES>
__global__ void __launch_bounds__(kThreads) column_sum_kernel(const T* __restrict__ x, float* __restrict__ out,
                                                              int64_t rows, int cols, int rows_per_chunk) {
  constexpr int kLanes = LANES, kRowLanes = kThreads / LANES;
  __shared__ float red[kRowLanes][kLanes * VEC + 1];
  begin_dependent_kernel();  // (the column sums of the partial rows may launch now: they wait for this grid)
  const int cv = blockIdx.x * kLanes + threadIdx.x;
  const bool live = cv * VEC < cols;
  float acc[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) acc[j] = 0.f;
  const int64_t r0 = (int64_t)blockIdx.y * rows_per_chunk;
  const int64_t r1 = min(rows, r0 + rows_per_chunk);
  if (live) {
    const T* p = x + (int64_t)cv * VEC;
    int64_t r = r0 + threadIdx.y;
    for (; r + (kUnroll - 1) * kRowLanes < r1; r += kUnroll * kRowLanes) {
      float v[kUnroll][VEC];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) load_f<T, VEC>(p + (r + u * kRowLanes) * cols, v[u]);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[j] += v[u][j];
    }
    if (r < r1) {  // the last 1 to kUnroll - 1 rows: one round, its loads predicated
      float v[kUnroll][VEC];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (r + u * kRowLanes < r1) {
          load_f<T, VEC>(p + (r + u * kRowLanes) * cols, v[u]);
        } else {
#pragma unroll
          for (int j = 0; j < VEC; ++j) v[u][j] = 0.f;
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[j] += v[u][j];
    }
  }
  // the row lanes of each column: through shared memory, then the block's LANES x VEC columns a thread each (the first
  // LANES x VEC threads), its row lanes added in order - row lane 0's thread summed all VEC columns of its vector, at
  // 16 lanes 128 loads and adds for 16 threads of the block, and spilled - and the partial row stored coalesced
#pragma unroll
  for (int j = 0; j < VEC; ++j) red[threadIdx.y][threadIdx.x * VEC + j] = acc[j];
  __syncthreads();
  const int e = threadIdx.y * kLanes + threadIdx.x;  // the block's column
  const int col = blockIdx.x * kLanes * VEC + e;
  if (e < kLanes * VEC && col < cols) {
    float s = red[0][e];
#pragma unroll
    for (int y = 1; y < kRowLanes; ++y) s += red[y][e];
    out[(int64_t)blockIdx.y * cols + col] = s;
  }
}

// Column blocks of 16 column vectors where 32 would leave lanes idle (see the top); BERTACCEL_COLSUM_LANES=32 keeps
// 32 everywhere (the blocks before session 80), to compare both in one run.
inline int column_lanes(int64_t col_vecs) {
  static const int setting = env_switch("BERTACCEL_COLSUM_LANES", 0);
  BERTACCEL_CHECK(setting == 0 || setting == 16 || setting == 32,
                  "BERTACCEL_COLSUM_LANES=%d is not a column block: unset it, or set 32 or 16", setting);
  if (setting != 0) return setting;
  return col_vecs % 32 != 0 && col_vecs % 16 == 0 ? 16 : 32;
}

// One wave: as many blocks as the GPU holds at once (the occupancy calculator's blocks per SM for this
// instantiation: 6 for the 8-wide bf16 kernel at 40 registers offline, not the 8 its threads would
// allow), split into column blocks and row chunks of at least one unrolled round of the block (32
// rows). Sized for 8 per SM, the grid ran a second, partial wave (1,056 blocks against 792 resident).
template <typename T, int VEC, int LANES>
void launch(const at::Tensor& x, const at::Tensor& out, int64_t rows, int64_t cols, cudaStream_t stream) {
  constexpr int kLanes = LANES, kRowLanes = kThreads / LANES;
  static const int per_sm = [] {
    int b = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, column_sum_kernel<T, VEC, LANES>, kThreads, 0));
    return std::max(b, 1);
  }();
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int col_blocks = (int)((cols / VEC + kLanes - 1) / kLanes);
  // Row chunks: one wave of blocks (`want` chunks a column block). Where that leaves a thread fewer than three
  // unrolled rounds (96 rows a chunk), the chunks are lengthened to fill half a wave, in whole rounds, up to 128 rows
  // (16 a thread): at 16384 x 384 / 768 the one-wave chunks were 42 / 63 rows and their 391 / 261 partial rows took a
  // second kernel of 3.7 us; 64 / 128-row chunks ran 1.5 / 1.3 us faster, 128 rows at 9,830 x 1,152 0.9 us (session
  // 77, H200). Chunks of a part of a round lost (47 rows at 2,048 x 2,304: 8.8 against 8.0-8.1 us), and so did
  // longer chunks where one wave already gave three rounds (16384 x 1152: 104 -> 128 rows, +0.2 us; 2304: 187 -> 256,
  // +3 us). BERTACCEL_COLSUM_CHUNK_ROWS: -1 one wave only (before session 77); R > 0 R rows a chunk, rounded up to
  // whole rounds (session 80; it was at least R, which could not ask for more chunks than one wave).
  // (16-lane blocks read 16 rows at once: their rounds are 64 rows, the same four a thread; the cap stays 128 rows, so
  // that 16384 x 1152's one-wave chunks of 187 rows - two rounds and a part-round a thread - stay one wave.)
  // On 16-lane blocks the one-wave chunk is rounded down to whole rounds (more chunks than one wave): 16384 x 1152's
  // 187 rows were two rounds of 64 and 59 rows of a third; 128-row chunks ran 12.9-13.0 us against 13.7 (session 80,
  // H200, two rounds). On 32-lane blocks rounding down lost (16384 x 2304 24.2 -> 26.4 us, 3072 31.2 -> 33.1, 16384 x
  // 1536 17.2 -> 17.6-17.7) and rounding up did not win (24.3-24.8, 31.5-32.0, 13.3-13.6 at 1152).
  // BERTACCEL_COLSUM_CHUNK_ROUND=down|up|none takes one rounding on every block shape, to compare.
  static const int chunk_rows = env_switch("BERTACCEL_COLSUM_CHUNK_ROWS", 0);
  static const int forced_round = env_choice("BERTACCEL_COLSUM_CHUNK_ROUND", {"", "down", "up", "none"}, "rounding");
  constexpr int kRoundOf[] = {0, -1, 1, 0};  // -1 down, 1 up, 0 none
  const int chunk_round = forced_round != 0 ? kRoundOf[forced_round] : LANES == 16 ? -1 : 0;
  constexpr int kRound = kUnroll * kRowLanes;  // rows a block reads in one unrolled round
  const int64_t want = std::max<int64_t>(1, (int64_t)sms * per_sm / col_blocks);
  const int64_t half_wave = std::max<int64_t>(1, want / 2);
  int64_t rpc64 = std::max<int64_t>(kRound, (rows + want - 1) / want);
  if (chunk_round < 0) rpc64 = std::max<int64_t>(kRound, rpc64 / kRound * kRound);
  else if (chunk_round > 0) rpc64 = (rpc64 + kRound - 1) / kRound * kRound;
  if (chunk_rows == 0 && rpc64 < 3 * kRound) {
    const int64_t half = (rows + half_wave - 1) / half_wave;
    rpc64 = std::max<int64_t>(rpc64, std::min<int64_t>(128, (half + kRound - 1) / kRound * kRound));
  } else if (chunk_rows > 0) {
    rpc64 = ((int64_t)chunk_rows + kRound - 1) / kRound * kRound;
  }
  const int rpc = (int)rpc64;
  const int chunks = (int)((rows + rpc - 1) / rpc);
  at::Tensor part = chunks > 1 ? at::empty({chunks, cols}, x.options().dtype(at::kFloat)) : out;
  launch_dependent(column_sum_kernel<T, VEC, LANES>, dim3(col_blocks, chunks), dim3(kLanes, kRowLanes), 0, stream,
                   (const T*)x.data_ptr(), part.data_ptr<float>(), rows, (int)cols, rpc);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // The partial rows' sums (common.cuh launch_column_sums): 32 x 8 blocks where one round of their loads takes every
  // partial row, else 32 x 32 from 2,048 columns (session 80) and 8 x 64 below - that rule alone under
  // BERTACCEL_COLSUM=by-width (the rule before session 81).
  if (chunks > 1) {
    const bool few = chunks <= kColumnSumsFewRows && column_sums_setting() != ColumnSumsShape::by_width;
    const auto shape = few ? ColumnSumsShape::few : cols >= 2048 ? ColumnSumsShape::wide : ColumnSumsShape::narrow;
    launch_column_sums({{&part, &out}}, chunks, (int)cols, stream, shape);
  }
}

at::Tensor column_sum(const at::Tensor& x) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous(), "bertaccel column_sum: input must be a contiguous CUDA tensor");
  BERTACCEL_CHECK(x.dim() >= 1, "bertaccel column_sum: input must have at least one dimension");
  BERTACCEL_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
                  "bertaccel column_sum: input must be bfloat16 or float32, got %s", c10::toString(x.scalar_type()));
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t cols = x.size(-1), rows = cols == 0 ? 0 : x.numel() / cols;
  BERTACCEL_CHECK(cols < (int64_t{1} << 31), "bertaccel column_sum: %lld columns do not fit 32-bit indices",
                  (long long)cols);
  if (rows == 0 || cols == 0) return at::zeros({cols}, x.options().dtype(at::kFloat));
  at::Tensor out = at::empty({cols}, x.options().dtype(at::kFloat));
  auto stream = at::cuda::getCurrentCUDAStream();
  auto run = [&](auto type_tag) {
    using T = decltype(type_tag);
    const int vec = pick_vec(cols, 16 / sizeof(T), {&x});
    const bool lanes16 = column_lanes(cols / vec) == 16;
#define BA_COLSUM_LAUNCH(V) \
  (lanes16 ? launch<T, V, 16>(x, out, rows, cols, stream) : launch<T, V, 32>(x, out, rows, cols, stream))
    if (vec == 8) { if constexpr (sizeof(T) == 2) BA_COLSUM_LAUNCH(8); }
    else if (vec == 4) BA_COLSUM_LAUNCH(4);
    else if (vec == 2) BA_COLSUM_LAUNCH(2);
    else BA_COLSUM_LAUNCH(1);
#undef BA_COLSUM_LAUNCH
  };
  if (x.scalar_type() == at::kBFloat16) run(__nv_bfloat16{});
  else run(float{});
  return out;
}

}  // namespace
}  // namespace bertaccel

TORCH_LIBRARY_IMPL(bertaccel, CUDA, m) { m.impl("column_sum", &bertaccel::column_sum); }
