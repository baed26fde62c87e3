// The K-split GEMM kernels without an epilogue (gemm_kernel.cuh, SPEC = kSpecSplitK: fp32 workspace slices or the
// splits summed in the kernel, bf16 or fp32 out, stored by TMA) for every single-block schedule, tile width and
// layout: their own translation unit, compiled in parallel with gemm.cu.
#include "gemm_kernel.cuh"

namespace bertaccel::gemm::kernel {

void launch_splitk(bool pingpong, bool rows192, int bn, bool a_mn, bool b_mn, const Maps& m, const Params& p, int grid,
                   cudaStream_t stream) {
  launch_single<kSpecSplitK>(pingpong, rows192, bn, a_mn, b_mn, m, p, grid, stream);
}

}  // namespace bertaccel::gemm::kernel
