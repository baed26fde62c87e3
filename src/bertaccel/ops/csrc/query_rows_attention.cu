// Attention of a few query rows per sequence over all of its keys: the last encoder layer computed at [CLS] only
// (bertaccel.modules.last_layer), one query per sequence and head over S keys. SDPA's kernels tile 64 queries: for
// one query with dropout PyTorch runs its memory-efficient kernels, 0.32 ms forward + backward at BERT-base 32x512 on
// an H200 for ~50 MB of K and V (README "Last layer at the rows the head reads"). Here one CTA per (sequence, head)
// reads each key's K and V row once for all its queries (Q <= 4):
//
//   forward : scores s = q . K_j * scale (masked keys -inf) -> lse = log sum exp, p_j = exp(s_j - lse),
//             out = sum_j p_j * keep_j / (1 - p_drop) * V_j          (fp32 accumulation)
//   backward: delta = dout . out; per key j: dV_j = sum_q p_j f_j dout, dp_j = f_j (dout . V_j),
//             ds_j = p_j (dp_j - delta), dK_j = sum_q ds_j * scale * q, dq += ds_j * scale * K_j
//
// Layout: q [B, Q, H] and kv [B, S, 2H] (the K then V projections of every token: H = heads x D) contiguous,
// key_mask [B, S] bool (true: attend), out [B, Q, H], lse [B, heads, Q] fp32 (natural log; -inf for a row with no
// key, whose output and gradients are zero), dkv [B, S, 2H] written whole (zeros at masked keys).
// Varlen (the unpadded encoder's packed rows, `query_rows_attention_varlen_*`): kv [T, 2H], sequence b's keys are
// rows cu_seqlens[b] .. cu_seqlens[b + 1] - 1 (int32 [B + 1], on the device; no mask, no padded copy of K and V),
// max_seqlen bounds every length (the keys past it are not read); dkv [T, 2H] written whole (zeros at the rows past
// cu_seqlens[B], which belong to no sequence). Key j of a sequence is its j-th row in either layout, so both layouts
// draw the same dropout mask and give the same bits.
//
// Session 56's layout (the first, one warp per key row with 4-byte loads, a scores pass and then a V pass: 186 us
// forward + backward at 32x1x512, ~0.8 TB/s): a key's row is read by a group of lanes, 16 bytes each (8 lanes at
// D = 64, bf16; a warp takes 4 keys per step), the forward is one pass (online softmax per lane group, merged over
// the groups and warps at the end), the dropout keep bits are drawn once per CTA into shared memory, and a kernel is
// compiled for one query (NQ = 1: fewer registers, two CTAs per SM) apart from the 2-4 query one.
//
// Dropout: element (b, q, h, j) is kept when 16 bits of Philox4x32 (bertaccel's 7 rounds) at counter
// (b * Q + q, j / 8 | h << 16, offset low, offset high), half j % 8 of its four words (word (j % 8) / 2, the
// high half when j is odd), are >= round(p * 65536). bertaccel.ops.attention.query_rows_keep mirrors it on CPU.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/PhiloxUtils.cuh>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <cmath>
#include <mutex>

#include "check.h"
#include "philox.cuh"
#include "vec.cuh"

