// A branch-free erf for the bf16 GELU kernels (gelu.cu's bias+GELU, gemm.cu's GELU epilogues).
#pragma once
#include <cuda_runtime.h>

namespace bertaccel {

// erf(x) within 1.5e-7 absolute (Abramowitz & Stegun 7.1.26): 1 - t (a1 + t (a2 + ... )) e^(-x^2),
// t = 1 / (1 + p |x|), sign restored. Two MUFU ops (reciprocal, exp2) and five FMAs, no branches;
// erff's two polynomial ranges diverge inside a warp of mixed |x| and take both. For bf16 outputs
// (a rounding step of 2^-9, ~4e-3 relative) the difference does not show; fp32 keeps erff.
static __device__ __forceinline__ float erf_fast(float x) {
  const float a = fabsf(x);
  const float t = __fdividef(1.f, fmaf(0.3275911f, a, 1.f));
  float q = fmaf(1.061405429f, t, -1.453152027f);
  q = fmaf(q, t, 1.421413741f);
  q = fmaf(q, t, -0.284496736f);
  q = fmaf(q, t, 0.254829592f);
  return copysignf(1.f - q * t * __expf(-a * a), x);
}

}  // namespace bertaccel
