// moegraph-bench --kernels: times the grouped fprop, dgrad and wgrad kernels alone by CUDA-graph
// replay, side by side with the dense cuBLASLt GEMM of the same total rows and the per-expert
// cuBLASLt loop with host-synced splits (the legacy way), on uniform and skewed routings.
// Method (docs/PERF.md): a fresh random routing before every replay, CUDA-event timing of the
// replay alone, medians, input sets rotated so L2 (50-60 MB) cannot hold them, no zero data.
// Each phase is judged against its roofline (tools/bench/roofline.hpp), measured in the same run.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "kernels/grouped_gemm/grouped_gemm.hpp"
#include "kernels/elementwise/elementwise.hpp"
#include "kernels/quantize/mxfp8.hpp"
#include "kernels/routing/offsets.hpp"
#include "moegraph/error.hpp"
#include "src/core/device_buffer.hpp"
#include "src/core/lt_gemm.hpp"
#include "testing/legacy_loop.hpp"
#include "testing/mxfp8_reference.hpp"
#include "graphs/graph_exec.hpp"
#include "src/core/device_info.hpp"
#include "tools/bench/bench_util.hpp"
#include "tools/bench/json_results.hpp"
#include "tools/bench/kernel_bench.hpp"
#include "tools/bench/roofline.hpp"

