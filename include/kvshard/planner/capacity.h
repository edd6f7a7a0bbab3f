#pragma once
// Capacity: what each GPU of a deployment holds (weights, KV) and how many tokens of KV fit.
// Sized the way vLLM v1 sizes its cache: the KV budget (memory * mem_util - weights - activation
// reserve) divided into blocks of vLLM's arrangement (engine_kv.h: its groups, equal pages and
// their padding), tokens and requests counted from those blocks as vLLM does. Formulas and
// sources: docs/cost-model.md.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvshard/layout/engine_kv.h"
#include "kvshard/layout/kv_layout.h"
#include "kvshard/layout/parallel_config.h"
#include "kvshard/model/model_spec.h"
#include "kvshard/planner/hardware.h"

namespace kvshard {

// The weight storage the planner sizes and times: the model's own dtype, or an override for a
// quantized checkpoint (fp8: 1 byte per weight, as FBGEMM's row-wise fp8 and vLLM's fp8
// checkpoints; fp4: 4 bits per weight, as NVFP4/MXFP4, their block scales (1 byte per 16 or 32
// weights) not counted). Norms and the router are kept at the override too (a small error, < 0.1%
// of weights).
enum class WeightDtype { kModel, kBf16, kFp8, kFp4 };
std::string_view weight_dtype_name(WeightDtype w);   // "model", "bf16", "fp8", "fp4"
WeightDtype parse_weight_dtype(std::string_view s);  // bf16|fp8|fp4 (model: the model's own)
// Bits per weight element: the override's, or 8 * dtype_size(m.weight_dtype) under kModel; 0 under
// kModel for a quantized checkpoint (m.weight_storage): its parts are sized part by part. Error
// under kModel when the checkpoint's quantization method is one kvshard does not size
// (weight_storage.sized false): the caller must name the storage.
int weight_bits(const ModelSpec& m, WeightDtype w);
// Bits per weight of each part at `bits` (weight_bits' value: an override, or 0 for the model's own
// storage): the quantized parts of a checkpoint at their stored bits, the rest (embedding, LM head,
// norms, router) at `base`; and whether the weight matmuls run on fp8 tensor cores (an override of
// 8 bits or fewer, an fp8 dtype, or a checkpoint that computes in fp8).
struct WeightPartBits {
    double base = 16, attention = 16, dense_mlp = 16, experts = 16;
    bool fp8_matmuls = false;
};
WeightPartBits weight_part_bits(const ModelSpec& m, int bits);

struct CapacityOptions {
    double mem_util = 0.9;  // share of GPU memory the engine may use (vLLM gpu_memory_utilization)
    // Memory kept for activations, CUDA graphs, the allocator and NCCL buffers, per GPU.
    int64_t activation_reserve_bytes = int64_t{2} << 30;  // 2 GiB
    int block_size = 16;  // tokens per KV block (vLLM and SGLang default 16)
    // Raise block_size for attention + Mamba/GDN models as vLLM does (engine_kv_arrangement);
    // false (a block size the user gave): keep it, and size such a model without vLLM's padding.
    bool raise_block_size = true;
    int64_t context_tokens = 0;  // a request's context; 0: only ask that one block fits
    // Tokens one scheduler step may prefill (vLLM max_num_batched_tokens; 8192 is `vllm serve`'s
    // default on GPUs of 70 GiB or more, vllm/engine/arg_utils.py): vLLM's startup check charges
    // each sliding layer W - 1 + this many tokens (max_context).
    int64_t max_num_batched_tokens = 8192;
    // Mamba/GDN groups (engine_kv.h): kNone counts one state block per request and group, as vLLM
    // with prefix caching off; kAlign (the default) two, as `vllm serve` does by default for hybrid
    // models since PR #50991 (prefix caching on in align mode).
    MambaCacheMode mamba_cache_mode = MambaCacheMode::kAlign;
    WeightDtype weight_dtype = WeightDtype::kModel;
    // A context_tokens above the model's max_model_len (ModelSpec) is refused, as vLLM refuses
    // such a --max-model-len; true: sized anyway, as vLLM with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1.
    bool allow_long_context = false;
    // Speculative decoding with the model's MTP layers as drafter (vLLM --speculative-config
    // '{"method": "mtp", "num_speculative_tokens": N}'); 0: off. Speculating, as vLLM does:
    //  - the MTP layers' KV joins the KV cache config (gpu_model_runner.get_kv_cache_spec walks
    //    every attention layer of the forward context, the drafter's included): an MLA or full
    //    attention layer more in its kind's groups (with_mtp_layers);
    //  - their weights take memory on every rank (WeightBytes::drafter); at pp > 1 vLLM runs the
    //    whole drafter on the last stage, so its layers' KV and weights are there, with its own
    //    vocab embedding (rank_drafter_weight_bytes);
    //  - each Mamba/GDN group holds N more state blocks per request (speculative_blocks);
    //  - the scheduler asks for N lookahead slots per request (Scheduler.num_lookahead_tokens),
    //    but KVCacheManager.allocate_slots caps a request's slots at max_model_len, which is
    //    context_tokens here: a request of context_tokens holds no more attention blocks.
    // Error on a model without MTP layers.
    int speculative_tokens = 0;
    void validate() const;  // throws Error on a bad value
};

// Weight bytes one rank holds, by kind.
struct WeightBytes {
    int64_t attention = 0;  // Q/K/V/O (K/V of replicated heads counted on every holder)
    int64_t dense_mlp = 0;  // dense layers' MLP, split by tp
    int64_t experts = 0;    // routed experts (E/ep whole experts, or all E split by tp when ep=1),
                            // shared experts (split by tp) and the router (replicated)
    int64_t embedding = 0;  // first PP stage, vocab split by tp
    int64_t lm_head = 0;    // last PP stage, vocab split by tp (also when tied and pp > 1)
    // Norm weights (replicated) and biases (ModelSpec::norms: split with the outputs of column-
    // parallel projections, whole for row-parallel ones and the router), unquantized.
    int64_t norms = 0;
    // Speculating with MTP (CapacityOptions::speculative_tokens): the MTP layers' decoder layers
    // (sized as the model's own layers), their eh_proj / fc and three norms each.
    int64_t drafter = 0;
    int64_t total() const {
        return attention + dense_mlp + experts + embedding + lm_head + norms + drafter;
    }
    bool operator==(const WeightBytes&) const = default;
};

struct RankCapacity {
    int rank = 0;
    WeightBytes weights;
    int64_t kv_bytes_per_token = 0;        // bytes of KV per token this rank stores
    int64_t state_bytes_per_sequence = 0;  // linear-attention / SSM state per sequence
    int64_t kv_budget_bytes = 0;           // memory*mem_util - weights - reserve (may be negative)
    int64_t kv_blocks = 0;                 // floor(budget / engine.block_bytes[rank]); 0 if < 0
    int64_t kv_tokens = 0;  // kv_blocks / groups * block_size (as vLLM logs it); 0 when none fit
};

struct CapacityReport {
    // The limiting rank's figures (the minimum KV token capacity over all ranks).
    int limiting_rank = 0;
    int64_t weight_bytes_per_gpu = 0;  // the most any rank holds
    // Per GPU, the most any rank stores (as weight_bytes_per_gpu; the limiting rank's is in
    // ranks[limiting_rank], 0 for a PP stage of only state layers); while shorter than windows.
    int64_t kv_bytes_per_token = 0;
    int64_t state_bytes_per_sequence = 0;  // per GPU, of the limiting rank
    // vLLM's arrangement of the KV cache (groups, block size, page, padding).
    EngineKvArrangement engine;
    // Blocks of the pool: the fewest over ranks (vLLM gives every worker the smallest num_blocks).
    int64_t kv_blocks_per_gpu = 0;
    // "GPU KV cache size" as vLLM logs it: kv_blocks_per_gpu / groups * block_size (one group:
    // every block of every layer; n groups: tokens one group could hold if the blocks were shared
    // evenly). kSeparate: tokens of a sequence shorter than every window.
    int64_t kv_tokens_per_gpu = 0;
    // The longest context vLLM starts with (its max_model_len check,
    // _check_enough_kv_cache_memory): engine_startup_blocks(M) <= kv_blocks_per_gpu, sliding layers
    // charged W - 1 + max_num_batched_tokens tokens. kSeparate: request_kv_bytes_peak within every
    // rank's budget.
    // At most the model's max_model_len (ModelSpec), as vLLM serves no longer sequence, unless
    // options.allow_long_context.
    int64_t max_context = 0;
    // Every layer keeps a bounded window or state: no context length runs out of memory
    // (max_context is then 2^40, the longest checked), and the model states no length (or
    // allow_long_context).
    bool context_unbounded = false;
    // max_context is the model's max_model_len, not what memory allows (which is more).
    bool context_limited_by_model = false;
    // Blocks one request of options.context_tokens holds at most on its way
    // (engine_request_blocks: full groups all its tokens, windowed groups ceil(W/B) + 1, state
    // groups one); 0 for kSeparate.
    int64_t request_blocks = 0;
    // Bytes the limiting rank holds for it: request_blocks x the rank's block bytes (padding
    // included); kSeparate: request_kv_bytes_peak.
    int64_t request_kv_bytes = 0;
    // Requests of options.context_tokens that fit at once in one DP replica and in all replicas:
    // kv_blocks_per_gpu / request_blocks (kSeparate: the fewest over ranks of floor(KV budget /
    // request_kv_bytes_peak)).
    int64_t requests_per_replica = 0;
    int64_t max_concurrency = 0;  // dp * requests_per_replica
    // Weights fit, at least one block of KV fits, and (when context_tokens > 0) one such request
    // fits and vLLM starts with max_model_len = context_tokens (context_tokens <= max_context).
    bool fits = false;
    std::string why_not;              // empty when fits
    std::vector<RankCapacity> ranks;  // indexed by rank
};

// Weight bytes held by `rank` of the layout, at `bits` per weight (0: the model's storage: each
// part at its weight_storage bits, or the model's dtype; parts left at bits that are not a multiple
// of 8 are rounded up to whole bytes per part).
WeightBytes rank_weight_bytes(const KvLayout& layout, int rank, int bits = 0);

// Weight bytes the MTP drafter adds on `rank` of a layout of `m`: its decoder layers as
// rank_weight_bytes sizes the model's own, plus per MTP step the 2 x hidden -> hidden projection at
// the unquantized weight bits (eh_proj, held whole on every rank; Qwen3-Next's and Nemotron-H's
// split by tp) and three hidden-wide norms. At pp > 1 all of it is on the last stage (vLLM runs the
// drafter there), with the drafter's own vocab embedding (split by tp), which vLLM shares with the
// target's only at pp 1; other stages add 0. Error when m has no MTP layers.
int64_t rank_drafter_weight_bytes(const ModelSpec& m, const ParallelConfig& p, int rank,
                                  int bits = 0);

// Tokens of a sequence of `context_tokens` that the busiest CP rank stores (cp_token_ranges).
int64_t cp_tokens_per_rank(const ParallelConfig& p, int64_t context_tokens);

CapacityReport compute_capacity(const ModelSpec& m, const ParallelConfig& p, const HardwareSpec& hw,
                                const CapacityOptions& options = {});

}  // namespace kvshard
