#include "kvshard/sim/simulator.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>
#include <numeric>

#include "kvshard/common/error.h"
#include "sim/replica_cache.h"

namespace kvshard {

using sim_detail::ReplicaCache;

void SimConfig::validate() const {
    require(num_replicas >= 1 && num_replicas <= KvIndex::kMaxReplicas, "simulate: ", num_replicas,
            " replicas; need 1 to ", KvIndex::kMaxReplicas);
    require(replica_capacity_blocks >= 1,
            "simulate: each replica needs at least one KV block, got ", replica_capacity_blocks);
    // Each simulated block costs its bookkeeping (about 64 bytes in the block manager and index):
    // the pools of all replicas together are held to 2^26 blocks (~4 GiB).
    require(replica_capacity_blocks <= (int64_t{1} << 26) / num_replicas,
            "simulate: ", num_replicas, " replicas of ", replica_capacity_blocks,
            " KV blocks exceed the 2^26 blocks the simulator holds (about 64 bytes each); use "
            "fewer or larger blocks (at most ",
            (int64_t{1} << 26) / num_replicas, " per replica here)");
    params.validate();
    require(index_mode == KvIndexMode::kExact || std::isfinite(index_ttl_s),
            "simulate: the approximate index's TTL must be finite, got ", index_ttl_s);
    require(max_batch >= 1, "simulate: max_batch must be at least 1, got ", max_batch);
    require(max_prefill_tokens >= 1, "simulate: max_prefill_tokens must be at least 1, got ",
            max_prefill_tokens);
    require(index_mode == KvIndexMode::kExact || index_ttl_s > 0,
            "simulate: the approximate index needs a positive TTL, got ", index_ttl_s);
}

double percentile(std::vector<double> values, double p) {
    if (values.empty()) return 0.0;
    std::sort(values.begin(), values.end());
    const double pos = std::clamp(p, 0.0, 100.0) / 100.0 * static_cast<double>(values.size() - 1);
    const size_t lo = static_cast<size_t>(std::floor(pos));
    const size_t hi = std::min(lo + 1, values.size() - 1);
    return values[lo] + (values[hi] - values[lo]) * (pos - static_cast<double>(lo));
}

namespace {

struct Running {
    int32_t req;
    int64_t remaining;  // output tokens still to generate
};

struct Replica {
    Replica(int64_t capacity, int block_tokens, bool eagle_block_drop)
        : cache(capacity, block_tokens, eagle_block_drop) {}
    ReplicaCache cache;
    std::deque<int32_t> waiting;
    std::vector<Running> running;
    std::vector<int32_t> prefilling;  // admitted in the current step
    bool busy = false;
    double step_end = 0;
    int64_t queued_prefill_tokens = 0;  // waiting prompts + this step's uncached prompt tokens
    int64_t context_tokens = 0;         // KV tokens of the running requests
};

class Engine {
  public:
    Engine(const Trace& trace, const SimConfig& cfg, const ServiceModel& service)
        : trace_(trace),
          cfg_(cfg),
          service_(service),
          bt_(trace.block_tokens),
          router_(cfg.num_replicas, cfg.policy, params_for(cfg, trace), cfg.index_mode,
                  cfg.index_ttl_s) {
        replicas_.reserve(static_cast<size_t>(cfg.num_replicas));
        for (int r = 0; r < cfg.num_replicas; ++r) {
            replicas_.emplace_back(cfg.replica_capacity_blocks, bt_, cfg.eagle_block_drop);
            router_.index().set_eagle_block_drop(r, cfg.eagle_block_drop);
            if (cfg.index_mode == KvIndexMode::kExact)
                replicas_.back().cache.publish_to(&router_.index(), r);
        }
        const size_t n = trace.requests.size();
        ttft_.assign(n, -1.0);
        new_tokens_.assign(n, 0);
        rep_.tokens_per_replica.assign(static_cast<size_t>(cfg.num_replicas), 0);
        rep_.requests_per_replica.assign(static_cast<size_t>(cfg.num_replicas), 0);
        rep_.reasons.assign(static_cast<size_t>(RouteReason::kSpill) + 1, 0);
        loads_.resize(static_cast<size_t>(cfg.num_replicas));
    }

