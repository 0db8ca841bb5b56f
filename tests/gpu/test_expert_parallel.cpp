// Expert parallelism on emulated ranks (R layers in this process on one GPU, each on its own stream,
// exchanging through each other's windows with the same kernels the NCCL transport runs): the
// ranks together equal the whole layer on the global batch (the concatenation of every rank's
// tokens) — output, dx, the router gradient summed over ranks, and each rank's slice of every
// expert weight and bias gradient — against the fp64 reference and the single-GPU MoeLayer, eager
// and graph-replayed (each rank captured in global mode, every replay a new routing), with ranks
// that receive nothing, all tokens on one expert, token counts differing per rank, invalid counts
// reported on every rank, and a receive bound whose drops are counted exactly.
#include <gtest/gtest.h>

#include <algorithm>
#include <exception>
#include <thread>
#include <cmath>
#include <memory>
#include <vector>

#include "moegraph/error.hpp"
#include "moegraph/expert_parallel.hpp"
#include "moegraph/moe_layer.hpp"
#include "testing/data.hpp"
#include "testing/device_array.hpp"
#include "testing/graph.hpp"
#include "testing/moe_layer_reference.hpp"
#include "tests/common/expect.hpp"

namespace moegraph::test {
namespace {

struct EpCase {
  const char* name;
  int ranks, experts, top_k;
  int64_t hidden, ffn, max_tokens;  // max_tokens per rank
  bool bias, sigmoid, renormalize;
  int row_align;
  bool main_grad, delay;
};

const EpCase kEpCases[] = {
    // name                  R  E   k  H    F    T   bias   sigm   renorm align mg     delay
    {"r2_e8_top2_bias", 2, 8, 2, 128, 64, 48, true, false, true, 1, true, false},
    {"r4_e16_top4_align16", 4, 16, 4, 128, 128, 40, false, true, true, 16, false, true},
    {"r4_e64_top8_bias_align32", 4, 64, 8, 256, 64, 24, true, false, false, 32, true, false},
    {"r2_e4_top1_odd", 2, 4, 1, 64, 32, 33, false, false, false, 1, true, true},
};

MoeLayerOptions ep_options(const EpCase& c, int ranks) {
  MoeLayerOptions o;
  o.experts = c.experts, o.top_k = c.top_k, o.hidden = c.hidden, o.ffn = c.ffn;
  o.max_tokens = ranks == 1 ? c.max_tokens * c.ranks : c.max_tokens;
  o.bias = c.bias;
  o.score = c.sigmoid ? RouterScore::kSigmoid : RouterScore::kSoftmax;
  o.renormalize = c.renormalize;
  o.row_align = c.row_align;
  o.training = true;
  o.wgrad_slots = 2;
  o.delay_wgrad = c.delay;
  o.main_grad_fp32 = c.main_grad;
  o.expert_parallel = ranks;
  return o;
}

Mat slice(const Mat& m, std::size_t begin, std::size_t count) {
  return Mat(m.begin() + static_cast<std::ptrdiff_t>(begin), m.begin() + static_cast<std::ptrdiff_t>(begin + count));
}
DeviceArray<uint16_t> upload16(const Mat& v, DType t) {
  DeviceArray<uint16_t> a(v.size());
  a.upload(to_device_bits(v, t));
  return a;
}

// One layer (a rank, or the whole layer on one GPU) with its device tensors.
struct LayerSlot {
  MoeLayerOptions o;
  DeviceArray<uint16_t> wr, w1, w2, b1, b2, x, y, dy, dx, dwr, dw1, dw2, db1, db2;
  DeviceArray<float> mgr, mg1, mg2;
  DeviceArray<int32_t> tokens;
  testing::Stream stream;
  std::unique_ptr<MoeLayer> layer;

