// The capture contract: forward_train + backward + delayed wgrad captured once under
// cudaStreamCaptureModeGlobal (which rejects synchronization and allocation anywhere in the
// process), then replayed with new device splits and data, matching the reference every time.
#include <gtest/gtest.h>

#include "testing/graph.hpp"
#include "tests/common/expect.hpp"

namespace moegraph::test {
namespace {

void run_training_graph_test(CaseSpec spec, int replays) {
  spec.delay_wgrad = true;
  Problem p(spec, test_seed(spec.name));
  Stream stream;
  // Warm-up outside capture (lazy module loading, like the runtime's warm-up step).
  p.op->forward_train(p.forward_args(), stream.get());
  p.op->backward(p.backward_args(), WgradMode::kDelayed, stream.get());
  p.op->backward_dw(stream.get());
  p.op->check_device_errors(stream.get());

  Graph graph(stream.get(), [&] {
    p.op->forward_train(p.forward_args(), stream.get());
    p.op->backward(p.backward_args(), WgradMode::kDelayed, stream.get());
    p.op->backward_dw(stream.get());
  });
  for (int i = 0; i < replays; ++i) {
    p.reroute_random();  // new device splits and data in the same buffers
    p.poison_outputs();
    graph.launch(stream.get());
    p.op->check_device_errors(stream.get());
    const std::string where = "replay " + std::to_string(i);
    for (OutputSet set : kAllOutputSets) expect_matches_reference(p, set, where);
    if (::testing::Test::HasFailure()) break;
  }
}

TEST(GraphCapture, TrainingStepReplaysWithNewRoutingsBf16) {
  CaseSpec spec{"graph_train_bf16", 16, 256, 384, DType::kBF16, 1, {}, 2000, Routing::kSkewed, 0, true, true};
  run_training_graph_test(spec, 20);
}

TEST(GraphCapture, TrainingStepReplaysAlignedMainGrad) {
  CaseSpec spec{"graph_train_align32_main_grad", 32, 128, 256, DType::kBF16, 32, {}, 1500, Routing::kUniform, 0,
                true, false, true};
  run_training_graph_test(spec, 20);
}

TEST(GraphCapture, InferenceForwardReplaysWithNewRoutings) {
  CaseSpec spec{"graph_forward", 64, 256, 256, DType::kBF16, 1, {}, 3000, Routing::kSkewed, 0, true, true};
  Problem p(spec, test_seed(spec.name));
  Stream stream;
  p.op->forward(p.forward_args(), stream.get());
  Graph graph(stream.get(), [&] { p.op->forward(p.forward_args(), stream.get()); });
  for (int i = 0; i < 20; ++i) {
    p.reroute_random();
    p.poison_outputs();
    graph.launch(stream.get());
    p.op->check_device_errors(stream.get());
    expect_matches_reference(p, OutputSet::kForward, "replay " + std::to_string(i));
    if (HasFailure()) break;
  }
}

// A host synchronization inside capture must be rejected by the runtime: this proves the mode
// used above really catches the calls the contract forbids.
TEST(GraphCapture, GlobalModeRejectsSynchronization) {
  Stream stream;
  EXPECT_THROW(Graph(stream.get(), [&] { MG_CUDA_CHECK(cudaStreamSynchronize(stream.get())); }), Error);
  cudaGetLastError();  // clear the sticky capture error for the tests after this one
}

}  // namespace
}  // namespace moegraph::test
