// ddo: the command-line program. `ddo presets`, `ddo profiles ...`, `ddo demo ...`.
#include <cstdio>
#include <exception>
#include <optional>
#include <string>
#include <string_view>

#include <CLI/CLI.hpp>

#include "commands.h"
#include "ddo/core/status.h"
#ifdef DDO_HAVE_TORCH
#include <torch/version.h>
#endif

namespace {

// CLI11 answers a mistyped command ("ddo profile", "ddo profiles lst") with "A subcommand is
// required", which does not say which word was wrong. Follows the words of the command line down
// the subcommand tree and names the first one that is not a command where a command is expected,
// with the choices. Stops at the first option: what follows it may be an option's value.
std::optional<std::string> unknown_command(CLI::App& app, int argc, char** argv) {
  CLI::App* current = &app;
  std::string path = "ddo";
  for (int i = 1; i < argc; ++i) {
    const std::string_view word = argv[i];
    if (word.empty() || word.front() == '-') return std::nullopt;
    const std::vector<CLI::App*> commands =
        current->get_subcommands([](CLI::App*) { return true; });
    if (commands.empty()) return std::nullopt;  // a leaf: the word is an argument
    CLI::App* next = nullptr;
    std::string choices;
    for (CLI::App* command : commands) {
      if (command->check_name(std::string(word))) next = command;
      choices += (choices.empty() ? "" : ", ") + command->get_name();
    }
    if (next == nullptr) {
      return "unknown command '" + std::string(word) + "' after '" + path + "'; the commands are " +
             choices + " (see `" + path + " --help`)";
    }
    path += " " + next->get_name();
    current = next;
  }
  return std::nullopt;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ddo: a dynamic device offloader for large diffusion models"};
  app.require_subcommand(1);
  // ddo's version and the torch it was built against: a library compiled for one torch cannot
  // be loaded by another (LibTorch has no stable C++ ABI).
#ifdef DDO_HAVE_TORCH
  app.set_version_flag("--version",
                       std::string("ddo ") + DDO_VERSION + " (torch " + TORCH_VERSION + ")");
#else
  app.set_version_flag("--version", std::string("ddo ") + DDO_VERSION + " (built without torch)");
#endif
  int exit_code = 0;
  ddo::cli::add_presets_command(app, exit_code);
  ddo::cli::add_profiles_command(app, exit_code);
#ifdef DDO_HAVE_TORCH
  ddo::cli::add_demo_command(app, exit_code);
#endif
  if (std::optional<std::string> unknown = unknown_command(app, argc, argv)) {
    std::fprintf(stderr, "ddo: error: %s\n", unknown->c_str());
    return 2;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const ddo::Error& e) {
    std::fprintf(stderr, "ddo: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddo: error: %s\n", e.what());
    return 1;
  }
  return exit_code;
}
