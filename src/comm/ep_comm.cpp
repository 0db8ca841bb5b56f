// What every expert-parallel transport shares: waiting for a step with a deadline, and abort
// (moegraph/expert_parallel.hpp).
#include <chrono>
#include <thread>

#include "moegraph/error.hpp"
#include "moegraph/expert_parallel.hpp"
#include "src/core/checks.hpp"
#include "src/core/deadline.hpp"
#include "src/core/device_scope.hpp"

namespace moegraph {

EpComm::WaitResult EpComm::wait(cudaStream_t stream, long long timeout_ms) {
  MG_CHECK(timeout_ms >= 0, "EpComm::wait: timeout_ms must be >= 0, got ", timeout_ms);
  const DeviceScope on_device(device());
  cudaEvent_t done = nullptr;
  MG_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  struct Destroy {
    cudaEvent_t e;
    ~Destroy() { cudaEventDestroy(e); }
  } destroy{done};
  MG_CUDA_CHECK(cudaEventRecord(done, stream));
  const auto deadline = deadline_after(std::chrono::steady_clock::now(), timeout_ms);
  // Polled rather than synchronized: a blocking wait could not be given up, and a thread blocked in
  // it would hold the stream's work hostage to a peer that never comes.
  for (;;) {
    const cudaError_t state = cudaEventQuery(done);
    if (state == cudaSuccess) return WaitResult::kDone;
    if (state != cudaErrorNotReady) MG_CUDA_CHECK(state);
    check_transport_error();
    if (std::chrono::steady_clock::now() >= deadline) return WaitResult::kTimedOut;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

void EpComm::abort() {
  if (aborted_.exchange(true, std::memory_order_acq_rel)) return;
  abort_transport();
}

void EpComm::require_not_aborted(std::string_view what) const {
  MG_CHECK(!aborted(), what, ": rank ", rank(), "'s expert-parallel communicator was aborted (EpComm::abort); "
           "destroy the layers and steps made with it and make new ones on a new communicator");
}

}  // namespace moegraph
