#include "kvshard/cache/block_pool.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>

#include "kvshard/common/error.h"
#include "kvshard/layout/kv_layout.h"

namespace kvshard {

PageOrder parse_page_order(std::string_view s) {
    if (s == "hnd" || s == "HND") return PageOrder::kHnd;
    if (s == "nhd" || s == "NHD") return PageOrder::kNhd;
    throw Error(detail::concat("page order must be one of hnd, nhd, got '", s, "'"));
}

namespace {
void check_geometry(const PageGeometry& g, int64_t num_blocks) {
    require(g.block_size >= 1, "block size must be at least 1 token, got ", g.block_size);
    require(g.num_layers >= 1 && g.num_heads >= 1 && g.head_dim >= 1 &&
                (g.kv_factor == 1 || g.kv_factor == 2),
            "page geometry needs at least one layer, head and element and kv_factor 1 or 2");
    require(num_blocks >= 1, "a block pool needs at least one block, got ", num_blocks);
}
}  // namespace

BlockPool::BlockPool(PageGeometry geometry, int64_t num_blocks, ExternalMemory memory)
    : geometry_(geometry), num_blocks_(num_blocks), external_(true) {
    check_geometry(geometry_, num_blocks_);
    require(memory.base != nullptr, "external KV memory is null: give the base of the buffer");
    require(memory.bytes >= static_cast<size_t>(arena_bytes()), "external KV memory of ",
            memory.bytes, " bytes is too small for ", num_blocks_, " blocks of ",
            geometry_.block_bytes(), " bytes (", arena_bytes(),
            " bytes): give a larger buffer or fewer blocks");
    require(reinterpret_cast<uintptr_t>(memory.base) % 64 == 0, "external KV memory at ",
            static_cast<const void*>(memory.base),
            " is not 64-byte aligned: allocate it on a 64-byte boundary (e.g. aligned_alloc, or a "
            "numpy array sliced at a 64-byte offset)");
    base_ = memory.base;
}

BlockPool::BlockPool(PageGeometry geometry, int64_t num_blocks, PoolMemory memory)
    : geometry_(geometry), num_blocks_(num_blocks) {
    check_geometry(geometry_, num_blocks_);
    const auto bytes = static_cast<size_t>(arena_bytes());
    if (memory == PoolMemory::kShareable) {
        shared_ = std::make_unique<SharedArena>(bytes);
        base_ = shared_->data();
    } else {
        private_ = allocate_large(bytes);
        base_ = private_.get();
    }
    std::memset(base_, 0, bytes);  // touches every page now, not in the first request
}

BlockPool BlockPool::from_budget(PageGeometry geometry, int64_t budget_bytes) {
    require(geometry.block_size >= 1, "block size must be at least 1 token, got ",
            geometry.block_size);
    const int64_t per_block = geometry.block_bytes();
    require(per_block > 0, "page geometry is empty");
    if (budget_bytes < per_block)
        throw Error(detail::concat("a memory budget of ", budget_bytes, " bytes holds no block of ",
                                   per_block, " bytes (", geometry.block_size,
                                   " tokens): give at least ", per_block,
                                   " bytes or a smaller block size"));
    return BlockPool(geometry, budget_bytes / per_block);
}

PageGeometry page_geometry(const KvLayout& layout, int rank, int block_size, PageOrder order) {
    require(rank >= 0 && rank < layout.world_size(), "rank ", rank, " out of range [0, ",
            layout.world_size(), ")");
    require(block_size >= 1, "block size must be at least 1 token, got ", block_size);
    const RankKv& r = layout.ranks[static_cast<size_t>(rank)];
    const ModelSpec& m = layout.model;
    require(m.uniform(), m.name, " has ", m.layer_mix(),
            ": page_geometry describes the one pool of a model whose every layer is full attention "
            "(or MLA) of one shape; models of several KV groups keep one pool per group per rank "
            "(RankModel::pool_at; transfer plans per group: group_transfer_plan)");
    PageGeometry g;
    g.num_layers = r.num_layers();
    g.block_size = block_size;
    g.dtype = m.kv_dtype;
    g.order = order;
    if (m.is_mla()) {
        g.kv_factor = 1;
        g.num_heads = 1;
        g.head_dim = mla_page_dim(m);  // with any indexer key; refuses fp8_ds_mla
    } else {
        g.kv_factor = 2;
        g.num_heads = r.num_kv_heads();
        g.head_dim = m.head_dim;
    }
    KVSHARD_CHECK(g.bytes_per_token() == r.kv_bytes_per_token, "page geometry of rank ", rank,
                  " gives ", g.bytes_per_token(), " bytes per token, the layout ",
                  r.kv_bytes_per_token);
    return g;
}

int64_t num_blocks_for_budget(std::span<const PageGeometry> ranks, int64_t budget_bytes) {
    require(!ranks.empty(), "no ranks to size a block pool for");
    int64_t blocks = INT64_MAX;
    for (const PageGeometry& g : ranks) {
        require(g.block_size >= 1, "block size must be at least 1 token, got ", g.block_size);
        const int64_t per_block = g.block_bytes();
        require(per_block > 0, "page geometry is empty");
        if (budget_bytes < per_block)
            throw Error(detail::concat("a memory budget of ", budget_bytes,
                                       " bytes holds no block of ", per_block, " bytes (",
                                       g.block_size, " tokens): give at least ", per_block,
                                       " bytes or a smaller block size"));
        blocks = std::min(blocks, budget_bytes / per_block);
    }
    return blocks;
}

namespace {

// The smallest power of two s with amax <= kFp8E4m3Max * s (amax > 0, finite).
float fp8_scale_for(float amax) {
    int e = 0;
    std::frexp(amax / kFp8E4m3Max, &e);  // amax / 448 in [2^(e-1), 2^e)
    float s = std::ldexp(1.0f, e - 1);
    if (s * kFp8E4m3Max < amax) s *= 2;
    return std::max(s, std::numeric_limits<float>::min());
}

uint8_t encode_fp8(float x, float scale) {
    return scale > 0 ? float_to_fp8_e4m3(x / scale) : float_to_fp8_e4m3(std::isnan(x) ? x : 0.0f);
}

}  // namespace

void store_vector(BlockPool& pool, int layer, int kv, int64_t block, int head, int slot,
                  const float* x) {
    const PageGeometry& g = pool.geometry();
    std::byte* page = pool.page(layer, kv, block);
    const int d = g.head_dim;
    const int64_t at = g.elem_in_page(head, slot, 0);
    switch (g.dtype) {
        case DType::kFp32:
            std::memcpy(page + at * 4, x, size_t(d) * sizeof(float));
            return;
        case DType::kBf16:
        case DType::kFp16: {
            auto* dst = reinterpret_cast<uint16_t*>(page) + at;
            if (g.dtype == DType::kBf16)
                for (int i = 0; i < d; ++i) dst[i] = float_to_bf16(x[i]);
            else
                for (int i = 0; i < d; ++i) dst[i] = float_to_fp16(x[i]);
            return;
        }
        case DType::kFp8: {
            auto* q = reinterpret_cast<uint8_t*>(page);
            float amax = 0;
            for (int i = 0; i < d; ++i)
                if (std::isfinite(x[i])) amax = std::max(amax, std::fabs(x[i]));
            float s = slot == 0 ? 0.0f : pool.scale(layer, kv, block, head);
            if (amax > kFp8E4m3Max * s) {
                const float ns = fp8_scale_for(amax);
                for (int t = 0; t < slot; ++t)
                    for (int i = 0; i < d; ++i) {
                        uint8_t& c = q[g.elem_in_page(head, t, i)];
                        c = encode_fp8(fp8_e4m3_to_float(c) * s, ns);
                    }
                s = ns;
                pool.set_scale(layer, kv, block, head, s);
            } else if (slot == 0) {
                pool.set_scale(layer, kv, block, head, 0.0f);
            }
            for (int i = 0; i < d; ++i) q[at + i] = encode_fp8(x[i], s);
            return;
        }
    }
}

void dequantize_page(const BlockPool& pool, int layer, int kv, int64_t block, float* out) {
    const PageGeometry& g = pool.geometry();
    const std::byte* page = pool.page(layer, kv, block);
    const int64_t n = g.page_elems();
    switch (g.dtype) {
        case DType::kFp32:
            std::memcpy(out, page, size_t(n) * sizeof(float));
            return;
        case DType::kBf16: {
            const auto* src = reinterpret_cast<const uint16_t*>(page);
            for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(src[i]);
            return;
        }
        case DType::kFp16: {
            const auto* src = reinterpret_cast<const uint16_t*>(page);
            for (int64_t i = 0; i < n; ++i) out[i] = fp16_to_float(src[i]);
            return;
        }
        case DType::kFp8: {
            const auto* src = reinterpret_cast<const uint8_t*>(page);
            for (int h = 0; h < g.num_heads; ++h) {
                const float s = pool.scale(layer, kv, block, h);
                for (int t = 0; t < g.block_size; ++t) {
                    const int64_t at = g.elem_in_page(h, t, 0);
                    for (int i = 0; i < g.head_dim; ++i)
                        out[at + i] = fp8_e4m3_to_float(src[at + i]) * s;
                }
            }
            return;
        }
    }
}

void convert_page(const std::byte* src, PageOrder from, std::byte* dst, PageOrder to,
                  const PageGeometry& geometry) {
    PageGeometry gs = geometry, gd = geometry;
    gs.order = from;
    gd.order = to;
    if (from == to) {
        std::memcpy(dst, src, static_cast<size_t>(geometry.page_bytes()));
        return;
    }
    // Rows of head_dim elements are contiguous in both orders: move one row at a time.
    const auto row = static_cast<size_t>(int64_t{geometry.head_dim} * geometry.elem_size());
    for (int h = 0; h < geometry.num_heads; ++h)
        for (int t = 0; t < geometry.block_size; ++t)
            std::memcpy(dst + gd.elem_in_page(h, t, 0) * geometry.elem_size(),
                        src + gs.elem_in_page(h, t, 0) * geometry.elem_size(), row);
}

}  // namespace kvshard
