#include "kvshard/cache/kv_events.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <ostream>

#include "kvshard/common/error.h"

namespace kvshard {

int KvEventSubscribers::add(KvEventCallback callback) {
    require(static_cast<bool>(callback), "cannot subscribe an empty callback");
    const int id = next_id_++;
    subs_.emplace_back(id, std::move(callback));
    return id;
}

void KvEventSubscribers::remove(int subscription_id) {
    const auto it = std::find_if(subs_.begin(), subs_.end(),
                                 [&](const auto& s) { return s.first == subscription_id; });
    require(it != subs_.end(), "no subscription with id ", subscription_id);
    subs_.erase(it);
}

void KvEventSubscribers::deliver(std::vector<KvEvent>& pending) const {
    if (pending.empty()) return;
    std::vector<KvEvent> events;
    events.swap(pending);
    for (const KvEvent& e : events)
        for (const auto& sub : subs_) sub.second(e);
}

std::string_view kv_event_kind_name(KvEventKind k) {
    switch (k) {
        case KvEventKind::kBlockStored:
            return "BlockStored";
        case KvEventKind::kBlockRemoved:
            return "BlockRemoved";
        case KvEventKind::kAllCleared:
            return "AllCleared";
    }
    return "?";
}

std::string to_json_line(const KvEvent& e, std::string_view source) {
    // Written by hand: field order is fixed and the hashes are strings, so the line is canonical.
    std::string s;
    s.reserve(96 + 36 * e.block_hashes.size() + 8 * e.block_ids.size());
    s += '{';
    if (!source.empty()) {
        s += "\"source\":";
        s += nlohmann::json(std::string(source)).dump();
        s += ',';
    }
    s += "\"seq\":";
    s += std::to_string(e.seq);
    s += ",\"type\":\"";
    s += kv_event_kind_name(e.kind);
    s += '"';
    if (e.kind != KvEventKind::kAllCleared) {
        s += ",\"block_hashes\":[";
        for (size_t i = 0; i < e.block_hashes.size(); ++i) {
            if (i) s += ',';
            s += '"';
            s += e.block_hashes[i].hex();
            s += '"';
        }
        s += ']';
    }
    if (e.kind == KvEventKind::kBlockStored) {
        s += ",\"parent_hash\":";
        if (e.parent_hash) {
            s += '"';
            s += e.parent_hash->hex();
            s += '"';
        } else {
            s += "null";
        }
        s += ",\"num_tokens\":";
        s += std::to_string(e.num_tokens);
    }
    s += ",\"block_size\":";
    s += std::to_string(e.block_size);
    if (e.kind != KvEventKind::kAllCleared) {
        s += ",\"block_ids\":[";
        for (size_t i = 0; i < e.block_ids.size(); ++i) {
            if (i) s += ',';
            s += std::to_string(e.block_ids[i]);
        }
        s += ']';
    }
    if (e.group != 0) {
        s += ",\"group\":";
        s += std::to_string(e.group);
    }
    s += '}';
    return s;
}

KvEvent kv_event_from_json(std::string_view line) {
    nlohmann::json j;
    try {
        j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& ex) {
        throw Error(detail::concat("a KV event line is not JSON: ", ex.what()));
    }
    require(j.is_object() && j.contains("seq") && j.contains("type"),
            "a KV event line needs an object with \"seq\" and \"type\"");
    KvEvent e;
    try {
        e.seq = j.at("seq").get<uint64_t>();
        const std::string type = j.at("type").get<std::string>();
        if (type == "BlockStored") {
            e.kind = KvEventKind::kBlockStored;
        } else if (type == "BlockRemoved") {
            e.kind = KvEventKind::kBlockRemoved;
        } else if (type == "AllCleared") {
            e.kind = KvEventKind::kAllCleared;
        } else {
            throw Error(detail::concat("unknown KV event type '", type,
                                       "' (valid: BlockStored, BlockRemoved, AllCleared)"));
        }
        if (j.contains("block_hashes"))
            for (const auto& h : j.at("block_hashes"))
                e.block_hashes.push_back(BlockHash::from_hex(h.get<std::string>()));
        if (j.contains("parent_hash") && !j.at("parent_hash").is_null())
            e.parent_hash = BlockHash::from_hex(j.at("parent_hash").get<std::string>());
        if (j.contains("num_tokens")) e.num_tokens = j.at("num_tokens").get<int64_t>();
        if (j.contains("block_size")) e.block_size = j.at("block_size").get<int>();
        if (j.contains("block_ids")) e.block_ids = j.at("block_ids").get<std::vector<int32_t>>();
        if (j.contains("group")) e.group = j.at("group").get<int>();
    } catch (const nlohmann::json::exception& ex) {
        throw Error(detail::concat("malformed KV event line: ", ex.what()));
    }
    return e;
}

void KvEventIndex::apply(const KvEvent& e) {
    if (next_seq_ && e.seq != *next_seq_)
        throw Error(detail::concat(
            "KV event ", e.seq, " arrived where event ", *next_seq_,
            " was expected: ", e.seq > *next_seq_ ? "events were lost" : "an event was replayed",
            "; resynchronize from a snapshot"));
    switch (e.kind) {
        case KvEventKind::kBlockStored: {
            HashSet& set = set_of(e.group);
            for (const BlockHash& h : e.block_hashes) set.insert(h);
            break;
        }
        case KvEventKind::kBlockRemoved: {
            // One copy per hash listed: another block of the same hash may still hold it.
            HashSet& set = set_of(e.group);
            for (const BlockHash& h : e.block_hashes)
                if (const auto it = set.find(h); it != set.end()) set.erase(it);
            break;
        }
        case KvEventKind::kAllCleared:
            hashes_.clear();
            other_groups_.clear();
            break;
    }
    next_seq_ = e.seq + 1;
}

void KvEventIndex::sync(std::span<const BlockHash> hashes, uint64_t next_seq) {
    hashes_.clear();
    other_groups_.clear();
    hashes_.insert(hashes.begin(), hashes.end());
    next_seq_ = next_seq;
}

const KvEventIndex::HashSet* KvEventIndex::find_set(int group) const {
    if (group == 0) return &hashes_;
    const auto it = other_groups_.find(group);
    return it == other_groups_.end() ? nullptr : &it->second;
}

bool KvEventIndex::contains(const BlockHash& h, int group) const {
    const HashSet* set = find_set(group);
    return set && set->count(h) != 0;
}

size_t KvEventIndex::match_length(std::span<const BlockHash> request, int group) const {
    const HashSet* set = find_set(group);
    size_t n = 0;
    while (set && n < request.size() && set->count(request[n])) ++n;
    return n;
}

size_t KvEventIndex::size() const {
    size_t n = hashes_.size();
    for (const auto& [g, set] : other_groups_) n += set.size();
    return n;
}

void KvEventJsonWriter::operator()(const KvEvent& e) const {
    *out_ << to_json_line(e, source_) << '\n';
    out_->flush();
}

}  // namespace kvshard
