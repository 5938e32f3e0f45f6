// Unit tests of the C++ core without Python: the free list and the fenced queue.
// Build and run: g++ -std=c++17 -O1 -I cpp cpp/tests/test_core.cpp cpp/*.cpp && ./a.out
// (tests/test_cpp_core.py does this; CMake: -DKVPOOL_BUILD_TESTS=ON, ctest).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "fenced_free_queue.h"
#include "free_block_list.h"

using kvpool::FencedFreeQueue;
using kvpool::FreeBlockList;

static int failures = 0;
#define CHECK(cond)                                                   \
  do {                                                                \
    if (!(cond)) {                                                    \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                     \
    }                                                                 \
  } while (0)

template <typename E, typename F>
static bool throws(F f) {
  try {
    f();
  } catch (const E&) {
    return true;
  }
  return false;
}

static void test_initial_order_and_pops() {
  FreeBlockList l(6, true);
  CHECK(l.size() == 6 && l.front() == 0 && l.back() == 5);
  CHECK(l.popleft() == 0);
  int32_t out[3];
  l.popleft_n(3, out);
  CHECK(out[0] == 1 && out[1] == 2 && out[2] == 3);
  CHECK(l.to_vector() == (std::vector<int32_t>{4, 5}));
  CHECK(throws<kvpool::InvalidBlockState>([&] { l.popleft_n(3, out); }));
  CHECK(l.size() == 2);
  l.check_invariants();
}

static void test_misuse_leaves_list_unchanged() {
  FreeBlockList l(5, true);
  int32_t taken[2];
  l.popleft_n(2, taken);  // 0, 1 taken
  auto before = l.to_vector();
  CHECK(throws<kvpool::SlotOutOfRange>([&] { l.remove(7); }));
  CHECK(throws<kvpool::InvalidBlockState>([&] { l.remove(0); }));
  CHECK(throws<kvpool::InvalidBlockState>([&] { l.append(3); }));
  int32_t dup[3] = {0, 1, 0};
  CHECK(throws<kvpool::InvalidBlockState>([&] { l.append_n(dup, 3); }));
  int32_t bad[2] = {1, 9};
  CHECK(throws<kvpool::SlotOutOfRange>([&] { l.prepend_n(bad, 2); }));
  CHECK(l.to_vector() == before);
  CHECK(!l.contains(0) && !l.contains(1));  // marks were undone
  l.check_invariants();
}

static void test_prepend_append_remove_rebuild() {
  FreeBlockList l(8, true);
  int32_t out[8];
  l.popleft_n(8, out);
  int32_t a[3] = {5, 2, 7};
  l.append_n(a, 3);
  int32_t p[2] = {1, 6};
  l.prepend_n(p, 2);
  CHECK(l.to_vector() == (std::vector<int32_t>{1, 6, 5, 2, 7}));
  l.remove(5);
  CHECK(l.next_of(6) == 2 && l.prev_of(2) == 6 && l.prev_of(1) == -1 && l.next_of(7) == -1);
  l.rebuild_canonical();
  CHECK(l.to_vector() == (std::vector<int32_t>{1, 2, 6, 7}));
  l.check_invariants();
}

static void test_rebuild_matches_sorted_free_set_randomly() {
  std::mt19937 rng(7);
  for (int round = 0; round < 200; ++round) {
    int32_t n = 1 + rng() % 300;
    FreeBlockList l(n, true);
    std::vector<int32_t> taken;
    for (int op = 0; op < 200; ++op) {
      if (!l.empty() && rng() % 2) {
        taken.push_back(l.popleft());
      } else if (!taken.empty()) {
        size_t i = rng() % taken.size();
        int32_t s = taken[i];
        taken.erase(taken.begin() + i);
        if (rng() % 2) l.append(s); else l.prepend_n(&s, 1);
      }
    }
    auto free = l.to_vector();
    std::sort(free.begin(), free.end());
    l.rebuild_canonical();
    CHECK(l.to_vector() == free);
    l.check_invariants();
  }
}

