// The C ABI of configs and the capture-and-replay runtime: mg_config_* and mg_step_graphs_*.
#include <memory>

#include "moegraph/config.hpp"
#include "moegraph/error.hpp"
#include "moegraph/expert_parallel.hpp"
#include "moegraph/moegraph.h"
#include "moegraph/step_graphs.hpp"
#include "src/c_api/c_api_common.hpp"

struct mg_config {
  moegraph::Config config;
  bool delay_wgrad_when_training = false;  // what mg_config_set_training(0) turned off, for (1) to restore
};

struct mg_step_graphs {
  // Kept alive with the step (declared first, freed last): expert parallelism's and sharding's groups.
  std::shared_ptr<moegraph::EpComm> comm, shard_comm;
  std::unique_ptr<moegraph::StepGraphs> step;
};

namespace {

using moegraph::c_api::check_handle;
using moegraph::c_api::guarded;
using moegraph::c_api::HandleKind;
using moegraph::c_api::read_struct;
using moegraph::c_api::write_struct;

const moegraph::Config& unwrap(const mg_config* config) {
  check_handle(config, HandleKind::kConfig, "mg_config");
  return config->config;
}

moegraph::StepGraphs& unwrap(const mg_step_graphs* step) {
  check_handle(step, HandleKind::kStepGraphs, "mg_step_graphs");
  return *step->step;
}

moegraph::StepPhase phase_of(mg_phase phase) {
  switch (phase) {
    case MG_PHASE_FORWARD: return moegraph::StepPhase::kForward;
    case MG_PHASE_FORWARD_TRAIN: return moegraph::StepPhase::kForwardTrain;
    case MG_PHASE_BACKWARD: return moegraph::StepPhase::kBackward;
    case MG_PHASE_WGRAD: return moegraph::StepPhase::kWgrad;
    default: break;
  }
  MG_FAIL("phase must be MG_PHASE_FORWARD, MG_PHASE_FORWARD_TRAIN, MG_PHASE_BACKWARD or MG_PHASE_WGRAD, got ",
          static_cast<int>(phase));
}

// Takes ownership of a parsed config and hands out its handle.
void emit(moegraph::Config config, mg_config** out) {
  auto handle = std::make_unique<mg_config>();
  handle->config = std::move(config);
  moegraph::c_api::register_handle(handle.get(), HandleKind::kConfig);
  *out = handle.release();
}

moegraph::StepWeights weights_of(const mg_step_weights* in) {
  const mg_step_weights w = read_struct(in, "mg_step_weights", mg_step_weights{});
  moegraph::StepWeights s;
  s.router = w.router;
  s.main_grad_router = w.main_grad_router;
  s.d_router = w.d_router;
  s.w1 = w.w1;
  s.w2 = w.w2;
  s.b1 = w.b1;
  s.b2 = w.b2;
  s.main_grad1 = w.main_grad1;
  s.main_grad2 = w.main_grad2;
  s.dw1 = w.dw1;
  s.dw2 = w.dw2;
  s.db1 = w.db1;
  s.db2 = w.db2;
  s.w1_mxfp8 = {w.w1_mxfp8_data,         w.w1_mxfp8_scales,      w.w1_mxfp8_data_t,
                w.w1_mxfp8_scales_t,      w.w1_mxfp8_dequantized, w.w1_mxfp8_dequantized_t,
                w.w1_mxfp8_scales_tiled,  w.w1_mxfp8_scales_t_tiled};
  s.w2_mxfp8 = {w.w2_mxfp8_data,         w.w2_mxfp8_scales,      w.w2_mxfp8_data_t,
                w.w2_mxfp8_scales_t,      w.w2_mxfp8_dequantized, w.w2_mxfp8_dequantized_t,
                w.w2_mxfp8_scales_tiled,  w.w2_mxfp8_scales_t_tiled};
  return s;
}

}  // namespace

