// The component directory index: open_checkpoint finds the weights of a diffusers or
// transformers component (one file, an index and its shards, a directory holding either) and
// joins their headers into one Checkpoint. Separate from the header checks
// (safetensors_header.cpp), which it calls per file, and from the reader (checkpoint_reader.cpp).
#include "ddo/core/checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <optional>
#include <system_error>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "checked_json.h"
#include "checkpoint_file.h"
#include "safetensors_header.h"

namespace ddo::core {
namespace fs = std::filesystem;
using nlohmann::json;

using internal::corrupt;
using internal::excerpt;
using internal::File;
using internal::kMaxMetadataKeys;
using internal::parse_bounded;
using internal::path_string;
using internal::read_exact;
using internal::to_path;

namespace {

constexpr std::string_view kWeightsSuffix = ".safetensors";
constexpr std::string_view kIndexSuffix = ".safetensors.index.json";
constexpr std::string_view kDiffusersWeights = "diffusion_pytorch_model.safetensors";
constexpr std::string_view kDiffusersIndex = "diffusion_pytorch_model.safetensors.index.json";
constexpr std::string_view kTransformersWeights = "model.safetensors";
constexpr std::string_view kTransformersIndex = "model.safetensors.index.json";

bool ends_with(std::string_view text, std::string_view suffix) {
  return text.size() >= suffix.size() && text.substr(text.size() - suffix.size()) == suffix;
}

std::string name_list(const std::vector<std::string>& names) {
  constexpr std::size_t kShown = 20;
  if (names.empty()) return "nothing";
  std::string out;
  for (std::size_t i = 0; i < names.size() && i < kShown; ++i) {
    if (i > 0) out += ", ";
    out += names[i];
  }
  if (names.size() > kShown) out += fmt::format(" and {} more", names.size() - kShown);
  return out;
}

// The one standard name among `found`: diffusers' or transformers', when exactly one of them is
// there.
std::optional<std::string> standard_name(const std::vector<std::string>& found,
                                         std::string_view diffusers,
                                         std::string_view transformers) {
  const bool has_diffusers = std::find(found.begin(), found.end(), diffusers) != found.end();
  const bool has_transformers = std::find(found.begin(), found.end(), transformers) != found.end();
  if (has_diffusers == has_transformers) return std::nullopt;
  return std::string(has_diffusers ? diffusers : transformers);
}

// A shard name from an index must stay inside the directory: a plain file name.
bool is_plain_file_name(const std::string& name) {
  if (name.empty() || name == "." || name == "..") return false;
  if (name.find_first_of(std::string_view("/\\\0", 3)) != std::string::npos) return false;
  return !to_path(name).has_root_name() && !to_path(name).is_absolute();
}

Status add_file(const std::string& path, SafetensorsHeader header, Checkpoint* ckpt) {
  const int file = static_cast<int>(ckpt->files.size());
  ckpt->files.push_back(path);
  ckpt->file_bytes.push_back(header.file_bytes);
  for (CheckpointTensor& tensor : header.tensors) {
    const auto [it, inserted] = ckpt->by_name.emplace(tensor.name, ckpt->tensors.size());
    if (!inserted) {
      const CheckpointTensor& other = ckpt->tensors[it->second];
      return Status(
          Code::kDataLoss,
          fmt::format("tensor '{}' is in both '{}' and '{}'; a checkpoint holds each "
                      "tensor once — remove the stray file",
                      tensor.name, ckpt->files[static_cast<std::size_t>(other.file)], path));
    }
    tensor.file = file;
    ckpt->tensors.push_back(std::move(tensor));
  }
  return Status::ok_status();
}

Status read_text_file(const std::string& path, std::uint64_t max_bytes, std::string* out) {
  File file;
  std::uint64_t size = 0;
  DDO_RETURN_IF_ERROR(File::open(path, &file, &size));
  if (size > max_bytes) {
    return corrupt(path, fmt::format("it is {} bytes, more than the limit of {}", size, max_bytes));
  }
  std::string text(static_cast<std::size_t>(size), '\0');
  DDO_RETURN_IF_ERROR(read_exact(file, path, "the index", text.data(), size, 0));
  *out = std::move(text);
  return Status::ok_status();
}

// Reads the index `index_name` in `dir` and every shard it names; see open_checkpoint.
Status open_index(const fs::path& dir, const std::string& index_name, Checkpoint* out,
                  const CheckpointLimits& limits) {
  const std::string index_path = path_string(dir / to_path(index_name));
  std::string text;
  DDO_RETURN_IF_ERROR(read_text_file(index_path, limits.max_header_bytes, &text));
  json index;
  DDO_RETURN_IF_ERROR(parse_bounded(text, index_path, "index", limits.max_json_depth,
                                    limits.max_tensors, limits.max_tensors + kMaxMetadataKeys,
                                    &index));
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
    return corrupt(index_path, "it has no 'weight_map' object (tensor name -> shard file)");
  }
  const json& weight_map = index["weight_map"];
  std::map<std::string, std::string> shard_of;                 // tensor -> shard
  std::map<std::string, std::vector<std::string>> tensors_of;  // shard -> tensors (sorted)
  for (const auto& [name, shard] : weight_map.items()) {
    if (!shard.is_string()) {
      return corrupt(index_path, fmt::format("weight_map gives tensor '{}' a {}, expected a "
                                             "shard file name",
                                             excerpt(name), shard.type_name()));
    }
    const auto& shard_name = shard.get_ref<const std::string&>();
    if (!is_plain_file_name(shard_name)) {
      return corrupt(index_path, fmt::format("weight_map puts tensor '{}' in '{}', which is not a "
                                             "plain file name in the index's directory",
                                             excerpt(name), excerpt(shard_name)));
    }
    shard_of[name] = shard_name;
    tensors_of[shard_name].push_back(name);
  }
  if (shard_of.empty()) return corrupt(index_path, "its weight_map is empty");

