// Parsing and validation of moe_layer cases: every rule is checked here, without a GPU, so CI can
// check case files on machines that cannot run them.
#include "tools/check/moe_layer_case.hpp"

#include <algorithm>

#include "moegraph/error.hpp"
#include "moegraph/grouped_linear.hpp"
#include "src/ops/moe/op_spec.hpp"

namespace moegraph::check {
namespace {

using config_detail::integer_in;

// Token counts per case: enough for every routing edge, small enough for the fp64 reference.
constexpr int64_t kMaxTokens = 65536;
constexpr std::size_t kMaxTokenCounts = 64;

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
  c.row_align = static_cast<int>(optional_value(shape, "row_align", int64_t{1}, read_row_align));
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

// The recipe's shape rules (one can_implement per recipe) on the experts' two grouped linears, as
// the layer applies them, named by the case's keys. The layer's own rules follow.
void check_recipe_accepts(const MoeLayerCase& c) {
  for (int fc : {1, 2}) {
    std::string reason;
    try {
      const MoeLayerOptions o = moe_layer_options(c, false);
      reason = layer::expert_recipe_refusal(o, fc, moe_expert_rows(o));
    } catch (const Error& e) {  // sizes the layer refuses: the same message as its own check below
      MG_CONFIG_FAIL("MoeLayer refuses this case: ", e.message());
    }
    MG_CONFIG_CHECK(reason.empty(), "recipe ", in_quotes(recipe_name(c.recipe)), " cannot run fc", fc,
                    " (shape.hidden ", c.hidden, ", shape.ffn ", c.ffn, ", shape.row_align ", c.row_align, "): ",
                    reason);
  }
}

// The layer's own set-up rules, so a case it would refuse fails here and not on the GPU.
void check_layer_accepts(const MoeLayerCase& c) {
  try {
    validate(moe_layer_options(c, false));
    if (c.phases.wgrad_delayed) validate(moe_layer_options(c, true));
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
  o.recipe = c.recipe;
  o.dequantized_weights = c.dequantized_weights;
  o.training = c.training();
  o.wgrad_slots = 1;
  o.delay_wgrad = delay_wgrad;
  o.main_grad_fp32 = c.main_grad;
  return o;
}

std::unique_ptr<CaseRunner> parse_moe_layer_case(const Json& value, const std::string& name) {
  const JsonObject o(value, "", {"name", "op", "seed", "shape", "tokens", "router", "dtype", "recipe",
                                 "dequantized_weights", "phases", "wgrad", "replays", "tolerance"});
  MoeLayerCase c;
  c.name = name;
  c.data_seed = optional_value(o, "seed", seed_from_name(name), config_detail::non_negative_integer);
  read_shape(o.required("shape"), c);
  read_tokens(o, c);
  read_router(o, c);

  c.dtype = read_dtype(o);
  c.recipe = read_recipe(o);
  c.dequantized_weights = optional_value(o, "dequantized_weights", false, config_detail::boolean);
  MG_CONFIG_CHECK(!c.dequantized_weights || (c.recipe == Recipe::kMXFP8 && c.dtype == DType::kBF16),
                  o.path("dequantized_weights"), " needs \"recipe\": \"mxfp8\" and \"dtype\": \"bf16\"");
  c.phases = read_phases(o);

  c.main_grad = read_main_grad(o, c.dtype, "the weight gradients", c.phases);
  c.replays = read_replays(o);
  if (const Json* tol = o.find("tolerance"))
    c.tolerance = read_tolerance(*tol, testing::layer_tolerance_for(c.dtype, c.recipe));

  // The reference's expert buffers hold the layer's routed rows with their alignment padding.
  const int64_t rows = moe_layer_rows(moe_layer_options(c, false));
  check_case_size({c.experts * (3 * c.ffn * c.hidden + c.hidden), rows * std::max(c.hidden, 2 * c.ffn),
                   c.max_tokens * (c.experts * c.hidden + c.top_k * 3 * c.ffn * c.hidden),
                   "experts * (3 * ffn * hidden + hidden)",
                   "rows (max_tokens * top_k + experts * (row_align - 1), aligned) * max(hidden, 2 * ffn)",
                   "max_tokens * (experts * hidden + top_k * 3 * ffn * hidden)"});
  check_recipe_accepts(c);
  check_layer_accepts(c);
  // Printed only now that every value has passed the schema: dump() recurses once per nesting level,
  // and an unchecked value may be nested deep enough to overflow the stack.
  c.json = value.dump(2);
  return std::make_unique<MoeLayerRunner>(std::move(c));
}

}  // namespace moegraph::check
