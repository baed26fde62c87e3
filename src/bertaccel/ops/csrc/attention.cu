// Fused variable-length attention (FlashAttention-2 style), forward and backward, bf16 / fp16 with
// fp32 accumulation, head dims 32, 64 and 128, on sm_80+ tensor cores (mma.sync m16n8k16).
//
// Inputs are packed rows: q, k, v are [T, heads, d] (any token and head strides, the last dim
// contiguous: views of one fused QKV projection output work), sequence b owns rows
// cu_seqlens[b] .. cu_seqlens[b + 1] - or, given seqused, the first seqused[b] of those rows (a padded
// [batch, seq] layout read in place: cu_seqlens b * seq, seqused the lengths). Nothing of size seq x seq
// is written: the forward keeps a running max and sum per query row (online softmax, fp32) and saves the
// log-sum-exp; the backward recomputes P from it. Rows of no sequence - past cu_seqlens[batch] (the fillers
// of a token count rounded up to a bucket), and a slot's rows past seqused - are fillers: their output,
// lse and gradients are written as zeros.
//
// Forward: one CTA of 4 warps per (64 queries, head, sequence); each warp owns 16 query rows and
// walks the sequence's keys 64 at a time: S = Q K^T (Q fragments held in registers, K from shared
// memory by ldmatrix), online softmax, O += P V (P converted in registers from the accumulator
// layout to the A-operand layout, V by ldmatrix.trans). K/V tiles are double-buffered by cp.async.
//
// Backward: one CTA per (64 keys, head, sequence) walks the query blocks (Q, dO double-buffered):
// S = Q K^T and dP = dO V^T per warp of 16 query rows, P = exp(S - lse), dS = P (dP - D) with
// D = rowsum(dO * O) from a pre-pass; dQ += dS K accumulated in fp32 with atomics (a post-pass
// scales and casts it); P and dS go through shared memory so that each warp then accumulates 16
// keys of dV += P^T dO and dK += dS^T Q in registers.
//
// Dropout: element (query q, key k, head h) of a sequence is kept when a 16-bit slice of Philox4x32-7
// at counter (token of q's 16-row tile + q % 8, (k - k % 16 + 2 * ((k % 8) / 2)) | h << 16, offset)
// is >= round(p * 65536) (see keep_bits): one Philox call gives the 8 draws a thread needs for its
// 2 rows x 4 keys of a 16 x 16 tile, in the forward and in the backward alike.
// bertaccel/ops/attention.py has the same function on the CPU.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/PhiloxUtils.cuh>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <mutex>
#include <optional>
#include <string>
#include <set>
#include <utility>

#include "check.h"
#include "philox.cuh"
#include "switches.h"
#include "async_copy.cuh"  // smem_u32 for every build; the rest for the sm_90a kernels
#if defined(BERTACCEL_ATTENTION_SM90A)
#include "tensor_map.h"
#include "wgmma.cuh"
#endif

namespace bertaccel {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kBlockM = 64;  // queries per forward CTA / per backward step
constexpr int kBlockN = 64;  // keys per forward step / per backward CTA
constexpr float kLog2e = 1.4426950408889634f;

// ------------------------------------------------------------------------------ PTX helpers
using async_copy::smem_u32;

// 16 bytes global -> shared; bytes past `src_bytes` (0 or 16) are zero-filled
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(src_bytes));
}
// 4 bytes global -> shared (through L1); zero-filled when `src_bytes` is 0
__device__ __forceinline__ void cp_async4(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

// C[16x8] += A[16x16] B[16x8], fp32 accumulators
template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t u) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&u));
  } else {
    return __half22float2(*reinterpret_cast<__half2*>(&u));
  }
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

struct Dropout {
  uint64_t seed, offset;
  uint32_t threshold;  // keep when the 16-bit draw >= threshold
  float scale;         // 1 / (1 - p)
};

// The Philox words of one thread's 8 draws of a 16 x 16 tile (see keep_bits for which element each is).
__device__ __forceinline__ uint4 keep_draws(const Dropout& d, int64_t row_token, int key, int head) {
  const uint4 c = make_uint4((uint32_t)row_token, (uint32_t)key | ((uint32_t)head << 16), (uint32_t)d.offset,
                             (uint32_t)(d.offset >> 32));
  return dropout_philox(c, (uint32_t)d.seed, (uint32_t)(d.seed >> 32));
}

// The keep bits of one thread's 8 elements of a 16 x 16 tile: rows g and g + 8 of the tile (g =
// lane / 4), keys 2t, 2t + 1, 2t + 8, 2t + 9 (t = lane % 4). Bit i of the result: word i / 2,
// half i % 2 -> (row g + 8 * (i / 4), key 2t + (i & 1) + 8 * ((i / 2) & 1)).
__device__ __forceinline__ uint32_t keep_bits(const Dropout& d, int64_t row_token, int key, int head) {
  const uint4 r = keep_draws(d, row_token, key, head);
  const uint32_t w[4] = {r.x, r.y, r.z, r.w};
  uint32_t bits = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t h = (i & 1) ? (w[i / 2] >> 16) : (w[i / 2] & 0xFFFFu);
    bits |= (h >= d.threshold ? 1u : 0u) << i;
  }
  return bits;
}

// Accumulator (c) index of one 16 x 16 tile's two n8 halves -> the keep bit above:
// half j (keys 8j..), c index e (row g + 8 * (e / 2), key 2t + e % 2) -> bit 4 * (e / 2) + 2 * j + e % 2
__device__ __forceinline__ int keep_bit_index(int side, int e) { return 4 * (e / 2) + 2 * side + (e & 1); }

// The same test without the packed bits (the Hopper kernels): draw_kept tests draw (side, e) of keep_draws'
// words - bit keep_bit_index(side, e), i.e. half e % 2 of word 2 (e / 2) + side - directly, so each element
// costs its half's extraction and one compare (packing the bits and testing them again cost two more integer
// instructions per element).
__device__ __forceinline__ bool draw_kept(const uint4& r, int side, int e, uint32_t threshold) {
  const int word = 2 * (e / 2) + side;
  const uint32_t w = word == 0 ? r.x : word == 1 ? r.y : word == 2 ? r.z : r.w;
  return ((e & 1) ? (w >> 16) : (w & 0xFFFFu)) >= threshold;
}

struct Params {
  const void* q;
  const void* k;
  const void* v;
  const void* o;   // forward: written; backward: read
  const void* dout;
  void* out;       // forward output
  void* dk;
  void* dv;
  float* dq_accum;  // [T, heads, d] fp32
  void* dq;         // the Hopper backward in clusters: written directly
  float* lse;       // [heads, T] natural log
  float* dsum;      // [heads, T] rowsum(dO * O)
  int64_t q_row, q_head, k_row, k_head, v_row, v_head;  // strides, elements
  int64_t o_row, o_head, do_row, do_head;               // out / o and dout strides
  int64_t grad_row;  // token stride of dq, dk, dv (elements; heads * d, or 3 * heads * d in one packed d(qkv))
  const int* cu;
  const int* used;  // seqused: sequence b is the first used[b] rows of slot cu[b] .. cu[b + 1] (null: all of them)
  int batch, heads, total;
  float scale;  // softmax scale
  float p;
  at::PhiloxCudaState philox;
  int64_t* rng;  // forward: (seed, offset) written; backward: read
};

// Sequence b's rows: from `start`, `len` of them; its slot (rows start .. start + slot) ends in fillers when
// seqused is given (a negative seqused: attn_check_seqused_kernel has stopped the forward).
struct SeqRows {
  int start, len, slot;
};
__device__ __forceinline__ SeqRows sequence_rows(const Params& p, int b) {
  const int start = p.cu[b], slot = p.cu[b + 1] - start;
  return {start, p.used ? max(0, min(p.used[b], slot)) : slot, slot};
}

// A negative seqused[b] is the interface's mark of a padding mask row that is not right-padded
// (hf_attention.py): no layout of the kernels holds that batch, so the forward stops with the reason, in
// a kernel of its own before the attention's (an assert - a function call - inside the attention kernels
// changed their register allocation: up to 224 registers instead of 169, spills where there were none).
__global__ void attn_check_seqused_kernel(const int* used, int batch) {
  for (int i = threadIdx.x; i < batch; i += blockDim.x)
    if (used[i] < 0)
      __assert_fail("bertaccel attention: a padding mask row is not right-padded (its tokens are not one run from "
                    "position 0); pad on the right (tokenizer padding_side='right') or use attn_implementation='sdpa'",
                    __FILE__, __LINE__, __func__);
}

// The fillers of sequence b's slot that fall in this CTA's rows [lo, hi) of the slot (those past `len`), head
// h: zeroed in up to three [T, heads, D] tensors (token stride `row`, heads contiguous, 16-byte aligned rows:
// check_qkv) and in lse. Every thread of the CTA calls it; no-op without seqused (the slot is the sequence).
template <typename T, int D>
__device__ __forceinline__ void zero_slot_fillers(const SeqRows& s, int lo, int hi, int h, int64_t row, T* a, T* b,
                                                  T* c, float* lse, int total) {
  const int r0 = max(lo, s.len), r1 = min(hi, s.slot);
  if (r0 >= r1) return;
  constexpr int C = D * (int)sizeof(T) / 16;  // 16-byte chunks per head row
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  for (int i = threadIdx.x; i < (r1 - r0) * C; i += blockDim.x) {
    const int64_t off = (int64_t)(s.start + r0 + i / C) * row + (int64_t)h * D + (i % C) * (16 / (int)sizeof(T));
    if (a) *reinterpret_cast<uint4*>(a + off) = zero;
    if (b) *reinterpret_cast<uint4*>(b + off) = zero;
    if (c) *reinterpret_cast<uint4*>(c + off) = zero;
  }
  if (lse)
    for (int r = r0 + (int)threadIdx.x; r < r1; r += blockDim.x) lse[(int64_t)h * total + s.start + r] = 0.f;
}

__device__ __forceinline__ Dropout read_dropout(const Params& p, bool from_rng) {
  Dropout d{0, 0, 0, 1.f};
  if (p.p > 0.f) {
    if (from_rng) {
      d.seed = (uint64_t)p.rng[0];
      d.offset = (uint64_t)p.rng[1];
    } else {
      auto s = at::cuda::philox::unpack(p.philox);
      d.seed = std::get<0>(s);
      d.offset = std::get<1>(s);
    }
    d.threshold = dropout_threshold(p.p);
    d.scale = 1.f / (1.f - p.p);
  }
  return d;
}

// The forward's dropout state, drawn from PyTorch's generator; the grid's first thread also writes its
// (seed, offset) to p.rng, from which the backward regenerates the mask ((0, 0) without dropout: the host
// allocates rng without a fill kernel).
template <bool DROPOUT>
__device__ __forceinline__ Dropout forward_dropout(const Params& p) {
  const Dropout drop = read_dropout(p, false);
  if (p.rng != nullptr && blockIdx.x == 0 && blockIdx.z == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
    p.rng[0] = (int64_t)drop.seed;
    p.rng[1] = (int64_t)drop.offset;
  }
  return drop;
}

