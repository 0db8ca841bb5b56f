// Tensor maps of the TMA kernels (host only): the driver's encoder, looked up once at set-up, and
// 128-byte-swizzled tiled maps. Encoding is arithmetic on pointers and sizes (no device access, no
// synchronization), so launchers that encode stay capturable.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace moegraph::kernels {

// cuTensorMapEncodeTiled (kept in GemmPlan::encode_tensor_map). Set-up only.
void* tensor_map_encoder();

// A tiled map of `rank` dims (dims[0] contiguous) with the 128-byte swizzle and zero fill past the
// edges: `byte_strides` for dims 1.., `box` in elements. base must be 16-byte aligned.
CUtensorMap encode_sw128_map(void* encoder, CUtensorMapDataType type, int rank, const void* base, const uint64_t* dims,
                             const uint64_t* byte_strides, const uint32_t* box);

}  // namespace moegraph::kernels
