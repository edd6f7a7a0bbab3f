// `kvshard router serve` end to end: the CLI process, two Python publishers speaking vLLM's wire
// format for a prompt hashed as vLLM hashes it, and HTTP requests to the service. Routes follow
// the longest cached prefix; a removal and an AllBlocksCleared change the answer; a gap without
// replay marks the replica stale; a restart clears it; malformed frames are counted; bad requests
// get 400; SIGTERM stops it cleanly.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <poll.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <thread>

#include "cli_runner.h"
#include "kvshard/common/error.h"
#include "kvshard/router/http_server.h"
#include "kvshard/router/vllm_event_subscriber.h"
#include "python_helpers.h"

namespace kvshard {
namespace {

using nlohmann::json;

constexpr int kBlock = 4;

std::vector<int32_t> prompt() {
    std::vector<int32_t> t;
    for (int i = 0; i < 8 * kBlock + 2; ++i) t.push_back(500 + 11 * i);
    return t;
}

json stored(int first, int count) {
    return {{"tag", "BlockStored"},
            {"_prompt",
             {{"scheme", "vllm-xxhash-cbor"},
              {"seed", "42"},
              {"block_size", kBlock},
              {"tokens", prompt()},
              {"first", first},
              {"count", count}}},
            {"lora_id", nullptr},
            {"medium", "GPU"},
            {"lora_name", nullptr}};
}

json batch(int seq, std::vector<json> events, bool drop = false) {
    json b = {{"seq", seq},
              {"batch", {{"ts", 1.0 + seq}, {"events", events}, {"dp", 0}, {"form", "map"}}}};
    if (drop) b["drop"] = true;
    return b;
}

// The accept-queue limit of the IPv4 TCP listener on `port`, as the kernel reports it over
// sock_diag (what `ss -ltn` prints as Send-Q); -1 if no listener is found.
int listen_backlog(int port) {
    const int nl = ::socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
    if (nl < 0) return -1;
    struct {
        nlmsghdr h;
        inet_diag_req_v2 r;
    } req{};
    req.h.nlmsg_len = sizeof(req);
    req.h.nlmsg_type = SOCK_DIAG_BY_FAMILY;
    req.h.nlmsg_flags = NLM_F_REQUEST | NLM_F_DUMP;
    req.r.sdiag_family = AF_INET;
    req.r.sdiag_protocol = IPPROTO_TCP;
    req.r.idiag_states = 1u << 10;  // TCP_LISTEN
    int found = -1;
    if (::send(nl, &req, sizeof(req), 0) == static_cast<ssize_t>(sizeof(req))) {
        alignas(nlmsghdr) char buf[16384];
        for (bool done = false; !done;) {
            const ssize_t n = ::recv(nl, buf, sizeof(buf), 0);
            if (n <= 0) break;
            int len = static_cast<int>(n);
            for (auto* h = reinterpret_cast<nlmsghdr*>(buf); NLMSG_OK(h, len);
                 h = NLMSG_NEXT(h, len)) {
                if (h->nlmsg_type == NLMSG_DONE || h->nlmsg_type == NLMSG_ERROR) {
                    done = true;
                    break;
                }
                const auto* m = static_cast<const inet_diag_msg*>(NLMSG_DATA(h));
                if (ntohs(m->id.idiag_sport) == port) found = static_cast<int>(m->idiag_wqueue);
            }
        }
    }
    ::close(nl);
    return found;
}

struct HttpReply {
    int status = 0;
    std::string headers;
    std::string body;
};

HttpReply http(int port, const std::string& method, const std::string& path,
               const std::string& body = {}, const std::string& extra_headers = {}) {
    HttpReply r;
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
        close(fd);
        return r;
    }
    const std::string req = method + " " + path +
                            " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                            "Content-Type: application/json\r\n" +
                            extra_headers + "Content-Length: " + std::to_string(body.size()) +
                            "\r\n\r\n" + body;
    (void)!write(fd, req.data(), req.size());
    std::string out;
    char buf[4096];
    ssize_t n = 0;
    while ((n = read(fd, buf, sizeof buf)) > 0) out.append(buf, static_cast<size_t>(n));
    close(fd);
    if (out.rfind("HTTP/1.1 ", 0) == 0) r.status = std::atoi(out.c_str() + 9);
    const size_t split = out.find("\r\n\r\n");
    if (split != std::string::npos) {
        r.headers = out.substr(0, split);
        r.body = out.substr(split + 4);
    }
    return r;
}

// The CLI as a child process; its stdout is read line by line.
class RouterProcess {
  public:
    explicit RouterProcess(const std::vector<std::string>& args) {
        int out[2];
        if (pipe(out) != 0) return;
        pid_ = fork();
        if (pid_ == 0) {
            dup2(out[1], 1);
            dup2(out[1], 2);
            close(out[0]);
            std::vector<char*> argv;
            argv.push_back(const_cast<char*>(KVSHARD_CLI_PATH));
            for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
            argv.push_back(nullptr);
            execv(KVSHARD_CLI_PATH, argv.data());
            _exit(127);
        }
        close(out[1]);
        from_ = fdopen(out[0], "r");
    }
    ~RouterProcess() {
        if (pid_ > 0 && !exited_) {
            kill(pid_, SIGKILL);
            waitpid(pid_, nullptr, 0);
        }
        if (from_) fclose(from_);
    }
    std::string read_line() {
        char buf[1024];
        if (!from_ || !std::fgets(buf, sizeof buf, from_)) return {};
        return buf;
    }
    // SIGTERM, then the exit status (-1 if it did not exit normally).
    int terminate() {
        kill(pid_, SIGTERM);
        int st = 0;
        waitpid(pid_, &st, 0);
        exited_ = true;
        return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    }

