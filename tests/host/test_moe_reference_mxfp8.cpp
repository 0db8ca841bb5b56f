// The mxfp8 recipe of the fp64 MoE-layer reference (MoeLayerInputs::recipe): the layer restated
// with its GEMM operands quantized here by hand, block by block and group by group, from the
// format's primitives (testing/mxfp8_reference.hpp) rather than testing/mxfp8_operands, which the
// reference uses; column-wise blocks that stay inside their group; the recipe changing results at
// the format's level, and only where the device quantizes; values MXFP8 holds exactly passing
// through unchanged; the bf16 recipe reading the tensors themselves; the recipe's shape rules.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "moegraph/error.hpp"
#include "testing/moe_layer_reference.hpp"
#include "testing/mxfp8_operands.hpp"
#include "testing/mxfp8_reference.hpp"
#include "tests/common/expect.hpp"

namespace moegraph::test {
namespace {

constexpr DType kT = DType::kBF16;

// ---- Quantizing by hand: each block's elements replaced in place by their MXFP8 values ----------

double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

// e4m3 * 2^(scale - 127) for each element of one block (exact in fp64), through pointers.
void quantize_in_place(const std::vector<double*>& block) {
  std::vector<double> values;
  for (const double* v : block) values.push_back(*v);
  std::vector<uint8_t> codes(values.size());
  const double scale = e8m0_decode(mx_quantize_block(values, codes));
  for (std::size_t i = 0; i < block.size(); ++i) *block[i] = e4m3_decode(codes[i]) * scale;
}

// Every row of m [rows, cols] in blocks of 32 consecutive columns (fprop's x and W, dgrad's dy).
Mat by_rows(Mat m, int64_t cols) {
  const int64_t rows = static_cast<int64_t>(m.size()) / cols;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c0 = 0; c0 < cols; c0 += kMxBlockSize) {
      std::vector<double*> block;
      for (int64_t c = c0; c < c0 + kMxBlockSize; ++c) block.push_back(&m[r * cols + c]);
      quantize_in_place(block);
    }
  return m;
}

// Group by group (wgrad's dy and x): blocks of 32 rows of one column from the group's first row,
// the last one ending with the group. Rows outside every group are left alone (zero in the layer).
Mat by_group_columns(const GroupLayout& l, Mat m, int64_t cols) {
  for (int e = 0; e < l.groups(); ++e) {
    const int64_t first = l.offsets[e], end = first + l.splits[e];
    for (int64_t c = 0; c < cols; ++c)
      for (int64_t r0 = first; r0 < end; r0 += kMxBlockSize) {
        std::vector<double*> block;
        for (int64_t r = r0; r < std::min(end, r0 + kMxBlockSize); ++r) block.push_back(&m[r * cols + c]);
        quantize_in_place(block);
      }
  }
  return m;
}

// W [E, n, k] as dgrad reads it (W_e^T row-wise): for each expert and k index, blocks of 32 n.
Mat by_weight_columns(Mat w, int experts, int64_t n, int64_t k) {
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t i = 0; i < k; ++i)
      for (int64_t j0 = 0; j0 < n; j0 += kMxBlockSize) {
        std::vector<double*> block;
        for (int64_t j = j0; j < j0 + kMxBlockSize; ++j) block.push_back(&w[(e * n + j) * k + i]);
        quantize_in_place(block);
      }
  return w;
}

Mat store(Mat m) {
  for (double& v : m) v = round_to(v, kT);
  return m;
}

// Equal up to fp64 reassociation (the restatements below repeat the reference's order of
// operations on the same values, so they are in fact bit-identical).
void expect_same_math(const Mat& got, const Mat& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 1.0;
  for (double v : want) scale = std::max(scale, std::fabs(v));
  std::size_t bad = 0;
  for (std::size_t i = 0; i < want.size(); ++i)
    if (!(std::fabs(got[i] - want[i]) <= 1e-12 * scale) && bad++ == 0)
      ADD_FAILURE() << what << "[" << i << "]: " << got[i] << " vs " << want[i];
  EXPECT_EQ(bad, 0u) << what << ": elements that differ";
}

// ---- Layers ----------------------------------------------------------------------------------------

int64_t capacity_for(int64_t assignments, int experts, int row_align) {
  const int64_t worst = assignments + int64_t{experts} * (row_align - 1);
  return (worst + row_align - 1) / row_align * row_align;
}

