#pragma once
// KvLayout: for every rank, which KV it holds. A pure function of (ModelSpec, ParallelConfig).
#include <cstdint>
#include <string>
#include <vector>

#include "kvshard/layout/parallel_config.h"
#include "kvshard/model/model_spec.h"

namespace kvshard {

// The longest sequence any figure is computed for (tokens): 2^40, far beyond any model's context,
// small enough that tokens x bytes per token stays inside 64 bits for every valid model.
constexpr int64_t kMaxContextTokens = int64_t{1} << 40;

struct TokenRange {
    int64_t begin = 0;  // global token positions [begin, end)
    int64_t end = 0;
    int64_t size() const { return end - begin; }
    bool operator==(const TokenRange&) const = default;
};

// Layers of one KV shape: vLLM's KV cache group (one block table per group and sequence).
struct KvGroup {
    LayerKind kind = LayerKind::kFullAttention;
    int window = 0;        // sliding window W or chunk C; 0 otherwise
    int num_kv_heads = 0;  // attention (not MLA) groups: KV heads of each layer, model-wide
    int head_dim = 0;
    bool indexer = false;     // the layers also cache indexer keys
    std::vector<int> layers;  // global layer ids, ascending
    bool operator==(const KvGroup&) const = default;
};
// The model's groups, in order of each group's first layer. Layers without KV form no group.
std::vector<KvGroup> kv_groups(const ModelSpec& m);

// One group's share on one rank.
struct RankKvGroup {
    int group = 0;  // index into kv_groups(model)
    LayerKind kind = LayerKind::kFullAttention;
    int window = 0;
    std::vector<int> layers;  // this rank's layers of the group
    // KV heads per layer on this rank (attention), 1 for MLA, the state heads for state groups.
    int kv_heads = 0;
    int64_t bytes_per_token = 0;           // all the group's layers here; 0 for state groups
    int64_t state_bytes_per_sequence = 0;  // all the group's layers here; 0 for token groups
    // fp8 KV: one fp32 scale per (layer, K/V, KV head) of every block, over the group's layers
    // here (4 * layers * kv_factor * kv_heads); 0 for other dtypes and state groups. A block's
    // bytes are block_size * bytes_per_token + scale_bytes_per_block (docs/cache.md).
    int64_t scale_bytes_per_block = 0;
    bool operator==(const RankKvGroup&) const = default;
};

struct RankKv {
    RankCoord coord;
    // Global KV head ids held, ascending and contiguous. MLA: {0}, the shared latent.
    std::vector<int> kv_heads;
    // Query heads computed here: [q_head_begin, q_head_end).
    int q_head_begin = 0, q_head_end = 0;
    // Other ranks (same dp, pp, cp) that hold copies of exactly these heads (tp > H_kv, MQA, MLA).
    std::vector<int> head_replica_ranks;
    // Cache layers [begin, end): entries of ModelSpec::layers (whole decoder layers).
    int layer_begin = 0, layer_end = 0;
    // Routed experts of this rank's MoE layers: [expert_begin, expert_end); empty for dense models.
    int expert_begin = 0, expert_end = 0;
    // Bytes of KV this rank stores for each token it holds (all its layers, K and V, its heads,
    // indexer keys): what a token adds while the sequence is shorter than every window.
    int64_t kv_bytes_per_token = 0;
    // Recurrent state of this rank's linear-attention / SSM layers, per sequence.
    int64_t state_bytes_per_sequence = 0;
    std::vector<RankKvGroup> groups;  // the groups this rank holds layers of

    int num_layers() const { return layer_end - layer_begin; }
    int num_kv_heads() const { return static_cast<int>(kv_heads.size()); }
    bool operator==(const RankKv&) const = default;
};

struct KvLayout {
    ModelSpec model;
    ParallelConfig parallel;
    std::vector<RankKv> ranks;  // indexed by rank