namespace bertaccel {
namespace {

constexpr int kQRWarps = 8;
constexpr int kQRMaxQueries = 4;

struct QRParams {
  const void* q;
  const void* kv;
  const bool* mask;  // padded layout: [B, S]
  const int* cu;     // varlen layout: cu_seqlens [B + 1] (nullptr: padded)
  const void* dout;  // backward
  const void* out;   // backward: the forward's output
  void* o;           // forward: out; backward: dq
  void* dkv;         // backward
  float* lse;
  int64_t* rng;  // forward: (seed, offset) written; backward: read
  at::PhiloxCudaState philox;
  int batch, queries, keys, heads;  // keys: S (padded) or max_seqlen (varlen)
  int64_t tokens;                   // varlen: T, the rows of kv
  float scale, p;
};

// Where sequence b's keys are: its first row in kv and its key count (the layout's only difference).
struct KeyRows {
  int64_t first;
  int count;
  const bool* mask;  // nullptr: every key of the count is attended
};
__device__ __forceinline__ KeyRows key_rows(const QRParams& P, int b) {
  if (P.cu != nullptr) {
    const int first = P.cu[b];
    return {first, max(0, min(P.cu[b + 1] - first, P.keys)), nullptr};
  }
  return {(int64_t)b * P.keys, P.keys, P.mask + (int64_t)b * P.keys};
}

__device__ __forceinline__ void dropout_state(const QRParams& P, bool from_rng, uint64_t& seed, uint64_t& offset) {
  seed = offset = 0;
  if (P.p <= 0.f) return;
  if (from_rng) {
    seed = (uint64_t)P.rng[0];
    offset = (uint64_t)P.rng[1];
  } else {
    auto s = at::cuda::philox::unpack(P.philox);
    seed = std::get<0>(s);
    offset = std::get<1>(s);
  }
}

// A key's row is read by a group of LK lanes, one 16-byte vector (E elements) each: at head dim 64 in bf16, 8 lanes
// per key, so a warp reads KPW = 4 keys' rows at once (4 x 128 contiguous bytes) and the dot products are sums over
// the group's lanes (3 xor shuffles).
template <typename T, int D>
struct RowLayout {
  static constexpr int E = 16 / (int)sizeof(T);  // elements per lane
  static constexpr int LK = D / E;               // lanes per key row
  static constexpr int KPW = 32 / LK;            // keys per warp and step
  static_assert(LK >= 1 && LK <= 32 && 32 % LK == 0, "head dim and dtype give 1 to 32 lanes per row");
};

template <int LK>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int o = LK / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// The keep bits of (b, query i, h) for keys 32 w .. 32 w + 31: the same draws as keep_factor, four Philox calls.
__device__ __forceinline__ uint32_t keep_word(const QRParams& P, uint64_t seed, uint64_t offset, int b, int i, int h,
                                              int w) {
  const uint32_t threshold = dropout_threshold(P.p);
  uint32_t bits = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint4 c = make_uint4((uint32_t)(b * P.queries + i), (uint32_t)(4 * w + k) | ((uint32_t)h << 16),
                               (uint32_t)offset, (uint32_t)(offset >> 32));
    const uint4 r = dropout_philox(c, (uint32_t)seed, (uint32_t)(seed >> 32));
    const uint32_t words[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      const uint32_t draw = (t & 1) ? (words[t >> 1] >> 16) : (words[t >> 1] & 0xFFFFu);
      bits |= (uint32_t)(draw >= threshold) << (8 * k + t);
    }
  }
  return bits;
}

// The CTA's dropout keep bits, [Q][ceil(S / 32)] words in shared memory (drawn once, read by every key's lanes).
__device__ __forceinline__ void fill_keep_bits(const QRParams& P, uint64_t seed, uint64_t offset, int b, int h, int Q,
                                               int S, uint32_t* bits) {
  const int W = (S + 31) / 32;
  for (int x = threadIdx.x; x < Q * W; x += kQRWarps * 32) bits[x] = keep_word(P, seed, offset, b, x / W, h, x % W);
  __syncthreads();
}

__device__ __forceinline__ float kept(const uint32_t* bits, int W, int i, int j, float factor) {
  return ((bits[i * W + (j >> 5)] >> (j & 31)) & 1u) ? factor : 0.f;
}

// One CTA per (sequence, head), one pass over the keys: each lane group keeps a running max, sum and output
// (online softmax) over its keys; the groups of a warp, then the 8 warps, are merged at the end. NQ: 1 (Q = 1) or
// kQRMaxQueries (Q = 1 .. 4). Dynamic shared memory: the keep bits (dropout only).
template <typename T, int D, int NQ>
__global__ void __launch_bounds__(kQRWarps * 32, NQ == 1 ? 2 : 1) query_rows_fwd_kernel(QRParams P) {
  using L = RowLayout<T, D>;
  constexpr int E = L::E, LK = L::LK, KPW = L::KPW;
  extern __shared__ uint32_t keep_bits[];
  __shared__ float partial[kQRWarps][NQ][D];
  __shared__ float stats[kQRWarps][NQ][2];  // (max, sum) of each warp
  const int b = blockIdx.x / P.heads, h = blockIdx.x % P.heads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, group = lane / LK, sub = lane % LK;
  const KeyRows rows = key_rows(P, b);
  const int Q = NQ == 1 ? 1 : P.queries, S = rows.count, H = P.heads * D, W = (S + 31) / 32;
  uint64_t seed, offset;
  dropout_state(P, false, seed, offset);
  if (P.rng != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
    P.rng[0] = (int64_t)seed;
    P.rng[1] = (int64_t)offset;
  }
  const bool dropout = P.p > 0.f;
  const float factor = dropout ? 1.f / (1.f - P.p) : 1.f;
  if (dropout) fill_keep_bits(P, seed, offset, b, h, Q, S, keep_bits);
  const T* q = static_cast<const T*>(P.q) + (int64_t)b * Q * H + h * D + sub * E;
  const T* k = static_cast<const T*>(P.kv) + rows.first * 2 * H + h * D + sub * E;
  const T* v = k + H;
  const bool* mask = rows.mask;

  float qf[NQ][E] = {}, m[NQ], l[NQ], acc[NQ][E] = {};
#pragma unroll
  for (int i = 0; i < NQ; ++i) {
    m[i] = -INFINITY, l[i] = 0.f;
    if (i < Q) load_f<T, E>(q + (int64_t)i * H, qf[i]);
  }
#pragma unroll 2
  for (int j0 = warp * KPW; j0 < S; j0 += kQRWarps * KPW) {  // uniform over the warp (its shuffles)
    const int j = j0 + group;
    const bool in = j < S;
    float kf[E] = {}, vf[E] = {};
    if (in) {
      load_f<T, E>(k + (int64_t)j * 2 * H, kf);
      load_f<T, E>(v + (int64_t)j * 2 * H, vf);
    }
    const bool valid = in && (mask == nullptr || mask[j]);
#pragma unroll
    for (int i = 0; i < NQ; ++i) {
      if (i >= Q) break;
      float dot = 0.f;
#pragma unroll
      for (int e = 0; e < E; ++e) dot = fmaf(qf[i][e], kf[e], dot);
      const float s = group_sum<LK>(dot) * P.scale;
      if (valid) {
        const float mn = fmaxf(m[i], s);
        const float c = __expf(m[i] - mn);  // 0 while m is -inf
        const float pr = __expf(s - mn);
        const float pf = dropout ? pr * kept(keep_bits, W, i, j, factor) : pr;
        l[i] = fmaf(l[i], c, pr);
#pragma unroll
        for (int e = 0; e < E; ++e) acc[i][e] = fmaf(acc[i][e], c, pf * vf[e]);
        m[i] = mn;
      }
    }
  }
  // merge the warp's groups (lanes sub, sub + LK, ...), then the warps through shared memory
#pragma unroll
  for (int o = LK; o < 32; o <<= 1) {
#pragma unroll
    for (int i = 0; i < NQ; ++i) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[i], o), lo = __shfl_xor_sync(0xffffffffu, l[i], o);
      const float mn = fmaxf(m[i], mo);
      const float c = mn == -INFINITY ? 0.f : __expf(m[i] - mn), co = mn == -INFINITY ? 0.f : __expf(mo - mn);
      l[i] = l[i] * c + lo * co;
#pragma unroll
      for (int e = 0; e < E; ++e) acc[i][e] = acc[i][e] * c + __shfl_xor_sync(0xffffffffu, acc[i][e], o) * co;
      m[i] = mn;
    }
  }
  if (group == 0) {
#pragma unroll
    for (int i = 0; i < NQ; ++i) {
#pragma unroll
      for (int e = 0; e < E; ++e) partial[warp][i][sub * E + e] = acc[i][e];
      if (sub == 0) stats[warp][i][0] = m[i], stats[warp][i][1] = l[i];
    }
  }
  __syncthreads();
  T* out = static_cast<T*>(P.o) + (int64_t)b * Q * H + h * D;
  for (int x = threadIdx.x; x < Q * D; x += blockDim.x) {
    const int i = x / D, c = x % D;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kQRWarps; ++w) M = fmaxf(M, stats[w][i][0]);
    float sum = 0.f, o = 0.f;
    if (M != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kQRWarps; ++w) {
        const float c_w = __expf(stats[w][i][0] - M);
        sum = fmaf(stats[w][i][1], c_w, sum);
        o = fmaf(partial[w][i][c], c_w, o);
      }
      o /= sum;
    }
    out[(int64_t)i * H + c] = from_f<T>(o);
    if (c == 0) P.lse[((int64_t)b * P.heads + h) * Q + i] = M == -INFINITY ? -INFINITY : M + __logf(sum);
  }
}