  for (const auto& [shard_name, listed] : tensors_of) {
    const std::string shard_path = path_string(dir / to_path(shard_name));
    SafetensorsHeader header;
    const Status read = read_safetensors_header(shard_path, &header, limits);
    if (read.code() == Code::kNotFound) {
      return Status(Code::kDataLoss,
                    fmt::format("{}: weight_map puts tensor '{}' in '{}', which cannot be opened "
                                "({}); the download is incomplete — download the missing shard",
                                index_path, listed.front(), shard_name, read.message()));
    }
    DDO_RETURN_IF_ERROR(read);
    for (const CheckpointTensor& tensor : header.tensors) {
      const auto it = shard_of.find(tensor.name);
      if (it == shard_of.end()) {
        return Status(Code::kDataLoss,
                      fmt::format("{}: shard '{}' holds tensor '{}', which the index does not "
                                  "list; the index and its shards do not match — re-download both",
                                  index_path, shard_name, tensor.name));
      }
      if (it->second != shard_name) {
        return Status(Code::kDataLoss,
                      fmt::format("{}: weight_map puts tensor '{}' in '{}' but shard '{}' holds "
                                  "it; the index and its shards do not match — re-download both",
                                  index_path, tensor.name, it->second, shard_name));
      }
    }
    for (const std::string& name : listed) {
      const bool found = std::any_of(header.tensors.begin(), header.tensors.end(),
                                     [&](const CheckpointTensor& t) { return t.name == name; });
      if (!found) {
        return Status(Code::kDataLoss,
                      fmt::format("{}: weight_map puts tensor '{}' in '{}' but that shard has no "
                                  "such tensor; the index and its shards do not match — "
                                  "re-download both",
                                  index_path, name, shard_name));
      }
    }
    DDO_RETURN_IF_ERROR(add_file(shard_path, std::move(header), out));
  }
  return Status::ok_status();
}

Status open_single(const std::string& path, Checkpoint* out, const CheckpointLimits& limits) {
  SafetensorsHeader header;
  DDO_RETURN_IF_ERROR(read_safetensors_header(path, &header, limits));
  return add_file(path, std::move(header), out);
}

Status open_directory(const std::string& path, const fs::path& dir, Checkpoint* out,
                      const CheckpointLimits& limits) {
  std::vector<std::string> names;  // every non-directory entry, for messages
  std::vector<std::string> indexes;
  std::vector<std::string> weights;
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  for (; !ec && it != fs::directory_iterator(); it.increment(ec)) {
    // Not is_regular_file: a broken link named model.safetensors (an interrupted download into
    // the Hugging Face cache) is picked and then fails to open, saying so, instead of vanishing.
    std::error_code type_ec;
    if (it->is_directory(type_ec)) continue;
    std::string name = path_string(it->path().filename());
    if (ends_with(name, kIndexSuffix)) indexes.push_back(name);
    if (ends_with(name, kWeightsSuffix)) weights.push_back(name);
    names.push_back(std::move(name));
  }
  if (ec) {
    return Status(Code::kNotFound,
                  fmt::format("cannot list the checkpoint directory '{}': {}", path, ec.message()));
  }
  std::sort(names.begin(), names.end());
  std::sort(indexes.begin(), indexes.end());
  std::sort(weights.begin(), weights.end());

  if (indexes.size() == 1) return open_index(dir, indexes.front(), out, limits);
  if (indexes.size() > 1) {
    const std::optional<std::string> index =
        standard_name(indexes, kDiffusersIndex, kTransformersIndex);
    if (!index) {
      return Status(Code::kInvalidArgument,
                    fmt::format("'{}' holds several safetensors indexes ({}) and not exactly one "
                                "of the standard {} and {}; pass the index file to use",
                                path, name_list(indexes), kDiffusersIndex, kTransformersIndex));
    }
    return open_index(dir, *index, out, limits);
  }
  if (weights.empty()) {
    return Status(Code::kNotFound,
                  fmt::format("'{}' holds no .safetensors file (found: {}); pass a diffusers or "
                              "transformers component directory, e.g. model/transformer",
                              path, name_list(names)));
  }
  std::optional<std::string> file;
  if (weights.size() == 1) {
    file = weights.front();
  } else {
    file = standard_name(weights, kDiffusersWeights, kTransformersWeights);
  }
  if (!file) {
    return Status(Code::kInvalidArgument,
                  fmt::format("'{}' holds several .safetensors files ({}), no index, and not "
                              "exactly one of the standard {} and {}; pass the file to use",
                              path, name_list(weights), kDiffusersWeights, kTransformersWeights));
  }
  return open_single(path_string(dir / to_path(*file)), out, limits);
}

}  // namespace

