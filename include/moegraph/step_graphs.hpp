// The capture-and-replay runtime: one MoE expert step per shape bucket, captured once into CUDA
// graphs per phase and replayed for any routing and any token count up to the bucket's capacity.
// The step (config "step") is the whole MoE layer — router, dispatch, FC1 -> SwiGLU -> FC2, combine
// (MoeLayer) — or the expert MLP alone on rows already grouped by expert.
//
// Threading contract (every handle of the library: GroupedLinear, MoeLayer, StepGraphs, and the C
// ABI's mg_* handles):
// - One thread at a time per handle: a handle keeps host-side state (free slots, the queues of
//   pending backwards and delayed wgrads, the active bucket). Distinct handles may be used from
//   distinct threads at once, each on its own stream(s); tests/gpu/test_threads.cpp runs eight.
// - What handles share is read-only or guarded: per-device caches of SM counts and kernel
//   residency (behind a mutex), and the caller's weights, which any number of handles may read.
//   Gradients that several handles accumulate into one main_grad must be ordered by the caller
//   (one stream, or events).
// - A handle is bound to the device current when it was created, and makes that device current
//   for each of its calls (giving the caller's back after), so any thread may call it whatever
//   device it has current (tests/gpu/test_threads.cpp, on two GPUs). Pass streams of the handle's
//   device.
// - Set-up (constructors, weights_changed of StepGraphs at construction, check_device_errors,
//   read_dropped) allocates or synchronizes. While any thread captures in
//   cudaStreamCaptureModeGlobal (StepGraphs's constructor does by default, to prove its enqueue
//   paths), no other thread may do either; set StepGraphsOptions::capture_mode to
//   cudaStreamCaptureModeThreadLocal (and capture your own graphs in thread-local or relaxed
//   mode) when threads set up or synchronize while others capture.
// - Destroying a handle frees its device memory (cudaFree waits for the work using it). Graphs
//   that a caller captured from a GroupedLinear or MoeLayer point into that memory and must not be
//   launched after the handle is destroyed; StepGraphs owns its graphs and destroys them with
//   itself.
#pragma once

#include "moegraph/export.h"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "moegraph/moe_layer.hpp"
#include "moegraph/sharding.hpp"
#include "moegraph/types.hpp"