// One CTA per (sequence, head): dK and dV rows of every key (written whole), dq of the Q query rows. The key layout
// and the keep bits as the forward's.
template <typename T, int D, int NQ>
__global__ void __launch_bounds__(kQRWarps * 32, NQ == 1 ? 2 : 1) query_rows_bwd_kernel(QRParams P) {
  using L = RowLayout<T, D>;
  constexpr int E = L::E, LK = L::LK, KPW = L::KPW;
  extern __shared__ uint32_t keep_bits[];
  __shared__ float partial[kQRWarps][NQ][D];
  const int b = blockIdx.x / P.heads, h = blockIdx.x % P.heads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, group = lane / LK, sub = lane % LK;
  const KeyRows rows = key_rows(P, b);
  const int Q = NQ == 1 ? 1 : P.queries, S = rows.count, H = P.heads * D, W = (S + 31) / 32;
  uint64_t seed, offset;
  dropout_state(P, true, seed, offset);
  const bool dropout = P.p > 0.f;
  const float factor = dropout ? 1.f / (1.f - P.p) : 1.f;
  if (dropout) fill_keep_bits(P, seed, offset, b, h, Q, S, keep_bits);
  const int64_t qrow = (int64_t)b * Q * H + h * D + sub * E;
  const T* q = static_cast<const T*>(P.q) + qrow;
  const T* dout = static_cast<const T*>(P.dout) + qrow;
  const T* out = static_cast<const T*>(P.out) + qrow;
  const int64_t krow = rows.first * 2 * H + h * D + sub * E;
  const T* k = static_cast<const T*>(P.kv) + krow;
  const T* v = k + H;
  T* dk = static_cast<T*>(P.dkv) + krow;
  T* dv = dk + H;
  const bool* mask = rows.mask;
  if (P.cu != nullptr) {  // varlen: the rows past the last sequence get zeros, spread over the CTAs of head h
    const float zeros[E] = {};
    T* tail = static_cast<T*>(P.dkv) + h * D + sub * E;
    for (int64_t r = P.cu[P.batch] + b + (int64_t)(warp * KPW + group) * P.batch; r < P.tokens;
         r += (int64_t)kQRWarps * KPW * P.batch) {
      store_f<T, E>(tail + r * 2 * H, zeros);
      store_f<T, E>(tail + r * 2 * H + H, zeros);
    }
  }

  float qf[NQ][E] = {}, df[NQ][E] = {}, lse[NQ], delta[NQ];
#pragma unroll
  for (int i = 0; i < NQ; ++i) {
    float of[E] = {};
    if (i < Q) {
      load_f<T, E>(q + (int64_t)i * H, qf[i]);
      load_f<T, E>(dout + (int64_t)i * H, df[i]);
      load_f<T, E>(out + (int64_t)i * H, of);
    }
    float dot = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) dot = fmaf(df[i][e], of[e], dot);
    delta[i] = group_sum<LK>(dot);
    lse[i] = i < Q ? P.lse[((int64_t)b * P.heads + h) * Q + i] : -INFINITY;
  }
  float dq[NQ][E] = {};
