// A device buffer whose last byte is the last byte of mapped memory: the address space after it is
// reserved and left unmapped, so a kernel that reads or writes past the buffer faults (an illegal
// address, reported by the next synchronization) instead of touching a neighbour's memory, as it
// would inside a cudaMalloc block or a caching allocator's segment. For tests of the promise that
// rows at or past a device-side count are never touched (MoeLayerIO).
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>

#include "moegraph/error.hpp"

namespace moegraph::testing {

class GuardedBuffer {
 public:
  // `bytes` a multiple of 16, so the buffer (ending on a granule boundary) is 16-byte aligned.
  explicit GuardedBuffer(std::size_t bytes) : bytes_(bytes) {
    MG_CHECK(bytes > 0 && bytes % 16 == 0, "GuardedBuffer: bytes must be a positive multiple of 16, got ", bytes);
    const Driver& d = driver();
    int device = 0;
    MG_CUDA_CHECK(cudaGetDevice(&device));
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    std::size_t granule = 0;
    check(d.granularity(&granule, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity");
    mapped_ = (bytes + granule - 1) / granule * granule;
    reserved_ = mapped_ + granule;  // the guard: one granule reserved, never mapped
    check(d.reserve(&base_, reserved_, granule, 0, 0), "cuMemAddressReserve");
    check(d.create(&handle_, mapped_, &prop, 0), "cuMemCreate");
    check(d.map(base_, mapped_, 0, handle_, 0), "cuMemMap");
    CUmemAccessDesc access{};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    check(d.set_access(base_, mapped_, &access, 1), "cuMemSetAccess");
  }
  ~GuardedBuffer() {
    const Driver& d = driver();
    cudaDeviceSynchronize();  // nothing may still use the memory; errors are the test's to report
    d.unmap(base_, mapped_);
    d.release(handle_);
    d.address_free(base_, reserved_);
  }
  GuardedBuffer(const GuardedBuffer&) = delete;
  GuardedBuffer& operator=(const GuardedBuffer&) = delete;

  void* get() const { return reinterpret_cast<void*>(base_ + mapped_ - bytes_); }

 private:
  // The virtual-memory calls, through the runtime's driver entry points (no link to libcuda).
  struct Driver {
    decltype(&cuMemGetAllocationGranularity) granularity;
    decltype(&cuMemAddressReserve) reserve;
    decltype(&cuMemCreate) create;
    decltype(&cuMemMap) map;
    decltype(&cuMemSetAccess) set_access;
    decltype(&cuMemUnmap) unmap;
    decltype(&cuMemRelease) release;
    decltype(&cuMemAddressFree) address_free;
  };
  template <class F>
  static void entry(const char* name, F& f) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status{};
    MG_CUDA_CHECK(cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &status));
    MG_CHECK(status == cudaDriverEntryPointSuccess && fn != nullptr, "the driver has no ", name);
    f = reinterpret_cast<F>(fn);
  }
  static const Driver& driver() {
    static const Driver d = [] {
      Driver r{};
      entry("cuMemGetAllocationGranularity", r.granularity);
      entry("cuMemAddressReserve", r.reserve);
      entry("cuMemCreate", r.create);
      entry("cuMemMap", r.map);
      entry("cuMemSetAccess", r.set_access);
      entry("cuMemUnmap", r.unmap);
      entry("cuMemRelease", r.release);
      entry("cuMemAddressFree", r.address_free);
      return r;
    }();
    return d;
  }
  static void check(CUresult r, const char* what) {
    MG_CHECK(r == CUDA_SUCCESS, "GuardedBuffer: ", what, " failed with CUresult ", static_cast<int>(r));
  }

  std::size_t bytes_ = 0, mapped_ = 0, reserved_ = 0;
  CUdeviceptr base_ = 0;
  CUmemGenericAllocationHandle handle_ = 0;
};

}  // namespace moegraph::testing
