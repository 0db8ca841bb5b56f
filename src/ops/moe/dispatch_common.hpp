// What the single-GPU and the expert-parallel dispatch share: the counting sort's parameters read
// from the tensor table, and the device records it raises into (error, dropped assignments).
#pragma once

#include <cstdint>
#include <string>

#include "kernels/routing/moe_routing.hpp"
#include "moegraph/moe_layer.hpp"
#include "src/core/device_buffer.hpp"
#include "src/ops/moe/tensor_table.hpp"

namespace moegraph::layer {

class DispatchRecords {
 public:
  void bind();  // set-up: allocates zeroed records
  DeviceErrorRecord* error() const { return error_.as<DeviceErrorRecord>(); }
  unsigned long long* dropped() const { return dropped_.as<unsigned long long>(); }
  // Synchronized by the caller already: read and clear.
  DeviceErrorRecord take_error();
  uint64_t take_dropped();

 private:
  DeviceBuffer error_, dropped_;
};

// The sort of slot `slot`'s top-k choices into `splits` / `offsets` (tensor names) with `row_align`,
// `capacity_rows` and `capacity_factor`; every other tensor is the layer's shared one.
kernels::DispatchParams dispatch_params(const TensorTable& t, int slot, const MoeLayerOptions& o,
                                        const std::string& splits, const std::string& offsets, int row_align,
                                        int64_t capacity_rows, double capacity_factor, const DispatchRecords& records);

}  // namespace moegraph::layer
