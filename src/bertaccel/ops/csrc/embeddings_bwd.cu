// Backward of the fused embeddings' LayerNorm and dropout (y = dropout(LayerNorm(z))): the kernel
// of layer_norm_bwd.cuh in its kEmb form (the incoming gradient is masked), and the scatter of the
// sum's gradient dz into the three tables (embedding_tables_bwd).
//
// The scatter: PyTorch's nn.Embedding backward sorts the ids (a radix sort, a segment scan and a
// reduction per table: ~250 us per training step of MiniLM at 32x256 on an H100, three tables of
// 30522, 512 and 2 rows) to sum equal ids in a fixed order. Here one pass adds each token's dz row
// into its three table rows with fp32 atomics (16-byte `red.global.add.v4.f32` on sm_90), summing
// runs of equal ids (the token-type id of a whole batch, repeated words) in registers first, so the
// 2-row token-type table sees one atomic per block and column instead of one per token. A block takes 16 tokens of
// one position from 16 sequences of the batch ([batch, seq] ids: tokens b * seq + s, b = b0 .. b0 + 15), so that
// the position rows - the same for every sequence of a padded batch - merge into one atomic per block and column too,
// where 16 consecutive tokens of one sequence gave 16 (the position table took as many atomics as the word table; a
// batch of fewer than 8 sequences, or flat ids, keeps consecutive tokens). Every block reads its 16 dz rows before
// its first atomic (16 loads in flight a thread, where each token's load waited on the last's atomics), and a block is
// as wide as the row's vectors (rounded to a warp, up to 256: 768 wide on 192 threads, where 128-thread blocks left
// the second column block half idle). Atomics
// make the order of the fp32 additions, and so the last bits, vary from run to run: under
// torch.use_deterministic_algorithms(True) the callers use PyTorch's sorted backward instead.
#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/embedding_dense_backward.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "layer_norm_bwd.cuh"

