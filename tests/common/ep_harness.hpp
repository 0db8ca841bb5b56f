// Expert-parallel layers against the whole layer, for any transport: the harness builds the ranks
// this process drives (all R for emulated ranks on one GPU; one for a process per GPU over NCCL)
// plus the whole layer on the global batch (every rank's tokens concatenated), which every process
// computes for itself from the same seed. Each driven rank's output, dx and expert-weight and bias
// gradients are compared with its share of the fp64 reference and of the single-GPU MoeLayer; the
// router gradient is summed over the ranks (across processes through `sum_over_processes`).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "moegraph/error.hpp"
#include "moegraph/expert_parallel.hpp"
#include "moegraph/moe_layer.hpp"
#include "moegraph/step_graphs.hpp"
#include "testing/data.hpp"
#include "testing/device_array.hpp"
#include "testing/graph.hpp"
#include "testing/moe_layer_reference.hpp"
#include "tests/common/expect.hpp"
#include "tests/common/threads.hpp"

namespace moegraph::test {

struct EpCase {
  const char* name;
  int ranks, experts, top_k;
  int64_t hidden, ffn, max_tokens;  // max_tokens per rank
  bool bias, sigmoid, renormalize;
  int row_align;
  bool main_grad, delay;
  EpExchange exchange = EpExchange::kPeerStores;
  int64_t chunk_rows = 0;  // send/recv: 0 for the worst case
};

inline MoeLayerOptions ep_options(const EpCase& c, int ranks) {
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
  if (ranks > 1) o.ep_exchange = c.exchange, o.ep_chunk_rows = c.chunk_rows;
  return o;
}

inline Mat slice(const Mat& m, std::size_t begin, std::size_t count) {
  return Mat(m.begin() + static_cast<std::ptrdiff_t>(begin), m.begin() + static_cast<std::ptrdiff_t>(begin + count));
}
inline DeviceArray<uint16_t> upload16(const Mat& v, DType t) {
  DeviceArray<uint16_t> a(v.size());
  a.upload(to_device_bits(v, t));
  return a;
}

// One layer (a rank, or the whole layer on one GPU) with its device tensors.
struct LayerSlot {
  int rank = 0;  // in the group (0 for the whole layer)
  std::shared_ptr<EpComm> comm;  // null for the whole layer
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

// One layer's results: y and dx of its tokens, the router gradient, its experts' gradients.
struct Outputs {
  Mat y, dx, dwr, dw1, dw2, db1, db2;
};

// The ranks a process drives and how to sum a vector over processes (null: all ranks are here).
struct EpRanks {
  std::vector<std::shared_ptr<EpComm>> comms;
  std::function<void(Mat&)> sum_over_processes;
};

class EpHarness {
 public:
  EpHarness(const EpCase& c, uint64_t seed, EpRanks ranks, int64_t recv_rows = 0)
      : c_(c), rng_(seed), sum_(std::move(ranks.sum_over_processes)) {
    const int64_t e = c.experts, h = c.hidden, f = c.ffn;
    const DType dt = DType::kBF16;
    wr_base_ = wr_ = grid_values(rng_, e * h, 64, 1.0 / 256);
    w1_ = random_values(rng_, e * 2 * f * h, 1.0 / std::sqrt(double(h)), dt);
    w2_ = random_values(rng_, e * h * f, 1.0 / std::sqrt(double(f)), dt);
    if (c.bias) b1_ = random_values(rng_, e * 2 * f, 0.1, dt), b2_ = random_values(rng_, e * h, 0.1, dt);
    whole_ = make_slot(ep_options(c, 1), nullptr, 0);
    for (const auto& comm : ranks.comms) {
      MG_CHECK(comm->ranks() == c.ranks, "case ", c.name, " has ", c.ranks, " ranks, the communicator ", comm->ranks());
      MoeLayerOptions o = ep_options(c, c.ranks);
      o.ep_recv_rows = recv_rows;
      ranks_.push_back(make_slot(o, comm, comm->rank()));
    }
  }

  int ranks() const { return c_.ranks; }
  // The ranks this process drives.
  std::vector<std::unique_ptr<LayerSlot>>& local() { return ranks_; }
  LayerSlot& whole() { return *whole_; }

