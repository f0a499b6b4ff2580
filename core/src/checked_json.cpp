#include "checked_json.h"

#include <unordered_set>
#include <utility>
#include <vector>

#include <fmt/format.h>

namespace ddo::core::internal {
namespace {

using json = nlohmann::json;

// Builds the document as nlohmann's DOM parser does (a stack of open containers, the next
// object member's key), with the checks of Note [Linear JSON parsing].
class CheckedBuilder final : public nlohmann::json_sax<json> {
 public:
  CheckedBuilder(CheckedJson* out, std::size_t max_keys) : out_(out), max_keys_(max_keys) {}

  bool null() override { return put(json(nullptr)); }
  bool boolean(bool v) override { return put(json(v)); }
  bool number_integer(number_integer_t v) override { return put(json(v)); }
  bool number_unsigned(number_unsigned_t v) override { return put(json(v)); }
  bool number_float(number_float_t v, const string_t&) override { return put(json(v)); }
  bool string(string_t& v) override { return put(json(std::move(v))); }
  bool binary(binary_t& v) override { return put(json::binary(std::move(v))); }

  bool start_object(std::size_t) override {
    json* slot = place(json::object());
    stack_.push_back(slot);
    // Depth of this object's keys: the top-level object's are 1, its children's 2.
    if (stack_.size() == 2) inner_keys_.clear();
    return true;
  }
  bool key(string_t& k) override {
    const std::size_t depth = stack_.size();
    if (depth <= 2 && ++keys_ > max_keys_) {
      out_->too_many_keys = true;
      return false;
    }
    if (depth == 1) {
      entry_ = k;
      if (!top_keys_.insert(k).second) {
        out_->duplicate = fmt::format("'{}' twice", excerpt(k));
        return false;
      }
    } else if (depth == 2 && !inner_keys_.insert(k).second) {
      out_->duplicate = fmt::format("field '{}' twice in '{}'", excerpt(k), excerpt(entry_));
      return false;
    }
    key_ = std::move(k);
    return true;
  }
  bool end_object() override {
    stack_.pop_back();
    return true;
  }
  bool start_array(std::size_t) override {
    stack_.push_back(place(json::array()));
    return true;
  }
  bool end_array() override {
    stack_.pop_back();
    return true;
  }
  bool parse_error(std::size_t position, const std::string&,
                   const nlohmann::detail::exception& ex) override {
    // 406: the lexer read a number a double cannot hold (1e999).
    if (ex.id == 406) {
      out_->number_overflow = true;
    } else {
      out_->parse_error = true;
      out_->error_byte = position;
    }
    return false;
  }

 private:
  // Stores `v` where the parser is (the root, the next array element, the member named key_)
  // and returns its address, which stays valid: a container's children are only appended to
  // after its own slot is final, and a parent never grows while a child is open.
  json* place(json&& v) {
    if (stack_.empty()) {
      out_->value = std::move(v);
      return &out_->value;
    }
    json& parent = *stack_.back();
    if (parent.is_array()) {
      parent.get_ref<json::array_t&>().push_back(std::move(v));
      return &parent.get_ref<json::array_t&>().back();
    }
    json& slot = parent.get_ref<json::object_t&>()[key_];
    slot = std::move(v);
    return &slot;
  }
  bool put(json&& v) {
    place(std::move(v));
    return true;
  }

  CheckedJson* out_;
  std::size_t max_keys_;
  std::size_t keys_ = 0;
  std::vector<json*> stack_;
  std::string key_;
  std::string entry_;
  std::unordered_set<std::string> top_keys_;
  std::unordered_set<std::string> inner_keys_;
};

}  // namespace

std::string excerpt(std::string_view text) {
  constexpr std::size_t kMaxShown = 200;
  if (text.size() <= kMaxShown) return std::string(text);
  std::size_t cut = kMaxShown;
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
  return fmt::format("{}... ({} bytes)", text.substr(0, cut), text.size());
}

CheckedJson parse_checked_json(std::string_view text, std::size_t max_keys) {
  CheckedJson out;
  CheckedBuilder builder(&out, max_keys);
  const bool ok = json::sax_parse(text, &builder, json::input_format_t::json, /*strict=*/true);
  if (!ok && out.ok()) out.parse_error = true;  // a handler refusal always sets a reason
  if (!out.ok()) out.value = json();
  return out;
}

}  // namespace ddo::core::internal