#pragma unroll 2
  for (int j0 = warp * KPW; j0 < S; j0 += kQRWarps * KPW) {  // uniform over the warp (its shuffles)
    const int j = j0 + group;
    const bool in = j < S;
    float kf[E] = {}, vf[E] = {}, dkf[E] = {}, dvf[E] = {};
    if (in) {
      load_f<T, E>(k + (int64_t)j * 2 * H, kf);
      load_f<T, E>(v + (int64_t)j * 2 * H, vf);
    }
    const bool valid = in && (mask == nullptr || mask[j]);
#pragma unroll
    for (int i = 0; i < NQ; ++i) {
      if (i >= Q) break;
      float s = 0.f, dpv = 0.f;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        s = fmaf(qf[i][e], kf[e], s);
        dpv = fmaf(df[i][e], vf[e], dpv);
      }
      s = group_sum<LK>(s) * P.scale;
      dpv = group_sum<LK>(dpv);
      if (valid && lse[i] != -INFINITY) {
        const float pr = __expf(s - lse[i]);
        const float f = dropout ? kept(keep_bits, W, i, j, factor) : 1.f;
        const float ds = pr * (dpv * f - delta[i]) * P.scale;
#pragma unroll
        for (int e = 0; e < E; ++e) {
          dvf[e] = fmaf(pr * f, df[i][e], dvf[e]);
          dkf[e] = fmaf(ds, qf[i][e], dkf[e]);
          dq[i][e] = fmaf(ds, kf[e], dq[i][e]);
        }
      }
    }
    if (in) {
      store_f<T, E>(dk + (int64_t)j * 2 * H, dkf);
      store_f<T, E>(dv + (int64_t)j * 2 * H, dvf);
    }
  }
  // dq: the warp's groups summed by shuffles, then the warps through shared memory
