// The C ABI on the GPU, operators: a GroupedLinear on a caller's workspace against one on its own,
// and MXFP8 weights the caller quantized (mg_quantize_mxfp8_weights, prequantized_weights) against
// the operators' own quantization.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "moegraph/config.hpp"
#include "moegraph/grouped_linear.hpp"
#include "moegraph/moegraph.h"
#include "moegraph/mxfp8_weights.hpp"
#include "moegraph/step_graphs.hpp"
#include "testing/graph.hpp"
#include "testing/step_weights.hpp"
#include "tests/common/expect.hpp"
#include "tests/gpu/c_abi_gpu_helpers.hpp"

namespace moegraph::test {
namespace {

using namespace c_abi_gpu;

// ---- GroupedLinear on a caller's workspace ---------------------------------------------------------

struct LinearCase {
  mg_grouped_linear_options options;
  std::vector<int32_t> splits;
  int64_t used_rows = 0;
  std::vector<uint16_t> x, weight, bias, dy;
  std::vector<float> bias_scale, main_grad;
};

LinearCase linear_case(std::mt19937_64& rng) {
  LinearCase c;
  mg_grouped_linear_options_init(&c.options);
  mg_grouped_linear_options& o = c.options;
  o.num_groups = 5, o.in_features = 128, o.out_features = 192, o.capacity_rows = 160, o.bias = 1;
  c.splits = {37, 0, 61, 1, 44};  // uneven, an empty group, a single row: 143 of 160 rows
  c.used_rows = 143;
  const int64_t rows = o.capacity_rows, k = o.in_features, n = o.out_features, g = o.num_groups;
  c.x = random_bf16(rng, rows * k, 1.0);
  c.weight = random_bf16(rng, g * n * k, 1.0 / std::sqrt(double(k)));
  c.bias = random_bf16(rng, g * n, 0.1);
  c.dy = random_bf16(rng, rows * n, 1.0);
  c.bias_scale = random_fp32(rng, rows, 1.0);
  c.main_grad = random_fp32(rng, g * n * k, 1.0);  // accumulated into
  return c;
}

struct LinearResult {
  std::vector<uint16_t> y, dx, dbias;            // y and dx: the used rows
  std::vector<uint32_t> dbias_scale, main_grad;  // dbias_scale: the used rows
};

// forward_train, then backward with the wgrad at once, on a new operator over `workspace` (NULL:
// its own); every output poisoned first.
LinearResult run_linear(const LinearCase& c, void* workspace) {
  const mg_grouped_linear_options& o = c.options;
  const std::size_t rows = o.capacity_rows, k = o.in_features, n = o.out_features, g = o.num_groups;
  DeviceArray<int32_t> splits(g);
  DeviceArray<uint16_t> x(rows * k), w(g * n * k), b(g * n), dy(rows * n), y(rows * n), dx(rows * k), db(g * n);
  DeviceArray<float> scale(rows), dscale(rows), main_grad(g * n * k);
  splits.upload(c.splits), x.upload(c.x), w.upload(c.weight), b.upload(c.bias), dy.upload(c.dy);
  scale.upload(c.bias_scale), main_grad.upload(c.main_grad);
  y.poison(), dx.poison(), db.poison(), dscale.poison();

  mg_grouped_linear* op = nullptr;
  ok(mg_grouped_linear_create(&o, workspace, &op));
  const std::unique_ptr<mg_grouped_linear, void (*)(mg_grouped_linear*)> owned(op, mg_grouped_linear_destroy);
  mg_forward_args f = sized<mg_forward_args>();
  f.x = x.get(), f.splits = splits.get(), f.weight = w.get(), f.bias = b.get(), f.bias_scale = scale.get();
  f.y = y.get();
  ok(mg_grouped_linear_forward(op, &f, /*train=*/1, nullptr));
  mg_backward_args bw = sized<mg_backward_args>();
  bw.dy = dy.get(), bw.weight = w.get(), bw.bias = b.get(), bw.dx = dx.get(), bw.dbias = db.get();
  bw.dbias_scale = dscale.get(), bw.main_grad = main_grad.get();
  ok(mg_grouped_linear_backward(op, &bw, /*delay_wgrad=*/0, nullptr));
  ok(mg_grouped_linear_check_device_errors(op, nullptr));

  const std::size_t used = c.used_rows;
  LinearResult r;
  r.y = y.download(), r.y.resize(used * n);
  r.dx = dx.download(), r.dx.resize(used * k);
  r.dbias = db.download();
  r.dbias_scale = bits_of(dscale.download()), r.dbias_scale.resize(used);
  r.main_grad = bits_of(main_grad.download());
  return r;
}

// A workspace larger than the GPU: MG_ERR_CUDA, a message naming the bytes asked and the device's
// free memory, and no error left behind. A server that catches the failure and makes a smaller
// operator on the same thread must see that one run: the failed cudaMalloc's error used to stay
// recorded, and the next launch check reported it.
TEST(CAbiGroupedLinearGpu, AWorkspaceTheGpuCannotHoldIsRefusedAndLeavesNoError) {
  mg_grouped_linear_options huge;
  mg_grouped_linear_options_init(&huge);
  huge.num_groups = 8, huge.in_features = huge.out_features = 1 << 16;
  huge.capacity_rows = int64_t{1} << 26;  // 8 TiB a row buffer: inside the ABI's limits (2^48 bytes)
  std::size_t bytes = 0, free = 0, total = 0;
  ok(mg_grouped_linear_workspace_bytes(&huge, &bytes));
  ASSERT_EQ(cudaMemGetInfo(&free, &total), cudaSuccess);
  ASSERT_GT(bytes, total);
  mg_grouped_linear* op = reinterpret_cast<mg_grouped_linear*>(&huge);  // overwritten with NULL
  EXPECT_EQ(mg_grouped_linear_create(&huge, nullptr, &op), MG_ERR_CUDA);
  EXPECT_EQ(op, nullptr);
  const std::string message = mg_last_error();
  EXPECT_NE(message.find("cannot allocate"), std::string::npos) << message;
  EXPECT_NE(message.find("free of"), std::string::npos) << message;
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "the failed allocation's error is still recorded";

  // The same thread then makes and runs a small operator (run_linear checks every call's status).
  std::mt19937_64 rng(test_seed("CAbiGroupedLinearGpu.AWorkspaceTheGpuCannotHoldIsRefusedAndLeavesNoError"));
  const LinearResult r = run_linear(linear_case(rng), nullptr);
  EXPECT_EQ(nan_count(r.y) + nan_count(r.dx), 0u) << "outputs left unwritten";
}

TEST(CAbiGroupedLinearGpu, CallerWorkspaceGivesTheResultsOfItsOwnWorkspace) {
  std::mt19937_64 rng(test_seed("CAbiGroupedLinearGpu.CallerWorkspaceGivesTheResultsOfItsOwnWorkspace"));
  const LinearCase c = linear_case(rng);
  std::size_t bytes = 0;
  ok(mg_grouped_linear_workspace_bytes(&c.options, &bytes));
  ASSERT_GT(bytes, 0u);
  DeviceArray<uint8_t> workspace(bytes);  // cudaMalloc: 256-byte aligned
  workspace.poison();                     // transient memory: the operator writes what it reads

  const LinearResult own = run_linear(c, nullptr);
  const LinearResult caller = run_linear(c, workspace.get());
  EXPECT_EQ(nan_count(own.y) + nan_count(own.dx) + nan_count(own.dbias_scale), 0u) << "outputs left unwritten";
  EXPECT_TRUE(identical(caller.y, own.y)) << "y";
  EXPECT_TRUE(identical(caller.dx, own.dx)) << "dx";
  EXPECT_TRUE(identical(caller.dbias, own.dbias)) << "dbias";
  EXPECT_TRUE(identical(caller.dbias_scale, own.dbias_scale)) << "dbias_scale";
  EXPECT_TRUE(identical(caller.main_grad, own.main_grad)) << "main_grad";
  // main_grad: the empty group 1 is left as it was, group 0 is accumulated into.
  const std::size_t per_group = c.options.out_features * c.options.in_features;
  const std::vector<uint32_t> before = bits_of(c.main_grad);
  EXPECT_TRUE(
      std::equal(before.begin() + per_group, before.begin() + 2 * per_group, own.main_grad.begin() + per_group));
  EXPECT_FALSE(std::equal(before.begin(), before.begin() + per_group, own.main_grad.begin()));

  // The context really lived in the caller's memory: forward_train's copy of the splits is there.
  GroupedLinearOptions cpp;
  cpp.num_groups = c.options.num_groups, cpp.in_features = c.options.in_features;
  cpp.out_features = c.options.out_features, cpp.capacity_rows = c.options.capacity_rows, cpp.bias = true;
  const auto buffers = GroupedLinear::workspace_buffers(cpp);
  const auto slot =
      std::find_if(buffers.begin(), buffers.end(), [](const auto& e) { return e.name == "slot0.splits"; });
  ASSERT_NE(slot, buffers.end());
  const std::vector<uint8_t> memory = workspace.download();
  std::vector<int32_t> saved(c.splits.size());
  std::memcpy(saved.data(), memory.data() + slot->offset, saved.size() * sizeof(int32_t));
  EXPECT_EQ(saved, c.splits);

  // A workspace off the 256-byte alignment is refused before anything is made.
  mg_grouped_linear* op = reinterpret_cast<mg_grouped_linear*>(0x1);
  EXPECT_EQ(mg_grouped_linear_create(&c.options, workspace.get() + 16, &op), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(op, nullptr);
  EXPECT_TRUE(last_error_has("256-byte aligned")) << mg_last_error();
}

// ---- MXFP8 weights given by the caller ----------------------------------------------------------

// The caller's MXFP8 copies of bf16 grouped weights w [g, n, k], sized and made through the C ABI on
// `s` (waited for). Every array is poisoned first, so one the quantizer left unwritten would show.
struct CMxfp8 {
  DeviceArray<uint8_t> data, scales, data_t, scales_t;
  CMxfp8(const void* w, int g, int64_t n, int64_t k, cudaStream_t s) {
    std::size_t data_bytes = 0, scale_bytes = 0;
    ok(mg_mxfp8_weight_bytes(g, n, k, &data_bytes, &scale_bytes));
    data = DeviceArray<uint8_t>(data_bytes), data_t = DeviceArray<uint8_t>(data_bytes);
    scales = DeviceArray<uint8_t>(scale_bytes), scales_t = DeviceArray<uint8_t>(scale_bytes);
    data.poison(), scales.poison(), data_t.poison(), scales_t.poison();
    ok(mg_quantize_mxfp8_weights(MG_DTYPE_BF16, w, g, n, k, data.get(), scales.get(), data_t.get(), scales_t.get(),
                                 s));
    MG_CUDA_CHECK(cudaStreamSynchronize(s));
  }
};

// The tiled copies of a CMxfp8's scales (mg_tile_mxfp8_weight_scales), made on `s` (waited for) over
// poison.
struct CTiled {
  DeviceArray<uint8_t> tiled, tiled_t;
  CTiled(const CMxfp8& q, int g, int64_t n, int64_t k, cudaStream_t s) {
    std::size_t bytes = 0;
    ok(mg_mxfp8_tiled_scale_bytes(g, n, k, &bytes));
    tiled = DeviceArray<uint8_t>(bytes), tiled_t = DeviceArray<uint8_t>(bytes);
    tiled.poison(), tiled_t.poison();
    ok(mg_tile_mxfp8_weight_scales(g, n, k, q.data.get(), q.scales.get(), q.data_t.get(), q.scales_t.get(),
                                   tiled.get(), tiled_t.get(), s));
    MG_CUDA_CHECK(cudaStreamSynchronize(s));
  }
};

// No byte is left at the poison: 0xFF is NaN as an E4M3 element and as an E8M0 scale, which finite
// weights never give.
std::size_t poison_bytes(const DeviceArray<uint8_t>& a) {
  const std::vector<uint8_t> bytes = a.download();
  return std::count(bytes.begin(), bytes.end(), uint8_t{0xff});
}

// A grouped linear of the mxfp8 recipe through the C ABI (kGroups x kOut x kIn, row_align 32) on
// random bf16 data, and one run of it: an inference forward, forward_train and backward (dx, dbias
// when options.bias, main_grad), with the weights as 16-bit (the operator quantizes them) or as the
// caller's MXFP8 copies (`given`, with their bf16 values when `values` is set).
struct CMxfp8Linear {
  static constexpr int kGroups = 5;
  static constexpr int64_t kIn = 256, kOut = 384;
  std::vector<int32_t> splits;
  std::vector<int64_t> starts;  // row_align 32: groups start on multiples of 32
  int64_t rows = 0;
  DeviceArray<int32_t> d_splits{kGroups};
  DeviceArray<uint16_t> x, w, b, dy;
  Stream stream;
  std::unique_ptr<CMxfp8> q;

  struct Out {
    std::vector<uint16_t> y, y_infer, dx, dbias;
    std::vector<uint32_t> main_grad;
  };

  CMxfp8Linear(std::vector<int32_t> host_splits, const char* seed_name) : splits(std::move(host_splits)) {
    for (int32_t n : splits) starts.push_back(rows), rows += (n + 31) / 32 * 32;
    rows += 32;  // rows past the last group
    std::mt19937_64 rng(test_seed(seed_name));
    x = DeviceArray<uint16_t>(rows * kIn), w = DeviceArray<uint16_t>(kGroups * kOut * kIn);
    b = DeviceArray<uint16_t>(kGroups * kOut), dy = DeviceArray<uint16_t>(rows * kOut);
    d_splits.upload(splits);
    x.upload(random_bf16(rng, x.size(), 1.0));
    w.upload(random_bf16(rng, w.size(), 1.0 / std::sqrt(double(kIn))));
    b.upload(random_bf16(rng, b.size(), 0.1));
    dy.upload(random_bf16(rng, dy.size(), 1.0));
    q = std::make_unique<CMxfp8>(w.get(), kGroups, kOut, kIn, stream.get());
  }

  mg_grouped_linear_options options() const {
    mg_grouped_linear_options o;
    mg_grouped_linear_options_init(&o);
    o.num_groups = kGroups, o.in_features = kIn, o.out_features = kOut, o.capacity_rows = rows, o.row_align = 32;
    o.recipe = MG_RECIPE_MXFP8;
    return o;
  }

  Out run(const mg_grouped_linear_options& options, bool given, const void* values = nullptr,
          const void* values_t = nullptr, const uint8_t* tiled = nullptr, const uint8_t* tiled_t = nullptr) {
    const cudaStream_t s = stream.get();
    mg_grouped_linear* op = nullptr;
    ok(mg_grouped_linear_create(&options, nullptr, &op));
    const std::unique_ptr<mg_grouped_linear, void (*)(mg_grouped_linear*)> owned(op, mg_grouped_linear_destroy);
    if (!given) ok(mg_grouped_linear_weights_changed(op, w.get(), s));
    DeviceArray<uint16_t> y(rows * kOut), y_infer(rows * kOut), dx(rows * kIn), db(kGroups * kOut);
    DeviceArray<float> main_grad(kGroups * kOut * kIn);
    y.poison(), y_infer.poison(), dx.poison(), db.poison();
    memset_and_wait(main_grad.get(), 0, main_grad.size() * sizeof(float));
    mg_forward_args f = sized<mg_forward_args>();
    f.x = x.get(), f.splits = d_splits.get(), f.bias = options.bias ? b.get() : nullptr;
    if (given) {
      f.mxfp8_data = q->data.get(), f.mxfp8_scales = q->scales.get(), f.mxfp8_dequantized = values;
      f.mxfp8_scales_tiled = tiled;
    } else {
      f.weight = w.get();
    }
    f.y = y_infer.get();
    ok(mg_grouped_linear_forward(op, &f, /*train=*/0, s));
    f.y = y.get();
    ok(mg_grouped_linear_forward(op, &f, /*train=*/1, s));
    mg_backward_args bw = sized<mg_backward_args>();
    bw.dy = dy.get(), bw.dx = dx.get(), bw.main_grad = main_grad.get();
    if (options.bias) bw.bias = b.get(), bw.dbias = db.get();
    if (given) {
      bw.mxfp8_data_t = q->data_t.get(), bw.mxfp8_scales_t = q->scales_t.get();
      bw.mxfp8_dequantized_t = values_t, bw.mxfp8_scales_t_tiled = tiled_t;
    } else {
      bw.weight = w.get();
    }
    ok(mg_grouped_linear_backward(op, &bw, /*delay_wgrad=*/0, s));
    ok(mg_grouped_linear_check_device_errors(op, s));
    return Out{y.download(), y_infer.download(), dx.download(), options.bias ? db.download() : std::vector<uint16_t>{},
               bits_of(main_grad.download())};
  }
};

// mg_quantize_mxfp8_weights passes every argument where the C++ quantizer expects it (n != k here, so
// a swap would show): the same four arrays, every byte written; one pair alone leaves the other.
TEST(CAbiMxfp8Gpu, QuantizerWritesWhatTheCppQuantizerWrites) {
  const int g = 3;
  const int64_t n = 96, k = 160;
  std::mt19937_64 rng(test_seed("CAbiMxfp8Gpu.QuantizerWritesWhatTheCppQuantizerWrites"));
  DeviceArray<uint16_t> w(g * n * k);
  w.upload(random_bf16(rng, w.size(), 1.0));
  Stream stream;
  const cudaStream_t s = stream.get();
  CMxfp8 c(w.get(), g, n, k, s);
  DeviceArray<uint8_t> data(g * n * k), scales(g * n * k / 32), data_t(g * n * k), scales_t(g * n * k / 32);
  data.poison(), scales.poison(), data_t.poison(), scales_t.poison();
  quantize_mxfp8_weights(DType::kBF16, w.get(), g, n, k, {data.get(), scales.get(), data_t.get(), scales_t.get()}, s);
  MG_CUDA_CHECK(cudaStreamSynchronize(s));
  EXPECT_TRUE(identical(c.data.download(), data.download())) << "data";
  EXPECT_TRUE(identical(c.scales.download(), scales.download())) << "scales";
  EXPECT_TRUE(identical(c.data_t.download(), data_t.download())) << "data_t";
  EXPECT_TRUE(identical(c.scales_t.download(), scales_t.download())) << "scales_t";
  for (const DeviceArray<uint8_t>* a : {&c.data, &c.scales, &c.data_t, &c.scales_t}) EXPECT_EQ(poison_bytes(*a), 0u);

  c.data_t.poison(), c.scales_t.poison();
  ok(mg_quantize_mxfp8_weights(MG_DTYPE_BF16, w.get(), g, n, k, c.data.get(), c.scales.get(), nullptr, nullptr, s));
  MG_CUDA_CHECK(cudaStreamSynchronize(s));
  EXPECT_EQ(poison_bytes(c.data_t) + poison_bytes(c.scales_t), c.data_t.size() + c.scales_t.size())
      << "the transposed pair was not given: left as it was";
  EXPECT_TRUE(identical(c.data.download(), data.download())) << "data, quantized again";
}

// A grouped linear of the mxfp8 recipe made through the C ABI twice: quantizing its own copies
// (mg_grouped_linear_weights_changed), and reading the caller's through the mxfp8_* fields of its
// arguments with no 16-bit weight given (the forward gets the row-wise pair only, the backward the
// transposed pair only). An inference forward, forward_train and backward (dx, dbias, main_grad)
// give the same bits.
TEST(CAbiMxfp8Gpu, GroupedLinearFromPrequantizedWeightsGivesTheSameBits) {
  // Uneven groups, an empty one, a single row.
  CMxfp8Linear l({37, 0, 61, 1, 44}, "CAbiMxfp8Gpu.GroupedLinearFromPrequantizedWeightsGivesTheSameBits");
  constexpr int kGroups = CMxfp8Linear::kGroups;
  constexpr int64_t kIn = CMxfp8Linear::kIn, kOut = CMxfp8Linear::kOut;
  const std::vector<int32_t>& splits = l.splits;
  const std::vector<int64_t>& starts = l.starts;
  const int64_t rows = l.rows;
  const cudaStream_t s = l.stream.get();
  const CMxfp8& q = *l.q;
  mg_grouped_linear_options o = l.options();
  o.bias = 1;
  mg_grouped_linear_options pre = o;
  pre.prequantized_weights = 1;
  using Out = CMxfp8Linear::Out;
  const Out own = l.run(o, false), given = l.run(pre, true);
  EXPECT_TRUE(identical(given.y, own.y)) << "y";
  EXPECT_TRUE(identical(given.y_infer, own.y_infer)) << "inference y";
  EXPECT_TRUE(identical(given.dx, own.dx)) << "dx";
  EXPECT_TRUE(identical(given.dbias, own.dbias)) << "dbias";
  EXPECT_TRUE(identical(given.main_grad, own.main_grad)) << "main_grad";
  EXPECT_TRUE(identical(own.y_infer, own.y)) << "inference vs training forward";
  // The groups' rows were computed (two runs that both wrote nothing would compare equal).
  for (int e = 0; e < kGroups; ++e) {
    SCOPED_TRACE(detail::concat("group ", e));
    const auto rows_of = [&](const std::vector<uint16_t>& v, int64_t cols) {
      return std::vector<uint16_t>(v.begin() + starts[e] * cols, v.begin() + (starts[e] + splits[e]) * cols);
    };
    EXPECT_EQ(nan_count(rows_of(own.y, kOut)), 0u);
    EXPECT_EQ(nan_count(rows_of(own.dx, kIn)), 0u);
    if (splits[e] > 0) {
      EXPECT_TRUE(any_nonzero(rows_of(own.y, kOut)));
    }
  }
  EXPECT_EQ(nan_count(own.main_grad), 0u);
  EXPECT_TRUE(any_nonzero(own.main_grad));

  // What the prequantized operator refuses, before enqueuing anything: its own quantization, and a
  // forward without the MXFP8 weights (an older mg_forward_args size carries none).
  mg_grouped_linear* op = nullptr;
  ok(mg_grouped_linear_create(&pre, nullptr, &op));
  const std::unique_ptr<mg_grouped_linear, void (*)(mg_grouped_linear*)> owned(op, mg_grouped_linear_destroy);
  EXPECT_EQ(mg_grouped_linear_weights_changed(op, l.w.get(), s), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("re-quantize them with quantize_mxfp8_weights instead")) << mg_last_error();
  DeviceArray<uint16_t> y(rows * kOut);
  y.poison();
  mg_forward_args f = sized<mg_forward_args>();
  f.x = l.x.get(), f.splits = l.d_splits.get(), f.weight = l.w.get(), f.bias = l.b.get(), f.y = y.get();
  EXPECT_EQ(mg_grouped_linear_forward(op, &f, /*train=*/0, s), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("forward needs mxfp8_weights.data and .scales (prequantized_weights)")) << mg_last_error();
  f.mxfp8_data = q.data.get(), f.mxfp8_scales = q.scales.get();
  f.struct_size = offsetof(mg_forward_args, mxfp8_data);
  EXPECT_EQ(mg_grouped_linear_forward(op, &f, /*train=*/0, s), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("forward needs mxfp8_weights.data and .scales")) << mg_last_error();
  f.struct_size = sizeof f;
  ok(mg_grouped_linear_forward(op, &f, /*train=*/0, s));
  ok(mg_grouped_linear_check_device_errors(op, s));
  EXPECT_TRUE(identical(y.download(), own.y_infer)) << "the refusals left nothing behind";
}

// The tiled scales through the C ABI: mg_tile_mxfp8_weight_scales writes what the C++ quantizer
// writes into Mxfp8Weights::scales_tiled and scales_t_tiled (every byte), and a grouped linear reading
// the caller's copies with them gives the bits of its own copies. Each is read where it should be:
// NaN scales in the forward's copy make y NaN and leave dx alone, in the backward's the other way.
TEST(CAbiMxfp8Gpu, TiledScalesThroughTheCAbiGiveTheSameBits) {
  CMxfp8Linear l({37, 0, 61, 1, 44}, "CAbiMxfp8Gpu.TiledScalesThroughTheCAbiGiveTheSameBits");
  constexpr int kGroups = CMxfp8Linear::kGroups;
  constexpr int64_t kIn = CMxfp8Linear::kIn, kOut = CMxfp8Linear::kOut;
  const cudaStream_t s = l.stream.get();
  const CMxfp8& q = *l.q;
  const CTiled t(q, kGroups, kOut, kIn, s);
  ASSERT_EQ(t.tiled.size(), mxfp8_tiled_scale_bytes(kGroups, kOut, kIn));
  {
    DeviceArray<uint8_t> data(q.data.size()), scales(q.scales.size()), data_t(q.data.size()), scales_t(q.scales.size());
    DeviceArray<uint8_t> cpp(t.tiled.size()), cpp_t(t.tiled.size());
    cpp.poison(), cpp_t.poison();
    Mxfp8Weights out{data.get(), scales.get(), data_t.get(), scales_t.get()};
    out.scales_tiled = cpp.get(), out.scales_t_tiled = cpp_t.get();
    quantize_mxfp8_weights(DType::kBF16, l.w.get(), kGroups, kOut, kIn, out, s);
    MG_CUDA_CHECK(cudaStreamSynchronize(s));
    EXPECT_TRUE(identical(t.tiled.download(), cpp.download())) << "scales_tiled";
    EXPECT_TRUE(identical(t.tiled_t.download(), cpp_t.download())) << "scales_t_tiled";
  }

  mg_grouped_linear_options o = l.options();
  GroupedLinearOptions cpp;
  cpp.num_groups = o.num_groups, cpp.in_features = o.in_features, cpp.out_features = o.out_features;
  cpp.capacity_rows = o.capacity_rows, cpp.row_align = o.row_align, cpp.recipe = Recipe::kMXFP8;
  const std::string kernels = GroupedLinear::describe_kernels(cpp);
  ASSERT_NE(kernels.find("swap_ab"), std::string::npos) << "the copies are read on the swap-AB route: " << kernels;
  mg_grouped_linear_options pre = o;
  pre.prequantized_weights = 1;
  using Out = CMxfp8Linear::Out;
  const Out own = l.run(o, false), given = l.run(pre, true, nullptr, nullptr, t.tiled.get(), t.tiled_t.get());
  EXPECT_TRUE(identical(given.y, own.y)) << "y";
  EXPECT_TRUE(identical(given.y_infer, own.y_infer)) << "inference y";
  EXPECT_TRUE(identical(given.dx, own.dx)) << "dx";
  EXPECT_TRUE(identical(given.main_grad, own.main_grad)) << "main_grad";
  // The groups' spans (their rows and alignment gaps; the rows past the last span keep the poison).
  const int64_t spans = l.rows - 32;
  const auto in_spans = [&](const std::vector<uint16_t>& v, int64_t cols) {
    return std::vector<uint16_t>(v.begin(), v.begin() + spans * cols);
  };
  EXPECT_TRUE(any_nonzero(in_spans(own.y, kOut)));
  EXPECT_EQ(nan_count(in_spans(own.y, kOut)) + nan_count(in_spans(own.dx, kIn)), 0u);

  DeviceArray<uint8_t> nan_scales(t.tiled.size());
  nan_scales.poison();  // 0xFF: the NaN scale
  const Out forward_nan = l.run(pre, true, nullptr, nullptr, nan_scales.get(), t.tiled_t.get());
  EXPECT_GT(nan_count(in_spans(forward_nan.y, kOut)), 0u) << "the forward reads mxfp8_scales_tiled";
  EXPECT_TRUE(identical(forward_nan.dx, own.dx)) << "dx does not read mxfp8_scales_tiled";
  const Out backward_nan = l.run(pre, true, nullptr, nullptr, t.tiled.get(), nan_scales.get());
  EXPECT_TRUE(identical(backward_nan.y, own.y)) << "the forward does not read mxfp8_scales_t_tiled";
  EXPECT_GT(nan_count(in_spans(backward_nan.dx, kIn)), 0u) << "dx reads mxfp8_scales_t_tiled";
}

// dequantized_weights through the C ABI: mg_dequantize_mxfp8_weights writes what the C++ quantizer
// writes into Mxfp8Weights::dequantized(_t) (every byte), and a grouped linear keeping its own
// values (weights_changed) gives the bits of one reading the caller's through mxfp8_dequantized(_t).
TEST(CAbiMxfp8Gpu, DequantizedWeightsThroughTheCAbiGiveTheSameBits) {
  // Groups past the swap-AB bound.
  CMxfp8Linear l({137, 0, 161, 1, 144}, "CAbiMxfp8Gpu.DequantizedWeightsThroughTheCAbiGiveTheSameBits");
  constexpr int kGroups = CMxfp8Linear::kGroups;
  constexpr int64_t kIn = CMxfp8Linear::kIn, kOut = CMxfp8Linear::kOut;
  const cudaStream_t s = l.stream.get();
  const CMxfp8& q = *l.q;
  const std::size_t elements = l.w.size();
  DeviceArray<uint16_t> values(elements), values_t(elements), cpp(elements), cpp_t(elements);
  values.poison(), values_t.poison(), cpp.poison(), cpp_t.poison();
  ok(mg_dequantize_mxfp8_weights(kGroups, kOut, kIn, q.data.get(), q.scales.get(), q.data_t.get(), q.scales_t.get(),
                                 values.get(), values_t.get(), s));
  {
    DeviceArray<uint8_t> data(q.data.size()), scales(q.scales.size()), data_t(q.data.size()), scales_t(q.scales.size());
    Mxfp8Weights out{data.get(), scales.get(), data_t.get(), scales_t.get(), cpp.get(), cpp_t.get()};
    quantize_mxfp8_weights(DType::kBF16, l.w.get(), kGroups, kOut, kIn, out, s);
    MG_CUDA_CHECK(cudaStreamSynchronize(s));
  }
  EXPECT_TRUE(identical(values.download(), cpp.download())) << "dequantized";
  EXPECT_TRUE(identical(values_t.download(), cpp_t.download())) << "dequantized_t";
  EXPECT_EQ(nan_count(values.download()) + nan_count(values_t.download()), 0u) << "every value written";

  mg_grouped_linear_options o = l.options();
  o.dequantized_weights = 1;
  mg_grouped_linear_options pre = o;
  pre.prequantized_weights = 1;
  const CMxfp8Linear::Out own = l.run(o, false), given = l.run(pre, true, values.get(), values_t.get());
  EXPECT_TRUE(identical(given.y, own.y)) << "y";
  EXPECT_TRUE(identical(given.y_infer, own.y_infer)) << "inference y";
  EXPECT_TRUE(identical(given.dx, own.dx)) << "dx";
  EXPECT_TRUE(identical(given.main_grad, own.main_grad)) << "main_grad";
  EXPECT_TRUE(any_nonzero(own.main_grad));
}

// A MoE layer of the mxfp8 recipe made through the C ABI from the 16-bit weights (it quantizes them
// itself: mg_moe_layer_weights_changed) and the same layer made from copies the caller quantized with
// mg_quantize_mxfp8_weights (prequantized_weights: no 16-bit w1 or w2 handed over at all), without
// and with their tiled scales (mg_tile_mxfp8_weight_scales). A training step (y, dx and every
// gradient) and an inference forward give the same bits.
TEST(CAbiMxfp8Gpu, MoeLayerFromPrequantizedWeightsMatchesTheSelfQuantizingLayer) {
  constexpr int kExperts = 8, kTopK = 2;
  constexpr int64_t kHidden = 256, kFfn = 128, kTokens = 64;  // hidden and ffn multiples of 128 (mxfp8)
  const int64_t h = kHidden, f = kFfn, count = kTokens - 9;   // rows past count hold data to be ignored
  const DType bf16 = DType::kBF16;
  std::mt19937_64 rng(test_seed("CAbiMxfp8Gpu.MoeLayerFromPrequantizedWeightsMatchesTheSelfQuantizingLayer"));
  const Mat wr = random_values(rng, kExperts * h, 1.0 / std::sqrt(double(h)), bf16);
  const Mat w1 = random_values(rng, kExperts * 2 * f * h, 1.0 / std::sqrt(double(h)), bf16);
  const Mat w2 = random_values(rng, kExperts * h * f, 1.0 / std::sqrt(double(f)), bf16);
  const Mat b1 = random_values(rng, kExperts * 2 * f, 0.1, bf16), b2 = random_values(rng, kExperts * h, 0.1, bf16);
  const Mat x = random_values(rng, kTokens * h, 1.0, bf16), dy = random_values(rng, kTokens * h, 1.0, bf16);

  mg_moe_layer_options o;
  mg_moe_layer_options_init(&o);
  o.experts = kExperts, o.hidden = kHidden, o.ffn = kFfn, o.top_k = kTopK, o.bias = 1, o.renormalize = 1;
  o.max_tokens = kTokens, o.row_align = 32, o.recipe = MG_RECIPE_MXFP8;
  // With the caller's copies of w1 and w2, or (null) from the 16-bit weights, which the layer quantizes.
  const auto make = [&](CLayer& l, const CMxfp8* mxfp8_w1, const CMxfp8* mxfp8_w2, const CTiled* t1 = nullptr,
                        const CTiled* t2 = nullptr) {
    const bool given = mxfp8_w1 != nullptr;
    l.tokens = kTokens;
    upload_bf16(l.wr, wr), upload_bf16(l.b1, b1), upload_bf16(l.b2, b2);
    l.db1 = DeviceArray<uint16_t>(kExperts * 2 * f), l.db2 = DeviceArray<uint16_t>(kExperts * h);
    l.mgr = DeviceArray<float>(kExperts * h);
    l.mg1 = DeviceArray<float>(kExperts * 2 * f * h), l.mg2 = DeviceArray<float>(kExperts * h * f);
    for (auto* a : {&l.x, &l.y, &l.dy, &l.dx}) *a = DeviceArray<uint16_t>(kTokens * h);
    mg_moe_layer_options lo = o;
    lo.prequantized_weights = given;
    mg_moe_layer_weights w = sized<mg_moe_layer_weights>();
    w.router = l.wr.get(), w.b1 = l.b1.get(), w.b2 = l.b2.get();
    w.main_grad_router = l.mgr.get(), w.main_grad1 = l.mg1.get(), w.main_grad2 = l.mg2.get();
    w.db1 = l.db1.get(), w.db2 = l.db2.get();
    if (given) {
      w.w1_mxfp8_data = mxfp8_w1->data.get(), w.w1_mxfp8_scales = mxfp8_w1->scales.get();
      w.w1_mxfp8_data_t = mxfp8_w1->data_t.get(), w.w1_mxfp8_scales_t = mxfp8_w1->scales_t.get();
      w.w2_mxfp8_data = mxfp8_w2->data.get(), w.w2_mxfp8_scales = mxfp8_w2->scales.get();
      w.w2_mxfp8_data_t = mxfp8_w2->data_t.get(), w.w2_mxfp8_scales_t = mxfp8_w2->scales_t.get();
      if (t1 != nullptr) w.w1_mxfp8_scales_tiled = t1->tiled.get(), w.w1_mxfp8_scales_t_tiled = t1->tiled_t.get();
      if (t2 != nullptr) w.w2_mxfp8_scales_tiled = t2->tiled.get(), w.w2_mxfp8_scales_t_tiled = t2->tiled_t.get();
    } else {
      upload_bf16(l.w1, w1), upload_bf16(l.w2, w2);
      w.w1 = l.w1.get(), w.w2 = l.w2.get();
    }
    ok(mg_moe_layer_create(&lo, &w, nullptr, &l.layer));
    ok(mg_moe_layer_weights_changed(l.layer, l.stream.get()));  // given: nothing to do, and accepted
  };

  CLayer own;
  make(own, nullptr, nullptr);
  // The caller's copies, from the same 16-bit values (own's device weights).
  const cudaStream_t s = own.stream.get();
  const CMxfp8 q1(own.w1.get(), kExperts, 2 * f, h, s), q2(own.w2.get(), kExperts, h, f, s);
  CLayer given, tiled;
  make(given, &q1, &q2);
  const CTiled t1(q1, kExperts, 2 * f, h, s), t2(q2, kExperts, h, f, s);
  make(tiled, &q1, &q2, &t1, &t2);

  for (CLayer* l : {&own, &given, &tiled}) l->reset(x, dy, count);
  ASSERT_EQ(own.train_step(), "");
  ASSERT_EQ(given.train_step(), "");
  ASSERT_EQ(tiled.train_step(), "");
  for (CLayer* l : {&own, &given, &tiled}) ok(mg_moe_layer_check_device_errors(l->layer, l->stream.get()));

  const auto bits16 = [](const DeviceArray<uint16_t>& a, std::size_t count16) {
    std::vector<uint16_t> all = a.download();
    all.resize(count16);
    return all;
  };
  const std::size_t used = count * h, all_rows = kTokens * h;
  const std::vector<uint16_t> y = bits16(own.y, used);
  EXPECT_EQ(nan_count(y), 0u);
  EXPECT_TRUE(any_nonzero(y));
  EXPECT_TRUE(identical(bits16(given.y, used), y)) << "y";
  EXPECT_TRUE(identical(bits16(tiled.y, used), y)) << "y, tiled scales";
  EXPECT_EQ(nan_count(bits16(own.dx, all_rows)), 0u) << "dx, rows past the tokens written as zero";
  EXPECT_TRUE(identical(bits16(given.dx, all_rows), bits16(own.dx, all_rows))) << "dx";
  EXPECT_TRUE(identical(bits16(tiled.dx, all_rows), bits16(own.dx, all_rows))) << "dx, tiled scales";
  EXPECT_EQ(nan_count(bits16(own.db1, own.db1.size())) + nan_count(bits16(own.db2, own.db2.size())), 0u);
  EXPECT_TRUE(identical(given.db1.download(), own.db1.download())) << "db1";
  EXPECT_TRUE(identical(given.db2.download(), own.db2.download())) << "db2";
  const std::pair<const char*, DeviceArray<float> CLayer::*> grads[] = {
      {"main_grad_router", &CLayer::mgr}, {"main_grad1", &CLayer::mg1}, {"main_grad2", &CLayer::mg2}};
  for (const auto& [name, grad] : grads) {
    const std::vector<uint32_t> want = bits_of((own.*grad).download());
    EXPECT_TRUE(any_nonzero(want)) << name;
    EXPECT_EQ(nan_count(want), 0u) << name;
    EXPECT_TRUE(identical(bits_of((given.*grad).download()), want)) << name;
    EXPECT_TRUE(identical(bits_of((tiled.*grad).download()), want)) << name << ", tiled scales";
  }

  // Inference: the training forward's y again, on both.
  for (CLayer* l : {&own, &given, &tiled}) {
    l->y.poison();
    const mg_moe_layer_io io = l->io();
    ok(mg_moe_layer_forward(l->layer, &io, /*train=*/0, l->stream.get()));
    ok(mg_moe_layer_check_device_errors(l->layer, l->stream.get()));
    EXPECT_TRUE(identical(bits16(l->y, used), y))
        << (l == &own ? "own" : l == &given ? "given" : "given, tiled scales") << ": inference y";
  }
}

}  // namespace
}  // namespace moegraph::test
