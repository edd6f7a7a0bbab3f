#pragma once
// Feeding a KvIndex from vLLM's KV event stream (docs/router.md, "vLLM's KV event stream").
//
// VllmEventIngest is the pure part: it takes one received message (topic, sequence frame, payload)
// of one replica, checks its sequence number and applies its events to the index. It owns no
// socket (VllmEventSubscriber in vllm_event_subscriber.h carries the bytes).
//
// Per replica, with `last` the sequence number of the last batch applied:
//  - the first batch, or seq == last + 1: applied.
//  - seq > last + 1 (a gap: batches were lost): kGap is returned with the first missing number.
//    The caller may replay the missing batches through on_message and then retry the message;
//    or call mark_stale(): the replica's part of the index is cleared and flagged stale (it then
//    holds only what later events tell, a subset of the truth) until an AllBlocksCleared resets it.
//  - seq <= last (the publisher restarted and counts from 0 again): the replica is cleared, then
//    the batch is applied (only a batch that decodes: a malformed one changes nothing).
//  - a malformed message (not 3 frames, a sequence frame not 8 bytes, a payload that does not
//    decode) is counted and dropped; the sequence number does not advance, so the next good batch
//    shows the gap.
// Only events of the GPU tier (medium "GPU" or null) enter the index; the others are counted.
// Each KV cache group (group_idx; null is group 0) has its own part of the index, and a route's
// overlap is the longest prefix every group of the replica serves (kv_index.h). A BlockStored
// that names its group's kv_cache_spec_kind sets the group's rule: "sliding_window" /
// "sliding_window_mla" with kv_cache_spec_sliding_window = W tokens needs only the last
// ceil((W - 1) / block_size) blocks before the hit, "mamba" only the block before it; every other
// kind, and a group whose kind was never named (revisions before the field), needs every block of
// the prefix (full attention; for a windowed group that may undercount a hit, never overcount).
// A group_idx outside 0..KvIndex::kMaxGroups - 1 is counted as ignored. With a block size set
// (the router's, which it hashes prompts with: vLLM's hash_block_size), a BlockStored whose
// block_size is s > 1 times it, from a replica that has stored a block of the router's size, is a
// hybrid group with larger blocks (vLLM publishes, for each of its blocks, the hash_block_size
// hash at the block's end): it is indexed, the group's scale set to the largest s seen
// (KvIndex::set_group_block_scale) and counted (larger_block_events). Before the replica's first
// block of the router's size such an event is taken as an engine hashing at another block size.
// A BlockStored of any other block_size is not indexed and is counted (block_size_mismatch): its
// hashes cover other token spans and could never match a route, and indexed they would only take
// room under the cap. A vLLM block id maps to the
// index key vllm_index_key(id). The index holds at most max_blocks_per_replica blocks per replica:
// past it the replica's oldest stored blocks (by their last BlockStored) are dropped from the index
// and counted (bounded memory; a dropped block only costs a missed hit).
#include <cstdint>
#include <deque>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kvshard/cache/block_hash.h"
#include "kvshard/cache/vllm_hash.h"
#include "kvshard/cache/vllm_kv_events.h"
#include "kvshard/router/block_hash_map.h"
#include "kvshard/router/kv_index.h"

