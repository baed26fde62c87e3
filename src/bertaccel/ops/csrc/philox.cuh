// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011), the
// generator of curand and Random123, written out so a kernel draws from an explicit counter without
// a curand state (no curand_init skip-ahead per draw). bertaccel's dropouts use its four words as
// eight 16-bit draws: an element is kept when its draw >= round(p * 65536) (p resolved to 1/65536;
// FlashAttention's dropout uses 8 bits). Python mirror: bertaccel.ops.attention.philox4x32_10.
#pragma once
#include <cstdint>

namespace bertaccel {

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint32_t k0, uint32_t k1) {
#pragma unroll
  for (int i = 0; i < 10; ++i) {
    const uint32_t hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
    const uint32_t hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
    c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c;
}

// The 16-bit draw threshold of dropout probability p (keep when draw >= threshold).
__device__ __forceinline__ uint32_t dropout_threshold(float p) { return __float2uint_rn(p * 65536.f); }

}  // namespace bertaccel
