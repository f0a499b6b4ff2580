// CheckpointReader: positional reads of tensors from an opened Checkpoint, with a read meter,
// one queue of pieces on a fixed set of threads (Note [Read queue]) for the disk tier, and a
// parallel read of everything for a load (Note [Parallel checkpoint reads]). Separate from the
// header checks and the directory index, which decide what is read; this file only reads it.
#include "ddo/core/checkpoint.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <system_error>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "checkpoint_file.h"

namespace ddo::core {

using internal::File;
using internal::read_exact;

// Note [Read meter]
// ~~~~~~~~~~~~~~~~~
// Whether reads keep a disk busy is the question every slow load or disk-tier step raises: a
// drive reading at its bandwidth but idle between reads, and one kept busy but reading slowly
// (too few requests in flight, scattered ranges), call for different fixes. So the reader counts,
// for every pread it issues, the wall time with at least one in flight and the integral of how
// many are, beside the bytes. Each read is a piece of at most a few MiB taking milliseconds; one
// short critical section before and after it costs well under a microsecond.
class ReadMeter {
 public:
  void begin() {
    std::lock_guard<std::mutex> lock(mutex_);
    advance(Clock::now());
    ++in_flight_;
  }
  void end(std::uint64_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    advance(Clock::now());
    --in_flight_;
    stats_.bytes += bytes;
    ++stats_.reads;
  }
  ReadStats stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    ReadStats s = stats_;
    add_stretch(Clock::now(), &s);  // the running stretch up to now
    return s;
  }

 private:
  using Clock = std::chrono::steady_clock;
  // Adds the stretch since the last change of in_flight_ up to `now` to `s`.
  void add_stretch(Clock::time_point now, ReadStats* s) const {
    if (in_flight_ == 0) return;
    const double dt = std::chrono::duration<double>(now - since_).count();
    s->busy_seconds += dt;
    s->depth_seconds += dt * in_flight_;
  }
  void advance(Clock::time_point now) {
    add_stretch(now, &stats_);
    since_ = now;
  }
  mutable std::mutex mutex_;
  int in_flight_ = 0;        // guarded by mutex_
  Clock::time_point since_;  // guarded by mutex_: the last change of in_flight_
  ReadStats stats_;          // guarded by mutex_
};

// Jobs cut into pieces of at most piece_bytes, numbered across all jobs (Note [Parallel
// checkpoint reads]); validated once, before any byte is read.
class PiecePlan {
 public:
  struct Piece {
    const ReadJob* job = nullptr;
    std::uint64_t start = 0;  // within the job
    std::uint64_t bytes = 0;
  };

  // Checks every job against `ckpt` (tensor index, range inside the tensor, a destination) and
  // numbers the pieces; `caller` names the API in messages.
  static Status make(const Checkpoint& ckpt, const std::vector<ReadJob>& jobs,
                     std::uint64_t piece_bytes, std::string_view caller, PiecePlan* out) {
    if (piece_bytes == 0) {
      return Status(Code::kInvalidArgument,
                    fmt::format("{}: piece_bytes is 0; pass at least 1", caller));
    }
    PiecePlan plan;
    plan.jobs_ = &jobs;
    plan.piece_bytes_ = piece_bytes;
    plan.first_piece_.assign(jobs.size() + 1, 0);
    for (std::size_t j = 0; j < jobs.size(); ++j) {
      const ReadJob& job = jobs[j];
      if (job.tensor >= ckpt.tensors.size()) {
        return Status(Code::kInvalidArgument,
                      fmt::format("{}: job {} names tensor {} but the checkpoint has {}", caller, j,
                                  job.tensor, ckpt.tensors.size()));
      }
      const CheckpointTensor& tensor = ckpt.tensors[job.tensor];
      if (job.offset > tensor.bytes || job.bytes > tensor.bytes - job.offset) {
        return Status(Code::kInvalidArgument,
                      fmt::format("{}: job {} reads {} bytes at offset {} of tensor '{}', "
                                  "which holds {} bytes",
                                  caller, j, job.bytes, job.offset, tensor.name, tensor.bytes));
      }
      if (job.bytes > 0 && job.dst == nullptr) {
        return Status(Code::kInvalidArgument, fmt::format("{}: job {} (tensor '{}') has a null dst",
                                                          caller, j, tensor.name));
      }
      plan.first_piece_[j + 1] = plan.first_piece_[j] + (job.bytes + piece_bytes - 1) / piece_bytes;
      plan.total_bytes_ += job.bytes;
    }
    *out = std::move(plan);
    return Status::ok_status();
  }

