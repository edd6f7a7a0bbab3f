// kvshard: the command-line tool. Each subcommand lives in its own cmd_*.cpp and registers itself.
#include <cstdio>
#include <exception>

#include <CLI/CLI.hpp>

#include "command.h"
#include "kvshard/common/error.h"
#include "parse_errors.h"

namespace kvshard::cli {

std::vector<CommandEntry>& command_registry() {
    static std::vector<CommandEntry> registry;
    return registry;
}

bool register_command(std::string name, CommandSetup setup) {
    command_registry().push_back({std::move(name), std::move(setup)});
    return true;
}

}  // namespace kvshard::cli

int main(int argc, char** argv) {
    CLI::App app{
        "kvshard: the KV cache under tensor, pipeline, context, expert and data parallelism"};
    app.require_subcommand(1);
    app.set_version_flag("--version", "kvshard 0.1.0");
    for (auto& cmd : kvshard::cli::command_registry()) cmd.setup(app);
    kvshard::cli::require_decimal_integers(app);
    try {
        app.parse(argc, argv);
    } catch (const CLI::CallForHelp& e) {
        return app.exit(e);
    } catch (const CLI::CallForAllHelp& e) {
        return app.exit(e);
    } catch (const CLI::CallForVersion& e) {
        return app.exit(e);
    } catch (const CLI::ParseError& e) {
        const std::string line = kvshard::cli::describe_parse_error(app, e, argc, argv);
        std::fprintf(stderr, "kvshard: error: %s\n", line.c_str());
        return 2;
    } catch (const kvshard::Error& e) {
        std::fprintf(stderr, "kvshard: error: %s\n", e.what());
        return 2;
    } catch (const kvshard::InternalError& e) {
        std::fprintf(stderr, "kvshard: internal error: %s\n", e.what());
        return 3;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "kvshard: error: %s\n", e.what());
        return 2;
    }
    return 0;
}
