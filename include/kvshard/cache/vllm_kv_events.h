#pragma once
// vLLM's KV event stream, decoded and encoded byte-exactly (docs/router.md, "vLLM's KV event
// stream"). A pure codec: bytes in, values out; the socket that carries them is elsewhere
// (kvshard/router/vllm_event_subscriber.h).
//
// Wire (vllm/distributed/kv_events.py, ZmqEventPublisher): a ZMQ PUB multipart message of three
// frames: topic (any bytes), the batch's sequence number as 8 bytes big-endian, and a msgpack
// payload: an EventBatch (ts: float, events: list, data_parallel_rank: int | None). Each event is a
// msgspec tagged struct, in one of two forms:
//   positional (msgspec array_like=True):  ["BlockStored", block_hashes, parent_block_hash,
//       token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx, ...]
//       ["BlockRemoved", block_hashes, medium, group_idx]   ["AllBlocksCleared"]
//   map: {"type": "BlockStored", "block_hashes": ..., ...} (the batch then is a map too)
// Trailing fields whose value is the default may be absent (omit_defaults); unknown trailing
// fields or keys are ignored. Block hashes are integers (the 64-bit id, the default) or bytes (the
// raw digest; its id is its last 8 bytes big-endian, vllm_hash.h).
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvshard/cache/kv_events.h"

namespace kvshard {

enum class VllmEventKind { kBlockStored, kBlockRemoved, kAllBlocksCleared };
// "BlockStored" | "BlockRemoved" | "AllBlocksCleared": the msgspec tag on the wire.
std::string_view vllm_event_kind_name(VllmEventKind k);

struct VllmKvEvent {
    VllmEventKind kind = VllmEventKind::kBlockStored;
    // The 64-bit ids (an int on the wire, or the low 64 bits of a bytes digest). Stored: one chain,
    // head first. Removed: the hashes dropped.
    std::vector<uint64_t> block_hashes;
    std::optional<uint64_t> parent_block_hash;  // Stored; nullopt: the chain starts at the root
    std::vector<int64_t> token_ids;             // Stored
    int64_t block_size = 0;                     // Stored
    std::optional<int64_t> lora_id;             // Stored (deprecated upstream)
    std::optional<std::string> medium;          // "GPU", "CPU", ...; nullopt when null/absent
    std::optional<std::string> lora_name;       // Stored
    std::optional<int64_t> group_idx;           // Stored / Removed: the KV cache group
    // Stored, newest revisions: the group's KVCacheSpecKind value ("full_attention",
    // "sliding_window", "mamba", ...) and its sliding window in tokens.
    std::optional<std::string> kv_cache_spec_kind;
    std::optional<int64_t> kv_cache_spec_sliding_window;
    bool hashes_as_bytes = false;  // decoded: some hash was bytes on the wire

    bool operator==(const VllmKvEvent&) const = default;
};

struct VllmEventBatch {
    double ts = 0.0;
    std::vector<VllmKvEvent> events;
    std::optional<int64_t> data_parallel_rank;

    bool operator==(const VllmEventBatch&) const = default;
};

// The outcome of decoding one payload: a batch, or why not. Never throws.
struct VllmDecodeResult {
    std::optional<VllmEventBatch> batch;
    std::string error;  // non-empty iff !batch
};

// Decodes one msgpack payload (the third frame). Malformed input (bad msgpack, wrong shapes, an
// unknown event tag, trailing bytes, nesting over 32 levels) gives an error, never a crash.
VllmDecodeResult decode_vllm_event_batch(std::span<const uint8_t> payload) noexcept;

// The second frame: 8 bytes big-endian; nullopt for any other length. vLLM's replay socket ends a
// replay with the sequence number -1 (all bytes 0xff), which reads here as UINT64_MAX.
std::optional<uint64_t> decode_vllm_seq(std::span<const uint8_t> frame) noexcept;
std::vector<uint8_t> encode_vllm_seq(uint64_t seq);

enum class VllmWireForm { kPositional, kMap };

// msgpack bytes of a batch as vLLM's msgspec encoder writes it in `form` (hashes as integers;
// optional trailing fields omitted when nullopt, as omit_defaults does for those with a default).
std::vector<uint8_t> encode_vllm_event_batch(const VllmEventBatch& batch,
                                             VllmWireForm form = VllmWireForm::kPositional);

// A kvshard BlockManager event in vLLM's terms: ids are the low 64 bits of kvshard's 128-bit
// hashes (BlockHash::lo), medium "GPU". Token ids are not in kvshard's events: token_ids is empty
// (the vLLM consumers we know of key on block_hashes).
VllmKvEvent to_vllm_event(const KvEvent& e);

}  // namespace kvshard
