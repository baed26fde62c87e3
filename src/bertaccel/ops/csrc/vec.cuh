// 16-byte vector packs and the float conversions of bertaccel's kernels (bf16, fp16, fp32): a lane's VEC consecutive
// elements read or written as one load / store and widened to fp32. Used by the row ops (common.cuh) and the query-rows
// attention (query_rows_attention.cu).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace bertaccel {

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half(x); }

template <typename T, int VEC>
__device__ __forceinline__ void load_f(const T* p, float (&out)[VEC]) {
  Pack<T, VEC> pk = *reinterpret_cast<const Pack<T, VEC>*>(p);
#pragma unroll
  for (int j = 0; j < VEC; ++j) out[j] = to_f(pk.v[j]);
}

// A pack's elements widened to fp32. bf16 pairs are read as the 32-bit words they arrive in (low element: the word
// shifted up 16 bits; high: the word with its low half cleared - one instruction each, exact): read element by element,
// ptxas moved each half into a register of its own first (PRMT) and shifted it at every use, and copied packs half by
// half (session 71, SASS of the LayerNorm backward).
template <typename T, int VEC>
__device__ __forceinline__ void unpack_f(const Pack<T, VEC>& p, float (&out)[VEC]) {
  if constexpr (__is_same(T, __nv_bfloat16) && VEC % 2 == 0) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(&p);
#pragma unroll
    for (int i = 0; i < VEC / 2; ++i) {
      out[2 * i] = __uint_as_float(w[i] << 16);
      out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[j] = to_f(p.v[j]);
  }
}

template <typename T, int VEC>
__device__ __forceinline__ void store_f(T* p, const float (&in)[VEC]) {
  Pack<T, VEC> pk;
#pragma unroll
  for (int j = 0; j < VEC; ++j) pk.v[j] = from_f<T>(in[j]);
  *reinterpret_cast<Pack<T, VEC>*>(p) = pk;
}

// store_f with bf16 pairs packed into 32-bit words and the words stored as one vector. The FAST forward ring stores
// through it: there NVVM split one of each row's 16-byte bf16 stores, written element by element, into 2-, 4- and
// 8-byte pieces that SASS kept (session 77, PTX and SASS of layer_norm_fwd.cu; the other kernels' stores stay whole).
template <typename T, int VEC>
__device__ __forceinline__ void store_f_words(T* p, const float (&in)[VEC]) {
  if constexpr (__is_same(T, __nv_bfloat16) && VEC % 2 == 0) {
    Pack<uint32_t, VEC / 2> w;
#pragma unroll
    for (int i = 0; i < VEC / 2; ++i) {
      const __nv_bfloat162 h = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
      w.v[i] = *reinterpret_cast<const uint32_t*>(&h);
    }
    *reinterpret_cast<Pack<uint32_t, VEC / 2>*>(p) = w;
  } else {
    store_f<T, VEC>(p, in);
  }
}

// store_f as one 16-byte st.global.v4 (inline PTX), for a vector NVVM would otherwise split: in the FAST residual
// forward ring (session 81, offline SASS) the first saved-sum vector of each row was stored as 4-byte words (float32,
// and bf16 through store_f_words) or 2-byte halves (bf16 through store_f) where the general kernel's stayed whole.
template <typename T, int VEC>
__device__ __forceinline__ void store_f_v4(T* p, const float (&in)[VEC]) {
  static_assert(VEC * sizeof(T) == 16, "one 16-byte vector");
  uint32_t w[4];
  if constexpr (sizeof(T) == 2) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __nv_bfloat162 h = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
      w[i] = *reinterpret_cast<const uint32_t*>(&h);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = __float_as_uint(in[i]);
  }
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]));
}

}  // namespace bertaccel
