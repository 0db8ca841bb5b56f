// The tools as a careless user runs them: bad files give a reason and exit 2, never an abort.
// meson test passes the binaries' paths (MOEGRAPH_BENCH, MOEGRAPH_CHECK); run by hand, the tests skip.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include <cuda_runtime_api.h>

namespace moegraph::test {
namespace {

struct ToolRun {
  int exit_code = -1;
  std::string output;  // stdout and stderr
};

ToolRun run_tool(const char* env, const std::string& args) {
  const char* tool = std::getenv(env);
  if (tool == nullptr) return {};
  ToolRun r;
  FILE* pipe = popen((std::string(tool) + " " + args + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return r;
  char buffer[4096];
  std::size_t n;
  while ((n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0) r.output.append(buffer, n);
  const int status = pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

#define SKIP_WITHOUT(env) \
  if (std::getenv(env) == nullptr) GTEST_SKIP() << env << " is not set (meson test sets it)"

TEST(Tools, BenchRefusesAnEndlessFileWithAReason) {
  SKIP_WITHOUT("MOEGRAPH_BENCH");
  const ToolRun r = run_tool("MOEGRAPH_BENCH", "/dev/zero --plan");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("\"/dev/zero\": it is larger than 16 MiB"), std::string::npos) << r.output;
}

TEST(Tools, FileErrorsCarryTheReason) {
  SKIP_WITHOUT("MOEGRAPH_BENCH");
  const std::string dir = std::filesystem::temp_directory_path().string();
  for (const char* env : {"MOEGRAPH_BENCH", "MOEGRAPH_CHECK"}) {
    const std::string extra = std::string(env) == "MOEGRAPH_BENCH" ? " --plan" : "";
    const ToolRun directory = run_tool(env, dir + extra);
    EXPECT_EQ(directory.exit_code, 2) << env << ": " << directory.output;
    EXPECT_NE(directory.output.find("it is a directory"), std::string::npos) << env << ": " << directory.output;
    const ToolRun missing = run_tool(env, "/no/such/moegraph.json" + extra);
    EXPECT_EQ(missing.exit_code, 2) << env << ": " << missing.output;
    EXPECT_NE(missing.output.find("No such file or directory"), std::string::npos) << env << ": " << missing.output;
  }
}

// Without a usable GPU the benchmark says so (not a driver-version riddle) and points at --plan.
TEST(Tools, BenchWithoutAGpuSaysSoAndSuggestsPlan) {
  SKIP_WITHOUT("MOEGRAPH_BENCH");
  int count = 0;
  if (cudaGetDeviceCount(&count) == cudaSuccess && count > 0) GTEST_SKIP() << "a GPU is present";
  const ToolRun r = run_tool("MOEGRAPH_BENCH", "");  // the built-in config
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("no CUDA device is available"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--plan"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace moegraph::test
