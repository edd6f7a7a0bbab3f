#pragma once
// Test harness: pools on every rank of both sides, source KV whose every element encodes its own
// (layer, kv, head, token, dim), and a checker that says whether each destination pool holds
// exactly what its layout says (and nothing else).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kvshard/cache/block_pool.h"
#include "kvshard/layout/kv_layout.h"
#include "kvshard/model/catalog.h"
#include "kvshard/transfer/pack.h"
#include "kvshard/transfer/transfer_plan.h"

namespace kvshard::testing {

constexpr uint32_t kSentinel = 0xABABABABu;  // untouched destination bytes
constexpr uint32_t kGarbage = 0xDEADBEEFu;   // source slots that hold no token of the request

// A llama-shaped small model: 32 query heads, 8 KV heads (the seed's GQA(8)), fp32 so that every
// element can carry a unique 32-bit code.
inline ModelSpec llama_mini(int layers = 4, int kv_heads = 8, int head_dim = 16) {
    ModelSpec m = catalog_model("tiny");
    m.name = "llama-mini";
    m.num_layers = layers;
    m.num_heads = 32;
    m.num_kv_heads = kv_heads;
    m.head_dim = head_dim;
    m.hidden = 32 * head_dim;
    m.attention = kv_heads == 32  ? AttentionKind::kMha
                  : kv_heads == 1 ? AttentionKind::kMqa
                                  : AttentionKind::kGqa;
    return m;
}

// tiny-mla with DeepSeek-V3.2's sparse-attention indexer on every layer: each token's page vector
// is the 40-wide fp32 latent, then 16 fp8 key values and one fp32 scale (5 more fp32 elements).
inline ModelSpec sparse_mla_mini() {
    ModelSpec m = catalog_model("tiny-mla");
    m.name = "sparse-mla-mini";
    m.indexer = {.heads = 2, .head_dim = 16, .topk = 32, .dtype = DType::kFp8, .scale_bytes = 4};
    return m;
}

// Every element's code: unique over (layer < 32, kv, head < 64, token < 1024, dim < 64), below
// 2^27, so never 0, the sentinel or the garbage value.
inline uint32_t element_code(int layer, int kv, int head, int64_t token, int dim) {
    return static_cast<uint32_t>(
        ((((uint64_t(layer) * 2 + kv) * 64 + head) * 1024 + token) * 64 + dim) + 1);
}

struct Side {
    TransferEndpoint endpoint;
    std::vector<std::unique_ptr<BlockPool>> pools;  // by rank; null outside the endpoint's replica
};

inline TransferEndpoint make_endpoint(const ModelSpec& m, const std::string& parallel,
                                      int block_size, PageOrder order, int64_t num_tokens,
                                      int dp = 0, uint64_t shuffle_seed = 0) {
    TransferEndpoint e;
    e.layout = make_layout(m, parse_parallel_config(parallel));
    e.dp = dp;
    e.block_size = block_size;
    e.order = order;
    e.block_tables = sequential_block_tables(e.layout, block_size, num_tokens);
    if (shuffle_seed != 0) {
        // Spread each CP rank's blocks over a pool twice as large, in random order.
        std::mt19937_64 rng(shuffle_seed);
        for (auto& t : e.block_tables) {
            std::vector<int32_t> ids(t.size() * 2 + 1);
            for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i);
            std::shuffle(ids.begin(), ids.end(), rng);
            for (size_t i = 0; i < t.size(); ++i) t[i] = ids[i];
        }
    }
    return e;
}

inline int64_t pool_blocks(const TransferEndpoint& e) {
    int64_t n = 1;
    for (const auto& t : e.block_tables)
        for (int32_t b : t) n = std::max<int64_t>(n, b + 1);
    return n;
}

// Fills pool elements as uint32 values: fn(rank, local_layer, kv, local_head, block, slot, dim).
template <typename Fn>
void for_each_token_element(const TransferEndpoint& e, int rank, int64_t num_tokens, Fn&& fn) {
    const RankKv& r = e.layout.ranks[rank];
    const PageGeometry g = rank_page_geometry(e.layout, rank, e.block_size, e.order);
    const auto ranges = cp_token_ranges(e.layout.parallel, r.coord.cp, num_tokens);
    int64_t j = 0;
    for (const auto& range : ranges)
        for (int64_t t = range.begin; t < range.end; ++t, ++j) {
            const int32_t block = e.block_tables[r.coord.cp][j / e.block_size];
            const int slot = static_cast<int>(j % e.block_size);
            for (int l = 0; l < g.num_layers; ++l)
                for (int kv = 0; kv < g.kv_factor; ++kv)
                    for (int h = 0; h < g.num_heads; ++h)
                        for (int d = 0; d < g.head_dim; ++d)
                            fn(r.layer_begin + l, l, kv,
                               (e.layout.model.is_mla() ? 0 : r.kv_heads[h]), h, t, block, slot, d);
        }
}

inline uint32_t* elem_ptr(BlockPool& pool, int local_layer, int kv, int64_t block, int local_head,
                          int slot, int d) {
    auto* page = reinterpret_cast<uint32_t*>(pool.page(local_layer, kv, block));
    return page + pool.geometry().elem_in_page(local_head, slot, d);
}

inline void fill_u32(BlockPool& pool, uint32_t v) {
    auto a = pool.arena();
    auto* p = reinterpret_cast<uint32_t*>(a.data());
    std::fill(p, p + a.size() / 4, v);
}

