// Index-based doubly linked list of free KV cache blocks.
//
// Mirrors the contract of vLLM 0.33.0's FreeKVCacheBlockQueue
// (vllm/v1/core/kv_cache_utils.py) without one Python object per link: a block is
// named by its slot (for a BlockPool, slot == block_id) and the links live in two
// int32 arrays. Node 0 is the fake head and node 1 the fake tail; slot s is node s+2.
// The fake nodes are never popped, so every free slot always has a prev and a next
// node and no operation branches on the list ends.
//
// Order is the eviction order: the front is allocated (or evicted) first. Every
// operation validates its arguments before it changes anything, so a rejected call
// leaves the list exactly as it was (no half-linked batch, no lost block). The same
// holds for std::bad_alloc (the strong exception guarantee): an operation that
// allocates does so before its first change.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "extent_reservations.h"
#include "slot_bitmap.h"

namespace kvpool {

// Raised for an argument outside the list's slots (maps to Python IndexError).
using SlotOutOfRange = std::out_of_range;
// Raised for a slot in the wrong state: removing a block that is not free, adding
// one that already is, popping from an empty list (maps to Python ValueError).
using InvalidBlockState = std::invalid_argument;

class FreeBlockList {
 public:
  static constexpr int32_t kNotFree = -1;

  // How free slots are ordered (docs/design.md, "Allocation policies"). vLLM's free
  // queue is always two segments: the *uncached* segment at the front (blocks freed
  // without a prefix-cache hash, prepended, then never-used blocks) and the *LRU*
  // segment behind it (blocks freed with a hash or released by unpin, appended).
  enum Order : int32_t {
    // vLLM's order; nothing is tracked. The default.
    kVllmOrder = 0,
    // vLLM's order, and each free slot remembers its segment (appended: LRU), so the
    // uncached segment can be sorted without touching the LRU segment
    // (rebuild_uncached_canonical).
    kSegments = 1,
    // The uncached segment is kept sorted by slot and indexed by a bitmap; inserting
    // an uncached slot links it at its sorted place. take() serves allocations from
    // it by position (a table's continuation, a new extent, the lowest slots) and
    // reaches the LRU segment, in vLLM's order, only when it is empty.
    kContiguous = 2,
  };

  // A list over `capacity` slots. With all_free, slots 0..capacity-1 are linked in
  // ascending order (vLLM's initial order); otherwise the list starts empty.
  explicit FreeBlockList(int32_t capacity, bool all_free = true);
  // An unallocated list: it allocates nothing and cannot throw (Cython constructs
  // members and temporaries this way, outside any try), and it must be reset()
  // before any other call but capacity/size/empty.
  FreeBlockList() noexcept = default;
  // Become a new list of `capacity` slots (as the constructor). Strong guarantee:
  // on bad_alloc the list is unchanged.
  void reset(int32_t capacity, bool all_free = true) {
    FreeBlockList fresh(capacity, all_free);
    swap(fresh);
  }
  void swap(FreeBlockList& other) noexcept;

  int32_t capacity() const { return capacity_; }
  int32_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  // True if `slot` is currently in the list. Throws SlotOutOfRange.
  bool contains(int32_t slot) const;

  // First / last free slot, or -1 if the list is empty.
  int32_t front() const { return empty() ? -1 : next_[kHead] - kFirst; }
  int32_t back() const { return empty() ? -1 : prev_[kTail] - kFirst; }
  // Neighbour of a free slot in eviction order; -1 when it is the fake head/tail.
  // Throws SlotOutOfRange, or InvalidBlockState if `slot` is not free.
  int32_t next_of(int32_t slot) const;
  int32_t prev_of(int32_t slot) const;

