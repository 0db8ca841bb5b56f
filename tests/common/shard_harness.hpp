// Sharded expert weights against the unsharded step, for any transport: the harness drives the
// ranks of a data-parallel group this process holds (all W for emulated ranks on one GPU; one for a
// process per GPU over NCCL) and runs the unsharded StepGraphs on the full weights on every rank's
// batch alone. Then, bit for bit:
//   - each rank's y and dx equal the unsharded step's on its batch (the gather assembled the full
//     weights exactly);
//   - each rank's fp32 main_grad shard equals its initial random values plus, per step, the fp32 sum
//     over ranks (in rank order) of the unsharded gradients, on its own rows only; 16-bit dw and db
//     shards equal that sum rounded (written). Random data make every row distinct, so a row landing
//     on the wrong rank or offset fails.
// The cases cover both policies and units, rows not divisible by W, a rank holding no rows, 16-bit
// gradients, delayed wgrad, caller-given descriptors in a non-rank order and the mxfp8 recipe, with
// graph replays of new routings and token counts every step.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "graphs/sharded_weights.hpp"
#include "moegraph/error.hpp"
#include "moegraph/expert_parallel.hpp"
#include "moegraph/sharding.hpp"
#include "moegraph/step_graphs.hpp"
#include "testing/graph.hpp"
#include "tests/common/expect.hpp"
#include "tests/common/threads.hpp"

namespace moegraph::test {

struct ShardCase {
  const char* name;
  int ranks;
  ShardPolicy policy;
  ShardUnit unit;
  int experts, top_k;
  int64_t hidden, ffn, tokens;
  bool bias, main_grad, delay;
  bool reversed_w1 = false;  // the caller gives w1's descriptors: rank r holds the r-th block from the end
  bool mxfp8 = false;        // the mxfp8 recipe: each forward quantizes the gathered weights
};

inline const ShardCase kShardCases[] = {
    // name                         W  policy                  unit               E  k  H   F   T   bias  mg     delay
    {"w2_chunk_expert_mg", 2, ShardPolicy::kChunk, ShardUnit::kExpert, 5, 2, 64, 32, 24, true, true, false},
    // chunk of 4 experts over 3 ranks: 2, 2, 0 (the last rank holds nothing)
    {"w3_chunk_expert_empty_rank_delay", 3, ShardPolicy::kChunk, ShardUnit::kExpert, 4, 2, 64, 32, 20, true, true, true},
    // row unit: b2's 240 one-element rows over 4 ranks start at unaligned bytes; 16-bit gradients written
    {"w4_balanced_row_dw", 4, ShardPolicy::kBalanced, ShardUnit::kRow, 3, 2, 80, 48, 16, true, false, false},
    {"w2_balanced_row_mg_delay", 2, ShardPolicy::kBalanced, ShardUnit::kRow, 3, 1, 48, 16, 17, false, true, true},
    {"w3_given_reversed_w1", 3, ShardPolicy::kBalanced, ShardUnit::kExpert, 7, 2, 64, 32, 16, true, true, false, true},
    // the mxfp8 recipe (K and N multiples of 128); 16-bit gradients
    {"w2_chunk_expert_mxfp8", 2, ShardPolicy::kChunk, ShardUnit::kExpert, 5, 2, 128, 128, 40, false, false, false,
     false, true},
};

inline StepGraphsOptions shard_options(const ShardCase& c, int ranks, cudaStreamCaptureMode mode) {
  StepGraphsOptions o;
  MoeLayerOptions& l = o.layer;
  l.experts = c.experts, l.top_k = c.top_k, l.hidden = c.hidden, l.ffn = c.ffn, l.bias = c.bias;
  l.renormalize = true;
  l.training = true, l.main_grad_fp32 = c.main_grad, l.delay_wgrad = c.delay;
  if (c.mxfp8) l.recipe = Recipe::kMXFP8, l.row_align = 32;
  o.buckets = {c.tokens};
  o.sharding.ranks = ranks, o.sharding.policy = c.policy, o.sharding.unit = c.unit;
  o.capture_mode = mode;
  return o;
}

inline DeviceArray<uint16_t> upload_bits16(const std::vector<uint16_t>& v) {
  DeviceArray<uint16_t> a(v.size());
  a.upload(v);
  return a;
}

// One rank's batch of one step, on the device (uploaded before the ranks' threads start).
struct ShardBatch {
  DeviceArray<uint16_t> x, dy;
  DeviceArray<int32_t> count;
  int32_t tokens = 0;
};

// What the unsharded step gives on one batch.
struct ShardResult {
  Mat y, dx, grad[4], router_grad;
};

class ShardData {
 public:
  explicit ShardData(const ShardCase& c) : c_(c), rng_(test_seed(c.name)) {
    const int64_t e = c.experts, h = c.hidden, f = c.ffn;
    const DType dt = DType::kBF16;
    wr_ = to_device_bits(grid_values(rng_, e * h, 64, 1.0 / 256), dt);
    full_[0] = to_device_bits(random_values(rng_, e * 2 * f * h, 1.0 / std::sqrt(double(h)), dt), dt);
    full_[1] = to_device_bits(random_values(rng_, e * h * f, 1.0 / std::sqrt(double(f)), dt), dt);
    if (c.bias) {
      full_[2] = to_device_bits(random_values(rng_, e * 2 * f, 0.1, dt), dt);
      full_[3] = to_device_bits(random_values(rng_, e * h, 0.1, dt), dt);
    }
    tensors_ = c.bias ? 4 : 2;
  }

