#include "tools/check/case_json.hpp"

#include <algorithm>
#include <cmath>

namespace moegraph::check {

std::string in_quotes(std::string_view s) {
  return Json(std::string(s)).dump(-1, ' ', false, Json::error_handler_t::replace);
}

std::string choice(const Json& value, const std::string& path, std::initializer_list<std::string_view> allowed) {
  std::string s = config_detail::string(value, path);
  if (std::find(allowed.begin(), allowed.end(), s) != allowed.end()) return s;
  std::string options;
  for (std::string_view a : allowed) options += detail::concat(options.empty() ? "" : ", ", in_quotes(a));
  MG_CONFIG_FAIL(path, " must be one of ", options, ", got ", in_quotes(s));
}

double number_in(const Json& value, const std::string& path, double lo, double hi) {
  const double x = config_detail::number(value, path);
  MG_CONFIG_CHECK(std::isfinite(x) && x >= lo && x <= hi, path, " must be in [", lo, ", ", hi, "], got ", x);
  return x;
}

int64_t feature_dim(const JsonObject& shape, std::string_view key) {
  const std::string path = shape.path(key);
  const char* rule = "a multiple of 16 in [16, 65536]";
  const int64_t v = config_detail::integer_in(shape.required(key), path, 16, 65536, rule);
  MG_CONFIG_CHECK(v % 16 == 0, path, " must be ", rule, ", got ", v);
  return v;
}

int64_t read_row_align(const Json& value, const std::string& path) {
  const int64_t align = config_detail::integer_in(value, path, 1, 128, "1, 16, 32 or 128");
  MG_CONFIG_CHECK(align == 1 || align == 16 || align == 32 || align == 128, path, " must be 1, 16, 32 or 128, got ",
                  align);
  return align;
}

DType read_dtype(const JsonObject& c) {
  const std::string dtype = optional_value(c, "dtype", std::string("bf16"), [](const Json& v, const std::string& p) {
    return choice(v, p, {"bf16", "fp16"});
  });
  return dtype == "fp16" ? DType::kFP16 : DType::kBF16;
}

Recipe read_recipe(const JsonObject& c) {
  const std::string recipe = optional_value(c, "recipe", std::string("bf16"), [](const Json& v, const std::string& p) {
    return choice(v, p, {"bf16", "mxfp8"});
  });
  return recipe == "mxfp8" ? Recipe::kMXFP8 : Recipe::kBF16;
}

bool read_main_grad(const JsonObject& c, DType dtype, std::string_view gradients, const PhaseSet& phases) {
  MG_CONFIG_CHECK(c.find("wgrad") == nullptr || phases.training(), c.path("wgrad"),
                  " says where the weight gradients go, but the case's phases are [\"forward\"] only: it "
                  "writes none (remove the key or add a training phase)");
  const std::string name(dtype_name(dtype));
  const std::string wgrad = optional_value(c, "wgrad", name, [&](const Json& v, const std::string& p) {
    const std::string w = choice(v, p, {"bf16", "fp16", "main_grad"});
    MG_CONFIG_CHECK(w == "main_grad" || w == name, p, " ", in_quotes(w), " would write ", gradients, " in ", w,
                    ", but the layer's dtype is ", name, ": use ", in_quotes(name), " or \"main_grad\"");
    return w;
  });
  return wgrad == "main_grad";
}

int read_replays(const JsonObject& c) {
  return static_cast<int>(optional_value(c, "replays", int64_t{3}, [](const Json& v, const std::string& p) {
    return config_detail::integer_in(v, p, 1, 1000);
  }));
}

testing::Tolerance read_tolerance(const Json& value, testing::Tolerance tol) {
  const JsonObject o(value, "tolerance", {"rtol", "atol", "rel_fro"});
  auto bound = [](const Json& v, const std::string& path) { return number_in(v, path, 0.0, 1.0); };
  tol.rtol = optional_value(o, "rtol", tol.rtol, bound);
  tol.atol = optional_value(o, "atol", tol.atol, bound);
  tol.rel_fro = optional_value(o, "rel_fro", tol.rel_fro, bound);
  return tol;
}

PhaseSet read_phases(const JsonObject& c) {
  const Json* value = c.find("phases");
  if (value == nullptr) return {true, true, true, true};
  PhaseSet phases;
  const std::string path = c.path("phases");
  const auto& items = config_detail::array(*value, path);
  MG_CONFIG_CHECK(!items.empty(), path, " must list at least one phase");
  for (std::size_t i = 0; i < items.size(); ++i) {
    const std::string phase =
        choice(items[i], detail::concat(path, "[", i, "]"), {"forward", "forward_train", "backward", "wgrad_delayed"});
    bool& flag = phase == "forward"         ? phases.forward
                 : phase == "forward_train" ? phases.forward_train
                 : phase == "backward"      ? phases.backward
                                            : phases.wgrad_delayed;
    MG_CONFIG_CHECK(!flag, path, " lists ", in_quotes(phase), " twice");
    flag = true;
  }
  return phases;
}

std::vector<StepPlan> plan_steps(const PhaseSet& phases) {
  std::vector<StepPlan> plans;
  if (phases.forward) plans.push_back({CaseStep::kInference, true, false, "forward"});
  if (phases.training())
    plans.push_back({CaseStep::kTraining, phases.forward_train, phases.backward, "forward_train+backward"});
  if (phases.wgrad_delayed)
    plans.push_back(
        {CaseStep::kTrainingDelayedWgrad, phases.forward_train, true, "forward_train+backward+wgrad_delayed"});
  return plans;
}

uint64_t seed_from_name(std::string_view name) {
  uint64_t hash = 14695981039346656037ull;
  for (unsigned char c : name) hash = (hash ^ c) * 1099511628211ull;
  return hash;
}

void check_case_size(const CaseSize& s) {
  MG_CONFIG_CHECK(s.weights <= kMaxCaseWeightElements, "shape: ", s.weights_formula, " = ", s.weights,
                  " weight elements, more than the 2^30 a case's fp64 reference may hold");
  MG_CONFIG_CHECK(s.activations <= kMaxCaseActivationElements, "shape: ", s.activations_formula, " = ",
                  s.activations, " activation elements, more than the 2^28 a case's fp64 reference may hold");
  MG_CONFIG_CHECK(s.multiply_adds <= kMaxCaseMultiplyAdds, "shape: ", s.work_formula, " = ", s.multiply_adds,
                  " multiply-adds a step, more than the 2^37 a case's fp64 reference may run");
}

}  // namespace moegraph::check
