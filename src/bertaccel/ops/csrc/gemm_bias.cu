// The bias-epilogue GEMM kernels (gemm_kernel.cuh, SPEC = kSpecBias: + bias, a bf16 output stored by TMA, one K
// split; K-major operands, the forward's layout) for every single-block schedule and tile width: their own
// translation unit, compiled in parallel with gemm.cu.
#include "gemm_kernel.cuh"

namespace bertaccel::gemm::kernel {

void launch_bias(bool pingpong, bool rows192, int bn, bool a_mn, bool b_mn, const Maps& m, const Params& p, int grid,
                 cudaStream_t stream) {
  launch_single<kSpecBias>(pingpong, rows192, bn, a_mn, b_mn, m, p, grid, stream);
}

}  // namespace bertaccel::gemm::kernel
