#include "kvshard/common/error.h"
#include "kvshard/router/http_server.h"
#include "kvshard/router/vllm_event_subscriber.h"

#include <algorithm>
#include <charconv>
#include <set>

namespace kvshard {

void check_http_options(const RouterHttpOptions& o) {
    require(o.port >= 0 && o.port <= 65535, "the listen port must be 0 to 65535, got ", o.port);
    require(o.threads >= 1 && o.threads <= 4096, "--http-threads must be 1 to 4096, got ",
            o.threads);
    require(o.keep_alive_timeout_s >= 1 && o.keep_alive_timeout_s <= 3600,
            "--keep-alive-timeout-s must be 1 to 3600, got ", o.keep_alive_timeout_s);
    const bool loopback = o.host == "localhost" || o.host == "::1" || o.host.rfind("127.", 0) == 0;
    require(loopback || o.allow_remote, "refusing to listen on '", o.host,
            "': the router binds to loopback (127.0.0.1, ::1, localhost) unless --allow-remote is "
            "given");
}

namespace {

int parse_port(std::string_view endpoint) {
    const size_t colon = endpoint.rfind(':');
    int port = -1;
    if (colon != std::string_view::npos) {
        const auto digits = endpoint.substr(colon + 1);
        const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), port);
        if (ec != std::errc() || end != digits.data() + digits.size() || digits.empty()) port = -1;
    }
    return port;
}

bool is_ipc(std::string_view endpoint) { return endpoint.rfind("ipc://", 0) == 0; }

// tcp://HOST:PORT or ipc://PATH, the transports vLLM's publisher binds that another process can
// reach. inproc:// names a socket inside the engine's own process: nothing outside can connect.
void check_endpoint(std::string_view what, std::string_view endpoint) {
    require(endpoint.rfind("inproc://", 0) != 0, what, " '", endpoint,
            "' is inproc://, which only reaches sockets inside the engine's own process; the "
            "router is another process: have the engine publish on tcp://HOST:PORT or ipc://PATH");
    if (is_ipc(endpoint)) {
        require(endpoint.size() > 6, what, " '", endpoint,
                "' has no path; expected ipc://PATH (e.g. ipc:///tmp/vllm-kv-events)");
        return;
    }
    const int port = parse_port(endpoint);
    require(endpoint.rfind("tcp://", 0) == 0 && port >= 1 && port <= 65535, what, " '", endpoint,
            "' is not tcp://HOST:PORT or ipc://PATH with a port of 1 to 65535 (e.g. "
            "tcp://127.0.0.1:5557)");
    const std::string_view host = endpoint.substr(6, endpoint.rfind(':') - 6);
    require(!host.empty(), what, " '", endpoint,
            "' has no host; expected tcp://HOST:PORT (e.g. tcp://127.0.0.1:5557)");
    require(host != "*" && host != "0.0.0.0" && host != "[::]", what, " '", endpoint,
            "' names the wildcard host the engine binds to; the router connects: give the "
            "engine's address (e.g. tcp://127.0.0.1:5557)");
}

bool name_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
           c == '_' || c == '-' || c == ':';
}

}  // namespace

std::string offset_endpoint_port(const std::string& endpoint, int rank) {
    if (rank == 0) return endpoint;
    require(!is_ipc(endpoint), "cannot offset '", endpoint,
            "' by DP rank: vLLM offsets tcp:// ports only (its offset_endpoint_port refuses an "
            "ipc:// endpoint for a rank above 0)");
    const int port = parse_port(endpoint);
    require(port >= 1, "cannot offset the port of '", endpoint, "': no numeric port");
    require(port + rank <= 65535, "'", endpoint, "' rank ", rank, ": port ", port + rank,
            " is over 65535");
    return endpoint.substr(0, endpoint.rfind(':') + 1) + std::to_string(port + rank);
}