  // Remove and return the first free slot. Throws InvalidBlockState if empty.
  int32_t popleft();
  // Remove the first n slots into out[0..n). Throws InvalidBlockState if n > size.
  void popleft_n(int32_t n, int32_t* out);
  // Remove a free slot from anywhere in the list, O(1).
  void remove(int32_t slot);
  // Add slots at the tail (append) or the front (prepend) in the given order.
  // Each slot must be in range, not free and not repeated in the batch.
  void append(int32_t slot);
  void append_n(const int32_t* slots, int32_t n);
  void prepend_n(const int32_t* slots, int32_t n);
  // The same without validation, for callers that have already checked every slot
  // (in range, not free, listed once): the block pool's free loop does this per
  // block anyway, so the batch link is one pass.
  void append_n_unchecked(const int32_t* slots, int32_t n) {
    if (order_ != kVllmOrder) mark_segment(slots, n, 1);
    link_run_after(prev_[kTail], slots, n);
  }
  void prepend_n_unchecked(const int32_t* slots, int32_t n) {
    if (order_ == kContiguous) {
      insert_uncached(slots, n);
      return;
    }
    if (order_ == kSegments) mark_segment(slots, n, 0);
    link_run_after(kHead, slots, n);
  }
  // remove() that reports the neighbours it unlinked from, and its exact inverse:
  // undoing removals in reverse order restores the list ("dancing links"). For
  // callers that validated `slot` (free, in range).
  void remove_recording(int32_t slot, int32_t* prev_node, int32_t* next_node) {
    int32_t node = slot + kFirst;
    *prev_node = prev_[node];
    *next_node = next_[node];
    next_[*prev_node] = *next_node;
    prev_[*next_node] = *prev_node;
    prev_[node] = next_[node] = kNotFree;
    --size_;
    if (order_ == kContiguous) uncached_.reset(slot);
  }
  void undo_remove(int32_t slot, int32_t prev_node, int32_t next_node) {
    int32_t node = slot + kFirst;
    prev_[node] = prev_node;
    next_[node] = next_node;
    next_[prev_node] = node;
    prev_[next_node] = node;
    ++size_;
    ++insertions_;
    if (order_ == kContiguous && !lru_[slot]) uncached_.set(slot);
  }
  // contains() without the range check; `slot` must be in [0, capacity).
  bool contains_unchecked(int32_t slot) const { return prev_[slot + kFirst] >= 0; }
  // Slots ever put into the list (a counter that only grows): a caller that ran
  // foreign code can tell whether anything was freed in the meantime. Moves of free
  // slots (make_uncached, the canonical relinks, restore_lru_front) are not counted.
  uint64_t insertions() const { return insertions_; }
  // Per slot, a value >= 0 exactly when the slot is free (its prev link): for loops
  // that test many slots. Valid until the capacity changes (grow).
  const int32_t* free_marks() const { return prev_.data() + kFirst; }
  // The next links by node (node = slot + 2; node 0 is the fake head, node 1 the
  // fake tail), for a loop that walks the front of the list while it does other
  // work per slot, then takes what it walked with detach_front.
  const int32_t* next_links() const { return next_.data(); }
  // Unlink the first k free slots: slots[0..k) must be exactly the first k slots
  // of the list, in order (the caller walked them with next_links). O(k).
  void detach_front(const int32_t* slots, int32_t k) {
    if (k <= 0) return;
    int32_t after = next_[slots[k - 1] + kFirst];
    next_[kHead] = after;
    prev_[after] = kHead;
    for (int32_t i = 0; i < k; ++i) {
      prev_[slots[i] + kFirst] = next_[slots[i] + kFirst] = kNotFree;
    }
    size_ -= k;
    if (order_ == kContiguous) forget_uncached(slots, k);
  }

  // ---- allocation policies (Order) ----
  Order order() const { return order_; }
  // Switch the order. Leaving kVllmOrder treats every free slot as uncached (right
  // for a list that was never used: a pool at construction); kContiguous relinks the
  // free slots in ascending order.
  void set_order(Order order);
  // The uncached free slots (kContiguous only; empty otherwise).
  const SlotBitmap& uncached() const { return uncached_; }
  // kContiguous: choose n free slots for an allocation and unlink them, into out[0..n):
  // first the continuation of a table (hint, hint+1, ... while uncached and not
  // reserved by another owner), then a run of max(want, rest) unreserved uncached
  // slots (reserved for `owner`, first fit; if none, a run of `rest`), then the
  // lowest unreserved uncached slots, then uncached slots reserved by others, then the
  // LRU segment's front, as vLLM would. owner 0: no table, no reservation. Returns
  // how many of the slots came from the uncached segment (out[0..k)); the rest are
  // the LRU front's, in its order. Throws InvalidBlockState if n > size.
  // `lru_window` W > 0 (opt-in, not vLLM's LRU): the m slots taken from the LRU
  // segment may be any m of its m + W oldest, chosen to make fewer runs of
  // consecutive slots (counting the run that continues the table: the slot after
  // out[k-1], else `hint`): runs among those m + W are left out shortest first,
  // never the continuation's, then the youngest chosen; used only when that is fewer
  // runs than the m oldest make, else the m oldest (vLLM's) are taken. They are
  // unlinked in LRU order; an undo (reinsert_front) puts them at the LRU front.
  int32_t take(int32_t n, int32_t hint, int32_t owner, int32_t want, int32_t* out,
               int32_t lru_window = 0);
  // kContiguous, for the undo of a take() with an LRU window: the first `span` slots
  // of the LRU segment, in order, into out (returns how many); and, once every slot
  // is back, relinking those of `slots` that are free LRU slots at the LRU segment's
  // front in that order, which makes the front what lru_front_slots() saw. Cannot throw.
  int32_t lru_front_slots(int32_t span, int32_t* out) const noexcept {
    int32_t k = 0;
    for (int32_t node = next_[lru_anchor()]; node != kTail && k < span; node = next_[node]) out[k++] = node - kFirst;
    return k;
  }
  void restore_lru_front(const int32_t* slots, int32_t n) noexcept {
    if (order_ != kContiguous) return;  // (foreign code switched the order meanwhile)
    const uint64_t inserted = insertions_;  // moves, not frees: not counted
    int32_t last = lru_anchor();
    for (int32_t i = 0; i < n; ++i) {
      int32_t s = slots[i];
      if (s < 0 || s >= capacity_ || prev_[s + kFirst] < 0 || !lru_[s]) continue;
      unlink_one(s);
      link_run_after(last, &s, 1);
      last = s + kFirst;
    }
    insertions_ = inserted;
  }
  // Undo a take()/popleft_n: link slots back where they were taken from, uncached ones
  // at their sorted place and LRU ones, in the given order, at the LRU segment's
  // front. In the other orders this is prepend_n_unchecked without touching segments.
  void reinsert_front(const int32_t* slots, int32_t n);
  // kContiguous: the LRU segment's first slot, or -1 when it is empty.
  int32_t lru_front() const {
    int32_t node = next_[lru_anchor()];
    return node == kTail ? -1 : node - kFirst;
  }
  // kContiguous: move a free slot of the LRU segment into the uncached segment, at its
  // sorted place (its caller knows it holds no cached data anyone can hit).
  void make_uncached(int32_t slot) {
    check_free(slot);
    const uint64_t inserted = insertions_;  // a move, not a free: not counted
    unlink_one(slot);
    insert_uncached(&slot, 1);
    insertions_ = inserted;
  }
  // kContiguous: the tables' extent reservations (cpp/extent_reservations.h); empty
  // in the other orders.
  const ExtentReservations& extents() const { return extents_; }
  // Forget every reservation of `owner` (its request was freed) / of all owners.
  void release(int32_t owner) noexcept { extents_.release(owner); }
  void release_all() noexcept { extents_.release_all(); }
  int32_t num_reserved_owners() const { return extents_.num_owners(); }
  // Extents recorded for `owner`, and forgetting the ones after the first `keep` (the
  // undo of a take() whose allocation failed later). Cannot throw.
  int32_t num_extents(int32_t owner) const { return extents_.num_extents(owner); }
  void truncate_extents(int32_t owner, int32_t keep) noexcept { extents_.truncate(owner, keep); }
  // kSegments / kContiguous: relink the uncached segment in ascending slot order; the
  // LRU segment keeps its order, behind it. O(capacity).
  void rebuild_uncached_canonical();
  // Maximal runs of consecutive free slots (any segment): their number and the
  // longest. O(capacity).
  void free_runs(int32_t* num_runs, int32_t* longest) const;

