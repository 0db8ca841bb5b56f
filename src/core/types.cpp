#include "moegraph/types.hpp"

namespace moegraph {

// Every switch names every enumerator, so the compiler flags a new one left unnamed (-Wswitch);
// the return after it is only for values outside the enum.
std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kBF16: return "bf16";
    case DType::kFP16: return "fp16";
    case DType::kFP32: return "fp32";
  }
  return "?";
}

std::string_view recipe_name(Recipe r) {
  switch (r) {
    case Recipe::kBF16: return "bf16";
    case Recipe::kMXFP8: return "mxfp8";
  }
  return "?";
}

std::string_view router_score_name(RouterScore s) {
  switch (s) {
    case RouterScore::kSoftmax: return "softmax";
    case RouterScore::kSigmoid: return "sigmoid";
  }
  return "?";
}

std::string_view step_kind_name(StepKind kind) {
  switch (kind) {
    case StepKind::kMoeLayer: return "moe_layer";
    case StepKind::kExperts: return "experts";
  }
  return "?";
}

std::string_view ep_exchange_name(EpExchange e) {
  switch (e) {
    case EpExchange::kPeerStores: return "peer_stores";
    case EpExchange::kSendRecv: return "send_recv";
  }
  return "?";
}

std::string_view gemm_pipeline_name(GemmPipeline p) {
  switch (p) {
    case GemmPipeline::kAuto: return "auto";
    case GemmPipeline::kCpAsync: return "cp_async";
    case GemmPipeline::kTma: return "tma";
  }
  return "?";
}

}  // namespace moegraph
