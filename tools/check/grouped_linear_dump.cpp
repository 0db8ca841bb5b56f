// --dump for grouped_linear cases: the inputs, the device outputs and the fp64 references of one
// step as .npy files, so a failure can be examined in NumPy without rerunning on a GPU.
#include <fstream>
#include <string>
#include <vector>

#include "moegraph/error.hpp"
#include "tools/check/grouped_linear_case.hpp"
#include "tools/check/npy.hpp"

namespace moegraph::check {
namespace {

using testing::OutputSet;

std::vector<float> as_float32(const std::vector<double>& v) { return {v.begin(), v.end()}; }

const char* kReadme = R"(Load the arrays with NumPy:

    import pathlib, numpy as np
    d = {p.stem: np.load(p) for p in pathlib.Path(".").glob("*.npy")}  # from this folder
    y_err = d["y"] - d["y_ref"]

Inputs, rounded to the layer's dtype (exact in float32):
  x [rows, K], dy [rows, N], w [G, N, K], b [G, N] (with a bias), scale [rows] (with a bias
  scale), main_grad_init [G, N, K] (with main_grad: the value wgrad accumulated into).
  Gap and padding rows of x and dy are zero here; on the device they held random values.
Routing: splits [G] int32 and offsets [G + 1] int64; group e owns rows offsets[e] .. offsets[e] + splits[e] - 1.
Device outputs (float32): y, dx, dbias, dbias_scale, and dweight or main_grad, as far as the
  step wrote them. NaN marks an element the step never wrote (outputs are poisoned first).
References (float64): the same names with "_ref".
Checked: y, dx and dbias_scale on rows < offsets[G] (padding rows past the last group are never
  written); dbias, dweight and main_grad everywhere. An element passes when
  |got - ref| <= rtol * |ref| + atol * rms(ref), and each output's ||got - ref|| / ||ref|| <= rel_fro:
)";

}  // namespace

void dump_grouped_linear(const testing::Problem& p, CaseStep last_step, const std::string& run_label,
                         const std::string& case_json, const std::filesystem::path& dir) {
  prepare_dump_dir(dir);
  const int64_t rows = p.layout.capacity_rows, g = p.spec.groups, n = p.spec.n, k = p.spec.k;
  write_npy(dir / "x.npy", as_float32(p.x), {rows, k});
  write_npy(dir / "dy.npy", as_float32(p.dy), {rows, n});
  write_npy(dir / "w.npy", as_float32(p.w), {g, n, k});
  if (p.spec.bias) write_npy(dir / "b.npy", as_float32(p.b), {g, n});
  if (p.spec.scale) write_npy(dir / "scale.npy", as_float32(p.s), {rows});
  if (p.spec.main_grad) write_npy(dir / "main_grad_init.npy", as_float32(p.main_grad_init), {g, n, k});
  write_npy(dir / "splits.npy", p.layout.splits, {g});
  write_npy(dir / "offsets.npy", p.layout.offsets, {g + 1});

  std::vector<OutputSet> written{OutputSet::kForward};
  if (last_step != CaseStep::kInference)
    written.insert(written.end(), {OutputSet::kDgrad, OutputSet::kBiasGrads, OutputSet::kWgrad});
  std::string tolerances;
  for (OutputSet set : written)
    for (const testing::Output& output : p.outputs(set)) {
      write_npy(dir / (output.name + ".npy"), as_float32(output.got), output.shape);
      write_npy(dir / (output.name + "_ref.npy"), *output.ref, output.shape);
      tolerances += detail::concat("  ", output.name, ": rtol ", output.tol.rtol, ", atol ", output.tol.atol,
                                   ", rel_fro ", output.tol.rel_fro, "\n");
    }

  std::ofstream(dir / "case.json") << case_json << "\n";
  std::ofstream readme(dir / "README.txt");
  readme << "moegraph-check dump of case '" << p.spec.name << "': " << run_label << ".\n\n"
         << kReadme << tolerances << "case.json is the case as written in its case file.\n";
  MG_CHECK(readme.good(), "error writing ", (dir / "README.txt").string());
}

}  // namespace moegraph::check
