// Decoder layers of several cache layers (ModelSpec::cache_layers_per_decoder_layer): Falcon-H1's
// attention and Mamba-2 branches side by side. PP splits decoder layers as vLLM's get_pp_indices
// splits num_hidden_layers, and a stage holds every cache layer of its decoder layers.
#include <gtest/gtest.h>

#include <functional>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "kvshard/common/error.h"
#include "kvshard/layout/kv_layout.h"
#include "kvshard/model/catalog.h"

namespace kvshard {
namespace {

// A small parallel hybrid: `decoder` decoder layers, each full attention (2 KV heads of 16, the
// layer's dense MLP) then Mamba-2 (4 heads of 8, 1 group of 16, conv 4; no MLP).
ModelSpec parallel_hybrid(int decoder) {
    ModelSpec m;
    m.name = "parallel-hybrid";
    m.num_layers = 2 * decoder;
    m.cache_layers_per_decoder_layer = 2;
    m.hidden = 64;
    m.num_heads = 4;
    m.num_kv_heads = 2;
    m.head_dim = 16;
    m.intermediate = 128;
    m.vocab = 100;
    m.state = {4, 8, 1, 16, 4};
    for (int d = 0; d < decoder; ++d) {
        LayerSpec a;
        a.kind = LayerKind::kFullAttention;
        a.num_kv_heads = 2;
        a.head_dim = 16;
        a.intermediate = 128;
        LayerSpec s;
        s.kind = LayerKind::kMamba2;
        s.mlp = MlpKind::kNone;
        m.layers.push_back(a);
        m.layers.push_back(s);
    }
    return m;
}

// vLLM's get_pp_indices (vllm/distributed/utils.py), written here from its docstring and body:
// num_hidden_layers // pp_size each, the remainder one each to partitions[-2], [-3], ... (never
// the last); returns [start, end) of pp_rank.
std::pair<int, int> get_pp_indices(int num_hidden_layers, int pp_rank, int pp_size) {
    std::vector<int> partitions(pp_size, num_hidden_layers / pp_size);
    const int remaining = num_hidden_layers % pp_size;
    for (int i = 2; i < remaining + 2; ++i) partitions[pp_size - i] += 1;
    const int start = std::accumulate(partitions.begin(), partitions.begin() + pp_rank, 0);
    return {start, start + partitions[pp_rank]};
}

void expect_error(const std::function<void()>& f, const std::string& needle) {
    try {
        f();
        ADD_FAILURE() << "no error; expected one naming '" << needle << "'";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
}

TEST(DecoderLayers, StagesHoldWholeDecoderLayers) {
    const ModelSpec m = parallel_hybrid(5);
    m.validate();
    EXPECT_EQ(m.num_decoder_layers(), 5);
    EXPECT_EQ(m.layer_mix(), "5 decoder layers x 2 cache layers: 5 full + 5 mamba2");
    ParallelConfig p;
    p.pp = 2;
    // get_pp_indices(5, ., 2): 3 then 2 decoder layers, i.e. cache layers [0,6) and [6,10).
    EXPECT_EQ(pp_layer_split(m, p), (std::vector<int>{3, 2}));
    EXPECT_EQ(pp_cache_layer_split(m, p), (std::vector<int>{6, 4}));
    const KvLayout l = make_layout(m, p);
    EXPECT_EQ(l.ranks[0].layer_begin, 0);
    EXPECT_EQ(l.ranks[0].layer_end, 6);
    EXPECT_EQ(l.ranks[1].layer_begin, 6);
    EXPECT_EQ(l.ranks[1].layer_end, 10);
    // Each stage: as many attention layers as Mamba-2 layers, K and V of 2 x 16 at bf16 each.
    for (const RankKv& r : l.ranks) {
        const int n = r.num_layers() / 2;
        EXPECT_EQ(r.kv_bytes_per_token, int64_t{n} * 2 * 2 * 16 * 2);
        EXPECT_EQ(r.state_bytes_per_sequence, int64_t{n} * state_bytes(m.state, 1));
        ASSERT_EQ(r.groups.size(), 2u);
        EXPECT_EQ(r.groups[0].layers.size(), static_cast<size_t>(n));
        EXPECT_EQ(r.groups[1].layers.size(), static_cast<size_t>(n));
    }
    // An explicit split counts decoder layers.
    p.pp_layers = {1, 4};
    const KvLayout e = make_layout(m, p);
    EXPECT_EQ(e.ranks[0].layer_end, 2);
    EXPECT_EQ(e.ranks[1].layer_begin, 2);
    EXPECT_EQ(e.ranks[1].layer_end, 10);
    p.pp_layers = {4, 6};  // cache layers: refused, naming what it counts
    expect_error([&] { make_layout(m, p); }, "5 decoder layers");
    p.pp_layers.clear();
    p.pp = 6;
    expect_error([&] { make_layout(m, p); }, "pp must be at most 5");
    // The KV-balanced split also counts decoder layers.
    p.pp = 2;
    const auto balanced = pp_layer_split_kv_balanced(m, p, 1000);
    ASSERT_EQ(balanced.size(), 2u);
    EXPECT_EQ(balanced[0] + balanced[1], 5);
    const auto stage = pp_stage_kv_bytes(m, p, 1000);
    ASSERT_EQ(stage.size(), 2u);
    EXPECT_EQ(stage[0], 3 * (1000 * 2 * 2 * 16 * 2 + state_bytes(m.state, 1)));
}

TEST(DecoderLayers, ModelsThatDoNotGroupAreRefused) {
    ModelSpec m = parallel_hybrid(3);
    m.cache_layers_per_decoder_layer = 4;  // 6 cache layers are not a whole number of 4
    expect_error([&] { m.validate(); }, "multiple of cache_layers_per_decoder_layer");
    m.cache_layers_per_decoder_layer = 0;
    expect_error([&] { m.validate(); }, "cache_layers_per_decoder_layer must be in [1, 8]");
    m.layers.clear();  // with no layers listed too
    expect_error([&] { m.validate(); }, "cache_layers_per_decoder_layer must be in [1, 8], got 0");
    m = parallel_hybrid(3);
    std::swap(m.layers[2], m.layers[3]);  // decoder layer 1: Mamba-2 first
    expect_error([&] { m.validate(); }, "every decoder layer");
    m = parallel_hybrid(3);
    m.layers.clear();
    m.num_layers = 6;
    expect_error([&] { m.validate(); }, "must list its layers");
    m = parallel_hybrid(3);
    m.mtp.layers = 1;
    m.mtp.layer = m.layers[0];
    expect_error([&] { m.validate(); }, "MTP layers are not modelled");
    // No all-full-attention comparison for branches side by side.
    expect_error([&] { (void)with_full_attention(parallel_hybrid(3)); }, "all-full-attention");
    // The JSON keeps the grouping; a model of one cache layer per decoder layer writes none.
    const ModelSpec h = parallel_hybrid(3);
    EXPECT_EQ(model_spec_from_json(to_json(h)), h);
    EXPECT_EQ(to_json(catalog_model("llama-3.1-8b")).find("cache_layers_per_decoder_layer"),
              std::string::npos);
}

// Falcon-H1-7B's 44 decoder layers on every pp from 1 to 44: each stage holds the cache layers
// [2 x start, 2 x end) of vLLM's get_pp_indices(44, stage, pp).
TEST(DecoderLayers, FalconH1SplitsAsGetPpIndices) {
    const ModelSpec m = load_hf_config(std::string(KVSHARD_TEST_DATA_DIR) +
                                       "/hf_configs/falcon-h1-7b-instruct.json");
    ASSERT_EQ(m.num_decoder_layers(), 44);
    for (int pp = 1; pp <= 44; ++pp) {
        SCOPED_TRACE(pp);
        ParallelConfig p;
        p.pp = pp;
        const KvLayout l = make_layout(m, p);
        for (int s = 0; s < pp; ++s) {
            const auto [start, end] = get_pp_indices(44, s, pp);
            const RankKv& r = l.ranks[static_cast<size_t>(rank_of(p, 0, s, 0, 0))];
            EXPECT_EQ(r.layer_begin, 2 * start) << "stage " << s;
            EXPECT_EQ(r.layer_end, 2 * end) << "stage " << s;
            // The stage's attention KV: 2 KV heads x 128 x K,V x bf16 per decoder layer.
            EXPECT_EQ(r.kv_bytes_per_token, int64_t{end - start} * 1024) << "stage " << s;
        }
    }
    ParallelConfig too_many;
    too_many.pp = 45;
    expect_error([&] { make_layout(m, too_many); }, "44 decoder layers");
}

// LongCat-Flash-Chat's 28 decoder layers of three cache layers (MLA, MLA, the MoE) on every pp from
// 1 to 28: cache layers [3 x start, 3 x end) of get_pp_indices(28, stage, pp), two MLA latents of
// (512 + 64) x bf16 per decoder layer.
TEST(DecoderLayers, LongcatFlashSplitsAsGetPpIndices) {
    const ModelSpec m =
        load_hf_config(std::string(KVSHARD_TEST_DATA_DIR) + "/hf_configs/longcat-flash-chat.json");
    ASSERT_EQ(m.num_decoder_layers(), 28);
    for (int pp = 1; pp <= 28; ++pp) {
        SCOPED_TRACE(pp);
        ParallelConfig p;
        p.pp = pp;
        const KvLayout l = make_layout(m, p);
        for (int s = 0; s < pp; ++s) {
            const auto [start, end] = get_pp_indices(28, s, pp);
            const RankKv& r = l.ranks[static_cast<size_t>(rank_of(p, 0, s, 0, 0))];
            EXPECT_EQ(r.layer_begin, 3 * start) << "stage " << s;
            EXPECT_EQ(r.layer_end, 3 * end) << "stage " << s;
            EXPECT_EQ(r.kv_bytes_per_token, int64_t{end - start} * 2 * 576 * 2) << "stage " << s;
        }
    }
}

}  // namespace
}  // namespace kvshard
