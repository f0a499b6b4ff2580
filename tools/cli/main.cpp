// ddo: the command-line program. `ddo presets`, `ddo profiles ...`, `ddo demo ...`.
#include <cstdio>
#include <exception>

#include <CLI/CLI.hpp>

#include "commands.h"
#include "ddo/core/status.h"

int main(int argc, char** argv) {
  CLI::App app{"ddo: a dynamic device offloader for large diffusion models"};
  app.require_subcommand(1);
  int exit_code = 0;
  ddo::cli::add_presets_command(app, exit_code);
  ddo::cli::add_profiles_command(app, exit_code);
#ifdef DDO_HAVE_TORCH
  ddo::cli::add_demo_command(app, exit_code);
#endif
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
