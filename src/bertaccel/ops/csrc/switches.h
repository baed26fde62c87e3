// Kernel switches (README "Kernel switches", for comparing variants in one run): environment variables
// read by the host code. Used by common.cuh's row ops, by pdl.cuh (which the GEMM includes too) and by the attention.
#pragma once
#include <cstdlib>
#include <string>

namespace bertaccel {

// The integer in the environment variable `name`, or `fallback` when it is unset or not an integer. Callers
// that read a switch once per process keep the value in a function-local static.
inline int env_switch(const char* name, int fallback) {
  const char* e = std::getenv(name);
  if (e == nullptr || *e == '\0') return fallback;
  char* end = nullptr;
  const long v = std::strtol(e, &end, 10);
  return *end == '\0' ? (int)v : fallback;
}

// A string-valued kernel switch: the environment variable's value, "" when unset. Read per call where
// benchmarks and tests compare kernels in one process (the attention's BERTACCEL_ATTENTION_FWD / _BWD).
inline std::string env_value(const char* name) {
  const char* e = std::getenv(name);
  return e != nullptr ? e : "";
}

// Whether the environment variable `name` is exactly `value`.
inline bool env_is(const char* name, const char* value) { return env_value(name) == value; }

}  // namespace bertaccel
