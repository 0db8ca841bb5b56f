// The "moe_layer" op of moegraph-check: a whole MoeLayer (router, dispatch, SwiGLU experts,
// combine, and backward through all of it) run step by step on the eager path, then as captured
// CUDA graphs replayed over a list of token counts with fresh data, so one capture is shown to
// serve every count; each run is checked against the fp64 layer reference (ref_moe_layer).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "moegraph/moe_layer.hpp"
#include "testing/data.hpp"
#include "tools/check/case_json.hpp"
#include "tools/check/case_runner.hpp"

namespace moegraph::check {

struct MoeLayerCase {
  std::string name;
  int experts = 0;
  int64_t hidden = 0, ffn = 0;
  int top_k = 1;
  bool bias = false;
  int row_align = 1;
  int64_t max_tokens = 0;
  std::vector<int64_t> tokens;  // the token counts of the runs, each in [0, max_tokens]
  RouterScore score = RouterScore::kSoftmax;
  bool renormalize = false;
  double aux_loss_coef = 0.0;
  double capacity_factor = 0.0;
  bool fuse_weights = false;
  DType dtype = DType::kBF16;
  Recipe recipe = Recipe::kBF16;  // kMXFP8: FC1 and FC2 on MXFP8 copies, and so does the reference
  bool dequantized_weights = false;  // kMXFP8, bf16: the MXFP8 weights also kept dequantized to bf16
  bool main_grad = false;  // weight gradients accumulate into fp32 main_grad (else written in dtype)
  PhaseSet phases;
  int replays = 3;                             // graph replays of every token count
  std::optional<testing::Tolerance> tolerance;  // default: layer_tolerance_for(dtype, recipe)
  uint64_t data_seed = 0;
  std::string json;  // the case as written, for dumps

  bool training() const { return phases.training(); }
};

// The layer options of a case; `delay_wgrad` picks the layer whose backward queues the weight
// gradients (the wgrad_delayed step runs on a second layer sharing the weights and gradients).
MoeLayerOptions moe_layer_options(const MoeLayerCase& c, bool delay_wgrad);

// Reads a case object (its name and op already checked by the caller); throws ConfigError.
std::unique_ptr<CaseRunner> parse_moe_layer_case(const Json& value, const std::string& name);

class MoeLayerRunner final : public CaseRunner {
 public:
  explicit MoeLayerRunner(MoeLayerCase c) : CaseRunner(c.name), case_(std::move(c)) {}
  CaseOutcome run(const RunSettings& settings) override;

 private:
  MoeLayerCase case_;
};

// ---- What a run leaves for --dump -----------------------------------------------------------------

// Host copies of the parameters, rounded to the dtype (exact in float32).
struct MoeLayerParams {
  testing::Mat router;  // [E, hidden]
  testing::Mat w1;      // [E, 2 * ffn, hidden]
  testing::Mat b1;      // [E, 2 * ffn] (with bias)
  testing::Mat w2;      // [E, hidden, ffn]
  testing::Mat b2;      // [E, hidden] (with bias)
};

// One output of a step next to its fp64 reference. With main_grad the weight gradients are the
// step's increment: main_grad after the step minus its value before.
struct MoeLayerOutput {
  std::string name;  // y, aux_loss, dx, d_router_weight, dw1, dw2, db1, db2
  std::vector<int64_t> shape;
  testing::Mat got, ref;
  testing::Tolerance tol;
  bool checked = false;  // the case's phases asked for it (else written by the step, not compared)
};

// One run of a case (for --dump): its token count, inputs (rows < n) and every output the step wrote.
struct MoeLayerRun {
  std::string label;  // e.g. "graph replay 2 of forward_train+backward, 96 tokens"
  int64_t tokens = 0;
  bool backward = false;  // the step ran a backward (dy is an input)
  testing::Mat x, dy;      // [n, hidden]
  std::vector<MoeLayerOutput> outputs;
  uint64_t dropped = 0, ref_dropped = 0;  // capacity-factor drops of the step: device, reference
  bool dropped_read = false;              // the step finished and read_dropped() was called
};

// Writes the inputs, outputs and references of `run` as .npy files, case.json and README.txt.
void dump_moe_layer(const MoeLayerCase& c, const MoeLayerParams& params, const MoeLayerRun& run, bool passed,
                    const std::filesystem::path& dir);

}  // namespace moegraph::check
