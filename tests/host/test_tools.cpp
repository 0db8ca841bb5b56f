// The tools as a careless user runs them: bad files give a reason and exit 2, never an abort; and
// --plan as a user sizing a config reads it: readable units, totals, the same numbers in its JSON.
// meson test passes the binaries' paths (MOEGRAPH_BENCH, MOEGRAPH_CHECK); run by hand, the tests skip.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <regex>
#include <span>
#include <string>
#include <tuple>

#include <cuda_runtime_api.h>
#include <nlohmann/json.hpp>

#include "moegraph/config.hpp"
#include "tools/bench/torch_results.hpp"

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

// Each (arguments, reason): the tool exits 2 and its output holds the reason.
template <class Cases>
void expect_refusals(const char* env, const Cases& cases) {
  for (const auto& [args, reason] : cases) {
    const ToolRun r = run_tool(env, args);
    EXPECT_EQ(r.exit_code, 2) << args << ": " << r.output;
    EXPECT_NE(r.output.find(reason), std::string::npos) << args << ": " << r.output;
  }
}

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

// A shape of one's own for the kernel bench is checked before any GPU is touched, with a reason.
TEST(Tools, KernelBenchRefusesMalformedShapesWithAReason) {
  SKIP_WITHOUT("MOEGRAPH_BENCH");
  const std::pair<const char*, const char*> cases[] = {
      {"--kernels --shape olmoe:64:2048", "expected NAME:GROUPS:K:N:ROWS"},
      {"--kernels --shape x:0:2048:2048:100", "GROUPS must be an integer in [1, 1024], got '0'"},
      {"--kernels --shape x:64:2040:2048:100", "K and N must be multiples of 16"},
      {"--kernels --shape x:64:2048:2048:1e4", "ROWS must be an integer"},
      {"--kernels --shape x:1024:65536:65536:100", "exceed 2^34 elements"},
      {"--kernels --set tiny", "--set must be presets, quick, fine or all, got 'tiny'"},
      {"--set fine", "--set, --quick and --shape go with --kernels"},
      {"--kernels --shape 'a|b:1:16:16:1'", "NAME may hold letters, digits, '_', '-' and '.' only"},
      {"--kernels --shape 'a:+1:16:16:1'", "GROUPS must be an integer in [1, 1024], got '+1'"},
      {"--kernels --shape 'a:1: 16:16:1'", "K must be an integer in [16, 65536], got ' 16'"},
      {"--kernels --shape a:1:16:16:1 --shape a:2:16:16:1", "--shape name 'a' given twice"},
  };
  expect_refusals("MOEGRAPH_BENCH", cases);
}

// ---- moegraph-bench --plan ----

bool gpu_present() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

// A file of this test's own under the temp folder, removed first so that a stale one cannot pass.
std::string fresh_temp_path(const std::string& name) {
  const std::filesystem::path p =
      std::filesystem::temp_directory_path() / ("moegraph-test-" + std::to_string(getpid()) + "-" + name);
  std::filesystem::remove(p);
  return p.string();
}

// The size printed after `label` ("1.88 GiB"), in bytes; nullopt when the label or a size is missing.
std::optional<double> printed_size(const std::string& output, const std::string& label) {
  std::smatch m;
  if (!std::regex_search(output, m, std::regex(std::regex_replace(label, std::regex(R"([()=+.])"), R"(\$&)") +
                                               R"(([0-9]+(\.[0-9]+)?) (B|KiB|MiB|GiB))")))
    return std::nullopt;
  const double unit = m[3] == "GiB" ? 1 << 30 : m[3] == "MiB" ? 1 << 20 : m[3] == "KiB" ? 1 << 10 : 1;
  return std::stod(m[1]) * unit;
}

// A printed size agrees with an exact byte count to the printed precision (at most 0.5% off).
void expect_printed(const std::string& output, const std::string& label, double bytes) {
  const std::optional<double> printed = printed_size(output, label);
  ASSERT_TRUE(printed.has_value()) << "no size after '" << label << "' in:\n" << output;
  EXPECT_NEAR(*printed, bytes, 0.005 * bytes) << label;
}

struct PlanRun {
  ToolRun run;
  nlohmann::json plan;  // null when no file was written or it does not parse
};

PlanRun run_plan(const std::string& config_args, const std::string& name) {
  const std::string path = fresh_temp_path(name + ".json");
  PlanRun r{run_tool("MOEGRAPH_BENCH", config_args + " --plan --json " + path), nullptr};
  std::ifstream f(path);
  if (f) r.plan = nlohmann::json::parse(f, nullptr, /*allow_exceptions=*/false);
  std::filesystem::remove(path);
  return r;
}

// A config file of the built-in preset with `patch` merged in (JSON merge patch).
std::string config_file(const nlohmann::json& patch, const std::string& name) {
  nlohmann::json config = nlohmann::json::parse(to_json(default_config()));
  config.merge_patch(patch);
  const std::string path = fresh_temp_path(name + ".json");
  std::ofstream(path) << config.dump();
  return path;
}

