// Block manager and prefix-cache hashing, each next to its ceiling in the same run.
//
//  BM_HashVsRawXxh3/<block_size>: chained block hashing of a 100k-token sequence
//    (BlockHasher::hash_blocks) next to raw XXH3_128bits over the very same encoded bytes, already
//    laid out contiguously. Both are timed inside every iteration, alternately; counters:
//    hash_GBps, raw_GBps (encoded bytes / s) and ratio = raw time / hash time (goal >= 0.8).
//  BM_LookupAllocateFree/<block_size>/<warm>: lookup + allocate + free of a 100k-token sequence
//    (token ids). warm=1: the prompt is cached (all hits); warm=0: every prompt is new, and the
//    pool is full of cached blocks, so allocate evicts. ops_per_s = sequences per second of thread
//    CPU time (one op = lookup + allocate + free); hash_floor_ratio = time of one raw XXH3 pass
//    over the prompt's encoded blocks (allocate must hash every full block at least once) / time
//    of the three operations. A warm lookup hashes the prompt a second time; a cold one stops at
//    the first missing block.
//  BM_LookupAllocateFreeHashes/<block_size>/<warm>: the same with precomputed block hashes
//    (lookup_hashes + allocate_with_hashes), as a trace simulator drives it (no hashing at all:
//    index probes, LRU and free-list work only).
#include <benchmark/benchmark.h>
// The same inline XXH3 build as src/cache/block_hash.cpp, so the ratio compares like with like.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <cstring>
#include <ctime>
#include <random>

#include "kvshard/cache/block_manager.h"

