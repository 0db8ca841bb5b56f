// Expert parallelism: the group of R ranks a MoeLayer spreads its experts over. Rank r owns experts
// [r·E/R, (r+1)·E/R); its layer holds the weights of those experts only (the router stays whole).
//
// An EpComm gives a layer what its exchange kernels need: its rank, the group size, and windows:
// memory laid out identically on every rank, which every rank can load from and store to. Two
// transports implement it:
//   - NCCL's device API (moegraph/nccl_ep.hpp): one process per GPU, windows are NCCL symmetric
//     memory registered on the communicator, and peers are reached through their load/store (LSA)
//     pointers over NVLink;
//   - EmulatedEpGroup: R ranks in one process on one GPU (each rank its own layer and stream; the
//     windows are R buffers of that GPU). The same kernels run; it is how the EP logic is tested on
//     one GPU.
// Set-up calls (allocate_window) are collective: every rank makes them in the same order with the
// same sizes. Steps are collective too: every rank runs the same sequence of forward / backward
// calls (the token counts may differ), or the group's device barriers time out and report it.
#pragma once

#include "moegraph/export.h"

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "moegraph/types.hpp"

namespace moegraph {

// One window: this rank's copy and every rank's copy as this rank addresses it (peer(rank) ==
// local()). Zeroed when allocated. Freed with the last reference.
class MOEGRAPH_API EpWindow {
 public:
  virtual ~EpWindow() = default;
  void* local() const { return peers_.at(static_cast<std::size_t>(rank_)); }
  void* peer(int rank) const { return peers_.at(static_cast<std::size_t>(rank)); }
  std::size_t bytes() const { return bytes_; }
  int ranks() const { return static_cast<int>(peers_.size()); }

 protected:
  EpWindow(int rank, std::vector<void*> peers, std::size_t bytes)
      : rank_(rank), peers_(std::move(peers)), bytes_(bytes) {}

 private:
  int rank_;
  std::vector<void*> peers_;
  std::size_t bytes_;
};

class MOEGRAPH_API EpComm {
 public:
  virtual ~EpComm() = default;
  virtual int rank() const = 0;
  virtual int ranks() const = 0;
  // "nccl device API (symmetric windows, LSA peer pointers)", "emulated ranks on one GPU", ...
  virtual std::string transport() const = 0;
  // The CUDA device this rank runs on (current when the communicator was created), or -1 when the
  // communicator does not say: the layers and steps made with it are set up on this device, whatever
  // device the creating thread has current.
  virtual int device() const { return -1; }
  // Collective (see above). Set-up only: allocates and may synchronize.
  virtual std::shared_ptr<EpWindow> allocate_window(std::size_t bytes) = 0;
  // How long a device barrier waits for a peer before it reports kDeviceErrorPeerTimeout and stops
  // the exchanges that wait on it (set-up reads MOEGRAPH_EP_TIMEOUT_MS, default 20000).
  virtual long long barrier_timeout_ns() const = 0;
  // Collective, set-up only: returns once every rank has called it. A step's first device barrier
  // must not start while a rank sharing its GPU still allocates or sets memory (the driver may order
  // that rank's later work after the waiting kernel: a deadlock until the timeout), so StepGraphs
  // calls it between its allocations and its warm-up. Emulated ranks wait for each other on the
  // host (throwing after the barrier timeout); NCCL ranks, one GPU each, have nothing to wait for.
  virtual void set_up_barrier() {}
  // Collective enqueue, for EpExchange::kSendRecv: chunk p of `send` ([ranks][chunk_bytes], device
  // memory) is moved whole into chunk rank() of rank p's `recv` ([ranks][chunk_bytes]), and chunk s
  // of this rank's `recv` holds rank s's chunk when the stream passes this call. `recv` must lie in
  // one of this communicator's windows, at the same offset on every rank; chunk_bytes is a multiple
  // of 16. NCCL: grouped ncclSend / ncclRecv (capturable; no host synchronization). Emulated ranks:
  // stores into the peers' windows and a device barrier, whose timeout is reported in `error`.
  virtual void all_to_all(const void* send, void* recv, std::size_t chunk_bytes, DeviceErrorRecord* error,
                          cudaStream_t stream) = 0;

  // ---- A peer that died or hangs ----
  // A server learns of it from a step's error (kDeviceErrorPeerTimeout or kDeviceErrorPeerStopped:
  // the device barriers gave up) or from wait() timing out (a send/recv exchange, whose NCCL
  // kernels have no timeout of their own, still waiting). Then: abort(), let the stream drain, and
  // destroy the layers, steps and communicators; make new ones with the ranks that are left.
  //
  // Waits on the host until the work enqueued on `stream` so far is done, at most timeout_ms (>= 0;
  // a value past a century, such as the largest for "forever", waits a century). kTimedOut leaves
  // that work in flight. Throws if the transport reports an error of its own
  // (NCCL: ncclCommGetAsyncError). It polls, so another thread may abort() meanwhile. Not an
  // enqueue path: it synchronizes.
  enum class WaitResult { kDone, kTimedOut };
  WaitResult wait(cudaStream_t stream, long long timeout_ms);
  // Stops this rank's communication for good. NCCL: ncclCommAbort on a communicator moegraph
  // created, which makes NCCL kernels still waiting on a peer return (a wrapped communicator,
  // nccl_ep_comm_wrap, is the caller's to abort: abort() then only marks this one). Afterwards every
  // layer call, step and window allocation with this communicator is refused, and destroying the
  // windows, layers and steps made with it calls nothing collective, so no teardown waits for a
  // peer. Not collective. Safe from another thread while the stream still runs a step or another
  // thread polls wait() (not while another thread is enqueuing one, or destroying the windows,
  // layers or steps made with this communicator). A second call does nothing.
  void abort();
  bool aborted() const { return aborted_.load(std::memory_order_acquire); }
  // Throws, naming `what` (e.g. "forward"), once abort() was called.
  void require_not_aborted(std::string_view what) const;

 protected:
  // The transport's part of abort() (called once) and of wait() (throws on its own errors).
  virtual void abort_transport() {}
  virtual void check_transport_error() const {}

 private:
  std::atomic<bool> aborted_{false};
};

// R ranks in this process, on the current device. rank(r) is rank r's communicator; it shares the
// group (the group outlives none of its communicators' windows: they hold it). The ranks' steps run
// concurrently on their own streams and wait for each other on the device, so every kernel must be
// loaded before the first step: the process needs CUDA_MODULE_LOADING=EAGER (set before CUDA
// initializes; lazy loading, the default, can stall a waiting rank's peers). The constructor
// refuses to run without it, and refuses more ranks than the process has hardware queues
// (CUDA_DEVICE_MAX_CONNECTIONS, 8 unless set before CUDA initializes, at most 32): ranks sharing a
// queue could wait on each other's kernels queued behind their barriers. Queues go to streams in
// creation order, so count every stream the process creates: a StepGraphs adds one of its own per
// rank, and several groups in one process (an expert-parallel by data-parallel grid) add theirs.
class MOEGRAPH_API EmulatedEpGroup {
 public:
  explicit EmulatedEpGroup(int ranks);
  ~EmulatedEpGroup();
  int ranks() const;
  std::shared_ptr<EpComm> rank(int r) const;
  struct State;  // opaque: shared by the group and its communicators

 private:
  std::shared_ptr<State> state_;
  std::vector<std::shared_ptr<EpComm>> comms_;
};

}  // namespace moegraph
