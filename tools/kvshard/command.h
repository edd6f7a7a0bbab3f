#pragma once
// Subcommand registry: each tools/kvshard/cmd_*.cpp registers itself with KVSHARD_COMMAND, so that
// adding a command touches no other file. Commands only parse flags and print; the work is done by
// library calls.
#include <functional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace kvshard::cli {

using CommandSetup = std::function<void(CLI::App& app)>;

struct CommandEntry {
    std::string name;
    CommandSetup setup;
};

std::vector<CommandEntry>& command_registry();
bool register_command(std::string name, CommandSetup setup);

}  // namespace kvshard::cli

#define KVSHARD_CLI_CONCAT2(a, b) a##b
#define KVSHARD_CLI_CONCAT(a, b) KVSHARD_CLI_CONCAT2(a, b)
// KVSHARD_COMMAND("layout", setup_fn): setup_fn(CLI::App& app) adds the subcommand and its
// callback.
#define KVSHARD_COMMAND(name, fn)                                                   \
    [[maybe_unused]] static const bool KVSHARD_CLI_CONCAT(kvshard_cmd_, __LINE__) = \
        ::kvshard::cli::register_command(name, fn)
