// CUDA-graph capture for verification: a stream and a graph captured from a callable under
// cudaStreamCaptureModeGlobal, which rejects synchronization and allocation anywhere in the
// process, so a capture that succeeds proves the enqueue path obeys the capture contract.
#pragma once

#include <cuda_runtime_api.h>

#include "graphs/graph_exec.hpp"
#include "moegraph/error.hpp"

namespace moegraph::testing {

class Stream {
 public:
  Stream() { MG_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(stream_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// The runtime's own capture helper, so tests and the tool capture exactly the way StepGraphs does.
using Graph = ::moegraph::GraphExec;

}  // namespace moegraph::testing
