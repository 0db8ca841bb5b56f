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
  // Whichever call first meets a machine without a usable device, the caller sees one kind for it
  // (MG_ERR_NO_DEVICE through the C ABI), as set-up's own device check reports it.
  const bool no_device = status == cudaErrorNoDevice || status == cudaErrorInsufficientDriver;
  throw Error(file, line,
              concat(no_device ? "no CUDA device is available: " : "", expr, " failed: ", cudaGetErrorName(status),
                     ": ", cudaGetErrorString(status)),
              no_device ? ErrorKind::kNoDevice : ErrorKind::kCuda);
}

}  // namespace detail
}  // namespace moegraph
