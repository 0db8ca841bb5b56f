// Sharded expert weights under expert parallelism, for any transport: ranks form an R x W grid,
// rank (i, j) holding expert-parallel index i (experts [i·E/R, (i+1)·E/R)) and data-parallel index j
// (its shard of those experts' rows). `ep` joins the R ranks of one j, `dp` the W ranks of one i.
// The harness drives the grid positions this process holds (all of them for emulated ranks on one
// GPU; one per process over NCCL) and runs, for every j, the whole layer on one GPU (no expert
// parallelism, no sharding) on data-parallel group j's batch: its R ranks' tokens concatenated.
// Then, per rank (i, j):
//   - y equals, bit for bit, the whole layer's rows of its tokens (expert parallelism computes every
//     expert's rows in the whole layer's order); dx agrees within the chained bf16 tolerance (the
//     combine's sums may round differently);
//   - its weight-gradient shard equals its rows of experts [i·E/R, ...) in the fp32 sum over j' (in
//     rank order) of the whole layers' gradients: main_grad adds it to its random initial values,
//     16-bit dw is written rounded. Bias gradients are compared within the tolerance.
// Random data make every row distinct, so a row landing on the wrong rank, expert or offset fails.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "tests/common/shard_harness.hpp"

namespace moegraph::test {

struct EpShardCase {
  const char* name;
  int ep, dp;  // R x W
  ShardPolicy policy;
  ShardUnit unit;
  int experts, top_k;
  int64_t hidden, ffn, tokens;  // tokens per rank
  bool bias, main_grad, delay;
  bool mxfp8 = false;  // the mxfp8 recipe on both sides (the whole layers quantize as the ranks do)

