// The GEMM kernels with the residual epilogue and no bias (gemm_kernel.cuh, SPEC = kSpecResidual: + aux[M, N], a
// bf16 output stored by TMA, one K split) for every single-block schedule, tile width and layout - the fused
// feed-forward block's input gradient, d(pre) W1 plus the residual's gradient (ffn.py): their own translation
// unit, compiled in parallel with gemm.cu.
#include "gemm_kernel.cuh"

namespace bertaccel::gemm::kernel {

void launch_residual(bool pingpong, bool rows192, int bn, bool a_mn, bool b_mn, const Maps& m, const Params& p, int grid,
                     cudaStream_t stream) {
  launch_single<kSpecResidual>(pingpong, rows192, bn, a_mn, b_mn, m, p, grid, stream);
}

}  // namespace bertaccel::gemm::kernel
