// The driver's cuTensorMapEncodeTiled, found once through the runtime (no link against libcuda), for the
// kernels that copy tiles with TMA (the GEMM; the attention forward's K / V and backward's Q / dO).
#pragma once
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

namespace bertaccel {

inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status;
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &status));
    TORCH_CHECK(status == cudaDriverEntryPointSuccess && ptr != nullptr,
                "bertaccel: the CUDA driver has no cuTensorMapEncodeTiled (a driver for CUDA 12 or newer is needed)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

// cuTensorMapEncodeTiled needs a current context (else CUDA_ERROR_INVALID_CONTEXT, 201). A thread whose
// first CUDA work is such an op has none: autograd's device thread when a backward starts with a GEMM (the
// ffn family's does) or recomputes an attention forward, as CUDAGuard skips cudaSetDevice when the device
// already matches. cudaSetDevice makes the device's primary context current (CUDA 12+); once per thread
// and device.
inline void bind_primary_context(int device) {
  thread_local int bound = -1;
  if (bound != device) {
    C10_CUDA_CHECK(cudaSetDevice(device));
    bound = device;
  }
}

}  // namespace bertaccel