  // Add `extra` slots (not free) at the end of the slot range.
  void grow(int32_t extra);
  // Undo grow(extra) of slots that were never made free (a caller's later step
  // failed). Shrinks without allocating: cannot throw.
  void ungrow(int32_t extra) noexcept {
    if (extra <= 0 || extra > capacity_) return;
    capacity_ -= extra;
    prev_.resize(static_cast<size_t>(capacity_) + kFirst);
    next_.resize(static_cast<size_t>(capacity_) + kFirst);
    if (order_ != kVllmOrder) lru_.resize(static_cast<size_t>(capacity_));
    if (order_ == kContiguous) extents_.set_capacity(capacity_);
    // The bitmaps keep their size: the dropped slots' bits are 0 and are never read.
  }
  // Relink every free slot in ascending slot order, O(capacity). The set of free
  // slots is unchanged; only their order is.
  void rebuild_canonical();
  // Relink the free slots in the order given: `slots` must be exactly the free set.
  void rebuild_in_order(const int32_t* slots, int32_t n);
  // Free slots in eviction order.
  std::vector<int32_t> to_vector() const;
  // Check the invariants (links symmetric, size matches, no cycle). For tests.
  void check_invariants() const;

 private:
  static constexpr int32_t kHead = 0;
  static constexpr int32_t kTail = 1;
  static constexpr int32_t kFirst = 2;

  void check_slot(int32_t slot) const;
  void check_free(int32_t slot) const;
  // Validate a batch for insertion; marks are undone before throwing.
  void validate_batch(const int32_t* slots, int32_t n);
  // Link n nodes, node_at(0) .. node_at(n-1), in that order right after node `anchor`.
  template <typename NodeAt>
  void splice_after(int32_t anchor, int32_t n, NodeAt node_at) {
    int32_t after = next_[anchor];
    int32_t last = anchor;
    for (int32_t i = 0; i < n; ++i) {
      int32_t node = node_at(i);
      next_[last] = node;
      prev_[node] = last;
      last = node;
    }
    next_[last] = after;
    prev_[after] = last;
    size_ += n;
    insertions_ += static_cast<uint64_t>(n);
  }
  void link_run_after(int32_t anchor, const int32_t* slots, int32_t n) {
    splice_after(anchor, n, [slots](int32_t i) { return slots[i] + kFirst; });
  }
  // Segment bookkeeping of the policies.
  void mark_segment(const int32_t* slots, int32_t n, uint8_t lru) {
    for (int32_t i = 0; i < n; ++i) lru_[slots[i]] = lru;
  }
  void forget_uncached(const int32_t* slots, int32_t n) {
    for (int32_t i = 0; i < n; ++i) uncached_.reset(slots[i]);
  }
  // kContiguous: link uncached slots at their sorted places.
  void insert_uncached(const int32_t* slots, int32_t n);
  // The node the LRU segment starts after: the last uncached node, or the fake head.
  int32_t lru_anchor() const {
    int32_t last = uncached_.find_prev(capacity_);
    return last < 0 ? kHead : last + kFirst;
  }
  void unlink_one(int32_t slot) {
    int32_t node = slot + kFirst;
    int32_t p = prev_[node], n = next_[node];
    next_[p] = n;
    prev_[n] = p;
    prev_[node] = next_[node] = kNotFree;
    --size_;
    if (order_ == kContiguous) uncached_.reset(slot);
  }
  // The relinking half of rebuild_uncached_canonical: `order` holds the uncached free
  // slots ascending (the first num_uncached) and then the LRU ones. Cannot throw.
  void link_uncached_canonical(const std::vector<int32_t>& order, size_t num_uncached) noexcept;
  // The free slots for link_uncached_canonical, by the segments in `lru` (per slot).
  std::vector<int32_t> uncached_canonical_order(const std::vector<uint8_t>& lru,
                                                size_t* num_uncached) const;
  // kContiguous: unlink the uncached slots [start, start + len), which are adjacent
  // nodes of the sorted uncached segment, in one splice; their slots go to out.
  void unlink_uncached_run(int32_t start, int32_t len, int32_t* out) {
    if (len <= 0) return;
    int32_t first = start + kFirst, last = start + len - 1 + kFirst;
    int32_t p = prev_[first], n = next_[last];
    next_[p] = n;
    prev_[n] = p;
    for (int32_t i = 0; i < len; ++i) {
      prev_[first + i] = next_[first + i] = kNotFree;
      out[i] = start + i;
    }
    size_ -= len;
    uncached_.reset_range(start, start + len);
  }

