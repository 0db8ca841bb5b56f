// moegraph-bench [CONFIG] [--plan] [--json FILE] [--replays N] [--recipe R] [--mxfp8-dequantized] [--torch FILE]
//                [--ops] [--expert-parallel R]
//                | --kernels [--quick | --set S | --shape NAME:G:K:N:ROWS ...] [--json FILE] [--replays N]
//                  [--mxfp8-dequantized]
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "moegraph/config.hpp"
#include "tools/bench/bench_util.hpp"
#include "tools/bench/ep_bench.hpp"
#include "tools/bench/kernel_bench.hpp"
#include "tools/bench/plan_report.hpp"
#include "tools/bench/shard_bench.hpp"
#include "tools/bench/step_bench.hpp"

namespace {

constexpr const char* kUsage =
    "usage: moegraph-bench [CONFIG.json] [--plan] [--json FILE] [--replays N] [--recipe bf16|mxfp8]\n"
    "                      [--mxfp8-dequantized] [--torch FILE] [--ops] [--expert-parallel R]\n"
    "       moegraph-bench --kernels [--quick | --set S | --shape NAME:G:K:N:ROWS ...] [--json FILE] [--replays N]\n"
    "                      [--mxfp8-dequantized]\n"
    "  CONFIG.json  layer, buckets, training and routing (docs/config.md); default: the built-in\n"
    "               Qwen3-30B-A3B-like preset\n"
    "  --plan       print each bucket's buffers, the kernels chosen and the device memory they take,\n"
    "               compared with the GPU's when there is one; needs no GPU\n"
    "  --json FILE  also write the results as JSON (scripts/plot-bench draws them); with --plan, the plan\n"
    "  --replays N  timed replays per measurement (default: the config's bench.replays)\n"
    "  --recipe R   override precision.recipe (mxfp8 training at row_align 1 or 16 uses row_align 32)\n"
    "  --mxfp8-dequantized  a config: set precision.dequantized_weights (mxfp8, bf16: the MXFP8 weights\n"
    "               also kept dequantized to bf16); --kernels: also MXFP8 fprop and dgrad on such\n"
    "               weights (columns dq ms, dq speed-up)\n"
    "  --torch FILE the same layer in PyTorch beside each bucket: columns \"torch ms\" (its graph replay)\n"
    "               and \"vs torch\" (torch ms / replay ms) from FILE, written by scripts/torch-moe-bench\n"
    "               --json FILE on the same config (name, layer with its bias, router, phase, buckets and\n"
    "               fill must match; a capacity_factor or step \"experts\" is not the PyTorch layer;\n"
    "               checked before the GPU is touched: exit 2 on a mismatch)\n"
    "  --ops        also each operator's time per phase (forward, backward, wgrad) and its share, per\n"
    "               bucket (whole-layer configs): eager, and inside replays of the captured eager step\n"
    "  --expert-parallel R  override parallel.expert_parallel. An expert-parallel config runs one process\n"
    "               per GPU: scripts/launch -n R -- moegraph-bench CONFIG; rank 0 prints the step and its\n"
    "               dispatch and combine against NCCL's all-to-all of the same bytes, eagerly and inside\n"
    "               graph replays (R = 1 given here: the same bench as a group of one)\n"
    "  A config with sharded weights (parallel.sharding.ranks W > 1) runs one process per GPU:\n"
    "               scripts/launch -n W -- moegraph-bench CONFIG; rank 0 prints the unsharded and sharded\n"
    "               steps, the gather and reduce against ncclAllGather / ncclReduceScatter of the same\n"
    "               bytes, and memory per rank. Without a launch: W emulated ranks on one GPU (plumbing)\n"
    "  --kernels    time the grouped fprop/dgrad/wgrad kernels alone against their roofline (dense\n"
    "               cuBLASLt rate and device-copy bandwidth, both measured in the same run)\n"
    "  --set S      kernel shapes: presets (default), quick, fine (60-256 experts of 40-500 rows) or all\n"
    "  --quick      the same as --set quick\n"
    "  --shape SPEC a shape of your own, NAME:GROUPS:K:N:ROWS (repeatable; instead of a set), e.g.\n"
    "               olmoe_fc1:64:2048:2048:16384\n";

int usage_error(const std::string& what) {
  std::fprintf(stderr, "moegraph-bench: %s\n%s", what.c_str(), kUsage);
  return 2;
}

// Why `path` cannot be written ("" when it can), found before any measurement runs rather than
// after it: the file is opened for appending (an existing one keeps its bytes), and only a file
// this check created is removed again: the file the name leads to (through links), never the name
// of a link; a file whose existence cannot be told counts as existing.
std::string unwritable_reason(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code exists_error;
  const bool existed = fs::exists(path, exists_error) || exists_error;  // follows links
  errno = 0;
  std::FILE* f = std::fopen(path.c_str(), "a");
  if (f == nullptr) return std::strerror(errno != 0 ? errno : EIO);
  std::fclose(f);
  if (!existed) {
    std::error_code resolve_error;
    const fs::path file = fs::canonical(path, resolve_error);  // the file just created, past any links
    if (!resolve_error) std::remove(file.c_str());
  }
  return "";
}

// A whole-number option value: digits only (strtol would also take spaces and a sign), in [lo, hi].
bool parse_count(const char* v, long lo, long hi, long& out) {
  const std::string s = v;
  if (s.empty() || s.size() > 9 || s.find_first_not_of("0123456789") != std::string::npos) return false;
  out = std::strtol(v, nullptr, 10);
  return out >= lo && out <= hi;
}

}  // namespace

