#pragma once
// TransferPlan: which source rank sends which KV to which destination rank, and where it lands,
// when a request's KV moves from one layout (prefill) to another (decode). A pure function of
// values (docs/transfer.md).
//
// Each side is a KvLayout plus the request's paged storage on that side:
//  - one DP replica serves the request (`dp`);
//  - CP rank c stores the tokens cp_token_ranges(parallel, c, num_tokens) in ascending global
//    position; its j-th token lives in block block_tables[c][j / block_size], slot j % block_size;
//  - a block id means the same tokens on every TP x PP rank of that CP index (block_pool.h), so one
//    table per CP rank serves all of them.
//
// The plan covers every destination rank of the replica: for each, every (layer, K/V, head, token)
// its layout holds arrives exactly once. A head held by several source ranks (tp > H_kv, or the MLA
// latent on every TP rank) is read from one copy per token: each destination gets its whole range
// from one copy (round-robin over the copies, so TP=8 -> TP=8 sends rank i's range from rank i),
// unless splitting destinations' ranges over several copies lowers the most bytes any one copy
// sends (a TP shrink: fewer destinations than copies). A head held by several destination ranks
// is delivered to each copy. Messages are coalesced: one per (source rank, destination rank, layer
// group).
#include <cstdint>
#include <string>
#include <vector>

#include "kvshard/cache/block_pool.h"
#include "kvshard/layout/kv_layout.h"

namespace kvshard {

// One side of a transfer: a layout and the request's block tables on it.
struct TransferEndpoint {
    KvLayout layout;
    int dp = 0;  // the replica that holds (or will hold) the request
    int block_size = 16;
    PageOrder order = PageOrder::kHnd;
    // Indexed by CP rank; entry c lists the blocks of CP rank c's tokens in order. Each needs at
    // least ceil(tokens held by c / block_size) entries.
    std::vector<std::vector<int32_t>> block_tables;
};

// Block tables that number each CP rank's blocks 0, 1, 2, ... (what the CLI and benchmarks use).
// The most tokens one transfer may move: 2^26, so that the block tables a plan lists (a block id
// per block per CP rank) stay within a few hundred MiB.
inline constexpr int64_t kMaxTransferTokens = int64_t{1} << 26;
// The most pieces (TransferPiece: a run of tokens within one block on both sides) one plan lists,
// in one message (2^26 tokens need blocks of at least 4) and over all its messages (about 2 GiB):
// make_transfer_plan refuses a plan past them (small blocks; large models between many ranks, a
// message per layer) before making its pieces.
inline constexpr int64_t kMaxTransferMessagePieces = int64_t{1} << 24;
inline constexpr int64_t kMaxTransferPieces = int64_t{1} << 26;

std::vector<std::vector<int32_t>> sequential_block_tables(const KvLayout& layout, int block_size,
                                                          int64_t num_tokens);

// The page geometry of rank `rank` of `layout`: its layers, its KV heads (MLA: one latent of
// kv_lora_rank + qk_rope_head_dim elements, kv_factor 1), the model's KV dtype.
PageGeometry rank_page_geometry(const KvLayout& layout, int rank, int block_size, PageOrder order);

// A run of `count` consecutive global token positions that sits in one source block and one
// destination block: source slots [src_slot, src_slot + count) and destination slots
// [dst_slot, dst_slot + count).
struct TransferPiece {
    int64_t token_begin = 0;
    int32_t count = 0;
    int32_t src_block = 0, src_slot = 0;
    int32_t dst_block = 0, dst_slot = 0;
    bool operator==(const TransferPiece&) const = default;
};

// Everything one source rank sends one destination rank for one layer group: the same pieces for
// every layer in [layer_begin, layer_end), both K and V (MLA: the latent), heads [head_begin,
// head_end) (global KV head ids; MLA: [0, 1)).
//
// Wire payload (docs/transfer.md): for layer ascending, for kv in K, V, for piece in order, the
// piece's (head, token) rectangle of head_dim-element vectors, in the page order of the side named
// by the mode (pre-send: the destination's; post-receive: the source's): HND = head-major, NHD =
// token-major.
//
// Models with several KV groups (kv_groups(model): sliding, chunked, MLA, state layers beside full
// attention) get messages per KV group (`kv_group`, an index into TransferPlan::groups): the
// message carries the group's layers within [layer_begin, layer_end) (the range is tight: its first
// and last layers are the group's). A state group's message carries no tokens: state heads
// [head_begin, head_end) and state key heads / groups [key_begin, key_end) of each layer.
struct TransferMessage {
    int src_rank = 0;  // rank in the source layout
    int dst_rank = 0;  // rank in the destination layout
    int layer_group = 0;
    int kv_group = 0;
    int layer_begin = 0, layer_end = 0;
    int head_begin = 0, head_end = 0;
    int key_begin = 0, key_end = 0;  // state groups only
    std::vector<TransferPiece> pieces;
    int64_t num_tokens = 0;  // sum of piece counts
    int64_t bytes = 0;       // payload bytes

