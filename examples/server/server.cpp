#include "server.hpp"

#include <moegraph/error.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <thread>

namespace server {

namespace {
// 0xFFFF is a NaN in both bf16 and fp16: an output element the step failed to write fails the check.
constexpr int kPoisonByte = 0xFF;
// Graph and eager run the same kernels, so they should agree bit for bit; this only forgives a
// difference far below one bf16/fp16 step of the value.
constexpr double kTolerance = 1e-6;

template <class T>
PinnedArray<T> pinned(std::size_t count) {
  void* p = nullptr;
  cuda_check(cudaMallocHost(&p, count * sizeof(T)), "cudaMallocHost");
  return PinnedArray<T>(static_cast<T*>(p));
}

// `count` elements of uniform(-scale, scale), generated on the host in blocks seeded by (seed, block)
// on several cores, so the values depend on the seed alone; staged in chunks to bound host memory.
void* upload_random(std::vector<std::unique_ptr<void, FreeDevice>>& owned, std::size_t count, float scale,
                    moegraph::DType t, uint64_t seed) {
  void* dst = nullptr;
  cuda_check(cudaMalloc(&dst, count * sizeof(uint16_t)), "cudaMalloc (weights)");
  owned.emplace_back(dst);
  constexpr std::size_t kBlock = std::size_t{1} << 20, kChunk = 64 * kBlock;
  std::vector<uint16_t> host(std::min(count, kChunk));
  const unsigned workers = std::clamp(std::thread::hardware_concurrency(), 1u, 16u);
  for (std::size_t chunk = 0; chunk < count; chunk += kChunk) {
    const std::size_t n = std::min(kChunk, count - chunk);
    std::atomic<std::size_t> next{0};
    auto work = [&] {
      for (std::size_t b; (b = next.fetch_add(kBlock)) < n;) {
        Rng rng(Rng(seed ^ ((chunk + b) / kBlock + 1) * 0xd1b54a32d192ed03ull).next());
        fill_uniform(host.data() + b, std::min(kBlock, n - b), scale, t, rng);
      }
    };
    std::vector<std::thread> pool;
    for (unsigned w = 1; w < workers; ++w) pool.emplace_back(work);
    work();
    for (std::thread& th : pool) th.join();
    cuda_check(cudaMemcpy(static_cast<uint16_t*>(dst) + chunk, host.data(), n * sizeof(uint16_t),
                          cudaMemcpyHostToDevice),
               "copy weights");
  }
  return dst;
}
}  // namespace

DeviceWeights::DeviceWeights(const moegraph::StepGraphsOptions& o, uint64_t seed) {
  const moegraph::MoeLayerOptions& l = o.layer;
  const std::size_t e = l.experts, h = l.hidden, f = l.ffn;
  const float in_h = 1.0f / std::sqrt(static_cast<float>(h)), in_f = 1.0f / std::sqrt(static_cast<float>(f));
  uint64_t tensor = 0;  // each tensor its own numbers
  auto upload = [&](std::size_t count, float scale) {
    return upload_random(owned, count, scale, l.dtype, Rng(seed + 0x9e3779b97f4a7c15ull * ++tensor).next());
  };
  w.router = upload(e * h, in_h);      // [experts, hidden]
  w.w1 = upload(e * 2 * f * h, in_h);  // [experts, 2 * ffn, hidden]
  w.w2 = upload(e * h * f, in_f);      // [experts, hidden, ffn]
  if (l.bias) {
    w.b1 = upload(e * 2 * f, in_h);    // [experts, 2 * ffn]
    w.b2 = upload(e * h, in_f);        // [experts, hidden]
  }
}

ServingThread::ServingThread(moegraph::StepGraphs& graphs, const ServeParams& params)
    : graphs_(graphs),
      params_(params),
      dtype_(graphs.options().layer.dtype),
      hidden_(graphs.options().layer.hidden),
      pool_rows_(2 * params.max_tokens),
      rng_(params.seed) {
  cudaStream_t s = nullptr;
  cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  stream_.reset(s);
  const std::size_t out_elems = static_cast<std::size_t>(params.max_tokens * hidden_);
  x_pool_ = pinned<uint16_t>(static_cast<std::size_t>(pool_rows_ * hidden_));
  num_tokens_ = pinned<int32_t>(1);
  y_graph_ = pinned<uint16_t>(out_elems);
  y_eager_ = pinned<uint16_t>(out_elems);
  // Activations of order 1, as a normalized hidden state would be.
  fill_uniform(x_pool_.get(), static_cast<std::size_t>(pool_rows_ * hidden_), 1.0f, dtype_, rng_);
}

// Log-uniform in [1, max_tokens]: servers see many small batches and a few large ones, and every
// bucket, the smallest included, gets traffic.
int64_t ServingThread::draw_tokens() {
  const double t = std::exp(rng_.uniform() * std::log(static_cast<double>(params_.max_tokens) + 1.0));
  return std::clamp<int64_t>(static_cast<int64_t>(t), 1, params_.max_tokens);
}

// The request's rows and its token count, from pinned host memory on this thread's stream. The
// host value must stay unchanged until the copy has run: each request synchronizes before the next.
void ServingThread::enqueue_inputs(const Request& r, const moegraph::BucketIO& io) {
  const std::size_t row_bytes = static_cast<std::size_t>(hidden_) * sizeof(uint16_t);
  num_tokens_[0] = static_cast<int32_t>(r.tokens);
  cuda_check(cudaMemcpyAsync(io.x, x_pool_.get() + r.first_pool_row * hidden_, r.tokens * row_bytes,
                             cudaMemcpyHostToDevice, stream()),
             "copy x");
  cuda_check(cudaMemcpyAsync(io.num_tokens, num_tokens_.get(), sizeof(int32_t), cudaMemcpyHostToDevice, stream()),
             "copy num_tokens");
}

ThreadReport ServingThread::run() {
  // The handle is bound to the device current at its creation; a new thread starts on device 0.
  cuda_check(cudaSetDevice(params_.device), "cudaSetDevice");
  ThreadReport report;
  report.latency_us.reserve(params_.requests);
  const std::size_t row_bytes = static_cast<std::size_t>(hidden_) * sizeof(uint16_t);
  for (int i = 0; i < params_.requests; ++i) {
    Request r;
    r.index = i;
    r.tokens = draw_tokens();
    r.first_pool_row = std::min(pool_rows_ - r.tokens,
                                static_cast<int64_t>(rng_.uniform() * static_cast<double>(pool_rows_ - r.tokens + 1)));
    r.bucket = graphs_.bucket_for(r.tokens);
    const moegraph::BucketIO io = graphs_.io(r.bucket);
    const bool checked = params_.check_every > 0 && i % params_.check_every == 0;
    if (checked) {  // before the clock starts: poisoning is the check's cost, not the request's
      cuda_check(cudaMemsetAsync(io.y, kPoisonByte, r.tokens * row_bytes, stream()), "poison y");
      cuda_check(cudaStreamSynchronize(stream()), "cudaStreamSynchronize");
    }

    const auto start = std::chrono::steady_clock::now();
    enqueue_inputs(r, io);
    graphs_.forward(r.bucket, stream());  // one graph launch: router, dispatch, experts, combine
    cuda_check(cudaMemcpyAsync(y_graph_.get(), io.y, r.tokens * row_bytes, cudaMemcpyDeviceToHost, stream()), "copy y");
    cuda_check(cudaStreamSynchronize(stream()), "cudaStreamSynchronize");
    const auto end = std::chrono::steady_clock::now();

    report.latency_us.push_back(std::chrono::duration<double, std::micro>(end - start).count());
    report.tokens += r.tokens;
    ++report.bucket_uses[io.tokens];
    if (checked) check(r, report);
  }
  // Invalid device inputs (a token count past the bucket) are recorded on the device, never
  // clipped; this throws if any request raised one.
  graphs_.check_device_errors(stream());
  report.dropped = graphs_.read_dropped(stream());
  return report;
}

// The same input again through the eager path (the kernels without the graph), compared element by
// element with what the graph returned.
void ServingThread::check(const Request& r, ThreadReport& report) {
  const moegraph::BucketIO io = graphs_.io(r.bucket);
  const std::size_t row_bytes = static_cast<std::size_t>(hidden_) * sizeof(uint16_t);
  cuda_check(cudaMemsetAsync(io.y, kPoisonByte, r.tokens * row_bytes, stream()), "poison y");
  enqueue_inputs(r, io);
  graphs_.run_eager(r.bucket, moegraph::StepPhase::kForward, stream());
  cuda_check(cudaMemcpyAsync(y_eager_.get(), io.y, r.tokens * row_bytes, cudaMemcpyDeviceToHost, stream()), "copy y");
  cuda_check(cudaStreamSynchronize(stream()), "cudaStreamSynchronize");

  const std::size_t n = static_cast<std::size_t>(r.tokens * hidden_);
  std::size_t bad = 0, first_bad = n, nonzero = 0;
  for (std::size_t e = 0; e < n; ++e) {
    const float g = from_bits(y_graph_[e], dtype_), ref = from_bits(y_eager_[e], dtype_);
    if (g != 0.0f) ++nonzero;
    if (y_graph_[e] == y_eager_[e] && std::isfinite(g)) continue;
    if (y_graph_[e] != y_eager_[e]) ++report.bitwise_different;
    const double diff = std::fabs(static_cast<double>(g) - ref);
    if (std::isfinite(diff)) report.max_abs_diff = std::max(report.max_abs_diff, diff);
    if (!std::isfinite(diff) || diff > kTolerance * std::max(1.0, std::fabs(static_cast<double>(ref)))) {
      if (bad++ == 0) first_bad = e;
    }
  }
  // Random weights and inputs never give an all-zero output: that would mean nothing was computed.
  if (bad == 0 && nonzero > 0) {
    ++report.checks_passed;
    return;
  }
  ++report.checks_failed;
  if (!report.first_failure.empty()) return;
  std::string what = "the output is all zero";
  if (bad > 0) {
    const std::size_t row = first_bad / hidden_, col = first_bad % hidden_;
    what = std::to_string(bad) + " of " + std::to_string(n) + " elements differ or are not finite; first at row " +
           std::to_string(row) + ", column " + std::to_string(col) + ": graph " +
           std::to_string(from_bits(y_graph_[first_bad], dtype_)) + ", eager " +
           std::to_string(from_bits(y_eager_[first_bad], dtype_));
  }
  report.first_failure = "request " + std::to_string(r.index) + " (" + std::to_string(r.tokens) +
                         " tokens, bucket of " + std::to_string(io.tokens) + "): " + what;
}

std::vector<ThreadReport> serve_concurrently(const std::vector<std::unique_ptr<ServingThread>>& threads,
                                             double& wall_s) {
  std::vector<ThreadReport> reports(threads.size());
  std::vector<std::exception_ptr> errors(threads.size());
  const auto start = std::chrono::steady_clock::now();
  {
    std::vector<std::thread> pool;
    for (std::size_t t = 0; t < threads.size(); ++t)
      pool.emplace_back([&, t] {
        try {
          reports[t] = threads[t]->run();
        } catch (...) {
          errors[t] = std::current_exception();
        }
      });
    for (std::thread& th : pool) th.join();
  }
  wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::exception_ptr first;
  for (std::size_t t = 0; t < threads.size(); ++t) {
    if (!errors[t]) continue;
    if (!first) {
      first = errors[t];
      continue;
    }
    try {
      std::rethrow_exception(errors[t]);
    } catch (const moegraph::Error& e) {
      std::fprintf(stderr, "serving thread %zu failed too: %s\n", t, e.message().c_str());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "serving thread %zu failed too: %s\n", t, e.what());
    }
  }
  if (first) std::rethrow_exception(first);
  return reports;
}

}  // namespace server