#pragma unroll
  for (int o = LK; o < 32; o <<= 1)
#pragma unroll
    for (int i = 0; i < NQ; ++i)
#pragma unroll
      for (int e = 0; e < E; ++e) dq[i][e] += __shfl_xor_sync(0xffffffffu, dq[i][e], o);
  if (group == 0)
#pragma unroll
    for (int i = 0; i < NQ; ++i)
#pragma unroll
      for (int e = 0; e < E; ++e) partial[warp][i][sub * E + e] = dq[i][e];
  __syncthreads();
  T* dqo = static_cast<T*>(P.o) + (int64_t)b * Q * H + h * D;
  for (int x = threadIdx.x; x < Q * D; x += blockDim.x) {
    const int i = x / D, c = x % D;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kQRWarps; ++w) sum += partial[w][i][c];
    dqo[(int64_t)i * H + c] = from_f<T>(sum);
  }
}

// What both layouts ask of q and kv (kv's shape is checked by the layout's own function).
void check_q_kv(const at::Tensor& q, const at::Tensor& kv, int64_t heads, double p) {
  BERTACCEL_CHECK(q.is_cuda() && q.dim() == 3 && q.is_contiguous(),
                  "bertaccel query_rows_attention: q must be a contiguous CUDA tensor [batch, queries, hidden]");
  BERTACCEL_CHECK(kv.is_cuda() && kv.is_contiguous() && kv.scalar_type() == q.scalar_type(),
                  "bertaccel query_rows_attention: kv must be a contiguous CUDA tensor of q's dtype");
  const int64_t Q = q.size(1), H = q.size(2);
  BERTACCEL_CHECK(kv.size(-1) == 2 * H, "bertaccel query_rows_attention: kv %s does not hold 2 x q's hidden (q %s)",
                  shape_str(kv.sizes()).c_str(), shape_str(q.sizes()).c_str());
  BERTACCEL_CHECK(heads > 0 && H % heads == 0, "bertaccel query_rows_attention: hidden %lld is not a multiple of %lld heads",
                  (long long)H, (long long)heads);
  const int64_t D = H / heads;
  BERTACCEL_CHECK(D == 32 || D == 64 || D == 128, "bertaccel query_rows_attention: head dim %lld (32, 64 or 128)", (long long)D);
  BERTACCEL_CHECK(Q >= 1 && Q <= kQRMaxQueries, "bertaccel query_rows_attention: %lld queries per sequence (1 to %d)",
                  (long long)Q, kQRMaxQueries);
  BERTACCEL_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf || q.scalar_type() == at::kFloat,
                  "bertaccel query_rows_attention: dtype must be bfloat16, float16 or float32");
  BERTACCEL_CHECK(p >= 0 && p < 1, "bertaccel query_rows_attention: dropout_p must be in [0, 1)");
  BERTACCEL_CHECK(reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(kv.data_ptr()) % 16 == 0,
                  "bertaccel query_rows_attention: q and kv must start on 16-byte boundaries (the rows are read as vectors)");
}