  private:
    pid_t pid_ = -1;
    FILE* from_ = nullptr;
    bool exited_ = false;
};

bool eventually(const std::function<bool()>& done) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (std::chrono::steady_clock::now() < deadline) {
        if (done()) return true;
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return done();
}

TEST(RouterServe, RoutesByVllmEventsAndStopsOnSigterm) {
    if (!VllmEventSubscriber::available() || !RouterHttpServer::available())
        GTEST_SKIP() << "built without libzmq or cpp-httplib";
    test::PythonPublisher pa, pb;
    ASSERT_TRUE(pa.ok() && pb.ok());
    RouterProcess router({"router", "serve", "--listen", "127.0.0.1:0", "--engine",
                          "a=" + pa.endpoint(), "--engine", "b=" + pb.endpoint(), "--policy",
                          "kvshard", "--block-size", std::to_string(kBlock), "--hash",
                          "vllm-xxhash-cbor", "--hash-seed", "42"});
    const std::string line = router.read_line();
    const size_t at = line.find("http://127.0.0.1:");
    ASSERT_NE(at, std::string::npos) << line;
    EXPECT_NE(line.find("(2 replicas, policy kvshard, vllm-xxhash-cbor, hash seed 42)\n"),
              std::string::npos)
        << line;
    const int port = std::atoi(line.c_str() + at + 17);
    ASSERT_GT(port, 0);
    ASSERT_TRUE(pa.wait_subscribed());
    ASSERT_TRUE(pb.wait_subscribed());

    auto replicas = [&] { return json::parse(http(port, "GET", "/replicas").body)["replicas"]; };
    auto seq_of = [&](int r) { return replicas()[r]["last_seq"]; };
    json body = {{"token_ids", prompt()}, {"request_id", "r1"}};
    int routed = 0;
    auto route = [&] {
        body["request_id"] = "r" + std::to_string(++routed);
        const auto rep = http(port, "POST", "/route", body.dump());
        EXPECT_EQ(rep.status, 200) << rep.body;
        const auto j = json::parse(rep.body);
        // Release the load again, so only the prefixes decide.
        const auto fin =
            http(port, "POST", "/requests/" + body["request_id"].get<std::string>() + "/finished");
        EXPECT_EQ(json::parse(fin.body)["finished"], true);
        return j;
    };

    EXPECT_EQ(http(port, "GET", "/healthz").status, 200);
    // a holds 8 blocks of the prompt, b 4.
    ASSERT_TRUE(pa.send(batch(0, {stored(0, 8)})));
    ASSERT_TRUE(pb.send(batch(0, {stored(0, 4)})));
    ASSERT_TRUE(eventually([&] { return seq_of(0) == 0 && seq_of(1) == 0; }));
    auto j = route();
    EXPECT_EQ(j["replica"], "a");
    EXPECT_EQ(j["matched_blocks"]["a"], 8);
    EXPECT_EQ(j["matched_blocks"]["b"], 4);

    // a loses block 2: b has the longer prefix.
    {
        // The id of block 2, as the reference hashes it (the BlockStored of block 2 alone).
        json one = stored(2, 1);
        json rm = {{"tag", "BlockRemoved"}, {"medium", "GPU"}, {"_prompt", one["_prompt"]}};
        ASSERT_TRUE(pa.send(batch(1, {rm})));
    }
    ASSERT_TRUE(eventually([&] { return seq_of(0) == 1; }));
    j = route();
    EXPECT_EQ(j["matched_blocks"]["a"], 2);
    EXPECT_EQ(j["replica"], "b");

    // b is cleared: a again.
    ASSERT_TRUE(pb.send(batch(1, {{{"tag", "AllBlocksCleared"}}})));
    ASSERT_TRUE(eventually([&] { return seq_of(1) == 1; }));
    j = route();
    EXPECT_EQ(j["matched_blocks"]["b"], 0);
    EXPECT_EQ(j["replica"], "a");

    // A lost batch on b (no replay configured): stale, then what follows the gap.
    ASSERT_TRUE(pb.send(batch(2, {stored(0, 2)}, /*drop=*/true)));
    ASSERT_TRUE(pb.send(batch(3, {stored(0, 6)})));
    ASSERT_TRUE(eventually([&] { return seq_of(1) == 3; }));
    EXPECT_EQ(replicas()[1]["stale"], true);
    EXPECT_EQ(replicas()[1]["gaps"], 1);
    j = route();
    EXPECT_EQ(j["replica"], "b");
    EXPECT_EQ(j["matched_blocks"]["b"], 6);

    // b's publisher restarts (sequence 0 again): cleared, no longer stale.
    ASSERT_TRUE(pb.send(batch(0, {stored(0, 1)})));
    ASSERT_TRUE(eventually([&] { return replicas()[1]["restarts"] == 1; }));
    EXPECT_EQ(replicas()[1]["stale"], false);
    EXPECT_EQ(replicas()[1]["index_blocks"], 1);

    // A hybrid model on a: a second KV group that holds only block 0 bounds a's prefix to 1 block
    // (group 0 still holds 2); then the group names itself a sliding window of 1 token (no block
    // before the hit is needed) and no longer bounds it.
    {
        json g1 = stored(0, 1);
        g1["group_idx"] = 1;
        ASSERT_TRUE(pa.send(batch(2, {g1})));
        ASSERT_TRUE(eventually([&] { return seq_of(0) == 2; }));
        j = route();
        EXPECT_EQ(j["matched_blocks"]["a"], 1);
        json swa = stored(0, 1);
        swa["group_idx"] = 1;
        swa["kv_cache_spec_kind"] = "sliding_window";
        swa["kv_cache_spec_sliding_window"] = 1;
        ASSERT_TRUE(pa.send(batch(3, {swa})));
        ASSERT_TRUE(eventually([&] { return seq_of(0) == 3; }));
        j = route();
        EXPECT_EQ(j["matched_blocks"]["a"], 2);
    }

    // Malformed frames are counted (and one with an old sequence number clears nothing). 7 routes
    // so far, with the one below.
    ASSERT_TRUE(pa.send({{"frames_hex", {"", "0000000000000002", "c1"}}}));
    ASSERT_TRUE(pa.send({{"frames_hex", {"00"}}}));
    ASSERT_TRUE(eventually([&] { return replicas()[0]["malformed"] == 2; }));
    EXPECT_EQ(replicas()[0]["restarts"], 0);
    EXPECT_EQ(route()["matched_blocks"]["a"], 2);
    const auto metrics = http(port, "GET", "/metrics");
    EXPECT_EQ(metrics.status, 200);
    EXPECT_NE(metrics.body.find("kvshard_router_malformed_total{replica=\"a\"} 2"),
              std::string::npos)
        << metrics.body;
    EXPECT_NE(metrics.body.find("kvshard_router_routes_total 7"), std::string::npos);
    EXPECT_NE(metrics.body.find("kvshard_router_gaps_total{replica=\"b\"} 1"), std::string::npos);
    EXPECT_NE(metrics.body.find("kvshard_router_route_seconds_count 7"), std::string::npos);

    // A salted prompt and a LoRA prompt, stored on b with vLLM's extra keys in their hashes: only
    // a route with the same salt / adapter name finds them.
    {
        std::vector<int32_t> salted, lora;
        for (int i = 0; i < 2 * kBlock + 1; ++i) {
            salted.push_back(7000 + i);
            lora.push_back(8000 + i);
        }
        auto stored_with = [](const std::vector<int32_t>& tokens, const char* key,
                              const char* value) {
            json e = {{"tag", "BlockStored"},
                      {"_prompt",
                       {{"scheme", "vllm-xxhash-cbor"},
                        {"seed", "42"},
                        {"block_size", kBlock},
                        {"tokens", tokens},
                        {"first", 0},
                        {"count", 2},
                        {key, value}}},
                      {"lora_id", nullptr},
                      {"medium", "GPU"},
                      {"lora_name", nullptr}};
            if (std::string(key) == "lora_name") {
                e["lora_id"] = 1;
                e["lora_name"] = value;
            }
            return e;
        };
        ASSERT_TRUE(pb.send(batch(1, {stored_with(salted, "cache_salt", "s1"),
                                      stored_with(lora, "lora_name", "adapterA")})));
        ASSERT_TRUE(
            eventually([&] { return seq_of(1) == 1 && replicas()[1]["index_blocks"] == 5; }));
        auto matched_b = [&](json req) {
            const auto rep = http(port, "POST", "/route", req.dump());
            EXPECT_EQ(rep.status, 200) << rep.body;
            return json::parse(rep.body)["matched_blocks"]["b"].get<int>();
        };
        EXPECT_EQ(matched_b({{"token_ids", salted}, {"cache_salt", "s1"}}), 2);
        EXPECT_EQ(matched_b({{"token_ids", salted}}), 0);
        EXPECT_EQ(matched_b({{"token_ids", salted}, {"cache_salt", "s2"}}), 0);
        EXPECT_EQ(matched_b({{"token_ids", lora}, {"lora_name", "adapterA"}}), 2);
        EXPECT_EQ(
            matched_b({{"token_ids", lora}, {"lora_name", "adapterA"}, {"cache_salt", nullptr}}),
            2);
        EXPECT_EQ(matched_b({{"token_ids", lora}}), 0);
    }

    // Bad requests: 400 with a message.
    for (const std::string& bad :
         {std::string("not json"), std::string("{\"token_ids\": 5}"),
          std::string("{\"token_ids\": [1, -2]}"), std::string("{\"token_ids\": []}"),
          std::string("{\"token_ids\": [1], \"request_id\": 3}"),
          std::string("{\"token_ids\": [1], \"cache_salt\": 3}"),
          std::string("{\"token_ids\": [1], \"cache_salt\": \"\"}"),
          std::string("{\"token_ids\": [1], \"lora_name\": [\"a\"]}")}) {
        const auto rep = http(port, "POST", "/route", bad);
        EXPECT_EQ(rep.status, 400) << bad;
        EXPECT_TRUE(json::parse(rep.body).contains("error")) << rep.body;
    }
    EXPECT_EQ(json::parse(http(port, "POST", "/requests/nope/finished").body)["finished"], false);
    // A client that accepts compressed replies (curl --compressed, browsers) still gets plain
    // JSON: compressing a reply of a few dozen bytes costs more than it saves (brotli took about
    // 0.7 ms per route).
    const auto plain = http(port, "POST", "/route", R"({"token_ids": [1, 2, 3]})",
                            "Accept-Encoding: br, gzip, deflate\r\n");
    EXPECT_EQ(plain.status, 200);
    EXPECT_EQ(plain.headers.find("Content-Encoding"), std::string::npos) << plain.headers;
    EXPECT_TRUE(json::parse(plain.body).contains("replica")) << plain.body;

    EXPECT_EQ(router.terminate(), 0);
    EXPECT_NE(router.read_line().find("stopped"), std::string::npos);
}

// A keep-alive connection to 127.0.0.1:port that has sent GET /healthz and may have its reply.
class KeepAliveClient {
  public:
    explicit KeepAliveClient(int port) : fd_(socket(AF_INET, SOCK_STREAM, 0)) {
        sockaddr_in addr{};
        addr.sin_family = AF_INET;
        addr.sin_port = htons(static_cast<uint16_t>(port));
        addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) return;
        const std::string req = "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
        (void)!write(fd_, req.data(), req.size());
    }
    ~KeepAliveClient() { close(fd_); }
    // True once the reply ("ok\n") has arrived; waits up to wait_ms for more bytes.
    bool answered(int wait_ms) {
        pollfd p{fd_, POLLIN, 0};
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(wait_ms);
        while (got_.find("\r\n\r\nok\n") == std::string::npos) {
            const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                                  deadline - std::chrono::steady_clock::now())
                                  .count();
            if (left <= 0 || poll(&p, 1, static_cast<int>(left)) <= 0) return false;
            char buf[512];
            const ssize_t n = read(fd_, buf, sizeof buf);
            if (n <= 0) return false;
            got_.append(buf, static_cast<size_t>(n));
        }
        return true;
    }

  private:
    int fd_;
    std::string got_;
};