namespace moegraph {

struct Config;

// What a StepGraphs runs, typed. A Config converts to it (step_graphs_options); code that builds
// a step without JSON fills it directly.
struct StepGraphsOptions {
  StepKind step = StepKind::kMoeLayer;
  MoeLayerOptions layer;           // every field but max_tokens (each bucket sets its own)
  std::vector<int64_t> buckets;    // capacities in tokens, strictly increasing, >= 1
  // Sharded expert weights (moegraph/sharding.hpp): the data-parallel group of sharding.ranks
  // ranks each holding a shard of w1, w2, b1, b2 and their gradients. 1: not sharded. The shards
  // are 16-bit (not prequantized_weights; the mxfp8 recipe quantizes what each forward gathers).
  // With expert_parallel R > 1 they are rows of the rank's E/R experts (docs/sharding.md).
  WeightSharding sharding;
  // How the constructor captures: global mode (the default) proves that no enqueue path
  // synchronizes or allocates anywhere in the process, but forbids other threads to do either
  // while it runs; thread-local mode lets other threads set up and synchronize meanwhile (a
  // server building steps while others serve).
  cudaStreamCaptureMode capture_mode = cudaStreamCaptureModeGlobal;
};
// The step of a config: layer, router, precision, training, row_align and buckets.
MOEGRAPH_API StepGraphsOptions step_graphs_options(const Config& config);
// Throws moegraph::Error naming the field, its value and the rule. Touches no GPU.
MOEGRAPH_API void validate(const StepGraphsOptions& options);

enum class StepPhase { kForward, kForwardTrain, kBackward, kWgrad };
MOEGRAPH_API std::string_view step_phase_name(StepPhase phase);

struct PlannedBuffer {
  std::string name;
  std::size_t offset = 0, bytes = 0;  // within the arena
  std::string within;  // the buffer holding this one (an operator's workspace), or empty
};

struct BucketPlan {
  int64_t tokens = 0;  // capacity in tokens
  int64_t rows = 0;    // permuted rows: tokens * top_k plus alignment padding
  std::vector<PlannedBuffer> buffers;
  std::size_t bytes = 0;
  // Expert parallelism: the bucket's window on the communicator (outside the arena: each bucket's
  // layer allocates its own), for the configured receive rows; 0 without expert parallelism.
  std::size_t window_bytes = 0;
};

// Sizes are per GPU (per rank with expert parallelism).
struct MOEGRAPH_API StepPlan {
  std::vector<BucketPlan> buckets;
  std::size_t arena_bytes = 0;     // the largest bucket: buckets share one arena
  std::size_t sum_of_buckets = 0;  // what one allocation per bucket would take
  std::size_t weight_bytes = 0;    // weights, biases and their gradients (outside the arena)
  // The mxfp8 recipe's weight copies, one set shared by all buckets (outside the arena; 0 for bf16
  // and with prequantized_weights, whose MXFP8 weights count in weight_bytes).
  std::size_t mxfp8_copy_bytes = 0;
  // Of those, the copies' bf16 values (layer.dequantized_weights): 2 bytes per weight element, and
  // 2 more for training (the transposed copy dgrad reads).
  std::size_t mxfp8_dequantized_bytes = 0;
  std::size_t window_bytes = 0;    // every bucket's expert-parallel window
  // Sharded weights: the window on the data-parallel group holding the full expert weights and
  // their full gradients (weight_bytes then counts the router and the largest shards).
  std::size_t shard_window_bytes = 0;
  std::vector<std::string> kernels;
  // Device memory the step needs (arena, weights and gradients, MXFP8 copies, windows): what must
  // fit the GPU, before the CUDA context and the caller's own buffers.
  std::size_t device_bytes() const;
  // The same for a step configured with bucket `b` alone: which buckets fit when all do not.
  std::size_t bucket_device_bytes(std::size_t b) const;
  std::string to_string() const;
};

// Lays out every bucket with a null base and names the kernels each GEMM runs (the same choice
// set-up makes): no GPU needed (moegraph-bench --plan).
MOEGRAPH_API StepPlan plan_step(const StepGraphsOptions& options);

// A bucket's device buffers. Whole layer: the caller writes x [tokens, hidden] and num_tokens (and
// dy), reads y, aux_loss (and dx); the router makes the splits. Experts only: the caller writes x
// [rows, hidden] grouped by expert and splits (and dy), reads y (and dx), all [rows, hidden]; rows
// of y and dx past the last group are not written (they hold whatever the buffer held).
struct BucketIO {
  // Capacity in tokens; the experts' rows: tokens * top_k plus alignment padding, or with expert
  // parallelism the receive rows of this rank's experts.
  int64_t tokens = 0, rows = 0;
  void* x = nullptr;
  int32_t* splits = nullptr;      // experts only: [experts]
  int32_t* num_tokens = nullptr;  // whole layer: device scalar, 0..tokens
  float* aux_loss = nullptr;      // whole layer: device scalar (router.aux_loss_coef > 0)
  void* y = nullptr;
  void* dy = nullptr;
  void* dx = nullptr;
};

// Device parameters and gradients shared by every bucket, owned by the caller (a trainer's or
// server's own parameters). Which are needed follows the options: the router for the whole layer,
// biases with layer.bias, and with training either fp32 main_grad_* (main_grad_fp32) or d*.
struct StepWeights {
  void* router = nullptr;  // [experts, hidden] (whole layer)
  float* main_grad_router = nullptr;
  void* d_router = nullptr;
  void* w1 = nullptr;  // [experts, 2 * ffn, hidden]
  void* w2 = nullptr;  // [experts, hidden, ffn]
  void* b1 = nullptr;  // [experts, 2 * ffn] (layer.bias)
  void* b2 = nullptr;  // [experts, hidden]
  float* main_grad1 = nullptr, *main_grad2 = nullptr;  // fp32, accumulated (training.main_grad_fp32), or
  void* dw1 = nullptr, *dw2 = nullptr;                  // written in the activation dtype
  void* db1 = nullptr, *db2 = nullptr;
  // layer.prequantized_weights (recipe mxfp8): the expert weights as MXFP8 instead of w1 and w2
  // (moegraph/mxfp8_weights.hpp; data_t and scales_t for training). Without it, a step of the
  // mxfp8 recipe quantizes w1 and w2 itself into one set of copies that all buckets read.
  Mxfp8Weights w1_mxfp8, w2_mxfp8;
  // Sharded weights (options.sharding.ranks > 1): w1, w2, b1, b2 and their gradients point at this
  // rank's shards (rows [first_row, first_row + rows) of each tensor in the sharding's unit; null
  // where the rank holds no rows). Descriptors left at global_rows 0 come from the policy.
  ExpertShards shards;
};

class BucketStep;      // graphs/bucket_step.hpp
class ShardedWeights;  // graphs/sharded_weights.hpp

class MOEGRAPH_API StepGraphs {
 public:
  // Allocates one arena (the largest bucket), binds the caller's weights (they must stay valid
  // for the object's lifetime), warms every bucket up eagerly on zero tokens, then captures each
  // phase of each bucket (per wgrad slot) into a graph. The weights' contents are not read until a
  // replay (MXFP8 from 16-bit weights: call weights_changed once they are written). The warm-up of a
  // training step does write the gradient buffers, on the step's own stream, finished before the
  // constructor returns: the 16-bit ones (dw1, dw2, d_router, and db1, db2 with main_grad too) get
  // zeros and main_grad_router gets zero added. Build a step before a backward whose gradients it
  // shares, or after the optimizer has read them.
  //
  // Expert parallelism (options.layer.expert_parallel = R > 1): `comm` is this rank's communicator
  // of R ranks, and the weights are this rank's experts only ([E/R, ...]; the router stays whole).
  // Every rank constructs the same StepGraphs (the constructor is collective: each bucket allocates
  // its window and warms up with the others) and then replays the same sequence of phases of the
  // same buckets: pick the bucket for the largest token count over the ranks (each rank's count
  // may be smaller). A rank that falls out of step raises kDeviceErrorPeerTimeout on the others,
  // which stops their exchanges (types.hpp, kDeviceErrorExchangeStopped): rebuild after that.
  //
  // Sharded weights (options.sharding.ranks = W > 1): `shard_comm` is this rank's communicator of
  // the data-parallel group (W ranks; an EpComm like the expert-parallel one: windows and device
  // barriers), and the expert weights are shards (StepWeights::shards). Every forward gathers the
  // full weights into a window on that group (backward reuses them); every phase that writes
  // gradients ends by summing each rank's rows over the group into its shard: main_grad added,
  // dw and db written. The constructor is collective over that group too.
  //
  // Both (R > 1 and W > 1): ranks form an R x W grid. `comm` joins the R ranks holding different
  // experts (the same data-parallel index), `shard_comm` the W ranks holding shards of the same
  // experts; the weights are this rank's shards of its E/R experts. Each expert's gradient is summed
  // over the W ranks, after the R ranks' exchange gave it every token routed to it in its group.
  StepGraphs(const StepGraphsOptions& options, const StepWeights& weights, std::shared_ptr<EpComm> comm = nullptr,
             std::shared_ptr<EpComm> shard_comm = nullptr);
  ~StepGraphs();
  StepGraphs(const StepGraphs&) = delete;
  StepGraphs& operator=(const StepGraphs&) = delete;