// The padded layout: kv [B, S, 2H], key_mask [B, S] bool.
void check_inputs(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& mask, int64_t heads, double p) {
  check_q_kv(q, kv, heads, p);
  BERTACCEL_CHECK(kv.dim() == 3, "bertaccel query_rows_attention: kv must be [batch, keys, 2 x hidden]");
  BERTACCEL_CHECK(mask.is_cuda() && mask.dim() == 2 && mask.is_contiguous() && mask.scalar_type() == at::kBool,
                  "bertaccel query_rows_attention: key_mask must be a contiguous CUDA bool tensor [batch, keys]");
  BERTACCEL_CHECK(kv.size(0) == q.size(0) && mask.size(0) == q.size(0) && mask.size(1) == kv.size(1),
                  "bertaccel query_rows_attention: q %s, kv %s and key_mask %s do not match", shape_str(q.sizes()).c_str(),
                  shape_str(kv.sizes()).c_str(), shape_str(mask.sizes()).c_str());
}

// The varlen layout: kv [T, 2H], cu_seqlens int32 [B + 1].
void check_varlen_inputs(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& cu, int64_t max_seqlen,
                         int64_t heads, double p) {
  check_q_kv(q, kv, heads, p);
  BERTACCEL_CHECK(kv.dim() == 2, "bertaccel query_rows_attention_varlen: kv must be the packed rows [tokens, 2 x hidden]");
  BERTACCEL_CHECK(cu.is_cuda() && cu.dim() == 1 && cu.is_contiguous() && cu.scalar_type() == at::kInt &&
                      cu.numel() == q.size(0) + 1,
                  "bertaccel query_rows_attention_varlen: cu_seqlens must be a contiguous CUDA int32 tensor [batch + 1] "
                  "(q %s, cu_seqlens %s)", shape_str(q.sizes()).c_str(), shape_str(cu.sizes()).c_str());
  BERTACCEL_CHECK(max_seqlen >= 0 && max_seqlen < (1LL << 31) && kv.size(0) < (1LL << 31),
                  "bertaccel query_rows_attention_varlen: max_seqlen and the token count must fit in int32");
}

// Dynamic shared memory of both kernels: the dropout keep bits, [Q][ceil(S / 32)] 32-bit words (checked to fit a CTA).
size_t keep_bits_smem(int64_t Q, int64_t S, double p) {
  const size_t smem = p > 0 ? (size_t)(Q * ((S + 31) / 32)) * sizeof(uint32_t) : 0;
  BERTACCEL_CHECK(smem <= 200 * 1024, "bertaccel query_rows_attention: %lld keys x %lld queries' dropout bits need more "
                  "shared memory than a CTA has", (long long)S, (long long)Q);
  return smem;
}

// f(T{}, D, NQ): NQ 1 for one query per sequence, kQRMaxQueries for 2 to 4.
template <typename F>
void dispatch_types(at::ScalarType t, int64_t D, int64_t Q, F&& f) {
  auto by_queries = [&](auto tag, auto dim) {
    if (Q == 1) f(tag, dim, std::integral_constant<int, 1>{});
    else f(tag, dim, std::integral_constant<int, kQRMaxQueries>{});
  };
  auto by_dim = [&](auto tag) {
    if (D == 32) by_queries(tag, std::integral_constant<int, 32>{});
    else if (D == 64) by_queries(tag, std::integral_constant<int, 64>{});
    else by_queries(tag, std::integral_constant<int, 128>{});
  };
  if (t == at::kBFloat16) by_dim(__nv_bfloat16{});
  else if (t == at::kHalf) by_dim(__half{});
  else by_dim(float{});
}

template <typename K>
void allow_smem(K kernel, size_t smem) {
  if (smem > 48 * 1024) C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
}

