// AdamW on fp32 master weights whose forward ran on bf16 copies (modules/weight_copies.py), in one
// multi-tensor pass per parameter group:
//
//   read  the bf16 gradient of the copy (2 B), the fp32 master, exp_avg, exp_avg_sq (12 B)
//   write the fp32 master, exp_avg, exp_avg_sq (12 B) and the refreshed bf16 copy (2 B)
//
// = 28 B per parameter. The unfused path moves 40 B in three kernels: the copies' gradients widened
// into the masters' fp32 `.grad` (2 B read, 4 B written), PyTorch's fused AdamW (16 B read, 12 B
// written) and the refresh of the copies (4 B read, 2 B written).
//
// The arithmetic is PyTorch's fused AdamW (ATen's FusedAdamMathFunctor, ADAMW mode, no amsgrad, not
// maximize) in fp32: decoupled weight decay p -= lr * wd * p; m = b1 m + (1 - b1) g;
// v = b2 v + (1 - b2) g^2; p -= (lr / (1 - b1^t)) m / (sqrt(v) / sqrt(1 - b2^t) + eps), with the
// step count t read from each parameter's device step tensor (capturable) and the learning rate
// from a device tensor (graph replays see the schedule's current value).
//
// `adamw_` is the same update for parameters without copies, from their own fp32 gradients (16 B read, 12 B
// written: what PyTorch's fused AdamW moves), so that the graphed step can update every parameter in this
// kernel (the word embeddings, read in fp32 by the embedding kernel, have no copy).
//
// Launch: one block per (tensor, chunk) pair, up to kMaxTensors tensors per launch, described in
// the kernel's parameter struct (no host-to-device copy, so a CUDA graph can capture it); 4-wide
// vectors where a tensor's pointers are 16-byte aligned and its size a multiple of 4. Chunks of
// kDefaultChunk elements (BERTACCEL_ADAMW_CHUNK, read at each call, sets another multiple of 1,024 for
// comparing). The first version's 65,536 made a MiniLM step's 22.7M parameters ~360 blocks of 256 threads,
// 2-3 per SM: too few loads in flight. H200, the product's update alone (benchmarks/bench_adamw.py, CUDA
// graphs, 28 B per parameter; PyTorch's fused AdamW in the same run): MiniLM 209.2 us at 65,536 (74% of
// the copy ceiling), 185.7 at 16,384, 171.4 at 4,096 (90%; PyTorch 182.7); BERT-base 844.2 / 812.1 /
// 777.9 us (95%; PyTorch 902.9).
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdlib>

#include "common.cuh"

