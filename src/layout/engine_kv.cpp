#include "kvshard/layout/engine_kv.h"

#include <algorithm>

#include "kvshard/common/checked.h"
#include "kvshard/common/error.h"

namespace kvshard {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// One layer of each model-wide KV group, as a rank that holds one sees it (TP splits every rank
// alike, so any holder gives the same figures). vLLM's pages hold the elements only: its fp8 cache
// keeps one k_scale and one v_scale per layer outside them (kvshard's own pools add a scale per
// block and head, RankKvGroup::scale_bytes_per_block, which this arrangement leaves out).
struct LayerPage {
    int64_t bytes_per_token = 0;  // token groups
    int64_t state_bytes = 0;      // state groups
};

std::vector<LayerPage> layer_pages(const KvLayout& l, size_t n_groups) {
    std::vector<LayerPage> out(n_groups);
    std::vector<bool> seen(n_groups, false);
    for (const RankKv& rk : l.ranks)
        for (const RankKvGroup& g : rk.groups) {
            const size_t gi = static_cast<size_t>(g.group);
            if (seen[gi]) continue;
            seen[gi] = true;
            const int64_t n = static_cast<int64_t>(g.layers.size());
            out[gi] = {g.bytes_per_token / n, g.state_bytes_per_sequence / n};
        }
    return out;
}

bool full_like(LayerKind k) { return k == LayerKind::kFullAttention || k == LayerKind::kMla; }

// vLLM's uniform cases (get_kv_cache_groups: is_kv_cache_spec_uniform, then
// UniformTypeKVCacheSpecs.is_uniform_type): every layer needs the same token slots.
bool uniform_type(const std::vector<KvGroup>& groups) {
    const KvGroup& a = groups.front();
    for (const KvGroup& g : groups) {
        if (full_like(a.kind) && full_like(g.kind)) continue;
        if (holds_state(a.kind) && holds_state(g.kind)) continue;
        if (g.kind != a.kind || g.window != a.window) return false;
    }
    return true;
}

void separate(const KvLayout& l, int block_size, EngineKvArrangement& a) {
    a.kind = EngineKvKind::kSeparate;
    a.block_size = block_size;
    a.group_size = 0;
    a.page_bytes = 0;
    a.state_page_padding = 0;
    a.groups.clear();
    const std::vector<KvGroup> groups = kv_groups(l.model);
    for (size_t gi = 0; gi < groups.size(); ++gi) {
        const KvGroup& g = groups[gi];
        a.groups.push_back({static_cast<int>(gi), g.kind, g.window, block_size, g.layers});
    }
    a.block_bytes.assign(l.ranks.size(), 0);
    for (size_t r = 0; r < l.ranks.size(); ++r)
        a.block_bytes[r] = sat_mul(block_size, l.ranks[r].kv_bytes_per_token);
}

// Blocks group g holds at the CP position cp_rank for a sequence of seq_len tokens, at most, on
// the way to seq_len. A state group in align mode holds the block of the last boundary and the
// running one for the step after the sequence crosses a block; speculating, it holds
// num_speculative_blocks more (MambaManager.allocate_new_blocks: none mode asks for
// block_size x num_speculative_blocks more tokens, align mode cdiv(n, B) + num_speculative_blocks
// blocks of which all but the running state, its speculative ones and the last boundary's are
// null).
int64_t peak_blocks(const ParallelConfig& p, const EngineKvGroup& g, const EngineKvArrangement& a,
                    int cp_rank, int64_t seq_len) {
    if (holds_state(g.kind)) {
        if (seq_len <= 0) return 0;
        return (a.mamba_cache_mode == MambaCacheMode::kAlign && seq_len > g.block_size ? 2 : 1) +
               a.speculative_blocks;
    }
    const int64_t all = ceil_div(cp_tokens_before(p, cp_rank, seq_len, seq_len), g.block_size);
    if (g.window > 0) return std::min(all, ceil_div(g.window, g.block_size) + 1);
    return all;
}

}  // namespace

std::string_view mamba_cache_mode_name(MambaCacheMode m) {
    return m == MambaCacheMode::kAlign ? "align" : "none";
}

MambaCacheMode parse_mamba_cache_mode(std::string_view s) {
    if (s == "none") return MambaCacheMode::kNone;
    if (s == "align") return MambaCacheMode::kAlign;
    throw Error(detail::concat("unknown mamba cache mode '", s,
                               "': expected none (vLLM with prefix caching off) or align (with "
                               "prefix caching on, vLLM's default for hybrid models)"));
}

