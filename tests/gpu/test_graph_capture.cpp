// The capture contract: forward_train + backward + delayed wgrad captured once under
// cudaStreamCaptureModeGlobal (which rejects synchronization and allocation anywhere in the
// process), then replayed with new device splits and data, matching the reference every time.
#include <gtest/gtest.h>

#include "tests/common/problem.hpp"

namespace moegraph::test {
namespace {

class Graph {
 public:
  template <class F>
  Graph(cudaStream_t stream, F enqueue) {
    MG_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    try {
      enqueue();
    } catch (...) {
      cudaGraph_t broken = nullptr;
      cudaStreamEndCapture(stream, &broken);
      if (broken) cudaGraphDestroy(broken);
      throw;
    }
    MG_CUDA_CHECK(cudaStreamEndCapture(stream, &graph_));
    MG_CUDA_CHECK(cudaGraphInstantiate(&exec_, graph_, 0));
  }
  ~Graph() {
    if (exec_) cudaGraphExecDestroy(exec_);
    if (graph_) cudaGraphDestroy(graph_);
  }
  void launch(cudaStream_t stream) { MG_CUDA_CHECK(cudaGraphLaunch(exec_, stream)); }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

struct Stream {
  Stream() { MG_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(s); }
  cudaStream_t s = nullptr;
};

void run_training_graph_test(CaseSpec spec, int replays) {
  spec.delay_wgrad = true;
  Problem p(spec, test_seed(spec.name));
  Stream stream;
  // Warm-up outside capture (lazy module loading, like the runtime's warm-up step).
  p.op->forward_train(p.forward_args(), stream.s);
  p.op->backward(p.backward_args(), Recipe::kBF16, WgradMode::kDelayed, stream.s);
  p.op->backward_dw(stream.s);
  p.op->check_device_errors(stream.s);

  Graph graph(stream.s, [&] {
    p.op->forward_train(p.forward_args(), stream.s);
    p.op->backward(p.backward_args(), Recipe::kBF16, WgradMode::kDelayed, stream.s);
    p.op->backward_dw(stream.s);
  });
  for (int i = 0; i < replays; ++i) {
    p.reroute_random();  // new device splits and data in the same buffers
    p.poison_outputs();
    graph.launch(stream.s);
    p.op->check_device_errors(stream.s);
    const std::string where = "replay " + std::to_string(i);
    p.expect_forward(where);
    p.expect_dgrad(where);
    p.expect_bias_grads(where);
    p.expect_wgrad(where);
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
  p.op->forward(p.forward_args(), stream.s);
  Graph graph(stream.s, [&] { p.op->forward(p.forward_args(), stream.s); });
  for (int i = 0; i < 20; ++i) {
    p.reroute_random();
    p.poison_outputs();
    graph.launch(stream.s);
    p.op->check_device_errors(stream.s);
    p.expect_forward("replay " + std::to_string(i));
    if (HasFailure()) break;
  }
}

// A host synchronization inside capture must be rejected by the runtime: this proves the mode
// used above really catches the calls the contract forbids.
TEST(GraphCapture, GlobalModeRejectsSynchronization) {
  Stream stream;
  EXPECT_THROW(Graph(stream.s, [&] { MG_CUDA_CHECK(cudaStreamSynchronize(stream.s)); }), Error);
  cudaGetLastError();  // clear the sticky capture error for the tests after this one
}

}  // namespace
}  // namespace moegraph::test
