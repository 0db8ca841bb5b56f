// R expert-parallel ranks in one process on one GPU: window k of every rank is allocated when the
// first rank asks for it, so each rank's peer table is complete however the ranks' set-up calls
// interleave (one thread builds rank 0's layer, then rank 1's, ...).
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <string>

#include "kernels/comm/ep_exchange.hpp"
#include "moegraph/error.hpp"
#include "moegraph/expert_parallel.hpp"
#include "src/comm/ep_environment.hpp"
#include "src/core/device_buffer.hpp"
#include "src/core/device_info.hpp"

namespace moegraph {

struct EmulatedEpGroup::State {
  struct Allocation {
    std::size_t bytes;
    std::vector<DeviceBuffer> buffers;  // one per rank
  };
  int ranks = 0;
  int device = -1;  // current at the group's creation; every rank's
  long long timeout_ns = 0;
  std::mutex mutex;
  std::vector<std::shared_ptr<Allocation>> allocations;
  std::vector<std::size_t> calls;  // windows each rank has asked for
  // set_up_barrier: ranks arrived in the current generation.
  std::condition_variable arrived_cv;
  int arrived = 0;
  long long generation = 0;
  // all_to_all's device barrier: per rank, `ranks` flags and then its epoch (zeroed).
  std::vector<DeviceBuffer> barrier;
};

namespace {

class EmulatedWindow final : public EpWindow {
 public:
  EmulatedWindow(int rank, std::shared_ptr<EmulatedEpGroup::State::Allocation> a)
      : EpWindow(rank, pointers(*a), a->bytes), allocation_(std::move(a)) {}

 private:
  static std::vector<void*> pointers(const EmulatedEpGroup::State::Allocation& a) {
    std::vector<void*> out;
    for (const DeviceBuffer& b : a.buffers) out.push_back(b.get());
    return out;
  }
  std::shared_ptr<EmulatedEpGroup::State::Allocation> allocation_;
};

class EmulatedComm final : public EpComm {
 public:
  EmulatedComm(std::shared_ptr<EmulatedEpGroup::State> state, int rank) : state_(std::move(state)), rank_(rank) {}
  int rank() const override { return rank_; }
  int ranks() const override { return state_->ranks; }
  std::string transport() const override { return "emulated ranks on one GPU"; }
  int device() const override { return state_->device; }
  long long barrier_timeout_ns() const override { return state_->timeout_ns; }

  std::shared_ptr<EpWindow> allocate_window(std::size_t bytes) override {
    require_not_aborted("allocate_window");
    MG_CHECK(bytes > 0, "an expert-parallel window needs at least one byte");
    std::lock_guard<std::mutex> lock(state_->mutex);
    // The rank's count moves only once its window is given: a refused or failed call leaves its
    // next call paired with the same window as its peers' (they would wait at another otherwise).
    const std::size_t k = state_->calls[rank_];
    if (k == state_->allocations.size()) {
      auto a = std::make_shared<EmulatedEpGroup::State::Allocation>();
      a->bytes = bytes;
      for (int r = 0; r < state_->ranks; ++r) {
        a->buffers.emplace_back(bytes);
        MG_CUDA_CHECK(cudaMemset(a->buffers.back().get(), 0, bytes));
      }
      MG_CUDA_CHECK(cudaDeviceSynchronize());
      state_->allocations.push_back(std::move(a));
    }
    const auto& a = state_->allocations[k];
    MG_CHECK(a->bytes == bytes, "emulated rank ", rank_, " asked for window ", k, " with ", bytes,
             " bytes, but rank(s) before it asked for ", a->bytes, ": ranks must set up the same layers in the "
             "same order");
    auto window = std::make_shared<EmulatedWindow>(rank_, a);
    ++state_->calls[rank_];
    return window;
  }

