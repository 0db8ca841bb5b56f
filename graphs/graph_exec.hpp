// An instantiated CUDA graph captured from a stream. Under cudaStreamCaptureModeGlobal (the
// default) the runtime rejects any synchronization or allocation anywhere in the process during
// capture, which proves the enqueue path obeys the capture contract; cudaStreamCaptureModeThreadLocal
// rejects them in the capturing thread only, so other threads may set up or synchronize meanwhile.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <vector>

#include "moegraph/error.hpp"

namespace moegraph {

class GraphExec {
 public:
  GraphExec() = default;
  template <class F>
  GraphExec(cudaStream_t stream, F enqueue, cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal) {
    MG_CUDA_CHECK(cudaStreamBeginCapture(stream, mode));
    cudaGraph_t graph = nullptr;
    try {
      enqueue();
    } catch (...) {
      cudaStreamEndCapture(stream, &graph);  // leave the stream usable
      if (graph != nullptr) cudaGraphDestroy(graph);
      throw;
    }
    MG_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    kernel_nodes_ = count_kernel_nodes(graph);
    const cudaError_t st = cudaGraphInstantiate(&exec_, graph, 0);
    cudaGraphDestroy(graph);
    MG_CUDA_CHECK(st);
  }
  GraphExec(GraphExec&& o) noexcept : exec_(o.exec_), kernel_nodes_(o.kernel_nodes_) { o.exec_ = nullptr; }
  GraphExec& operator=(GraphExec&& o) noexcept {
    if (this != &o) {
      if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
      exec_ = o.exec_;
      kernel_nodes_ = o.kernel_nodes_;
      o.exec_ = nullptr;
    }
    return *this;
  }
  GraphExec(const GraphExec&) = delete;
  GraphExec& operator=(const GraphExec&) = delete;
  ~GraphExec() {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
  }
  bool valid() const { return exec_ != nullptr; }
  void launch(cudaStream_t stream) const { MG_CUDA_CHECK(cudaGraphLaunch(exec_, stream)); }
  // Kernel nodes in the captured graph (cuBLASLt's included): each costs a launch inside a replay.
  std::size_t kernel_nodes() const { return kernel_nodes_; }

 private:
  // A count for reports only: 0 where the runtime cannot list the nodes (the graph is then
  // instantiated, and its errors reported, as before).
  static std::size_t count_kernel_nodes(cudaGraph_t graph) noexcept {
    try {
      std::size_t n = 0;
      if (cudaGraphGetNodes(graph, nullptr, &n) != cudaSuccess) return 0;
      std::vector<cudaGraphNode_t> nodes(n);
      if (n > 0 && cudaGraphGetNodes(graph, nodes.data(), &n) != cudaSuccess) return 0;
      std::size_t kernels = 0;
      for (cudaGraphNode_t node : nodes) {
        cudaGraphNodeType type{};
        kernels += cudaGraphNodeGetType(node, &type) == cudaSuccess && type == cudaGraphNodeTypeKernel;
      }
      return kernels;
    } catch (...) {  // the node list's allocation: the graph must still be instantiated or destroyed
      return 0;
    }
  }
  cudaGraphExec_t exec_ = nullptr;
  std::size_t kernel_nodes_ = 0;
};

}  // namespace moegraph
