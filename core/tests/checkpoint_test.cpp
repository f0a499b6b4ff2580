// Checkpoint (checkpoint.h): safetensors files written by hand in a temporary directory, read
// back byte for byte; directories with and without an index and the choice between standard
// names; and one test per lie a header or an index can tell (Note [Checkpoint validation]), each
// checking the error names the file and the tensor. The reader tests truncate a file under an
// open reader and read one tensor from four threads in small pieces.
#include "ddo/core/checkpoint.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>
#endif

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace ddo::core {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

// --- writing safetensors files -----------------------------------------------------------------

struct TensorSpec {
  std::string name;
  std::string dtype;
  std::vector<std::int64_t> shape;
};

std::uint64_t spec_bytes(const TensorSpec& spec) {
  std::uint64_t numel = 1;
  for (std::int64_t d : spec.shape) numel *= static_cast<std::uint64_t>(d);
  const std::optional<TensorDtype> dtype = parse_tensor_dtype(spec.dtype);
  return numel * static_cast<std::uint64_t>(dtype ? tensor_dtype_bytes(*dtype) : 1);
}

// Distinct bytes per tensor, so a read from the wrong place is seen.
std::string pattern(const std::string& name, std::uint64_t bytes) {
  std::string out(static_cast<std::size_t>(bytes), '\0');
  const std::size_t seed = std::hash<std::string>{}(name);
  for (std::size_t i = 0; i < out.size(); ++i) {
    out[i] = static_cast<char>((seed + i * 131 + (i >> 8)) & 0xff);
  }
  return out;
}

// 8-byte little-endian length, the header text, the data.
std::string raw_file(const std::string& header, const std::string& data) {
  std::string out;
  std::uint64_t length = header.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((length >> (8 * i)) & 0xff));
  return out + header + data;
}

// A valid file holding `specs` in order, each filled with pattern(name, bytes).
std::string safetensors_file(const std::vector<TensorSpec>& specs, const json& metadata = nullptr) {
  json header = json::object();
  std::string data;
  for (const TensorSpec& spec : specs) {
    const std::uint64_t begin = data.size();
    data += pattern(spec.name, spec_bytes(spec));
    header[spec.name] = {{"dtype", spec.dtype},
                         {"shape", spec.shape},
                         {"data_offsets", {begin, static_cast<std::uint64_t>(data.size())}}};
  }
  if (!metadata.is_null()) header["__metadata__"] = metadata;
  return raw_file(header.dump(), data);
}

