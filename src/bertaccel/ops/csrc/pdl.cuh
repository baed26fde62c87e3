// Programmatic dependent launch (Hopper): a kernel is launched while the one before it on the stream
// still runs (e.g. the column sums while the backward that writes their partial rows drains), so its
// launch latency hides behind that kernel's tail instead of following it. Every kernel launched this way
// allows the next at its start and waits for the previous grid, completed and its writes visible, before
// its first global access (`begin_dependent_kernel`, with `launch_dependent`). Correctness never rests on
// where the allowing is: the wait is for the whole prerequisite grid. BERTACCEL_PDL=0 launches them
// plainly (read once per process; the GEMM reads it at every launch, for tests that compare both launches
// in one process). Used by the row ops (common.cuh) and the GEMM (gemm_kernel.cuh, beside its cluster
// attribute). The attention kernels launch plainly: with
// every kernel of the forward and backward launched this way (d3dda9f) the 32x512x12x64 forward +
// backward measured 0.3974 / 0.3981 ms against 0.3919 / 0.3921 without (H100, two alternated pairs,
// benchmarks/results/h100/attention_pdl_*_d3dda9f.json); other cells within +-1%.
#pragma once
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <utility>

#include "switches.h"

namespace bertaccel {

__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_prerequisite_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// The first statement of every kernel started by `launch_dependent`: wait for the previous grid (its
// writes visible), then allow the next launch_dependent kernel to be scheduled (it waits likewise).
__device__ __forceinline__ void begin_dependent_kernel() {
  wait_for_prerequisite_grids();
  allow_dependent_launch();
}

// BERTACCEL_PDL as it is set now (on unless 0)
inline bool pdl_switch_now() { return env_switch("BERTACCEL_PDL", 1) != 0; }
// BERTACCEL_PDL as it was at the first call
inline bool pdl_enabled() {
  static const bool on = pdl_switch_now();
  return on;
}

// Sets `a` to the programmatic-serialization attribute where it applies (switch on, sm_90+): true if set.
// read_switch_now: the switch as it is set now, not at the first call.
inline bool dependent_launch_attribute(cudaLaunchAttribute& a, bool read_switch_now = false) {
  if (!(read_switch_now ? pdl_switch_now() : pdl_enabled()) || at::cuda::getCurrentDeviceProperties()->major < 9)
    return false;
  a = cudaLaunchAttribute{};
  a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a.val.programmaticStreamSerializationAllowed = 1;
  return true;
}

// kernel<<<grid, block, smem, stream>>>(args...) as a programmatic dependent launch on Hopper and later
// (unless BERTACCEL_PDL=0): the grid may be scheduled as soon as every block of the kernel before it on
// the stream has allowed it (`allow_dependent_launch`) or exited, instead of after that kernel has
// completed, so its launch and block start-up overlap the previous kernel's tail. The kernel must start
// with `begin_dependent_kernel()`, before it reads or writes global memory.
template <typename... Params, typename... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                      Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute{};
  if (dependent_launch_attribute(attribute)) {
    config.attrs = &attribute;
    config.numAttrs = 1;
  }
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace bertaccel
