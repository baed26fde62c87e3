// Host code's calls of the bertaccel ops through the dispatcher (csrc/autograd.cpp, csrc/eager.cpp): a typed,
// unboxed handle per op, and autograd.cpp's functions that eager.cpp's entry points call.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <tuple>

namespace bertaccel {

// The op `name` ("bertaccel::layer_norm") as a typed dispatcher handle of signature Sig (looked up once per
// call site: keep it in a function-local static).
template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// csrc/autograd.cpp: the residual LayerNorm's fan-out form, (y, an alias of y) through its C++ autograd Function
std::tuple<at::Tensor, at::Tensor> residual_layer_norm_fanout(const at::Tensor& x, const at::Tensor& bias,
                                                              const at::Tensor& residual, const at::Tensor& weight,
                                                              const at::Tensor& ln_bias, double p, double eps);

}  // namespace bertaccel
