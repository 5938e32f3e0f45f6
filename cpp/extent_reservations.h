// Per-table extent reservations of the contiguous allocation policy.
//
// An *extent* is a run of slots [start, start + len) reserved for one owner (a request's
// block table, numbered by the Python policy: kvpool.allocation.contiguous). Extents
// never overlap: FreeBlockList::take reserves only slots outside every extent. A
// reservation is a preference, never a refusal: take() still hands a reserved slot to
// another owner when nothing else is left (docs/design.md, "Allocation policies").
//
// The bookkeeping: a bitmap of reserved slots (for SlotBitmap::find_run's "outside
// every extent"), the owner of each reserved slot, and each owner's extents (so a
// release is O(its reserved slots), not O(capacity)).
//
// Exception safety follows the free list's: everything that allocates is named so
// (the constructor, open(), reserve_capacity()); record(), release(), release_all(),
// truncate() and the queries cannot throw.
#pragma once

#include <algorithm>
#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

#include "slot_bitmap.h"

namespace kvpool {

class ExtentReservations {
 public:
  using Extent = std::pair<int32_t, int32_t>;  // (start slot, length in slots)

  // No slots, allocates nothing, cannot throw.
  ExtentReservations() noexcept = default;
  // Reservations over `capacity` slots, none reserved. Throws bad_alloc.
  explicit ExtentReservations(int32_t capacity)
      : reserved_(capacity), owner_of_(static_cast<size_t>(capacity), 0) {}

  void swap(ExtentReservations& other) noexcept {
    reserved_.swap(other.reserved_);
    owner_of_.swap(other.owner_of_);
    extents_.swap(other.extents_);
  }

  // ---- queries (cannot throw; `slot` in [0, capacity)) ----
  // The reserved slots, as a bitmap (for SlotBitmap::find_run's `exclude`).
  const SlotBitmap& reserved() const { return reserved_; }
  bool is_reserved(int32_t slot) const { return reserved_.test(slot); }
  // The owner of a reserved slot; 0 for a slot no extent holds.
  int32_t owner_of(int32_t slot) const { return owner_of_[static_cast<size_t>(slot)]; }
  // True when `owner` may take `slot` without entering another owner's extent.
  bool usable_by(int32_t slot, int32_t owner) const {
    return !reserved_.test(slot) || owner_of_[static_cast<size_t>(slot)] == owner;
  }
  // Owners with at least one extent.
  int32_t num_owners() const { return static_cast<int32_t>(extents_.size()); }
  // Extents recorded for `owner`.
  int32_t num_extents(int32_t owner) const {
    auto it = extents_.find(owner);
    return it == extents_.end() ? 0 : static_cast<int32_t>(it->second.size());
  }
  // Slots reserved in all (for tests). O(capacity / 64).
  int32_t num_reserved_slots() const { return reserved_.count(); }

  // ---- capacity ----
  // Make room for `capacity` slots (the allocating half of FreeBlockList::grow).
  // Strong: on bad_alloc nothing changed that set_capacity would see.
  void reserve_capacity(int32_t capacity) {
    owner_of_.reserve(static_cast<size_t>(capacity));
    if (reserved_.capacity() < capacity) reserved_.resize(capacity);
  }
  // Set the slot count within reserve_capacity's room (growing: the new slots are
  // unreserved; shrinking: the dropped slots must be unreserved). Cannot throw once
  // room was reserved; the bitmap keeps its size (extra bits are 0, never read).
  void set_capacity(int32_t capacity) noexcept {
    owner_of_.resize(static_cast<size_t>(capacity), 0);
  }

  // ---- recording an extent: open, then record (cannot throw) ----
  // Make room for one more extent of `owner` (> 0). The one allocation of a take()
  // that reserves, done before the list changes. Returns true when `owner` had no
  // entry (close_if_empty then drops it if nothing was recorded). Strong.
  bool open(int32_t owner) {
    auto found = extents_.find(owner);
    bool fresh = found == extents_.end();
    if (fresh) found = extents_.emplace(owner, std::vector<Extent>()).first;
    try {
      found->second.reserve(found->second.size() + 1);
    } catch (...) {
      if (fresh) extents_.erase(found);
      throw;
    }
    return fresh;
  }
  // Reserve [start, start + len) for `owner`, after open(owner). The slots must be
  // outside every extent. Cannot throw (open made the room).
  void record(int32_t owner, int32_t start, int32_t len) noexcept {
    reserved_.set_range(start, start + len);
    std::fill(owner_of_.begin() + start, owner_of_.begin() + start + len, owner);
    extents_.find(owner)->second.emplace_back(start, len);  // open() made the room
  }
  // Drop `owner`'s entry if open() created it and nothing was recorded.
  void close_if_empty(int32_t owner) noexcept {
    auto it = extents_.find(owner);
    if (it != extents_.end() && it->second.empty()) extents_.erase(it);
  }

  // ---- releasing (cannot throw) ----
  // Forget every extent of `owner` (its table is gone).
  void release(int32_t owner) noexcept {
    auto it = extents_.find(owner);
    if (it == extents_.end()) return;
    for (const Extent& e : it->second) unreserve(e);
    extents_.erase(it);
  }
  // Forget every extent: O(reserved slots), not O(capacity) (runs whenever the pool
  // empties).
  void release_all() noexcept {
    for (const auto& owner_extents : extents_)
      for (const Extent& e : owner_extents.second) unreserve(e);
    extents_.clear();
  }
  // Forget `owner`'s extents after the first `keep` (the undo of a take() whose
  // allocation failed later).
  void truncate(int32_t owner, int32_t keep) noexcept {
    auto it = extents_.find(owner);
    if (it == extents_.end()) return;
    auto& list = it->second;
    while (static_cast<int32_t>(list.size()) > keep) {
      unreserve(list.back());
      list.pop_back();
    }
    if (list.empty()) extents_.erase(it);
  }

 private:
  void unreserve(const Extent& e) noexcept {
    reserved_.reset_range(e.first, e.first + e.second);
    std::fill(owner_of_.begin() + e.first, owner_of_.begin() + e.first + e.second, 0);
  }

  SlotBitmap reserved_;            // slots in some owner's extent
  std::vector<int32_t> owner_of_;  // per slot: that owner (0: none)
  std::unordered_map<int32_t, std::vector<Extent>> extents_;
};

}  // namespace kvpool