namespace moegraph::bench {
namespace {

// Expert FC1 of the four presets (N = 2 * ffn: gate and up), at training/prefill sizes and decode.
const KernelShape kShapes[] = {
    {"mixtral_fc1", 8, 4096, 28672, 16384},
    {"deepseek_shard_fc1", 32, 7168, 4096, 32768},
    {"qwen3_fc1", 128, 2048, 1536, 32768},
    {"decode_fc1", 64, 4096, 2816, 768},
};
const KernelShape kQuickShapes[] = {
    {"qwen3_fc1_small", 128, 2048, 1536, 8192},
    {"decode_fc1", 64, 4096, 2816, 768},
};
// Fine-grained experts that are not presets: 60-256 experts of 40-500 rows, K and N from 1024 to
// 7168 (FC1- and FC2-like), memory-bound on the weights (fprop, dgrad) or their gradients (wgrad).
const KernelShape kFineShapes[] = {
    {"fine60_k2048_n2816", 60, 2048, 2816, 10240},     // ~170 rows per expert
    {"fine64_k2048_n2048", 64, 2048, 2048, 32000},     // 500
    {"fine128_k4096_n3072", 128, 4096, 3072, 16384},   // 128
    {"fine128_k1536_n4096", 128, 1536, 4096, 5120},    // 40
    {"fine256_k7168_n1024", 256, 7168, 1024, 32768},   // 128
    {"fine256_k2048_n7168", 256, 2048, 7168, 20480},   // 80
};

// kWgradMainGrad: wgrad accumulated into fp32 main_grad (the training step's), against the dense
// GEMM accumulating into one fp32 [N, K] and the legacy loop accumulating too.
enum class Phase { kFprop, kDgrad, kWgrad, kWgradMainGrad };
kernels::GemmPhase gemm_phase(Phase p) {
  return p == Phase::kFprop ? kernels::GemmPhase::kFprop
         : p == Phase::kDgrad ? kernels::GemmPhase::kDgrad
                              : kernels::GemmPhase::kWgrad;
}
// The kernel the library's heuristic picks for this shape and phase (optionally forcing the
// 16-bit load pipeline), prepared on this device.
kernels::GemmPlan plan_for(const KernelShape& s, Phase phase, Recipe recipe, int64_t capacity_rows, int sm_count,
                           GemmPipeline forced = GemmPipeline::kAuto, bool dequantized_weights = false) {
  kernels::GemmProblem problem;
  problem.dequantized_weights = dequantized_weights;
  problem.phase = gemm_phase(phase);
  problem.recipe = recipe;
  problem.groups = s.groups;
  problem.capacity_rows = capacity_rows;
  problem.expected_rows_per_group = capacity_rows / s.groups;
  problem.n = s.n;
  problem.k = s.k;
  problem.into_main_grad = phase == Phase::kWgradMainGrad;
  kernels::GemmOverrides overrides;
  overrides.pipeline = forced;
  kernels::GemmConfig config = kernels::choose_gemm_config(problem, kernels::with_environment(overrides));
  if (forced != GemmPipeline::kAuto && recipe == Recipe::kBF16)  // the same tile on the forced pipeline
    config = kernels::choose_gemm_config(problem, [&] {
      kernels::GemmOverrides o = kernels::with_environment({});
      o.tile_n = config.block_n, o.pipeline = forced;
      return o;
    }());
  return kernels::prepare_gemm(config, sm_count);
}

const char* phase_name(Phase p) {
  return p == Phase::kFprop ? "fprop" : p == Phase::kDgrad ? "dgrad" : p == Phase::kWgrad ? "wgrad" : "wgrad+mg";
}

struct Buffers {
  std::vector<DeviceBuffer> x, dy, out_rows;  // rotated input sets; outputs per set
  DeviceBuffer w, dw, main_grad, dense_main_grad, splits, offsets, error, routings;
};

void fill_random(DeviceBuffer& b, std::size_t elems, std::mt19937_64& rng) {
  std::vector<uint16_t> host(elems);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  for (auto& h : host) {
    const float f = dist(rng);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    h = static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
  }
  MG_CUDA_CHECK(cudaMemcpy(b.get(), host.data(), elems * 2, cudaMemcpyHostToDevice));
}

struct Result {
  double grouped_ms, cp_async_ms, dense_ms, legacy_ms;  // grouped: the chosen pipeline; cp_async: the v4 kernels
};

// MXFP8 operands of a shape (one input set: every operand but decode's x already exceeds L2):
// random finite E4M3 codes, E8M0 scales within 2^+-7, row-wise copies for fprop / dgrad and
// column-wise ones (over 32-aligned groups) for wgrad.
struct MxBuffers {
  DeviceBuffer x, xs, dy, dys;    // row-wise [rows, k] / [rows, n] and their scales
  DeviceBuffer xsf, dysf;         // the same scales as floats (what the swap-AB route reads of A)
  DeviceBuffer w, ws, wt, wts;    // [G, n, k] along k; [G, k, n] along n
  DeviceBuffer ws_tiled, wts_tiled;  // ws and wts in the swap-AB route's tile order (as weights_changed makes them)
  DeviceBuffer x_t, x_ts, dy_t, dy_ts;  // column-wise [k | n, cap32], scales [cap32 / 32, k | n]
  DeviceBuffer offsets32;         // group offsets with row_align 32
  int64_t cap32 = 0;
};
DeviceBuffer random_mx_bytes(std::size_t count, bool scales, std::mt19937_64& rng) {
  std::vector<uint8_t> host(count);
  if (scales) {
    std::uniform_int_distribution<int> exp(120, 134);
    for (auto& h : host) h = static_cast<uint8_t>(exp(rng));
  } else {  // eight codes per draw: the fine-grained shapes hold billions
    for (std::size_t i = 0; i < count; i += 8) {
      const uint64_t bits = rng();
      std::memcpy(host.data() + i, &bits, std::min<std::size_t>(8, count - i));
    }
    for (auto& h : host)
      if ((h & 0x7f) == 0x7f) h ^= 1;  // never the NaN code
  }
  DeviceBuffer d(count);
  MG_CUDA_CHECK(cudaMemcpy(d.get(), host.data(), count, cudaMemcpyHostToDevice));
  return d;
}
// E8M0 scales [rows, cols / 32] on the device as the floats the swap-AB route reads, stage-major
// (set-up only: read back, decoded and laid out on the host).
DeviceBuffer scale_floats_of(const DeviceBuffer& scales, int64_t rows, int64_t cols) {
  std::vector<uint8_t> bytes(rows * cols / 32);
  MG_CUDA_CHECK(cudaMemcpy(bytes.data(), scales.get(), bytes.size(), cudaMemcpyDeviceToHost));
  const std::vector<float> floats = testing::e8m0_floats(bytes, rows, cols);
  DeviceBuffer d(floats.size() * sizeof(float));
  MG_CUDA_CHECK(cudaMemcpy(d.get(), floats.data(), floats.size() * sizeof(float), cudaMemcpyHostToDevice));
  return d;
}
// Weight scales [groups, rows, cols / 32] in the swap-AB route's tile order, by the library's kernel.
DeviceBuffer tiled_scales_of(const DeviceBuffer& scales, int groups, int64_t rows, int64_t cols) {
  DeviceBuffer d(kernels::mxfp8_tiled_scale_bytes(groups, rows, cols));
  kernels::launch_tile_mxfp8_scales(scales.as<uint8_t>(), d.as<uint8_t>(), groups, rows, cols, nullptr);
  MG_CUDA_CHECK(cudaDeviceSynchronize());
  return d;
}
MxBuffers make_mx_buffers(const KernelShape& s, std::mt19937_64& rng) {
  MxBuffers m;
  m.cap32 = (s.rows + int64_t{s.groups} * 31 + 31) / 32 * 32;
  m.x = random_mx_bytes(s.rows * s.k, false, rng), m.xs = random_mx_bytes(s.rows * s.k / 32, true, rng);
  m.dy = random_mx_bytes(s.rows * s.n, false, rng), m.dys = random_mx_bytes(s.rows * s.n / 32, true, rng);
  m.xsf = scale_floats_of(m.xs, s.rows, s.k), m.dysf = scale_floats_of(m.dys, s.rows, s.n);
  m.w = random_mx_bytes(s.groups * s.n * s.k, false, rng), m.ws = random_mx_bytes(s.groups * s.n * s.k / 32, true, rng);
  m.wt = random_mx_bytes(s.groups * s.n * s.k, false, rng), m.wts = random_mx_bytes(s.groups * s.n * s.k / 32, true, rng);
  m.ws_tiled = tiled_scales_of(m.ws, s.groups, s.n, s.k), m.wts_tiled = tiled_scales_of(m.wts, s.groups, s.k, s.n);
  m.x_t = random_mx_bytes(s.k * m.cap32, false, rng), m.x_ts = random_mx_bytes(m.cap32 / 32 * s.k, true, rng);
  m.dy_t = random_mx_bytes(s.n * m.cap32, false, rng), m.dy_ts = random_mx_bytes(m.cap32 / 32 * s.n, true, rng);
  m.offsets32 = DeviceBuffer((s.groups + 1) * 8);
  return m;
}

const char* mxfp8_route_name(kernels::GemmFamily family) {
  switch (family) {
    case kernels::GemmFamily::kMxfp8SwapAb: return "swap_ab";
    case kernels::GemmFamily::kMxfp8Dequant: return "dequant";
    case kernels::GemmFamily::kMxfp8Staged: return "staged";
    default: return "e4m3";
  }
}

// One MXFP8 phase on the same routings, graph-replayed like the bf16 kernels: its time and the
// route (kernel family) the heuristic chose. With `dequantized`, the route the heuristic picks for
// weights kept dequantized (dequantized_weights), their bf16 values made here at set-up; ms is 0
// where that is the same route as without (swap-AB, wgrad).
struct MxResult {
  double ms;
  kernels::GemmFamily family;
};
MxResult run_mxfp8(const KernelShape& s, Phase phase, const std::vector<std::vector<int32_t>>& routings, Buffers& b,
                 const MxBuffers& mx, int sm_count, int replays, cudaStream_t stream, bool dequantized = false) {
  const kernels::GemmPlan plan = plan_for(s, phase, Recipe::kMXFP8, phase == Phase::kWgrad ? mx.cap32 : s.rows,
                                          sm_count, GemmPipeline::kAuto, dequantized);  // set-up
  if (dequantized && !plan.config.dequantized_weights) return {0, plan.config.family};
  DeviceBuffer values;
  if (plan.config.dequantized_weights) {
    const bool fprop_weights = phase == Phase::kFprop;
    values = DeviceBuffer(s.groups * s.n * s.k * 2);
    kernels::launch_dequantize_mxfp8_weights((fprop_weights ? mx.w : mx.wt).as<uint8_t>(),
                                             (fprop_weights ? mx.ws : mx.wts).as<uint8_t>(), values.get(),
                                             s.groups * (fprop_weights ? s.n : s.k), fprop_weights ? s.k : s.n,
                                             stream);
  }
  auto splits = b.splits.as<int32_t>();
  auto offsets = b.offsets.as<int64_t>();
  auto err = b.error.as<DeviceErrorRecord>();
  // The staged route's scratch (its dequantizing passes are part of the time).
  const bool fprop = phase == Phase::kFprop, wgrad = phase == Phase::kWgrad;
  const DeviceBuffer staging(kernels::mxfp8_staging_bytes(plan.config, s.groups, wgrad ? mx.cap32 : s.rows,
                                                          fprop || wgrad ? s.n : s.k, fprop || wgrad ? s.k : s.n));
  auto grouped = [&] {
    if (wgrad) {
      auto off32 = mx.offsets32.as<int64_t>();
      kernels::launch_group_offsets(splits, s.groups, 32, mx.cap32, off32, err, stream);
      kernels::Mxfp8WgradParams p;
      p.dy_t = mx.dy_t.as<uint8_t>(), p.dy_t_scales = mx.dy_ts.as<uint8_t>();
      p.x_t = mx.x_t.as<uint8_t>(), p.x_t_scales = mx.x_ts.as<uint8_t>();
      p.n = s.n, p.k = s.k, p.capacity_rows = mx.cap32, p.splits = splits, p.offsets = off32;
      p.num_groups = s.groups, p.dweight = b.dw.get();
      p.staging = staging.get(), p.staging_bytes = staging.bytes();
      kernels::launch_mxfp8_wgrad(plan, p, stream);
      return;
    }
    kernels::launch_group_offsets(splits, s.groups, 1, s.rows, offsets, err, stream);
    kernels::Mxfp8RaggedGemmParams p;
    p.a = (fprop ? mx.x : mx.dy).as<uint8_t>(), p.a_scales = (fprop ? mx.xs : mx.dys).as<uint8_t>();
    p.a_scale_floats = (fprop ? mx.xsf : mx.dysf).as<float>();
    p.b_scales_tiled = (fprop ? mx.ws_tiled : mx.wts_tiled).as<uint8_t>();
    p.b = (fprop ? mx.w : mx.wt).as<uint8_t>(), p.b_scales = (fprop ? mx.ws : mx.wts).as<uint8_t>();
    p.n = fprop ? s.n : s.k, p.k = fprop ? s.k : s.n;
    p.splits = splits, p.offsets = offsets, p.num_groups = s.groups, p.c = b.out_rows[0].get();
    p.capacity_rows = s.rows;
    p.staging = staging.get(), p.staging_bytes = staging.bytes();
    p.b_dequantized = values.get();
    kernels::launch_mxfp8_ragged_gemm(plan, p, stream);
  };
  auto set_routing = [&](int i) {
    MG_CUDA_CHECK(cudaMemcpyAsync(splits, b.routings.as<int32_t>() + (i % routings.size()) * s.groups,
                                  s.groups * sizeof(int32_t), cudaMemcpyDeviceToDevice, stream));
  };
  set_routing(0);
  grouped();
  MG_CUDA_CHECK(cudaStreamSynchronize(stream));
  GraphExec graph(stream, grouped);
  EventTimer timer;
  std::vector<float> t;
  for (int i = 0; i < replays; ++i) {
    set_routing(i);
    t.push_back(timer.time(stream, [&] { graph.launch(stream); }));
  }
  return {median(t), plan.config.family};
}

Result run_phase(const KernelShape& s, Phase phase, const std::vector<std::vector<int32_t>>& routings, Buffers& b,
                 int sm_count, int sets, int replays, cudaStream_t stream) {
  LtGemm lt;
  LegacyExpertLoop legacy(s.groups, s.n, s.k, s.rows, 1, DType::kBF16);
  const int64_t g = s.groups;
  auto splits = b.splits.as<int32_t>();
  auto offsets = b.offsets.as<int64_t>();
  auto err = b.error.as<DeviceErrorRecord>();

  const kernels::GemmPlan chosen = plan_for(s, phase, Recipe::kBF16, s.rows, sm_count);
  const kernels::GemmPlan cp_async_plan = plan_for(s, phase, Recipe::kBF16, s.rows, sm_count, GemmPipeline::kCpAsync);
  auto grouped_on = [&](int set, const kernels::GemmPlan& plan) {
    kernels::launch_group_offsets(splits, s.groups, 1, s.rows, offsets, err, stream);
    if (phase == Phase::kWgrad || phase == Phase::kWgradMainGrad) {
      kernels::WgradParams p;
      p.dy = b.dy[set].get(), p.x = b.x[set].get(), p.n = s.n, p.k = s.k, p.capacity_rows = s.rows;
      p.splits = splits, p.offsets = offsets, p.num_groups = s.groups;
      if (phase == Phase::kWgrad) p.dweight = b.dw.get();
      else p.main_grad = b.main_grad.as<float>();
      kernels::launch_grouped_wgrad(plan, p, stream);
      return;
    }
    kernels::RaggedGemmParams p;
    const bool fprop = phase == Phase::kFprop;
    p.a = fprop ? b.x[set].get() : b.dy[set].get();
    p.w = b.w.get(), p.n = s.n, p.k = s.k, p.splits = splits, p.offsets = offsets, p.num_groups = s.groups;
    p.c = b.out_rows[set].get(), p.capacity_rows = s.rows;
    kernels::launch_ragged_gemm(plan, p, stream);
  };
  auto grouped = [&](int set) { grouped_on(set, chosen); };
  auto cp_async = [&](int set) { grouped_on(set, cp_async_plan); };
  auto dense = [&](int set) {
    RowMajorGemm d;
    if (phase == Phase::kFprop) {
      d.trans_b = true, d.m = s.rows, d.n = s.n, d.k = s.k;
      d.a = b.x[set].get(), d.lda = s.k, d.b = b.w.get(), d.ldb = s.k, d.c = b.out_rows[set].get(), d.ldc = s.n;
    } else if (phase == Phase::kDgrad) {
      d.m = s.rows, d.n = s.k, d.k = s.n;
      d.a = b.dy[set].get(), d.lda = s.n, d.b = b.w.get(), d.ldb = s.k, d.c = b.out_rows[set].get(), d.ldc = s.k;
    } else {
      d.trans_a = true, d.m = s.n, d.n = s.k, d.k = s.rows;
      d.a = b.dy[set].get(), d.lda = s.n, d.b = b.x[set].get(), d.ldb = s.k, d.c = b.dw.get(), d.ldc = s.k;
      if (phase == Phase::kWgradMainGrad) d.c = b.dense_main_grad.get(), d.c_type = DType::kFP32, d.beta = 1.0f;
    }
    lt.run(d, stream);
  };
  auto legacy_run = [&](int set) {
    if (phase == Phase::kFprop) legacy.fprop_not_capturable(b.x[set].get(), splits, b.w.get(), b.out_rows[set].get(), stream);
    else if (phase == Phase::kDgrad) legacy.dgrad_not_capturable(b.dy[set].get(), splits, b.w.get(), b.out_rows[set].get(), stream);
    else if (phase == Phase::kWgrad)
      legacy.wgrad_not_capturable(b.dy[set].get(), b.x[set].get(), splits, b.dw.get(), nullptr, stream);
    else legacy.wgrad_not_capturable(b.dy[set].get(), b.x[set].get(), splits, nullptr, b.main_grad.as<float>(), stream);
  };

  auto set_routing = [&](int i) {
    MG_CUDA_CHECK(cudaMemcpyAsync(splits, b.routings.as<int32_t>() + (i % routings.size()) * g, g * sizeof(int32_t),
                                  cudaMemcpyDeviceToDevice, stream));
  };
  // Warm-up outside capture: module loading, cuBLASLt heuristics (cached per shape).
  set_routing(0);
  for (int set = 0; set < sets; ++set) grouped(set), cp_async(set), dense(set);
  MG_CUDA_CHECK(cudaStreamSynchronize(stream));

  std::vector<GraphExec> grouped_graphs, cp_async_graphs, dense_graphs;
  for (int set = 0; set < sets; ++set) {
    grouped_graphs.emplace_back(stream, [&] { grouped(set); });
    cp_async_graphs.emplace_back(stream, [&] { cp_async(set); });
    dense_graphs.emplace_back(stream, [&] { dense(set); });
  }
  EventTimer timer;
  std::vector<float> tg, tc, td, tl;
  for (int i = 0; i < replays; ++i) {
    const int set = i % sets;
    set_routing(i);
    tg.push_back(timer.time(stream, [&] { grouped_graphs[set].launch(stream); }));
    tc.push_back(timer.time(stream, [&] { cp_async_graphs[set].launch(stream); }));
    td.push_back(timer.time(stream, [&] { dense_graphs[set].launch(stream); }));
  }
  const int legacy_reps = std::min(replays, 20);
  for (int i = 0; i < legacy_reps; ++i) {
    set_routing(i);
    tl.push_back(timer.time(stream, [&] { legacy_run(i % sets); }));
  }
  DeviceErrorRecord rec{};
  MG_CUDA_CHECK(cudaMemcpy(&rec, err, sizeof(rec), cudaMemcpyDeviceToHost));
  MG_CHECK(rec.code == 0, "benchmark routings raised device error code ", rec.code);
  return {median(tg), median(tc), median(td), median(tl)};
}

// Quantizing the bf16 activations x [rows, k] (32-aligned groups, one routing) into both MXFP8
// copies from one read, next to a device copy of the same bytes: the quantizer counts 2
// bytes read and 2 x (1 + 1/32) written per used element, the copy reads and writes half of that
// total each, and is the faster of cudaMemcpyAsync and the roofline's copy kernel (on an H100 the
// kernel: 2810 against 2434 GB/s). All graph-replayed; the group offsets are computed once, outside
// the replays, so every one times the data movement alone. `values`: both copies as their bf16
// values instead (what the layer's quantizer of dy writes for a staged dgrad and an immediate staged
// wgrad): 2 + 2 bytes written per element.
struct QuantizeTiming {
  double ms = 0;
  double copy_ms = 0;
  double bytes = 0;  // the quantizer's count, also what the copy moves
  double gbps(double t_ms) const { return bytes / t_ms / 1e6; }
};
QuantizeTiming run_quantize(const KernelShape& s, Buffers& b, const MxBuffers& mx, bool values, int replays,
                            cudaStream_t stream) {
  auto off32 = mx.offsets32.as<int64_t>();
  DeviceBuffer row_data(mx.cap32 * s.k), row_scales(mx.cap32 * s.k / 32), col_data(mx.cap32 * s.k),
      col_scales(mx.cap32 * s.k / 32), x(mx.cap32 * s.k * 2);
  MG_CUDA_CHECK(cudaMemsetAsync(x.get(), 0x3c, x.bytes(), stream));  // 1.16 in every bf16: finite, non-zero
  DeviceBuffer row_values(values ? mx.cap32 * s.k * 2 : 0), col_values(values ? mx.cap32 * s.k * 2 : 0);
  const kernels::Mxfp8Rowwise row = values ? kernels::Mxfp8Rowwise{nullptr, nullptr, row_values.as<uint16_t>()}
                                           : kernels::Mxfp8Rowwise{row_data.as<uint8_t>(), row_scales.as<uint8_t>()};
  const kernels::Mxfp8Colwise col = values ? kernels::Mxfp8Colwise{nullptr, nullptr, col_values.as<uint16_t>()}
                                           : kernels::Mxfp8Colwise{col_data.as<uint8_t>(), col_scales.as<uint8_t>()};
  kernels::launch_group_offsets(b.splits.as<int32_t>(), s.groups, 32, mx.cap32, off32, b.error.as<DeviceErrorRecord>(),
                                stream);
  std::vector<int64_t> offsets(s.groups + 1);
  MG_CUDA_CHECK(cudaMemcpyAsync(offsets.data(), off32, offsets.size() * 8, cudaMemcpyDeviceToHost, stream));
  MG_CUDA_CHECK(cudaStreamSynchronize(stream));
  QuantizeTiming timing;
  timing.bytes = static_cast<double>(offsets.back()) * s.k * (values ? 6.0 : 2.0 + 2 * (1 + 1.0 / 32));

  auto replayed = [&](auto work) { return replayed_median(stream, work, replays); };
  timing.ms = replayed([&] {
    kernels::launch_quantize_mxfp8(DType::kBF16, x.get(), mx.cap32, s.k, off32, b.splits.as<int32_t>(), s.groups, &row,
                                   &col, stream);
  });

  const std::size_t half = std::max<std::size_t>(16, static_cast<std::size_t>(timing.bytes / 2) / 16 * 16);
  DeviceBuffer src(half), dst(half);
  MG_CUDA_CHECK(cudaMemsetAsync(src.get(), 0x3c, half, stream));
  timing.copy_ms = std::min(
      replayed([&] { MG_CUDA_CHECK(cudaMemcpyAsync(dst.get(), src.get(), half, cudaMemcpyDeviceToDevice, stream)); }),
      replayed([&] { launch_copy_kernel(dst.get(), src.get(), half, stream); }));
  return timing;
}

// The fewest bytes a phase must move (bf16): its activations once, and the weights of the experts
// that received rows (fprop, dgrad) or every expert's gradient (wgrad writes zeros for empty
// experts; into main_grad it reads and writes the fp32 gradients of the active ones).
double phase_bytes(const KernelShape& s, Phase phase, double active) {
  const double acts = static_cast<double>(s.rows) * (s.k + s.n) * 2, weight = static_cast<double>(s.n) * s.k;
  switch (phase) {
    case Phase::kFprop:
    case Phase::kDgrad: return acts + active * weight * 2;
    case Phase::kWgrad: return acts + s.groups * weight * 2;
    case Phase::kWgradMainGrad: return acts + active * weight * 8;
  }
  return 0;
}

// The same for the MXFP8 GEMMs: their operands as E4M3 with one E8M0 byte per 32 (1 + 1/32 bytes
// an element; wgrad reads the column-wise copies), their outputs in bf16 as above.
double mxfp8_phase_bytes(const KernelShape& s, Phase phase, double active) {
  constexpr double kMx = 1.0 + 1.0 / 32;
  const double rows = static_cast<double>(s.rows), weight = static_cast<double>(s.n) * s.k;
  switch (phase) {
    case Phase::kFprop: return rows * s.k * kMx + rows * s.n * 2 + active * weight * kMx;
    case Phase::kDgrad: return rows * s.n * kMx + rows * s.k * 2 + active * weight * kMx;
    case Phase::kWgrad: return rows * (s.n + s.k) * kMx + s.groups * weight * 2;
    case Phase::kWgradMainGrad: return rows * (s.n + s.k) * kMx + active * weight * 8;
  }
  return 0;
}

int64_t parse_int(const std::string& field, const std::string& what, const std::string& spec, int64_t lo, int64_t hi) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(field.c_str(), &end, 10);
  // Digits only: strtoll would also take leading spaces and a sign.
  const bool digits = !field.empty() && field.find_first_not_of("0123456789") == std::string::npos;
  MG_CHECK(digits && *end == '\0' && errno == 0 && v >= lo && v <= hi, "--shape '", spec, "': ", what,
               " must be an integer in [", lo, ", ", hi, "], got '", field, "'");
  return v;
}

}  // namespace

