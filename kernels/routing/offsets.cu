#include <cub/block/block_scan.cuh>

#include "kernels/routing/offsets.hpp"
#include "kernels/routing/routing_common.cuh"
#include "moegraph/error.hpp"

namespace moegraph::kernels {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) group_offsets_kernel(
    const int32_t* __restrict__ splits, int num_groups, int row_align, int64_t capacity,
    int64_t* __restrict__ offsets, DeviceErrorRecord* error) {
  using Scan = cub::BlockScan<int64_t, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int64_t carry;
  __shared__ int first_past_capacity;
  const int tid = threadIdx.x;
  if (tid == 0) {
    carry = 0;
    first_past_capacity = num_groups;
    offsets[0] = 0;
  }
  __syncthreads();
  for (int base = 0; base < num_groups; base += kThreads) {
    const int e = base + tid;
    int64_t span = 0;
    if (e < num_groups) {
      const int32_t s = splits[e];
      if (s < 0) raise_device_error(error, kDeviceErrorNegativeSplit, e, s, 0);
      else span = (static_cast<int64_t>(s) + row_align - 1) / row_align * row_align;
    }
    int64_t inclusive, block_total;
    Scan(scan_storage).InclusiveSum(span, inclusive, block_total);
    const int64_t end = carry + inclusive;
    if (e < num_groups) {
      if (end > capacity) atomicMin(&first_past_capacity, e);
      offsets[e + 1] = end < capacity ? end : capacity;
    }
    __syncthreads();  // everyone has read `carry` and the scan storage
    if (tid == 0) carry += block_total;
    __syncthreads();
  }
  if (tid == 0 && carry > capacity) raise_device_error(error, kDeviceErrorPastCapacity, first_past_capacity, carry, capacity);
}

}  // namespace

void launch_group_offsets(const int32_t* splits, int num_groups, int row_align,
                          int64_t capacity_rows, int64_t* offsets, DeviceErrorRecord* error,
                          cudaStream_t stream) {
  group_offsets_kernel<<<1, kThreads, 0, stream>>>(splits, num_groups, row_align, capacity_rows,
                                                   offsets, error);
  MG_LAUNCH_CHECK();
}

}  // namespace moegraph::kernels