  MoeLayerIO io() const {
    MoeLayerIO io;
    io.x = x.get(), io.num_tokens = tokens.get(), io.y = y.get(), io.dy = dy.get(), io.dx = dx.get();
    return io;
  }
  void train_step() {
    const MoeLayerIO a = io();
    layer->forward_train(a, stream.get());
    layer->backward(a, stream.get());
    if (o.delay_wgrad) layer->backward_dw(stream.get());
  }
  void poison() {
    y.poison(), dx.poison();
    for (DeviceArray<float>* a : {&mgr, &mg1, &mg2})
      if (a->size()) testing::memset_and_wait(a->get(), 0, a->size() * sizeof(float));
    for (DeviceArray<uint16_t>* a : {&dwr, &dw1, &dw2, &db1, &db2})
      if (a->size()) a->poison();
  }
};

struct Outputs {
  Mat y, dx, dwr, dw1, dw2, db1, db2;  // global layout: tokens of rank 0, then rank 1, ...
};

class EpHarness {
 public:
  EpHarness(const EpCase& c, uint64_t seed, int64_t recv_rows = 0) : c_(c), rng_(seed), group_(c.ranks) {
    const int64_t e = c.experts, h = c.hidden, f = c.ffn;
    const DType dt = DType::kBF16;
    wr_base_ = wr_ = grid_values(rng_, e * h, 64, 1.0 / 256);
    w1_ = random_values(rng_, e * 2 * f * h, 1.0 / std::sqrt(double(h)), dt);
    w2_ = random_values(rng_, e * h * f, 1.0 / std::sqrt(double(f)), dt);
    if (c.bias) b1_ = random_values(rng_, e * 2 * f, 0.1, dt), b2_ = random_values(rng_, e * h, 0.1, dt);
    whole_ = make_slot(ep_options(c, 1), nullptr, 0);
    for (int r = 0; r < c.ranks; ++r) {
      MoeLayerOptions o = ep_options(c, c.ranks);
      o.ep_recv_rows = recv_rows;
      ranks_.push_back(make_slot(o, group_.rank(r), r));
    }
  }

  int ranks() const { return c_.ranks; }
  LayerSlot& rank(int r) { return *ranks_[r]; }
  LayerSlot& whole() { return *whole_; }

  // Fresh x and dy on every rank (all rows: rows past n hold data the layer must ignore) and the
  // token counts; the whole layer gets the concatenation. `hot` >= 0: every token's top choice is
  // that expert (a large weight on x's first column, which is 1 for every token).
  void set_inputs(const std::vector<int64_t>& counts, int hot = -1) {
    const int64_t t = c_.max_tokens, h = c_.hidden;
    const DType dt = DType::kBF16;
    counts_ = counts;
    n_ = 0;
    x_.clear(), dy_.clear();
    Mat whole_x(c_.ranks * t * h, 0.0), whole_dy(c_.ranks * t * h, 0.0);
    for (int r = 0; r < c_.ranks; ++r) {
      Mat x = grid_values(rng_, t * h, 4, 0.25), dy = random_values(rng_, t * h, 1.0, dt);
      if (hot >= 0)
        for (int64_t i = 0; i < t; ++i) x[i * h] = 1.0;
      ranks_[r]->x.upload(to_device_bits(x, dt));
      ranks_[r]->dy.upload(to_device_bits(dy, dt));
      ranks_[r]->tokens.upload({static_cast<int32_t>(counts[r])});
      std::copy(x.begin(), x.begin() + counts[r] * h, whole_x.begin() + n_ * h);
      std::copy(dy.begin(), dy.begin() + counts[r] * h, whole_dy.begin() + n_ * h);
      n_ += counts[r];
    }
    x_ = Mat(whole_x.begin(), whole_x.begin() + n_ * h);
    dy_ = Mat(whole_dy.begin(), whole_dy.begin() + n_ * h);
    whole_->x.upload(to_device_bits(whole_x, dt));
    whole_->dy.upload(to_device_bits(whole_dy, dt));
    whole_->tokens.upload({static_cast<int32_t>(n_)});
    set_hot(hot);
  }

  void poison() {
    whole_->poison();
    for (auto& r : ranks_) r->poison();
  }
  // Every rank's step enqueued by its own host thread on its own stream, as one process per GPU
  // would (they meet at the device barriers).
  void train_ranks() {
    on_every_rank([](LayerSlot& s) { s.train_step(); });
  }
  template <class F>
  void on_every_rank(F f) {
    std::vector<std::thread> threads;
    std::vector<std::exception_ptr> errors(ranks_.size());
    for (std::size_t r = 0; r < ranks_.size(); ++r)
      threads.emplace_back([&, r] {
        try {
          f(*ranks_[r]);
        } catch (...) {
          errors[r] = std::current_exception();
        }
      });
    for (auto& t : threads) t.join();
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
  }
  void sync() { MG_CUDA_CHECK(cudaDeviceSynchronize()); }

