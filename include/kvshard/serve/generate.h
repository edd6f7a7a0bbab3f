#pragma once
// Batched prefill + greedy decode of a set of prompts on one group of ranks, unsharded or sharded
// over TP / PP / EP / DP, or under context parallelism (docs/model.md, "Sharded execution";
// docs/context-parallel.md §8).
//
// Every rank runs the same schedule: prefill steps over all of its replica's prompts (each
// prompt first asks the prefix cache; cached tokens are not recomputed; one step, or chunks of
// prefill_chunk_tokens per prompt per step), then max_new_tokens - 1 decode steps of one token per
// sequence. Prompt i goes to DP replica i % dp. The last pipeline
// stage picks the greedy token and sends it to the earlier stages of its replica. With cp > 1
// (dp = pp = 1) the CP executor (exec/cp_session.h) serves each prompt in turn.
#include <cstdint>
#include <optional>
#include <vector>

#include "kvshard/cache/block_pool.h"
#include "kvshard/layout/cp_plan.h"
#include "kvshard/layout/kv_layout.h"
#include "kvshard/model/weights.h"

namespace kvshard {

class Communicator;

struct GenerationOptions {
    int max_new_tokens = 16;  // greedy tokens per prompt; the first comes from the prefill step
    int block_size = 16;
    int64_t num_blocks = 0;  // blocks per rank; 0: enough for every prompt of the replica
    bool prefix_cache = true;
    // Chunked prefill: each step computes at most this many tokens of each prompt (bounding a
    // step's rows and activations); a prompt starts decoding when all prompts are prefilled.
    // 0: a prompt's whole prefill in one step. Not for cp > 1 (its executor prefills per prompt).
    int64_t prefill_chunk_tokens = 0;
    PageOrder page_order = PageOrder::kHnd;
    // Context parallelism (cp > 1): the prefill mode (empty: the one that moves fewer bytes) and
    // how the decode partials are merged.
    std::optional<CpPrefillMode> cp_prefill_mode;
    CpDecodeMerge cp_decode_merge = CpDecodeMerge::kAllGather;
    // The DP replica of each prompt (e.g. from route_prompts); empty: prompt i on replica i % dp.
    std::vector<int> replica_of;
    // Continuous batching under CP (cp > 1): prompt i joins the running batch at decode step
    // arrival_step[i] (>= 0; the prompts arriving at one step are prefilled together, then decode
    // with the others), and each leaves once it has max_new_tokens tokens. Empty: every prompt at
    // step 0. The plain runner (cp = 1) refuses it: it prefills every prompt in its first steps.
    std::vector<int> arrival_step;
};

struct RankReport {
    int rank = 0;
    RankCoord coord;
    int64_t kv_tokens = 0;  // distinct tokens whose KV this rank holds at the end
    // The bytes of this rank's pool in the distinct blocks it holds at the end (elements of the
    // KV dtype and, fp8, the per-block scales): blocks * the pool's block_bytes(). Under CP:
    // kv_tokens * the pool's bytes per token.
    int64_t kv_bytes = 0;
    // The layout's figure: the sum over the rank's requests of request_kv_bytes (at the run's KV
    // dtype), less the layout's bytes of one block per block the prefix cache shares. Under CP:
    // kv_tokens * the layout's kv_bytes_per_token.
    int64_t kv_bytes_predicted = 0;
    int64_t prefix_hit_tokens = 0;  // prompt tokens found in this rank's prefix cache
    double prefill_seconds = 0, decode_seconds = 0;
};

struct GenerationReport {
    std::vector<std::vector<int32_t>> tokens;        // per prompt: the generated tokens
    std::vector<std::vector<float>> last_logits;     // per prompt: [vocab] logits of the last step
    std::vector<RankReport> ranks;                   // by rank
    int64_t prompt_tokens = 0;                       // over all prompts
    int64_t prefix_hit_tokens = 0;                   // over all replicas
    int64_t computed_prompt_tokens = 0;              // prompt tokens run through the prefill step
    double prefill_seconds = 0, decode_seconds = 0;  // the slowest rank's
    // Whether prompts were looked up in the prefix cache: options.prefix_cache, except under CP
    // when the scheme cannot align block hashes across ranks (cp_prefix_cache_supported).
    bool prefix_cache = true;
    std::string prefix_cache_note;  // why it is off when options asked for it; empty otherwise
};

// Under CP the prefix cache works when every rank's blocks hold whole hashed blocks of the
// sequence: cp_scheme interleave with cp_interleave == block_size. Empty when it does; else why
// not.
std::string cp_prefix_cache_unsupported(const ParallelConfig& p, int block_size);
// Why a model cannot reuse cached prefixes at all, or empty: state layers (Gated DeltaNet) keep one
// running state per sequence, which the runner does not save at block boundaries, so a prefix hit
// could not restore it.
std::string model_prefix_cache_unsupported(const ModelSpec& m);

// Runs the generation on this rank. Collective over `world` (world->size() == p.world_size()); with
// world == nullptr the run is one rank and p.world_size() must be 1. Every rank returns the whole
// report. The model computes in fp32; its pools store m.kv_dtype (fp32, bf16, fp16 or fp8 e4m3,
// docs/cache.md "Element types"). Under CP (cp > 1) the KV dtype must be fp32 (Error otherwise).
GenerationReport generate(const ModelSpec& m, const ParallelConfig& p, const TensorSource& weights,
                          const std::vector<std::vector<int32_t>>& prompts,
                          const GenerationOptions& options, Communicator* world = nullptr);

// generate()'s path for cp > 1, with the same report: continuous batching on a CpSession (the
// prompts that arrive at a step, opt.arrival_step, are prefilled in one forward; every running
// sequence decodes one token per step, all in one forward). Prompt i is sequence i; prefix caching
// (opt.prefix_cache) needs cp_scheme = interleave with cp_interleave = opt.block_size. Collective
// over world (world->size() == p.world_size(), dp = pp = 1); null world: one rank.
GenerationReport cp_generate(const ModelSpec& m, const ParallelConfig& p,
                             const TensorSource& weights,
                             const std::vector<std::vector<int32_t>>& prompts,
                             const GenerationOptions& opt, Communicator* world);

// Continuous batching's schedule, a pure function of the arrivals (the CP runner carries it out).
// At a step, the prompts that have arrived by then join (one batch prefill, which gives each its
// first token), then every running prompt (those joining included) decodes one token, unless it
// already has max_new_tokens; a prompt leaves in the step at which it reaches max_new_tokens. Steps
// at which nothing runs and nothing arrives are skipped. arrival_step empty: all at step 0.
struct BatchStep {
    int step = 0;
    std::vector<int64_t> join;    // prompts prefilled at this step, by arrival then index
    std::vector<int64_t> decode;  // prompts decoding one token at this step, in batch order
    std::vector<int64_t> leave;   // prompts done after this step
    bool operator==(const BatchStep&) const = default;
};
std::vector<BatchStep> continuous_batch_schedule(const std::vector<int>& arrival_step,
                                                 size_t num_prompts, int max_new_tokens);

// Error unless max_new_tokens >= 1 and every prompt is non-empty with token ids in [0, vocab).
void check_prompts(const std::vector<std::vector<int32_t>>& prompts, int vocab, int max_new_tokens);

}  // namespace kvshard
