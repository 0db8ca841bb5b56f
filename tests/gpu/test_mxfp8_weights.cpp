// Prequantized MXFP8 weights (moegraph/mxfp8_weights.hpp): an operator or a step that reads the
// caller's MXFP8 weights computes the same bits as one that quantizes the 16-bit weights itself,
// keeps no weight copy of its own, and a StepGraphs of the mxfp8 recipe quantizes once for all its
// buckets. The quantizer itself is checked bit for bit against the host reference. Weights kept
// dequantized (dequantized_weights) give the same bits as the staged route that dequantizes them on
// every call, whether the operator, the step or the caller keeps them. An operator reading its rows
// through a map (ForwardArgs::x_rows) gives the same bits as one reading the gathered buffer, and
// one applying SwiGLU as it reads (ForwardArgs::x_swiglu) the same bits as one reading its output.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/elementwise/elementwise.hpp"
#include "kernels/routing/moe_routing.hpp"
#include "moegraph/grouped_linear.hpp"
#include "moegraph/mxfp8_weights.hpp"
#include "testing/data.hpp"
#include "testing/mxfp8_reference.hpp"
#include "testing/reference.hpp"
#include "tests/common/env_var.hpp"
#include "tests/common/expect.hpp"
#include "tests/gpu/step_driver.hpp"

