// The small vocabulary every layer shares: element types, recipes, router scores, step kinds and
// the device error record. Each enum has one name function (an exhaustive switch).
#pragma once

#include "moegraph/export.h"

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace moegraph {

// Groups (experts) of one grouped operator: the device tile scheduler keeps a prefix per group.
inline constexpr int kMaxGroups = 1024;
// Ranks of an expert-parallel group (moegraph/expert_parallel.hpp): one host's NVLink domain and more.
inline constexpr int kMaxExpertParallel = 64;

// Element types of grouped buffers. Activations and weights are bf16 or fp16; fp32 is used for
// main_grad, bias scales and their gradients.
enum class DType { kBF16, kFP16, kFP32 };

constexpr std::size_t dtype_size(DType t) { return t == DType::kFP32 ? 4 : 2; }
MOEGRAPH_API std::string_view dtype_name(DType t);

// How the GEMMs compute: kBF16 on the activation dtype; kMXFP8 on E4M3 operands with one E8M0
// scale per 32 elements (docs/mxfp8.md). Fixed when an operator is set up; its backend owns it.
enum class Recipe { kBF16, kMXFP8 };
MOEGRAPH_API std::string_view recipe_name(Recipe r);

// Weight gradient of a backward call: computed at once, or queued for backward_dw().
enum class WgradMode { kImmediate, kDelayed };

// The router's score function.
enum class RouterScore { kSoftmax, kSigmoid };
MOEGRAPH_API std::string_view router_score_name(RouterScore s);

// What a step runs: the whole MoE layer (router, dispatch, experts, combine), or the expert MLP
// alone on rows already grouped by expert.
enum class StepKind { kMoeLayer, kExperts };
MOEGRAPH_API std::string_view step_kind_name(StepKind kind);  // "moe_layer" or "experts"

// How expert-parallel ranks move rows (moegraph/expert_parallel.hpp). kPeerStores: exact rows stored
// into the peers' windows by the exchange kernels, published by device barriers (NCCL's device
// API). kSendRecv: each rank packs its rows for every peer into a chunk of a fixed capacity, and
// the transport moves every chunk whole (grouped ncclSend / ncclRecv: sizes fixed at capture).
enum class EpExchange { kPeerStores, kSendRecv };
MOEGRAPH_API std::string_view ep_exchange_name(EpExchange e);  // "peer_stores" or "send_recv"

// How the 16-bit wgmma GEMMs feed their tensor cores: chosen by the GEMM heuristic (kAuto),
// cp.async by every thread, or a warp-specialized TMA producer.
enum class GemmPipeline { kAuto, kCpAsync, kTma };
MOEGRAPH_API std::string_view gemm_pipeline_name(GemmPipeline p);

// What a kernel raises on the device for invalid device inputs (never clipped silently); the
// host reads it after the step (check_device_errors). The first problem of a step is kept.
struct DeviceErrorRecord {
  int32_t code;   // kDeviceErrorNone, ...
  int32_t group;  // first offending group
  int64_t value;  // the split (negative split), the aligned row total, or the token count
  int64_t limit;  // capacity_rows, or the bucket's capacity in tokens
};
inline constexpr int32_t kDeviceErrorNone = 0;
inline constexpr int32_t kDeviceErrorNegativeSplit = 1;   // value: the split
inline constexpr int32_t kDeviceErrorPastCapacity = 2;    // value: aligned rows needed; limit: capacity_rows
inline constexpr int32_t kDeviceErrorTokenCount = 3;      // value: num_tokens; limit: the bucket's tokens
// Expert parallelism (and sharded weights, which share the barrier):
// - another rank's token count was invalid (group: that rank), so every rank of the group reports
//   it; the step ran on the clamped counts, in step on every rank;
// - a peer did not reach a barrier in time (group: the peer; value: the barrier's epoch; limit: the
//   timeout in ms), or a peer's exchanges had stopped (group: that peer; value: the epoch). Either
//   stops this rank's exchanges of that layer (or sharded-weight set): they wait for nobody and store
//   into no peer from then on, and say so in every later step (kDeviceErrorExchangeStopped, group:
//   this rank). The results of those steps are lost on every rank: rebuild the layers and the group.
inline constexpr int32_t kDeviceErrorPeerTokenCount = 4;  // value: num_tokens; limit: the bucket's tokens
inline constexpr int32_t kDeviceErrorPeerTimeout = 5;
inline constexpr int32_t kDeviceErrorPeerStopped = 6;
inline constexpr int32_t kDeviceErrorExchangeStopped = 7;
// A gathered input (ForwardArgs::x_rows): a data row's entry names no row of x (group: the grouped
// row; value: its entry; limit: ForwardArgs::x_rows_bound). The row was read as zeros.
inline constexpr int32_t kDeviceErrorSourceRow = 8;

}  // namespace moegraph
