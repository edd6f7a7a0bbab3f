#pragma once
// BlockPool: the bytes of one rank's paged KV. One arena of num_blocks fixed-size blocks.
//
// Byte layout (docs/cache.md). The arena is layer-major:
//   arena = [local_layer][kv_factor][num_blocks] pages, page = page_bytes() bytes,
//   page(l, kv, b) starts at ((l * kv_factor + kv) * num_blocks + b) * page_bytes().
// kv = 0 is K, kv = 1 is V; MLA has kv_factor 1 (the latent, "head" count 1, head_dim = latent
// dim). Inside a page (one layer, K or V, one block):
//   HND: [num_heads][block_size][head_dim]  (default: a contiguous range of heads is contiguous
//   bytes) NHD: [block_size][num_heads][head_dim]
// fp8 pools (e4m3) add one fp32 scale per (local layer, kv, block, head) after the pages:
//   scales at pages_bytes() = num_layers * kv_factor * num_blocks * page_bytes(), scale(l, kv, b,
//   h) at pages_bytes() + (((l * kv_factor + kv) * num_blocks + b) * num_heads + h) * 4,
// so block_bytes() counts them. Element (h, t, x) stores x / scale(h); the scale rule is
// store_vector's (docs/cache.md, "Element types").
// The arena starts on a kArenaAlign (4 KiB) boundary, so a page is aligned to the largest power of
// two dividing both page_bytes() and 4 KiB (SIMD kernels read it with aligned cache lines). A
// private arena of 2 MiB or more is 2 MiB-aligned and on transparent huge pages (large_alloc.h).
// A block id means the same tokens on every rank of a TP x PP group; each rank stores only its own
// heads and layers, so the pools of one group differ in geometry but share block ids.
// A shareable pool (PoolMemory::kShareable) keeps its arena in memory that other processes on the
// host can map read-only (common/shared_arena.h): a transfer's destination then reads it in place.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string_view>

#include "kvshard/common/dtype.h"
#include "kvshard/common/large_alloc.h"
#include "kvshard/common/shared_arena.h"

namespace kvshard {

struct KvLayout;

enum class PageOrder { kHnd, kNhd };
// "hnd" or "nhd" (either case); Error naming the valid ones otherwise.
PageOrder parse_page_order(std::string_view s);

// Where a pool's arena lives: private memory (allocate_large: huge pages from 2 MiB up), or
// shareable memory (SharedArena: other processes on the host may map it read-only; the kernel's
// shared-memory pages).
enum class PoolMemory { kPrivate, kShareable };

// Memory a caller owns (an engine's KV tensor, a numpy array, a buffer of its own): a pool built
// over it reads and writes those bytes in the byte layout above and never allocates, frees or
// clears them. `bytes` must hold the pool's arena_bytes(); `base` must be 64-byte aligned (the
// copy kernels' cache-line stores).
struct ExternalMemory {
    std::byte* base = nullptr;
    size_t bytes = 0;
};

struct PageGeometry {
    int num_layers = 1;   // layers held by this rank
    int kv_factor = 2;    // 2: K and V; 1: MLA latent
    int num_heads = 1;    // KV heads held by this rank (MLA: 1)
    int block_size = 16;  // tokens per block
    int head_dim = 1;     // elements per head per token (MLA: kv_lora_rank + qk_rope_head_dim)
    DType dtype = DType::kFp32;
    PageOrder order = PageOrder::kHnd;

    int64_t elem_size() const { return static_cast<int64_t>(dtype_size(dtype)); }
    int64_t page_elems() const { return int64_t{num_heads} * block_size * head_dim; }
    int64_t page_bytes() const { return page_elems() * elem_size(); }
    // fp32 scales one block carries over all layers and K/V: one per head (fp8 only, else 0).
    int64_t scales_per_block() const {
        return dtype == DType::kFp8 ? int64_t{num_layers} * kv_factor * num_heads : 0;
    }
    // Bytes one block occupies over all layers and K/V, its scales included.
    int64_t block_bytes() const {
        return page_bytes() * num_layers * kv_factor + scales_per_block() * 4;
    }
    // Bytes one token occupies over all layers and K/V (= the layout's kv_bytes_per_token).
    int64_t bytes_per_token() const {
        return int64_t{num_layers} * kv_factor * num_heads * head_dim * elem_size();
    }
    // Element index of (head, token-in-block, dim) inside a page.
    int64_t elem_in_page(int head, int token, int dim) const {
        return order == PageOrder::kHnd ? (int64_t{head} * block_size + token) * head_dim + dim
                                        : (int64_t{token} * num_heads + head) * head_dim + dim;
    }
    bool operator==(const PageGeometry&) const = default;
};

class BlockPool {
  public:
    static constexpr size_t kArenaAlign = 4096;

    // Throws Error when num_blocks < 1 or the geometry is empty.
    BlockPool(PageGeometry geometry, int64_t num_blocks, PoolMemory memory = PoolMemory::kPrivate);
    // Over the caller's memory (left as it is: not cleared). Throws Error naming what is wrong
    // when it is null, too small for num_blocks blocks of this geometry, or not 64-byte aligned.
    BlockPool(PageGeometry geometry, int64_t num_blocks, ExternalMemory memory);
    // Sized from a memory budget: floor(budget_bytes / block_bytes) blocks; Error if not even one
    // fits.
    static BlockPool from_budget(PageGeometry geometry, int64_t budget_bytes);

