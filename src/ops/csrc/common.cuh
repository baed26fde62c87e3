// Shared device helpers for bertaccel's kernels: 16-byte vector packs, bf16/fp32 conversion,
// Welford merging, Philox dropout draws, and the column-sum kernel used by every backward.
#pragma once
#include <cuda_bf16.h>
#include <curand_kernel.h>
#include <cstdint>

namespace bertaccel {

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16(x); }

template <typename T, int VEC>
__device__ __forceinline__ void load_f(const T* p, float (&out)[VEC]) {
  Pack<T, VEC> pk = *reinterpret_cast<const Pack<T, VEC>*>(p);
#pragma unroll
  for (int j = 0; j < VEC; ++j) out[j] = to_f(pk.v[j]);
}

template <typename T, int VEC>
__device__ __forceinline__ void store_f(T* p, const float (&in)[VEC]) {
  Pack<T, VEC> pk;
#pragma unroll
  for (int j = 0; j < VEC; ++j) pk.v[j] = from_f<T>(in[j]);
  *reinterpret_cast<Pack<T, VEC>*>(p) = pk;
}

// Welford state (count, mean, sum of squared deviations) and Chan et al.'s merge.
struct Welford {
  float n, mean, m2;
};

__device__ __forceinline__ Welford welford_merge(Welford a, Welford b) {
  float n = a.n + b.n;
  if (n == 0.f) return {0.f, 0.f, 0.f};
  float d = b.mean - a.mean;
  float wb = b.n / n;
  return {n, a.mean + d * wb, a.m2 + b.m2 + d * d * a.n * wb};
}

__device__ __forceinline__ Welford welford_shfl_xor(Welford w, int lane_mask, int width) {
  Welford o;
  o.n = __shfl_xor_sync(0xffffffffu, w.n, lane_mask, width);
  o.mean = __shfl_xor_sync(0xffffffffu, w.mean, lane_mask, width);
  o.m2 = __shfl_xor_sync(0xffffffffu, w.m2, lane_mask, width);
  return welford_merge(w, o);
}

// Dropout: element i of a launch keeps its value when the Philox uniform number
// (seed, subsequence i / 4, offset)[i % 4] exceeds p. A pure function of (seed, offset, i): the
// backward regenerates the same mask whatever its launch shape.
__device__ __forceinline__ float4 philox4(uint64_t seed, uint64_t offset, uint64_t group) {
  curandStatePhilox4_32_10_t s;
  curand_init(seed, group, offset, &s);
  return curand_uniform4(&s);
}

template <int VEC>
__device__ __forceinline__ void dropout_keep(uint64_t seed, uint64_t offset, int64_t i0, float p, bool (&keep)[VEC]) {
  if constexpr (VEC % 4 == 0) {  // i0 is a multiple of VEC: whole groups of four
#pragma unroll
    for (int g = 0; g < VEC / 4; ++g) {
      float4 u = philox4(seed, offset, (uint64_t)(i0 / 4 + g));
      keep[4 * g + 0] = u.x > p;
      keep[4 * g + 1] = u.y > p;
      keep[4 * g + 2] = u.z > p;
      keep[4 * g + 3] = u.w > p;
    }
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      int64_t i = i0 + j;
      float4 u = philox4(seed, offset, (uint64_t)(i / 4));
      int c = (int)(i & 3);
      float uj = c == 0 ? u.x : c == 1 ? u.y : c == 2 ? u.z : u.w;
      keep[j] = uj > p;
    }
  }
}

// out[c] = sum_r part[r, c] for a (parts, cols) fp32 matrix. Block (32 cols x 8 row slices):
// each thread sums a strided slice of rows for one column, then the 8 slices meet in shared memory.
static __global__ void column_sum_kernel(const float* __restrict__ part, int parts, int cols, float* __restrict__ out) {
  __shared__ float red[8][33];
  int c = blockIdx.x * 32 + threadIdx.x;
  float s = 0.f;
  if (c < cols)
    for (int r = threadIdx.y; r < parts; r += 8) s += part[(int64_t)r * cols + c];
  red[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float t = 0.f;
#pragma unroll
    for (int k = 0; k < 8; ++k) t += red[k][threadIdx.x];
    out[c] = t;
  }
}

}  // namespace bertaccel
