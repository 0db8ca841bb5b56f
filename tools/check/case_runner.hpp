// moegraph-check's interface to one operator: a case file entry becomes a CaseRunner (parsed and
// validated without a GPU), which later runs on the GPU. Each op ("grouped_linear", later
// "expert_mlp") has its own parser and runner, registered in case_file.cpp.
#pragma once

#include <filesystem>
#include <optional>
#include <string>

namespace moegraph::check {

struct RunSettings {
  std::optional<std::filesystem::path> dump_dir;  // --dump: write the case's data under DIR/<name>/
};

struct CaseOutcome {
  bool passed = false;
  std::string paths;         // what ran and matched the reference, e.g. "eager+graph"
  double max_rel_err = 0.0;  // largest relative Frobenius error over every output checked
  std::string failure;       // the first failing check, when not passed
};

class CaseRunner {
 public:
  explicit CaseRunner(std::string name) : name_(std::move(name)) {}
  virtual ~CaseRunner() = default;
  CaseRunner(const CaseRunner&) = delete;
  CaseRunner& operator=(const CaseRunner&) = delete;

  const std::string& name() const { return name_; }
  // Runs the case on the current GPU against the fp64 reference. Failed checks are reported in the
  // outcome; an exception means the run itself broke (the caller reports it as a failure too).
  virtual CaseOutcome run(const RunSettings& settings) = 0;

 private:
  std::string name_;
};

}  // namespace moegraph::check