// Zero rows [cu[batch], total) of [T, heads, d] tensors (token stride `row`, heads contiguous): the fillers.
// Run by the grid's last z slice (gridDim.x * gridDim.y blocks): one warp per row, 16-byte stores where the
// tensors allow them. (The first version spread elements over threads with a 64-bit division and modulo per
// 2-byte store: on BERT-base 16x128 with 40% fillers it took 2x the forward's own time.)
template <typename T>
__device__ void zero_fillers(const Params& p, int D, int64_t row, T* a, T* b, float* lse, T* c = nullptr) {
  const int first_row = p.cu[p.batch];
  if (first_row >= p.total) return;
  const int hd = p.heads * D;
  const int thread = (blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x;
  const int threads = gridDim.x * gridDim.y * blockDim.x;  // a multiple of 32
  const int lane = threadIdx.x & 31, warp = thread >> 5, warps = threads >> 5;
  constexpr int V = 16 / sizeof(T);
  auto aligned = [](const T* x) { return x == nullptr || reinterpret_cast<uintptr_t>(x) % 16 == 0; };
  if (hd % V == 0 && row % V == 0 && aligned(a) && aligned(b) && aligned(c)) {
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    for (int r = first_row + warp; r < p.total; r += warps) {
      const int64_t base = (int64_t)r * row;
      for (int e = lane * V; e < hd; e += 32 * V) {
        if (a) *reinterpret_cast<uint4*>(a + base + e) = zero;
        if (b) *reinterpret_cast<uint4*>(b + base + e) = zero;
        if (c) *reinterpret_cast<uint4*>(c + base + e) = zero;
      }
    }
  } else {
    for (int r = first_row + warp; r < p.total; r += warps) {
      const int64_t base = (int64_t)r * row;
      for (int e = lane; e < hd; e += 32) {
        if (a) a[base + e] = T{};  // value-initialised: +0
        if (b) b[base + e] = T{};
        if (c) c[base + e] = T{};
      }
    }
  }
  if (lse) {
    for (int h = 0; h < p.heads; ++h)
      for (int i = first_row + thread; i < p.total; i += threads) lse[(int64_t)h * p.total + i] = 0.f;
  }
}

// rows x D tile of [T, heads, d] at (token row0, head) into shared memory with row pitch LD;
// rows >= valid are zero-filled.
template <typename T, int D, int ROWS, int LD>
__device__ __forceinline__ void load_tile(T* s, const T* g, int64_t row_stride, int64_t row0, int valid) {
  constexpr int CHUNKS = D / 8;
  for (int c = threadIdx.x; c < ROWS * CHUNKS; c += kThreads) {
    const int r = c / CHUNKS, col = (c % CHUNKS) * 8;
    const bool ok = r < valid;
    const T* src = ok ? g + (row0 + r) * row_stride + col : g;
    cp_async16(s + r * LD + col, src, ok ? 16 : 0);
  }
}

// ------------------------------------------------------------------------------ forward
// CTAs per SM the forward is compiled for. At D = 64 shared memory fits 4 (5 x 64 x 72 bf16 = 46 KB
// each) but the kernel compiled to 129 registers, which rounds to 136 x 128 threads: 3 CTAs. Asking
// for 4 caps it at 128.
template <int D>
constexpr int fwd_min_blocks() { return D == 64 ? 4 : 0; }  // 0: no minimum (as without the argument)

template <typename T, int D, bool DROPOUT>
__global__ void __launch_bounds__(kThreads, fwd_min_blocks<D>()) attn_fwd_kernel(const Params p) {
  constexpr int LD = D + 8;  // +16 bytes per row: ldmatrix rows fall in distinct banks
  extern __shared__ __align__(16) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  T* sK = sQ + kBlockM * LD;          // [2][kBlockN][LD]
  T* sV = sK + 2 * kBlockN * LD;      // [2][kBlockN][LD]
  const int b = blockIdx.z, h = blockIdx.y;
  if (b == p.batch) {
    zero_fillers<T>(p, D, p.o_row, static_cast<T*>(p.out), nullptr, p.lse);
    return;
  }
  const Dropout drop = forward_dropout<DROPOUT>(p);
  const SeqRows seq = sequence_rows(p, b);
  const int start = seq.start, len = seq.len;
  const int m0 = blockIdx.x * kBlockM;
  zero_slot_fillers<T, D>(seq, m0, m0 + kBlockM, h, p.o_row, static_cast<T*>(p.out), nullptr, nullptr, p.lse, p.total);
  if (m0 >= len) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const T* q = static_cast<const T*>(p.q) + (int64_t)h * p.q_head;
  const T* k = static_cast<const T*>(p.k) + (int64_t)h * p.k_head;
  const T* v = static_cast<const T*>(p.v) + (int64_t)h * p.v_head;

  load_tile<T, D, kBlockM, LD>(sQ, q, p.q_row, start + m0, len - m0);
  load_tile<T, D, kBlockN, LD>(sK, k, p.k_row, start, len);
  load_tile<T, D, kBlockN, LD>(sV, v, p.v_row, start, len);
  cp_async_commit();

  constexpr int KS = D / 16;  // k-slices of the head dim
  constexpr int NT = kBlockN / 8;  // n8 tiles of S per warp
  constexpr int DT = D / 8;  // n8 tiles of O per warp
  uint32_t qf[KS][4];
  float acc[DT][4];
#pragma unroll
  for (int i = 0; i < DT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
  const float scale_log2 = p.scale * kLog2e;
  const int nblocks = (len + kBlockN - 1) / kBlockN;
  const int64_t row_token = (int64_t)start + m0 + warp * 16 + g;  // the dropout counter's row

  for (int n = 0; n < nblocks; ++n) {
    cp_async_wait_all();
    __syncthreads();
    if (n + 1 < nblocks) {
      const int stage = (n + 1) & 1;
      load_tile<T, D, kBlockN, LD>(sK + stage * kBlockN * LD, k, p.k_row, start + (n + 1) * kBlockN,
                                   len - (n + 1) * kBlockN);
      load_tile<T, D, kBlockN, LD>(sV + stage * kBlockN * LD, v, p.v_row, start + (n + 1) * kBlockN,
                                   len - (n + 1) * kBlockN);
      cp_async_commit();
    }
    if (n == 0) {
#pragma unroll
      for (int ks = 0; ks < KS; ++ks)
        ldmatrix_x4(qf[ks], sQ + (warp * 16 + lane % 16) * LD + ks * 16 + (lane / 16) * 8);
    }
    const T* cK = sK + (n & 1) * kBlockN * LD;
    const T* cV = sV + (n & 1) * kBlockN * LD;

    // S = Q K^T for this warp's 16 rows x 64 keys
    float s[NT][4];
#pragma unroll
    for (int i = 0; i < NT; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t kb[4];
        const int j = lane / 8, r = lane % 8;
        ldmatrix_x4(kb, cK + (np * 16 + (j / 2) * 8 + r) * LD + ks * 16 + (j % 2) * 8);
        mma16816<T>(s[2 * np], qf[ks], kb[0], kb[1]);
        mma16816<T>(s[2 * np + 1], qf[ks], kb[2], kb[3]);
      }
    }
    // mask keys past the sequence (last block only), scale to log2 units
    const int key0 = n * kBlockN;
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + i * 8 + 2 * t + (e & 1);
        s[i][e] = key < len ? s[i][e] * scale_log2 : -INFINITY;
      }
    // online softmax: rows g (e = 0, 1) and g + 8 (e = 2, 3); a row's 64 keys are spread over a quad
    float corr[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = row_max[r];
#pragma unroll
      for (int i = 0; i < NT; ++i) mx = fmaxf(mx, fmaxf(s[i][2 * r], s[i][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      corr[r] = fast_exp2(row_max[r] - mx);  // 0 on the first block (-inf - finite)
      row_max[r] = mx;
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < NT; ++i) {
        s[i][2 * r] = fast_exp2(s[i][2 * r] - mx);
        s[i][2 * r + 1] = fast_exp2(s[i][2 * r + 1] - mx);
        sum += s[i][2 * r] + s[i][2 * r + 1];
      }
      row_sum[r] = row_sum[r] * corr[r] + sum;  // quad-partial; reduced at the end
    }
#pragma unroll
    for (int i = 0; i < DT; ++i) {
      acc[i][0] *= corr[0];
      acc[i][1] *= corr[0];
      acc[i][2] *= corr[1];
      acc[i][3] *= corr[1];
    }
    // O += P V, P by 16-key slices straight from the accumulators
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      if constexpr (DROPOUT) {
        const uint32_t bits = keep_bits(drop, row_token, key0 + kk * 16 + 2 * t, h);
#pragma unroll
        for (int side = 0; side < 2; ++side)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const bool keep = (bits >> keep_bit_index(side, e)) & 1u;
            s[2 * kk + side][e] = keep ? s[2 * kk + side][e] * drop.scale : 0.f;
          }
      }
      uint32_t a[4];
      a[0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
      a[1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
      a[2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      a[3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        uint32_t vb[4];
        const int j = lane / 8, r = lane % 8;
        ldmatrix_x4_trans(vb, cV + (kk * 16 + (j % 2) * 8 + r) * LD + dp * 16 + (j / 2) * 8);
        mma16816<T>(acc[2 * dp], a, vb[0], vb[1]);
        mma16816<T>(acc[2 * dp + 1], a, vb[2], vb[3]);
      }
    }
  }
  // finish: O / l, lse = (max + log2 l) * ln 2
  T* out = static_cast<T*>(p.out) + (int64_t)h * p.o_head;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = row_sum[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const float inv = 1.f / sum;
    const int row = m0 + warp * 16 + g + 8 * r;
    if (row < len) {
      T* o = out + (int64_t)(start + row) * p.o_row;
#pragma unroll
      for (int i = 0; i < DT; ++i)
        *reinterpret_cast<uint32_t*>(o + i * 8 + 2 * t) = pack2<T>(acc[i][2 * r] * inv, acc[i][2 * r + 1] * inv);
      if (t == 0) p.lse[(int64_t)h * p.total + start + row] = (row_max[r] + __log2f(sum)) / kLog2e;
    }
  }
}

// ------------------------------------------------------------------------------ backward
// D = rowsum(dO * O) per (row, head), fp32: D / 8 threads per (row, head), 16 bytes of each per thread;
// and, when zero_dq, clears the fp32 dQ sums (D values per (row, head): all of them, whatever their layout)
template <typename T, int D>
__global__ void attn_bwd_dsum_kernel(const Params p, bool zero_dq) {
  constexpr int TPR = D / 8;  // threads per (row, head); divides 32
  const int64_t gid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t w = gid / TPR;
  const int part = (int)(gid % TPR);
  const bool valid = w < (int64_t)p.total * p.heads;  // no early return: the shuffles below take every lane
  const int64_t row = w / p.heads;
  const int h = (int)(w % p.heads);
  float acc = 0.f;
  if (valid) {
    const uint4 a = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.o) + row * p.o_row + (int64_t)h * p.o_head + part * 8);
    const uint4 b = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.dout) + row * p.do_row + (int64_t)h * p.do_head + part * 8);
    const uint32_t av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 x = unpack2<T>(av[i]), y = unpack2<T>(bv[i]);
      acc += x.x * y.x + x.y * y.y;
    }
    if (zero_dq) {
      float4* z = reinterpret_cast<float4*>(p.dq_accum + w * D + part * 8);
      z[0] = z[1] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
#pragma unroll
  for (int s = TPR / 2; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, s);
  if (valid && part == 0) p.dsum[(int64_t)h * p.total + row] = row < p.cu[p.batch] ? acc : 0.f;
}

template <typename T, int D, bool DROPOUT>
__global__ void __launch_bounds__(kThreads) attn_bwd_kernel(const Params p) {
  constexpr int LD = D + 8;
  constexpr int LP = kBlockN + 8;  // pitch of the P and dS tiles
  extern __shared__ __align__(16) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem);             // [kBlockN][LD]
  T* sV = sK + kBlockN * LD;                      // [kBlockN][LD]
  T* sQ = sV + kBlockN * LD;                      // [2][kBlockM][LD]
  T* sdO = sQ + 2 * kBlockM * LD;                 // [2][kBlockM][LD]
  T* sP = sdO + 2 * kBlockM * LD;                 // [kBlockM][LP]
  T* sdS = sP + kBlockM * LP;                     // [kBlockM][LP]
  float* sLse = reinterpret_cast<float*>(sdS + kBlockM * LP);  // [2][kBlockM], log2 units
  float* sDsum = sLse + 2 * kBlockM;                            // [2][kBlockM]
  const int b = blockIdx.z, h = blockIdx.y;
  if (b == p.batch) {
    zero_fillers<T>(p, D, p.grad_row, static_cast<T*>(p.dk), static_cast<T*>(p.dv), nullptr);
    return;
  }
  const SeqRows seq = sequence_rows(p, b);
  const int start = seq.start, len = seq.len;
  const int n0 = blockIdx.x * kBlockN;
  zero_slot_fillers<T, D>(seq, n0, n0 + kBlockN, h, p.grad_row, static_cast<T*>(p.dk), static_cast<T*>(p.dv), nullptr,
                          nullptr, p.total);
  if (n0 >= len) return;
  const Dropout drop = read_dropout(p, true);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const T* q = static_cast<const T*>(p.q) + (int64_t)h * p.q_head;
  const T* k = static_cast<const T*>(p.k) + (int64_t)h * p.k_head;
  const T* v = static_cast<const T*>(p.v) + (int64_t)h * p.v_head;
  const T* dout = static_cast<const T*>(p.dout) + (int64_t)h * p.do_head;
  const float scale_log2 = p.scale * kLog2e;

  auto load_q_block = [&](int m, int stage) {
    const int m0 = m * kBlockM;
    load_tile<T, D, kBlockM, LD>(sQ + stage * kBlockM * LD, q, p.q_row, start + m0, len - m0);
    load_tile<T, D, kBlockM, LD>(sdO + stage * kBlockM * LD, dout, p.do_row, start + m0, len - m0);
    for (int r = threadIdx.x; r < kBlockM; r += kThreads) {
      const bool ok = m0 + r < len;
      const int64_t i = (int64_t)h * p.total + start + m0 + r;
      // a padded query row gets P = 0 (lse +inf) and D = 0
      sLse[stage * kBlockM + r] = ok ? p.lse[i] * kLog2e : INFINITY;
      sDsum[stage * kBlockM + r] = ok ? p.dsum[i] : 0.f;
    }
  };
  load_tile<T, D, kBlockN, LD>(sK, k, p.k_row, start + n0, len - n0);
  load_tile<T, D, kBlockN, LD>(sV, v, p.v_row, start + n0, len - n0);
  load_q_block(0, 0);
  cp_async_commit();

  constexpr int KS = D / 16;
  constexpr int NT = kBlockN / 8;
  constexpr int DT = D / 8;
  float dk[DT][4], dv[DT][4];
