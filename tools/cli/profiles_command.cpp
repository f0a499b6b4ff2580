// `ddo profiles`: list, show, locate and delete named workload profiles.
//
//   ddo profiles list [--json]
//   ddo profiles show NAME [--class CLASS] [--json]   (or: show --key KEY)
//   ddo profiles path [NAME [--class CLASS] | --key KEY] (no arguments: the directory)
//   ddo profiles delete NAME [--class CLASS]          (or: delete --key KEY)
//
// --class may be left out when one class has a profile of that NAME. KEY is the file name, with
// or without ".json", or just its 24 hex digits. The directory is DDO_PROFILE_DIR, else
// ~/.ddo/profiles (profile_store.h).
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "commands.h"
#include "ddo/core/profile_store.h"
#include "ddo/core/status.h"

namespace ddo::cli {
namespace {
namespace fs = std::filesystem;
using core::ProfileStore;
using nlohmann::json;

// The command line is the one place besides the settings loader that reads the process
// environment; it passes only the variables the profile directory depends on.
std::map<std::string, std::string> profile_env() {
  std::map<std::string, std::string> env;
  for (const char* name : {"DDO_PROFILE_DIR", "HOME", "USERPROFILE"}) {
    if (const char* value = std::getenv(name)) env[name] = value;
  }
  return env;
}

ProfileStore open_store() {
  core::ProfileStoreOptions options;
  options.directory = core::resolve_profile_dir(profile_env());
  return ProfileStore(std::move(options));
}

// A key as users write it: the key, its file name, or just its 24 hex digits.
std::string normalize_key(std::string key) {
  if (key.ends_with(".json")) key.resize(key.size() - 5);
  const bool bare_digits =
      key.size() == 24 && key.find_first_not_of("0123456789abcdef") == std::string::npos;
  return bare_digits ? std::string(core::kProfileFilePrefix) + key : key;
}

// Which profile a subcommand names: NAME (with --class when several classes have that name), or
// --key. resolve() turns what was given into a key or a full identity.
struct Selector {
  std::string name;
  std::string model_class;
  std::string key;

  void add_to(CLI::App* command, bool required) {
    command->add_option("name", name, "the profile's readable name");
    command->add_option("--class", model_class,
                        "the model class qualified name (needed only when several classes have "
                        "a profile of that name)");
    command->add_option("--key", key,
                        "the profile key shown by `ddo profiles list`: ddo-capacity-v1-<24 hex "
                        "digits>, its file name, or the 24 digits alone");
    required_ = required;
  }

  bool given() const { return !name.empty() || !model_class.empty() || !key.empty(); }

  // Checks the arguments and fills in the class of a NAME given alone; throws ddo::Error with
  // what to write instead.
  void resolve(const ProfileStore& store) {
    DDO_CHECK(given() || !required_, Code::kInvalidArgument,
              "name a profile: NAME [--class CLASS], or --key KEY (see `ddo profiles list`)");
    if (!key.empty()) {
      DDO_CHECK(name.empty() && model_class.empty(), Code::kInvalidArgument,
                "--key selects a profile by itself; drop NAME and --class");
      key = normalize_key(key);
      return;
    }
    if (!given()) return;
    DDO_CHECK(!name.empty(), Code::kInvalidArgument, "--class '", model_class,
              "' needs the profile NAME too");
    if (!model_class.empty()) return;
    std::vector<std::string> classes;
    for (const core::ProfileListing& row : store.list()) {
      if (row.problem.empty() && row.name == name) classes.push_back(row.model_class);
    }
    DDO_CHECK(!classes.empty(), Code::kNotFound, "no profile named '", name, "' in ",
              store.directory().string(), "; see `ddo profiles list`");
    DDO_CHECK(classes.size() == 1, Code::kInvalidArgument, "profile '", name,
              "' exists for several model classes (", fmt::format("{}", fmt::join(classes, ", ")),
              "); add --class CLASS");
    model_class = classes.front();
  }

  // The profile file (after resolve()).
  fs::path path(const ProfileStore& store) const {
    if (!key.empty()) return store.path_for_key(key);
    return store.path_for(identity());
  }

