#include "tests/common/problem.hpp"

#include <gtest/gtest.h>

#include <numeric>

namespace moegraph::test {

std::vector<double> to_doubles(const std::vector<float>& v) { return {v.begin(), v.end()}; }

Problem::Problem(const CaseSpec& sp, uint64_t seed) : spec(sp), rng(seed) {
  std::vector<int32_t> splits = spec.splits;
  if (splits.empty()) splits = random_splits(rng, spec.groups, spec.rows, spec.routing);
  spec.groups = static_cast<int>(splits.size());
  spec.rows = std::accumulate(splits.begin(), splits.end(), int64_t{0});
  // Capacity: the worst aligned layout of `rows` rows, plus the requested padding. With
  // capacity_extra = 0 and row_align = 1 the buffer is exactly full.
  const int64_t worst = spec.row_align == 1 ? spec.rows : spec.rows + int64_t{spec.groups} * (spec.row_align - 1);
  int64_t capacity = (worst + spec.row_align - 1) / spec.row_align * spec.row_align + spec.capacity_extra;
  capacity = std::max<int64_t>(capacity, spec.row_align);
  layout = make_layout(splits, spec.row_align, capacity);

  GroupedLinearOptions o;
  o.num_groups = spec.groups;
  o.in_features = spec.k;
  o.out_features = spec.n;
  o.capacity_rows = capacity;
  o.row_align = spec.row_align;
  o.dtype = spec.dtype;
  o.bias = spec.bias;
  o.wgrad_slots = spec.wgrad_slots;
  o.delay_wgrad = spec.delay_wgrad;
  op = std::make_unique<GroupedLinear>(o);

  const int64_t g = spec.groups, n = spec.n, k = spec.k;
  d_splits = DeviceArray<int32_t>(g);
  d_x = DeviceArray<uint16_t>(capacity * k);
  d_w = DeviceArray<uint16_t>(g * n * k);
  d_y = DeviceArray<uint16_t>(capacity * n);
  d_dy = DeviceArray<uint16_t>(capacity * n);
  d_dx = DeviceArray<uint16_t>(capacity * k);
  d_dw = DeviceArray<uint16_t>(g * n * k);
  w = random_values(rng, g * n * k, 1.0 / std::sqrt(static_cast<double>(k)), spec.dtype);
  d_w.upload(to_device_bits(w, spec.dtype));
  if (spec.bias) {
    d_b = DeviceArray<uint16_t>(g * n);
    d_db = DeviceArray<uint16_t>(g * n);
    b = random_values(rng, g * n, 1.0, spec.dtype);
    d_b.upload(to_device_bits(b, spec.dtype));
  }
  if (spec.scale) {
    d_s = DeviceArray<float>(capacity);
    d_ds = DeviceArray<float>(capacity);
  }
  if (spec.main_grad) {
    d_main_grad = DeviceArray<float>(g * n * k);
    main_grad_init = random_values(rng, g * n * k, 1.0, DType::kFP32);
  }
  reroute(splits);
}

void Problem::reroute(const std::vector<int32_t>& splits) {
  layout = make_layout(splits, spec.row_align, layout.capacity_rows);
  const int64_t cap = layout.capacity_rows;
  d_splits.upload(splits);
  // Gap and padding rows hold garbage on purpose: kernels must not read them as data.
  x = random_values(rng, cap * spec.k, 1.0, spec.dtype);
  dy = random_values(rng, cap * spec.n, 1.0, spec.dtype);
  const auto is_data = data_rows(layout);
  d_x.upload(to_device_bits(x, spec.dtype));
  d_dy.upload(to_device_bits(dy, spec.dtype));
  for (int64_t r = 0; r < cap; ++r) {
    if (is_data[r]) continue;
    std::fill(x.begin() + r * spec.k, x.begin() + (r + 1) * spec.k, 0.0);
    std::fill(dy.begin() + r * spec.n, dy.begin() + (r + 1) * spec.n, 0.0);
  }
  if (spec.scale) {
    s = random_values(rng, cap, 1.0, DType::kFP32);
    d_s.upload(std::vector<float>(s.begin(), s.end()));
  }
  if (spec.main_grad) d_main_grad.upload(std::vector<float>(main_grad_init.begin(), main_grad_init.end()));
}

void Problem::reroute_random() { reroute(random_splits(rng, spec.groups, spec.rows, spec.routing)); }

void Problem::poison_outputs() {
  d_y.poison();
  d_dx.poison();
  d_dw.poison();
  if (spec.bias) d_db.poison();
  if (spec.scale) d_ds.poison();
}

ForwardArgs Problem::forward_args() const {
  ForwardArgs a;
  a.x = d_x.get();
  a.splits = d_splits.get();
  a.weight = d_w.get();
  a.bias = spec.bias ? d_b.get() : nullptr;
  a.bias_scale = spec.scale ? d_s.get() : nullptr;
  a.y = d_y.get();
  return a;
}

BackwardArgs Problem::backward_args() const {
  BackwardArgs a;
  a.dy = d_dy.get();
  a.weight = d_w.get();
  a.bias = spec.bias ? d_b.get() : nullptr;
  a.dx = d_dx.get();
  a.dbias = spec.bias ? d_db.get() : nullptr;
  a.dbias_scale = spec.scale ? d_ds.get() : nullptr;
  if (spec.main_grad) a.main_grad = d_main_grad.get();
  else a.dweight = d_dw.get();
  return a;
}

std::vector<double> Problem::download(const DeviceArray<uint16_t>& a) const {
  const auto bits = a.download();
  std::vector<double> out(bits.size());
  for (std::size_t i = 0; i < bits.size(); ++i) out[i] = from_bits(bits[i], spec.dtype);
  return out;
}

void Problem::expect_forward(const std::string& where) const {
  const auto ref = ref_fprop(layout, x, w, b, spec.scale ? s : std::vector<double>{}, spec.n, spec.k);
  EXPECT_TRUE(all_close(where + " y", download(d_y), ref, spec.n, written_rows(layout), tolerance_for(spec.dtype)));
}

void Problem::expect_dgrad(const std::string& where) const {
  const auto ref = ref_dgrad(layout, dy, w, spec.n, spec.k);
  EXPECT_TRUE(all_close(where + " dx", download(d_dx), ref, spec.k, written_rows(layout), tolerance_for(spec.dtype)));
}

void Problem::expect_bias_grads(const std::string& where) const {
  if (!spec.bias) return;
  const std::vector<double> scale = spec.scale ? s : std::vector<double>{};
  EXPECT_TRUE(all_close(where + " dbias", download(d_db), ref_bias_grad(layout, dy, scale, spec.n), spec.n, {},
                        tolerance_for(spec.dtype)));
  if (spec.scale) {
    EXPECT_TRUE(all_close(where + " dbias_scale", to_doubles(d_ds.download()), ref_scale_grad(layout, dy, b, spec.n),
                          1, written_rows(layout), tolerance_for(DType::kFP32)));
  }
}

void Problem::expect_wgrad(const std::string& where) const {
  auto ref = ref_wgrad(layout, dy, x, spec.n, spec.k);
  if (spec.main_grad) {
    for (std::size_t i = 0; i < ref.size(); ++i) ref[i] += main_grad_init[i];
    EXPECT_TRUE(all_close(where + " main_grad", to_doubles(d_main_grad.download()), ref, spec.k, {},
                          tolerance_for(DType::kFP32)));
  } else {
    EXPECT_TRUE(all_close(where + " dweight", download(d_dw), ref, spec.k, {}, tolerance_for(spec.dtype)));
  }
}

}  // namespace moegraph::test