    // Layers in [layer_begin, layer_end): all of them for a model of one KV group (what pack and
    // the executor move); TransferPlan::group_layers counts a group's layers in the range.
    int num_layers() const { return layer_end - layer_begin; }
    int num_heads() const { return head_end - head_begin; }
    bool operator==(const TransferMessage&) const = default;
};

struct TransferPlanOptions {
    // Layers per group: layer l belongs to group l / layers_per_group. 0: one group (all layers),
    // so one message per (source, destination) pair. 1: a message per layer (layer-wise streaming).
    int layers_per_group = 0;
    // Tokens [0, dst_cached_tokens) the destination already holds (a prefix-cache hit there, in
    // its own blocks): the plan moves tokens [dst_cached_tokens, num_tokens) only, and min_bytes
    // counts only those. In [0, num_tokens).
    int64_t dst_cached_tokens = 0;
};

// One KV group of the model (kv_groups order) as the plan moves it.
struct TransferGroup {
    LayerKind kind = LayerKind::kFullAttention;
    int window = 0;           // sliding window W or chunk C; 0 otherwise
    std::vector<int> layers;  // global layer ids, ascending
    // Token groups: K and V (2) or the MLA latent (1) of `num_heads` heads (MLA: 1, on every TP
    // rank) of `vector_bytes` each (MLA: the latent plus any indexer key). State groups: 0.
    int kv_factor = 2;
    int num_heads = 0;
    int64_t vector_bytes = 0;
    // The first position the destination's next query (at position num_tokens, its first decode
    // step) reads: first_kept_position(kind, window, num_tokens + 1), where the decode side's
    // KvGroupManager::keep_from starts. The plan moves the destination's blocks from the one
    // holding it (whole blocks), as far as the source still holds them; num_tokens when that query
    // reads none of them (a new chunk). 0 for full attention and MLA.
    int64_t first_kept = 0;
    // State groups: state heads and key heads / groups, and the bytes each adds to one layer's
    // state (conv columns and recurrent state of a head; conv columns of a key group), so that a
    // rank's share of tp is state_bytes(state, tp) (model_spec.h).
    int state_heads = 0, state_keys = 0;
    int64_t state_head_bytes = 0, state_key_bytes = 0;

    bool holds_state() const { return kv_factor == 0; }
    bool operator==(const TransferGroup&) const = default;
};

struct TransferPlan {
    TransferEndpoint src, dst;
    int64_t num_tokens = 0;
    TransferPlanOptions options;
    int num_layer_groups = 1;
    // The model's KV groups (one for a uniform model). The three fields below are the uniform
    // layer's, which pack/unpack and the executor use (they move models of one group only).
    std::vector<TransferGroup> groups;
    int kv_factor = 2;  // 2: K and V; 1: MLA latent
    int head_dim = 0;   // elements per head vector (MLA: the latent width)
    int64_t elem_size = 0;
    // Ordered by (layer group, KV group, source rank, destination rank).
    std::vector<TransferMessage> messages;
    int64_t bytes = 0;  // sum of message payloads
    // Sum over destination ranks of needed_bytes: what each must receive.
    int64_t min_bytes = 0;

