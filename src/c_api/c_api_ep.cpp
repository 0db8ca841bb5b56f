// The C ABI of the communicators (expert parallelism, and the data-parallel group of sharded weights):
// mg_nccl_unique_id, mg_ep_comm_*, and the shard descriptors' policies (mg_shard_rows).
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "moegraph/error.hpp"
#include "moegraph/expert_parallel.hpp"
#include "moegraph/moegraph.h"
#include "moegraph/nccl_ep.hpp"
#include "moegraph/sharding.hpp"
#include "moegraph/types.hpp"
#include "src/c_api/c_api_common.hpp"

struct mg_ep_comm {
  std::shared_ptr<moegraph::EpComm> comm;
};

namespace {

using moegraph::c_api::guarded;
using moegraph::c_api::HandleKind;

// 2 hex digits per byte of ncclUniqueId (NCCL_UNIQUE_ID_BYTES, 128).
constexpr std::size_t kUniqueIdDigits = 256;

// Takes a communicator and hands out its handle.
void emit(std::shared_ptr<moegraph::EpComm> comm, mg_ep_comm** out) {
  auto handle = std::make_unique<mg_ep_comm>();
  handle->comm = std::move(comm);
  moegraph::c_api::register_handle(handle.get(), HandleKind::kEpComm);
  *out = handle.release();
}

// A C string read at most one past the id's length (strnlen): the rest of the id's checks (its
// length, hex digits, ranks and rank) are nccl_ep_comm_init's, made before it touches NCCL or a GPU.
std::string bounded_unique_id(const char* hex) {
  MG_CHECK(hex != nullptr, "mg_ep_comm_create_nccl: unique_id_hex is NULL (make it with mg_nccl_unique_id)");
  const std::size_t length = strnlen(hex, kUniqueIdDigits + 1);
  MG_CHECK(length <= kUniqueIdDigits, "mg_ep_comm_create_nccl: unique_id_hex must be ", kUniqueIdDigits,
           " hex digits (mg_nccl_unique_id), got a longer string");
  return std::string(hex, length);
}

}  // namespace

namespace moegraph::c_api {

std::shared_ptr<EpComm> ep_comm_of(const mg_ep_comm* comm) {
  check_handle(comm, HandleKind::kEpComm, "mg_ep_comm");
  return comm->comm;
}

}  // namespace moegraph::c_api

