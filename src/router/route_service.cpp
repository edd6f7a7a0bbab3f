#include "kvshard/router/route_service.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <charconv>
#include <chrono>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>

#include "kvshard/common/error.h"

namespace kvshard {
namespace {

constexpr int64_t kMaxTokenId = std::numeric_limits<int32_t>::max();

template <class Int>
[[noreturn]] void token_out_of_range(size_t i, Int v) {
    throw Error(detail::concat("\"token_ids\"[", i, "] = ", v,
                               " is out of range; token ids are 0 to ", kMaxTokenId));
}

// The digits at p when 8 bytes can be read there and fewer than 8 of them are digits: their
// count (1 to 7); else 0 (the caller reads them one by one). Eight bytes at once: a byte is a
// digit when its high nibble is 3 and its low nibble at most 9.
int leading_digits_swar(const char* p, const char* end) {
    if constexpr (std::endian::native != std::endian::little) {
        return 0;
    } else {
        if (end - p < 8) return 0;
        uint64_t w;
        std::memcpy(&w, p, 8);
        const uint64_t non_digit =
            ((w & 0xF0F0F0F0F0F0F0F0ull) ^ 0x3030303030303030ull) |
            (((w & 0x0F0F0F0F0F0F0F0Full) + 0x0606060606060606ull) & 0xF0F0F0F0F0F0F0F0ull);
        return non_digit == 0 ? 0 : std::countr_zero(non_digit) / 8;
    }
}

// The value of the n (1 to 7) digits at p, 8 bytes readable: the digits moved to the top bytes
// (the bytes below them are leading zeros) and combined pairwise, then in fours, then in eights.
uint64_t digits_swar(const char* p, int n) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    uint64_t t = (w & 0x0F0F0F0F0F0F0F0Full) << (8 * (8 - n));
    t = (t * 2561) >> 8;
    t = ((t & 0x00FF00FF00FF00FFull) * 6553601) >> 16;
    return static_cast<uint32_t>(((t & 0x0000FFFF0000FFFFull) * 42949672960001ull) >> 32);
}

// The one-pass reader of the usual /route body. nullopt on anything it does not handle (the full
// parser then decides, and says what is wrong): other keys, a key twice, escapes or non-ASCII
// text, numbers that are not plain non-negative integers of int32, an extra key that is not a
// non-empty string, bad JSON.
std::optional<RouteRequestBody> parse_route_request_fast(std::string_view body) {
    const char* p = body.data();
    const char* const end = p + body.size();
    auto ws = [&] {
        while (p < end && (*p == ' ' || *p == '\n' || *p == '\r' || *p == '\t')) ++p;
    };
    auto eat = [&](char c) {
        ws();
        if (p == end || *p != c) return false;
        ++p;
        return true;
    };
    // A string without escapes, control characters or non-ASCII bytes; p after its closing quote.
    auto plain_string = [&](std::string_view& out) {
        if (!eat('"')) return false;
        const char* q = p;
        while (q < end && *q != '"') {
            const auto c = static_cast<unsigned char>(*q);
            if (c == '\\' || c < 0x20 || c >= 0x80) return false;
            ++q;
        }
        if (q == end) return false;
        out = std::string_view(p, static_cast<size_t>(q - p));
        p = q + 1;
        return true;
    };
    RouteRequestBody out;
    bool have_tokens = false, have_id = false, have_lora = false, have_salt = false;
    if (!eat('{')) return std::nullopt;
    do {
        std::string_view key;
        if (!plain_string(key) || !eat(':')) return std::nullopt;
        if (key == "token_ids" && !have_tokens) {
            have_tokens = true;
            if (!eat('[')) return std::nullopt;
            ws();
            if (p < end && *p == ']') {
                ++p;
            } else {
                out.token_ids.reserve(body.size() / 4);
                // A loop of its own (the hot part of the body): digits accumulated by hand, at
                // most 10 of them (2^31 - 1 has 10), so the value cannot overflow.
                for (;;) {
                    ws();
                    // JSON integers: no sign here (negative ids are errors: the full parser
                    // words them), no leading zeros, no fraction or exponent.
                    if (p == end || static_cast<unsigned>(*p - '0') > 9) return std::nullopt;
                    if (*p == '0' && p + 1 < end && static_cast<unsigned>(p[1] - '0') <= 9)
                        return std::nullopt;
                    uint64_t v = 0;
                    if (const int n = leading_digits_swar(p, end); n > 0) {
                        v = digits_swar(p, n);
                        p += n;
                    } else {
                        const char* const first = p;
                        while (p < end && static_cast<unsigned>(*p - '0') <= 9) {
                            v = v * 10 + static_cast<unsigned>(*p - '0');
                            if (++p - first > 10) return std::nullopt;
                        }
                    }
                    if (v > static_cast<uint64_t>(kMaxTokenId)) return std::nullopt;
                    if (p < end && (*p == '.' || *p == 'e' || *p == 'E')) return std::nullopt;
                    out.token_ids.push_back(static_cast<int32_t>(v));
                    if (p < end && *p == ',') {
                        ++p;
                        continue;
                    }
                    ws();
                    if (p < end && *p == ',') {
                        ++p;
                        continue;
                    }
                    if (p < end && *p == ']') {
                        ++p;
                        break;
                    }
                    return std::nullopt;
                }
            }
        } else if (key == "request_id" && !have_id) {
            have_id = true;
            std::string_view id;
            if (!plain_string(id)) return std::nullopt;
            out.request_id.assign(id);
        } else if ((key == "lora_name" && !have_lora) || (key == "cache_salt" && !have_salt)) {
            const bool lora = key == "lora_name";
            (lora ? have_lora : have_salt) = true;
            std::string_view v;
            if (!plain_string(v) || v.empty()) return std::nullopt;
            (lora ? out.extra.lora_name : out.extra.cache_salt).assign(v);
        } else {
            return std::nullopt;
        }
    } while (eat(','));
    if (!eat('}')) return std::nullopt;
    ws();
    if (p != end || !have_tokens) return std::nullopt;
    return out;
}

}  // namespace

