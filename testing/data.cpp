#include "testing/data.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <sstream>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "moegraph/error.hpp"

#include "src/ops/group_layout.hpp"

namespace moegraph::testing {

uint16_t to_bits(double v, DType t) {
  if (t == DType::kFP16) return static_cast<__half_raw>(__double2half(v)).x;
  return static_cast<__nv_bfloat16_raw>(__double2bfloat16(v)).x;
}

double from_bits(uint16_t bits, DType t) {
  if (t == DType::kFP16) {
    __half_raw raw;
    raw.x = bits;
    return static_cast<double>(__half2float(__half(raw)));
  }
  __nv_bfloat16_raw raw;
  raw.x = bits;
  return static_cast<double>(__bfloat162float(__nv_bfloat16(raw)));
}

uint64_t test_seed(const std::string& test_name) {
  uint64_t seed = 20261121;
  if (const char* env = std::getenv("MOEGRAPH_TEST_SEED")) seed = std::strtoull(env, nullptr, 10);
  seed ^= std::hash<std::string>{}(test_name);
  std::printf("[ seed     ] %s: %llu (MOEGRAPH_TEST_SEED reseeds)\n", test_name.c_str(),
              static_cast<unsigned long long>(seed));
  return seed;
}

std::vector<double> grid_values(std::mt19937_64& rng, std::size_t count, int range, double step) {
  std::uniform_int_distribution<int> d(-range, range);
  std::vector<double> v(count);
  for (double& x : v) x = d(rng) * step;
  if (count > 0) v[0] = step;  // never all zero
  return v;
}

std::vector<double> random_values(std::mt19937_64& rng, std::size_t count, double scale, DType t) {
  std::uniform_real_distribution<double> dist(-scale, scale);
  std::vector<double> v(count);
  for (auto& x : v) {
    x = dist(rng);
    x = t == DType::kFP32 ? static_cast<double>(static_cast<float>(x)) : round_to(x, t);
  }
  if (count > 0 && t != DType::kFP32) v[0] = round_to(scale * 0.75, t);  // never all zero
  return v;
}

std::vector<float> data_row_weights(std::mt19937_64& rng, const GroupLayout& l) {
  const std::vector<bool> data = data_rows(l);
  std::vector<float> weights(l.capacity_rows, std::numeric_limits<float>::quiet_NaN());
  std::uniform_real_distribution<float> weight(0.05f, 1.0f);
  for (int64_t r = 0; r < l.capacity_rows; ++r)
    if (data[r]) weights[r] = weight(rng);
  return weights;
}

std::vector<uint16_t> to_device_bits(const std::vector<double>& v, DType t) {
  std::vector<uint16_t> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = to_bits(v[i], t);
  return out;
}

std::vector<int32_t> random_splits(std::mt19937_64& rng, int groups, int64_t rows, double zipf_exponent) {
  std::vector<double> weight(groups);
  for (int e = 0; e < groups; ++e) weight[e] = zipf_exponent == 0.0 ? 1.0 : 1.0 / std::pow(e + 1.0, zipf_exponent);
  std::shuffle(weight.begin(), weight.end(), rng);
  std::discrete_distribution<int> pick(weight.begin(), weight.end());
  std::vector<int32_t> splits(groups, 0);
  for (int64_t r = 0; r < rows; ++r) ++splits[pick(rng)];
  return splits;
}

GroupLayout make_layout(const std::vector<int32_t>& splits, int row_align, int64_t capacity_rows) {
  HostOffsets h = host_group_offsets(splits, row_align, capacity_rows);
  if (h.error.code != 0) throw std::runtime_error("test splits do not fit: " + describe_device_error(h.error, row_align));
  return GroupLayout{splits, std::move(h.offsets), capacity_rows};
}

Tolerance tolerance_for(DType output) {
  switch (output) {
    case DType::kBF16: return {1.0 / 128, 2e-3, 6e-3};   // output rounding: 2^-9 relative
    case DType::kFP16: return {1.0 / 1024, 1e-3, 1e-3};  // 2^-11 relative
    case DType::kFP32: return {1e-5, 1e-5, 1e-5};        // fp32 accumulation only
  }
  return {0, 0, 0};
}

Tolerance chain_tolerance_for(DType storage) {
  const Tolerance single = tolerance_for(storage);
  return {2 * single.rtol, 10 * single.atol, single.rel_fro};
}

Tolerance mxfp8_gemm_tolerance() {
  const Tolerance bf16 = tolerance_for(DType::kBF16);
  return {bf16.rtol, 2 * bf16.atol, bf16.rel_fro};
}

Tolerance mxfp8_chain_tolerance() { return {1.0 / 8, 1.0, 1.5e-2}; }

Tolerance layer_tolerance_for(DType storage, Recipe recipe) {
  return recipe == Recipe::kMXFP8 ? mxfp8_chain_tolerance() : chain_tolerance_for(storage);
}

double relative_error(const std::vector<double>& got, const std::vector<double>& ref, int64_t cols,
                      const std::vector<bool>& mask) {
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (!mask.empty() && !mask[i / cols]) continue;
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

CompareResult all_close(const std::string& what, const std::vector<double>& got, const std::vector<double>& ref,
                        int64_t cols, const std::vector<bool>& mask, Tolerance tol) {
  CompareResult result;
  if (got.size() != ref.size()) {
    result.ok = false;
    result.rel_fro = std::numeric_limits<double>::infinity();
    result.message = detail::concat(what, ": size ", got.size(), " vs reference ", ref.size());
    return result;
  }
  double sq = 0.0;
  std::size_t counted = 0;
  for (std::size_t i = 0; i < ref.size(); ++i)
    if (mask.empty() || mask[i / cols]) sq += ref[i] * ref[i], ++counted;
  const double rms = counted ? std::sqrt(sq / counted) : 0.0;
  std::size_t bad = 0, first_bad = 0;
  double worst = 0.0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (!mask.empty() && !mask[i / cols]) continue;
    const double err = std::fabs(got[i] - ref[i]);
    const double allowed = tol.rtol * std::fabs(ref[i]) + tol.atol * rms;
    if (!(err <= allowed)) {  // NaN fails here
      if (bad++ == 0) first_bad = i;
      worst = std::isnan(err) ? err : std::max(worst, err);
    }
  }
  result.rel_fro = relative_error(got, ref, cols, mask);
  result.out_of_tolerance = bad;
  result.compared = counted;
  result.ok = bad == 0 && result.rel_fro <= tol.rel_fro;
  if (result.ok) return result;
  std::ostringstream os;
  os << what << ": " << bad << " of " << counted << " elements out of tolerance";
  if (bad) {
    os << " (first at row " << first_bad / cols << " col " << first_bad % cols << ": got " << got[first_bad]
       << ", reference " << ref[first_bad] << "; worst error " << worst << ")";
  }
  os << ", relative Frobenius error " << result.rel_fro << " (limit " << tol.rel_fro << "), rms(ref) " << rms;
  result.message = os.str();
  return result;
}

}  // namespace moegraph::testing
