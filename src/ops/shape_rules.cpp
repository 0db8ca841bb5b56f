#include "src/ops/shape_rules.hpp"

#include <algorithm>

#include "moegraph/error.hpp"

namespace moegraph {

void validate(const GroupedLinearOptions& o) {
  MG_CHECK(o.num_groups >= 1 && o.num_groups <= 1024, "num_groups must be in [1, 1024], got ", o.num_groups);
  MG_CHECK(o.in_features >= 16 && o.in_features % 16 == 0,
           "in_features (K) must be a positive multiple of 16, got ", o.in_features);
  MG_CHECK(o.out_features >= 16 && o.out_features % 16 == 0,
           "out_features (N) must be a positive multiple of 16, got ", o.out_features);
  MG_CHECK(o.capacity_rows >= 1, "capacity_rows must be at least 1, got ", o.capacity_rows);
  MG_CHECK(o.capacity_rows <= (int64_t{1} << 31) - 1, "capacity_rows must be below 2^31, got ", o.capacity_rows);
  MG_CHECK(o.row_align == 1 || o.row_align == 16 || o.row_align == 32 || o.row_align == 128,
           "row_align must be 1, 16, 32 or 128, got ", o.row_align);
  MG_CHECK(o.capacity_rows % o.row_align == 0, "capacity_rows must be a multiple of row_align (", o.row_align,
           "), got ", o.capacity_rows);
  MG_CHECK(o.dtype == DType::kBF16 || o.dtype == DType::kFP16, "dtype must be bf16 or fp16, got ",
           dtype_name(o.dtype));
  MG_CHECK(o.wgrad_slots >= 1 && o.wgrad_slots <= 64, "wgrad_slots must be in [1, 64], got ", o.wgrad_slots);
  MG_CHECK(o.tile_n == 0 || o.tile_n == 128 || o.tile_n == 256, "tile_n must be 0 (automatic), 128 or 256, got ",
           o.tile_n);
  if (o.recipe != Recipe::kMXFP8) return;
  // The MXFP8 GEMMs stage 128 K elements at a time (fprop reduces K, dgrad N), and the
  // column-wise copies for wgrad need every group to start on a multiple of 32 rows.
  MG_CHECK(o.in_features % 128 == 0, "the mxfp8 recipe needs in_features (K) a multiple of 128, got ",
           o.in_features);
  MG_CHECK(o.out_features % 128 == 0, "the mxfp8 recipe needs out_features (N) a multiple of 128, got ",
           o.out_features);
  MG_CHECK(o.row_align == 32 || o.row_align == 128, "the mxfp8 recipe needs row_align 32 or 128, got ", o.row_align);
  MG_CHECK(!o.reference_kernels, "the mxfp8 recipe has no reference (WMMA) kernels");
}

HostOffsets host_group_offsets(std::span<const int32_t> splits, int row_align, int64_t capacity) {
  HostOffsets out;
  out.offsets.assign(splits.size() + 1, 0);
  int64_t total = 0;
  int first_past = static_cast<int>(splits.size());
  for (std::size_t e = 0; e < splits.size(); ++e) {
    int64_t span = 0;
    if (splits[e] < 0) {
      if (out.error.code == 0) out.error = {1, static_cast<int32_t>(e), splits[e], 0};
    } else {
      span = (static_cast<int64_t>(splits[e]) + row_align - 1) / row_align * row_align;
    }
    total += span;
    if (total > capacity) first_past = std::min(first_past, static_cast<int>(e));
    out.offsets[e + 1] = std::min(total, capacity);
  }
  if (total > capacity && out.error.code == 0) out.error = {2, first_past, total, capacity};
  return out;
}

std::string describe_device_error(const DeviceErrorRecord& e, int row_align) {
  switch (e.code) {
    case 0: return {};
    case 1: return detail::concat("splits[", e.group, "] = ", e.value, " is negative");
    case 2:
      return detail::concat("splits need ", e.value, " rows (row_align ", row_align, ") but capacity_rows is ",
                            e.limit, "; the total passes capacity at group ", e.group);
    case 3:  // kernels::kErrorTokenCount
      return detail::concat("num_tokens = ", e.value, " is outside [0, ", e.limit,
                            "] (the bucket's capacity in tokens); the step ran on the clamped count");
    default: return detail::concat("unknown device error code ", e.code);
  }
}

}  // namespace moegraph