  // The peers' stores go straight into `recv` on every rank (found through the window holding it),
  // then the group's own device barrier publishes them.
  void all_to_all(const void* send, void* recv, std::size_t chunk_bytes, DeviceErrorRecord* error,
                  cudaStream_t stream) override {
    require_not_aborted("all_to_all");
    EmulatedEpGroup::State& st = *state_;
    kernels::PeerBases to;
    {
      std::lock_guard<std::mutex> lock(st.mutex);  // allocations only grow at set-up; host data only
      for (const auto& a : st.allocations) {
        const char* mine = static_cast<const char*>(a->buffers[rank_].get());
        const char* at = static_cast<const char*>(recv);
        if (at < mine || at >= mine + a->bytes) continue;
        MG_CHECK(static_cast<std::size_t>(at - mine) + chunk_bytes * st.ranks <= a->bytes,
                 "all_to_all: the receive chunks pass the end of their window");
        for (int r = 0; r < st.ranks; ++r) to.base[r] = static_cast<char*>(a->buffers[r].get()) + (at - mine);
      }
    }
    MG_CHECK(to.base[0] != nullptr, "all_to_all: the receive buffer is not in a window of emulated rank ", rank_);
    // The group's link word: once a barrier of this rank timed out, no chunk reaches a peer.
    uint32_t* link = st.barrier[rank_].as<uint32_t>() + st.ranks;
    kernels::launch_ep_push_chunks(send, to, chunk_bytes, rank_, st.ranks, link, stream);
    kernels::EpBarrierParams b;
    for (int r = 0; r < st.ranks; ++r) b.flags.base[r] = static_cast<char*>(st.barrier[r].get());
    b.epoch = link;
    b.rank = rank_, b.ranks = st.ranks;
    b.timeout_ns = st.timeout_ns;
    b.error = error;
    kernels::launch_ep_barrier(b, stream);
  }

  void set_up_barrier() override {
    EmulatedEpGroup::State& st = *state_;
    std::unique_lock<std::mutex> lock(st.mutex);
    const long long generation = st.generation;
    if (++st.arrived == st.ranks) {
      st.arrived = 0, ++st.generation;
      st.arrived_cv.notify_all();
      return;
    }
    const bool all = st.arrived_cv.wait_for(lock, std::chrono::nanoseconds(st.timeout_ns),
                                            [&] { return st.generation != generation; });
    if (!all) --st.arrived;  // leave the generation as it was for the ranks still to come
    MG_CHECK(all, "emulated rank ", rank_, " waited ", st.timeout_ns / 1000000, " ms at a set-up barrier for the "
             "other ranks (each rank needs its own thread to set up a collective step)");
  }

 private:
  std::shared_ptr<EmulatedEpGroup::State> state_;
  int rank_;
};

}  // namespace

EmulatedEpGroup::EmulatedEpGroup(int ranks) : state_(std::make_shared<State>()) {
  MG_CHECK(ranks >= 1 && ranks <= kMaxExpertParallel, "an emulated expert-parallel group needs 1 to ",
           kMaxExpertParallel, " ranks, got ", ranks);
  // Each rank's stream needs a hardware queue of its own. Streams beyond the process's queues share
  // one, in submission order: a rank's kernel queued behind another rank's spinning barrier and its
  // successor cannot start, and the barrier waits for it until the timeout.
  const long long queues = comm::env_integer("CUDA_DEVICE_MAX_CONNECTIONS", 1, 32, 8);
  MG_CHECK(ranks <= queues, "an emulated expert-parallel group of ", ranks, " ranks needs as many hardware queues, "
           "and this process has ", queues, " (CUDA_DEVICE_MAX_CONNECTIONS, 8 unless set, at most 32; set it before "
           "CUDA initializes)");
  const char* loading = std::getenv("CUDA_MODULE_LOADING");
  MG_CHECK(ranks == 1 || (loading != nullptr && std::string(loading) == "EAGER"),
           "emulated expert-parallel ranks wait for each other on one GPU, so every kernel must be loaded before "
           "the first step: run with CUDA_MODULE_LOADING=EAGER (set before CUDA initializes; got ",
           loading ? loading : "unset, which means LAZY", ")");
  state_->device = require_supported_device().device;
  state_->ranks = ranks;
  state_->timeout_ns = comm::barrier_timeout_ns_from_environment();
  state_->calls.assign(ranks, 0);
  for (int r = 0; r < ranks; ++r) {
    state_->barrier.emplace_back((ranks + 1) * sizeof(uint32_t));
    MG_CUDA_CHECK(cudaMemset(state_->barrier.back().get(), 0, state_->barrier.back().bytes()));
  }
  MG_CUDA_CHECK(cudaDeviceSynchronize());
  for (int r = 0; r < ranks; ++r) comms_.push_back(std::make_shared<EmulatedComm>(state_, r));
}

EmulatedEpGroup::~EmulatedEpGroup() = default;
int EmulatedEpGroup::ranks() const { return state_->ranks; }
std::shared_ptr<EpComm> EmulatedEpGroup::rank(int r) const {
  MG_CHECK(r >= 0 && r < state_->ranks, "rank ", r, " is outside the group of ", state_->ranks);
  return comms_[r];
}

}  // namespace moegraph