#pragma unroll
  for (int i = 0; i < DT; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.f;
  const int mblocks = (len + kBlockM - 1) / kBlockM;
  float* dq_accum = p.dq_accum + (int64_t)h * D;
  const int64_t dq_row = (int64_t)p.heads * D;

  for (int m = 0; m < mblocks; ++m) {
    const int stage = m & 1;
    cp_async_wait_all();
    __syncthreads();
    if (m + 1 < mblocks) {
      load_q_block(m + 1, stage ^ 1);
      cp_async_commit();
    }
    const T* cQ = sQ + stage * kBlockM * LD;
    const T* cdO = sdO + stage * kBlockM * LD;
    const int m0 = m * kBlockM;
    const int wrow = warp * 16;  // this warp's 16 query rows of the block

    // S = Q K^T and dPd = dO V^T for 16 rows x 64 keys
    float s[NT][4], dp[NT][4];
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[i][e] = dp[i][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      uint32_t qa[4], da[4];
      ldmatrix_x4(qa, cQ + (wrow + lane % 16) * LD + ks * 16 + (lane / 16) * 8);
      ldmatrix_x4(da, cdO + (wrow + lane % 16) * LD + ks * 16 + (lane / 16) * 8);
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t kb[4], vb[4];
        const int j = lane / 8, r = lane % 8;
        ldmatrix_x4(kb, sK + (np * 16 + (j / 2) * 8 + r) * LD + ks * 16 + (j % 2) * 8);
        ldmatrix_x4(vb, sV + (np * 16 + (j / 2) * 8 + r) * LD + ks * 16 + (j % 2) * 8);
        mma16816<T>(s[2 * np], qa, kb[0], kb[1]);
        mma16816<T>(s[2 * np + 1], qa, kb[2], kb[3]);
        mma16816<T>(dp[2 * np], da, vb[0], vb[1]);
        mma16816<T>(dp[2 * np + 1], da, vb[2], vb[3]);
      }
    }
    // P, dropout, dS = P (dP - D); P (dropped) and dS to shared memory as bf16
    const float lse0 = sLse[stage * kBlockM + wrow + g], lse1 = sLse[stage * kBlockM + wrow + g + 8];
    const float ds0 = sDsum[stage * kBlockM + wrow + g], ds1 = sDsum[stage * kBlockM + wrow + g + 8];
    const int64_t row_token = (int64_t)start + m0 + wrow + g;
    uint32_t dsa[kBlockN / 16][4];  // dS as A fragments (rows = queries, k = keys), for dQ
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      [[maybe_unused]] uint32_t bits = 0xFFu;
      if constexpr (DROPOUT) bits = keep_bits(drop, row_token, n0 + kk * 16 + 2 * t, h);
#pragma unroll
      for (int side = 0; side < 2; ++side) {
        const int i = 2 * kk + side;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = n0 + i * 8 + 2 * t + (e & 1);
          const float lse = e < 2 ? lse0 : lse1, dsum = e < 2 ? ds0 : ds1;
          const float pr = key < len ? fast_exp2(s[i][e] * scale_log2 - lse) : 0.f;
          float pd = pr, dpe = dp[i][e];
          if constexpr (DROPOUT) {
            const bool keep = (bits >> keep_bit_index(side, e)) & 1u;
            pd = keep ? pr * drop.scale : 0.f;
            dpe = keep ? dpe * drop.scale : 0.f;
          }
          s[i][e] = pd;                   // P with dropout, for dV
          dp[i][e] = pr * (dpe - dsum);   // dS
        }
        T* prow = sP + (wrow + g) * LP + i * 8 + 2 * t;
        T* drow = sdS + (wrow + g) * LP + i * 8 + 2 * t;
        *reinterpret_cast<uint32_t*>(prow) = pack2<T>(s[i][0], s[i][1]);
        *reinterpret_cast<uint32_t*>(prow + 8 * LP) = pack2<T>(s[i][2], s[i][3]);
        *reinterpret_cast<uint32_t*>(drow) = pack2<T>(dp[i][0], dp[i][1]);
        *reinterpret_cast<uint32_t*>(drow + 8 * LP) = pack2<T>(dp[i][2], dp[i][3]);
      }
      dsa[kk][0] = pack2<T>(dp[2 * kk][0], dp[2 * kk][1]);
      dsa[kk][1] = pack2<T>(dp[2 * kk][2], dp[2 * kk][3]);
      dsa[kk][2] = pack2<T>(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
      dsa[kk][3] = pack2<T>(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
    }
    // dQ (unscaled) += dS K for the warp's 16 rows, fp32 atomics
    {
      float dq[DT][4];
#pragma unroll
      for (int i = 0; i < DT; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk)
#pragma unroll
        for (int dpi = 0; dpi < DT / 2; ++dpi) {
          uint32_t kb[4];
          const int j = lane / 8, r = lane % 8;
          ldmatrix_x4_trans(kb, sK + (kk * 16 + (j % 2) * 8 + r) * LD + dpi * 16 + (j / 2) * 8);
          mma16816<T>(dq[2 * dpi], dsa[kk], kb[0], kb[1]);
          mma16816<T>(dq[2 * dpi + 1], dsa[kk], kb[2], kb[3]);
        }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = m0 + wrow + g + 8 * r;
        if (row < len) {
          float* dst = dq_accum + (int64_t)(start + row) * dq_row;
#pragma unroll
          for (int i = 0; i < DT; ++i) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
            atomicAdd(reinterpret_cast<float2*>(dst + i * 8 + 2 * t), make_float2(dq[i][2 * r], dq[i][2 * r + 1]));
#else
            atomicAdd(dst + i * 8 + 2 * t, dq[i][2 * r]);
            atomicAdd(dst + i * 8 + 2 * t + 1, dq[i][2 * r + 1]);
#endif
          }
        }
      }
    }
    __syncthreads();  // P and dS of all 64 rows are in shared memory
    // dV += P^T dO and dK += dS^T Q for this warp's 16 keys
    const int wkey = warp * 16;
#pragma unroll
    for (int qs = 0; qs < kBlockM / 16; ++qs) {
      uint32_t pa[4], sa[4];
      const int j = lane / 8, r = lane % 8;
      // A[m = key][k = query] from the [query][key] tiles: ldmatrix.trans
      ldmatrix_x4_trans(pa, sP + (qs * 16 + (j / 2) * 8 + r) * LP + wkey + (j % 2) * 8);
      ldmatrix_x4_trans(sa, sdS + (qs * 16 + (j / 2) * 8 + r) * LP + wkey + (j % 2) * 8);
#pragma unroll
      for (int dpi = 0; dpi < DT / 2; ++dpi) {
        uint32_t ob[4], qb[4];
        ldmatrix_x4_trans(ob, cdO + (qs * 16 + (j % 2) * 8 + r) * LD + dpi * 16 + (j / 2) * 8);
        ldmatrix_x4_trans(qb, cQ + (qs * 16 + (j % 2) * 8 + r) * LD + dpi * 16 + (j / 2) * 8);
        mma16816<T>(dv[2 * dpi], pa, ob[0], ob[1]);
        mma16816<T>(dv[2 * dpi + 1], pa, ob[2], ob[3]);
        mma16816<T>(dk[2 * dpi], sa, qb[0], qb[1]);
        mma16816<T>(dk[2 * dpi + 1], sa, qb[2], qb[3]);
      }
    }
  }
  // write dK (scaled) and dV for this warp's 16 keys; the gradients are [T, heads, d], token stride grad_row
  T* dkp = static_cast<T*>(p.dk) + (int64_t)h * D;
  T* dvp = static_cast<T*>(p.dv) + (int64_t)h * D;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = n0 + warp * 16 + g + 8 * r;
    if (key < len) {
      const int64_t off = (int64_t)(start + key) * p.grad_row;
#pragma unroll
      for (int i = 0; i < DT; ++i) {
        *reinterpret_cast<uint32_t*>(dkp + off + i * 8 + 2 * t) =
            pack2<T>(dk[i][2 * r] * p.scale, dk[i][2 * r + 1] * p.scale);
        *reinterpret_cast<uint32_t*>(dvp + off + i * 8 + 2 * t) = pack2<T>(dv[i][2 * r], dv[i][2 * r + 1]);
      }
    }
  }
}

// The Hopper backward's dQ partial sums: [heads, T, d] fp32, each token row's 32-byte chunks (8 values)
// XOR-permuted by the token index: chunk c of token row r at chunk c ^ dq_chunk_phase(r, d). The backward
// stages 64 rows in shared memory in this layout (so the 8 rows one store instruction writes fall in
// different banks) and adds them with one bulk copy; attn_bwd_dq_kernel undoes the permutation.
__host__ __device__ __forceinline__ int dq_chunk_phase(int row, int d) { return row & (d / 8 - 1); }

// The layouts of dq_accum: the mma.sync backward's [T, heads, d], the Hopper backward's (dq_chunk_phase)
enum class DqLayout : int { kTokensMajor = 0, kHeadsMajorPermuted = 1 };

// scale * (a, b), cast to T: one 16-byte chunk of dq from 8 fp32 partial sums
template <typename T>
__device__ __forceinline__ uint4 scaled8(const float4 a, const float4 b, float scale) {
  uint4 out;
  out.x = pack2<T>(a.x * scale, a.y * scale);
  out.y = pack2<T>(a.z * scale, a.w * scale);
  out.z = pack2<T>(b.x * scale, b.y * scale);
  out.w = pack2<T>(b.z * scale, b.w * scale);
  return out;
}

// dq = scale * dq_accum, cast; 8 elements (one 32-byte chunk of dq_accum) per thread. dq is [T, heads, d]
// with token stride dq_row (heads contiguous); dq_accum in `layout`
template <typename T>
__global__ void attn_bwd_dq_kernel(const float* __restrict__ acc, T* __restrict__ dq, int64_t n, float scale,
                                   DqLayout layout, int heads, int d, int64_t dq_row) {
  const int64_t i = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * 8;
  if (i < n) {
    int64_t j = i;
    const int64_t row = (int64_t)heads * d, tok = i / row;
    if (layout != DqLayout::kTokensMajor) {
      const int64_t tokens = n / row;
      const int h = (int)(i % row / d);
      int c = (int)(i % d);
      if (layout == DqLayout::kHeadsMajorPermuted) c = ((c >> 3) ^ dq_chunk_phase((int)tok, d)) << 3;
      j = ((int64_t)h * tokens + tok) * d + c;
    }
    const float4 a = *reinterpret_cast<const float4*>(acc + j), b = *reinterpret_cast<const float4*>(acc + j + 4);
    *reinterpret_cast<uint4*>(dq + tok * dq_row + i % row) = scaled8<T>(a, b, scale);
  }
}

