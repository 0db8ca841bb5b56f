// Parsing and validation of moe_layer cases: every rule is checked here, without a GPU, so CI can
// check case files on machines that cannot run them.
#include "tools/check/moe_layer_case.hpp"

#include <cmath>

#include "moegraph/error.hpp"

namespace moegraph::check {
namespace {

using config_detail::integer_in;

// Token counts per case: enough for every routing edge, small enough for the fp64 reference.
constexpr int64_t kMaxTokens = 65536;
constexpr std::size_t kMaxTokenCounts = 64;

int64_t feature_dim(const JsonObject& shape, std::string_view key) {
  const std::string path = shape.path(key);
  const char* rule = "a multiple of 16 in [16, 65536]";
  const int64_t v = integer_in(shape.required(key), path, 16, 65536, rule);
  MG_CONFIG_CHECK(v % 16 == 0, path, " must be ", rule, ", got ", v);
  return v;
}

void read_shape(const Json& value, MoeLayerCase& c) {
  const JsonObject shape(value, "shape", {"experts", "hidden", "ffn", "top_k", "bias", "row_align", "max_tokens"});
  c.experts = static_cast<int>(integer_in(shape.required("experts"), shape.path("experts"), 1, 1024));
  c.hidden = feature_dim(shape, "hidden");
  c.ffn = feature_dim(shape, "ffn");
  c.top_k = static_cast<int>(optional_value(shape, "top_k", int64_t{1}, [](const Json& v, const std::string& path) {
    return integer_in(v, path, 1, 8);
  }));
  MG_CONFIG_CHECK(c.top_k <= c.experts, shape.path("top_k"), " must be at most shape.experts (", c.experts,
                  "), got ", c.top_k);
  c.bias = optional_value(shape, "bias", false, config_detail::boolean);
  c.row_align = static_cast<int>(optional_value(shape, "row_align", int64_t{1}, [](const Json& v, const std::string& path) {
    const int64_t align = integer_in(v, path, 1, 128, "1, 16, 32 or 128");
    MG_CONFIG_CHECK(align == 1 || align == 16 || align == 32 || align == 128, path, " must be 1, 16, 32 or 128, got ",
                    align);
    return align;
  }));
  c.max_tokens = integer_in(shape.required("max_tokens"), shape.path("max_tokens"), 1, kMaxTokens);
}

void read_tokens(const JsonObject& o, MoeLayerCase& c) {
  const std::string path = o.path("tokens");
  const auto& items = config_detail::array(o.required("tokens"), path);
  MG_CONFIG_CHECK(!items.empty() && items.size() <= kMaxTokenCounts, path, " must list 1 to ", kMaxTokenCounts,
                  " token counts, got ", items.size());
  for (std::size_t i = 0; i < items.size(); ++i)
    c.tokens.push_back(integer_in(items[i], detail::concat(path, "[", i, "]"), 0, c.max_tokens,
                                  detail::concat("in [0, shape.max_tokens] = [0, ", c.max_tokens, "]")));
}

double number_in(const Json& value, const std::string& path, double lo, double hi) {
  const double x = config_detail::number(value, path);
  MG_CONFIG_CHECK(std::isfinite(x) && x >= lo && x <= hi, path, " must be in [", lo, ", ", hi, "], got ", x);
  return x;
}

void read_router(const JsonObject& o, MoeLayerCase& c) {
  const Json* value = o.find("router");
  if (value == nullptr) return;
  const JsonObject r(*value, "router", {"score", "renormalize", "aux_loss_coef", "capacity_factor", "fuse_weights"});
  const std::string score = optional_value(r, "score", std::string("softmax"), [](const Json& v, const std::string& p) {
    return choice(v, p, {"softmax", "sigmoid"});
  });
  c.score = score == "sigmoid" ? RouterScore::kSigmoid : RouterScore::kSoftmax;
  c.renormalize = optional_value(r, "renormalize", false, config_detail::boolean);
  c.aux_loss_coef = optional_value(r, "aux_loss_coef", 0.0, [](const Json& v, const std::string& p) {
    return number_in(v, p, 0.0, 100.0);
  });
  c.capacity_factor = optional_value(r, "capacity_factor", 0.0, [](const Json& v, const std::string& p) {
    return number_in(v, p, 0.0, 1024.0);
  });
  c.fuse_weights = optional_value(r, "fuse_weights", false, config_detail::boolean);
}

void read_phases(const JsonObject& o, MoeLayerCase& c) {
  const Json* value = o.find("phases");
  if (value == nullptr) {
    c.forward = c.forward_train = c.backward = c.wgrad_delayed = true;
    return;
  }
  const std::string path = o.path("phases");
  const auto& items = config_detail::array(*value, path);
  MG_CONFIG_CHECK(!items.empty(), path, " must list at least one phase");
  for (std::size_t i = 0; i < items.size(); ++i) {
    const std::string phase =
        choice(items[i], detail::concat(path, "[", i, "]"), {"forward", "forward_train", "backward", "wgrad_delayed"});
    bool& flag = phase == "forward"         ? c.forward
                 : phase == "forward_train" ? c.forward_train
                 : phase == "backward"      ? c.backward
                                            : c.wgrad_delayed;
    MG_CONFIG_CHECK(!flag, path, " lists ", in_quotes(phase), " twice");
    flag = true;
  }
}

verify::Tolerance read_tolerance(const Json& value, verify::Tolerance tol) {
  const JsonObject o(value, "tolerance", {"rtol", "atol", "rel_fro"});
  auto bound = [](const Json& v, const std::string& path) { return number_in(v, path, 0.0, 1.0); };
  tol.rtol = optional_value(o, "rtol", tol.rtol, bound);
  tol.atol = optional_value(o, "atol", tol.atol, bound);
  tol.rel_fro = optional_value(o, "rel_fro", tol.rel_fro, bound);
  return tol;
}

// The layer's own set-up rules, so a case it would refuse fails here and not on the GPU.
void check_layer_accepts(const MoeLayerCase& c) {
  try {
    validate(moe_layer_options(c, false));
    if (c.wgrad_delayed) validate(moe_layer_options(c, true));
  } catch (const Error& e) {
    MG_CONFIG_FAIL("MoeLayer refuses this case: ", e.message());
  }
}

}  // namespace

MoeLayerOptions moe_layer_options(const MoeLayerCase& c, bool delay_wgrad) {
  MoeLayerOptions o;
  o.experts = c.experts;
  o.hidden = c.hidden;
  o.ffn = c.ffn;
  o.top_k = c.top_k;
  o.bias = c.bias;
  o.score = c.score;
  o.renormalize = c.renormalize;
  o.aux_loss_coef = c.aux_loss_coef;
  o.capacity_factor = c.capacity_factor;
  o.fuse_weights = c.fuse_weights;
  o.max_tokens = c.max_tokens;
  o.row_align = c.row_align;
  o.dtype = c.dtype;
  o.training = c.training();
  o.wgrad_slots = 1;
  o.delay_wgrad = delay_wgrad;
  o.main_grad_fp32 = c.main_grad;
  return o;
}

std::unique_ptr<CaseRunner> parse_moe_layer_case(const Json& value, const std::string& name) {
  const JsonObject o(value, "", {"name", "op", "seed", "shape", "tokens", "router", "dtype", "phases", "wgrad",
                                 "replays", "tolerance"});
  MoeLayerCase c;
  c.name = name;
  c.json = value.dump(2);
  c.data_seed = optional_value(o, "seed", seed_from_name(name), config_detail::non_negative_integer);
  read_shape(o.required("shape"), c);
  read_tokens(o, c);
  read_router(o, c);

  const std::string dtype = optional_value(o, "dtype", std::string("bf16"), [](const Json& v, const std::string& p) {
    return choice(v, p, {"bf16", "fp16"});
  });
  c.dtype = dtype == "fp16" ? DType::kFP16 : DType::kBF16;
  read_phases(o, c);

  // The weight gradients are written in the layer's dtype, or accumulated into fp32 main_grad.
  const std::string wgrad = optional_value(o, "wgrad", dtype, [&](const Json& v, const std::string& p) {
    const std::string w = choice(v, p, {"bf16", "fp16", "main_grad"});
    MG_CONFIG_CHECK(w == "main_grad" || w == dtype, p, " ", in_quotes(w), " would write the weight gradients in ", w,
                    ", but the layer's dtype is ", dtype, ": use ", in_quotes(dtype), " or \"main_grad\"");
    return w;
  });
  c.main_grad = wgrad == "main_grad";
  c.replays = static_cast<int>(optional_value(o, "replays", int64_t{3}, [](const Json& v, const std::string& p) {
    return integer_in(v, p, 1, 1000);
  }));
  if (const Json* tol = o.find("tolerance")) c.tolerance = read_tolerance(*tol, verify::chain_tolerance_for(c.dtype));

  check_layer_accepts(c);
  return std::make_unique<MoeLayerRunner>(std::move(c));
}

}  // namespace moegraph::check
