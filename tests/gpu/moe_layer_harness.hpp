// The whole-layer harness of the MoeLayer GPU tests: a layer with its parameters, gradients and
// stream, fresh inputs, poisoned outputs, a training step, the outputs read back, and the fp64
// layer reference (ref_moe_layer, with the layer's recipe) of the last inputs. Shared by
// test_moe_layer.cpp (bf16) and test_moe_layer_mxfp8.cpp.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "moegraph/moe_layer.hpp"
#include "testing/data.hpp"
#include "testing/device_array.hpp"
#include "testing/graph.hpp"
#include "testing/moe_layer_reference.hpp"
#include "tests/common/expect.hpp"

namespace moegraph::test {

struct LayerCase {
  const char* name;
  int experts, top_k;
  int64_t hidden, ffn, max_tokens;
  bool bias, sigmoid, renormalize;
  double aux, capacity_factor;
  bool fuse;
  int row_align;
  bool main_grad, delay;
};

inline MoeLayerOptions options_of(const LayerCase& c, Recipe recipe = Recipe::kBF16) {
  MoeLayerOptions o;
  o.recipe = recipe;
  o.experts = c.experts, o.top_k = c.top_k, o.hidden = c.hidden, o.ffn = c.ffn, o.max_tokens = c.max_tokens;
  o.bias = c.bias;
  o.score = c.sigmoid ? RouterScore::kSigmoid : RouterScore::kSoftmax;
  o.renormalize = c.renormalize;
  o.aux_loss_coef = c.aux;
  o.capacity_factor = c.capacity_factor;
  o.fuse_weights = c.fuse;
  o.row_align = c.row_align;
  o.training = true;
  o.wgrad_slots = 2;
  o.delay_wgrad = c.delay;
  o.main_grad_fp32 = c.main_grad;
  return o;
}

struct LayerOutputs {
  Mat y, dx, dwr, dw1, dw2, db1, db2;
  double aux = 0;
  bool operator==(const LayerOutputs& o) const {
    return same_bits(y, o.y) && same_bits(dx, o.dx) && same_bits(dwr, o.dwr) && same_bits(dw1, o.dw1) &&
           same_bits(dw2, o.dw2) && same_bits(db1, o.db1) && same_bits(db2, o.db2) &&
           (aux == o.aux || (std::isnan(aux) && std::isnan(o.aux)));
  }
};

class LayerHarness {
 public:
  LayerHarness(const MoeLayerOptions& o, uint64_t seed) : o_(o), rng_(seed) {
    const int64_t e = o.experts, h = o.hidden, f = o.ffn, t = o.max_tokens;
    const DType dt = o.dtype;
    wr_ = grid_values(rng_, e * h, 64, 1.0 / 256);
    w1_ = random_values(rng_, e * 2 * f * h, 1.0 / std::sqrt(double(h)), dt);
    w2_ = random_values(rng_, e * h * f, 1.0 / std::sqrt(double(f)), dt);
    if (o.bias) b1_ = random_values(rng_, e * 2 * f, 0.1, dt), b2_ = random_values(rng_, e * h, 0.1, dt);
    wr_d_ = upload(wr_), w1_d_ = upload(w1_), w2_d_ = upload(w2_);
    if (o.bias) b1_d_ = upload(b1_), b2_d_ = upload(b2_);
    x_d_ = DeviceArray<uint16_t>(t * h), y_d_ = DeviceArray<uint16_t>(t * h);
    dy_d_ = DeviceArray<uint16_t>(t * h), dx_d_ = DeviceArray<uint16_t>(t * h);
    tokens_d_ = DeviceArray<int32_t>(1), aux_d_ = DeviceArray<float>(1);
    if (o.bias) db1_d_ = DeviceArray<uint16_t>(e * 2 * f), db2_d_ = DeviceArray<uint16_t>(e * h);
    if (o.main_grad_fp32) {
      mgr_ = DeviceArray<float>(e * h), mg1_ = DeviceArray<float>(e * 2 * f * h), mg2_ = DeviceArray<float>(e * h * f);
    } else {
      dwr_ = DeviceArray<uint16_t>(e * h), dw1_ = DeviceArray<uint16_t>(e * 2 * f * h);
      dw2_ = DeviceArray<uint16_t>(e * h * f);
    }
    const MoeLayerWeights w = weights();
    layer_ = std::make_unique<MoeLayer>(o, w);
    // As a caller must before the first forward: the mxfp8 recipe quantizes W1 and W2 here (the
    // weights never change in a test); bf16 has nothing to do.
    layer_->weights_changed(stream());
  }

