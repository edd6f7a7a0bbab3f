#include "kvshard/router/kv_index.h"

#include <algorithm>
#include <bit>

#include "kvshard/common/error.h"

namespace kvshard {

std::string_view kv_index_mode_name(KvIndexMode m) {
    return m == KvIndexMode::kExact ? "exact" : "approximate";
}

KvIndexMode parse_kv_index_mode(std::string_view s) {
    if (s == "exact") return KvIndexMode::kExact;
    if (s == "approximate" || s == "approx") return KvIndexMode::kApproximate;
    throw Error(detail::concat("unknown KV index mode '", s, "': expected exact or approximate"));
}

KvIndex::KvIndex(int num_replicas, KvIndexMode mode, double ttl_s)
    : num_replicas_(num_replicas), mode_(mode), ttl_s_(ttl_s) {
    require(num_replicas >= 1 && num_replicas <= kMaxReplicas, "KV index: ", num_replicas,
            " replicas; the router handles 1 to ", kMaxReplicas);
    require(mode == KvIndexMode::kExact || ttl_s > 0,
            "KV index: approximate mode needs ttl_s > 0, got ", ttl_s);
    counts_.assign(static_cast<size_t>(num_replicas), 0);
    next_seq_.assign(static_cast<size_t>(num_replicas), -1);
    if (mode == KvIndexMode::kApproximate) expiry_of_.resize(static_cast<size_t>(num_replicas));
}

void KvIndex::check_replica(int replica) const {
    KVSHARD_CHECK(replica >= 0 && replica < num_replicas_, "replica ", replica, " of ",
                  num_replicas_);
}

void KvIndex::set_bit(int replica, BlockHash h) {
    const uint64_t bit = uint64_t{1} << replica;
    uint64_t& m = masks_[h];
    if (!(m & bit)) {
        m |= bit;
        ++counts_[static_cast<size_t>(replica)];
    }
}

void KvIndex::clear_bit(int replica, BlockHash h) {
    const auto it = masks_.find(h);
    const uint64_t bit = uint64_t{1} << replica;
    if (it == masks_.end() || !(it->second & bit)) return;
    it->second &= ~bit;
    --counts_[static_cast<size_t>(replica)];
    if (it->second == 0) masks_.erase(it);
}

void KvIndex::block_stored(int replica, std::span<const BlockHash> hashes) {
    check_replica(replica);
    for (BlockHash h : hashes) set_bit(replica, h);
}

void KvIndex::block_removed(int replica, std::span<const BlockHash> hashes) {
    check_replica(replica);
    for (BlockHash h : hashes) clear_bit(replica, h);
}

void KvIndex::all_cleared(int replica) {
    check_replica(replica);
    const uint64_t bit = uint64_t{1} << replica;
    for (auto it = masks_.begin(); it != masks_.end();) {
        it->second &= ~bit;
        it = it->second == 0 ? masks_.erase(it) : std::next(it);
    }
    counts_[static_cast<size_t>(replica)] = 0;
    next_seq_[static_cast<size_t>(replica)] = -1;
    if (mode_ == KvIndexMode::kApproximate) expiry_of_[static_cast<size_t>(replica)].clear();
}

void KvIndex::apply(int replica, const KvEvent& event) {
    check_replica(replica);
    int64_t& next = next_seq_[static_cast<size_t>(replica)];
    require(next < 0 || event.seq == static_cast<uint64_t>(next), "KV index: replica ", replica,
            " sent event ", event.seq, " but event ", next,
            " was expected (lost or replayed events; clear and resubscribe)");
    next = static_cast<int64_t>(event.seq) + 1;
    switch (event.kind) {
        case KvEventKind::kBlockStored:
            block_stored(replica, event.block_hashes);
            break;
        case KvEventKind::kBlockRemoved:
            block_removed(replica, event.block_hashes);
            break;
        case KvEventKind::kAllCleared:
            all_cleared(replica);
            break;
    }
}

void KvIndex::record_routed(int replica, std::span<const BlockHash> hashes, double now_s) {
    check_replica(replica);
    KVSHARD_CHECK(mode_ == KvIndexMode::kApproximate, "record_routed needs approximate mode");
    expire(now_s);
    const double at = now_s + ttl_s_;
    auto& expiry = expiry_of_[static_cast<size_t>(replica)];
    for (BlockHash h : hashes) {
        set_bit(replica, h);
        expiry[h] = at;
        expiries_.push_back({at, h, replica});
    }
}

void KvIndex::expire(double now_s) {
    if (mode_ != KvIndexMode::kApproximate) return;
    while (!expiries_.empty() && expiries_.front().at <= now_s) {
        const Expiry e = expiries_.front();
        expiries_.pop_front();
        auto& expiry = expiry_of_[static_cast<size_t>(e.replica)];
        const auto it = expiry.find(e.hash);
        // A later record_routed refreshed this entry: a later FIFO element will expire it.
        if (it == expiry.end() || it->second > now_s) continue;
        expiry.erase(it);
        clear_bit(e.replica, e.hash);
    }
}

void KvIndex::prefix_overlap(std::span<const BlockHash> hashes, std::span<int> out) const {
    KVSHARD_CHECK(static_cast<int>(out.size()) == num_replicas_, "out has ", out.size(),
                  " entries for ", num_replicas_, " replicas");
    const uint64_t all = num_replicas_ == 64 ? ~uint64_t{0} : (uint64_t{1} << num_replicas_) - 1;
    uint64_t alive = all;
    int pos = 0;
    for (; pos < static_cast<int>(hashes.size()) && alive != 0; ++pos) {
        const auto it = masks_.find(hashes[static_cast<size_t>(pos)]);
        const uint64_t now = it == masks_.end() ? 0 : (alive & it->second);
        uint64_t dropped = alive & ~now;
        while (dropped) {
            out[static_cast<size_t>(std::countr_zero(dropped))] = pos;
            dropped &= dropped - 1;
        }
        alive = now;
    }
    while (alive) {
        out[static_cast<size_t>(std::countr_zero(alive))] = pos;
        alive &= alive - 1;
    }
}

bool KvIndex::contains(int replica, BlockHash h) const {
    check_replica(replica);
    const auto it = masks_.find(h);
    return it != masks_.end() && (it->second >> replica & 1);
}

}  // namespace kvshard
