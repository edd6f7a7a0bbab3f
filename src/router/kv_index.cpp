#include "kvshard/router/kv_index.h"

#include <algorithm>
#include <bit>
#include <numeric>

#include "kvshard/common/error.h"

namespace kvshard {

std::string_view kv_index_mode_name(KvIndexMode m) {
    return m == KvIndexMode::kExact ? "exact" : "approximate";
}

bool vllm_eagle_block_drop(std::string_view method) {
    for (std::string_view m : {"eagle", "eagle3", "mtp"})
        if (method == m) return true;
    for (std::string_view m :
         {"", "none", "ngram", "medusa", "mlp_speculator", "draft_model", "suffix"})
        if (method == m) return false;
    throw Error(detail::concat(
        "unknown speculative method '", method,
        "': expected vLLM's --speculative-config method: eagle, eagle3 or mtp (these drop the last "
        "block of a prefix-cache hit), ngram, medusa, mlp_speculator, draft_model, suffix, or "
        "none"));
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
    masks_.resize(1);
    group_counts_.assign(static_cast<size_t>(num_replicas), std::vector<int64_t>(1, 0));
    groups_.assign(static_cast<size_t>(num_replicas), 0);
    window_.assign(static_cast<size_t>(num_replicas), std::vector<int>(1, -1));
    scale_.assign(static_cast<size_t>(num_replicas), std::vector<int>(1, 1));
    copies_.resize(static_cast<size_t>(num_replicas));
    for (auto& c : copies_) c.resize(1);
    next_seq_.assign(static_cast<size_t>(num_replicas), -1);
    if (mode == KvIndexMode::kApproximate) expiry_of_.resize(static_cast<size_t>(num_replicas));
}

void KvIndex::check_replica(int replica) const {
    KVSHARD_CHECK(replica >= 0 && replica < num_replicas_, "replica ", replica, " of ",
                  num_replicas_);
}

void KvIndex::check_group(int group) const {
    require(group >= 0 && group < kMaxGroups, "KV index: KV cache group ", group, " is outside 0..",
            kMaxGroups - 1);
}

void KvIndex::grow_groups(size_t r, size_t g) {
    if (g >= masks_.size()) masks_.resize(g + 1);
    if (g >= group_counts_[r].size()) group_counts_[r].resize(g + 1, 0);
    if (g >= window_[r].size()) window_[r].resize(g + 1, -1);
    if (g >= scale_[r].size()) scale_[r].resize(g + 1, 1);
    if (g >= copies_[r].size()) copies_[r].resize(g + 1);
}

void KvIndex::update_hybrid(int replica) {
    const auto r = static_cast<size_t>(replica);
    bool hybrid = (groups_[r] & ~uint64_t{1}) != 0;
    for (int w : window_[r]) hybrid = hybrid || w >= 0;
    for (int s : scale_[r]) hybrid = hybrid || s > 1;
    const uint64_t bit = uint64_t{1} << replica;
    hybrid_ = hybrid ? (hybrid_ | bit) : (hybrid_ & ~bit);
}

void KvIndex::set_bit(int replica, BlockHash h, int group, bool count_copy) {
    const uint64_t bit = uint64_t{1} << replica;
    const auto r = static_cast<size_t>(replica);
    const auto g = static_cast<size_t>(group);
    uint64_t& m = masks_[g][h];
    if (m & bit) {
        if (!count_copy) return;
        ++copies_[r][g][h];  // another block of the replica holds the same hash
    } else {
        m |= bit;
    }
    ++counts_[r];
    ++group_counts_[r][g];
}

void KvIndex::clear_bit(int replica, BlockHash h, int group, bool every_copy) {
    auto& masks = masks_[static_cast<size_t>(group)];
    uint64_t* m = masks.find(h);
    const uint64_t bit = uint64_t{1} << replica;
    if (!m || !(*m & bit)) return;
    const auto r = static_cast<size_t>(replica);
    const auto g = static_cast<size_t>(group);
    int64_t gone = 1;
    if (g < copies_[r].size() && !copies_[r][g].empty()) {
        auto& copies = copies_[r][g];
        if (const auto it = copies.find(h); it != copies.end()) {
            if (!every_copy) {  // one copy goes, the others keep the hash
                if (--it->second == 0) copies.erase(it);
                --counts_[r];
                --group_counts_[r][g];
                return;
            }
            gone += it->second;
            copies.erase(it);
        }
    }
    *m &= ~bit;
    counts_[r] -= gone;
    group_counts_[r][g] -= gone;
    if (*m == 0) masks.erase(h);
}

void KvIndex::block_stored(int replica, std::span<const BlockHash> hashes, int group) {
    check_replica(replica);
    check_group(group);
    const auto g = static_cast<size_t>(group);
    const auto r = static_cast<size_t>(replica);
    grow_groups(r, g);
    if (hashes.empty()) return;
    groups_[r] |= uint64_t{1} << group;
    if (group != 0) hybrid_ |= uint64_t{1} << replica;
    auto& masks = masks_[g];
    if (masks.size() + hashes.size() <= masks.capacity())
        for (BlockHash h : hashes) masks.prefetch(h);  // (a growing table moves them)
    for (BlockHash h : hashes) set_bit(replica, h, group, /*count_copy=*/true);
}

void KvIndex::block_removed(int replica, std::span<const BlockHash> hashes, int group) {
    check_replica(replica);
    check_group(group);
    if (static_cast<size_t>(group) >= masks_.size()) return;
    for (BlockHash h : hashes) masks_[static_cast<size_t>(group)].prefetch(h);
    for (BlockHash h : hashes) clear_bit(replica, h, group, /*every_copy=*/false);
}

void KvIndex::block_forgotten(int replica, std::span<const BlockHash> hashes, int group) {
    check_replica(replica);
    check_group(group);
    if (static_cast<size_t>(group) >= masks_.size()) return;
    for (BlockHash h : hashes) clear_bit(replica, h, group, /*every_copy=*/true);
}

void KvIndex::set_group_window(int replica, int group, int window_blocks) {
    check_replica(replica);
    check_group(group);
    require(window_blocks >= 0, "KV index: a group's window is >= 0 blocks, got ", window_blocks);
    const auto r = static_cast<size_t>(replica);
    const auto g = static_cast<size_t>(group);
    grow_groups(r, g);
    window_[r][g] = window_blocks;
    hybrid_ |= uint64_t{1} << replica;
}

void KvIndex::set_group_full(int replica, int group) {
    check_replica(replica);
    check_group(group);
    const auto r = static_cast<size_t>(replica);
    const auto g = static_cast<size_t>(group);
    if (g < window_[r].size()) window_[r][g] = -1;
    update_hybrid(replica);
}

void KvIndex::set_group_block_scale(int replica, int group, int scale) {
    check_replica(replica);
    check_group(group);
    require(scale >= 1, "KV index: a group's block is at least 1 router block, got ", scale);
    const auto r = static_cast<size_t>(replica);
    grow_groups(r, static_cast<size_t>(group));
    scale_[r][static_cast<size_t>(group)] = scale;
    update_hybrid(replica);
}

int KvIndex::group_block_scale(int replica, int group) const {
    check_replica(replica);
    const auto& s = scale_[static_cast<size_t>(replica)];
    return group >= 0 && static_cast<size_t>(group) < s.size() ? s[static_cast<size_t>(group)] : 1;
}

void KvIndex::set_eagle_block_drop(int replica, bool on) {
    check_replica(replica);
    const uint64_t bit = uint64_t{1} << replica;
    eagle_ = on ? (eagle_ | bit) : (eagle_ & ~bit);
}

bool KvIndex::eagle_block_drop(int replica) const {
    check_replica(replica);
    return (eagle_ >> replica & 1) != 0;
}

void KvIndex::all_cleared(int replica) {
    check_replica(replica);
    const uint64_t bit = uint64_t{1} << replica;
    for (auto& masks : masks_) {
        masks.rewrite([bit](const BlockHash&, uint64_t& m) {
            m &= ~bit;
            return m != 0;
        });
    }
    const auto r = static_cast<size_t>(replica);
    counts_[r] = 0;
    std::fill(group_counts_[r].begin(), group_counts_[r].end(), 0);
    for (auto& c : copies_[r]) c.clear();
    groups_[r] = 0;
    update_hybrid(replica);
    next_seq_[r] = -1;
    if (mode_ == KvIndexMode::kApproximate) expiry_of_[r].clear();
}

int64_t KvIndex::num_blocks(int replica, int group) const {
    check_replica(replica);
    const auto& c = group_counts_[static_cast<size_t>(replica)];
    return group >= 0 && static_cast<size_t>(group) < c.size() ? c[static_cast<size_t>(group)] : 0;
}

int64_t KvIndex::num_hashes() const {
    int64_t n = 0;
    for (const auto& m : masks_) n += static_cast<int64_t>(m.size());
    return n;
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
            block_stored(replica, event.block_hashes, event.group);
            break;
        case KvEventKind::kBlockRemoved:
            block_removed(replica, event.block_hashes, event.group);
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
        set_bit(replica, h, 0, /*count_copy=*/false);
        groups_[static_cast<size_t>(replica)] |= 1;
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
        clear_bit(e.replica, e.hash, 0, /*every_copy=*/true);
    }
}

