#pragma once
// CLI11's parse errors in kvshard's words: what is wrong, what would be right, which --help to
// read.
#include <string>

#include <CLI/CLI.hpp>

namespace kvshard::cli {

// The subcommand the user named (argv's first word that is a command), or nullptr.
const CLI::App* named_subcommand(const CLI::App& app, int argc, char** argv);

// Makes every integer option of app and its subcommands (recursively) take a decimal integer that
// fits in 64 bits. CLI11 alone reads "010" as octal 8 and "0x10" as 16, takes '' as 0, and clamps
// an out-of-range value such as 18446744073709551616 to 2^63 - 1 instead of refusing it.
void require_decimal_integers(CLI::App& app);

// One line (without "kvshard: error: ") for a CLI11 ParseError raised while parsing argv.
std::string describe_parse_error(const CLI::App& app, const CLI::ParseError& e, int argc,
                                 char** argv);

}  // namespace kvshard::cli
