// Case files of moegraph-check: JSON holding one case object or {"cases": [...]}. Every case is
// parsed and validated up front, without a GPU, so CI checks the files even where none can run.
#pragma once

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "tools/check/case_runner.hpp"

namespace moegraph::check {

// A case file that cannot be used; the message names the file, the case and the key.
// moegraph-check exits with code 2 on it.
class CaseFileError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

std::vector<std::unique_ptr<CaseRunner>> load_case_file(const std::string& path);

}  // namespace moegraph::check
