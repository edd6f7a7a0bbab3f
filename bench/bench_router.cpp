// Routing decisions per second: 16 replicas, 100-block requests, an exact index holding 16 x 2000
// blocks. The floor any hash index pays is one lookup per request block: BM_RawLookups does exactly
// those 100 lookups in a plain std::unordered_map of the same keys; the ratio route / raw says what
// the router adds on top (the AND of replica masks, the policy).
#include <benchmark/benchmark.h>

#include <random>
#include <unordered_map>
#include <vector>

#include "kvshard/router/kv_index.h"
#include "kvshard/router/policy.h"

namespace kvshard {
namespace {

constexpr int kReplicas = 16;
constexpr int kRequestBlocks = 100;
constexpr int kBlocksPerReplica = 2000;

BlockHash hash_of(uint64_t id) {
    uint64_t z = id + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return {z ^ (z >> 31), id};
}

struct Fixture {
    KvIndex index{kReplicas};
    std::vector<std::vector<BlockHash>> requests;  // 256 requests of 100 blocks
    std::vector<ReplicaLoad> loads;
    std::unordered_map<BlockHash, uint64_t, BlockHashHasher> raw;

    Fixture() {
        std::mt19937_64 rng(7);
        // Each replica holds 20 conversations of 100 blocks (ids distinct per conversation).
        std::vector<std::vector<BlockHash>> convs;
        for (int r = 0; r < kReplicas; ++r)
            for (int c = 0; c < kBlocksPerReplica / kRequestBlocks; ++c) {
                std::vector<BlockHash> chain;
                const uint64_t base =
                    (static_cast<uint64_t>(r) * 100 + static_cast<uint64_t>(c)) * 1000;
                for (int b = 0; b < kRequestBlocks; ++b)
                    chain.push_back(hash_of(base + static_cast<uint64_t>(b)));
                index.block_stored(r, chain);
                for (const auto& h : chain) raw[h] |= uint64_t{1} << r;
                convs.push_back(chain);
            }
        // Requests: a random conversation's first 20-100 blocks, then new blocks up to 100.
        for (int i = 0; i < 256; ++i) {
            const auto& conv = convs[rng() % convs.size()];
            const int keep = 20 + static_cast<int>(rng() % 81);
            std::vector<BlockHash> q(conv.begin(), conv.begin() + keep);
            while (static_cast<int>(q.size()) < kRequestBlocks)
                q.push_back(hash_of(1'000'000'000 + rng() % 1'000'000));
            requests.push_back(q);
        }
        for (int r = 0; r < kReplicas; ++r)
            loads.push_back(
                {static_cast<int64_t>(rng() % 20000), static_cast<int64_t>(rng() % 1500), 2000});
    }
};

Fixture& fixture() {
    static Fixture f;
    return f;
}

void BM_Route(benchmark::State& state) {
    const auto policy = static_cast<RoutingPolicy>(state.range(0));
    Fixture& f = fixture();
    Router router(kReplicas, policy);
    // Share the populated index (copy once, outside the timed loop).
    router.index() = f.index;
    size_t i = 0;
    for (auto _ : state) {
        const auto& q = f.requests[i++ & 255];
        benchmark::DoNotOptimize(router.route({q, kRequestBlocks * 512}, f.loads, 0.0));
    }
    state.SetLabel(std::string(routing_policy_name(policy)));
    state.counters["decisions_per_s"] =
        benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Route)->DenseRange(0, 4);

void BM_PrefixOverlap(benchmark::State& state) {
    Fixture& f = fixture();
    std::vector<int> out(kReplicas);
    size_t i = 0;
    for (auto _ : state) {
        f.index.prefix_overlap(f.requests[i++ & 255], out);
        benchmark::DoNotOptimize(out.data());
    }
    state.counters["lookups_per_s"] =
        benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_PrefixOverlap);

// The floor: 100 finds in a plain unordered_map of the same keys (no early stop).
void BM_RawLookups(benchmark::State& state) {
    Fixture& f = fixture();
    size_t i = 0;
    for (auto _ : state) {
        uint64_t acc = 0;
        for (const auto& h : f.requests[i++ & 255]) {
            const auto it = f.raw.find(h);
            acc ^= it == f.raw.end() ? 0 : it->second;
        }
        benchmark::DoNotOptimize(acc);
    }
    state.counters["requests_per_s"] =
        benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_RawLookups);

}  // namespace
}  // namespace kvshard

BENCHMARK_MAIN();