namespace kvshard {
namespace {

constexpr int64_t kSeqTokens = 100'000;

std::vector<int32_t> random_tokens(size_t n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int32_t> d(0, 150'000);
    std::vector<int32_t> t(n);
    for (auto& x : t) x = d(rng);
    return t;
}

// The canonical bytes of every full block of `tokens`, one after the other.
std::vector<std::byte> encode_all(const std::vector<int32_t>& tokens, int bs, size_t& stride) {
    const auto hashes = hash_token_blocks(tokens, bs);
    stride = 16 + 4 * static_cast<size_t>(bs);
    std::vector<std::byte> out(hashes.size() * stride);
    for (size_t i = 0; i < hashes.size(); ++i) {
        const auto enc = encode_block(
            i == 0 ? kRootParentHash : hashes[i - 1],
            std::span(tokens).subspan(i * static_cast<size_t>(bs), static_cast<size_t>(bs)));
        std::memcpy(out.data() + i * stride, enc.data(), stride);
    }
    return out;
}

void raw_xxh3(const std::vector<std::byte>& bytes, size_t stride, std::vector<BlockHash>& out) {
    out.clear();
    for (size_t off = 0; off + stride <= bytes.size(); off += stride) {
        const XXH128_hash_t h = XXH3_128bits(bytes.data() + off, stride);
        out.push_back({h.low64, h.high64});
    }
}

// Per-thread CPU time: on a shared machine, time the thread spent descheduled does not count.
double thread_seconds() {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

void BM_HashVsRawXxh3(benchmark::State& state) {
    const int bs = static_cast<int>(state.range(0));
    const auto tokens = random_tokens(kSeqTokens, 1);
    size_t stride = 0;
    const auto bytes = encode_all(tokens, bs, stride);
    BlockHasher hasher;
    std::vector<BlockHash> a, b;
    a.reserve(bytes.size() / stride);
    b.reserve(bytes.size() / stride);
    double t_hash = 0, t_raw = 0;
    for (auto _ : state) {
        double t0 = thread_seconds();
        a.clear();
        hasher.hash_blocks(kRootParentHash, tokens, bs, {}, a);
        benchmark::DoNotOptimize(a.data());
        t_hash += (thread_seconds() - t0);
        t0 = thread_seconds();
        raw_xxh3(bytes, stride, b);
        benchmark::DoNotOptimize(b.data());
        t_raw += (thread_seconds() - t0);
    }
    if (a != b) state.SkipWithError("block hashes differ from raw XXH3 over the same bytes");
    const double total =
        static_cast<double>(bytes.size()) * static_cast<double>(state.iterations());
    state.counters["hash_GBps"] = total / t_hash / 1e9;
    state.counters["raw_GBps"] = total / t_raw / 1e9;
    state.counters["ratio"] = t_raw / t_hash;
    state.counters["blocks"] = static_cast<double>(a.size());
}
BENCHMARK(BM_HashVsRawXxh3)->Arg(16)->Arg(64)->Arg(256)->Arg(512)->Unit(benchmark::kMicrosecond);

// A pool of `seqs_in_pool` 100k-token sequences' worth of blocks, full of cached blocks of
// other prompts, so that cold allocations must evict.
struct Fixture {
    BlockManager manager;
    std::vector<int32_t> warm_prompt;
    std::vector<std::vector<int32_t>> cold_prompts;
};

Fixture make_fixture(int bs) {
    const int64_t blocks_per_seq = (kSeqTokens + bs - 1) / bs;
    Fixture f{BlockManager({blocks_per_seq * 3, bs, true}), random_tokens(kSeqTokens, 7), {}};
    for (uint32_t i = 0; i < 4; ++i) f.cold_prompts.push_back(random_tokens(kSeqTokens, 100 + i));
    // Fill the cache: three prompts allocated and freed.
    for (SeqId s = 0; s < 3; ++s) {
        f.manager.allocate(s, random_tokens(kSeqTokens, 200 + static_cast<uint32_t>(s)));
        f.manager.free(s);
    }
    return f;
}

void BM_LookupAllocateFree(benchmark::State& state) {
    const int bs = static_cast<int>(state.range(0));
    const bool warm = state.range(1) != 0;
    Fixture f = make_fixture(bs);
    if (warm) {
        f.manager.allocate(1000, f.warm_prompt);
        f.manager.free(1000);
    }
    size_t stride = 0;
    const auto bytes = encode_all(f.warm_prompt, bs, stride);
    std::vector<BlockHash> raw;
    SeqId id = 2000;
    size_t k = 0;
    int64_t hit = 0;
    double t_ops = 0, t_raw = 0;
    for (auto _ : state) {
        const auto& prompt = warm ? f.warm_prompt : f.cold_prompts[k++ % f.cold_prompts.size()];
        double t0 = thread_seconds();
        const PrefixMatch m = f.manager.lookup(prompt);
        const AllocResult r = f.manager.allocate(id, prompt);
        f.manager.free(id++);
        t_ops += (thread_seconds() - t0);
        benchmark::DoNotOptimize(m.num_tokens);
        hit += r.cached_tokens;
        t0 = thread_seconds();
        raw_xxh3(bytes, stride, raw);
        benchmark::DoNotOptimize(raw.data());
        t_raw += (thread_seconds() - t0);
    }
    state.counters["ops_per_s"] = static_cast<double>(state.iterations()) / t_ops;
    state.counters["tokens_per_s"] =
        static_cast<double>(state.iterations()) * static_cast<double>(kSeqTokens) / t_ops;
    state.counters["hit_rate"] =
        static_cast<double>(hit) / (static_cast<double>(state.iterations()) * kSeqTokens);
    state.counters["hash_floor_ratio"] = t_raw / t_ops;
    state.counters["evictions"] = static_cast<double>(f.manager.metrics().evictions);
}
BENCHMARK(BM_LookupAllocateFree)
    ->Args({16, 1})
    ->Args({16, 0})
    ->Args({512, 1})
    ->Args({512, 0})
    ->Unit(benchmark::kMicrosecond);

void BM_LookupAllocateFreeHashes(benchmark::State& state) {
    const int bs = static_cast<int>(state.range(0));
    const bool warm = state.range(1) != 0;
    Fixture f = make_fixture(bs);
    const auto warm_hashes = hash_token_blocks(f.warm_prompt, bs);
    std::vector<std::vector<BlockHash>> cold;
    for (const auto& p : f.cold_prompts) cold.push_back(hash_token_blocks(p, bs));
    if (warm) {
        f.manager.allocate_with_hashes(1000, warm_hashes, kSeqTokens);
        f.manager.free(1000);
    }
    SeqId id = 2000;
    size_t k = 0;
    double t_ops = 0;
    for (auto _ : state) {
        const auto& h = warm ? warm_hashes : cold[k++ % cold.size()];
        const double t0 = thread_seconds();
        const PrefixMatch m = f.manager.lookup_hashes(h);
        benchmark::DoNotOptimize(m.num_tokens);
        f.manager.allocate_with_hashes(id, h, kSeqTokens);
        f.manager.free(id++);
        t_ops += thread_seconds() - t0;
    }
    state.counters["ops_per_s"] = static_cast<double>(state.iterations()) / t_ops;
    state.counters["evictions"] = static_cast<double>(f.manager.metrics().evictions);
}
BENCHMARK(BM_LookupAllocateFreeHashes)
    ->Args({16, 1})
    ->Args({16, 0})
    ->Args({512, 1})
    ->Args({512, 0})
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace kvshard

BENCHMARK_MAIN();