  // Fresh x and dy on every rank (all rows: rows past n hold data the layer must ignore) and the
  // token counts; the whole layer gets the concatenation. `hot` >= 0: every token's top choice is
  // that expert (a large weight on x's first column, which is 1 for every token). Every process
  // draws every rank's data, so they agree on the global batch.
  void set_inputs(const std::vector<int64_t>& counts, int hot = -1) {
    const int64_t t = c_.max_tokens, h = c_.hidden;
    const DType dt = DType::kBF16;
    counts_ = counts;
    first_.assign(c_.ranks, 0);
    n_ = 0;
    Mat whole_x(c_.ranks * t * h, 0.0), whole_dy(c_.ranks * t * h, 0.0);
    for (int r = 0; r < c_.ranks; ++r) {
      Mat x = grid_values(rng_, t * h, 4, 0.25), dy = random_values(rng_, t * h, 1.0, dt);
      if (hot >= 0)
        for (int64_t i = 0; i < t; ++i) x[i * h] = 1.0;
      if (LayerSlot* s = driven(r)) {
        s->x.upload(to_device_bits(x, dt));
        s->dy.upload(to_device_bits(dy, dt));
        s->tokens.upload({static_cast<int32_t>(counts[r])});
      }
      std::copy(x.begin(), x.begin() + counts[r] * h, whole_x.begin() + n_ * h);
      std::copy(dy.begin(), dy.begin() + counts[r] * h, whole_dy.begin() + n_ * h);
      first_[r] = n_;
      n_ += counts[r];
    }
    x_ = Mat(whole_x.begin(), whole_x.begin() + n_ * h);
    dy_ = Mat(whole_dy.begin(), whole_dy.begin() + n_ * h);
    whole_->x.upload(to_device_bits(whole_x, dt));
    whole_->dy.upload(to_device_bits(whole_dy, dt));
    whole_->tokens.upload({static_cast<int32_t>(n_)});
    set_hot(hot);
  }
  // Overrides rank r's device token count (when this process drives it).
  void set_count(int r, int64_t count) {
    if (LayerSlot* s = driven(r)) s->tokens.upload({static_cast<int32_t>(count)});
  }

  void poison() {
    whole_->poison();
    for (auto& r : ranks_) r->poison();
  }
  // Every driven rank's step enqueued by its own host thread on its own stream, as one process per
  // GPU would (they meet at the device barriers). The threads leave their current device at 0: a
  // rank on another GPU is driven from a thread with another device current, which the layers
  // handle (they make their own device current for each call).
  void train_ranks() {
    on_every_rank([](LayerSlot& s) { s.train_step(); });
  }
  template <class F>
  void on_every_rank(F f) {
    on_threads(static_cast<int>(ranks_.size()), [&](int i) { f(*ranks_[i]); });
  }
  void check_device_errors() {
    for (auto& s : ranks_) s->layer->check_device_errors(s->stream.get());
  }
  void sync() { MG_CUDA_CHECK(cudaDeviceSynchronize()); }
  // Summed over the driven ranks and, across processes, over the group.
  uint64_t read_dropped() {
    Mat total{0.0};
    for (auto& s : ranks_) total[0] += static_cast<double>(s->layer->read_dropped(s->stream.get()));
    if (sum_) sum_(total);
    return static_cast<uint64_t>(total[0]);
  }