const CheckpointTensor* Checkpoint::find(const std::string& name) const {
  const auto it = by_name.find(name);
  return it == by_name.end() ? nullptr : &tensors[it->second];
}

std::uint64_t Checkpoint::total_bytes() const {
  std::uint64_t total = 0;
  for (const CheckpointTensor& tensor : tensors) total += tensor.bytes;
  return total;
}

Status open_checkpoint(const std::string& path, Checkpoint* out, const CheckpointLimits& limits) {
  const fs::path target = to_path(path);
  std::error_code ec;
  const fs::file_status status = fs::status(target, ec);
  if (status.type() == fs::file_type::not_found) {
    return Status(Code::kNotFound,
                  fmt::format("checkpoint '{}' does not exist; pass a component directory (e.g. "
                              "model/transformer) or a .safetensors file",
                              path));
  }
  if (ec) {
    return Status(Code::kNotFound,
                  fmt::format("cannot read checkpoint '{}': {}", path, ec.message()));
  }
  Checkpoint ckpt;
  ckpt.root = path;
  if (fs::is_directory(status)) {
    DDO_RETURN_IF_ERROR(open_directory(path, target, &ckpt, limits));
  } else if (ends_with(path, kIndexSuffix)) {
    DDO_RETURN_IF_ERROR(
        open_index(target.parent_path(), path_string(target.filename()), &ckpt, limits));
  } else if (ends_with(path, kWeightsSuffix)) {
    DDO_RETURN_IF_ERROR(open_single(path, &ckpt, limits));
  } else {
    return Status(Code::kInvalidArgument,
                  fmt::format("'{}' is neither a directory nor a .safetensors file; pass a "
                              "component directory (e.g. model/transformer)",
                              path));
  }
  *out = std::move(ckpt);
  return Status::ok_status();
}
}  // namespace ddo::core