// Sizes in KiB/MiB/GiB (offsets included: no raw byte counts of seven digits or more), and the
// device-memory total a reader looks for.
TEST(Tools, BenchPlanPrintsReadableSizesAndATotal) {
  SKIP_WITHOUT("MOEGRAPH_BENCH");
  const ToolRun r = run_tool("MOEGRAPH_BENCH", "--plan");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(" MiB"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(" GiB"), std::string::npos) << r.output;
  std::smatch raw;
  EXPECT_FALSE(std::regex_search(r.output, raw, std::regex("[0-9]{7,}"))) << "a raw byte count: " << raw.str(0);
  EXPECT_TRUE(printed_size(r.output, "device memory total: ").has_value()) << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex(" at [0-9.]+ (KiB|MiB|GiB)\n"))) << "offsets in readable units:\n"
                                                                                   << r.output;
}

// --plan --json writes the plan, and its numbers are the ones printed.
TEST(Tools, BenchPlanJsonHoldsThePrintedPlan) {
  SKIP_WITHOUT("MOEGRAPH_BENCH");
  const PlanRun r = run_plan("", "plan");
  ASSERT_EQ(r.run.exit_code, 0) << r.run.output;
  ASSERT_TRUE(r.plan.is_object()) << "--plan --json wrote no JSON file (or one that does not parse)\n" << r.run.output;
  const nlohmann::json& p = r.plan;
  for (const char* key : {"name", "config", "buckets", "arena_bytes", "sum_of_buckets", "weight_bytes", "window_bytes",
                          "shard_window_bytes", "device_bytes", "kernels", "gpu_memory_bytes", "expert_parallel"})
    EXPECT_TRUE(p.contains(key)) << key;
  const Config preset = default_config();
  EXPECT_EQ(p["name"], preset.name);
  EXPECT_EQ(p["config"], nlohmann::json::parse(to_json(preset)));
  ASSERT_EQ(p["buckets"].size(), preset.buckets.size());
  std::size_t largest = 0, sum = 0;
  for (std::size_t b = 0; b < preset.buckets.size(); ++b) {
    const nlohmann::json& bucket = p["buckets"][b];
    EXPECT_EQ(bucket["tokens"], preset.buckets[b]);
    EXPECT_GT(bucket["rows"].get<int64_t>(), 0);
    const std::size_t bytes = bucket["bytes"];
    largest = std::max(largest, bytes), sum += bytes;
    ASSERT_FALSE(bucket["buffers"].empty());
    for (const nlohmann::json& buf : bucket["buffers"])
      EXPECT_LE(buf["offset"].get<std::size_t>() + buf["bytes"].get<std::size_t>(), bytes) << buf.dump();
    EXPECT_EQ(bucket["device_bytes"], bytes + p["weight_bytes"].get<std::size_t>());
    expect_printed(r.run.output, "bucket " + std::to_string(preset.buckets[b]) + " tokens (" +
                                     std::to_string(bucket["rows"].get<int64_t>()) + " rows): ", bytes);
  }
  EXPECT_EQ(p["arena_bytes"], largest);
  EXPECT_EQ(p["sum_of_buckets"], sum);
  EXPECT_EQ(p["window_bytes"], 0);
  EXPECT_TRUE(p["expert_parallel"].is_null());
  EXPECT_EQ(p["device_bytes"], largest + p["weight_bytes"].get<std::size_t>());
  expect_printed(r.run.output, "arena (shared by all buckets, = the largest): ", largest);
  expect_printed(r.run.output, "weights and gradients (outside the arena): ", p["weight_bytes"]);
  expect_printed(r.run.output, "device memory total: ", p["device_bytes"]);
  EXPECT_FALSE(p["kernels"].empty());
  if (gpu_present()) {
    cudaDeviceProp prop{};
    ASSERT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
    EXPECT_EQ(p["gpu_memory_bytes"], prop.totalGlobalMem);
  } else {
    EXPECT_TRUE(p["gpu_memory_bytes"].is_null());
  }
}

// With expert parallelism each bucket's window counts, at the configured bound, in the totals.
TEST(Tools, BenchPlanCountsTheExpertParallelWindows) {
  SKIP_WITHOUT("MOEGRAPH_BENCH");
  const std::string config =
      config_file({{"name", "ep4"}, {"parallel", {{"expert_parallel", 4}, {"recv_rows", 20000}}}}, "ep4");
  const PlanRun r = run_plan(config, "ep4-plan");
  std::filesystem::remove(config);
  ASSERT_EQ(r.run.exit_code, 0) << r.run.output;
  ASSERT_TRUE(r.plan.is_object()) << r.run.output;
  const nlohmann::json& p = r.plan;
  ASSERT_TRUE(p["expert_parallel"].is_object()) << p.dump(1);
  EXPECT_EQ(p["expert_parallel"]["ranks"], 4);
  const nlohmann::json& windows = p["expert_parallel"]["windows"];
  ASSERT_EQ(windows.size(), p["buckets"].size());
  std::size_t sum = 0;
  for (std::size_t b = 0; b < windows.size(); ++b) {
    EXPECT_EQ(windows[b]["recv_rows"], 20000);
    EXPECT_LT(windows[b]["bound_bytes"], windows[b]["worst_case_bytes"]) << "20000 rows are below the worst case";
    EXPECT_EQ(p["buckets"][b]["window_bytes"], windows[b]["bound_bytes"]) << "the bound is what is allocated";
    sum += windows[b]["bound_bytes"].get<std::size_t>();
  }
  EXPECT_EQ(p["window_bytes"], sum);
  EXPECT_EQ(p["device_bytes"], p["arena_bytes"].get<std::size_t>() + p["weight_bytes"].get<std::size_t>() + sum);
  expect_printed(r.run.output, "expert-parallel windows (outside the arena, one per bucket): ", sum);
  expect_printed(r.run.output, "device memory total: ", p["device_bytes"]);
}