  const ShardCase& c() const { return c_; }
  int tensors() const { return tensors_; }
  const std::vector<uint16_t>& full(int t) const { return full_[t]; }
  const std::vector<uint16_t>& router() const { return wr_; }

  std::vector<ShardBatch> batches() {
    std::vector<ShardBatch> out(c_.ranks);
    const int64_t h = c_.hidden, t = c_.tokens;
    std::uniform_int_distribution<int32_t> count(0, static_cast<int32_t>(t));
    for (int r = 0; r < c_.ranks; ++r) {
      out[r].x = upload_bits16(to_device_bits(grid_values(rng_, t * h, 4, 0.25), DType::kBF16));
      out[r].dy = upload_bits16(to_device_bits(random_values(rng_, t * h, 1.0, DType::kBF16), DType::kBF16));
      out[r].tokens = r == 0 ? static_cast<int32_t>(t) : count(rng_);  // rank 0 full, the others random
      out[r].count = DeviceArray<int32_t>(1);
      out[r].count.upload({out[r].tokens});
    }
    return out;
  }

 private:
  ShardCase c_;
  std::mt19937_64 rng_;
  std::vector<uint16_t> wr_, full_[4];
  int tensors_ = 2;
};

// Copies a batch into a bucket's inputs, poisons its outputs, runs one training step (graphs) and
// copies y and dx out.
inline void shard_train_step(StepGraphs& g, const ShardBatch& b, const ShardCase& c, cudaStream_t st, DeviceArray<uint16_t>& y,
                DeviceArray<uint16_t>& dx) {
  const BucketIO io = g.io(0);
  const std::size_t bytes = static_cast<std::size_t>(c.tokens * c.hidden) * sizeof(uint16_t);
  MG_CUDA_CHECK(cudaMemcpyAsync(io.x, b.x.get(), bytes, cudaMemcpyDeviceToDevice, st));
  MG_CUDA_CHECK(cudaMemcpyAsync(io.dy, b.dy.get(), bytes, cudaMemcpyDeviceToDevice, st));
  MG_CUDA_CHECK(cudaMemcpyAsync(io.num_tokens, b.count.get(), sizeof(int32_t), cudaMemcpyDeviceToDevice, st));
  MG_CUDA_CHECK(cudaMemsetAsync(io.y, 0xff, bytes, st));
  MG_CUDA_CHECK(cudaMemsetAsync(io.dx, 0xff, bytes, st));
  g.forward_train(0, st);
  g.backward(0, st);
  if (c.delay) g.wgrad(0, st);
  MG_CUDA_CHECK(cudaMemcpyAsync(y.get(), io.y, bytes, cudaMemcpyDeviceToDevice, st));
  MG_CUDA_CHECK(cudaMemcpyAsync(dx.get(), io.dx, bytes, cudaMemcpyDeviceToDevice, st));
  g.check_device_errors(st);  // synchronizes
}

// The unsharded step (one GPU, no expert parallelism) on one batch of up to c.tokens tokens at a
// time, gradients from zero each time.
class UnshardedStep {
 public:
  explicit UnshardedStep(const ShardData& run) : UnshardedStep(run.c(), run.router(), run.tensors(), [&](int t) -> auto& {
    return run.full(t);
  }) {}
  // The case's shape with the given router and full expert tensors (w1, w2 and, with bias, b1, b2).
  template <class Full>
  UnshardedStep(const ShardCase& c, const std::vector<uint16_t>& router, int tensors, Full full) : c_(c) {
    const StepGraphsOptions o = shard_options(c_, 1, cudaStreamCaptureModeGlobal);
    const int64_t e = c_.experts, h = c_.hidden, f = c_.ffn;
    wr_ = upload_bits16(router);
    for (int t = 0; t < tensors; ++t) w_[t] = upload_bits16(full(t));
    const std::size_t sizes[4] = {std::size_t(e * 2 * f * h), std::size_t(e * h * f), std::size_t(e * 2 * f),
                                  std::size_t(e * h)};
    for (int t = 0; t < 4; ++t) d_[t] = DeviceArray<uint16_t>(t >= 2 || !c_.main_grad ? sizes[t] : 0);
    for (int t = 0; t < 2; ++t) mg_[t] = DeviceArray<float>(c_.main_grad ? sizes[t] : 0);
    mgr_ = DeviceArray<float>(c_.main_grad ? e * h : 0);
    dr_ = DeviceArray<uint16_t>(c_.main_grad ? 0 : e * h);
    y_ = DeviceArray<uint16_t>(c_.tokens * h), dx_ = DeviceArray<uint16_t>(c_.tokens * h);
    StepWeights w;
    w.router = wr_.get(), w.w1 = w_[0].get(), w.w2 = w_[1].get();
    if (c_.bias) w.b1 = w_[2].get(), w.b2 = w_[3].get(), w.db1 = d_[2].get(), w.db2 = d_[3].get();
    if (c_.main_grad) w.main_grad1 = mg_[0].get(), w.main_grad2 = mg_[1].get(), w.main_grad_router = mgr_.get();
    else w.dw1 = d_[0].get(), w.dw2 = d_[1].get(), w.d_router = dr_.get();
    step_ = std::make_unique<StepGraphs>(o, w);
    step_->weights_changed(stream_.get());  // the mxfp8 recipe's copies of the weights uploaded above
  }

