// bench_router_service: the running router's two rates on loopback, each next to its ceiling in the
// same run (BENCHMARKS.md, "Router service").
//  1. Events: a ZMQ PUB sends N vLLM EventBatches (one BlockStored of 4 blocks each).
//     raw     = a bare SUB that receives and msgpack-decodes every message;
//     service = VllmEventSubscriber (receive, decode, sequence checks, KvIndex updates).
//  2. Routes: R prompts of 64 blocks against an index of 8 replicas.
//     raw     = hashing the prompt (vLLM sha256_cbor) + KvIndex::prefix_overlap, in process;
//     service = POST /route over HTTP/1.1 keep-alive to RouterHttpServer (p50 / p99 latency);
//     http    = the HTTP ceiling: the same bodies POSTed to a no-op handler of a cpp-httplib
//               server set up as RouterHttpServer is (configure_http_server: its thread pool,
//               accept queue, keep-alive and socket options), answering a
//               fixed reply of a route reply's size. A route over HTTP costs at least
//               raw + http per request: "serial ceiling" = 1 / (1 / raw + 1 / http).
//     tcp     = the transport's ceiling: a bare TCP round trip on loopback (TCP_NODELAY, one
//               connection, blocking send/recv) of a request's and a reply's bytes as they go
//               on the wire (headers included), no HTTP at all; no server answers one
//               connection faster.
//               Also over 2, 4 and 8 connections at once: what any number of clients could get
//               through the loopback in total.
//     parallel = POST /route from 2, 4 and 8 keep-alive clients at once, routes/s in total.
// Each measurement runs `rounds` times, raw and service back to back (their order alternating
// from round to round); reported: the median rate of each and the median of the rounds' ratios
// (the machine is shared: the ratio of two neighbouring runs is steadier than either rate).
// Usage: bench_router_service [events N] [routes R] [rounds K]
#include <httplib.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "kvshard/cache/vllm_hash.h"
#include "kvshard/cache/vllm_kv_events.h"
#include "kvshard/router/http_server.h"
#include "kvshard/router/route_service.h"
#include "kvshard/router/vllm_event_subscriber.h"
#include "router/http_setup.h"

using namespace kvshard;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::vector<std::vector<uint8_t>> make_payloads(int n) {
    std::mt19937_64 rng(1);
    std::vector<std::vector<uint8_t>> out;
    for (int i = 0; i < n; ++i) {
        VllmKvEvent e;
        e.kind = VllmEventKind::kBlockStored;
        for (int b = 0; b < 4; ++b) e.block_hashes.push_back(rng());
        e.parent_block_hash = rng();
        e.token_ids.assign(64, 1000 + i % 1000);
        e.block_size = 16;
        e.medium = "GPU";
        out.push_back(encode_vllm_event_batch(VllmEventBatch{1.0 * i, {e}, 0}));
    }
    return out;
}

// Sends every payload on a fresh PUB bound to loopback once `ready` says a subscriber is there.
void publish_all(zmq::socket_t& pub, const std::vector<std::vector<uint8_t>>& payloads) {
    for (size_t i = 0; i < payloads.size(); ++i) {
        const auto s = encode_vllm_seq(i);
        std::array<zmq::const_buffer, 3> msg = {zmq::const_buffer(nullptr, 0), zmq::buffer(s),
                                                zmq::buffer(payloads[i])};
        zmq::send_multipart(pub, msg);
    }
}

// Sends probes (not counted) until the subscriber has joined: a PUB drops what it sends before.
zmq::socket_t bound_pub(zmq::context_t& ctx, std::string& endpoint) {
    zmq::socket_t pub(ctx, zmq::socket_type::xpub);
    pub.set(zmq::sockopt::sndhwm, 0);
    pub.bind("tcp://127.0.0.1:0");
    endpoint = pub.get(zmq::sockopt::last_endpoint);
    return pub;
}

void wait_subscribed(zmq::socket_t& pub) {
    zmq::message_t m;
    (void)pub.recv(m);
}