// Sharded weights: the gather's window is in the JSON, and the JSON's parts add up to its total.
TEST(Tools, BenchPlanJsonCountsTheShardWindow) {
  SKIP_WITHOUT("MOEGRAPH_BENCH");
  const std::string config = config_file({{"name", "sharded4"}, {"parallel", {{"sharding", {{"ranks", 4}}}}}}, "sharded4");
  const PlanRun r = run_plan(config, "sharded4-plan");
  std::filesystem::remove(config);
  ASSERT_EQ(r.run.exit_code, 0) << r.run.output;
  const nlohmann::json& p = r.plan;
  ASSERT_TRUE(p.contains("shard_window_bytes")) << p.dump(1);
  EXPECT_GT(p["shard_window_bytes"].get<std::size_t>(), 0u);
  std::size_t parts = 0;
  for (const char* key : {"arena_bytes", "weight_bytes", "mxfp8_copy_bytes", "window_bytes", "shard_window_bytes"})
    parts += p[key].get<std::size_t>();
  EXPECT_EQ(p["device_bytes"], parts);
}

// send/recv chunks smaller than a source's rows bound the receive buffer: its "worst case" drops
// rows, and the plan says so rather than "dropless".
TEST(Tools, BenchPlanSaysChunksDropRows) {
  SKIP_WITHOUT("MOEGRAPH_BENCH");
  const std::string config = config_file(
      {{"name", "chunks"}, {"buckets", {16, 4096}},
       {"parallel", {{"expert_parallel", 8}, {"exchange", "send_recv"}, {"chunk_rows", 128}}}}, "chunks");
  const PlanRun r = run_plan(config, "chunks-plan");
  std::filesystem::remove(config);
  ASSERT_EQ(r.run.exit_code, 0) << r.run.output;
  const nlohmann::json& windows = r.plan["expert_parallel"]["windows"];
  ASSERT_EQ(windows.size(), 2u) << r.plan.dump(1);
  EXPECT_EQ(windows[0]["chunk_bounded"], false) << "16 tokens route at most 16 * top_k = 128 rows, a chunk's";
  EXPECT_EQ(windows[1]["chunk_bounded"], true);
  EXPECT_NE(r.run.output.find("16 tokens: window"), std::string::npos) << r.run.output;
  const std::size_t big = r.run.output.find("4096 tokens: window");
  ASSERT_NE(big, std::string::npos) << r.run.output;
  const std::string line = r.run.output.substr(big, r.run.output.find('\n', big) - big);
  EXPECT_NE(line.find("rows past a chunk are dropped"), std::string::npos) << line;
  EXPECT_EQ(line.find("dropless"), std::string::npos) << line;
  // With two experts a rank, a token sends a peer at most two rows (its top-8 experts are distinct):
  // 64 tokens send at most 128, within chunks of 256, though 64 * top_k = 512 is not.
  const std::string few = config_file({{"name", "few"}, {"layer", {{"experts", 16}}}, {"buckets", {64}},
                                       {"parallel", {{"expert_parallel", 8}, {"exchange", "send_recv"}, {"chunk_rows", 256}}}},
                                      "few");
  const PlanRun f = run_plan(few, "few-plan");
  std::filesystem::remove(few);
  ASSERT_EQ(f.run.exit_code, 0) << f.run.output;
  EXPECT_EQ(f.plan["expert_parallel"]["windows"][0]["chunk_bounded"], false) << f.plan.dump(1);
  EXPECT_NE(f.run.output.find("worst case: dropless"), std::string::npos) << f.run.output;
}

// An experts-only config cannot spread its experts: refused as such, before any advice to launch ranks.
TEST(Tools, BenchRefusesExpertParallelExpertsOnlyBeforeLaunchAdvice) {
  SKIP_WITHOUT("MOEGRAPH_BENCH");
  const std::string config = config_file({{"name", "experts-only"}, {"step", "experts"}}, "experts-only");
  const ToolRun r = run_tool("MOEGRAPH_BENCH", config + " --expert-parallel 1");
  std::filesystem::remove(config);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("expert parallelism needs step \"moe_layer\""), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("scripts/launch"), std::string::npos) << r.output;
}

