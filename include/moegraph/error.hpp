// moegraph's error model: every host-side failure is a moegraph::Error carrying file:line and a
// message assembled from parts. Library code never calls exit(); destructors never throw.
#pragma once

#include "moegraph/export.h"

#include <cuda_runtime_api.h>

#include <sstream>
#include <stdexcept>
#include <string>

namespace moegraph {

// What went wrong, for callers that map errors to codes (the C ABI does).
enum class ErrorKind {
  kInvalidArgument,   // bad options or arguments (the message names the field, value and rule)
  kCuda,              // a CUDA runtime error
  kLibrary,           // cuBLASLt or NCCL
  kDeviceSplits,      // invalid device inputs recorded by a kernel (check_device_errors)
  kNoDevice,          // no usable CUDA device
  kUnsupportedDevice, // a device other than compute capability 9.0
};

class MOEGRAPH_API Error : public std::runtime_error {
 public:
  Error(const char* file, int line, const std::string& message, ErrorKind kind = ErrorKind::kInvalidArgument);
  ErrorKind kind() const noexcept { return kind_; }
  const char* file() const noexcept { return file_; }
  int line() const noexcept { return line_; }
  // The message without the "file:line: " prefix.
  const std::string& message() const noexcept { return message_; }

 private:
  const char* file_;
  int line_;
  std::string message_;
  ErrorKind kind_;
};

namespace detail {
template <class... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}
[[noreturn]] MOEGRAPH_API void throw_error(const char* file, int line, const std::string& message,
                              ErrorKind kind = ErrorKind::kInvalidArgument);
[[noreturn]] MOEGRAPH_API void throw_cuda_error(const char* file, int line, const char* expr, cudaError_t status);
}  // namespace detail

}  // namespace moegraph

// MG_CHECK(cond, "layer.hidden must be a multiple of 16, got ", h)
#define MG_CHECK(cond, ...)                                                                     \
  do {                                                                                          \
    if (!(cond))                                                                                \
      ::moegraph::detail::throw_error(__FILE__, __LINE__, ::moegraph::detail::concat(__VA_ARGS__)); \
  } while (0)

#define MG_FAIL(...) ::moegraph::detail::throw_error(__FILE__, __LINE__, ::moegraph::detail::concat(__VA_ARGS__))

#define MG_CUDA_CHECK(expr)                                                        \
  do {                                                                             \
    cudaError_t mg_status_ = (expr);                                               \
    if (mg_status_ != cudaSuccess)                                                 \
      ::moegraph::detail::throw_cuda_error(__FILE__, __LINE__, #expr, mg_status_); \
  } while (0)

// After every kernel launch: launch-configuration errors surface here, not at the next sync.
#define MG_LAUNCH_CHECK() MG_CUDA_CHECK(cudaGetLastError())