  std::uint64_t pieces() const { return first_piece_.empty() ? 0 : first_piece_.back(); }
  std::uint64_t total_bytes() const { return total_bytes_; }

  // Piece `n` (< pieces()): its job by binary search over the jobs' first piece numbers, so
  // pieces are never materialised (O(jobs) memory even for a tiny piece size).
  Piece at(std::uint64_t n) const {
    const auto j = static_cast<std::size_t>(
        std::upper_bound(first_piece_.begin(), first_piece_.end(), n) - first_piece_.begin() - 1);
    const ReadJob& job = (*jobs_)[j];
    const std::uint64_t start = (n - first_piece_[j]) * piece_bytes_;
    return {&job, start, std::min(piece_bytes_, job.bytes - start)};
  }

 private:
  const std::vector<ReadJob>* jobs_ = nullptr;
  std::vector<std::uint64_t> first_piece_;  // job j's pieces are [first_piece_[j], [j + 1])
  std::uint64_t piece_bytes_ = 0;
  std::uint64_t total_bytes_ = 0;
};

// Note [Read queue]
// ~~~~~~~~~~~~~~~~~
// The reader owns one queue of pieces served first come first served by a fixed set of threads, so
// the drive sees a steady number of large requests in flight, as a sequential sweep has: that is
// how a drive reads fastest. The disk tier reads a unit of tens to a hundred MB at a time on each
// of the copy scheduler's reader threads; splitting each unit over threads of its own would make
// the drive's queue uneven: deep while two units are read, shallow at each unit's tail and whenever
// the ring lets only one be read (measured that way on an H100 machine's disk: 11 reads in flight
// on average, 0.89 of its sequential sweep while busy). A call appends its pieces as one batch and
// waits for them; a worker takes the next piece of the oldest batch that has one left, so the
// pieces of the unit read next follow the tail of the current one without a gap, and the depth
// stays at the worker count however many callers there are. The workers start on the first call and
// stop with the reader; one mutex guards the batches (a lock per piece of milliseconds). A failed
// piece stops its batch from handing out more; the caller returns once the pieces already running
// are done, since their destinations are the caller's. Measured with the queue
// (bench/results/2026-12-06-h100-8abc593-disk-queue): 7 reads in flight and the files busy for the
// whole disk-bound stretch; a gain over per-unit threads is not isolated (the two measurements used
// different machines and methods).
class ReadQueue {
 public:
  using ReadPiece = std::function<Status(const PiecePlan::Piece& piece, bool drop_behind)>;
  ReadQueue(int workers, ReadPiece read) : workers_(workers), read_(std::move(read)) {}
  ~ReadQueue() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    work_.notify_all();
    for (std::thread& t : threads_) t.join();
  }
  ReadQueue(const ReadQueue&) = delete;
  ReadQueue& operator=(const ReadQueue&) = delete;

  Status run(const PiecePlan& plan, bool drop_behind) {
    if (plan.pieces() == 0) return Status::ok_status();
    Batch batch;
    batch.plan = &plan;
    batch.drop_behind = drop_behind;
    std::unique_lock<std::mutex> lock(mutex_);
    start_workers();
    if (threads_.empty()) {  // no thread could start: read on the caller's thread
      lock.unlock();
      for (std::uint64_t p = 0; p < plan.pieces(); ++p) {
        DDO_RETURN_IF_ERROR(read_(plan.at(p), drop_behind));
      }
      return Status::ok_status();
    }
    batches_.push_back(&batch);
    work_.notify_all();
    batch.done_cv.wait(lock, [&] { return batch.finished(); });
    return std::move(batch.error);
  }

 private:
  struct Batch {
    const PiecePlan* plan = nullptr;
    bool drop_behind = false;
    std::uint64_t taken = 0;  // guarded by ReadQueue::mutex_, as are the fields below
    std::uint64_t done = 0;
    bool failed = false;
    Status error;
    std::condition_variable done_cv;
    bool exhausted() const { return failed || taken == plan->pieces(); }
    bool finished() const { return exhausted() && done == taken; }
  };

  void start_workers() {  // under mutex_
    if (started_) return;
    started_ = true;
    for (int i = 0; i < workers_; ++i) {
      try {
        threads_.emplace_back([this] { work(); });
      } catch (const std::system_error&) {
        break;  // fewer workers
      }
    }
  }

  void work() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      work_.wait(lock, [&] { return stop_ || !batches_.empty(); });
      if (stop_) return;
      Batch* b = batches_.front();
      const std::uint64_t piece = b->taken++;
      if (b->exhausted()) batches_.pop_front();
      lock.unlock();
      Status status = read_(b->plan->at(piece), b->drop_behind);
      lock.lock();
      ++b->done;
      if (!status.ok() && !b->failed) {
        b->failed = true;
        b->error = std::move(status);
        // Hand out no more of it: drop it from the queue if still there.
        for (auto it = batches_.begin(); it != batches_.end(); ++it) {
          if (*it == b) {
            batches_.erase(it);
            break;
          }
        }
      }
      if (b->finished()) b->done_cv.notify_one();  // b may be gone once the lock is released
    }
  }

  const int workers_;
  const ReadPiece read_;
  std::mutex mutex_;
  std::condition_variable work_;
  std::deque<Batch*> batches_;  // guarded by mutex_: batches with pieces left to hand out
  bool stop_ = false;           // guarded by mutex_
  bool started_ = false;        // guarded by mutex_
  std::vector<std::thread> threads_;
};

