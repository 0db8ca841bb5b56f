// GPU test entry: exits 77 (Meson's SKIP) when no CUDA device is present.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  // Emulated expert-parallel ranks run concurrently on one GPU and wait for each other on the
  // device; lazily loading a kernel mid-step would stall the device for the waiting rank
  // (moegraph/expert_parallel.hpp). Set before CUDA initializes.
  setenv("CUDA_MODULE_LOADING", "EAGER", 1);
  // Every stream needs a hardware queue of its own while emulated ranks wait for each other: two
  // streams sharing one run in submission order, so a rank's kernel can sit behind another rank's
  // spinning barrier until the timeout. The grid tests drive six ranks with two streams each (the
  // test's and StepGraphs' set-up stream), more than the default 8 queues. A caller's value stays.
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  int devices = 0;
  const cudaError_t st = cudaGetDeviceCount(&devices);
  if (st != cudaSuccess || devices == 0) {
    std::printf("no CUDA device (%s): skipped %d tests\n", st != cudaSuccess ? cudaGetErrorString(st) : "none",
                ::testing::UnitTest::GetInstance()->total_test_count());
    return 77;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("device: %s, sm_%d%d, %d SMs\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount);
  return RUN_ALL_TESTS();
}