// The subscriber has a context (an I/O thread) of its own, as VllmEventSubscriber has and as a
// router in another process than the engine's publisher would (sharing_context: the publisher's).
double raw_events_per_s(const std::vector<std::vector<uint8_t>>& payloads,
                        bool sharing_context = false) {
    zmq::context_t ctx(1), sub_ctx(1);
    std::string ep;
    auto pub = bound_pub(ctx, ep);
    zmq::socket_t sub(sharing_context ? ctx : sub_ctx, zmq::socket_type::sub);
    sub.set(zmq::sockopt::rcvhwm, 0);
    sub.set(zmq::sockopt::subscribe, "");
    sub.connect(ep);
    wait_subscribed(pub);
    const auto t0 = Clock::now();
    std::thread sender([&] { publish_all(pub, payloads); });
    size_t got = 0, events = 0;
    while (got < payloads.size()) {
        std::vector<zmq::message_t> parts;
        if (!zmq::recv_multipart(sub, std::back_inserter(parts))) continue;
        const auto r = decode_vllm_event_batch(
            {static_cast<const uint8_t*>(parts[2].data()), parts[2].size()});
        if (r.batch) events += r.batch->events.size();
        ++got;
    }
    const double dt = seconds_since(t0);
    sender.join();
    return static_cast<double>(events) / dt;
}

double service_events_per_s(const std::vector<std::vector<uint8_t>>& payloads) {
    zmq::context_t ctx(1);
    std::string ep;
    auto pub = bound_pub(ctx, ep);
    KvIndex index(1);
    VllmSubscriberOptions opt;
    opt.receive_hwm = 0;
    VllmEventSubscriber sub(index, {{0, ep, "", ""}}, opt);
    wait_subscribed(pub);
    const auto t0 = Clock::now();
    publish_all(pub, payloads);
    while (sub.status(0).batches < static_cast<int64_t>(payloads.size())) {
        if (seconds_since(t0) > 60) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));  // not contending for its lock
    }
    const double dt = seconds_since(t0);
    const auto st = sub.status(0);
    if (st.batches != static_cast<int64_t>(payloads.size()) || st.gaps || st.malformed)
        std::printf("  (service: %lld batches, %lld gaps, %lld malformed)\n",
                    static_cast<long long>(st.batches), static_cast<long long>(st.gaps),
                    static_cast<long long>(st.malformed));
    return static_cast<double>(st.events) / dt;
}

double percentile(std::vector<double> v, double p) {
    std::sort(v.begin(), v.end());
    return v[static_cast<size_t>(p * static_cast<double>(v.size() - 1))];
}

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

struct HttpRun {
    double per_s = 0;
    std::vector<double> latency_s;
    int errors = 0;
};

HttpRun post_all(int port, const std::string& path, const std::vector<std::string>& bodies, int n) {
    httplib::Client client("127.0.0.1", port);
    client.set_keep_alive(true);
    client.set_tcp_nodelay(true);
    HttpRun run;
    run.latency_s.reserve(static_cast<size_t>(n));
    const auto t0 = Clock::now();
    for (int i = 0; i < n; ++i) {
        const auto a = Clock::now();
        auto res = client.Post(path.c_str(), bodies[static_cast<size_t>(i) % bodies.size()],
                               "application/json");
        run.latency_s.push_back(seconds_since(a));
        if (!res || res->status != 200) ++run.errors;
    }
    run.per_s = n / seconds_since(t0);
    return run;
}

// Sends all of buf / receives exactly buf.size() bytes on a blocking socket.
bool send_all(int fd, const std::string& buf) {
    for (size_t at = 0; at < buf.size();) {
        const ssize_t k = ::send(fd, buf.data() + at, buf.size() - at, MSG_NOSIGNAL);
        if (k <= 0) return false;
        at += static_cast<size_t>(k);
    }
    return true;
}
bool recv_all(int fd, std::string& buf) {
    for (size_t at = 0; at < buf.size();) {
        const ssize_t k = ::recv(fd, buf.data() + at, buf.size() - at, 0);
        if (k <= 0) return false;
        at += static_cast<size_t>(k);
    }
    return true;
}

// The bare TCP round trip: n requests of request_bytes answered by reply_bytes, one connection.
double tcp_round_trips_per_s(size_t request_bytes, size_t reply_bytes, int n) {
    const int one = 1;
    const int lfd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    if (lfd < 0 || ::bind(lfd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::listen(lfd, 1) != 0 || ::getsockname(lfd, reinterpret_cast<sockaddr*>(&addr), &len) != 0)
        return 0;
    std::thread server([&] {
        const int fd = ::accept(lfd, nullptr, nullptr);
        if (fd < 0) return;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        std::string req(request_bytes, '\0'), rep(reply_bytes, 'r');
        for (int i = 0; i < n && recv_all(fd, req) && send_all(fd, rep); ++i) {
        }
        ::close(fd);
    });
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    double per_s = 0;
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
        std::string req(request_bytes, 'q'), rep(reply_bytes, '\0');
        const auto t0 = Clock::now();
        int done = 0;
        for (; done < n && send_all(fd, req) && recv_all(fd, rep); ++done) {
        }
        per_s = done == n ? n / seconds_since(t0) : 0;
    }
    ::close(fd);
    server.join();
    ::close(lfd);
    return per_s;
}

