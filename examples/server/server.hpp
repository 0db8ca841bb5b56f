// The device side of the example inference server: the caller-owned weights, and the serving
// threads, each with its own stream, pinned staging buffers and StepGraphs handle (a handle is used
// by one thread at a time: moegraph/step_graphs.hpp), serving requests of random size by replaying
// the bucket that fits each one.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <moegraph/step_graphs.hpp>
#include <moegraph/types.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace server {

// CUDA runtime calls of the example itself (the library reports its own as moegraph::Error).
inline void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

// Owners of CUDA allocations: freed however set-up ends, a throw halfway included.
struct FreeDevice {
  void operator()(void* p) const { cudaFree(p); }
};
struct FreeHost {
  void operator()(void* p) const { cudaFreeHost(p); }
};
struct DestroyStream {
  void operator()(cudaStream_t s) const { cudaStreamDestroy(s); }
};
template <class T>
using PinnedArray = std::unique_ptr<T[], FreeHost>;

// A small seeded generator (splitmix64): fast enough to fill gigabytes of weights, and the same
// numbers on every platform, so a seed reproduces a run.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)

 private:
  uint64_t state_;
};

// Host images of device elements are raw 16-bit patterns in the config's dtype (bf16 or fp16).
inline uint16_t to_bits(float v, moegraph::DType t) {
  if (t == moegraph::DType::kFP16) return static_cast<__half_raw>(__float2half_rn(v)).x;
  return static_cast<__nv_bfloat16_raw>(__float2bfloat16_rn(v)).x;
}
inline float from_bits(uint16_t bits, moegraph::DType t) {
  if (t == moegraph::DType::kFP16) return __half2float(__half(__half_raw{bits}));
  __nv_bfloat16_raw raw;
  raw.x = bits;
  return __bfloat162float(__nv_bfloat16(raw));
}
// uniform(-scale, scale) in dtype `t`.
inline void fill_uniform(uint16_t* out, std::size_t n, float scale, moegraph::DType t, Rng& rng) {
  for (std::size_t i = 0; i < n; ++i) out[i] = to_bits(static_cast<float>(2.0 * rng.uniform() - 1.0) * scale, t);
}

// The server's parameters: allocated and owned here, read by every StepGraphs (none writes them in
// inference). Random, scaled by 1/sqrt(fan_in) so each layer keeps activations of order 1.
struct DeviceWeights {
  DeviceWeights(const moegraph::StepGraphsOptions& options, uint64_t seed);
  moegraph::StepWeights w;
  std::vector<std::unique_ptr<void, FreeDevice>> owned;
};

struct ServeParams {
  int device = 0;          // the device current when the StepGraphs was created
  int requests = 200;
  int64_t max_tokens = 0;  // at most the largest bucket
  int check_every = 10;    // check 1 of every K requests against the eager path; 0: never
  uint64_t seed = 1;
};

struct ThreadReport {
  std::vector<double> latency_us;     // per request: input copy start to output on the host
  int64_t tokens = 0;
  std::map<int64_t, int> bucket_uses;  // bucket capacity (tokens) -> requests served by it
  int checks_passed = 0, checks_failed = 0;
  uint64_t bitwise_different = 0;      // elements of checked outputs whose bits differ
  double max_abs_diff = 0.0;           // over checked outputs, graph vs eager
  uint64_t dropped = 0;                // (token, expert) assignments dropped by router.capacity_factor
  std::string first_failure;
};

// Set-up (stream, pinned buffers, the input pool) allocates and synchronizes, so it happens on the
// main thread before serving starts; run() is what the serving thread does. Destroy only after every
// thread has finished: freeing pinned memory synchronizes the whole device, which would stall the
// other threads' requests.
class ServingThread {
 public:
  ServingThread(moegraph::StepGraphs& graphs, const ServeParams& params);

  ThreadReport run();

 private:
  struct Request {
    int index;
    int64_t tokens, first_pool_row;
    int bucket;
  };
  int64_t draw_tokens();
  void enqueue_inputs(const Request& r, const moegraph::BucketIO& io);
  void check(const Request& r, ThreadReport& report);

  moegraph::StepGraphs& graphs_;
  ServeParams params_;
  moegraph::DType dtype_;
  int64_t hidden_, pool_rows_;
  Rng rng_;
  std::unique_ptr<CUstream_st, DestroyStream> stream_;
  cudaStream_t stream() const { return stream_.get(); }
  // Pinned, so the copies are truly asynchronous and overlap with other threads' work.
  PinnedArray<uint16_t> x_pool_;   // [pool_rows, hidden]: requests take random windows of it
  PinnedArray<int32_t> num_tokens_;
  PinnedArray<uint16_t> y_graph_;  // [max_tokens, hidden]
  PinnedArray<uint16_t> y_eager_;  // [max_tokens, hidden]
};

// Runs every ServingThread on a thread of its own, all at once; wall_s: from the first start to the
// last finish (the serving phase). An exception must not leave a thread (std::terminate): the first
// is rethrown here once all have finished, the others are printed.
std::vector<ThreadReport> serve_concurrently(const std::vector<std::unique_ptr<ServingThread>>& threads,
                                             double& wall_s);

}  // namespace server
