#include "kernels/comm/nccl_window.hpp"

#include <nccl.h>
// NCCL's device headers leave parameters of stub functions unnamed-but-unused: not our warnings.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include <nccl_device.h>
#pragma GCC diagnostic pop

#include "moegraph/error.hpp"
#include "moegraph/types.hpp"

namespace moegraph::kernels {
namespace {

struct LsaRanks {
  int rank[kMaxExpertParallel];
};

__global__ void peer_pointers_kernel(ncclWindow_t window, LsaRanks lsa, int ranks, void** out) {
  const int r = threadIdx.x;
  if (r < ranks) out[r] = ncclGetLsaPointer(window, 0, lsa.rank[r]);
}

}  // namespace

std::vector<int> nccl_lsa_ranks(ncclComm_t comm) {
  int ranks = 0;
  MG_CHECK(ncclCommCount(comm, &ranks) == ncclSuccess, "ncclCommCount failed");
  const ncclTeam_t world = ncclTeamWorld(comm), lsa = ncclTeamLsa(comm);
  MG_CHECK(lsa.nRanks == ranks, "expert parallelism over NCCL needs every rank to reach every other by load/store "
           "over NVLink (one LSA team), but this rank's LSA team holds ", lsa.nRanks, " of the communicator's ", ranks,
           " ranks: use ranks on one host's NVLink domain");
  std::vector<int> out(ranks);
  for (int r = 0; r < ranks; ++r) out[r] = ncclTeamRankToLsa(comm, world, r);
  return out;
}

std::vector<void*> nccl_window_peer_pointers(ncclWindow_t window, const std::vector<int>& lsa_rank) {
  const int ranks = static_cast<int>(lsa_rank.size());
  MG_CHECK(ranks >= 1 && ranks <= kMaxExpertParallel, "an NCCL window of ", ranks, " ranks");
  LsaRanks lsa{};
  for (int r = 0; r < ranks; ++r) lsa.rank[r] = lsa_rank[r];
  void** out = nullptr;
  MG_CUDA_CHECK(cudaMalloc(&out, sizeof(void*) * ranks));
  std::vector<void*> host(ranks, nullptr);
  peer_pointers_kernel<<<1, kMaxExpertParallel>>>(window, lsa, ranks, out);
  cudaError_t status = cudaGetLastError();
  if (status == cudaSuccess) status = cudaMemcpy(host.data(), out, sizeof(void*) * ranks, cudaMemcpyDeviceToHost);
  cudaFree(out);
  MG_CUDA_CHECK(status);
  return host;
}

}  // namespace moegraph::kernels