int main(int argc, char** argv) {
  std::string config_path;
  bool plan = false, kernels = false;
  moegraph::bench::KernelBenchOptions kernel_options;
  std::vector<std::string> shape_specs;
  std::string recipe, torch_path;
  int expert_parallel = 0;  // --expert-parallel R: 0 keeps the config's
  moegraph::bench::StepBenchOptions options;
  std::set<std::string> given;  // options seen: each but --shape at most once (--quick is --set)
  bool config_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    // An option's value: present, not empty, and not the next option (`--json --plan` would write
    // the results to a file named --plan).
    auto value = [&](const char* flag) -> const char* {
      if (i + 1 >= argc) return usage_error(std::string(flag) + " needs a value"), nullptr;
      const std::string v = argv[i + 1];
      if (v.empty()) return usage_error(std::string(flag) + " needs a value, got an empty one"), nullptr;
      if (v.rfind("--", 0) == 0)
        return usage_error(std::string(flag) + " needs a value, got the option '" + v + "'"), nullptr;
      return argv[++i];
    };
    if (a.rfind("--", 0) == 0 && a != "--shape") {
      const std::string key = a == "--quick" ? "--set" : a;
      if (!given.insert(key).second)
        return usage_error(key == "--set" ? "--set and --quick choose one set: give one of them once"
                                          : a + " given twice");
    }
    if (a == "--help" || a == "-h") {
      std::printf("%s", kUsage);
      return 0;
    } else if (a == "--plan") {
      plan = true;
    } else if (a == "--ops") {
      options.ops = true;
    } else if (a == "--kernels") {
      kernels = true;
    } else if (a == "--mxfp8-dequantized") {
      kernel_options.mxfp8_dequantized = true;
    } else if (a == "--quick") {
      kernel_options.set = "quick";
    } else if (a == "--set") {
      const char* v = value("--set");
      if (!v) return 2;
      kernel_options.set = v;
      if (kernel_options.set != "presets" && kernel_options.set != "quick" && kernel_options.set != "fine" &&
          kernel_options.set != "all")
        return usage_error("--set must be presets, quick, fine or all, got '" + kernel_options.set + "'");
    } else if (a == "--shape") {
      const char* v = value("--shape");
      if (!v) return 2;
      shape_specs.push_back(v);
    } else if (a == "--json") {
      const char* v = value("--json");
      if (!v) return 2;
      options.json_path = v;
    } else if (a == "--recipe") {
      const char* v = value("--recipe");
      if (!v) return 2;
      recipe = v;
      if (recipe != "bf16" && recipe != "mxfp8") return usage_error("--recipe must be bf16 or mxfp8, got '" + recipe + "'");
    } else if (a == "--expert-parallel") {
      const char* v = value("--expert-parallel");
      if (!v) return 2;
      long n = 0;
      if (!parse_count(v, 1, 64, n)) return usage_error("--expert-parallel needs an integer in [1, 64], got '" + std::string(v) + "'");
      expert_parallel = static_cast<int>(n);
    } else if (a == "--torch") {
      const char* v = value("--torch");
      if (!v) return 2;
      torch_path = v;
    } else if (a == "--replays") {
      const char* v = value("--replays");
      if (!v) return 2;
      long n = 0;
      if (!parse_count(v, 1, moegraph::kMaxBenchReplays, n))
        return usage_error("--replays needs an integer in [1, " + std::to_string(moegraph::kMaxBenchReplays) + "], got '" +
                           std::string(v) + "'");
      options.replays = static_cast<int>(n);
    } else if (!a.empty() && a[0] == '-') {
      return usage_error("unknown option '" + a + "'");
    } else if (!config_given) {
      if (a.empty()) return usage_error("the config path is empty (leave it out for the built-in preset)");
      config_path = a, config_given = true;
    } else {
      return usage_error("more than one config given ('" + config_path + "', '" + a + "')");
    }
  }
  if (!options.json_path.empty())
    if (const std::string why = unwritable_reason(options.json_path); !why.empty())
      return usage_error("--json " + options.json_path + ": cannot write it (" + why + ")");
  try {
    if (kernels) {
      if (!torch_path.empty()) return usage_error("--torch goes with the step bench of a config, not --kernels");
      if (options.ops) return usage_error("--ops goes with the step bench of a config, not --kernels");
      // The kernel bench takes no config: what a config's options would change is not silently dropped.
      if (config_given) return usage_error("--kernels takes no config ('" + config_path + "'): its shapes come from --set or --shape");
      for (const char* step_only : {"--plan", "--recipe", "--expert-parallel"})
        if (given.count(step_only)) return usage_error(std::string(step_only) + " goes with a config's step, not --kernels");
      if (!shape_specs.empty() && given.count("--set"))
        return usage_error("--shape times its own shapes instead of a set: give --set (or --quick) or --shape, not both");
      std::set<std::string> names;
      for (const std::string& spec : shape_specs) {
        kernel_options.shapes.push_back(moegraph::bench::parse_kernel_shape(spec));
        if (!names.insert(kernel_options.shapes.back().name).second)
          return usage_error("--shape name '" + kernel_options.shapes.back().name + "' given twice");
      }
      kernel_options.json_path = options.json_path;
      kernel_options.replays = options.replays;
      return moegraph::bench::run_kernel_bench(kernel_options);
    }
    if (!shape_specs.empty() || kernel_options.set != "presets") return usage_error("--set, --quick and --shape go with --kernels");
    moegraph::Config config = config_path.empty() ? moegraph::default_config() : moegraph::load_config(config_path);
    if (!recipe.empty() && recipe != moegraph::recipe_name(config.precision.recipe)) {
      config.precision.recipe = recipe == "mxfp8" ? moegraph::Recipe::kMXFP8 : moegraph::Recipe::kBF16;
      if (recipe == "mxfp8" && config.training.enabled && config.row_align < 32) config.row_align = 32;
      config = moegraph::parse_config(moegraph::to_json(config), "--recipe " + recipe);  // the config's rules again
    }
    if (kernel_options.mxfp8_dequantized && !config.precision.dequantized_weights) {
      config.precision.dequantized_weights = true;
      config = moegraph::parse_config(moegraph::to_json(config), "--mxfp8-dequantized");  // needs mxfp8 and bf16
    }
    if (expert_parallel > 0) {
      config.parallel.expert_parallel = expert_parallel;
      config = moegraph::parse_config(moegraph::to_json(config), "--expert-parallel " + std::to_string(expert_parallel));
    }
    if (plan && !torch_path.empty()) return usage_error("--torch goes with the step bench, not --plan");
    if (plan && options.ops) return usage_error("--ops goes with the step bench, not --plan");
    if (plan && given.count("--replays")) return usage_error("--replays goes with the step bench, not --plan");
    if (plan) return moegraph::bench::run_plan(config, options.json_path);
    if (!torch_path.empty() && config.parallel.expert_parallel == 1 && expert_parallel == 0) {  // before the GPU: a wrong file fails at once, with or without one
      try {
        options.torch = moegraph::bench::load_torch_results(torch_path, config);
      } catch (const moegraph::Error& e) {
        std::fprintf(stderr, "moegraph-bench: --torch: %s\n", e.message().c_str());
        return 2;
      }
    }
    if (config.parallel.sharding.ranks > 1) {
      if (options.ops) return usage_error("--ops: a sharded config times its gather and reduce itself");
      if (!torch_path.empty()) return usage_error("--torch goes with the single-GPU step bench");
      if (config.parallel.expert_parallel > 1)
        return usage_error("a config with both parallel.sharding.ranks and parallel.expert_parallel above 1 runs in "
                           "the library (docs/sharding.md), but this bench times one group: set one of them to 1");
      return moegraph::bench::run_shard_bench(config, options);
    }
    if (config.parallel.expert_parallel > 1 || expert_parallel > 0) {  // --expert-parallel 1: a group of one
      if (options.ops) return usage_error("--ops: an expert-parallel config always times its dispatch and combine");
      if (!torch_path.empty()) return usage_error("--torch: the PyTorch EP layer is scripts/torch-ep-bench's own table");
      return moegraph::bench::run_ep_bench(config, options);
    }
    return moegraph::bench::run_step_bench(config, options);
  } catch (const moegraph::ConfigError& e) {
    std::fprintf(stderr, "moegraph-bench: invalid config: %s\n", e.message().c_str());
    return 2;
  } catch (const moegraph::Error& e) {
    std::fprintf(stderr, "moegraph-bench: %s\n", e.message().c_str());
    if (e.kind() == moegraph::ErrorKind::kNoDevice || e.kind() == moegraph::ErrorKind::kUnsupportedDevice)
      std::fprintf(stderr, "moegraph-bench: --plan prints a config's buffers, kernels and device memory without a GPU\n");
    return e.kind() == moegraph::ErrorKind::kInvalidArgument ? 2 : 1;
  } catch (const std::exception& e) {  // out of memory and the like: a reason, never an abort
    std::fprintf(stderr, "moegraph-bench: %s\n", e.what());
    return 2;
  }
}
