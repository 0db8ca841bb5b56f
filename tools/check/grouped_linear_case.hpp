// The "grouped_linear" op of moegraph-check: one GroupedLinear layer, run step by step on the
// eager path and then as captured CUDA graphs replayed with fresh data (and fresh splits for random
// routings), every output checked against the fp64 reference.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "testing/problem.hpp"
#include "tools/check/case_json.hpp"
#include "tools/check/case_runner.hpp"
#include "tools/check/routing.hpp"

namespace moegraph::check {

struct GroupedLinearCase {
  testing::CaseSpec spec;  // shape, dtype, wgrad output and tolerance; the splits come from `routing`
  RoutingSpec routing;
  uint64_t data_seed = 0;
  PhaseSet phases;
  int replays = 3;
  std::string json;  // the case as written, for dumps
};

// Reads a case object (its name and op already checked by the caller); throws ConfigError.
std::unique_ptr<CaseRunner> parse_grouped_linear_case(const Json& value, const std::string& name);

class GroupedLinearRunner final : public CaseRunner {
 public:
  explicit GroupedLinearRunner(GroupedLinearCase c) : CaseRunner(c.spec.name), case_(std::move(c)) {}
  CaseOutcome run(const RunSettings& settings) override;

 private:
  GroupedLinearCase case_;
};

// Writes the problem's inputs, the outputs of `last_step` and their references under `dir`.
void dump_grouped_linear(const testing::Problem& p, CaseStep last_step, const std::string& run_label,
                         const std::string& case_json, const std::filesystem::path& dir);

}  // namespace moegraph::check
