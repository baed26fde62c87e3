// What gemm.cu (the bf16 tensor-core path) and gemm_fp32.cu (the fp32 SIMT path) share.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace bertaccel::gemm {

// The logical sizes of out[M, N] = op(a) op(b)^T (a: [M, K], or stored [K, M] with trans_a; b: [N, K],
// or stored [K, N] with trans_b), after the checks both paths make: 2-D operands on one CUDA device,
// unit inner stride, equal inner dimensions, K > 0. Dtype and alignment are each path's own.
struct Dims {
  int64_t M, N, K;
};
Dims dims(const at::Tensor& a, const at::Tensor& b, bool trans_a, bool trans_b);

// The device's SM count (both paths size their grids and schedules by it).
int sm_count(int device);

// gemm_fp32.cu: `bertaccel::gemm` with float32 operands
std::tuple<at::Tensor, at::Tensor> gemm_fp32(const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& bias,
                                             const c10::optional<at::Tensor>& aux, int64_t epilogue, bool trans_a,
                                             bool trans_b, bool save_pre, int64_t tile, int64_t splits_k);

}  // namespace bertaccel::gemm
