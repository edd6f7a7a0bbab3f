#pragma once
// KvLayout: for every rank, which KV it holds. A pure function of (ModelSpec, ParallelConfig).
#include <cstdint>
#include <string>
#include <vector>

#include "kvshard/layout/parallel_config.h"
#include "kvshard/model/model_spec.h"

namespace kvshard {

struct TokenRange {
    int64_t begin = 0;  // global token positions [begin, end)
    int64_t end = 0;
    int64_t size() const { return end - begin; }
    bool operator==(const TokenRange&) const = default;
};

struct RankKv {
    RankCoord coord;
    // Global KV head ids held, ascending and contiguous. MLA: {0}, the shared latent.
    std::vector<int> kv_heads;
    // Query heads computed here: [q_head_begin, q_head_end).
    int q_head_begin = 0, q_head_end = 0;
    // Other ranks (same dp, pp, cp) that hold copies of exactly these heads (tp > H_kv, MQA, MLA).
    std::vector<int> head_replica_ranks;
    int layer_begin = 0, layer_end = 0;  // [begin, end)
    // Routed experts of this rank's MoE layers: [expert_begin, expert_end); empty for dense models.
    int expert_begin = 0, expert_end = 0;
    // Bytes of KV this rank stores for each token it holds (all its layers, K and V, its heads).
    int64_t kv_bytes_per_token = 0;

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

// Layers held by each PP stage: explicit split if given, else as even as possible with the first
// (L mod pp) stages holding one extra layer. Validates as make_layout does.
std::vector<int> pp_layer_split(const ModelSpec& m, const ParallelConfig& p);

// Throws Error with a one-line message that says what is wrong and what would be valid.
void validate(const ModelSpec& m, const ParallelConfig& p);
// Also checks that the world size equals the number of GPUs available.
void validate_world(const ParallelConfig& p, int gpus);
// Valid TP sizes for a model: divisors of H that either divide H_kv or are multiples of it.
std::vector<int> valid_tp_sizes(const ModelSpec& m);

KvLayout make_layout(const ModelSpec& m, const ParallelConfig& p);

// ---- token ownership under CP (seq_len: tokens of the sequence so far) ----
// The CP rank that stores token `pos` of a sequence of `seq_len` tokens.
int cp_owner(const ParallelConfig& p, int64_t seq_len, int64_t pos);
// Ranges of global positions CP rank `cp_rank` holds, ascending.
std::vector<TokenRange> cp_token_ranges(const ParallelConfig& p, int cp_rank, int64_t seq_len);
// A human description of the rule, e.g. "chunks 1 and 6 of 8" or "tokens t with (t/16)%4==2".
std::string cp_token_rule(const ParallelConfig& p, int cp_rank);

std::string to_json(const KvLayout& l);

}  // namespace kvshard
