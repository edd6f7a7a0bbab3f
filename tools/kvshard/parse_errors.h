#pragma once
// CLI11's parse errors in kvshard's words: what is wrong, what would be right, which --help to
// read.
#include <string>

#include <CLI/CLI.hpp>

namespace kvshard::cli {

// The subcommand the user named (argv's first word that is a command), or nullptr.
const CLI::App* named_subcommand(const CLI::App& app, int argc, char** argv);

// One line (without "kvshard: error: ") for a CLI11 ParseError raised while parsing argv.
std::string describe_parse_error(const CLI::App& app, const CLI::ParseError& e, int argc,
                                 char** argv);

}  // namespace kvshard::cli
