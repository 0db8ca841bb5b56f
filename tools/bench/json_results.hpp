// Writing a bench's results as JSON (--json FILE): one place for the file, its check and the note.
#pragma once

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "moegraph/error.hpp"

namespace moegraph::bench {

inline void write_json_results(const nlohmann::json& out, const std::string& path, int indent = 2) {
  std::ofstream f(path);
  f << out.dump(indent) << "\n";
  MG_CHECK(f.good(), "cannot write ", path);
  std::printf("\nresults written to %s\n", path.c_str());
}

}  // namespace moegraph::bench