  int32_t capacity_ = 0;
  int32_t size_ = 0;
  uint64_t insertions_ = 0;
  std::vector<int32_t> prev_;
  std::vector<int32_t> next_;
  Order order_ = kVllmOrder;
  std::vector<uint8_t> lru_;        // per slot: 1 if it was last inserted at the tail
  SlotBitmap uncached_;             // kContiguous: free slots of the uncached segment
  ExtentReservations extents_;      // kContiguous: the tables' reserved extents
  // take()'s LRU window (see take()): `need` slots of the LRU segment's need + window
  // oldest into out, or 0 when they would make no fewer runs than the `need` oldest.
  // The scratch space is reserved by take(). Cannot throw.
  int32_t take_from_lru_window(int32_t need, int32_t cont, int32_t window, int32_t* out) noexcept;
  // take()'s scratch space for the LRU window (reserved before anything is unlinked):
  std::vector<int32_t> window_order_;  // the window's slots in LRU order
  std::vector<int32_t> window_;        // ... sorted
  std::vector<uint8_t> window_keep_;   // ... chosen (by sorted index)
  std::vector<int32_t> window_front_;  // the need oldest, sorted (vLLM's choice)
  std::vector<std::pair<int32_t, int32_t>> window_runs_;  // the window's runs (length, first index)
};

// ---- implementation (inline: the Cython loops call these per block) ----


namespace detail {
constexpr int32_t kMark = -2;  // transient mark used while validating a batch

inline std::string slot_msg(const char* what, int32_t slot) {
  return std::string(what) + " (slot " + std::to_string(slot) + ")";
}
}  // namespace detail

inline FreeBlockList::FreeBlockList(int32_t capacity, bool all_free) {
  if (capacity < 0) throw SlotOutOfRange("capacity must be >= 0");
  capacity_ = capacity;
  prev_.assign(static_cast<size_t>(capacity) + kFirst, kNotFree);
  next_.assign(static_cast<size_t>(capacity) + kFirst, kNotFree);
  prev_[kHead] = kNotFree;
  next_[kTail] = kNotFree;
  if (all_free) {
    size_ = capacity;
    int32_t last = kHead;
    for (int32_t node = kFirst; node < capacity + kFirst; ++node) {
      next_[last] = node;
      prev_[node] = last;
      last = node;
    }
    next_[last] = kTail;
    prev_[kTail] = last;
  } else {
    size_ = 0;
    next_[kHead] = kTail;
    prev_[kTail] = kHead;
  }
}

inline void FreeBlockList::check_slot(int32_t slot) const {
  if (slot < 0 || slot >= capacity_) {
    throw SlotOutOfRange("block slot " + std::to_string(slot) + " is out of range [0, " +
                         std::to_string(capacity_) + ")");
  }
}

inline bool FreeBlockList::contains(int32_t slot) const {
  check_slot(slot);
  return prev_[slot + kFirst] >= 0;
}

inline void FreeBlockList::check_free(int32_t slot) const {
  if (!contains(slot)) throw InvalidBlockState(detail::slot_msg("block is not in the free list", slot));
}

inline int32_t FreeBlockList::next_of(int32_t slot) const {
  check_free(slot);
  int32_t n = next_[slot + kFirst];
  return n == kTail ? -1 : n - kFirst;
}

inline int32_t FreeBlockList::prev_of(int32_t slot) const {
  check_free(slot);
  int32_t p = prev_[slot + kFirst];
  return p == kHead ? -1 : p - kFirst;
}

inline int32_t FreeBlockList::popleft() {
  if (size_ == 0) throw InvalidBlockState("No free blocks available");
  int32_t node = next_[kHead];
  int32_t after = next_[node];
  next_[kHead] = after;
  prev_[after] = kHead;
  prev_[node] = next_[node] = kNotFree;
  --size_;
  if (order_ == kContiguous) uncached_.reset(node - kFirst);
  return node - kFirst;
}

inline void FreeBlockList::popleft_n(int32_t n, int32_t* out) {
  if (n < 0) throw InvalidBlockState("cannot pop a negative number of blocks");
  if (n > size_) {
    throw InvalidBlockState("cannot pop " + std::to_string(n) + " blocks: only " +
                            std::to_string(size_) + " free");
  }
  int32_t node = next_[kHead];
  for (int32_t i = 0; i < n; ++i) {
    int32_t after = next_[node];
    out[i] = node - kFirst;
    prev_[node] = next_[node] = kNotFree;
    node = after;
  }
  next_[kHead] = node;
  prev_[node] = kHead;
  size_ -= n;
  if (order_ == kContiguous) forget_uncached(out, n);
}

inline void FreeBlockList::remove(int32_t slot) {
  check_free(slot);
  unlink_one(slot);
}

inline void FreeBlockList::validate_batch(const int32_t* slots, int32_t n) {
  if (n < 0) throw InvalidBlockState("negative batch size");
  int32_t i = 0;
  std::string error;
  bool range_error = false;
  for (; i < n; ++i) {
    int32_t s = slots[i];
    if (s < 0 || s >= capacity_) {
      range_error = true;
      error = "block slot " + std::to_string(s) + " is out of range [0, " +
              std::to_string(capacity_) + ")";
      break;
    }
    int32_t& mark = prev_[s + kFirst];
    if (mark == detail::kMark) {
      error = detail::slot_msg("block appears twice in one batch", s);
      break;
    }
    if (mark >= 0) {
      error = detail::slot_msg("block is already in the free list (double free?)", s);
      break;
    }
    mark = detail::kMark;
  }
  if (i == n) {
    for (int32_t j = 0; j < n; ++j) prev_[slots[j] + kFirst] = kNotFree;
    return;
  }
  for (int32_t j = 0; j < i; ++j) prev_[slots[j] + kFirst] = kNotFree;
  if (range_error) throw SlotOutOfRange(error);
  throw InvalidBlockState(error);
}

inline void FreeBlockList::append(int32_t slot) { append_n(&slot, 1); }

inline void FreeBlockList::append_n(const int32_t* slots, int32_t n) {
  if (n == 0) return;
  validate_batch(slots, n);
  append_n_unchecked(slots, n);
}

inline void FreeBlockList::prepend_n(const int32_t* slots, int32_t n) {
  if (n == 0) return;
  validate_batch(slots, n);
  prepend_n_unchecked(slots, n);
}

inline void FreeBlockList::grow(int32_t extra) {
  if (extra < 0) throw InvalidBlockState("cannot shrink the free list");
  if (extra > INT32_MAX - kFirst - capacity_) throw SlotOutOfRange("free list capacity overflow");
  const int32_t capacity = capacity_ + extra;
  const size_t nodes = static_cast<size_t>(capacity) + kFirst;
  // Every allocation first (reserve; the bitmaps' resize is strong by itself and a
  // bitmap longer than the list is harmless: its extra bits are 0), then the vector
  // resizes, which cannot throw within the reserved capacity.
  prev_.reserve(nodes);
  next_.reserve(nodes);
  if (order_ != kVllmOrder) lru_.reserve(static_cast<size_t>(capacity));
  if (order_ == kContiguous) {
    extents_.reserve_capacity(capacity);
    if (uncached_.capacity() < capacity) uncached_.resize(capacity);
  }
  prev_.resize(nodes, kNotFree);
  next_.resize(nodes, kNotFree);
  if (order_ != kVllmOrder) lru_.resize(static_cast<size_t>(capacity), 0);
  if (order_ == kContiguous) extents_.set_capacity(capacity);
  capacity_ = capacity;
}

inline void FreeBlockList::swap(FreeBlockList& other) noexcept {
  std::swap(capacity_, other.capacity_);
  std::swap(size_, other.size_);
  std::swap(insertions_, other.insertions_);
  prev_.swap(other.prev_);
  next_.swap(other.next_);
  std::swap(order_, other.order_);
  lru_.swap(other.lru_);
  uncached_.swap(other.uncached_);
  extents_.swap(other.extents_);
  window_order_.swap(other.window_order_);
  window_.swap(other.window_);
  window_keep_.swap(other.window_keep_);
  window_front_.swap(other.window_front_);
  window_runs_.swap(other.window_runs_);
}

inline void FreeBlockList::rebuild_canonical() {
  // Chunks of 64 nodes: a chunk whose nodes are all free (the common case between
  // rollout rounds: only the null block is held) is linked with two branch-free,
  // vectorisable fills; other chunks node by node.
  constexpr int32_t kChunk = 64;
  int32_t* prev = prev_.data();
  int32_t* next = next_.data();
  int32_t last = kHead;
  const int32_t end = capacity_ + kFirst;
  for (int32_t start = kFirst; start < end; start += kChunk) {
    const int32_t stop = std::min(start + kChunk, end);
    int32_t any_not_free = 0;
    for (int32_t i = start; i < stop; ++i) any_not_free |= prev[i];  // sign bit
    if (any_not_free >= 0) {
      next[last] = start;
      prev[start] = last;
      for (int32_t i = start + 1; i < stop; ++i) prev[i] = i - 1;
      for (int32_t i = start; i < stop - 1; ++i) next[i] = i + 1;
      last = stop - 1;
    } else {
      for (int32_t i = start; i < stop; ++i) {
        if (prev[i] < 0) continue;
        next[last] = i;
        prev[i] = last;
        last = i;
      }
    }
  }
  next[last] = kTail;
  prev[kTail] = last;
  if (order_ != kVllmOrder) {
    // One canonical segment: every free slot counts as uncached from now on.
    std::fill(lru_.begin(), lru_.end(), 0);
    if (order_ == kContiguous) {
      uncached_.clear();
      for (int32_t s = 0; s < capacity_; ++s)
        if (prev_[s + kFirst] >= 0) uncached_.set(s);
    }
  }
}

inline void FreeBlockList::rebuild_in_order(const int32_t* slots, int32_t n) {
  if (n != size_) {
    throw InvalidBlockState("rebuild_in_order needs exactly the " + std::to_string(size_) +
                            " free blocks, got " + std::to_string(n));
  }
  std::vector<uint8_t> seen(static_cast<size_t>(capacity_), 0);
  for (int32_t i = 0; i < n; ++i) {
    int32_t s = slots[i];
    check_slot(s);
    if (prev_[s + kFirst] < 0 || seen[s]) {
      throw InvalidBlockState(detail::slot_msg("rebuild_in_order got a block that is not free or repeated", s));
    }
    seen[s] = 1;
  }
  if (order_ == kContiguous) {
    // Any order is allowed here; the sorted-uncached invariant then needs every
    // free slot treated as LRU (kept in the given order, reached front first).
    uncached_.clear();
    for (int32_t i = 0; i < n; ++i) lru_[slots[i]] = 1;
  }
  // Same free set, new order: empty the list and link the run after the head.
  next_[kHead] = kTail;
  prev_[kTail] = kHead;
  size_ = 0;
  link_run_after(kHead, slots, n);
}

inline std::vector<int32_t> FreeBlockList::to_vector() const {
  std::vector<int32_t> out;
  out.reserve(size_);
  for (int32_t node = next_[kHead]; node != kTail; node = next_[node]) out.push_back(node - kFirst);
  return out;
}

inline void FreeBlockList::check_invariants() const {
  int32_t count = 0;
  int32_t last = kHead;
  for (int32_t node = next_[kHead]; node != kTail; node = next_[node]) {
    if (node < kFirst || node >= capacity_ + kFirst) throw std::logic_error("link out of range");
    if (prev_[node] != last) throw std::logic_error("asymmetric link");
    if (++count > size_) throw std::logic_error("cycle or size mismatch");
    last = node;
  }
  if (prev_[kTail] != last) throw std::logic_error("tail link broken");
  if (count != size_) throw std::logic_error("size mismatch");
  int32_t marked = 0;
  for (int32_t node = kFirst; node < capacity_ + kFirst; ++node) marked += prev_[node] >= 0;
  if (marked != size_) throw std::logic_error("membership mismatch");
  if (order_ == kContiguous) {
    // The uncached segment is the list's sorted prefix, exactly the bitmap's members.
    int32_t node = next_[kHead], last = -1, uncached = 0;
    for (; node != kTail && !lru_[node - kFirst]; node = next_[node], ++uncached) {
      if (node - kFirst <= last) throw std::logic_error("uncached segment not sorted");
      if (!uncached_.test(node - kFirst)) throw std::logic_error("uncached slot missing from the bitmap");
      last = node - kFirst;
    }
    for (; node != kTail; node = next_[node])
      if (!lru_[node - kFirst]) throw std::logic_error("uncached slot inside the LRU segment");
    if (uncached != uncached_.count()) throw std::logic_error("bitmap holds slots that are not free");
  }
}

// ---- allocation policies ----

inline void FreeBlockList::set_order(Order order) {
  if (order == order_) return;
  if (order != kVllmOrder && order != kSegments && order != kContiguous)
    throw InvalidBlockState("unknown free-list order " + std::to_string(order));
  // Strong guarantee: build every new array first (each may throw bad_alloc), then
  // switch with swaps and a relink that cannot throw.
  std::vector<uint8_t> lru;
  SlotBitmap uncached;
  ExtentReservations extents;
  std::vector<int32_t> order_slots;
  size_t num_uncached = 0;
  if (order != kVllmOrder) {
    if (order_ == kVllmOrder) lru.assign(static_cast<size_t>(capacity_), 0);
    else lru = lru_;
  }
  if (order == kContiguous) {
    uncached = SlotBitmap(capacity_);
    ExtentReservations(capacity_).swap(extents);
    order_slots = uncached_canonical_order(lru, &num_uncached);  // by the new segments
  }
  order_ = order;
  lru_.swap(lru);
  uncached_.swap(uncached);
  extents_.swap(extents);  // (the old order's reservations are dropped with `extents`)
  if (order == kContiguous) link_uncached_canonical(order_slots, num_uncached);
}

inline void FreeBlockList::insert_uncached(const int32_t* slots, int32_t n) {
  // A freed table is usually one run of consecutive slots (reversed): link it in one
  // splice at its sorted place.
  if (n > 1) {
    int32_t step = slots[1] - slots[0];
    bool run = step == 1 || step == -1;
    for (int32_t i = 2; run && i < n; ++i) run = slots[i] - slots[i - 1] == step;
    if (run) {
      int32_t lo = step == 1 ? slots[0] : slots[n - 1];
      int32_t p = uncached_.find_prev(lo);
      splice_after(p < 0 ? kHead : p + kFirst, n, [lo](int32_t i) { return lo + i + kFirst; });
      std::fill(lru_.begin() + lo, lru_.begin() + lo + n, 0);
      uncached_.set_range(lo, lo + n);
      return;
    }
  }
  for (int32_t i = 0; i < n; ++i) {
    int32_t s = slots[i];
    int32_t node = s + kFirst;
    int32_t before;  // the node to link after
    // A freed table comes back as a run (reversed, usually): its neighbour is the
    // slot just inserted, so the common case needs no search.
    if (s + 1 < capacity_ && uncached_.test(s + 1)) {
      before = prev_[s + 1 + kFirst];
    } else if (s > 0 && uncached_.test(s - 1)) {
      before = s - 1 + kFirst;
    } else {
      int32_t p = uncached_.find_prev(s);
      before = p < 0 ? kHead : p + kFirst;
    }
    int32_t after = next_[before];
    next_[before] = node;
    prev_[node] = before;
    next_[node] = after;
    prev_[after] = node;
    lru_[s] = 0;
    uncached_.set(s);
  }
  size_ += n;
  insertions_ += static_cast<uint64_t>(n);
}

inline void FreeBlockList::reinsert_front(const int32_t* slots, int32_t n) {
  if (order_ != kContiguous) {
    link_run_after(kHead, slots, n);  // segments as they were
    return;
  }
  // No allocation: this is the undo path of a failed allocation.
  for (int32_t i = 0; i < n; ++i)
    if (!lru_[slots[i]]) insert_uncached(slots + i, 1);
  int32_t last = lru_anchor();
  for (int32_t i = 0; i < n; ++i) {
    if (!lru_[slots[i]]) continue;
    link_run_after(last, slots + i, 1);
    last = slots[i] + kFirst;
  }
}

inline int32_t FreeBlockList::take(int32_t n, int32_t hint, int32_t owner, int32_t want, int32_t* out,
                                   int32_t lru_window) {
  if (order_ != kContiguous) throw InvalidBlockState("take() needs the contiguous order");
  if (n < 0) throw InvalidBlockState("cannot take a negative number of blocks");
  if (n > size_) {
    throw InvalidBlockState("cannot take " + std::to_string(n) + " blocks: only " +
                            std::to_string(size_) + " free");
  }
  lru_window = std::max(0, std::min(lru_window, size_ - n));
  if (lru_window > 0) {  // the window's scratch space, before anything is unlinked
    const size_t span = static_cast<size_t>(n) + static_cast<size_t>(lru_window);
    window_order_.reserve(span);
    window_.reserve(span);
    window_keep_.reserve(span);
    window_front_.reserve(static_cast<size_t>(n));
    window_runs_.reserve(span);
  }
  // The one allocation (room for an extent record) before anything is unlinked, so a
  // bad_alloc leaves the list as it was. A new owner's empty entry is dropped below
  // if no extent is recorded for it.
  if (owner > 0) extents_.open(owner);
  int32_t k = 0;
  auto usable = [&](int32_t s) {
    return s < capacity_ && uncached_.test(s) && extents_.usable_by(s, owner);
  };
  // 1. The table's continuation.
  if (hint >= 0 && owner > 0) {
    int32_t len = 0;
    while (k + len < n && usable(hint + len)) ++len;
    unlink_uncached_run(hint, len, out + k);
    k += len;
  }
  // 2. A new extent where the expected growth fits.
  if (k < n && owner > 0) {
    int32_t rest = n - k;
    int32_t len = std::max(want, rest);
    int32_t start = uncached_.find_run(len, &extents_.reserved());
    if (start < 0 && len > rest) {
      len = rest;
      start = uncached_.find_run(len, &extents_.reserved());
    }
    if (start >= 0) {
      extents_.record(owner, start, len);
      unlink_uncached_run(start, n - k, out + k);
      k = n;
    }
  }
  // 3. The lowest unreserved uncached slots, then 4. those reserved by others, a run
  // of consecutive slots at a time.
  for (int pass = 0; pass < 2 && k < n; ++pass) {
    int32_t s = uncached_.find_next(0);
    while (k < n && s >= 0) {
      auto takeable = [&](int32_t t) {
        return t < capacity_ && uncached_.test(t) &&
               (pass == 1 || extents_.usable_by(t, owner));
      };
      if (!takeable(s)) {
        s = uncached_.find_next(s + 1);
        continue;
      }
      int32_t len = 1;
      while (k + len < n && takeable(s + len)) ++len;
      unlink_uncached_run(s, len, out + k);
      k += len;
      s = uncached_.find_next(s + len);
    }
  }
  // 5. The LRU segment, from its front (now the list's front), as vLLM; with an LRU
  // window, first the table's continuation among the window's slots.
  const int32_t uncached = k;
  if (lru_window > 0 && k < n) k += take_from_lru_window(n - k, k > 0 ? out[k - 1] + 1 : hint, lru_window, out + k);
  while (k < n) out[k++] = popleft();
  if (owner > 0) extents_.close_if_empty(owner);
  return uncached;
}

inline int32_t FreeBlockList::take_from_lru_window(int32_t need, int32_t cont, int32_t window,
                                                   int32_t* out) noexcept {
  // The need + window oldest LRU slots (the list's front: no uncached slot is left),
  // in LRU order and sorted; the need oldest sorted (vLLM's choice).
  const size_t span = static_cast<size_t>(need) + static_cast<size_t>(window);
  window_order_.clear();
  for (int32_t node = next_[kHead]; node != kTail && window_order_.size() < span; node = next_[node])
    window_order_.push_back(node - kFirst);
  window_front_.assign(window_order_.begin(), window_order_.begin() + std::min<size_t>(need, window_order_.size()));
  window_.assign(window_order_.begin(), window_order_.end());
  std::sort(window_front_.begin(), window_front_.end());
  std::sort(window_.begin(), window_.end());
  window_keep_.assign(window_.size(), 1);
  auto index_of = [this](int32_t slot) {
    return static_cast<size_t>(std::lower_bound(window_.begin(), window_.end(), slot) - window_.begin());
  };
  // Leave out the window's runs shortest first (never the one that continues the
  // table), while whole runs fit in the slots to leave out; then the youngest.
  window_runs_.clear();
  for (size_t i = 0; i < window_.size();) {
    size_t j = i + 1;
    while (j < window_.size() && window_[j] == window_[j - 1] + 1) ++j;
    if (window_[i] != cont) window_runs_.emplace_back(static_cast<int32_t>(j - i), static_cast<int32_t>(i));
    i = j;
  }
  std::sort(window_runs_.begin(), window_runs_.end());
  size_t extra = window_.size() - static_cast<size_t>(need);
  for (const auto& run : window_runs_) {
    if (static_cast<size_t>(run.first) > extra) break;
    std::fill_n(window_keep_.begin() + run.second, run.first, 0);
    extra -= static_cast<size_t>(run.first);
  }
  for (size_t i = window_order_.size(); extra > 0 && i-- > 0;) {
    size_t at = index_of(window_order_[i]);
    if (window_keep_[at]) {
      window_keep_[at] = 0;
      --extra;
    }
  }
  // Descriptors of each choice: its runs, one less when one starts at cont.
  int32_t chosen = 0, front = 0;
  bool chosen_cont = false, front_cont = false;
  for (size_t i = 0; i < window_.size(); ++i) {
    if (!window_keep_[i]) continue;
    if (i == 0 || !window_keep_[i - 1] || window_[i - 1] != window_[i] - 1) ++chosen;
    chosen_cont = chosen_cont || window_[i] == cont;
  }
  for (size_t i = 0; i < window_front_.size(); ++i) {
    if (i == 0 || window_front_[i - 1] != window_front_[i] - 1) ++front;
    front_cont = front_cont || window_front_[i] == cont;
  }
  if (chosen - chosen_cont >= front - front_cont) return 0;  // no better than vLLM's
  int32_t k = 0;
  for (int32_t slot : window_order_) {  // unlinked in LRU order
    if (!window_keep_[index_of(slot)]) continue;
    unlink_one(slot);
    out[k++] = slot;
  }
  return k;
}

inline std::vector<int32_t> FreeBlockList::uncached_canonical_order(const std::vector<uint8_t>& lru,
                                                                    size_t* num_uncached) const {
  std::vector<int32_t> order;
  order.reserve(static_cast<size_t>(size_));  // the only allocation
  for (int32_t s = 0; s < capacity_; ++s)
    if (prev_[s + kFirst] >= 0 && !lru[s]) order.push_back(s);
  *num_uncached = order.size();
  for (int32_t node = next_[kHead]; node != kTail; node = next_[node])
    if (lru[node - kFirst]) order.push_back(node - kFirst);
  return order;
}

inline void FreeBlockList::link_uncached_canonical(const std::vector<int32_t>& order,
                                                   size_t num_uncached) noexcept {
  const uint64_t inserted = insertions_;  // a relink of the free slots, not a free
  next_[kHead] = kTail;
  prev_[kTail] = kHead;
  size_ = 0;
  link_run_after(kHead, order.data(), static_cast<int32_t>(order.size()));
  insertions_ = inserted;
  if (order_ == kContiguous) {
    uncached_.clear();
    for (size_t i = 0; i < num_uncached; ++i) uncached_.set(order[i]);
  }
}

inline void FreeBlockList::rebuild_uncached_canonical() {
  if (order_ == kVllmOrder) throw InvalidBlockState("the free list does not track its segments");
  size_t num_uncached = 0;
  std::vector<int32_t> order = uncached_canonical_order(lru_, &num_uncached);
  link_uncached_canonical(order, num_uncached);
}

inline void FreeBlockList::free_runs(int32_t* num_runs, int32_t* longest) const {
  int32_t runs = 0, best = 0, cur = 0;
  for (int32_t node = kFirst; node < capacity_ + kFirst; ++node) {
    if (prev_[node] >= 0) {
      if (cur == 0) ++runs;
      if (++cur > best) best = cur;
    } else {
      cur = 0;
    }
  }
  *num_runs = runs;
  *longest = best;
}

}  // namespace kvpool