// A route service over one empty replica "a" (block size 4), for the HTTP server's own tests.
struct OneReplica {
    KvIndex index{1};
    RouteService svc{config(), [this](const auto& fn) { fn(index, nullptr); }};
    static RouteServiceConfig config() {
        RouteServiceConfig c;
        c.replica_names = {"a"};
        c.block_size = 4;
        return c;
    }
};

// RouterHttpOptions::threads is the number of keep-alive clients served at once: with 3 threads,
// 3 open connections are answered and a fourth waits until one of them closes. The default pool
// serves 9 at once (cpp-httplib's own default, 8 threads on this machine, would not).
// Gateways that connect at once must not overflow the accept queue (cpp-httplib's default backlog
// is 5; an overflowed SYN waits for the kernel's 1 s retry): the listener's queue is 4096, or
// net.core.somaxconn where that is smaller.
TEST(RouterServe, ListensWithABacklogForManyGatewaysAtOnce) {
    if (!RouterHttpServer::available()) GTEST_SKIP() << "built without cpp-httplib";
    int somaxconn = 4096;
    std::ifstream("/proc/sys/net/core/somaxconn") >> somaxconn;
    // The probe reads a backlog of 5 where 5 was asked, so it can tell the two apart.
    const int plain = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::bind(plain, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    ASSERT_EQ(::listen(plain, 5), 0);
    socklen_t al = sizeof(a);
    ::getsockname(plain, reinterpret_cast<sockaddr*>(&a), &al);
    EXPECT_EQ(listen_backlog(ntohs(a.sin_port)), 5);
    ::close(plain);

    OneReplica one;
    RouteService& svc = one.svc;
    RouterHttpServer server(svc, RouterHttpOptions{});
    std::thread serving([&] { server.run(); });
    EXPECT_EQ(listen_backlog(server.port()), std::min(4096, somaxconn));
    // A second router on the same port is refused (not let in beside the first by SO_REUSEPORT).
    RouterHttpOptions same;
    same.port = server.port();
    EXPECT_THROW(RouterHttpServer(svc, same), Error);
    server.stop();
    serving.join();
}

// A stop() that comes before run() has begun listening is not lost (cpp-httplib's own stop() does
// nothing then, and run() would serve on): run() returns, whichever thread gets there first.
TEST(RouterServe, AStopBeforeRunIsNotLost) {
    if (!RouterHttpServer::available()) GTEST_SKIP() << "built without cpp-httplib";
    OneReplica one;
    RouteService& svc = one.svc;
    {
        RouterHttpServer server(svc, RouterHttpOptions{});
        server.stop();
        server.run();  // returns at once
    }
    for (int i = 0; i < 50; ++i) {
        RouterHttpServer server(svc, RouterHttpOptions{});
        std::thread serving([&] { server.run(); });
        server.stop();  // races run(): may come before or after it begins listening
        serving.join();
    }
}

TEST(RouterServe, ServesAsManyKeepAliveClientsAsThreads) {
    if (!RouterHttpServer::available()) GTEST_SKIP() << "built without cpp-httplib";
    OneReplica one;
    RouteService& svc = one.svc;
    {
        RouterHttpOptions o;
        o.threads = 3;
        o.keep_alive_timeout_s = 600;
        RouterHttpServer server(svc, o);
        std::thread serving([&] { server.run(); });
        std::vector<std::unique_ptr<KeepAliveClient>> held;
        for (int i = 0; i < 3; ++i) {
            held.push_back(std::make_unique<KeepAliveClient>(server.port()));
            EXPECT_TRUE(held.back()->answered(20000)) << "client " << i;
        }
        auto fourth = std::make_unique<KeepAliveClient>(server.port());
        EXPECT_FALSE(fourth->answered(500)) << "a fourth client was served by 3 busy threads";
        held.pop_back();  // one connection closes: its thread takes the fourth
        EXPECT_TRUE(fourth->answered(20000));
        // Every connection closes before stop(): the server waits for an idle one to time out
        // (600 s here), so one left open would hold run() that long.
        fourth.reset();
        held.clear();
        server.stop();
        serving.join();
    }
    {
        RouterHttpServer server(svc, RouterHttpOptions{});
        std::thread serving([&] { server.run(); });
        std::vector<std::unique_ptr<KeepAliveClient>> held;
        for (int i = 0; i < 9; ++i)
            held.push_back(std::make_unique<KeepAliveClient>(server.port()));
        for (int i = 0; i < 9; ++i) EXPECT_TRUE(held[i]->answered(20000)) << "client " << i;
        held.clear();
        server.stop();
        serving.join();
    }
    RouterHttpOptions bad;
    bad.threads = 0;
    EXPECT_THROW(check_http_options(bad), Error);
    bad.threads = 1;
    bad.keep_alive_timeout_s = 0;
    EXPECT_THROW(check_http_options(bad), Error);
}

// Without --hash-seed the startup line names the seed the router hashes with: vLLM's default
// NONE_HASH seed for engines that run without PYTHONHASHSEED.
TEST(RouterServe, TheStartupLineNamesTheHashSeedInUse) {
    if (!VllmEventSubscriber::available() || !RouterHttpServer::available())
        GTEST_SKIP() << "built without libzmq or cpp-httplib";
    RouterProcess router({"router", "serve", "--listen", "127.0.0.1:0", "--engine",
                          "a=tcp://127.0.0.1:1", "--engine", "b=tcp://127.0.0.1:2,dp=2"});
    const std::string line = router.read_line();
    EXPECT_NE(line.find("(3 replicas, policy kvshard, vllm-sha256, hash seed vllm-none-hash: "
                        "vLLM's default without PYTHONHASHSEED)\n"),
              std::string::npos)
        << line;
    EXPECT_EQ(router.terminate(), 0);
}

// An engine started with an EAGLE/MTP --speculative-config pops the last block of each prefix
// hit (vllm/v1/core/single_type_kv_cache_manager.py, find_longest_cache_hit, drop_eagle_block;
// SpeculativeConfig.use_eagle() in vllm/config/speculative.py): spec= says so per engine.
TEST(RouterServe, AnEagleEngineIsCreditedOneBlockLess) {
    if (!VllmEventSubscriber::available() || !RouterHttpServer::available())
        GTEST_SKIP() << "built without libzmq or cpp-httplib";
    test::PythonPublisher pa, pb;
    ASSERT_TRUE(pa.ok() && pb.ok());
    RouterProcess router({"router", "serve", "--listen", "127.0.0.1:0", "--engine",
                          "a=" + pa.endpoint() + ",spec=eagle3", "--engine", "b=" + pb.endpoint(),
                          "--policy", "cache-aware", "--block-size", std::to_string(kBlock),
                          "--hash", "vllm-xxhash-cbor", "--hash-seed", "42"});
    const std::string line = router.read_line();
    const size_t at = line.find("http://127.0.0.1:");
    ASSERT_NE(at, std::string::npos) << line;
    const int port = std::atoi(line.c_str() + at + 17);
    ASSERT_TRUE(pa.wait_subscribed());
    ASSERT_TRUE(pb.wait_subscribed());
    auto replicas = [&] { return json::parse(http(port, "GET", "/replicas").body)["replicas"]; };
    // Both hold all 8 full blocks of the 34-token prompt (cap: 33 / 4 = 8 blocks).
    ASSERT_TRUE(pa.send(batch(0, {stored(0, 8)})));
    ASSERT_TRUE(pb.send(batch(0, {stored(0, 8)})));
    ASSERT_TRUE(eventually(
        [&] { return replicas()[0]["last_seq"] == 0 && replicas()[1]["last_seq"] == 0; }));
    const auto rep = http(port, "POST", "/route", json{{"token_ids", prompt()}}.dump());
    ASSERT_EQ(rep.status, 200) << rep.body;
    const auto j = json::parse(rep.body);
    EXPECT_EQ(j["matched_blocks"]["a"], 7);
    EXPECT_EQ(j["matched_blocks"]["b"], 8);
    EXPECT_EQ(j["replica"], "b");
    EXPECT_EQ(router.terminate(), 0);
}

TEST(RouterServe, ExpandsEnginesIntoUniquelyNamedReplicas) {
    const std::vector<VllmEngineSpec> two = {
        parse_vllm_engine_spec("a=tcp://h:10,dp=2,replay=tcp://h:20"),
        parse_vllm_engine_spec("b=ipc:///tmp/b")};
    const VllmReplicaFeeds f = expand_vllm_engines(two);
    EXPECT_EQ(f.names, (std::vector<std::string>{"a/dp0", "a/dp1", "b"}));
    ASSERT_EQ(f.endpoints.size(), 3u);
    EXPECT_EQ(f.endpoints[1].replica, 1);
    EXPECT_EQ(f.endpoints[1].endpoint, "tcp://h:11");
    EXPECT_EQ(f.endpoints[1].replay_endpoint, "tcp://h:21");
    EXPECT_EQ(f.endpoints[2].replay_endpoint, "");
    EXPECT_EQ(f.eagle_block_drop, (std::vector<bool>{false, false, false}));
    // spec= applies to every DP rank of its engine.
    const std::vector<VllmEngineSpec> spec = {parse_vllm_engine_spec("a=tcp://h:10,spec=mtp,dp=2"),
                                              parse_vllm_engine_spec("b=tcp://h:30,spec=ngram"),
                                              parse_vllm_engine_spec("c=tcp://h:40,spec=eagle")};
    EXPECT_EQ(spec[0].speculative_method, "mtp");
    const VllmReplicaFeeds fs = expand_vllm_engines(spec);
    EXPECT_EQ(fs.eagle_block_drop, (std::vector<bool>{true, true, false, true}));
    KvIndex index(4);
    configure_vllm_index(index, fs);
    EXPECT_TRUE(index.eagle_block_drop(1));
    EXPECT_FALSE(index.eagle_block_drop(2));
    KvIndex wrong(3);
    EXPECT_THROW(configure_vllm_index(wrong, fs), Error);
    auto refused = [](std::vector<std::string> texts) {
        std::vector<VllmEngineSpec> e;
        for (const auto& t : texts) e.push_back(parse_vllm_engine_spec(t));
        try {
            expand_vllm_engines(e);
        } catch (const Error& err) {
            return std::string(err.what());
        }
        return std::string();
    };
    EXPECT_NE(refused({"a=tcp://h:10", "a=tcp://h:11"}).find("replica name 'a' is given twice"),
              std::string::npos);
    EXPECT_NE(refused({"a=tcp://h:10", "b=tcp://h:10"}).find("which another replica uses"),
              std::string::npos);
    // dp=2 on port 10 takes 10 and 11: an engine on 11 would read rank 1's events.
    EXPECT_NE(refused({"a=tcp://h:10,dp=2", "b=tcp://h:11"}).find("which another replica uses"),
              std::string::npos);
    EXPECT_NE(refused({"a=tcp://h:10,replay=tcp://h:10"}).find("which another replica uses"),
              std::string::npos);
    EXPECT_NE(refused({"a=tcp://h:10,dp=64", "b=tcp://h:100"}).find("at most 64 replicas"),
              std::string::npos);
    EXPECT_NE(refused({}).find("at least one engine"), std::string::npos);
    EXPECT_EQ(refused({"a=tcp://h:10,dp=64"}), "");
}

TEST(RouterServe, RefusesBadFlags) {
    struct Bad {
        std::string args, message;
    };
    const std::vector<Bad> bad = {
        {"router serve --engine a=tcp://127.0.0.1:1 --hash-seed 0 --listen 0.0.0.0:0",
         "--allow-remote"},
        {"router serve --engine a --hash-seed 0", "NAME=tcp://HOST:PORT"},
        {"router serve --engine a=udp://x:1 --hash-seed 0", "is not tcp://HOST:PORT or ipc://PATH"},
        {"router serve --engine a=inproc://kv --hash-seed 0", "is inproc://"},
        {"router serve --engine a=ipc:// --hash-seed 0", "has no path"},
        {"router serve --engine a=ipc:///tmp/kv,dp=2 --hash-seed 0", "needs tcp:// endpoints"},
        {"router serve --engine a=tcp://127.0.0.1:1,dp=2,replay=ipc:///tmp/r --hash-seed 0",
         "needs tcp:// endpoints"},
        {"router serve --engine a=tcp://127.0.0.1:1,dp=0 --hash-seed 0", "dp must be 1 to 64"},
        {"router serve --engine a=tcp://127.0.0.1:1,zz=1 --hash-seed 0", "unknown option"},
        {"router serve --engine a=tcp://127.0.0.1:1 --hash-seed 0 --hash md5", "vllm-sha256-cbor"},
        {"router serve --engine a=tcp://127.0.0.1:1 --hash-seed 0 --listen nope", "HOST:PORT"},
        // std::stoi read ' 80' and '+80' as 80 (the router then listened on port 80).
        {"router serve --engine a=tcp://127.0.0.1:1 --hash-seed 0 --listen '127.0.0.1: 80'",
         "the port is not a number in [0, 65535]"},
        {"router serve --engine a=tcp://127.0.0.1:1 --hash-seed 0 --listen 127.0.0.1:+80",
         "the port is not a number in [0, 65535]"},
        {"router serve --engine a=tcp://127.0.0.1:1 --hash-seed 0 --http-threads 0",
         "--http-threads must be 1 to 4096"},
        {"router serve --engine a=tcp://127.0.0.1:1 --hash-seed 0 --keep-alive-timeout-s 0",
         "--keep-alive-timeout-s must be 1 to 3600"},
        {"router serve --engine a=tcp://127.0.0.1:1 --engine a=tcp://127.0.0.1:2",
         "replica name 'a' is given twice"},
        {"router serve --engine a=tcp://127.0.0.1:1 --engine b=tcp://127.0.0.1:1",
         "which another replica uses"},
        {"router serve --engine a=tcp://:5557", "has no host"},
        {"router serve --engine a=tcp://*:5557", "wildcard host"},
        {"router serve --engine a=tcp://0.0.0.0:5557", "wildcard host"},
        {"router serve --engine a=tcp://127.0.0.1:70000", "a port of 1 to 65535"},
        {"router serve --engine a=tcp://127.0.0.1:0", "a port of 1 to 65535"},
        {"router serve --engine a=tcp://127.0.0.1:-1", "a port of 1 to 65535"},
        {"router serve --engine a=tcp://127.0.0.1:99999999999", "a port of 1 to 65535"},
        {"router serve --engine a=tcp://127.0.0.1:65535,dp=2", "is over 65535"},
        {"router serve --engine 'a\"b=tcp://127.0.0.1:1'", "may hold only letters"},
        {"router serve --engine a/dp0=tcp://127.0.0.1:1", "may hold only letters"},
        {"router serve --engine =tcp://127.0.0.1:1", "NAME=tcp://HOST:PORT"},
        {"router serve --engine a=tcp://127.0.0.1:1 --listen 127.0.0.1:70000",
         "the listen port must be 0 to 65535"},
        {"router serve --engine a=tcp://127.0.0.1:1 --listen 127.0.0.1:99999999999",
         "the port is not a number in [0, 65535]"},
        {"router serve --engine a=tcp://127.0.0.1:1 --listen :8000", "expected HOST:PORT"},
        {"router serve --engine a=tcp://127.0.0.1:1 --listen []:8000", "expected HOST:PORT"},
        {"router serve --engine a=tcp://127.0.0.1:1 --index-cap-blocks 0",
         "--index-cap-blocks must be 1 to 268435456"},
        {"router serve --engine a=tcp://127.0.0.1:1 --index-cap-blocks 1000000000000000000",
         "--index-cap-blocks must be 1 to 268435456"},
        {"router serve --engine a=tcp://127.0.0.1:1 --block-size 0", "--block-size must be 1"},
        {"router serve --engine a=tcp://127.0.0.1:1 --block-size -16", "--block-size must be 1"},
        {"router serve --engine a=tcp://127.0.0.1:1 --hash-seed -1", "is not a PYTHONHASHSEED"},
        {"router serve --engine a=tcp://127.0.0.1:1 --hash vllm-xxhash", "PYTHONHASHSEED"},
        {"router serve --engine a=tcp://127.0.0.1:1 --hash-seed ''", "--hash-seed is empty"},
        {"router serve --engine a=tcp://127.0.0.1:1 --replay-timeout-ms 0",
         "--replay-timeout-ms must be 1 to 600000"},
        {"router serve --engine a=tcp://127.0.0.1:5557,spec=eagle-3",
         "--engine a: unknown speculative method 'eagle-3': expected vLLM's --speculative-config "
         "method: eagle, eagle3 or mtp"},
        {"router serve --engine a=tcp://127.0.0.1:5557,specs=eagle",
         "unknown option 'specs=eagle'; expected dp=K, replay=tcp://HOST:PORT or spec=METHOD"},
    };
    for (const auto& b : bad) {
        const auto r = test::run_cli(b.args);
        EXPECT_EQ(r.status, 2) << b.args << "\n" << r.out;
        EXPECT_NE(r.out.find(b.message), std::string::npos) << b.args << "\n" << r.out;
    }
    EXPECT_EQ(offset_endpoint_port("tcp://127.0.0.1:5557", 2), "tcp://127.0.0.1:5559");
    EXPECT_EQ(parse_vllm_engine_spec("e=tcp://h:10,dp=3,replay=tcp://h:20").dp, 3);
    const auto ipc = parse_vllm_engine_spec("e=ipc:///tmp/kv.pub,replay=ipc:///tmp/kv.replay");
    EXPECT_EQ(ipc.endpoint, "ipc:///tmp/kv.pub");
    EXPECT_EQ(ipc.replay_endpoint, "ipc:///tmp/kv.replay");
    EXPECT_EQ(offset_endpoint_port("ipc:///tmp/kv", 0), "ipc:///tmp/kv");
    EXPECT_THROW(offset_endpoint_port("ipc:///tmp/kv", 1), Error);
}

}  // namespace
}  // namespace kvshard