  core::ProfileIdentity identity() const { return {name, model_class}; }

  std::string describe() const {
    if (!key.empty()) return fmt::format("with key {}", key);
    return fmt::format("'{}' for class '{}'", core::printable_text(name),
                       core::printable_text(model_class));
  }

 private:
  bool required_ = true;
};

std::string gib(const std::optional<double>& value) {
  return value ? fmt::format("{:.2f} GiB", *value) : std::string("-");
}

std::string limit(const std::optional<double>& value) {
  return value ? fmt::format("{:.2f}", *value) : std::string("-");
}

void run_list(bool as_json) {
  ProfileStore store = open_store();
  std::vector<fs::path> contexts;
  std::vector<core::ProfileListing> rows = store.list(&contexts);
  if (as_json) {
    json out = json::array();
    for (const core::ProfileListing& row : rows) out.push_back(row.to_json());
    json context_paths = json::array();
    for (const fs::path& p : contexts) context_paths.push_back(p.string());
    fmt::print("{}\n", json{{"directory", store.directory().string()},
                            {"profiles", out},
                            {"host_contexts", context_paths}}
                           .dump(2));
    return;
  }
  if (rows.empty()) {
    fmt::print("no profiles in {}\n", store.directory().string());
  } else {
    fmt::print("profiles in {}:\n", store.directory().string());
    fmt::print("{:<20} {:<32} {:>10} {:<28} {:<24} {}\n", "NAME", "CLASS", "BUDGET", "KIND",
               "UPDATED", "KEY");
  }
  for (const core::ProfileListing& row : rows) {
    if (!row.problem.empty()) {
      fmt::print("{:<20} {:<32} {:>10} {:<28} {:<24} {}\n", "(unreadable)", "-", "-", "-", "-",
                 row.profile_key);
      fmt::print("  {}; delete it with `ddo profiles delete --key {}`\n", row.problem,
                 row.profile_key);
      continue;
    }
    fmt::print("{:<20} {:<32} {:>10} {:<28} {:<24} {}\n", core::printable_text(row.name),
               core::printable_text(row.model_class), gib(row.resident_budget_gb),
               row.profile_measurement_kind.empty() ? "-" : row.profile_measurement_kind,
               row.updated_at, row.profile_key);
  }
  if (!contexts.empty()) {
    // The older host-context API (record_dynamic_offload_profile) keeps its records in the same
    // folder and key space; they are not named profiles, but they are there.
    fmt::print("also {} host-context record{} (record_dynamic_offload_profile), not profiles:\n",
               contexts.size(), contexts.size() == 1 ? "" : "s");
    for (const fs::path& p : contexts) fmt::print("  {}\n", p.filename().string());
  }
}

void run_show(Selector selector, bool as_json) {
  ProfileStore store = open_store();
  selector.resolve(store);
  const fs::path path = selector.path(store);
  std::error_code ec;
  DDO_CHECK(fs::exists(path, ec), Code::kNotFound, "no profile ", selector.describe(), " in ",
            store.directory().string(), "; see `ddo profiles list`");
  std::optional<core::ProfileRecord> record =
      selector.key.empty() ? store.load(selector.identity()) : store.load_by_key(selector.key);
  DDO_CHECK(record.has_value(), Code::kDataLoss, "profile ", selector.describe(), " at ",
            path.string(), " is unreadable (see the warning above); recalibrate or delete it");
  if (as_json) {
    json out = record->to_json();
    out["path"] = path.string();
    fmt::print("{}\n", out.dump(2));
    return;
  }
  fmt::print("name:       {}\n", core::printable_text(record->identity.name));
  fmt::print("class:      {}\n", core::printable_text(record->identity.model_class));
  fmt::print("key:        {}\n", record->profile_key);
  fmt::print("path:       {}\n", path.string());
  fmt::print("updated at: {}\n", record->updated_at);
  if (const auto& rec = record->recommendation) {
    fmt::print("recommendation: {:.2f} GiB resident ({})\n", rec->resident_budget_gb,
               rec->profile_measurement_kind);
    fmt::print("  measured peak {:.2f} GiB of {:.2f} GiB, headroom {:.2f} GiB, at {}\n",
               rec->peak_vram_gb, rec->total_vram_gb, rec->headroom_gb, rec->measured_at);
    if (!rec->weights.empty()) {
      fmt::print("  measured with weights {}\n", core::printable_text(rec->weights));
    }
    if (rec->probe_pending) {
      fmt::print(
          "  pending probe, not a validated resident run; the next normal SDNQ run probes "
          "it (safe budget {})\n",
          gib(rec->safe_budget_gb));
    }
  } else {
    fmt::print("recommendation: none\n");
  }
  for (const auto& [metric, limits] : record->capacity) {
    fmt::print("capacity {}: max success {}, min failure {}\n", metric, limit(limits.max_success),
               limit(limits.min_failure));
  }
  fmt::print("observations ({}, oldest first):\n", record->observations.size());
  for (const core::ProfileObservation& o : record->observations) {
    fmt::print("  {:<24} {:<28} budget {:.2f} GiB, peak {:.2f} GiB -> {:.2f} GiB{}\n",
               o.recorded_at, o.profile_measurement_kind, o.resident_budget_gb, o.peak_vram_gb,
               o.recommended_budget_gb, o.success ? "" : " (over total - headroom)");
  }
}

void run_path(Selector selector) {
  ProfileStore store = open_store();
  selector.resolve(store);
  if (!selector.given()) {
    fmt::print("{}\n", store.directory().string());
    return;
  }
  fmt::print("{}\n", selector.path(store).string());
}

void run_delete(Selector selector) {
  ProfileStore store = open_store();
  selector.resolve(store);
  const fs::path path = selector.path(store);
  Status status =
      selector.key.empty() ? store.remove(selector.identity()) : store.remove_by_key(selector.key);
  throw_if_error(std::move(status));
  // `ddo demo` keeps its calibration run's summary beside the profile (demo_command.cpp).
  std::error_code ec;
  const bool demo_run = fs::remove(path.string() + ".demo-run.json", ec);
  fmt::print("deleted profile {}{}\n", selector.describe(),
             demo_run ? " and the demo's run summary beside it" : "");
}

}  // namespace

void add_profiles_command(CLI::App& app, int& exit_code) {
  CLI::App* profiles =
      app.add_subcommand("profiles", "list, show, locate or delete named workload profiles");
  profiles->require_subcommand(1);

  // Owned by the callbacks for the program's lifetime; CLI11 writes options into them.
  auto list_json = std::make_shared<bool>(false);
  CLI::App* list = profiles->add_subcommand("list", "list saved profiles");
  list->add_flag("--json", *list_json, "print JSON");
  list->callback([list_json, &exit_code] {
    run_list(*list_json);
    exit_code = 0;
  });

  auto show_selector = std::make_shared<Selector>();
  auto show_json = std::make_shared<bool>(false);
  CLI::App* show =
      profiles->add_subcommand("show", "show one profile: NAME [--class CLASS], or --key KEY");
  show_selector->add_to(show, /*required=*/true);
  show->add_flag("--json", *show_json, "print JSON");
  show->callback([show_selector, show_json, &exit_code] {
    run_show(*show_selector, *show_json);
    exit_code = 0;
  });

  auto path_selector = std::make_shared<Selector>();
  CLI::App* path = profiles->add_subcommand(
      "path",
      "print the profile directory, or one profile's file: NAME [--class CLASS], or --key KEY");
  path_selector->add_to(path, /*required=*/false);
  path->callback([path_selector, &exit_code] {
    run_path(*path_selector);
    exit_code = 0;
  });

  auto delete_selector = std::make_shared<Selector>();
  CLI::App* remove =
      profiles->add_subcommand("delete", "delete one profile: NAME [--class CLASS], or --key KEY");
  delete_selector->add_to(remove, /*required=*/true);
  remove->callback([delete_selector, &exit_code] {
    run_delete(*delete_selector);
    exit_code = 0;
  });
}

}  // namespace ddo::cli
