// Parsing and validation of grouped_linear cases: every rule is checked here, without a GPU, so CI
// can check case files on machines that cannot run them.
#include "tools/check/grouped_linear_case.hpp"

#include <cmath>
#include <numeric>

#include "moegraph/error.hpp"
#include "moegraph/grouped_linear.hpp"

namespace moegraph::check {
namespace {

using config_detail::integer_in;

int64_t feature_dim(const JsonObject& shape, std::string_view key) {
  const std::string path = shape.path(key);
  const char* rule = "a multiple of 16 in [16, 65536]";
  const int64_t v = integer_in(shape.required(key), path, 16, 65536, rule);
  MG_CONFIG_CHECK(v % 16 == 0, path, " must be ", rule, ", got ", v);
  return v;
}

void read_shape(const Json& value, verify::CaseSpec& spec) {
  const JsonObject shape(value, "shape", {"groups", "k", "n", "row_align", "bias", "bias_scale", "capacity_extra"});
  spec.groups = static_cast<int>(integer_in(shape.required("groups"), shape.path("groups"), 1, 1024));
  spec.k = feature_dim(shape, "k");
  spec.n = feature_dim(shape, "n");
  spec.row_align = optional_value(shape, "row_align", 1, [](const Json& v, const std::string& path) {
    const int64_t align = integer_in(v, path, 1, 128, "1, 16, 32 or 128");
    MG_CONFIG_CHECK(align == 1 || align == 16 || align == 32 || align == 128, path, " must be 1, 16, 32 or 128, got ",
                    align);
    return align;
  });
  spec.bias = optional_value(shape, "bias", false, config_detail::boolean);
  spec.scale = optional_value(shape, "bias_scale", false, config_detail::boolean);
  MG_CONFIG_CHECK(!spec.scale || spec.bias, "shape.bias_scale needs shape.bias (the scale multiplies the bias)");
  spec.capacity_extra = optional_value(shape, "capacity_extra", int64_t{0}, [](const Json& v, const std::string& path) {
    return integer_in(v, path, 0, int64_t{1} << 20);
  });
}

void read_phases(const JsonObject& c, GroupedLinearCase& gl) {
  const Json* value = c.find("phases");
  if (value == nullptr) {
    gl.forward = gl.forward_train = gl.backward = gl.wgrad_delayed = true;
    return;
  }
  const std::string path = c.path("phases");
  const auto& items = config_detail::array(*value, path);
  MG_CONFIG_CHECK(!items.empty(), path, " must list at least one phase");
  for (std::size_t i = 0; i < items.size(); ++i) {
    const std::string phase =
        choice(items[i], detail::concat(path, "[", i, "]"), {"forward", "forward_train", "backward", "wgrad_delayed"});
    bool& flag = phase == "forward"         ? gl.forward
                 : phase == "forward_train" ? gl.forward_train
                 : phase == "backward"      ? gl.backward
                                            : gl.wgrad_delayed;
    MG_CONFIG_CHECK(!flag, path, " lists ", in_quotes(phase), " twice");
    flag = true;
  }
}

verify::Tolerance read_tolerance(const Json& value, verify::Tolerance tol) {
  const JsonObject o(value, "tolerance", {"rtol", "atol", "rel_fro"});
  auto bound = [](const Json& v, const std::string& path) {
    const double x = config_detail::number(v, path);
    MG_CONFIG_CHECK(std::isfinite(x) && x >= 0.0 && x <= 1.0, path, " must be in [0, 1], got ", x);
    return x;
  };
  tol.rtol = optional_value(o, "rtol", tol.rtol, bound);
  tol.atol = optional_value(o, "atol", tol.atol, bound);
  tol.rel_fro = optional_value(o, "rel_fro", tol.rel_fro, bound);
  return tol;
}

// The operator's own set-up rules, so a case it would refuse fails here and not on the GPU.
void check_operator_accepts(const GroupedLinearCase& gl, int64_t rows) {
  const verify::CaseSpec& s = gl.spec;
  GroupedLinearOptions o;
  o.num_groups = s.groups;
  o.in_features = s.k;
  o.out_features = s.n;
  o.capacity_rows = verify::capacity_rows_for(rows, s.groups, s.row_align, s.capacity_extra);
  o.row_align = s.row_align;
  o.dtype = s.dtype;
  o.bias = s.bias;
  o.delay_wgrad = s.delay_wgrad;
  try {
    validate(o);
  } catch (const Error& e) {
    MG_CONFIG_FAIL("GroupedLinear refuses this case: ", e.message());
  }
}

}  // namespace

std::unique_ptr<CaseRunner> parse_grouped_linear_case(const Json& value, const std::string& name) {
  const JsonObject c(value, "", {"name", "op", "seed", "shape", "dtype", "recipe", "routing", "phases", "wgrad",
                                 "replays", "tolerance"});
  GroupedLinearCase gl;
  verify::CaseSpec& spec = gl.spec;
  spec.name = name;
  gl.json = value.dump(2);
  gl.data_seed = optional_value(c, "seed", seed_from_name(name), config_detail::non_negative_integer);
  read_shape(c.required("shape"), spec);

  const std::string dtype = optional_value(c, "dtype", std::string("bf16"), [](const Json& v, const std::string& p) {
    return choice(v, p, {"bf16", "fp16"});
  });
  spec.dtype = dtype == "fp16" ? DType::kFP16 : DType::kBF16;
  // Only the bf16 recipe exists for now (fp16 layers use it too); mxfp8 joins it later.
  optional_value(c, "recipe", std::string("bf16"), [](const Json& v, const std::string& p) { return choice(v, p, {"bf16"}); });

  gl.routing = read_routing(c.required("routing"), "routing", spec.groups);
  read_phases(c, gl);
  spec.delay_wgrad = gl.wgrad_delayed;

  // The weight gradient is written in the layer's dtype, or accumulated into fp32 main_grad.
  const std::string wgrad = optional_value(c, "wgrad", dtype, [&](const Json& v, const std::string& p) {
    const std::string w = choice(v, p, {"bf16", "fp16", "main_grad"});
    MG_CONFIG_CHECK(w == "main_grad" || w == dtype, p, " ", in_quotes(w), " would write dweight in ", w,
                    ", but the layer's dtype is ", dtype, ": use ", in_quotes(dtype), " or \"main_grad\"");
    return w;
  });
  spec.main_grad = wgrad == "main_grad";
  gl.replays = static_cast<int>(optional_value(c, "replays", int64_t{3}, [](const Json& v, const std::string& p) {
    return integer_in(v, p, 1, 1000);
  }));
  if (const Json* tol = c.find("tolerance")) spec.tolerance = read_tolerance(*tol, verify::tolerance_for(spec.dtype));

  const int64_t rows = gl.routing.kind == RoutingKind::kExplicit
                           ? std::accumulate(gl.routing.splits.begin(), gl.routing.splits.end(), int64_t{0})
                           : gl.routing.rows;
  check_operator_accepts(gl, rows);
  return std::make_unique<GroupedLinearRunner>(std::move(gl));
}

}  // namespace moegraph::check
