// Host and device assertion helpers and CUDA error checking, shared by every mok:: translation
// unit. Torch-free: host failures throw mok::Error (a std::runtime_error, which torch's op
// dispatcher turns into a Python RuntimeError); device failures print and trap.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdio>
#include <stdexcept>
#include <string>

#define MOK_HOST_DEVICE __host__ __device__ __forceinline__
#define MOK_DEVICE __device__ __forceinline__

namespace mok {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {

// printf-style formatting into a std::string (host only).
template <typename... Args>
inline std::string format_message(const char* fmt, Args... args) {
  const int size = std::snprintf(nullptr, 0, fmt, args...);
  if (size <= 0) return std::string(fmt);
  std::string out(static_cast<size_t>(size) + 1, '\0');
  std::snprintf(out.data(), out.size(), fmt, args...);
  out.resize(static_cast<size_t>(size));
  return out;
}

[[noreturn]] inline void throw_check_failure(const char* file, int line, const char* condition,
                                             const std::string& message) {
  throw Error(format_message("%s:%d: check `%s` failed: %s", file, line, condition,
                             message.c_str()));
}

[[noreturn]] inline void throw_cuda_failure(const char* file, int line, const char* expression,
                                            cudaError_t status) {
  throw Error(format_message("%s:%d: CUDA call `%s` failed: %s (%s)", file, line, expression,
                             cudaGetErrorString(status), cudaGetErrorName(status)));
}

}  // namespace detail
}  // namespace mok

// MOK_HOST_CHECK(cond, fmt, args...): host code; throws mok::Error naming the rule and the value.
#define MOK_HOST_CHECK(cond, ...)                                                               \
  do {                                                                                          \
    if (!(cond)) {                                                                              \
      ::mok::detail::throw_check_failure(__FILE__, __LINE__, #cond,                             \
                                         ::mok::detail::format_message(__VA_ARGS__));           \
    }                                                                                           \
  } while (0)

// MOK_DEVICE_CHECK(cond, fmt, args...): device code; prints the location and message, then traps
// (the launch fails with cudaErrorLaunchFailure and the next host-visible point reports it).
#define MOK_DEVICE_CHECK(cond, ...)                                                            \
  do {                                                                                         \
    if (!(cond)) {                                                                             \
      printf("%s:%d: device check `%s` failed (block %d,%d,%d thread %d): ", __FILE__, __LINE__, \
             #cond, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x);                          \
      printf(__VA_ARGS__);                                                                     \
      printf("\n");                                                                            \
      __trap();                                                                                \
    }                                                                                          \
  } while (0)

// MOK_CHECK picks the host or device flavour; use it in __host__ __device__ functions.
#if defined(__CUDA_ARCH__)
#define MOK_CHECK(cond, ...) MOK_DEVICE_CHECK(cond, __VA_ARGS__)
#else
#define MOK_CHECK(cond, ...) MOK_HOST_CHECK(cond, __VA_ARGS__)
#endif

// MOK_CUDA_CHECK(expr): host code; throws mok::Error if a CUDA runtime call did not succeed.
#define MOK_CUDA_CHECK(expr)                                                     \
  do {                                                                           \
    const cudaError_t mok_cuda_status_ = (expr);                                 \
    if (mok_cuda_status_ != cudaSuccess) {                                       \
      ::mok::detail::throw_cuda_failure(__FILE__, __LINE__, #expr, mok_cuda_status_); \
    }                                                                            \
  } while (0)
