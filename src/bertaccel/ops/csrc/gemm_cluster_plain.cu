// The PLAIN GEMM kernels in clusters of two blocks (gemm_kernel.cuh, CLU = 2, SPEC = kSpecPlain: no epilogue, a
// bf16 output stored by TMA, one K split) for every schedule, tile width and layout the cluster kernels have:
// their own translation unit, compiled in parallel with gemm.cu.
#include "gemm_kernel.cuh"

namespace bertaccel::gemm::kernel {

void launch_pair_plain(bool pingpong, bool rows192, int bn, bool a_mn, bool b_mn, const Maps& m, const Params& p, int grid,
                       cudaStream_t stream) {
  if (pingpong) {
    if (bn == 128) launch_layout<128, true, 2, 2, kSpecPlain>(a_mn, b_mn, m, p, grid, stream);
    else launch_layout<64, true, 2, 2, kSpecPlain>(a_mn, b_mn, m, p, grid, stream);
  } else if (rows192) {
    switch (bn) {
      case 192: launch_layout<192, false, 3, 2, kSpecPlain>(a_mn, b_mn, m, p, grid, stream); break;
      case 128: launch_layout<128, false, 3, 2, kSpecPlain>(a_mn, b_mn, m, p, grid, stream); break;
      default: launch_layout<64, false, 3, 2, kSpecPlain>(a_mn, b_mn, m, p, grid, stream); break;
    }
  } else {
    switch (bn) {
      case 96:
        TORCH_CHECK(!a_mn && !b_mn, "bertaccel gemm: 96-wide tiles need K-major operands");
        launch<96, false, false, false, 2, 2, kSpecPlain>(m, p, grid, stream);
        break;
      case 256: launch_layout<256, false, 2, 2, kSpecPlain>(a_mn, b_mn, m, p, grid, stream); break;
      case 192: launch_layout<192, false, 2, 2, kSpecPlain>(a_mn, b_mn, m, p, grid, stream); break;
      case 128: launch_layout<128, false, 2, 2, kSpecPlain>(a_mn, b_mn, m, p, grid, stream); break;
      default: launch_layout<64, false, 2, 2, kSpecPlain>(a_mn, b_mn, m, p, grid, stream); break;
    }
  }
}

}  // namespace bertaccel::gemm::kernel
