// moegraph-check [--dump DIR] [--filter SUBSTR] CASE_FILE...
// Runs JSON-described cases on the eager and graph paths against the fp64 reference, one line per
// case, then "N passed, M failed" (", K skipped" when cases were skipped).
// Exit codes: 0 all passed; 1 a case failed; 2 invalid arguments or case files; 77 every case
// skipped because there is no GPU (Meson's SKIP). Case files are validated first, GPU or not.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "tools/check/case_file.hpp"
#include "tools/check/case_json.hpp"

namespace moegraph::check {
namespace {

constexpr int kExitFailed = 1;
constexpr int kExitUsage = 2;
constexpr int kExitSkipped = 77;

const char* kUsage =
    "usage: moegraph-check [--dump DIR] [--filter SUBSTR] CASE_FILE...\n"
    "  --dump DIR       write each case's inputs, outputs and fp64 references as .npy under DIR/<case>/\n"
    "  --filter SUBSTR  run only the cases whose name contains SUBSTR (all files are still validated)\n";

struct Arguments {
  RunSettings settings;
  std::optional<std::string> filter;
  std::vector<std::string> files;
  bool help = false;
};

class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

Arguments parse_arguments(int argc, char** argv) {
  Arguments args;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw UsageError(arg + " needs a value");
      const std::string v = argv[++i];
      // "--dump --filter x" would make a folder named "--filter": an option is never a value.
      if (v.rfind("--", 0) == 0) throw UsageError(arg + " needs a value, got the option '" + v + "'");
      // An empty filter would select every case, and an empty --dump folder is the working one.
      if (v.empty()) throw UsageError(arg + " needs a value, got an empty one");
      return v;
    };
    if (arg == "-h" || arg == "--help") {
      args.help = true;
    } else if (arg == "--dump") {
      if (args.settings.dump_dir) throw UsageError("--dump given twice");
      args.settings.dump_dir = value();
    } else if (arg == "--filter") {
      if (args.filter) throw UsageError("--filter given twice");
      args.filter = value();
    } else if (arg.size() > 1 && arg[0] == '-') {
      throw UsageError("unknown option " + arg);
    } else {
      args.files.push_back(arg);
    }
  }
  if (args.files.empty() && !args.help) throw UsageError("no case file given");
  return args;
}

// Every case of every file, validated; names must be unique since they name dump folders.
std::vector<std::unique_ptr<CaseRunner>> load_cases(const std::vector<std::string>& files) {
  std::vector<std::unique_ptr<CaseRunner>> all;
  std::set<std::string> names;
  for (const std::string& file : files)
    for (auto& runner : load_case_file(file)) {
      if (!names.insert(runner->name()).second)
        throw CaseFileError(file + ": case " + in_quotes(runner->name()) + ": the name is used by an earlier case");
      all.push_back(std::move(runner));
    }
  return all;
}

// cudaGetDeviceCount fails cleanly without a driver or device, which is what CI machines have.
std::optional<std::string> why_no_gpu() {
  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess) return cudaGetErrorString(status);
  if (devices == 0) return "no CUDA device";
  return std::nullopt;
}

int run(const Arguments& args) {
  if (args.help) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  std::vector<std::unique_ptr<CaseRunner>> cases = load_cases(args.files);
  if (args.filter) {
    std::erase_if(cases, [&](const auto& c) { return c->name().find(*args.filter) == std::string::npos; });
    if (cases.empty()) throw UsageError("no case name contains '" + *args.filter + "'");
  }
  if (args.settings.dump_dir) {
    std::error_code error;
    std::filesystem::create_directories(*args.settings.dump_dir, error);
    if (error) throw UsageError("--dump: cannot create " + args.settings.dump_dir->string() + ": " + error.message());
  }
  const std::optional<std::string> no_gpu = why_no_gpu();
  if (no_gpu) std::printf("no GPU (%s): skipping %zu case(s)\n", no_gpu->c_str(), cases.size());

  int passed = 0, failed = 0, skipped = 0;
  for (const auto& c : cases) {
    if (no_gpu) {
      std::printf("SKIP %s (no GPU)\n", c->name().c_str());
      ++skipped;
      continue;
    }
    CaseOutcome outcome;
    try {
      outcome = c->run(args.settings);
    } catch (const std::exception& e) {
      outcome.passed = false;
      outcome.failure = e.what();
    }
    if (outcome.passed) {
      std::printf("PASS %s  %s  max rel err %.1e\n", c->name().c_str(), outcome.paths.c_str(), outcome.max_rel_err);
      ++passed;
    } else {
      std::printf("FAIL %s: %s\n", c->name().c_str(), outcome.failure.c_str());
      ++failed;
    }
    std::fflush(stdout);
  }
  if (skipped > 0) std::printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
  else std::printf("%d passed, %d failed\n", passed, failed);
  if (failed > 0) return kExitFailed;
  return skipped == static_cast<int>(cases.size()) ? kExitSkipped : 0;
}

}  // namespace
}  // namespace moegraph::check

int main(int argc, char** argv) {
  using namespace moegraph::check;
  try {
    return run(parse_arguments(argc, argv));
  } catch (const UsageError& e) {
    std::fprintf(stderr, "moegraph-check: %s\n%s", e.what(), kUsage);
  } catch (const CaseFileError& e) {
    std::fprintf(stderr, "moegraph-check: %s\n", e.what());
  } catch (const std::exception& e) {  // out of memory and the like: a reason, never an abort
    std::fprintf(stderr, "moegraph-check: %s\n", e.what());
  }
  return kExitUsage;
}
