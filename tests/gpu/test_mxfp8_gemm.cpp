// The MXFP8 ragged GEMM (fprop / dgrad form) against the fp64 reference on the dequantized
// operands: random E4M3 codes with random per-32-block E8M0 scales spread over many binades, ragged
// groups (empty ones, row_align gaps, padding past the last group), partial column tiles, bias
// with a per-row scale, NaN scales propagating, and a captured launch replayed on new routings.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "kernels/common/device_query.hpp"
#include "kernels/grouped_gemm/grouped_gemm.hpp"
#include "kernels/quantize/mxfp8.hpp"
#include "kernels/routing/offsets.hpp"
#include "testing/device_array.hpp"
#include "testing/graph.hpp"
#include "testing/mxfp8_reference.hpp"
#include "tests/common/expect.hpp"

namespace moegraph::test {
namespace {

struct Mx {
  std::vector<uint8_t> data, scales;  // [rows, k], [rows, k / 32]
  Mat values;                         // dequantized
};

// Random finite codes; scales 2^(e - 127) with e in [center - spread, center + spread].
Mx random_mx(std::mt19937_64& rng, int64_t rows, int64_t k, int spread, int center = 127) {
  Mx m;
  m.data.resize(rows * k);
  m.scales.resize(rows * k / 32);
  m.values.resize(rows * k);
  std::uniform_int_distribution<int> code(0, 255), exp(center - spread, center + spread);
  for (auto& s : m.scales) s = static_cast<uint8_t>(exp(rng));
  for (int64_t i = 0; i < rows * k; ++i) {
    uint8_t c;
    do c = static_cast<uint8_t>(code(rng));
    while ((c & 0x7f) == 0x7f);
    m.data[i] = c;
    m.values[i] = e4m3_decode(c) * e8m0_decode(m.scales[i / 32]);
  }
  return m;
}

// A's scales [rows, k / 32] as the swap-AB route reads them (Mxfp8RaggedGemmParams::a_scale_floats,
// stage-major), decoded and laid out on the host independently of the quantizer.
DeviceArray<float> scale_floats(const std::vector<uint8_t>& scales, int64_t rows, int64_t k) {
  const std::vector<float> floats = e8m0_floats(scales, rows, k);
  DeviceArray<float> d(floats.size());
  d.upload(floats);
  return d;
}
// B's scales [groups, n, k / 32] in the swap-AB route's tile order (b_scales_tiled), laid out on the
// host independently of the library's tiling kernel.
DeviceArray<uint8_t> tiled_scales_of(const std::vector<uint8_t>& scales, int64_t groups, int64_t n, int64_t k) {
  const std::vector<uint8_t> tiled = tiled_scales(scales, groups, n, k);
  DeviceArray<uint8_t> d(tiled.size());
  d.upload(tiled);
  return d;
}

struct GemmCase {
  const char* name;
  int groups;
  int64_t k, n;
  int row_align;
  bool bias;
  int spread;  // binades of scale spread around 1
  int shift = 0;  // A's scales centred 2^-shift, B's 2^shift (their products stay near 1)
  int rows_per_group = 37;  // on average
  int pad_rows = 64;        // capacity past the data and its alignment gaps
};

using kernels::Mxfp8Route;
constexpr Mxfp8Route kRoutes[] = {Mxfp8Route::kE4m3, Mxfp8Route::kSwapAb, Mxfp8Route::kDequant,
                                  Mxfp8Route::kStaged};
std::string route_name(Mxfp8Route r) {
  switch (r) {
    case Mxfp8Route::kSwapAb: return "swap_ab";
    case Mxfp8Route::kDequant: return "dequant";
    case Mxfp8Route::kStaged: return "staged";
    default: return "row_tiles";
  }
}

// The staged route's scratch for a launch (none for the other routes), poisoned: the route must
// write every staged value it reads. experts_per_run: 0 for the default size.
struct Staging {
  Staging(const kernels::GemmPlan& plan, int groups, int64_t capacity_rows, int64_t n, int64_t k,
          int experts_per_run = 0)
      : bytes(kernels::mxfp8_staging_bytes(plan.config, groups, capacity_rows, n, k, experts_per_run)),
        buffer(std::max<std::size_t>(bytes, 1)) {
    buffer.poison();
  }
  std::size_t bytes;
  DeviceArray<uint8_t> buffer;
};

// Each case runs on every fprop/dgrad kernel: E4M3 wgmma on 128-row tiles, E4M3 swap-AB (weight rows
// on M, 32 group rows on N), the operands dequantized to bf16 on chip, the operands staged as bf16
// in scratch for the bf16 kernel, and that route reading the weights' values kept dequantized
// (dequantized_weights: B's codes and scales are then not given at all, so it must read the values).
struct RouteChoice {
  Mxfp8Route route;
  bool dequantized_weights = false;
};
constexpr RouteChoice kGemmRoutes[] = {{Mxfp8Route::kE4m3},
                                       {Mxfp8Route::kSwapAb},
                                       {Mxfp8Route::kDequant},
                                       {Mxfp8Route::kStaged},
                                       {Mxfp8Route::kStaged, true}};
class Mxfp8Gemm : public ::testing::TestWithParam<std::tuple<GemmCase, RouteChoice>> {};

// The MXFP8 kernel for a phase (bf16 outputs), prepared on this device, on the route asked for
// (wgrad: E4M3 or staged; for staged, the bf16 wgrad kernel may be forced too).
kernels::GemmPlan mxfp8_plan(kernels::GemmPhase phase, Mxfp8Route route = Mxfp8Route::kE4m3, int wgrad_ping_pong = -1,
                             int tile_n = 0, bool dequantized_weights = false) {
  kernels::GemmProblem problem;
  problem.phase = phase;
  problem.recipe = Recipe::kMXFP8;
  problem.dequantized_weights = dequantized_weights;
  kernels::GemmOverrides forced;
  forced.mxfp8_route = route;
  forced.wgrad_ping_pong = wgrad_ping_pong;
  forced.tile_n = tile_n;
  const kernels::GemmConfig config = kernels::choose_gemm_config(problem, kernels::with_environment(forced));
  const bool wgrad = phase == kernels::GemmPhase::kWgrad;
  EXPECT_EQ(config.family == kernels::GemmFamily::kMxfp8SwapAb, route == Mxfp8Route::kSwapAb && !wgrad);
  EXPECT_EQ(config.family == kernels::GemmFamily::kMxfp8Dequant, route == Mxfp8Route::kDequant && !wgrad);
  EXPECT_EQ(config.family == kernels::GemmFamily::kMxfp8Staged, route == Mxfp8Route::kStaged);
  EXPECT_EQ(config.dequantized_weights, dequantized_weights && route == Mxfp8Route::kStaged && !wgrad);
  return kernels::prepare_gemm(config, kernels::current_sm_count());
}

TEST_P(Mxfp8Gemm, MatchesReferenceOnDequantizedOperands) {
  const auto& [c, choice] = GetParam();
  const Mxfp8Route route = choice.route;
  const bool values = choice.dequantized_weights;
  std::mt19937_64 rng(test_seed(c.name));
  const int64_t data_rows = int64_t{c.rows_per_group} * c.groups + 5;
  const int64_t capacity = data_rows + int64_t{c.groups} * c.row_align + c.pad_rows;  // padding past the last group
  testing::Stream stream;
  const kernels::GemmPlan fprop_plan = mxfp8_plan(kernels::GemmPhase::kFprop, route, -1, 0, values);
  if (route == Mxfp8Route::kSwapAb) {  // which swap-AB kernel the launches below take
    const bool deep = kernels::mxfp8_swap_ab_deep_ring(fprop_plan, c.groups, capacity, c.n);
    if (std::string(c.name).find("deep_ring") != std::string::npos && fprop_plan.sm_count >= 126) {
      EXPECT_TRUE(deep) << "the deep-ring case must take the deep-ring kernel";
    }
    if (c.rows_per_group >= 300) {
      EXPECT_FALSE(deep) << "hundreds of tiles take the two-CTA kernel";
    }
  }

  const Mx a = random_mx(rng, capacity, c.k, c.spread, 127 - c.shift);
  const Mx b = random_mx(rng, c.groups * c.n, c.k, c.spread, 127 + c.shift);
  const Mat bias = c.bias ? random_values(rng, c.groups * c.n, 0.5, DType::kBF16) : Mat{};
  Mat scale = c.bias ? random_values(rng, capacity, 1.0, DType::kFP32) : Mat{};
  DeviceArray<uint8_t> da(a.data.size()), das(a.scales.size()), db(b.data.size()), dbs(b.scales.size());
  da.upload(a.data), das.upload(a.scales), db.upload(b.data), dbs.upload(b.scales);
  DeviceArray<uint16_t> dbias(bias.size());
  DeviceArray<float> dscale(scale.size());
  if (c.bias) dbias.upload(to_device_bits(bias, DType::kBF16)), dscale.upload(std::vector<float>(scale.begin(), scale.end()));
  DeviceArray<int32_t> dsplits(c.groups);
  DeviceArray<int64_t> doffsets(c.groups + 1);
  DeviceArray<DeviceErrorRecord> derr(1);
  testing::memset_and_wait(derr.get(), 0, sizeof(DeviceErrorRecord));
  DeviceArray<uint16_t> dc(capacity * c.n);
  // Weights staged two experts at a time: several runs, the last one short when groups are odd.
  Staging staging(fprop_plan, c.groups, capacity, c.n, c.k, 2);

  kernels::Mxfp8RaggedGemmParams p;
  const DeviceArray<float> das_floats = scale_floats(a.scales, capacity, c.k);
  // fprop reads B's tiled scales (swap-AB: one bulk copy a stage), the dgrad plan below the row-wise
  // ones (4-byte copies): both producer paths on every case.
  const DeviceArray<uint8_t> dbs_tiled = tiled_scales_of(b.scales, c.groups, c.n, c.k);
  p.a = da.get(), p.a_scales = das.get(), p.b = db.get(), p.b_scales = dbs.get(), p.n = c.n, p.k = c.k;
  p.a_scale_floats = das_floats.get(), p.b_scales_tiled = dbs_tiled.get();
  p.splits = dsplits.get(), p.offsets = doffsets.get(), p.num_groups = c.groups;
  p.bias = c.bias ? dbias.get() : nullptr, p.bias_scale = c.bias ? dscale.get() : nullptr, p.c = dc.get();
  p.capacity_rows = capacity;
  p.staging = staging.buffer.get(), p.staging_bytes = staging.bytes;
  // The kept values, made by the library's dequantizer from B (as weights_changed makes them) into
  // poisoned memory; B's codes and scales are withheld.
  DeviceArray<uint16_t> b_values(values ? b.data.size() : 0);
  if (values) {
    b_values.poison();
    kernels::launch_dequantize_mxfp8_weights(db.get(), dbs.get(), b_values.get(), int64_t{c.groups} * c.n, c.k,
                                             stream.get());
    p.b = nullptr, p.b_scales = nullptr, p.b_dequantized = b_values.get();
  }
  auto enqueue = [&] {
    kernels::launch_group_offsets(p.splits, c.groups, c.row_align, capacity, doffsets.get(), derr.get(), stream.get());
    kernels::launch_mxfp8_ragged_gemm(fprop_plan, p, stream.get());
  };
  auto check = [&](const std::vector<int32_t>& splits, const std::string& where, bool with_bias = true) {
    const GroupLayout layout = make_layout(splits, c.row_align, capacity);
    const Mat ref = ref_fprop(layout, a.values, b.values, with_bias ? bias : Mat{}, with_bias ? scale : Mat{}, c.n, c.k);
    const auto got_bits = dc.download();
    Mat got(got_bits.size());
    for (std::size_t i = 0; i < got.size(); ++i) got[i] = from_bits(got_bits[i], DType::kBF16);
    EXPECT_TRUE(passed(all_close(where, got, ref, c.n, written_rows(layout), mxfp8_gemm_tolerance())));
    // Padding past the last group keeps its poison: never written.
    std::size_t touched = 0;
    const auto written = written_rows(layout);
    for (int64_t r = 0; r < capacity; ++r)
      if (!written[r]) touched += got_bits[r * c.n] != 0xffff;
    EXPECT_EQ(touched, 0u) << where << ": rows past the last group were written";
  };

  std::vector<int32_t> splits = random_splits(rng, c.groups, data_rows, Routing::kSkewed);
  splits[0] = 0;  // an empty group
  dsplits.upload(splits);
  dc.poison();
  enqueue();
  MG_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
  check(splits, detail::concat(c.name, " eager"));

  testing::Graph graph(stream.get(), enqueue);
  for (int replay = 0; replay < 2; ++replay) {
    splits = random_splits(rng, c.groups, data_rows - replay * 11, Routing::kUniform);
    dsplits.upload(splits);
    dc.poison();
    graph.launch(stream.get());
    MG_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
    check(splits, detail::concat(c.name, " graph replay ", replay));
  }

  // The route's dgrad plan on the same operands: to the GEMM, dgrad is the same form C = A · B_e^T
  // (B is then W^T [G, K, N], blocked along N), without bias. The staged route runs its fprop
  // kernel over the staged W^T there, here with weights in runs of three.
  const kernels::GemmPlan dgrad_plan = mxfp8_plan(kernels::GemmPhase::kDgrad, route, -1, 0, values);
  Staging dgrad_staging(dgrad_plan, c.groups, capacity, c.n, c.k, 3);
  p.bias = nullptr, p.bias_scale = nullptr, p.b_scales_tiled = nullptr;
  p.staging = dgrad_staging.buffer.get(), p.staging_bytes = dgrad_staging.bytes;
  splits = random_splits(rng, c.groups, data_rows, Routing::kSkewed);
  dsplits.upload(splits);
  dc.poison();
  kernels::launch_group_offsets(p.splits, c.groups, c.row_align, capacity, doffsets.get(), derr.get(), stream.get());
  kernels::launch_mxfp8_ragged_gemm(dgrad_plan, p, stream.get());
  MG_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
  check(splits, detail::concat(c.name, " dgrad plan"), false);

  // The staged route with A's bf16 values already at the start of the staging (a_staged, as the
  // operators' quantizer leaves them there): A's codes and scales are withheld.
  if (route == Mxfp8Route::kStaged) {
    dgrad_staging.buffer.poison();
    kernels::launch_group_offsets(p.splits, c.groups, c.row_align, capacity, doffsets.get(), derr.get(), stream.get());
    kernels::launch_dequantize_mxfp8_rowwise(da.get(), das.get(), DType::kBF16, dgrad_staging.buffer.get(), capacity,
                                             c.k, doffsets.get(), c.groups, stream.get());
    p.a = nullptr, p.a_scales = nullptr, p.a_staged = true;
    dc.poison();
    kernels::launch_mxfp8_ragged_gemm(dgrad_plan, p, stream.get());
    MG_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
    check(splits, detail::concat(c.name, " dgrad plan, A's values staged by the caller"), false);
  } else {  // the other routes read A's codes: a_staged is refused before anything is enqueued
    p.a_staged = true;
    EXPECT_THROW(kernels::launch_mxfp8_ragged_gemm(dgrad_plan, p, stream.get()), Error);
  }
  if (route == Mxfp8Route::kSwapAb) {  // which reads A's scales as floats: refused without them
    p.a_staged = false, p.a_scale_floats = nullptr;
    EXPECT_THROW(kernels::launch_mxfp8_ragged_gemm(dgrad_plan, p, stream.get()), Error);
  }
  EXPECT_EQ(derr.download()[0].code, 0);
}

const GemmCase kCases[] = {
    {"g4_k256_n128", 4, 256, 128, 1, false, 4},
    {"g8_k512_n384_bias_align32", 8, 512, 384, 32, true, 20},
    {"g3_k1024_n136_partial_tile", 3, 1024, 136, 16, true, 24},
    {"g64_k128_n256", 64, 128, 256, 1, false, 8},
    // Scales far from 1 (A's E8M0 bytes 37-97, B's 157-217), whose products are still normal: the
    // swap-AB kernel's promotion decodes them one by one instead of adding exponent fields.
    {"g8_k512_n256_scales_far_from_one", 8, 512, 256, 32, true, 30, 60},
    // Groups of several 128-row tiles, long reductions: many tiles per CTA, chunks across tiles.
    {"g5_k1536_n384_rows300", 5, 1536, 384, 1, true, 6, 0, 300},
    // Decode: a row or a few a group and few tiles, so the swap-AB route cuts each tile's reduction
    // over several CTAs (8 splits of 4 stages here; 4 uneven ones of 4 and 5 stages below, with a
    // partial column tile) and sums them in the last split to arrive.
    {"g6_k4096_n256_rows1_split8", 6, 4096, 256, 1, true, 6, 0, 1},
    {"g2_k2176_n520_rows5_split4", 2, 2176, 520, 1, false, 10, 0, 5},
    // Between a quarter of the CTAs and one tile per SM (at most 14 row tiles x 9 column tiles, the
    // last partial: 126, checked to take the deep-ring kernel on a device of 126 SMs or more): the
    // swap-AB route's launches (the dgrad plan runs the same shape) take the deep-ring kernel, one
    // CTA per SM, its 8 stages wrapping twice over 16.
    {"g12_k2048_n1096_rows2_deep_ring", 12, 2048, 1096, 1, true, 8, 0, 2},
    // The deep ring's two consumer pairs take its stages in turn and add their sums at the tile's
    // end: an odd count of stages (11) with about 20 rows a group (skewed: J = 1 to 4; at most 84
    // tiles by the host's bound), and a single stage, so that the second pair adds nothing.
    {"g12_k1408_n512_rows20_deep_ring_odd_stages", 12, 1408, 512, 1, true, 8, 0, 20},
    {"g12_k128_n1096_rows2_deep_ring_one_stage", 12, 128, 1096, 1, false, 8, 0, 2},
    // The capacity 3 rows past the data (32 rows, 35 capacity): the last group's 32-row tile starts
    // fewer than 32 rows before the capacity, so the swap-AB route's copy of A's scale floats is
    // short there (its only copy whose size varies).
    {"g3_k512_n256_rows9_short_last_tile", 3, 512, 256, 1, false, 8, 0, 9, 0},
};
INSTANTIATE_TEST_SUITE_P(Cases, Mxfp8Gemm,
                         ::testing::Combine(::testing::ValuesIn(kCases), ::testing::ValuesIn(kGemmRoutes)),
                         [](const auto& info) {
                           const RouteChoice r = std::get<1>(info.param);
                           return std::string(std::get<0>(info.param).name) + "_" + route_name(r.route) +
                                  (r.dequantized_weights ? "_dequantized_weights" : "");
                         });

// wgrad from column-wise operands: tiled codes (mx_colwise_index) with block-major scales
// [capacity / 32][cols]; rows outside the groups' data hold zero codes (the gap rows are zero in a
// real step), rows past the last group hold garbage the kernel must not read.
struct ColumnWise {
  std::vector<uint8_t> data, scales;
  Mat values;  // [capacity][cols], row-major (the reference's layout)
};
ColumnWise random_column_wise(std::mt19937_64& rng, const GroupLayout& l, int64_t cols, int spread) {
  const int64_t cap = l.capacity_rows;
  ColumnWise m;
  m.data.resize(cols * cap);
  m.scales.resize(cap / 32 * cols);
  m.values.assign(cap * cols, 0.0);
  const auto data = data_rows(l);
  std::uniform_int_distribution<int> code(0, 255), exp(127 - spread, 127 + spread);
  for (auto& v : m.scales) v = static_cast<uint8_t>(exp(rng));
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t r = 0; r < cap; ++r) {
      uint8_t q = static_cast<uint8_t>(code(rng));
      if ((q & 0x7f) == 0x7f) q ^= 1;
      const bool past_last = r >= l.offsets.back();
      if (!data[r] && !past_last) q = 0;
      m.data[mx_colwise_index(r, c, cap, cols)] = q;  // the tiled column-wise layout
      if (data[r]) m.values[r * cols + c] = e4m3_decode(q) * e8m0_decode(m.scales[(r / 32) * cols + c]);
    }
  return m;
}

// wgrad on the E4M3 kernel and on the staged route with each bf16 wgrad kernel it may run:
// ping-pong consumers (short reductions), 128-wide and 256-wide shared tiles.
struct WgradRoute {
  const char* name;
  Mxfp8Route route;
  int ping_pong, tile_n;  // forced onto the staged route's bf16 kernel (-1, 0: the heuristic's)
};
constexpr WgradRoute kWgradRoutes[] = {{"row_tiles", Mxfp8Route::kE4m3, -1, 0},
                                       {"staged_ping_pong", Mxfp8Route::kStaged, 1, 0},
                                       {"staged_128", Mxfp8Route::kStaged, 0, 128},
                                       {"staged_256", Mxfp8Route::kStaged, 0, 256}};
class Mxfp8Wgrad : public ::testing::TestWithParam<WgradRoute> {};
TEST_P(Mxfp8Wgrad, MatchesReferenceWrittenAndAccumulated) {
  std::mt19937_64 rng(test_seed("mxfp8_wgrad"));
  const int groups = 6;
  const int64_t n = 144, k = 272, data_rows_total = 700;
  const int64_t capacity = (data_rows_total + groups * 31 + 64 + 31) / 32 * 32;
  std::vector<int32_t> splits = random_splits(rng, groups, data_rows_total, Routing::kSkewed);
  splits[2] = 0;
  splits[4] += splits[5], splits[5] = 1;  // a one-row group
  const GroupLayout layout = make_layout(splits, 32, capacity);
  const ColumnWise dy = random_column_wise(rng, layout, n, 6), x = random_column_wise(rng, layout, k, 6);
  const Mat ref = ref_wgrad(layout, dy.values, x.values, n, k);
  const WgradRoute r = GetParam();
  const kernels::GemmPlan wgrad_plan = mxfp8_plan(kernels::GemmPhase::kWgrad, r.route, r.ping_pong, r.tile_n);
  if (r.route == Mxfp8Route::kStaged) {
    EXPECT_EQ(wgrad_plan.config.ping_pong, r.ping_pong == 1) << wgrad_plan.config.to_string();
    if (r.tile_n != 0) {
      EXPECT_EQ(wgrad_plan.config.block_n, r.tile_n) << wgrad_plan.config.to_string();
    }
  }
  Staging staging(wgrad_plan, groups, capacity, n, k);
  DeviceArray<uint8_t> ddy(dy.data.size()), ddys(dy.scales.size()), dx(x.data.size()), dxs(x.scales.size());
  ddy.upload(dy.data), ddys.upload(dy.scales), dx.upload(x.data), dxs.upload(x.scales);
  DeviceArray<int32_t> dsplits(groups);
  DeviceArray<int64_t> doffsets(groups + 1);
  dsplits.upload(splits), doffsets.upload(layout.offsets);
  DeviceArray<uint16_t> dw(groups * n * k);
  DeviceArray<float> mg(groups * n * k);
  kernels::Mxfp8WgradParams p;
  p.dy_t = ddy.get(), p.dy_t_scales = ddys.get(), p.x_t = dx.get(), p.x_t_scales = dxs.get();
  p.n = n, p.k = k, p.capacity_rows = capacity, p.splits = dsplits.get(), p.offsets = doffsets.get();
  p.num_groups = groups;
  p.staging = staging.buffer.get(), p.staging_bytes = staging.bytes;

  dw.poison();
  p.dweight = dw.get();
  kernels::launch_mxfp8_wgrad(wgrad_plan, p, nullptr);
  const auto bits = dw.download();
  Mat got(bits.size());
  for (std::size_t i = 0; i < got.size(); ++i) got[i] = from_bits(bits[i], DType::kBF16);
  EXPECT_TRUE(passed(all_close("mxfp8 wgrad dweight", got, ref, k, {}, mxfp8_gemm_tolerance())));

  const Mat init = random_values(rng, groups * n * k, 1.0, DType::kFP32);
  mg.upload(std::vector<float>(init.begin(), init.end()));
  p.dweight = nullptr, p.main_grad = mg.get();
  testing::Stream stream;
  testing::Graph graph(stream.get(), [&] { kernels::launch_mxfp8_wgrad(wgrad_plan, p, stream.get()); });
  graph.launch(stream.get());
  MG_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
  const auto acc = mg.download();
  Mat delta(acc.size());
  for (std::size_t i = 0; i < acc.size(); ++i) delta[i] = acc[i] - init[i];
  EXPECT_TRUE(passed(all_close("mxfp8 wgrad main_grad increment", delta, ref, k, {}, mxfp8_gemm_tolerance())));
  for (int64_t i = 0; i < n * k; ++i)  // group 2 is empty: main_grad unchanged, bit for bit
    ASSERT_EQ(acc[2 * n * k + i], static_cast<float>(init[2 * n * k + i])) << "empty group's main_grad changed";

  // dy's bf16 values given made (Mxfp8WgradParams::dy_values: what dy's quantizer writes for the
  // staged route), dy's codes not given at all, in the smaller staging that then suffices: dW bit for
  // bit that of the codes. The E4M3 kernel reads codes: it refuses them.
  DeviceArray<uint16_t> dy_values(capacity * n);
  dy_values.poison();
  kernels::launch_dequantize_mxfp8_colwise(ddy.get(), ddys.get(), DType::kBF16, dy_values.get(), capacity, n,
                                           doffsets.get(), groups, nullptr);
  kernels::Mxfp8WgradParams pv = p;
  pv.dy_t = nullptr, pv.dy_t_scales = nullptr, pv.dy_values = dy_values.get();
  pv.dweight = dw.get(), pv.main_grad = nullptr;
  if (r.route != Mxfp8Route::kStaged) {
    EXPECT_THROW(kernels::launch_mxfp8_wgrad(wgrad_plan, pv, nullptr), Error);
    return;
  }
  const std::size_t smaller = kernels::mxfp8_staged_wgrad_bytes(capacity, n, k, true);
  EXPECT_LT(smaller, staging.bytes);
  DeviceArray<uint8_t> x_only(smaller);
  x_only.poison();
  pv.staging = x_only.get(), pv.staging_bytes = smaller;
  dw.poison();
  kernels::launch_mxfp8_wgrad(wgrad_plan, pv, nullptr);
  MG_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(dw.download(), bits) << "dW from dy's values differs from dW from its codes";
  pv.staging_bytes = smaller - 1;  // too small: refused before anything is enqueued
  EXPECT_THROW(kernels::launch_mxfp8_wgrad(wgrad_plan, pv, nullptr), Error);
}
INSTANTIATE_TEST_SUITE_P(Kernels, Mxfp8Wgrad, ::testing::ValuesIn(kWgradRoutes),
                         [](const auto& info) { return std::string(info.param.name); });

// A NaN scale (E8M0 0xFF) or a NaN code (0x7F, 0xFF), of A or of the weights, poisons exactly the
// outputs that block feeds: never silently a number.
class Mxfp8GemmNaN : public ::testing::TestWithParam<Mxfp8Route> {};
TEST_P(Mxfp8GemmNaN, NanScalePropagatesToItsRowOnly) {
  std::mt19937_64 rng(5);
  const int groups = 2;
  const int64_t k = 256, n = 128, rows = 64;
  const kernels::GemmPlan fprop_plan = mxfp8_plan(kernels::GemmPhase::kFprop, GetParam());
  Staging staging(fprop_plan, groups, rows, n, k);
  Mx a = random_mx(rng, rows, k, 2);
  const Mx b = random_mx(rng, groups * n, k, 2);
  a.scales[10 * (k / 32) + 3] = 0xff;  // row 10, K block 3
  a.data[40 * k + 77] = 0x7f;          // row 40: one NaN code under a finite scale
  a.data[50 * k + 200] = 0xff;         // row 50: the negative NaN code
  DeviceArray<uint8_t> da(a.data.size()), das(a.scales.size()), db(b.data.size()), dbs(b.scales.size());
  da.upload(a.data), das.upload(a.scales), db.upload(b.data), dbs.upload(b.scales);
  DeviceArray<int32_t> dsplits(groups);
  DeviceArray<int64_t> doffsets(groups + 1);
  DeviceArray<DeviceErrorRecord> derr(1);
  testing::memset_and_wait(derr.get(), 0, sizeof(DeviceErrorRecord));
  dsplits.upload({32, 32});
  DeviceArray<uint16_t> dc(rows * n);
  kernels::launch_group_offsets(dsplits.get(), groups, 1, rows, doffsets.get(), derr.get(), nullptr);
  kernels::Mxfp8RaggedGemmParams p;
  const DeviceArray<float> das_floats = scale_floats(a.scales, rows, k);
  const DeviceArray<uint8_t> dbs_tiled = tiled_scales_of(b.scales, groups, n, k);
  p.a = da.get(), p.a_scales = das.get(), p.b = db.get(), p.b_scales = dbs.get(), p.n = n, p.k = k;
  p.a_scale_floats = das_floats.get(), p.b_scales_tiled = dbs_tiled.get();
  p.splits = dsplits.get(), p.offsets = doffsets.get(), p.num_groups = groups, p.c = dc.get();
  p.capacity_rows = rows;
  p.staging = staging.buffer.get(), p.staging_bytes = staging.bytes;
  kernels::launch_mxfp8_ragged_gemm(fprop_plan, p, nullptr);
  const auto got = dc.download();
  int nan_rows = 0;
  for (int64_t r = 0; r < rows; ++r) {
    int nans = 0;
    for (int64_t col = 0; col < n; ++col) nans += std::isnan(from_bits(got[r * n + col], DType::kBF16));
    if (r == 10 || r == 40 || r == 50) EXPECT_EQ(nans, n) << "every output of row " << r << " reads a NaN";
    else EXPECT_EQ(nans, 0) << "row " << r;
    nan_rows += nans > 0;
  }
  EXPECT_EQ(nan_rows, 3);

  // A NaN code in a weight row under a finite scale: output column 77 of group 1's rows (32-63)
  // turns NaN as well, and nothing else does.
  Mx b_nan = b;
  b_nan.data[(n + 77) * k + 130] = 0x7f;  // group 1, weight row 77, K block 4
  db.upload(b_nan.data);
  dc.poison();
  kernels::launch_mxfp8_ragged_gemm(fprop_plan, p, nullptr);
  const auto got_w = dc.download();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t col = 0; col < n; ++col) {
      const bool nan = std::isnan(from_bits(got_w[r * n + col], DType::kBF16));
      const bool want = r == 10 || r == 40 || r == 50 || (r >= 32 && col == 77);
      EXPECT_EQ(nan, want) << "row " << r << ", column " << col << " after a NaN weight code";
    }
}
INSTANTIATE_TEST_SUITE_P(Kernels, Mxfp8GemmNaN, ::testing::ValuesIn(kRoutes),
                         [](const auto& info) { return route_name(info.param); });