namespace moegraph::test {
namespace {

// How many of an operator's GEMMs take the swap-AB route, as its kernels line names them.
std::size_t swap_ab_gemms(const std::string& kernels) {
  std::size_t n = 0;
  for (std::size_t at = kernels.find("swap_ab"); at != std::string::npos; at = kernels.find("swap_ab", at + 1)) ++n;
  return n;
}

// The four arrays of W [g, n, k] in one device block.
struct Mxfp8Block {
  DeviceArray<uint8_t> data, scales, data_t, scales_t;
  Mxfp8Block(int g, int64_t n, int64_t k)
      : data(mxfp8_weight_data_bytes(g, n, k)),
        scales(mxfp8_weight_scale_bytes(g, n, k)),
        data_t(data.size()),
        scales_t(scales.size()) {}
  Mxfp8Weights view(bool transposed = true) const {
    return {data.get(), scales.get(), transposed ? data_t.get() : nullptr, transposed ? scales_t.get() : nullptr};
  }
};

TEST(Mxfp8WeightsApi, QuantizerMatchesTheReference) {
  const int g = 3;
  const int64_t n = 96, k = 160;
  std::mt19937_64 rng(test_seed("mxfp8_weights_api"));
  const Mat w = random_values(rng, g * n * k, 1.0, DType::kBF16);
  DeviceArray<uint16_t> dw(w.size());
  dw.upload(to_device_bits(w, DType::kBF16));
  Mxfp8Block q(g, n, k);
  q.data.poison(), q.scales.poison(), q.data_t.poison(), q.scales_t.poison();
  quantize_mxfp8_weights(DType::kBF16, dw.get(), g, n, k, q.view(), nullptr);
  MG_CUDA_CHECK(cudaDeviceSynchronize());
  MxBuffer row = mx_buffer(g * n, k), col = mx_buffer(g * n, k);
  mx_quantize_weights(w, g, n, k, &row, &col);
  EXPECT_TRUE(q.data.download() == row.data);
  EXPECT_TRUE(q.scales.download() == row.scales);
  EXPECT_TRUE(q.data_t.download() == col.data);
  EXPECT_TRUE(q.scales_t.download() == col.scales);

  // One pair alone leaves the other untouched.
  q.data_t.poison();
  quantize_mxfp8_weights(DType::kBF16, dw.get(), g, n, k, q.view(false), nullptr);
  MG_CUDA_CHECK(cudaDeviceSynchronize());
  for (uint8_t b : q.data_t.download()) ASSERT_EQ(b, 0xff);
}

// The tiled scales (the swap-AB route's order) are the reference's layout of each pair's scales,
// padding zero: N = 96 pads the one row tile, K = 160 leaves a last stage of one block (and the
// transposed pair: 160 rows, two tiles, N = 96 three blocks of one stage). Written by the quantizer
// beside the codes, and by tile_mxfp8_weight_scales from scales already there; refused without
// their pair.
TEST(Mxfp8WeightsApi, TiledScalesAreTheScalesInTileOrder) {
  const int g = 3;
  const int64_t n = 96, k = 160;
  std::mt19937_64 rng(test_seed("mxfp8_tiled_scales"));
  Mat w = random_values(rng, g * n * k, 1.0, DType::kBF16);
  // Blocks of 32 scaled by 2^-4 .. 2^4 (exact in bf16): scale bytes that differ from block to block,
  // so a block out of place shows.
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = std::ldexp(w[i], static_cast<int>(i / 32 % 9) - 4);
  DeviceArray<uint16_t> dw(w.size());
  dw.upload(to_device_bits(w, DType::kBF16));
  const std::size_t bytes = mxfp8_tiled_scale_bytes(g, n, k);
  EXPECT_EQ(bytes, std::size_t{512} * g * 1 * 2);
  EXPECT_EQ(mxfp8_tiled_scale_bytes(g, k, n), std::size_t{512} * g * 2 * 1);
  Mxfp8Block q(g, n, k);
  DeviceArray<uint8_t> tiled(bytes), tiled_t(bytes);
  tiled.poison(), tiled_t.poison();
  Mxfp8Weights out = q.view();
  out.scales_tiled = tiled.get(), out.scales_t_tiled = tiled_t.get();
  quantize_mxfp8_weights(DType::kBF16, dw.get(), g, n, k, out, nullptr);
  MG_CUDA_CHECK(cudaDeviceSynchronize());
  MxBuffer row = mx_buffer(g * n, k), col = mx_buffer(g * n, k);
  mx_quantize_weights(w, g, n, k, &row, &col);
  const std::vector<uint8_t> want = tiled_scales(row.scales, g, n, k), want_t = tiled_scales(col.scales, g, k, n);
  EXPECT_TRUE(tiled.download() == want);
  EXPECT_TRUE(tiled_t.download() == want_t);
  std::size_t distinct = 0;
  std::vector<bool> seen(256, false);
  for (uint8_t b : row.scales) distinct += !seen[b], seen[b] = true;
  EXPECT_GT(distinct, 4u) << "the scales should span several bytes";

  tiled.poison(), tiled_t.poison();
  tile_mxfp8_weight_scales(g, n, k, out, nullptr);
  MG_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_TRUE(tiled.download() == want);
  EXPECT_TRUE(tiled_t.download() == want_t);

  Mxfp8Weights orphan;  // tiled scales without their pair
  orphan.scales_tiled = tiled.get();
  EXPECT_THROW(tile_mxfp8_weight_scales(g, n, k, orphan, nullptr), Error);
  EXPECT_THROW(tile_mxfp8_weight_scales(g, n, k, q.view(), nullptr), Error);  // nothing to write
}

// The dequantized copies hold exactly the host rule's values of the codes written beside them
// (e4m3 x 2^(s - 127) rounded to bf16), for both pairs, in their pairs' order.
TEST(Mxfp8WeightsApi, QuantizerWritesTheDequantizedValues) {
  const int g = 3;
  const int64_t n = 96, k = 160;
  std::mt19937_64 rng(test_seed("mxfp8_dequantized_values"));
  const Mat w = random_values(rng, g * n * k, 1.0, DType::kBF16);
  DeviceArray<uint16_t> dw(w.size()), values(w.size()), values_t(w.size());
  dw.upload(to_device_bits(w, DType::kBF16));
  values.poison(), values_t.poison();
  Mxfp8Block q(g, n, k);
  Mxfp8Weights out = q.view();
  out.dequantized = values.get(), out.dequantized_t = values_t.get();
  quantize_mxfp8_weights(DType::kBF16, dw.get(), g, n, k, out, nullptr);
  MG_CUDA_CHECK(cudaDeviceSynchronize());
  MxBuffer row = mx_buffer(g * n, k), col = mx_buffer(g * n, k);
  mx_quantize_weights(w, g, n, k, &row, &col);
  const Mat expect = mx_dequantize_rowwise(row, k, g * n, DType::kBF16);
  const Mat expect_t = mx_dequantize_rowwise(col, n, g * k, DType::kBF16);
  EXPECT_TRUE(values.download() == to_device_bits(expect, DType::kBF16));
  EXPECT_TRUE(values_t.download() == to_device_bits(expect_t, DType::kBF16));
  std::size_t nonzero = 0;
  for (double v : expect) nonzero += v != 0.0;
  EXPECT_GT(nonzero, expect.size() / 2);
}

// A grouped linear of the mxfp8 recipe (6 experts, K 256, N 384, bias, row_align 32) over
// `splits`, with random bf16 x, dy, W and bias on the device, and what one pass gives: the
// inference y, forward_train's y, and backward's dx and main_grad (immediate wgrad).
struct Mxfp8Linear {
  static constexpr int G = 6;
  static constexpr int64_t K = 256, N = 384;
  GroupedLinearOptions options;
  int64_t rows = 0;
  DeviceArray<uint16_t> x, dy, w, b;
  DeviceArray<int32_t> splits;
  testing::Stream stream;

  struct Out {
    std::vector<uint16_t> y, y_infer, dx;
    std::vector<float> main_grad;
    // Bit for bit: main_grad's -0.0 and 0.0 differ here, and NaN equals NaN of the same bits.
    bool operator==(const Out& o) const {
      return y == o.y && y_infer == o.y_infer && dx == o.dx && main_grad.size() == o.main_grad.size() &&
             std::memcmp(main_grad.data(), o.main_grad.data(), main_grad.size() * sizeof(float)) == 0;
    }
  };

