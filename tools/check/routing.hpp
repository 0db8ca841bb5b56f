// The routing of a check case: how many rows each expert gets, first and on every graph replay.
//   explicit       {"splits": [...]}                   the same splits every time
//   random         {"rows", "seed", "skew"}            fresh random splits of `rows` each time;
//                                                      skew 0 is uniform, else a Zipf exponent
//   empty_experts  {"rows", "seed", "experts": [...]}  fresh random splits; the listed experts get none
//   one_expert     {"rows", "expert"}                  every row to one expert
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "tools/check/case_json.hpp"

namespace moegraph::check {

enum class RoutingKind { kExplicit, kRandom, kEmptyExperts, kOneExpert };

struct RoutingSpec {
  RoutingKind kind = RoutingKind::kExplicit;
  std::vector<int32_t> splits;     // kExplicit
  int64_t rows = 0;                // the other kinds
  uint64_t seed = 0;               // kRandom, kEmptyExperts
  double skew = 0.0;               // kRandom
  std::vector<int> empty_experts;  // kEmptyExperts
  int expert = 0;                  // kOneExpert
};

// Reads and validates `value` (at `path`) for a layer of `groups` experts.
RoutingSpec read_routing(const Json& value, const std::string& path, int groups);

// Produces the splits of a routing: the first call gives the initial routing, later calls the
// routing of each replay (new for random kinds, the same total rows every time).
class SplitGenerator {
 public:
  SplitGenerator(const RoutingSpec& spec, int groups);
  std::vector<int32_t> next();

 private:
  RoutingSpec spec_;
  int groups_;
  std::mt19937_64 rng_;
};

}  // namespace moegraph::check