  // The weights and gradient buffers where they are now (null: not used by these options).
  MoeLayerWeights weights() {
    MoeLayerWeights w;
    w.router = wr_d_.get(), w.w1 = w1_d_.get(), w.w2 = w2_d_.get();
    if (o_.bias) w.b1 = b1_d_.get(), w.b2 = b2_d_.get(), w.db1 = db1_d_.get(), w.db2 = db2_d_.get();
    if (o_.main_grad_fp32) w.main_grad_router = mgr_.get(), w.main_grad1 = mg1_.get(), w.main_grad2 = mg2_.get();
    else w.d_router = dwr_.get(), w.dw1 = dw1_.get(), w.dw2 = dw2_.get();
    return w;
  }
  // Copies the weights (and, with `gradients`, the gradient buffers) to new device memory and
  // re-binds the layer (set_weights), as FSDP2 re-gathers parameters. The old memory stays
  // allocated and is poisoned (NaN), so a layer still reading it gives NaN. Nothing moves when
  // set_weights refuses.
  void move_weights(bool gradients = true) {
    std::vector<std::pair<DeviceArray<uint16_t>*, DeviceArray<uint16_t>>> to16;
    std::vector<std::pair<DeviceArray<float>*, DeviceArray<float>>> to32;
    const auto copy = [](auto& from, auto& list) {
      if (from.size() == 0) return;
      std::remove_reference_t<decltype(from)> to(from.size());
      MG_CUDA_CHECK(cudaMemcpy(to.get(), from.get(), from.size() * sizeof(*from.get()), cudaMemcpyDeviceToDevice));
      list.emplace_back(&from, std::move(to));
    };
    for (DeviceArray<uint16_t>* a : {&wr_d_, &w1_d_, &w2_d_, &b1_d_, &b2_d_}) copy(*a, to16);
    if (gradients) {
      for (DeviceArray<uint16_t>* a : {&dwr_, &dw1_, &dw2_, &db1_d_, &db2_d_}) copy(*a, to16);
      for (DeviceArray<float>* a : {&mgr_, &mg1_, &mg2_}) copy(*a, to32);
    }
    MoeLayerWeights w = weights();
    const auto pointer_to = [&](const void* old) -> void* {
      for (auto& [from, to] : to16)
        if (from->get() == old) return to.get();
      for (auto& [from, to] : to32)
        if (from->get() == old) return to.get();
      return const_cast<void*>(old);
    };
    w.router = pointer_to(w.router), w.w1 = pointer_to(w.w1), w.w2 = pointer_to(w.w2);
    w.b1 = pointer_to(w.b1), w.b2 = pointer_to(w.b2), w.db1 = pointer_to(w.db1), w.db2 = pointer_to(w.db2);
    w.d_router = pointer_to(w.d_router), w.dw1 = pointer_to(w.dw1), w.dw2 = pointer_to(w.dw2);
    w.main_grad_router = static_cast<float*>(pointer_to(w.main_grad_router));
    w.main_grad1 = static_cast<float*>(pointer_to(w.main_grad1));
    w.main_grad2 = static_cast<float*>(pointer_to(w.main_grad2));
    layer_->set_weights(w);
    for (auto& [from, to] : to16) from->poison(), moved_from16_.push_back(std::exchange(*from, std::move(to)));
    for (auto& [from, to] : to32) from->poison(), moved_from32_.push_back(std::exchange(*from, std::move(to)));
  }

  MoeLayer& layer() { return *layer_; }
  cudaStream_t stream() const { return stream_.get(); }
  MoeLayerIO io() const {
    MoeLayerIO io;
    io.x = x_d_.get(), io.num_tokens = tokens_d_.get(), io.y = y_d_.get(), io.aux_loss = aux_d_.get();
    io.dy = dy_d_.get(), io.dx = dx_d_.get();
    return io;
  }