  Outputs read_ranks() {
    sync();
    const DType dt = DType::kBF16;
    const int64_t h = c_.hidden, f = c_.ffn, l = c_.experts / c_.ranks;
    Outputs out;
    out.dwr.assign(c_.experts * h, 0.0);
    for (int r = 0; r < c_.ranks; ++r) {
      LayerSlot& s = *ranks_[r];
      const Mat y = download_bits(s.y, dt), dx = download_bits(s.dx, dt);
      out.y.insert(out.y.end(), y.begin(), y.begin() + counts_[r] * h);
      out.dx.insert(out.dx.end(), dx.begin(), dx.begin() + counts_[r] * h);
      std::size_t nonzero_past_n = 0;
      for (std::size_t i = counts_[r] * h; i < dx.size(); ++i) nonzero_past_n += dx[i] != 0.0;
      EXPECT_EQ(nonzero_past_n, 0u) << "rank " << r << ": dx rows past n must be written as zero";
      const Mat dwr = c_.main_grad ? download_floats(s.mgr) : download_bits(s.dwr, dt);
      for (std::size_t i = 0; i < dwr.size(); ++i) out.dwr[i] += dwr[i];
      const Mat dw1 = c_.main_grad ? download_floats(s.mg1) : download_bits(s.dw1, dt);
      const Mat dw2 = c_.main_grad ? download_floats(s.mg2) : download_bits(s.dw2, dt);
      EXPECT_EQ(dw1.size(), static_cast<std::size_t>(l * 2 * f * h));
      out.dw1.insert(out.dw1.end(), dw1.begin(), dw1.end());
      out.dw2.insert(out.dw2.end(), dw2.begin(), dw2.end());
      if (c_.bias) {
        const Mat db1 = download_bits(s.db1, dt), db2 = download_bits(s.db2, dt);
        out.db1.insert(out.db1.end(), db1.begin(), db1.end());
        out.db2.insert(out.db2.end(), db2.begin(), db2.end());
      }
    }
    return out;
  }

  Outputs read_whole() {
    sync();
    const DType dt = DType::kBF16;
    const int64_t h = c_.hidden;
    LayerSlot& s = *whole_;
    Outputs out;
    out.y = slice(download_bits(s.y, dt), 0, n_ * h);
    out.dx = slice(download_bits(s.dx, dt), 0, n_ * h);
    out.dwr = c_.main_grad ? download_floats(s.mgr) : download_bits(s.dwr, dt);
    out.dw1 = c_.main_grad ? download_floats(s.mg1) : download_bits(s.dw1, dt);
    out.dw2 = c_.main_grad ? download_floats(s.mg2) : download_bits(s.dw2, dt);
    if (c_.bias) out.db1 = download_bits(s.db1, dt), out.db2 = download_bits(s.db2, dt);
    return out;
  }

  MoeLayerRef reference() const {
    RouterSpec spec;
    spec.experts = c_.experts, spec.top_k = c_.top_k, spec.sigmoid = c_.sigmoid;
    spec.renormalize = c_.renormalize, spec.row_align = c_.row_align;
    MoeLayerInputs in;
    in.x = &x_, in.wr = &wr_, in.w1 = &w1_, in.b1 = &b1_, in.w2 = &w2_, in.b2 = &b2_, in.dy = &dy_;
    in.tokens = n_, in.hidden = c_.hidden, in.ffn = c_.ffn, in.capacity_rows = moe_layer_rows(whole_->o);
    in.router = spec, in.dtype = DType::kBF16;
    return ref_moe_layer(in);
  }

