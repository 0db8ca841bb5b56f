// Tensor maps of the TMA kernels (host only): the driver's encoder, looked up once at set-up, and
// 128-byte-swizzled tiled maps. Encoding is arithmetic on pointers and sizes (no device access, no
// synchronization), so launchers that encode stay capturable.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "moegraph/types.hpp"

namespace moegraph::kernels {

// cuTensorMapEncodeTiled (kept in GemmPlan::encode_tensor_map). Set-up only.
void* tensor_map_encoder();

// A tiled map of `rank` dims (dims[0] contiguous) with the 128-byte swizzle and zero fill past the
// edges: `byte_strides` for dims 1.., `box` in elements. base must be 16-byte aligned.
CUtensorMap encode_sw128_map(void* encoder, CUtensorMapDataType type, int rank, const void* base, const uint64_t* dims,
                             const uint64_t* byte_strides, const uint32_t* box);

// The two shapes every grouped GEMM reads, for elements of `elem_bytes` bytes:
// row-major rows [rows, cols] (activations), box of box_cols x box_rows;
CUtensorMap encode_rows_map(void* encoder, CUtensorMapDataType type, int elem_bytes, const void* base, int64_t rows,
                            int64_t cols, uint32_t box_cols, uint32_t box_rows);
// grouped [groups, n, k] with k contiguous (weights and their gradients), box of box_k x box_n x 1.
CUtensorMap encode_grouped_map(void* encoder, CUtensorMapDataType type, int elem_bytes, const void* base, int64_t groups,
                               int64_t n, int64_t k, uint32_t box_k, uint32_t box_n);
// The map type of a 16-bit dtype (bf16 or fp16).
CUtensorMapDataType tensor_map_type_16bit(DType dtype);

}  // namespace moegraph::kernels