  // The driven ranks' results (in the order of local()); the router gradient summed over the group.
  std::vector<Outputs> read_ranks() {
    sync();
    const DType dt = DType::kBF16;
    const int64_t h = c_.hidden, f = c_.ffn, l = c_.experts / c_.ranks;
    std::vector<Outputs> out;
    Mat dwr_sum(c_.experts * h, 0.0);
    for (auto& sp : ranks_) {
      LayerSlot& s = *sp;
      const int r = s.rank;
      Outputs o;
      const Mat y = download_bits(s.y, dt), dx = download_bits(s.dx, dt);
      o.y = slice(y, 0, counts_[r] * h);
      o.dx = slice(dx, 0, counts_[r] * h);
      std::size_t nonzero_past_n = 0;
      for (std::size_t i = counts_[r] * h; i < dx.size(); ++i) nonzero_past_n += dx[i] != 0.0;
      EXPECT_EQ(nonzero_past_n, 0u) << "rank " << r << ": dx rows past n must be written as zero";
      const Mat dwr = c_.main_grad ? download_floats(s.mgr) : download_bits(s.dwr, dt);
      for (std::size_t i = 0; i < dwr.size(); ++i) dwr_sum[i] += dwr[i];
      o.dw1 = c_.main_grad ? download_floats(s.mg1) : download_bits(s.dw1, dt);
      o.dw2 = c_.main_grad ? download_floats(s.mg2) : download_bits(s.dw2, dt);
      EXPECT_EQ(o.dw1.size(), static_cast<std::size_t>(l * 2 * f * h));
      if (c_.bias) o.db1 = download_bits(s.db1, dt), o.db2 = download_bits(s.db2, dt);
      out.push_back(std::move(o));
    }
    if (sum_) sum_(dwr_sum);
    for (Outputs& o : out) o.dwr = dwr_sum;
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

  // Rank r's share of a whole-layer result: its tokens' rows of y and dx, its experts' gradients.
  Outputs share(const Outputs& whole, int r) const {
    const std::size_t h = c_.hidden, f = c_.ffn, l = c_.experts / c_.ranks;
    Outputs o;
    o.y = slice(whole.y, first_[r] * h, counts_[r] * h);
    o.dx = slice(whole.dx, first_[r] * h, counts_[r] * h);
    o.dwr = whole.dwr;
    o.dw1 = slice(whole.dw1, r * l * 2 * f * h, l * 2 * f * h);
    o.dw2 = slice(whole.dw2, r * l * h * f, l * h * f);
    if (c_.bias) o.db1 = slice(whole.db1, r * l * 2 * f, l * 2 * f), o.db2 = slice(whole.db2, r * l * h, l * h);
    return o;
  }

  // Every driven rank's outputs against its share of the fp64 reference of the global batch and of
  // the whole layer.
  void expect_matches(const std::vector<Outputs>& got, const std::string& where) {
    const MoeLayerRef ref = reference();
    Outputs ref_all;
    ref_all.y = ref.y, ref_all.dx = ref.dx, ref_all.dwr = ref.dwr, ref_all.dw1 = ref.dw1, ref_all.dw2 = ref.dw2;
    ref_all.db1 = ref.db1, ref_all.db2 = ref.db2;
    // The whole layer on one GPU computes the same rows in the same order (by expert, then
    // token): the expert outputs agree to the last bit; sums over ranks may round differently.
    whole_->poison();
    whole_->train_step();
    const Outputs one_all = read_whole();
    const Tolerance tol = chain_tolerance_for(DType::kBF16);
    const int64_t h = c_.hidden, f = c_.ffn;
    for (std::size_t i = 0; i < got.size(); ++i) {
      const int r = ranks_[i]->rank;
      const std::string at = where + " rank " + std::to_string(r);
      const Outputs want = share(ref_all, r), one = share(one_all, r);
      const Outputs& g = got[i];
      if (counts_[r] > 0) {
        EXPECT_TRUE(passed(all_close(at + " y", g.y, want.y, h, {}, tol)));
        EXPECT_TRUE(passed(all_close(at + " dx", g.dx, want.dx, h, {}, tol)));
      }
      EXPECT_TRUE(passed(all_close(at + " d_router (sum over ranks)", g.dwr, want.dwr, h, {}, tol)));
      EXPECT_TRUE(passed(all_close(at + " dw1", g.dw1, want.dw1, h, {}, tol)));
      EXPECT_TRUE(passed(all_close(at + " dw2", g.dw2, want.dw2, f, {}, tol)));
      if (c_.bias) {
        EXPECT_TRUE(passed(all_close(at + " db1", g.db1, want.db1, 2 * f, {}, tol)));
        EXPECT_TRUE(passed(all_close(at + " db2", g.db2, want.db2, h, {}, tol)));
      }
      EXPECT_TRUE(same_bits(g.y, one.y)) << at << ": y differs from the single-GPU layer's";
      EXPECT_TRUE(same_bits(g.dw1, one.dw1)) << at << ": dw1 differs from the single-GPU layer's";
      EXPECT_TRUE(same_bits(g.dw2, one.dw2)) << at << ": dw2 differs from the single-GPU layer's";
      EXPECT_TRUE(passed(all_close(at + " dx vs one GPU", g.dx, one.dx, h, {}, tol)));
    }
  }

  // Assignments dropped by a receive bound (0: the worst case) and the case's send/recv chunks, by
  // the greedy rule of kernels/comm/ep_exchange.hpp.
  uint64_t expected_dropped(int64_t recv_rows) const {
    if (recv_rows == 0) recv_rows = moe_ep_worst_case_rows(ep_options(c_, c_.ranks));
    const int64_t chunk = moe_ep_chunk_rows(ep_options(c_, c_.ranks));
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
      std::vector<int64_t> sent(R, 0);  // rows of each source kept by owner d (at most one chunk)
      for (int l = 0; l < L; ++l) {
        for (int s = 0; s < R; ++s) {
          const int64_t take = std::min({want[s][d * L + l], recv_rows - off, chunk - sent[s]});
          dropped += want[s][d * L + l] - take;
          sent[s] += take;
          off += take;
        }
        off = (off + c_.row_align - 1) / c_.row_align * c_.row_align;
      }
    }
    return dropped;
  }