// ------------------------------------------------------------------------------ forward, Hopper
// sm_90a (built when the GPU is a Hopper: BERTACCEL_ATTENTION_SM90A): the same algorithm, dropout
// and outputs as attn_fwd_kernel, with warpgroup MMAs. A CTA of NWG warpgroups takes 64 * NWG
// queries of one (sequence, head); each warpgroup owns 64 of them. Per block of BN keys: S = Q K^T
// by wgmma with Q and K in shared memory, online softmax in the accumulators' registers, then
// O += P V by wgmma with P from registers (the accumulator layout of S is, per warp, the mma.sync
// layout, so P packs into A fragments in place) and V in shared memory as an MN-major operand.
// Tiles are stored as the tensor cores read them: rows of 128 bytes (64 elements; D = 128 as two
// column blocks) or 64 bytes (D = 32) with the matching swizzle, double-buffered: K and V by TMA at
// D <= 64 (one cp.async.bulk.tensor per tile, an mbarrier per stage), by cp.async at D = 128; Q by cp.async.
#if defined(BERTACCEL_ATTENTION_SM90A)
namespace hopper {

// The dynamic shared memory's first 1024-byte boundary (the 128-byte swizzle's atoms repeat every 1024
// bytes), reached by pointer arithmetic on the shared-memory pointer itself: through an integer cast the
// compiler loses the address space and every access to the tiles became a generic 64-bit one (ST / LD
// instead of STS / LDS, 64-bit address arithmetic).
__device__ __forceinline__ uint8_t* align_shared_1024(unsigned char* smem) {
  return reinterpret_cast<uint8_t*>(smem) + ((1024u - (smem_u32(smem) & 1023u)) & 1023u);
}

// The shared-memory image of a [rows x D] tile: column blocks of kRowBytes-wide rows, 16-byte chunks
// XOR-swizzled within each 8-row atom (128-byte rows: chunk ^ row % 8; 64-byte rows: chunk ^ (row / 2) % 4),
// as TMA's SWIZZLE_128B / SWIZZLE_64B would write it.
template <int D>
struct Swz {
  static constexpr int kRowBytes = D >= 64 ? 128 : D * 2;
  static constexpr int kChunks = kRowBytes / 16;  // 16-byte chunks per row of a column block
  static constexpr int kAtom = 8 * kRowBytes;      // 8 rows: the swizzle's period
  static_assert(D == 32 || D % 64 == 0, "head dim 32 or a multiple of 64");
  template <int R>
  __device__ static __forceinline__ int offset(int r, int c) {  // bytes; chunk c of D / 8
    const int blk = c / kChunks, cc = c % kChunks;
    const int phase = kRowBytes == 128 ? (r & 7) : ((r >> 1) & 3);
    return blk * R * kRowBytes + r * kRowBytes + ((cc ^ phase) << 4);
  }
  // the high word of a tile's wgmma descriptor: stride byte offset (one 8-row atom) >> 4, swizzle mode
  // (bits 62-63: 1 = 128-byte, 2 = 64-byte); the same for every tile of this layout
  static constexpr uint32_t kDescHi = (uint32_t)(kAtom >> 4) | ((kRowBytes == 128 ? 1u : 2u) << 30);
};

// The wgmma descriptors of one [R rows x D] tile (Swz<D>). The low word (start address >> 4, leading byte
// offset >> 4 at bit 16 - MN-major: the next column block) is built once, where the tile's base is set, so
// that the descriptor of a k-slice is one 32-bit add of a constant: built from the slice's address at every
// use (mask, shift, or), each descriptor cost five uniform instructions and the backward's loop about 200
// of its ~650 per query block. Shared addresses stay below 2^18, so the 14-bit start field never carries.
template <int D, int R>
struct TileDesc {
  using S = Swz<D>;
  uint32_t lo;
  __device__ __forceinline__ explicit TileDesc(const void* tile)
      : lo((smem_u32(tile) >> 4) | ((uint32_t)(R * S::kRowBytes) >> 4 << 16)) {}
  __device__ __forceinline__ TileDesc(uint32_t lo_) : lo(lo_) {}
  // the same layout `bytes` further on (bytes % 16 == 0; e.g. a tile's other pipeline stage)
  __device__ __forceinline__ TileDesc plus(uint32_t bytes) const { return TileDesc(lo + (bytes >> 4)); }
  __device__ __forceinline__ uint64_t at(int bytes) const {
    return ((uint64_t)S::kDescHi << 32) | (uint64_t)(lo + ((uint32_t)bytes >> 4));
  }
  // A K-major operand ([R rows x D], K = D): k-slice ks (16 elements, 32 bytes)
  __device__ __forceinline__ uint64_t k_major(int ks) const {
    const int byte = ks * 32;
    return at(byte / S::kRowBytes * R * S::kRowBytes + byte % S::kRowBytes);
  }
  // An MN-major operand ([R rows = K x D = N]): K rows 16 ks .. 16 ks + 15
  __device__ __forceinline__ uint64_t mn_major(int ks) const { return at(ks * 16 * S::kRowBytes); }
};

// Thread-block clusters: mbarriers other CTAs arrive at (initialised by async_copy::mbar_init), and reads of
// another CTA's shared memory
using async_copy::fence_mbar_init;
using async_copy::mbar_init;
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// the same shared-memory offset in CTA `rank` of the cluster
__device__ __forceinline__ uint32_t map_to_rank(uint32_t local, int rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
}
// arrive (release, cluster scope) at CTA `rank`'s copy of this CTA's mbarrier `bar`
__device__ __forceinline__ void mbarrier_arrive_cluster(uint64_t* bar, int rank) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(map_to_rank(smem_u32(bar), rank))
               : "memory");
}
__device__ __forceinline__ void mbarrier_wait_cluster(uint64_t* bar, int parity) {
  const uint32_t addr = smem_u32(bar);
  uint32_t done = 0;
  while (!done)
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(addr), "r"(parity) : "memory");
}
__device__ __forceinline__ float4 ld_shared_cluster_f4(uint32_t local, int rank) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(map_to_rank(local, rank)) : "memory");
  return v;
}

// dst[0 .. bytes) += src (fp32), by the copy engine (a bulk async reduction; 16-byte aligned, bytes % 16 == 0)
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
               "r"(smem_u32(src)), "r"(bytes)
               : "memory");
  async_copy::bulk_commit();
}

// TMA (the forward's K / V tiles, the backward's Q / dO): the mbarriers the copy engine completes
// (async_copy.cuh, as the GEMM's), and a 3-D tile copy ([d, heads, tokens] box) into the swizzled image
// (SWIZZLE_128B / 64B: Swz<D>'s layout)
using async_copy::mbar_expect_tx;
using async_copy::mbar_wait;
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, int c0, int c1, int c2, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
      ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(bar))
      : "memory");
}

// rows x D tile of [T, heads, d] at (token row0) into the swizzled image; rows >= valid zero-filled.
// Thread x copies chunk x % (D / 8) of rows x / (D / 8) + i * NT / (D / 8): a fixed chunk, so its
// shared-memory offset (the swizzle phase repeats every 8 rows) and its global column are set once.
// FULL: every row of the tile is in the sequence (valid >= R): no per-row test (the test and the zero-fill
// select cost the forward ~90 of its ~425 instructions per key block at d 64).
template <typename T, int D, int R, int NT, bool FULL = false>
__device__ __forceinline__ void load_tile(uint8_t* s, const T* g, int64_t row_stride, int64_t row0, int valid) {
  constexpr int CH = D / 8, ROWS = NT / CH;  // rows per pass
  static_assert(NT % CH == 0 && ROWS % 8 == 0 && R % ROWS == 0, "whole passes of whole swizzle atoms");
  const int r0 = threadIdx.x / CH, ch = threadIdx.x % CH;
  uint8_t* dst = s + Swz<D>::template offset<R>(r0, ch);
  const T* src = g + (row0 + r0) * row_stride + ch * 8;
#pragma unroll
  for (int i = 0; i < R / ROWS; ++i) {
    if constexpr (FULL) {
      cp_async16(dst + i * ROWS * Swz<D>::kRowBytes, src + i * ROWS * row_stride, 16);
    } else {
      const bool ok = r0 + i * ROWS < valid;
      cp_async16(dst + i * ROWS * Swz<D>::kRowBytes, ok ? src + i * ROWS * row_stride : g, ok ? 16 : 0);
    }
  }
}
// load_tile with the per-row test only where the tile reaches past the sequence (a uniform branch)
template <typename T, int D, int R, int NT>
__device__ __forceinline__ void load_tile_any(uint8_t* s, const T* g, int64_t row_stride, int64_t row0, int valid) {
  if (valid >= R) load_tile<T, D, R, NT, true>(s, g, row_stride, row0, valid);
  else load_tile<T, D, R, NT, false>(s, g, row_stride, row0, valid);
}

template <int D, int NWG, int BN>
constexpr size_t fwd_smem() { return (size_t)(64 * NWG + 4 * BN) * D * 2 + NWG * 128 * 4 + 32 + 1024; }  // Q, 2 x (K, V), anchor, 4 mbarriers, alignment

// Keys per block by default. 128 (BERTACCEL_ATTENTION_FWD=n128, D <= 64) needs 156-168 registers (3 CTAs
// per SM instead of 4; it spilled 48-144 bytes at the 128-register cap) and measured faster only on full
// 512-token sequences at D = 32 (see hopper_forward_warpgroups).
constexpr int kFwdBlockN = 64;
constexpr float kRescaleSlack = 8.f;  // log2 units: the forward's exponentials stay below 256 (see attn_fwd_kernel)

template <int D, int NWG, int BN>
constexpr int fwd_min_blocks() { return D <= 64 ? (BN > 64 ? 3 : 4) / NWG : 1; }  // 128 registers at D <= 64 (168 with 128 keys)

