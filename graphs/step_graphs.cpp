#include "moegraph/step_graphs.hpp"

#include <chrono>
#include <exception>
#include <utility>

#include "graphs/bucket_step.hpp"
#include "graphs/sharded_weights.hpp"
#include "graphs/step_weights.hpp"
#include "src/core/device_buffer.hpp"
#include "src/ops/moe/op_spec.hpp"
#include "graphs/graph_exec.hpp"
#include "moegraph/expert_parallel.hpp"
#include "src/core/device_info.hpp"
#include "src/core/device_scope.hpp"

namespace moegraph {

struct StepGraphs::Graphs {
  GraphExec forward;
  std::vector<GraphExec> forward_train, backward, wgrad;  // one per wgrad slot
};

struct StepGraphs::Memory {
  DeviceBuffer arena;
  DeviceBuffer mxfp8;  // the mxfp8 recipe's weight copies, shared by the buckets (step_owns_mxfp8_weights)
  cudaStream_t stream = nullptr;  // set-up work: warm-up and capture
  int device = -1;                // set up on; made current for every call (DeviceScope)
  ~Memory() {
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
};

namespace {
int slots_of(const MoeLayerOptions& o) { return o.training ? o.wgrad_slots : 1; }

// The caller's parameters that these options read or write.
void check_weights(const StepGraphsOptions& o, const StepWeights& w) {
  const MoeLayerOptions& l = o.layer;
  const bool layer = o.step == StepKind::kMoeLayer;
  if (l.prequantized_weights) {
    layer::require_prequantized_weights(l, w.w1_mxfp8, w.w2_mxfp8, "StepWeights");
  } else if (o.sharding.ranks == 1) {  // shards are checked by ShardedWeights (a rank may hold none)
    MG_CHECK(w.w1 != nullptr && w.w2 != nullptr, "StepWeights needs w1 and w2");
  }
  MG_CHECK(!layer || w.router != nullptr, "StepWeights needs the router weight for the whole-layer step");
  if (o.sharding.ranks > 1) {
    MG_CHECK(!l.training || !layer || (l.main_grad_fp32 ? w.main_grad_router != nullptr : w.d_router != nullptr),
             "StepWeights needs the router's gradient (", l.main_grad_fp32 ? "main_grad_router" : "d_router", ")");
    return;
  }
  MG_CHECK(!l.bias || (w.b1 != nullptr && w.b2 != nullptr), "StepWeights needs b1 and b2 (layer.bias)");
  if (!l.training) return;
  if (l.main_grad_fp32)
    MG_CHECK(w.main_grad1 != nullptr && w.main_grad2 != nullptr && (!layer || w.main_grad_router != nullptr),
             "StepWeights needs main_grad1, main_grad2", layer ? " and main_grad_router" : "",
             " (training with main_grad_fp32)");
  else
    MG_CHECK(w.dw1 != nullptr && w.dw2 != nullptr && (!layer || w.d_router != nullptr), "StepWeights needs dw1, dw2",
             layer ? " and d_router" : "", " (training without main_grad_fp32)");
  MG_CHECK(!l.bias || (w.db1 != nullptr && w.db2 != nullptr), "StepWeights needs db1 and db2 (layer.bias)");
}
}  // namespace

StepGraphs::StepGraphs(const StepGraphsOptions& options, const StepWeights& weights, std::shared_ptr<EpComm> comm,
                       std::shared_ptr<EpComm> shard_comm)
    : options_(options), plan_(plan_step(options)), weights_(weights), comm_(std::move(comm)) {
  const int ranks = options_.layer.expert_parallel;
  MG_CHECK(ranks == 1 || comm_ != nullptr, "expert_parallel = ", ranks,
           ": StepGraphs needs this rank's communicator (moegraph/nccl_ep.hpp, or moegraph/expert_parallel.hpp)");
  MG_CHECK(comm_ == nullptr || comm_->ranks() == ranks, "the communicator has ", comm_ ? comm_->ranks() : 0,
           " ranks but expert_parallel is ", ranks);
  const bool sharded = options_.sharding.ranks > 1;
  MG_CHECK(!sharded || shard_comm != nullptr, "sharding.ranks = ", options_.sharding.ranks,
           ": StepGraphs needs this rank's communicator of the data-parallel group (shard_comm)");
  MG_CHECK(comm_ == nullptr || !sharded || comm_->device() == shard_comm->device(),
           "the expert-parallel communicator runs on device ", comm_ ? comm_->device() : -1,
           " but the data-parallel one on device ", sharded ? shard_comm->device() : -1, ": a rank has one device");
  check_weights(options_, weights_);
  // With a communicator, set-up runs on its device (the creating thread may have another current).
  const DeviceScope on_device(comm_ != nullptr ? comm_->device() : shard_comm != nullptr ? shard_comm->device() : -1);
  const int device = require_supported_device().device;
  memory_ = std::make_unique<Memory>();
  memory_->device = device;
  MG_CUDA_CHECK(cudaStreamCreateWithFlags(&memory_->stream, cudaStreamNonBlocking));
  cudaStream_t s = memory_->stream;
  memory_->arena = DeviceBuffer(plan_.arena_bytes);
  MG_CUDA_CHECK(cudaMemsetAsync(memory_->arena.get(), 0, plan_.arena_bytes, s));
  const MoeLayerOptions& l = options_.layer;
  bucket_weights_ = weights_;
  if (sharded) {
    sharded_ = std::make_unique<ShardedWeights>(options_, weights_, shard_comm);
    bucket_weights_ = sharded_->full();
  }
  if (step_owns_mxfp8_weights(l)) {
    // One quantized copy for every bucket: the buckets' layers read it as prequantized weights.
    memory_->mxfp8 = DeviceBuffer(plan_.mxfp8_copy_bytes);
    LayoutWalker walk(static_cast<std::byte*>(memory_->mxfp8.get()));
    lay_out_mxfp8_pair(options_, walk, bucket_weights_);
  }
  for (int64_t tokens : options_.buckets) {
    LayoutWalker walk(static_cast<std::byte*>(memory_->arena.get()));
    buckets_.push_back(make_bucket_step(options_, tokens, walk, bucket_weights_, true, ranks > 1 ? comm_ : nullptr));
  }
  for (int slot = slots_of(l) - 1; slot >= 0; --slot) free_slots_.push_back(slot);
  // MXFP8: quantized copies exist before the warm-up (of whatever the weights hold); a sharded step
  // quantizes after each gather instead.
  if (!sharded) weights_changed(s);
  if (ranks > 1) comm_->set_up_barrier();  // every rank's allocations done before any warm-up step waits
  if (sharded) {
    shard_comm->set_up_barrier();
    sharded_->exchange_shards(s);
  }

  // Warm-up: one eager step per bucket (no tokens, or all experts empty: valid, and every kernel
  // is loaded).
  for (int b = 0; b < num_buckets(); ++b) {
    const BucketIO bio = io(b);
    if (bio.splits != nullptr) MG_CUDA_CHECK(cudaMemsetAsync(bio.splits, 0, l.experts * sizeof(int32_t), s));
    if (bio.num_tokens != nullptr) MG_CUDA_CHECK(cudaMemsetAsync(bio.num_tokens, 0, sizeof(int32_t), s));
    run_eager(b, StepPhase::kForward, s);
    if (!l.training) continue;
    run_eager(b, StepPhase::kForwardTrain, s);
    run_eager(b, StepPhase::kBackward, s);
    if (l.delay_wgrad) run_eager(b, StepPhase::kWgrad, s);
  }
  check_device_errors(s);

  // Capture. Per slot, in the FIFO order replays follow: all forward_trains, then all backwards,
  // then all wgrads, so each operator's saved contexts pair up inside every slot's graphs.
  const int slots = slots_of(l);
  for (int b = 0; b < num_buckets(); ++b) {
    const auto t0 = std::chrono::steady_clock::now();
    BucketStep& bucket = *buckets_[b];
    auto g = std::make_unique<Graphs>();
    const cudaStreamCaptureMode mode = options_.capture_mode;
    g->forward = GraphExec(s, [&] { enqueue(bucket, StepPhase::kForward, 0, s); }, mode);
    if (l.training) {
      for (int slot = 0; slot < slots; ++slot)
        g->forward_train.emplace_back(s, [&] { enqueue(bucket, StepPhase::kForwardTrain, slot, s); }, mode);
      for (int slot = 0; slot < slots; ++slot)
        g->backward.emplace_back(s, [&] { enqueue(bucket, StepPhase::kBackward, slot, s); }, mode);
      if (l.delay_wgrad)
        for (int slot = 0; slot < slots; ++slot)
          g->wgrad.emplace_back(s, [&] { enqueue(bucket, StepPhase::kWgrad, slot, s); }, mode);
    }
    graphs_.push_back(std::move(g));
    capture_ms_.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  MG_CUDA_CHECK(cudaStreamSynchronize(s));
}

StepGraphs::~StepGraphs() = default;

void StepGraphs::enqueue(BucketStep& bucket, StepPhase phase, int slot, cudaStream_t stream) {
  ShardedWeights* sh = sharded_.get();
  const bool delay = options_.layer.delay_wgrad;
  switch (phase) {
    case StepPhase::kForward:
      if (sh) gather(stream);
      bucket.forward(stream);
      return;
    case StepPhase::kForwardTrain:
      if (sh) gather(stream);
      bucket.forward_train(slot, stream);
      return;
    case StepPhase::kBackward:
      if (sh && !delay) sh->zero_weight_gradients(stream);
      bucket.backward(slot, stream);
      if (sh) sh->reduce(/*weights=*/!delay, /*biases=*/true, stream);
      return;
    case StepPhase::kWgrad:
      if (sh) sh->zero_weight_gradients(stream);
      bucket.wgrad(stream);
      if (sh) sh->reduce(/*weights=*/true, /*biases=*/false, stream);
      return;
  }
}

std::string StepGraphs::describe_shards() const { return sharded_ ? sharded_->describe() : std::string(); }

int StepGraphs::graph_count() const {
  int n = 0;
  for (const auto& g : graphs_)
    n += 1 + static_cast<int>(g->forward_train.size() + g->backward.size() + g->wgrad.size());
  return n;
}

int StepGraphs::bucket_for(int64_t tokens) const {
  MG_CHECK(tokens >= 0, "token count must be non-negative, got ", tokens);
  for (int b = 0; b < num_buckets(); ++b)
    if (tokens <= options_.buckets[b]) return b;
  MG_FAIL(tokens, " tokens exceed the largest bucket (", options_.buckets.back(),
          " tokens): add a larger bucket (the config's \"buckets\")");
}

BucketIO StepGraphs::io(int bucket) const {
  MG_CHECK(bucket >= 0 && bucket < num_buckets(), "bucket index ", bucket, " out of range [0, ", num_buckets(), ")");
  return buckets_[bucket]->io();
}

void StepGraphs::launch(int b, StepPhase phase, bool use_graph, cudaStream_t stream) {
  const DeviceScope on_device(memory_->device);
  MG_CHECK(b >= 0 && b < num_buckets(), "bucket index ", b, " out of range [0, ", num_buckets(), ")");
  // A captured step on an aborted communicator would replay exchanges with peers that are gone.
  if (comm_ != nullptr) comm_->require_not_aborted(step_phase_name(phase));
  if (sharded_) sharded_->comm().require_not_aborted(step_phase_name(phase));
  const bool training_phase = phase != StepPhase::kForward;
  MG_CHECK(!training_phase || options_.layer.training, step_phase_name(phase), " needs training.enabled");
  MG_CHECK(phase != StepPhase::kWgrad || options_.layer.delay_wgrad, "wgrad needs training.delay_wgrad");
  if (active_bucket_ >= 0 && (active_bucket_ != b || phase == StepPhase::kForward))
    MG_FAIL("bucket ", active_bucket_, " (", options_.buckets[active_bucket_], " tokens) has ", awaiting_backward_.size(),
            " forward_train awaiting backward and ", awaiting_wgrad_.size(),
            " queued wgrads; buckets share one arena, so ", step_phase_name(phase), " of bucket ", b,
            " must wait until they finish");
  MG_CHECK(active_bucket_ < 0 || !training_phase || use_graph == in_flight_replayed_, "bucket ", b, " has ",
           awaiting_backward_.size(), " forward_train awaiting backward and ", awaiting_wgrad_.size(),
           " queued wgrads that ran ", in_flight_replayed_ ? "replayed" : "eagerly", "; their micro-batches' ",
           step_phase_name(phase), " must run the same way (", in_flight_replayed_ ? "replay" : "run_eager", ")");
  BucketStep& bucket = *buckets_[b];
  // Eager runs also happen during set-up, before the graphs exist.
  auto graphs = [&]() -> Graphs& { return *graphs_.at(b); };
  switch (phase) {
    case StepPhase::kForward:
      if (use_graph) graphs().forward.launch(stream);
      else enqueue(bucket, phase, 0, stream);
      return;
    case StepPhase::kForwardTrain: {
      MG_CHECK(!free_slots_.empty(), "all ", slots_of(options_.layer),
               " wgrad_slots hold micro-batches in flight: run backward/wgrad first");
      const int slot = free_slots_.back();
      if (use_graph) graphs().forward_train[slot].launch(stream);
      else enqueue(bucket, phase, slot, stream);
      free_slots_.pop_back();
      awaiting_backward_.push_back(slot);
      active_bucket_ = b;
      in_flight_replayed_ = use_graph;
      return;
    }
    case StepPhase::kBackward: {
      MG_CHECK(!awaiting_backward_.empty(), "backward of bucket ", b, " without a forward_train");
      const int slot = awaiting_backward_.front();
      if (use_graph) graphs().backward[slot].launch(stream);
      else enqueue(bucket, phase, slot, stream);
      awaiting_backward_.pop_front();
      if (options_.layer.delay_wgrad) awaiting_wgrad_.push_back(slot);
      else free_slots_.push_back(slot);
      break;
    }
    case StepPhase::kWgrad: {
      MG_CHECK(!awaiting_wgrad_.empty(), "wgrad of bucket ", b, " without a queued backward");
      const int slot = awaiting_wgrad_.front();
      if (use_graph) graphs().wgrad[slot].launch(stream);
      else enqueue(bucket, phase, slot, stream);
      awaiting_wgrad_.pop_front();
      free_slots_.push_back(slot);
      break;
    }
  }
  if (awaiting_backward_.empty() && awaiting_wgrad_.empty()) active_bucket_ = -1;
}

void StepGraphs::forward(int bucket, cudaStream_t stream) { launch(bucket, StepPhase::kForward, true, stream); }
void StepGraphs::forward_train(int bucket, cudaStream_t stream) { launch(bucket, StepPhase::kForwardTrain, true, stream); }
void StepGraphs::backward(int bucket, cudaStream_t stream) { launch(bucket, StepPhase::kBackward, true, stream); }
void StepGraphs::wgrad(int bucket, cudaStream_t stream) { launch(bucket, StepPhase::kWgrad, true, stream); }
void StepGraphs::run_eager(int bucket, StepPhase phase, cudaStream_t stream) { launch(bucket, phase, false, stream); }

// Every bucket's record (and the shards') is read, and so cleared, before the first error found is
// thrown: the next call reports only what happened after this one.
void StepGraphs::check_device_errors(cudaStream_t stream) {
  const DeviceScope on_device(memory_->device);
  std::exception_ptr first;
  const auto check = [&](auto&& f) {
    try {
      f();
    } catch (const Error&) {
      if (!first) first = std::current_exception();
    }
  };
  for (auto& b : buckets_) check([&] { b->check_device_errors(stream); });
  if (sharded_) check([&] { sharded_->check_device_errors(stream); });
  if (first) std::rethrow_exception(first);
}

// The full weights from the shards, and with the mxfp8 recipe their quantized copies: every forward
// gathers, since the shards may have changed (the optimizer step) since the last one.
void StepGraphs::gather(cudaStream_t stream) {
  sharded_->gather(stream);
  quantize_weights(bucket_weights_, stream);
}

void StepGraphs::quantize_weights(const StepWeights& from, cudaStream_t stream) {
  const MoeLayerOptions& l = options_.layer;
  if (!step_owns_mxfp8_weights(l)) return;
  const int g = moe_local_experts(l);
  quantize_mxfp8_weights(l.dtype, from.w1, g, 2 * l.ffn, l.hidden, bucket_weights_.w1_mxfp8, stream);
  quantize_mxfp8_weights(l.dtype, from.w2, g, l.hidden, l.ffn, bucket_weights_.w2_mxfp8, stream);
}

void StepGraphs::weights_changed(cudaStream_t stream) {
  const DeviceScope on_device(memory_->device);
  if (!sharded_) quantize_weights(weights_, stream);  // sharded: each forward's gather quantizes
}

uint64_t StepGraphs::read_dropped(cudaStream_t stream) {
  const DeviceScope on_device(memory_->device);
  // As documented, for every step kind: the experts-only buckets count nothing and did not sync.
  MG_CUDA_CHECK(cudaStreamSynchronize(stream));
  uint64_t total = 0;
  for (auto& b : buckets_) total += b->read_dropped(stream);
  return total;
}

}  // namespace moegraph
