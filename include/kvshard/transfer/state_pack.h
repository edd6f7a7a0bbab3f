#pragma once
// Pack and unpack the messages of a TransferPlan's state groups (linear-attention state: Gated
// DeltaNet), between the per-sequence states of two ranks (docs/transfer.md, "State messages").
//
// A state message carries, for each of its group's layers in [layer_begin, layer_end) ascending:
//  - for each key head k in [key_begin, key_end): the conv state's q and k columns of k, as
//    (conv_kernel - 1) rows of [q: key_dim | k: key_dim] (state_key_bytes);
//  - for each value head h in [head_begin, head_end): the conv state's v columns of h, as
//    (conv_kernel - 1) rows of value_dim, then the recurrent state of h, key_dim x value_dim
//    (state_head_bytes);
// fp32 elements, native byte order.
#include <cstddef>
#include <functional>
#include <span>

#include "kvshard/transfer/transfer_plan.h"

namespace kvshard {

// One rank's share of a state layer, as it stores it for one sequence:
//   conv [conv_kernel - 1][2 * num_keys * key_dim + num_heads * value_dim] (q columns of its key
//        heads, then k columns, then v columns of its value heads), oldest row first;
//   rec  [num_heads][key_dim][value_dim].
struct StateShard {
    int key_begin = 0, num_keys = 0;    // global key heads held
    int head_begin = 0, num_heads = 0;  // global value heads held
    int conv_kernel = 0, key_dim = 0, value_dim = 0;

    int64_t conv_channels() const {
        return 2 * int64_t{num_keys} * key_dim + int64_t{num_heads} * value_dim;
    }
    int64_t conv_elems() const { return int64_t{conv_kernel - 1} * conv_channels(); }
    int64_t rec_elems() const { return int64_t{num_heads} * key_dim * value_dim; }
};

// The state of one layer of one sequence on this rank.
struct StateRef {
    std::span<float> conv, rec;
};
// Global layer id -> that layer's state (the request's).
using StateAccess = std::function<StateRef(int layer)>;

// The shard of rank `rank` of `layout` (its tp index's heads and key heads, replicated where tp
// exceeds them) of the model's state shape.
StateShard rank_state_shard(const KvLayout& layout, int rank);

// Writes state message `msg` (of a state group of plan; Error otherwise, or when `out` is not
// msg.bytes long, the state is not fp32, or a head is outside the shard) from the source rank.
void pack_state_message(const TransferPlan& plan, const TransferMessage& msg, const StateShard& src,
                        const StateAccess& state, std::span<std::byte> out);
// Copies it into the destination rank's states.
void unpack_state_message(const TransferPlan& plan, const TransferMessage& msg,
                          const StateShard& dst, const StateAccess& state,
                          std::span<const std::byte> in);

}  // namespace kvshard