  // Every output against the fp64 reference of the global batch and against the whole layer.
  void expect_matches(const Outputs& got, const std::string& where) {
    const MoeLayerRef ref = reference();
    const Tolerance tol = chain_tolerance_for(DType::kBF16);
    const int64_t h = c_.hidden, f = c_.ffn;
    if (n_ > 0) {
      EXPECT_TRUE(passed(all_close(where + " y", got.y, ref.y, h, {}, tol)));
      EXPECT_TRUE(passed(all_close(where + " dx", got.dx, ref.dx, h, {}, tol)));
    }
    EXPECT_TRUE(passed(all_close(where + " d_router (sum over ranks)", got.dwr, ref.dwr, h, {}, tol)));
    EXPECT_TRUE(passed(all_close(where + " dw1", got.dw1, ref.dw1, h, {}, tol)));
    EXPECT_TRUE(passed(all_close(where + " dw2", got.dw2, ref.dw2, f, {}, tol)));
    if (c_.bias) {
      EXPECT_TRUE(passed(all_close(where + " db1", got.db1, ref.db1, 2 * f, {}, tol)));
      EXPECT_TRUE(passed(all_close(where + " db2", got.db2, ref.db2, h, {}, tol)));
    }
    // The whole layer on one GPU computes the same rows in the same order (by expert, then
    // token): the expert outputs agree to the last bit; sums over ranks may round differently.
    whole_->poison();
    whole_->train_step();
    const Outputs one = read_whole();
    EXPECT_TRUE(same_bits(got.y, one.y)) << where << ": y differs from the single-GPU layer's";
    EXPECT_TRUE(same_bits(got.dw1, one.dw1)) << where << ": dw1 differs from the single-GPU layer's";
    EXPECT_TRUE(same_bits(got.dw2, one.dw2)) << where << ": dw2 differs from the single-GPU layer's";
    EXPECT_TRUE(passed(all_close(where + " dx vs one GPU", got.dx, one.dx, h, {}, tol)));
  }

  // Assignments dropped by a receive bound, by the greedy rule of kernels/comm/ep_exchange.hpp.
  uint64_t expected_dropped(int64_t recv_rows) const {
    const MoeLayerRef ref = reference();
    const int R = c_.ranks, E = c_.experts, L = E / R, k = c_.top_k;
    std::vector<std::vector<int64_t>> want(R, std::vector<int64_t>(E, 0));
    int64_t token = 0;
    for (int r = 0; r < R; ++r)
      for (int64_t t = 0; t < counts_[r]; ++t, ++token)
        for (int j = 0; j < k; ++j) ++want[r][ref.router.topk_ids[token * k + j]];
    uint64_t dropped = 0;
    for (int d = 0; d < R; ++d) {
      int64_t off = 0;
      for (int l = 0; l < L; ++l) {
        for (int s = 0; s < R; ++s) {
          const int64_t take = std::min(want[s][d * L + l], recv_rows - off);
          dropped += want[s][d * L + l] - take;
          off += take;
        }
        off = (off + c_.row_align - 1) / c_.row_align * c_.row_align;
      }
    }
    return dropped;
  }

 private:
  std::unique_ptr<LayerSlot> make_slot(const MoeLayerOptions& o, std::shared_ptr<EpComm> comm, int rank) {
    auto s = std::make_unique<LayerSlot>();
    s->o = o;
    const DType dt = DType::kBF16;
    const int64_t e = o.experts, l = moe_local_experts(o), h = o.hidden, f = o.ffn, t = o.max_tokens;
    s->wr = upload16(wr_, dt);
    s->w1 = upload16(slice(w1_, rank * l * 2 * f * h, l * 2 * f * h), dt);
    s->w2 = upload16(slice(w2_, rank * l * h * f, l * h * f), dt);
    MoeLayerWeights w;
    w.router = s->wr.get(), w.w1 = s->w1.get(), w.w2 = s->w2.get();
    if (o.bias) {
      s->b1 = upload16(slice(b1_, rank * l * 2 * f, l * 2 * f), dt);
      s->b2 = upload16(slice(b2_, rank * l * h, l * h), dt);
      s->db1 = DeviceArray<uint16_t>(l * 2 * f), s->db2 = DeviceArray<uint16_t>(l * h);
      w.b1 = s->b1.get(), w.b2 = s->b2.get(), w.db1 = s->db1.get(), w.db2 = s->db2.get();
    }
    if (o.main_grad_fp32) {
      s->mgr = DeviceArray<float>(e * h), s->mg1 = DeviceArray<float>(l * 2 * f * h);
      s->mg2 = DeviceArray<float>(l * h * f);
      w.main_grad_router = s->mgr.get(), w.main_grad1 = s->mg1.get(), w.main_grad2 = s->mg2.get();
    } else {
      s->dwr = DeviceArray<uint16_t>(e * h), s->dw1 = DeviceArray<uint16_t>(l * 2 * f * h);
      s->dw2 = DeviceArray<uint16_t>(l * h * f);
      w.d_router = s->dwr.get(), w.dw1 = s->dw1.get(), w.dw2 = s->dw2.get();
    }
    s->x = DeviceArray<uint16_t>(t * h), s->y = DeviceArray<uint16_t>(t * h);
    s->dy = DeviceArray<uint16_t>(t * h), s->dx = DeviceArray<uint16_t>(t * h);
    s->tokens = DeviceArray<int32_t>(1);
    s->layer = std::make_unique<MoeLayer>(o, w, nullptr, std::move(comm));
    return s;
  }

