// Per-operator timing (moegraph-bench --ops, and the expert-parallel bench): while a sink is
// installed, the layer program calls it after each operator's forward, backward and delayed wgrad
// with the stream, so the sink can record an event there. The benchmark installs it around eager
// runs, or around its own capture of an eager run (events recorded as external nodes, timed on
// every replay), never while StepGraphs captures its graphs, and from one thread.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

namespace moegraph::layer {

class OpEventSink {
 public:
  virtual ~OpEventSink() = default;
  // `phase`: "forward", "backward" or "wgrad".
  virtual void after(const std::string& op, const char* phase, cudaStream_t stream) = 0;
};

void set_op_event_sink(OpEventSink* sink);  // nullptr: none

}  // namespace moegraph::layer
