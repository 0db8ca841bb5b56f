// Helpers of the C ABI's GPU tests (test_c_abi_step.cpp, test_c_abi_ep_gpu.cpp,
// test_c_abi_linear_gpu.cpp): status checks, sized structs, stream-ordered copies, random data and
// bit-for-bit comparisons; a MoE layer made through the C ABI with its device tensors.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "moegraph/error.hpp"
#include "moegraph/moegraph.h"
#include "testing/graph.hpp"
#include "tests/common/expect.hpp"

namespace moegraph::test::c_abi_gpu {

// Throws with the C ABI's last error unless `status` is MG_OK (the test then fails, naming it).
inline void ok(mg_status status) {
  if (status != MG_OK) throw std::runtime_error(std::string(mg_status_string(status)) + ": " + mg_last_error());
}
inline bool last_error_has(const std::string& part) { return std::string(mg_last_error()).find(part) != std::string::npos; }

template <class T>
T sized() {
  T t{};
  t.struct_size = sizeof(T);
  return t;
}

// Stream-ordered copies; each waits, so host vectors may go away after it.
template <class T>
inline void to_device(void* dst, const std::vector<T>& v, cudaStream_t s) {
  MG_CUDA_CHECK(cudaMemcpyAsync(dst, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice, s));
  MG_CUDA_CHECK(cudaStreamSynchronize(s));
}
template <class T>
inline std::vector<T> to_host(const void* src, std::size_t count, cudaStream_t s) {
  std::vector<T> v(count);
  MG_CUDA_CHECK(cudaMemcpyAsync(v.data(), src, count * sizeof(T), cudaMemcpyDeviceToHost, s));
  MG_CUDA_CHECK(cudaStreamSynchronize(s));
  return v;
}
// All-ones bytes: NaN in bf16 and fp32.
inline void poison(void* p, std::size_t bytes, cudaStream_t s) { MG_CUDA_CHECK(cudaMemsetAsync(p, 0xff, bytes, s)); }

inline std::vector<uint16_t> random_bf16(std::mt19937_64& rng, std::size_t count, double scale) {
  return to_device_bits(random_values(rng, count, scale, DType::kBF16), DType::kBF16);
}
inline std::vector<float> random_fp32(std::mt19937_64& rng, std::size_t count, double scale) {
  const auto v = random_values(rng, count, scale, DType::kFP32);
  return std::vector<float>(v.begin(), v.end());
}
inline std::vector<uint32_t> bits_of(const std::vector<float>& v) {
  std::vector<uint32_t> out(v.size());
  std::transform(v.begin(), v.end(), out.begin(), [](float f) { return std::bit_cast<uint32_t>(f); });
  return out;
}

inline std::size_t nan_count(const std::vector<uint16_t>& bf16) {
  return std::count_if(bf16.begin(), bf16.end(), [](uint16_t b) { return (b & 0x7fff) > 0x7f80; });
}
inline std::size_t nan_count(const std::vector<uint32_t>& fp32) {
  return std::count_if(fp32.begin(), fp32.end(), [](uint32_t b) { return (b & 0x7fffffffu) > 0x7f800000u; });
}
template <class T>
inline bool any_nonzero(const std::vector<T>& v) {
  return std::any_of(v.begin(), v.end(), [](T b) { return b != 0; });
}

// Bit-for-bit equality, naming how many elements differ and the first.
template <class T>
::testing::AssertionResult identical(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << a.size() << " vs " << b.size() << " elements";
  std::size_t first = 0, count = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i] && count++ == 0) first = i;
  if (count == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << count << " of " << a.size() << " elements differ, the first at " << first
                                       << ": 0x" << std::hex << +a[first] << " vs 0x" << +b[first];
}

// `a` resized to hold v and given its values as bf16.
inline void upload_bf16(DeviceArray<uint16_t>& a, const Mat& v) {
  a = DeviceArray<uint16_t>(v.size());
  a.upload(to_device_bits(v, DType::kBF16));
}

// One layer made through the C ABI with its device tensors: a rank's (its experts' slice of the
// weights) or the whole layer's (every expert).
struct CLayer {
  int64_t tokens = 0;  // max_tokens
  DeviceArray<uint16_t> wr, w1, w2, b1, b2, db1, db2, x, y, dy, dx;
  DeviceArray<float> mgr, mg1, mg2;
  DeviceArray<int32_t> num_tokens{1};
  Stream stream;
  mg_moe_layer* layer = nullptr;
  ~CLayer() { mg_moe_layer_destroy(layer); }

  mg_moe_layer_io io() const {
    mg_moe_layer_io io = sized<mg_moe_layer_io>();
    io.x = x.get(), io.num_tokens = num_tokens.get(), io.y = y.get(), io.dy = dy.get(), io.dx = dx.get();
    return io;
  }
  // Inputs of `count` tokens (rows past it hold data the layer must ignore); outputs poisoned,
  // fp32 main_grad zeroed (it is accumulated into).
  void reset(const Mat& x_rows, const Mat& dy_rows, int64_t count) {
    x.upload(to_device_bits(x_rows, DType::kBF16));
    dy.upload(to_device_bits(dy_rows, DType::kBF16));
    num_tokens.upload({static_cast<int32_t>(count)});
    y.poison(), dx.poison(), db1.poison(), db2.poison();
    for (DeviceArray<float>* a : {&mgr, &mg1, &mg2}) memset_and_wait(a->get(), 0, a->size() * sizeof(float));
  }
  // forward (training) and backward, enqueued; the message of the first failure, or "".
  std::string train_step() {
    const mg_moe_layer_io a = io();
    mg_status s = mg_moe_layer_forward(layer, &a, /*train=*/1, stream.get());
    if (s == MG_OK) s = mg_moe_layer_backward(layer, &a, stream.get());
    return s == MG_OK ? std::string() : std::string(mg_status_string(s)) + ": " + mg_last_error();
  }
};

}  // namespace moegraph::test::c_abi_gpu