void write_file(const fs::path& path, const std::string& content) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(content.data(), static_cast<std::streamsize>(content.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::string path_of(const fs::path& path) {
  return path.string();
}

// The status has `code` and its message holds every one of `parts`.
::testing::AssertionResult fails_with(const Status& status, Code code,
                                      std::initializer_list<std::string> parts) {
  if (status.code() != code) {
    return ::testing::AssertionFailure() << "code " << code_name(status.code()) << ", expected "
                                         << code_name(code) << ": " << status.message();
  }
  for (const std::string& part : parts) {
    if (status.message().find(part) == std::string::npos) {
      return ::testing::AssertionFailure()
             << "message lacks '" << part << "': " << status.message();
    }
  }
  return ::testing::AssertionSuccess();
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / (std::string("ddo-checkpoint-") + info->name() + "-" +
                                        std::to_string(std::random_device{}()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  // Writes `content` as `name` in the test directory (or `sub` inside it) and returns its path.
  std::string put(const std::string& name, const std::string& content,
                  const std::string& sub = "") {
    const fs::path folder = sub.empty() ? dir_ : dir_ / sub;
    fs::create_directories(folder);
    write_file(folder / name, content);
    return path_of(folder / name);
  }

  // Reads every tensor of `ckpt` and compares it with what safetensors_file wrote.
  void expect_contents(const Checkpoint& ckpt) {
    std::unique_ptr<CheckpointReader> reader;
    ASSERT_TRUE(CheckpointReader::open(ckpt, &reader).ok());
    for (const CheckpointTensor& t : ckpt.tensors) {
      std::string got(static_cast<std::size_t>(t.bytes), '\x55');
      const Status s = reader->read(t, 0, got.data(), t.bytes);
      ASSERT_TRUE(s.ok()) << s.to_string();
      EXPECT_EQ(got, pattern(t.name, t.bytes)) << t.name;
    }
  }

  // parse_safetensors_header on `header` text with `data_bytes` of data after it.
  Status parse(const std::string& header, std::uint64_t data_bytes = 1024,
               const CheckpointLimits& limits = {}) {
    SafetensorsHeader out;
    return parse_safetensors_header(header, 8 + header.size() + data_bytes, "f.safetensors", &out,
                                    limits);
  }

  fs::path dir_;
};

// --- dtypes ------------------------------------------------------------------------------------

TEST(CheckpointDtypeTest, NamesAndSizesRoundTrip) {
  const std::vector<std::pair<std::string, int>> expected = {
      {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8},     {"I32", 4},
      {"I16", 2}, {"I8", 1},  {"U8", 1},  {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1}};
  for (const auto& [name, bytes] : expected) {
    const std::optional<TensorDtype> dtype = parse_tensor_dtype(name);
    ASSERT_TRUE(dtype.has_value()) << name;
    EXPECT_EQ(tensor_dtype_name(*dtype), name);
    EXPECT_EQ(tensor_dtype_bytes(*dtype), bytes) << name;
  }
  EXPECT_FALSE(parse_tensor_dtype("U16").has_value());
  EXPECT_FALSE(parse_tensor_dtype("f32").has_value());
}

// --- valid files -------------------------------------------------------------------------------

TEST_F(CheckpointTest, RoundTripsDtypesScalarAndEmptyTensor) {
  const std::vector<TensorSpec> specs = {{"a.weight", "F32", {2, 3}},    {"b.bias", "BF16", {5}},
                                         {"c.step", "I64", {}},          {"d.empty", "U8", {0, 7}},
                                         {"e.scale", "F8_E4M3", {3}},    {"f.mask", "BOOL", {2, 2}},
                                         {"g.double", "F64", {1, 1, 2}}, {"h.half", "F16", {3}}};
  const std::string path =
      put("one.safetensors", safetensors_file(specs, {{"format", "pt"}, {"note", "x"}}));

  SafetensorsHeader header;
  ASSERT_TRUE(read_safetensors_header(path, &header).ok());
  EXPECT_EQ(header.file_bytes, fs::file_size(path));
  EXPECT_EQ(header.metadata.at("format"), "pt");
  EXPECT_EQ(header.metadata.at("note"), "x");
  ASSERT_EQ(header.tensors.size(), specs.size());
  for (std::size_t i = 1; i < header.tensors.size(); ++i) {
    EXPECT_LE(header.tensors[i - 1].offset, header.tensors[i].offset) << "sorted by offset";
  }

  Checkpoint ckpt;
  const Status s = open_checkpoint(path, &ckpt);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(ckpt.files, std::vector<std::string>{path});
  EXPECT_EQ(ckpt.tensors.size(), specs.size());
  std::uint64_t total = 0;
  for (const TensorSpec& spec : specs) {
    const CheckpointTensor* t = ckpt.find(spec.name);
    ASSERT_NE(t, nullptr) << spec.name;
    EXPECT_EQ(tensor_dtype_name(t->dtype), spec.dtype);
    EXPECT_EQ(t->shape, spec.shape);
    EXPECT_EQ(t->bytes, spec_bytes(spec));
    EXPECT_GE(t->offset, header.data_offset) << "absolute offsets";
    total += t->bytes;
  }
  EXPECT_EQ(ckpt.find("c.step")->shape.size(), 0u);
  EXPECT_EQ(ckpt.find("c.step")->bytes, 8u);
  EXPECT_EQ(ckpt.find("d.empty")->bytes, 0u);
  EXPECT_EQ(ckpt.find("missing"), nullptr);
  EXPECT_EQ(ckpt.total_bytes(), total);
  expect_contents(ckpt);
}

TEST_F(CheckpointTest, SingleFileDirectory) {
  put("diffusion_pytorch_model.safetensors", safetensors_file({{"w", "F32", {4}}}));
  put("config.json", "{}");
  Checkpoint ckpt;
  const Status s = open_checkpoint(path_of(dir_), &ckpt);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(ckpt.root, path_of(dir_));
  ASSERT_EQ(ckpt.files.size(), 1u);
  EXPECT_EQ(fs::path(ckpt.files[0]).filename(), "diffusion_pytorch_model.safetensors");
  ASSERT_NE(ckpt.find("w"), nullptr);
  expect_contents(ckpt);
}

TEST_F(CheckpointTest, ShardedDirectoryWithIndex) {
  const std::string s1 = "model-00001-of-00002.safetensors";
  const std::string s2 = "model-00002-of-00002.safetensors";
  put(s1, safetensors_file({{"a", "F32", {3}}, {"b", "BF16", {2, 2}}}));
  put(s2, safetensors_file({{"c", "F16", {5}}}));
  put("model.safetensors.index.json",
      json{{"metadata", {{"total_size", 26}}}, {"weight_map", {{"a", s1}, {"b", s1}, {"c", s2}}}}
          .dump());
  Checkpoint ckpt;
  const Status s = open_checkpoint(path_of(dir_), &ckpt);
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_EQ(ckpt.files.size(), 2u);
  EXPECT_EQ(fs::path(ckpt.files[0]).filename(), s1);
  EXPECT_EQ(fs::path(ckpt.files[1]).filename(), s2);
  ASSERT_EQ(ckpt.tensors.size(), 3u);
  EXPECT_EQ(ckpt.find("a")->file, 0);
  EXPECT_EQ(ckpt.find("c")->file, 1);
  EXPECT_EQ(ckpt.total_bytes(), 12u + 8u + 10u);
  expect_contents(ckpt);

  // The index file itself may be passed.
  Checkpoint by_index;
  ASSERT_TRUE(open_checkpoint(path_of(dir_ / "model.safetensors.index.json"), &by_index).ok());
  EXPECT_EQ(by_index.files, ckpt.files);
}

TEST_F(CheckpointTest, PrefersTheDiffusersNameOverVariants) {
  put("diffusion_pytorch_model.safetensors", safetensors_file({{"default", "F32", {1}}}));
  put("diffusion_pytorch_model.fp16.safetensors", safetensors_file({{"variant", "F16", {1}}}));
  Checkpoint ckpt;
  const Status s = open_checkpoint(path_of(dir_), &ckpt);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_NE(ckpt.find("default"), nullptr);
  EXPECT_EQ(ckpt.find("variant"), nullptr);
}

TEST_F(CheckpointTest, PrefersTheTransformersNameWhenItIsTheOnlyStandardOne) {
  put("model.safetensors", safetensors_file({{"default", "F32", {1}}}));
  put("other.safetensors", safetensors_file({{"other", "F32", {1}}}));
  Checkpoint ckpt;
  const Status s = open_checkpoint(path_of(dir_), &ckpt);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_NE(ckpt.find("default"), nullptr);
  EXPECT_EQ(ckpt.find("other"), nullptr);
}

TEST_F(CheckpointTest, BothStandardNamesIsAmbiguous) {
  put("model.safetensors", safetensors_file({{"t", "F32", {1}}}));
  put("diffusion_pytorch_model.safetensors", safetensors_file({{"d", "F32", {1}}}));
  Checkpoint ckpt;
  EXPECT_TRUE(fails_with(
      open_checkpoint(path_of(dir_), &ckpt), Code::kInvalidArgument,
      {path_of(dir_), "model.safetensors", "diffusion_pytorch_model.safetensors", "several"}));
}

TEST_F(CheckpointTest, SeveralIndexesPreferTheDiffusersIndex) {
  const std::string shard = "diffusion_pytorch_model-00001-of-00001.safetensors";
  put(shard, safetensors_file({{"w", "F32", {2}}}));
  put("diffusion_pytorch_model.safetensors.index.json",
      json{{"weight_map", {{"w", shard}}}}.dump());
  put("extra.safetensors.index.json", json{{"weight_map", {{"w", "nowhere.safetensors"}}}}.dump());
  Checkpoint ckpt;
  const Status s = open_checkpoint(path_of(dir_), &ckpt);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_NE(ckpt.find("w"), nullptr);
}

// --- lying headers -----------------------------------------------------------------------------

TEST_F(CheckpointTest, UnknownDtype) {
  EXPECT_TRUE(fails_with(parse(R"({"a.weight":{"dtype":"U16","shape":[2],"data_offsets":[0,4]}})"),
                         Code::kDataLoss, {"f.safetensors", "'a.weight'", "'U16'", "BF16"}));
}

TEST_F(CheckpointTest, ShapeAndSizeMismatchSaysBoth) {
  const Status s = parse(R"({"a.weight":{"dtype":"BF16","shape":[4,4],"data_offsets":[0,30]}})");
  EXPECT_TRUE(fails_with(s, Code::kDataLoss,
                         {"f.safetensors: tensor 'a.weight' says shape [4,4] BF16 (32 bytes) but "
                          "data_offsets [0, 30] hold 30 bytes",
                          "re-download or re-save it"}));
}

TEST_F(CheckpointTest, OffsetsOutsideTheFile) {
  // 16 bytes of F32 [4] at [0, 16), but only 12 bytes of data follow the header.
  const Status s =
      parse(R"({"a.weight":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", /*data_bytes=*/12);
  EXPECT_TRUE(
      fails_with(s, Code::kDataLoss, {"f.safetensors", "'a.weight'", "[0, 16]", "12 bytes"}));
  // Offsets near 2^64 must not wrap around the file size check.
  EXPECT_TRUE(fails_with(
      parse(
          R"({"b":{"dtype":"U8","shape":[1],"data_offsets":[18446744073709551614,18446744073709551615]}})"),
      Code::kDataLoss, {"'b'"}));
}

TEST_F(CheckpointTest, OverlappingRanges) {
  const Status s = parse(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                         R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]},)"
                         R"("z":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})");
  EXPECT_TRUE(fails_with(s, Code::kDataLoss, {"f.safetensors", "'a'", "'b'", "share bytes"}));
  // A zero-size tensor owns no bytes, so on its own it overlaps nothing.
  EXPECT_TRUE(parse(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                    R"("z":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})")
                  .ok());
}

TEST_F(CheckpointTest, MalformedEntries) {
  const auto bad = [&](const std::string& entry, const std::string& part) {
    EXPECT_TRUE(fails_with(parse(R"({"t.w":)" + entry + "}"), Code::kDataLoss,
                           {"f.safetensors", "'t.w'", part}))
        << entry;
  };
  bad(R"([1,2])", "expected an object");
  bad(R"({"dtype":"F32","shape":[1]})", "no 'data_offsets'");
  bad(R"({"dtype":"F32","shape":[1],"data_offsets":[0,4],"extra":1})", "field 'extra'");
  bad(R"({"dtype":"F32","shape":[-1],"data_offsets":[0,4]})", "non-negative");
  bad(R"({"dtype":"F32","shape":[1.5],"data_offsets":[0,4]})", "non-negative");
  bad(R"({"dtype":"F32","shape":[1],"data_offsets":[4,0]})", "end before they begin");
  bad(R"({"dtype":"F32","shape":[1],"data_offsets":[0]})", "[begin, end]");
  bad(R"({"dtype":7,"shape":[1],"data_offsets":[0,4]})", "dtype");
  bad(R"({"dtype":"F32","shape":[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1],"data_offsets":[0,4]})",
      "17 dimensions");
  bad(R"({"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]})",
      "does not fit in 64 bits");
  bad(R"({"dtype":"F32","shape":[1],"dtype":"F16","data_offsets":[0,4]})", "twice");
  EXPECT_TRUE(fails_with(parse(R"({"":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})"),
                         Code::kDataLoss, {"empty name"}));
  EXPECT_TRUE(fails_with(parse(R"([])"), Code::kDataLoss, {"expected an object"}));
  EXPECT_TRUE(fails_with(parse(R"({"a":)"), Code::kDataLoss, {"not valid JSON"}));
  // nlohmann throws out_of_range, not parse_error, for this (found by the fuzzer).
  EXPECT_TRUE(fails_with(parse(R"({"a":{"dtype":"F32","shape":[1e999],"data_offsets":[0,4]}})"),
                         Code::kDataLoss, {"f.safetensors", "too large for a double"}));
  // A zero dimension makes the tensor empty, but the other sizes must still multiply within
  // int64 (torch computes numel in any order).
  EXPECT_TRUE(parse(R"({"e":{"dtype":"F32","shape":[0,1000000],"data_offsets":[0,0]}})").ok());
  bad(R"({"dtype":"F32","shape":[0,4611686018427387904],"data_offsets":[0,0]})",
      "does not fit in 64 bits");
}