struct CheckpointReader::Impl {
  const Checkpoint* checkpoint = nullptr;
  std::vector<File> files;  // parallel to checkpoint->files
  // Note [A shard changed under the disk tier]: each file's last-write time when opened (0 when
  // the system could not say), parallel to `files`.
  std::vector<std::int64_t> modified;
  ReadMeter meter;
  std::unique_ptr<ReadQueue> queue;  // Note [Read queue]
};

CheckpointReader::~CheckpointReader() = default;

Status CheckpointReader::open(const Checkpoint& checkpoint, std::unique_ptr<CheckpointReader>* out,
                              int queue_workers) {
  if (queue_workers < 1 || queue_workers > 256) {
    return Status(Code::kInvalidArgument,
                  fmt::format("queue_workers={} is out of range; use 1..256", queue_workers));
  }
  DDO_ASSERT(checkpoint.files.size() == checkpoint.file_bytes.size(), "files ",
             checkpoint.files.size(), " sizes ", checkpoint.file_bytes.size());
  auto impl = std::make_unique<Impl>();
  impl->checkpoint = &checkpoint;
  impl->files.reserve(checkpoint.files.size());
  for (std::size_t i = 0; i < checkpoint.files.size(); ++i) {
    const std::string& path = checkpoint.files[i];
    File file;
    std::uint64_t size = 0;
    const Status opened = File::open(path, &file, &size);
    if (!opened.ok()) {
      return Status(Code::kDataLoss,
                    fmt::format("{} (it was there when the checkpoint was opened); open the "
                                "checkpoint again",
                                opened.message()));
    }
    if (size != checkpoint.file_bytes[i]) {
      return Status(Code::kDataLoss,
                    fmt::format("'{}' is now {} bytes but was {} bytes when the checkpoint was "
                                "opened; it changed on disk — open the checkpoint again",
                                path, size, checkpoint.file_bytes[i]));
    }
    std::uint64_t stamped_size = 0;
    std::int64_t modified = 0;
    impl->modified.push_back(file.stamp(&stamped_size, &modified) ? modified : 0);
    impl->files.push_back(std::move(file));
  }
  std::unique_ptr<CheckpointReader> reader(new CheckpointReader());
  const CheckpointReader* self = reader.get();
  impl->queue = std::make_unique<ReadQueue>(
      queue_workers, [self](const PiecePlan::Piece& piece, bool drop_behind) {
        return self->read_piece(*piece.job, piece.start, piece.bytes, drop_behind);
      });
  reader->impl_ = std::move(impl);
  *out = std::move(reader);
  return Status::ok_status();
}

