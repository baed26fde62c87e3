// Philox4x32 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011), the generator of
// curand and Random123, written out so a kernel draws from an explicit counter without a curand state
// (no curand_init skip-ahead per draw). bertaccel's dropouts use its four words as eight 16-bit draws: an
// element is kept when its draw >= round(p * 65536) (p resolved to 1/65536; FlashAttention's dropout uses
// 8 bits).
//
// Rounds: the dropouts run kDropoutPhiloxRounds = 7, as FlashAttention-2's dropout does (and so PyTorch's
// flash SDPA backend), not curand's 10. Seven is the fewest rounds of Philox4x32 the Random123 paper
// found Crush-resistant (passing TestU01's BigCrush with its own counters); its default 10 adds a safety
// margin for general use. Each round is two 32x32->64 multiplies (IMAD.WIDE) and two three-input XORs
// (LOP3); with dropout the attention kernels and the residual LayerNorm forward are issue-bound on these
// (docs/attention.md "Philox rounds" for what seven saved). Python mirror: bertaccel.ops.registration.philox4x32,
// whose ten-round form is checked against Random123's known answers.
#pragma once
#include <cstdint>

namespace bertaccel {

constexpr int kDropoutPhiloxRounds = 7;  // bertaccel.ops.registration.DROPOUT_PHILOX_ROUNDS

template <int ROUNDS>
__device__ __forceinline__ uint4 philox4x32(uint4 c, uint32_t k0, uint32_t k1) {
#pragma unroll
  for (int i = 0; i < ROUNDS; ++i) {
    const uint32_t hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
    const uint32_t hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
    c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c;
}

// The dropouts' draw: Philox4x32 with kDropoutPhiloxRounds rounds.
__device__ __forceinline__ uint4 dropout_philox(uint4 c, uint32_t k0, uint32_t k1) {
  return philox4x32<kDropoutPhiloxRounds>(c, k0, k1);
}

// The 16-bit draw threshold of dropout probability p (keep when draw >= threshold).
__device__ __forceinline__ uint32_t dropout_threshold(float p) { return __float2uint_rn(p * 65536.f); }

}  // namespace bertaccel
