// Kernel switches (README "Kernel switches", for comparing variants in one run): environment variables
// read by the host code. Used by common.cuh's row ops, by pdl.cuh (which the GEMM includes too) and by the attention.
#pragma once
#include <cstdlib>
#include <initializer_list>
#include <string>

#include "check.h"

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

// A kernel switch that takes one of a few words: the index of the environment variable's value in `choices`, whose
// first entry is what an unset variable means ("" unless the default also has a name). Any other value is refused,
// naming the choices: "NAME=v is not a <what>: unset it or set a, b or c". Callers that read it once per process keep
// the index in a function-local static (a refusal leaves it unset: every call is refused).
inline int env_choice(const char* name, std::initializer_list<const char*> choices, const char* what) {
  const std::string v = env_value(name);
  std::string named;
  int i = 0;
  for (const char* c : choices) {
    if (v == c || (i == 0 && v.empty())) return i;
    if (*c != '\0') named += std::string(named.empty() ? "" : i + 1 == (int)choices.size() ? " or " : ", ") + c;
    ++i;
  }
  BERTACCEL_CHECK(false, "%s=%s is not a %s: unset it or set %s", name, v.c_str(), what, named.c_str());
  return 0;
}

// Whether the environment variable `name` is exactly `value`.
inline bool env_is(const char* name, const char* value) { return env_value(name) == value; }

}  // namespace bertaccel