    const PageGeometry& geometry() const { return geometry_; }
    int64_t num_blocks() const { return num_blocks_; }
    int64_t arena_bytes() const { return num_blocks_ * geometry_.block_bytes(); }

    std::byte* page(int layer, int kv, int64_t block) {
        return base_ + page_offset(layer, kv, block);
    }
    const std::byte* page(int layer, int kv, int64_t block) const {
        return base_ + page_offset(layer, kv, block);
    }
    // fp32 pools only.
    float* page_f32(int layer, int kv, int64_t block) {
        return reinterpret_cast<float*>(page(layer, kv, block));
    }
    const float* page_f32(int layer, int kv, int64_t block) const {
        return reinterpret_cast<const float*>(page(layer, kv, block));
    }
    int64_t page_offset(int layer, int kv, int64_t block) const {
        return ((int64_t{layer} * geometry_.kv_factor + kv) * num_blocks_ + block) *
               geometry_.page_bytes();
    }
    // Bytes of all pages; an fp8 pool's scales follow them.
    int64_t pages_bytes() const {
        return num_blocks_ * geometry_.page_bytes() * geometry_.num_layers * geometry_.kv_factor;
    }
    int64_t scale_offset(int layer, int kv, int64_t block, int head) const {
        return pages_bytes() +
               (((int64_t{layer} * geometry_.kv_factor + kv) * num_blocks_ + block) *
                    geometry_.num_heads +
                head) *
                   4;
    }
    // The scale of (layer, kv, block, head) of an fp8 pool (0: nothing stored since slot 0).
    float scale(int layer, int kv, int64_t block, int head) const {
        float s;
        std::memcpy(&s, base_ + scale_offset(layer, kv, block, head), sizeof s);
        return s;
    }
    void set_scale(int layer, int kv, int64_t block, int head, float s) {
        std::memcpy(base_ + scale_offset(layer, kv, block, head), &s, sizeof s);
    }
    std::span<std::byte> arena() { return {base_, static_cast<size_t>(arena_bytes())}; }
    std::span<const std::byte> arena() const { return {base_, static_cast<size_t>(arena_bytes())}; }
    // A shareable pool's arena, for a reader in another process (SharedArenaView::open; its
    // data() is this arena()); null for a private pool.
    const SharedArenaId* shared_id() const { return shared_ ? &shared_->id() : nullptr; }
    // True for a pool over ExternalMemory.
    bool external() const { return external_; }

  private:
    PageGeometry geometry_;
    int64_t num_blocks_;
    LargeBuffer private_;                  // kPrivate
    std::unique_ptr<SharedArena> shared_;  // kShareable
    std::byte* base_ = nullptr;            // the arena, in one or the other (or the caller's)
    bool external_ = false;
};

// The page geometry of `rank` in a layout: its layers, its KV heads (MLA: one latent of
// kv_lora_rank + qk_rope_head_dim, kv_factor 1), the model's KV dtype. Then
// geometry.bytes_per_token() == layout.ranks[rank].kv_bytes_per_token.
PageGeometry page_geometry(const KvLayout& layout, int rank, int block_size,
                           PageOrder order = PageOrder::kHnd);

// Blocks a group of ranks can share (one BlockManager, one block id space) when each rank has
// budget_bytes for KV: the minimum over the ranks of floor(budget / block_bytes). Throws Error when
// some rank cannot hold a single block.
int64_t num_blocks_for_budget(std::span<const PageGeometry> ranks, int64_t budget_bytes);

// Stores one head_dim vector `x` (fp32) at (layer, kv, block, head, slot), converted to the pool's
// dtype: fp32 as is, bf16 / fp16 rounded to nearest even, fp8 e4m3 scaled and saturated at +-448.
// fp8 scale rule, per (layer, kv, block, head): slot 0 starts the block (scale := 0); a vector
// whose largest finite |x| exceeds 448 * scale raises the scale to the smallest power of two s
// with amax <= 448 * s and re-encodes the head's slots [0, slot) at s (exact for those codes
// that stay normal: a power-of-two change). Tokens are written in slot order, so the codes and
// the scale are a function of that head's values in that block alone, whatever the rank or the
// batching of the writes.
void store_vector(BlockPool& pool, int layer, int kv, int64_t block, int head, int slot,
                  const float* x);
// Page (layer, kv, block) as fp32 values, in the page's order (page_elems() floats).
void dequantize_page(const BlockPool& pool, int layer, int kv, int64_t block, float* out);

// Copies one page between page orders (HND <-> NHD, or the same order). src and dst hold
// geometry.page_bytes() bytes each and do not overlap; `from` and `to` name their orders.
void convert_page(const std::byte* src, PageOrder from, std::byte* dst, PageOrder to,
                  const PageGeometry& geometry);

}  // namespace kvshard