static void test_fenced_queue_fifo_and_fences() {
  FencedFreeQueue q;
  int64_t a[2] = {1, 2}, b[1] = {3}, c[2] = {4, 5};
  q.push(1, a, 2);
  q.push(3, b, 1);
  q.push(2, c, 2);  // behind an unmet fence
  CHECK(q.ready_entries(2) == 1 && q.num_blocks() == 5);
  std::vector<int64_t> out;
  std::vector<size_t> ends;
  CHECK(q.drain(2, out, &ends) == 1);
  CHECK(out == (std::vector<int64_t>{1, 2}) && ends == (std::vector<size_t>{2}));
  out.clear();
  CHECK(q.drain(3, out, nullptr) == 2 && out == (std::vector<int64_t>{3, 4, 5}));
  CHECK(q.empty() && q.num_blocks() == 0);
  CHECK(throws<std::out_of_range>([&] { q.pop_front(out); }));
  // Many entries: compaction keeps offsets right.
  for (int64_t i = 0; i < 20000; ++i) q.push(i, &i, 1);
  out.clear();
  q.drain(9999, out, nullptr);
  CHECK(out.size() == 10000 && out.back() == 9999 && q.entry(0).fence_seq == 10000);
  out.clear();
  q.drain(1 << 30, out, nullptr);
  CHECK(out.size() == 10000 && out.front() == 10000);
}

// A request's KV cache groups are parts of one entry: counted once, freed one by one,
// and what is left of an entry after its first parts are removed is a head again.
static void test_fenced_queue_joined_parts() {
  FencedFreeQueue q;
  int64_t a[2] = {1, 2}, b[1] = {3}, c[1] = {4};
  CHECK(throws<std::invalid_argument>([&] { q.push(1, a, 2, true); }));  // nothing to join
  q.push(1, a, 2);
  CHECK(throws<std::invalid_argument>([&] { q.push(2, b, 1, true); }));  // other fence
  q.push(1, b, 1, true);
  q.push(2, c, 1);
  CHECK(q.num_entries() == 3 && q.num_heads() == 2 && q.num_blocks() == 4);
  CHECK(!q.entry(0).joined && q.entry(1).joined && !q.entry(2).joined);
  q.discard_front(1);
  CHECK(q.num_heads() == 2 && !q.entry(0).joined && q.entry(0).fence_seq == 1);
  std::vector<int64_t> out;
  CHECK(q.drain(5, out, nullptr) == 2 && out == (std::vector<int64_t>{3, 4}));
  CHECK(q.num_heads() == 0 && q.empty());
  q.push(1, a, 2);
  q.push(1, b, 1, true);
  q.clear();
  CHECK(q.num_heads() == 0 && q.num_entries() == 0);
}

// Walking the front with next_links and taking the walked run with detach_front is
// popleft_n; free_marks tells free slots from taken ones.
static void test_walk_and_detach_front() {
  FreeBlockList a(8, true), b(8, true);
  int32_t order[4] = {5, 2, 7, 0};
  for (FreeBlockList* l : {&a, &b}) {
    l->remove(5); l->remove(2); l->remove(7); l->remove(0);
    l->prepend_n(order, 4);  // 5 2 7 0 1 3 4 6
    l->remove(6);
  }
  const int32_t* next = a.next_links();
  int32_t walked[3], node = next[0];
  for (int i = 0; i < 3; ++i) {
    walked[i] = node - 2;
    node = next[node];
  }
  a.detach_front(walked, 3);
  int32_t popped[3];
  b.popleft_n(3, popped);
  CHECK(std::equal(walked, walked + 3, popped));
  CHECK(walked[0] == 5 && walked[1] == 2 && walked[2] == 7);
  CHECK(a.to_vector() == b.to_vector() && a.size() == b.size() && a.size() == 4);
  a.check_invariants();
  const int32_t* marks = a.free_marks();
  for (int32_t s = 0; s < 8; ++s) CHECK((marks[s] >= 0) == a.contains(s));
  a.detach_front(walked, 0);  // nothing
  CHECK(a.size() == 4);
}

int main() {
  test_walk_and_detach_front();
  test_initial_order_and_pops();
  test_misuse_leaves_list_unchanged();
  test_prepend_append_remove_rebuild();
  test_rebuild_matches_sorted_free_set_randomly();
  test_fenced_queue_fifo_and_fences();
  test_fenced_queue_joined_parts();
  if (failures) {
    std::fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  std::printf("cpp core: all checks passed\n");
  return 0;
}
