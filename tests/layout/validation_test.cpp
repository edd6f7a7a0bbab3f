// Every validation error path of the layout (issue 2, §3): each is a kvshard::Error whose one-line
// message says what is wrong and what would be valid.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kvshard/common/error.h"
#include "kvshard/layout/kv_layout.h"
#include "kvshard/model/catalog.h"

namespace kvshard {
namespace {

ParallelConfig cfg(int tp, int pp = 1, int cp = 1, int dp = 1, int ep = 1) {
    ParallelConfig p;
    p.tp = tp;
    p.pp = pp;
    p.cp = cp;
    p.dp = dp;
    p.ep = ep;
    return p;
}

// Runs f, expects an Error whose message contains every needle and has no newline.
template <typename F>
void expect_error(F&& f, std::initializer_list<const char*> needles) {
    try {
        f();
        ADD_FAILURE() << "no error; expected one mentioning " << *needles.begin();
    } catch (const Error& e) {
        const std::string what = e.what();
        for (const char* n : needles)
            EXPECT_NE(what.find(n), std::string::npos) << "'" << n << "' not in: " << what;
        EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    }
}

const ModelSpec& llama70() {
    static const ModelSpec m = catalog_model("llama-3.1-70b");
    return m;
}

TEST(Validation, QueryHeadsNotDivisibleByTp) {
    expect_error(
        [] { make_layout(llama70(), cfg(3)); },
        {"tp=3 does not divide the 64 query heads", "valid tp sizes are 1, 2, 4, 8, 16, 32, 64"});
}

TEST(Validation, TpAndKvHeadsDoNotDivideOneAnother) {
    ModelSpec m = llama70();
    m.num_heads = 48;  // 48 query heads, 8 KV heads: tp=12 divides 48 but neither divides the other
    expect_error([&] { make_layout(m, cfg(12)); },
                 {"tp=12 and the 8 KV heads", "valid tp sizes are 1, 2, 4, 8, 16, 24, 48"});
    EXPECT_EQ(valid_tp_sizes(m), (std::vector<int>{1, 2, 4, 8, 16, 24, 48}));
}

// vLLM's MambaMixer2 (vllm/model_executor/layers/mamba/mamba_mixer2.py) asserts num_heads % tp
// == 0 and (n_groups % tp == 0 or n_groups == 1). Nemotron-H-8B (128 SSM heads, 8 groups, 32 query
// heads, 8 KV heads) therefore runs at tp 1, 2, 4 and 8 only: tp 16 and 32 would replicate its
// groups, which vLLM refuses.
TEST(Validation, Mamba2GroupsAreSplitOverTpOrSingle) {
    const ModelSpec nh = catalog_model("nemotron-h-8b");
    EXPECT_EQ(valid_tp_sizes(nh), (std::vector<int>{1, 2, 4, 8}));
    expect_error([&] { make_layout(nh, cfg(16)); },
                 {"tp=16", "128 SSM heads and 8 groups", "valid tp sizes are 1, 2, 4, 8"});
    // One group: every rank holds it. mamba2_state_shape extends n_groups = 1 to tp groups
    // (extra_groups_for_head_shards) and splits the conv channels over tp: at tp 8 a rank's conv
    // state is 3 x (128 x 64 + 2 x 8 x 128) / 8 = 3 x 1280 bf16, its SSM state 16 x 64 x 128
    // fp32: 7,680 + 524,288 = 531,968 B, the same as with 8 groups.
    ModelSpec one = nh;
    one.state.groups = 1;
    EXPECT_EQ(valid_tp_sizes(one), (std::vector<int>{1, 2, 4, 8, 16, 32}));
    EXPECT_EQ(make_layout(one, cfg(8)).ranks[0].state_bytes_per_sequence, 24 * 531968);
    EXPECT_EQ(state_bytes(one.state, 8), 531968);
    EXPECT_EQ(state_bytes(nh.state, 8), 531968);
}

TEST(Validation, PpLargerThanLayers) {
    expect_error([] { make_layout(catalog_model("tiny"), cfg(1, 5)); },
                 {"pp=5 is larger than the 4 layers", "at most 4"});
}

TEST(Validation, ExplicitPpSplitErrors) {
    auto p = cfg(1, 2);
    p.pp_layers = {40};
    expect_error([&] { make_layout(llama70(), p); }, {"pp_layers lists 1 stages but pp=2"});
    p.pp_layers = {80, 0};
    expect_error([&] { make_layout(llama70(), p); }, {"at least one layer"});
    p.pp_layers = {40, 30};
    expect_error([&] { make_layout(llama70(), p); }, {"pp_layers sums to 70", "add up to 80"});
}

TEST(Validation, EpOnDenseModel) {
    expect_error([] { make_layout(llama70(), cfg(4, 1, 1, 2, 8)); },
                 {"ep=8 on llama-3.1-70b", "dense model", "use ep=1"});
}

TEST(Validation, EpNotDividingExperts) {
    expect_error([] { make_layout(catalog_model("mixtral-8x7b"), cfg(1, 1, 1, 3, 3)); },
                 {"ep=3 does not divide the 8 experts"});
    // 6 ranks per stage, ep=6: does not divide the 8 experts either.
    expect_error([] { make_layout(catalog_model("mixtral-8x7b"), cfg(2, 1, 1, 3, 6)); },
                 {"ep=6 does not divide the 8 experts"});
}

TEST(Validation, EpNotDividingStageRanks) {
    expect_error([] { make_layout(catalog_model("mixtral-8x7b"), cfg(4, 1, 1, 1, 8)); },
                 {"ep=8 does not divide the dp*cp*tp=4 ranks", "ep must divide dp*cp*tp"});
}

TEST(Validation, WorldSizeMustMatchGpuCount) {
    expect_error([] { validate_world(cfg(8, 2), 8); },
                 {"dp*pp*cp*tp = 1*2*1*8 = 16 ranks, but 8 GPUs", "must equal the GPU count"});
    expect_error([] { validate_world(cfg(1), 0); },
                 {"GPU count must be a positive integer, got 0"});
    EXPECT_NO_THROW(validate_world(cfg(8, 2), 16));
}

TEST(Validation, ZeroOrNegativeSizes) {
    for (int v : {0, -1}) {
        expect_error([&] { make_layout(llama70(), cfg(v)); }, {"tp must be a positive integer"});
        expect_error([&] { make_layout(llama70(), cfg(1, v)); }, {"pp must be a positive integer"});
        expect_error([&] { make_layout(llama70(), cfg(1, 1, v)); },
                     {"cp must be a positive integer"});
        expect_error([&] { make_layout(llama70(), cfg(1, 1, 1, v)); },
                     {"dp must be a positive integer"});
        expect_error([&] { make_layout(llama70(), cfg(1, 1, 1, 1, v)); },
                     {"ep must be a positive integer"});
        auto p = cfg(1, 1, 2);
        p.cp_scheme = CpScheme::kInterleave;
        p.cp_interleave = v;
        expect_error([&] { make_layout(llama70(), p); },
                     {"cp_interleave must be a positive integer"});
    }
}

TEST(Validation, ParallelConfigText) {
    expect_error([] { parse_parallel_config("tp=8,qq=2"); },
                 {"unknown key 'qq'", "expected tp, pp"});
    expect_error([] { parse_parallel_config("tp8"); }, {"'tp8' is not key=value"});
    expect_error([] { parse_parallel_config("tp=eight"); }, {"'tp' needs an integer, got 'eight'"});
    // A key given twice would keep only its last value: refused, aliases included.
    expect_error([] { parse_parallel_config("tp=2,tp=4"); }, {"gives tp twice", "each key once"});
    expect_error([] { parse_parallel_config("cp=2 sp=4"); }, {"gives cp twice"});
    expect_error([] { parse_parallel_config("cp_scheme=zigzag,cp-scheme=contiguous"); },
                 {"gives cp_scheme twice"});
    expect_error([] { parse_parallel_config(""); }, {"names no key", "e.g. tp=8,pp=2"});
    expect_error([] { parse_parallel_config(" , "); }, {"names no key"});
    expect_error([] { parse_cp_scheme("spiral"); },
                 {"unknown CP scheme 'spiral'", "contiguous, zigzag or interleave"});
    const auto p =
        parse_parallel_config("tp=8 pp=2,cp=4 dp=1,ep=1,cp_scheme=zigzag,pp_layers=40/40");
    EXPECT_EQ(p.tp, 8);
    EXPECT_EQ(p.cp, 4);
    EXPECT_EQ(p.cp_scheme, CpScheme::kZigzag);
    EXPECT_EQ(p.pp_layers, (std::vector<int>{40, 40}));
}

TEST(Validation, ModelSpecFields) {
    auto bad = [](auto mutate, const char* needle) {
        ModelSpec m = catalog_model("tiny");
        mutate(m);
        expect_error([&] { make_layout(m, cfg(1)); }, {needle});
    };
    bad([](ModelSpec& m) { m.num_layers = 0; }, "num_layers must be a positive integer");
    bad([](ModelSpec& m) { m.hidden = -4; }, "hidden must be a positive integer");
    bad([](ModelSpec& m) { m.num_heads = 0; }, "num_heads must be a positive integer");
    bad([](ModelSpec& m) { m.num_kv_heads = 0; }, "num_kv_heads must be a positive integer");
    bad([](ModelSpec& m) { m.num_kv_heads = 3; }, "must be a multiple of num_kv_heads (3)");
    bad([](ModelSpec& m) { m.head_dim = 0; }, "head_dim must be a positive integer");
    bad([](ModelSpec& m) { m.vocab = 0; }, "vocab must be a positive integer");
    bad([](ModelSpec& m) { m.intermediate = 0; }, "intermediate must be a positive integer");
    bad(
        [](ModelSpec& m) {
            m.moe.num_experts = 4;
            m.moe.experts_per_token = 5;
            m.moe.expert_intermediate = 8;
        },
        "experts_per_token must be in [1, num_experts=4]");
    bad(
        [](ModelSpec& m) {
            m.attention = AttentionKind::kMla;
            m.mla = {};
        },
        "mla.kv_lora_rank must be a positive integer");
}

TEST(Validation, CatalogAndDtypeErrors) {
    expect_error([] { catalog_model("gpt-5"); }, {"unknown model 'gpt-5'", "llama-3.1-70b"});
    expect_error([] { parse_dtype("fp7"); }, {"fp7"});
}

// LFM2-MoE: vLLM's Lfm2MoeSparseMoeBlock (lfm2_moe.py) raises "Tensor parallel size N is greater
// than the number of experts E" when tp > num_experts. The published LFM2-8B-A1B (32 heads, 32
// experts) never meets it (tp divides the heads); a config of 8 experts does at tp 16 and 32.
TEST(Validation, Lfm2MoeTpAboveTheExperts) {
    const std::string path = std::string(KVSHARD_TEST_DATA_DIR) + "/hf_configs/lfm2-8b-a1b.json";
    const ModelSpec published = load_hf_config(path);
    ASSERT_EQ(published.moe.num_experts, 32);
    EXPECT_TRUE(published.moe.tp_at_most_experts);
    EXPECT_EQ(valid_tp_sizes(published), (std::vector<int>{1, 2, 4, 8, 16, 32}));
    EXPECT_NO_THROW(make_layout(published, cfg(32)));
    EXPECT_EQ(model_spec_from_json(to_json(published)), published);

    std::ifstream in(path);
    nlohmann::json j = nlohmann::json::parse(in);
    j["num_experts"] = 8;
    const ModelSpec eight = parse_hf_config(j.dump(), "lfm2-moe-8-experts.json");
    EXPECT_EQ(valid_tp_sizes(eight), (std::vector<int>{1, 2, 4, 8}));
    EXPECT_NO_THROW(make_layout(eight, cfg(8)));
    expect_error([&] { make_layout(eight, cfg(16)); },
                 {"tp=16 is greater than the 8 experts of", "Lfm2MoeSparseMoeBlock",
                  "valid tp sizes are 1, 2, 4, 8"});
    // Every layer dense (num_dense_layers >= layers): no MoE block, no limit.
    j["num_dense_layers"] = 24;
    const ModelSpec dense = parse_hf_config(j.dump(), "lfm2-moe-dense.json");
    EXPECT_FALSE(dense.moe.enabled());
    EXPECT_NO_THROW(make_layout(dense, cfg(16)));
    // Other MoE families are not limited here: Mixtral's 8 experts at tp 16 (its 32 heads, 8 KV
    // heads replicated) stay valid.
    EXPECT_NO_THROW(make_layout(catalog_model("mixtral-8x7b"), cfg(16)));
}

// The other families whose vLLM MoE block raises "Tensor parallel size N is greater than the
// number of experts E": qwen2_moe.py Qwen2MoeSparseMoeBlock, qwen3_moe.py Qwen3MoeSparseMoeBlock
// (qwen3_vl_moe.py builds Qwen3MoeModel), qwen3_next.py Qwen3NextSparseMoeBlock (qwen3_5.py builds
// it for qwen3_5_moe_text), hunyuan_v1.py HunYuanSparseMoeBlock, ernie45_moe.py Ernie4_5_MoeMoE.
// The check reads the TP group's size, which expert parallelism leaves as it is, so ep does not
// lift it. The published configs have more experts than heads; each is cut to fewer here.
TEST(Validation, MoeBlocksThatRefuseTpAboveTheExperts) {
    const std::string dir = std::string(KVSHARD_TEST_DATA_DIR) + "/hf_configs/";
    auto load = [&](const std::string& name) {
        std::ifstream in(dir + name + ".json");
        return nlohmann::json::parse(in);
    };
    struct Case {
        const char* file;
        bool nested;  // the decoder's fields sit under text_config
        const char* experts_key;
        const char* top_k_key;  // nullptr: the published top-k fits the cut
        int experts, ok_tp, refused_tp;
    };
    const Case cases[] = {
        {"qwen3-30b-a3b", false, "num_experts", nullptr, 8, 8, 16},
        {"qwen3-vl-30b-a3b", true, "num_experts", nullptr, 8, 8, 16},
        {"qwen3-next-80b-a3b", false, "num_experts", "num_experts_per_tok", 4, 4, 8},
        {"qwen3.5-35b-a3b", true, "num_experts", "num_experts_per_tok", 4, 4, 8},
        {"hunyuan-a13b-instruct", false, "num_experts", nullptr, 8, 8, 16},
        {"ernie-4.5-21b-a3b-pt", false, "moe_num_experts", "moe_k", 4, 4, 20},
    };
    for (const Case& c : cases) {
        const ModelSpec published = load_hf_config(dir + c.file + ".json");
        EXPECT_TRUE(published.moe.tp_at_most_experts) << c.file;
        EXPECT_NO_THROW(make_layout(published, cfg(c.refused_tp))) << c.file;
        nlohmann::json j = load(c.file);
        nlohmann::json& t = c.nested ? j["text_config"] : j;
        t[c.experts_key] = c.experts;
        if (c.top_k_key) t[c.top_k_key] = c.experts;
        const ModelSpec cut = parse_hf_config(j.dump(), std::string(c.file) + "-cut.json");
        ASSERT_EQ(cut.moe.num_experts, c.experts) << c.file;
        EXPECT_NO_THROW(make_layout(cut, cfg(c.ok_tp))) << c.file;
        expect_error([&] { make_layout(cut, cfg(c.refused_tp)); },
                     {"is greater than the", "experts of", "valid tp sizes are"});
        const auto tps = valid_tp_sizes(cut);
        EXPECT_EQ(tps.back(), c.ok_tp) << c.file;
    }
    // Expert parallelism does not lift it: Qwen3-30B-A3B cut to 8 experts at tp 16 with ep 8.
    nlohmann::json q = load("qwen3-30b-a3b");
    q["num_experts"] = 8;
    const ModelSpec q8 = parse_hf_config(q.dump(), "qwen3-moe-8-experts.json");
    expect_error([&] { make_layout(q8, cfg(16, 1, 1, 1, 8)); }, {"tp=16 is greater than the 8"});
    EXPECT_NO_THROW(make_layout(q8, cfg(8, 1, 1, 1, 8)));
    // Qwen2-MoE (Qwen1.5-MoE-A2.7B's shape, 4 layers, 4 experts): tp 4 accepted, 8 refused.
    const nlohmann::json qwen2 = {{"model_type", "qwen2_moe"},
                                  {"hidden_size", 2048},
                                  {"num_attention_heads", 16},
                                  {"num_key_value_heads", 16},
                                  {"num_hidden_layers", 4},
                                  {"intermediate_size", 5632},
                                  {"moe_intermediate_size", 1408},
                                  {"shared_expert_intermediate_size", 5632},
                                  {"num_experts", 4},
                                  {"num_experts_per_tok", 4},
                                  {"vocab_size", 151936},
                                  {"max_position_embeddings", 8192},
                                  {"rope_theta", 1000000.0},
                                  {"rms_norm_eps", 1e-6},
                                  {"decoder_sparse_step", 1},
                                  {"torch_dtype", "bfloat16"}};
    const ModelSpec q2 = parse_hf_config(qwen2.dump(), "qwen2-moe-4-experts.json");
    EXPECT_TRUE(q2.moe.tp_at_most_experts);
    EXPECT_NO_THROW(make_layout(q2, cfg(4)));
    expect_error([&] { make_layout(q2, cfg(8)); }, {"tp=8 is greater than the 4 experts of"});
    // Qwen3-Next with every layer in mlp_only_layers builds no MoE block: no limit.
    nlohmann::json next = load("qwen3-next-80b-a3b");
    next["num_experts"] = 4;
    next["num_experts_per_tok"] = 4;
    next["mlp_only_layers"] = nlohmann::json::array();
    for (int l = 0; l < next["num_hidden_layers"].get<int>(); ++l)
        next["mlp_only_layers"].push_back(l);
    const ModelSpec all_dense = parse_hf_config(next.dump(), "qwen3-next-all-dense.json");
    EXPECT_EQ(all_dense.num_moe_layers(), 0);
    EXPECT_NO_THROW(make_layout(all_dense, cfg(8)));
}

}  // namespace
}  // namespace kvshard