// Note [Linear JSON parsing]: a header of many entries parses in one pass. The bound is 60 s for
// 200k entries: the callback parser this replaced took 166 s for 100k (it rescanned the parent
// object at every entry's end), the linear parse takes well under a second unloaded, so no
// machine load (or sanitizer) brings a linear parse near the bound or a quadratic one under it.
TEST_F(CheckpointTest, ManyEntriesParseInOnePass) {
  constexpr int kEntries = 200000;
  std::string header = "{";
  for (int i = 0; i < kEntries; ++i) {
    header += fmt::format(R"({}"t{}":{{"dtype":"U8","shape":[1],"data_offsets":[{},{}]}})",
                          i == 0 ? "" : ",", i, i, i + 1);
  }
  header += "}";
  const auto start = std::chrono::steady_clock::now();
  SafetensorsHeader out;
  const Status s =
      parse_safetensors_header(header, 8 + header.size() + kEntries, "f.safetensors", &out, {});
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(out.tensors.size(), static_cast<std::size_t>(kEntries));
  EXPECT_LT(seconds, 60.0);
}

TEST_F(CheckpointTest, MoreEntriesThanTheLimitAreRefusedWhileParsing) {
  CheckpointLimits limits;
  limits.max_tensors = 100;
  std::string header = "{";
  for (int i = 0; i < 100000; ++i) {
    header += fmt::format(R"({}"t{}":{{"dtype":"U8","shape":[1],"data_offsets":[{},{}]}})",
                          i == 0 ? "" : ",", i, i, i + 1);
  }
  header += "}";
  EXPECT_TRUE(fails_with(parse(header, 100000, limits), Code::kDataLoss,
                         {"f.safetensors", "more entries than the limit of 100 tensors"}));
  // Under the limit the same shape parses.
  EXPECT_TRUE(parse(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", 1, limits).ok());
}

TEST_F(CheckpointTest, MetadataMustBeStrings) {
  EXPECT_TRUE(fails_with(parse(R"({"__metadata__":{"format":"pt","n":3}})"), Code::kDataLoss,
                         {"f.safetensors", "'__metadata__'", "'n'", "expected a string"}));
  EXPECT_TRUE(fails_with(parse(R"({"__metadata__":["pt"]})"), Code::kDataLoss,
                         {"'__metadata__'", "an array"}));
}

TEST_F(CheckpointTest, DeepNestingIsAnErrorNotACrash) {
  const std::string deep(100000, '[');
  EXPECT_TRUE(fails_with(parse(deep), Code::kDataLoss, {"f.safetensors", "100000 levels deep"}));
  const std::string closed =
      R"({"__metadata__":)" + std::string(100000, '[') + std::string(100000, ']') + "}";
  EXPECT_TRUE(fails_with(parse(closed), Code::kDataLoss, {"levels deep"}));
  // Through a file too.
  const std::string path = put("deep.safetensors", raw_file(deep, ""));
  SafetensorsHeader header;
  EXPECT_TRUE(
      fails_with(read_safetensors_header(path, &header), Code::kDataLoss, {path, "levels deep"}));
}

TEST_F(CheckpointTest, HeaderLengthLongerThanTheFile) {
  std::string file = safetensors_file({{"a", "F32", {2}}});
  file.resize(file.size() - 20);  // cuts into the header
  const std::string path = put("short.safetensors", file);
  SafetensorsHeader header;
  EXPECT_TRUE(fails_with(read_safetensors_header(path, &header), Code::kDataLoss,
                         {path, "header length promises", "truncated"}));
  const std::string tiny = put("tiny.safetensors", "abc");
  EXPECT_TRUE(
      fails_with(read_safetensors_header(tiny, &header), Code::kDataLoss, {tiny, "3 bytes"}));
}

TEST_F(CheckpointTest, HeaderLengthOverTheLimit) {
  const std::string file = safetensors_file({{"a", "F32", {2}}});
  const std::string path = put("big.safetensors", file);
  CheckpointLimits limits;
  limits.max_header_bytes = 16;
  SafetensorsHeader header;
  EXPECT_TRUE(fails_with(read_safetensors_header(path, &header, limits), Code::kDataLoss,
                         {path, "more than the limit of 16"}));
  // A length of 2^63 (the first bytes of a file that is not safetensors at all).
  const std::string foreign = put("foreign.safetensors", std::string(7, '\0') + "\x80" + "{}");
  const Status s = read_safetensors_header(foreign, &header);
  EXPECT_TRUE(
      fails_with(s, Code::kDataLoss, {foreign, "not a safetensors header length", "limit"}));
  // The 8 bytes of a file that is not safetensors (a link to any file) are not repeated.
  EXPECT_EQ(s.message().find("9223372036854775808"), std::string::npos) << s.message();
}

TEST_F(CheckpointTest, AByteOrderMarkOrANulInTheHeaderIsRefusedAsSafetensorsDoes) {
  const std::string entry = R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})";
  EXPECT_TRUE(fails_with(parse("\xEF\xBB\xBF" + entry, 1), Code::kDataLoss, {"byte-order mark"}));
  EXPECT_TRUE(fails_with(parse(entry + std::string(1, '\0') + "junk", 1), Code::kDataLoss,
                         {"NUL byte at byte " + std::to_string(entry.size() + 1)}));
  EXPECT_TRUE(parse(entry + "    ", 1).ok());  // space padding, as safetensors writes it
}

