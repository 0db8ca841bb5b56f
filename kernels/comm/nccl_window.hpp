// The load/store addresses of an NCCL symmetric window on every rank, as this process maps them.
// NCCL hands them out only on the device (ncclGetLsaPointer), so a set-up kernel reads them once and
// the exchange kernels take plain pointers (PeerBases), the same as for emulated ranks.
#pragma once

#include <vector>

typedef struct ncclComm* ncclComm_t;               // as nccl.h declares them
typedef struct ncclWindow_vidmem* ncclWindow_t;

namespace moegraph::kernels {

// Each world rank's rank in this rank's LSA team (the peers it reaches by load/store); throws when
// some rank of the communicator is outside it (another host, or no NVLink path).
std::vector<int> nccl_lsa_ranks(ncclComm_t comm);

// Set-up only (launches, copies back, synchronizes): entry r is world rank r's copy of the window,
// where lsa_rank[r] is r's rank in this rank's LSA team.
std::vector<void*> nccl_window_peer_pointers(ncclWindow_t window, const std::vector<int>& lsa_rank);

}  // namespace moegraph::kernels