int EngineKvArrangement::padding_slots() const {
    if (kind != EngineKvKind::kHybrid) return 0;
    int layers = 0;
    for (const EngineKvGroup& g : groups) layers += static_cast<int>(g.layers.size());
    return group_size * static_cast<int>(groups.size()) - layers;
}

EngineKvArrangement engine_kv_arrangement(const KvLayout& l, int block_size, bool raise_block_size,
                                          MambaCacheMode mamba_cache_mode) {
    require(block_size >= 1, "block_size must be a positive integer, got ", block_size);
    EngineKvArrangement a;
    a.mamba_cache_mode = mamba_cache_mode;
    a.block_size = a.vllm_block_size = block_size;
    const std::vector<KvGroup> groups = kv_groups(l.model);
    a.block_bytes.assign(l.ranks.size(), 0);
    if (groups.empty()) return a;
    const std::vector<LayerPage> pages = layer_pages(l, groups.size());

    if (uniform_type(groups)) {
        // One group, one block table; a block takes a page in every layer's tensor.
        a.kind = EngineKvKind::kUniform;
        EngineKvGroup g{0, groups.front().kind, groups.front().window, block_size, {}};
        for (const KvGroup& kg : groups)
            g.layers.insert(g.layers.end(), kg.layers.begin(), kg.layers.end());
        std::sort(g.layers.begin(), g.layers.end());
        a.groups.push_back(std::move(g));
        for (size_t r = 0; r < l.ranks.size(); ++r) {
            int64_t bytes = 0;
            for (const RankKvGroup& rg : l.ranks[r].groups)
                bytes =
                    sat_add(bytes, holds_state(rg.kind) ? rg.state_bytes_per_sequence
                                                        : sat_mul(block_size, rg.bytes_per_token));
            a.block_bytes[r] = bytes;
        }
        return a;
    }

    // Platform._align_hybrid_block_size: an attention page must hold a state page, so the block
    // size becomes a * cdiv(state page, a * one token's attention page) when smaller, with the
    // alignment a = max(the attention backend's smallest kernel block, the configured block
    // size); the state page is padded up to the attention page. kKernelBlockAlignment is
    // FlashAttention's and FlashInfer's smallest kernel block on CUDA.
    constexpr int64_t kKernelBlockAlignment = 16;
    int64_t state_page = 0, attn_token = 0;
    for (size_t gi = 0; gi < groups.size(); ++gi) {
        state_page = std::max(state_page, pages[gi].state_bytes);
        attn_token = std::max(attn_token, pages[gi].bytes_per_token);
    }
    int block = block_size;
    if (state_page > 0 && attn_token > 0) {
        const int64_t align = std::max<int64_t>(kKernelBlockAlignment, block_size);
        // A multiple of align, so never below block_size; equal when block_size tokens hold it.
        const int64_t needed = align * ceil_div(state_page, align * attn_token);
        require(needed == block_size || needed <= (1 << 20), "a state page of ", state_page,
                " bytes needs more than 2^20 tokens per attention block");
        a.vllm_block_size = std::max<int>(block_size, static_cast<int>(needed));
        if (a.vllm_block_size > block_size && !raise_block_size) {
            a.note = detail::concat("vLLM would raise the block size from ", block_size, " to ",
                                    a.vllm_block_size, " tokens so an attention page (",
                                    a.vllm_block_size * attn_token,
                                    " B) holds a state page; sized without its padding");
            separate(l, block_size, a);
            return a;
        }
        block = a.vllm_block_size;
    }
    a.block_size = block;

    // unify_kv_cache_spec_page_size: the largest page wins; a smaller one gets more tokens per
    // block when it divides it, and vLLM refuses the model otherwise.
    std::vector<int64_t> page(groups.size());
    int64_t largest = 0;
    for (size_t gi = 0; gi < groups.size(); ++gi) {
        page[gi] = holds_state(groups[gi].kind) ? pages[gi].state_bytes
                                                : sat_mul(block, pages[gi].bytes_per_token);
        if (!holds_state(groups[gi].kind)) largest = std::max(largest, page[gi]);
    }
    if (largest == 0) largest = *std::max_element(page.begin(), page.end());
    std::vector<int> group_block(groups.size(), block);
    for (size_t gi = 0; gi < groups.size(); ++gi) {
        if (holds_state(groups[gi].kind)) continue;  // padded to the attention page
        if (page[gi] < largest) {
            if (largest % page[gi] != 0) {
                a.note = detail::concat("vLLM cannot make its pages equal (", page[gi],
                                        " B does "
                                        "not divide ",
                                        largest, " B); sized without padding");
                separate(l, block_size, a);
                return a;
            }
            group_block[gi] = static_cast<int>(block * (largest / page[gi]));
        }
    }
    a.kind = EngineKvKind::kHybrid;
    a.page_bytes = largest;
    a.state_page_padding = state_page > 0 ? largest - state_page : 0;

    // _get_kv_cache_groups_uniform_page_size: groups of group_size layers, the fewest layers of a
    // kind (or the most, when no kind has 1.5x the fewest); the i-th of n groups of a kind takes
    // its layers[i::n], the last ones padded.
    size_t fewest = SIZE_MAX, most = 0;
    for (const KvGroup& g : groups) {
        fewest = std::min(fewest, g.layers.size());
        most = std::max(most, g.layers.size());
    }
    a.group_size = static_cast<int>(2 * most < 3 * fewest ? most : fewest);
    for (size_t gi = 0; gi < groups.size(); ++gi) {
        const auto& layers = groups[gi].layers;
        const size_t n = ceil_div(static_cast<int64_t>(layers.size()), a.group_size);
        for (size_t i = 0; i < n; ++i) {
            EngineKvGroup g{
                static_cast<int>(gi), groups[gi].kind, groups[gi].window, group_block[gi], {}};
            for (size_t j = i; j < layers.size(); j += n) g.layers.push_back(layers[j]);
            a.groups.push_back(std::move(g));
        }
    }
    // get_kv_cache_config_from_groups, per worker: one tensor of num_blocks pages per layer slot,
    // as many slots as the largest group has layers on that worker.
    for (size_t r = 0; r < l.ranks.size(); ++r) {
        const RankKv& rk = l.ranks[r];
        int64_t slots = 0;
        for (const EngineKvGroup& g : a.groups)
            slots = std::max<int64_t>(
                slots, std::count_if(g.layers.begin(), g.layers.end(), [&](int layer) {
                    return layer >= rk.layer_begin && layer < rk.layer_end;
                }));
        a.block_bytes[r] = sat_mul(largest, slots);
    }
    return a;
}