  Mxfp8Linear(const std::vector<int32_t>& host_splits, const char* seed_name) : splits(G) {
    options.num_groups = G, options.in_features = K, options.out_features = N, options.row_align = 32;
    options.bias = true, options.recipe = Recipe::kMXFP8;
    for (int32_t n : host_splits) rows += (n + 31) / 32 * 32;
    rows += 64;  // rows past the last group
    options.capacity_rows = rows;
    std::mt19937_64 rng(test_seed(seed_name));
    const auto upload = [&](DeviceArray<uint16_t>& a, int64_t n, double scale) {
      a = DeviceArray<uint16_t>(n);
      a.upload(to_device_bits(random_values(rng, n, scale, DType::kBF16), DType::kBF16));
    };
    upload(x, rows * K, 1.0), upload(dy, rows * N, 1.0), upload(w, G * N * K, 0.1), upload(b, G * N, 0.1);
    splits.upload(host_splits);
  }

  // x_in and x_rows (ForwardArgs::x_rows, x_in having x_rows_bound rows) stand in for x when given;
  // with x_swiglu x_in is gate | up [rows, 2K] (ForwardArgs::x_swiglu, x_row_weight).
  Out run(GroupedLinear& op, const void* weight, const Mxfp8Weights& m, const void* x_in = nullptr,
          const int32_t* x_rows = nullptr, int64_t x_rows_bound = 0, bool x_swiglu = false,
          const float* x_row_weight = nullptr) {
    const cudaStream_t s = stream.get();
    DeviceArray<uint16_t> y(rows * N), y_infer(rows * N), dx(rows * K);
    DeviceArray<float> main_grad(G * N * K);
    y.poison(), y_infer.poison(), dx.poison();
    testing::memset_and_wait(main_grad.get(), 0, main_grad.size() * 4);
    const void* in = x_in != nullptr ? x_in : x.get();
    ForwardArgs f{in, splits.get(), weight, b.get(), nullptr, y_infer.get(), nullptr, m, x_rows, x_rows_bound};
    f.x_swiglu = x_swiglu, f.x_row_weight = x_row_weight;
    op.forward(f, s);
    f.y = y.get();
    op.forward_train(f, s);
    op.backward({dy.get(), weight, b.get(), dx.get(), nullptr, nullptr, nullptr, main_grad.get(), m},
                WgradMode::kImmediate, s);
    op.check_device_errors(s);
    return Out{y.download(), y_infer.download(), dx.download(), main_grad.download()};
  }
};

std::size_t nonzero(const std::vector<float>& v) {
  return static_cast<std::size_t>(std::count_if(v.begin(), v.end(), [](float f) { return f != 0.0f; }));
}

// Three operators on the same weights and data: one keeping the dequantized values itself, one
// reading the caller's (prequantized_weights), and one without them; with the staged route forced
// on all three the same y, dx and main_grad bits, and each holds the copies it says. The first two
// take the staged route of their own accord (groups past the swap-AB bound). A prequantized one
// without the values is refused.
TEST(Mxfp8WeightsApi, DequantizedWeightsGiveTheStagedRoutesBits) {
  Mxfp8Linear l({140, 0, 97, 5, 64, 131}, "mxfp8_dequantized_linear");
  const int G = Mxfp8Linear::G;
  const int64_t K = Mxfp8Linear::K, N = Mxfp8Linear::N;
  const GroupedLinearOptions& o = l.options;
  GroupedLinearOptions kept = o, given_opts = o;
  kept.dequantized_weights = true;
  given_opts.dequantized_weights = given_opts.prequantized_weights = true;
  EXPECT_NE(GroupedLinear::describe_kernels(kept).find("kept bf16 values"), std::string::npos)
      << GroupedLinear::describe_kernels(kept);
  Mxfp8Block q(G, N, K);
  DeviceArray<uint16_t> values(G * N * K), values_t(G * N * K);
  Mxfp8Weights caller = q.view();
  caller.dequantized = values.get(), caller.dequantized_t = values_t.get();
  const cudaStream_t s = l.stream.get();
  quantize_mxfp8_weights(DType::kBF16, l.w.get(), G, N, K, caller, s);

  const std::size_t value_bytes = 2 * mxfp8_dequantized_weight_bytes(G, N, K);
  {
    GroupedLinear own(kept), given(given_opts), plain(o);
    // own's fprop and dgrad take the staged route, whose A the quantizer writes as bf16 values into
    // the staging: own keeps no row-wise codes of x or dy, which plain's routes read here.
    const auto in_layout = [](std::size_t bytes) { return (bytes + 255) / 256 * 256; };  // buffers start 256-aligned
    const std::size_t code_bytes = static_cast<std::size_t>(l.rows) * std::max(K, N);
    const std::size_t codes = in_layout(code_bytes) + in_layout(code_bytes / 32);
    // The staging differs too: own's holds A's values (x [rows, K] for fprop, dy [rows, N] for dgrad)
    // and the staged wgrad's x (dy's values come from its quantizer), so [rows, max(K, N)] bf16;
    // plain's holds what its routes need (the wgrad's x, or the swap-AB kernel's partial sums).
    const auto buffer = [](const GroupedLinearOptions& opts, const char* name) {
      for (const auto& b : GroupedLinear::workspace_buffers(opts))
        if (b.name == name) return b.bytes;
      return std::size_t{0};
    };
    const auto staging = [&](const GroupedLinearOptions& opts) { return buffer(opts, "mxfp8.staging"); };
    EXPECT_EQ(staging(kept), static_cast<std::size_t>(l.rows) * std::max(K, N) * 2);
    // Where plain's fprop and dgrad take the swap-AB route (as at these group sizes),
    // plain also holds A's scales as floats and, per swap-AB GEMM, the weights' scales in tile
    // order; own holds neither.
    const std::string plain_kernels = GroupedLinear::describe_kernels(o);
    const std::size_t swap_ab = swap_ab_gemms(plain_kernels);
    const std::size_t swap_ab_bytes = in_layout(buffer(o, "mxfp8.operand.scale_floats")) +
                                      swap_ab * mxfp8_tiled_scale_bytes(G, N, K);
    EXPECT_EQ(swap_ab > 0, buffer(o, "mxfp8.operand.scale_floats") > 0) << plain_kernels;
    EXPECT_EQ(buffer(kept, "mxfp8.operand.scale_floats"), 0u);
    EXPECT_EQ(own.device_bytes(), plain.device_bytes() + value_bytes - codes - swap_ab_bytes +
                                      in_layout(staging(kept)) - in_layout(staging(o)));
    own.weights_changed(l.w.get(), s);
    EXPECT_TRUE(l.run(own, l.w.get(), {}) == l.run(given, nullptr, caller)) << "own and the caller's kept values";
    Mxfp8Weights missing = caller;
    missing.dequantized_t = nullptr;
    DeviceArray<uint16_t> y(l.rows * N), dx(l.rows * K);
    given.forward_train({l.x.get(), l.splits.get(), nullptr, l.b.get(), nullptr, y.get(), nullptr, caller}, s);
    EXPECT_THROW(given.backward({l.dy.get(), nullptr, l.b.get(), dx.get(), nullptr, nullptr, nullptr, nullptr, missing},
                                WgradMode::kImmediate, s),
                 Error);
    missing.dequantized = nullptr;
    EXPECT_THROW(given.forward({l.x.get(), l.splits.get(), nullptr, l.b.get(), nullptr, y.get(), nullptr, missing}, s),
                 Error);
  }
  EnvVar staged("MOEGRAPH_MXFP8_ROUTE", "staged");
  GroupedLinear own(kept), plain(o);
  own.weights_changed(l.w.get(), s);
  plain.weights_changed(l.w.get(), s);
  const Mxfp8Linear::Out a = l.run(own, l.w.get(), {}), p = l.run(plain, l.w.get(), {});
  EXPECT_TRUE(a == p) << "the kept values and the per-call staging";
  EXPECT_GT(nonzero(a.main_grad), a.main_grad.size() / 2) << "the step computed gradients";
}

// An immediate wgrad on the staged route reads dy's bf16 values written by dy's quantizer
// (Mxfp8Colwise::values); an operator with delay_wgrad keeps dy's codes in its slot and its wgrad
// dequantizes them. Run immediately, both give the same y, dx and main_grad bits.
TEST(Mxfp8WeightsApi, ImmediateWgradFromDyValuesGivesTheCodesBits) {
  Mxfp8Linear l({140, 0, 97, 5, 64, 131}, "mxfp8_dy_values_linear");
  GroupedLinearOptions delayed = l.options;
  delayed.delay_wgrad = true;
  GroupedLinear values(l.options), codes(delayed);
  EXPECT_NE(values.describe().find("dy's as bf16 values"), std::string::npos) << values.describe();
  EXPECT_EQ(codes.describe().find("dy's as bf16 values"), std::string::npos) << codes.describe();
  values.weights_changed(l.w.get(), l.stream.get());
  codes.weights_changed(l.w.get(), l.stream.get());
  const Mxfp8Linear::Out a = l.run(values, l.w.get(), {}), b = l.run(codes, l.w.get(), {});
  EXPECT_TRUE(a == b) << "dy's values and dy's codes give different results";
  EXPECT_GT(nonzero(a.main_grad), a.main_grad.size() / 2) << "the step computed gradients";
}

// ForwardArgs::x_rows: the operator reading its rows from tokens through a map (as the MoE layer's
// FC1 reads the dispatch's token_of_row) gives the same y, inference y, dx and main_grad bits as
// reading the gathered buffer, on both GEMM routes. The gap rows' map entries name a NaN token that
// no data row uses (reading one would show). The bf16 recipe refuses x_rows.
TEST(Mxfp8WeightsApi, GatheredInputRowsGiveTheGatheredBuffersBits) {
  const std::vector<int32_t> host_splits{40, 0, 97, 5, 64, 31};
  Mxfp8Linear l(host_splits, "mxfp8_gathered_linear");
  const int64_t K = Mxfp8Linear::K, T = 90;
  std::mt19937_64 rng(test_seed("mxfp8_gathered_linear_tokens"));
  std::vector<uint16_t> tokens = to_device_bits(random_values(rng, (T + 1) * K, 1.0, DType::kBF16), DType::kBF16);
  std::fill(tokens.begin() + T * K, tokens.end(), uint16_t{0x7fc0});  // token T: NaN, never to be read
  const GroupLayout layout = make_layout(host_splits, 32, l.rows);
  const std::vector<bool> data = data_rows(layout);
  std::vector<int32_t> map(l.rows, static_cast<int32_t>(T));
  std::vector<uint16_t> gathered = l.x.download();  // padding rows keep their random values
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(T) - 1);
  for (int64_t r = 0; r < layout.offsets.back(); ++r) {
    if (data[r]) map[r] = token(rng);
    for (int64_t c = 0; c < K; ++c) gathered[r * K + c] = data[r] ? tokens[map[r] * K + c] : uint16_t{0};
  }
  l.x.upload(gathered);
  DeviceArray<uint16_t> d_tokens(tokens.size());
  d_tokens.upload(tokens);
  DeviceArray<int32_t> d_map(map.size());
  d_map.upload(map);
  for (const char* route : {"staged", "e4m3"}) {
    EnvVar forced("MOEGRAPH_MXFP8_ROUTE", route);
    GroupedLinear op(l.options);
    op.weights_changed(l.w.get(), l.stream.get());
    const Mxfp8Linear::Out want = l.run(op, l.w.get(), {}),
                           got = l.run(op, l.w.get(), {}, d_tokens.get(), d_map.get(), T + 1);
    EXPECT_TRUE(got == want) << route << " route: gathered rows differ from the gathered buffer";
    EXPECT_GT(nonzero(want.main_grad), want.main_grad.size() / 2) << route << ": the step computed gradients";
  }
  {  // x_rows without the rows of x is refused before anything is enqueued
    GroupedLinear op(l.options);
    op.weights_changed(l.w.get(), l.stream.get());
    DeviceArray<uint16_t> y(l.rows * Mxfp8Linear::N);
    EXPECT_THROW(op.forward({d_tokens.get(), l.splits.get(), l.w.get(), l.b.get(), nullptr, y.get(), nullptr, {},
                             d_map.get()}, l.stream.get()),
                 Error);
  }
  {  // a data row's entry past x (the NaN token, with x_rows_bound T) reads as zeros and is reported
    std::vector<int32_t> bad = map;
    const int64_t row = layout.offsets[2] + 7;
    ASSERT_TRUE(data[row]);
    bad[row] = static_cast<int32_t>(T);
    d_map.upload(bad);
    GroupedLinear op(l.options);
    op.weights_changed(l.w.get(), l.stream.get());
    DeviceArray<uint16_t> y(l.rows * Mxfp8Linear::N);
    y.poison();
    op.forward({d_tokens.get(), l.splits.get(), l.w.get(), l.b.get(), nullptr, y.get(), nullptr, {}, d_map.get(), T},
               l.stream.get());
    try {
      op.check_device_errors(l.stream.get());
      ADD_FAILURE() << "an x_rows entry past x was not reported";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(detail::concat("x_rows[", row, "] = ", T)), std::string::npos) << e.what();
    }
    // A zero row times W plus its group's bias: the bias itself, bit for bit (not the NaN token).
    const std::vector<uint16_t> out = y.download(), bias = l.b.download();
    for (int64_t c = 0; c < Mxfp8Linear::N; ++c)
      ASSERT_EQ(out[row * Mxfp8Linear::N + c], bias[2 * Mxfp8Linear::N + c]) << "column " << c;
    d_map.upload(map);
  }
  GroupedLinearOptions bf16 = l.options;
  bf16.recipe = Recipe::kBF16;
  GroupedLinear plain(bf16);
  DeviceArray<uint16_t> y(l.rows * Mxfp8Linear::N);
  EXPECT_THROW(plain.forward({d_tokens.get(), l.splits.get(), l.w.get(), l.b.get(), nullptr, y.get(), nullptr, {},
                              d_map.get()}, l.stream.get()),
               Error);
}