  ShardResult run(const ShardBatch& b) {
    for (auto* a : {&mg_[0], &mg_[1], &mgr_})
      if (a->size()) memset_and_wait(a->get(), 0, a->size() * sizeof(float));
    for (auto& a : d_)
      if (a.size()) a.poison();
    shard_train_step(*step_, b, c_, stream_.get(), y_, dx_);
    ShardResult r;
    const int64_t n = static_cast<int64_t>(b.tokens) * c_.hidden;
    const Mat y = download_bits(y_, DType::kBF16);
    r.y = Mat(y.begin(), y.begin() + n);
    const Mat dx = download_bits(dx_, DType::kBF16);
    r.dx = Mat(dx.begin(), dx.begin() + n);
    for (int t = 0; t < (c_.bias ? 4 : 2); ++t)
      r.grad[t] = t < 2 && c_.main_grad ? download_floats(mg_[t]) : download_bits(d_[t], DType::kBF16);
    r.router_grad = c_.main_grad ? download_floats(mgr_) : download_bits(dr_, DType::kBF16);
    return r;
  }

 private:
  ShardCase c_;
  DeviceArray<uint16_t> wr_, w_[4], d_[4], dr_, y_, dx_;
  DeviceArray<float> mg_[2], mgr_;
  testing::Stream stream_;
  std::unique_ptr<StepGraphs> step_;
};

// One emulated rank: its shards, gradients, outputs and step.
struct ShardRank {
  int rank = 0;
  std::shared_ptr<EpComm> comm;
  Shard shard[4];
  int64_t row_elements[4] = {};
  DeviceArray<uint16_t> w[4], d[4], dr, y, dx;
  DeviceArray<float> mg[2], mgr;
  std::vector<float> mg_expected[2];
  testing::Stream stream;
  std::unique_ptr<StepGraphs> step;
};

// The policy's blocks handed out from the end: rank r holds block W - 1 - r.
inline Shard given_w1(const ShardCase& c, int rank) { return shard_for(c.policy, c.experts, c.ranks, c.ranks - 1 - rank); }

// The ranks `comms` drive (all of them for emulated ranks, one per process over NCCL) against the
// unsharded step, which every process runs on every rank's batch (the same seed gives every process
// the same data). Three steps, each with new batches and token counts.
inline void run_shard_case(const ShardCase& c, const std::vector<std::shared_ptr<EpComm>>& comms,
                           cudaStreamCaptureMode mode) {
  SCOPED_TRACE(c.name);
  ShardData data(c);
  UnshardedStep whole(data);
  const StepGraphsOptions o = shard_options(c, c.ranks, mode);
  const auto shapes = sharded_tensor_shapes(o);
  std::vector<std::unique_ptr<ShardRank>> ranks;
  for (const auto& comm : comms) {
    MG_CHECK(comm->ranks() == c.ranks, "case ", c.name, " has ", c.ranks, " ranks, the communicator ", comm->ranks());
    const int r = comm->rank();
    // Each rank's initial main_grad from its own stream of numbers, whichever ranks this process drives.
    std::mt19937_64 rng(test_seed(c.name) + 1 + static_cast<uint64_t>(r));
    auto k = std::make_unique<ShardRank>();
    k->rank = r, k->comm = comm;
    for (int t = 0; t < data.tensors(); ++t) {
      k->row_elements[t] = shapes[t].row_elements;
      k->shard[t] = t == 0 && c.reversed_w1 ? given_w1(c, r) : shard_for(c.policy, shapes[t].global_rows, c.ranks, r);
      const int64_t first = k->shard[t].first_row * k->row_elements[t], count = k->shard[t].rows * k->row_elements[t];
      const auto& full = data.full(t);
      k->w[t] = upload_bits16(std::vector<uint16_t>(full.begin() + first, full.begin() + first + count));
      if (t < 2 && c.main_grad) {
        const Mat init = random_values(rng, static_cast<std::size_t>(count), 1.0, DType::kFP32);
        k->mg_expected[t].assign(init.begin(), init.end());
        k->mg[t] = DeviceArray<float>(count);
        k->mg[t].upload(k->mg_expected[t]);
      } else {
        k->d[t] = DeviceArray<uint16_t>(count);
      }
    }
    k->dr = DeviceArray<uint16_t>(c.main_grad ? 0 : c.experts * c.hidden);
    k->mgr = DeviceArray<float>(c.main_grad ? c.experts * c.hidden : 0);
    if (c.main_grad) memset_and_wait(k->mgr.get(), 0, k->mgr.size() * sizeof(float));
    k->y = DeviceArray<uint16_t>(c.tokens * c.hidden), k->dx = DeviceArray<uint16_t>(c.tokens * c.hidden);
    ranks.push_back(std::move(k));
  }
  const int driven = static_cast<int>(ranks.size());
  DeviceArray<uint16_t> router = upload_bits16(data.router());
  on_threads(driven, [&](int i) {
    ShardRank& k = *ranks[i];
    StepWeights w;
    w.router = router.get();
    void** weight[4] = {&w.w1, &w.w2, &w.b1, &w.b2};
    for (int t = 0; t < data.tensors(); ++t) *weight[t] = k.w[t].get();
    if (c.main_grad) w.main_grad1 = k.mg[0].get(), w.main_grad2 = k.mg[1].get(), w.main_grad_router = k.mgr.get();
    else w.dw1 = k.d[0].get(), w.dw2 = k.d[1].get(), w.d_router = k.dr.get();
    if (c.bias) w.db1 = k.d[2].get(), w.db2 = k.d[3].get();
    if (c.reversed_w1) w.shards.w1 = k.shard[0];
    k.step = std::make_unique<StepGraphs>(o, w, nullptr, k.comm);
  });

  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE(detail::concat("step ", step));
    const std::vector<ShardBatch> batches = data.batches();
    std::vector<ShardResult> want;
    for (const ShardBatch& b : batches) want.push_back(whole.run(b));
    for (auto& k : ranks)
      for (int t = 0; t < data.tensors(); ++t)
        if (k->d[t].size()) k->d[t].poison();
    on_threads(driven, [&](int i) {
      ShardRank& k = *ranks[i];
      shard_train_step(*k.step, batches[k.rank], c, k.stream.get(), k.y, k.dx);
    });

    for (auto& kp : ranks) {
      ShardRank& k = *kp;
      const int r = k.rank;
      const int64_t n = static_cast<int64_t>(batches[r].tokens) * c.hidden;
      const Mat y = download_bits(k.y, DType::kBF16), dx = download_bits(k.dx, DType::kBF16);
      EXPECT_TRUE(same_bits(Mat(y.begin(), y.begin() + n), want[r].y)) << "rank " << r << ": y";
      EXPECT_TRUE(same_bits(Mat(dx.begin(), dx.begin() + n), want[r].dx)) << "rank " << r << ": dx";
      if (step == 0) {  // the router is replicated: its gradient is the rank's own (summed by the caller)
        const Mat rg = c.main_grad ? download_floats(k.mgr) : download_bits(k.dr, DType::kBF16);
        EXPECT_TRUE(same_bits(rg, want[r].router_grad)) << "rank " << r << ": router gradient";
      }
      for (int t = 0; t < data.tensors(); ++t) {
        const int64_t first = k.shard[t].first_row * k.row_elements[t], count = k.shard[t].rows * k.row_elements[t];
        const bool fp32 = t < 2 && c.main_grad;
        const Mat got = fp32 ? download_floats(k.mg[t]) : download_bits(k.d[t], DType::kBF16);
        ASSERT_EQ(got.size(), static_cast<std::size_t>(count));
        std::size_t bad = 0, first_bad = 0;
        for (int64_t i = 0; i < count; ++i) {
          // The reduction's order: rank 0's gradient, then each next rank's added, in fp32.
          float s = static_cast<float>(want[0].grad[t][first + i]);
          for (int p = 1; p < c.ranks; ++p) s += static_cast<float>(want[p].grad[t][first + i]);
          double expected;
          if (fp32) {
            k.mg_expected[t][i] = k.mg_expected[t][i] + s;
            expected = k.mg_expected[t][i];
          } else {
            expected = round_to(s, DType::kBF16);
          }
          if (!(got[i] == expected) && bad++ == 0) first_bad = static_cast<std::size_t>(i);
        }
        EXPECT_EQ(bad, 0u) << "rank " << r << ", tensor " << t << " (rows [" << k.shard[t].first_row << ", "
                           << k.shard[t].first_row + k.shard[t].rows << ")): " << bad << " of " << count
                           << " elements differ, the first at " << first_bad;
      }
    }
  }
}

}  // namespace moegraph::test
