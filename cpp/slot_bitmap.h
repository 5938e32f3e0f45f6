// A set of block slots as a two-level bitmap: one bit per slot, one summary bit per
// 64-slot word. For the contiguous allocation policy (docs/design.md, "Allocation
// policies"): the free blocks that hold no prefix-cache hash, searched by position.
//
// find_next / find_prev cost O(1) word operations plus a scan of the summary
// (capacity / 4096 words: 21 for 85,000 blocks); find_run scans the words once.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace kvpool {

class SlotBitmap {
 public:
  explicit SlotBitmap(int32_t capacity = 0) { resize(capacity); }

  // Strong exception guarantee: the only allocations come first, so a bad_alloc
  // leaves the bitmap as it was.
  void resize(int32_t capacity) {
    const size_t num_words = static_cast<size_t>(capacity + 63) / 64;
    const size_t num_summary = (num_words + 63) / 64;
    words_.reserve(num_words);
    summary_.reserve(num_summary);
    words_.resize(num_words, 0);  // within the reserved capacity: cannot throw
    summary_.resize(num_summary, 0);
    capacity_ = capacity;
  }
  void swap(SlotBitmap& other) noexcept {
    words_.swap(other.words_);
    summary_.swap(other.summary_);
    std::swap(capacity_, other.capacity_);
    std::swap(count_, other.count_);
  }
  void clear() {
    std::fill(words_.begin(), words_.end(), 0);
    std::fill(summary_.begin(), summary_.end(), 0);
    count_ = 0;
  }

  int32_t capacity() const { return capacity_; }
  int32_t count() const { return count_; }
  bool test(int32_t slot) const { return (words_[slot >> 6] >> (slot & 63)) & 1; }

  void set(int32_t slot) {
    uint64_t& w = words_[slot >> 6];
    uint64_t bit = uint64_t{1} << (slot & 63);
    if (w & bit) return;
    w |= bit;
    summary_[slot >> 12] |= uint64_t{1} << ((slot >> 6) & 63);
    ++count_;
  }
  void reset(int32_t slot) {
    uint64_t& w = words_[slot >> 6];
    uint64_t bit = uint64_t{1} << (slot & 63);
    if (!(w & bit)) return;
    w &= ~bit;
    if (!w) summary_[slot >> 12] &= ~(uint64_t{1} << ((slot >> 6) & 63));
    --count_;
  }

  // set() / reset() of every slot in [begin, end), a word at a time.
  void set_range(int32_t begin, int32_t end) { update_range(begin, end, true); }
  void reset_range(int32_t begin, int32_t end) { update_range(begin, end, false); }

  // Smallest member >= slot, or -1.
  int32_t find_next(int32_t slot) const {
    if (slot < 0) slot = 0;
    if (slot >= capacity_) return -1;
    size_t wi = static_cast<size_t>(slot) >> 6;
    uint64_t w = words_[wi] & (~uint64_t{0} << (slot & 63));
    if (w) return static_cast<int32_t>((wi << 6) + __builtin_ctzll(w));
    size_t next_word = wi + 1;
    for (size_t si = next_word >> 6; si < summary_.size(); ++si) {
      uint64_t s = summary_[si];
      if (si == (next_word >> 6)) s &= (next_word & 63) ? (~uint64_t{0} << (next_word & 63)) : ~uint64_t{0};
      if (s) {
        size_t w2 = (si << 6) + __builtin_ctzll(s);
        return static_cast<int32_t>((w2 << 6) + __builtin_ctzll(words_[w2]));
      }
    }
    return -1;
  }

  // Largest member < slot, or -1.
  int32_t find_prev(int32_t slot) const {
    if (slot <= 0) return -1;
    if (slot > capacity_) slot = capacity_;
    size_t wi = static_cast<size_t>(slot) >> 6;
    uint64_t w = (slot & 63) ? (words_[wi] & ((uint64_t{1} << (slot & 63)) - 1)) : 0;
    if (w) return static_cast<int32_t>((wi << 6) + 63 - __builtin_clzll(w));
    if (wi == 0) return -1;
    size_t last_word = wi - 1;
    for (size_t si = (last_word >> 6) + 1; si-- > 0;) {
      uint64_t s = summary_[si];
      if (si == (last_word >> 6) && (last_word & 63) != 63) s &= (uint64_t{1} << ((last_word & 63) + 1)) - 1;
      if (s) {
        size_t w2 = (si << 6) + 63 - __builtin_clzll(s);
        return static_cast<int32_t>((w2 << 6) + 63 - __builtin_clzll(words_[w2]));
      }
    }
    return -1;
  }

  // First run of at least `len` consecutive members of (this and not `exclude`),
  // lowest start first; -1 if none. `exclude` may be null.
  int32_t find_run(int32_t len, const SlotBitmap* exclude) const {
    if (len <= 0) return 0;
    int32_t run_start = -1, run_len = 0;
    for (size_t wi = 0; wi < words_.size(); ++wi) {
      uint64_t w = words_[wi];
      if (exclude) w &= ~exclude->words_[wi];
      if (w == ~uint64_t{0}) {
        if (run_len == 0) run_start = static_cast<int32_t>(wi << 6);
        run_len += 64;
        if (run_len >= len) return run_start;
        continue;
      }
      int32_t bit = 0;
      while (bit < 64) {
        uint64_t rest = w >> bit;
        if (rest & 1) {
          int32_t ones = (~rest) ? __builtin_ctzll(~rest) : 64 - bit;
          if (run_len == 0) run_start = static_cast<int32_t>((wi << 6) + bit);
          run_len += ones;
          if (run_len >= len) return run_start;
          bit += ones;
        } else {
          run_len = 0;
          if (!rest) break;
          bit += __builtin_ctzll(rest);
        }
      }
    }
    return -1;
  }

 private:
  void update_range(int32_t begin, int32_t end, bool value) {
    while (begin < end) {
      size_t wi = static_cast<size_t>(begin) >> 6;
      int32_t lo = begin & 63;
      int32_t hi = std::min<int32_t>(64, lo + (end - begin));
      uint64_t mask = (hi == 64 ? ~uint64_t{0} : ((uint64_t{1} << hi) - 1)) & (~uint64_t{0} << lo);
      uint64_t& w = words_[wi];
      uint64_t before = w;
      w = value ? (w | mask) : (w & ~mask);
      count_ += __builtin_popcountll(w) - __builtin_popcountll(before);
      uint64_t sbit = uint64_t{1} << (wi & 63);
      if (w) {
        summary_[wi >> 6] |= sbit;
      } else {
        summary_[wi >> 6] &= ~sbit;
      }
      begin += hi - lo;
    }
  }

  int32_t capacity_ = 0;
  int32_t count_ = 0;
  std::vector<uint64_t> words_;
  std::vector<uint64_t> summary_;
};

}  // namespace kvpool