// Pin registers at this point of the program: the compiler may not move their reads or writes across
// (a wgmma reads and writes them asynchronously, between its issue and the wait that follows).
template <int N>
__device__ __forceinline__ void reg_fence(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void reg_fence(uint32_t (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}

// Per block n of BN keys, each warpgroup: the softmax of S_n (its exponentials overlap the MMAs of
// O += P_{n-1} V_{n-1} still running), then the MMAs of S_{n+1} = Q K_{n+1}^T and of O += P_n V_n are
// issued together and only S_{n+1}'s are waited for (FlashAttention-3's intra-warpgroup overlap).
// Loads run a block ahead: K_{n+2} and V_{n+1} are copied, issued behind those MMAs, while block n+1's
// softmax runs.
template <typename T, int D, bool DROPOUT, int NWG, int BN>
__global__ void __launch_bounds__(NWG * 128, (fwd_min_blocks<D, NWG, BN>()))
    attn_fwd_kernel(const Params p, const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int BM = 64 * NWG, NT = NWG * 128;
  constexpr bool F16 = std::is_same_v<T, __half>;
  using S = Swz<D>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint8_t* sQ = align_shared_1024(smem_raw);
  uint8_t* sK = sQ + BM * D * 2;      // [2][BN x D]: K_n in stage n % 2
  uint8_t* sV = sK + 2 * BN * D * 2;  // [2][BN x D]: V_n in stage n % 2
  volatile float* anchor = reinterpret_cast<float*>(sV + 2 * BN * D * 2);  // [NT], written, never read
  // TMA (D <= 64): K and V tiles copied by thread 0, one instruction each, completing full[stage] (K) and
  // full[2 + stage] (V); with cp.async every thread computed four 64-bit row addresses per tile (~25
  // instructions per tile per thread). Rows past the tensor read zero; rows of the next sequence are read:
  // their keys are masked to -inf in the last block, so their V rows are weighted by P = 0.
  constexpr bool kTma = D <= 64;
  uint64_t* full = reinterpret_cast<uint64_t*>(const_cast<float*>(anchor) + NT);
  const int b = blockIdx.z, h = blockIdx.y;
  if (b == p.batch) {
    zero_fillers<T>(p, D, p.o_row, static_cast<T*>(p.out), nullptr, p.lse);
    return;
  }
  const Dropout drop = forward_dropout<DROPOUT>(p);
  const SeqRows seq = sequence_rows(p, b);
  const int start = seq.start, len = seq.len;
  const int m0 = blockIdx.x * BM;
  zero_slot_fillers<T, D>(seq, m0, m0 + BM, h, p.o_row, static_cast<T*>(p.out), nullptr, nullptr, p.lse, p.total);
  if (m0 >= len) return;
  const int wg = threadIdx.x / 128, wt = threadIdx.x % 128, warp = wt / 32, lane = threadIdx.x % 32, g = lane / 4,
            t = lane % 4;
  const T* q = static_cast<const T*>(p.q) + (int64_t)h * p.q_head;
  const T* k = static_cast<const T*>(p.k) + (int64_t)h * p.k_head;
  const T* v = static_cast<const T*>(p.v) + (int64_t)h * p.v_head;
  const int nblocks = (len + BN - 1) / BN;
  auto load_k = [&](int n) {
    if constexpr (kTma) {
      if (threadIdx.x == 0) {
        mbar_expect_tx(&full[n & 1], BN * D * 2);
        tma_load_3d(sK + (n & 1) * BN * D * 2, &tm_k, 0, h, start + n * BN, &full[n & 1]);
      }
    } else {
      load_tile_any<T, D, BN, NT>(sK + (n & 1) * BN * D * 2, k, p.k_row, start + n * BN, len - n * BN);
    }
  };
  auto load_v = [&](int n) {
    if constexpr (kTma) {
      if (threadIdx.x == 0) {
        mbar_expect_tx(&full[2 + (n & 1)], BN * D * 2);
        tma_load_3d(sV + (n & 1) * BN * D * 2, &tm_v, 0, h, start + n * BN, &full[2 + (n & 1)]);
      }
    } else {
      load_tile_any<T, D, BN, NT>(sV + (n & 1) * BN * D * 2, v, p.v_row, start + n * BN, len - n * BN);
    }
  };
  // the k-th copy into a stage completes its mbarrier's phase k: block n's tiles, phase n / 2
  auto wait_k = [&](int n) { if constexpr (kTma) mbar_wait(&full[n & 1], (n >> 1) & 1); };
  auto wait_v = [&](int n) { if constexpr (kTma) mbar_wait(&full[2 + (n & 1)], (n >> 1) & 1); };
  if constexpr (kTma) {
    if (threadIdx.x == 0) {
#pragma unroll
      for (int i = 0; i < 4; ++i) mbar_init(&full[i], 1);
      fence_mbar_init();  // the inits, seen by the copy engine
    }
  }

  load_tile<T, D, BM, NT>(sQ, q, p.q_row, start + m0, len - m0);
  load_k(0);
  load_v(0);
  if (nblocks > 1) load_k(1);
  cp_async_commit();

  constexpr int KS = D / 16;   // k-slices of S = Q K^T
  constexpr int PS = BN / 16;  // k-slices of O += P V
  constexpr int NS = BN / 8;   // n8 column groups of S
  constexpr int NO = D / 8;    // n8 column groups of O
  float o[D / 2], s[BN / 2];
  uint32_t pa[PS][4];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) s[i] = 0.f;
#pragma unroll
  for (int i = 0; i < PS; ++i) pa[i][0] = pa[i][1] = pa[i][2] = pa[i][3] = 0u;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
  const float scale_log2 = p.scale * kLog2e;
  const int wrow = wg * 64 + warp * 16;  // this warp's 16 query rows of the CTA's BM
  const int64_t row_token = (int64_t)start + m0 + wrow + g;  // the dropout counter's row
  // this warpgroup's 64 rows of Q: 64-row offsets keep the swizzle phase (a multiple of 8 rows)
  const TileDesc<D, BM> q_wg(sQ + wg * 64 * S::kRowBytes);
  const TileDesc<D, BN> k_desc(sK), v_desc(sV);  // stage 0; stage 1 is BN * D * 2 bytes on
  auto issue_s = [&](int n) {  // S_n = Q K_n^T, this warpgroup's 64 rows x BN keys
    const TileDesc<D, BN> kn = k_desc.plus((n & 1) * BN * D * 2);
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) wgmma::mma_ss<F16, BN, 0, 0>(s, q_wg.k_major(ks), kn.k_major(ks), ks > 0 ? 1 : 0);
    wgmma::commit();
  };

  cp_async_wait_all();
  async_copy::fence_proxy_async();  // this thread's cp.async writes, visible to the tensor cores' (async proxy) reads
  __syncthreads();      // and every thread's (and, with TMA, the mbarriers' inits)
  wait_k(0);
  wgmma::fence();
  issue_s(0);
  wgmma::wait<0>();
  reg_fence(s);

  // Block n; NEXT: S_{n+1} follows (every block but the last). The last block is its own instance, so
  // that no wgmma issue or wait is conditional at run time: ptxas then serializes every wgmma (C7514)
  // or waits for all of them before the softmax.
  auto block = [&](int n, auto next) {
    constexpr bool NEXT = decltype(next)::value;
    // softmax of S_n; element 4 j + e: row g + 8 (e / 2), key 8 j + 2 t + e % 2. Keys past the sequence
    // (the last block only) masked to -inf; max in raw units, exponentials as exp2(s * scale_log2 - max
    // * scale_log2): one FFMA per element. row_max is kept in log2 units.
    const int key0 = n * BN;
    // only the last block can reach past the sequence ((n + 1) * BN < len while a block follows): the test
    // compiled into 32 ISETP + 32 FSEL in every block (if-converted), not a branch around them
    if (!NEXT && key0 + BN > len) {
#pragma unroll
      for (int j = 0; j < NS; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (key0 + j * 8 + 2 * t + (e & 1) >= len) s[4 * j + e] = -INFINITY;
    }
    // The reference max of each row moves only when a block's max exceeds it by more than kRescaleSlack
    // (log2 units; FlashAttention-4's conditional rescaling): the exponentials below the reference stay
    // under 2^kRescaleSlack, the row sum and lse use the same reference, and O is rescaled only in the
    // blocks where a row of the warp moved it (after the first block, rarely).
    float corr[2];
    bool moved = false;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = s[2 * r];
#pragma unroll
      for (int j = 0; j < NS; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float cand = mx * scale_log2;                 // key 0 of each block is real: finite
      const bool move = cand > row_max[r] + kRescaleSlack;  // always on the first block (-inf)
      corr[r] = move ? fast_exp2(row_max[r] - cand) : 1.f;  // 0 on the first block (-inf - finite)
      if (move) row_max[r] = cand;
      moved |= move;
      const float mx_log2 = row_max[r];
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < NS; ++j) {
        s[4 * j + 2 * r] = fast_exp2(fmaf(s[4 * j + 2 * r], scale_log2, -mx_log2));
        s[4 * j + 2 * r + 1] = fast_exp2(fmaf(s[4 * j + 2 * r + 1], scale_log2, -mx_log2));
        sum += s[4 * j + 2 * r] + s[4 * j + 2 * r + 1];
      }
      row_sum[r] = row_sum[r] * corr[r] + sum;
    }
    // Keep the exponentials above ahead of the wait and the barrier below: ptxas moves register-only work
    // freely across both, and sank the whole softmax below them (no overlap with P_{n-1} V_{n-1}). A
    // shared-memory store of a value that needs every exponential (the row sums) is ordered before them.
    anchor[threadIdx.x] = row_sum[0] + row_sum[1];
    wgmma::wait<0>();  // O += P_{n-1} V_{n-1} is done: O and the P registers are free
    reg_fence(o);
    reg_fence(pa);
    if constexpr (!kTma) {
      cp_async_wait_all();  // K_{n+1} and V_n (copied during block n - 1, or before the loop)
      async_copy::fence_proxy_async();
    }
    __syncthreads();  // every warpgroup is past S_n and P_{n-1} V_{n-1}: K_n's and V_{n-1}'s stages are free
    if constexpr (NEXT) wait_k(n + 1);  // (with cp.async: no-ops, the copies are in)
    wait_v(n);
    if (__any_sync(0xffffffffu, moved)) {  // (the warp's O rows; corr is 1 for the rows that did not move)
#pragma unroll
      for (int i = 0; i < NO; ++i) {
        o[4 * i] *= corr[0];
        o[4 * i + 1] *= corr[0];
        o[4 * i + 2] *= corr[1];
        o[4 * i + 3] *= corr[1];
      }
    }
    // P (dropped) as A fragments
#pragma unroll
    for (int kk = 0; kk < PS; ++kk) {
      if constexpr (DROPOUT) {  // dropped P unscaled: 1 / (1 - p) goes with 1 / l at the end (O is linear in P)
        const uint4 r = keep_draws(drop, row_token, key0 + kk * 16 + 2 * t, h);
#pragma unroll
        for (int side = 0; side < 2; ++side)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float& x = s[4 * (2 * kk + side) + e];
            x = draw_kept(r, side, e, drop.threshold) ? x : 0.f;
          }
      }
      pa[kk][0] = pack2<T>(s[8 * kk], s[8 * kk + 1]);
      pa[kk][1] = pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
      pa[kk][2] = pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
      pa[kk][3] = pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
    }
    wgmma::fence();
    if constexpr (NEXT) issue_s(n + 1);
    // O += P_n V_n: V [BN keys x D] is the MN-major B operand (K = keys, N = D)
    const TileDesc<D, BN> vn = v_desc.plus((n & 1) * BN * D * 2);
#pragma unroll
    for (int kk = 0; kk < PS; ++kk) wgmma::mma_rs<F16, D, 1>(o, pa[kk], vn.mn_major(kk), 1);
    wgmma::commit();
    // the next copies, behind the MMAs just issued: K_{n+2} into K_n's stage, V_{n+1} into V_{n-1}'s
    if (n + 2 < nblocks) load_k(n + 2);
    if constexpr (NEXT) load_v(n + 1);
    cp_async_commit();
    if constexpr (NEXT) {
      wgmma::wait<1>();  // S_{n+1} is in; P_n V_n may still run
      reg_fence(s);
    }
  };
  for (int n = 0; n + 1 < nblocks; ++n) block(n, std::true_type{});
  block(nblocks - 1, std::false_type{});
  wgmma::wait<0>();
  reg_fence(o);
  // finish: O / l through shared memory (this warpgroup's Q rows, free now) for 16-byte row stores;
  // lse = (max + log2 l) * ln 2
  uint8_t* stage = sQ + wg * 64 * S::kRowBytes;  // 64 rows of each column block (Swz<D>::offset<BM>)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = row_sum[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    float inv = 1.f / sum;
    if constexpr (DROPOUT) inv *= drop.scale;  // P was kept unscaled
    const int lr = warp * 16 + g + 8 * r;  // row within the warpgroup's 64
#pragma unroll
    for (int i = 0; i < NO; ++i)
      *reinterpret_cast<uint32_t*>(stage + S::template offset<BM>(lr, i) + 4 * t) =
          pack2<T>(o[4 * i + 2 * r] * inv, o[4 * i + 2 * r + 1] * inv);
    const int row = m0 + wg * 64 + lr;
    if (t == 0 && row < len) p.lse[(int64_t)h * p.total + start + row] = (row_max[r] + __log2f(sum)) / kLog2e;
  }
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");  // this warpgroup's rows are staged
  T* out = static_cast<T*>(p.out) + (int64_t)h * p.o_head;
  constexpr int CH = D / 8;
#pragma unroll
  for (int c = wt; c < 64 * CH; c += 128) {
    const int lr = c / CH, ch = c % CH, row = m0 + wg * 64 + lr;
    if (row < len)
      *reinterpret_cast<uint4*>(out + (int64_t)(start + row) * p.o_row + ch * 8) =
          *reinterpret_cast<const uint4*>(stage + S::template offset<BM>(lr, ch));
  }
#endif
}

// Backward on warpgroup MMAs (D <= 64): one warpgroup per CTA of 64 keys, as attn_bwd_kernel walks the
// query blocks. Per block of 64 queries: S = Q K^T and dP = dO V^T (A and B in shared memory); P and dS
// in registers; dQ = dS K with dS from registers, its 64 rows added to an fp32 [heads, T, d] buffer by
// one bulk asynchronous reduction (cp.reduce.async.bulk) instead of per-element atomics - or, with at
// most 2 key blocks, summed with the other CTA's through distributed shared memory (CLUSTER); P and dS
// through shared memory (swizzled, MN-major) for dV += P^T dO and dK += dS^T Q, whose B operands (dO, Q)
// are read MN-major from the same tiles the first two MMAs read K-major. The next block's Q and dO (TMA)
// and lse and D (cp.async) are copied behind the current block's first MMAs.
template <int D>
constexpr size_t bwd_smem() {  // K, V, 2 x (Q, dO), P, dS, 2 x (lse, dsum), 4 mbarriers, alignment
  return (size_t)6 * 64 * D * 2 + 2 * 64 * 64 * 2 + 4 * 64 * 4 + 32 + 1024;
}

// CTAs per SM the registers must allow (the cluster code's few extra registers would otherwise cost one).
// With dropout at head dim 64 also 3 (168 registers, 28 / 40 bytes spilled, clusters 0 / 2): 253-256 us
// against 266-270 on 2 CTAs (218 registers) at 32x512x12x64 on the H100; at head dim 32, 4 CTAs with
// dropout (128 registers, 104 bytes spilled) measured level with 3 (benchmarks/results/h100/
// attention_bwd_dropout_3ctas_4769539.txt, attention_bwd_dropout_d32_4ctas_6b6297f.txt).
template <int D, bool DROPOUT>
constexpr int bwd_min_blocks() { return D <= 32 ? (DROPOUT ? 3 : 4) : 3; }

