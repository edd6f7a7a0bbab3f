#include "kvshard/router/policy.h"

#include <algorithm>
#include <array>
#include <limits>

#include "kvshard/common/checked.h"
#include "kvshard/common/error.h"

namespace kvshard {

void PolicyParams::validate() const {
    require(block_tokens >= 1 && block_tokens <= (1 << 20),
            "block_tokens must be an integer in [1, 2^20], got ", block_tokens);
    require_finite_in(cache_threshold, 0, 1, "the cache-aware policy's cache threshold");
    require_finite_in(balance_abs_threshold, 0, 1e15,
                      "the cache-aware policy's absolute balance gap");
    require_finite_in(balance_rel_threshold, 1, 1e15, "the cache-aware policy's balance ratio");
    require_finite_in(overlap_weight, 0, 1e6, "the cost policy's overlap weight");
    require_finite_in(load_slack, 0, 1e6, "the kvshard policy's load slack");
    require_finite_in(load_headroom_tokens, 0, 1e15, "the kvshard policy's load headroom");
    require_finite_in(prefill_weight, 0, 1e6, "the kvshard policy's prefill weight");
    require(affinity_blocks >= 0 && min_gain_blocks >= 0,
            "affinity_blocks and min_gain_blocks must be >= 0, got ", affinity_blocks, " and ",
            min_gain_blocks);
}

std::string_view routing_policy_name(RoutingPolicy p) {
    switch (p) {
        case RoutingPolicy::kRoundRobin:
            return "round-robin";
        case RoutingPolicy::kLeastLoaded:
            return "least-loaded";
        case RoutingPolicy::kCacheAware:
            return "cache-aware";
        case RoutingPolicy::kCost:
            return "cost";
        case RoutingPolicy::kKvshard:
            return "kvshard";
    }
    return "?";
}

RoutingPolicy parse_routing_policy(std::string_view s) {
    for (RoutingPolicy p : all_routing_policies())
        if (s == routing_policy_name(p)) return p;
    throw Error(
        detail::concat("unknown routing policy '", s,
                       "': expected round-robin, least-loaded, cache-aware, cost or kvshard"));
}

std::vector<RoutingPolicy> all_routing_policies() {
    return {RoutingPolicy::kRoundRobin, RoutingPolicy::kLeastLoaded, RoutingPolicy::kCacheAware,
            RoutingPolicy::kCost, RoutingPolicy::kKvshard};
}

std::string_view route_reason_name(RouteReason r) {
    switch (r) {
        case RouteReason::kRoundRobin:
            return "round-robin";
        case RouteReason::kLeastLoaded:
            return "least-loaded";
        case RouteReason::kImbalanced:
            return "imbalanced";
        case RouteReason::kBestMatch:
            return "best-match";
        case RouteReason::kLowestCost:
            return "lowest-cost";
        case RouteReason::kSpill:
            return "spill";
    }
    return "?";
}

double effective_load_blocks(const ReplicaLoad& l, int block_tokens, double mean_capacity_blocks) {
    const double queued_blocks =
        static_cast<double>((l.queued_prefill_tokens + block_tokens - 1) / block_tokens);
    const double blocks = static_cast<double>(l.active_blocks) + queued_blocks;
    if (mean_capacity_blocks <= 0 || l.capacity_blocks <= 0) return blocks;
    return blocks * mean_capacity_blocks / static_cast<double>(l.capacity_blocks);
}

uint64_t rendezvous_score(uint64_t key, int replica) {
    // splitmix64 finalizer of key mixed with the replica id: a fixed, platform-independent order.
    uint64_t z = key + 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(replica + 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

namespace {

constexpr int kMax = KvIndex::kMaxReplicas;

// The first replica in rotation order from `start` that minimises key(r) among those with
// allowed(r); -1 when none is allowed.
template <typename Key, typename Allowed>
int argmin_rotated(int n, uint64_t start, Key key, Allowed allowed) {
    int best = -1;
    double best_key = std::numeric_limits<double>::infinity();
    for (int i = 0; i < n; ++i) {
        const int r =
            static_cast<int>((start + static_cast<uint64_t>(i)) % static_cast<uint64_t>(n));
        if (!allowed(r)) continue;
        const double k = key(r);
        if (best < 0 || k < best_key) {
            best = r;
            best_key = k;
        }
    }
    return best;
}

struct Context {
    int n;
    int request_blocks;
    std::array<double, kMax> load{};
    double min_load = 0, max_load = 0, mean_load = 0;
};

Context make_context(const PolicyParams& params, const RouteRequest& req,
                     std::span<const ReplicaLoad> loads) {
    Context c;
    c.n = static_cast<int>(loads.size());
    c.request_blocks = static_cast<int>(req.block_hashes.size());
    double cap_sum = 0;
    bool all_caps = true;
    for (const auto& l : loads) {
        cap_sum += static_cast<double>(l.capacity_blocks);
        all_caps = all_caps && l.capacity_blocks > 0;
    }
    const double mean_cap = all_caps ? cap_sum / c.n : 0.0;
    double sum = 0;
    for (int r = 0; r < c.n; ++r) {
        c.load[static_cast<size_t>(r)] =
            effective_load_blocks(loads[static_cast<size_t>(r)], params.block_tokens, mean_cap);
        sum += c.load[static_cast<size_t>(r)];
    }
    c.min_load = *std::min_element(c.load.begin(), c.load.begin() + c.n);
    c.max_load = *std::max_element(c.load.begin(), c.load.begin() + c.n);
    c.mean_load = sum / c.n;
    return c;
}

RouteDecision decision(int r, std::span<const int> overlap, RouteReason why) {
    return {r, overlap[static_cast<size_t>(r)], why};
}

int least_loaded(const Context& c, uint64_t rr) {
    return argmin_rotated(
        c.n, rr, [&](int r) { return c.load[static_cast<size_t>(r)]; }, [](int) { return true; });
}

// Highest overlap; ties: lowest load, then rotation order.
int best_match(const Context& c, std::span<const int> overlap, uint64_t rr) {
    int best_overlap = 0;
    for (int r = 0; r < c.n; ++r)
        best_overlap = std::max(best_overlap, overlap[static_cast<size_t>(r)]);
    return argmin_rotated(
        c.n, rr, [&](int r) { return c.load[static_cast<size_t>(r)]; },
        [&](int r) { return overlap[static_cast<size_t>(r)] == best_overlap; });
}

RouteDecision cache_aware(const PolicyParams& p, const Context& c, std::span<const int> overlap,
                          uint64_t rr) {
    const bool imbalanced = c.max_load - c.min_load > p.balance_abs_threshold &&
                            c.max_load > p.balance_rel_threshold * c.min_load;
    if (imbalanced) return decision(least_loaded(c, rr), overlap, RouteReason::kImbalanced);
    const int best = best_match(c, overlap, rr);
    const double ratio =
        c.request_blocks == 0
            ? 0.0
            : static_cast<double>(overlap[static_cast<size_t>(best)]) / c.request_blocks;
    if (ratio < p.cache_threshold || overlap[static_cast<size_t>(best)] == 0)
        return decision(least_loaded(c, rr), overlap, RouteReason::kLeastLoaded);
    return decision(best, overlap, RouteReason::kBestMatch);
}

RouteDecision cost(const PolicyParams& p, const Context& c, const RouteRequest& req,
                   std::span<const int> overlap, std::span<const ReplicaLoad> loads, uint64_t rr) {
    const int r = argmin_rotated(
        c.n, rr,
        [&](int i) {
            const auto& l = loads[static_cast<size_t>(i)];
            const double queued_blocks = static_cast<double>(
                (l.queued_prefill_tokens + p.block_tokens - 1) / p.block_tokens);
            const double to_prefill =
                queued_blocks + c.request_blocks - overlap[static_cast<size_t>(i)];
            return p.overlap_weight * to_prefill + static_cast<double>(l.active_blocks);
        },
        [](int) { return true; });
    (void)req;
    return decision(r, overlap, RouteReason::kLowestCost);
}

RouteDecision kvshard_policy(const PolicyParams& p, const Context& c, const RouteRequest& req,
                             std::span<const int> overlap, std::span<const ReplicaLoad> loads) {
    const double bound =
        (1.0 + p.load_slack) * c.mean_load + p.load_headroom_tokens / p.block_tokens;
    auto allowed = [&](int r) { return c.load[static_cast<size_t>(r)] <= bound; };
    auto ov = [&](int r) { return overlap[static_cast<size_t>(r)]; };
    // Placement load: queued prefill weighted by prefill_weight (a queued prompt holds up every
    // request behind it; an active block only slows decode steps a little), capacity-scaled like
    // c.load.
    std::array<double, kMax> place{};
    for (int r = 0; r < c.n; ++r) {
        const auto& l = loads[static_cast<size_t>(r)];
        const double queued =
            static_cast<double>((l.queued_prefill_tokens + p.block_tokens - 1) / p.block_tokens);
        const double plain = static_cast<double>(l.active_blocks) + queued;
        const double weighted = static_cast<double>(l.active_blocks) + p.prefill_weight * queued;
        place[static_cast<size_t>(r)] =
            plain > 0 ? weighted * c.load[static_cast<size_t>(r)] / plain : 0.0;
    }
    // Ties go by rendezvous order of the request's affinity key (its chained hash at position
    // affinity_blocks), the same for every turn of one conversation.
    uint64_t key = 0x51ED27A1u;
    if (c.request_blocks > 0) {
        const int pos = std::min(std::max(p.affinity_blocks, 0), c.request_blocks - 1);
        const BlockHash& h = req.block_hashes[static_cast<size_t>(pos)];
        key = rendezvous_score(h.lo ^ (h.hi * 0xC2B2AE3D27D4EB4Full), pos);
    }
    std::array<uint64_t, kMax> score{};
    for (int r = 0; r < c.n; ++r) score[static_cast<size_t>(r)] = rendezvous_score(key, r);
    auto before = [&](int a, int b) {  // lower placement load, then higher rendezvous score
        const double la = place[static_cast<size_t>(a)], lb = place[static_cast<size_t>(b)];
        return la < lb ||
               (la == lb && score[static_cast<size_t>(a)] > score[static_cast<size_t>(b)]);
    };
    // least: the first allowed replica by placement load; best: the longest overlap among allowed
    // replicas. The replica of least plain load is always allowed.
    int least = -1, best = -1, best_any = 0;
    for (int r = 0; r < c.n; ++r) {
        best_any = std::max(best_any, ov(r));
        if (!allowed(r)) continue;
        if (least < 0 || before(r, least)) least = r;
        if (best < 0 || ov(r) > ov(best) || (ov(r) == ov(best) && before(r, best))) best = r;
    }
    KVSHARD_CHECK(least >= 0 && best >= 0, "the least loaded replica is always under the bound");
    if (ov(best) > ov(least) + p.min_gain_blocks)
        return decision(best, overlap,
                        ov(best) == best_any ? RouteReason::kBestMatch : RouteReason::kSpill);
    return decision(
        least, overlap,
        best_any > ov(least) + p.min_gain_blocks ? RouteReason::kSpill : RouteReason::kLeastLoaded);
}

}  // namespace

RouteDecision decide_route(RoutingPolicy policy, const PolicyParams& params,
                           const RouteRequest& req, std::span<const int> overlap,
                           std::span<const ReplicaLoad> loads, uint64_t rr_counter) {
    require(!loads.empty() && loads.size() == overlap.size() && loads.size() <= size_t{kMax},
            "routing: ", loads.size(), " loads and ", overlap.size(),
            " overlaps; need one of each per replica, 1 to ", kMax, " replicas");
    require(params.block_tokens > 0, "routing: block_tokens must be positive, got ",
            params.block_tokens);
    if (policy == RoutingPolicy::kRoundRobin) {
        const int r = static_cast<int>(rr_counter % loads.size());
        return decision(r, overlap, RouteReason::kRoundRobin);
    }
    const Context c = make_context(params, req, loads);
    switch (policy) {
        case RoutingPolicy::kRoundRobin:
            break;
        case RoutingPolicy::kLeastLoaded:
            return decision(least_loaded(c, rr_counter), overlap, RouteReason::kLeastLoaded);
        case RoutingPolicy::kCacheAware:
            return cache_aware(params, c, overlap, rr_counter);
        case RoutingPolicy::kCost:
            return cost(params, c, req, overlap, loads, rr_counter);
        case RoutingPolicy::kKvshard:
            return kvshard_policy(params, c, req, overlap, loads);
    }
    KVSHARD_CHECK(false, "unhandled routing policy");
    return {};
}

Router::Router(int num_replicas, RoutingPolicy policy, PolicyParams params, KvIndexMode mode,
               double ttl_s)
    : policy_(policy),
      params_(params),
      index_(num_replicas, mode, ttl_s),
      overlap_(static_cast<size_t>(num_replicas), 0) {}

RouteDecision Router::route(const RouteRequest& req, std::span<const ReplicaLoad> loads,
                            double now_s) {
    require(static_cast<int>(loads.size()) == num_replicas(), "router: ", loads.size(),
            " loads for ", num_replicas(), " replicas");
    // The hashes name the prompt's blocks: one per full block, optionally one for a partial last
    // block (a trace's hash_ids), never more. Fewer is a prefix of the prompt (allowed).
    require(req.num_tokens >= 0, "router: a prompt of ", req.num_tokens,
            " tokens; the token count must be >= 0");
    const int64_t bt = params_.block_tokens;  // ceil without overflow near 2^63
    const int64_t most = req.num_tokens / bt + (req.num_tokens % bt != 0);
    if (static_cast<int64_t>(req.block_hashes.size()) > most)
        throw Error(detail::concat(
            "router: ", req.block_hashes.size(), " block hashes for a prompt of ", req.num_tokens,
            " tokens, but blocks of ", params_.block_tokens, " tokens give it at most ", most,
            " (one per full block, optionally one for a partial last block); pass the prompt's "
            "token count with its hashes"));
    if (index_.mode() == KvIndexMode::kApproximate) index_.expire(now_s);
    // The overlap an engine would use: vLLM recomputes the last prompt token, so at most
    // (num_tokens - 1) / block_tokens blocks (a trailing partial block's hash is never a hit).
    const auto cap = static_cast<size_t>(
        std::min<int64_t>(static_cast<int64_t>(req.block_hashes.size()),
                          vllm_max_cache_hit_blocks(req.num_tokens, params_.block_tokens)));
    index_.prefix_overlap(req.block_hashes.first(cap), overlap_);
    const RouteDecision d = decide_route(policy_, params_, req, overlap_, loads, rr_counter_++);
    if (index_.mode() == KvIndexMode::kApproximate)
        index_.record_routed(d.replica, req.block_hashes, now_s);
    return d;
}

}  // namespace kvshard