// One layer's parameters and data (bf16 values), owned here; inputs() points into them.
struct LayerData {
  int64_t n, h, f;
  int experts, top_k;
  Mat x, wr, w1, b1, w2, b2, dy;

  MoeLayerInputs inputs(Recipe recipe, bool fuse_weights = false) const {
    MoeLayerInputs in;
    in.x = &x, in.wr = &wr, in.w1 = &w1, in.b1 = &b1, in.w2 = &w2, in.b2 = &b2, in.dy = &dy;
    in.tokens = n, in.hidden = h, in.ffn = f;
    in.capacity_rows = capacity_for(n * top_k, experts, 32);
    in.router = RouterSpec{.experts = experts, .top_k = top_k, .renormalize = true, .row_align = 32};
    in.fuse_weights = fuse_weights;
    in.dtype = kT;
    in.recipe = recipe;
    return in;
  }
};

LayerData random_layer(std::mt19937_64& rng, int64_t n, int experts, int top_k, int64_t h, int64_t f) {
  LayerData d{n, h, f, experts, top_k, {}, {}, {}, {}, {}, {}, {}};
  d.x = random_values(rng, n * h, 1.0, kT);
  d.wr = random_values(rng, experts * h, 1.0, kT);
  d.w1 = random_values(rng, experts * 2 * f * h, 0.5, kT);
  d.w2 = random_values(rng, experts * h * f, 0.5, kT);
  d.b1 = random_values(rng, experts * 2 * f, 0.3, kT);
  d.b2 = random_values(rng, experts * h, 0.3, kT);
  d.dy = random_values(rng, n * h, 1.0, kT);
  return d;
}

// Rows of m [., cols] scaled by 1, 2^-8, 2^-16 in turn (exact in bf16). Within a block of like
// magnitudes E4M3 keeps 4 significant bits whatever the block's scale, so only blocks that mix
// magnitudes tell the layouts apart: a block along the columns keeps a row's small values, a block
// across these rows pushes them to E4M3's subnormals or to zero.
Mat spread_rows(Mat m, int64_t cols) {
  for (std::size_t i = 0; i < m.size(); ++i) m[i] = std::ldexp(m[i], -8 * static_cast<int>(i / cols % 3));
  return m;
}

