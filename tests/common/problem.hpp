// One grouped-linear problem for GPU tests: host data (fp64, rounded to the device type), the
// matching device buffers, the operator, and checks of each output against the fp64 reference.
#pragma once

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "moegraph/grouped_linear.hpp"
#include "tests/common/data.hpp"
#include "tests/common/device.hpp"

namespace moegraph::test {

struct CaseSpec {
  std::string name;
  int groups = 8;
  int64_t k = 256, n = 256;
  DType dtype = DType::kBF16;
  int row_align = 1;
  std::vector<int32_t> splits;  // explicit; empty: random splits of `rows`
  int64_t rows = 0;
  Routing routing = Routing::kUniform;
  int64_t capacity_extra = 0;   // padding rows past the last group (0: capacity exactly full)
  bool bias = false, scale = false, main_grad = false, delay_wgrad = false;
  int wgrad_slots = 1;
};

class Problem {
 public:
  Problem(const CaseSpec& spec, uint64_t seed);

  // New routing (same total rows, so it fits the capacity) and new inputs, uploaded.
  void reroute(const std::vector<int32_t>& splits);
  void reroute_random();
  void poison_outputs();

  ForwardArgs forward_args() const;
  BackwardArgs backward_args() const;

  // Each compares a device output with the fp64 reference (gtest assertions inside).
  void expect_forward(const std::string& where) const;
  void expect_dgrad(const std::string& where) const;
  void expect_bias_grads(const std::string& where) const;
  void expect_wgrad(const std::string& where) const;

  std::vector<double> download(const DeviceArray<uint16_t>& a) const;

  CaseSpec spec;
  GroupLayout layout;
  std::mt19937_64 rng;
  std::vector<double> x, w, b, s, dy, main_grad_init;
  DeviceArray<int32_t> d_splits;
  DeviceArray<uint16_t> d_x, d_w, d_b, d_y, d_dy, d_dx, d_db, d_dw;
  DeviceArray<float> d_s, d_ds, d_main_grad;
  std::unique_ptr<GroupedLinear> op;
};

std::vector<double> to_doubles(const std::vector<float>& v);

}  // namespace moegraph::test