RouteRequestBody parse_route_request(std::string_view body) {
    if (auto fast = parse_route_request_fast(body)) return std::move(*fast);
    nlohmann::json j;
    try {
        j = nlohmann::json::parse(body);
    } catch (const std::exception&) {
        throw Error(
            "the body is not JSON; expected {\"token_ids\": [...], \"request_id\": \"...\"}");
    }
    if (!j.is_object() || !j.contains("token_ids") || !j["token_ids"].is_array())
        throw Error("expected {\"token_ids\": [int, ...], \"request_id\": \"...\"}");
    RouteRequestBody out;
    const auto& tokens = j["token_ids"];
    out.token_ids.reserve(tokens.size());
    for (size_t i = 0; i < tokens.size(); ++i) {
        if (!tokens[i].is_number_integer()) throw Error("\"token_ids\" must hold integers only");
        if (tokens[i].is_number_unsigned()) {
            const auto v = tokens[i].get<uint64_t>();
            if (v > static_cast<uint64_t>(kMaxTokenId)) token_out_of_range(i, v);
            out.token_ids.push_back(static_cast<int32_t>(v));
            continue;
        }
        const auto v = tokens[i].get<int64_t>();
        if (v < 0 || v > kMaxTokenId) token_out_of_range(i, v);
        out.token_ids.push_back(static_cast<int32_t>(v));
    }
    if (j.contains("request_id")) {
        if (!j["request_id"].is_string()) throw Error("\"request_id\" must be a string");
        out.request_id = j["request_id"].get<std::string>();
    }
    // null is absent, as in vLLM's OpenAI server (cache_salt: Optional[str] = None).
    auto extra_key = [&j](const char* key, const char* what, std::string& to) {
        const auto it = j.find(key);
        if (it == j.end() || it->is_null()) return;
        if (!it->is_string() || it->get_ref<const std::string&>().empty())
            throw Error(detail::concat("\"", key, "\" must be a non-empty string (", what,
                                       ") or null, got ",
                                       it->is_string() ? "\"\"" : it->type_name()));
        to = it->get<std::string>();
    };
    extra_key("lora_name", "the LoRA adapter's name, as vLLM's lora_request.lora_name",
              out.extra.lora_name);
    extra_key("cache_salt", "the request's cache salt, as sent to vLLM", out.extra.cache_salt);
    return out;
}

