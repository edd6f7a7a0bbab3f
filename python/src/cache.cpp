// Block hashing (kvshard's XXH3-128 chain and vLLM's schemes), the block manager, KV events.
#include <fmt/format.h>

#include "bindings.h"
#include "kvshard/cache/block_hash.h"
#include "kvshard/cache/block_manager.h"
#include "kvshard/cache/kv_events.h"
#include "kvshard/cache/kv_group_manager.h"
#include "kvshard/cache/vllm_hash.h"

namespace kvshard::python {

namespace {

std::span<const uint8_t> byte_span(const py::bytes& b) {
    const std::string_view v(b);
    return {reinterpret_cast<const uint8_t*>(v.data()), v.size()};
}

py::bytes to_bytes(const VllmBlockHash& h) {
    return py::bytes(reinterpret_cast<const char*>(h.bytes().data()), h.size());
}

VllmBlockHash vllm_hash_of(const py::bytes& b) {
    const auto s = byte_span(b);
    require(s.size() >= 1 && s.size() <= VllmBlockHash::kMaxSize,
            "a vLLM block hash has 1 to 32 bytes, got ", s.size());
    return VllmBlockHash(s);
}

py::object event_dict(const KvEvent& e) { return json_loads(to_json_line(e)); }

// An event from its dict (as event_dict returns and the JSON lines carry) or its JSON line.
KvEvent event_of(const py::object& e) {
    if (py::isinstance<py::str>(e)) return kv_event_from_json(e.cast<std::string>());
    return kv_event_from_json(json_dumps(e));
}

std::vector<std::byte> extra_keys_of(const std::string& cache_salt, const std::string& adapter_id) {
    if (cache_salt.empty() && adapter_id.empty()) return {};
    return encode_extra_keys(cache_salt, adapter_id);
}

py::array_t<int32_t> int32_array(std::span<const int32_t> v) {
    return py::array_t<int32_t>(static_cast<py::ssize_t>(v.size()), v.data());
}

const char* block_state_name(BlockState s) {
    switch (s) {
        case BlockState::kFree:
            return "free";
        case BlockState::kUsed:
            return "used";
        case BlockState::kCached:
            return "cached";
    }
    return "?";
}

py::dict group_spec_dict(const KvGroupPoolSpec& g) {
    py::dict d;
    d["kind"] = std::string(layer_kind_name(g.kind));
    d["window"] = g.window;
    d["num_blocks"] = g.num_blocks;
    return d;
}

// A group's pool from its dict: {"kind": "full"|"sliding"|..., "window": W, "num_blocks": N}.
KvGroupPoolSpec group_spec_of(const py::dict& d) {
    for (auto item : d) {
        const auto key = item.first.cast<std::string>();
        require(key == "kind" || key == "window" || key == "num_blocks",
                "a KV group has no field '", key, "': its fields are kind, window, num_blocks");
    }
    require(d.contains("kind") && d.contains("num_blocks"),
            "a KV group needs 'kind' and 'num_blocks' (and 'window' when windowed)");
    KvGroupPoolSpec g;
    g.kind = parse_layer_kind(d["kind"].cast<std::string>());
    g.window = d.contains("window") ? d["window"].cast<int>() : 0;
    g.num_blocks = d["num_blocks"].cast<int64_t>();
    return g;
}

KvGroupManager group_manager(std::vector<KvGroupPoolSpec> groups, int block_size,
                             bool enable_prefix_cache, bool deferred_commit) {
    return KvGroupManager({.groups = std::move(groups),
                           .block_size = block_size,
                           .enable_prefix_cache = enable_prefix_cache,
                           .deferred_commit = deferred_commit});
}

void bind_kv_group_manager(py::module_& m) {
    py::class_<KvGroupManager>(
        m, "KvGroupManager",
        "One block table per KV group and sequence (full, sliding, chunked, MLA, state groups), "
        "each group with its own pool of block ids, prefix cache and LRU: vLLM's hybrid KV cache "
        "manager (docs/cache.md, 'KV groups'). Entries a windowed group dropped are -1.")
        .def(py::init([](const std::vector<py::dict>& groups, int block_size,
                         bool enable_prefix_cache, bool deferred_commit) {
                 std::vector<KvGroupPoolSpec> specs;
                 for (const auto& g : groups) specs.push_back(group_spec_of(g));
                 return group_manager(std::move(specs), block_size, enable_prefix_cache,
                                      deferred_commit);
             }),
             py::arg("groups"), py::arg("block_size") = 16, py::kw_only(),
             py::arg("enable_prefix_cache") = true, py::arg("deferred_commit") = false,
             "Groups as dicts {'kind', 'window', 'num_blocks'}.")
        .def(py::init([](const ModelSpec& model, int64_t num_blocks, int block_size,
                         bool enable_prefix_cache, bool deferred_commit) {
                 return group_manager(group_pool_specs(kv_groups(model), num_blocks), block_size,
                                      enable_prefix_cache, deferred_commit);
             }),
             py::arg("model"), py::arg("num_blocks"), py::arg("block_size") = 16, py::kw_only(),
             py::arg("enable_prefix_cache") = true, py::arg("deferred_commit") = false,
             "The model's KV groups (kv_groups(model)), each with num_blocks blocks.")
        .def_property_readonly("num_groups", &KvGroupManager::num_groups)
        .def_property_readonly("block_size", &KvGroupManager::block_size)
        .def(
            "group", [](const KvGroupManager& k, int g) { return group_spec_dict(k.group(g)); },
            py::arg("g"), "Group g's pool: {'kind', 'window', 'num_blocks'}.")
        .def("keep_from", &KvGroupManager::keep_from, py::arg("g"), py::arg("committed"),
             py::arg("num_tokens"),
             "The first table entry group g keeps with `committed` of num_tokens tokens "
             "committed.")
        .def(
            "lookup",
            [](const KvGroupManager& k, const TokenArray& tokens, const std::string& cache_salt,
               const std::string& adapter_id) {
                const auto extra = extra_keys_of(cache_salt, adapter_id);
                return k.lookup(token_span(tokens), extra);
            },
            py::arg("tokens"), py::kw_only(), py::arg("cache_salt") = "",
            py::arg("adapter_id") = "",
            "The hybrid prefix hit in tokens: the leading whole blocks every group serves.")
        .def(
            "allocate",
            [](KvGroupManager& k, SeqId seq, const TokenArray& tokens,
               const std::string& cache_salt, const std::string& adapter_id,
               int64_t max_cached_blocks) {
                const auto extra = extra_keys_of(cache_salt, adapter_id);
                const GroupAllocResult r =
                    k.allocate(seq, token_span(tokens), extra, max_cached_blocks);
                py::dict d;
                d["cached_tokens"] = r.cached_tokens;
                d["cached_blocks"] = r.cached_blocks;
                d["new_blocks"] = r.new_blocks;
                return d;
            },
            py::arg("seq"), py::arg("tokens"), py::kw_only(), py::arg("cache_salt") = "",
            py::arg("adapter_id") = "", py::arg("max_cached_blocks") = -1,
            "Blocks in every group for a new sequence, sharing the hybrid prefix hit: "
            "{'cached_tokens', 'cached_blocks', 'new_blocks' (per group)}. "
            "kvshard.OutOfBlocksError when some group lacks blocks (nothing changed).")
        .def(
            "can_allocate",
            [](const KvGroupManager& k, const TokenArray& tokens, int64_t max_cached_blocks) {
                return k.can_allocate(token_span(tokens), {}, max_cached_blocks);
            },
            py::arg("tokens"), py::arg("max_cached_blocks") = -1)
        .def(
            "append",
            [](KvGroupManager& k, SeqId seq, const TokenArray& tokens) {
                k.append(seq, token_span(tokens));
            },
            py::arg("seq"), py::arg("tokens"),
            "Generated tokens appended; windowed groups drop what fell out of their window.")
        .def("can_append", &KvGroupManager::can_append, py::arg("seq"), py::arg("count"))
        .def("commit", &KvGroupManager::commit, py::arg("seq"), py::arg("num_computed_tokens"),
             py::arg("next_query") = -1,
             "Marks tokens computed (deferred_commit); windowed groups then drop what no query "
             "still needs.")
        .def("free", &KvGroupManager::free, py::arg("seq"))
        .def("__contains__", &KvGroupManager::contains, py::arg("seq"))
        .def("num_tokens", &KvGroupManager::num_tokens, py::arg("seq"))
        .def("num_committed_tokens", &KvGroupManager::num_committed_tokens, py::arg("seq"))
        .def(
            "block_table",
            [](const KvGroupManager& k, int g, SeqId seq) {
                return int32_array(k.block_table(g, seq));
            },
            py::arg("g"), py::arg("seq"),
            "Group g's table of the sequence as an int32 array (-1 where the group holds no "
            "block).")
        .def("resident_blocks", &KvGroupManager::resident_blocks, py::arg("g"), py::arg("seq"))
        .def(
            "paged_kv",
            [](const KvGroupManager& k, int g, const std::vector<SeqId>& seqs) {
                const PagedKv p = k.paged_kv(g, seqs);
                py::dict d;
                d["indptr"] = int32_array(p.indptr);
                d["indices"] = int32_array(p.indices);
                d["last_page_len"] = int32_array(p.last_page_len);
                return d;
            },
            py::arg("g"), py::arg("seqs"),
            "FlashInfer's paged-KV description of group g's blocks of these sequences: int32 "
            "arrays indptr, indices, last_page_len.")
        .def(
            "subscribe",
            [](KvGroupManager& k, py::function callback) {
                // Delivered at the end of the manager's call, on the calling thread (which holds
                // the GIL: no method of this class releases it).
                return k.subscribe(
                    [cb = std::move(callback)](const KvEvent& e) { cb(event_dict(e)); });
            },
            py::arg("callback"),
            "Calls callback(event_dict) for every KV event (each names its group); returns an "
            "id for unsubscribe.")
        .def("unsubscribe", &KvGroupManager::unsubscribe, py::arg("subscription_id"))
        .def_property_readonly("next_event_seq", &KvGroupManager::next_event_seq)
        .def("num_available_blocks", &KvGroupManager::num_available_blocks, py::arg("g"))
        .def("num_used_blocks", &KvGroupManager::num_used_blocks, py::arg("g"))
        .def(
            "block_state",
            [](const KvGroupManager& k, int g, BlockId b) {
                return block_state_name(k.block_state(g, b));
            },
            py::arg("g"), py::arg("block"), "'free', 'used' or 'cached'.")
        .def("ref_count", &KvGroupManager::ref_count, py::arg("g"), py::arg("block"))
        .def("eviction_order", &KvGroupManager::eviction_order, py::arg("g"),
             "Group g's cached blocks, least recently used first.")
        .def("check_invariants", &KvGroupManager::check_invariants)
        .def("__repr__", [](const KvGroupManager& k) {
            std::string groups;
            for (int g = 0; g < k.num_groups(); ++g) {
                const auto& s = k.group(g);
                groups += fmt::format("{}{}{}:{}", g ? ", " : "", layer_kind_name(s.kind),
                                      s.window ? fmt::format("({})", s.window) : "", s.num_blocks);
            }
            return fmt::format("KvGroupManager([{}], block_size={})", groups, k.block_size());
        });
}

}  // namespace

void bind_cache(py::module_& m) {
    m.def(
        "hash_token_blocks",
        [](const TokenArray& tokens, int block_size, const std::string& cache_salt,
           const std::string& adapter_id) {
            require(block_size >= 1, "block_size must be >= 1, got ", block_size);
            const auto extra = extra_keys_of(cache_salt, adapter_id);
            std::vector<BlockHash> h;
            {
                py::gil_scoped_release release;
                h = hash_token_blocks(token_span(tokens), block_size, extra);
            }
            return hashes_to(h);
        },
        py::arg("tokens"), py::arg("block_size"), py::kw_only(), py::arg("cache_salt") = "",
        py::arg("adapter_id") = "",
        "kvshard's chained XXH3-128 hashes of the full blocks of `tokens`, as 32-digit hex "
        "strings (the form of KV events and the router).");

    m.def("vllm_hash_schemes", [] {
        std::vector<std::string> out;
        for (VllmHashScheme s : all_vllm_hash_schemes()) out.emplace_back(vllm_hash_scheme_name(s));
        return out;
    });
    m.def(
        "vllm_none_hash",
        [](const std::string& scheme, const std::string& python_hash_seed) {
            return to_bytes(vllm_none_hash(parse_vllm_hash_scheme(scheme), python_hash_seed));
        },
        py::arg("scheme"), py::arg("python_hash_seed"),
        "vLLM's NONE_HASH (the root parent) for PYTHONHASHSEED = python_hash_seed.");
    m.def(
        "vllm_hash_block",
        [](const std::string& scheme, const py::bytes& parent, const TokenArray& tokens,
           const std::vector<std::string>& extra_keys) {
            return to_bytes(vllm_hash_block(parse_vllm_hash_scheme(scheme), vllm_hash_of(parent),
                                            token_span(tokens), extra_keys));
        },
        py::arg("scheme"), py::arg("parent"), py::arg("tokens"),
        py::arg("extra_keys") = std::vector<std::string>{},
        "vLLM's hash_block_tokens: the digest of (parent, tokens, extra_keys) as bytes.");
    m.def(
        "vllm_block_cbor",
        [](const py::bytes& parent, const TokenArray& tokens,
           const std::vector<std::string>& extra_keys) {
            const auto c = vllm_block_cbor(byte_span(parent), token_span(tokens), extra_keys);
            return py::bytes(reinterpret_cast<const char*>(c.data()), c.size());
        },
        py::arg("parent"), py::arg("tokens"), py::arg("extra_keys") = std::vector<std::string>{},
        "The canonical CBOR that vLLM's *_cbor schemes hash.");
    m.def(
        "vllm_block_pickle",
        [](const py::bytes& parent, const TokenArray& tokens,
           const std::vector<std::string>& extra_keys) {
            const auto c = vllm_block_pickle(byte_span(parent), token_span(tokens), extra_keys);
            return py::bytes(reinterpret_cast<const char*>(c.data()), c.size());
        },
        py::arg("parent"), py::arg("tokens"), py::arg("extra_keys") = std::vector<std::string>{},
        "pickle.dumps((parent, tuple(tokens), tuple(extra_keys) or None), protocol=5): what "
        "vLLM's sha256 and xxhash schemes hash.");
    m.def(
        "vllm_block_encoding",
        [](const std::string& scheme, const py::bytes& parent, const TokenArray& tokens,
           const std::vector<std::string>& extra_keys) {
            const auto c = vllm_block_encoding(parse_vllm_hash_scheme(scheme), byte_span(parent),
                                               token_span(tokens), extra_keys);
            return py::bytes(reinterpret_cast<const char*>(c.data()), c.size());
        },
        py::arg("scheme"), py::arg("parent"), py::arg("tokens"),
        py::arg("extra_keys") = std::vector<std::string>{},
        "What `scheme` hashes for a block (CBOR or pickle; sha256_cbor_64bit: CBOR with the "
        "parent as an integer).");
    m.def(
        "vllm_hash_blocks",
        [](const TokenArray& tokens, int block_size, const std::string& scheme,
           const py::bytes& root, const std::string& lora_name, const std::string& cache_salt) {
            VllmBlockHasher hasher(parse_vllm_hash_scheme(scheme));
            const VllmBlockHash r = vllm_hash_of(root);
            std::vector<VllmBlockHash> h;
            {
                py::gil_scoped_release release;
                h = hasher.hash_blocks(r, token_span(tokens), block_size,
                                       {.lora_name = lora_name, .cache_salt = cache_salt});
            }
            py::list out;
            for (const auto& x : h) out.append(to_bytes(x));
            return out;
        },
        py::arg("tokens"), py::arg("block_size"), py::kw_only(),
        py::arg("scheme") = "vllm-sha256-cbor", py::arg("root"), py::arg("lora_name") = "",
        py::arg("cache_salt") = "",
        "vLLM's block hashes of the full blocks of `tokens`, chained from `root` "
        "(vllm_none_hash(scheme, seed) or a known parent), as bytes.");
    m.def(
        "vllm_event_id", [](const py::bytes& h) { return vllm_hash_of(h).event_id(); },
        py::arg("hash"), "The integer vLLM's KV events carry for a block hash.");

    py::class_<BlockManager>(m, "BlockManager",
                             "Blocks of one KV group: ids, hashes and refcounts (no bytes), with "
                             "prefix caching and KV events.")
        .def(py::init([](int64_t num_blocks, int block_size, bool enable_prefix_cache) {
                 return BlockManager({.num_blocks = num_blocks,
                                      .block_size = block_size,
                                      .enable_prefix_cache = enable_prefix_cache});
             }),
             py::arg("num_blocks"), py::arg("block_size") = 16,
             py::arg("enable_prefix_cache") = true)
        .def_property_readonly("block_size", &BlockManager::block_size)
        .def_property_readonly("num_blocks", &BlockManager::num_blocks)
        .def_property_readonly("num_available_blocks", &BlockManager::num_available_blocks)
        .def_property_readonly("prefix_cache_enabled", &BlockManager::prefix_cache_enabled)
        .def(
            "allocate",
            [](BlockManager& b, SeqId seq, const TokenArray& tokens, const std::string& cache_salt,
               const std::string& adapter_id) {
                const auto extra = extra_keys_of(cache_salt, adapter_id);
                const AllocResult r = b.allocate(seq, token_span(tokens), extra);
                py::dict d;
                d["cached_tokens"] = r.cached_tokens;
                d["cached_blocks"] = r.cached_blocks;
                d["new_blocks"] = r.new_blocks;
                return d;
            },
            py::arg("seq"), py::arg("tokens"), py::kw_only(), py::arg("cache_salt") = "",
            py::arg("adapter_id") = "",
            "Blocks for a new sequence, sharing its cached prefix. kvshard.OutOfBlocksError when "
            "too few blocks are free.")
        .def(
            "can_allocate",
            [](const BlockManager& b, const TokenArray& tokens) {
                return b.can_allocate(token_span(tokens));
            },
            py::arg("tokens"))
        .def(
            "lookup",
            [](const BlockManager& b, const TokenArray& tokens) {
                const PrefixMatch p = b.lookup(token_span(tokens));
                py::dict d;
                d["blocks"] = int32_array(p.blocks);
                d["num_tokens"] = p.num_tokens;
                return d;
            },
            py::arg("tokens"), "The longest cached prefix, in whole blocks (no allocation).")
        .def(
            "append",
            [](BlockManager& b, SeqId seq, const TokenArray& tokens) {
                b.append(seq, token_span(tokens));
            },
            py::arg("seq"), py::arg("tokens"), "Generated tokens appended to a sequence.")
        .def("append_tokens", &BlockManager::append_tokens, py::arg("seq"), py::arg("count"))
        .def("can_append", &BlockManager::can_append, py::arg("seq"), py::arg("count"))
        .def("free", &BlockManager::free, py::arg("seq"))
        .def("__contains__", &BlockManager::contains, py::arg("seq"))
        .def(
            "block_table",
            [](const BlockManager& b, SeqId seq) { return int32_array(b.block_table(seq)); },
            py::arg("seq"), "The sequence's block ids, as an int32 numpy array.")
        .def("num_tokens", &BlockManager::num_tokens, py::arg("seq"))
        .def(
            "block_hashes",
            [](const BlockManager& b, SeqId seq) { return hashes_to(b.block_hashes(seq)); },
            py::arg("seq"), "Hashes of the sequence's full blocks, as hex strings.")
        .def("clear_cache", &BlockManager::clear_cache,
             "Drops every cached hash and returns True; returns False, changing nothing, while any "
             "block is in use (vLLM's BlockPool.reset_prefix_cache).")
        .def(
            "subscribe",
            [](BlockManager& b, py::function callback) {
                // Events are delivered at the end of the manager's call, on the calling thread,
                // which holds the GIL (no method of this class releases it).
                return b.subscribe(
                    [cb = std::move(callback)](const KvEvent& e) { cb(event_dict(e)); });
            },
            py::arg("callback"),
            "Calls callback(event_dict) for every KV event (BlockStored, BlockRemoved, "
            "AllCleared); returns an id for unsubscribe.")
        .def("unsubscribe", &BlockManager::unsubscribe, py::arg("subscription_id"))
        .def_property_readonly("next_event_seq", &BlockManager::next_event_seq)
        .def("metrics",
             [](const BlockManager& b) {
                 const CacheMetrics c = b.metrics();
                 py::dict d;
                 d["num_blocks"] = c.num_blocks;
                 d["used_blocks"] = c.used_blocks;
                 d["free_blocks"] = c.free_blocks;
                 d["cached_blocks"] = c.cached_blocks;
                 d["hashed_blocks"] = c.hashed_blocks;
                 d["num_sequences"] = c.num_sequences;
                 d["queries"] = c.queries;
                 d["query_tokens"] = c.query_tokens;
                 d["hit_tokens"] = c.hit_tokens;
                 d["evictions"] = c.evictions;
                 d["stored_blocks"] = c.stored_blocks;
                 d["token_hit_rate"] = c.token_hit_rate();
                 return d;
             })
        .def(
            "block_state",
            [](const BlockManager& b, BlockId id) {
                require(id >= 0 && id < b.num_blocks(), "block ", id, " is outside [0, ",
                        b.num_blocks(), ")");
                switch (b.block_state(id)) {
                    case BlockState::kFree:
                        return "free";
                    case BlockState::kUsed:
                        return "used";
                    case BlockState::kCached:
                        return "cached";
                }
                return "?";
            },
            py::arg("block"), "'free', 'used' or 'cached'.")
        .def(
            "ref_count",
            [](const BlockManager& b, BlockId id) {
                require(id >= 0 && id < b.num_blocks(), "block ", id, " is outside [0, ",
                        b.num_blocks(), ")");
                return b.ref_count(id);
            },
            py::arg("block"))
        .def("eviction_order", &BlockManager::eviction_order,
             "Cached blocks, least recently used first.")
        .def("check_invariants", &BlockManager::check_invariants)
        .def("__repr__", [](const BlockManager& b) {
            return fmt::format("BlockManager(num_blocks={}, block_size={}, available={})",
                               b.num_blocks(), b.block_size(), b.num_available_blocks());
        });

    m.def(
        "kv_event_from_json",
        [](const std::string& line) { return event_dict(kv_event_from_json(line)); },
        py::arg("line"), "A KV event JSON line, checked and returned as its canonical dict.");
    m.def(
        "kv_event_to_json",
        [](const py::object& event, const std::string& source) {
            return to_json_line(event_of(event), source);
        },
        py::arg("event"), py::arg("source") = "", "The canonical JSON line of an event dict.");

    bind_kv_group_manager(m);

    py::class_<KvEventIndex>(
        m, "KvEventIndex",
        "The block hashes one engine holds (a multiset: copies of one hash count each), kept from "
        "its KV events.")
        .def(py::init<>())
        .def(
            "apply", [](KvEventIndex& i, const py::object& e) { i.apply(event_of(e)); },
            py::arg("event"), "Applies an event (dict or JSON line).")
        .def(
            "__contains__",
            [](const KvEventIndex& i, const std::string& h) {
                return i.contains(BlockHash::from_hex(h));
            },
            py::arg("hash"))
        .def(
            "match_length",
            [](const KvEventIndex& i, const py::object& hashes) {
                return i.match_length(hashes_from(hashes));
            },
            py::arg("hashes"), "Leading hashes of the request that the engine holds.")
        .def("__len__", &KvEventIndex::size)
        .def_property_readonly("next_seq", &KvEventIndex::next_seq);
}

}  // namespace kvshard::python
