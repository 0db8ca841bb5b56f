// The E8M0 scale as the MXFP8 GEMMs promote with it (docs/mxfp8.md): shared by both kernel families.
#pragma once

#include <cstdint>

namespace moegraph::kernels {

// 2^(e - 127); e = 0 is 2^-127 (an fp32 subnormal), 0xFF is NaN.
__device__ __forceinline__ float e8m0_to_float(uint32_t e) {
  return e == 0xffu ? __int_as_float(0x7fc00000) : e == 0u ? __int_as_float(0x00400000) : __int_as_float(e << 23);
}

}  // namespace moegraph::kernels
