// moegraph-bench --plan: a config's buffers, kernels and device memory, compared with the GPU's
// memory when there is one (it needs none), and with --json the same as a file.
#pragma once

#include <string>

#include "moegraph/config.hpp"

namespace moegraph::bench {

// Prints the plan of `config` and, unless json_path is empty, writes it there as JSON. Returns the
// exit code: 0 whether or not a GPU is present and whether or not the step fits it.
int run_plan(const Config& config, const std::string& json_path);

}  // namespace moegraph::bench
