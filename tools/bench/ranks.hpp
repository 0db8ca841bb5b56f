// The ranks of a multi-rank bench (expert parallelism, sharded weights): where they meet before a
// timed run, outside the timing, and the largest of a value over them. Between processes, one per
// GPU, through NCCL; between emulated ranks' threads in one process, through a host barrier (the
// object is then shared by the threads). Each rank's stream is synchronized first.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <barrier>
#include <memory>
#include <vector>

#include "moegraph/nccl_ep.hpp"
#include "src/core/checks.hpp"
#include "src/core/device_buffer.hpp"

namespace moegraph::bench {

class Ranks {
 public:
  // nccl: this process's communicator; null for `ranks` emulated ranks.
  Ranks(int ranks, std::shared_ptr<NcclEpComm> nccl)
      : nccl_(std::move(nccl)), barrier_(ranks), values_(ranks), scratch_(nccl_ ? sizeof(double) : 0) {}
  bool emulated() const { return nccl_ == nullptr; }
  ncclComm_t nccl() const { return nccl_->nccl(); }
  // `rank`: the calling rank (emulated ranks share this object; meet needs it only for symmetry).
  void meet([[maybe_unused]] int rank, cudaStream_t s) {
    MG_CUDA_CHECK(cudaStreamSynchronize(s));
    if (emulated()) return barrier_.arrive_and_wait();
    MG_NCCL_CHECK(ncclAllReduce(scratch_.get(), scratch_.get(), 1, ncclFloat64, ncclSum, nccl(), s));
    MG_CUDA_CHECK(cudaStreamSynchronize(s));
  }
  double max(int rank, double v, cudaStream_t s) {
    if (emulated()) {
      values_[rank] = v;
      barrier_.arrive_and_wait();
      const double m = *std::max_element(values_.begin(), values_.end());
      barrier_.arrive_and_wait();  // every rank has read before the next max writes
      return m;
    }
    MG_CUDA_CHECK(cudaMemcpyAsync(scratch_.get(), &v, sizeof v, cudaMemcpyHostToDevice, s));
    MG_NCCL_CHECK(ncclAllReduce(scratch_.get(), scratch_.get(), 1, ncclFloat64, ncclMax, nccl(), s));
    MG_CUDA_CHECK(cudaMemcpyAsync(&v, scratch_.get(), sizeof v, cudaMemcpyDeviceToHost, s));
    MG_CUDA_CHECK(cudaStreamSynchronize(s));
    return v;
  }

 private:
  std::shared_ptr<NcclEpComm> nccl_;
  std::barrier<> barrier_;
  std::vector<double> values_;
  DeviceBuffer scratch_;
};

}  // namespace moegraph::bench