TEST_F(CheckpointTest, MissingFileIsNotFound) {
  SafetensorsHeader header;
  const std::string path = path_of(dir_ / "absent.safetensors");
  EXPECT_TRUE(fails_with(read_safetensors_header(path, &header), Code::kNotFound, {path}));
}

// --- lying indexes -----------------------------------------------------------------------------

TEST_F(CheckpointTest, IndexNamingAMissingShard) {
  put("a.safetensors", safetensors_file({{"x", "F32", {1}}}));
  put("model.safetensors.index.json",
      json{{"weight_map", {{"x", "a.safetensors"}, {"y", "b.safetensors"}}}}.dump());
  Checkpoint ckpt;
  EXPECT_TRUE(
      fails_with(open_checkpoint(path_of(dir_), &ckpt), Code::kDataLoss,
                 {"model.safetensors.index.json", "'y'", "b.safetensors", "missing shard"}));
}

TEST_F(CheckpointTest, IndexNamingATensorItsShardLacks) {
  put("a.safetensors", safetensors_file({{"x", "F32", {1}}}));
  put("model.safetensors.index.json",
      json{{"weight_map", {{"x", "a.safetensors"}, {"ghost", "a.safetensors"}}}}.dump());
  Checkpoint ckpt;
  EXPECT_TRUE(fails_with(open_checkpoint(path_of(dir_), &ckpt), Code::kDataLoss,
                         {"model.safetensors.index.json", "'ghost'", "a.safetensors", "no such"}));
}

