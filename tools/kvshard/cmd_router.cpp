// kvshard router serve: the KV-aware router as a service (HTTP JSON API), fed by vLLM engines' KV
// event streams.
#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>

#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "command.h"
#include "kvshard/common/error.h"
#include "kvshard/router/http_server.h"
#include "kvshard/router/route_service.h"
#include "kvshard/router/vllm_event_subscriber.h"

namespace kvshard::cli {
namespace {

struct ServeFlags {
    std::string listen = "127.0.0.1:8000";
    std::vector<std::string> engines;
    std::string policy = "kvshard";
    int block_size = 16;
    std::string hash = "vllm-sha256";  // vLLM's default --prefix-caching-hash-algo
    std::string hash_seed;
    bool allow_remote = false;
    int replay_timeout_ms = 1000;
    int64_t index_cap_blocks = VllmEventIngest::kDefaultMaxBlocksPerReplica;
    int http_threads = RouterHttpOptions{}.threads;
    int keep_alive_timeout_s = RouterHttpOptions{}.keep_alive_timeout_s;
};

int g_stop_pipe_write = -1;

extern "C" void on_stop_signal(int) {
    const char c = 1;
    (void)!write(g_stop_pipe_write, &c, 1);
}

RouterHttpOptions listen_options(const ServeFlags& f) {
    const size_t colon = f.listen.rfind(':');
    require(colon != std::string::npos && colon > 0 && colon + 1 < f.listen.size(), "--listen '",
            f.listen, "': expected HOST:PORT, e.g. 127.0.0.1:8000");
    RouterHttpOptions o;
    o.host = f.listen.substr(0, colon);
    if (o.host.front() == '[' || o.host.back() == ']') {
        require(o.host.size() > 2 && o.host.front() == '[' && o.host.back() == ']', "--listen '",
                f.listen, "': expected HOST:PORT, e.g. 127.0.0.1:8000 or [::1]:8000");
        o.host = o.host.substr(1, o.host.size() - 2);
    }
    // Digits only: std::stoi took ' 80' and '+80' as port 80.
    const std::string port = f.listen.substr(colon + 1);
    const auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), o.port);
    require(ec == std::errc() && end == port.data() + port.size() &&
                port.find_first_not_of("0123456789") == std::string::npos,
            "--listen '", f.listen,
            "': the port is not a number in [0, 65535], e.g. 127.0.0.1:8000");
    o.allow_remote = f.allow_remote;
    o.threads = f.http_threads;
    o.keep_alive_timeout_s = f.keep_alive_timeout_s;
    check_http_options(o);
    return o;
}

void serve(const ServeFlags& f) {
    require(f.replay_timeout_ms >= 1 && f.replay_timeout_ms <= 600000,
            "--replay-timeout-ms must be 1 to 600000, got ", f.replay_timeout_ms);
    require(f.index_cap_blocks >= 1 && f.index_cap_blocks <= VllmEventIngest::kMaxBlocksPerReplica,
            "--index-cap-blocks must be 1 to ", VllmEventIngest::kMaxBlocksPerReplica,
            " blocks per replica, got ", f.index_cap_blocks);
    RouteServiceConfig cfg;
    cfg.policy = parse_routing_policy(f.policy);
    cfg.scheme = parse_vllm_hash_scheme(f.hash);
    cfg.hash_seed = f.hash_seed;
    cfg.block_size = f.block_size;
    std::vector<VllmEngineSpec> engines;
    for (const auto& text : f.engines) engines.push_back(parse_vllm_engine_spec(text));
    VllmReplicaFeeds feeds = expand_vllm_engines(engines);
    cfg.replica_names = std::move(feeds.names);
    const RouterHttpOptions http_options = listen_options(f);

    // Every flag is checked (the service's constructor checks the rest) before a socket opens.
    KvIndex index(static_cast<int>(cfg.replica_names.size()));
    configure_vllm_index(index, feeds);
    std::unique_ptr<VllmEventSubscriber> subscriber;
    RouteService service(cfg, [&subscriber](const auto& fn) {
        subscriber->with_index(
            [&fn](const KvIndex& idx, const VllmEventIngest& ingest) { fn(idx, &ingest); });
    });
    VllmSubscriberOptions sub_options;
    sub_options.replay_timeout_ms = f.replay_timeout_ms;
    sub_options.max_blocks_per_replica = f.index_cap_blocks;
    sub_options.block_size = cfg.block_size;

    // SIGTERM / SIGINT: the handler only writes a byte to a pipe (async-signal-safe; any thread
    // may run it, libraries start threads of their own before main); a watcher thread reads it
    // and stops the server.
    int fds[2];
    require(pipe(fds) == 0, "cannot create the signal pipe");
    g_stop_pipe_write = fds[1];
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, nullptr);
    sigaction(SIGINT, &sa, nullptr);

    subscriber = std::make_unique<VllmEventSubscriber>(index, feeds.endpoints, sub_options);
    RouterHttpServer http(service, http_options);
    std::thread waiter([&] {
        char c = 0;
        while (read(fds[0], &c, 1) < 0 && errno == EINTR) {
        }
        http.stop();
    });
    fmt::print(
        "kvshard router: listening on http://{}:{} ({} replicas, policy {}, {}, hash seed {}{})\n",
        http_options.host, http.port(), cfg.replica_names.size(), routing_policy_name(cfg.policy),
        vllm_hash_scheme_name(cfg.scheme), service.engine_hash_seed(),
        cfg.hash_seed.empty() ? ": vLLM's default without PYTHONHASHSEED" : "");
    std::fflush(stdout);
    http.run();
    subscriber->stop();
    const char wake = 0;
    (void)!write(fds[1], &wake, 1);  // the waiter, if run() ended for another reason
    waiter.join();
    fmt::print("kvshard router: stopped\n");
    std::fflush(stdout);
}

