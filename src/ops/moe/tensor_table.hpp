// The named device tensors of one MoE layer bucket. Each operator declares what it produces (and
// its own workspaces); the table lays them all out in one walk (null base: sizes only) and ops
// look their inputs up by name when they enqueue. A tensor is either per step (one buffer, reused
// by every phase) or saved (one buffer per wgrad slot: it lives from forward_train until the
// micro-batch's backward / delayed wgrad).
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <vector>

#include "moegraph/error.hpp"
#include "src/core/layout.hpp"

namespace moegraph::layer {

enum class Lifetime { kStep, kSaved };

class TensorTable {
 public:
  explicit TensorTable(int slots) : slots_(slots) {}

  // Declared by the producing op; names are unique.
  void declare(const std::string& name, std::size_t bytes, Lifetime lifetime) {
    MG_CHECK(!index_.count(name), "tensor \"", name, "\" declared twice");
    index_[name] = entries_.size();
    entries_.push_back({name, bytes, lifetime, {}});
  }
  bool has(const std::string& name) const { return index_.count(name) != 0; }

  // Walks every tensor in declaration order: saved tensors once per slot ("slot1.name").
  void lay_out(LayoutWalker& walk) {
    for (Entry& e : entries_) {
      e.ptrs.clear();
      const int copies = e.lifetime == Lifetime::kSaved ? slots_ : 1;
      for (int s = 0; s < copies; ++s)
        e.ptrs.push_back(walk.take(e.lifetime == Lifetime::kSaved ? detail::concat("slot", s, ".", e.name) : e.name,
                                   e.bytes));
    }
  }

  // The tensor's buffer for `slot` (ignored for per-step tensors). Null when sized with a null
  // base or declared with zero bytes.
  template <class T = void>
  T* get(const std::string& name, int slot = 0) const {
    const auto it = index_.find(name);
    MG_CHECK(it != index_.end(), "no tensor \"", name, "\" was declared (an operator reads it before any produces it)");
    const Entry& e = entries_[it->second];
    MG_CHECK(!e.ptrs.empty(), "tensor \"", name, "\" read before the table was laid out");
    return static_cast<T*>(e.ptrs[e.lifetime == Lifetime::kSaved ? slot : 0]);
  }

 private:
  struct Entry {
    std::string name;
    std::size_t bytes;
    Lifetime lifetime;
    std::vector<void*> ptrs;
  };
  int slots_;
  std::vector<Entry> entries_;
  std::map<std::string, std::size_t> index_;
};

}  // namespace moegraph::layer