TEST_F(CheckpointTest, ShardTensorMissingFromTheIndex) {
  put("a.safetensors", safetensors_file({{"x", "F32", {1}}, {"stray", "F32", {1}}}));
  put("model.safetensors.index.json", json{{"weight_map", {{"x", "a.safetensors"}}}}.dump());
  Checkpoint ckpt;
  EXPECT_TRUE(
      fails_with(open_checkpoint(path_of(dir_), &ckpt), Code::kDataLoss,
                 {"model.safetensors.index.json", "a.safetensors", "'stray'", "does not list"}));
}

TEST_F(CheckpointTest, ShardTensorTheIndexPutsElsewhere) {
  put("a.safetensors", safetensors_file({{"x", "F32", {1}}, {"y", "F32", {1}}}));
  put("b.safetensors", safetensors_file({{"y", "F32", {1}}}));
  put("model.safetensors.index.json",
      json{{"weight_map", {{"x", "a.safetensors"}, {"y", "b.safetensors"}}}}.dump());
  Checkpoint ckpt;
  EXPECT_TRUE(fails_with(open_checkpoint(path_of(dir_), &ckpt), Code::kDataLoss,
                         {"'y'", "a.safetensors", "b.safetensors"}));
}

TEST_F(CheckpointTest, ShardNamesMustStayInTheDirectory) {
  put("outside.safetensors", safetensors_file({{"x", "F32", {1}}}));
  for (const std::string& name :
       {std::string("../outside.safetensors"), std::string("sub/a.safetensors"),
        std::string("/etc/passwd"), std::string(".."), std::string("a\\b.safetensors")}) {
    put("model.safetensors.index.json", json{{"weight_map", {{"x", name}}}}.dump(), "comp");
    Checkpoint ckpt;
    EXPECT_TRUE(fails_with(open_checkpoint(path_of(dir_ / "comp"), &ckpt), Code::kDataLoss,
                           {"model.safetensors.index.json", "'x'", "not a plain file name"}))
        << name;
  }
}

TEST_F(CheckpointTest, IndexWithoutWeightMap) {
  put("model.safetensors.index.json", R"({"metadata":{}})");
  Checkpoint ckpt;
  EXPECT_TRUE(fails_with(open_checkpoint(path_of(dir_), &ckpt), Code::kDataLoss,
                         {"model.safetensors.index.json", "weight_map"}));
  put("model.safetensors.index.json", std::string(100000, '{'));
  EXPECT_TRUE(fails_with(open_checkpoint(path_of(dir_), &ckpt), Code::kDataLoss,
                         {"model.safetensors.index.json", "levels deep"}));
}

// --- directories -------------------------------------------------------------------------------

TEST_F(CheckpointTest, TwoFilesWithoutIndexListsThem) {
  put("part-a.safetensors", safetensors_file({{"x", "F32", {1}}}));
  put("part-b.safetensors", safetensors_file({{"y", "F32", {1}}}));
  Checkpoint ckpt;
  EXPECT_TRUE(fails_with(open_checkpoint(path_of(dir_), &ckpt), Code::kInvalidArgument,
                         {path_of(dir_), "part-a.safetensors, part-b.safetensors"}));
}