RouteService::RouteService(RouteServiceConfig config, IndexAccess index)
    : config_(std::move(config)), index_(std::move(index)) {
    require(!config_.replica_names.empty(), "the router needs at least one replica (--engine)");
    require(static_cast<int>(config_.replica_names.size()) <= KvIndex::kMaxReplicas,
            "the router takes at most ", KvIndex::kMaxReplicas, " replicas, got ",
            config_.replica_names.size());
    require(config_.block_size >= 1 && config_.block_size <= (1 << 20),
            "--block-size must be 1 to 1048576 tokens (the engines' block size), got ",
            config_.block_size);
    config_.params.block_tokens = config_.block_size;
    config_.params.validate();
    engine_hash_seed_ = vllm_engine_hash_seed(config_.scheme, config_.hash_seed);
    root_ = vllm_none_hash(config_.scheme, engine_hash_seed_);
    load_.assign(config_.replica_names.size(), 0);
    routes_to_.assign(config_.replica_names.size(), 0);
    // Route latency buckets, seconds (Prometheus histogram upper bounds).
    latency_bounds_s_ = {1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 1e-1};
    latency_counts_.assign(latency_bounds_s_.size() + 1, 0);
    for (size_t r = 0; r < config_.replica_names.size(); ++r) {
        names_sorted_.push_back(r);
        names_json_.push_back(nlohmann::json(config_.replica_names[r]).dump());
    }
    // nlohmann::json objects order their keys as std::map<std::string> does.
    std::stable_sort(names_sorted_.begin(), names_sorted_.end(), [this](size_t a, size_t b) {
        return config_.replica_names[a] < config_.replica_names[b];
    });
}

RouteOutcome RouteService::route(const std::string& request_id, std::span<const int64_t> token_ids,
                                 const VllmExtraKeys& extra) {
    std::vector<int32_t> tokens;
    tokens.reserve(token_ids.size());
    for (size_t i = 0; i < token_ids.size(); ++i) {
        if (token_ids[i] < 0 || token_ids[i] > kMaxTokenId) token_out_of_range(i, token_ids[i]);
        tokens.push_back(static_cast<int32_t>(token_ids[i]));
    }
    return route(request_id, tokens, extra);
}

