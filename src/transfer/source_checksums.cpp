#include "kvshard/transfer/source_checksums.h"

#include <algorithm>

#include "kvshard/common/error.h"
#include "kvshard/common/xxh3.h"

namespace kvshard {

SourceChecksums::SourceChecksums(const BlockPool& pool)
    : pool_(&pool),
      num_blocks_(pool.num_blocks()),
      kv_factor_(pool.geometry().kv_factor),
      num_heads_(pool.geometry().num_heads),
      num_layers_(pool.geometry().num_layers) {
    require(pool.geometry().order == PageOrder::kHnd,
            "source checksums need an HND pool (a head's slots contiguous); this pool is NHD");
    units_.assign(static_cast<size_t>(int64_t{num_layers_} * kv_factor_ * num_blocks_ * num_heads_),
                  0);
    tokens_.assign(static_cast<size_t>(int64_t{num_layers_} * num_blocks_), 0);
}

void SourceChecksums::seal(int layer, int32_t block, int tokens) {
    const PageGeometry& g = pool_->geometry();
    require(layer >= 0 && layer < num_layers_, "layer ", layer, " is outside the pool's ",
            num_layers_, " layers");
    require(block >= 0 && block < num_blocks_, "block ", block, " is outside the pool's ",
            num_blocks_, " blocks");
    require(tokens >= 1 && tokens <= g.block_size, "a block holds 1 to ", g.block_size,
            " tokens, not ", tokens);
    const int64_t vec = int64_t{g.head_dim} * g.elem_size();
    for (int kv = 0; kv < kv_factor_; ++kv) {
        const std::byte* page = pool_->page(layer, kv, block);
        for (int h = 0; h < num_heads_; ++h)
            units_[static_cast<size_t>(index(layer, kv, block, h))] =
                xxh3_64(page + int64_t{h} * g.block_size * vec, static_cast<size_t>(tokens * vec));
    }
    tokens_[static_cast<size_t>(int64_t{layer} * num_blocks_ + block)] = tokens;
}

void SourceChecksums::seal_sequence(int layer, std::span<const int32_t> block_table,
                                    int64_t num_tokens) {
    const int bs = pool_->geometry().block_size;
    const int64_t blocks = (num_tokens + bs - 1) / bs;
    require(num_tokens >= 0 && static_cast<int64_t>(block_table.size()) >= blocks, "a sequence of ",
            num_tokens, " tokens needs ", blocks, " blocks, the table has ", block_table.size());
    for (int64_t j = 0; j < blocks; ++j)
        seal(layer, block_table[static_cast<size_t>(j)],
             static_cast<int>(std::min<int64_t>(bs, num_tokens - j * bs)));
}

void SourceChecksums::forget(int32_t block) {
    require(block >= 0 && block < num_blocks_, "block ", block, " is outside the pool's ",
            num_blocks_, " blocks");
    for (int l = 0; l < num_layers_; ++l)
        tokens_[static_cast<size_t>(int64_t{l} * num_blocks_ + block)] = 0;
}

}  // namespace kvshard