  // Fresh x (every row, so rows past n hold data the layer must ignore) and dy; n tokens. x is on
  // a grid that keeps the router's fp32 logits exact (see grid_values). For mxfp8 the grid has 8
  // significant bits, so that most x are no MXFP8 values and FC1's quantization of x matters; the
  // logits stay exact (products are multiples of 2^-16 of at most 255 * 64 of them, and their sums
  // over a hidden of up to 1024 stay below 2^24 of them).
  void set_inputs(int64_t n) {
    const int64_t t = o_.max_tokens, h = o_.hidden;
    x_ = o_.recipe == Recipe::kMXFP8 ? grid_values(rng_, t * h, 255, 1.0 / 256) : grid_values(rng_, t * h, 4, 0.25);
    dy_ = random_values(rng_, t * h, 1.0, o_.dtype);
    x_d_.upload(to_device_bits(x_, o_.dtype));
    dy_d_.upload(to_device_bits(dy_, o_.dtype));
    set_tokens(n);
  }
  // The last inputs set, to be written again later (micro-batches in flight).
  struct Inputs {
    Mat x, dy;
    int64_t n = 0;
  };
  Inputs inputs() const { return {x_, dy_, n_}; }
  // x and the token count of `in` into the caller's buffers (forward), or dy (backward).
  void write_forward_inputs(const Inputs& in) {
    x_d_.upload(to_device_bits(in.x, o_.dtype));
    tokens_d_.upload({static_cast<int32_t>(in.n)});
  }
  void write_dy(const Inputs& in) { dy_d_.upload(to_device_bits(in.dy, o_.dtype)); }
  void set_tokens(int64_t n) {
    n_ = n;
    tokens_d_.upload({static_cast<int32_t>(n)});
  }
  // NaN outputs, zero main_grad (it accumulates), NaN written gradients.
  void poison() {
    y_d_.poison(), dx_d_.poison(), aux_d_.poison();
    for (DeviceArray<float>* a : {&mgr_, &mg1_, &mg2_})
      if (a->size()) testing::memset_and_wait(a->get(), 0, a->size() * sizeof(float));
    for (DeviceArray<uint16_t>* a : {&dwr_, &dw1_, &dw2_, &db1_d_, &db2_d_})
      if (a->size()) a->poison();
  }
  void train_step() {
    const MoeLayerIO x = io();
    layer_->forward_train(x, stream());
    layer_->backward(x, stream());
    if (o_.delay_wgrad) layer_->backward_dw(stream());
  }
  LayerOutputs read() {
    MG_CUDA_CHECK(cudaStreamSynchronize(stream()));
    LayerOutputs out;
    const DType dt = o_.dtype;
    out.y = download_bits(y_d_, dt);
    out.dx = download_bits(dx_d_, dt);
    out.aux = aux_d_.download()[0];
    if (o_.main_grad_fp32) {
      out.dwr = download_floats(mgr_), out.dw1 = download_floats(mg1_), out.dw2 = download_floats(mg2_);
    } else {
      out.dwr = download_bits(dwr_, dt), out.dw1 = download_bits(dw1_, dt), out.dw2 = download_bits(dw2_, dt);
    }
    if (o_.bias) out.db1 = download_bits(db1_d_, dt), out.db2 = download_bits(db2_d_, dt);
    return out;
  }

  // The reference of the last inputs; `recipe` other than the layer's: what a check on the wrong
  // reference would compare against.
  MoeLayerRef reference(bool with_backward) const { return reference(with_backward, o_.recipe); }
  MoeLayerRef reference(bool with_backward, Recipe recipe) const {
    const int64_t h = o_.hidden;
    const Mat x(x_.begin(), x_.begin() + n_ * h), dy(dy_.begin(), dy_.begin() + n_ * h);
    RouterSpec spec;
    spec.experts = o_.experts, spec.top_k = o_.top_k, spec.sigmoid = o_.score == RouterScore::kSigmoid;
    spec.renormalize = o_.renormalize, spec.aux_coef = o_.aux_loss_coef;
    spec.capacity_factor = o_.capacity_factor, spec.row_align = o_.row_align;
    MoeLayerInputs in;
    in.x = &x, in.wr = &wr_, in.w1 = &w1_, in.b1 = &b1_, in.w2 = &w2_, in.b2 = &b2_;
    in.dy = with_backward ? &dy : nullptr;
    in.tokens = n_, in.hidden = h, in.ffn = o_.ffn, in.capacity_rows = moe_layer_rows(o_);
    in.router = spec, in.fuse_weights = o_.fuse_weights, in.dtype = o_.dtype, in.recipe = recipe;
    return ref_moe_layer(in);
  }

