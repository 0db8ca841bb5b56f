// Group offsets from device splits (host-callable launcher; no device code in this header).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "moegraph/types.hpp"


namespace moegraph::kernels {

// offsets[0] = 0, offsets[e+1] = offsets[e] + round_up(splits[e], row_align), computed with a
// CUB block scan in one block. Invalid splits (negative, or a total past capacity_rows) raise the
// first error into *error (if none is recorded yet); the offsets written are then clamped into
// [0, capacity_rows] so that no kernel reading them can leave the buffers.
void launch_group_offsets(const int32_t* splits, int num_groups, int row_align,
                          int64_t capacity_rows, int64_t* offsets, DeviceErrorRecord* error,
                          cudaStream_t stream);

}  // namespace moegraph::kernels