// ForwardArgs::x_swiglu: the operator applying SwiGLU to gate | up as its quantizer reads them (as
// the MoE layer's FC2 reads FC1's output) gives the same y, inference y, dx and main_grad bits as
// reading the SwiGLU kernels' output, unweighted and weighted, on both GEMM routes. gate | up
// holds random values in the gap rows and past the groups, and the gap rows' weights are NaN: none
// may be read. The bf16 recipe refuses x_swiglu; x_row_weight without it and x_swiglu with x_rows
// are refused.
TEST(Mxfp8WeightsApi, SwigluInputGivesTheSwigluOutputsBits) {
  const std::vector<int32_t> host_splits{40, 0, 97, 5, 64, 31};
  Mxfp8Linear l(host_splits, "mxfp8_swiglu_linear");
  const int64_t K = Mxfp8Linear::K, rows = l.rows;
  std::mt19937_64 rng(test_seed("mxfp8_swiglu_linear_gate_up"));
  DeviceArray<uint16_t> gate_up(rows * 2 * K), h(rows * K), h_weighted(rows * K);
  gate_up.upload(to_device_bits(random_values(rng, rows * 2 * K, 3.0, DType::kBF16), DType::kBF16));
  const GroupLayout layout = make_layout(host_splits, 32, rows);
  const std::vector<float> weights = data_row_weights(rng, layout);
  DeviceArray<float> d_weights(rows);
  d_weights.upload(weights);
  DeviceArray<int64_t> offsets(layout.offsets.size());
  offsets.upload(layout.offsets);
  h.poison(), h_weighted.poison();
  kernels::launch_swiglu_forward(DType::kBF16, gate_up.get(), h.get(), K, offsets.get(), Mxfp8Linear::G, 64,
                                 l.stream.get());
  kernels::launch_swiglu_weighted_forward(DType::kBF16, gate_up.get(), d_weights.get(), h_weighted.get(), K,
                                          offsets.get(), Mxfp8Linear::G, l.stream.get());
  for (const char* route : {"staged", "e4m3"}) {
    EnvVar forced("MOEGRAPH_MXFP8_ROUTE", route);
    GroupedLinear op(l.options);
    op.weights_changed(l.w.get(), l.stream.get());
    const Mxfp8Linear::Out want = l.run(op, l.w.get(), {}, h.get()),
                           got = l.run(op, l.w.get(), {}, gate_up.get(), nullptr, 0, true);
    EXPECT_TRUE(got == want) << route << " route: SwiGLU on the way in differs from the SwiGLU kernel's output";
    EXPECT_GT(nonzero(want.main_grad), want.main_grad.size() / 2) << route << ": the step computed gradients";
    const Mxfp8Linear::Out want_w = l.run(op, l.w.get(), {}, h_weighted.get()),
                           got_w = l.run(op, l.w.get(), {}, gate_up.get(), nullptr, 0, true, d_weights.get());
    EXPECT_TRUE(got_w == want_w) << route << " route: weighted SwiGLU on the way in differs";
    EXPECT_FALSE(want_w == want) << route << ": the weights changed nothing";
  }
  GroupedLinear op(l.options);
  op.weights_changed(l.w.get(), l.stream.get());
  DeviceArray<uint16_t> y(rows * Mxfp8Linear::N);
  ForwardArgs bad;
  bad.x = gate_up.get(), bad.splits = l.splits.get(), bad.weight = l.w.get(), bad.bias = l.b.get();
  bad.y = y.get();
  bad.x_row_weight = d_weights.get();  // without x_swiglu
  EXPECT_THROW(op.forward(bad, l.stream.get()), Error);
  DeviceArray<int32_t> map(rows);
  map.upload(std::vector<int32_t>(rows, 0));
  bad.x_swiglu = true, bad.x_rows = map.get(), bad.x_rows_bound = rows;
  EXPECT_THROW(op.forward(bad, l.stream.get()), Error);
  GroupedLinearOptions bf16 = l.options;
  bf16.recipe = Recipe::kBF16;
  GroupedLinear plain(bf16);
  ForwardArgs swiglu;
  swiglu.x = gate_up.get(), swiglu.splits = l.splits.get(), swiglu.weight = l.w.get(), swiglu.bias = l.b.get();
  swiglu.y = y.get();
  swiglu.x_swiglu = true;
  EXPECT_THROW(plain.forward(swiglu, l.stream.get()), Error);
}

