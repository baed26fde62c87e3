// The ping-pong and 192-row GEMM kernels in clusters of two blocks (gemm_kernel.cuh, CLU = 2): their own
// translation unit, so the build compiles them in parallel with gemm.cu.
#include "gemm_kernel.cuh"

namespace bertaccel::gemm::kernel {

void launch_pair_rows(bool pingpong, int bn, bool a_mn, bool b_mn, const Maps& m, const Params& p, int grid,
                      cudaStream_t stream) {
  if (pingpong) {
    if (bn == 128) launch_layout<128, true, 2, 2>(a_mn, b_mn, m, p, grid, stream);
    else launch_layout<64, true, 2, 2>(a_mn, b_mn, m, p, grid, stream);
    return;
  }
  switch (bn) {
    case 192: launch_layout<192, false, 3, 2>(a_mn, b_mn, m, p, grid, stream); break;
    case 128: launch_layout<128, false, 3, 2>(a_mn, b_mn, m, p, grid, stream); break;
    default: launch_layout<64, false, 3, 2>(a_mn, b_mn, m, p, grid, stream); break;
  }
}

}  // namespace bertaccel::gemm::kernel
