// The device error record of a LayerOp (see LayerOp::take_device_error), read on the host.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "moegraph/error.hpp"
#include "moegraph/grouped_linear.hpp"
#include "src/common/device_buffer.hpp"
#include "src/ops/shape_rules.hpp"

namespace moegraph::layer {

// Synchronized by the caller already: reads the DeviceErrorRecord in `record` and, if one was
// raised, clears it and returns it described as "<who>: ..."; "" when none.
inline std::string take_error_record(DeviceBuffer& record, int row_align, const std::string& who) {
  DeviceErrorRecord r{};
  MG_CUDA_CHECK(cudaMemcpy(&r, record.get(), sizeof(r), cudaMemcpyDeviceToHost));
  if (r.code == 0) return {};
  MG_CUDA_CHECK(cudaMemset(record.get(), 0, sizeof(r)));
  return who + ": " + describe_device_error(r, row_align);
}

}  // namespace moegraph::layer