  // Router row `hot` gets a large weight on x's first column (1 for every token); the others none.
  void set_hot(int hot) {
    if (hot == hot_) return;
    hot_ = hot;
    wr_ = wr_base_;
    if (hot >= 0)
      for (int e = 0; e < c_.experts; ++e) wr_[e * c_.hidden] = e == hot ? 64.0 : 0.0;
    const auto bits = to_device_bits(wr_, DType::kBF16);
    whole_->wr.upload(bits);
    for (auto& r : ranks_) r->wr.upload(bits);
  }

  EpCase c_;
  std::mt19937_64 rng_;
  EmulatedEpGroup group_;
  Mat wr_base_, wr_, w1_, w2_, b1_, b2_, x_, dy_;
  int hot_ = -1;
  std::vector<int64_t> counts_;
  int64_t n_ = 0;
  std::unique_ptr<LayerSlot> whole_;
  std::vector<std::unique_ptr<LayerSlot>> ranks_;
};

// Per-rank token counts of a step: full, differing, one rank empty.
std::vector<std::vector<int64_t>> count_patterns(const EpCase& c) {
  const int64_t t = c.max_tokens;
  std::vector<std::vector<int64_t>> out;
  std::vector<int64_t> full(c.ranks, t), differing(c.ranks), one_empty(c.ranks, t / 2 + 1);
  for (int r = 0; r < c.ranks; ++r) differing[r] = std::max<int64_t>(1, t - 7 * r);
  one_empty[c.ranks - 1] = 0;
  out.push_back(full), out.push_back(differing), out.push_back(one_empty);
  return out;
}

class ExpertParallelCase : public ::testing::TestWithParam<EpCase> {};

TEST_P(ExpertParallelCase, EagerStepsMatchTheWholeLayer) {
  const EpCase& c = GetParam();
  EpHarness h(c, test_seed(c.name));
  for (const auto& counts : count_patterns(c)) {
    h.set_inputs(counts);
    h.poison();
    h.train_ranks();
    for (int r = 0; r < h.ranks(); ++r) h.rank(r).layer->check_device_errors(h.rank(r).stream.get());
    h.expect_matches(h.read_ranks(), detail::concat(c.name, " eager n0=", counts[0], " nlast=", counts.back()));
  }
}

// Each rank's step captured (global mode) into its own graph, replayed on its own stream with a new
// routing and new token counts every replay.
TEST_P(ExpertParallelCase, GraphReplaysMatchTheWholeLayer) {
  const EpCase& c = GetParam();
  EpHarness h(c, test_seed(c.name) + 1);
  h.set_inputs(std::vector<int64_t>(c.ranks, c.max_tokens));
  h.train_ranks();  // warm-up outside capture
  h.sync();
  std::vector<std::unique_ptr<testing::Graph>> graphs;
  for (int r = 0; r < h.ranks(); ++r)
    graphs.push_back(std::make_unique<testing::Graph>(h.rank(r).stream.get(), [&, r] { h.rank(r).train_step(); }));
  auto patterns = count_patterns(c);
  patterns.push_back(std::vector<int64_t>(c.ranks, 0));  // nobody has tokens
  for (const auto& counts : patterns) {
    h.set_inputs(counts);
    h.poison();
    h.on_every_rank([&](LayerSlot& s) {
      for (int r = 0; r < h.ranks(); ++r)
        if (&h.rank(r) == &s) graphs[r]->launch(s.stream.get());
    });
    h.expect_matches(h.read_ranks(), detail::concat(c.name, " graph n0=", counts[0], " nlast=", counts.back()));
  }
  for (int r = 0; r < h.ranks(); ++r) h.rank(r).layer->check_device_errors(h.rank(r).stream.get());
}

INSTANTIATE_TEST_SUITE_P(Cases, ExpertParallelCase, ::testing::ValuesIn(kEpCases),
                         [](const auto& info) { return std::string(info.param.name); });

// Every token of every rank picks the last expert first: one rank receives all the rows of that
// expert, the others receive only their share of the other choices (none with top-1).
TEST(ExpertParallel, AllTokensToOneExpert) {
  for (EpCase c : {kEpCases[3], kEpCases[1]}) {
    EpHarness h(c, 41);
    h.set_inputs(std::vector<int64_t>(c.ranks, c.max_tokens), c.experts - 1);
    h.poison();
    h.train_ranks();
    for (int r = 0; r < h.ranks(); ++r) h.rank(r).layer->check_device_errors(h.rank(r).stream.get());
    h.expect_matches(h.read_ranks(), detail::concat(c.name, " all tokens to expert ", c.experts - 1));
  }
}

// A token count past the bucket on one rank is reported on every rank; the next step is right.
TEST(ExpertParallel, InvalidCountIsReportedOnEveryRank) {
  const EpCase& c = kEpCases[1];
  EpHarness h(c, 43);
  std::vector<int64_t> counts(c.ranks, c.max_tokens);
  h.set_inputs(counts);
  h.rank(1).tokens.upload({static_cast<int32_t>(c.max_tokens + 5)});
  h.train_ranks();
  for (int r = 0; r < h.ranks(); ++r) {
    try {
      h.rank(r).layer->check_device_errors(h.rank(r).stream.get());
      ADD_FAILURE() << "rank " << r << " did not report rank 1's invalid token count";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kDeviceSplits);
      const std::string what = e.what();
      EXPECT_NE(what.find(std::to_string(c.max_tokens + 5)), std::string::npos) << what;
      if (r != 1) {
        EXPECT_NE(what.find("rank 1"), std::string::npos) << what;
      }
    }
  }
  h.set_inputs(counts);
  h.poison();
  h.train_ranks();
  for (int r = 0; r < h.ranks(); ++r) h.rank(r).layer->check_device_errors(h.rank(r).stream.get());
  h.expect_matches(h.read_ranks(), "after an invalid count");
}

// A receive bound below the worst case: rows past it are dropped, counted on their source rank
// exactly as the greedy rule says, and every output stays finite (dropped rows contribute zero).
TEST(ExpertParallel, ReceiveBoundCountsDrops) {
  EpCase c = kEpCases[0];
  const int64_t bound = 32;  // a fraction of what a skewed routing sends to one rank
  EpHarness h(c, 47, bound);
  h.set_inputs(std::vector<int64_t>(c.ranks, c.max_tokens), c.experts - 1);
  h.poison();
  h.train_ranks();
  h.sync();
  uint64_t dropped = 0;
  for (int r = 0; r < h.ranks(); ++r) {
    h.rank(r).layer->check_device_errors(h.rank(r).stream.get());
    dropped += h.rank(r).layer->read_dropped(h.rank(r).stream.get());
  }
  EXPECT_EQ(dropped, h.expected_dropped(bound));
  EXPECT_GT(dropped, 0u);
  const Outputs got = h.read_ranks();
  for (const Mat* m : {&got.y, &got.dx, &got.dw1, &got.dw2})
    for (double v : *m) ASSERT_TRUE(std::isfinite(v));
}

TEST(ExpertParallel, OptionsAreChecked) {
  MoeLayerOptions o = ep_options(kEpCases[0], 2);
  o.experts = 9;
  EXPECT_THROW(validate(o), Error);
  o = ep_options(kEpCases[0], 2);
  o.capacity_factor = 1.0;
  EXPECT_THROW(validate(o), Error);
  o = ep_options(kEpCases[0], 2);
  o.ep_recv_rows = moe_ep_worst_case_rows(o) + 1;
  EXPECT_THROW(validate(o), Error);
  o = ep_options(kEpCases[0], 2);
  const MoeLayerWeights none{};
  EXPECT_THROW({ MoeLayer layer(o, none, nullptr, nullptr); }, Error);  // no communicator
  EmulatedEpGroup four(4);
  EXPECT_THROW({ MoeLayer layer(o, none, nullptr, four.rank(0)); }, Error);  // a group of the wrong size
}

}  // namespace
}  // namespace moegraph::test
