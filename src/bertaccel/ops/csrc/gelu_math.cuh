// GELU and its derivative on one fp32 value, erf and tanh forms, for the GEMM epilogues (gemm.cu: bf16
// outputs, erf through erf_fast; gemm_fp32.cu: fp32 outputs, erff and expf).
#pragma once
#include <cuda_runtime.h>

#include "erf_fast.cuh"

namespace bertaccel {

// kFast: erf_fast and __expf (within 1.5e-7; for bf16 outputs), else erff and expf
template <bool kFast>
__device__ __forceinline__ float gelu_erf(float x) {
  const float z = x * 0.70710678118654752f;
  return 0.5f * x * (1.f + (kFast ? erf_fast(z) : erff(z)));
}
template <bool kFast>
__device__ __forceinline__ float dgelu_erf(float x) {
  const float z = x * 0.70710678118654752f, e = -0.5f * x * x;
  return 0.5f * (1.f + (kFast ? erf_fast(z) : erff(z))) + x * 0.3989422804014327f * (kFast ? __expf(e) : expf(e));
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
