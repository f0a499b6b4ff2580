// The `ddo` command's subcommands: each file adds one to the app.
#pragma once

#include <CLI/CLI.hpp>

namespace ddo::cli {

// Each adds its subcommand to `app`; the subcommand's callback sets `exit_code`.
void add_presets_command(CLI::App& app, int& exit_code);   // presets_command.cpp
void add_profiles_command(CLI::App& app, int& exit_code);  // profiles_command.cpp
void add_demo_command(CLI::App& app, int& exit_code);      // demo_command.cpp (needs torch)

}  // namespace ddo::cli
