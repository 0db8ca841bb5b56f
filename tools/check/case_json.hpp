// Reading helpers shared by the op parsers of moegraph-check, on top of the project's strict JSON
// reader (src/config/json_reader.hpp): every problem throws ConfigError naming the key path, and
// load_case_file puts the file and the case in front. Also the phases of a case and the steps
// that run them, shared by the op runners.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "moegraph/types.hpp"
#include "src/config/json_reader.hpp"
#include "testing/data.hpp"

namespace moegraph::check {

using config_detail::Json;
using config_detail::JsonObject;

// `object[key]` read by `read(value, path)`, or `fallback` when the key is absent.
template <class T, class Read>
T optional_value(const JsonObject& object, std::string_view key, T fallback, Read read) {
  const Json* value = object.find(key);
  return value != nullptr ? static_cast<T>(read(*value, object.path(key))) : fallback;
}

// For messages: `s` as a JSON string literal ("bf16").
std::string in_quotes(std::string_view s);

// A string that must be one of `allowed`.
std::string choice(const Json& value, const std::string& path, std::initializer_list<std::string_view> allowed);

// A number in [lo, hi] (finite).
double number_in(const Json& value, const std::string& path, double lo, double hi);

// `shape[key]`, required: a feature dimension, a multiple of 16 in [16, 65536].
int64_t feature_dim(const JsonObject& shape, std::string_view key);

// A row alignment: 1, 16, 32 or 128 (a reader for optional_value).
int64_t read_row_align(const Json& value, const std::string& path);

// `c["dtype"]`: "bf16" (the default) or "fp16".
DType read_dtype(const JsonObject& c);

// `c["recipe"]`: "bf16" (the default: the GEMMs on the 16-bit dtype, fp16 included) or "mxfp8"
// (on MXFP8 copies, docs/mxfp8.md); the op's shape rules are checked by its parser.
Recipe read_recipe(const JsonObject& c);

// `c["replays"]`: graph replays, in [1, 1000] (default 3).
int read_replays(const JsonObject& c);

// A "tolerance" object: each of rtol, atol and rel_fro in [0, 1], else the one in `tol`.
testing::Tolerance read_tolerance(const Json& value, testing::Tolerance tol);

// The phases a case runs. backward and wgrad_delayed run a forward_train first (it saves their
// context), and forward_train alone is followed by a backward (which frees the context), unchecked.
struct PhaseSet {
  bool forward = false, forward_train = false, backward = false, wgrad_delayed = false;

  bool training() const { return forward_train || backward || wgrad_delayed; }
};

// `c["phases"]`: a non-empty list of distinct phase names; all four when the key is absent.
PhaseSet read_phases(const JsonObject& c);

// `c["wgrad"]`: true for "main_grad" (weight gradients accumulated into fp32 main_grad), false for
// the layer's `dtype` (the default: they are written in it); another dtype is refused, naming the
// gradients as `gradients` ("dweight"), and so is the key in a case that runs no training phase.
bool read_main_grad(const JsonObject& c, DType dtype, std::string_view gradients, const PhaseSet& phases);

// What one step of a case enqueues: a forward; a forward_train and its backward; the same with
// the weight gradients queued by the backward and computed by the delayed wgrad call.
enum class CaseStep { kInference, kTraining, kTrainingDelayedWgrad };

// One step of a case and what its phases ask to check.
struct StepPlan {
  CaseStep step;
  bool check_forward;  // the forward outputs
  bool check_grads;    // dx and every parameter gradient
  const char* label;
};

// The steps that run `phases`, in order. Any training phase runs the immediate step: it also
// gives the bits the delayed weight gradients must reproduce.
std::vector<StepPlan> plan_steps(const PhaseSet& phases);

// The fp64 reference runs on the host: a case whose weights, activations (the widest row buffer)
// or reference work a step pass these bounds is refused with its file (a mistyped shape would
// otherwise end in an out-of-memory error on the host or the GPU). The bound on work is per step:
// replays and token counts multiply it. The shipped cases stay below 2^25 weight elements, 2^22
// activation elements and 2^30 multiply-adds.
inline constexpr int64_t kMaxCaseWeightElements = int64_t{1} << 30, kMaxCaseActivationElements = int64_t{1} << 28,
                         kMaxCaseMultiplyAdds = int64_t{1} << 37;
struct CaseSize {
  int64_t weights, activations, multiply_adds;  // exact in 64 bits within the keys' own bounds
  std::string_view weights_formula, activations_formula, work_formula;
};
void check_case_size(const CaseSize& size);

// The default data seed of a case: a hash of its name (FNV-1a), stable across platforms and runs.
uint64_t seed_from_name(std::string_view name);

}  // namespace moegraph::check
