// Small helpers of moegraph-bench: graph capture, event timing, routings, the result table.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "graphs/graph_exec.hpp"
#include "moegraph/error.hpp"
#include "testing/data.hpp"

namespace moegraph::bench {

class EventTimer {
 public:
  EventTimer() {
    MG_CUDA_CHECK(cudaEventCreate(&start_));
    MG_CUDA_CHECK(cudaEventCreate(&stop_));
  }
  ~EventTimer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;
  // Milliseconds between events recorded around f's work on `stream`.
  template <class F>
  float time(cudaStream_t stream, F f) {
    begin(stream);
    f();
    end(stream);
    return ms();
  }
  // The same in pieces. While `stream` is captured, pass cudaEventRecordExternal: the events become
  // event nodes of the graph, recorded again by every replay, and ms() after a replay reads it.
  void begin(cudaStream_t stream, unsigned flags = cudaEventRecordDefault) {
    MG_CUDA_CHECK(cudaEventRecordWithFlags(start_, stream, flags));
  }
  void end(cudaStream_t stream, unsigned flags = cudaEventRecordDefault) {
    MG_CUDA_CHECK(cudaEventRecordWithFlags(stop_, stream, flags));
  }
  float ms() const {
    MG_CUDA_CHECK(cudaEventSynchronize(stop_));
    float ms = 0;
    MG_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
    return ms;
  }

 private:
  cudaEvent_t start_, stop_;
};

inline double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Routings come from the verification library (testing/): the same draws as the tests.
using testing::Routing;
// The median time of `replays` graph replays of `work` (captured once, after one warm-up run outside
// capture for module loading, library heuristics and occupancy queries).
template <class F>
double replayed_median(cudaStream_t stream, F work, int replays) {
  work();
  MG_CUDA_CHECK(cudaStreamSynchronize(stream));
  GraphExec graph(stream, work);
  EventTimer timer;
  std::vector<float> t;
  for (int i = 0; i < replays; ++i) t.push_back(timer.time(stream, [&] { graph.launch(stream); }));
  return median(t);
}

inline const char* routing_name(Routing r) { return r == Routing::kUniform ? "uniform" : "zipf1.2"; }

inline std::string fmt(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

inline void progress(int done, int total, const char* what) {
  std::fprintf(stderr, "\r[%-30s] %d/%d %s      ", std::string(30 * done / total, '#').c_str(), done, total, what);
  std::fflush(stderr);
}

class Table {
 public:
  void add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  // A Markdown table, so it can go into docs/PERF.md as printed.
  void print(const std::vector<std::string>& header) const {
    std::vector<std::size_t> width(header.size());
    for (std::size_t c = 0; c < header.size(); ++c) {
      width[c] = header[c].size();
      for (const auto& r : rows_) width[c] = std::max(width[c], r[c].size());
    }
    auto line = [&](const std::vector<std::string>& r) {
      std::printf("|");
      for (std::size_t c = 0; c < r.size(); ++c) std::printf(" %*s |", static_cast<int>(width[c]), r[c].c_str());
      std::printf("\n");
    };
    line(header);
    std::printf("|");
    for (std::size_t c = 0; c < header.size(); ++c) std::printf("%s|", std::string(width[c] + 2, '-').c_str());
    std::printf("\n");
    for (const auto& r : rows_) line(r);
  }

 private:
  std::vector<std::vector<std::string>> rows_;
};


}  // namespace moegraph::bench
