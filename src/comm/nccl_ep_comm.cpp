// The NCCL transport of expert parallelism (moegraph/nccl_ep.hpp): windows are NCCL symmetric memory
// and peers are addressed through their LSA pointers, read once per window at set-up.
#include "moegraph/nccl_ep.hpp"

#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>

#include "kernels/comm/nccl_window.hpp"
#include "moegraph/error.hpp"
#include "src/comm/ep_environment.hpp"
#include "src/core/checks.hpp"
#include "src/core/device_info.hpp"
#include "src/core/device_scope.hpp"

namespace moegraph {

struct NcclEpComm::State {
  ncclComm_t comm = nullptr;
  bool owned = false;
  // Set by abort() before NCCL is told: from then on nothing collective runs on the communicator
  // (no window deregistration, no ncclCommDestroy), and an owned one no longer exists.
  std::atomic<bool> aborted{false};
  // Held by abort_transport across ncclCommAbort (which frees an owned communicator) and by the
  // error check while it queries NCCL: wait() polls that check while another thread may abort.
  std::mutex mutex;
  int rank = 0, ranks = 0, device = 0;
  long long timeout_ns = 0;
  std::vector<int> lsa_rank;
  ~State() {
    if (owned && comm != nullptr && !aborted) ncclCommDestroy(comm);
  }
};

namespace {

// Symmetric registration works on whole pages of NCCL's allocation granularity.
constexpr std::size_t kWindowAlignment = NCCL_WIN_REQUIRED_ALIGNMENT;

class NcclWindow final : public EpWindow {
 public:
  NcclWindow(std::shared_ptr<NcclEpComm::State> state, void* memory, ncclWindow_t window, std::vector<void*> peers,
             std::size_t bytes)
      : EpWindow(state->rank, std::move(peers), bytes), state_(std::move(state)), memory_(memory), window_(window) {}
  ~NcclWindow() override {
    // Collective like the registration: every rank frees the same windows in the same order, on
    // the communicator's device whichever device the destroying thread has current.
    // After an abort the registration went with the communicator, and a deregistration would wait
    // for peers that may be gone: only the memory is freed.
    const DeviceScope on_device(state_->device, std::nothrow);
    if (!state_->aborted) ncclCommWindowDeregister(state_->comm, window_);
    ncclMemFree(memory_);
  }

