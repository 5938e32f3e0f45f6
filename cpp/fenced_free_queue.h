// FIFO of deferred block frees guarded by scheduler step fences.
//
// Mirrors Scheduler.deferred_frees in vLLM 0.33.0 (vllm/v1/core/sched/scheduler.py):
// a finished or preempted request's blocks may still be written by a step that was
// dispatched but whose output has not been processed yet (async scheduling with a KV
// consumer, or pipeline parallelism). Its blocks are queued with fence_seq = the
// newest dispatched step (sched_seq) and become reusable once
// processed_step_seq >= fence_seq. Entries drain strictly in FIFO order and the
// drain stops at the first unmet fence, as in vLLM.
//
// The queue stores opaque int64 block handles in one flat buffer; the binding decides
// what a handle names (here: an index into a table of Python block objects).
//
// One request's blocks may span several KV cache groups. vLLM frees each group with a
// call of its own (KVCacheCoordinator.free), and the order of unhashed blocks depends on
// that split (each call prepends its own run), so a request's entry keeps one part per
// group: a part after the first is `joined` to the entry before it (same fence). The
// front part is never joined: removing a request's first parts makes the rest the head
// of what is left of it.
#pragma once

#include <cstdint>
#include <deque>
#include <stdexcept>
#include <vector>

namespace kvpool {

class FencedFreeQueue {
 public:
  struct Entry {
    int64_t fence_seq;
    size_t begin;  // offset into the flat handle buffer
    size_t end;
    bool joined;   // a further KV cache group of the entry before it
  };

  // Queue `n` handles that become free once processed_step_seq >= fence_seq. With
  // `joined`, they are a further group of the last entry: its fence must equal
  // fence_seq (std::invalid_argument otherwise, or when the queue is empty).
  void push(int64_t fence_seq, const int64_t* handles, size_t n, bool joined = false);
  // Number of leading entries whose fence is met, without removing them.
  size_t ready_entries(int64_t processed_step_seq) const;
  // Queue one request's parts (one per KV cache group, sizes[p] handles each, empty
  // parts skipped) as one entry: all of them or, on bad_alloc, none.
  void push_parts(int64_t fence_seq, const int64_t* handles, const size_t* sizes, size_t num_parts);
  // A counter that changes whenever an entry is added or removed: a caller that ran
  // Python code can tell whether the queue changed meanwhile.
  uint64_t version() const { return version_; }
  // Remove the leading ready entries; their handles, in queue order, are appended to
  // `out` and per-entry end offsets (into `out`) to `entry_ends`. Returns the number
  // of entries drained. Strong: the output is reserved before anything is removed.
  size_t drain(int64_t processed_step_seq, std::vector<int64_t>& out,
               std::vector<size_t>* entry_ends = nullptr);
  // Remove the first entry regardless of its fence. Throws if empty.
  void pop_front(std::vector<int64_t>& out);
  // Remove the first k entries (k <= num_entries()) without copying them out.
  void discard_front(size_t k);
  // Remove the last request's entry (its first part and the parts joined to it),
  // undoing the push or push_parts that queued it. Returns the number of parts
  // removed (0 when the queue is empty). Never throws.
  size_t discard_back() noexcept;

  size_t num_entries() const { return entries_.size(); }
  // Entries that are not joined to the one before: requests, as a deque would count them.
  size_t num_heads() const { return num_heads_; }
  size_t num_blocks() const { return num_blocks_; }
  bool empty() const { return entries_.empty(); }
  const Entry& entry(size_t i) const { return entries_.at(i); }
  const int64_t* handles() const { return buffer_.data(); }
  void clear();

 private:
  void compact();
  void pop_one();

  std::deque<Entry> entries_;
  uint64_t version_ = 0;  // changes with every push and removal
  std::vector<int64_t> buffer_;
  size_t head_offset_ = 0;  // buffer_[0, head_offset_) is drained and reclaimable
  size_t num_blocks_ = 0;
  size_t num_heads_ = 0;
};

}  // namespace kvpool
