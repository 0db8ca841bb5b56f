// --ops: each operator's time per phase, from events the layer program records after every
// operator (src/ops/moe/op_events.hpp). Shared by the step bench and the expert-parallel bench.
// In graph mode the events are recorded while a graph is captured, as external event nodes: each
// replay records them again, and finish() after a replay reads that replay's times.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "moegraph/error.hpp"
#include "src/ops/moe/op_events.hpp"
#include "tools/bench/bench_util.hpp"

namespace moegraph::bench {

// One operator's time per phase, medians over the runs.
struct OpTime {
  std::string op;
  double forward_ms = 0, backward_ms = 0, wgrad_ms = 0;
  double total() const { return forward_ms + backward_ms + wgrad_ms; }
};

// Records an event after every operator of the layer program (src/ops/moe/op_events.hpp), and
// collects each (operator, phase)'s time since the event before it, over several runs (eager, or
// replays of a captured run).
class OpTimer : public layer::OpEventSink {
 public:
  explicit OpTimer(bool in_graph = false) : in_graph_(in_graph) { layer::set_op_event_sink(this); }
  ~OpTimer() override {
    layer::set_op_event_sink(nullptr);
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
  }
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;
  void start(cudaStream_t s) {
    used_ = 0, labels_.clear();
    record({}, s);
  }
  void after(const std::string& op, const char* phase, cudaStream_t s) override { record({op, phase}, s); }
  // After the run's work: each operator's time in this run, added to the samples.
  void finish() {
    MG_CUDA_CHECK(cudaEventSynchronize(events_[used_ - 1]));
    for (std::size_t i = 1; i < used_; ++i) {
      float ms = 0;
      MG_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[i - 1], events_[i]));
      if (!samples_.count(labels_[i])) order_.push_back(labels_[i].first);
      samples_[labels_[i]].push_back(ms);
    }
  }
  std::vector<OpTime> medians() const {
    std::vector<OpTime> out;
    for (const std::string& op : order_) {
      if (std::any_of(out.begin(), out.end(), [&](const OpTime& t) { return t.op == op; })) continue;
      OpTime t{op};
      auto get = [&](const char* phase) {
        const auto it = samples_.find({op, phase});
        return it == samples_.end() ? 0.0 : median(it->second);
      };
      t.forward_ms = get("forward"), t.backward_ms = get("backward"), t.wgrad_ms = get("wgrad");
      out.push_back(t);
    }
    return out;
  }

 private:
  using Label = std::pair<std::string, std::string>;
  void record(Label label, cudaStream_t s) {
    if (used_ == events_.size()) {
      events_.emplace_back();
      MG_CUDA_CHECK(cudaEventCreate(&events_.back()));
    }
    MG_CUDA_CHECK(cudaEventRecordWithFlags(events_[used_++], s,
                                           in_graph_ ? cudaEventRecordExternal : cudaEventRecordDefault));
    labels_.push_back(std::move(label));
  }
  bool in_graph_;
  std::vector<cudaEvent_t> events_;
  std::size_t used_ = 0;
  std::vector<Label> labels_;
  std::map<Label, std::vector<float>> samples_;
  std::vector<std::string> order_;
};

}  // namespace moegraph::bench
