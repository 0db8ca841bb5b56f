#include "moegraph/error.hpp"

#include "moegraph/types.hpp"

namespace moegraph {

Error::Error(const char* file, int line, const std::string& message, ErrorKind kind)
    : std::runtime_error(detail::concat(file, ":", line, ": ", message)), file_(file), line_(line),
      message_(message), kind_(kind) {}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kBF16: return "bf16";
    case DType::kFP16: return "fp16";
    case DType::kFP32: return "fp32";
  }
  return "?";
}

std::string_view recipe_name(Recipe r) { return r == Recipe::kMXFP8 ? "mxfp8" : "bf16"; }

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