// The forward of either layout (checked by the caller): S keys per sequence (max_seqlen with cu), out [B, Q, H],
// lse [B, heads, Q] fp32, rng (seed, offset) int64.
std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(const at::Tensor& q, const at::Tensor& kv, const bool* mask,
                                                       const int* cu, int64_t S, int64_t heads, double dropout_p,
                                                       double scale) {
  c10::cuda::CUDAGuard guard(q.device());
  const int64_t B = q.size(0), Q = q.size(1), H = q.size(2), D = H / heads;
  const size_t smem = keep_bits_smem(Q, S, dropout_p);
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor lse = at::empty({B, heads, Q}, q.options().dtype(at::kFloat));
  const bool written = B > 0 && S > 0;  // the first CTA writes (seed, offset); no CTA runs otherwise
  at::Tensor rng = written ? at::empty({2}, q.options().dtype(at::kLong)) : at::zeros({2}, q.options().dtype(at::kLong));
  if (B == 0 || S == 0) {
    if (S == 0) out.zero_(), lse.fill_(-INFINITY);
    return {out, lse, rng};
  }
  QRParams P{};
  P.q = q.data_ptr();
  P.kv = kv.data_ptr();
  P.mask = mask;
  P.cu = cu;
  P.o = out.data_ptr();
  P.lse = lse.data_ptr<float>();
  P.rng = rng.data_ptr<int64_t>();
  P.batch = (int)B, P.queries = (int)Q, P.keys = (int)S, P.heads = (int)heads;
  P.tokens = kv.dim() == 2 ? kv.size(0) : 0;
  P.scale = (float)scale, P.p = (float)dropout_p;
  if (dropout_p > 0) {
    auto gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(std::nullopt, at::cuda::detail::getDefaultCUDAGenerator());
    std::lock_guard<std::mutex> lock(gen->mutex_);
    P.philox = gen->philox_cuda_state(4);  // the counter's own fields give every element its draw
  }
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_types(q.scalar_type(), D, Q, [&](auto tag, auto dim, auto nq) {
    auto kernel = query_rows_fwd_kernel<decltype(tag), decltype(dim)::value, decltype(nq)::value>;
    allow_smem(kernel, smem);
    kernel<<<(unsigned)(B * heads), kQRWarps * 32, smem, stream>>>(P);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, lse, rng};
}

void check_backward_inputs(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& out, const at::Tensor& lse,
                           int64_t heads, const at::Tensor& rng) {
  BERTACCEL_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes() && dout.is_contiguous() && out.is_contiguous() &&
                      dout.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
                  "bertaccel query_rows_attention: grad_out and out must be contiguous and shaped like q");
  BERTACCEL_CHECK(lse.is_cuda() && lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.numel() == q.size(0) * heads * q.size(1),
                  "bertaccel query_rows_attention: lse must be the forward's fp32 [batch, heads, queries]");
  BERTACCEL_CHECK(rng.is_cuda() && rng.scalar_type() == at::kLong && rng.numel() == 2,
                  "bertaccel query_rows_attention: rng must be the forward's int64 (seed, offset)");
}

