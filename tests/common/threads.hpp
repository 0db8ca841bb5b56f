// Emulated ranks in tests: each rank's work runs on its own host thread, as one process per GPU
// would (the ranks meet at device barriers, so one thread cannot drive them all in turn).
#pragma once

#include <exception>
#include <thread>
#include <vector>

namespace moegraph::test {

// f(i) for i in [0, count), each on its own host thread; rethrows the first rank's exception after
// every thread has joined.
template <class F>
void on_threads(int count, F f) {
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(count);
  for (int r = 0; r < count; ++r)
    threads.emplace_back([&, r] {
      try {
        f(r);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace moegraph::test
