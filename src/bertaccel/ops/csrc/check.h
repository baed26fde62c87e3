// BERTACCEL_CHECK(cond, printf-format, args...): TORCH_CHECK with a message formatted by snprintf and
// handed over as one C string.
//
// Why: on the H100 host (torch 2.11, CUDA 13) a failing TORCH_CHECK in the GEMM extension whose message
// carried a number segfaulted instead of raising, while messages of string literals alone raised
// (session 5; the error-path test of tests/ops/test_gemm.py). A message with values goes through
// c10::str's ostringstream, compiled inline into the extension; a single C string does not, and with
// this macro the same checks raised their messages on the H100. The extensions were then compiled as
// C++17 against a C++20 libtorch, the likely root cause: build.py now compiles them as C++20.
#pragma once
#include <c10/util/Exception.h>

#include <cstdio>
#include <string>

#define BERTACCEL_CHECK(cond, ...)                                          \
  do {                                                                      \
    if (C10_UNLIKELY(!(cond))) {                                            \
      char bertaccel_msg_[384];                                             \
      std::snprintf(bertaccel_msg_, sizeof(bertaccel_msg_), __VA_ARGS__);   \
      TORCH_CHECK(false, static_cast<const char*>(bertaccel_msg_));         \
    }                                                                       \
  } while (0)

namespace bertaccel {
// "[2, 12, 128, 128]" without an ostringstream
template <typename Sizes>
inline std::string shape_str(const Sizes& sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}
}  // namespace bertaccel