// A receive bound between the buckets' worst cases: the small bucket sizes its worst case and
// reports no bound, the larger ones the bound (such a config used to be refused).
TEST(Tools, BenchPlanBoundsOnlyTheBucketsItCanBound) {
  SKIP_WITHOUT("MOEGRAPH_BENCH");
  const std::string config =
      config_file({{"name", "ep4b"}, {"buckets", {1024, 4096}}, {"parallel", {{"expert_parallel", 4}, {"recv_rows", 40000}}}},
                  "ep4b");
  const PlanRun r = run_plan(config, "ep4b-plan");
  std::filesystem::remove(config);
  ASSERT_EQ(r.run.exit_code, 0) << r.run.output;
  const nlohmann::json& windows = r.plan["expert_parallel"]["windows"];
  ASSERT_EQ(windows.size(), 2u) << r.plan.dump(1);
  EXPECT_LT(windows[0]["worst_case_rows"].get<int64_t>(), 40000) << windows[0].dump();
  EXPECT_EQ(windows[0]["recv_rows"], 0) << "1024 tokens cannot fill 40000 rows";
  EXPECT_EQ(r.plan["buckets"][0]["window_bytes"], windows[0]["worst_case_bytes"]);
  EXPECT_GT(windows[1]["worst_case_rows"].get<int64_t>(), 40000) << windows[1].dump();
  EXPECT_EQ(windows[1]["recv_rows"], 40000);
  EXPECT_EQ(r.plan["buckets"][1]["window_bytes"], windows[1]["bound_bytes"]);
}

// The plan is compared with the GPU when there is one; without, it says so and still succeeds.
TEST(Tools, BenchPlanComparesWithTheGpuOrSaysThereIsNone) {
  SKIP_WITHOUT("MOEGRAPH_BENCH");
  const std::string config = config_file({{"buckets", {1048576}}}, "huge");  // past any GPU's memory
  const ToolRun r = run_tool("MOEGRAPH_BENCH", config + " --plan");
  std::filesystem::remove(config);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  if (gpu_present())
    EXPECT_NE(r.output.find("WARNING: the step needs"), std::string::npos) << r.output;
  else
    EXPECT_NE(r.output.find("no GPU found to compare against"), std::string::npos) << r.output;
}

TEST(Tools, BenchPlanJsonToAnUnwritablePathFailsWithAReason) {
  SKIP_WITHOUT("MOEGRAPH_BENCH");
  // Checked before anything runs, for every bench (a GPU run would otherwise end in the error).
  for (const char* args : {"--plan --json /no/such/folder/plan.json", "--json /no/such/folder/plan.json",
                           "--kernels --json /no/such/folder/plan.json"}) {
    const ToolRun r = run_tool("MOEGRAPH_BENCH", args);
    EXPECT_EQ(r.exit_code, 2) << args << ": " << r.output;
    EXPECT_NE(r.output.find("--json /no/such/folder/plan.json: cannot write it (No such file or directory)"),
              std::string::npos)
        << args << ": " << r.output;
  }
  // A writable path is left as it was: the check appends nothing and removes a file it created.
  const std::string path = fresh_temp_path("writable.json");
  const ToolRun r = run_tool("MOEGRAPH_BENCH", "--json " + path + " --set fine");  // refused after the check
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_FALSE(std::filesystem::exists(path)) << r.output;
}

// Options and their values: an empty value, the next option taken as a value, an option given twice,
// a config with --kernels or an empty config path, and numbers with signs or spaces are refused
// (exit 2, the option named) instead of dropped or read as something else.
TEST(Tools, BenchRefusesAmbiguousOptions) {
  SKIP_WITHOUT("MOEGRAPH_BENCH");
  const std::pair<const char*, const char*> cases[] = {
      {"--plan --json ''", "--json needs a value, got an empty one"},
      {"--json --plan", "--json needs a value, got the option '--plan'"},
      {"--torch --ops", "--torch needs a value, got the option '--ops'"},
      {"'' --plan", "the config path is empty"},
      {"--replays 5 --replays 6 --plan", "--replays given twice"},
      {"--plan --plan", "--plan given twice"},
      {"--kernels --set fine --quick", "--set and --quick choose one set"},
      {"--kernels --set all --shape a:1:16:16:16", "give --set (or --quick) or --shape, not both"},
      {"--kernels --quick --shape a:1:16:16:16", "give --set (or --quick) or --shape, not both"},
      {"--plan --replays 5", "--replays goes with the step bench, not --plan"},
      {"--kernels --plan", "--plan goes with a config's step, not --kernels"},
      {"--kernels --recipe mxfp8", "--recipe goes with a config's step, not --kernels"},
      {"--kernels --expert-parallel 2", "--expert-parallel goes with a config's step, not --kernels"},
      {"--kernels some.json", "--kernels takes no config ('some.json')"},
      {"--replays +5 --plan", "--replays needs an integer in [1, 1000000], got '+5'"},
      {"--replays ' 5' --plan", "--replays needs an integer in [1, 1000000], got ' 5'"},
      {"--expert-parallel +2 --plan", "--expert-parallel needs an integer in [1, 64], got '+2'"},
  };
  expect_refusals("MOEGRAPH_BENCH", cases);
}

