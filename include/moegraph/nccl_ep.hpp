// Expert parallelism over NCCL: one process per GPU, the windows of moegraph/expert_parallel.hpp are
// NCCL symmetric memory (ncclMemAlloc, registered on the communicator with ncclCommWindowRegister)
// and every peer is reached through its load/store (LSA) pointer over NVLink, so the dispatch and
// combine kernels store exact rows into peers' memory with no host involvement.
//
// Requirements, checked at creation: NCCL 2.28 or newer; every rank of the communicator in this
// rank's LSA team (one host's NVLink domain); NCCL_NVLS_ENABLE=0 in the process, since it started
// (moegraph never uses NVLink multicast, and a communicator created with it may bind multicast
// memory to every window: on shared machines that is refused rather than risked; NCCL reads the
// variable once, when it first starts, so a setenv after the start is refused too); and no NCCL
// environment plugin named by NCCL_ENV_PLUGIN (anything but "none": NCCL would read NCCL_NVLS_ENABLE
// through it; scripts/launch sets none, which also keeps NCCL from loading a default libnccl-env.so
// found on the library path, something this check cannot see). The send/recv
// exchange (EpExchange::kSendRecv) also needs NCCL_GRAPH_REGISTER=0 and NCCL_LOCAL_REGISTER=0, checked by
// its first exchange (a StepGraphs' set-up, or a MoeLayer's first forward): with NCCL's own
// registration of the captured buffers it hung (docs/expert-parallel.md).
//
// Getting a communicator:
//   - nccl_ep_comm_from_environment(): what scripts/launch starts (MOEGRAPH_EP_RANK,
//     MOEGRAPH_EP_RANKS, MOEGRAPH_EP_DEVICE, and the unique id in MOEGRAPH_NCCL_ID (hex) or in the
//     file MOEGRAPH_NCCL_ID_FILE, which rank 0 creates and the others wait for);
//   - nccl_ep_comm_init(ranks, rank, id): the caller distributes the id (nccl_unique_id_hex());
//   - nccl_ep_comm_wrap(comm): the caller's own ncclComm_t, not destroyed by moegraph;
//   - nccl_ep_comm_split(parent, color, key): a sub-group of a communicator, e.g. the expert-parallel
//     and the data-parallel groups of a sharded step under expert parallelism (docs/sharding.md).
// Creation and window allocation are collective and synchronize; nothing of this runs in a step.
#pragma once

#include "moegraph/export.h"

#include <memory>
#include <string>

#include "moegraph/expert_parallel.hpp"

typedef struct ncclComm* ncclComm_t;  // as nccl.h declares it

namespace moegraph {

class MOEGRAPH_API NcclEpComm : public EpComm {
 public:
  ~NcclEpComm() override;
  int rank() const override;
  int ranks() const override;
  std::string transport() const override;
  std::shared_ptr<EpWindow> allocate_window(std::size_t bytes) override;
  long long barrier_timeout_ns() const override;
  void all_to_all(const void* send, void* recv, std::size_t chunk_bytes, DeviceErrorRecord* error,
                  cudaStream_t stream) override;
  // The communicator (for the caller's own collectives, e.g. a baseline all-to-all); null after
  // abort() on one moegraph created (ncclCommAbort freed it).
  ncclComm_t nccl() const;
  int device() const override;
  struct State;  // opaque: shared with the windows, which keep the communicator alive

  explicit NcclEpComm(std::shared_ptr<State> state);

 protected:
  void abort_transport() override;
  void check_transport_error() const override;

 private:
  std::shared_ptr<State> state_;
};

// A fresh NCCL unique id as 256 hex digits (for nccl_ep_comm_init or MOEGRAPH_NCCL_ID).
MOEGRAPH_API std::string nccl_unique_id_hex();
// Creates a communicator of `ranks` with this process as `rank` on the current device.
MOEGRAPH_API std::shared_ptr<NcclEpComm> nccl_ep_comm_init(int ranks, int rank, const std::string& unique_id_hex);
// From the launcher's environment (see above); sets the current device to MOEGRAPH_EP_DEVICE
// (default: the rank). Ranks other than 0 wait at most MOEGRAPH_EP_INIT_TIMEOUT_MS (default 120 s)
// for the id file.
MOEGRAPH_API std::shared_ptr<NcclEpComm> nccl_ep_comm_from_environment();
// Whether the launcher's environment is present (MOEGRAPH_EP_RANKS is set).
MOEGRAPH_API bool nccl_ep_environment_present();
// The caller's communicator (its current device must be the communicator's); not destroyed.
MOEGRAPH_API std::shared_ptr<NcclEpComm> nccl_ep_comm_wrap(ncclComm_t comm);
// The ranks of `parent` that pass the same color (>= 0), ordered by key (then by parent rank), as a
// new communicator on the parent's device (ncclCommSplit). Collective over every rank of the parent.
MOEGRAPH_API std::shared_ptr<NcclEpComm> nccl_ep_comm_split(const NcclEpComm& parent, int color, int key);

}  // namespace moegraph