// Runs job(0) .. job(k - 1) on k threads at once; returns the wall time until the last ends.
template <typename Job>
double seconds_at_once(int k, Job job) {
    std::vector<std::thread> threads;
    const auto t0 = Clock::now();
    for (int c = 0; c < k; ++c) threads.emplace_back([&job, c] { job(c); });
    for (auto& t : threads) t.join();
    return seconds_since(t0);
}

// CPU seconds (user + system) of the process (RUSAGE_SELF) or of the calling thread.
double cpu_seconds(int who) {
    rusage u{};
    getrusage(who, &u);
    return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
           1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

struct ParallelRun {
    double per_s = 0;
    // The server's CPU per route: the process's CPU time less the client threads' own, over the
    // routes (pool threads, the kernel's work on their sockets; nothing else runs meanwhile).
    double server_cpu_s_per_route = 0;
};

// POST /route from `clients` keep-alive clients at once (a thread each), n requests in all.
ParallelRun post_parallel(int port, const char* path, const std::vector<std::string>& bodies, int n,
                          int clients, int& errors) {
    std::vector<HttpRun> runs(static_cast<size_t>(clients));
    std::vector<double> client_cpu(static_cast<size_t>(clients), 0);
    const double self0 = cpu_seconds(RUSAGE_SELF);
    const double dt = seconds_at_once(clients, [&](int c) {
        const double t0 = cpu_seconds(RUSAGE_THREAD);
        runs[static_cast<size_t>(c)] = post_all(port, path, bodies, n / clients);
        client_cpu[static_cast<size_t>(c)] = cpu_seconds(RUSAGE_THREAD) - t0;
    });
    double server_cpu = cpu_seconds(RUSAGE_SELF) - self0;
    for (double c : client_cpu) server_cpu -= c;
    for (const HttpRun& r : runs) errors += r.errors;
    const int done = (n / clients) * clients;
    return {done / dt, server_cpu / done};
}

// The same round trips over `conns` connections at once (a thread and a server thread each):
// what any number of keep-alive clients could get through the loopback in total.
double tcp_parallel_round_trips_per_s(size_t request_bytes, size_t reply_bytes, int n, int conns) {
    std::vector<double> rates(static_cast<size_t>(conns), 0);
    const double dt = seconds_at_once(conns, [&](int c) {
        rates[static_cast<size_t>(c)] =
            tcp_round_trips_per_s(request_bytes, reply_bytes, n / conns);
    });
    for (double r : rates)
        if (r <= 0) return 0;
    return (n / conns) * conns / dt;
}

}  // namespace