VllmEngineSpec parse_vllm_engine_spec(std::string_view text) {
    const size_t eq = text.find('=');
    require(eq != std::string_view::npos && eq > 0, "--engine '", text,
            "': expected NAME=tcp://HOST:PORT[,dp=K,replay=tcp://HOST:PORT,spec=METHOD] (or "
            "ipc://PATH "
            "for either endpoint)");
    VllmEngineSpec e;
    e.name = std::string(text.substr(0, eq));
    require(std::all_of(e.name.begin(), e.name.end(), name_char), "--engine '", text,
            "': the name '", e.name,
            "' may hold only letters, digits and . _ - : (it names the replica in JSON replies "
            "and Prometheus labels)");
    std::string_view rest = text.substr(eq + 1);
    size_t comma = rest.find(',');
    e.endpoint = std::string(rest.substr(0, comma));
    check_endpoint("--engine " + e.name + ": the event endpoint", e.endpoint);
    while (comma != std::string_view::npos) {
        rest = rest.substr(comma + 1);
        comma = rest.find(',');
        const std::string_view opt = rest.substr(0, comma);
        if (opt.rfind("dp=", 0) == 0) {
            const auto v = opt.substr(3);
            int dp = 0;
            const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), dp);
            require(ec == std::errc() && end == v.data() + v.size() && dp >= 1 && dp <= 64,
                    "--engine ", e.name, ": dp must be 1 to 64, got '", v, "'");
            e.dp = dp;
        } else if (opt.rfind("replay=", 0) == 0) {
            e.replay_endpoint = std::string(opt.substr(7));
            check_endpoint("--engine " + e.name + ": the replay endpoint", e.replay_endpoint);
        } else if (opt.rfind("spec=", 0) == 0) {
            e.speculative_method = std::string(opt.substr(5));
            try {
                (void)vllm_eagle_block_drop(e.speculative_method);
            } catch (const Error& err) {
                throw Error(detail::concat("--engine ", e.name, ": ", err.what()));
            }
        } else {
            throw Error(detail::concat(
                "--engine ", e.name, ": unknown option '", opt,
                "'; expected dp=K, replay=tcp://HOST:PORT or spec=METHOD (the engine's "
                "--speculative-config method)"));
        }
    }
    require(e.dp == 1 || (!is_ipc(e.endpoint) && !is_ipc(e.replay_endpoint)), "--engine ", e.name,
            ": dp=", e.dp,
            " needs tcp:// endpoints: vLLM gives DP rank k the port + k of a tcp:// endpoint and "
            "cannot offset an ipc:// one; give each rank's ipc:// endpoint its own --engine");
    return e;
}

VllmReplicaFeeds expand_vllm_engines(std::span<const VllmEngineSpec> engines) {
    require(!engines.empty(),
            "the router needs at least one engine (--engine NAME=tcp://HOST:PORT)");
    VllmReplicaFeeds out;
    std::set<std::string> names, endpoints;
    for (const VllmEngineSpec& e : engines) {
        for (int k = 0; k < e.dp; ++k) {
            const int replica = static_cast<int>(out.names.size());
            require(replica < KvIndex::kMaxReplicas, "the router takes at most ",
                    KvIndex::kMaxReplicas, " replicas (engines times their dp); --engine ", e.name,
                    " makes it more");
            std::string name = e.dp == 1 ? e.name : e.name + "/dp" + std::to_string(k);
            require(names.insert(name).second, "--engine ", e.name, ": replica name '", name,
                    "' is given twice; give each engine (and DP rank) its own name");
            VllmEventEndpoint ep{replica, offset_endpoint_port(e.endpoint, k),
                                 e.replay_endpoint.empty()
                                     ? std::string()
                                     : offset_endpoint_port(e.replay_endpoint, k),
                                 ""};
            for (const std::string* p : {&ep.endpoint, &ep.replay_endpoint}) {
                if (p->empty()) continue;
                require(endpoints.insert(*p).second, "--engine ", e.name, ": replica '", name,
                        "' would use endpoint '", *p,
                        "', which another replica uses already; each engine rank publishes (and "
                        "replays) on its own port");
            }
            out.names.push_back(std::move(name));
            out.endpoints.push_back(std::move(ep));
            out.eagle_block_drop.push_back(vllm_eagle_block_drop(e.speculative_method));
        }
    }
    return out;
}

void configure_vllm_index(KvIndex& index, const VllmReplicaFeeds& feeds) {
    require(static_cast<size_t>(index.num_replicas()) == feeds.eagle_block_drop.size(),
            "the KV index has ", index.num_replicas(), " replicas, the engines give ",
            feeds.eagle_block_drop.size());
    for (int r = 0; r < index.num_replicas(); ++r)
        index.set_eagle_block_drop(r, feeds.eagle_block_drop[static_cast<size_t>(r)]);
}

}  // namespace kvshard
