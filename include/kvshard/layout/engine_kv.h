#pragma once
// How vLLM v1 arranges a model's KV cache in GPU memory: its KV cache groups, its page per block
// and the padding both bring, so that the planner's capacity is what vLLM allocates. Sources
// (vllm-project/vllm): vllm/v1/core/kv_cache_utils.py @001cabc1 (get_kv_cache_groups,
// _get_kv_cache_groups_uniform_page_size, get_kv_cache_config_from_groups, _report_kv_cache_config,
// _max_memory_usage_bytes_from_groups), vllm/v1/kv_cache_interface.py @001cabc1 (page sizes,
// max_memory_usage_bytes), vllm/model_executor/models/config.py @1936cf38
// (HybridAttentionMambaModelConfig) and vllm/platforms/interface.py (Platform.
// _align_hybrid_block_size, which took its block size rule over in vLLM PR #37467). docs/model.md
// "KV groups" walks through it.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvshard/layout/kv_layout.h"

namespace kvshard {

enum class EngineKvKind {
    // One group of every layer, one block = every layer's page (vLLM's uniform spec and
    // UniformTypeKVCacheSpecs: all layers full attention / MLA, or one window, or one chunk).
    kUniform,
    // Several kinds: pages made equal (Mamba states padded to an attention page, smaller pages
    // given more tokens per block), each kind split into groups of group_size layer slots; a block
    // id takes one page in each of group_size tensors, so padding slots cost memory.
    kHybrid,
    // Not vLLM's arrangement: the block size was given below what vLLM needs for the model's
    // state pages, or vLLM cannot make the pages equal. Token groups in blocks of block_size with
    // the bytes they hold, state layers their state once per sequence, nothing padded.
    kSeparate,
};

// vLLM's cache_config.mamba_cache_mode for the state (Mamba/GDN) groups. kNone: prefix caching off,
// one state block per request and group. kAlign: prefix caching on, `vllm serve`'s default for
// hybrid models since vLLM PR #50991 (vllm/engine/arg_utils.py, 2026-08): the state is kept at
// block boundaries, so a request holds a second state block for the step after it crosses one
// (MambaManager in vllm/v1/core/single_type_kv_cache_manager.py) and vLLM's startup check charges
// two (MambaSpec.max_memory_usage_bytes, vllm/v1/kv_cache_interface.py). The block size rule is
// the same for both.
enum class MambaCacheMode { kNone, kAlign };
std::string_view mamba_cache_mode_name(MambaCacheMode m);   // "none", "align"
MambaCacheMode parse_mamba_cache_mode(std::string_view s);  // Error naming the choices

// One of vLLM's KV cache groups: one block table per request.
struct EngineKvGroup {
    int kv_group = 0;  // index into kv_groups(model): the kind of its layers
    LayerKind kind = LayerKind::kFullAttention;
    int window = 0;           // W or chunk C; 0 otherwise
    int block_size = 16;      // tokens per block of this group (a Mamba group: one state per block)
    std::vector<int> layers;  // global layer ids: layers[i::n] of its kind (n groups of the kind)
    bool operator==(const EngineKvGroup&) const = default;
};

struct EngineKvArrangement {
    EngineKvKind kind = EngineKvKind::kUniform;
    int block_size = 16;       // tokens per block of the attention groups
    int vllm_block_size = 16;  // what vLLM would use (differs when a given block_size is too small)
    int group_size = 0;        // layer slots per group, model-wide (kHybrid)
    int64_t page_bytes = 0;    // bytes of one layer slot per block (kHybrid)
    int64_t state_page_padding = 0;  // bytes added to each Mamba/GDN state page (kHybrid)
    std::vector<EngineKvGroup> groups;
    // Bytes one block id takes on each rank (kHybrid: page_bytes x the most layers any group has
    // on that rank; kUniform: the rank's layers' pages, vLLM's fp8 keeping its per-layer scales
    // outside them; kSeparate: the token groups' blocks, state not included).
    std::vector<int64_t> block_bytes;                          // indexed by rank
    MambaCacheMode mamba_cache_mode = MambaCacheMode::kAlign;  // how state groups count blocks
    // Extra state blocks a request holds in each Mamba/GDN group while speculating: vLLM's
    // MambaSpec.num_speculative_blocks, the number of speculative tokens
    // (MambaBase.get_kv_cache_spec), one state per draft token a step may verify.
    int speculative_blocks = 0;
    std::string note;  // why kSeparate, or what vLLM does that differs from the options given
    int padding_slots() const;  // group_size x groups - layers (kHybrid), else 0
    bool operator==(const EngineKvArrangement&) const = default;
};

// vLLM's arrangement of `l` at `block_size` tokens per block. raise_block_size: for a model with
// Mamba/GDN layers and attention, raise block_size as vLLM does (a x cdiv(state page, a x one
// token's attention page), a = max(16, block_size)) when it is smaller; false: keep it (kSeparate
// when it is too small, with a note naming vLLM's).
EngineKvArrangement engine_kv_arrangement(const KvLayout& l, int block_size,
                                          bool raise_block_size = true,
                                          MambaCacheMode mamba_cache_mode = MambaCacheMode::kAlign);

// Blocks one request holds across all groups, at the busiest CP rank of a sequence of `seq_len`
// tokens: full groups ceil(n / B), windowed groups the most blocks they hold at any length up to
// seq_len (min(ceil(n / B), ceil(W / B) + 1)), state groups 1 (kAlign: 2 once seq_len exceeds
// their block) + speculative_blocks. Not for kSeparate.
int64_t engine_request_blocks(const EngineKvArrangement& a, const ParallelConfig& p,
                              int64_t seq_len);
// Blocks vLLM's startup check charges one request of max_model_len M
// (_max_memory_usage_bytes_from_groups): full ceil(n / B), sliding ceil(min(W - 1 + T, M) / B) +
// 1, chunked ceil(min(C + T, M) / B), state 1 (kAlign: 2) + speculative_blocks
// (MambaSpec.max_memory_usage_bytes), T = max_num_batched_tokens (the
// chunked-prefill tokens a step may add). kUniform: the most any of its kinds needs. Not for
// kSeparate.
int64_t engine_startup_blocks(const EngineKvArrangement& a, const ParallelConfig& p,
                              int64_t max_model_len, int64_t max_num_batched_tokens);

}  // namespace kvshard
