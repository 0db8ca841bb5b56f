// Parsing and validation of grouped_linear cases: every rule is checked here, without a GPU, so CI
// can check case files on machines that cannot run them.
#include "tools/check/grouped_linear_case.hpp"

#include <algorithm>
#include <numeric>

#include "moegraph/error.hpp"
#include "moegraph/grouped_linear.hpp"

namespace moegraph::check {
namespace {

using config_detail::integer_in;

void read_shape(const Json& value, testing::CaseSpec& spec) {
  const JsonObject shape(value, "shape", {"groups", "k", "n", "row_align", "bias", "bias_scale", "capacity_extra"});
  spec.groups = static_cast<int>(integer_in(shape.required("groups"), shape.path("groups"), 1, 1024));
  spec.k = feature_dim(shape, "k");
  spec.n = feature_dim(shape, "n");
  spec.row_align = optional_value(shape, "row_align", 1, read_row_align);
  spec.bias = optional_value(shape, "bias", false, config_detail::boolean);
  spec.scale = optional_value(shape, "bias_scale", false, config_detail::boolean);
  MG_CONFIG_CHECK(!spec.scale || spec.bias, "shape.bias_scale needs shape.bias (the scale multiplies the bias)");
  spec.capacity_extra = optional_value(shape, "capacity_extra", int64_t{0}, [](const Json& v, const std::string& path) {
    return integer_in(v, path, 0, int64_t{1} << 20);
  });
}

// The operator's own set-up rules, so a case it would refuse fails here and not on the GPU.
void check_operator_accepts(const GroupedLinearCase& gl, int64_t rows) {
  const testing::CaseSpec& s = gl.spec;
  GroupedLinearOptions o;
  o.num_groups = s.groups;
  o.in_features = s.k;
  o.out_features = s.n;
  o.capacity_rows = testing::capacity_rows_for(rows, s.groups, s.row_align, s.capacity_extra);
  o.row_align = s.row_align;
  o.dtype = s.dtype;
  o.bias = s.bias;
  o.delay_wgrad = s.delay_wgrad;
  o.recipe = s.recipe;
  try {
    validate(o);
  } catch (const Error& e) {
    MG_CONFIG_FAIL("GroupedLinear refuses this case: ", e.message());
  }
  if (gl.phases.training()) {
    const std::string reason = recipe_can_train(o);
    MG_CONFIG_CHECK(reason.empty(), "GroupedLinear cannot train this case (phases other than \"forward\"): ", reason);
  }
}

}  // namespace

std::unique_ptr<CaseRunner> parse_grouped_linear_case(const Json& value, const std::string& name) {
  const JsonObject c(value, "", {"name", "op", "seed", "shape", "dtype", "recipe", "routing", "phases", "wgrad",
                                 "replays", "tolerance"});
  GroupedLinearCase gl;
  testing::CaseSpec& spec = gl.spec;
  spec.name = name;
  gl.data_seed = optional_value(c, "seed", seed_from_name(name), config_detail::non_negative_integer);
  read_shape(c.required("shape"), spec);

  spec.dtype = read_dtype(c);
  // "mxfp8": checked against the fp64 reference on the dequantized operands.
  spec.recipe = read_recipe(c);

  gl.routing = read_routing(c.required("routing"), "routing", spec.groups);
  gl.phases = read_phases(c);
  spec.delay_wgrad = gl.phases.wgrad_delayed;

  spec.main_grad = read_main_grad(c, spec.dtype, "dweight", gl.phases);
  gl.replays = read_replays(c);
  if (const Json* tol = c.find("tolerance"))
    spec.tolerance = read_tolerance(*tol, spec.recipe == Recipe::kMXFP8 ? testing::mxfp8_gemm_tolerance()
                                                                        : testing::tolerance_for(spec.dtype));

  const int64_t rows = gl.routing.kind == RoutingKind::kExplicit
                           ? std::accumulate(gl.routing.splits.begin(), gl.routing.splits.end(), int64_t{0})
                           : gl.routing.rows;
  const int64_t capacity = testing::capacity_rows_for(rows, spec.groups, spec.row_align, spec.capacity_extra);
  check_case_size({spec.groups * spec.n * spec.k, capacity * std::max(spec.k, spec.n), rows * spec.n * spec.k,
                   "groups * n * k", "capacity rows * max(k, n)", "rows * n * k"});
  check_operator_accepts(gl, rows);
  // Printed only now that every value has passed the schema: dump() recurses once per nesting level,
  // and an unchecked value may be nested deep enough to overflow the stack.
  gl.json = value.dump(2);
  return std::make_unique<GroupedLinearRunner>(std::move(gl));
}

}  // namespace moegraph::check