// One grouped linear quantizing its own copies and one reading the caller's: the same y, dx and
// main_grad bits; the second holds no weight copy.
TEST(Mxfp8WeightsApi, GroupedLinearFromPrequantizedWeightsGivesTheSameBits) {
  Mxfp8Linear l({40, 0, 97, 5, 64, 31}, "mxfp8_prequantized_linear");
  const int G = Mxfp8Linear::G;
  const int64_t K = Mxfp8Linear::K, N = Mxfp8Linear::N;
  const GroupedLinearOptions& o = l.options;
  GroupedLinearOptions pre = o;
  pre.prequantized_weights = true;
  GroupedLinear own(o), given(pre);
  // Its own copies: both pairs, and the tiled scales of each GEMM that takes the swap-AB route (as
  // its kernels line names them: fprop and dgrad here, 64 rows a group).
  const std::size_t copies = 2 * (mxfp8_weight_data_bytes(G, N, K) + mxfp8_weight_scale_bytes(G, N, K));
  const std::string kernels = GroupedLinear::describe_kernels(o);
  const std::size_t swap_ab = swap_ab_gemms(kernels);
  EXPECT_EQ(swap_ab, 2u) << kernels;
  EXPECT_EQ(own.device_bytes() - given.device_bytes(), copies + swap_ab * mxfp8_tiled_scale_bytes(G, N, K));
  const std::size_t tiled = mxfp8_tiled_scale_bytes(G, N, K);

  // The caller's copies without tiled scales (the swap-AB route then gathers them from the row-wise
  // ones), and with them: the same bits as the operator's own copies either way.
  Mxfp8Block q(G, N, K);
  DeviceArray<uint8_t> q_tiled(tiled), q_tiled_t(tiled);
  Mxfp8Weights with_tiled = q.view();
  with_tiled.scales_tiled = q_tiled.get(), with_tiled.scales_t_tiled = q_tiled_t.get();
  const cudaStream_t s = l.stream.get();
  quantize_mxfp8_weights(DType::kBF16, l.w.get(), G, N, K, with_tiled, s);
  own.weights_changed(l.w.get(), s);
  const Mxfp8Linear::Out a = l.run(own, l.w.get(), {});
  for (const Mxfp8Weights& given_weights : {q.view(), with_tiled}) {
    const Mxfp8Linear::Out c = l.run(given, nullptr, given_weights);
    const char* which = given_weights.scales_tiled != nullptr ? "with tiled scales" : "without tiled scales";
    EXPECT_TRUE(a.y == c.y) << which;
    EXPECT_TRUE(a.y_infer == c.y_infer) << which;
    EXPECT_TRUE(a.dx == c.dx) << which;
    EXPECT_TRUE(a.main_grad == c.main_grad) << which;
  }
  EXPECT_GT(nonzero(a.main_grad), a.main_grad.size() / 2) << "the step computed gradients";

  // What the prequantized operator refuses: its own quantization, and missing MXFP8 weights.
  EXPECT_THROW(given.weights_changed(l.w.get(), s), Error);
  DeviceArray<uint16_t> y(l.rows * N);
  EXPECT_THROW(given.forward({l.x.get(), l.splits.get(), l.w.get(), l.b.get(), nullptr, y.get(), nullptr, {}}, s),
               Error);
}

