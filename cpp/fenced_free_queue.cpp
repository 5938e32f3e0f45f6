#include "fenced_free_queue.h"

namespace kvpool {

void FencedFreeQueue::push(int64_t fence_seq, const int64_t* handles, size_t n, bool joined) {
  if (joined && (entries_.empty() || entries_.back().fence_seq != fence_seq))
    throw std::invalid_argument("a joined part needs a last entry with the same fence");
  size_t begin = buffer_.size();
  buffer_.insert(buffer_.end(), handles, handles + n);  // strong: unchanged on bad_alloc
  try {
    entries_.push_back(Entry{fence_seq, begin, buffer_.size(), joined});
  } catch (...) {
    buffer_.resize(begin);  // shrinking cannot throw
    throw;
  }
  num_blocks_ += n;
  if (!joined) ++num_heads_;
  ++version_;
}

void FencedFreeQueue::push_parts(int64_t fence_seq, const int64_t* handles, const size_t* sizes,
                                 size_t num_parts) {
  const size_t entries_before = entries_.size(), buffer_before = buffer_.size();
  const size_t blocks_before = num_blocks_, heads_before = num_heads_;
  try {
    size_t offset = 0;
    bool joined = false;
    for (size_t p = 0; p < num_parts; ++p) {
      if (sizes[p] == 0) continue;
      push(fence_seq, handles + offset, sizes[p], joined);
      offset += sizes[p];
      joined = true;
    }
  } catch (...) {
    while (entries_.size() > entries_before) entries_.pop_back();  // cannot throw
    buffer_.resize(buffer_before);
    num_blocks_ = blocks_before;
    num_heads_ = heads_before;
    ++version_;
    throw;
  }
}

void FencedFreeQueue::pop_one() {
  const Entry& e = entries_.front();
  num_blocks_ -= e.end - e.begin;
  head_offset_ = e.end;
  if (!e.joined) --num_heads_;
  entries_.pop_front();
  ++version_;
  // What is left of a request whose first parts are gone is the head of its entry.
  if (!entries_.empty() && entries_.front().joined) {
    entries_.front().joined = false;
    ++num_heads_;
  }
}

size_t FencedFreeQueue::ready_entries(int64_t processed_step_seq) const {
  size_t k = 0;
  while (k < entries_.size() && entries_[k].fence_seq <= processed_step_seq) ++k;
  return k;
}

size_t FencedFreeQueue::drain(int64_t processed_step_seq, std::vector<int64_t>& out,
                              std::vector<size_t>* entry_ends) {
  // Room for every ready entry first: a bad_alloc must not strand drained handles.
  size_t ready = ready_entries(processed_step_seq), count = 0;
  for (size_t i = 0; i < ready; ++i) count += entries_[i].end - entries_[i].begin;
  out.reserve(out.size() + count);
  if (entry_ends) entry_ends->reserve(entry_ends->size() + ready);
  size_t drained = 0;
  while (!entries_.empty() && entries_.front().fence_seq <= processed_step_seq) {
    const Entry& e = entries_.front();
    out.insert(out.end(), buffer_.begin() + e.begin, buffer_.begin() + e.end);
    if (entry_ends) entry_ends->push_back(out.size());
    pop_one();
    ++drained;
  }
  if (drained) compact();
  return drained;
}

void FencedFreeQueue::pop_front(std::vector<int64_t>& out) {
  if (entries_.empty()) throw std::out_of_range("pop from an empty deferred-free queue");
  const Entry& e = entries_.front();
  out.insert(out.end(), buffer_.begin() + e.begin, buffer_.begin() + e.end);
  pop_one();
  compact();
}

void FencedFreeQueue::discard_front(size_t k) {
  if (k > entries_.size()) throw std::out_of_range("discard_front past the end of the queue");
  for (size_t i = 0; i < k; ++i) pop_one();
  if (k) compact();
}

size_t FencedFreeQueue::discard_back() noexcept {
  size_t removed = 0;
  while (!entries_.empty()) {
    const Entry e = entries_.back();
    entries_.pop_back();
    // The last entry's handles end the buffer: shrinking it cannot throw.
    buffer_.resize(e.begin);
    num_blocks_ -= e.end - e.begin;
    ++removed;
    if (!e.joined) {
      --num_heads_;
      break;
    }
  }
  if (removed) {
    ++version_;
    if (entries_.empty()) {
      buffer_.clear();
      head_offset_ = 0;
    }
  }
  return removed;
}

void FencedFreeQueue::clear() {
  ++version_;
  entries_.clear();
  buffer_.clear();
  head_offset_ = 0;
  num_blocks_ = 0;
  num_heads_ = 0;
}

void FencedFreeQueue::compact() {
  if (entries_.empty()) {
    buffer_.clear();
    head_offset_ = 0;
    return;
  }
  // Reclaim the drained prefix once it dominates the buffer: amortised O(1) per block.
  if (head_offset_ < 4096 || head_offset_ * 2 < buffer_.size()) return;
  buffer_.erase(buffer_.begin(), buffer_.begin() + head_offset_);
  for (Entry& e : entries_) {
    e.begin -= head_offset_;
    e.end -= head_offset_;
  }
  head_offset_ = 0;
}

}  // namespace kvpool
