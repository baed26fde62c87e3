// GELU and its derivative on one fp32 value, erf and tanh forms, for the GEMM epilogues (gemm.cu: bf16
// outputs, erf through normal_cdf_fast; gemm_fp32.cu: fp32 outputs, erff and expf).
#pragma once
#include <cuda_runtime.h>

#include "erf_fast.cuh"

namespace bertaccel {

// kFast: normal_cdf_fast (erf within 1.5e-7, MUFU approximations; for bf16 outputs), else erff and expf
template <bool kFast>
__device__ __forceinline__ float gelu_erf(float x) {
  if constexpr (kFast) return x * normal_cdf_fast(x).cdf;
  return 0.5f * x * (1.f + erff(x * 0.70710678118654752f));
}
template <bool kFast>
__device__ __forceinline__ float dgelu_erf(float x) {  // Phi(x) + x phi(x)
  if constexpr (kFast) {
    const NormalCdf n = normal_cdf_fast(x);
    return fmaf(x * 0.3989422804014327f, n.gauss, n.cdf);
  }
  return 0.5f * (1.f + erff(x * 0.70710678118654752f)) + x * 0.3989422804014327f * expf(-0.5f * x * x);
}
__device__ __forceinline__ float gelu_tanh(float x) {
  return 0.5f * x * (1.f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}
__device__ __forceinline__ float dgelu_tanh(float x) {
  const float k = 0.7978845608028654f, x2 = x * x;
  const float t = tanhf(k * (x + 0.044715f * x2 * x));
  return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * k * (1.f + 3.f * 0.044715f * x2);
}

}  // namespace bertaccel