extern "C" {

mg_status mg_config_load(const char* path, mg_config** out) {
  return guarded([&] {
    MG_CHECK(out != nullptr, "mg_config_load needs an output handle");
    *out = nullptr;
    MG_CHECK(path != nullptr, "mg_config_load needs a path");
    emit(moegraph::load_config(path), out);
  });
}

mg_status mg_config_parse(const char* json_text, mg_config** out) {
  return guarded([&] {
    MG_CHECK(out != nullptr, "mg_config_parse needs an output handle");
    *out = nullptr;
    MG_CHECK(json_text != nullptr, "mg_config_parse needs JSON text");
    emit(moegraph::parse_config(json_text, "<text>"), out);
  });
}

mg_status mg_config_default(mg_config** out) {
  return guarded([&] {
    MG_CHECK(out != nullptr, "mg_config_default needs an output handle");
    *out = nullptr;
    emit(moegraph::default_config(), out);
  });
}

void mg_config_destroy(mg_config* config) {
  if (moegraph::c_api::unregister_handle(config, HandleKind::kConfig)) delete config;
}

mg_status mg_config_shape_of(const mg_config* config, mg_config_shape* out) {
  return guarded([&] {
    const moegraph::Config& c = unwrap(config);
    mg_config_shape s{};
    s.struct_size = sizeof(s);
    s.whole_layer = c.step == moegraph::StepKind::kMoeLayer;
    s.experts = c.layer.experts;
    s.hidden = c.layer.hidden;
    s.ffn = c.layer.ffn;
    s.top_k = c.layer.top_k;
    s.bias = c.layer.bias;
    s.dtype = moegraph::c_api::c_dtype(c.precision.dtype);
    s.recipe = moegraph::c_api::c_recipe(c.precision.recipe);
    s.training = c.training.enabled;
    s.delay_wgrad = c.training.delay_wgrad;
    s.main_grad_fp32 = c.training.main_grad_fp32;
    s.num_buckets = static_cast<int>(c.buckets.size());
    s.max_tokens = c.buckets.empty() ? 0 : c.buckets.back();
    s.expert_parallel = c.parallel.expert_parallel;
    s.prequantized_weights = c.precision.prequantized_weights;
    s.dequantized_weights = c.precision.dequantized_weights;
    const moegraph::WeightSharding& sh = c.parallel.sharding;
    s.shard_ranks = sh.ranks;
    s.shard_policy = sh.policy == moegraph::ShardPolicy::kChunk ? MG_SHARD_CHUNK : MG_SHARD_BALANCED;
    s.shard_unit = sh.unit == moegraph::ShardUnit::kExpert ? MG_SHARD_UNIT_EXPERT : MG_SHARD_UNIT_ROW;
    write_struct(out, "mg_config_shape", s);
  });
}

mg_status mg_config_set_training(mg_config* config, int training) {
  return guarded([&] {
    check_handle(config, HandleKind::kConfig, "mg_config");
    moegraph::Config c = config->config;
    bool delayed = config->delay_wgrad_when_training;
    if (training == 0 && c.training.enabled) delayed = c.training.delay_wgrad;
    c.training.enabled = training != 0;
    // A forward-only step has no wgrad to delay; turning training back on restores the setting.
    c.training.delay_wgrad = c.training.enabled && (c.training.delay_wgrad || delayed);
    // The whole config's rules again, as if it had been written so (e.g. the mxfp8 recipe trains only
    // at row_align 32 or 128); refused, the config stays as it was.
    config->config = moegraph::parse_config(moegraph::to_json(c), "mg_config_set_training(" +
                                                                     std::to_string(training != 0) + ")");
    config->delay_wgrad_when_training = delayed;
  });
}

mg_status mg_step_graphs_create(const mg_config* config, const mg_step_weights* weights,
                                const mg_step_graphs_options* options, mg_step_graphs** out) {
  return guarded([&] {
    MG_CHECK(out != nullptr, "mg_step_graphs_create needs an output handle");
    *out = nullptr;
    moegraph::StepGraphsOptions opts = moegraph::step_graphs_options(unwrap(config));
    const moegraph::StepWeights w = weights_of(weights);
    std::shared_ptr<moegraph::EpComm> comm, shard_comm;
    if (options != nullptr) {
      const mg_step_graphs_options o = read_struct(options, "mg_step_graphs_options", mg_step_graphs_options{});
      if (o.thread_local_capture) opts.capture_mode = cudaStreamCaptureModeThreadLocal;
      if (o.comm != nullptr) comm = moegraph::c_api::ep_comm_of(o.comm);
      if (o.shard_comm != nullptr) shard_comm = moegraph::c_api::ep_comm_of(o.shard_comm);
    }
    // Refused here, naming the C fields, before the step looks for a device.
    const auto check_group = [&](const std::shared_ptr<moegraph::EpComm>& c, int ranks, const char* key,
                                 const char* field) {
      MG_CHECK(ranks == 1 || c != nullptr, "mg_step_graphs_create: the config's ", key, " = ", ranks,
               " needs this rank's communicator in mg_step_graphs_options.", field, ", got ",
               options == nullptr ? "no options" : "NULL");
      MG_CHECK(c == nullptr || c->ranks() == ranks, "mg_step_graphs_create: mg_step_graphs_options.", field, " has ",
               c ? c->ranks() : 0, " ranks but the config's ", key, " is ", ranks);
    };
    check_group(comm, opts.layer.expert_parallel, "parallel.expert_parallel", "comm");
    check_group(shard_comm, opts.sharding.ranks, "parallel.sharding.ranks", "shard_comm");
    auto handle = std::make_unique<mg_step_graphs>();
    // A group of one has nothing to exchange.
    if (opts.layer.expert_parallel > 1) handle->comm = std::move(comm);
    if (opts.sharding.ranks > 1) handle->shard_comm = std::move(shard_comm);
    handle->step = std::make_unique<moegraph::StepGraphs>(opts, w, handle->comm, handle->shard_comm);
    moegraph::c_api::register_handle(handle.get(), HandleKind::kStepGraphs);
    *out = handle.release();
  });
}

void mg_step_graphs_destroy(mg_step_graphs* step) {
  if (moegraph::c_api::unregister_handle(step, HandleKind::kStepGraphs)) delete step;
}

mg_status mg_step_graphs_num_buckets(const mg_step_graphs* step, int* out) {
  return guarded([&] {
    MG_CHECK(out != nullptr, "mg_step_graphs_num_buckets needs an output");
    *out = 0;  // what a refused call leaves
    *out = unwrap(step).num_buckets();
  });
}

mg_status mg_step_graphs_bucket_tokens(const mg_step_graphs* step, int bucket, int64_t* out) {
  return guarded([&] {
    MG_CHECK(out != nullptr, "mg_step_graphs_bucket_tokens needs an output");
    *out = 0;  // what a refused call leaves
    *out = unwrap(step).io(bucket).tokens;  // io() refuses a bucket out of range, naming it
  });
}

mg_status mg_step_graphs_bucket_for(const mg_step_graphs* step, int64_t tokens, int* out) {
  return guarded([&] {
    MG_CHECK(out != nullptr, "mg_step_graphs_bucket_for needs an output");
    *out = -1;
    *out = unwrap(step).bucket_for(tokens);
  });
}

mg_status mg_step_graphs_io(const mg_step_graphs* step, int bucket, mg_bucket_io* out) {
  return guarded([&] {
    const moegraph::BucketIO b = unwrap(step).io(bucket);
    const mg_bucket_io io{sizeof(mg_bucket_io), b.tokens, b.rows, b.x, b.splits, b.num_tokens, b.aux_loss,
                          b.y, b.dy, b.dx};
    write_struct(out, "mg_bucket_io", io);
  });
}

mg_status mg_step_graphs_replay(mg_step_graphs* step, int bucket, mg_phase phase, cudaStream_t stream) {
  return guarded([&] {
    moegraph::StepGraphs& s = unwrap(step);
    switch (phase_of(phase)) {
      case moegraph::StepPhase::kForward: s.forward(bucket, stream); break;
      case moegraph::StepPhase::kForwardTrain: s.forward_train(bucket, stream); break;
      case moegraph::StepPhase::kBackward: s.backward(bucket, stream); break;
      case moegraph::StepPhase::kWgrad: s.wgrad(bucket, stream); break;
    }
  });
}

mg_status mg_step_graphs_run_eager(mg_step_graphs* step, int bucket, mg_phase phase, cudaStream_t stream) {
  return guarded([&] { unwrap(step).run_eager(bucket, phase_of(phase), stream); });
}

mg_status mg_step_graphs_weights_changed(mg_step_graphs* step, cudaStream_t stream) {
  return guarded([&] { unwrap(step).weights_changed(stream); });
}

mg_status mg_step_graphs_check_device_errors(mg_step_graphs* step, cudaStream_t stream) {
  return guarded([&] { unwrap(step).check_device_errors(stream); });
}

mg_status mg_step_graphs_read_dropped(mg_step_graphs* step, cudaStream_t stream, uint64_t* out) {
  return guarded([&] {
    MG_CHECK(out != nullptr, "mg_step_graphs_read_dropped needs an output");
    *out = 0;
    *out = unwrap(step).read_dropped(stream);
  });
}

}  // extern "C"