namespace bertaccel {
namespace {

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
  launch_bwd_any<kEmb>(dy, z, gamma, mean, rstd, dz, none, dgamma, dbeta, none, p, rng);
  return {dz, dgamma, dbeta};
}

constexpr int kScatterMaxThreads = 256;  // a block's columns: the row's vectors rounded up to a warp, at most 256
constexpr int kScatterTokens = 16;       // tokens per block: 512 blocks for 32 x 256 tokens (grid x), columns on y

template <int VEC>
__device__ __forceinline__ void add_row(float* dst, const float (&v)[VEC]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (VEC == 4) {
    atomicAdd(reinterpret_cast<float4*>(dst), make_float4(v[0], v[1], v[2], v[3]));
    return;
  }
#endif
#pragma unroll
  for (int j = 0; j < VEC; ++j) atomicAdd(dst + j, v[j]);
}

// One run-length accumulator per table: consecutive tokens with the same id are summed in registers
// and added to the table once. Ids outside [0, rows) (the forward has already rejected them) and the
// padding id get nothing.
template <int VEC>
struct RunSum {
  int64_t id = -1;
  float acc[VEC];
  __device__ __forceinline__ void flush(float* table, int64_t H, int64_t col) {
    if (id >= 0) add_row<VEC>(table + id * H + col, acc);
    id = -1;
  }
  __device__ __forceinline__ void add(int64_t next, const float (&v)[VEC], float* table, int64_t H, int64_t col) {
    if (next != id) {
      flush(table, H, col);
      id = next;
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[j] = 0.f;
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] += v[j];
  }
};

// Block x takes position s = x % seq of sequences b0 = (x / seq) * 16 .. b0 + n - 1 (tokens first + k * seq); flat
// ids run as one sequence position a token (seq = 1, seqs = tokens): 16 consecutive tokens.
template <typename T, int VEC>
__global__ void __launch_bounds__(kScatterMaxThreads) embedding_tables_bwd_kernel(
    const T* __restrict__ dz, const int64_t* __restrict__ ids, const int64_t* __restrict__ pos_ids,
    const int64_t* __restrict__ type_ids, float* __restrict__ dword, float* __restrict__ dpos,
    float* __restrict__ dtype, int64_t seqs, int64_t seq, int64_t H, int64_t word_rows, int64_t pos_rows,
    int64_t type_rows, int64_t padding_idx) {
  __shared__ int64_t sid[3][kScatterTokens];
  const int64_t b0 = (int64_t)(blockIdx.x / seq) * kScatterTokens;
  const int64_t first = b0 * seq + blockIdx.x % seq;
  const int n = (int)min((int64_t)kScatterTokens, seqs - b0);
  for (int i = threadIdx.x; i < 3 * kScatterTokens; i += blockDim.x) {
    const int t = i / kScatterTokens, k = i % kScatterTokens;
    int64_t v = -1;
    if (k < n) {
      v = (t == 0 ? ids : t == 1 ? pos_ids : type_ids)[first + k * seq];
      const int64_t rows = t == 0 ? word_rows : t == 1 ? pos_rows : type_rows;
      if (v < 0 || v >= rows || (t == 0 && v == padding_idx)) v = -1;
    }
    sid[t][k] = v;
  }
  __syncthreads();
  const int64_t col = ((int64_t)blockIdx.y * blockDim.x + threadIdx.x) * VEC;
  if (col >= H) return;
  float v[kScatterTokens][VEC];  // every row's load issued before the first atomic
#pragma unroll
  for (int k = 0; k < kScatterTokens; ++k)
    if (k < n) load_f<T, VEC>(dz + (first + k * seq) * H + col, v[k]);
  RunSum<VEC> word, pos, type;
#pragma unroll
  for (int k = 0; k < kScatterTokens; ++k) {
    if (k >= n) break;
    // a skipped id (-1) ends the table's run and starts none
    if (sid[0][k] >= 0) word.add(sid[0][k], v[k], dword, H, col); else word.flush(dword, H, col);
    if (sid[1][k] >= 0) pos.add(sid[1][k], v[k], dpos, H, col); else pos.flush(dpos, H, col);
    if (sid[2][k] >= 0) type.add(sid[2][k], v[k], dtype, H, col); else type.flush(dtype, H, col);
  }
  word.flush(dword, H, col);
  pos.flush(dpos, H, col);
  type.flush(dtype, H, col);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> embedding_tables_bwd(
    const at::Tensor& dz_in, const at::Tensor& ids, const at::Tensor& pos_ids, const at::Tensor& type_ids,
    int64_t word_rows, int64_t pos_rows, int64_t type_rows, int64_t padding_idx) {
  const int64_t H = dz_in.size(-1);
  const int64_t tokens = ids.numel();
  BERTACCEL_CHECK(dz_in.numel() == tokens * H, "bertaccel embedding_tables_bwd: dz has %lld elements, expected %lld ids x %lld",
                  (long long)dz_in.numel(), (long long)tokens, (long long)H);
  BERTACCEL_CHECK(dz_in.scalar_type() == at::kFloat || dz_in.scalar_type() == at::kBFloat16,
                  "bertaccel embedding_tables_bwd: dz must be float32 or bfloat16");
  for (auto* t : {&ids, &pos_ids, &type_ids})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->numel() == tokens && t->device() == dz_in.device(),
                "bertaccel embedding_tables_bwd: ids must be int64, one per row of dz, on dz's device");
  c10::cuda::CUDAGuard guard(dz_in.device());
  if (at::globalContext().deterministicAlgorithms()) {  // PyTorch's sorted backward: a fixed order
    at::Tensor dzf = dz_in.reshape({tokens, H}).to(at::kFloat);
    return {at::embedding_dense_backward(dzf, ids.reshape({tokens}), word_rows, padding_idx, false),
            at::embedding_dense_backward(dzf, pos_ids.reshape({tokens}), pos_rows, -1, false),
            at::embedding_dense_backward(dzf, type_ids.reshape({tokens}), type_rows, -1, false)};
  }
  at::Tensor dz = dz_in.contiguous();
  at::Tensor i0 = ids.contiguous(), i1 = pos_ids.contiguous(), i2 = type_ids.contiguous();
  auto fopts = dz.options().dtype(at::kFloat);
  at::Tensor dword = at::zeros({word_rows, H}, fopts), dpos = at::zeros({pos_rows, H}, fopts),
             dtype = at::zeros({type_rows, H}, fopts);
  if (tokens == 0 || H == 0) return {dword, dpos, dtype};
  const int vec = pick_vec(H, 4, {&dz, &dword, &dpos, &dtype});
  const int64_t col_vecs = H / vec;
  const int threads = (int)std::min<int64_t>(kScatterMaxThreads, (col_vecs + 31) / 32 * 32);
  const int64_t col_blocks = (col_vecs + threads - 1) / threads;
  // [batch, seq] ids of 8 or more sequences: a block takes one position of 16 sequences (see the top); otherwise
  // consecutive tokens. BERTACCEL_EMB_SCATTER=tokens keeps consecutive tokens everywhere (the order before session 80).
  // Measured (H200, session 80, the scatter alone, tokens / positions): 16x128x768 10.7-11.2 / 9.6-9.9 us, 128x128x768
  // 60.7-61.5 / 49.9-50.0, 32x512x1024 77.7-77.8 / 63.5-64.6 (the kernel before session 80: 14.1, 66-68, 81-83).
  static const bool by_position =
      env_choice("BERTACCEL_EMB_SCATTER", {"positions", "tokens"}, "scatter order (positions, the default)") == 0;
  const int64_t seq = by_position && ids.dim() >= 2 && tokens / std::max<int64_t>(ids.size(-1), 1) >= 8 ? ids.size(-1) : 1;
  const int64_t seqs = tokens / seq;
  const int64_t tok_blocks = (seqs + kScatterTokens - 1) / kScatterTokens * seq;
  BERTACCEL_CHECK(tok_blocks < (1LL << 31) && col_blocks < 65536,
                  "bertaccel embedding_tables_bwd: %lld tokens x %lld columns is too many", (long long)tokens, (long long)H);
  dim3 grid((unsigned)tok_blocks, (unsigned)col_blocks);  // tokens on x: up to 2^31 - 1 blocks
  auto stream = at::cuda::getCurrentCUDAStream();
  auto run = [&](auto type_tag, auto vec_tag) {
    using T = decltype(type_tag);
    constexpr int V = decltype(vec_tag)::value;
    embedding_tables_bwd_kernel<T, V><<<grid, threads, 0, stream>>>(
        (const T*)dz.data_ptr(), i0.data_ptr<int64_t>(), i1.data_ptr<int64_t>(), i2.data_ptr<int64_t>(),
        dword.data_ptr<float>(), dpos.data_ptr<float>(), dtype.data_ptr<float>(), seqs, seq, H, word_rows, pos_rows,
        type_rows, padding_idx);
  };
  auto by_vec = [&](auto type_tag) {
    if (vec == 4) run(type_tag, std::integral_constant<int, 4>{});
    else if (vec == 2) run(type_tag, std::integral_constant<int, 2>{});
    else run(type_tag, std::integral_constant<int, 1>{});
  };
  if (dz.scalar_type() == at::kBFloat16) by_vec(__nv_bfloat16{});
  else by_vec(float{});
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {dword, dpos, dtype};
}

}  // namespace
}  // namespace bertaccel

TORCH_LIBRARY_IMPL(bertaccel, CUDA, m) {
  m.impl("embedding_layer_norm_bwd", &bertaccel::embedding_layer_norm_bwd);
  m.impl("embedding_tables_bwd", &bertaccel::embedding_tables_bwd);
}
