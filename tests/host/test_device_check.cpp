// Set-up refuses a device it cannot run on, with its own error kind and status code, before any
// enqueue (so never inside a capture); without a GPU it says "no CUDA device" plainly.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <string>

#include "moegraph/error.hpp"
#include "moegraph/grouped_linear.hpp"
#include "moegraph/moe_layer.hpp"
#include "moegraph/moegraph.h"
#include "src/core/device_info.hpp"

namespace moegraph::test {
namespace {

bool has_gpu() {
  int count = 0;
  const bool yes = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  cudaGetLastError();
  return yes;
}

TEST(DeviceCheck, NonHopperDevicesAreRefusedByName) {
  for (const auto& [major, minor] : {std::pair{8, 0}, std::pair{8, 9}, std::pair{10, 0}, std::pair{9, 1}}) {
    DeviceInfo info;
    info.device = 3, info.name = "NVIDIA Test GPU", info.major = major, info.minor = minor, info.sm_count = 100;
    try {
      require_hopper(info);
      FAIL() << "compute capability " << major << "." << minor << " must be refused";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kUnsupportedDevice);
      const std::string want = "device 3 (NVIDIA Test GPU) has compute capability " + std::to_string(major) + "." +
                               std::to_string(minor) + "; moegraph's kernels need 9.0";
      EXPECT_NE(e.message().find(want), std::string::npos) << e.message();
    }
  }
  DeviceInfo hopper;
  hopper.major = 9, hopper.minor = 0;
  EXPECT_NO_THROW(require_hopper(hopper));
}

// Valid options, so the constructor gets past validation to the device: without a GPU that is
// kNoDevice (MG_ERR_NO_DEVICE through the C ABI); on the GPU machine (an H100/H200) it succeeds.
TEST(DeviceCheck, SetUpReportsAMissingDevice) {
  GroupedLinearOptions o;
  o.num_groups = 4, o.in_features = 64, o.out_features = 64, o.capacity_rows = 128;
  mg_grouped_linear_options c;
  mg_grouped_linear_options_init(&c);
  c.num_groups = 4, c.in_features = 64, c.out_features = 64, c.capacity_rows = 128;
  mg_grouped_linear* handle = nullptr;
  const mg_status status = mg_grouped_linear_create(&c, nullptr, &handle);
  if (has_gpu()) {
    EXPECT_NO_THROW(GroupedLinear{o});
    EXPECT_EQ(status, MG_OK) << mg_last_error();
    mg_grouped_linear_destroy(handle);
    return;
  }
  try {
    GroupedLinear op(o);
    FAIL() << "set-up without a GPU must throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kNoDevice);
    EXPECT_NE(e.message().find("no CUDA device is available"), std::string::npos) << e.message();
  }
  EXPECT_EQ(status, MG_ERR_NO_DEVICE);
  EXPECT_NE(std::string(mg_last_error()).find("no CUDA device is available"), std::string::npos) << mg_last_error();
  EXPECT_EQ(handle, nullptr);
}

// The weights every forward reads are checked at creation, before the device (a NULL router was
// read by the first forward's GEMM); without a GPU, valid arguments then meet the device check,
// which every set-up path reports as MG_ERR_NO_DEVICE (some reported MG_ERR_CUDA).
TEST(DeviceCheck, MoeLayerRefusesMissingWeightsBeforeTheDevice) {
  alignas(256) static uint8_t fake[256];
  MoeLayerOptions o;
  o.experts = 8, o.hidden = 128, o.ffn = 128, o.top_k = 2, o.max_tokens = 16, o.bias = true;
  MoeLayerWeights w;
  const auto refusal = [&] {
    try {
      MoeLayer layer(o, w);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.message();
      return e.message();
    }
    return std::string("created");
  };
  EXPECT_NE(refusal().find("MoeLayerWeights needs router"), std::string::npos) << refusal();
  w.router = fake;
  EXPECT_NE(refusal().find("MoeLayerWeights needs w1 and w2"), std::string::npos) << refusal();
  w.w1 = w.w2 = fake;
  EXPECT_NE(refusal().find("MoeLayerWeights needs b1 and b2 (bias)"), std::string::npos) << refusal();
  o.prequantized_weights = true, o.recipe = Recipe::kMXFP8, o.row_align = 32;
  EXPECT_NE(refusal().find("MoeLayerWeights needs w1_mxfp8.data and .scales (prequantized_weights)"),
            std::string::npos) << refusal();

  mg_moe_layer_options c;
  mg_moe_layer_options_init(&c);
  c.experts = 8, c.hidden = 64, c.ffn = 64, c.top_k = 2, c.max_tokens = 16;
  mg_moe_layer_weights none{};
  none.struct_size = sizeof none;
  mg_moe_layer* handle = nullptr;
  EXPECT_EQ(mg_moe_layer_create(&c, &none, nullptr, &handle), MG_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(mg_last_error()).find("MoeLayerWeights needs router"), std::string::npos) << mg_last_error();
  EXPECT_EQ(handle, nullptr);
  if (has_gpu()) return;
  mg_moe_layer_weights all = none;
  all.router = all.w1 = all.w2 = fake;
  EXPECT_EQ(mg_moe_layer_create(&c, &all, nullptr, &handle), MG_ERR_NO_DEVICE) << mg_last_error();
  EXPECT_EQ(handle, nullptr);
  uint8_t* const p = fake;
  EXPECT_EQ(mg_quantize_mxfp8_weights(MG_DTYPE_BF16, fake, 1, 32, 32, p, p, p, p, nullptr), MG_ERR_NO_DEVICE)
      << mg_last_error();
}

}  // namespace
}  // namespace moegraph::test