namespace kvshard {

// The KvIndex key of a vLLM 64-bit block id.
inline BlockHash vllm_index_key(uint64_t id) { return BlockHash{id, 0}; }

// The index keys of a prompt's full blocks as a vLLM engine with this scheme, PYTHONHASHSEED and
// block size would publish them.
std::vector<BlockHash> vllm_prompt_keys(VllmBlockHasher& hasher, const VllmBlockHash& root,
                                        std::span<const int32_t> tokens, int block_size,
                                        const VllmExtraKeys& keys = {});

// The window rule of a KV cache group from its BlockStored's kv_cache_spec_kind: the blocks
// before a hit the group must hold (KvIndex::set_group_window), or nullopt for every block (full
// attention, and kinds whose hit rule the router does not model).
std::optional<int> vllm_group_window_blocks(std::string_view kind,
                                            std::optional<int64_t> sliding_window,
                                            int64_t block_size);

struct VllmFeedStatus {
    std::optional<uint64_t> last_seq;  // nullopt before the first batch
    bool stale = false;
    int64_t batches = 0;              // batches applied
    int64_t events = 0;               // events applied to the index
    int64_t ignored = 0;              // events of another tier (or a group_idx out of range)
    int64_t gaps = 0;                 // gaps seen
    int64_t restarts = 0;             // sequence went back
    int64_t malformed = 0;            // messages dropped
    int64_t replayed = 0;             // batches applied from a replay
    int64_t evicted = 0;              // blocks dropped from the index by the per-replica cap
    int64_t block_size_mismatch = 0;  // BlockStored events of another block size, not indexed
    // BlockStored events at a multiple of the block size (a hybrid group with larger blocks),
    // indexed.
    int64_t larger_block_events = 0;
    int64_t last_event_block_size = 0;  // the block_size of the last event of either kind
    std::string last_error;             // the last malformed message's reason
};

class VllmEventIngest {
  public:
    enum class Outcome { kApplied, kGap, kRestarted, kMalformed };
    struct Result {
        Outcome outcome = Outcome::kApplied;
        uint64_t missing_from = 0;  // kGap: the first sequence number not received
    };

    static constexpr int64_t kDefaultMaxBlocksPerReplica = 4'000'000;
    // The largest cap accepted: 2^28 blocks, 4 billion tokens at a block of 16, far more than one
    // engine's KV cache holds; a larger cap would not bound the index's memory at all.
    static constexpr int64_t kMaxBlocksPerReplica = int64_t{1} << 28;

    // `index` must outlive this; replicas 0 .. index.num_replicas() - 1. `block_size`: the
    // engines' block size in tokens, which every BlockStored must carry; 0 accepts any. Error
    // unless max_blocks_per_replica is 1 to kMaxBlocksPerReplica and block_size >= 0.
    explicit VllmEventIngest(KvIndex& index,
                             int64_t max_blocks_per_replica = kDefaultMaxBlocksPerReplica,
                             int block_size = 0);

    // One message as received: frames[0] topic, frames[1] sequence, frames[2] payload.
    // `decoded`, when given, is decode_vllm_event_batch(frames[2]) done by the caller (outside
    // whatever lock guards this object and the index); the result is the same.
    Result on_message(int replica, std::span<const std::span<const uint8_t>> frames,
                      const VllmDecodeResult* decoded = nullptr);
    // The same from already split parts (a replay reply has no topic).
    Result on_batch(int replica, std::span<const uint8_t> seq_frame,
                    std::span<const uint8_t> payload, bool replayed = false,
                    const VllmDecodeResult* decoded = nullptr);
    // After a gap that will not be replayed: clear the replica, flag it stale and accept `seq` as
    // the new position (the batch that showed the gap is applied with on_batch next).
    void mark_stale(int replica);

    const VllmFeedStatus& status(int replica) const;
    int num_replicas() const { return static_cast<int>(status_.size()); }

  private:
    void apply(int replica, const VllmEventBatch& b);
    Result malformed(int replica, std::string why);
    void clear_replica(int replica);
    void stored(int replica, std::span<const BlockHash> keys, int group);
    void removed(int replica, std::span<const BlockHash> keys, int group);

    // Per replica, the blocks held in the index in store order: a FIFO of (key, generation) and,
    // once tracking (the replica past half its cap, or a FIFO to compact), key -> generation of
    // its latest store; a FIFO entry whose generation is not the key's latest is stale and
    // skipped. Keys are (block, group): the group in the key's high half.
    struct Held {
        BlockHashMap<uint64_t> latest;
        std::deque<std::pair<BlockHash, uint64_t>> order;
        uint64_t generation = 0;
        bool tracking = false;
    };
    static constexpr size_t kCompactSlack = 1024;
    void start_tracking(int replica);

    KvIndex* index_;
    int64_t max_blocks_;
    int block_size_;
    std::vector<Held> held_;
    std::vector<VllmFeedStatus> status_;
    std::vector<bool> accept_next_;  // after mark_stale: the next seq is accepted whatever it is
    // The replica has stored a block of the router's block size (its larger blocks are then
    // groups with larger blocks, not an engine hashing at another size).
    std::vector<bool> exact_seen_;
};

}  // namespace kvshard