    PolicyReport run(const SimProgress& progress) {
        rep_.name = std::string(routing_policy_name(cfg_.policy));
        const auto& reqs = trace_.requests;
        const int64_t total = static_cast<int64_t>(reqs.size());
        for (int64_t i = 0; i < total; ++i) {
            const TraceRequest& q = reqs[static_cast<size_t>(i)];
            for (auto& r : replicas_) advance(r, q.arrival_s);
            route(static_cast<int32_t>(i), q.arrival_s);
            // Requests arriving at the same instant are all queued before an idle replica starts.
            if (i + 1 == total || reqs[static_cast<size_t>(i + 1)].arrival_s > q.arrival_s)
                for (auto& r : replicas_)
                    if (!r.busy) start_step(r, q.arrival_s);
            if (progress && (i % 256 == 0 || i + 1 == total)) progress(i + 1, total);
        }
        for (auto& r : replicas_) advance(r, std::numeric_limits<double>::infinity());
        finish_report();
        return rep_;
    }

  private:
    static PolicyParams params_for(const SimConfig& cfg, const Trace& trace) {
        PolicyParams p = cfg.params;
        p.block_tokens = trace.block_tokens;
        return p;
    }

    void route(int32_t i, double now) {
        const TraceRequest& q = trace_.requests[static_cast<size_t>(i)];
        for (size_t r = 0; r < replicas_.size(); ++r) {
            loads_[r].queued_prefill_tokens = replicas_[r].queued_prefill_tokens;
            loads_[r].active_blocks = replicas_[r].cache.used_blocks();
            loads_[r].capacity_blocks = cfg_.replica_capacity_blocks;
        }
        const RouteDecision d = router_.route({trace_.blocks(q), q.input_tokens}, loads_, now);
        ++rep_.reasons[static_cast<size_t>(d.reason)];
        Replica& r = replicas_[static_cast<size_t>(d.replica)];
        rep_.tokens_per_replica[static_cast<size_t>(d.replica)] += q.input_tokens + q.output_tokens;
        ++rep_.requests_per_replica[static_cast<size_t>(d.replica)];
        total_blocks_ += q.num_blocks;
        total_tokens_ += q.input_tokens;
        r.waiting.push_back(i);
        r.queued_prefill_tokens += q.input_tokens;
    }

    void advance(Replica& r, double t) {
        while (r.busy && r.step_end <= t) finish_step(r);
    }

    void start_step(Replica& r, double t) {
        int64_t prefill_tokens = 0;
        while (!r.waiting.empty() &&
               static_cast<int>(r.running.size() + r.prefilling.size()) < cfg_.max_batch) {
            const int32_t i = r.waiting.front();
            const TraceRequest& q = trace_.requests[static_cast<size_t>(i)];
            if (!r.prefilling.empty() && prefill_tokens + q.input_tokens > cfg_.max_prefill_tokens)
                break;
            const auto blocks = trace_.blocks(q);
            const size_t full = static_cast<size_t>(q.input_tokens / bt_);
            const auto hit = r.cache.admit(i, blocks.first(full), q.input_tokens, q.output_tokens);
            if (!hit) {
                if (r.running.empty() && r.prefilling.empty()) {
                    // Even an idle replica cannot hold it: it can never run.
                    ++rep_.rejected;
                    r.waiting.pop_front();
                    r.queued_prefill_tokens -= q.input_tokens;
                    continue;
                }
                break;  // head of line waits for blocks
            }
            r.waiting.pop_front();
            const int64_t hit_tokens = *hit * bt_;
            hit_blocks_ += *hit;
            hit_tokens_ += hit_tokens;
            const int64_t fresh = q.input_tokens - hit_tokens;
            new_tokens_[static_cast<size_t>(i)] = fresh;
            r.queued_prefill_tokens -= hit_tokens;
            prefill_tokens += fresh;
            r.prefilling.push_back(i);
        }
        if (r.prefilling.empty() && r.running.empty()) {
            r.busy = false;
            return;
        }
        double dt = 0;
        // A fully cached prompt still runs its last token to produce logits.
        if (!r.prefilling.empty()) dt += service_.prefill_s(std::max<int64_t>(prefill_tokens, 1));
        if (!r.running.empty())
            dt += service_.decode_step_s(static_cast<int64_t>(r.running.size()), r.context_tokens);
        r.busy = true;
        r.step_end = t + dt;
    }

    void complete(Replica& r, int32_t i, double t) {
        r.cache.release(i);
        ++rep_.completed;
        last_completion_ = std::max(last_completion_, t);
    }

