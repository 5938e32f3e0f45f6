#include "fenced_free_queue.h"

namespace kvpool {

void FencedFreeQueue::push(int64_t fence_seq, const int64_t* handles, size_t n, bool joined) {
  if (joined && (entries_.empty() || entries_.back().fence_seq != fence_seq))
    throw std::invalid_argument("a joined part needs a last entry with the same fence");
  size_t begin = buffer_.size();
  buffer_.insert(buffer_.end(), handles, handles + n);
  entries_.push_back(Entry{fence_seq, begin, buffer_.size(), joined});
  num_blocks_ += n;
  if (!joined) ++num_heads_;
}

void FencedFreeQueue::pop_one() {
  const Entry& e = entries_.front();
  num_blocks_ -= e.end - e.begin;
  head_offset_ = e.end;
  if (!e.joined) --num_heads_;
  entries_.pop_front();
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

void FencedFreeQueue::clear() {
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