TEST(Tools, CheckRefusesAnOptionGivenTwice) {
  SKIP_WITHOUT("MOEGRAPH_CHECK");
  const std::pair<const char*, const char*> cases[] = {{"--dump /tmp/a --dump /tmp/b x.json", "--dump given twice"},
                                                       {"--filter a --filter b x.json", "--filter given twice"}};
  expect_refusals("MOEGRAPH_CHECK", cases);
}

TEST(Tools, CheckTakesNoOptionAsAValue) {
  SKIP_WITHOUT("MOEGRAPH_CHECK");
  const std::pair<const char*, const char*> cases[] = {
      {"--dump --filter a x.json", "--dump needs a value, got the option '--filter'"},
      {"--filter --dump /tmp/a x.json", "--filter needs a value, got the option '--dump'"},
      {"--filter '' x.json", "--filter needs a value, got an empty one"},
      {"--dump '' x.json", "--dump needs a value, got an empty one"}};
  expect_refusals("MOEGRAPH_CHECK", cases);
}

// The check that --json can be written ran before anything else and removed what it had not
// created: a dangling link given as --json was deleted.
TEST(Tools, BenchJsonCheckRemovesOnlyWhatItCreated) {
  SKIP_WITHOUT("MOEGRAPH_BENCH");
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("moegraph-json-link-" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path link = dir / "link.json", target = dir / "target.json";
  fs::create_symlink(target, link);
  const ToolRun r = run_tool("MOEGRAPH_BENCH", "--kernels --plan --json " + link.string());  // refused after the check
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(fs::is_symlink(fs::symlink_status(link))) << "the link given as --json was removed";
  EXPECT_FALSE(fs::exists(target)) << "the file the check created through the link was left behind";
  std::ofstream(target) << "kept";
  EXPECT_EQ(run_tool("MOEGRAPH_BENCH", "--kernels --plan --json " + link.string()).exit_code, 2);
  EXPECT_TRUE(fs::exists(target)) << "a file that existed was removed";
  const fs::path fresh = dir / "fresh.json";
  const ToolRun f = run_tool("MOEGRAPH_BENCH", "--kernels --plan --json " + fresh.string());
  EXPECT_EQ(f.exit_code, 2) << f.output;
  EXPECT_FALSE(fs::exists(fresh)) << "the file the check created was left behind";
  fs::remove_all(dir);
}

// ---- moegraph-bench CONFIG --torch T.json ----

// What scripts/torch-moe-bench --json writes for config `c` (its keys and layout), every bucket timed.
nlohmann::json torch_results_for(const Config& c) {
  nlohmann::json records = nlohmann::json::array();
  for (const int64_t bucket : c.buckets) {
    const int64_t tokens = std::max<int64_t>(1, static_cast<int64_t>(bucket * c.bench.fill));
    records.push_back({{"bucket", bucket}, {"tokens", tokens}, {"rows", tokens * c.layer.top_k}, {"eager_ms", 2.5},
                       {"graph_ms", 1.5}, {"capture_ms", 30.0}, {"error", nullptr}, {"graph_error", nullptr}});
  }
  const nlohmann::json cfg = {{"name", c.name}, {"step", "moe_layer"}, {"experts", c.layer.experts},
                              {"hidden", c.layer.hidden}, {"ffn", c.layer.ffn}, {"top_k", c.layer.top_k},
                              {"bias", c.layer.bias}, {"score", std::string(router_score_name(c.router.score))},
                              {"renormalize", c.router.renormalize}, {"aux_coef", c.router.aux_loss_coef},
                              {"dtype", "bf16"}, {"training", c.training.enabled}, {"buckets", c.buckets},
                              {"fill", c.bench.fill}, {"replays", 10}};
  const nlohmann::json entry = {{"file", "config.json"}, {"config", cfg}, {"grouped_mm", "torch._grouped_mm"},
                                {"replays", 10}, {"phase", c.training.enabled ? "train" : "inference"},
                                {"buckets", records}};
  return {{"device", "NVIDIA H100 80GB HBM3"}, {"torch", "2.9.0"}, {"configs", nlohmann::json::array({entry})}};
}

// A matching file gives each bucket's graph replay, and none where PyTorch's bucket failed.
TEST(Tools, TorchResultsGiveEachBucketsGraphReplay) {
  Config c = default_config();
  c.buckets = {1, 64, 256};
  nlohmann::json t = torch_results_for(c);
  t["configs"][0]["buckets"][1]["graph_ms"] = 0.75;
  t["configs"][0]["buckets"][2]["graph_ms"] = nullptr;  // its capture failed
  t["configs"][0]["buckets"][2]["graph_error"] = "RuntimeError: out of memory";
  const std::string path = fresh_temp_path("torch-ok.json");
  std::ofstream(path) << t.dump();
  const bench::TorchResults r = bench::load_torch_results(path, c);
  std::filesystem::remove(path);
  EXPECT_EQ(r.device, "NVIDIA H100 80GB HBM3");
  EXPECT_EQ(r.torch_version, "2.9.0");
  EXPECT_EQ(r.grouped_mm, "torch._grouped_mm");
  ASSERT_EQ(r.buckets.size(), 3u);
  EXPECT_EQ(r.at(1).graph_ms, 1.5);
  EXPECT_EQ(r.at(64).graph_ms, 0.75);
  EXPECT_EQ(r.at(64).tokens, 64);
  EXPECT_FALSE(r.at(256).graph_ms.has_value());
}

// A layer the PyTorch bench does not model is refused whatever the file says: a capacity bound (it
// routes dropless) and the expert MLP alone (it times the whole layer).
TEST(Tools, TorchResultsRefuseALayerThePyTorchBenchDoesNotModel) {
  Config c = default_config();
  c.buckets = {64};
  const std::string path = fresh_temp_path("torch-model.json");
  std::ofstream(path) << torch_results_for(c).dump();
  EXPECT_NO_THROW(bench::load_torch_results(path, c));
  Config capacity = c, experts = c;
  capacity.router.capacity_factor = 1.25;
  experts.step = StepKind::kExperts;
  const std::pair<const Config*, const char*> cases[] = {
      {&capacity, "the PyTorch layer routes dropless; this config has router.capacity_factor 1.25"},
      {&experts, "the PyTorch layer is the whole MoE layer; this config's step is \"experts\""}};
  for (const auto& [config, reason] : cases) {
    try {
      bench::load_torch_results(path, *config);
      ADD_FAILURE() << "accepted: " << reason;
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(reason), std::string::npos) << e.what();
    }
  }
  std::filesystem::remove(path);
}

