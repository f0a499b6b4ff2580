/// \file
/// Checkpoint: a diffusers/transformers component directory of safetensors files, validated
/// before any byte is used, and read with several threads straight into caller-owned memory.
///
/// The safetensors format is an 8-byte little-endian header length, a JSON header naming every
/// tensor (`dtype`, `shape`, `data_offsets` relative to the end of the header) and an optional
/// `__metadata__` object of strings, then the data. A directory holds either one
/// `*.safetensors` file or shards listed by a `*.safetensors.index.json` (`weight_map`: tensor
/// name -> shard file). Everything a file says is checked against the file itself (Note
/// [Checkpoint validation] in safetensors_header.cpp) so a lying header is an error that names the
/// file and the tensor, never a read out of range.
///
/// ```
/// ddo::core::Checkpoint ckpt;
/// DDO_RETURN_IF_ERROR(ddo::core::open_checkpoint("model/transformer", &ckpt));
/// const ddo::core::CheckpointTensor* t = ckpt.find("proj_out.weight");
/// std::unique_ptr<ddo::core::CheckpointReader> reader;
/// DDO_RETURN_IF_ERROR(ddo::core::CheckpointReader::open(ckpt, &reader));
/// DDO_RETURN_IF_ERROR(reader->read(*t, 0, dst, t->bytes));
/// ```
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ddo/core/status.h"

namespace ddo::core {

/// The element types a safetensors header may name.
enum class TensorDtype {
  kF64,
  kF32,
  kF16,
  kBF16,
  kI64,
  kI32,
  kI16,
  kI8,
  kU8,
  kBool,
  kF8E4M3,  ///< "F8_E4M3"
  kF8E5M2,  ///< "F8_E5M2"
};

/// The dtype a header name ("F32", "BF16", ...) stands for; nullopt for an unknown name.
std::optional<TensorDtype> parse_tensor_dtype(std::string_view name);
/// The header name of a dtype ("BF16").
const char* tensor_dtype_name(TensorDtype dtype);
/// Bytes per element.
int tensor_dtype_bytes(TensorDtype dtype);

/// Limits on what a header may declare (Note [Checkpoint validation]).
struct CheckpointLimits {
  std::uint64_t max_header_bytes = std::uint64_t{100} << 20;  ///< 100 MiB, as safetensors itself
  int max_json_depth = 64;                                    ///< nesting of the header JSON
  int max_rank = 16;                                          ///< dimensions of one tensor
  std::size_t max_tensors = 1u << 20;                         ///< tensors in one file
};

/// One tensor of a checkpoint: where its bytes are and what they are.
struct CheckpointTensor {
  std::string name;                       ///< the state-dict key, e.g. "blocks.0.attn.to_q.weight"
  TensorDtype dtype = TensorDtype::kF32;  ///< the element type stored in the file
  std::vector<std::int64_t> shape;        ///< dimensions; {} for a scalar
  int file = 0;                           ///< index into Checkpoint::files
  std::uint64_t offset = 0;               ///< absolute byte offset of the first element in the file
  std::uint64_t bytes = 0;                ///< numel * dtype bytes
};

/// One safetensors file's header, validated against the file's size.
struct SafetensorsHeader {
  std::uint64_t file_bytes = 0;           ///< size of the file the header was checked against
  std::uint64_t data_offset = 0;          ///< 8 + header length: where data_offsets count from
  std::vector<CheckpointTensor> tensors;  ///< file order (sorted by offset); `file` is 0
  std::map<std::string, std::string> metadata;  ///< the `__metadata__` object
};

/// Parses and validates the JSON header of a safetensors file of `file_bytes` bytes whose header
/// is `header_json` (the bytes after the 8-byte length). `label` names the file in errors.
/// kDataLoss on anything the file cannot honour: unknown dtype, shape/size mismatch, a range
/// outside the data section, overlapping ranges, bad JSON, limits exceeded.
Status parse_safetensors_header(std::string_view header_json, std::uint64_t file_bytes,
                                const std::string& label, SafetensorsHeader* out,
                                const CheckpointLimits& limits = {});

/// Opens `path`, reads and validates its header (kNotFound for a missing file).
Status read_safetensors_header(const std::string& path, SafetensorsHeader* out,
                               const CheckpointLimits& limits = {});

/// A component's weights: its files and every tensor in them, by name.
struct Checkpoint {
  std::string root;                            ///< the directory (or the single file) opened
  std::vector<std::string> files;              ///< paths of the safetensors files used
  std::vector<std::uint64_t> file_bytes;       ///< their sizes when opened
  std::vector<CheckpointTensor> tensors;       ///< every tensor, file by file in offset order
  std::map<std::string, std::size_t> by_name;  ///< name -> index into tensors

