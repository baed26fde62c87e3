// The cooperative GEMM kernels in clusters of two blocks (gemm_kernel.cuh, CLU = 2): their own translation
// unit, so the build compiles them in parallel with gemm.cu.
#include "gemm_kernel.cuh"

namespace bertaccel::gemm::kernel {

void launch_pair_cooperative(int bn, bool a_mn, bool b_mn, const Maps& m, const Params& p, int grid, cudaStream_t stream) {
  switch (bn) {
    case 96:
      TORCH_CHECK(!a_mn && !b_mn, "bertaccel gemm: 96-wide tiles need K-major operands");
      launch<96, false, false, false, 2, 2>(m, p, grid, stream);
      break;
    case 256: launch_layout<256, false, 2, 2>(a_mn, b_mn, m, p, grid, stream); break;
    case 192: launch_layout<192, false, 2, 2>(a_mn, b_mn, m, p, grid, stream); break;
    case 128: launch_layout<128, false, 2, 2>(a_mn, b_mn, m, p, grid, stream); break;
    default: launch_layout<64, false, 2, 2>(a_mn, b_mn, m, p, grid, stream); break;
  }
}

}  // namespace bertaccel::gemm::kernel