TEST_F(CheckpointTest, EmptyDirectory) {
  Checkpoint ckpt;
  EXPECT_TRUE(fails_with(open_checkpoint(path_of(dir_), &ckpt), Code::kNotFound,
                         {path_of(dir_), "no .safetensors", "found: nothing"}));
  put("config.json", "{}");
  EXPECT_TRUE(
      fails_with(open_checkpoint(path_of(dir_), &ckpt), Code::kNotFound, {"found: config.json"}));
}

TEST_F(CheckpointTest, MissingDirectory) {
  Checkpoint ckpt;
  const std::string path = path_of(dir_ / "no-such-component");
  EXPECT_TRUE(fails_with(open_checkpoint(path, &ckpt), Code::kNotFound, {path, "does not exist"}));
  const std::string other = put("weights.bin", "x");
  EXPECT_TRUE(fails_with(open_checkpoint(other, &ckpt), Code::kInvalidArgument,
                         {other, "neither a directory nor a .safetensors file"}));
}

// --- reading -----------------------------------------------------------------------------------

TEST_F(CheckpointTest, FileTruncatedAfterOpenIsDataLossNamingFileAndTensor) {
  const std::string path =
      put("w.safetensors", safetensors_file({{"first", "F32", {4}}, {"last.weight", "F32", {64}}}));
  Checkpoint ckpt;
  ASSERT_TRUE(open_checkpoint(path, &ckpt).ok());
  std::unique_ptr<CheckpointReader> reader;
  ASSERT_TRUE(CheckpointReader::open(ckpt, &reader).ok());

  fs::resize_file(path, fs::file_size(path) - 100);
  const CheckpointTensor& last = *ckpt.find("last.weight");
  std::vector<char> buf(static_cast<std::size_t>(last.bytes));
  EXPECT_TRUE(fails_with(reader->read(last, 0, buf.data(), last.bytes), Code::kDataLoss,
                         {"file truncated", path, "tensor 'last.weight'", "expected 256 bytes"}));
  // The first tensor is still whole.
  const CheckpointTensor& first = *ckpt.find("first");
  std::vector<char> head(16);
  EXPECT_TRUE(reader->read(first, 0, head.data(), 16).ok());

  // read_all reports the same, whichever worker met it.
  const std::vector<ReadJob> jobs = {{ckpt.by_name.at("first"), 0, 16, head.data()},
                                     {ckpt.by_name.at("last.weight"), 0, last.bytes, buf.data()}};
  EXPECT_TRUE(fails_with(reader->read_all(jobs, 4, {}, 8), Code::kDataLoss,
                         {"file truncated", path, "'last.weight'"}));

  // A new reader sees the size change before reading anything.
  std::unique_ptr<CheckpointReader> again;
  EXPECT_TRUE(
      fails_with(CheckpointReader::open(ckpt, &again), Code::kDataLoss, {path, "changed on disk"}));
  fs::remove(path);
  EXPECT_TRUE(fails_with(CheckpointReader::open(ckpt, &again), Code::kDataLoss, {path}));
}

// Note [A shard changed under the disk tier]: the disk tier's reads (drop_behind) refuse a file
// written in place since the reader opened it, even at the same size.
TEST_F(CheckpointTest, AFileWrittenInPlaceIsRefusedByTheDiskTiersReads) {
  const std::string path = put("w.safetensors", safetensors_file({{"w", "F32", {64}}}));
  Checkpoint ckpt;
  ASSERT_TRUE(open_checkpoint(path, &ckpt).ok());
  std::unique_ptr<CheckpointReader> reader;
  ASSERT_TRUE(CheckpointReader::open(ckpt, &reader).ok());
  const CheckpointTensor& w = *ckpt.find("w");
  std::vector<char> buf(static_cast<std::size_t>(w.bytes));
  const std::vector<ReadJob> jobs = {{ckpt.by_name.at("w"), 0, w.bytes, buf.data()}};
  ASSERT_TRUE(reader->read_queued(jobs, std::uint64_t{1} << 20, /*drop_behind=*/true).ok());

  {  // the same size, other bytes: what an in-place overwrite leaves
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(w.offset));
    f.write("XXXXXXXX", 8);
  }
  // The write's own time may fall in the same clock tick as the file's creation; a later
  // last-write time is what a real overwrite leaves.
  fs::last_write_time(path, fs::last_write_time(path) + std::chrono::seconds(2));
  EXPECT_TRUE(fails_with(reader->read_queued(jobs, std::uint64_t{1} << 20, true), Code::kDataLoss,
                         {path, "changed on disk while ddo reads weights from it"}));
  // Loading reads (no drop_behind) are not the disk tier's and are not checked.
  EXPECT_TRUE(reader->read_queued(jobs, std::uint64_t{1} << 20, false).ok());
}

TEST_F(CheckpointTest, ReadOutsideTheTensorIsInvalidArgument) {
  const std::string path = put("w.safetensors", safetensors_file({{"w", "F32", {4}}}));
  Checkpoint ckpt;
  ASSERT_TRUE(open_checkpoint(path, &ckpt).ok());
  std::unique_ptr<CheckpointReader> reader;
  ASSERT_TRUE(CheckpointReader::open(ckpt, &reader).ok());
  char buf[32];
  EXPECT_TRUE(fails_with(reader->read(ckpt.tensors[0], 8, buf, 9), Code::kInvalidArgument,
                         {"'w'", "16 bytes"}));
  EXPECT_TRUE(
      fails_with(reader->read_all({{5, 0, 1, buf}}, 1), Code::kInvalidArgument, {"tensor 5"}));
  ASSERT_TRUE(reader->read(ckpt.tensors[0], 4, buf, 8).ok());
  EXPECT_EQ(std::string(buf, 8), pattern("w", 16).substr(4, 8));
}