extern "C" {

mg_status mg_nccl_unique_id(char* out, size_t size) {
  return guarded([&] {
    MG_CHECK(out != nullptr, "mg_nccl_unique_id needs an output buffer");
    if (size > 0) out[0] = '\0';
    MG_CHECK(size >= kUniqueIdDigits + 1, "mg_nccl_unique_id: size must be at least ", kUniqueIdDigits + 1,
             " (", kUniqueIdDigits, " hex digits and a NUL), got ", size);
    const std::string hex = moegraph::nccl_unique_id_hex();
    MG_CHECK(hex.size() == kUniqueIdDigits, "mg_nccl_unique_id: NCCL gave an id of ", hex.size(), " hex digits");
    std::memcpy(out, hex.c_str(), hex.size() + 1);
  });
}

mg_status mg_ep_comm_create_nccl(int ranks, int rank, const char* unique_id_hex, mg_ep_comm** out) {
  return guarded([&] {
    MG_CHECK(out != nullptr, "mg_ep_comm_create_nccl needs an output handle");
    *out = nullptr;
    emit(moegraph::nccl_ep_comm_init(ranks, rank, bounded_unique_id(unique_id_hex)), out);
  });
}

mg_status mg_ep_comm_create_from_environment(mg_ep_comm** out) {
  return guarded([&] {
    MG_CHECK(out != nullptr, "mg_ep_comm_create_from_environment needs an output handle");
    *out = nullptr;
    emit(moegraph::nccl_ep_comm_from_environment(), out);
  });
}

mg_status mg_ep_comm_wrap_nccl(void* nccl_comm, mg_ep_comm** out) {
  return guarded([&] {
    MG_CHECK(out != nullptr, "mg_ep_comm_wrap_nccl needs an output handle");
    *out = nullptr;
    MG_CHECK(nccl_comm != nullptr, "mg_ep_comm_wrap_nccl: nccl_comm is NULL (pass the caller's ncclComm_t)");
    emit(moegraph::nccl_ep_comm_wrap(static_cast<ncclComm_t>(nccl_comm)), out);
  });
}

mg_status mg_ep_comm_split(mg_ep_comm* parent, int color, int key, mg_ep_comm** out) {
  return guarded([&] {
    MG_CHECK(out != nullptr, "mg_ep_comm_split needs an output handle");
    *out = nullptr;
    const auto nccl = std::dynamic_pointer_cast<moegraph::NcclEpComm>(moegraph::c_api::ep_comm_of(parent));
    MG_CHECK(nccl != nullptr, "mg_ep_comm_split: the parent is not an NCCL communicator (emulated groups are made "
             "with mg_ep_emulated_group_create)");
    emit(moegraph::nccl_ep_comm_split(*nccl, color, key), out);
  });
}

mg_status mg_ep_emulated_group_create(int ranks, mg_ep_comm** out_array) {
  return guarded([&] {
    MG_CHECK(out_array != nullptr, "mg_ep_emulated_group_create needs an output array");
    MG_CHECK(ranks >= 1 && ranks <= moegraph::kMaxExpertParallel, "mg_ep_emulated_group_create: ranks must be in [1, ",
             moegraph::kMaxExpertParallel, "], got ", ranks);
    for (int r = 0; r < ranks; ++r) out_array[r] = nullptr;
    const moegraph::EmulatedEpGroup group(ranks);  // its communicators keep the group's state alive
    std::vector<std::unique_ptr<mg_ep_comm>> handles;
    for (int r = 0; r < ranks; ++r) {
      handles.push_back(std::make_unique<mg_ep_comm>());
      handles.back()->comm = group.rank(r);
    }
    std::size_t registered = 0;
    try {
      for (; registered < handles.size(); ++registered)
        moegraph::c_api::register_handle(handles[registered].get(), HandleKind::kEpComm);
    } catch (...) {
      for (std::size_t i = 0; i < registered; ++i)
        moegraph::c_api::unregister_handle(handles[i].get(), HandleKind::kEpComm);
      throw;
    }
    for (int r = 0; r < ranks; ++r) out_array[r] = handles[r].release();
  });
}

void mg_ep_comm_destroy(mg_ep_comm* comm) {
  if (moegraph::c_api::unregister_handle(comm, HandleKind::kEpComm)) delete comm;
}

mg_status mg_ep_comm_rank(const mg_ep_comm* comm, int* out) {
  return guarded([&] {
    MG_CHECK(out != nullptr, "mg_ep_comm_rank needs an output");
    *out = moegraph::c_api::ep_comm_of(comm)->rank();
  });
}

mg_status mg_ep_comm_ranks(const mg_ep_comm* comm, int* out) {
  return guarded([&] {
    MG_CHECK(out != nullptr, "mg_ep_comm_ranks needs an output");
    *out = moegraph::c_api::ep_comm_of(comm)->ranks();
  });
}

mg_status mg_ep_comm_wait(mg_ep_comm* comm, cudaStream_t stream, int64_t timeout_ms, int* completed) {
  return guarded([&] {
    MG_CHECK(completed != nullptr, "mg_ep_comm_wait needs an output");
    *completed = 0;
    const auto c = moegraph::c_api::ep_comm_of(comm);
    *completed = c->wait(stream, timeout_ms) == moegraph::EpComm::WaitResult::kDone ? 1 : 0;
  });
}

mg_status mg_ep_comm_abort(mg_ep_comm* comm) {
  return guarded([&] { moegraph::c_api::ep_comm_of(comm)->abort(); });
}

mg_status mg_shard_rows(mg_shard_policy policy, int64_t global_rows, int ranks, int rank, int64_t* first_row,
                        int64_t* rows) {
  return guarded([&] {
    if (first_row != nullptr) *first_row = 0;  // what a refused call leaves, a missing output's too
    if (rows != nullptr) *rows = 0;
    MG_CHECK(first_row != nullptr && rows != nullptr, "mg_shard_rows needs both outputs");
    MG_CHECK(policy == MG_SHARD_CHUNK || policy == MG_SHARD_BALANCED, "mg_shard_rows: policy ",
             static_cast<int>(policy), " is neither MG_SHARD_CHUNK (0) nor MG_SHARD_BALANCED (1)");
    const moegraph::Shard s = moegraph::shard_for(
        policy == MG_SHARD_CHUNK ? moegraph::ShardPolicy::kChunk : moegraph::ShardPolicy::kBalanced, global_rows, ranks,
        rank);
    *first_row = s.first_row, *rows = s.rows;
  });
}

}  // extern "C"