// A StepGraphs of the mxfp8 recipe from 16-bit weights (one shared quantized copy) and one from the
// same weights prequantized by the caller: every output and gradient of a training step, replayed
// and eager, bit for bit, on two buckets.
TEST(Mxfp8WeightsApi, StepFromPrequantizedWeightsGivesTheSameBits) {
  StepGraphsOptions o = small_layer_step(8, 2, 64);
  o.layer.recipe = Recipe::kMXFP8;
  o.layer.row_align = 32;
  o.buckets = {64, 256};  // the driver runs the first; both read the one shared copy
  StepGraphsOptions pre = o;
  pre.layer.prequantized_weights = true;
  EXPECT_GT(o.buckets.size(), 1u);
  EXPECT_GT(plan_step(o).mxfp8_copy_bytes, 0u);
  EXPECT_EQ(plan_step(pre).mxfp8_copy_bytes, 0u);

  StepDriver self(o), given(pre);
  std::mt19937_64 rng(test_seed("mxfp8_prequantized_step"));
  const int64_t n = self.tokens() * self.hidden();
  for (int32_t tokens : {64, 23}) {
    const auto x = to_device_bits(random_values(rng, n, 1.0, DType::kBF16), DType::kBF16);
    const auto dy = to_device_bits(random_values(rng, n, 1.0, DType::kBF16), DType::kBF16);
    for (bool graph : {false, true}) {
      for (StepDriver* d : {&self, &given}) {
        d->write_inputs(x, dy, tokens);
        d->reset_outputs();
        d->train_step(graph);
      }
      const StepBits a = self.read(), b = given.read();
      EXPECT_TRUE(a.y == b.y) << tokens << " tokens, graph " << graph;
      EXPECT_TRUE(a.dx == b.dx) << tokens << " tokens, graph " << graph;
      EXPECT_TRUE(a.main_grad1 == b.main_grad1 && a.main_grad2 == b.main_grad2 &&
                  a.main_grad_router == b.main_grad_router)
          << tokens << " tokens, graph " << graph;
      std::size_t nan = 0;
      for (int64_t i = 0; i < int64_t{tokens} * self.hidden(); ++i) nan += std::isnan(from_bits(a.y[i], DType::kBF16));
      EXPECT_EQ(nan, 0u);
      self.step().check_device_errors(self.stream());
      given.step().check_device_errors(given.stream());
    }
  }
}

