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
  // The failure is reported by this exception: clear the thread's last-error record, which a failed
  // runtime call also sets. Otherwise a caller who catches it and goes on (a server that retries a
  // smaller bucket after an allocation failure) would see its next kernel launch "fail" with this
  // error. A sticky error (a kernel fault) stays: every later call reports it again.
  (void)cudaGetLastError();
  throw Error(file, line, concat(expr, " failed: ", cudaGetErrorName(status), ": ", cudaGetErrorString(status)),
              ErrorKind::kCuda);
}

}  // namespace detail
}  // namespace moegraph
