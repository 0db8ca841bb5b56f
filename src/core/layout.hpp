// Carves named buffers out of one block of device memory. The same walk runs twice: with a null
// base to size the block (no GPU needed, e.g. for --plan), then with the real base.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace moegraph {

class LayoutWalker {
 public:
  static constexpr std::size_t kAlignment = 256;
  struct Entry {
    std::string name;
    std::size_t offset, bytes;
  };

  explicit LayoutWalker(std::byte* base = nullptr) : base_(base) {}

  // The next buffer of `bytes` bytes (aligned), or null when sizing or when bytes == 0.
  template <class T = void>
  T* take(std::string name, std::size_t bytes) {
    offset_ = (offset_ + kAlignment - 1) / kAlignment * kAlignment;
    entries_.push_back({std::move(name), offset_, bytes});
    std::byte* p = base_ != nullptr && bytes > 0 ? base_ + offset_ : nullptr;
    offset_ += bytes;
    return reinterpret_cast<T*>(p);
  }
  std::size_t bytes() const { return (offset_ + kAlignment - 1) / kAlignment * kAlignment; }
  const std::vector<Entry>& entries() const { return entries_; }

 private:
  std::byte* base_;
  std::size_t offset_ = 0;
  std::vector<Entry> entries_;
};

}  // namespace moegraph