// A StepGraphs keeping the dequantized values in its one shared set, one given them by the caller,
// and one staging the weights per call (staged route forced on all three): the same bits of a
// training step on a bucket whose groups take the staged route, eager and replayed.
TEST(Mxfp8WeightsApi, StepWithDequantizedWeightsGivesTheStagedRoutesBits) {
  StepGraphsOptions o = small_layer_step(8, 2, 512);
  o.layer.recipe = Recipe::kMXFP8;
  o.layer.row_align = 32;
  StepGraphsOptions kept = o, given = o;
  kept.layer.dequantized_weights = true;
  given.layer.dequantized_weights = given.layer.prequantized_weights = true;
  EXPECT_GT(plan_step(kept).mxfp8_dequantized_bytes, 0u);
  // The buckets' fprop and dgrad read the kept values (else the bit equality below would hold
  // whether or not they were used); with the staged route forced too, below, as with none.
  for (const StepGraphsOptions* options : {&kept, &given}) {
    std::size_t reading = 0;
    for (const std::string& k : plan_step(*options).kernels) reading += k.find("kept bf16 values") != std::string::npos;
    EXPECT_EQ(reading, 2u) << "fc1 and fc2 of the one bucket";
  }
  EnvVar staged("MOEGRAPH_MXFP8_ROUTE", "staged");
  StepDriver plain(o), own(kept), caller(given);
  std::mt19937_64 rng(test_seed("mxfp8_dequantized_step"));
  const int64_t n = plain.tokens() * plain.hidden();
  for (int32_t tokens : {512, 77}) {
    const auto x = to_device_bits(random_values(rng, n, 1.0, DType::kBF16), DType::kBF16);
    const auto dy = to_device_bits(random_values(rng, n, 1.0, DType::kBF16), DType::kBF16);
    for (bool graph : {false, true}) {
      for (StepDriver* d : {&plain, &own, &caller}) {
        d->write_inputs(x, dy, tokens);
        d->reset_outputs();
        d->train_step(graph);
        d->step().check_device_errors(d->stream());
      }
      const StepBits a = plain.read(), b = own.read(), c = caller.read();
      EXPECT_TRUE(a == b) << tokens << " tokens, graph " << graph << ": kept values differ from staging";
      EXPECT_TRUE(b == c) << tokens << " tokens, graph " << graph << ": own and the caller's values differ";
      std::size_t nan = 0;
      for (int64_t i = 0; i < int64_t{tokens} * plain.hidden(); ++i) nan += std::isnan(from_bits(b.y[i], DType::kBF16));
      EXPECT_EQ(nan, 0u);
    }
  }
}