    int world_size() const { return static_cast<int>(ranks.size()); }
    // KV heads per TP rank: max(1, H_kv / tp) (MLA: 1 latent).
    int kv_heads_per_rank() const;
    // How many TP ranks hold each KV head: max(1, tp / H_kv) (MLA: tp).
    int head_replication() const;
    bool operator==(const KvLayout&) const = default;
};

// Decoder layers held by each PP stage: explicit split if given (ParallelConfig::pp_layers counts
// decoder layers), else vLLM's get_pp_indices: as even as possible, the (L mod pp) stages before
// the last holding one extra layer each, from the second-to-last backwards (61 layers on 4
// stages: 15, 15, 16, 15). L is ModelSpec::num_decoder_layers(), num_layers for most models.
// Validates as make_layout does.
std::vector<int> pp_layer_split(const ModelSpec& m, const ParallelConfig& p);
// The same split in cache layers (entries of ModelSpec::layers, what RankKv::layer_begin /
// layer_end count): each stage's decoder layers x cache_layers_per_decoder_layer.
std::vector<int> pp_cache_layer_split(const ModelSpec& m, const ParallelConfig& p);

// Throws Error with a one-line message that says what is wrong and what would be valid.
void validate(const ModelSpec& m, const ParallelConfig& p);
// Also checks that the world size equals the number of GPUs available.
void validate_world(const ParallelConfig& p, int gpus);
// Valid TP sizes for a model: divisors of H that either divide H_kv or are multiples of it (and
// the state heads and groups alike); with Mamba-2 layers, also dividing their SSM heads and their
// groups unless there is a single group, as vLLM's MambaMixer2 requires.
std::vector<int> valid_tp_sizes(const ModelSpec& m);

KvLayout make_layout(const ModelSpec& m, const ParallelConfig& p);

// ---- token ownership under CP (seq_len: tokens of the sequence so far) ----
// The CP rank that stores token `pos` of a sequence of `seq_len` tokens.
int cp_owner(const ParallelConfig& p, int64_t seq_len, int64_t pos);
// Ranges of global positions CP rank `cp_rank` holds, ascending.
std::vector<TokenRange> cp_token_ranges(const ParallelConfig& p, int cp_rank, int64_t seq_len);
// A human description of the rule, e.g. "chunks 1 and 6 of 8" or "tokens t with (t/16)%4==2".
std::string cp_token_rule(const ParallelConfig& p, int cp_rank);

// Tokens a KV group keeps of a sequence of `seq_len` tokens: the positions [first, seq_len) with
// first = 0 (full, MLA), max(0, seq_len - W) (sliding: the last token's window), or the start of
// the last token's chunk (chunked). State groups keep no tokens (first = seq_len). That is the
// window of the query at position seq_len - 1; the next query, at seq_len, reads from
// first_kept_position(kind, W, seq_len + 1) (what a transfer of seq_len tokens moves).
int64_t first_kept_position(LayerKind kind, int window, int64_t seq_len);

// Bytes `rank` holds for one request of `seq_len` tokens, in whole blocks of `block_size` tokens
// per group: a group keeps ceil(n / block_size) - floor(s / block_size) blocks, n being the tokens
// of the sequence this rank's CP position holds and s those of them before first_kept_position;
// state groups add their state; fp8 groups add their per-block scales (scale_bytes_per_block per
// block). Equals the engines' resident KV at that length (docs/model.md).
int64_t request_kv_bytes(const KvLayout& l, int rank, int64_t seq_len, int block_size);
// As request_kv_bytes, but a windowed group counts the most blocks it can hold at any length up to
// seq_len: min(blocks of all n tokens, ceil(W / block_size) + 1). Non-decreasing in seq_len.
int64_t request_kv_bytes_peak(const KvLayout& l, int rank, int64_t seq_len, int block_size);

// KV bytes each PP stage holds for one request of `context_tokens` tokens (block_size 1).
std::vector<int64_t> pp_stage_kv_bytes(const ModelSpec& m, const ParallelConfig& p,
                                       int64_t context_tokens);
// A split of the decoder layers into p.pp contiguous stages that minimises the most KV bytes any
// stage holds for a request of `context_tokens` tokens (ties: the even split's neighbourhood).
std::vector<int> pp_layer_split_kv_balanced(const ModelSpec& m, const ParallelConfig& p,
                                            int64_t context_tokens);

// Tokens among positions [0, pos) of a sequence of seq_len tokens that CP rank cp_rank holds.
int64_t cp_tokens_before(const ParallelConfig& p, int cp_rank, int64_t seq_len, int64_t pos);

std::string to_json(const KvLayout& l);

}  // namespace kvshard