  const StepGraphsOptions& options() const { return options_; }
  const StepPlan& plan() const { return plan_; }
  int num_buckets() const { return static_cast<int>(buckets_.size()); }
  // The smallest bucket holding `tokens`; a clear error above the largest.
  int bucket_for(int64_t tokens) const;
  BucketIO io(int bucket) const;
  const StepWeights& weights() const { return weights_; }
  // Host time to capture and instantiate the bucket's graphs.
  double capture_ms(int bucket) const { return capture_ms_.at(bucket); }
  int graph_count() const;

  // Replays. Buckets share one arena, so while one bucket has training contexts in flight (a
  // forward_train awaiting backward, or a queued wgrad) no other bucket may run: that throws.
  void forward(int bucket, cudaStream_t stream);
  void forward_train(int bucket, cudaStream_t stream);
  void backward(int bucket, cudaStream_t stream);
  void wgrad(int bucket, cudaStream_t stream);  // needs training.delay_wgrad
  // Sharded weights: every rank's rows of every expert tensor (empty when not sharded).
  std::string describe_shards() const;
  // The same phases enqueued without graphs (same ordering rules), for checks and timing. While
  // micro-batches are in flight, their remaining phases run the way their forward_train ran
  // (replayed or eager): the graphs pin each slot's saved tensors, the eager layer keeps its own
  // slot order, so a mix would pair a backward with another micro-batch's context (refused).
  void run_eager(int bucket, StepPhase phase, cudaStream_t stream);
  // The weights were updated (e.g. by the optimizer): with precision.recipe "mxfp8" the step
  // re-quantizes w1 and w2 into the copies all buckets share; nothing to do for bf16 or with
  // prequantized_weights (the caller keeps its MXFP8 weights current), or with sharded weights
  // (each forward quantizes the weights it gathered). Enqueued on `stream`.
  void weights_changed(cudaStream_t stream);
  // Synchronizes `stream` and reports invalid device splits seen by any bucket (clears them).
  void check_device_errors(cudaStream_t stream);
  // Synchronizes `stream`: (token, expert) assignments dropped by router.capacity_factor in every
  // bucket since the last call (0 when dropless or experts only).
  uint64_t read_dropped(cudaStream_t stream);

 private:
  struct Graphs;
  int next_slot(int bucket, StepPhase phase);
  void launch(int bucket, StepPhase phase, bool use_graph, cudaStream_t stream);
  // One phase of one bucket as captured: with sharded weights, wrapped in their gather or reduce.
  void enqueue(BucketStep& bucket, StepPhase phase, int slot, cudaStream_t stream);
  void gather(cudaStream_t stream);  // sharded weights (and the mxfp8 recipe's copies of them)
  void quantize_weights(const StepWeights& from, cudaStream_t stream);  // the mxfp8 recipe's shared copies

  StepGraphsOptions options_;
  StepPlan plan_;
  std::vector<std::unique_ptr<BucketStep>> buckets_;
  std::vector<std::unique_ptr<Graphs>> graphs_;
  StepWeights weights_;
  StepWeights bucket_weights_;  // weights_, with the shared MXFP8 copies of the mxfp8 recipe
  std::shared_ptr<EpComm> comm_;
  std::unique_ptr<ShardedWeights> sharded_;
  struct Memory;
  std::unique_ptr<Memory> memory_;
  std::vector<double> capture_ms_;
  // Host-side order of the micro-batches in flight (slot indices).
  int active_bucket_ = -1;
  bool in_flight_replayed_ = false;  // how the micro-batches in flight ran (with active_bucket_ >= 0)
  std::vector<int> free_slots_;
  std::deque<int> awaiting_backward_, awaiting_wgrad_;
};

}  // namespace moegraph