const Checkpoint& CheckpointReader::checkpoint() const {
  return *impl_->checkpoint;
}

Status CheckpointReader::read(const CheckpointTensor& tensor, std::uint64_t offset, void* dst,
                              std::uint64_t bytes) const {
  const Checkpoint& ckpt = *impl_->checkpoint;
  if (tensor.file < 0 || static_cast<std::size_t>(tensor.file) >= impl_->files.size()) {
    return Status(Code::kInvalidArgument,
                  fmt::format("tensor '{}' names file {} but the checkpoint has {} files",
                              tensor.name, tensor.file, impl_->files.size()));
  }
  const auto file = static_cast<std::size_t>(tensor.file);
  if (offset > tensor.bytes || bytes > tensor.bytes - offset) {
    return Status(Code::kInvalidArgument,
                  fmt::format("reading {} bytes at offset {} of tensor '{}', which holds {} bytes; "
                              "read inside the tensor",
                              bytes, offset, tensor.name, tensor.bytes));
  }
  // A tensor the caller built (not one of ckpt.tensors) must still lie inside its file.
  if (tensor.offset > ckpt.file_bytes[file] ||
      tensor.bytes > ckpt.file_bytes[file] - tensor.offset) {
    return Status(Code::kInvalidArgument,
                  fmt::format("tensor '{}' says bytes [{}, {}) of '{}', which is {} bytes; pass a "
                              "tensor of this checkpoint",
                              tensor.name, tensor.offset, tensor.offset + tensor.bytes,
                              ckpt.files[file], ckpt.file_bytes[file]));
  }
  if (bytes == 0) return Status::ok_status();
  if (dst == nullptr) {
    return Status(Code::kInvalidArgument,
                  fmt::format("reading tensor '{}' into a null buffer", tensor.name));
  }
  impl_->meter.begin();
  Status status =
      read_exact(impl_->files[file], ckpt.files[file], fmt::format("tensor '{}'", tensor.name), dst,
                 bytes, tensor.offset + offset);
  impl_->meter.end(status.ok() ? bytes : 0);
  return status;
}

// A piece of a job that PiecePlan::make validated.
Status CheckpointReader::read_piece(const ReadJob& job, std::uint64_t start, std::uint64_t bytes,
                                    bool drop_behind) const {
  const CheckpointTensor& tensor = impl_->checkpoint->tensors[job.tensor];
  DDO_RETURN_IF_ERROR(read(tensor, job.offset + start, static_cast<char*>(job.dst) + start, bytes));
  if (drop_behind) {
    impl_->files[static_cast<std::size_t>(tensor.file)].drop_cached(
        tensor.offset + job.offset + start, bytes);
  }
  return Status::ok_status();
}