template <typename T, int D, bool DROPOUT, int CLUSTER>
__global__ void __launch_bounds__(128, (bwd_min_blocks<D, DROPOUT>()))
    attn_bwd_kernel(const Params p, const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_do) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int B = 64, NT = 128;  // keys per CTA = queries per block
  constexpr int TILE = B * D * 2;
  constexpr bool F16 = std::is_same_v<T, __half>;
  using S = Swz<D>;
  using SP = Swz<64>;  // P and dS: [64 queries x 64 keys], 128-byte rows
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint8_t* sK = align_shared_1024(smem_raw);
  uint8_t* sV = sK + TILE;
  uint8_t* sQ = sV + TILE;         // [2]
  uint8_t* sdO = sQ + 2 * TILE;    // [2]
  uint8_t* sP = sdO + 2 * TILE;    // 8 KB
  uint8_t* sdS = sP + B * 64 * 2;  // 8 KB
  float* sLse = reinterpret_cast<float*>(sdS + B * 64 * 2);  // [2][64]
  float* sDsum = sLse + 2 * B;                                // [2][64]
  uint64_t* bars = reinterpret_cast<uint64_t*>(sDsum + 2 * B);  // CLUSTER: staged, consumed
  // Q and dO of a query block by TMA: thread 0 issues both copies into the stage, completing full[stage]
  // (every thread waits on it, parity m / 2, before the block's first MMAs). Rows past the sequence hold
  // the next sequence's rows (rows past the tensor: zero): their lse is set to +inf, so P = 0 and dS = 0.
  uint64_t* full = bars + 2;
  const int b = blockIdx.z, h = blockIdx.y;
  if (b == p.batch) {
    zero_fillers<T>(p, D, p.grad_row, static_cast<T*>(p.dk), static_cast<T*>(p.dv), nullptr,
                    p.dq_accum ? nullptr : static_cast<T*>(p.dq));
    return;
  }
  const SeqRows seq = sequence_rows(p, b);
  const int start = seq.start, len = seq.len;
  const int n0 = blockIdx.x * B;
  // (dq too where the clusters write it: elsewhere its fp32 sums are cleared for every row and cast)
  zero_slot_fillers<T, D>(seq, n0, n0 + B, h, p.grad_row, static_cast<T*>(p.dk), static_cast<T*>(p.dv),
                          p.dq_accum ? nullptr : static_cast<T*>(p.dq), nullptr, p.total);
  // CLUSTER > 0 (gridDim.x <= CLUSTER): every key block of one (sequence, head) in one thread-block
  // cluster, summing dQ through each other's shared memory: per query block, each CTA stages its 64 x D
  // partial (fp32), and the `nact` CTAs with keys split the block's rows, each adding the nact partials of
  // its rows (distributed shared memory), scaling, casting and writing them to dq: no fp32 buffer to clear,
  // add to and cast. Two mbarriers per CTA pace it: `staged` (one arrival per active CTA: its partial is
  // in) and `consumed` (one per active CTA: it has read this CTA's partial).
  constexpr bool direct = CLUSTER > 0;
  const int rank = blockIdx.x;
  const int nact = CLUSTER > 0 ? (len + B - 1) / B : 1;
  if constexpr (CLUSTER > 0) {
    if (threadIdx.x == 0 && n0 < len) {
      mbar_init(&bars[0], nact);
      mbar_init(&bars[1], nact);
      fence_mbar_init();
    }
    cluster_sync();  // every CTA's barriers are initialised before any remote arrival
  }
  if (n0 >= len) return;
  const Dropout drop = read_dropout(p, true);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const T* q = static_cast<const T*>(p.q) + (int64_t)h * p.q_head;
  const T* k = static_cast<const T*>(p.k) + (int64_t)h * p.k_head;
  const T* v = static_cast<const T*>(p.v) + (int64_t)h * p.v_head;
  const T* dout = static_cast<const T*>(p.dout) + (int64_t)h * p.do_head;
  const float scale_log2 = p.scale * kLog2e;
  const bool keys_full = n0 + B <= len;  // no key of this CTA past the sequence
  auto load_q_block = [&](int m, int stage) {
    const int m0 = m * B;
    if (threadIdx.x == 0) {
      mbar_expect_tx(&full[stage], 2 * TILE);
      tma_load_3d(sQ + stage * TILE, &tm_q, 0, h, start + m0, &full[stage]);
      tma_load_3d(sdO + stage * TILE, &tm_do, 0, h, start + m0, &full[stage]);
    }
    // lse (threads 0-63) and D (64-127) of the block's rows, copied as Q and dO are (a plain load here
    // held warps 0 and 1, and so the warpgroup's next MMAs, for a global-memory round trip per block).
    // Rows past the sequence: lse +inf (P = 0, so dV's and dK's terms P^T dO and dS^T Q, dS = P (dP - D),
    // are zero; their dQ rows are not added), D 0.
    static_assert(NT == 2 * B, "one lse or D value per thread");
    const int r = threadIdx.x % B;
    float* dst = threadIdx.x < B ? &sLse[stage * B + r] : &sDsum[stage * B + r];
    if (m0 + r < len) cp_async4(dst, (threadIdx.x < B ? p.lse : p.dsum) + (int64_t)h * p.total + start + m0 + r, 4);
    else *dst = threadIdx.x < B ? INFINITY : 0.f;
  };
  const int mblocks = (len + B - 1) / B;
  // The query block of step i. Without clusters CTA n starts at block n % mblocks: the CTAs of a sequence,
  // running side by side, then add to different dQ rows at a time, not all to the same 64 (b348d32: 32x512
  // d 32 0.253 against 0.258 ms in order, d 64 0.403 against 0.401, packed cells 0-1% faster).
  const int first = CLUSTER == 0 ? (int)blockIdx.x % mblocks : 0;
  auto qblock = [&](int i) { return first + i < mblocks ? first + i : first + i - mblocks; };
  if (threadIdx.x == 0) {
    mbar_init(&full[0], 1);
    mbar_init(&full[1], 1);
    fence_mbar_init();  // the inits, seen by the copy engine
  }
  load_tile<T, D, B, NT>(sK, k, p.k_row, start + n0, len - n0);
  load_tile<T, D, B, NT>(sV, v, p.v_row, start + n0, len - n0);
  load_q_block(qblock(0), 0);
  cp_async_commit();

  constexpr int KS = D / 16;  // k-slices over the head dim
  constexpr int NO = D / 8;
  float s[32], dp[32], dq[D / 2], dk[D / 2], dv[D / 2];
  uint32_t dsa[4][4], pa[4][4];  // dS (dQ's A fragments) and P, packed
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = dq[i] = 0.f;
#pragma unroll
  for (int i = 0; i < 32; ++i) s[i] = dp[i] = 0.f;
  // dQ partial sums: [heads, T, d] fp32 (this layout: a block's 64 rows are one contiguous run), added
  // by the copy engine from shared memory (the P and dS tiles' 16 KB, free once the MMAs are done)
  float* dq_accum = direct ? nullptr : p.dq_accum + ((int64_t)h * p.total + start) * D;
  float* sdQ = reinterpret_cast<float*>(sP);  // [64][D] fp32, row-major
  // CLUSTER: rows [rank * 64 / nact, ...) of query block m, summed over the active CTAs' staged partials
  auto sum_dq = [&](int m) {
    mbarrier_wait_cluster(&bars[0], m & 1);  // every active CTA's block m partial is staged
    const int r0 = rank * B / nact, r1 = (rank + 1) * B / nact, m0 = m * B;
    const int rows = min(r1, len - m0) - r0;
    T* dq = static_cast<T*>(p.dq) + (int64_t)h * D;
    constexpr int C4 = D / 4;  // float4 chunks per row
    for (int idx = threadIdx.x; idx < rows * C4; idx += NT) {
      const int row = r0 + idx / C4, c = (idx % C4) * 4;
      const int pc = (((c >> 3) ^ dq_chunk_phase(start + m0 + row, D)) << 3) | (c & 7);
      const uint32_t local = smem_u32(sdQ + row * D + pc);
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int j = 0; j < nact; ++j) {
        const float4 x = ld_shared_cluster_f4(local, j);
        acc.x += x.x, acc.y += x.y, acc.z += x.z, acc.w += x.w;
      }
      uint2 out;
      out.x = pack2<T>(acc.x * p.scale, acc.y * p.scale);
      out.y = pack2<T>(acc.z * p.scale, acc.w * p.scale);
      *reinterpret_cast<uint2*>(dq + (int64_t)(start + m0 + row) * p.grad_row + c) = out;
    }
    __syncthreads();  // this CTA's reads are done
    if (threadIdx.x < nact) mbarrier_arrive_cluster(&bars[1], threadIdx.x);  // at each active CTA
  };

  // S_m and dP_m, both operands in shared memory
  const TileDesc<D, B> k_desc(sK), v_desc(sV), q_desc(sQ), do_desc(sdO);  // Q, dO: stage 0 (stage 1: TILE on)
  const TileDesc<64, B> p_desc(sP), ds_desc(sdS);
  auto issue_s_dp = [&](int m) {
    const TileDesc<D, B> cq = q_desc.plus((m & 1) * TILE), cdo = do_desc.plus((m & 1) * TILE);
    wgmma::fence();
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) wgmma::mma_ss<F16, 64, 0, 0>(s, cq.k_major(ks), k_desc.k_major(ks), ks > 0 ? 1 : 0);
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) wgmma::mma_ss<F16, 64, 0, 0>(dp, cdo.k_major(ks), v_desc.k_major(ks), ks > 0 ? 1 : 0);
    wgmma::commit();
  };
  cp_async_wait_all();
  async_copy::fence_proxy_async();
  __syncthreads();  // block 0 is in (every thread's copies)

  for (int m = 0; m < mblocks; ++m) {
    const int stage = m & 1;
    const int m0 = qblock(m) * B;
    mbar_wait(&full[stage], (m >> 1) & 1);  // block m's Q and dO (the stage's (m / 2)-th copy)
    issue_s_dp(m);  // block m is in: copied before the loop or at the top of block m - 1
    // behind the MMAs: block m + 1's copies (into block m - 1's stage, whose MMAs are done), and the
    // wait for block m - 1's dQ to leave the P and dS tiles
    if (m + 1 < mblocks) load_q_block(qblock(m + 1), stage ^ 1);
    cp_async_commit();
    if constexpr (CLUSTER > 0) {
      if (m > 0) {
        sum_dq(m - 1);  // behind the MMAs: block m - 1's dQ rows of this CTA, from every active CTA
        mbarrier_wait_cluster(&bars[1], (m - 1) & 1);  // every CTA has read this CTA's block m - 1 partial
      }
    }
    wgmma::wait<0>();
    reg_fence(s);
    reg_fence(dp);
    // P (dropped, for dV), dS = P (dP - D); rows g and g + 8 of the warp's 16 queries; computed in registers
    // (packed: pa for P, dsa for dS, also dQ's A fragments) before the wait for the P and dS tiles below
    const int wrow = warp * 16;
    const float lse0 = sLse[stage * B + wrow + g] * kLog2e, lse1 = sLse[stage * B + wrow + g + 8] * kLog2e;
    const float ds0 = sDsum[stage * B + wrow + g], ds1 = sDsum[stage * B + wrow + g + 8];
    const int64_t row_token = (int64_t)start + m0 + wrow + g;
    // Two copies of the elementwise part, picked per CTA: without the key test where every key of the
    // CTA is in the sequence (all but a sequence's last key block). One copy with the test in it compiled
    // to a predicate per element (ISETP, the zero result, lse * log2e again under the predicate).
    auto p_and_ds = [&](auto masked_keys) {
    constexpr bool kMasked = decltype(masked_keys)::value;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      [[maybe_unused]] uint4 draws;
      if constexpr (DROPOUT) draws = keep_draws(drop, row_token, n0 + kk * 16 + 2 * t, h);
#pragma unroll
      for (int side = 0; side < 2; ++side) {
        const int j = 2 * kk + side;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = n0 + j * 8 + 2 * t + (e & 1);
          const float lse = e < 2 ? lse0 : lse1, dsum = e < 2 ? ds0 : ds1;
          const float pr = (!kMasked || key < len) ? fast_exp2(fmaf(s[4 * j + e], scale_log2, -lse)) : 0.f;
          if constexpr (DROPOUT) {
            // P dropped, unscaled (dV is scaled by 1 / (1 - p) once, at its store); dS = P (dP dropped and
            // scaled - D), the scale in the same FFMA as D
            const bool keep = draw_kept(draws, side, e, drop.threshold);
            s[4 * j + e] = keep ? pr : 0.f;
            dp[4 * j + e] = pr * fmaf(keep ? dp[4 * j + e] : 0.f, drop.scale, -dsum);
          } else {
            s[4 * j + e] = pr;
            dp[4 * j + e] = pr * (dp[4 * j + e] - dsum);
          }
        }
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // [kk][i]: key chunk 2 kk + i / 2, row g + 8 (i % 2)
        pa[kk][i] = pack2<T>(s[8 * kk + 2 * i], s[8 * kk + 2 * i + 1]);
        dsa[kk][i] = pack2<T>(dp[8 * kk + 2 * i], dp[8 * kk + 2 * i + 1]);
      }
    }
    };
    if (keys_full) p_and_ds(std::false_type{});
    else p_and_ds(std::true_type{});
    // The P and dS tiles hold block m - 1's dQ (fp32) until the bulk reductions have read it: each warp's lane
    // 0 waits for its own rows' reduction, the barrier tells the others (waiting here rather than before the exponentials leaves the copy engine
    // the elementwise part's time too)
    if (!direct && lane == 0) async_copy::bulk_wait_read<0>();  // this warp's rows of block m - 1's dQ
    __syncthreads();
    // to shared memory, [query][key] swizzled: key chunk j of rows g, g + 8
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int off = SP::offset<B>(wrow + g + 8 * r, j) + 4 * t;
        *reinterpret_cast<uint32_t*>(sP + off) = pa[j / 2][2 * (j % 2) + r];
        *reinterpret_cast<uint32_t*>(sdS + off) = dsa[j / 2][2 * (j % 2) + r];
      }
    async_copy::fence_proxy_async();  // P and dS, visible to the tensor cores
    __syncthreads();
    wgmma::fence();
    // dQ (unscaled) = dS K: K [64 keys x D] as the MN-major B (K = keys)
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma::mma_rs<F16, D, 1>(dq, dsa[kk], k_desc.mn_major(kk), kk > 0 ? 1 : 0);
    // dV += P^T dO and dK += dS^T Q: A = P^T / dS^T (MN-major: [query][key] rows), B = dO / Q (MN-major)
    const TileDesc<D, B> cq = q_desc.plus(stage * TILE), cdo = do_desc.plus(stage * TILE);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) wgmma::mma_ss<F16, D, 1, 1>(dv, p_desc.mn_major(ks), cdo.mn_major(ks), 1);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) wgmma::mma_ss<F16, D, 1, 1>(dk, ds_desc.mn_major(ks), cq.mn_major(ks), 1);
    wgmma::commit();
    wgmma::wait<0>();
    reg_fence(dq);
    reg_fence(dv);
    reg_fence(dk);
    reg_fence(dsa);
    // Block m + 1's S and dP follow dQ's staging (issued before it, their accumulators would be live through
    // it: offline ptxas spilled 544-556 bytes at d 64 and serialized the wgmmas), at the top of the loop
    // with no barrier between: the one here also has block m + 1 in.
    if (m + 1 < mblocks) cp_async_wait_all();  // block m + 1's lse and D (this thread's copies; Q, dO: by TMA)
    __syncthreads();  // every warp is done with block m's MMAs, which read the P / dS tiles dQ is staged in
    // rows in dq_accum's layout (dq_chunk): the 8 rows of a store land in different banks
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = wrow + g + 8 * r;
      float* dst = sdQ + row * D + 2 * t;
      const int phase = dq_chunk_phase(start + m0 + row, D);