namespace bertaccel {
namespace {

constexpr int kMaxTensors = 48;  // 48 x 6 pointers + sizes + chunk starts < 4 KB of kernel parameters
constexpr int kAdamThreads = 256;
constexpr int64_t kDefaultChunk = 4096;

struct AdamWTensors {
  float* p[kMaxTensors];
  const void* g[kMaxTensors];  // bf16 (the copies' gradients) or fp32 (adamw_: the parameters' own)
  float* m[kMaxTensors];
  float* v[kMaxTensors];
  const float* step[kMaxTensors];
  __nv_bfloat16* c[kMaxTensors];  // null without copies (adamw_)
  int64_t n[kMaxTensors];
  int chunk_start[kMaxTensors + 1];
  int count;
  int64_t chunk;  // elements per block
};

struct AdamWScalars {
  float beta1, beta2, weight_decay, eps;
};

__device__ __forceinline__ void adamw_one(float& p, float g, float& m, float& v, float wd_lr, float step_size,
                                          float bc2_sqrt, const AdamWScalars& s) {
  p -= wd_lr * p;
  m = s.beta1 * m + (1.f - s.beta1) * g;
  v = s.beta2 * v + (1.f - s.beta2) * g * g;
  const float denom = sqrtf(v) / bc2_sqrt + s.eps;
  p -= step_size * m / denom;
}

// G: the gradients' type; COPY: write the refreshed bf16 copies (adamw_bf16_copies_) or not (adamw_).
template <typename G, bool COPY>
__global__ void __launch_bounds__(kAdamThreads) adamw_kernel(AdamWTensors t, const float* __restrict__ lr_ptr,
                                                            AdamWScalars s) {
  // the tensor of this block: the last i with chunk_start[i] <= blockIdx.x
  int lo = 0, hi = t.count - 1;
  const int b = blockIdx.x;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (t.chunk_start[mid] <= b) lo = mid; else hi = mid - 1;
  }
  const int i = lo;
  const int64_t begin = (int64_t)(b - t.chunk_start[i]) * t.chunk;
  const int64_t end = min(t.n[i], begin + t.chunk);
  const float lr = *lr_ptr;
  const float step = *t.step[i];
  const float bc1 = 1.f - powf(s.beta1, step);
  const float bc2_sqrt = sqrtf(1.f - powf(s.beta2, step));
  const float step_size = lr / bc1, wd_lr = lr * s.weight_decay;
  float* __restrict__ P = t.p[i];
  const G* __restrict__ Gr = static_cast<const G*>(t.g[i]);
  float* __restrict__ M = t.m[i];
  float* __restrict__ V = t.v[i];
  __nv_bfloat16* __restrict__ C = t.c[i];
  const bool vec = t.n[i] % 4 == 0 &&
                   ((reinterpret_cast<uintptr_t>(P) | reinterpret_cast<uintptr_t>(M) | reinterpret_cast<uintptr_t>(V)) % 16) == 0 &&
                   reinterpret_cast<uintptr_t>(Gr) % (4 * sizeof(G)) == 0 && (!COPY || reinterpret_cast<uintptr_t>(C) % 8 == 0);
  if (vec) {
    for (int64_t k = begin + 4 * (int64_t)threadIdx.x; k < end; k += 4 * kAdamThreads) {
      float p[4], g[4], m[4], v[4];
      load_f<float, 4>(P + k, p);
      load_f<G, 4>(Gr + k, g);
      load_f<float, 4>(M + k, m);
      load_f<float, 4>(V + k, v);
#pragma unroll
      for (int j = 0; j < 4; ++j) adamw_one(p[j], g[j], m[j], v[j], wd_lr, step_size, bc2_sqrt, s);
      store_f<float, 4>(P + k, p);
      store_f<float, 4>(M + k, m);
      store_f<float, 4>(V + k, v);
      if constexpr (COPY) store_f<__nv_bfloat16, 4>(C + k, p);
    }
  } else {
    for (int64_t k = begin + threadIdx.x; k < end; k += kAdamThreads) {
      float p = P[k], m = M[k], v = V[k];
      adamw_one(p, to_f(Gr[k]), m, v, wd_lr, step_size, bc2_sqrt, s);
      P[k] = p;
      M[k] = m;
      V[k] = v;
      if constexpr (COPY) C[k] = __float2bfloat16(p);
    }
  }
}

// Elements per block: kDefaultChunk, or BERTACCEL_ADAMW_CHUNK (a positive multiple of 1,024: one 4-wide
// vector per thread and iteration), read at each call (one optimizer call per step; in a CUDA graph, at capture);
// any other value is an error. BERTACCEL_CHECK, not TORCH_CHECK: a TORCH_CHECK message with a number in it
// segfaulted on the GPU host (check.h) - it did here too, in session 57's first version.
int64_t adamw_chunk() {
  const char* env = std::getenv("BERTACCEL_ADAMW_CHUNK");
  if (env == nullptr || *env == '\0') return kDefaultChunk;
  char* end = nullptr;
  const long long v = std::strtoll(env, &end, 10);
  BERTACCEL_CHECK(end != env && *end == '\0' && v > 0 && v % (4 * kAdamThreads) == 0 && v <= (1LL << 30),
                  "BERTACCEL_ADAMW_CHUNK must be a positive multiple of %d (elements per block), got '%.64s'; unset "
                  "it for the default %lld", 4 * kAdamThreads, env, (long long)kDefaultChunk);
  return v;
}

// Both ops: checks, then one launch per kMaxTensors parameters. copies empty: adamw_ (fp32 gradients, no copies).
void adamw_launch(const char* op, at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                  at::TensorList exp_avg_sqs, at::TensorList steps, at::TensorList copies, const at::Tensor& lr,
                  double beta1, double beta2, double weight_decay, double eps, bool with_copies) {
  const int64_t chunk = adamw_chunk();
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n &&
                  (!with_copies || copies.size() == n),
              "bertaccel ", op, ": every tensor list must have one entry per parameter");
  if (n == 0) return;
  TORCH_CHECK(lr.is_cuda() && lr.scalar_type() == at::kFloat && lr.numel() == 1,
              "bertaccel ", op, ": lr must be a one-element float32 CUDA tensor (capturable)");
  const at::ScalarType grad_type = with_copies ? at::kBFloat16 : at::kFloat;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK(p.is_cuda() && p.scalar_type() == at::kFloat && p.is_contiguous(),
                "bertaccel ", op, ": parameters must be contiguous float32 CUDA tensors");
    for (const at::Tensor* t : {&exp_avgs[i], &exp_avg_sqs[i]})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == p.numel() &&
                      t->device() == p.device(),
                  "bertaccel ", op, ": exp_avg / exp_avg_sq must be contiguous float32 like the parameter");
    TORCH_CHECK(grads[i].scalar_type() == grad_type && grads[i].is_contiguous() && grads[i].numel() == p.numel() &&
                    grads[i].device() == p.device(),
                "bertaccel ", op, ": gradients must be contiguous ", with_copies ? "bfloat16" : "float32",
                " like the parameter");
    if (with_copies)
      TORCH_CHECK(copies[i].scalar_type() == at::kBFloat16 && copies[i].is_contiguous() &&
                      copies[i].numel() == p.numel() && copies[i].device() == p.device(),
                  "bertaccel ", op, ": copies must be contiguous bfloat16 like the master");
    TORCH_CHECK(steps[i].scalar_type() == at::kFloat && steps[i].numel() == 1 && steps[i].device() == p.device(),
                "bertaccel ", op, ": step counts must be one-element float32 tensors on the parameter's device");
    TORCH_CHECK(p.device() == lr.device(), "bertaccel ", op, ": lr must be on the parameters' device");
  }
  c10::cuda::CUDAGuard guard(params[0].device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const AdamWScalars s{(float)beta1, (float)beta2, (float)weight_decay, (float)eps};
  size_t first = 0;
  while (first < n) {
    AdamWTensors t{};
    t.chunk = chunk;
    int blocks = 0;
    int k = 0;
    for (; k < kMaxTensors && first + k < n; ++k) {
      const size_t i = first + k;
      t.p[k] = params[i].data_ptr<float>();
      t.g[k] = grads[i].data_ptr();
      t.m[k] = exp_avgs[i].data_ptr<float>();
      t.v[k] = exp_avg_sqs[i].data_ptr<float>();
      t.step[k] = steps[i].data_ptr<float>();
      t.c[k] = with_copies ? reinterpret_cast<__nv_bfloat16*>(copies[i].data_ptr()) : nullptr;
      t.n[k] = params[i].numel();
      t.chunk_start[k] = blocks;
      const int64_t chunks = (t.n[k] + chunk - 1) / chunk;
      TORCH_CHECK(blocks + chunks < (1LL << 31), "bertaccel ", op, ": too many elements for one launch");
      blocks += (int)chunks;
    }
    t.count = k;
    t.chunk_start[k] = blocks;
    if (blocks > 0) {
      if (with_copies) adamw_kernel<__nv_bfloat16, true><<<blocks, kAdamThreads, 0, stream>>>(t, lr.data_ptr<float>(), s);
      else adamw_kernel<float, false><<<blocks, kAdamThreads, 0, stream>>>(t, lr.data_ptr<float>(), s);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    first += k;
  }
}

void adamw_bf16_copies_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                        at::TensorList exp_avg_sqs, at::TensorList steps, at::TensorList copies, const at::Tensor& lr,
                        double beta1, double beta2, double weight_decay, double eps) {
  adamw_launch("adamw_bf16_copies_", params, grads, exp_avgs, exp_avg_sqs, steps, copies, lr, beta1, beta2,
               weight_decay, eps, true);
}

void adamw_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
            at::TensorList steps, const at::Tensor& lr, double beta1, double beta2, double weight_decay, double eps) {
  adamw_launch("adamw_", params, grads, exp_avgs, exp_avg_sqs, steps, {}, lr, beta1, beta2, weight_decay, eps, false);
}

}  // namespace
}  // namespace bertaccel

TORCH_LIBRARY_IMPL(bertaccel, CUDA, m) {
  m.impl("adamw_bf16_copies_", &bertaccel::adamw_bf16_copies_);
  m.impl("adamw_", &bertaccel::adamw_);
}
