// `ddo profiles`: list, show, locate and delete named workload profiles.
//
//   ddo profiles list [--json]
//   ddo profiles show NAME --class CLASS [--json]     (or: show --key KEY)
//   ddo profiles path [NAME --class CLASS | --key KEY] (no arguments: the directory)
//   ddo profiles delete NAME --class CLASS            (or: delete --key KEY)
//
// The directory is DDO_PROFILE_DIR, else ~/.ddo/profiles (profile_store.h).
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <string>

#include <fmt/format.h>

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

// Which profile a subcommand names: NAME with --class, or --key.
struct Selector {
  std::string name;
  std::string model_class;
  std::string key;

  void add_to(CLI::App* command, bool required) {
    command->add_option("name", name, "the profile's readable name");
    command->add_option("--class", model_class, "the model class qualified name");
    command->add_option("--key", key, "the 32-hex-digit profile key shown by `ddo profiles list`");
    required_ = required;
  }

  bool given() const { return !name.empty() || !model_class.empty() || !key.empty(); }

  // The profile file; throws ddo::Error with what to write instead.
  fs::path path(const ProfileStore& store) const {
    DDO_CHECK(given() || !required_, Code::kInvalidArgument,
              "name a profile: NAME --class CLASS, or --key KEY (see `ddo profiles list`)");
    if (!key.empty()) {
      DDO_CHECK(name.empty() && model_class.empty(), Code::kInvalidArgument,
                "--key selects a profile by itself; drop NAME and --class");
      return store.path_for_key(key);
    }
    DDO_CHECK(!name.empty(), Code::kInvalidArgument, "--class '", model_class,
              "' needs the profile NAME too");
    DDO_CHECK(!model_class.empty(), Code::kInvalidArgument, "profile '", name,
              "' needs --class CLASS (profiles are per model class; see `ddo profiles list`)");
    return store.path_for(identity());
  }

  core::ProfileIdentity identity() const { return {name, model_class}; }

  std::string describe() const {
    if (!key.empty()) return fmt::format("with key {}", key);
    return fmt::format("'{}' for class '{}'", name, model_class);
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
  std::vector<core::ProfileListing> rows = store.list();
  if (as_json) {
    json out = json::array();
    for (const core::ProfileListing& row : rows) out.push_back(row.to_json());
    fmt::print("{}\n", json{{"directory", store.directory().string()}, {"profiles", out}}.dump(2));
    return;
  }
  if (rows.empty()) {
    fmt::print("no profiles in {}\n", store.directory().string());
    return;
  }
  fmt::print("{:<20} {:<32} {:>10} {:<28} {:<24} {}\n", "NAME", "CLASS", "BUDGET", "KIND",
             "UPDATED", "PATH");
  for (const core::ProfileListing& row : rows) {
    if (!row.problem.empty()) {
      fmt::print("{:<20} {:<32} {:>10} {:<28} {:<24} {}\n", "(unreadable)", "-", "-", "-", "-",
                 row.path.string());
      fmt::print("  {}; delete it with `ddo profiles delete --key {}`\n", row.problem,
                 row.profile_key);
      continue;
    }
    fmt::print("{:<20} {:<32} {:>10} {:<28} {:<24} {}\n", row.name, row.model_class,
               gib(row.resident_budget_gb),
               row.profile_measurement_kind.empty() ? "-" : row.profile_measurement_kind,
               row.updated_at, row.path.string());
  }
}

void run_show(const Selector& selector, bool as_json) {
  ProfileStore store = open_store();
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
  fmt::print("name:       {}\n", record->identity.name);
  fmt::print("class:      {}\n", record->identity.model_class);
  fmt::print("key:        {}\n", record->profile_key);
  fmt::print("path:       {}\n", path.string());
  fmt::print("updated at: {}\n", record->updated_at);
  if (const auto& rec = record->recommendation) {
    fmt::print("recommendation: {:.2f} GiB resident ({})\n", rec->resident_budget_gb,
               rec->profile_measurement_kind);
    fmt::print("  measured peak {:.2f} GiB of {:.2f} GiB, headroom {:.2f} GiB, at {}\n",
               rec->peak_vram_gb, rec->total_vram_gb, rec->headroom_gb, rec->measured_at);
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

void run_path(const Selector& selector) {
  ProfileStore store = open_store();
  if (!selector.given()) {
    fmt::print("{}\n", store.directory().string());
    return;
  }
  fmt::print("{}\n", selector.path(store).string());
}

void run_delete(const Selector& selector) {
  ProfileStore store = open_store();
  (void)selector.path(store);  // validates the arguments
  Status status =
      selector.key.empty() ? store.remove(selector.identity()) : store.remove_by_key(selector.key);
  throw_if_error(std::move(status));
  fmt::print("deleted profile {}\n", selector.describe());
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
      profiles->add_subcommand("show", "show one profile: NAME --class CLASS, or --key");
  show_selector->add_to(show, /*required=*/true);
  show->add_flag("--json", *show_json, "print JSON");
  show->callback([show_selector, show_json, &exit_code] {
    run_show(*show_selector, *show_json);
    exit_code = 0;
  });

  auto path_selector = std::make_shared<Selector>();
  CLI::App* path = profiles->add_subcommand(
      "path", "print the profile directory, or one profile's file: NAME --class CLASS, or --key");
  path_selector->add_to(path, /*required=*/false);
  path->callback([path_selector, &exit_code] {
    run_path(*path_selector);
    exit_code = 0;
  });

  auto delete_selector = std::make_shared<Selector>();
  CLI::App* remove =
      profiles->add_subcommand("delete", "delete one profile: NAME --class CLASS, or --key");
  delete_selector->add_to(remove, /*required=*/true);
  remove->callback([delete_selector, &exit_code] {
    run_delete(*delete_selector);
    exit_code = 0;
  });
}

}  // namespace ddo::cli