 private:
  std::shared_ptr<NcclEpComm::State> state_;
  void* memory_;
  ncclWindow_t window_;
};

// Captured grouped ncclSend / ncclRecv of megabyte chunks, received into symmetric windows, never
// completed on two H200s with NCCL 2.28 while NCCL registered user buffers itself: both ranks spun
// in NCCL's SendRecv kernel. With NCCL_GRAPH_REGISTER=0 and NCCL_LOCAL_REGISTER=0 the same steps
// ran; NCCL_LOCAL_REGISTER=0 alone did not help (docs/bench/2026-11-24-h200x2-ep-second-run.txt).
// Refused rather than hung. Kilobyte chunks completed either way.
void require_user_buffer_registration_off() {
  for (const char* name : {"NCCL_GRAPH_REGISTER", "NCCL_LOCAL_REGISTER"}) {
    const std::string refusal = comm::zero_since_start_refusal(
        name, std::getenv(name), comm::start_environment(), "the send/recv exchange over NCCL");
    MG_CHECK(refusal.empty(), refusal, ": while NCCL registers the exchange's buffers itself it hangs "
             "(docs/expert-parallel.md); scripts/launch sets NCCL_GRAPH_REGISTER=0 and NCCL_LOCAL_REGISTER=0 unless "
             "given");
  }
}

void require_nccl_version() {
  int version = 0;
  MG_NCCL_CHECK(ncclGetVersion(&version));
  MG_CHECK(version >= 22800, "expert parallelism over NCCL needs NCCL 2.28 or newer (symmetric windows and the "
           "device API), this process runs ", version);
}

std::shared_ptr<NcclEpComm> make_comm(ncclComm_t comm, bool owned) {
  auto state = std::make_shared<NcclEpComm::State>();
  state->comm = comm;  // owned only once every check passed: a refusal here leaves it to the caller
  MG_NCCL_CHECK(ncclCommUserRank(comm, &state->rank));
  MG_NCCL_CHECK(ncclCommCount(comm, &state->ranks));
  MG_NCCL_CHECK(ncclCommCuDevice(comm, &state->device));
  int current = -1;
  MG_CUDA_CHECK(cudaGetDevice(&current));
  MG_CHECK(current == state->device, "the NCCL communicator runs on device ", state->device, " but device ", current,
           " is current");
  MG_CHECK(state->ranks >= 1 && state->ranks <= kMaxExpertParallel, "an expert-parallel group has 1 to ",
           kMaxExpertParallel, " ranks, the communicator has ", state->ranks);
  state->lsa_rank = kernels::nccl_lsa_ranks(comm);
  state->timeout_ns = comm::barrier_timeout_ns_from_environment();
  auto made = std::make_shared<NcclEpComm>(state);
  state->owned = owned;
  return made;
}

// What every creation refuses by the environment, before its first collective NCCL call (so no
// rank refuses once its peers wait in it): NVLink multicast and environment plugins, and the
// barrier timeout.
void require_creation_environment() {
  comm::require_nvls_off();
  (void)comm::barrier_timeout_ns_from_environment();
}

int env_int(const char* name, int lo, int hi, int fallback) {
  return static_cast<int>(comm::env_integer(name, lo, hi, fallback));
}

std::string to_hex(const ncclUniqueId& id) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : std::string(id.internal, sizeof(id.internal))) {
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out;
}

// The id's form is checked before NCCL, CUDA or the environment is consulted, so a bad argument is
// refused by name on any machine (the C ABI relies on it).
ncclUniqueId from_hex(const std::string& hex) {
  ncclUniqueId id{};
  const std::size_t digits = 2 * sizeof(id.internal);
  MG_CHECK(hex.size() == digits, "unique_id_hex must be ", digits, " hex digits (mg_nccl_unique_id), got ",
           hex.size(), " characters");
  auto nibble = [&](std::size_t i) {
    const char c = hex[i];
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    MG_FAIL("unique_id_hex must hold hex digits only, got character ", static_cast<int>(static_cast<unsigned char>(c)),
            " at position ", i);
  };
  for (std::size_t i = 0; i < sizeof(id.internal); ++i)
    id.internal[i] = static_cast<char>(nibble(2 * i) * 16 + nibble(2 * i + 1));
  return id;
}

// Rank 0 writes a fresh id (to a temporary name, then renamed: a reader sees all of it or nothing);
// the others wait for it. The file must not exist before the launch: a stale id would join the
// ranks to a communicator that no longer exists.
std::string id_through_file(const std::string& path, int rank) {
  namespace fs = std::filesystem;
  if (rank == 0) {
    MG_CHECK(!fs::exists(path), "MOEGRAPH_NCCL_ID_FILE ", path, " exists already: give every launch a fresh path");
    const std::string hex = nccl_unique_id_hex();
    const std::string tmp = path + ".tmp";
    {
      std::ofstream f(tmp);
      f << hex;
      MG_CHECK(f.good(), "cannot write the NCCL unique id to ", tmp);
    }
    fs::rename(tmp, path);
    return hex;
  }
  const int timeout_ms = env_int("MOEGRAPH_EP_INIT_TIMEOUT_MS", 1, 3600 * 1000, 120000);
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    std::ifstream f(path);
    std::string hex;
    if (f && (f >> hex) && hex.size() == 2 * sizeof(ncclUniqueId::internal)) return hex;
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
    MG_CHECK(waited.count() < timeout_ms, "rank ", rank, " waited ", timeout_ms, " ms for rank 0's NCCL unique id in ",
             path, " (MOEGRAPH_EP_INIT_TIMEOUT_MS)");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace

NcclEpComm::NcclEpComm(std::shared_ptr<State> state) : state_(std::move(state)) {}
NcclEpComm::~NcclEpComm() = default;
int NcclEpComm::rank() const { return state_->rank; }
int NcclEpComm::ranks() const { return state_->ranks; }
int NcclEpComm::device() const { return state_->device; }
ncclComm_t NcclEpComm::nccl() const { return state_->aborted && state_->owned ? nullptr : state_->comm; }

void NcclEpComm::abort_transport() {
  const std::lock_guard<std::mutex> lock(state_->mutex);
  state_->aborted = true;
  if (!state_->owned) return;  // the caller's communicator: the caller aborts it
  const DeviceScope on_device(state_->device, std::nothrow);
  // NCCL kernels still waiting on a peer see the abort flag and return; the communicator is freed.
  const ncclResult_t r = ncclCommAbort(state_->comm);
  if (r != ncclSuccess)
    std::fprintf(stderr, "moegraph: ncclCommAbort on rank %d returned %s\n", state_->rank, ncclGetErrorString(r));
}

void NcclEpComm::check_transport_error() const {
  const std::lock_guard<std::mutex> lock(state_->mutex);
  if (state_->aborted) return;
  ncclResult_t async = ncclSuccess;
  MG_NCCL_CHECK(ncclCommGetAsyncError(state_->comm, &async));
  if (async != ncclSuccess && async != ncclInProgress)
    detail::throw_error(__FILE__, __LINE__,
                        detail::concat("rank ", state_->rank, "'s NCCL communicator reports ", ncclGetErrorString(async),
                                       ": ", ncclGetLastError(state_->comm), " (abort it: EpComm::abort)"),
                        ErrorKind::kLibrary);
}
long long NcclEpComm::barrier_timeout_ns() const { return state_->timeout_ns; }
std::string NcclEpComm::transport() const { return "nccl device api (symmetric windows, LSA peer pointers)"; }

// Grouped point-to-point calls of fixed sizes: what a capture records, replayed for any routing.
// Chunks to and from this rank itself go through NCCL as well, as in the common all-to-all style.
void NcclEpComm::all_to_all(const void* send, void* recv, std::size_t chunk_bytes, DeviceErrorRecord*,
                            cudaStream_t stream) {
  require_not_aborted("all_to_all");
  MG_CHECK(chunk_bytes % 16 == 0, "all_to_all: ", chunk_bytes, " bytes per chunk must be a multiple of 16");
  require_user_buffer_registration_off();
  const auto* from = static_cast<const char*>(send);
  auto* to = static_cast<char*>(recv);
  // A failed call inside the group must still close it: a thread left inside an NCCL group queues
  // every later NCCL call of the process's thread (the caller's own, a rebuild's init) for good.
  struct Group {
    bool open = true;
    ~Group() {
      if (open) ncclGroupEnd();
    }
  };
  MG_NCCL_CHECK(ncclGroupStart());
  Group group;
  for (int p = 0; p < state_->ranks; ++p) {
    const std::size_t at = static_cast<std::size_t>(p) * chunk_bytes;
    MG_NCCL_CHECK(ncclSend(from + at, chunk_bytes, ncclUint8, p, state_->comm, stream));
    MG_NCCL_CHECK(ncclRecv(to + at, chunk_bytes, ncclUint8, p, state_->comm, stream));
  }
  group.open = false;
  MG_NCCL_CHECK(ncclGroupEnd());
}

std::shared_ptr<EpWindow> NcclEpComm::allocate_window(std::size_t bytes) {
  require_not_aborted("allocate_window");
  MG_CHECK(bytes > 0, "an expert-parallel window needs at least one byte");
  const std::size_t rounded = (bytes + kWindowAlignment - 1) / kWindowAlignment * kWindowAlignment;
  MG_CHECK(rounded >= bytes, "an expert-parallel window of ", bytes, " bytes overflows");
  void* memory = nullptr;
  MG_NCCL_CHECK(ncclMemAlloc(&memory, rounded));
  ncclWindow_t window = nullptr;
  try {
    // Zeroed before the registration: the registration is collective, so no peer can store into
    // this window (or read its barrier flags) before it is clean.
    MG_CUDA_CHECK(cudaMemset(memory, 0, rounded));
    MG_CUDA_CHECK(cudaDeviceSynchronize());
    MG_NCCL_CHECK(ncclCommWindowRegister(state_->comm, memory, rounded, &window, NCCL_WIN_COLL_SYMMETRIC));
    // Every copy, this rank's too, is addressed through NCCL's flat mapping of the team's windows.
    std::vector<void*> peers = kernels::nccl_window_peer_pointers(window, state_->lsa_rank);
    return std::make_shared<NcclWindow>(state_, memory, window, std::move(peers), bytes);
  } catch (...) {
    if (window != nullptr) ncclCommWindowDeregister(state_->comm, window);
    ncclMemFree(memory);
    throw;
  }
}

std::string nccl_unique_id_hex() {
  ncclUniqueId id;
  MG_NCCL_CHECK(ncclGetUniqueId(&id));
  return to_hex(id);
}

std::shared_ptr<NcclEpComm> nccl_ep_comm_init(int ranks, int rank, const std::string& unique_id_hex) {
  MG_CHECK(ranks >= 1 && ranks <= kMaxExpertParallel, "ranks must be in [1, ", kMaxExpertParallel, "], got ", ranks);
  MG_CHECK(rank >= 0 && rank < ranks, "rank must be in [0, ranks - 1 = ", ranks - 1, "], got ", rank);
  const ncclUniqueId id = from_hex(unique_id_hex);
  require_creation_environment();
  require_nccl_version();
  require_supported_device();
  ncclComm_t comm = nullptr;
  MG_NCCL_CHECK(ncclCommInitRank(&comm, ranks, id, rank));
  try {
    return make_comm(comm, true);
  } catch (...) {
    ncclCommDestroy(comm);
    throw;
  }
}

bool nccl_ep_environment_present() {
  const char* ranks = std::getenv("MOEGRAPH_EP_RANKS");
  return ranks != nullptr && *ranks != '\0';
}

std::shared_ptr<NcclEpComm> nccl_ep_comm_from_environment() {
  const int ranks = env_int("MOEGRAPH_EP_RANKS", 1, kMaxExpertParallel, -1);
  const int rank = env_int("MOEGRAPH_EP_RANK", 0, ranks - 1, -1);
  int devices = 0;
  MG_CUDA_CHECK(cudaGetDeviceCount(&devices));
  const int device = env_int("MOEGRAPH_EP_DEVICE", 0, devices - 1, rank < devices ? rank : -1);
  MG_CUDA_CHECK(cudaSetDevice(device));
  // What nccl_ep_comm_init refuses by the environment, before rank 0 publishes the id: a rank 0 that
  // refused after writing it would leave its peers in ncclCommInitRank instead of at the id's timeout.
  require_creation_environment();
  std::string hex;
  if (const char* id = std::getenv("MOEGRAPH_NCCL_ID"); id != nullptr && *id != '\0') {
    hex = id;
  } else {
    const char* file = std::getenv("MOEGRAPH_NCCL_ID_FILE");
    MG_CHECK(file != nullptr && *file != '\0', "expert parallelism over NCCL needs the unique id: set "
             "MOEGRAPH_NCCL_ID (hex) or MOEGRAPH_NCCL_ID_FILE (scripts/launch does)");
    hex = id_through_file(file, rank);
  }
  return nccl_ep_comm_init(ranks, rank, hex);
}

std::shared_ptr<NcclEpComm> nccl_ep_comm_wrap(ncclComm_t comm) {
  MG_CHECK(comm != nullptr, "nccl_ep_comm_wrap: the communicator is null");
  require_creation_environment();
  require_nccl_version();
  require_supported_device();
  return make_comm(comm, false);
}

std::shared_ptr<NcclEpComm> nccl_ep_comm_split(const NcclEpComm& parent, int color, int key) {
  // Every rank takes part (NCCL_SPLIT_NOCOLOR would leave one out, with no communicator to return).
  MG_CHECK(color >= 0, "nccl_ep_comm_split: color must be >= 0, got ", color);
  parent.require_not_aborted("nccl_ep_comm_split");
  require_creation_environment();
  const DeviceScope on_device(parent.device());
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  ncclComm_t comm = nullptr;
  MG_NCCL_CHECK(ncclCommSplit(parent.nccl(), color, key, &comm, &config));
  MG_CHECK(comm != nullptr, "nccl_ep_comm_split: NCCL returned no communicator for color ", color);
  try {
    return make_comm(comm, true);
  } catch (...) {
    ncclCommDestroy(comm);
    throw;
  }
}

}  // namespace moegraph
