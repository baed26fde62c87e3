// A linear layer's weight gradient dw = dy^T x and bias gradient db (dy summed over the tokens): by
// default cuBLAS's GEMM, then our column-sum kernel (column_sum.cu); with BERTACCEL_DENSE_WGRAD=fused,
// one cuBLASLt matmul whose BGRADB epilogue sums dy while the GEMM reads it (Apex's fused_dense and
// Transformer Engine take their wgrad bias gradients this way).
//
// The fused form is not the default because it measured slower, and less exact: on an H200 (session 53,
// `python -m benchmarks.bench_ops --ops bias_grad`, graph replays, bf16) 119.2 us against 109.8 for
// GEMM + column sum at BERT-base's Q/K/V projection (16,384 tokens, 2,304 x 768; the GEMM alone 83.1),
// 48.4 against 41.7 at MiniLM's (1,152 x 384; GEMM alone 29.0), and slower at 9,830 tokens too; and
// cuBLASLt offered the epilogue only with a bf16 bias vector (no fp32 one beside bf16 matrices), so db
// is rounded to bf16 where column_sum returns fp32. The BERT-base / MiniLM 32x512 graphed steps
// measured no difference either way (within the run-to-run spread). The switch stays for other GPUs (the
// H100 is the product's target) and cuBLAS versions.
//
// Column-major cuBLAS view of the row-major tensors (m = in_features K, n = out_features N, k = tokens M):
//   D (K x N, ld K)  = dw [N, K] row-major
//   A (K x M, ld K)  = x  [M, K] row-major, op N
//   B (N x M, ld N)  = dy [M, N] row-major, op T  -> M x N; BGRADB: length n = N, summed over k = M.
//
// No link against cuBLASLt: its functions are looked up in the copy PyTorch has loaded (dlopen with
// RTLD_NOLOAD), so the extension loads wherever PyTorch runs. Where they are missing, or cuBLASLt
// offers no algorithm for the shape (heuristics asked once per shape), or the inputs are not bf16 /
// 16-byte aligned, the fused form falls back to the separate one and `dense_wgrad_path` says why.
// The switch is read per call (compare both in one run). The fused form's bias gradient is fp32 where
// cuBLASLt takes an fp32 bias vector, else bf16 widened to fp32; which one is cached per shape.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>
#include <dlfcn.h>
#include <torch/library.h>

#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "check.h"
#include "dispatch.h"
#include "switches.h"

namespace bertaccel {
namespace {

// ------------------------------------------------------------------ cuBLASLt, from PyTorch's copy
struct Lt {
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
  std::string missing;  // "" when every function was found
};

const Lt& lt() {
  static const Lt l = [] {
    Lt r;
    void* lib = nullptr;
    for (const char* so : {"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"})
      if ((lib = dlopen(so, RTLD_NOW | RTLD_NOLOAD)) != nullptr) break;
    void* scope = lib != nullptr ? lib : RTLD_DEFAULT;
    auto get = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(scope, name));
      if (fn == nullptr && r.missing.empty()) r.missing = std::string("cuBLASLt's ") + name + " is not loaded in this process";
    };
    get(r.desc_create, "cublasLtMatmulDescCreate");
    get(r.desc_destroy, "cublasLtMatmulDescDestroy");
    get(r.desc_set, "cublasLtMatmulDescSetAttribute");
    get(r.layout_create, "cublasLtMatrixLayoutCreate");
    get(r.layout_destroy, "cublasLtMatrixLayoutDestroy");
    get(r.pref_create, "cublasLtMatmulPreferenceCreate");
    get(r.pref_destroy, "cublasLtMatmulPreferenceDestroy");
    get(r.pref_set, "cublasLtMatmulPreferenceSetAttribute");
    get(r.heuristic, "cublasLtMatmulAlgoGetHeuristic");
    get(r.matmul, "cublasLtMatmul");
    return r;
  }();
  return l;
}

// The descriptors of one dw / db matmul; destroyed with it.
struct Plan {
  const Lt& l;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasStatus_t status = CUBLAS_STATUS_SUCCESS;