// Note [A shard changed under the disk tier]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The disk tier reads its weights from the checkpoint every step (read_queued with drop_behind).
// A shard replaced by a new file is safe: the open handle still reads the old one. A shard
// overwritten in place keeps its size, and its new bytes would change the output without a word.
// So every such read first compares each file it touches with the size and last-write time it had
// when the reader opened it: one fstat per file per unit read, beside reads of megabytes.
Status CheckpointReader::check_unchanged(const std::vector<ReadJob>& jobs) const {
  const Checkpoint& checkpoint = *impl_->checkpoint;
  int last = -1;
  for (const ReadJob& job : jobs) {
    if (job.tensor >= checkpoint.tensors.size()) continue;  // PiecePlan::make reports it
    const int f = checkpoint.tensors[job.tensor].file;
    if (f == last || f < 0 || static_cast<std::size_t>(f) >= impl_->files.size()) continue;
    last = f;
    if (impl_->modified[f] == 0) continue;  // the system gave no stamp at open
    std::uint64_t size = 0;
    std::int64_t modified = 0;
    if (!impl_->files[f].stamp(&size, &modified)) continue;
    if (size != checkpoint.file_bytes[f] || modified != impl_->modified[f]) {
      return Status(Code::kDataLoss,
                    fmt::format("'{}' changed on disk while ddo reads weights from it (its size "
                                "or last-write time is not what it was when it was opened); "
                                "replace checkpoint files with new files instead of writing into "
                                "them, and attach again (remove the offload, load, enable)",
                                checkpoint.files[f]));
    }
  }
  return Status::ok_status();
}

Status CheckpointReader::read_queued(const std::vector<ReadJob>& jobs, std::uint64_t piece_bytes,
                                     bool drop_behind) const {
  if (drop_behind) DDO_RETURN_IF_ERROR(check_unchanged(jobs));
  PiecePlan plan;
  DDO_RETURN_IF_ERROR(PiecePlan::make(*impl_->checkpoint, jobs, piece_bytes, "read_queued", &plan));
  return impl_->queue->run(plan, drop_behind);
}

ReadStats CheckpointReader::stats() const {
  return impl_->meter.stats();
}

// Note [Parallel checkpoint reads]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Jobs are cut into pieces of at most piece_bytes, numbered across all jobs; workers take the
// next number from one atomic counter, so a single 10 GB tensor keeps every thread busy and no
// thread waits behind another's large job. Pieces are never materialised: a piece number maps to
// its job by binary search over each job's first piece number (O(jobs) memory even when a tiny
// piece size makes billions of pieces). The first error is kept under a mutex and raises a flag
// that stops every worker taking new pieces; the calling thread works too, so workers <= 1 runs
// inline and a failure to start a thread only means fewer threads.
Status CheckpointReader::read_all(const std::vector<ReadJob>& jobs, int workers,
                                  const ReadProgress& progress, std::uint64_t piece_bytes) const {
  PiecePlan plan;
  DDO_RETURN_IF_ERROR(PiecePlan::make(*impl_->checkpoint, jobs, piece_bytes, "read_all", &plan));
  const std::uint64_t pieces = plan.pieces();
  const std::uint64_t total = plan.total_bytes();
  if (pieces == 0) return Status::ok_status();

  std::atomic<std::uint64_t> next{0};
  std::atomic<std::uint64_t> done{0};
  std::atomic<bool> failed{false};
  std::mutex error_mutex;
  Status first_error;  // guarded by error_mutex
  const auto work = [&] {
    while (!failed.load(std::memory_order_relaxed)) {
      const std::uint64_t n = next.fetch_add(1, std::memory_order_relaxed);
      if (n >= pieces) return;
      const PiecePlan::Piece piece = plan.at(n);
      Status status = read_piece(*piece.job, piece.start, piece.bytes, /*drop_behind=*/false);
      if (!status.ok()) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!failed.load(std::memory_order_relaxed)) first_error = std::move(status);
        failed.store(true, std::memory_order_relaxed);
        return;
      }
      const std::uint64_t now =
          done.fetch_add(piece.bytes, std::memory_order_relaxed) + piece.bytes;
      if (progress) progress(now, total);
    }
  };

  const std::uint64_t threads =
      std::min<std::uint64_t>(pieces, static_cast<std::uint64_t>(std::max(workers, 1)));
  std::vector<std::thread> helpers;
  helpers.reserve(static_cast<std::size_t>(threads - 1));
  for (std::uint64_t i = 1; i < threads; ++i) {
    try {
      helpers.emplace_back(work);
    } catch (const std::system_error&) {
      break;  // fewer threads; the pieces still all get read
    }
  }
  work();
  for (std::thread& helper : helpers) helper.join();
  std::lock_guard<std::mutex> lock(error_mutex);
  return first_error;
}

}  // namespace ddo::core
