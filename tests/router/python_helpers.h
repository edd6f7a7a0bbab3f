#pragma once
// Running the Python stand-ins of the router tests (KVSHARD_TEST_PYTHON, set by
// tests/CMakeLists.txt: Debian's python3 with python3-zmq, python3-msgpack, python3-cbor2,
// python3-xxhash).
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#include "cli_runner.h"

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

namespace kvshard::test {

inline std::string publisher_script() {
    return std::string(KVSHARD_TEST_SOURCE_DIR) + "/router/vllm_event_publisher.py";
}

// `python publisher encode FILE` over the batch specs; a JSON list of hex payloads, or null.
inline nlohmann::json python_encode(const nlohmann::json& specs) {
    char path[] = "/tmp/kvshard_vllm_events_XXXXXX";
    const int fd = mkstemp(path);
    if (fd < 0) return nullptr;
    close(fd);
    std::ofstream(path) << specs.dump();
    const std::string cmd =
        std::string(KVSHARD_TEST_PYTHON) + " " + publisher_script() + " encode " + path;
    const test::CliResult ran = test::run_command(cmd);
    const std::string& out = ran.out;
    const int st = ran.status;
    std::remove(path);
    if (st != 0) {
        ADD_FAILURE() << "the publisher script failed (needs python3-msgpack, python3-zmq: "
                         "scripts/install-deps.sh): "
                      << cmd;
        return nullptr;
    }
    return nlohmann::json::parse(out);
}

inline std::vector<uint8_t> from_hex(const std::string& h) {
    std::vector<uint8_t> out;
    for (size_t i = 0; i + 1 < h.size(); i += 2)
        out.push_back(static_cast<uint8_t>(std::stoi(h.substr(i, 2), nullptr, 16)));
    return out;
}

// `python publisher serve` as a child process: commands on its stdin, answers on its stdout.
// On loopback TCP, or with `ipc_prefix` on ipc://PREFIX.pub and ipc://PREFIX.replay.
class PythonPublisher {
  public:
    explicit PythonPublisher(const std::string& ipc_prefix = "") {
        int in[2], out[2];
        if (pipe(in) != 0 || pipe(out) != 0) return;
        pid_ = fork();
        if (pid_ == 0) {
            dup2(in[0], 0);
            dup2(out[1], 1);
            close(in[1]);
            close(out[0]);
            const std::string script = publisher_script();
            if (ipc_prefix.empty()) {
                execl(KVSHARD_TEST_PYTHON, KVSHARD_TEST_PYTHON, script.c_str(), "serve",
                      static_cast<char*>(nullptr));
            } else {
                execl(KVSHARD_TEST_PYTHON, KVSHARD_TEST_PYTHON, script.c_str(), "serve",
                      ipc_prefix.c_str(), static_cast<char*>(nullptr));
            }
            _exit(127);
        }
        close(in[0]);
        close(out[1]);
        to_ = fdopen(in[1], "w");
        from_ = fdopen(out[0], "r");
        const std::string ports = read_line();
        if (ports.rfind("ipc ", 0) == 0) {
            const size_t space = ports.find(' ', 4);
            if (space != std::string::npos) {
                endpoint_ = ports.substr(4, space - 4);
                replay_endpoint_ = ports.substr(space + 1);
            }
        } else if (std::sscanf(ports.c_str(), "ports %d %d", &pub_port_, &replay_port_) == 2) {
            endpoint_ = "tcp://127.0.0.1:" + std::to_string(pub_port_);
            replay_endpoint_ = "tcp://127.0.0.1:" + std::to_string(replay_port_);
        }
        if (endpoint_.empty())
            ADD_FAILURE() << "the publisher said '" << ports
                          << "', expected 'ports PUB REPLAY' or 'ipc PUB REPLAY'";
    }
    ~PythonPublisher() {
        if (to_) fclose(to_);
        if (from_) fclose(from_);
        if (pid_ > 0) {
            int st = 0;
            if (waitpid(pid_, &st, WNOHANG) == 0) {
                kill(pid_, SIGTERM);
                waitpid(pid_, &st, 0);
            }
        }
    }
    PythonPublisher(const PythonPublisher&) = delete;
    PythonPublisher& operator=(const PythonPublisher&) = delete;

    bool ok() const { return !endpoint_.empty(); }
    std::string endpoint() const { return endpoint_; }
    std::string replay_endpoint() const { return replay_endpoint_; }
    // Blocks until a subscriber has joined.
    bool wait_subscribed() { return read_line() == "subscribed"; }
    // Sends one command; true once the publisher has sent it.
    bool send(const nlohmann::json& cmd) {
        if (!to_) return false;
        std::fputs((cmd.dump() + "\n").c_str(), to_);
        std::fflush(to_);
        return read_line() == "ok";
    }

  private:
    std::string read_line() {
        if (!from_) return {};
        char buf[512];
        if (!std::fgets(buf, sizeof buf, from_)) return {};
        std::string s(buf);
        while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
        return s;
    }
    pid_t pid_ = -1;
    FILE* to_ = nullptr;
    FILE* from_ = nullptr;
    int pub_port_ = 0;
    int replay_port_ = 0;
    std::string endpoint_, replay_endpoint_;
};

}  // namespace kvshard::test