  void expect_matches_reference(const LayerOutputs& got, const std::string& where, bool with_backward = true) const {
    const MoeLayerRef ref = reference(with_backward);
    const int64_t h = o_.hidden, f = o_.ffn, n = n_;
    const Tolerance tol = layer_tolerance_for(o_.dtype, o_.recipe);
    const Mat y(got.y.begin(), got.y.begin() + n * h);
    if (n > 0) {
      EXPECT_TRUE(passed(all_close(where + " y", y, ref.y, h, {}, tol)));
    }
    if (o_.aux_loss_coef > 0) {
      EXPECT_NEAR(got.aux, ref.aux_loss, 1e-4 * std::abs(ref.aux_loss) + 1e-6) << where << " aux_loss";
    }
    if (!with_backward) return;
    const Mat dx(got.dx.begin(), got.dx.begin() + n * h);
    if (n > 0) {
      EXPECT_TRUE(passed(all_close(where + " dx", dx, ref.dx, h, {}, tol)));
    }
    std::size_t nonzero_past_n = 0;
    for (std::size_t i = n * h; i < got.dx.size(); ++i) nonzero_past_n += got.dx[i] != 0.0;
    EXPECT_EQ(nonzero_past_n, 0u) << where << " dx rows past n must be written as zero";
    EXPECT_TRUE(passed(all_close(where + " d_router", got.dwr, ref.dwr, h, {}, tol)));
    EXPECT_TRUE(passed(all_close(where + " dw1", got.dw1, ref.dw1, h, {}, tol)));
    EXPECT_TRUE(passed(all_close(where + " dw2", got.dw2, ref.dw2, f, {}, tol)));
    if (o_.bias) {
      EXPECT_TRUE(passed(all_close(where + " db1", got.db1, ref.db1, 2 * f, {}, tol)));
      EXPECT_TRUE(passed(all_close(where + " db2", got.db2, ref.db2, h, {}, tol)));
    }
  }
  uint64_t reference_dropped() const { return reference(false).dispatch.dropped; }

 private:
  DeviceArray<uint16_t> upload(const Mat& v) const {
    DeviceArray<uint16_t> a(v.size());
    a.upload(to_device_bits(v, o_.dtype));
    return a;
  }

  MoeLayerOptions o_;
  std::mt19937_64 rng_;
  Mat wr_, w1_, w2_, b1_, b2_, x_, dy_;
  int64_t n_ = 0;
  DeviceArray<uint16_t> wr_d_, w1_d_, w2_d_, b1_d_, b2_d_, x_d_, y_d_, dy_d_, dx_d_;
  DeviceArray<uint16_t> dwr_, dw1_, dw2_, db1_d_, db2_d_;
  DeviceArray<float> mgr_, mg1_, mg2_, aux_d_;
  DeviceArray<int32_t> tokens_d_;
  std::vector<DeviceArray<uint16_t>> moved_from16_;  // poisoned, kept allocated (move_weights)
  std::vector<DeviceArray<float>> moved_from32_;
  Stream stream_;
  std::unique_ptr<MoeLayer> layer_;
};

// Eager training steps at several token counts, each against the reference, then the inference
// forward on the same data, whose y must equal forward_train's bit for bit.
inline void expect_train_steps_match(const LayerCase& c, const MoeLayerOptions& options, uint64_t seed) {
  LayerHarness h(options, seed);
  for (int64_t n : {c.max_tokens, c.max_tokens / 2 + 1, int64_t{1}}) {
    h.set_inputs(n);
    h.poison();
    h.train_step();
    h.layer().check_device_errors(h.stream());
    const LayerOutputs train = h.read();
    h.expect_matches_reference(train, detail::concat(c.name, " n=", n));
    h.poison();
    h.layer().forward(h.io(), h.stream());
    const LayerOutputs infer = h.read();
    EXPECT_TRUE(same_bits(infer.y, train.y)) << c.name << " n=" << n << ": inference y differs from forward_train's";
  }
}

// One capture of a training step replayed for other token counts (0 included) and data: every
// replay matches the reference and an eager run on the same data bit for bit.
inline void expect_graph_replays_match(const LayerCase& c, const MoeLayerOptions& options, uint64_t seed) {
  LayerHarness h(options, seed);
  h.set_inputs(c.max_tokens);
  h.train_step();  // warm-up outside capture
  testing::Graph graph(h.stream(), [&] { h.train_step(); });
  for (int64_t n : {c.max_tokens, int64_t{0}, c.max_tokens / 3 + 1, int64_t{1}}) {
    h.set_inputs(n);
    h.poison();
    graph.launch(h.stream());
    const LayerOutputs replayed = h.read();
    h.expect_matches_reference(replayed, detail::concat(c.name, " graph n=", n));
    h.poison();
    h.train_step();
    EXPECT_TRUE(h.read() == replayed) << c.name << " n=" << n << ": graph replay and eager run differ";
  }
  h.layer().check_device_errors(h.stream());
}

// The same for the case's options on a recipe.
inline void expect_train_steps_match(const LayerCase& c, Recipe recipe, uint64_t seed) {
  expect_train_steps_match(c, options_of(c, recipe), seed);
}
inline void expect_graph_replays_match(const LayerCase& c, Recipe recipe, uint64_t seed) {
  expect_graph_replays_match(c, options_of(c, recipe), seed);
}

}  // namespace moegraph::test
