#include "moegraph/error.hpp"

namespace moegraph {

Error::Error(const char* file, int line, const std::string& message, ErrorKind kind)
    : std::runtime_error(detail::concat(file, ":", line, ": ", message)), file_(file), line_(line),
      message_(message), kind_(kind) {}

namespace detail {

void throw_error(const char* file, int line, const std::string& message, ErrorKind kind) {
  throw Error(file, line, message, kind);
}

void throw_cuda_error(const char* file, int line, const char* expr, cudaError_t status) {
  throw Error(file, line, concat(expr, " failed: ", cudaGetErrorName(status), ": ", cudaGetErrorString(status)),
              ErrorKind::kCuda);
}

}  // namespace detail
}  // namespace moegraph