    void finish_step(Replica& r) {
        const double t = r.step_end;
        for (size_t k = 0; k < r.running.size();) {
            Running& run = r.running[k];
            ++r.context_tokens;
            if (--run.remaining == 0) {
                const TraceRequest& q = trace_.requests[static_cast<size_t>(run.req)];
                r.context_tokens -= q.input_tokens + q.output_tokens;
                complete(r, run.req, t);
                run = r.running.back();
                r.running.pop_back();
            } else {
                ++k;
            }
        }
        for (const int32_t i : r.prefilling) {
            const TraceRequest& q = trace_.requests[static_cast<size_t>(i)];
            ttft_[static_cast<size_t>(i)] = t - q.arrival_s;
            output_tokens_ += q.output_tokens;
            r.queued_prefill_tokens -= new_tokens_[static_cast<size_t>(i)];
            if (q.output_tokens <= 1) {
                complete(r, i, t);
            } else {
                r.running.push_back({i, q.output_tokens - 1});
                r.context_tokens += q.input_tokens + 1;
            }
        }
        r.prefilling.clear();
        start_step(r, t);
    }

    void finish_report() {
        rep_.hits.hit_blocks = hit_blocks_;
        rep_.hits.hit_tokens = hit_tokens_;
        rep_.hits.total_blocks = total_blocks_;
        rep_.hits.total_tokens = total_tokens_;
        rep_.hits.block_hit_rate =
            total_blocks_ ? static_cast<double>(hit_blocks_) / total_blocks_ : 0;
        rep_.hits.token_hit_rate =
            total_tokens_ ? static_cast<double>(hit_tokens_) / total_tokens_ : 0;
        const auto& t = rep_.tokens_per_replica;
        const double mean = static_cast<double>(std::accumulate(t.begin(), t.end(), int64_t{0})) /
                            static_cast<double>(t.size());
        rep_.load_max_over_mean =
            mean > 0 ? static_cast<double>(*std::max_element(t.begin(), t.end())) / mean : 0;
        std::vector<double> ttft;
        for (double v : ttft_)
            if (v >= 0) ttft.push_back(v);
        if (!ttft.empty()) {
            rep_.ttft_mean_s =
                std::accumulate(ttft.begin(), ttft.end(), 0.0) / static_cast<double>(ttft.size());
            rep_.ttft_p50_s = percentile(ttft, 50);
            rep_.ttft_p90_s = percentile(ttft, 90);
            rep_.ttft_p99_s = percentile(ttft, 99);
        }
        if (!trace_.requests.empty()) {
            rep_.makespan_s = std::max(0.0, last_completion_ - trace_.requests.front().arrival_s);
            if (rep_.makespan_s > 0) {
                rep_.requests_per_s = static_cast<double>(rep_.completed) / rep_.makespan_s;
                rep_.output_tokens_per_s = static_cast<double>(output_tokens_) / rep_.makespan_s;
            }
        }
        for (const auto& r : replicas_) rep_.evicted_blocks += r.cache.evictions();
    }

    const Trace& trace_;
    const SimConfig& cfg_;
    const ServiceModel& service_;
    const int bt_;
    Router router_;
    std::vector<Replica> replicas_;
    std::vector<ReplicaLoad> loads_;
    std::vector<double> ttft_;
    std::vector<int64_t> new_tokens_;
    PolicyReport rep_;
    int64_t hit_blocks_ = 0, hit_tokens_ = 0, total_blocks_ = 0, total_tokens_ = 0;
    int64_t output_tokens_ = 0;
    double last_completion_ = 0;
};

}  // namespace

PolicyReport simulate(const Trace& trace, const SimConfig& config, const ServiceModel& service,
                      const SimProgress& progress) {
    config.validate();
    Engine engine(trace, config, service);
    return engine.run(progress);
}

HitRates pooled_lru_hit_rates(const Trace& trace, int64_t capacity_blocks, bool eagle_block_drop) {
    require(capacity_blocks >= 1, "pooled LRU: capacity must be at least one block, got ",
            capacity_blocks);
    ReplicaCache cache(capacity_blocks, trace.block_tokens, eagle_block_drop);
    HitRates h;
    const int64_t bt = trace.block_tokens;
    for (size_t i = 0; i < trace.requests.size(); ++i) {
        const TraceRequest& q = trace.requests[i];
        const auto blocks = trace.blocks(q);
        h.total_blocks += q.num_blocks;
        h.total_tokens += q.input_tokens;
        const auto hit =
            cache.admit(static_cast<int64_t>(i),
                        blocks.first(static_cast<size_t>(q.input_tokens / bt)), q.input_tokens, 0);
        if (!hit) continue;  // larger than the whole pool
        h.hit_blocks += *hit;
        h.hit_tokens += *hit * bt;
        cache.release(static_cast<int64_t>(i));
    }
    h.block_hit_rate = h.total_blocks ? static_cast<double>(h.hit_blocks) / h.total_blocks : 0;
    h.token_hit_rate = h.total_tokens ? static_cast<double>(h.hit_tokens) / h.total_tokens : 0;
    return h;
}

}  // namespace kvshard
