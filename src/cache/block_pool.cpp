#include "kvshard/cache/block_pool.h"

#include <cstring>

#include "kvshard/common/error.h"

namespace kvshard {

BlockPool::BlockPool(PageGeometry geometry, int64_t num_blocks) : geometry_(geometry), num_blocks_(num_blocks) {
    require(geometry_.block_size >= 1, "block size must be at least 1 token, got ", geometry_.block_size);
    require(geometry_.num_layers >= 1 && geometry_.num_heads >= 1 && geometry_.head_dim >= 1 &&
                (geometry_.kv_factor == 1 || geometry_.kv_factor == 2),
            "page geometry needs at least one layer, head and element and kv_factor 1 or 2");
    require(num_blocks_ >= 1, "a block pool needs at least one block, got ", num_blocks_);
    arena_ = std::make_unique<std::byte[]>(static_cast<size_t>(arena_bytes()));  // zeroed
}

BlockPool BlockPool::from_budget(PageGeometry geometry, int64_t budget_bytes) {
    require(geometry.block_size >= 1, "block size must be at least 1 token, got ", geometry.block_size);
    const int64_t per_block = geometry.block_bytes();
    require(per_block > 0, "page geometry is empty");
    if (budget_bytes < per_block)
        throw Error(detail::concat("a memory budget of ", budget_bytes, " bytes holds no block of ", per_block,
                                   " bytes (", geometry.block_size, " tokens): give at least ", per_block,
                                   " bytes or a smaller block size"));
    return BlockPool(geometry, budget_bytes / per_block);
}

}  // namespace kvshard
