#include "src/ops/group_layout.hpp"

#include <algorithm>

#include "moegraph/error.hpp"
#include "src/core/device_buffer.hpp"

namespace moegraph {

HostOffsets host_group_offsets(std::span<const int32_t> splits, int row_align, int64_t capacity) {
  HostOffsets out;
  out.offsets.assign(splits.size() + 1, 0);
  int64_t total = 0;
  int first_past = static_cast<int>(splits.size());
  for (std::size_t e = 0; e < splits.size(); ++e) {
    int64_t span = 0;
    if (splits[e] < 0) {
      if (out.error.code == 0) out.error = {kDeviceErrorNegativeSplit, static_cast<int32_t>(e), splits[e], 0};
    } else {
      span = (static_cast<int64_t>(splits[e]) + row_align - 1) / row_align * row_align;
    }
    total += span;
    if (total > capacity) first_past = std::min(first_past, static_cast<int>(e));
    out.offsets[e + 1] = std::min(total, capacity);
  }
  if (total > capacity && out.error.code == 0) out.error = {kDeviceErrorPastCapacity, first_past, total, capacity};
  return out;
}

std::string describe_device_error(const DeviceErrorRecord& e, int row_align, std::string_view group) {
  switch (e.code) {
    case kDeviceErrorNone: return {};
    case kDeviceErrorNegativeSplit: return detail::concat("splits[", e.group, "] = ", e.value, " is negative");
    case kDeviceErrorPastCapacity:
      return detail::concat("splits need ", e.value, " rows (row_align ", row_align, ") but capacity_rows is ",
                            e.limit, "; the total passes capacity at group ", e.group);
    case kDeviceErrorTokenCount:
      return detail::concat("num_tokens = ", e.value, " is outside [0, ", e.limit,
                            "] (the bucket's capacity in tokens); the step ran on the clamped count");
    case kDeviceErrorPeerTokenCount:
      return detail::concat("rank ", e.group, " of the ", group, " group had num_tokens = ", e.value,
                            ", outside [0, ", e.limit, "]; every rank ran on its clamped count");
    case kDeviceErrorPeerTimeout:
      return detail::concat("rank ", e.group, " of the ", group, " group did not reach barrier ", e.value,
                            " within ", e.limit, " ms (it stopped, or runs a different sequence of steps); this "
                            "rank's exchanges have stopped: rebuild the layers and the group");
    case kDeviceErrorPeerStopped:
      return detail::concat("rank ", e.group, " of the ", group, " group had stopped exchanging after an error of "
                            "its own (seen at barrier ", e.value, "); this rank's exchanges have stopped too: rebuild "
                            "the layers and the group");
    case kDeviceErrorExchangeStopped:
      return detail::concat("rank ", e.group, "'s exchanges of this ", group, " group stopped at an earlier timeout "
                            "or a peer's stop (barrier ", e.value, " waited for nobody): results since then are lost; "
                            "rebuild the layers and the group");
    case kDeviceErrorSourceRow:
      return detail::concat("x_rows[", e.group, "] = ", e.value, " names no row of x (x_rows_bound ", e.limit,
                            "); the row was read as zeros");
    default: return detail::concat("unknown device error code ", e.code);
  }
}

DeviceErrorRecord take_device_error_record(DeviceErrorRecord* record) {
  DeviceErrorRecord r{};
  MG_CUDA_CHECK(cudaMemcpy(&r, record, sizeof(r), cudaMemcpyDeviceToHost));
  if (r.code != kDeviceErrorNone) zero_now(record, sizeof(r));
  return r;
}

DeviceErrorRecord take_device_error_record(DeviceBuffer& record) {
  return take_device_error_record(static_cast<DeviceErrorRecord*>(record.get()));
}

}  // namespace moegraph