// The backward of either layout (checked by the caller): dq [B, Q, H], dkv shaped like kv.
std::tuple<at::Tensor, at::Tensor> backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& kv,
                                            const bool* mask, const int* cu, int64_t S, const at::Tensor& out,
                                            const at::Tensor& lse, int64_t heads, double dropout_p, double scale,
                                            const at::Tensor& rng) {
  c10::cuda::CUDAGuard guard(q.device());
  const int64_t B = q.size(0), Q = q.size(1), H = q.size(2), D = H / heads;
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dkv = at::empty(kv.sizes(), kv.options());
  if (B == 0) return {dq, cu != nullptr ? dkv.zero_() : dkv};
  if (S == 0) return {dq.zero_(), cu != nullptr ? dkv.zero_() : dkv};
  QRParams P{};
  P.q = q.data_ptr();
  P.kv = kv.data_ptr();
  P.mask = mask;
  P.cu = cu;
  P.dout = dout.data_ptr();
  P.out = out.data_ptr();
  P.o = dq.data_ptr();
  P.dkv = dkv.data_ptr();
  P.lse = const_cast<float*>(lse.data_ptr<float>());
  P.rng = const_cast<int64_t*>(rng.data_ptr<int64_t>());
  P.batch = (int)B, P.queries = (int)Q, P.keys = (int)S, P.heads = (int)heads;
  P.tokens = kv.dim() == 2 ? kv.size(0) : 0;
  P.scale = (float)scale, P.p = (float)dropout_p;
  auto stream = at::cuda::getCurrentCUDAStream();
  const size_t smem = keep_bits_smem(Q, S, dropout_p);
  dispatch_types(q.scalar_type(), D, Q, [&](auto tag, auto dim, auto nq) {
    auto kernel = query_rows_bwd_kernel<decltype(tag), decltype(dim)::value, decltype(nq)::value>;
    allow_smem(kernel, smem);
    kernel<<<(unsigned)(B * heads), kQRWarps * 32, smem, stream>>>(P);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {dq, dkv};
}

// padded: kv [B, S, 2H], key_mask [B, S]
std::tuple<at::Tensor, at::Tensor, at::Tensor> query_rows_attention_fwd(const at::Tensor& q, const at::Tensor& kv,
                                                                        const at::Tensor& key_mask, int64_t heads,
                                                                        double dropout_p, double scale) {
  check_inputs(q, kv, key_mask, heads, dropout_p);
  return forward(q, kv, key_mask.data_ptr<bool>(), nullptr, kv.size(1), heads, dropout_p, scale);
}

std::tuple<at::Tensor, at::Tensor> query_rows_attention_bwd(const at::Tensor& dout, const at::Tensor& q,
                                                            const at::Tensor& kv, const at::Tensor& key_mask,
                                                            const at::Tensor& out, const at::Tensor& lse,
                                                            int64_t heads, double dropout_p, double scale,
                                                            const at::Tensor& rng) {
  check_inputs(q, kv, key_mask, heads, dropout_p);
  check_backward_inputs(dout, q, out, lse, heads, rng);
  return backward(dout, q, kv, key_mask.data_ptr<bool>(), nullptr, kv.size(1), out, lse, heads, dropout_p, scale, rng);
}

// varlen: kv [T, 2H], cu_seqlens int32 [B + 1]
std::tuple<at::Tensor, at::Tensor, at::Tensor> query_rows_attention_varlen_fwd(const at::Tensor& q, const at::Tensor& kv,
                                                                               const at::Tensor& cu_seqlens,
                                                                               int64_t max_seqlen, int64_t heads,
                                                                               double dropout_p, double scale) {
  check_varlen_inputs(q, kv, cu_seqlens, max_seqlen, heads, dropout_p);
  return forward(q, kv, nullptr, cu_seqlens.data_ptr<int>(), max_seqlen, heads, dropout_p, scale);
}

std::tuple<at::Tensor, at::Tensor> query_rows_attention_varlen_bwd(const at::Tensor& dout, const at::Tensor& q,
                                                                   const at::Tensor& kv, const at::Tensor& cu_seqlens,
                                                                   const at::Tensor& out, const at::Tensor& lse,
                                                                   int64_t max_seqlen, int64_t heads, double dropout_p,
                                                                   double scale, const at::Tensor& rng) {
  check_varlen_inputs(q, kv, cu_seqlens, max_seqlen, heads, dropout_p);
  check_backward_inputs(dout, q, out, lse, heads, rng);
  return backward(dout, q, kv, nullptr, cu_seqlens.data_ptr<int>(), max_seqlen, out, lse, heads, dropout_p, scale, rng);
}

}  // namespace
}  // namespace bertaccel

TORCH_LIBRARY_IMPL(bertaccel, CUDA, m) {
  m.impl("query_rows_attention_fwd", &bertaccel::query_rows_attention_fwd);
  m.impl("query_rows_attention_bwd", &bertaccel::query_rows_attention_bwd);
  m.impl("query_rows_attention_varlen_fwd", &bertaccel::query_rows_attention_varlen_fwd);
  m.impl("query_rows_attention_varlen_bwd", &bertaccel::query_rows_attention_varlen_bwd);
}
