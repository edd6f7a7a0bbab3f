#pragma once
// Runs the kvshard CLI (KVSHARD_CLI_PATH, set by tests/CMakeLists.txt) with arguments and captures
// its exit status and its stdout and stderr together (run_command: any command). Shared by the CLI
// tests of every component.
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

namespace kvshard::test {

struct CliResult {
    int status = -1;  // exit code; -1 when the process did not exit normally or could not start
    std::string out;  // stdout and stderr together
};

// Runs a shell command and captures its stdout (add " 2>&1" for stderr too) and exit status.
inline CliResult run_command(const std::string& cmd) {
    CliResult r;
    FILE* pipe = popen(cmd.c_str(), "r");
    if (!pipe) return r;
    std::array<char, 4096> buf{};
    size_t n = 0;
    while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) r.out.append(buf.data(), n);
    const int st = pclose(pipe);
    r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    return r;
}

inline CliResult run_cli(const std::string& args) {
    return run_command(std::string(KVSHARD_CLI_PATH) + " " + args + " 2>&1");
}

}  // namespace kvshard::test