// The whole mxfp8 layer, forward and backward, restated with the operator references on operands
// quantized by hand: FC1 and FC2 fprop on row-wise x and W (blocks along K), dgrad on row-wise dy
// (along N) and W_e^T (along N), wgrad on dy and x in column blocks of each group; the bias
// gradients, SwiGLU, the combine and the router on the unquantized values. Tokens and weight rows
// of three magnitudes make each layout's blocks matter (spread_rows).
TEST(MoeLayerReferenceMxfp8, IsTheLayerOnOperandsQuantizedByHand) {
  std::mt19937_64 rng(test_seed("MoeLayerReferenceMxfp8.IsTheLayerOnOperandsQuantizedByHand"));
  constexpr int64_t n = 80, h = 64, f = 32;
  constexpr int E = 4, k = 2;
  LayerData data = random_layer(rng, n, E, k, h, f);
  data.x = spread_rows(data.x, h);
  data.dy = spread_rows(data.dy, h);
  data.w1 = spread_rows(data.w1, h);
  data.w2 = spread_rows(data.w2, f);
  // The layouts differ on this data (else the restatement below could not tell them apart).
  ASSERT_NE(mx_weight_values(data.w1, E, 2 * f, h, false), mx_weight_values(data.w1, E, 2 * f, h, true));
  ASSERT_NE(mx_weight_values(data.w2, E, h, f, false), mx_weight_values(data.w2, E, h, f, true));
  const MoeLayerInputs in = data.inputs(Recipe::kMXFP8);
  const MoeLayerRef layer = ref_moe_layer(in);
  const DispatchRef& d = layer.dispatch;
  const GroupLayout& l = d.layout;
  const int64_t rows = in.capacity_rows;
  // Column blocks that end inside a group and groups of more than one block, so the group-wise
  // blocking is exercised (160 assignments over 4 experts: about 40 rows each).
  ASSERT_GT(*std::max_element(l.splits.begin(), l.splits.end()), kMxBlockSize);
  ASSERT_TRUE(std::any_of(l.splits.begin(), l.splits.end(), [](int32_t s) { return s % kMxBlockSize != 0; }));

  const Mat px = ref_permute(d, data.x, h);
  const Mat h1 = store(ref_fprop(l, by_rows(px, h), by_rows(data.w1, h), data.b1, {}, 2 * f, h));
  expect_same_math(layer.h1, h1, "h1");
  Mat a(rows * f, 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < f; ++j) {
      const double gate = h1[r * 2 * f + j], up = h1[r * 2 * f + f + j];
      a[r * f + j] = round_to(gate * sigmoid(gate) * up, kT);
    }
  expect_same_math(layer.a, a, "a");
  const Mat out = store(ref_fprop(l, by_rows(a, f), by_rows(data.w2, f), data.b2, {}, h, f));
  expect_same_math(layer.expert_out, out, "expert_out");
  expect_same_math(layer.y, store(ref_combine(d, out, layer.router.topk_weights, n, k, h)), "y");

  Mat d_out(rows * h, 0.0);  // the combine backward: w_r dy[t_r], stored
  for (int64_t r = 0; r < rows; ++r)
    if (const int32_t t = d.token_of_row[r]; t >= 0)
      for (int64_t c = 0; c < h; ++c) d_out[r * h + c] = round_to(d.row_weight[r] * data.dy[t * h + c], kT);
  const Mat da = store(ref_dgrad(l, by_rows(d_out, h), by_weight_columns(data.w2, E, h, f), h, f));
  expect_same_math(layer.da, da, "da");
  expect_same_math(layer.dw2, ref_wgrad(l, by_group_columns(l, d_out, h), by_group_columns(l, a, f), h, f), "dw2");
  expect_same_math(layer.db2, ref_bias_grad(l, d_out, {}, h), "db2 (on the unquantized gradient)");
  Mat dh1(rows * 2 * f, 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < f; ++j) {
      const double gate = h1[r * 2 * f + j], up = h1[r * 2 * f + f + j], g = da[r * f + j];
      const double s = sigmoid(gate);
      dh1[r * 2 * f + j] = round_to(g * up * s * (1.0 + gate * (1.0 - s)), kT);
      dh1[r * 2 * f + f + j] = round_to(g * gate * s, kT);
    }
  expect_same_math(layer.dh1, dh1, "dh1");
  expect_same_math(layer.dw1, ref_wgrad(l, by_group_columns(l, dh1, 2 * f), by_group_columns(l, px, h), 2 * f, h),
                   "dw1");
  expect_same_math(layer.db1, ref_bias_grad(l, dh1, {}, 2 * f), "db1 (on the unquantized gradient)");

  // dx = stored(d_logits W_r + stored(sum_j the stored FC1 input gradient of (t, j))); the router's
  // gradient reads the stored expert outputs, unquantized.
  Mat d_topk(n * k, 0.0);
  for (int64_t i = 0; i < n * k; ++i)
    if (const int32_t row = d.row_of[i]; row >= 0)
      for (int64_t c = 0; c < h; ++c) d_topk[i] += data.dy[(i / k) * h + c] * out[row * h + c];
  const Mat d_logits = store(ref_router_backward(layer.router, d_topk, in.router));
  expect_same_math(layer.d_logits, d_logits, "d_logits");
  const Mat d_perm = store(ref_dgrad(l, by_rows(dh1, 2 * f), by_weight_columns(data.w1, E, 2 * f, h), 2 * f, h));
  Mat dx(n * h, 0.0);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < h; ++c) {
      double router = 0.0, experts = 0.0;
      for (int e = 0; e < E; ++e) router += d_logits[t * E + e] * data.wr[e * h + c];
      for (int j = 0; j < k; ++j)
        if (const int32_t row = d.row_of[t * k + j]; row >= 0) experts += d_perm[row * h + c];
      dx[t * h + c] = round_to(router + round_to(experts, kT), kT);
    }
  expect_same_math(layer.dx, dx, "dx");
}

