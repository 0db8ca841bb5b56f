// The device error record (moegraph/types.hpp, DeviceErrorRecord): how a kernel reports an invalid
// device input, which it never clips silently, to the host that reads it after the step.
#pragma once

#include <cstdint>

#include "moegraph/types.hpp"

namespace moegraph::kernels {

// Records the first error only: a later one never overwrites what the host will report.
__device__ __forceinline__ void raise_device_error(DeviceErrorRecord* error, int code, int group, int64_t value,
                                                   int64_t limit) {
  if (atomicCAS(&error->code, 0, -1) == 0) {  // -1: being written; the host reads after a sync
    error->group = group;
    error->value = value;
    error->limit = limit;
    __threadfence();
    atomicExch(&error->code, code);
  }
}

}  // namespace moegraph::kernels