// Every finite E4M3 code at scales across the E8M0 range (0, the edges of the dequantizing kernel's
// fast path at 134 / 135, and up to 246, where 448 x 2^119 is still finite) through a GEMM whose
// weights are the identity (code 0x38 = 1, scale 2^0): each output is then one product, so it must
// equal the dequantized code rounded to bf16 bit for bit (zeros by value), subnormals included. A conversion error
// the accumulated sums of the other tests could hide shows here.
class Mxfp8GemmExact : public ::testing::TestWithParam<Mxfp8Route> {};
TEST_P(Mxfp8GemmExact, IdentityWeightsReturnEveryCodeExactly) {
  const int64_t k = 256, n = 256, rows = 96;
  const uint8_t kScaleBytes[] = {0, 1, 7, 64, 100, 119, 120, 126, 127, 128, 133, 134, 135, 200, 246};
  std::vector<uint8_t> a(rows * k), as(rows * k / 32), b(n * k, 0), bs(n * k / 32, 127);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < k; ++c) {
      uint8_t code = static_cast<uint8_t>((c + 37 * r) % 256);
      if ((code & 0x7f) == 0x7f) code ^= 0x40;  // NaN codes would poison whole rows (see Mxfp8GemmNaN)
      a[r * k + c] = code;
    }
  for (std::size_t i = 0; i < as.size(); ++i) as[i] = kScaleBytes[i % std::size(kScaleBytes)];
  for (int64_t i = 0; i < n; ++i) b[i * k + i] = 0x38;
  DeviceArray<uint8_t> da(a.size()), das(as.size()), db(b.size()), dbs(bs.size());
  da.upload(a), das.upload(as), db.upload(b), dbs.upload(bs);
  DeviceArray<int32_t> dsplits(1);
  DeviceArray<int64_t> doffsets(2);
  dsplits.upload({static_cast<int32_t>(rows)}), doffsets.upload({0, rows});
  DeviceArray<uint16_t> dc(rows * n);
  dc.poison();
  kernels::Mxfp8RaggedGemmParams p;
  const DeviceArray<float> das_floats = scale_floats(as, rows, k);
  p.a = da.get(), p.a_scales = das.get(), p.b = db.get(), p.b_scales = dbs.get(), p.n = n, p.k = k;
  p.a_scale_floats = das_floats.get();
  p.splits = dsplits.get(), p.offsets = doffsets.get(), p.num_groups = 1, p.c = dc.get(), p.capacity_rows = rows;
  const kernels::GemmPlan plan = mxfp8_plan(kernels::GemmPhase::kFprop, GetParam());
  Staging staging(plan, 1, rows, n, k);
  p.staging = staging.buffer.get(), p.staging_bytes = staging.bytes;
  kernels::launch_mxfp8_ragged_gemm(plan, p, nullptr);
  const auto got = dc.download();
  int wrong = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < n; ++c) {
      const double v = e4m3_decode(a[r * k + c]) * e8m0_decode(as[(r * k + c) / 32]);
      const uint16_t want = to_bits(v, DType::kBF16);
      // -0 (code 0x80) times 1 plus the other columns' +0 products sums to +0: zeros compare by value.
      const bool zeros = (got[r * n + c] & 0x7fff) == 0 && (want & 0x7fff) == 0;
      if (got[r * n + c] != want && !zeros && wrong++ < 8)
        ADD_FAILURE() << "row " << r << " code 0x" << std::hex << int{a[r * k + c]} << " scale byte " << std::dec
                      << int{as[(r * k + c) / 32]} << ": got bf16 0x" << std::hex << got[r * n + c] << ", want 0x"
                      << want;
    }
  EXPECT_EQ(wrong, 0);
}
INSTANTIATE_TEST_SUITE_P(Kernels, Mxfp8GemmExact, ::testing::ValuesIn(kRoutes),
                         [](const auto& info) { return route_name(info.param); });

}  // namespace
}  // namespace moegraph::test
