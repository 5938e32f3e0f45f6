// Where one allocation's blocks go in the block table (the contiguous policy).
//
// vLLM hands an allocation's blocks to the table in free-queue order. Once the pool
// has wrapped, nearly every block of an allocation is evicted from the LRU front, and
// vLLM frees a request's blocks tail first, so those blocks come out in *descending*
// runs: each one its own NIXL descriptor (vLLM PR #55841, issue #55434). Which blocks
// are evicted, and in which order, is vLLM's (their ids carry the cached data); where
// each of them sits in the table is free. place_ascending() puts them in ascending
// id order, starting at the block that continues the table's last run when that block
// is among them: a sorted set of r runs is then r descriptors, or r - 1 after the
// table's previous block.
//
// Plain C++17, no Python headers; unit-tested in cpp/tests/test_core.cpp.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace kvpool {

// Sorts ids[0..n) ascending, applies the same permutation to objs[0..n), then rotates
// both so that `cont` (the id after the table's previous block; -1: none) comes first
// when it is one of the ids. `scratch` must have capacity >= n: nothing is allocated
// here, so this cannot throw.
template <typename T>
void place_ascending(int32_t* ids, T* objs, int32_t n, int32_t cont,
                     std::vector<std::pair<int32_t, T>>& scratch) noexcept {
  if (n <= 1) return;
  scratch.clear();  // keeps the capacity the caller reserved
  for (int32_t i = 0; i < n; ++i) scratch.emplace_back(ids[i], objs[i]);
  std::sort(scratch.begin(), scratch.end(),
            [](const std::pair<int32_t, T>& a, const std::pair<int32_t, T>& b) {
              return a.first < b.first;
            });
  if (cont >= 0) {
    auto at = std::lower_bound(
        scratch.begin(), scratch.end(), cont,
        [](const std::pair<int32_t, T>& a, int32_t id) { return a.first < id; });
    if (at != scratch.end() && at->first == cont) std::rotate(scratch.begin(), at, scratch.end());
  }
  for (int32_t i = 0; i < n; ++i) {
    ids[i] = scratch[static_cast<size_t>(i)].first;
    objs[i] = scratch[static_cast<size_t>(i)].second;
  }
}

}  // namespace kvpool