// Note [Read queue]: callers on several threads share the queue's workers; each gets its own
// bytes, whole, and returns only once they are read.
TEST_F(CheckpointTest, ReadQueuedFromSeveralCallersReadsEveryByte) {
  std::vector<TensorSpec> specs;
  for (int i = 0; i < 12; ++i) specs.push_back({"t" + std::to_string(i), "F32", {250 + 37 * i}});
  const std::string path = put("w.safetensors", safetensors_file(specs));
  Checkpoint ckpt;
  ASSERT_TRUE(open_checkpoint(path, &ckpt).ok());
  std::unique_ptr<CheckpointReader> reader;
  ASSERT_TRUE(CheckpointReader::open(ckpt, &reader, /*queue_workers=*/3).ok());
  const ReadStats before = reader->stats();

  // Six callers, each reading two tensors (the second from an offset) in 64-byte pieces, three
  // rounds each, drop_behind on for half of them.
  constexpr int kCallers = 6;
  std::vector<Status> statuses(kCallers);
  std::vector<std::vector<std::string>> out(kCallers);
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      for (int round = 0; round < 3 && statuses[c].ok(); ++round) {
        const CheckpointTensor& a = ckpt.tensors[static_cast<std::size_t>(2 * c)];
        const CheckpointTensor& b = ckpt.tensors[static_cast<std::size_t>(2 * c + 1)];
        out[c] = {std::string(a.bytes, '\0'), std::string(b.bytes - 12, '\0')};
        statuses[c] =
            reader->read_queued({{ckpt.by_name.at(a.name), 0, a.bytes, out[c][0].data()},
                                 {ckpt.by_name.at(b.name), 12, b.bytes - 12, out[c][1].data()}},
                                /*piece_bytes=*/64, /*drop_behind=*/c % 2 == 0);
      }
    });
  }
  for (std::thread& t : callers) t.join();
  std::uint64_t bytes = 0;
  for (int c = 0; c < kCallers; ++c) {
    ASSERT_TRUE(statuses[c].ok()) << statuses[c].to_string();
    const CheckpointTensor& a = ckpt.tensors[static_cast<std::size_t>(2 * c)];
    const CheckpointTensor& b = ckpt.tensors[static_cast<std::size_t>(2 * c + 1)];
    EXPECT_EQ(out[c][0], pattern(a.name, a.bytes)) << a.name;
    EXPECT_EQ(out[c][1], pattern(b.name, b.bytes).substr(12)) << b.name;
    bytes += 3 * (a.bytes + b.bytes - 12);
  }
  // The meter saw every byte, and while busy no more reads in flight than the three workers.
  const ReadStats after = reader->stats();
  EXPECT_EQ(after.bytes - before.bytes, bytes);
  EXPECT_GE(after.reads - before.reads, bytes / 64);
  EXPECT_GT(after.busy_seconds, before.busy_seconds);
  const double depth =
      (after.depth_seconds - before.depth_seconds) / (after.busy_seconds - before.busy_seconds);
  EXPECT_GE(depth, 1.0 - 1e-9);
  EXPECT_LE(depth, 3.0 + 1e-9);

  // An empty call returns at once; bad arguments are errors naming them.
  EXPECT_TRUE(reader->read_queued({}).ok());
  char buf[8];
  EXPECT_TRUE(fails_with(reader->read_queued({{0, 0, 8, buf}}, 0), Code::kInvalidArgument,
                         {"piece_bytes"}));
  EXPECT_TRUE(
      fails_with(reader->read_queued({{99, 0, 8, buf}}), Code::kInvalidArgument, {"tensor 99"}));
  std::unique_ptr<CheckpointReader> bad;
  EXPECT_TRUE(fails_with(CheckpointReader::open(ckpt, &bad, 0), Code::kInvalidArgument,
                         {"queue_workers=0", "1..256"}));
}

// A failed piece fails its own call with the reader's message; the queue serves later calls.
TEST_F(CheckpointTest, ReadQueuedFailureReturnsTheErrorAndTheQueueGoesOn) {
  const std::string path = put(
      "w.safetensors", safetensors_file({{"first", "F32", {64}}, {"last.weight", "F32", {512}}}));
  Checkpoint ckpt;
  ASSERT_TRUE(open_checkpoint(path, &ckpt).ok());
  std::unique_ptr<CheckpointReader> reader;
  ASSERT_TRUE(CheckpointReader::open(ckpt, &reader, 2).ok());
  fs::resize_file(path, fs::file_size(path) - 1000);
  const CheckpointTensor& last = *ckpt.find("last.weight");
  std::string buf(last.bytes, '\0');
  EXPECT_TRUE(
      fails_with(reader->read_queued({{ckpt.by_name.at("last.weight"), 0, last.bytes, buf.data()}},
                                     /*piece_bytes=*/100),
                 Code::kDataLoss, {"file truncated", path, "'last.weight'"}));
  std::string head(256, '\0');
  ASSERT_TRUE(reader->read_queued({{ckpt.by_name.at("first"), 0, 256, head.data()}}, 16).ok());
  EXPECT_EQ(head, pattern("first", 256));
}

