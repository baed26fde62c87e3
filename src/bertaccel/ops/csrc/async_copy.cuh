// Asynchronous-proxy helpers of the sm_90a kernels (the GEMM, the Hopper attention; smem_u32 also the attention's sm_80 cp.async): shared-window addresses, the fence that
// makes a thread's generic shared-memory writes visible to async-proxy readers (wgmma, TMA and bulk
// copies), the bulk-copy groups a thread commits and waits for, and the mbarriers TMA copies complete.
#pragma once
#include <cstdint>

namespace bertaccel::async_copy {

// a shared-memory pointer as the 32-bit shared-window address PTX takes
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// an mbarrier expecting `count` arrivals per phase, and the fence after a thread's inits that makes them
// visible to the copy engine (TMA completes the mbarriers) and to the cluster's other CTAs
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n"
               ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void fence_mbar_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// this thread's arrival at `bar`, announcing `bytes` more of transactions (a TMA copy) for the phase
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
               ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
// until the phase of `bar` with this parity has completed
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
  } while (!done);
}

__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// The bulk copies (TMA stores, bulk reductions) this thread issued since the last commit form one group.
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N>  // until at most N of this thread's bulk groups still read shared memory
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory"); }
// until every bulk group of this thread is complete
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

}  // namespace bertaccel::async_copy
