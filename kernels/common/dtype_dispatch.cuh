// The one dtype dispatch of the launchers: calls f with a value of the CUDA type of a 16-bit DType.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "moegraph/error.hpp"
#include "moegraph/types.hpp"

namespace moegraph::kernels {

// f(__nv_bfloat16{}) or f(__half{}); any other dtype is refused with `who` in the message.
template <class F>
decltype(auto) with_16bit_type(DType dtype, const char* who, F&& f) {
  switch (dtype) {
    case DType::kBF16: return f(__nv_bfloat16{});
    case DType::kFP16: return f(__half{});
    case DType::kFP32: break;
  }
  MG_FAIL(who, ": the dtype must be bf16 or fp16, got ", dtype_name(dtype));
}

}  // namespace moegraph::kernels
