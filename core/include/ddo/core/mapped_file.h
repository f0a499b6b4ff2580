/// \file
/// MappedFile: a file in this process's address space, for host storage that must read as the
/// file's bytes without holding them in memory: the checkpoint tensors of the disk tier, whose
/// parameters stay readable while the copy scheduler reads the files every step (Note [Disk-tier
/// storage] in torch/src/attach_disk_tier.cpp). POSIX in core/src/mapped_file_posix.cpp, Win32 in
/// core/src/mapped_file_win32.cpp.
///
/// ```
/// ddo::core::MappedFile file;
/// DDO_RETURN_IF_ERROR(ddo::core::MappedFile::map_private("model.safetensors", &file));
/// float first = *reinterpret_cast<const float*>(file.data() + tensor.offset);
///
/// ddo::core::MappedFile spill;   // a temporary file, gone with the mapping
/// DDO_RETURN_IF_ERROR(ddo::core::MappedFile::create_temporary(dir, bytes, &spill));
/// std::memcpy(spill.data(), converted, bytes);
/// spill.drop_pages(0, bytes);    // the bytes stay in the file; this process stops holding them
/// ```
#pragma once

// Note [File mappings per platform]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// map_private   mmap(PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_NORESERVE) of the open file;
//               CreateFileMappingW(PAGE_WRITECOPY) + MapViewOfFile(FILE_MAP_COPY). A write makes a
//               private copy of its page and never reaches the file, so a host that writes a
//               parameter in place gets no fault (ddo then refuses to serve the change: Note
//               [Weights changed in place] in torch/src/intercept_common.h).
// temporary     mkstemp in `dir`, unlinked at once, ftruncate, mmap(MAP_SHARED);
//               CreateFileW(CREATE_NEW, FILE_ATTRIBUTE_TEMPORARY | FILE_FLAG_DELETE_ON_CLOSE),
//               the file handle kept until the view is unmapped. Either way the file is gone when
//               the mapping is, and no crash leaves it behind on POSIX.
// drop_pages    madvise(MADV_DONTNEED) on the whole pages inside the range: a shared file
//               mapping keeps its contents in the file; VirtualUnlock, which takes unlocked pages
//               out of the working set. Only for temporary mappings: on a private mapping it
//               would discard written pages.
// A temporary file on a RAM file system (a tmpfs /tmp) holds its bytes in memory; the caller picks
// `dir` (TMPDIR / TMP choose the system's temporary directory).

#include <cstdint>
#include <filesystem>
#include <string>

#include "ddo/core/status.h"

namespace ddo::core {

/// A mapped file: the whole file in this process's address space until destroyed (or moved
/// from). Move-only; an empty MappedFile maps nothing.
class MappedFile {
 public:
  MappedFile() = default;
  ~MappedFile();
  MappedFile(MappedFile&& other) noexcept;             ///< takes the mapping; `other` is empty
  MappedFile& operator=(MappedFile&& other) noexcept;  ///< unmaps this one, takes `other`'s
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  /// Maps the whole regular file `path` copy-on-write (Note [File mappings per platform]).
  /// kNotFound naming the path when it cannot be opened; kInvalidArgument for an empty file;
  /// kResourceExhausted when the system refuses the mapping.
  static Status map_private(const std::string& path, MappedFile* out);

  /// A new temporary file of `bytes` (> 0) in the directory `dir`, mapped read-write; the file is
  /// deleted with the mapping. Its blocks are allocated before it is mapped, so a full disk is
  /// this error and never a fault at a later write (Note [A spill file is allocated first]).
  /// kUnavailable naming `dir` when it cannot be created there; kResourceExhausted naming `dir`
  /// and the bytes when the disk has no room for it.
  static Status create_temporary(const std::filesystem::path& dir, std::uint64_t bytes,
                                 MappedFile* out);

  /// The directory temporary files go to (TMPDIR on POSIX, TMP/TEMP on Windows, else the
  /// system's). kUnavailable naming the variable and its value when it is not a directory.
  static Status temporary_directory(std::filesystem::path* out);

  char* data() const { return data_; }              ///< the first byte; null when empty
  std::uint64_t size() const { return size_; }      ///< bytes mapped (the file's size)
  bool mapped() const { return data_ != nullptr; }  ///< false for an empty MappedFile

  /// Stops holding the whole pages inside [offset, offset + bytes) in this process's memory;
  /// their contents stay in the file. Temporary mappings only.
  void drop_pages(std::uint64_t offset, std::uint64_t bytes);

 private:
  void reset();

  char* data_ = nullptr;
  std::uint64_t size_ = 0;
  bool temporary_ = false;
  // Windows: the file (kept for delete-on-close) and the section; unused on POSIX.
  [[maybe_unused]] void* file_handle_ = nullptr;
  [[maybe_unused]] void* section_handle_ = nullptr;
};

}  // namespace ddo::core