    // Bytes of one head vector and of one token of one head over K and V.
    int64_t vector_bytes() const { return int64_t{head_dim} * elem_size; }
    // Indices into messages sent by source rank r / received by destination rank r.
    std::vector<int> messages_from(int src_rank) const;
    std::vector<int> messages_to(int dst_rank) const;
    // Layers of msg's KV group within [msg.layer_begin, msg.layer_end).
    int group_layers(const TransferMessage& msg) const;
    // Whether pack/unpack and the executor can carry the plan out: a model of one KV group whose
    // every layer is the uniform full-attention (or MLA) layer. Other plans are carried out per
    // group: group_transfer_plan for each token group, pack_state_message for state groups. A
    // sparse-MLA plan at fp8 (fp8_ds_mla entries) is sized only.
    bool executable() const;
};

// Throws an Error saying why `plan` is not executable (several KV groups: `why` follows; or
// fp8_ds_mla entries, which no pool lays out); nothing when it is.
void require_executable(const TransferPlan& plan, std::string_view why);

// The messages of token group `kv_group` (an index into plan.groups: full, sliding, chunked or MLA)
// as an executable plan of their own, over a model of that one group: its layers renumbered 0, 1,
// ... (layer j is global layer plan.groups[kv_group].layers[j]), each rank of both layouts holding
// the group's layers within its layer range and its TP share of the group's KV heads (max(1, H /
// tp) contiguous heads of the group's head size, replicated where tp > H: RankKvGroup::kv_heads;
// these may differ from the model's, as Gemma 4's full layers do). Its page geometry is that of
// each rank's pool of the group (RankModel::pool_at), so pack/unpack, schedules and the executor
// move it unchanged; the pieces (for a windowed group, from the block holding its first kept token)
// and bytes are the plan's, and min_bytes counts the group only. A rank's layer L of the model is
// done when its layers [0, group_layers_done(layers, L)) of the group are
// (TransferSender::layer_ready). Error for a state group.
TransferPlan group_transfer_plan(const TransferPlan& plan, int kv_group);
// The group layers among `layers` (ascending global ids) at or before global layer `layer`.
int group_layers_done(const std::vector<int>& layers, int layer);

// Throws Error when the two layouts describe different models (layers, KV groups, KV heads,
// head_dim, MLA shape, state shape, KV dtype), a dp index is out of range, a block table is missing
// or too short, or num_tokens < 1.
TransferPlan make_transfer_plan(const TransferEndpoint& src, const TransferEndpoint& dst,
                                int64_t num_tokens, const TransferPlanOptions& options = {});

// The bytes destination rank `dst_rank` must receive: per token group, its layers x heads x the
// tokens it holds at or after the cached prefix and, for windowed groups, in its blocks from the
// one holding the group's first kept token on (tokens its source CP rank no longer holds, outside
// the window in a block the source dropped, excepted); per state group, its layers' share of the
// state (state_bytes of the destination's tp).
int64_t needed_bytes(const TransferPlan& plan, int dst_rank);

// The bytes that cannot leave before their source rank has written its last layer: the messages
// whose layer range ends at that rank's last layer. Layer-wise streaming (layers_per_group 1)
// leaves only the last layer's bytes there; one group (after prefill) leaves all of them. What a
// prefill/decode run can at best not hide behind its prefill.
int64_t tail_bytes(const TransferPlan& plan);

// Messages and bytes of each KV group (indexed as TransferPlan::groups).
struct TransferGroupTotals {
    int messages = 0;
    int64_t bytes = 0;
};
std::vector<TransferGroupTotals> group_totals(const TransferPlan& plan);

// {"messages", "bytes", "min_bytes", "layer_groups", "from", "to", "tokens", "pairs":
// [{"src","dst", "bytes","messages"}], "kv_groups": [{"group", "kind", "window", "layers",
// "first_kept", "messages", "bytes"}], "message_list": [...]} (message_list only with
// `with_messages`).
std::string to_json(const TransferPlan& plan, bool with_messages = false);

}  // namespace kvshard