RouteOutcome RouteService::route(const std::string& request_id, std::span<const int32_t> tokens,
                                 const VllmExtraKeys& extra) {
    const auto t0 = std::chrono::steady_clock::now();
    require(!tokens.empty(), "\"token_ids\" is empty; a prompt has at least one token");
    for (size_t i = 0; i < tokens.size(); ++i)
        if (tokens[i] < 0) token_out_of_range(i, tokens[i]);
    // One hasher per thread: its CBOR buffer is reused from request to request.
    thread_local std::optional<VllmBlockHasher> tl_hasher;
    if (!tl_hasher || tl_hasher->scheme() != config_.scheme) tl_hasher.emplace(config_.scheme);
    VllmBlockHasher& hasher = *tl_hasher;
    const auto keys = vllm_prompt_keys(hasher, root_, tokens, config_.block_size, extra);
    const int n = num_replicas();
    RouteOutcome out;
    out.matched_blocks.assign(static_cast<size_t>(n), 0);
    index_([&](const KvIndex& idx, const VllmEventIngest*) {
        // vLLM recomputes the last prompt token: a hit of at most (tokens - 1) / block_size.
        const auto cap = static_cast<size_t>(std::min<int64_t>(
            static_cast<int64_t>(keys.size()),
            vllm_max_cache_hit_blocks(static_cast<int64_t>(tokens.size()), config_.block_size)));
        idx.prefix_overlap(std::span<const BlockHash>(keys).first(cap), out.matched_blocks);
    });
    const int64_t blocks =
        (static_cast<int64_t>(tokens.size()) + config_.block_size - 1) / config_.block_size;

    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = inflight_.find(request_id); it != inflight_.end()) {
        load_[static_cast<size_t>(it->second.first)] -= it->second.second;
        inflight_.erase(it);
    }
    std::vector<ReplicaLoad> loads(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) loads[static_cast<size_t>(r)].active_blocks = load_[r];
    const RouteDecision d = decide_route(config_.policy, config_.params,
                                         RouteRequest{keys, static_cast<int64_t>(tokens.size())},
                                         out.matched_blocks, loads, rr_counter_++);
    out.replica = d.replica;
    out.replica_name = config_.replica_names[static_cast<size_t>(d.replica)];
    out.reason = d.reason;
    if (!request_id.empty() && inflight_.size() < config_.max_tracked_requests) {
        inflight_[request_id] = {d.replica, blocks};
        load_[static_cast<size_t>(d.replica)] += blocks;
    }
    out.load_blocks = load_;
    ++routes_;
    ++routes_to_[static_cast<size_t>(d.replica)];
    if (d.matched_blocks > 0) {
        ++hits_;
        hit_blocks_ += d.matched_blocks;
    }
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    size_t b = 0;
    while (b < latency_bounds_s_.size() && dt > latency_bounds_s_[b]) ++b;
    ++latency_counts_[b];
    latency_sum_s_ += dt;
    return out;
}

std::string RouteService::route_reply_json(const RouteOutcome& o) const {
    std::string s;
    s.reserve(64 + names_json_.size() * 48);
    auto per_replica = [&](const char* key, const auto& values) {
        s += key;
        s += '{';
        bool first = true;
        for (size_t r : names_sorted_) {
            if (!first) s += ',';
            first = false;
            s += names_json_[r];
            s += ':';
            s += std::to_string(values[r]);
        }
        s += '}';
    };
    per_replica("{\"load\":", o.load_blocks);
    per_replica(",\"matched_blocks\":", o.matched_blocks);
    s += ",\"reason\":\"";
    s += route_reason_name(o.reason);  // lowercase words and '-': nothing to escape
    s += "\",\"replica\":";
    s += names_json_[static_cast<size_t>(o.replica)];
    s += '}';
    return s;
}

bool RouteService::finished(const std::string& request_id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = inflight_.find(request_id);
    if (it == inflight_.end()) return false;
    load_[static_cast<size_t>(it->second.first)] -= it->second.second;
    inflight_.erase(it);
    ++finished_;
    return true;
}

void RouteService::count_bad_request() {
    std::lock_guard<std::mutex> lock(mu_);
    ++bad_requests_;
}

std::string RouteService::replicas_json() const {
    nlohmann::json reps = nlohmann::json::array();
    std::vector<nlohmann::json> feed(static_cast<size_t>(num_replicas()));
    index_([&](const KvIndex& idx, const VllmEventIngest* ingest) {
        for (int r = 0; r < num_replicas(); ++r) {
            nlohmann::json j{{"index_blocks", idx.num_blocks(r)}};
            if (ingest && r < ingest->num_replicas()) {
                const auto& s = ingest->status(r);
                j["last_seq"] = s.last_seq ? nlohmann::json(*s.last_seq) : nlohmann::json(nullptr);
                j["stale"] = s.stale;
                j["events"] = s.events;
                j["gaps"] = s.gaps;
                j["restarts"] = s.restarts;
                j["malformed"] = s.malformed;
                j["evicted"] = s.evicted;
                j["block_size_mismatch"] = s.block_size_mismatch;
                j["larger_block_events"] = s.larger_block_events;
            }
            feed[static_cast<size_t>(r)] = j;
        }
    });
    std::lock_guard<std::mutex> lock(mu_);
    for (int r = 0; r < num_replicas(); ++r) {
        auto j = feed[static_cast<size_t>(r)];
        j["name"] = config_.replica_names[static_cast<size_t>(r)];
        j["load_blocks"] = load_[static_cast<size_t>(r)];
        reps.push_back(j);
    }
    return nlohmann::json{{"replicas", reps}}.dump();
}