// The PyTorch results are read and matched to the config before any GPU is touched: a wrong or
// stale file exits 2 with the reason, on a machine with or without a GPU.
TEST(Tools, BenchTorchResultsAreCheckedBeforeTheGpu) {
  SKIP_WITHOUT("MOEGRAPH_BENCH");
  const nlohmann::json patch = {{"name", "torch-pair"}, {"buckets", {64, 256}}, {"bench", {{"fill", 0.5}}}};
  const std::string config = config_file(patch, "torch-pair");
  const Config c = load_config(config);
  using Edit = void (*)(nlohmann::json&);
  const std::pair<Edit, const char*> cases[] = {
      {[](nlohmann::json& t) { t["configs"][0]["config"]["name"] = "other"; },
       "no results of config \"torch-pair\" (it holds \"other\")"},
      {[](nlohmann::json& t) { t["configs"][0]["config"]["buckets"] = {64}; },
       "its buckets are [64], this config's [64, 256]"},
      {[](nlohmann::json& t) { t["configs"][0]["buckets"].erase(1); }, "no result for the bucket of 256 tokens"},
      {[](nlohmann::json& t) { t["configs"][0]["buckets"][0]["tokens"] = 64; },
       "its bucket of 64 tokens routed 64 tokens, this config routes 32 (bench.fill differs)"},
      {[](nlohmann::json& t) { t["configs"][0]["config"]["hidden"] = 4096; }, "it was run with layer.hidden 4096"},
      {[](nlohmann::json& t) { t["configs"][0]["config"]["training"] = false; },
       "it timed inference, this config training"},
      {[](nlohmann::json& t) { t["configs"][0]["config"]["bias"] = true; },
       "it was run with layer.bias true, this config has false"},
      {[](nlohmann::json& t) { t["configs"][0]["config"]["renormalize"] = false; },
       "it was run with router.renormalize false, this config has true"},
      {[](nlohmann::json& t) { t["configs"][0]["config"]["score"] = "sigmoid"; },
       "it was run with router.score \"sigmoid\", this config has \"softmax\""},
      {[](nlohmann::json& t) { t["configs"][0]["config"]["aux_coef"] = 0.0; },
       "it was run with router.aux_loss_coef 0, this config has 0.001"},
      {[](nlohmann::json& t) { t["configs"][0]["config"].erase("score"); }, "missing key \"config.score\""},
      {[](nlohmann::json& t) { t["configs"][0]["buckets"][1]["graph_ms"] = "fast"; },
       "buckets[1].graph_ms must be a number"},
      {[](nlohmann::json& t) { t["configs"].push_back(t["configs"][0]); }, "2 results of config \"torch-pair\""},
      {[](nlohmann::json& t) { t = nlohmann::json::array(); }, "the document must be an object"},
  };
  const std::string torch = fresh_temp_path("torch-results.json");
  for (const auto& [edit, reason] : cases) {
    nlohmann::json t = torch_results_for(c);
    edit(t);
    std::ofstream(torch) << t.dump();
    const ToolRun r = run_tool("MOEGRAPH_BENCH", config + " --torch " + torch);
    EXPECT_EQ(r.exit_code, 2) << reason << ": " << r.output;
    EXPECT_NE(r.output.find("--torch: torch results file \"" + torch + "\": " + reason), std::string::npos)
        << r.output;
    EXPECT_EQ(r.output.find("CUDA"), std::string::npos) << "checked after the GPU: " << r.output;
  }
  const std::pair<std::string, const char*> arguments[] = {
      {config + " --torch /no/such/torch.json",
       "cannot open torch results file \"/no/such/torch.json\": No such file or directory"},
      {config + " --torch", "--torch needs a value"},
      {"--kernels --torch " + torch, "--torch goes with the step bench of a config, not --kernels"},
      {config + " --plan --torch " + torch, "--torch goes with the step bench, not --plan"},
      {"--kernels --ops", "--ops goes with the step bench of a config, not --kernels"},
      {config + " --plan --ops", "--ops goes with the step bench, not --plan"},
  };
  expect_refusals("MOEGRAPH_BENCH", arguments);
  // A file that matches passes the check; without a GPU the run then stops where any run does.
  std::ofstream(torch) << torch_results_for(c).dump();
  if (!gpu_present()) {
    const ToolRun r = run_tool("MOEGRAPH_BENCH", config + " --torch " + torch);
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("no CUDA device is available"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("--torch:"), std::string::npos) << r.output;
  }
  std::filesystem::remove(torch);
  std::filesystem::remove(config);
}