  Plan(const Lt& l_, int64_t M, int64_t N, int64_t K, cudaDataType_t bias_type, const void* db) : l(l_) {
    auto ok = [&](cublasStatus_t s) { if (status == CUBLAS_STATUS_SUCCESS) status = s; };
    ok(l.desc_create(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    if (status != CUBLAS_STATUS_SUCCESS) return;
    const cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_T;
    const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BGRADB;
    const int32_t bt = bias_type;
    ok(l.desc_set(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    ok(l.desc_set(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    ok(l.desc_set(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
    ok(l.desc_set(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &db, sizeof(db)));
    ok(l.desc_set(op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)));
    ok(l.layout_create(&a, CUDA_R_16BF, (uint64_t)K, (uint64_t)M, K));
    ok(l.layout_create(&b, CUDA_R_16BF, (uint64_t)N, (uint64_t)M, N));
    ok(l.layout_create(&d, CUDA_R_16BF, (uint64_t)K, (uint64_t)N, K));
  }
  ~Plan() {
    if (d) l.layout_destroy(d);
    if (b) l.layout_destroy(b);
    if (a) l.layout_destroy(a);
    if (op) l.desc_destroy(op);
  }
};

constexpr size_t kMaxWorkspace = size_t{32} << 20;  // cuBLAS's recommendation for Hopper

// What cuBLASLt offers for one shape: an algorithm and the bias vector's type it was found for.
struct Choice {
  bool found = false;
  cudaDataType_t bias_type = CUDA_R_32F;
  cublasLtMatmulHeuristicResult_t result{};
  std::string why;  // when not found
};

Choice choose(const Lt& l, int64_t M, int64_t N, int64_t K) {
  Choice c;
  cublasLtMatmulPreference_t pref = nullptr;
  if (l.pref_create(&pref) != CUBLAS_STATUS_SUCCESS) {
    c.why = "cublasLtMatmulPreferenceCreate failed";
    return c;
  }
  const uint64_t ws = kMaxWorkspace;
  const uint32_t align = 16;
  l.pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
    l.pref_set(pref, attr, &align, sizeof(align));
  // fp32 bias gradient first; a bf16 one (widened afterwards) where cuBLASLt has no fp32 form
  for (cudaDataType_t bt : {CUDA_R_32F, CUDA_R_16BF}) {
    // the heuristics look at the bias pointer's alignment only: any 16-byte aligned address will do
    Plan p(l, M, N, K, bt, reinterpret_cast<const void*>(uintptr_t{256}));
    if (p.status != CUBLAS_STATUS_SUCCESS) continue;
    int n = 0;
    if (l.heuristic(at::cuda::getCurrentCUDABlasLtHandle(), p.op, p.a, p.b, p.d, p.d, pref, 1, &c.result, &n) ==
            CUBLAS_STATUS_SUCCESS &&
        n > 0 && c.result.workspaceSize <= kMaxWorkspace) {
      c.found = true;
      c.bias_type = bt;
      break;
    }
  }
  l.pref_destroy(pref);
  if (!c.found) c.why = "cuBLASLt offers no bias-gradient (BGRADB) algorithm for this shape";
  return c;
}

const Choice& choice_for(int64_t M, int64_t N, int64_t K) {
  static std::mutex mu;
  static std::map<std::tuple<int, int64_t, int64_t, int64_t>, Choice> cache;
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> g(mu);
  auto key = std::make_tuple(dev, M, N, K);
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, choose(lt(), M, N, K)).first;
  return it->second;
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// "" when the fused matmul can run for these inputs, else why not.
std::string why_unfused(const at::Tensor& dy, const at::Tensor& x) {
  if (!env_is("BERTACCEL_DENSE_WGRAD", "fused")) return "the default (BERTACCEL_DENSE_WGRAD=fused for cuBLASLt's BGRADB)";
  if (dy.scalar_type() != at::kBFloat16 || x.scalar_type() != at::kBFloat16) return "the fused form takes bfloat16 only";
  if (!lt().missing.empty()) return lt().missing;
  const int64_t M = dy.size(0), N = dy.size(1), K = x.size(1);
  if (M == 0 || N == 0 || K == 0) return "an empty matrix";
  if (N % 8 != 0 || K % 8 != 0 || !aligned16(dy) || !aligned16(x))
    return "rows not 16-byte aligned (sizes must be multiples of 8)";
  if (M > INT32_MAX || N > INT32_MAX || K > INT32_MAX) return "a size over 2^31";
  const Choice& c = choice_for(M, N, K);
  return c.found ? "" : c.why;
}

void check_inputs(const at::Tensor& dy, const at::Tensor& x) {
  TORCH_CHECK(dy.is_cuda() && x.is_cuda(), "bertaccel dense_wgrad: inputs must be CUDA tensors");
  BERTACCEL_CHECK(dy.dim() == 2 && x.dim() == 2 && dy.size(0) == x.size(0),
                  "bertaccel dense_wgrad: dy [tokens, out] and x [tokens, in] must share the token count, got %s and %s",
                  shape_str(dy.sizes()).c_str(), shape_str(x.sizes()).c_str());
  TORCH_CHECK(dy.scalar_type() == x.scalar_type(), "bertaccel dense_wgrad: dy and x must have one dtype");
}

std::tuple<at::Tensor, at::Tensor> dense_wgrad(const at::Tensor& dy_, const at::Tensor& x_) {
  check_inputs(dy_, x_);
  c10::cuda::CUDAGuard guard(dy_.device());
  const at::Tensor dy = dy_.contiguous(), x = x_.contiguous();
  if (!why_unfused(dy, x).empty()) {
    static auto column_sum = op<at::Tensor(const at::Tensor&)>("bertaccel::column_sum");
    return {at::mm(dy.t(), x), column_sum.call(dy)};
  }
  const int64_t M = dy.size(0), N = dy.size(1), K = x.size(1);
  const Choice& c = choice_for(M, N, K);
  const Lt& l = lt();
  at::Tensor dw = at::empty({N, K}, dy.options());
  at::Tensor db = at::empty({N}, dy.options().dtype(c.bias_type == CUDA_R_32F ? at::kFloat : at::kBFloat16));
  at::Tensor ws = at::empty({(int64_t)std::max<size_t>(c.result.workspaceSize, 1)}, dy.options().dtype(at::kByte));
  Plan p(l, M, N, K, c.bias_type, db.data_ptr());
  BERTACCEL_CHECK(p.status == CUBLAS_STATUS_SUCCESS, "bertaccel dense_wgrad: cuBLASLt descriptor setup failed (status %d)",
                  (int)p.status);
  const float one = 1.f, zero = 0.f;
  const cublasStatus_t s =
      l.matmul(at::cuda::getCurrentCUDABlasLtHandle(), p.op, &one, x.data_ptr(), p.a, dy.data_ptr(), p.b, &zero,
               dw.data_ptr(), p.d, dw.data_ptr(), p.d, &c.result.algo, ws.data_ptr(), c.result.workspaceSize,
               at::cuda::getCurrentCUDAStream());
  BERTACCEL_CHECK(s == CUBLAS_STATUS_SUCCESS, "bertaccel dense_wgrad: cublasLtMatmul failed (status %d) at dy %s, x %s",
                  (int)s, shape_str(dy.sizes()).c_str(), shape_str(x.sizes()).c_str());
  return {dw, db.scalar_type() == at::kFloat ? db : db.to(at::kFloat)};
}

// Which form dense_wgrad takes for these inputs: "fused (fp32 bias gradient)", "fused (bf16 bias
// gradient)", or "separate: <why>". For tests and benchmarks.
std::string dense_wgrad_path(const at::Tensor& dy, const at::Tensor& x) {
  check_inputs(dy, x);
  c10::cuda::CUDAGuard guard(dy.device());
  const at::Tensor dyc = dy.contiguous(), xc = x.contiguous();
  const std::string why = why_unfused(dyc, xc);
  if (!why.empty()) return "separate: " + why;
  return choice_for(dy.size(0), dy.size(1), x.size(1)).bias_type == CUDA_R_32F ? "fused (fp32 bias gradient)"
                                                                                : "fused (bf16 bias gradient)";
}

}  // namespace
}  // namespace bertaccel

TORCH_LIBRARY_IMPL(bertaccel, CUDA, m) {
  m.impl("dense_wgrad", &bertaccel::dense_wgrad);
  m.impl("dense_wgrad_path", &bertaccel::dense_wgrad_path);
}