std::string RouteService::metrics_text() const {
    std::vector<VllmFeedStatus> feed;
    index_([&](const KvIndex&, const VllmEventIngest* ingest) {
        if (!ingest) return;
        for (int r = 0; r < ingest->num_replicas(); ++r) feed.push_back(ingest->status(r));
    });
    std::lock_guard<std::mutex> lock(mu_);
    std::string s;
    auto counter = [&](const char* name, const char* help, int64_t v) {
        s += fmt::format("# HELP {} {}\n# TYPE {} counter\n{} {}\n", name, help, name, name, v);
    };
    counter("kvshard_router_routes_total", "Requests routed.", routes_);
    counter("kvshard_router_hits_total", "Routes whose chosen replica held a prefix.", hits_);
    counter("kvshard_router_hit_blocks_total", "Prefix blocks matched on the chosen replica.",
            hit_blocks_);
    counter("kvshard_router_finished_total", "Requests reported finished.", finished_);
    counter("kvshard_router_bad_requests_total", "HTTP requests refused with 400.", bad_requests_);
    auto per_replica = [&](const char* name, const char* help, auto value) {
        s += fmt::format("# HELP {} {}\n# TYPE {} counter\n", name, help, name);
        for (size_t r = 0; r < feed.size() && r < config_.replica_names.size(); ++r)
            s += fmt::format("{}{{replica=\"{}\"}} {}\n", name, config_.replica_names[r],
                             value(feed[r]));
    };
    per_replica("kvshard_router_events_total", "KV events applied to the index.",
                [](const VllmFeedStatus& f) { return f.events; });
    per_replica("kvshard_router_gaps_total", "Sequence gaps seen.",
                [](const VllmFeedStatus& f) { return f.gaps; });
    per_replica("kvshard_router_restarts_total", "Publisher restarts seen.",
                [](const VllmFeedStatus& f) { return f.restarts; });
    per_replica("kvshard_router_malformed_total", "Malformed messages dropped.",
                [](const VllmFeedStatus& f) { return f.malformed; });
    per_replica("kvshard_router_block_size_mismatch_total",
                "BlockStored events of another block size than the router's, not indexed.",
                [](const VllmFeedStatus& f) { return f.block_size_mismatch; });
    per_replica("kvshard_router_larger_block_events_total",
                "BlockStored events at a multiple of the router's block size (a hybrid KV cache "
                "group with larger blocks), indexed.",
                [](const VllmFeedStatus& f) { return f.larger_block_events; });
    s += "# HELP kvshard_router_stale Whether the replica's index is stale (1) after a gap.\n"
         "# TYPE kvshard_router_stale gauge\n";
    for (size_t r = 0; r < feed.size() && r < config_.replica_names.size(); ++r)
        s += fmt::format("kvshard_router_stale{{replica=\"{}\"}} {}\n", config_.replica_names[r],
                         feed[r].stale ? 1 : 0);
    s += "# HELP kvshard_router_route_seconds Time to answer a route (hashing, index, policy).\n"
         "# TYPE kvshard_router_route_seconds histogram\n";
    int64_t cum = 0;
    for (size_t b = 0; b < latency_bounds_s_.size(); ++b) {
        cum += latency_counts_[b];
        s += fmt::format("kvshard_router_route_seconds_bucket{{le=\"{}\"}} {}\n",
                         latency_bounds_s_[b], cum);
    }
    cum += latency_counts_.back();
    s += fmt::format("kvshard_router_route_seconds_bucket{{le=\"+Inf\"}} {}\n", cum);
    s += fmt::format("kvshard_router_route_seconds_sum {}\n", latency_sum_s_);
    s += fmt::format("kvshard_router_route_seconds_count {}\n", cum);
    return s;
}

}  // namespace kvshard