// ---- moegraph-check ----

// Each case, written alone to a file named `file`, is refused by moegraph-check (exit 2) with
// `reason` in its output.
void expect_case_refusals(const char* file, std::span<const std::pair<nlohmann::json, const char*>> cases) {
  const std::string path = fresh_temp_path(file);
  for (const auto& [json, reason] : cases) {
    std::ofstream(path) << json.dump();
    const ToolRun r = run_tool("MOEGRAPH_CHECK", path);
    EXPECT_EQ(r.exit_code, 2) << reason << ": " << r.output;
    EXPECT_NE(r.output.find(reason), std::string::npos) << r.output;
  }
  std::filesystem::remove(path);
}

// A case past what its host fp64 reference can hold or run is refused with the file (exit 2, GPU or
// not), where each key alone is within its range.
TEST(Tools, CheckRefusesCasesTooLargeForTheReference) {
  SKIP_WITHOUT("MOEGRAPH_CHECK");
  auto linear = [](nlohmann::json shape, int rows) {
    return nlohmann::json{{"name", "c"}, {"op", "grouped_linear"}, {"shape", std::move(shape)},
                          {"routing", {{"kind", "random"}, {"rows", rows}, {"seed", 1}}}};
  };
  auto moe = [](nlohmann::json shape) {
    return nlohmann::json{{"name", "c"}, {"op", "moe_layer"}, {"shape", std::move(shape)}, {"tokens", {4}}};
  };
  const std::pair<nlohmann::json, const char*> cases[] = {
      {linear({{"groups", 1024}, {"k", 65536}, {"n", 65536}}, 4096),
       "shape: groups * n * k = 4398046511104 weight elements, more than the 2^30"},
      {linear({{"groups", 1}, {"k", 32768}, {"n", 32768}}, 4096),
       "shape: rows * n * k = 4398046511104 multiply-adds a step, more than the 2^37"},
      {moe({{"experts", 1024}, {"hidden", 65536}, {"ffn", 65536}, {"max_tokens", 16}}),
       "shape: experts * (3 * ffn * hidden + hidden) = 13194206642176 weight elements"},
      // The rows' width alone: capacity_extra rows count, though they hold no data.
      {linear({{"groups", 1}, {"k", 65536}, {"n", 16}, {"capacity_extra", 1048576}}, 0),
       "shape: capacity rows * max(k, n) = 68719476736 activation elements, more than the 2^28"},
      {moe({{"experts", 256}, {"hidden", 65536}, {"ffn", 16}, {"max_tokens", 43690}}),
       "shape: rows (max_tokens * top_k + experts * (row_align - 1), aligned) * max(hidden, 2 * ffn) = 2863267840 "
       "activation elements"},
      // The rows' alignment padding counts: one token, yet 130176 rows of 2 * ffn in the reference.
      {moe({{"experts", 1024}, {"hidden", 16}, {"ffn", 16384}, {"row_align", 128}, {"max_tokens", 4}}),
       "= 4265607168 activation elements, more than the 2^28"},
      // The router's GEMM counts too (experts * hidden a token).
      {moe({{"experts", 512}, {"hidden", 16384}, {"ffn", 16}, {"max_tokens", 16384}}),
       "shape: max_tokens * (experts * hidden + top_k * 3 * ffn * hidden) = 150323855360 multiply-adds a step"},
  };
  expect_case_refusals("huge-case.json", cases);
}

// The keys read before the rest of a case is known (its name, op and routing kind): a misspelt one is
// named as a likely typo, not only as missing.
TEST(Tools, CheckNamesATypoOfAKeyReadFirst) {
  SKIP_WITHOUT("MOEGRAPH_CHECK");
  const std::pair<nlohmann::json, const char*> cases[] = {
      {{{"nmae", "c"}, {"op", "grouped_linear"}}, R"(missing required key "name"; is "nmae" a typo of it?)"},
      {{{"name", "c"}, {"opp", "grouped_linear"}}, R"(missing required key "op"; is "opp" a typo of it?)"},
      {{{"name", "c"}, {"op", "grouped_linear"}, {"shape", {{"groups", 2}, {"k", 64}, {"n", 64}}},
        {"routing", {{"knid", "random"}, {"rows", 8}, {"seed", 1}}}},
       R"(missing required key "routing.kind"; is "knid" a typo of it?)"},
  };
  expect_case_refusals("typo-case.json", cases);
}

