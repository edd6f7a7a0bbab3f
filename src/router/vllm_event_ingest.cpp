#include "kvshard/router/vllm_event_ingest.h"

#include <algorithm>
#include <limits>

#include "kvshard/common/error.h"

namespace kvshard {

std::vector<BlockHash> vllm_prompt_keys(VllmBlockHasher& hasher, const VllmBlockHash& root,
                                        std::span<const int32_t> tokens, int block_size,
                                        const VllmExtraKeys& keys) {
    std::vector<BlockHash> out;
    for (const auto& h : hasher.hash_blocks(root, tokens, block_size, keys))
        out.push_back(vllm_index_key(h.event_id()));
    return out;
}

VllmEventIngest::VllmEventIngest(KvIndex& index, int64_t max_blocks_per_replica, int block_size)
    : index_(&index),
      max_blocks_(max_blocks_per_replica),
      block_size_(block_size),
      held_(static_cast<size_t>(index.num_replicas())),
      status_(static_cast<size_t>(index.num_replicas())),
      accept_next_(static_cast<size_t>(index.num_replicas()), false),
      exact_seen_(static_cast<size_t>(index.num_replicas()), false) {
    require(max_blocks_per_replica >= 1 && max_blocks_per_replica <= kMaxBlocksPerReplica,
            "the index cap must be 1 to ", kMaxBlocksPerReplica, " blocks per replica, got ",
            max_blocks_per_replica);
    require(block_size >= 0, "the events' block size must be at least 1 token (0: unchecked), got ",
            block_size);
}

void VllmEventIngest::clear_replica(int replica) {
    index_->all_cleared(replica);
    held_[static_cast<size_t>(replica)] = Held{};
}

namespace {
// The cap's key of a block: its index key with the group in the (otherwise zero) high half.
BlockHash held_key(const BlockHash& k, int group) {
    return BlockHash{k.lo, k.hi ^ static_cast<uint64_t>(group)};
}
}  // namespace

void VllmEventIngest::start_tracking(int replica) {
    Held& h = held_[static_cast<size_t>(replica)];
    h.latest.clear();
    for (const auto& [hk, gen] : h.order) {
        const BlockHash key{hk.lo, 0};  // vLLM keys have hi == 0: hk.hi is the group
        if (index_->contains(replica, key, static_cast<int>(hk.hi))) h.latest[hk] = gen;
    }
    std::deque<std::pair<BlockHash, uint64_t>> live;
    for (const auto& e : h.order) {
        const uint64_t* latest = h.latest.find(e.first);
        if (latest && *latest == e.second) live.push_back(e);
    }
    h.order.swap(live);
    h.tracking = true;
}

void VllmEventIngest::stored(int replica, std::span<const BlockHash> keys, int group) {
    Held& h = held_[static_cast<size_t>(replica)];
    if (h.tracking)
        for (const auto& k : keys) h.latest.prefetch(held_key(k, group));  // overlaps the index's
    index_->block_stored(replica, keys, group);
    for (const auto& k : keys) {
        const BlockHash hk = held_key(k, group);
        ++h.generation;
        if (h.tracking) h.latest[hk] = h.generation;
        h.order.emplace_back(hk, h.generation);
    }
    if (!h.tracking) {
        // Until the replica nears its cap, a store is one append: the map of latest stores is
        // built from the FIFO (and the index) once it is needed, or once dead entries (removed or
        // re-stored blocks) would make the FIFO outgrow the blocks held.
        const int64_t held = index_->num_blocks(replica);
        if (held > max_blocks_ / 2 ||
            h.order.size() > 2 * static_cast<size_t>(held) + kCompactSlack)
            start_tracking(replica);
        if (!h.tracking) return;
    }
    auto& s = status_[static_cast<size_t>(replica)];
    while (static_cast<int64_t>(h.latest.size()) > max_blocks_ && !h.order.empty()) {
        const auto [hk, gen] = h.order.front();
        h.order.pop_front();
        const uint64_t* latest = h.latest.find(hk);
        if (!latest || *latest != gen) continue;  // removed or stored again since
        h.latest.erase(hk);
        const BlockHash key{hk.lo, 0};
        // Every copy: the cap forgets the hash (the engine's BlockRemoved for each copy it
        // still holds then finds nothing to remove).
        index_->block_forgotten(replica, std::span<const BlockHash>(&key, 1),
                                static_cast<int>(hk.hi));
        ++s.evicted;
    }
    // Stale FIFO entries (re-stored or removed keys) are dropped once they outnumber live ones.
    if (h.order.size() > 2 * h.latest.size() + kCompactSlack) {
        std::deque<std::pair<BlockHash, uint64_t>> live;
        for (const auto& e : h.order) {
            const uint64_t* latest = h.latest.find(e.first);
            if (latest && *latest == e.second) live.push_back(e);
        }
        h.order.swap(live);
    }
}

void VllmEventIngest::removed(int replica, std::span<const BlockHash> keys, int group) {
    index_->block_removed(replica, keys, group);
    Held& h = held_[static_cast<size_t>(replica)];
    if (h.tracking)
        for (const auto& k : keys)  // (a hash with copies left stays, and stays capped)
            if (!index_->contains(replica, k, group)) h.latest.erase(held_key(k, group));
}

std::optional<int> vllm_group_window_blocks(std::string_view kind,
                                            std::optional<int64_t> sliding_window,
                                            int64_t block_size) {
    if (kind == "mamba") return 1;  // the state saved in the block before the hit
    if ((kind == "sliding_window" || kind == "sliding_window_mla") && sliding_window &&
        *sliding_window >= 1 && block_size >= 1) {
        // vLLM's SlidingWindowManager: cdiv(sliding_window - 1, block_size) contiguous blocks.
        const int64_t w = (*sliding_window - 1 + block_size - 1) / block_size;
        return static_cast<int>(std::min<int64_t>(w, std::numeric_limits<int>::max()));
    }
    return std::nullopt;
}

const VllmFeedStatus& VllmEventIngest::status(int replica) const {
    require(replica >= 0 && replica < num_replicas(), "replica ", replica, " is not in 0..",
            num_replicas() - 1);
    return status_[static_cast<size_t>(replica)];
}

VllmEventIngest::Result VllmEventIngest::malformed(int replica, std::string why) {
    auto& s = status_[static_cast<size_t>(replica)];
    ++s.malformed;
    s.last_error = std::move(why);
    return {Outcome::kMalformed, 0};
}

VllmEventIngest::Result VllmEventIngest::on_message(
    int replica, std::span<const std::span<const uint8_t>> frames,
    const VllmDecodeResult* decoded) {
    (void)status(replica);
    if (frames.size() != 3)
        return malformed(replica, "a message has " + std::to_string(frames.size()) +
                                      " frames; vLLM sends 3 (topic, sequence, payload)");
    return on_batch(replica, frames[1], frames[2], false, decoded);
}

VllmEventIngest::Result VllmEventIngest::on_batch(int replica, std::span<const uint8_t> seq_frame,
                                                  std::span<const uint8_t> payload, bool replayed,
                                                  const VllmDecodeResult* decoded) {
    (void)status(replica);
    auto& s = status_[static_cast<size_t>(replica)];
    const auto seq = decode_vllm_seq(seq_frame);
    if (!seq)
        return malformed(replica, "the sequence frame is " + std::to_string(seq_frame.size()) +
                                      " bytes; vLLM sends 8 (big-endian)");
    Result result;
    const bool first = !s.last_seq || accept_next_[static_cast<size_t>(replica)];
    if (!first && *seq > *s.last_seq + 1) {
        ++s.gaps;
        return {Outcome::kGap, *s.last_seq + 1};
    }
    // Decoded before a sequence going back clears the replica: a malformed message changes nothing.
    VllmDecodeResult own;
    if (!decoded) own = decode_vllm_event_batch(payload);
    const VllmDecodeResult& d = decoded ? *decoded : own;
    if (!d.batch) return malformed(replica, d.error);
    if (!first && *seq <= *s.last_seq) {
        // A publisher restart: its cache started empty.
        ++s.restarts;
        clear_replica(replica);
        s.stale = false;
        result.outcome = Outcome::kRestarted;
    }
    accept_next_[static_cast<size_t>(replica)] = false;
    s.last_seq = *seq;
    ++s.batches;
    if (replayed) ++s.replayed;
    apply(replica, *d.batch);
    return result;
}

void VllmEventIngest::mark_stale(int replica) {
    (void)status(replica);
    auto& s = status_[static_cast<size_t>(replica)];
    clear_replica(replica);
    s.stale = true;
    accept_next_[static_cast<size_t>(replica)] = true;
}

void VllmEventIngest::apply(int replica, const VllmEventBatch& b) {
    auto& s = status_[static_cast<size_t>(replica)];
    std::vector<BlockHash> keys;
    for (const auto& e : b.events) {
        const bool gpu = !e.medium || *e.medium == "GPU";
        const int64_t group = e.group_idx.value_or(0);
        if (e.kind != VllmEventKind::kAllBlocksCleared &&
            (!gpu || group < 0 || group >= KvIndex::kMaxGroups)) {
            ++s.ignored;
            continue;
        }
        // A block s times the router's (vLLM's hash_block_size): a hybrid group with larger
        // blocks, whose ids are the hash_block_size hashes at the ends of its blocks. Taken as
        // such only once the replica has stored a block of the router's size: an engine all of
        // whose blocks are larger (a uniform model at 32 tokens per block, a Mamba hybrid whose
        // block size vLLM raised) hashes at that larger size, and nothing it stores could match.
        int scale = 1;
        if (e.kind == VllmEventKind::kBlockStored && block_size_ > 0 && e.block_size == block_size_)
            exact_seen_[static_cast<size_t>(replica)] = true;
        if (e.kind == VllmEventKind::kBlockStored && block_size_ > 0 &&
            e.block_size != block_size_) {
            if (!exact_seen_[static_cast<size_t>(replica)] || e.block_size < block_size_ ||
                e.block_size % block_size_ != 0 ||
                e.block_size / block_size_ > std::numeric_limits<int>::max()) {
                ++s.block_size_mismatch;
                s.last_event_block_size = e.block_size;
                continue;
            }
            scale = static_cast<int>(e.block_size / block_size_);
            ++s.larger_block_events;
            s.last_event_block_size = e.block_size;
        }
        const int g = static_cast<int>(group);
        keys.clear();
        for (uint64_t id : e.block_hashes) keys.push_back(vllm_index_key(id));
        switch (e.kind) {
            case VllmEventKind::kBlockStored:
                // The group's largest block seen: a full block always names the group's block
                // size (vLLM revisions that publish partial-block entries name shorter ones).
                if (block_size_ > 0 && scale > index_->group_block_scale(replica, g))
                    index_->set_group_block_scale(replica, g, scale);
                if (e.kv_cache_spec_kind) {
                    const auto w = vllm_group_window_blocks(
                        *e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window, e.block_size);
                    if (w) {
                        index_->set_group_window(replica, g, *w);
                    } else {
                        index_->set_group_full(replica, g);
                    }
                }
                stored(replica, keys, g);
                break;
            case VllmEventKind::kBlockRemoved:
                removed(replica, keys, g);
                break;
            case VllmEventKind::kAllBlocksCleared:
                clear_replica(replica);
                s.stale = false;  // the index is exact again: empty, as the engine's cache
                break;
        }
        ++s.events;
    }
}

}  // namespace kvshard
