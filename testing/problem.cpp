#include "testing/problem.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

#include "testing/mxfp8_operands.hpp"

namespace moegraph::testing {

std::vector<double> to_doubles(const std::vector<float>& v) { return {v.begin(), v.end()}; }

int64_t capacity_rows_for(int64_t rows, int groups, int row_align, int64_t extra) {
  const int64_t worst = row_align == 1 ? rows : rows + int64_t{groups} * (row_align - 1);
  const int64_t capacity = (worst + row_align - 1) / row_align * row_align + extra;
  return std::max<int64_t>(capacity, row_align);
}

CompareResult compare(const Output& output, const std::string& where) {
  const int64_t cols = output.shape.size() > 1 ? output.shape.back() : 1;
  return all_close(where + " " + output.name, output.got, *output.ref, cols, output.rows, output.tol);
}

Problem::Problem(const CaseSpec& sp, uint64_t seed) : spec(sp), rng(seed) {
  std::vector<int32_t> splits = spec.splits;
  if (splits.empty()) splits = random_splits(rng, spec.groups, spec.rows, spec.routing);
  spec.groups = static_cast<int>(splits.size());
  spec.rows = std::accumulate(splits.begin(), splits.end(), int64_t{0});
  const int64_t capacity = capacity_rows_for(spec.rows, spec.groups, spec.row_align, spec.capacity_extra);
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
  o.caller_keeps_activations = spec.caller_keeps_activations;
  o.forward_only = spec.forward_only;
  o.reference_kernels = spec.reference_kernels;
  o.tile_n = spec.tile_n;
  o.pipeline = spec.pipeline;
  o.wgrad_ping_pong = spec.wgrad_ping_pong;
  o.recipe = spec.recipe;
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
  upload_weights();
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
  references_.clear();
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
  restore_main_grad();
}

void Problem::upload_weights() {
  references_.clear();
  d_w.upload(to_device_bits(w, spec.dtype));
  if (spec.recipe == Recipe::kMXFP8) op->weights_changed(d_w.get(), nullptr);
}

void Problem::restore_main_grad() {
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

const Mat& Problem::reference(const std::string& name, const std::function<Mat()>& compute) const {
  auto it = references_.find(name);
  if (it == references_.end()) it = references_.emplace(name, compute()).first;
  return it->second;
}

const Mat& Problem::operand(Operand which) const {
  const bool mx = spec.recipe == Recipe::kMXFP8;
  const int64_t rows = layout.capacity_rows, n = spec.n, k = spec.k;
  switch (which) {
    case Operand::kFpropX: return mx ? reference("mxfp8 x row-wise", [&] { return mx_rowwise_values(x, rows, k); }) : x;
    case Operand::kFpropW:
      return mx ? reference("mxfp8 w row-wise", [&] { return mx_weight_values(w, spec.groups, n, k, false); }) : w;
    case Operand::kDgradDy:
      return mx ? reference("mxfp8 dy row-wise", [&] { return mx_rowwise_values(dy, rows, n); }) : dy;
    case Operand::kDgradW:
      return mx ? reference("mxfp8 w transposed", [&] { return mx_weight_values(w, spec.groups, n, k, true); }) : w;
    case Operand::kWgradDy:
      return mx ? reference("mxfp8 dy column-wise", [&] { return mx_colwise_values(layout, dy, n); }) : dy;
    case Operand::kWgradX:
      return mx ? reference("mxfp8 x column-wise", [&] { return mx_colwise_values(layout, x, k); }) : x;
  }
  throw std::logic_error("unknown operand");
}

Tolerance case_tolerance(const CaseSpec& spec, bool gemm_output, DType output) {
  // The case's override is for the GEMM outputs in its dtype: a bias gradient keeps the table's
  // row (an override loosened for MXFP8 GEMMs would have loosened it too).
  if (!gemm_output) return tolerance_for(output);
  if (spec.tolerance && output == spec.dtype) return *spec.tolerance;
  return spec.recipe == Recipe::kMXFP8 ? mxfp8_gemm_tolerance() : tolerance_for(output);
}

Tolerance Problem::tolerance(DType output) const { return case_tolerance(spec, false, output); }

Tolerance Problem::gemm_tolerance(DType output) const { return case_tolerance(spec, true, output); }

std::vector<Output> Problem::outputs(OutputSet set) const {
  const int64_t rows = layout.capacity_rows, g = spec.groups, n = spec.n, k = spec.k;
  const Mat no_scale;
  const Mat& scale = spec.scale ? s : no_scale;
  const std::vector<bool> written = written_rows(layout);
  switch (set) {
    case OutputSet::kForward:
      return {{"y", {rows, n}, download(d_y),
               &reference("y",
                          [&] {
                            return ref_fprop(layout, operand(Operand::kFpropX), operand(Operand::kFpropW), b, scale,
                                             n, k);
                          }),
               written, gemm_tolerance(spec.dtype)}};
    case OutputSet::kDgrad:
      return {{"dx", {rows, k}, download(d_dx),
               &reference("dx",
                          [&] {
                            return ref_dgrad(layout, operand(Operand::kDgradDy), operand(Operand::kDgradW), n, k);
                          }),
               written, gemm_tolerance(spec.dtype)}};
    case OutputSet::kBiasGrads: {
      std::vector<Output> out;
      if (!spec.bias) return out;
      out.push_back({"dbias", {g, n}, download(d_db),
                     &reference("dbias", [&] { return ref_bias_grad(layout, dy, scale, n); }), {},
                     tolerance(spec.dtype)});
      if (spec.scale)
        out.push_back({"dbias_scale", {rows}, to_doubles(d_ds.download()),
                       &reference("dbias_scale", [&] { return ref_scale_grad(layout, dy, b, n); }), written,
                       tolerance(DType::kFP32)});
      return out;
    }
    case OutputSet::kWgrad: {
      auto wgrad = [&] { return ref_wgrad(layout, operand(Operand::kWgradDy), operand(Operand::kWgradX), n, k); };
      if (spec.main_grad) {
        auto accumulated = [&] {
          Mat ref = wgrad();
          for (std::size_t i = 0; i < ref.size(); ++i) ref[i] += main_grad_init[i];
          return ref;
        };
        return {{"main_grad", {g, n, k}, to_doubles(d_main_grad.download()), &reference("main_grad", accumulated),
                 {}, gemm_tolerance(DType::kFP32)}};
      }
      return {{"dweight", {g, n, k}, download(d_dw), &reference("dweight", wgrad), {}, gemm_tolerance(spec.dtype)}};
    }
  }
  return {};
}

std::vector<CompareResult> Problem::check(OutputSet set, const std::string& where) const {
  std::vector<CompareResult> results;
  for (const Output& output : outputs(set)) results.push_back(compare(output, where));
  return results;
}

}  // namespace moegraph::testing