#pragma unroll
      for (int i = 0; i < NO; ++i)
        *reinterpret_cast<float2*>(dst + ((i ^ phase) << 3)) = make_float2(dq[4 * i + 2 * r], dq[4 * i + 2 * r + 1]);
    }
    if constexpr (CLUSTER > 0) {
      __syncthreads();  // the partial is staged
      if (threadIdx.x < nact) mbarrier_arrive_cluster(&bars[0], threadIdx.x);  // at each active CTA
    } else {
      // each warp adds its own 16 rows (contiguous in sdQ and in the buffer) once they are staged: no barrier
      // for the whole CTA here (block m + 1 is in since the one above)
      async_copy::fence_proxy_async();
      __syncwarp();
      const int rows = min(16, len - m0 - wrow);
      if (lane == 0 && rows > 0)
        bulk_reduce_add_f32(dq_accum + (int64_t)(m0 + wrow) * D, sdQ + wrow * D, (uint32_t)rows * D * 4);
    }
  }
  if constexpr (CLUSTER > 0) {
    sum_dq(mblocks - 1);
    mbarrier_wait_cluster(&bars[1], (mblocks - 1) & 1);  // no CTA reads this one's shared memory any more
  }
  if (!direct && lane == 0) async_copy::bulk_wait_all();
  // dK (scaled) and dV (with dropout: its P was unscaled, 1 / (1 - p) here): rows = this CTA's keys (warp's
  // 16), [T, heads, d], token stride grad_row
  T* dkp = static_cast<T*>(p.dk) + (int64_t)h * D;
  T* dvp = static_cast<T*>(p.dv) + (int64_t)h * D;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = n0 + warp * 16 + g + 8 * r;
    if (key < len) {
      const int64_t off = (int64_t)(start + key) * p.grad_row;
#pragma unroll
      for (int i = 0; i < NO; ++i) {
        *reinterpret_cast<uint32_t*>(dkp + off + i * 8 + 2 * t) = pack2<T>(dk[4 * i + 2 * r] * p.scale, dk[4 * i + 2 * r + 1] * p.scale);
        if constexpr (DROPOUT)
          *reinterpret_cast<uint32_t*>(dvp + off + i * 8 + 2 * t) =
              pack2<T>(dv[4 * i + 2 * r] * drop.scale, dv[4 * i + 2 * r + 1] * drop.scale);
        else
          *reinterpret_cast<uint32_t*>(dvp + off + i * 8 + 2 * t) = pack2<T>(dv[4 * i + 2 * r], dv[4 * i + 2 * r + 1]);
      }
    }
  }
#endif
}

}  // namespace hopper
#endif  // BERTACCEL_ATTENTION_SM90A

// ------------------------------------------------------------------------------ host
void check_qkv(const at::Tensor& t, const char* name, const at::Tensor& q) {
  BERTACCEL_CHECK(t.is_cuda() && t.dim() == 3, "bertaccel varlen_attention: %s must be a CUDA tensor [tokens, heads, head_dim]",
                  name);
  BERTACCEL_CHECK(t.scalar_type() == q.scalar_type() && t.sizes() == q.sizes() && t.device() == q.device(),
                  "bertaccel varlen_attention: %s must match q in shape %s, dtype and device", name,
                  shape_str(q.sizes()).c_str());
  BERTACCEL_CHECK(t.stride(2) == 1 && t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0 &&
                      reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
                  "bertaccel varlen_attention: %s needs a contiguous head dim, token and head strides that are "
                  "multiples of 8 and a 16-byte aligned start (the eligibility check routes others to PyTorch)",
                  name);
}

void check_common(const at::Tensor& q, const at::Tensor& cu, int64_t max_seqlen, double p,
                  const std::optional<at::Tensor>& seqused) {
  BERTACCEL_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
                  "bertaccel varlen_attention: q must be bfloat16 or float16, got %s", c10::toString(q.scalar_type()));
  const int64_t d = q.size(2);
  BERTACCEL_CHECK(d == 32 || d == 64 || d == 128, "bertaccel varlen_attention: head dim %lld is not 32, 64 or 128",
                  (long long)d);
  BERTACCEL_CHECK(q.size(1) < 65536 && max_seqlen < 65536 && q.size(0) < (1LL << 31),
                  "bertaccel varlen_attention: up to 65535 heads and sequence length, 2^31 tokens");
  BERTACCEL_CHECK(cu.is_cuda() && cu.scalar_type() == at::kInt && cu.dim() == 1 && cu.size(0) >= 1 && cu.is_contiguous() &&
                      cu.device() == q.device(),
                  "bertaccel varlen_attention: cu_seqlens must be a contiguous int32 [batch + 1] tensor on q's device");
  BERTACCEL_CHECK(p >= 0 && p < 1, "bertaccel varlen_attention: dropout probability must be in [0, 1), got %g", p);
  if (seqused) {
    const at::Tensor& u = *seqused;
    BERTACCEL_CHECK(u.is_cuda() && u.scalar_type() == at::kInt && u.dim() == 1 && u.size(0) == cu.size(0) - 1 &&
                        u.is_contiguous() && u.device() == q.device(),
                    "bertaccel varlen_attention: seqused must be a contiguous int32 [batch] tensor on q's device "
                    "(cu_seqlens has %lld entries, seqused %s)",
                    (long long)cu.size(0), shape_str(u.sizes()).c_str());
  }
}

Params make_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu, double scale,
                   double p, const std::optional<at::Tensor>& seqused) {
  Params P{};
  P.q = q.data_ptr();
  P.k = k.data_ptr();
  P.v = v.data_ptr();
  P.q_row = q.stride(0), P.q_head = q.stride(1);
  P.k_row = k.stride(0), P.k_head = k.stride(1);
  P.v_row = v.stride(0), P.v_head = v.stride(1);
  P.cu = cu.data_ptr<int>();
  P.used = seqused ? seqused->data_ptr<int>() : nullptr;
  P.batch = (int)cu.size(0) - 1;
  P.heads = (int)q.size(1);
  P.total = (int)q.size(0);
  P.scale = (float)scale;
  P.p = (float)p;
  return P;
}

