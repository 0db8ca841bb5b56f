// The data side of a moe_layer case run (tools/check/moe_layer_runner.cpp): the layer (and the one
// whose backward queues the weight gradients), its parameters and gradients on the device and on the
// host, one run's inputs, and the fp64 layer reference of that run.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "moegraph/moe_layer.hpp"
#include "testing/device_array.hpp"
#include "testing/moe_layer_reference.hpp"
#include "tools/check/moe_layer_case.hpp"

namespace moegraph::check {

// One parameter's gradient: written in the dtype, or accumulated into fp32 main_grad.
struct GradBuffer {
  testing::DeviceArray<uint16_t> written;
  testing::DeviceArray<float> main_grad;
  std::vector<float> main_grad_init;
};

// The layer, its parameters and gradients, one run's data and its reference.
class MoeProblem {
 public:
  explicit MoeProblem(const MoeLayerCase& c);

  // Fresh x and dy for `n` tokens, uploaded with NaN in the rows past n, and their reference.
  void draw(int64_t n);

  // Before every run: outputs NaN, main_grad back to its initial value (the step accumulates into it).
  void prepare_run();

  MoeLayerIO io() const;

  MoeLayer& layer(CaseStep step) { return step == CaseStep::kTrainingDelayedWgrad ? *delayed_ : *immediate_; }

  // Downloads what the step wrote (rows < n of y and dx) next to the references. Rows past n
  // are checked by rows_past_n_error.
  std::vector<MoeLayerOutput> outputs(const StepPlan& plan) const;

  // The contract for rows at or past n: y keeps what it held (the poison), dx is written as zero.
  std::string rows_past_n_error(bool training_step) const;

  // The bits of every parameter gradient, by name, for the delayed-vs-immediate comparison.
  std::vector<std::pair<std::string, std::vector<unsigned char>>> gradient_bits() const;

  int64_t tokens() const { return n_; }
  const testing::Mat& x() const { return x_host_; }
  const testing::Mat& dy() const { return dy_host_; }
  const MoeLayerParams& params() const { return params_; }
  uint64_t ref_dropped() const { return static_cast<uint64_t>(ref_.dispatch.dropped); }

 private:
  testing::DeviceArray<uint16_t> upload(testing::Mat& host, int64_t count, double scale);

  GradBuffer grad_buffer(int64_t count);

  // The step's gradient: written in the dtype, or what it added to main_grad (exact in fp64).
  testing::Mat gradient(const GradBuffer& g) const;

  // Rows [0, n) from `host`, NaN in the rest: the layer must never read them.
  void upload_rows(testing::DeviceArray<uint16_t>& d, const testing::Mat& host) const;

  // Redraws the tokens whose top-k is decided by a near tie of router logits (scores are monotone
  // in the logits for softmax and sigmoid alike).
  void avoid_router_ties();

  const MoeLayerCase& c_;
  MoeLayerOptions options_;
  std::mt19937_64 rng_;
  testing::Tolerance tol_;
  MoeLayerParams params_;
  testing::DeviceArray<uint16_t> router_, w1_, b1_, w2_, b2_;
  testing::DeviceArray<uint16_t> x_, y_, dy_, dx_, db1_, db2_;
  testing::DeviceArray<int32_t> num_tokens_;
  testing::DeviceArray<float> aux_loss_;
  GradBuffer grad_router_, grad1_, grad2_;
  // After the buffers, so the layers go first.
  std::unique_ptr<MoeLayer> immediate_, delayed_;

  int64_t n_ = 0;
  testing::Mat x_host_, dy_host_;
  testing::MoeLayerRef ref_;
};

}  // namespace moegraph::check
