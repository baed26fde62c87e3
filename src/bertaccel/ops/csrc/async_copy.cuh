// Asynchronous-proxy helpers of the sm_90a kernels (the GEMM, the Hopper attention): the fence that
// makes a thread's generic shared-memory writes visible to async-proxy readers (wgmma, TMA and bulk
// copies), and the bulk-copy groups a thread commits and waits for.
#pragma once

namespace bertaccel::async_copy {

__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// The bulk copies (TMA stores, bulk reductions) this thread issued since the last commit form one group.
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N>  // until at most N of this thread's bulk groups still read shared memory
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory"); }
// until every bulk group of this thread is complete
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

}  // namespace bertaccel::async_copy