  // The shape of one data-parallel group's whole layer, and of one rank's step.
  ShardCase whole() const {
    return {name, 1, policy, unit, experts, top_k, hidden, ffn, ep * tokens, bias, main_grad, delay, false, mxfp8};
  }
  ShardCase rank_step() const {
    return {name, dp, policy, unit, experts, top_k, hidden, ffn, tokens, bias, main_grad, delay, false, mxfp8};
  }
};

inline const EpShardCase kEpShardCases[] = {
    // name                               R  W  policy                  unit               E  k  H    F   T   bias   mg     delay
    // 3 local experts over 2 ranks: 2, 1
    {"ep2_dp2_chunk_expert_mg", 2, 2, ShardPolicy::kChunk, ShardUnit::kExpert, 6, 2, 128, 64, 24, false, true, false},
    // 2 local experts over 3 ranks: 1, 1, 0 (a rank holds nothing); delayed wgrad
    {"ep2_dp3_chunk_expert_empty_delay", 2, 3, ShardPolicy::kChunk, ShardUnit::kExpert, 4, 2, 64, 32, 20, false, true,
     true},
    // each local expert's rows spread over the ranks; 16-bit gradients written; biases
    {"ep2_dp2_balanced_row_dw_bias", 2, 2, ShardPolicy::kBalanced, ShardUnit::kRow, 8, 2, 128, 64, 16, true, false,
     false},
    // 8 ranks: 3 local experts over 2 ranks (2, 1); delayed wgrad
    {"ep4_dp2_balanced_expert_mg_delay", 4, 2, ShardPolicy::kBalanced, ShardUnit::kExpert, 12, 2, 64, 32, 16, false,
     true, true},
    // sharding, expert parallelism and the mxfp8 recipe together (K and N multiples of 128): each
    // rank's forward quantizes its gathered local experts; 2 local experts over 2 ranks; main_grad
    {"ep2_dp2_chunk_expert_mxfp8_mg", 2, 2, ShardPolicy::kChunk, ShardUnit::kExpert, 4, 2, 128, 128, 40, false, true,
     false, true},
};

// One grid position this process drives, with its two communicators.
struct GridRank {
  int ep_index = 0, dp_index = 0;
  std::shared_ptr<EpComm> ep, dp;
};

inline StepGraphsOptions ep_shard_options(const EpShardCase& c, cudaStreamCaptureMode mode) {
  StepGraphsOptions o = shard_options(c.rank_step(), c.dp, mode);
  o.layer.expert_parallel = c.ep;
  return o;
}

namespace ep_shard_detail {

// One driven rank: its shards, gradients, outputs and step.
struct Rank {
  GridRank at;
  Shard shard[4];
  int64_t row_elements[4] = {}, local_first[4] = {};  // local_first: the rank's experts' first element
  DeviceArray<uint16_t> w[4], d[4], dr, y, dx;
  DeviceArray<float> mg[2], mgr;
  std::vector<float> mg_expected[2];
  testing::Stream stream;
  std::unique_ptr<StepGraphs> step;
};

// Rank batches of one step for every grid position, and each data-parallel group's concatenation.
struct StepData {
  std::vector<std::vector<ShardBatch>> rank;  // [j][i]
  std::vector<ShardBatch> group;               // [j]
  std::vector<std::vector<int64_t>> first;     // [j][i]: the rank's first token in the group's batch
};

inline StepData draw_step(const EpShardCase& c, std::mt19937_64& rng) {
  const int64_t h = c.hidden, t = c.tokens;
  const DType dt = DType::kBF16;
  StepData s;
  s.rank.resize(c.dp), s.group.resize(c.dp), s.first.resize(c.dp);
  std::uniform_int_distribution<int32_t> count(0, static_cast<int32_t>(t));
  for (int j = 0; j < c.dp; ++j) {
    std::vector<uint16_t> gx(static_cast<std::size_t>(c.ep * t * h), 0), gdy(gx.size(), 0);
    int64_t n = 0;
    for (int i = 0; i < c.ep; ++i) {
      const std::vector<uint16_t> x = to_device_bits(grid_values(rng, t * h, 4, 0.25), dt);
      const std::vector<uint16_t> dy = to_device_bits(random_values(rng, t * h, 1.0, dt), dt);
      ShardBatch b;
      b.tokens = i == 0 && j == 0 ? static_cast<int32_t>(t) : count(rng);  // one rank full, the others random
      b.x = upload_bits16(x), b.dy = upload_bits16(dy);
      b.count = DeviceArray<int32_t>(1);
      b.count.upload({b.tokens});
      std::copy(x.begin(), x.begin() + b.tokens * h, gx.begin() + n * h);
      std::copy(dy.begin(), dy.begin() + b.tokens * h, gdy.begin() + n * h);
      s.first[j].push_back(n);
      n += b.tokens;
      s.rank[j].push_back(std::move(b));
    }
    ShardBatch& g = s.group[j];
    g.tokens = static_cast<int32_t>(n);
    g.x = upload_bits16(gx), g.dy = upload_bits16(gdy);
    g.count = DeviceArray<int32_t>(1);
    g.count.upload({g.tokens});
  }
  return s;
}

}  // namespace ep_shard_detail

// The grid positions `driven` of case `c` against the whole layers. Three steps, each with new
// batches and token counts.
inline void run_ep_shard_case(const EpShardCase& c, const std::vector<GridRank>& driven, cudaStreamCaptureMode mode) {
  using ep_shard_detail::Rank;
  SCOPED_TRACE(c.name);
  MG_CHECK(c.experts % c.ep == 0, "case ", c.name, ": ", c.ep, " ranks must divide ", c.experts, " experts");
  std::mt19937_64 rng(test_seed(c.name));
  const int64_t e = c.experts, h = c.hidden, f = c.ffn, el = e / c.ep;
  const DType dt = DType::kBF16;
  const std::vector<uint16_t> router = to_device_bits(grid_values(rng, e * h, 64, 1.0 / 256), dt);
  std::vector<uint16_t> full[4];
  full[0] = to_device_bits(random_values(rng, e * 2 * f * h, 1.0 / std::sqrt(double(h)), dt), dt);
  full[1] = to_device_bits(random_values(rng, e * h * f, 1.0 / std::sqrt(double(f)), dt), dt);
  if (c.bias) {
    full[2] = to_device_bits(random_values(rng, e * 2 * f, 0.1, dt), dt);
    full[3] = to_device_bits(random_values(rng, e * h, 0.1, dt), dt);
  }
  const int tensors = c.bias ? 4 : 2;
  const int64_t per_expert[4] = {2 * f * h, h * f, 2 * f, h};  // elements of one expert's slice
  UnshardedStep whole(c.whole(), router, tensors, [&](int t) -> auto& { return full[t]; });

  const StepGraphsOptions o = ep_shard_options(c, mode);
  const auto shapes = sharded_tensor_shapes(o);
  std::vector<std::unique_ptr<Rank>> ranks;
  for (const GridRank& at : driven) {
    MG_CHECK(at.ep->ranks() == c.ep && at.dp->ranks() == c.dp && at.ep->rank() == at.ep_index &&
                 at.dp->rank() == at.dp_index,
             "case ", c.name, ": the communicators do not match grid position (", at.ep_index, ", ", at.dp_index, ")");
    std::mt19937_64 init(test_seed(c.name) + 1 + static_cast<uint64_t>(at.dp_index * c.ep + at.ep_index));
    auto k = std::make_unique<Rank>();
    k->at = at;
    for (int t = 0; t < tensors; ++t) {
      k->row_elements[t] = shapes[t].row_elements;
      k->shard[t] = shard_for(c.policy, shapes[t].global_rows, c.dp, at.dp_index);
      k->local_first[t] = at.ep_index * el * per_expert[t];
      const int64_t first = k->local_first[t] + k->shard[t].first_row * k->row_elements[t];
      const int64_t count = k->shard[t].rows * k->row_elements[t];
      k->w[t] = upload_bits16(std::vector<uint16_t>(full[t].begin() + first, full[t].begin() + first + count));
      if (t < 2 && c.main_grad) {
        const Mat v = random_values(init, static_cast<std::size_t>(count), 1.0, DType::kFP32);
        k->mg_expected[t].assign(v.begin(), v.end());
        k->mg[t] = DeviceArray<float>(count);
        k->mg[t].upload(k->mg_expected[t]);
      } else {
        k->d[t] = DeviceArray<uint16_t>(count);
      }
    }
    k->dr = DeviceArray<uint16_t>(c.main_grad ? 0 : e * h);
    k->mgr = DeviceArray<float>(c.main_grad ? e * h : 0);
    if (c.main_grad) memset_and_wait(k->mgr.get(), 0, k->mgr.size() * sizeof(float));
    k->y = DeviceArray<uint16_t>(c.tokens * h), k->dx = DeviceArray<uint16_t>(c.tokens * h);
    ranks.push_back(std::move(k));
  }
  const int n = static_cast<int>(ranks.size());
  DeviceArray<uint16_t> router_d = upload_bits16(router);
  on_threads(n, [&](int r) {
    Rank& k = *ranks[r];
    StepWeights w;
    w.router = router_d.get();
    void** weight[4] = {&w.w1, &w.w2, &w.b1, &w.b2};
    for (int t = 0; t < tensors; ++t) *weight[t] = k.w[t].get();
    if (c.main_grad) w.main_grad1 = k.mg[0].get(), w.main_grad2 = k.mg[1].get(), w.main_grad_router = k.mgr.get();
    else w.dw1 = k.d[0].get(), w.dw2 = k.d[1].get(), w.d_router = k.dr.get();
    if (c.bias) w.db1 = k.d[2].get(), w.db2 = k.d[3].get();
    k.step = std::make_unique<StepGraphs>(o, w, k.at.ep, k.at.dp);
  });

  const ShardCase step_case = c.rank_step();
  const Tolerance tol = chain_tolerance_for(dt);
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE(detail::concat("step ", step));
    const ep_shard_detail::StepData data = ep_shard_detail::draw_step(c, rng);
    std::vector<ShardResult> want;  // per data-parallel group
    for (const ShardBatch& g : data.group) want.push_back(whole.run(g));
    for (auto& k : ranks)
      for (int t = 0; t < tensors; ++t)
        if (k->d[t].size()) k->d[t].poison();
    on_threads(n, [&](int r) {
      Rank& k = *ranks[r];
      shard_train_step(*k.step, data.rank[k.at.dp_index][k.at.ep_index], step_case, k.stream.get(), k.y, k.dx);
    });

    for (auto& kp : ranks) {
      Rank& k = *kp;
      const int i = k.at.ep_index, j = k.at.dp_index;
      const std::string at = detail::concat("rank (", i, ", ", j, ")");
      const int64_t rows = data.rank[j][i].tokens, first = data.first[j][i];
      const Mat y = download_bits(k.y, dt), dx = download_bits(k.dx, dt);
      const auto part = [&](const Mat& m) { return Mat(m.begin() + first * h, m.begin() + (first + rows) * h); };
      EXPECT_TRUE(same_bits(Mat(y.begin(), y.begin() + rows * h), part(want[j].y))) << at << ": y";
      EXPECT_TRUE(passed(all_close(at + " dx", Mat(dx.begin(), dx.begin() + rows * h), part(want[j].dx), h, {}, tol)));
      for (int t = 0; t < tensors; ++t) {
        const int64_t first_el = k.local_first[t] + k.shard[t].first_row * k.row_elements[t];
        const int64_t count = k.shard[t].rows * k.row_elements[t];
        const bool fp32 = t < 2 && c.main_grad;
        const Mat got = fp32 ? download_floats(k.mg[t]) : download_bits(k.d[t], dt);
        ASSERT_EQ(got.size(), static_cast<std::size_t>(count));
        Mat expected(static_cast<std::size_t>(count));
        for (int64_t x = 0; x < count; ++x) {
          // The reduction's order: data-parallel rank 0's gradient, then each next rank's, in fp32.
          float s = static_cast<float>(want[0].grad[t][first_el + x]);
          for (int p = 1; p < c.dp; ++p) s += static_cast<float>(want[p].grad[t][first_el + x]);
          if (fp32) expected[x] = k.mg_expected[t][x] = k.mg_expected[t][x] + s;
          else expected[x] = round_to(s, dt);
        }
        const std::string what = detail::concat(at, " tensor ", t, " (rows [", k.shard[t].first_row, ", ",
                                                k.shard[t].first_row + k.shard[t].rows, ") of its experts)");
        if (t < 2) {
          EXPECT_TRUE(same_bits(got, expected)) << what;
        } else if (count > 0) {
          EXPECT_TRUE(passed(all_close(what, got, expected, 1, {}, tol)));
        }
      }
    }
  }
}

}  // namespace moegraph::test