void setup(CLI::App& app) {
    auto f = std::make_shared<ServeFlags>();
    auto* router = app.add_subcommand("router", "The KV-aware router as a service");
    router->require_subcommand(1);
    auto* sub = router->add_subcommand(
        "serve",
        "Route requests by the prefixes vLLM engines report in their KV events (HTTP API)");
    sub->add_option("--listen", f->listen, "HOST:PORT to serve HTTP on (loopback by default)");
    sub->add_option("--engine", f->engines,
                    "NAME=tcp://HOST:PORT[,dp=K,replay=tcp://HOST:PORT,spec=METHOD]: an "
                    "engine's KV event publisher, tcp:// or ipc://PATH (repeat per engine); "
                    "spec= its --speculative-config method (eagle, eagle3, mtp: vLLM drops the "
                    "last block of each prefix-cache hit)")
        ->required();
    sub->add_option("--policy", f->policy,
                    "round-robin | least-loaded | cache-aware | cost | kvshard");
    sub->add_option("--block-size", f->block_size, "the engines' block size in tokens");
    sub->add_option("--hash", f->hash,
                    "vllm-sha256 | vllm-sha256-cbor | vllm-xxhash | vllm-xxhash-cbor | "
                    "vllm-sha256-cbor-64bit (the engines' --prefix-caching-hash-algo, with vllm- "
                    "before it)");
    auto* seed = sub->add_option(
        "--hash-seed", f->hash_seed,
        "the engines' PYTHONHASHSEED (\"random\" or 0..4294967295); leave it out when "
        "they run without one: vLLM's default seed \"vllm-none-hash\" for the sha256 "
        "schemes (the xxhash ones need it)");
    sub->add_flag("--allow-remote", f->allow_remote, "allow --listen on a non-loopback address");
    sub->add_option("--replay-timeout-ms", f->replay_timeout_ms,
                    "how long to wait for an engine's replay after a gap");
    sub->add_option("--index-cap-blocks", f->index_cap_blocks,
                    "blocks the index keeps per replica; past it the oldest are dropped");
    sub->add_option("--http-threads", f->http_threads,
                    "connections served at once (a keep-alive client holds one until it closes "
                    "or idles past --keep-alive-timeout-s)");
    sub->add_option("--keep-alive-timeout-s", f->keep_alive_timeout_s,
                    "seconds an idle keep-alive connection is kept open");
    sub->callback([f, seed] {
        // An empty seed would be taken as the flag left out.
        require(seed->count() == 0 || !f->hash_seed.empty(),
                "--hash-seed is empty; give the engines' PYTHONHASHSEED or leave the flag out "
                "(vLLM's default seed \"vllm-none-hash\")");
        serve(*f);
    });
}

KVSHARD_COMMAND("router", setup);

}  // namespace
}  // namespace kvshard::cli