KernelShape parse_kernel_shape(const std::string& spec) {
  std::vector<std::string> f;
  std::size_t start = 0;
  for (std::size_t pos; (pos = spec.find(':', start)) != std::string::npos; start = pos + 1)
    f.push_back(spec.substr(start, pos - start));
  f.push_back(spec.substr(start));
  MG_CHECK(f.size() == 5 && !f[0].empty(), "--shape '", spec, "': expected NAME:GROUPS:K:N:ROWS");
  // The name heads a table row and a JSON key: letters, digits, '_', '-' and '.' only.
  MG_CHECK(f[0].find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.") ==
               std::string::npos,
           "--shape '", spec, "': NAME may hold letters, digits, '_', '-' and '.' only");
  KernelShape s;
  s.name = f[0];
  s.groups = static_cast<int>(parse_int(f[1], "GROUPS", spec, 1, 1024));
  s.k = parse_int(f[2], "K", spec, 16, 65536);
  s.n = parse_int(f[3], "N", spec, 16, 65536);
  s.rows = parse_int(f[4], "ROWS", spec, 1, int64_t{1} << 24);
  MG_CHECK(s.k % 16 == 0 && s.n % 16 == 0, "--shape '", spec, "': K and N must be multiples of 16");
  MG_CHECK(s.groups * s.n * s.k <= (int64_t{1} << 34), "--shape '", spec,
               "': the weights (GROUPS * N * K) exceed 2^34 elements");
  return s;
}

