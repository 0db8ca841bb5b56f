// --dump for moe_layer cases: the inputs, the device outputs and the fp64 references of one run of a
// case (the failing one, or the passing run of the most tokens) as .npy files, and case.json with the layer's settings, so a failure can be examined in
// NumPy and scripts/torch-moe-crosscheck can rebuild the layer in PyTorch, without a rerun.
#include <fstream>
#include <string>
#include <vector>

#include "moegraph/error.hpp"
#include "tools/check/moe_layer_case.hpp"
#include "tools/check/npy.hpp"

namespace moegraph::check {
namespace {

std::vector<float> as_float32(const testing::Mat& v) { return {v.begin(), v.end()}; }

bool is_weight_gradient(const std::string& name) {
  return name == "d_router_weight" || name == "dw1" || name == "dw2";
}

const char* kReadme = R"(Load the arrays with NumPy:

    import pathlib, numpy as np
    d = {p.stem: np.load(p) for p in pathlib.Path(".").glob("*.npy")}  # from this folder
    y_err = d["y"] - d["ref_y"]

Cross-check against PyTorch autograd (float64) on these inputs:

    scripts/torch-moe-crosscheck DIR...

Inputs, rounded to the layer's dtype (exact in float32); n = case.json "tokens":
  x [n, hidden], dy [n, hidden] (the loss is sum(y * dy) + aux_loss), router_weight [E, hidden],
  w1 [E, 2 * ffn, hidden] (rows: gate, then up), w2 [E, hidden, ffn], b1 [E, 2 * ffn] and
  b2 [E, hidden] (with bias). On the device, rows n .. max_tokens - 1 of x and dy held NaN.
Device outputs, as far as the step wrote them: y [n, hidden], aux_loss [1] (with an aux loss),
  dx [n, hidden], d_router_weight [E, hidden], dw1, dw2, db1, db2 (the parameters' shapes). Float32,
  except that with "wgrad": "main_grad" the weight gradients are float64: main_grad after the step
  minus its value before. NaN marks an element the step never wrote (outputs are poisoned first).
References (float64, from moegraph's fp64 layer reference, which rounds the intermediates the
  device stores and, with case.json "recipe": "mxfp8", runs FC1 and FC2 on the MXFP8 copies of their
  operands as the device does): the same names with "ref_" in front.
case.json: the layer, the router settings, the run, the dropped assignment counts (device and
  reference), the outputs the run wrote and checked with their tolerances, and the case as written.
An element passes when |got - ref| <= rtol * |ref| + atol * rms(ref), and each output's
  ||got - ref|| / ||ref|| <= rel_fro.
)";

}  // namespace

void dump_moe_layer(const MoeLayerCase& c, const MoeLayerParams& params, const MoeLayerRun& run, bool passed,
                    const std::filesystem::path& dir) {
  prepare_dump_dir(dir);

  const int64_t n = run.tokens, e = c.experts, h = c.hidden, f = c.ffn;
  write_npy(dir / "x.npy", as_float32(run.x), {n, h});
  if (run.backward) write_npy(dir / "dy.npy", as_float32(run.dy), {n, h});
  write_npy(dir / "router_weight.npy", as_float32(params.router), {e, h});
  write_npy(dir / "w1.npy", as_float32(params.w1), {e, 2 * f, h});
  write_npy(dir / "w2.npy", as_float32(params.w2), {e, h, f});
  if (c.bias) {
    write_npy(dir / "b1.npy", as_float32(params.b1), {e, 2 * f});
    write_npy(dir / "b2.npy", as_float32(params.b2), {e, h});
  }

  Json written = Json::array(), checked = Json::array(), tolerances = Json::object();
  for (const MoeLayerOutput& o : run.outputs) {
    if (c.main_grad && is_weight_gradient(o.name)) write_npy(dir / (o.name + ".npy"), o.got, o.shape);
    else write_npy(dir / (o.name + ".npy"), as_float32(o.got), o.shape);
    write_npy(dir / ("ref_" + o.name + ".npy"), o.ref, o.shape);
    written.push_back(o.name);
    if (o.checked) checked.push_back(o.name);
    tolerances[o.name] = {{"rtol", o.tol.rtol}, {"atol", o.tol.atol}, {"rel_fro", o.tol.rel_fro}};
  }

  Json info = Json::object();
  info["op"] = "moe_layer";  // what scripts/torch-moe-crosscheck reads
  info["name"] = c.name;
  info["experts"] = c.experts;
  info["hidden"] = c.hidden;
  info["ffn"] = c.ffn;
  info["top_k"] = c.top_k;
  info["bias"] = c.bias;
  info["row_align"] = c.row_align;
  info["max_tokens"] = c.max_tokens;
  info["tokens"] = n;
  info["dtype"] = std::string(dtype_name(c.dtype));
  info["recipe"] = std::string(recipe_name(c.recipe));
  info["wgrad"] = c.main_grad ? "main_grad" : std::string(dtype_name(c.dtype));
  info["router"] = {{"score", c.score == RouterScore::kSigmoid ? "sigmoid" : "softmax"},
                    {"renormalize", c.renormalize},
                    {"aux_loss_coef", c.aux_loss_coef},
                    {"capacity_factor", c.capacity_factor},
                    {"fuse_weights", c.fuse_weights}};
  info["run"] = run.label;
  info["passed"] = passed;
  info["dropped"] = run.dropped_read ? Json(run.dropped) : Json(nullptr);
  info["ref_dropped"] = run.dropped_read ? Json(run.ref_dropped) : Json(nullptr);
  info["outputs"] = written;
  info["checked"] = checked;
  info["tolerance"] = tolerances;
  info["case"] = Json::parse(c.json);
  std::ofstream(dir / "case.json") << info.dump(2) << "\n";

  std::ofstream readme(dir / "README.txt");
  readme << "moegraph-check dump of case '" << c.name << "': " << (passed ? "the passing run of the most tokens, " : "the failing run, ")
         << run.label << ".\n\n"
         << kReadme;
  MG_CHECK(readme.good(), "error writing ", (dir / "README.txt").string());
}

}  // namespace moegraph::check
