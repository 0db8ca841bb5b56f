// An owning device allocation. Allocation happens at set-up only, never in an enqueue path.
#pragma once

#include <cstddef>
#include <utility>

namespace moegraph {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return ptr_; }
  template <class T>
  T* as() const { return static_cast<T*>(ptr_); }
  std::size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

// Zeroes `bytes` at device address p and waits until that is done. For set-up and for the queries
// that synchronize anyway (reading a device error record back), never an enqueue path. A plain
// cudaMemset would run on the default stream, which does not order the caller's non-blocking
// streams: a kernel enqueued there next could record an error that the late memset then erases.
void zero_now(void* p, std::size_t bytes);

}  // namespace moegraph