std::vector<KernelShape> kernel_bench_shapes(const KernelBenchOptions& o) {
  if (!o.shapes.empty()) return o.shapes;
  std::vector<KernelShape> shapes;
  auto add = [&](const auto& list) { shapes.insert(shapes.end(), std::begin(list), std::end(list)); };
  if (o.set == "quick") add(kQuickShapes);
  else if (o.set == "presets") add(kShapes);
  else if (o.set == "fine") add(kFineShapes);
  else if (o.set == "all") add(kShapes), add(kFineShapes);
  else MG_FAIL("unknown kernel shape set '", o.set, "' (presets, quick, fine or all)");
  return shapes;
}

int run_kernel_bench(const KernelBenchOptions& options) {
  const std::vector<KernelShape> shapes = kernel_bench_shapes(options);
  cudaDeviceProp prop{};
  const DeviceInfo device = require_supported_device();  // "no CUDA device" or a wrong GPU, said plainly
  MG_CUDA_CHECK(cudaGetDeviceProperties(&prop, device.device));
  std::printf("device: %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
  const int grid = prop.multiProcessorCount;  // plans scale it by each kernel's occupancy
  std::printf("grouped kernels: wgmma 128 x tile_n x 64 (tile_n and the load pipeline per shape and phase), "
              "persistent; cp_async column: the v4 cp.async kernels on the same tile\n");
  cudaStream_t stream;
  MG_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const Roofline roof = measure_roofline(stream);
  std::printf("%s\n", roof.describe().c_str());

  const int replays = options.replays > 0 ? options.replays : options.set == "quick" ? 15 : 40;
  Table table, mx_table, q_table;
  nlohmann::json out;
  out["device"] = prop.name;
  out["roofline"] = {{"dense_tflops", roof.dense_tflops}, {"copy_gbps", roof.copy_gbps}};
  out["replays"] = replays;
  int done = 0;
  const int total = static_cast<int>(shapes.size()) * 2 * 4;
  for (const KernelShape& s : shapes) {
    std::mt19937_64 rng(1234);
    Buffers b;
    const std::size_t set_bytes = s.rows * (s.k + s.n) * 2;
    const int sets = static_cast<int>(std::clamp<std::size_t>(3 * prop.l2CacheSize / set_bytes + 1, 1, 4));
    for (int i = 0; i < sets; ++i) {
      b.x.emplace_back(s.rows * s.k * 2);
      fill_random(b.x.back(), s.rows * s.k, rng);
      b.dy.emplace_back(s.rows * s.n * 2);
      fill_random(b.dy.back(), s.rows * s.n, rng);
      b.out_rows.emplace_back(s.rows * std::max(s.k, s.n) * 2);
    }
    b.w = DeviceBuffer(s.groups * s.n * s.k * 2);
    kernels::launch_fill_uniform(DType::kBF16, b.w.get(), s.groups * s.n * s.k, 1.0f, 99, stream);
    b.dw = DeviceBuffer(s.groups * s.n * s.k * 2);
    b.main_grad = DeviceBuffer(s.groups * s.n * s.k * 4);
    MG_CUDA_CHECK(cudaMemset(b.main_grad.get(), 0, b.main_grad.bytes()));
    b.dense_main_grad = DeviceBuffer(s.n * s.k * 4);
    MG_CUDA_CHECK(cudaMemset(b.dense_main_grad.get(), 0, b.dense_main_grad.bytes()));
    b.splits = DeviceBuffer(s.groups * 4);
    b.offsets = DeviceBuffer((s.groups + 1) * 8);
    b.error = DeviceBuffer(sizeof(DeviceErrorRecord));
    MG_CUDA_CHECK(cudaMemset(b.error.get(), 0, sizeof(DeviceErrorRecord)));
    const bool mx_shape = s.k % 128 == 0 && s.n % 128 == 0;
    const MxBuffers mx = mx_shape ? make_mx_buffers(s, rng) : MxBuffers{};
    nlohmann::json js = {{"name", s.name}, {"groups", s.groups}, {"k", s.k}, {"n", s.n}, {"rows", s.rows}};
    for (Routing routing : {Routing::kUniform, Routing::kSkewed}) {
      std::vector<std::vector<int32_t>> routings;
      for (int i = 0; i < 16; ++i) routings.push_back(testing::random_splits(rng, s.groups, s.rows, routing));
      js["routings"][routing_name(routing)] = routings;
      std::vector<int32_t> flat;
      for (auto& r : routings) flat.insert(flat.end(), r.begin(), r.end());
      b.routings = DeviceBuffer(flat.size() * 4);
      MG_CUDA_CHECK(cudaMemcpy(b.routings.get(), flat.data(), flat.size() * 4, cudaMemcpyHostToDevice));
      double active = 0;  // mean number of experts that received rows (their weights are read)
      for (auto& r : routings) active += std::count_if(r.begin(), r.end(), [](int32_t v) { return v > 0; });
      active /= routings.size();
      if (mx_shape && routing == Routing::kUniform) {
        MG_CUDA_CHECK(cudaMemcpy(b.splits.get(), routings[0].data(), s.groups * 4, cudaMemcpyHostToDevice));
        for (bool values : {false, true}) {
          const QuantizeTiming q = run_quantize(s, b, mx, values, replays, stream);
          q_table.add({s.name, std::to_string(s.rows) + " x " + std::to_string(s.k), values ? "values" : "codes",
                       fmt(q.ms, 3), fmt(q.gbps(q.ms), 0), fmt(q.gbps(q.ms) / roof.copy_gbps, 2), fmt(q.copy_ms, 3),
                       fmt(q.copy_ms / q.ms, 2)});
          out["quantize"].push_back({{"shape", s.name}, {"copies", values ? "values" : "codes"}, {"ms", q.ms},
                                     {"bytes", q.bytes}, {"same_size_copy_ms", q.copy_ms}});
        }
      }
      for (Phase phase : {Phase::kFprop, Phase::kDgrad, Phase::kWgrad, Phase::kWgradMainGrad}) {
        const Result r = run_phase(s, phase, routings, b, grid, sets, replays, stream);
        const double flops = 2.0 * s.rows * s.n * s.k, bytes = phase_bytes(s, phase, active);
        const double floor = roof.floor_ms(flops, bytes);
        double mx_ms = 0, mx_floor = 0, dq_ms = 0;
        std::string mx_route;
        if (mx_shape && phase != Phase::kWgradMainGrad) {
          const MxResult m = run_mxfp8(s, phase, routings, b, mx, grid, replays, stream);
          mx_ms = m.ms;
          mx_floor = roof.floor_ms(flops, mxfp8_phase_bytes(s, phase, active));
          mx_route = mxfp8_route_name(m.family);
          if (options.mxfp8_dequantized && phase != Phase::kWgrad)
            dq_ms = run_mxfp8(s, phase, routings, b, mx, grid, replays, stream, true).ms;
          mx_table.add({s.name, routing_name(routing), phase_name(phase), mx_route, fmt(r.grouped_ms, 3),
                        fmt(floor / r.grouped_ms, 2), fmt(mx_ms, 3), fmt(mx_floor, 3), fmt(mx_floor / mx_ms, 2),
                        fmt(r.grouped_ms / mx_ms, 2), dq_ms > 0 ? fmt(dq_ms, 3) : "-",
                        dq_ms > 0 ? fmt(r.grouped_ms / dq_ms, 2) : "-"});
        }
        const kernels::GemmConfig chosen = plan_for(s, phase, Recipe::kBF16, s.rows, grid).config;
        const std::string tile = std::to_string(chosen.block_n) + " " +
                                 (chosen.family == kernels::GemmFamily::kTma16 ? "tma" : "cp_async");
        table.add({s.name, routing_name(routing), phase_name(phase), tile, fmt(r.grouped_ms, 3),
                   fmt(flops / r.grouped_ms / 1e9, 1), fmt(bytes / r.grouped_ms / 1e6, 0), fmt(floor, 3),
                   roof.bound(flops, bytes), fmt(floor / r.grouped_ms, 2), fmt(floor / r.cp_async_ms, 2),
                   fmt(r.dense_ms, 3), fmt(r.dense_ms / r.grouped_ms, 2), fmt(r.legacy_ms, 3),
                   fmt(r.legacy_ms / r.grouped_ms, 2)});
        nlohmann::json jr = {{"shape", s.name}, {"routing", routing_name(routing)}, {"phase", phase_name(phase)},
                             {"kernel", chosen.to_string()}, {"ms", r.grouped_ms}, {"cp_async_ms", r.cp_async_ms},
                             {"dense_ms", r.dense_ms}, {"legacy_ms", r.legacy_ms}, {"flops", flops},
                             {"bytes", bytes}, {"active_experts", active}, {"floor_ms", floor},
                             {"bound", roof.bound(flops, bytes)}, {"of_roofline", floor / r.grouped_ms}};
        if (mx_ms > 0) jr["mxfp8_ms"] = mx_ms, jr["mxfp8_floor_ms"] = mx_floor, jr["mxfp8_route"] = mx_route;
        if (dq_ms > 0) jr["mxfp8_dequantized_weights_ms"] = dq_ms;
        out["results"].push_back(jr);
        progress(++done, total, s.name.c_str());
      }
    }
    out["shapes"].push_back(js);
  }
  std::fprintf(stderr, "\n");
  std::printf("\nmedian of %d graph replays (legacy: %d eager runs), bf16, fresh routing per replay; floor = max(FLOPs "
              "at the dense rate, fewest bytes at the copy bandwidth); of roofline = floor / time\n", replays,
              std::min(replays, 20));
  table.print({"shape", "routing", "phase", "tile", "grouped ms", "TFLOP/s", "GB/s", "floor ms", "bound",
               "of roofline", "cp_async of roofline", "dense ms", "vs dense", "legacy ms", "vs legacy"});
  std::printf("\nMXFP8 vs BF16, same routings (MXFP8 wgrad: groups 32-row aligned); route: e4m3 (E4M3 wgmma, "
              "per-32 scales promoted), swap_ab, dequant (to bf16 on chip) or staged (to bf16 in scratch, then the "
              "bf16 kernel), as the heuristic or MOEGRAPH_MXFP8_ROUTE picks; mxfp8 floor: FLOPs at the dense bf16 "
              "rate (faithful per-32 scaling cannot beat it on Hopper) or the MXFP8 bytes (1 + 1/32 per operand "
              "element) at the copy bandwidth, whichever is larger; dq: fprop and dgrad with the weights kept "
              "dequantized to bf16 (dequantized_weights: the staged route without the weights' pass; - where the "
              "route is the same%s)\n", options.mxfp8_dequantized ? "" : "; not run: --mxfp8-dequantized");
  mx_table.print({"shape", "routing", "phase", "route", "bf16 ms", "bf16 of roofline", "mxfp8 ms", "mxfp8 floor ms",
                  "mxfp8 of roofline", "mxfp8 speed-up", "dq ms", "dq speed-up"});
  std::printf("\nMXFP8 quantize of bf16 x into the row-wise and column-wise copies (one read), uniform routing; "
              "copies: their codes, or both as bf16 values (the staged routes' operands, as the layer's quantizer of "
              "dy writes them for an immediate wgrad); same-size copy: the faster of cudaMemcpyAsync and the copy "
              "kernel over the same bytes (half read, half written), graph-replayed like the quantizer; of same-size "
              "copy = its time / the quantizer's\n");
  q_table.print({"shape", "x", "copies", "ms", "GB/s moved", "of copy bandwidth", "same-size copy ms",
                 "of same-size copy"});
  cudaStreamDestroy(stream);
  if (!options.json_path.empty()) {
    write_json_results(out, options.json_path, 1);
  }
  return 0;
}

}  // namespace moegraph::bench
