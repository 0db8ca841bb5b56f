// libFuzzer target: moegraph-check's case-file parser (load_case_file) on arbitrary bytes.
// CaseFileError is its documented answer to a bad file; any other exception is a finding.
// load_case_file reads a path, so each input is written to one scratch file of this process first.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "tests/fuzz/fuzz_common.hpp"
#include "tools/check/case_file.hpp"
#include "tools/check/grouped_linear_case.hpp"
#include "tools/check/moe_layer_case.hpp"

namespace moegraph::check {
// Running a case needs a GPU and the device half of the testing library; the parser only constructs
// runners, so these stand in for the real run() (tools/check/*_runner.cpp) and keep device code out.
CaseOutcome GroupedLinearRunner::run(const RunSettings&) { fuzz::finding("GroupedLinearRunner::run called"); }
CaseOutcome MoeLayerRunner::run(const RunSettings&) { fuzz::finding("MoeLayerRunner::run called"); }
}  // namespace moegraph::check

namespace {

// An in-memory file (memfd), reached by its /proc path: no disk in the loop, nothing left behind.
struct ScratchFile {
  int fd = ::memfd_create("moegraph-fuzz-case", 0);
  std::string path = "/proc/self/fd/" + std::to_string(fd);

  void write(const uint8_t* data, size_t size) const {
    const bool ok = fd >= 0 && ::ftruncate(fd, 0) == 0 &&
                    (size == 0 || ::pwrite(fd, data, size, 0) == static_cast<ssize_t>(size));
    if (!ok) moegraph::fuzz::finding("cannot write the scratch case file " + path);
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const ScratchFile scratch;
  scratch.write(data, size);
  moegraph::fuzz::expect_only<moegraph::check::CaseFileError>("load_case_file", [] {
    const auto runners = moegraph::check::load_case_file(scratch.path);
    if (runners.empty()) moegraph::fuzz::finding("load_case_file accepted a file with no case");
    for (const auto& runner : runners)
      if (runner == nullptr || runner->name().empty()) moegraph::fuzz::finding("load_case_file gave an unnamed case");
  });
  return 0;
}
