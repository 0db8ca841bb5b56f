// The named device tensors of one MoE layer bucket. Each operator declares what it produces (and
// its own workspaces); the table lays them all out in one walk (null base: sizes only) and ops
// look their inputs up by name when they enqueue. A tensor is either per step (one buffer, reused
// by every phase) or saved (one buffer per wgrad slot: it lives from forward_train until the
// micro-batch's backward / delayed wgrad). With expert parallelism some tensors are placed in the
// rank's window instead (peers store into them): laid out by a second walk, identically on every
// rank, and addressable on every peer (peers()).
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kernels/comm/ep_exchange.hpp"
#include "moegraph/error.hpp"
#include "moegraph/expert_parallel.hpp"
#include "src/core/layout.hpp"

namespace moegraph::layer {

enum class Lifetime { kStep, kSaved };
enum class Placement { kWorkspace, kWindow };

class TensorTable {
 public:
  explicit TensorTable(int slots) : slots_(slots) {}

  // Declared by the producing op; names are unique.
  void declare(const std::string& name, std::size_t bytes, Lifetime lifetime,
               Placement placement = Placement::kWorkspace) {
    MG_CHECK(!index_.count(name), "tensor \"", name, "\" declared twice");
    index_[name] = entries_.size();
    entries_.push_back({name, bytes, lifetime, placement, {}});
  }
  // `name` is another name of `of` (already declared): the same buffers.
  void alias(const std::string& name, const std::string& of) {
    MG_CHECK(!index_.count(name), "tensor \"", name, "\" declared twice");
    const auto it = index_.find(of);
    MG_CHECK(it != index_.end(), "alias \"", name, "\" of undeclared tensor \"", of, "\"");
    index_[name] = it->second;
  }
  bool has(const std::string& name) const { return index_.count(name) != 0; }

  // Walks every tensor in declaration order, those placed in the window with `window` (which may
  // be null when none is): saved tensors once per slot ("slot1.name").
  void lay_out(LayoutWalker& workspace, LayoutWalker* window) {
    for (Entry& e : entries_) {
      e.ptrs.clear();
      LayoutWalker* walk = e.placement == Placement::kWindow ? window : &workspace;
      MG_CHECK(walk != nullptr, "tensor \"", e.name, "\" is placed in a window, but the layer has none");
      const int copies = e.lifetime == Lifetime::kSaved ? slots_ : 1;
      for (int s = 0; s < copies; ++s)
        e.ptrs.push_back(walk->take(e.lifetime == Lifetime::kSaved ? detail::concat("slot", s, ".", e.name) : e.name,
                                    e.bytes));
    }
  }

  // The window the kWindow tensors were laid out on (set-up, before any peers() call).
  void set_window(std::shared_ptr<EpWindow> window) { window_ = std::move(window); }
  // A window tensor's buffer on every rank, as this rank addresses it.
  kernels::PeerBases peers(const std::string& name, int slot = 0) const {
    MG_CHECK(window_ != nullptr, "tensor \"", name, "\": the layer has no expert-parallel window");
    const char* local = get<char>(name, slot);
    const std::ptrdiff_t offset = local - static_cast<const char*>(window_->local());
    MG_CHECK(offset >= 0 && static_cast<std::size_t>(offset) < window_->bytes(), "tensor \"", name,
             "\" is not in the window");
    kernels::PeerBases out;
    for (int r = 0; r < static_cast<int>(window_->ranks()); ++r)
      out.base[r] = static_cast<char*>(window_->peer(r)) + offset;
    return out;
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
    Placement placement;
    std::vector<void*> ptrs;
  };
  int slots_;
  std::shared_ptr<EpWindow> window_;
  std::vector<Entry> entries_;
  std::map<std::string, std::size_t> index_;
};

}  // namespace moegraph::layer
