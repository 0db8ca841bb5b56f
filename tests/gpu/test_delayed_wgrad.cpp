// Delayed weight gradients: several micro-batches in flight, results bit-identical to immediate.
#include <gtest/gtest.h>

#include "tests/common/expect.hpp"

namespace moegraph::test {
namespace {

// Two micro-batches in flight with the recipe of `spec`; delayed wgrad against immediate.
void expect_pipelined_wgrads_bit_identical(CaseSpec spec) {
  spec.delay_wgrad = true;
  spec.wgrad_slots = 2;
  Problem p(spec, test_seed(spec.name));
  cudaStream_t stream = nullptr;
  const int64_t rows = p.layout.capacity_rows;
  const std::size_t x_elems = rows * spec.k, dy_elems = rows * spec.n;

  // Two micro-batches with different routings and data; inputs are copied aside per micro-batch.
  std::vector<std::vector<uint16_t>> immediate(2);
  std::vector<std::vector<int32_t>> splits(2);
  std::vector<std::vector<uint16_t>> xs(2), dys(2);
  for (int mb = 0; mb < 2; ++mb) {
    p.reroute_random();
    splits[mb] = p.layout.splits;
    xs[mb] = p.d_x.download();
    dys[mb] = p.d_dy.download();
    p.op->forward_train(p.forward_args(), stream);
    p.op->backward(p.backward_args(), WgradMode::kImmediate, stream);
    p.op->check_device_errors(stream);
    immediate[mb] = p.d_dw.download();
    expect_matches_reference(p, OutputSet::kWgrad, "immediate mb" + std::to_string(mb));
  }
  ASSERT_EQ(xs[0].size(), x_elems);
  ASSERT_EQ(dys[0].size(), dy_elems);

  // Pipeline: F0 F1 B0 B1 (wgrads queued), the input buffers overwritten in between, then W0 W1.
  DeviceArray<uint16_t> dw0(p.d_dw.size()), dw1(p.d_dw.size());
  for (int mb = 0; mb < 2; ++mb) {
    p.d_splits.upload(splits[mb]);
    p.d_x.upload(xs[mb]);
    p.op->forward_train(p.forward_args(), stream);
  }
  EXPECT_THROW(p.op->forward_train(p.forward_args(), stream), Error) << "a third context must not fit two slots";
  for (int mb = 0; mb < 2; ++mb) {
    p.d_dy.upload(dys[mb]);
    BackwardArgs args = p.backward_args();
    args.dweight = (mb == 0 ? dw0 : dw1).get();
    p.op->backward(args, WgradMode::kDelayed, stream);
  }
  EXPECT_EQ(p.op->queued_wgrads(), 2);
  p.d_x.poison();  // saved contexts must not depend on the caller's buffers any more
  p.d_dy.poison();
  p.op->backward_dw(stream);
  p.op->backward_dw(stream);
  p.op->check_device_errors(stream);
  EXPECT_EQ(p.op->queued_wgrads(), 0);
  EXPECT_THROW(p.op->backward_dw(stream), Error);
  EXPECT_TRUE(dw0.download() == immediate[0]) << "micro-batch 0: delayed wgrad differs from immediate";
  EXPECT_TRUE(dw1.download() == immediate[1]) << "micro-batch 1: delayed wgrad differs from immediate";
  EXPECT_FALSE(immediate[0] == immediate[1]) << "the two micro-batches should differ";
}

TEST(DelayedWgrad, PipelinedMicroBatchesAreBitIdenticalToImmediate) {
  expect_pipelined_wgrads_bit_identical(
      {"delayed_pipeline", 8, 256, 384, DType::kBF16, 1, {}, 1500, Routing::kSkewed, 0, true, true});
}

// MXFP8: the slot keeps x and dy as column-wise MXFP8 copies, which the delayed wgrad must read
// exactly as the immediate one reads its fresh copies.
TEST(DelayedWgrad, Mxfp8PipelinedMicroBatchesAreBitIdenticalToImmediate) {
  CaseSpec spec{"delayed_pipeline_mxfp8", 8, 256, 384, DType::kBF16, 32, {}, 1500, Routing::kSkewed, 0, true, true};
  spec.recipe = Recipe::kMXFP8;
  expect_pipelined_wgrads_bit_identical(spec);
}

// caller_keeps_activations: the operator keeps pointers to x, the bias scale and dy instead of
// copies, so each micro-batch's buffers are its own until its wgrad has run. Pipelined F0 F1 B0 B1
// W0 W1 on those buffers equals immediate wgrad bit for bit, and poisoning a kept buffer before its
// wgrad reaches the result (the operator reads the caller's memory, as the contract says).
TEST(DelayedWgrad, CallerKeptActivationsPipelineBitIdenticalToImmediate) {
  CaseSpec spec{"delayed_caller_kept", 8, 256, 384, DType::kBF16, 1, {}, 1500, Routing::kSkewed, 0, true, true};
  spec.delay_wgrad = true, spec.wgrad_slots = 2, spec.caller_keeps_activations = true;
  Problem p(spec, test_seed(spec.name));
  cudaStream_t stream = nullptr;
  std::vector<std::vector<uint16_t>> immediate(2), db(2);
  std::vector<std::vector<int32_t>> splits(2);
  std::vector<DeviceArray<uint16_t>> xs, dys;
  std::vector<DeviceArray<float>> scales;
  for (int mb = 0; mb < 2; ++mb) {
    p.reroute_random();
    splits[mb] = p.layout.splits;
    xs.emplace_back(p.d_x.size()), dys.emplace_back(p.d_dy.size()), scales.emplace_back(p.d_s.size());
    MG_CUDA_CHECK(cudaMemcpy(xs[mb].get(), p.d_x.get(), p.d_x.size() * 2, cudaMemcpyDeviceToDevice));
    MG_CUDA_CHECK(cudaMemcpy(dys[mb].get(), p.d_dy.get(), p.d_dy.size() * 2, cudaMemcpyDeviceToDevice));
    MG_CUDA_CHECK(cudaMemcpy(scales[mb].get(), p.d_s.get(), p.d_s.size() * 4, cudaMemcpyDeviceToDevice));
    p.op->forward_train(p.forward_args(), stream);
    p.op->backward(p.backward_args(), WgradMode::kImmediate, stream);
    p.op->check_device_errors(stream);
    immediate[mb] = p.d_dw.download(), db[mb] = p.d_db.download();
    expect_matches_reference(p, OutputSet::kWgrad, "immediate mb" + std::to_string(mb));
  }
  ASSERT_FALSE(immediate[0] == immediate[1]) << "the two micro-batches should differ";

  // poison: none, micro-batch 0's x, or its dy, after both backwards and before the delayed wgrads
  // (then restored for the next run).
  enum class Poison { kNone, kX0, kDy0 };
  const std::vector<uint16_t> x0 = xs[0].download(), dy0 = dys[0].download();
  auto pipeline = [&](Poison poison) {
    DeviceArray<uint16_t> dw0(p.d_dw.size()), dw1(p.d_dw.size());
    for (int mb = 0; mb < 2; ++mb) {
      p.d_splits.upload(splits[mb]);
      ForwardArgs f = p.forward_args();
      f.x = xs[mb].get(), f.bias_scale = scales[mb].get();
      p.op->forward_train(f, stream);
    }
    for (int mb = 0; mb < 2; ++mb) {
      BackwardArgs b = p.backward_args();
      b.dy = dys[mb].get(), b.dweight = (mb == 0 ? dw0 : dw1).get();
      p.op->backward(b, WgradMode::kDelayed, stream);
      MG_CUDA_CHECK(cudaStreamSynchronize(stream));
      EXPECT_TRUE(p.d_db.download() == db[mb]) << "micro-batch " << mb << ": dbias from the kept bias scale";
    }
    p.d_x.poison(), p.d_dy.poison(), p.d_s.poison();  // the operator's usual inputs: not read any more
    if (poison == Poison::kX0) xs[0].poison();
    if (poison == Poison::kDy0) dys[0].poison();
    p.op->backward_dw(stream);
    p.op->backward_dw(stream);
    p.op->check_device_errors(stream);
    xs[0].upload(x0), dys[0].upload(dy0);
    return std::make_pair(dw0.download(), dw1.download());
  };
  const auto [dw0, dw1] = pipeline(Poison::kNone);
  EXPECT_TRUE(dw0 == immediate[0]) << "micro-batch 0: delayed wgrad from the kept buffers differs from immediate";
  EXPECT_TRUE(dw1 == immediate[1]) << "micro-batch 1: delayed wgrad from the kept buffers differs from immediate";
  for (Poison poison : {Poison::kX0, Poison::kDy0}) {
    const char* what = poison == Poison::kX0 ? "x" : "dy";
    const auto [poisoned0, still1] = pipeline(poison);
    EXPECT_FALSE(poisoned0 == immediate[0]) << "micro-batch 0's wgrad did not read the caller's " << what;
    EXPECT_TRUE(still1 == immediate[1]) << "micro-batch 1 must not read micro-batch 0's " << what;
  }
}

TEST(DelayedWgrad, RefusedWithoutDelayOption) {
  CaseSpec spec{"delay_refused", 4, 128, 128, DType::kBF16, 1, {}, 100};
  Problem p(spec, test_seed(spec.name));
  p.op->forward_train(p.forward_args(), nullptr);
  EXPECT_THROW(p.op->backward(p.backward_args(), WgradMode::kDelayed, nullptr), Error);
  EXPECT_EQ(p.op->pending_backwards(), 1) << "a refused backward must leave the context queued";
}

}  // namespace
}  // namespace moegraph::test
