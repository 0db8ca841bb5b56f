#include "kernels/common/device_query.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>

#include "moegraph/error.hpp"

namespace moegraph::kernels {

namespace {
// (device, kernel or null for the SM count, threads) -> the answer.
using Key = std::tuple<int, const void*, int>;
std::mutex g_mutex;
std::map<Key, int> g_cache;

template <class Query>
int cached(const Key& key, Query query) {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (const auto it = g_cache.find(key); it != g_cache.end()) return it->second;
  }
  const int value = query();
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_cache.emplace(key, value).first->second;
}

int current_device() {
  int device = 0;
  MG_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}
}  // namespace

int current_sm_count() {
  const int device = current_device();
  return cached({device, nullptr, 0}, [&] {
    int sms = 0;
    MG_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    return sms;
  });
}

int resident_blocks_per_sm(const void* kernel, int threads) {
  return cached({current_device(), kernel, threads}, [&] {
    int blocks = 0;
    MG_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, 0));
    return std::max(blocks, 1);
  });
}

}  // namespace moegraph::kernels
