// GELU and its derivative on one fp32 value, erf and tanh forms, for the GEMM epilogues (gemm.cu: bf16
// outputs, erf through normal_cdf_fast; gemm_fp32.cu: fp32 outputs, erff and expf).
#pragma once
#include <cuda_runtime.h>

#include "erf_fast.cuh"

namespace bertaccel {
#ifdef BERTACCEL_GELU_LEGACY_MATH
__device__ __forceinline__ float legacy_erfc_abs(float z) {
  const float a = fabsf(z);
  const float t = __fdividef(1.f, fmaf(0.3275911f, a, 1.f));
  float q = fmaf(1.061405429f, t, -1.453152027f);
  q = fmaf(q, t, 1.421413741f);
  q = fmaf(q, t, -0.284496736f);
  q = fmaf(q, t, 0.254829592f);
  return q * t * __expf(-a * a);
}
#endif

// kFast: normal_cdf_fast (erf within 1.5e-7, MUFU approximations; for bf16 outputs), else erff and expf
template <bool kFast>
__device__ __forceinline__ float gelu_erf(float x) {
#ifdef BERTACCEL_GELU_LEGACY_MATH  // TEMPORARY (session 30 A/B): the math before normal_cdf_fast
  if constexpr (kFast) return 0.5f * x * (1.f + copysignf(1.f - legacy_erfc_abs(x * 0.70710678118654752f), x));
#endif
  if constexpr (kFast) return x * normal_cdf_fast(x).cdf;
  return 0.5f * x * (1.f + erff(x * 0.70710678118654752f));
}
template <bool kFast>
__device__ __forceinline__ float dgelu_erf(float x) {  // Phi(x) + x phi(x)
#ifdef BERTACCEL_GELU_LEGACY_MATH
  if constexpr (kFast) {
    const float z = x * 0.70710678118654752f;
    return 0.5f * (1.f + copysignf(1.f - legacy_erfc_abs(z), z)) + x * 0.3989422804014327f * __expf(-0.5f * x * x);
  }
#endif
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
