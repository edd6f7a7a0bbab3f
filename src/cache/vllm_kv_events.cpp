#include "kvshard/cache/vllm_kv_events.h"

#define MSGPACK_NO_BOOST 1
#include <msgpack.hpp>

#include <cstring>
#include <exception>
#include <stdexcept>

namespace kvshard {
namespace {

// A payload that does not decode; caught in decode_vllm_event_batch and turned into its error.
struct Malformed : std::runtime_error {
    using std::runtime_error::runtime_error;
};

[[noreturn]] void malformed(const std::string& what) { throw Malformed(what); }

constexpr size_t kMaxDepth = 32;

std::string_view type_name(const msgpack::object& o) {
    switch (o.type) {
        case msgpack::type::NIL:
            return "nil";
        case msgpack::type::BOOLEAN:
            return "bool";
        case msgpack::type::POSITIVE_INTEGER:
        case msgpack::type::NEGATIVE_INTEGER:
            return "int";
        case msgpack::type::FLOAT32:
        case msgpack::type::FLOAT64:
            return "float";
        case msgpack::type::STR:
            return "str";
        case msgpack::type::BIN:
            return "bin";
        case msgpack::type::ARRAY:
            return "array";
        case msgpack::type::MAP:
            return "map";
        default:
            return "ext";
    }
}

bool is_int(const msgpack::object& o) {
    return o.type == msgpack::type::POSITIVE_INTEGER || o.type == msgpack::type::NEGATIVE_INTEGER;
}

int64_t as_int(const msgpack::object& o, std::string_view field) {
    if (o.type == msgpack::type::POSITIVE_INTEGER) {
        if (o.via.u64 > static_cast<uint64_t>(INT64_MAX))
            malformed(std::string(field) + " is out of the int64 range");
        return static_cast<int64_t>(o.via.u64);
    }
    if (o.type == msgpack::type::NEGATIVE_INTEGER) return o.via.i64;
    malformed(std::string(field) + " must be an int, got " + std::string(type_name(o)));
}

std::optional<int64_t> as_opt_int(const msgpack::object& o, std::string_view field) {
    if (o.type == msgpack::type::NIL) return std::nullopt;
    return as_int(o, field);
}

std::optional<std::string> as_opt_str(const msgpack::object& o, std::string_view field) {
    if (o.type == msgpack::type::NIL) return std::nullopt;
    if (o.type != msgpack::type::STR)
        malformed(std::string(field) + " must be a str or nil, got " + std::string(type_name(o)));
    return std::string(o.via.str.ptr, o.via.str.size);
}

// An ExternalBlockHash: an int (vLLM's 64-bit id; older vLLM hashed with Python's hash(), which
// can be negative: taken as its two's complement) or bytes (the digest: its last 8 bytes, BE,
// int.from_bytes(b, "big") & (2**64 - 1) as maybe_convert_block_hash reads it). The bytes may be
// longer than one digest: the vLLM revisions whose BlockHashListWithBlockSize concatenated the k
// hash_block_size digests of a larger group's block publish that concatenation (k x 32 bytes for
// sha256), whose id is its last digest's.
uint64_t as_hash(const msgpack::object& o, std::string_view field, bool& as_bytes) {
    if (o.type == msgpack::type::POSITIVE_INTEGER) return o.via.u64;
    if (o.type == msgpack::type::NEGATIVE_INTEGER) return static_cast<uint64_t>(o.via.i64);
    if (o.type == msgpack::type::BIN) {
        if (o.via.bin.size == 0)
            malformed(std::string(field) + " as bytes must be at least 1 byte, got 0");
        as_bytes = true;
        const auto* b = reinterpret_cast<const uint8_t*>(o.via.bin.ptr);
        uint64_t id = 0;
        for (uint32_t i = o.via.bin.size > 8 ? o.via.bin.size - 8 : 0; i < o.via.bin.size; ++i)
            id = id << 8 | b[i];
        return id;
    }
    malformed(std::string(field) + " must be an int or bytes, got " + std::string(type_name(o)));
}

std::vector<uint64_t> as_hash_list(const msgpack::object& o, std::string_view field,
                                   bool& as_bytes) {
    if (o.type != msgpack::type::ARRAY)
        malformed(std::string(field) + " must be an array, got " + std::string(type_name(o)));
    std::vector<uint64_t> out;
    out.reserve(o.via.array.size);
    for (uint32_t i = 0; i < o.via.array.size; ++i)
        out.push_back(as_hash(o.via.array.ptr[i], field, as_bytes));
    return out;
}

std::vector<int64_t> as_int_list(const msgpack::object& o, std::string_view field) {
    if (o.type != msgpack::type::ARRAY)
        malformed(std::string(field) + " must be an array, got " + std::string(type_name(o)));
    std::vector<int64_t> out;
    out.reserve(o.via.array.size);
    for (uint32_t i = 0; i < o.via.array.size; ++i)
        out.push_back(as_int(o.via.array.ptr[i], field));
    return out;
}

bool str_is(const msgpack::object& o, std::string_view s) {
    return o.type == msgpack::type::STR && o.via.str.size == s.size() &&
           std::memcmp(o.via.str.ptr, s.data(), s.size()) == 0;
}

// Field order of each event in the positional form (the struct's declaration order, tag first).
constexpr std::string_view kStoredFields[] = {"block_hashes",
                                              "parent_block_hash",
                                              "token_ids",
                                              "block_size",
                                              "lora_id",
                                              "medium",
                                              "lora_name",
                                              "extra_keys",
                                              "group_idx",
                                              "kv_cache_spec_kind",
                                              "kv_cache_spec_sliding_window"};
constexpr std::string_view kRemovedFields[] = {"block_hashes", "medium", "group_idx"};

// Sets one field of `e` from its wire value. Unknown fields are ignored (newer vLLM adds some).
void set_field(VllmKvEvent& e, std::string_view name, const msgpack::object& v) {
    if (name == "block_hashes") {
        e.block_hashes = as_hash_list(v, name, e.hashes_as_bytes);
    } else if (name == "parent_block_hash") {
        if (v.type == msgpack::type::NIL) {
            e.parent_block_hash.reset();
        } else {
            e.parent_block_hash = as_hash(v, name, e.hashes_as_bytes);
        }
    } else if (name == "token_ids") {
        e.token_ids = as_int_list(v, name);
    } else if (name == "block_size") {
        e.block_size = as_int(v, name);
    } else if (name == "lora_id") {
        e.lora_id = as_opt_int(v, name);
    } else if (name == "medium") {
        e.medium = as_opt_str(v, name);
    } else if (name == "lora_name") {
        e.lora_name = as_opt_str(v, name);
    } else if (name == "group_idx") {
        e.group_idx = as_opt_int(v, name);
    } else if (name == "kv_cache_spec_kind") {
        e.kv_cache_spec_kind = as_opt_str(v, name);
    } else if (name == "kv_cache_spec_sliding_window") {
        e.kv_cache_spec_sliding_window = as_opt_int(v, name);
    }
    // extra_keys (per-block tuples of MM ids, LoRA name, salt) are accepted and not kept.
}

VllmEventKind parse_tag(const msgpack::object& tag) {
    if (str_is(tag, "BlockStored")) return VllmEventKind::kBlockStored;
    if (str_is(tag, "BlockRemoved")) return VllmEventKind::kBlockRemoved;
    if (str_is(tag, "AllBlocksCleared")) return VllmEventKind::kAllBlocksCleared;
    if (tag.type == msgpack::type::STR)
        malformed("unknown event tag '" + std::string(tag.via.str.ptr, tag.via.str.size) +
                  "'; expected BlockStored, BlockRemoved or AllBlocksCleared");
    malformed("an event's tag must be a str, got " + std::string(type_name(tag)));
}

std::span<const std::string_view> fields_of(VllmEventKind k) {
    if (k == VllmEventKind::kBlockStored) return kStoredFields;
    if (k == VllmEventKind::kBlockRemoved) return kRemovedFields;
    return {};
}

// Fields a struct declares without a default: they are always on the wire.
size_t required_fields(VllmEventKind k) {
    // BlockStored: block_hashes, parent_block_hash, token_ids, block_size (lora_id and medium are
    // required in later revisions, absent in the earliest: accepted either way).
    if (k == VllmEventKind::kBlockStored) return 4;
    if (k == VllmEventKind::kBlockRemoved) return 1;
    return 0;
}

VllmKvEvent decode_event(const msgpack::object& o) {
    VllmKvEvent e;
    if (o.type == msgpack::type::ARRAY) {
        if (o.via.array.size == 0) malformed("an event array is empty (its tag comes first)");
        e.kind = parse_tag(o.via.array.ptr[0]);
        const auto fields = fields_of(e.kind);
        const size_t n = o.via.array.size - 1;
        if (n < required_fields(e.kind))
            malformed(std::string(vllm_event_kind_name(e.kind)) + " has " + std::to_string(n) +
                      " fields, needs at least " + std::to_string(required_fields(e.kind)));
        for (size_t i = 0; i < n && i < fields.size(); ++i)
            set_field(e, fields[i], o.via.array.ptr[i + 1]);
        return e;
    }
    if (o.type == msgpack::type::MAP) {
        const msgpack::object* tag = nullptr;
        for (uint32_t i = 0; i < o.via.map.size; ++i)
            if (str_is(o.via.map.ptr[i].key, "type")) tag = &o.via.map.ptr[i].val;
        if (!tag) malformed("an event map has no \"type\" tag");
        e.kind = parse_tag(*tag);
        size_t seen_required = 0;
        const auto fields = fields_of(e.kind);
        for (uint32_t i = 0; i < o.via.map.size; ++i) {
            const auto& kv = o.via.map.ptr[i];
            if (kv.key.type != msgpack::type::STR)
                malformed("an event map key must be a str, got " + std::string(type_name(kv.key)));
            const std::string_view name(kv.key.via.str.ptr, kv.key.via.str.size);
            for (size_t f = 0; f < required_fields(e.kind); ++f)
                if (fields[f] == name) ++seen_required;
            set_field(e, name, kv.val);
        }
        if (seen_required < required_fields(e.kind))
            malformed(std::string(vllm_event_kind_name(e.kind)) + " lacks a required field");
        return e;
    }
    malformed("an event must be an array or a map, got " + std::string(type_name(o)));
}

std::vector<VllmKvEvent> decode_events(const msgpack::object& o) {
    if (o.type != msgpack::type::ARRAY)
        malformed("events must be an array, got " + std::string(type_name(o)));
    std::vector<VllmKvEvent> out;
    out.reserve(o.via.array.size);
    for (uint32_t i = 0; i < o.via.array.size; ++i) out.push_back(decode_event(o.via.array.ptr[i]));
    return out;
}

double as_ts(const msgpack::object& o) {
    if (o.type == msgpack::type::FLOAT32 || o.type == msgpack::type::FLOAT64) return o.via.f64;
    if (is_int(o)) return static_cast<double>(as_int(o, "ts"));
    malformed("ts must be a float, got " + std::string(type_name(o)));
}

VllmEventBatch decode_batch(const msgpack::object& o) {
    VllmEventBatch b;
    if (o.type == msgpack::type::ARRAY) {
        if (o.via.array.size < 2)
            malformed("an EventBatch array has " + std::to_string(o.via.array.size) +
                      " items, needs [ts, events] or [ts, events, data_parallel_rank]");
        b.ts = as_ts(o.via.array.ptr[0]);
        b.events = decode_events(o.via.array.ptr[1]);
        if (o.via.array.size >= 3)
            b.data_parallel_rank = as_opt_int(o.via.array.ptr[2], "data_parallel_rank");
        return b;
    }
    if (o.type == msgpack::type::MAP) {
        bool have_ts = false, have_events = false;
        for (uint32_t i = 0; i < o.via.map.size; ++i) {
            const auto& kv = o.via.map.ptr[i];
            if (str_is(kv.key, "ts")) {
                b.ts = as_ts(kv.val);
                have_ts = true;
            } else if (str_is(kv.key, "events")) {
                b.events = decode_events(kv.val);
                have_events = true;
            } else if (str_is(kv.key, "data_parallel_rank")) {
                b.data_parallel_rank = as_opt_int(kv.val, "data_parallel_rank");
            }
        }
        if (!have_ts || !have_events) malformed("an EventBatch map needs \"ts\" and \"events\"");
        return b;
    }
    malformed("an EventBatch must be an array or a map, got " + std::string(type_name(o)));
}

// msgpack writing, the way msgspec does: shortest forms for ints and lengths, float64 for floats.
void pack_hashes(msgpack::packer<msgpack::sbuffer>& pk, const std::vector<uint64_t>& h) {
    pk.pack_array(static_cast<uint32_t>(h.size()));
    for (uint64_t x : h) pk.pack_uint64(x);
}

template <typename T, typename Fn>
void pack_opt(msgpack::packer<msgpack::sbuffer>& pk, const std::optional<T>& v, Fn fn) {
    if (v) {
        fn(*v);
    } else {
        pk.pack_nil();
    }
}

void pack_int(msgpack::packer<msgpack::sbuffer>& pk, int64_t v) {
    if (v >= 0) {
        pk.pack_uint64(static_cast<uint64_t>(v));
    } else {
        pk.pack_int64(v);
    }
}

void pack_str(msgpack::packer<msgpack::sbuffer>& pk, std::string_view s) {
    pk.pack_str(static_cast<uint32_t>(s.size()));
    pk.pack_str_body(s.data(), static_cast<uint32_t>(s.size()));
}

void pack_event(msgpack::packer<msgpack::sbuffer>& pk, const VllmKvEvent& e, VllmWireForm form) {
    const bool map = form == VllmWireForm::kMap;
    auto key = [&](std::string_view k) {
        if (map) pack_str(pk, k);
    };
    auto opt_int = [&](const std::optional<int64_t>& v) {
        pack_opt(pk, v, [&](int64_t x) { pack_int(pk, x); });
    };
    auto opt_str = [&](const std::optional<std::string>& v) {
        pack_opt(pk, v, [&](const std::string& x) { pack_str(pk, x); });
    };
    if (e.kind == VllmEventKind::kBlockStored) {
        // Required: tag + 7 fields; then extra_keys (always nil here), group_idx,
        // kv_cache_spec_kind and kv_cache_spec_sliding_window: positional up to the last one set
        // (trailing defaults are omitted), the map form only those set.
        const int trailing = e.kv_cache_spec_sliding_window ? 4
                             : e.kv_cache_spec_kind         ? 3
                             : e.group_idx                  ? 2
                                                            : 0;
        if (map) {
            pk.pack_map(8 + (e.group_idx ? 1 : 0) + (e.kv_cache_spec_kind ? 1 : 0) +
                        (e.kv_cache_spec_sliding_window ? 1 : 0));
        } else {
            pk.pack_array(static_cast<uint32_t>(8 + trailing));
        }
        key("type");
        pack_str(pk, "BlockStored");
        key("block_hashes");
        pack_hashes(pk, e.block_hashes);
        key("parent_block_hash");
        pack_opt(pk, e.parent_block_hash, [&](uint64_t x) { pk.pack_uint64(x); });
        key("token_ids");
        pk.pack_array(static_cast<uint32_t>(e.token_ids.size()));
        for (int64_t t : e.token_ids) pack_int(pk, t);
        key("block_size");
        pack_int(pk, e.block_size);
        key("lora_id");
        opt_int(e.lora_id);
        key("medium");
        opt_str(e.medium);
        key("lora_name");
        opt_str(e.lora_name);
        if (!map && trailing > 0) pk.pack_nil();  // extra_keys, positional
        if (map ? e.group_idx.has_value() : trailing >= 2) {
            key("group_idx");
            opt_int(e.group_idx);
        }
        if (map ? e.kv_cache_spec_kind.has_value() : trailing >= 3) {
            key("kv_cache_spec_kind");
            opt_str(e.kv_cache_spec_kind);
        }
        if (map ? e.kv_cache_spec_sliding_window.has_value() : trailing >= 4) {
            key("kv_cache_spec_sliding_window");
            opt_int(e.kv_cache_spec_sliding_window);
        }
    } else if (e.kind == VllmEventKind::kBlockRemoved) {
        const uint32_t n = 3 + (e.group_idx ? 1 : 0);
        if (map) {
            pk.pack_map(n);
        } else {
            pk.pack_array(n);
        }
        key("type");
        pack_str(pk, "BlockRemoved");
        key("block_hashes");
        pack_hashes(pk, e.block_hashes);
        key("medium");
        opt_str(e.medium);
        if (e.group_idx) {
            key("group_idx");
            pack_int(pk, *e.group_idx);
        }
    } else {
        if (map) {
            pk.pack_map(1);
        } else {
            pk.pack_array(1);
        }
        key("type");
        pack_str(pk, "AllBlocksCleared");
    }
}

}  // namespace

std::string_view vllm_event_kind_name(VllmEventKind k) {
    switch (k) {
        case VllmEventKind::kBlockStored:
            return "BlockStored";
        case VllmEventKind::kBlockRemoved:
            return "BlockRemoved";
        case VllmEventKind::kAllBlocksCleared:
            return "AllBlocksCleared";
    }
    return "?";
}

VllmDecodeResult decode_vllm_event_batch(std::span<const uint8_t> payload) noexcept {
    VllmDecodeResult r;
    try {
        // No container can hold more items than the payload has bytes; these limits keep a
        // claimed length from allocating more than the message could fill.
        const size_t n = payload.size();
        const msgpack::unpack_limit limit(n, n / 2, n, n, n, kMaxDepth);
        size_t off = 0;
        const msgpack::object_handle oh = msgpack::unpack(
            reinterpret_cast<const char*>(payload.data()), n, off, nullptr, nullptr, limit);
        if (off != n)
            malformed("trailing bytes after the EventBatch: " + std::to_string(n - off) + " of " +
                      std::to_string(n));
        r.batch = decode_batch(oh.get());
    } catch (const Malformed& e) {
        r.error = e.what();
    } catch (const msgpack::unpack_error& e) {
        r.error = std::string("not msgpack: ") + e.what();
    } catch (const std::bad_alloc&) {
        r.error = "not msgpack: a length exceeds what the payload can hold";
    } catch (const std::exception& e) {
        r.error = std::string("not decodable: ") + e.what();
    } catch (...) {
        r.error = "not decodable";
    }
    if (!r.batch && r.error.empty()) r.error = "not decodable";
    return r;
}

std::optional<uint64_t> decode_vllm_seq(std::span<const uint8_t> frame) noexcept {
    if (frame.size() != 8) return std::nullopt;
    uint64_t v = 0;
    for (uint8_t b : frame) v = (v << 8) | b;
    return v;
}

std::vector<uint8_t> encode_vllm_seq(uint64_t seq) {
    std::vector<uint8_t> out(8);
    for (int i = 0; i < 8; ++i)
        out[static_cast<size_t>(i)] = static_cast<uint8_t>(seq >> (56 - 8 * i));
    return out;
}

std::vector<uint8_t> encode_vllm_event_batch(const VllmEventBatch& batch, VllmWireForm form) {
    msgpack::sbuffer buf;
    msgpack::packer<msgpack::sbuffer> pk(buf);
    const bool map = form == VllmWireForm::kMap;
    const uint32_t n = batch.data_parallel_rank ? 3 : 2;
    if (map) {
        pk.pack_map(n);
        pack_str(pk, "ts");
    } else {
        pk.pack_array(n);
    }
    // msgspec writes a float as float64 always; msgpack-cxx's pack_double writes a whole number
    // as an integer, so the 9 bytes are written here.
    uint64_t bits = 0;
    std::memcpy(&bits, &batch.ts, sizeof bits);
    char f64[9] = {static_cast<char>(0xcb)};
    for (int i = 0; i < 8; ++i) f64[1 + i] = static_cast<char>(bits >> (56 - 8 * i));
    buf.write(f64, sizeof f64);
    if (map) pack_str(pk, "events");
    pk.pack_array(static_cast<uint32_t>(batch.events.size()));
    for (const auto& e : batch.events) pack_event(pk, e, form);
    if (batch.data_parallel_rank) {
        if (map) pack_str(pk, "data_parallel_rank");
        pack_int(pk, *batch.data_parallel_rank);
    }
    const auto* p = reinterpret_cast<const uint8_t*>(buf.data());
    return std::vector<uint8_t>(p, p + buf.size());
}

VllmKvEvent to_vllm_event(const KvEvent& e) {
    VllmKvEvent v;
    v.medium = "GPU";
    switch (e.kind) {
        case KvEventKind::kBlockStored:
            v.kind = VllmEventKind::kBlockStored;
            for (const auto& h : e.block_hashes) v.block_hashes.push_back(h.lo);
            if (e.parent_hash) v.parent_block_hash = e.parent_hash->lo;
            v.block_size = e.block_size;
            break;
        case KvEventKind::kBlockRemoved:
            v.kind = VllmEventKind::kBlockRemoved;
            for (const auto& h : e.block_hashes) v.block_hashes.push_back(h.lo);
            break;
        case KvEventKind::kAllCleared:
            v.kind = VllmEventKind::kAllBlocksCleared;
            v.medium.reset();
            break;
    }
    return v;
}

}  // namespace kvshard