void KvIndex::prefix_overlap(std::span<const BlockHash> hashes, std::span<int> out) const {
    KVSHARD_CHECK(static_cast<int>(out.size()) == num_replicas_, "out has ", out.size(),
                  " entries for ", num_replicas_, " replicas");
    if (hybrid_ != 0) return hybrid_overlap(hashes, out);
    const uint64_t all = num_replicas_ == 64 ? ~uint64_t{0} : (uint64_t{1} << num_replicas_) - 1;
    uint64_t alive = all;
    int pos = 0;
    const MaskMap& masks = masks_[0];
    for (; pos < static_cast<int>(hashes.size()) && alive != 0; ++pos) {
        const uint64_t* m = masks.find(hashes[static_cast<size_t>(pos)]);
        const uint64_t now = m ? (alive & *m) : 0;
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
    // vLLM's unitary coordinator: the walk stops at the cap, then one block is popped.
    for (uint64_t e = eagle_; e != 0; e &= e - 1) {
        int& hit = out[static_cast<size_t>(std::countr_zero(e))];
        if (hit > 0) --hit;
    }
}

void KvIndex::hybrid_overlap(std::span<const BlockHash> hashes, std::span<int> out) const {
    const int n = static_cast<int>(hashes.size());
    // held[g][pos]: the replicas holding the request's hash pos in group g. Filled lazily, group by
    // group.
    std::vector<std::vector<uint64_t>> held(masks_.size());
    auto held_of = [&](size_t g) -> const std::vector<uint64_t>& {
        auto& h = held[g];
        if (h.empty() && n > 0) {
            h.resize(static_cast<size_t>(n));
            for (int pos = 0; pos < n; ++pos) {
                const uint64_t* m = masks_[g].find(hashes[static_cast<size_t>(pos)]);
                h[static_cast<size_t>(pos)] = m ? *m : 0;
            }
        }
        return h;
    };
    for (int r = 0; r < num_replicas_; ++r) {
        const auto ru = static_cast<size_t>(r);
        const uint64_t bit = uint64_t{1} << r;
        const bool eagle = (eagle_ & bit) != 0;
        // Group 0 always takes part (a replica that stored nothing there holds no prefix).
        const uint64_t gs = groups_[ru] | 1;
        auto scale_of = [&](size_t g) { return g < scale_[ru].size() ? scale_[ru][g] : 1; };
        // Every hit is a multiple of `align` router blocks (vLLM's scheduler block size).
        int64_t align = 1;
        for (size_t g = 0; g < masks_.size(); ++g)
            if (gs >> g & 1) align = std::min<int64_t>(std::lcm(align, scale_of(g)), n + 1);
        int k = static_cast<int>(n / align * align);
        for (bool lowered = true; lowered && k > 0;) {
            lowered = false;
            for (size_t g = 0; g < masks_.size() && k > 0; ++g) {
                if (!(gs >> g & 1)) continue;
                const auto& h = held_of(g);
                const int w = g < window_[ru].size() ? window_[ru][g] : -1;
                const int s = scale_of(g);
                // In the group's own blocks: block j is held when the request's hash at its end,
                // (j + 1) * s - 1, is; a hit of j blocks must be a multiple of step = align / s.
                auto has = [&](int j) { return (h[static_cast<size_t>((j + 1) * s - 1)] & bit); };
                // With the EAGLE drop (set_eagle_block_drop), a group serves j blocks when it
                // would serve j + 1 without it, with a window one block longer: vLLM's hybrid
                // coordinator looks one group block past the candidate (within the cap) and pops
                // it. m: the blocks the group may look at.
                const int e = eagle && w != 0 ? 1 : 0;
                const int m = std::min(k / s + e, n / s);
                const int step = static_cast<int>(align / s);
                int hit = 0;
                if (w < 0) {  // full attention: the held run from block 0
                    while (hit < m && has(hit)) ++hit;
                    if (hit > 0) hit -= e;
                    hit -= hit % step;
                } else if (w == 0) {
                    hit = m;
                } else {  // the largest aligned j <= m - e with blocks [max(0, j - w), j + e) held
                    // run[i]: held blocks ending at block i (inclusive), for i < m.
                    std::vector<int> run(static_cast<size_t>(m));
                    for (int i = 0; i < m; ++i)
                        run[static_cast<size_t>(i)] =
                            has(i) ? (i > 0 ? run[static_cast<size_t>(i - 1)] : 0) + 1 : 0;
                    const int top = std::max(0, m - e);
                    for (hit = top - top % step; hit > 0; hit -= step)
                        if (run[static_cast<size_t>(hit + e - 1)] >= std::min(w + e, hit + e))
                            break;
                }
                const int hit_k = hit * s;
                if (hit_k < k) {
                    k = hit_k;
                    lowered = true;
                }
            }
        }
        out[ru] = k;
    }
}

bool KvIndex::contains(int replica, BlockHash h, int group) const {
    check_replica(replica);
    if (group < 0 || static_cast<size_t>(group) >= masks_.size()) return false;
    const auto& masks = masks_[static_cast<size_t>(group)];
    const uint64_t* m = masks.find(h);
    return m && (*m >> replica & 1);
}

}  // namespace kvshard
