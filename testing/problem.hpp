// One grouped-linear problem: host data (fp64, rounded to the device type), the matching device
// buffers, the operator, and each device output next to its fp64 reference. The checks return
// results; the caller reports them (gtest expectations, moegraph-check lines).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "moegraph/grouped_linear.hpp"
#include "testing/data.hpp"
#include "testing/device_array.hpp"

namespace moegraph::testing {

struct CaseSpec {
  std::string name;
  int groups = 8;
  int64_t k = 256, n = 256;
  DType dtype = DType::kBF16;
  int row_align = 1;
  std::vector<int32_t> splits;  // explicit; empty: random splits of `rows`
  int64_t rows = 0;
  Routing routing = Routing::kUniform;
  int64_t capacity_extra = 0;   // padding rows past the last group (0: capacity exactly full)
  bool bias = false, scale = false, main_grad = false, delay_wgrad = false;
  int wgrad_slots = 1;
  bool caller_keeps_activations = false;  // bf16: the operator keeps pointers to x, s and dy, no copies
  bool forward_only = false;              // the operator serves forward() only (no slots)
  bool reference_kernels = false;  // the WMMA reference kernels instead of wgmma
  int tile_n = 0;                  // wgmma tile width (0: the heuristic's choice)
  GemmPipeline pipeline = GemmPipeline::kAuto;  // 16-bit wgmma operand loads
  int wgrad_ping_pong = -1;        // TMA wgrad with ping-pong consumers (-1: the heuristic's choice)
  // Tolerance of the GEMM outputs in `dtype` (y, dx, dweight; default: the recipe's, see below).
  // The bias gradients keep the table's row, and main_grad (fp32) the fp32 row, or under kMXFP8
  // mxfp8_gemm_tolerance() (case_tolerance).
  std::optional<Tolerance> tolerance = std::nullopt;
  // kMXFP8: the GEMMs read MXFP8 copies (docs/mxfp8.md), and so do their references: x, dy and W
  // quantized as the device does (only data rows; gap and padding rows count as zero) and
  // dequantized exactly. Needs K, N multiples of 128 and row_align 32 or 128. The GEMM outputs
  // (y, dx, dweight, main_grad) are then checked with mxfp8_gemm_tolerance() unless `tolerance`
  // is set; the bias gradients read the unquantized dy and keep their usual tolerance.
  Recipe recipe = Recipe::kBF16;
};

// Rows of every grouped buffer of a problem with `rows` rows of data: the worst aligned layout of
// any routing of those rows, plus `extra` padding rows. With extra = 0 and row_align = 1 the
// buffer is exactly full.
int64_t capacity_rows_for(int64_t rows, int groups, int row_align, int64_t extra);

// The tolerance a case checks an output of type `output` with: a GEMM's (y, dx, dweight, main_grad)
// is the case's override when the output is in its dtype, else the recipe's (mxfp8_gemm_tolerance()
// under kMXFP8, the table's row otherwise); any other output's (dbias, dbias_scale) is the table's.
Tolerance case_tolerance(const CaseSpec& spec, bool gemm_output, DType output);

// The outputs a check covers, by the computation that writes them.
enum class OutputSet { kForward, kDgrad, kBiasGrads, kWgrad };

// One device output next to its fp64 reference.
struct Output {
  std::string name;            // y, dx, dbias, dbias_scale, dweight or main_grad
  std::vector<int64_t> shape;  // row-major
  std::vector<double> got;     // downloaded from the device
  const Mat* ref = nullptr;    // owned by the Problem: valid until its next reroute
  std::vector<bool> rows;      // rows compared (a row is shape.back() wide, or 1 for 1-D); empty: all
  Tolerance tol;
};
CompareResult compare(const Output& output, const std::string& where);

class Problem {
 public:
  Problem(const CaseSpec& spec, uint64_t seed);

  // New routing (same total rows, so it fits the capacity) and new inputs, uploaded.
  void reroute(const std::vector<int32_t>& splits);
  void reroute_random();
  void poison_outputs();
  // main_grad back to its initial value: wgrad accumulates into it, so each run needs a fresh start.
  void restore_main_grad();

  ForwardArgs forward_args() const;
  BackwardArgs backward_args() const;

  // The device outputs of `set` next to their references (computed once per routing). Bias
  // gradients are empty without a bias; dbias_scale is there only with a bias scale.
  std::vector<Output> outputs(OutputSet set) const;
  // Each output of `set` against the fp64 reference: one result per output, named `where` + name.
  std::vector<CompareResult> check(OutputSet set, const std::string& where) const;

  std::vector<double> download(const DeviceArray<uint16_t>& a) const;
  // `w` to the device (and, with the MXFP8 recipe, the operator's quantized copies of it): call it
  // after changing w. Drops the cached references.
  void upload_weights();

  CaseSpec spec;
  GroupLayout layout;
  std::mt19937_64 rng;
  std::vector<double> x, w, b, s, dy, main_grad_init;
  DeviceArray<int32_t> d_splits;
  DeviceArray<uint16_t> d_x, d_w, d_b, d_y, d_dy, d_dx, d_db, d_dw;
  DeviceArray<float> d_s, d_ds, d_main_grad;
  std::unique_ptr<GroupedLinear> op;

 private:
  // The operands the GEMMs of the recipe read, as fp64 matrices in the layout of x, dy and w:
  // the inputs themselves (bf16 recipe) or their MXFP8 copies dequantized exactly.
  enum class Operand { kFpropX, kFpropW, kDgradDy, kDgradW, kWgradDy, kWgradX };
  const Mat& operand(Operand which) const;
  const Mat& reference(const std::string& name, const std::function<Mat()>& compute) const;
  Tolerance tolerance(DType output) const;       // dbias, dbias_scale: the table's row
  Tolerance gemm_tolerance(DType output) const;  // y, dx, dweight, main_grad: the case's override or the recipe's

  mutable std::map<std::string, Mat> references_;  // by output name (and MXFP8 operand), for the current routing
};

// Every output set, in the order a training step writes them.
inline constexpr OutputSet kAllOutputSets[] = {OutputSet::kForward, OutputSet::kDgrad, OutputSet::kBiasGrads,
                                               OutputSet::kWgrad};

std::vector<double> to_doubles(const std::vector<float>& v);

}  // namespace moegraph::testing