int main(int argc, char** argv) {
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
    const int n_events = argc > 1 ? std::atoi(argv[1]) : 50000;
    const int n_routes = argc > 2 ? std::atoi(argv[2]) : 5000;
    const int rounds = argc > 3 ? std::max(1, std::atoi(argv[3])) : 3;
    const auto payloads = make_payloads(n_events);
    std::printf("events: %d batches of 1 BlockStored (4 blocks), loopback ZMQ, %d rounds\n",
                n_events, rounds);
    std::vector<double> raw_ev, shared_ev, svc_ev, ratio_ev, ratio_shared;
    for (int k = 0; k < rounds; ++k) {
        if (k % 2 == 0) {
            raw_ev.push_back(raw_events_per_s(payloads));
            shared_ev.push_back(raw_events_per_s(payloads, true));
            svc_ev.push_back(service_events_per_s(payloads));
        } else {
            svc_ev.push_back(service_events_per_s(payloads));
            shared_ev.push_back(raw_events_per_s(payloads, true));
            raw_ev.push_back(raw_events_per_s(payloads));
        }
        ratio_ev.push_back(svc_ev.back() / raw_ev.back());
        ratio_shared.push_back(svc_ev.back() / shared_ev.back());
        std::printf(
            "  round %d: raw %.0f (sharing the publisher's context %.0f), service %.0f events/s "
            "(%.2f; %.2f)\n",
            k + 1, raw_ev.back(), shared_ev.back(), svc_ev.back(), ratio_ev.back(),
            ratio_shared.back());
    }
    std::printf("  raw receive + decode   %10.0f events/s   (own ZMQ context, as the service)\n",
                median(raw_ev));
    std::printf("  the same, sharing the publisher's context %10.0f events/s\n", median(shared_ev));
    std::printf(
        "  VllmEventSubscriber    %10.0f events/s   (median of the rounds' ratios: %.2f of raw; "
        "%.2f of the shared-context figure)\n",
        median(svc_ev), median(ratio_ev), median(ratio_shared));

    // Routes: 8 replicas, replica r holds the first 8 * r blocks of every prompt.
    constexpr int kReplicas = 8, kBlocks = 64, kBs = 16, kPrompts = 64;
    KvIndex index(kReplicas);
    VllmBlockHasher hasher(VllmHashScheme::kSha256Cbor);
    const auto root = vllm_none_hash(VllmHashScheme::kSha256Cbor, "0");
    std::vector<std::vector<int32_t>> prompts(kPrompts);
    for (int p = 0; p < kPrompts; ++p) {
        for (int t = 0; t < kBlocks * kBs; ++t) prompts[p].push_back(p * 100000 + t);
        const auto keys = vllm_prompt_keys(hasher, root, prompts[p], kBs);
        for (int r = 0; r < kReplicas; ++r)
            index.block_stored(r, std::span<const BlockHash>(keys.data(), 8 * r));
    }
    auto raw_routes_per_s = [&] {
        std::vector<int> overlap(kReplicas);
        const auto t0 = Clock::now();
        for (int i = 0; i < n_routes; ++i) {
            const auto keys = vllm_prompt_keys(hasher, root, prompts[i % kPrompts], kBs);
            index.prefix_overlap(keys, overlap);
        }
        return n_routes / seconds_since(t0);
    };

    RouteServiceConfig cfg;
    cfg.scheme = VllmHashScheme::kSha256Cbor;  // the scheme BENCHMARKS.md's router figures used
    for (int r = 0; r < kReplicas; ++r) cfg.replica_names.push_back("r" + std::to_string(r));
    cfg.block_size = kBs;
    RouteService svc(cfg, [&index](const auto& fn) { fn(index, nullptr); });
    RouterHttpServer http(svc, {});
    std::thread server([&] { http.run(); });
    std::vector<std::string> bodies;
    for (const auto& p : prompts)
        bodies.push_back(nlohmann::json{{"token_ids", p}, {"request_id", ""}}.dump());

    // The HTTP ceiling: the same library and settings, a handler that does nothing.
    // The probe's connection closes here: a keep-alive connection holds a server thread.
    const std::string fixed_reply = [&] {
        httplib::Client probe("127.0.0.1", http.port());
        const auto sample = probe.Post("/route", bodies[0], "application/json");
        return std::string(sample ? sample->body.size() : 200, ' ');
    }();
    httplib::Server noop;
    int noop_listen_fd = -1;
    configure_http_server(noop, RouterHttpOptions{}, &noop_listen_fd);
    noop.Post("/noop", [&fixed_reply](const httplib::Request&, httplib::Response& res) {
        res.set_content(fixed_reply, "application/json; charset=utf-8");
    });
    const int noop_port = bind_http_server(noop, RouterHttpOptions{}, &noop_listen_fd);
    std::thread noop_thread([&] { noop.listen_after_bind(); });

    // The bytes of a request and a reply as they go on the wire: cpp-httplib's client request
    // line and headers (Host, Accept, User-Agent, Connection, Content-Type, Content-Length)
    // are about 150 bytes, a reply's status line and headers about 130.
    size_t body_bytes = 0;
    for (const auto& b : bodies) body_bytes += b.size();
    const size_t request_bytes = body_bytes / bodies.size() + 150,
                 reply_bytes = fixed_reply.size() + 130;

    std::vector<double> raw_rt, svc_rt, http_rt, tcp_rt, p50, p99, of_raw, of_http, of_serial,
        of_tcp;
    int errors = 0;
    for (int k = 0; k < rounds; ++k) {
        HttpRun s, e;
        double raw = 0;
        if (k % 2 == 0) {
            raw = raw_routes_per_s();
            s = post_all(http.port(), "/route", bodies, n_routes);
            e = post_all(noop_port, "/noop", bodies, n_routes);
        } else {
            e = post_all(noop_port, "/noop", bodies, n_routes);
            s = post_all(http.port(), "/route", bodies, n_routes);
            raw = raw_routes_per_s();
        }
        tcp_rt.push_back(tcp_round_trips_per_s(request_bytes, reply_bytes, n_routes));
        raw_rt.push_back(raw);
        svc_rt.push_back(s.per_s);
        http_rt.push_back(e.per_s);
        of_raw.push_back(s.per_s / raw);
        of_http.push_back(s.per_s / e.per_s);
        of_serial.push_back(s.per_s * (1.0 / raw + 1.0 / e.per_s));
        of_tcp.push_back(tcp_rt.back() / raw);
        p50.push_back(percentile(s.latency_s, 0.5));
        p99.push_back(percentile(s.latency_s, 0.99));
        errors += s.errors + e.errors;
        std::printf(
            "  round %d: raw %.0f, service %.0f, http no-op %.0f, tcp %.0f routes/s (%.2f / %.2f / "
            "%.2f; tcp / raw %.2f)\n",
            k + 1, raw, s.per_s, e.per_s, tcp_rt.back(), of_raw.back(), of_http.back(),
            of_serial.back(), of_tcp.back());
    }
    // Several clients at once (a router answers many gateways): the server's thread pool
    // serves their connections concurrently.
    // The no-op server the same way: its CPU per request is what HTTP alone costs the server.
    struct AtOnce {
        int clients;
        ParallelRun route, noop;
    };
    std::vector<AtOnce> parallel;
    for (int clients : {1, 2, 4, 8})
        parallel.push_back({clients,
                            post_parallel(http.port(), "/route", bodies, n_routes, clients, errors),
                            post_parallel(noop_port, "/noop", bodies, n_routes, clients, errors)});
    http.stop();
    server.join();
    noop.stop();
    noop_thread.join();
    const double raw = median(raw_rt), service = median(svc_rt), http_ceiling = median(http_rt);
    const double serial = 1.0 / (1.0 / raw + 1.0 / http_ceiling);
    std::printf("routes: %d prompts of %d blocks (%d tokens), %d replicas, one client\n", n_routes,
                kBlocks, kBlocks * kBs, kReplicas);
    std::printf("  raw hash + index lookup %9.0f routes/s\n", raw);
    std::printf(
        "  TCP round trip (%zu B / %zu B) %.0f round trips/s   (median of the rounds' "
        "tcp / raw: %.2f)\n",
        request_bytes, reply_bytes, median(tcp_rt), median(of_tcp));
    for (int conns : {2, 4, 8}) {
        const double r =
            tcp_parallel_round_trips_per_s(request_bytes, reply_bytes, n_routes, conns);
        std::printf("  TCP round trips, %d connections at once: %.0f round trips/s (%.2f of raw)\n",
                    conns, r, r / raw);
    }
    std::printf("  HTTP no-op, same bodies %9.0f requests/s\n", http_ceiling);
    std::printf("  serial ceiling          %9.0f routes/s   (1 / (1/raw + 1/http))\n", serial);
    std::printf("  POST /route (HTTP)      %9.0f routes/s   p50 %.0f us  p99 %.0f us  errors %d\n",
                service, 1e6 * median(p50), 1e6 * median(p99), errors);
    // On 2 cores the clients share the machine with the server, so routes/s at once is bounded by
    // both; the server's own CPU per route against the raw route's (one thread, 1 / raw) says what
    // a server core answers, whatever the clients cost.
    for (const auto& [clients, p, q] : parallel)
        std::printf(
            "  POST /route, %d clients at once %7.0f routes/s   (%.2f of raw, %.2f of http no-op "
            "%.0f/s); server CPU %.1f us/route, no-op %.1f us/request: the route's own %.1f us "
            "(raw %.1f us)\n",
            clients, p.per_s, p.per_s / raw, p.per_s / q.per_s, q.per_s,
            1e6 * p.server_cpu_s_per_route, 1e6 * q.server_cpu_s_per_route,
            1e6 * (p.server_cpu_s_per_route - q.server_cpu_s_per_route), 1e6 / raw);
    std::printf(
        "  median of the rounds' ratios: %.2f of raw, %.2f of http no-op, %.2f of serial "
        "ceiling\n",
        median(of_raw), median(of_http), median(of_serial));
    return errors == 0 ? 0 : 1;
}
