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
// leaves the list exactly as it was (no half-linked batch, no lost block).
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvpool {

// Raised for an argument outside the list's slots (maps to Python IndexError).
using SlotOutOfRange = std::out_of_range;
// Raised for a slot in the wrong state: removing a block that is not free, adding
// one that already is, popping from an empty list (maps to Python ValueError).
using InvalidBlockState = std::invalid_argument;

class FreeBlockList {
 public:
  static constexpr int32_t kNotFree = -1;

  // A list over `capacity` slots. With all_free, slots 0..capacity-1 are linked in
  // ascending order (vLLM's initial order); otherwise the list starts empty.
  explicit FreeBlockList(int32_t capacity = 0, bool all_free = true);

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
  void append_n_unchecked(const int32_t* slots, int32_t n) { link_run_after(prev_[kTail], slots, n); }
  void prepend_n_unchecked(const int32_t* slots, int32_t n) { link_run_after(kHead, slots, n); }
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
  }
  void undo_remove(int32_t slot, int32_t prev_node, int32_t next_node) {
    int32_t node = slot + kFirst;
    prev_[node] = prev_node;
    next_[node] = next_node;
    next_[prev_node] = node;
    prev_[next_node] = node;
    ++size_;
    ++insertions_;
  }
  // contains() without the range check; `slot` must be in [0, capacity).
  bool contains_unchecked(int32_t slot) const { return prev_[slot + kFirst] >= 0; }
  // Slots ever put into the list (a counter that only grows): a caller that ran
  // foreign code can tell whether anything was freed in the meantime.
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
  }

  // Add `extra` slots (not free) at the end of the slot range.
  void grow(int32_t extra);
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
  void link_run_after(int32_t anchor, const int32_t* slots, int32_t n);

  int32_t capacity_ = 0;
  int32_t size_ = 0;
  uint64_t insertions_ = 0;
  std::vector<int32_t> prev_;
  std::vector<int32_t> next_;
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
}

inline void FreeBlockList::remove(int32_t slot) {
  check_free(slot);
  int32_t node = slot + kFirst;
  int32_t p = prev_[node], n = next_[node];
  next_[p] = n;
  prev_[n] = p;
  prev_[node] = next_[node] = kNotFree;
  --size_;
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

inline void FreeBlockList::link_run_after(int32_t anchor, const int32_t* slots, int32_t n) {
  int32_t after = next_[anchor];
  int32_t last = anchor;
  for (int32_t i = 0; i < n; ++i) {
    int32_t node = slots[i] + kFirst;
    next_[last] = node;
    prev_[node] = last;
    last = node;
  }
  next_[last] = after;
  prev_[after] = last;
  size_ += n;
  insertions_ += static_cast<uint64_t>(n);
}

inline void FreeBlockList::append(int32_t slot) { append_n(&slot, 1); }

inline void FreeBlockList::append_n(const int32_t* slots, int32_t n) {
  if (n == 0) return;
  validate_batch(slots, n);
  link_run_after(prev_[kTail], slots, n);
}

inline void FreeBlockList::prepend_n(const int32_t* slots, int32_t n) {
  if (n == 0) return;
  validate_batch(slots, n);
  link_run_after(kHead, slots, n);
}

inline void FreeBlockList::grow(int32_t extra) {
  if (extra < 0) throw InvalidBlockState("cannot shrink the free list");
  capacity_ += extra;
  prev_.resize(static_cast<size_t>(capacity_) + kFirst, kNotFree);
  next_.resize(static_cast<size_t>(capacity_) + kFirst, kNotFree);
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
}

}  // namespace kvpool