// A file with "cases" is a list of cases and nothing else: one case that also has a "cases" key is
// told so, not told that its own keys are unknown.
TEST(Tools, CheckRefusesCasesBesideOtherKeys) {
  SKIP_WITHOUT("MOEGRAPH_CHECK");
  const std::pair<nlohmann::json, const char*> cases[] = {
      {{{"name", "c"}, {"op", "grouped_linear"}, {"cases", 1}},
       R"(either {"cases": [...]} alone or one case object, but this one has "cases" beside "name", "op")"},
  };
  expect_case_refusals("cases-beside.json", cases);
}

// A key that would do nothing is refused: where weight gradients go, in a case that writes none.
TEST(Tools, CheckRefusesWgradInAForwardOnlyCase) {
  SKIP_WITHOUT("MOEGRAPH_CHECK");
  const std::string path = fresh_temp_path("forward-wgrad-case.json");
  for (const char* op : {"grouped_linear", "moe_layer"}) {
    nlohmann::json c = {{"name", "c"}, {"op", op}, {"phases", {"forward"}}, {"wgrad", "main_grad"}};
    if (std::string(op) == "moe_layer") {
      c["shape"] = {{"experts", 8}, {"hidden", 256}, {"ffn", 128}, {"max_tokens", 16}};
      c["tokens"] = {4};
    } else {
      c["shape"] = {{"groups", 4}, {"k", 128}, {"n", 128}};
      c["routing"] = {{"kind", "random"}, {"rows", 64}, {"seed", 1}};
    }
    std::ofstream(path) << c.dump();
    ToolRun r = run_tool("MOEGRAPH_CHECK", path);
    EXPECT_EQ(r.exit_code, 2) << op << ": " << r.output;
    EXPECT_NE(r.output.find("wgrad says where the weight gradients go, but the case's phases are [\"forward\"] only"),
              std::string::npos)
        << r.output;
    c.erase("wgrad");
    std::ofstream(path) << c.dump();
    r = run_tool("MOEGRAPH_CHECK", path);
    EXPECT_EQ(r.exit_code, gpu_present() ? 0 : 77) << op << ": " << r.output;
  }
  std::filesystem::remove(path);
}

// A moe_layer case's recipe is checked with the file, GPU or not: the name, then each linear's shape
// rules (FC1: K hidden, N 2 ffn; FC2: K ffn, N hidden), named by the case's keys.
TEST(Tools, CheckRefusesMoeLayerRecipesTheLayerCannotRun) {
  SKIP_WITHOUT("MOEGRAPH_CHECK");
  const std::string path = fresh_temp_path("mxfp8-case.json");
  auto write_case = [&](int hidden, int ffn, int row_align, const std::string& recipe) {
    std::ofstream(path) << nlohmann::json{{"name", "c"},
                                          {"op", "moe_layer"},
                                          {"shape", {{"experts", 8}, {"hidden", hidden}, {"ffn", ffn},
                                                     {"row_align", row_align}, {"max_tokens", 16}}},
                                          {"tokens", {4}},
                                          {"recipe", recipe}}
                                .dump();
  };
  const std::tuple<int, int, int, const char*, const char*> cases[] = {
      {256, 128, 32, "fp8", "recipe must be one of \"bf16\", \"mxfp8\", got \"fp8\""},
      {192, 128, 32, "mxfp8", "recipe \"mxfp8\" cannot run fc1 (shape.hidden 192, shape.ffn 128, shape.row_align 32)"},
      {256, 64, 32, "mxfp8", "recipe \"mxfp8\" cannot run fc2 (shape.hidden 256, shape.ffn 64, shape.row_align 32): "
                             "the mxfp8 recipe needs in_features (K) and out_features (N) multiples of 128, got K 64 "
                             "and N 256"},
      {256, 128, 16, "mxfp8", "recipe \"mxfp8\" cannot run fc1 (shape.hidden 256, shape.ffn 128, shape.row_align "
                              "16): the mxfp8 recipe trains only at row_align 32 or 128"},
  };
  for (const auto& [hidden, ffn, row_align, recipe, reason] : cases) {
    write_case(hidden, ffn, row_align, recipe);
    const ToolRun r = run_tool("MOEGRAPH_CHECK", path);
    EXPECT_EQ(r.exit_code, 2) << reason << ": " << r.output;
    EXPECT_NE(r.output.find(std::string("case \"c\": ") + reason), std::string::npos) << r.output;
  }
  // Shapes the recipe can run pass validation: the case is skipped without a GPU (77), run with one.
  const int valid_exit = gpu_present() ? 0 : 77;
  for (const auto& [hidden, ffn, row_align, recipe] :
       {std::tuple{192, 128, 16, "bf16"}, std::tuple{256, 128, 128, "mxfp8"}, std::tuple{512, 384, 32, "mxfp8"}}) {
    write_case(hidden, ffn, row_align, recipe);
    const ToolRun r = run_tool("MOEGRAPH_CHECK", path);
    EXPECT_EQ(r.exit_code, valid_exit) << recipe << " hidden " << hidden << ": " << r.output;
  }
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace moegraph::test
