#include "tools/check/moe_layer_problem.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>

#include "moegraph/error.hpp"

namespace moegraph::check {
namespace {

using testing::DeviceArray;
using testing::Mat;

// All-ones 16 bits: NaN in bf16 and fp16 (what DeviceArray::poison writes).
constexpr uint16_t kNaNBits = 0xffff;
// The aux loss is an fp32 sum over up to max_tokens scores, not a chained 16-bit output.
constexpr testing::Tolerance kAuxLossTolerance{1e-4, 0.0, 1e-4};
// A token whose k-th and (k+1)-th largest router logits are closer than this is redrawn: the
// device's fp32 logits then pick the same experts as the fp64 reference (its fp32 rounding error
// is below 1e-4 at the case sizes), so the device's top-k ids need not be read back.
constexpr double kMinLogitGap = 1e-3;
constexpr int kMaxRedraws = 1000;

Mat values_of(const std::vector<uint16_t>& bits, std::size_t count, DType t) {
  Mat out(count);
  for (std::size_t i = 0; i < count; ++i) out[i] = testing::from_bits(bits[i], t);
  return out;
}

template <class T>
std::vector<unsigned char> bytes_of(const std::vector<T>& values) {
  std::vector<unsigned char> out(values.size() * sizeof(T));
  std::memcpy(out.data(), values.data(), out.size());
  return out;
}

}  // namespace

MoeProblem::MoeProblem(const MoeLayerCase& c)
    : c_(c),
      options_(moe_layer_options(c, false)),
      rng_(c.data_seed),
      tol_(c.tolerance.value_or(testing::layer_tolerance_for(c.dtype, c.recipe))) {
  const int64_t e = c.experts, h = c.hidden, f = c.ffn;
  const double sh = 1.0 / std::sqrt(static_cast<double>(h)), sf = 1.0 / std::sqrt(static_cast<double>(f));
  // Logits x · W_r^T with x ~ U(-1, 1): standard deviation s * sqrt(hidden) / 3, so s = 3 / sqrt(hidden)
  // spreads them by about 1. The experts follow nn.Linear's U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
  router_ = upload(params_.router, e * h, 3.0 * sh);
  w1_ = upload(params_.w1, e * 2 * f * h, sh);
  w2_ = upload(params_.w2, e * h * f, sf);
  if (c.bias) {
    b1_ = upload(params_.b1, e * 2 * f, sh);
    b2_ = upload(params_.b2, e * h, sf);
  }
  x_ = DeviceArray<uint16_t>(c.max_tokens * h);
  y_ = DeviceArray<uint16_t>(c.max_tokens * h);
  num_tokens_ = DeviceArray<int32_t>(1);
  if (c.aux_loss_coef > 0.0) aux_loss_ = DeviceArray<float>(1);

  MoeLayerWeights weights;
  weights.router = router_.get();
  weights.w1 = w1_.get();
  weights.w2 = w2_.get();
  if (c.bias) {
    weights.b1 = b1_.get();
    weights.b2 = b2_.get();
  }
  if (c.training()) {
    dy_ = DeviceArray<uint16_t>(c.max_tokens * h);
    dx_ = DeviceArray<uint16_t>(c.max_tokens * h);
    grad_router_ = grad_buffer(e * h);
    grad1_ = grad_buffer(e * 2 * f * h);
    grad2_ = grad_buffer(e * h * f);
    if (c.main_grad) {
      weights.main_grad_router = grad_router_.main_grad.get();
      weights.main_grad1 = grad1_.main_grad.get();
      weights.main_grad2 = grad2_.main_grad.get();
    } else {
      weights.d_router = grad_router_.written.get();
      weights.dw1 = grad1_.written.get();
      weights.dw2 = grad2_.written.get();
    }
    if (c.bias) {
      db1_ = DeviceArray<uint16_t>(e * 2 * f);
      db2_ = DeviceArray<uint16_t>(e * h);
      weights.db1 = db1_.get();
      weights.db2 = db2_.get();
    }
  }
  immediate_ = std::make_unique<MoeLayer>(options_, weights);
  // The wgrad_delayed step needs a layer whose backward queues: delay_wgrad is a set-up option.
  if (c.phases.wgrad_delayed) delayed_ = std::make_unique<MoeLayer>(moe_layer_options(c, true), weights);
  // As a caller must before the first forward (and after every weight update, which a case never
  // makes): the mxfp8 recipe quantizes W1 and W2 into its copies here, bf16 has nothing to do.
  for (MoeLayer* layer : {immediate_.get(), delayed_.get()})
    if (layer != nullptr) layer->weights_changed(nullptr);
  MG_CUDA_CHECK(cudaDeviceSynchronize());
}

void MoeProblem::draw(int64_t n) {
  const int64_t h = c_.hidden;
  n_ = n;
  x_host_ = testing::random_values(rng_, n * h, 1.0, c_.dtype);
  avoid_router_ties();
  upload_rows(x_, x_host_);
  if (c_.training()) {
    dy_host_ = testing::random_values(rng_, n * h, 1.0, c_.dtype);
    upload_rows(dy_, dy_host_);
  }
  num_tokens_.upload({static_cast<int32_t>(n)});

  testing::MoeLayerInputs in;
  in.x = &x_host_;
  in.wr = &params_.router;
  in.w1 = &params_.w1;
  in.b1 = &params_.b1;  // empty without bias
  in.w2 = &params_.w2;
  in.b2 = &params_.b2;
  in.dy = c_.training() ? &dy_host_ : nullptr;
  in.tokens = n;
  in.hidden = h;
  in.ffn = c_.ffn;
  in.capacity_rows = moe_layer_rows(options_);
  in.router.experts = c_.experts;
  in.router.top_k = c_.top_k;
  in.router.sigmoid = c_.score == RouterScore::kSigmoid;
  in.router.renormalize = c_.renormalize;
  in.router.aux_coef = c_.aux_loss_coef;
  in.router.capacity_factor = c_.capacity_factor;
  in.router.row_align = c_.row_align;
  in.fuse_weights = c_.fuse_weights;
  in.dtype = c_.dtype;
  in.recipe = c_.recipe;
  ref_ = testing::ref_moe_layer(in);
}

void MoeProblem::prepare_run() {
  y_.poison();
  if (c_.aux_loss_coef > 0.0) aux_loss_.poison();
  if (!c_.training()) return;
  dx_.poison();
  for (GradBuffer* g : {&grad_router_, &grad1_, &grad2_}) {
    if (c_.main_grad) g->main_grad.upload(g->main_grad_init);
    else g->written.poison();
  }
  if (c_.bias) {
    db1_.poison();
    db2_.poison();
  }
}

MoeLayerIO MoeProblem::io() const {
  MoeLayerIO io;
  io.x = x_.get();
  io.num_tokens = num_tokens_.get();
  io.y = y_.get();
  io.aux_loss = c_.aux_loss_coef > 0.0 ? aux_loss_.get() : nullptr;
  if (c_.training()) {
    io.dy = dy_.get();
    io.dx = dx_.get();
  }
  return io;
}

std::vector<MoeLayerOutput> MoeProblem::outputs(const StepPlan& plan) const {
  const int64_t e = c_.experts, h = c_.hidden, f = c_.ffn, rows = n_ * h;
  std::vector<MoeLayerOutput> out;
  auto add = [&](std::string name, std::vector<int64_t> shape, Mat got, const Mat& ref, testing::Tolerance tol,
                 bool checked) {
    out.push_back({std::move(name), std::move(shape), std::move(got), ref, tol, checked});
  };
  add("y", {n_, h}, values_of(y_.download(), rows, c_.dtype), ref_.y, tol_, plan.check_forward);
  if (plan.step == CaseStep::kInference) return out;
  if (c_.aux_loss_coef > 0.0)
    add("aux_loss", {1}, {static_cast<double>(aux_loss_.download()[0])}, Mat{ref_.aux_loss}, kAuxLossTolerance,
        plan.check_forward);
  add("dx", {n_, h}, values_of(dx_.download(), rows, c_.dtype), ref_.dx, tol_, plan.check_grads);
  add("d_router_weight", {e, h}, gradient(grad_router_), ref_.dwr, tol_, plan.check_grads);
  add("dw1", {e, 2 * f, h}, gradient(grad1_), ref_.dw1, tol_, plan.check_grads);
  add("dw2", {e, h, f}, gradient(grad2_), ref_.dw2, tol_, plan.check_grads);
  if (c_.bias) {
    add("db1", {e, 2 * f}, values_of(db1_.download(), db1_.size(), c_.dtype), ref_.db1, tol_, plan.check_grads);
    add("db2", {e, h}, values_of(db2_.download(), db2_.size(), c_.dtype), ref_.db2, tol_, plan.check_grads);
  }
  return out;
}

std::string MoeProblem::rows_past_n_error(bool training_step) const {
  const std::size_t first = static_cast<std::size_t>(n_ * c_.hidden);
  const std::vector<uint16_t> y = y_.download();
  for (std::size_t i = first; i < y.size(); ++i)
    if (y[i] != kNaNBits)
      return detail::concat("y row ", i / c_.hidden, " (past the ", n_, " tokens) was written: it must be left alone");
  if (!training_step) return {};
  const std::vector<uint16_t> dx = dx_.download();
  for (std::size_t i = first; i < dx.size(); ++i)
    if (testing::from_bits(dx[i], c_.dtype) != 0.0)
      return detail::concat("dx row ", i / c_.hidden, " col ", i % c_.hidden, " (past the ", n_, " tokens) is ",
                            testing::from_bits(dx[i], c_.dtype), ", not zero");
  return {};
}

std::vector<std::pair<std::string, std::vector<unsigned char>>> MoeProblem::gradient_bits() const {
  std::vector<std::pair<std::string, std::vector<unsigned char>>> bits;
  const std::pair<const char*, const GradBuffer*> grads[] = {
      {"d_router_weight", &grad_router_}, {"dw1", &grad1_}, {"dw2", &grad2_}};
  for (const auto& [name, g] : grads)
    bits.emplace_back(name, c_.main_grad ? bytes_of(g->main_grad.download()) : bytes_of(g->written.download()));
  if (c_.bias) {
    bits.emplace_back("db1", bytes_of(db1_.download()));
    bits.emplace_back("db2", bytes_of(db2_.download()));
  }
  return bits;
}

DeviceArray<uint16_t> MoeProblem::upload(Mat& host, int64_t count, double scale) {
  host = testing::random_values(rng_, static_cast<std::size_t>(count), scale, c_.dtype);
  DeviceArray<uint16_t> d(static_cast<std::size_t>(count));
  d.upload(testing::to_device_bits(host, c_.dtype));
  return d;
}

GradBuffer MoeProblem::grad_buffer(int64_t count) {
  GradBuffer g;
  const auto size = static_cast<std::size_t>(count);
  if (c_.main_grad) {
    // A nonzero start, so a gradient written instead of accumulated fails the check.
    const Mat init = testing::random_values(rng_, size, 1.0, DType::kFP32);
    g.main_grad_init.assign(init.begin(), init.end());
    g.main_grad = DeviceArray<float>(size);
  } else {
    g.written = DeviceArray<uint16_t>(size);
  }
  return g;
}

Mat MoeProblem::gradient(const GradBuffer& g) const {
  if (!c_.main_grad) return values_of(g.written.download(), g.written.size(), c_.dtype);
  const std::vector<float> now = g.main_grad.download();
  Mat out(now.size());
  for (std::size_t i = 0; i < now.size(); ++i)
    out[i] = static_cast<double>(now[i]) - static_cast<double>(g.main_grad_init[i]);
  return out;
}

void MoeProblem::upload_rows(DeviceArray<uint16_t>& d, const Mat& host) const {
  std::vector<uint16_t> bits(d.size(), kNaNBits);
  const std::vector<uint16_t> data = testing::to_device_bits(host, c_.dtype);
  std::copy(data.begin(), data.end(), bits.begin());
  d.upload(bits);
}

void MoeProblem::avoid_router_ties() {
  const int64_t h = c_.hidden;
  const int k = c_.top_k;
  if (k >= c_.experts) return;
  std::uniform_real_distribution<double> dist(-1.0, 1.0);
  std::vector<double> logits(c_.experts);
  for (int64_t t = 0; t < n_; ++t) {
    double* row = x_host_.data() + t * h;
    for (int attempt = 0;; ++attempt) {
      for (int e = 0; e < c_.experts; ++e) {
        const double* w = params_.router.data() + e * h;
        double sum = 0.0;
        for (int64_t i = 0; i < h; ++i) sum += row[i] * w[i];
        logits[e] = sum;
      }
      std::nth_element(logits.begin(), logits.begin() + k, logits.end(), std::greater<>());
      const double kth = *std::min_element(logits.begin(), logits.begin() + k);
      if (kth - logits[k] >= kMinLogitGap) break;
      MG_CHECK(attempt < kMaxRedraws, "no token without a router tie in ", kMaxRedraws, " draws");
      for (int64_t i = 0; i < h; ++i) row[i] = testing::round_to(dist(rng_), c_.dtype);
    }
  }
}

}  // namespace moegraph::check