// Column-wise blocks of the aligned layout are the blocks of each group: with groups whose values
// differ by 2^20 (more than E4M3 spans, 2^17.8), a block shared by two groups would flush the
// smaller group's values.
TEST(MoeLayerReferenceMxfp8, ColumnBlocksStayInsideTheirGroup) {
  std::mt19937_64 rng(test_seed("MoeLayerReferenceMxfp8.ColumnBlocksStayInsideTheirGroup"));
  constexpr int64_t cols = 32;
  const std::vector<int32_t> splits{3, 45, 0, 33, 1};
  const GroupLayout l = make_layout(splits, 32, 256);
  Mat m(l.capacity_rows * cols, 0.0);  // zero outside the groups, as the layer's buffers
  for (int e = 0; e < l.groups(); ++e) {
    const Mat values = random_values(rng, splits[e] * cols, std::ldexp(1.0, 20 * e - 40), kT);
    std::copy(values.begin(), values.end(), m.begin() + l.offsets[e] * cols);
  }
  const Mat per_group = by_group_columns(l, m, cols);
  EXPECT_EQ(mx_colwise_values(l, m, cols), per_group);
  GemmOperands operands(Recipe::kMXFP8, l);
  EXPECT_EQ(operands.colwise(m, cols), per_group);

  // The check can fail: blocks over the data rows packed without their gaps straddle groups.
  const int64_t used = 82;
  Mat packed;
  for (int e = 0; e < l.groups(); ++e)
    packed.insert(packed.end(), m.begin() + l.offsets[e] * cols, m.begin() + (l.offsets[e] + splits[e]) * cols);
  packed.resize(96 * cols, 0.0);
  const Mat straddling = by_group_columns(make_layout({static_cast<int32_t>(used)}, 32, 96), packed, cols);
  Mat unpacked(m.size(), 0.0);
  int64_t at = 0;
  for (int e = 0; e < l.groups(); ++e)
    for (int64_t r = 0; r < splits[e]; ++r, ++at)
      std::copy_n(&straddling[at * cols], cols, &unpacked[(l.offsets[e] + r) * cols]);
  EXPECT_NE(unpacked, per_group);

  // Groups that do not start on a multiple of 32 (row_align 16) have no column-wise copy.
  EXPECT_THROW(mx_colwise_values(make_layout({3, 45}, 16, 256), m, cols), std::invalid_argument);
}

// Random data: the mxfp8 reference moves every output the quantized GEMMs feed by about the
// format's precision (3 mantissa bits: up to 2^-4 relative per operand element), far above the
// layer's bf16 chain error; the router's forward and what reads no quantized operand stay exact.
TEST(MoeLayerReferenceMxfp8, QuantizationMovesWhatTheGemmsFeed) {
  std::mt19937_64 rng(test_seed("MoeLayerReferenceMxfp8.QuantizationMovesWhatTheGemmsFeed"));
  constexpr int64_t n = 64, h = 64, f = 64;
  constexpr int E = 4;
  const LayerData data = random_layer(rng, n, E, 2, h, f);
  const MoeLayerRef bf16 = ref_moe_layer(data.inputs(Recipe::kBF16));
  const MoeLayerRef mxfp8 = ref_moe_layer(data.inputs(Recipe::kMXFP8));

  EXPECT_EQ(mxfp8.logits, bf16.logits);
  EXPECT_EQ(mxfp8.router.topk_ids, bf16.router.topk_ids);
  EXPECT_EQ(mxfp8.router.topk_weights, bf16.router.topk_weights);
  // Unfused, FC2's output gradient is w_r dy: FC2's bias gradient reads it unquantized.
  EXPECT_EQ(mxfp8.db2, bf16.db2);

  // Above the layer's mxfp8 bound with room for the device's own distance from the reference (at
  // most 0.6 of the bound in emulation): a device that skipped the quantization fails the check.
  // Below 0.2: the recipes differ by the format's rounding, not by another computation.
  const double limit = mxfp8_chain_tolerance().rel_fro;
  const std::vector<std::tuple<const char*, const Mat*, const Mat*, int64_t>> outputs{
      {"h1", &mxfp8.h1, &bf16.h1, 2 * f},    {"y", &mxfp8.y, &bf16.y, h},
      {"dx", &mxfp8.dx, &bf16.dx, h},        {"dwr", &mxfp8.dwr, &bf16.dwr, h},
      {"dw1", &mxfp8.dw1, &bf16.dw1, h},     {"dw2", &mxfp8.dw2, &bf16.dw2, f},
      {"db1", &mxfp8.db1, &bf16.db1, 2 * f}, {"d_logits", &mxfp8.d_logits, &bf16.d_logits, E}};
  for (const auto& [name, got, want, cols] : outputs) {
    const double rel = relative_error(*got, *want, cols, {});
    EXPECT_GT(rel, 1.5 * limit) << name;
    EXPECT_LT(rel, 0.2) << name;
  }
}