int64_t engine_request_blocks(const EngineKvArrangement& a, const ParallelConfig& p,
                              int64_t seq_len) {
    KVSHARD_CHECK(a.kind != EngineKvKind::kSeparate, "request blocks of a separate arrangement");
    int64_t most = 0;
    for (int c = 0; c < p.cp; ++c) {
        int64_t blocks = 0;
        for (const EngineKvGroup& g : a.groups)
            blocks = sat_add(blocks, peak_blocks(p, g, a, c, seq_len));
        most = std::max(most, blocks);
    }
    return most;
}

int64_t engine_startup_blocks(const EngineKvArrangement& a, const ParallelConfig& p,
                              int64_t max_model_len, int64_t max_num_batched_tokens) {
    KVSHARD_CHECK(a.kind != EngineKvKind::kSeparate, "startup blocks of a separate arrangement");
    int64_t n = 0;  // tokens the busiest CP rank keeps (vLLM's DCP: cdiv(M, dcp))
    for (int c = 0; c < p.cp; ++c)
        n = std::max(n, cp_tokens_before(p, c, max_model_len, max_model_len));
    int64_t blocks = 0;
    for (const EngineKvGroup& g : a.groups) {
        const int64_t b = g.block_size;
        int64_t need = 0;
        switch (g.kind) {
            case LayerKind::kSlidingWindow:
                need =
                    ceil_div(std::min(g.window - 1 + max_num_batched_tokens, max_model_len), b) + 1;
                break;
            case LayerKind::kChunkedLocal:
                need = ceil_div(std::min(g.window + max_num_batched_tokens, max_model_len), b);
                break;
            case LayerKind::kGatedDeltaNet:
            case LayerKind::kMamba2:
            case LayerKind::kMamba1:
            case LayerKind::kShortConv:
                need =
                    (a.mamba_cache_mode == MambaCacheMode::kAlign ? 2 : 1) + a.speculative_blocks;
                break;
            default:
                need = ceil_div(n, b);
                break;
        }
        blocks = sat_add(blocks, need);
    }
    return blocks;
}

}  // namespace kvshard