 private:
  LayerSlot* driven(int r) {
    for (auto& s : ranks_)
      if (s->rank == r) return s.get();
    return nullptr;
  }

  std::unique_ptr<LayerSlot> make_slot(const MoeLayerOptions& o, std::shared_ptr<EpComm> comm, int rank) {
    auto s = std::make_unique<LayerSlot>();
    s->rank = rank;
    s->comm = comm;
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
  std::function<void(Mat&)> sum_;
  Mat wr_base_, wr_, w1_, w2_, b1_, b2_, x_, dy_;
  int hot_ = -1;
  std::vector<int64_t> counts_, first_;
  int64_t n_ = 0;
  std::unique_ptr<LayerSlot> whole_;
  std::vector<std::unique_ptr<LayerSlot>> ranks_;
};

// Per-rank token counts of a step: full, differing, one rank empty.
inline std::vector<std::vector<int64_t>> count_patterns(const EpCase& c) {
  const int64_t t = c.max_tokens;
  std::vector<std::vector<int64_t>> out;
  std::vector<int64_t> full(c.ranks, t), differing(c.ranks), one_empty(c.ranks, t / 2 + 1);
  for (int r = 0; r < c.ranks; ++r) differing[r] = std::max<int64_t>(1, t - 7 * r);
  one_empty[c.ranks - 1] = 0;
  out.push_back(full), out.push_back(differing), out.push_back(one_empty);
  return out;
}

// ---- The scenarios, for any transport (tests/gpu/test_expert_parallel.cpp: emulated ranks;
// tests/ep/test_nccl_ep.cpp: one process per GPU over NCCL) ------------------------------------------

// Eager training steps for every count pattern.
inline void ep_eager_steps(const EpCase& c, const EpRanks& ranks) {
  EpHarness h(c, test_seed(c.name), ranks);
  for (const auto& counts : count_patterns(c)) {
    h.set_inputs(counts);
    h.poison();
    h.train_ranks();
    h.check_device_errors();
    h.expect_matches(h.read_ranks(), detail::concat(c.name, " eager n0=", counts[0], " nlast=", counts.back()));
  }
}

// Each rank's step captured (global mode) into its own graph, replayed on its own stream with a new
// routing and new token counts every replay.
inline void ep_graph_replays(const EpCase& c, const EpRanks& ranks) {
  EpHarness h(c, test_seed(c.name) + 1, ranks);
  h.set_inputs(std::vector<int64_t>(c.ranks, c.max_tokens));
  h.train_ranks();  // warm-up outside capture
  h.sync();
  std::vector<std::unique_ptr<testing::Graph>> graphs;
  for (auto& s : h.local()) {
    LayerSlot* slot = s.get();
    graphs.push_back(std::make_unique<testing::Graph>(slot->stream.get(), [slot] { slot->train_step(); }));
  }
  auto patterns = count_patterns(c);
  patterns.push_back(std::vector<int64_t>(c.ranks, 0));  // nobody has tokens
  for (const auto& counts : patterns) {
    h.set_inputs(counts);
    h.poison();
    h.on_every_rank([&](LayerSlot& s) {
      for (std::size_t i = 0; i < h.local().size(); ++i)
        if (h.local()[i].get() == &s) graphs[i]->launch(s.stream.get());
    });
    h.expect_matches(h.read_ranks(), detail::concat(c.name, " graph n0=", counts[0], " nlast=", counts.back()));
  }
  h.check_device_errors();
}

// Every token of every rank picks the last expert first: one rank receives all the rows of that
// expert, the others receive only their share of the other choices (none with top-1).
inline void ep_all_tokens_to_one_expert(const EpCase& c, const EpRanks& ranks) {
  EpHarness h(c, 41, ranks);
  h.set_inputs(std::vector<int64_t>(c.ranks, c.max_tokens), c.experts - 1);
  h.poison();
  h.train_ranks();
  h.check_device_errors();
  h.expect_matches(h.read_ranks(), detail::concat(c.name, " all tokens to expert ", c.experts - 1));
}

// A token count past the bucket on rank 1 is reported on every rank; the next step is right.
inline void ep_invalid_count(const EpCase& c, const EpRanks& ranks) {
  EpHarness h(c, 43, ranks);
  std::vector<int64_t> counts(c.ranks, c.max_tokens);
  h.set_inputs(counts);
  h.set_count(1, c.max_tokens + 5);
  h.train_ranks();
  for (auto& s : h.local()) {
    try {
      s->layer->check_device_errors(s->stream.get());
      ADD_FAILURE() << "rank " << s->rank << " did not report rank 1's invalid token count";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kDeviceSplits);
      const std::string what = e.what();
      EXPECT_NE(what.find(std::to_string(c.max_tokens + 5)), std::string::npos) << what;
      if (s->rank != 1) {
        EXPECT_NE(what.find("rank 1"), std::string::npos) << what;
      }
    }
  }
  h.set_inputs(counts);
  h.poison();
  h.train_ranks();
  h.check_device_errors();
  h.expect_matches(h.read_ranks(), "after an invalid count");
}

// A training step with every token's first choice on the last expert: the drops read back equal the
// host model's for `recv_rows` (0: the worst case) and the case's chunks, and every output stays
// finite (dropped rows contribute zero). Returns the drops.
inline uint64_t train_skewed_and_count_drops(EpHarness& h, const EpCase& c, int64_t recv_rows) {
  h.set_inputs(std::vector<int64_t>(c.ranks, c.max_tokens), c.experts - 1);
  h.poison();
  h.train_ranks();
  h.sync();
  h.check_device_errors();
  const uint64_t dropped = h.read_dropped();
  EXPECT_EQ(dropped, h.expected_dropped(recv_rows));
  std::size_t not_finite = 0;
  for (const Outputs& got : h.read_ranks())
    for (const Mat* m : {&got.y, &got.dx, &got.dw1, &got.dw2})
      not_finite += static_cast<std::size_t>(std::count_if(m->begin(), m->end(), [](double v) { return !std::isfinite(v); }));
  EXPECT_EQ(not_finite, 0u) << "outputs that are not finite";
  return dropped;
}

// A receive bound below the worst case: rows past it are dropped, counted on their source rank
// exactly as the greedy rule says, and every output stays finite (dropped rows contribute zero).
inline void ep_receive_bound(const EpCase& c, const EpRanks& ranks) {
  const int64_t bound = 32;  // a fraction of what a skewed routing sends to one rank
  EpHarness h(c, 47, ranks, bound);
  const uint64_t dropped = train_skewed_and_count_drops(h, c, bound);
  EXPECT_GT(dropped, 0u);
}

// Send/recv chunks smaller than what a skewed routing sends one owner: rows past a chunk are dropped,
// counted on their source exactly as the greedy rule says, and every output stays finite.
inline void ep_chunk_bound(EpCase c, const EpRanks& ranks) {
  c.exchange = EpExchange::kSendRecv;
  c.chunk_rows = 8;  // far fewer than the max_tokens rows every source sends the hot expert's owner
  EpHarness h(c, 53, ranks);
  const uint64_t dropped = train_skewed_and_count_drops(h, c, 0);
  EXPECT_GE(dropped, static_cast<uint64_t>(c.ranks * (c.max_tokens - c.chunk_rows)));
}

// StepGraphs on every driven rank (one bucket, the case's max_tokens, bound to the harness's own
// weights and gradients): graph replays with new routings and token counts give, bit for bit, what
// the ranks' MoeLayers give on the same inputs (which the scenarios above check against the whole
// layer). Each rank's constructor and replays run on its own thread: they meet at the barriers.
inline void ep_step_graphs(const EpCase& c, const EpRanks& ranks, cudaStreamCaptureMode mode) {
  EpHarness h(c, test_seed(c.name) + 2, ranks);
  std::vector<std::unique_ptr<StepGraphs>> steps(h.local().size());
  const auto index_of = [&](const LayerSlot& s) {
    for (std::size_t i = 0; i < h.local().size(); ++i)
      if (h.local()[i].get() == &s) return i;
    MG_FAIL("not a driven rank");
  };
  h.on_every_rank([&](LayerSlot& s) {
    StepGraphsOptions o;
    o.layer = s.o;
    o.buckets = {c.max_tokens};
    o.capture_mode = mode;
    StepWeights w;
    w.router = s.wr.get(), w.w1 = s.w1.get(), w.w2 = s.w2.get(), w.b1 = s.b1.get(), w.b2 = s.b2.get();
    w.main_grad_router = s.mgr.get(), w.main_grad1 = s.mg1.get(), w.main_grad2 = s.mg2.get();
    w.d_router = s.dwr.get(), w.dw1 = s.dw1.get(), w.dw2 = s.dw2.get(), w.db1 = s.db1.get(), w.db2 = s.db2.get();
    steps[index_of(s)] = std::make_unique<StepGraphs>(o, w, s.comm);
  });
  const std::size_t row_bytes = c.hidden * sizeof(uint16_t), bytes = c.max_tokens * row_bytes;
  auto patterns = count_patterns(c);
  for (const auto& counts : patterns) {
    h.set_inputs(counts);
    h.poison();
    h.train_ranks();
    const std::vector<Outputs> want = h.read_ranks();
    h.poison();
    h.on_every_rank([&](LayerSlot& s) {
      StepGraphs& g = *steps[index_of(s)];
      const BucketIO io = g.io(0);
      cudaStream_t st = s.stream.get();
      MG_CUDA_CHECK(cudaMemcpyAsync(io.x, s.x.get(), bytes, cudaMemcpyDeviceToDevice, st));
      MG_CUDA_CHECK(cudaMemcpyAsync(io.dy, s.dy.get(), bytes, cudaMemcpyDeviceToDevice, st));
      MG_CUDA_CHECK(cudaMemcpyAsync(io.num_tokens, s.tokens.get(), sizeof(int32_t), cudaMemcpyDeviceToDevice, st));
      g.forward_train(0, st);
      g.backward(0, st);
      if (c.delay) g.wgrad(0, st);
      MG_CUDA_CHECK(cudaMemcpyAsync(s.y.get(), io.y, bytes, cudaMemcpyDeviceToDevice, st));
      MG_CUDA_CHECK(cudaMemcpyAsync(s.dx.get(), io.dx, bytes, cudaMemcpyDeviceToDevice, st));
      g.check_device_errors(st);
    });
    const std::vector<Outputs> got = h.read_ranks();
    const std::string where = detail::concat(c.name, " StepGraphs n0=", counts[0], " nlast=", counts.back());
    for (std::size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(same_bits(got[i].y, want[i].y)) << where << ": y";
      EXPECT_TRUE(same_bits(got[i].dx, want[i].dx)) << where << ": dx";
      EXPECT_TRUE(same_bits(got[i].dw1, want[i].dw1)) << where << ": dw1";
      EXPECT_TRUE(same_bits(got[i].dw2, want[i].dw2)) << where << ": dw2";
      EXPECT_TRUE(same_bits(got[i].dwr, want[i].dwr)) << where << ": d_router";
    }
  }
}

}  // namespace moegraph::test