#if defined(__linux__)
// drop_behind leaves the bytes it read out of the page cache (Note [Disk unit reads]). Skips on a
// file system that keeps pages whatever it is told (tmpfs), saying so.
TEST_F(CheckpointTest, ReadQueuedDropBehindLeavesThePagesUncached) {
  const std::uint64_t n = std::uint64_t{8} << 20;
  const std::string path =
      put("w.safetensors", safetensors_file({{"w", "U8", {static_cast<std::int64_t>(n)}}}));
  Checkpoint ckpt;
  ASSERT_TRUE(open_checkpoint(path, &ckpt).ok());
  std::unique_ptr<CheckpointReader> reader;
  ASSERT_TRUE(CheckpointReader::open(ckpt, &reader, 2).ok());
  const CheckpointTensor& w = ckpt.tensors[0];
  // Pages of [w.offset, w.offset + n) in the page cache.
  const auto cached_pages = [&]() -> long {
    const int fd = ::open(path.c_str(), O_RDONLY);
    const long page = ::sysconf(_SC_PAGESIZE);
    const std::uint64_t begin = (w.offset + page - 1) / page * page;
    const std::uint64_t end = (w.offset + n) / page * page;
    void* map = ::mmap(nullptr, end - begin, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(begin));
    std::vector<unsigned char> vec((end - begin) / page);
    long resident = -1;
    if (map != MAP_FAILED && ::mincore(map, end - begin, vec.data()) == 0) {
      resident = 0;
      for (unsigned char v : vec) resident += v & 1;
    }
    if (map != MAP_FAILED) ::munmap(map, end - begin);
    ::close(fd);
    return resident;
  };
  std::string out(n, '\0');
  ASSERT_TRUE(reader->read_queued({{0, 0, n, out.data()}}, std::uint64_t{1} << 20, false).ok());
  const long kept = cached_pages();
  ASSERT_GE(kept, 0) << "mincore failed";
  {
    const int fd = ::open(path.c_str(), O_RDONLY);
    ::fsync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
  if (cached_pages() == kept && kept > 0) {
    GTEST_SKIP() << "this file system keeps pages after POSIX_FADV_DONTNEED (tmpfs?): "
                    "drop_behind cannot be observed here";
  }
  ASSERT_TRUE(reader->read_queued({{0, 0, n, out.data()}}, std::uint64_t{1} << 20, true).ok());
  EXPECT_EQ(out, pattern("w", n));
  // At most the pages at piece edges (one per piece) and a read-ahead tail stay cached.
  EXPECT_LE(cached_pages(), kept / 4) << "of " << kept << " pages cached by a plain read";
}
#endif

TEST_F(CheckpointTest, ReadAllWithFourWorkersAndSmallPieces) {
  const std::vector<TensorSpec> specs = {
      {"big", "F32", {1000}}, {"odd", "U8", {13}}, {"empty", "BF16", {0}}, {"mid", "F16", {77}}};
  const std::string path = put("w.safetensors", safetensors_file(specs));
  Checkpoint ckpt;
  ASSERT_TRUE(open_checkpoint(path, &ckpt).ok());
  std::unique_ptr<CheckpointReader> reader;
  ASSERT_TRUE(CheckpointReader::open(ckpt, &reader).ok());
  EXPECT_EQ(&reader->checkpoint(), &ckpt);

  std::vector<std::string> out(ckpt.tensors.size());
  std::vector<ReadJob> jobs;
  for (std::size_t i = 0; i < ckpt.tensors.size(); ++i) {
    out[i].assign(static_cast<std::size_t>(ckpt.tensors[i].bytes), '\0');
    jobs.push_back({i, 0, ckpt.tensors[i].bytes, out[i].data()});
  }
  // Part of a tensor, from an offset inside it.
  std::string part(100, '\0');
  jobs.push_back({ckpt.by_name.at("big"), 1000, 100, part.data()});

  std::mutex mutex;
  std::uint64_t max_done = 0;
  std::uint64_t seen_total = 0;
  int calls = 0;
  const Status s = reader->read_all(
      jobs, 4,
      [&](std::uint64_t done, std::uint64_t total) {
        std::lock_guard<std::mutex> lock(mutex);
        max_done = std::max(max_done, done);
        seen_total = total;
        ++calls;
      },
      /*piece_bytes=*/7);
  ASSERT_TRUE(s.ok()) << s.to_string();
  for (std::size_t i = 0; i < ckpt.tensors.size(); ++i) {
    EXPECT_EQ(out[i], pattern(ckpt.tensors[i].name, ckpt.tensors[i].bytes)) << ckpt.tensors[i].name;
  }
  EXPECT_EQ(part, pattern("big", 4000).substr(1000, 100));
  const std::uint64_t expected_total = 4000 + 13 + 0 + 154 + 100;
  EXPECT_EQ(seen_total, expected_total);
  EXPECT_EQ(max_done, expected_total);
  EXPECT_EQ(calls, (4000 + 6) / 7 + (13 + 6) / 7 + (154 + 6) / 7 + (100 + 6) / 7);

  // Inline (one worker) reads the same bytes.
  std::string again(4000, '\0');
  ASSERT_TRUE(reader->read_all({{ckpt.by_name.at("big"), 0, 4000, again.data()}}, 1).ok());
  EXPECT_EQ(again, out[ckpt.by_name.at("big")]);
  EXPECT_TRUE(
      fails_with(reader->read_all(jobs, 2, {}, 0), Code::kInvalidArgument, {"piece_bytes"}));
}

}  // namespace
}  // namespace ddo::core