// Serving from an MXFP8 checkpoint: an inference step given only the fprop copies (no 16-bit
// weights, no transposed copies) replays the forward of the step that quantizes for itself.
TEST(Mxfp8WeightsApi, InferenceStepServesFromMxfp8WeightsAlone) {
  StepGraphsOptions o = small_layer_step(8, 2, 32);
  o.layer.recipe = Recipe::kMXFP8, o.layer.row_align = 32;
  o.layer.training = false, o.layer.delay_wgrad = false;
  StepGraphsOptions pre = o;
  pre.layer.prequantized_weights = true;
  const StepPlan plan16 = plan_step(o), plan8 = plan_step(pre);
  // The expert weights shrink from 2 bytes to 1 + 1/32 bytes an element, and no copy is made.
  const std::size_t experts = o.layer.experts * 3 * o.layer.ffn * o.layer.hidden;
  EXPECT_LT(plan8.device_bytes(), plan16.device_bytes());
  EXPECT_GE(plan16.device_bytes() - plan8.device_bytes(), experts * 2 * 99 / 100);

  testing::Stream stream;
  cudaStream_t s = stream.get();
  const testing::OwnedStepWeights w16 = testing::make_step_weights(o, s), w8 = testing::make_step_weights(pre, s);
  EXPECT_EQ(w8.weights.w1, nullptr);
  EXPECT_EQ(w8.weights.w1_mxfp8.data_t, nullptr) << "inference needs no dgrad copy";
  StepGraphs a(o, w16.weights), b(pre, w8.weights);
  std::mt19937_64 rng(test_seed("mxfp8_serving"));
  const int64_t n = 32 * o.layer.hidden;
  for (int32_t tokens : {32, 1, 7}) {
    const auto x = to_device_bits(random_values(rng, n, 1.0, DType::kBF16), DType::kBF16);
    std::vector<uint16_t> y[2];
    int i = 0;
    for (StepGraphs* step : {&a, &b}) {
      const BucketIO io = step->io(0);
      MG_CUDA_CHECK(cudaMemcpyAsync(io.x, x.data(), n * 2, cudaMemcpyHostToDevice, s));
      MG_CUDA_CHECK(cudaMemcpyAsync(io.num_tokens, &tokens, 4, cudaMemcpyHostToDevice, s));
      MG_CUDA_CHECK(cudaMemsetAsync(io.y, 0xff, n * 2, s));
      step->forward(0, s);
      step->check_device_errors(s);
      y[i].resize(n);
      MG_CUDA_CHECK(cudaMemcpy(y[i].data(), io.y, n * 2, cudaMemcpyDeviceToHost));
      ++i;
    }
    EXPECT_TRUE(y[0] == y[1]) << tokens << " tokens";
    for (int64_t e = 0; e < int64_t{tokens} * o.layer.hidden; ++e)
      ASSERT_FALSE(std::isnan(from_bits(y[1][e], DType::kBF16))) << "token row " << e / o.layer.hidden;
  }
}

}  // namespace
}  // namespace moegraph::test