// Integers in [-15, 15] times a power of two are MXFP8 values whatever the block (at most 4
// significant bits, and the block scale puts the largest in (224, 448], so none is flushed). With
// x, W1, W2 and dy on such grids and the routing weights fused (FC2's output gradient is dy
// itself), FC1's output and FC2's input gradient are the same in both recipes; the SwiGLU output
// is no such value, so y still differs.
TEST(MoeLayerReferenceMxfp8, ValuesMxfp8HoldsExactlyPassUnchanged) {
  std::mt19937_64 rng(test_seed("MoeLayerReferenceMxfp8.ValuesMxfp8HoldsExactlyPassUnchanged"));
  constexpr int64_t n = 40, h = 64, f = 32;
  constexpr int E = 4;
  LayerData data = random_layer(rng, n, E, 2, h, f);
  data.x = grid_values(rng, data.x.size(), 15, 1.0 / 8);
  data.w1 = grid_values(rng, data.w1.size(), 15, 1.0 / 64);
  data.w2 = grid_values(rng, data.w2.size(), 15, 1.0 / 64);
  data.dy = grid_values(rng, data.dy.size(), 15, 1.0 / 16);
  const MoeLayerRef bf16 = ref_moe_layer(data.inputs(Recipe::kBF16, true));
  const MoeLayerRef mxfp8 = ref_moe_layer(data.inputs(Recipe::kMXFP8, true));
  EXPECT_EQ(mxfp8.h1, bf16.h1);
  EXPECT_EQ(mxfp8.da, bf16.da);
  EXPECT_NE(mxfp8.y, bf16.y);

  const GroupLayout& l = mxfp8.dispatch.layout;
  const Mat px = ref_permute(mxfp8.dispatch, data.x, h);
  GemmOperands operands(Recipe::kMXFP8, l);
  EXPECT_EQ(operands.rowwise(px, h), px);
  EXPECT_EQ(operands.colwise(px, h), px);
  EXPECT_EQ(operands.weight(data.w1, 2 * f, h, false), data.w1);
  EXPECT_EQ(operands.weight(data.w1, 2 * f, h, true), data.w1);
  EXPECT_NE(operands.rowwise(mxfp8.a, f), mxfp8.a);  // and the helper does quantize
}

// The bf16 recipe's GEMMs read the tensors themselves: no copy, so nothing can change them.
TEST(MoeLayerReferenceMxfp8, Bf16RecipeReadsTheTensorsThemselves) {
  EXPECT_EQ(MoeLayerInputs{}.recipe, Recipe::kBF16);
  const GroupLayout l = make_layout({5, 0, 40}, 32, 128);
  const Mat m(128 * 32, 0.25), w(3 * 32 * 32, 0.5);
  GemmOperands operands(Recipe::kBF16, l);
  EXPECT_EQ(&operands.rowwise(m, 32), &m);
  EXPECT_EQ(&operands.colwise(m, 32), &m);
  EXPECT_EQ(&operands.weight(w, 32, 32, false), &w);
  EXPECT_EQ(&operands.weight(w, 32, 32, true), &w);
}

// The reference needs whole blocks along K and N and, for the backward, groups starting on a block of rows.
TEST(MoeLayerReferenceMxfp8, ShapeRulesAreChecked) {
  std::mt19937_64 rng(test_seed("MoeLayerReferenceMxfp8.ShapeRulesAreChecked"));
  LayerData data = random_layer(rng, 8, 4, 2, 48, 32);  // hidden 48: not whole blocks
  EXPECT_NO_THROW(ref_moe_layer(data.inputs(Recipe::kBF16)));
  EXPECT_THROW(ref_moe_layer(data.inputs(Recipe::kMXFP8)), Error);
  data = random_layer(rng, 8, 4, 2, 32, 32);
  MoeLayerInputs in = data.inputs(Recipe::kMXFP8);
  EXPECT_NO_THROW(ref_moe_layer(in));
  in.router.row_align = 16;
  try {
    ref_moe_layer(in);
    ADD_FAILURE() << "row_align 16 must be refused with the mxfp8 recipe";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("row_align 32 or 128, got hidden 32, ffn 32, row_align 16"), std::string::npos)
        << e.message();
  }
  // The forward reads row-wise copies only: any row_align.
  ASSERT_NE(in.dy, nullptr);
  in.dy = nullptr;
  EXPECT_NO_THROW(ref_moe_layer(in));
}

}  // namespace
}  // namespace moegraph::test
