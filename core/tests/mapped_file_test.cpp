// core::MappedFile on this system (Note [File mappings per platform]); the Windows build runs it
// under Wine like the rest of core.
#include "ddo/core/mapped_file.h"

#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#ifndef _WIN32
#include <sys/resource.h>
#endif

#include "ddo/core/os_memory.h"
#include "test_files.h"

namespace ddo::core {
namespace {

namespace fs = std::filesystem;

class MappedFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("ddo-mapped-" + std::to_string(ddo::testing::process_id()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    ddo::testing::remove_tree(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { ddo::testing::remove_tree(dir_); }

  std::string write_file(const std::string& name, const std::vector<std::uint8_t>& bytes) {
    const fs::path path = dir_ / name;
    std::ofstream(path, std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()),
               static_cast<std::streamsize>(bytes.size()));
    return path.string();
  }
  std::vector<std::uint8_t> read_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }
  std::size_t files_in_dir() {
    std::size_t n = 0;
    for (const auto& e : fs::directory_iterator(dir_)) n += e.is_regular_file() ? 1 : 0;
    return n;
  }

  fs::path dir_;
};

std::vector<std::uint8_t> pattern(std::size_t n) {
  std::vector<std::uint8_t> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::uint8_t>(i * 7 + 3);
  return v;
}

TEST_F(MappedFileTest, PrivateMappingReadsTheFileAndWritesNeverReachIt) {
  const std::vector<std::uint8_t> bytes = pattern(3 * os::page_size() + 100);
  const std::string path = write_file("weights.bin", bytes);
  MappedFile m;
  ASSERT_TRUE(MappedFile::map_private(path, &m).ok());
  ASSERT_EQ(m.size(), bytes.size());
  EXPECT_EQ(std::memcmp(m.data(), bytes.data(), bytes.size()), 0);
  // A write is a private copy of its page: no fault, the mapping sees it, the file does not.
  m.data()[5] = 0;
  m.data()[bytes.size() - 1] = 0;
  EXPECT_EQ(m.data()[5], 0);
  m = MappedFile();
  EXPECT_EQ(read_file(path), bytes);
}

TEST_F(MappedFileTest, MissingOrEmptyFilesAreErrorsNamingThePath) {
  MappedFile m;
  const std::string missing = (dir_ / "absent.safetensors").string();
  const Status gone = MappedFile::map_private(missing, &m);
  EXPECT_EQ(gone.code(), Code::kNotFound);
  EXPECT_NE(gone.message().find("absent.safetensors"), std::string::npos) << gone.message();
  const std::string empty = write_file("empty.bin", {});
  const Status none = MappedFile::map_private(empty, &m);
  EXPECT_EQ(none.code(), Code::kInvalidArgument);
  EXPECT_NE(none.message().find("empty"), std::string::npos) << none.message();
  EXPECT_FALSE(m.mapped());
}

TEST_F(MappedFileTest, TemporaryMappingKeepsItsBytesAfterDroppingPagesAndLeavesNoFile) {
  const std::size_t n = 5 * os::page_size() + 12;
  const std::vector<std::uint8_t> bytes = pattern(n);
  {
    MappedFile spill;
    ASSERT_TRUE(MappedFile::create_temporary(dir_, n, &spill).ok());
    ASSERT_EQ(spill.size(), n);
    std::memcpy(spill.data(), bytes.data(), n);
    spill.drop_pages(0, n);
    spill.drop_pages(n - 1, 100);  // a range past the end is clipped
    EXPECT_EQ(std::memcmp(spill.data(), bytes.data(), n), 0);
    MappedFile moved = std::move(spill);
    EXPECT_FALSE(spill.mapped());
    EXPECT_EQ(std::memcmp(moved.data(), bytes.data(), n), 0);
  }
  EXPECT_EQ(files_in_dir(), 0u);
}

TEST_F(MappedFileTest, TemporaryMappingInAMissingDirectoryIsAnErrorNamingIt) {
  MappedFile spill;
  const Status s = MappedFile::create_temporary(dir_ / "not-there", 4096, &spill);
  EXPECT_EQ(s.code(), Code::kUnavailable);
  EXPECT_NE(s.message().find("not-there"), std::string::npos) << s.message();
  EXPECT_EQ(MappedFile::create_temporary(dir_, 0, &spill).code(), Code::kInvalidArgument);
}

#ifndef _WIN32
// A spill file larger than its filesystem's free space is an error at creation, never a fault at
// a later write (Note [A spill file is allocated first]). RLIMIT_FSIZE stands in for a full disk
// (posix_fallocate answers EFBIG past it), with SIGXFSZ ignored so the limit is an error.
TEST_F(MappedFileTest, TemporaryMappingLargerThanTheRoomIsAnErrorNotAFault) {
  struct rlimit old_limit {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = old_limit;
  small.rlim_cur = 1 << 20;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  MappedFile spill;
  const Status s = MappedFile::create_temporary(dir_, 8u << 20, &spill);
  ::setrlimit(RLIMIT_FSIZE, &old_limit);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_EQ(s.code(), Code::kResourceExhausted) << s.message();
  EXPECT_NE(s.message().find(dir_.string()), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("8388608 bytes"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("TMPDIR"), std::string::npos) << s.message();
  EXPECT_FALSE(spill.mapped());
  EXPECT_EQ(files_in_dir(), 0u);
}

TEST_F(MappedFileTest, TemporaryDirectoryNamesTmpdirWhenItIsNotADirectory) {
  const char* old = std::getenv("TMPDIR");
  const std::string saved = old != nullptr ? old : "";
  const std::string bad = (dir_ / "no-such-dir").string();
  ::setenv("TMPDIR", bad.c_str(), 1);
  std::filesystem::path dir;
  const Status s = MappedFile::temporary_directory(&dir);
  if (old != nullptr) {
    ::setenv("TMPDIR", saved.c_str(), 1);
  } else {
    ::unsetenv("TMPDIR");
  }
  EXPECT_EQ(s.code(), Code::kUnavailable);
  EXPECT_NE(s.message().find("TMPDIR='" + bad + "'"), std::string::npos) << s.message();
  ASSERT_TRUE(MappedFile::temporary_directory(&dir).ok());
  EXPECT_TRUE(std::filesystem::is_directory(dir));
}
#endif

}  // namespace
}  // namespace ddo::core