// memory: kShareable lets a destination read the pools in place (direct read).
inline Side make_source(const TransferEndpoint& e, int64_t num_tokens,
                        PoolMemory memory = PoolMemory::kPrivate) {
    Side s;
    s.endpoint = e;
    s.pools.resize(e.layout.world_size());
    for (const auto& r : e.layout.ranks) {
        if (r.coord.dp != e.dp) continue;
        auto pool = std::make_unique<BlockPool>(
            rank_page_geometry(e.layout, r.coord.rank, e.block_size, e.order), pool_blocks(e),
            memory);
        fill_u32(*pool, kGarbage);
        for_each_token_element(e, r.coord.rank, num_tokens,
                               [&](int layer, int ll, int kv, int head, int lh, int64_t t,
                                   int32_t b, int slot, int d) {
                                   *elem_ptr(*pool, ll, kv, b, lh, slot, d) =
                                       element_code(layer, kv, head, t, d);
                               });
        s.pools[r.coord.rank] = std::move(pool);
    }
    return s;
}

// The seals a prefill would make of each source rank's pool after writing it (HND sources; empty
// for NHD): every layer, each CP rank's blocks over the tokens it holds.
inline std::vector<std::unique_ptr<SourceChecksums>> seal_source(const Side& src,
                                                                 int64_t num_tokens) {
    const TransferEndpoint& e = src.endpoint;
    std::vector<std::unique_ptr<SourceChecksums>> sums(src.pools.size());
    if (e.order != PageOrder::kHnd) return sums;
    for (const auto& r : e.layout.ranks) {
        const auto& pool = src.pools[static_cast<size_t>(r.coord.rank)];
        if (!pool) continue;
        int64_t held = 0;
        for (const auto& tr : cp_token_ranges(e.layout.parallel, r.coord.cp, num_tokens))
            held += tr.size();
        auto s = std::make_unique<SourceChecksums>(*pool);
        for (int l = 0; l < pool->geometry().num_layers; ++l)
            s->seal_sequence(l, e.block_tables[static_cast<size_t>(r.coord.cp)], held);
        sums[static_cast<size_t>(r.coord.rank)] = std::move(s);
    }
    return sums;
}

inline Side make_destination(const TransferEndpoint& e) {
    Side s;
    s.endpoint = e;
    s.pools.resize(e.layout.world_size());
    for (const auto& r : e.layout.ranks) {
        if (r.coord.dp != e.dp) continue;
        s.pools[r.coord.rank] = std::make_unique<BlockPool>(
            rank_page_geometry(e.layout, r.coord.rank, e.block_size, e.order), pool_blocks(e));
        fill_u32(*s.pools[r.coord.rank], kSentinel);
    }
    return s;
}

// What a destination pool must hold: codes at the request's slots, the sentinel everywhere else.
// Tokens before `from_token` (a prefix the destination already holds) stay kSentinel.
inline std::vector<uint32_t> expected_pool(const TransferEndpoint& e, int rank, int64_t num_tokens,
                                           const BlockPool& like, int64_t from_token = 0) {
    BlockPool want(like.geometry(), like.num_blocks());
    fill_u32(want, kSentinel);
    for_each_token_element(
        e, rank, num_tokens,
        [&](int layer, int ll, int kv, int head, int lh, int64_t t, int32_t b, int slot, int d) {
            if (t >= from_token)
                *elem_ptr(want, ll, kv, b, lh, slot, d) = element_code(layer, kv, head, t, d);
        });
    const auto* p = reinterpret_cast<const uint32_t*>(want.arena().data());
    return {p, p + want.arena().size() / 4};
}

struct RunResult {
    int64_t bytes = 0;
    std::vector<int64_t> bytes_to;  // by destination rank
};

// Packs every message from its source pool and unpacks it into its destination pool.
inline RunResult run_plan(const TransferPlan& plan, TransferMode mode, const Side& src, Side& dst) {
    mode = resolve_mode(plan, mode);
    RunResult r;
    r.bytes_to.assign(dst.pools.size(), 0);
    std::vector<std::byte> buf;
    for (const auto& msg : plan.messages) {
        buf.assign(static_cast<size_t>(msg.bytes), std::byte{0});
        pack_message(plan, msg, mode, *src.pools.at(msg.src_rank), buf);
        unpack_message(plan, msg, mode, buf, *dst.pools.at(msg.dst_rank));
        r.bytes += msg.bytes;
        r.bytes_to[msg.dst_rank] += msg.bytes;
    }
    return r;
}

// How many times each byte of each destination pool is written by the plan (unpacking a payload of
// 0x01 bytes into a zeroed pool per message and summing).
inline std::vector<std::vector<uint8_t>> write_counts(const TransferPlan& plan, TransferMode mode,
                                                      const Side& dst) {
    mode = resolve_mode(plan, mode);
    std::vector<std::vector<uint8_t>> counts(dst.pools.size());
    for (size_t r = 0; r < dst.pools.size(); ++r)
        if (dst.pools[r]) counts[r].assign(dst.pools[r]->arena().size(), 0);
    for (const auto& msg : plan.messages) {
        const BlockPool& like = *dst.pools.at(msg.dst_rank);
        BlockPool scratch(like.geometry(), like.num_blocks());
        std::vector<std::byte> ones(static_cast<size_t>(msg.bytes), std::byte{1});
        unpack_message(plan, msg, mode, ones, scratch);
        auto a = scratch.arena();
        for (size_t i = 0; i < a.size(); ++i) counts[msg.dst_rank][i] += static_cast<uint8_t>(a[i]);
    }
    return counts;
}

}  // namespace kvshard::testing
