// Unit tests of the C++ core without Python: the free list, the contiguous policy's
// extent reservations and table placement, and the fenced queue.
// Build and run: g++ -std=c++17 -O1 -I cpp cpp/tests/test_core.cpp cpp/*.cpp && ./a.out
// (tests/native/test_cpp_core.py does this; CMake: -DKVPOOL_BUILD_TESTS=ON, ctest).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <random>
#include <tuple>
#include <type_traits>
#include <vector>

#include "extent_reservations.h"
#include "fenced_free_queue.h"
#include "free_block_list.h"
#include "table_placement.h"

using kvpool::ExtentReservations;
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

// Fault injection: operator new of this binary fails the k-th allocation after
// arm(k), once (the strong exception guarantee tests below).
static long g_countdown = -1;
static bool g_failed = false;
static void arm(long k) {
  g_countdown = k;
  g_failed = false;
}
static bool disarm() {
  g_countdown = -1;
  return g_failed;
}
void* operator new(std::size_t n) {
  if (g_countdown >= 0 && g_countdown-- == 0) {
    g_countdown = -1;
    g_failed = true;
    throw std::bad_alloc();
  }
  void* p = std::malloc(n ? n : 1);
  if (!p) throw std::bad_alloc();
  return p;
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

using ListState = std::tuple<std::vector<int32_t>, int32_t, int32_t, int, int32_t, int32_t>;
static ListState state_of(const FreeBlockList& l) {
  return ListState(l.to_vector(), l.size(), l.capacity(), static_cast<int>(l.order()),
                   l.num_reserved_owners(), l.uncached().count());
}

// For every k: the k-th allocation inside `op` fails; the list must be as before.
// Returns the number of allocation points (an op that allocates nothing has 0).
template <typename Make, typename Op>
static int sweep_list(Make make, Op op) {
  for (long k = 0; k < 10000; ++k) {
    FreeBlockList l = make();
    ListState before = state_of(l);
    arm(k);
    bool threw = false;
    try {
      op(l);
    } catch (const std::bad_alloc&) {
      threw = true;
    }
    bool hit = disarm();
    if (!hit) {
      CHECK(!threw);
      l.check_invariants();
      return static_cast<int>(k);
    }
    CHECK(threw);
    CHECK(state_of(l) == before);
    l.check_invariants();
  }
  CHECK(false);
  return -1;
}

// A used list: some slots taken, some given back at the front, some at the tail.
static FreeBlockList used_list(FreeBlockList::Order order) {
  FreeBlockList l(64, true);
  if (order != FreeBlockList::kVllmOrder) l.set_order(order);
  int32_t taken[20];
  l.popleft_n(20, taken);
  l.prepend_n(taken + 10, 4);  // 10..13 back uncached
  l.append_n(taken + 2, 5);    // 2..6 back at the LRU tail
  return l;
}

static void test_strong_guarantee_on_bad_alloc() {
  static_assert(std::is_nothrow_default_constructible<FreeBlockList>::value,
                "Cython builds the member in tp_new outside any try");
  FreeBlockList unallocated;
  CHECK(unallocated.size() == 0 && unallocated.capacity() == 0 && unallocated.empty());
  int points = 0;
  points += sweep_list([] { return used_list(FreeBlockList::kVllmOrder); },
                       [](FreeBlockList& l) { l.set_order(FreeBlockList::kContiguous); });
  points += sweep_list([] { return used_list(FreeBlockList::kSegments); },
                       [](FreeBlockList& l) { l.set_order(FreeBlockList::kContiguous); });
  points += sweep_list([] { return used_list(FreeBlockList::kVllmOrder); },
                       [](FreeBlockList& l) { l.set_order(FreeBlockList::kSegments); });
  points += sweep_list([] { return used_list(FreeBlockList::kContiguous); },
                       [](FreeBlockList& l) { l.rebuild_uncached_canonical(); });
  points += sweep_list([] { return used_list(FreeBlockList::kContiguous); },
                       [](FreeBlockList& l) { l.grow(5); });
  points += sweep_list([] { return used_list(FreeBlockList::kVllmOrder); },
                       [](FreeBlockList& l) { l.reset(128, true); });
  // take(): the continuation 10..13, then a new extent for owner 9 (its record is the
  // allocation); a second take for the same owner needs room for a second record.
  points += sweep_list([] { return used_list(FreeBlockList::kContiguous); }, [](FreeBlockList& l) {
    int32_t out[12];
    l.take(12, 10, 9, 16, out);
  });
  points += sweep_list([] {
    FreeBlockList l = used_list(FreeBlockList::kContiguous);
    int32_t out[3];
    l.take(3, -1, 9, 3, out);
    return l;
  }, [](FreeBlockList& l) {
    int32_t out[12];
    l.take(12, 60, 9, 16, out);
  });
  CHECK(points >= 8);  // every operation above allocates at least once

  // The fenced queue: push_parts is all or nothing, drain reserves its output first.
  for (long k = 0; k < 1000; ++k) {
    FencedFreeQueue q;
    int64_t h[6] = {1, 2, 3, 4, 5, 6};
    q.push(1, h, 2, false);
    size_t sizes[3] = {3, 0, 1};
    arm(k);
    bool threw = false;
    try {
      q.push_parts(2, h + 2, sizes, 3);
    } catch (const std::bad_alloc&) {
      threw = true;
    }
    if (!disarm()) {
      CHECK(q.num_entries() == 3 && q.num_heads() == 2 && q.num_blocks() == 6);
      break;
    }
    CHECK(threw && q.num_entries() == 1 && q.num_heads() == 1 && q.num_blocks() == 2);
  }
  for (long k = 0; k < 1000; ++k) {
    FencedFreeQueue q;
    int64_t h[4] = {1, 2, 3, 4};
    q.push(1, h, 2, false);
    q.push(2, h + 2, 2, false);
    std::vector<int64_t> out;
    std::vector<size_t> ends;
    arm(k);
    bool threw = false;
    try {
      q.drain(5, out, &ends);
    } catch (const std::bad_alloc&) {
      threw = true;
    }
    if (!disarm()) {
      CHECK(q.empty() && out == std::vector<int64_t>({1, 2, 3, 4}));
      break;
    }
    CHECK(threw && q.num_entries() == 2 && out.empty());
  }
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
  // discard_back removes the last request, all its parts, and nothing before it.
  CHECK(q.discard_back() == 0);
  q.push(1, a, 2);
  uint64_t v = q.version();
  q.push(2, b, 1);
  q.push(2, c, 1, true);
  CHECK(q.discard_back() == 2 && q.version() != v);
  CHECK(q.num_entries() == 1 && q.num_heads() == 1 && q.num_blocks() == 2);
  q.push(3, c, 1);  // the buffer was shrunk back: the new entry follows the first
  out.clear();
  CHECK(q.drain(5, out, nullptr) == 2 && out == (std::vector<int64_t>{1, 2, 4}));
  q.push(1, a, 2);
  CHECK(q.discard_back() == 1 && q.empty() && q.num_blocks() == 0 && q.num_heads() == 0);
}

// The contiguous order against a model of vLLM's list (uncached segment LIFO, then
// never-used, then LRU): the same slots are free, the LRU segment has the same order,
// and every take() reaches the LRU segment exactly when vLLM's popleft_n would, taking
// the same LRU slots in the same order. Only which uncached slots are taken differs.
static void test_contiguous_order_keeps_vllm_lru_segment() {
  const int32_t cap = 300;
  FreeBlockList l(cap, true);
  l.set_order(FreeBlockList::kContiguous);
  std::vector<int32_t> uncached_model, lru_model;  // vLLM: front = uncached_model[0]
  for (int32_t s = 0; s < cap; ++s) uncached_model.push_back(s);
  std::vector<int32_t> held;
  uint64_t rng = 12345;
  auto next = [&](uint64_t m) { rng = rng * 6364136223846793005ULL + 1442695040888963407ULL; return (rng >> 33) % m; };
  int32_t owners = 0;
  for (int step = 0; step < 20000; ++step) {
    int op = static_cast<int>(next(4));
    if (op == 0 && l.size() > 0) {  // allocation
      int32_t n = static_cast<int32_t>(1 + next(std::min<uint64_t>(l.size(), 12)));
      int32_t hint = held.empty() || next(2) ? -1 : held[next(held.size())] + 1;
      int32_t owner = static_cast<int32_t>(next(4));
      std::vector<int32_t> out(n);
      l.take(n, hint, owner, static_cast<int32_t>(n + next(8)), out.data());
      int32_t from_uncached = std::min<int32_t>(n, static_cast<int32_t>(uncached_model.size()));
      for (int32_t i = 0; i < n; ++i) {
        if (i < from_uncached) {
          auto it = std::find(uncached_model.begin(), uncached_model.end(), out[i]);
          CHECK(it != uncached_model.end());
          uncached_model.erase(it);
        } else {
          CHECK(!lru_model.empty() && lru_model.front() == out[i]);
          lru_model.erase(lru_model.begin());
        }
        held.push_back(out[i]);
      }
      if (next(5) == 0) l.release(owner);
      owners = std::max(owners, owner);
    } else if ((op == 1 || op == 2) && !held.empty()) {  // free: without (1) / with (2) a hash
      int32_t k = static_cast<int32_t>(1 + next(std::min<uint64_t>(held.size(), 6)));
      std::vector<int32_t> batch(held.end() - k, held.end());
      held.resize(held.size() - k);
      std::reverse(batch.begin(), batch.end());
      if (op == 1) {
        l.prepend_n_unchecked(batch.data(), k);
        uncached_model.insert(uncached_model.begin(), batch.begin(), batch.end());
      } else {
        l.append_n_unchecked(batch.data(), k);
        lru_model.insert(lru_model.end(), batch.begin(), batch.end());
      }
    } else if (op == 3 && !lru_model.empty()) {  // a prefix-cache hit takes an LRU block
      int32_t s = lru_model[next(lru_model.size())];
      l.remove(s);
      lru_model.erase(std::find(lru_model.begin(), lru_model.end(), s));
      held.push_back(s);
    }
    if (step % 97 == 0) {
      l.check_invariants();
      std::vector<int32_t> got = l.to_vector();
      std::vector<int32_t> want_uncached = uncached_model;
      std::sort(want_uncached.begin(), want_uncached.end());
      std::vector<int32_t> want = want_uncached;
      want.insert(want.end(), lru_model.begin(), lru_model.end());
      CHECK(got == want);
    }
  }
  l.release_all();
  CHECK(l.num_reserved_owners() == 0);
}

// Range updates agree with per-slot ones, across word boundaries.
static void test_slot_bitmap_ranges() {
  kvpool::SlotBitmap a(300), b(300);
  int32_t ranges[][2] = {{0, 1}, {3, 64}, {63, 130}, {128, 192}, {250, 300}, {5, 5}};
  for (auto& r : ranges) {
    a.set_range(r[0], r[1]);
    for (int32_t s = r[0]; s < r[1]; ++s) b.set(s);
  }
  a.reset_range(70, 129);
  for (int32_t s = 70; s < 129; ++s) b.reset(s);
  CHECK(a.count() == b.count());
  for (int32_t s = 0; s < 300; ++s) CHECK(a.test(s) == b.test(s));
  for (int32_t s = 0; s <= 300; ++s) CHECK(a.find_next(s) == b.find_next(s) && a.find_prev(s) == b.find_prev(s));
  // Members: 0, 3..69, 129..191, 250..299.
  CHECK(a.find_run(67, nullptr) == 3 && a.find_run(68, nullptr) == -1 && a.find_run(1, nullptr) == 0);
  kvpool::SlotBitmap excluded(300);
  excluded.set_range(0, 70);
  CHECK(a.find_run(60, &excluded) == 129 && a.find_run(64, &excluded) == -1 && a.find_run(50, &excluded) == 129);
}

// take(): a table continues at hint; a new owner's extent avoids other owners'
// reservations; undoing a take puts every slot back where it was.
static void test_contiguous_take_extents_and_reinsert() {
  FreeBlockList l(64, true);
  l.set_order(FreeBlockList::kContiguous);
  int32_t a[4], b[2], c[3];
  l.take(4, -1, 1, 10, a);  // owner 1 reserves [0, 10)
  CHECK(a[0] == 0 && a[3] == 3);
  l.take(2, -1, 2, 8, b);   // owner 2: first fit after owner 1's extent
  CHECK(b[0] == 10 && b[1] == 11);
  l.take(3, a[3] + 1, 1, 0, c);  // owner 1 continues its table
  CHECK(c[0] == 4 && c[2] == 6);
  int32_t d[2];
  l.take(2, -1, 0, 0, d);  // no owner: lowest unreserved
  CHECK(d[0] == 18 && d[1] == 19);
  std::vector<int32_t> before = l.to_vector();
  int32_t e[40];
  l.append_n_unchecked(d, 2);  // 18, 19 now in the LRU segment
  before = l.to_vector();
  l.take(40, -1, 0, 0, e);
  l.reinsert_front(e, 40);
  CHECK(l.to_vector() == before);
  l.check_invariants();
  l.release(1);
  int32_t f[1];
  l.take(1, -1, 0, 0, f);
  CHECK(f[0] == 7);  // owner 1's extent is free for anyone again
  int32_t runs = 0, longest = 0;
  l.free_runs(&runs, &longest);
  CHECK(runs >= 1 && longest >= 1);
}

// The extent reservations on their own: record, query, release, truncate, and the
// strong guarantee of the one call that allocates (open).
static void test_extent_reservations() {
  ExtentReservations none;
  CHECK(none.num_owners() == 0 && none.num_extents(1) == 0);
  ExtentReservations r(32);
  CHECK(r.open(7));   // a new owner
  CHECK(!r.open(7));  // known now (its entry is kept until closed or released)
  r.close_if_empty(7);
  CHECK(r.num_owners() == 0);  // nothing recorded: dropped
  CHECK(r.open(7));
  r.record(7, 4, 6);  // [4, 10)
  CHECK(r.open(9));
  r.record(9, 12, 3);  // [12, 15)
  CHECK(!r.open(7));
  r.record(7, 20, 2);  // owner 7's second extent, [20, 22)
  CHECK(r.num_owners() == 2 && r.num_extents(7) == 2 && r.num_extents(9) == 1);
  CHECK(r.num_reserved_slots() == 11);
  CHECK(r.is_reserved(4) && r.is_reserved(9) && !r.is_reserved(10) && !r.is_reserved(3));
  CHECK(r.owner_of(5) == 7 && r.owner_of(13) == 9 && r.owner_of(11) == 0);
  CHECK(r.usable_by(5, 7) && !r.usable_by(5, 9) && !r.usable_by(5, 0) && r.usable_by(11, 9));
  CHECK(r.reserved().find_run(4, nullptr) == 4);  // the reserved slots, as a bitmap
  r.truncate(7, 1);  // the undo of a take() that recorded [20, 22)
  CHECK(r.num_extents(7) == 1 && !r.is_reserved(20) && r.owner_of(21) == 0);
  r.release(9);
  CHECK(r.num_owners() == 1 && !r.is_reserved(13) && r.owner_of(13) == 0);
  r.release(42);  // unknown owner: nothing
  r.truncate(7, 0);
  CHECK(r.num_owners() == 0 && r.num_reserved_slots() == 0);
  CHECK(r.open(1) && r.open(2));
  r.record(1, 0, 2);
  r.record(2, 30, 2);
  r.release_all();
  CHECK(r.num_owners() == 0 && r.num_reserved_slots() == 0 && r.owner_of(31) == 0);
  // Growing: the room first (may throw), then the size (cannot).
  r.reserve_capacity(64);
  r.set_capacity(64);
  CHECK(r.open(3));
  r.record(3, 60, 4);
  CHECK(r.owner_of(63) == 3 && r.usable_by(63, 3));
  // open() allocates (a map node, the owner's room): a bad_alloc changes nothing.
  for (long k = 0; k < 4; ++k) {
    arm(k);
    bool threw = throws<std::bad_alloc>([&] { r.open(100 + static_cast<int32_t>(k)); });
    bool failed = disarm();
    CHECK(threw == failed);
    CHECK(r.num_owners() == (threw ? 1 : 2));
    if (!threw) r.close_if_empty(100 + static_cast<int32_t>(k));
  }
  CHECK(r.num_owners() == 1 && r.num_extents(3) == 1);
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

// place_ascending: ids sorted with their objects, rotated to start at `cont` only
// when it is one of them; take() says how many slots were uncached.
static void test_place_ascending_and_take_counts() {
  std::vector<std::pair<int32_t, int>> scratch;
  scratch.reserve(8);
  int32_t ids[6] = {13, 12, 11, 10, 31, 30};
  int objs[6] = {113, 112, 111, 110, 131, 130};
  kvpool::place_ascending(ids, objs, 6, 30, scratch);
  const int32_t want_ids[6] = {30, 31, 10, 11, 12, 13};
  for (int i = 0; i < 6; ++i) CHECK(ids[i] == want_ids[i] && objs[i] == want_ids[i] + 100);
  kvpool::place_ascending(ids, objs, 6, 14, scratch);  // 14 is not among them: plain sort
  const int32_t sorted_ids[6] = {10, 11, 12, 13, 30, 31};
  for (int i = 0; i < 6; ++i) CHECK(ids[i] == sorted_ids[i] && objs[i] == sorted_ids[i] + 100);
  CHECK(scratch.capacity() == 8);  // nothing allocated
  std::mt19937 rng(7);
  for (int round = 0; round < 200; ++round) {
    std::vector<int32_t> v(1 + rng() % 8);
    for (auto& x : v) x = static_cast<int32_t>(rng() % 1000);
    std::sort(v.begin(), v.end());
    v.erase(std::unique(v.begin(), v.end()), v.end());
    std::vector<int32_t> shuffled = v;
    std::shuffle(shuffled.begin(), shuffled.end(), rng);
    std::vector<int> o(shuffled.begin(), shuffled.end());
    int32_t cont = v[rng() % v.size()];
    kvpool::place_ascending(shuffled.data(), o.data(), static_cast<int32_t>(v.size()), cont, scratch);
    CHECK(shuffled[0] == cont);
    for (size_t i = 0; i < v.size(); ++i) CHECK(o[i] == shuffled[i]);
    std::rotate(v.begin(), std::find(v.begin(), v.end(), cont), v.end());
    CHECK(shuffled == v);
  }
  // take(): 4 uncached slots left, then the LRU front.
  FreeBlockList l(16, true);
  l.set_order(FreeBlockList::kContiguous);
  int32_t out[16];
  l.popleft_n(16, out);
  l.prepend_n(out, 4);       // 0..3 uncached
  l.append_n(out + 10, 3);   // 10..12 at the LRU tail
  int32_t got[6];
  CHECK(l.take(6, -1, 0, 0, got) == 4);
  CHECK(got[4] == 10 && got[5] == 11);
  CHECK(l.take(1, -1, 0, 0, got) == 0 && got[0] == 12);

  // An LRU window: the m taken may be any m of the m + W oldest, when that makes fewer
  // runs (the table's continuation counted); otherwise vLLM's m oldest.
  FreeBlockList w(64, true);
  w.set_order(FreeBlockList::kContiguous);
  int32_t all[64];
  w.popleft_n(64, all);
  const int32_t lru[6] = {30, 31, 5, 6, 7, 40};
  w.append_n(lru, 6);  // the table ends at block 4: its continuation is 5
  CHECK(w.take(2, 5, 0, 0, got, 2) == 0 && got[0] == 5 && got[1] == 6);  // {30, 31} left
  CHECK(w.take(1, 7, 0, 0, got, 1) == 0 && got[0] == 30);  // 7 is outside {30, 31}: vLLM's
  CHECK(w.take(1, 7, 0, 0, got, 2) == 0 && got[0] == 7);   // {31, 7, 40}: the continuation
  CHECK(w.size() == 2 && w.front() == 31 && w.back() == 40);
  CHECK(w.take(2, 50, 0, 0, got, 0) == 0 && got[0] == 31 && got[1] == 40);  // W = 0: vLLM's
  const int32_t lru2[5] = {20, 21, 9, 22, 23};
  w.append_n(lru2, 5);
  CHECK(w.take(4, -1, 0, 0, got, 1) == 0);  // {20, 21, 22, 23}: one run instead of two
  CHECK(got[0] == 20 && got[1] == 21 && got[2] == 22 && got[3] == 23 && w.front() == 9);
  CHECK(w.take(1, -1, 0, 0, got, 100) == 0 && got[0] == 9 && w.size() == 0);  // W clamped
}

int main() {
  test_walk_and_detach_front();
  test_initial_order_and_pops();
  test_misuse_leaves_list_unchanged();
  test_prepend_append_remove_rebuild();
  test_rebuild_matches_sorted_free_set_randomly();
  test_fenced_queue_fifo_and_fences();
  test_fenced_queue_joined_parts();
  test_contiguous_order_keeps_vllm_lru_segment();
  test_contiguous_take_extents_and_reinsert();
  test_extent_reservations();
  test_slot_bitmap_ranges();
  test_strong_guarantee_on_bad_alloc();
  test_place_ascending_and_take_counts();
  if (failures) {
    std::fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  std::printf("cpp core: all checks passed\n");
  return 0;
}
