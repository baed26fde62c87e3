// A branch-free erf and normal CDF for the bf16 GELU kernels (gelu.cu's bias+GELU, the GEMM's GELU epilogues).
#pragma once
#include <cuda_runtime.h>

namespace bertaccel {

// The MUFU approximations with denormals flushed. __fdividef / __expf compile (without --use_fast_math) to
// the non-ftz forms, which wrap each MUFU in a range fix-up (FSETP, FSEL, two predicated FMULs): 7 of the 24
// instructions GELU took per value in the GEMM epilogue, where it runs on 128 values per thread and tile.
// Here the reciprocal's argument is >= 1 and an exp2 result below 2^-126 is as good as zero.
static __device__ __forceinline__ float rcp_approx_ftz(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
static __device__ __forceinline__ float ex2_approx_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Abramowitz & Stegun 7.1.26, erf(z) within 1.5e-7 absolute: erfc(|z|) = t (a1 + t (a2 + ... + t a5)) e^(-z^2),
// t = 1 / (1 + p |z|). Two MUFU ops (reciprocal, exp2) and a few FMAs, no branches; erff's two polynomial ranges
// diverge inside a warp of mixed |z| and take both. For bf16 outputs (a rounding step of 2^-9, ~4e-3 relative)
// the difference does not show; fp32 outputs keep erff.
constexpr float kAs7126P = 0.3275911f;
// (a1 + t (a2 + ... + t a5)) scaled by `scale` (folded into the constants at compile time; a power of two, exact)
static __device__ __forceinline__ float as7126_poly(float t, float scale) {
  float q = fmaf(scale * 1.061405429f, t, scale * -1.453152027f);
  q = fmaf(q, t, scale * 1.421413741f);
  q = fmaf(q, t, scale * -0.284496736f);
  return fmaf(q, t, scale * 0.254829592f);
}
static __device__ __forceinline__ float erf_fast(float z) {
  const float a = fabsf(z);
  const float t = rcp_approx_ftz(fmaf(kAs7126P, a, 1.f));
  return copysignf(1.f - as7126_poly(t, 1.f) * t * ex2_approx_ftz(a * a * -1.4426950408889634f), z);
}

// The standard normal CDF Phi(x) = (1 + erf(x / sqrt 2)) / 2 by the same formula, with its constants folded (the
// 1 / sqrt 2 into p, the 1 / 2 into the a_i), and e^(-x^2 / 2), which dGELU needs too (x phi(x) = x e / sqrt(2 pi)).
struct NormalCdf {
  float cdf, gauss;  // Phi(x), e^(-x^2 / 2)
};
static __device__ __forceinline__ NormalCdf normal_cdf_fast(float x) {
  const float t = rcp_approx_ftz(fmaf(kAs7126P * 0.70710678118654752f, fabsf(x), 1.f));
  const float gauss = ex2_approx_ftz(x * x * (-0.5f * 1.4426950408889634f));
  const float tail = as7126_poly(t, 0.5f) * t * gauss;  // P(X > |x|) = erfc(|x| / sqrt 2) / 2
  return {x >= 0.f ? 1.f - tail : tail, gauss};
}

}  // namespace bertaccel