  /// The tensor called `name`, or null.
  const CheckpointTensor* find(const std::string& name) const;
  /// Sum of every tensor's bytes.
  std::uint64_t total_bytes() const;
};

/// Opens a component: `path` is a directory or one `.safetensors` file. A directory with one
/// `*.safetensors.index.json` uses its weight_map (every shard it names must exist and hold
/// exactly the tensors the index gives it: a missing shard, a tensor in no shard, or a tensor the
/// index puts elsewhere is kDataLoss naming both); a directory with exactly one `*.safetensors`
/// file uses it; anything else (none, several without an index, several indexes) is an error
/// that lists what was found. The same name in two files is kDataLoss.
///
/// Where several indexes, or several `*.safetensors` files and no index, are found, the standard
/// name wins when exactly one of diffusers' (`diffusion_pytorch_model.safetensors[.index.json]`)
/// and transformers' (`model.safetensors[.index.json]`) is there, so a directory that also holds
/// variants (`diffusion_pytorch_model.fp16.safetensors`) opens the default weights. `path` may
/// also name a `*.safetensors.index.json` file, which is used with the shards beside it. Shard
/// names in an index must be plain file names (no `/`, backslash, `..` or drive letter): kDataLoss
/// otherwise. A missing or unreadable `path` is kNotFound naming it; none found is kNotFound,
/// several without a standard name kInvalidArgument.
Status open_checkpoint(const std::string& path, Checkpoint* out,
                       const CheckpointLimits& limits = {});

/// One read: `bytes` of tensor `tensor` (an index into Checkpoint::tensors) from `offset` within
/// it, into `dst`.
struct ReadJob {
  std::size_t tensor = 0;    ///< index into Checkpoint::tensors
  std::uint64_t offset = 0;  ///< byte offset within the tensor
  std::uint64_t bytes = 0;   ///< bytes to read
  void* dst = nullptr;       ///< where they go
};

/// Called from reader threads with the bytes done so far and the total; must be thread-safe.
using ReadProgress = std::function<void(std::uint64_t done, std::uint64_t total)>;

/// What a CheckpointReader has read since it was opened (Note [Read meter]). `busy_seconds` is
/// the wall time with at least one read running; `depth_seconds` integrates the number running
/// over time, so depth_seconds / busy_seconds is the mean number of reads in flight while busy,
/// and bytes / busy_seconds the bandwidth the reads saw.
struct ReadStats {
  std::uint64_t bytes = 0;     ///< SUM: bytes read
  std::uint64_t reads = 0;     ///< COUNT: read() calls that read bytes (pieces of read_all too)
  double busy_seconds = 0.0;   ///< wall time with at least one read in flight
  double depth_seconds = 0.0;  ///< integral of the reads in flight over time
};

/// Reads tensors of an opened checkpoint with pread(); one open descriptor per file, shared by
/// all threads. Safe to call from several threads at once.
class CheckpointReader {
 public:
  /// Opens every file of `checkpoint` (which must outlive the reader); fails if a file is gone
  /// or its size changed since open_checkpoint (kDataLoss, naming it).
  /// `queue_workers`: threads of read_queued's queue, started on its first call (1..256).
  static Status open(const Checkpoint& checkpoint, std::unique_ptr<CheckpointReader>* out,
                     int queue_workers = 8);
  ~CheckpointReader();
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;

  /// Reads `bytes` of `tensor` starting `offset` bytes into it. A range outside the tensor is
  /// kInvalidArgument; a short read (file truncated since open) or an I/O error is kDataLoss
  /// naming the file and the tensor.
  Status read(const CheckpointTensor& tensor, std::uint64_t offset, void* dst,
              std::uint64_t bytes) const;

  /// Runs `jobs` on `workers` threads (large jobs are split into pieces of at most
  /// `piece_bytes` so the threads share one big tensor). Stops at the first error and returns it.
  /// `progress`, when set, is called as pieces complete.
  Status read_all(const std::vector<ReadJob>& jobs, int workers, const ReadProgress& progress = {},
                  std::uint64_t piece_bytes = std::uint64_t{64} << 20) const;

  /// Reads `jobs` through the reader's shared queue (Note [Read queue]): pieces of at most
  /// `piece_bytes`, served first come first served by `queue_workers` threads (open()) that live
  /// as long as the reader, so callers on several threads together keep that many reads in
  /// flight, whatever each asks for. Blocks until this call's pieces are read; returns the first
  /// error among them (after the pieces already running have finished). `drop_behind`: each
  /// piece's pages are dropped from the page cache once read (posix_fadvise DONTNEED), for bytes
  /// read again every step that host RAM is not meant to hold (the disk tier); those reads first
  /// check that each file they touch has the size and last-write time it had when opened, and a
  /// file written in place since is kDataLoss naming it.
  Status read_queued(const std::vector<ReadJob>& jobs, std::uint64_t piece_bytes = kQueuePieceBytes,
                     bool drop_behind = false) const;

  /// Piece size of read_queued: large enough that each read is sequential for the drive, small
  /// enough that one unit of a hundred MB spreads over the queue's workers.
  static constexpr std::uint64_t kQueuePieceBytes = std::uint64_t{16} << 20;

  /// The checkpoint being read.
  const Checkpoint& checkpoint() const;

  /// Checks that each file `jobs` touch has the size and last-write time it had when the reader
  /// opened it (one fstat per file): kDataLoss naming the first that does not, a file written in
  /// place since (Note [A shard changed under the disk tier]). read_queued's drop_behind reads
  /// check first; a caller whose reads must give the bytes of the load checks before others.
  Status check_unchanged(const std::vector<ReadJob>& jobs) const;

  /// Totals of every read so far, from any thread (Note [Read meter]).
  ReadStats stats() const;

 private:
  CheckpointReader() = default;
  Status read_piece(const ReadJob& job, std::uint64_t start, std::uint64_t bytes,
                    bool drop_behind) const;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ddo::core