#if defined(BERTACCEL_ATTENTION_SM90A)
// A TMA map over q / k / v ([T, heads, d], any token and head strides, multiples of 16 bytes: check_qkv)
// in [d, 1 head, box_rows tokens] boxes, swizzled as Swz<d> lays a tile out (d 64: 128-byte rows, d 32:
// 64-byte); tokens past T read zero.
CUtensorMap qkv_tile_map(const at::Tensor& t, int box_rows) {
  CUtensorMap map;
  const int64_t d = t.size(2);
  const uint64_t dims[3] = {(uint64_t)d, (uint64_t)t.size(1), (uint64_t)t.size(0)};
  const uint64_t strides[2] = {(uint64_t)t.stride(1) * 2, (uint64_t)t.stride(0) * 2};
  const uint32_t box[3] = {(uint32_t)d, 1, (uint32_t)box_rows};
  const uint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = tensor_map_encoder()(
      &map, t.scalar_type() == at::kHalf ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3,
      t.data_ptr(), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      d == 64 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  BERTACCEL_CHECK(r == CUDA_SUCCESS,
                  "bertaccel varlen_attention: cuTensorMapEncodeTiled failed (%d) for a [%lld, %lld, %lld] tensor with "
                  "strides (%lld, %lld)",
                  (int)r, (long long)t.size(0), (long long)t.size(1), (long long)d, (long long)t.stride(0),
                  (long long)t.stride(1));
  return map;
}
#endif

// Opt a kernel in to more than 48 KB of dynamic shared memory, once per (kernel, device): the call
// is not allowed while a stream is being captured into a CUDA graph (cudaErrorStreamCaptureImplicit),
// and the first call always comes from an eager run (the warm-up before any capture).
template <typename Kernel>
void set_smem(Kernel kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return;
  static std::mutex mutex;
  static std::set<std::pair<const void*, int>> done;
  const int device = c10::cuda::current_device();
  std::lock_guard<std::mutex> lock(mutex);
  if (done.insert({reinterpret_cast<const void*>(kernel), device}).second)
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
}

#if defined(BERTACCEL_ATTENTION_SM90A)
// The warpgroup-MMA kernels run on a Hopper GPU (sm_90) unless an environment switch (read per call,
// so that benchmarks compare the kernels in one process) asks for the mma.sync ones.
bool on_hopper() {
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  return prop->major == 9 && prop->minor == 0;
}

// The forward's kernel (hopper::attn_fwd_kernel) as its warpgroups per CTA, or 0 for the mma.sync
// kernel; -1: one warpgroup with 128 keys per block. BERTACCEL_ATTENTION_FWD: "mma" (the mma.sync
// kernel), "wg1" / "wg2" (64 / 128 queries per CTA, 64 keys per block), "n128" (64 queries, 128 keys;
// head dims 32 and 64). Default: one warpgroup, 64 keys - as fast or faster than two warpgroups in every
// cell of benchmarks/bench_attention.py at 238afcd (seq 128: 0.046 vs 0.048 ms at d 64; packed uniform
// lengths 0.051 vs 0.055; seq 512 d 64 0.0905 vs 0.0903). 128 keys per block (3 CTAs per SM instead of
// 4) won only on full 512-token sequences at d 32 (a190df3: 0.0653 vs 0.0692 ms) and lost on packed
// ragged lengths (IMDB-like 0.0196 vs 0.0187, uniform 0.0384 vs 0.0379: a partial last block wastes up
// to 127 keys) and at d 64 (f8f5eff: 0.0925 vs 0.0916).
//
// `full_128`: every sequence of the call is max_seqlen long, a multiple of 128 (the host sees it without
// reading cu_seqlens: the token count is batch x max_seqlen, and no sequence is longer than max_seqlen),
// no dropout, head dim <= 64. Then no block is partial and 128 keys per block are the default; "n64"
// keeps 64 keys there. H100, TMA tiles, forward kernel alone (attention_calls --kernels, two rounds,
// session 38): 32x512x12x64 74.1 / 74.2 -> 73.2 / 73.5 us, x32 61.1 / 61.0 -> 58.4 / 58.5, 128x128x12x64
// 44.2 / 43.7 -> 41.9 / 42.6.
int hopper_forward_warpgroups(bool full_128) {
  if (!on_hopper()) return 0;
  const std::string choice = env_value("BERTACCEL_ATTENTION_FWD");
  if (choice == "mma") return 0;
  if (choice == "wg2") return 2;
  if (choice == "n128") return -1;
  if (choice.empty() && full_128) return -1;
  return 1;
}

// Which backward runs at head dims 32 and 64: hopper::attn_bwd_kernel on a Hopper (kClusters: with dQ
// summed on chip where varlen_attention_bwd allows it), unless BERTACCEL_ATTENTION_BWD=mma (the mma.sync
// kernel: kNone) or =bulk (dQ through the fp32 buffer at every length: kBuffer).
enum class HopperBackward { kNone, kClusters, kBuffer };
HopperBackward hopper_backward() {
  if (!on_hopper()) return HopperBackward::kNone;
  const std::string choice = env_value("BERTACCEL_ATTENTION_BWD");
  if (choice == "mma") return HopperBackward::kNone;
  return choice == "bulk" ? HopperBackward::kBuffer : HopperBackward::kClusters;
}
#endif

// fn(T{}, integral_constant<int, D>, bool_constant<DROPOUT>) for the runtime dtype, head dim and dropout
template <typename Fn>
void dispatch(at::ScalarType dtype, int64_t d, bool dropout, Fn&& fn) {
  auto by_dropout = [&](auto type_tag, auto dim) {
    if (dropout) fn(type_tag, dim, std::true_type{});
    else fn(type_tag, dim, std::false_type{});
  };
  auto by_dim = [&](auto type_tag) {
    if (d == 32) by_dropout(type_tag, std::integral_constant<int, 32>{});
    else if (d == 64) by_dropout(type_tag, std::integral_constant<int, 64>{});
    else by_dropout(type_tag, std::integral_constant<int, 128>{});
  };
  if (dtype == at::kBFloat16) by_dim(__nv_bfloat16{});
  else by_dim(__half{});
}

// (out [T, heads, d], lse [heads, T] fp32 natural log, rng (seed, offset) int64)
std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_fwd(const at::Tensor& q, const at::Tensor& k,
                                                                    const at::Tensor& v, const at::Tensor& cu_seqlens,
                                                                    int64_t max_seqlen, double dropout_p, double scale,
                                                                    const std::optional<at::Tensor>& seqused) {
  check_common(q, cu_seqlens, max_seqlen, dropout_p, seqused);
  check_qkv(q, "q", q);
  check_qkv(k, "k", q);
  check_qkv(v, "v", q);
  c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor lse = at::empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat));
  // (seed, offset): written by the grid's first block, sequence 0 (no fill kernel); zeros where no such block
  // runs (no tokens, or a batch of fillers only)
  const bool written = q.numel() > 0 && cu_seqlens.size(0) > 1;
  at::Tensor rng = written ? at::empty({2}, q.options().dtype(at::kLong)) : at::zeros({2}, q.options().dtype(at::kLong));
  if (q.numel() == 0) return {out, lse, rng};
  Params P = make_params(q, k, v, cu_seqlens, scale, dropout_p, seqused);
  P.out = out.data_ptr();
  P.o_row = out.stride(0), P.o_head = out.stride(1);
  P.lse = lse.data_ptr<float>();
  P.rng = rng.data_ptr<int64_t>();
  const bool dropout = dropout_p > 0;
  if (dropout) {
    auto gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(std::nullopt, at::cuda::detail::getDefaultCUDAGenerator());
    std::lock_guard<std::mutex> lock(gen->mutex_);
    P.philox = gen->philox_cuda_state(4);  // the counter's own fields give every element its draw
  }
  const int64_t d = q.size(2);
  const dim3 grid((unsigned)std::max<int64_t>((max_seqlen + kBlockM - 1) / kBlockM, 1), (unsigned)P.heads,
                  (unsigned)P.batch + 1);
  auto stream = at::cuda::getCurrentCUDAStream();
  if (seqused && P.batch > 0) {
    attn_check_seqused_kernel<<<1, 256, 0, stream>>>(P.used, P.batch);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
#if defined(BERTACCEL_ATTENTION_SM90A)
  const bool full_128 = !dropout && d <= 64 && max_seqlen % 128 == 0 && q.size(0) == (int64_t)P.batch * max_seqlen &&
                        !seqused;  // with seqused the lengths are on the device only
  if (const int nwg = hopper_forward_warpgroups(full_128)) {
    dispatch(q.scalar_type(), d, dropout, [&](auto type_tag, auto dim, auto drop) {
      using T = decltype(type_tag);
      constexpr int D = decltype(dim)::value;
      constexpr bool DR = decltype(drop)::value;
      auto launch = [&](auto warpgroups, auto keys) {
        constexpr int NWG = decltype(warpgroups)::value;
        constexpr int BN = decltype(keys)::value;
        constexpr size_t smem = hopper::fwd_smem<D, NWG, BN>();
        const dim3 grid((unsigned)std::max<int64_t>((max_seqlen + 64 * NWG - 1) / (64 * NWG), 1), (unsigned)P.heads,
                        (unsigned)P.batch + 1);
        auto kernel = hopper::attn_fwd_kernel<T, D, DR, NWG, BN>;
        set_smem(kernel, smem);
        CUtensorMap tm_k{}, tm_v{};  // read by the kernel at head dims <= 64 only
        if constexpr (D <= 64) {
          bind_primary_context(q.get_device());
          tm_k = qkv_tile_map(k, BN);
          tm_v = qkv_tile_map(v, BN);
        }
        kernel<<<grid, NWG * 128, smem, stream>>>(P, tm_k, tm_v);
      };
      constexpr std::integral_constant<int, hopper::kFwdBlockN> bn{};
      if (nwg == 2) launch(std::integral_constant<int, 2>{}, bn);
      else if constexpr (D <= 64) {
        if (nwg == -1) launch(std::integral_constant<int, 1>{}, std::integral_constant<int, 128>{});
        else launch(std::integral_constant<int, 1>{}, bn);
      } else launch(std::integral_constant<int, 1>{}, bn);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return {out, lse, rng};
  }
#endif
  dispatch(q.scalar_type(), d, dropout, [&](auto type_tag, auto dim, auto drop) {
    using T = decltype(type_tag);
    constexpr int D = decltype(dim)::value;
    constexpr bool DR = decltype(drop)::value;
    constexpr size_t smem = (size_t)(kBlockM + 4 * kBlockN) * (D + 8) * sizeof(T);
    auto kernel = attn_fwd_kernel<T, D, DR>;
    set_smem(kernel, smem);
    kernel<<<grid, kThreads, smem, stream>>>(P);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, lse, rng};
}

// The backward into dq, dk, dv: [T, heads, d] each, heads contiguous, one token stride shared by the three
// (heads * d for separate tensors; 3 * heads * d for the parts of one packed d(qkv), which then needs no cat).
void attention_bwd_into(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens, int64_t max_seqlen,
                        double dropout_p, double scale, const at::Tensor& rng, const at::Tensor& dq,
                        const at::Tensor& dk, const at::Tensor& dv, const std::optional<at::Tensor>& seqused) {
  check_common(q, cu_seqlens, max_seqlen, dropout_p, seqused);
  check_qkv(q, "q", q);
  check_qkv(k, "k", q);
  check_qkv(v, "v", q);
  check_qkv(out, "out", q);
  check_qkv(dout, "grad_out", q);
  BERTACCEL_CHECK(lse.is_cuda() && lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.dim() == 2 &&
                      lse.size(0) == q.size(1) && lse.size(1) == q.size(0),
                  "bertaccel varlen_attention: lse must be the forward's float32 [heads, tokens]");
  BERTACCEL_CHECK(rng.is_cuda() && rng.scalar_type() == at::kLong && rng.numel() == 2,
                  "bertaccel varlen_attention: rng must be the forward's int64 (seed, offset)");
  for (const at::Tensor* g : {&dq, &dk, &dv}) {
    check_qkv(*g, "a gradient", q);
    BERTACCEL_CHECK(g->stride(1) == q.size(2) && g->stride(0) == dq.stride(0),
                    "bertaccel varlen_attention: the gradients' heads must be contiguous, one token stride for all three");
  }
  c10::cuda::CUDAGuard guard(q.device());
  const int64_t d = q.size(2);
  if (q.numel() == 0) return;
#if defined(BERTACCEL_ATTENTION_SM90A)
  const HopperBackward choice = d <= 64 ? hopper_backward() : HopperBackward::kNone;
  const bool hopper = choice != HopperBackward::kNone, clusters = choice == HopperBackward::kClusters;
#else
  const bool hopper = false, clusters = false;
#endif
  const int64_t key_blocks = std::max<int64_t>((max_seqlen + kBlockN - 1) / kBlockN, 1);
  // The Hopper backward: with at most 2 key blocks (max_seqlen <= 128) both CTAs of a (sequence, head) run as
  // one cluster and write dq from on-chip sums (128x128x12x64 fwd+bwd 0.212 ms against 0.245 through the
  // buffer, 6f6343a); past that, each CTA adds its dQ partial to an fp32 buffer (cleared by the dsum
  // kernel, cast by attn_bwd_dq_kernel). Clusters measured slower there (benchmarks/bench_attention.py,
  // 32x512x12x64): all 8 key blocks writing dq directly 0.506 ms (a78e2b0), pairs adding their sums to
  // the buffer (half the L2 reductions) 0.539 ms (6f6343a), against 0.416-0.424 without clusters; pairs again
  // with every remote read in flight (tried/attention-bwd-dq-pairs): main kernel 281 against 212 us.
  // BERTACCEL_ATTENTION_BWD=bulk: the buffer at every length (for tests and timing).
  const int cluster = clusters && key_blocks <= 2 ? 2 : 0;
  const bool direct = cluster > 0;
  at::Tensor dq_accum;
  if (!direct) dq_accum = at::empty(q.sizes(), q.options().dtype(at::kFloat));
  at::Tensor dsum = at::empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat));
  Params P = make_params(q, k, v, cu_seqlens, scale, dropout_p, seqused);
  P.o = out.data_ptr();
  P.o_row = out.stride(0), P.o_head = out.stride(1);
  P.dout = dout.data_ptr();
  P.do_row = dout.stride(0), P.do_head = dout.stride(1);
  P.dk = dk.data_ptr();
  P.dv = dv.data_ptr();
  P.dq_accum = direct ? nullptr : dq_accum.data_ptr<float>();
  P.dq = dq.data_ptr();
  P.grad_row = dq.stride(0);
  P.lse = lse.data_ptr<float>();
  P.dsum = dsum.data_ptr<float>();
  P.rng = rng.data_ptr<int64_t>();
  const bool dropout = dropout_p > 0;
  auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t rows = q.size(0) * q.size(1);  // (token, head) pairs
  const dim3 grid((unsigned)key_blocks, (unsigned)P.heads, (unsigned)P.batch + 1);
  dispatch(q.scalar_type(), d, dropout, [&](auto type_tag, auto dim, auto drop) {
    using T = decltype(type_tag);
    constexpr int D = decltype(dim)::value;
    constexpr bool DR = decltype(drop)::value;
    bool launched = false;
    DqLayout layout = DqLayout::kTokensMajor;
    attn_bwd_dsum_kernel<T, D><<<(unsigned)((rows * (D / 8) + 255) / 256), 256, 0, stream>>>(P, !direct);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
#if defined(BERTACCEL_ATTENTION_SM90A)
    if constexpr (D <= 64) {
      if (hopper) {
        constexpr size_t smem = hopper::bwd_smem<D>();
        bind_primary_context(q.get_device());
        const CUtensorMap tm_q = qkv_tile_map(q, 64), tm_do = qkv_tile_map(dout, 64);
        if (cluster > 0) {
          auto kernel = hopper::attn_bwd_kernel<T, D, DR, 2>;
          set_smem(kernel, smem);
          cudaLaunchConfig_t config = {};
          config.gridDim = grid;
          config.blockDim = dim3(128);
          config.dynamicSmemBytes = smem;
          config.stream = stream;
          cudaLaunchAttribute attr;
          attr.id = cudaLaunchAttributeClusterDimension;
          attr.val.clusterDim.x = grid.x;  // every key block
          attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
          config.attrs = &attr;
          config.numAttrs = 1;
          C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, P, tm_q, tm_do));
        } else {
          auto kernel = hopper::attn_bwd_kernel<T, D, DR, 0>;
          set_smem(kernel, smem);
          kernel<<<grid, 128, smem, stream>>>(P, tm_q, tm_do);
        }
        launched = true;
        layout = DqLayout::kHeadsMajorPermuted;
      }
    }
#endif
    if (!launched) {
      constexpr size_t smem = (size_t)(2 * kBlockN + 4 * kBlockM) * (D + 8) * sizeof(T) +
                              (size_t)2 * kBlockM * (kBlockN + 8) * sizeof(T) + 4 * kBlockM * sizeof(float);
      auto kernel = attn_bwd_kernel<T, D, DR>;
      set_smem(kernel, smem);
      kernel<<<grid, kThreads, smem, stream>>>(P);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (direct) return;  // dq written by the backward itself
    const int64_t n = dq.numel();
    attn_bwd_dq_kernel<T><<<(unsigned)((n / 8 + 255) / 256), 256, 0, stream>>>(P.dq_accum, (T*)dq.data_ptr(), n,
                                                                             (float)scale, layout, P.heads, (int)D,
                                                                             P.grad_row);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& cu_seqlens, int64_t max_seqlen, double dropout_p, double scale,
    const at::Tensor& rng, const std::optional<at::Tensor>& seqused) {
  BERTACCEL_CHECK(q.is_cuda() && q.dim() == 3, "bertaccel varlen_attention: q must be a CUDA tensor [tokens, heads, head_dim]");
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(q.sizes(), q.options());
  at::Tensor dv = at::empty(q.sizes(), q.options());
  attention_bwd_into(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, dropout_p, scale, rng, dq, dk, dv, seqused);
  return {dq, dk, dv};
}

// The packed form: qkv [T, 3, heads, d] (one projection's output, viewed), its gradient written as one
// [T, 3, heads, d] tensor - the three parts' token stride 3 * heads * d - so autograd has no split to undo.
void check_packed(const at::Tensor& qkv) {
  BERTACCEL_CHECK(qkv.is_cuda() && qkv.dim() == 4 && qkv.size(1) == 3,
                  "bertaccel varlen_attention_packed: qkv must be a CUDA tensor [tokens, 3, heads, head_dim], got %s",
                  shape_str(qkv.sizes()).c_str());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_packed_fwd(const at::Tensor& qkv,
                                                                           const at::Tensor& cu_seqlens,
                                                                           int64_t max_seqlen, double dropout_p,
                                                                           double scale,
                                                                           const std::optional<at::Tensor>& seqused) {
  check_packed(qkv);
  return varlen_attention_fwd(qkv.select(1, 0), qkv.select(1, 1), qkv.select(1, 2), cu_seqlens, max_seqlen, dropout_p,
                              scale, seqused);
}

at::Tensor varlen_attention_packed_bwd(const at::Tensor& dout, const at::Tensor& qkv, const at::Tensor& out,
                                      const at::Tensor& lse, const at::Tensor& cu_seqlens, int64_t max_seqlen,
                                      double dropout_p, double scale, const at::Tensor& rng,
                                      const std::optional<at::Tensor>& seqused) {
  check_packed(qkv);
  at::Tensor dqkv = at::empty({qkv.size(0), 3, qkv.size(2), qkv.size(3)}, qkv.options());
  attention_bwd_into(dout, qkv.select(1, 0), qkv.select(1, 1), qkv.select(1, 2), out, lse, cu_seqlens, max_seqlen,
                     dropout_p, scale, rng, dqkv.select(1, 0), dqkv.select(1, 1), dqkv.select(1, 2), seqused);
  return dqkv;
}

}  // namespace
}  // namespace bertaccel

TORCH_LIBRARY_IMPL(bertaccel, CUDA, m) {
  m.impl("varlen_attention_fwd", &bertaccel::varlen_attention_fwd);
  m.impl("varlen_attention_bwd", &bertaccel::varlen_attention_bwd);
  m.impl("varlen_attention_packed_fwd", &bertaccel::varlen_attention_packed_fwd);
  m.impl("varlen_attention_packed_bwd", &bertaccel::varlen_attention_packed_bwd);
}
