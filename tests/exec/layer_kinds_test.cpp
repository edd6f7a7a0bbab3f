// Every layer kind the reference model runs (sliding window with sinks, chunked local, MLA, Gated
// DeltaNet, layers without KV or MLP), sharded on the threads backend against the unsharded run of
// the same weights: identical greedy tokens, last-step logits within 1e-4 relative L2, and every
// rank's KV bytes (windowed groups freed to their window, states once per sequence) equal to the
// layout's request_kv_bytes. Prompts are longer than every window.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>

#include "cli_runner.h"
#include "kvshard/comm/threads.h"
#include "kvshard/common/error.h"
#include "kvshard/exec/rank_model.h"
#include "kvshard/model/catalog.h"
#include "kvshard/model/safetensors.h"
#include "kvshard/serve/disagg.h"
#include "kvshard/serve/generate.h"
#include "kvshard/serve/verify.h"

namespace kvshard {
namespace {

constexpr uint64_t kSeed = 5;
constexpr int kSteps = 12;

// tiny with chunked-local layers (chunk 8), a layer without KV (an MLP-only block) and a layer
// without MLP, to run the kinds the catalog's tiny models do not have.
ModelSpec tiny_chunked() {
    ModelSpec m = catalog_model("tiny");
    m.name = "tiny-chunked";
    const ModelSpec uniform = m;
    for (int l = 0; l < m.num_layers; ++l) m.layers.push_back(uniform.layer(l));
    m.layers[0].kind = LayerKind::kChunkedLocal;
    m.layers[0].window = 8;
    m.layers[2].kind = LayerKind::kChunkedLocal;
    m.layers[2].window = 8;
    m.layers[1].kind = LayerKind::kNoKv;
    m.layers[1].num_kv_heads = 0;
    m.layers[1].head_dim = 0;
    m.layers[3].mlp = MlpKind::kNone;
    m.layers[3].intermediate = 0;
    m.validate();
    return m;
}

ModelSpec model_named(const std::string& name) {
    return name == "tiny-chunked" ? tiny_chunked() : catalog_model(name);
}

std::vector<std::vector<int32_t>> prompts_for(const ModelSpec& m) {
    std::vector<std::vector<int32_t>> out;
    uint32_t s = 777;
    for (int len : {21, 9, 30, 14}) {
        std::vector<int32_t> p;
        for (int i = 0; i < len; ++i) {
            s = s * 1664525u + 1013904223u;
            p.push_back(int32_t((s >> 8) % uint32_t(m.vocab)));
        }
        out.push_back(p);
    }
    return out;
}

GenerationOptions options(int steps = kSteps) {
    GenerationOptions o;
    o.max_new_tokens = steps;
    o.block_size = 4;
    return o;
}

GenerationReport run(const ModelSpec& m, const ParallelConfig& p,
                     const std::vector<std::vector<int32_t>>& prompts, const GenerationOptions& opt,
                     const TensorSource& src) {
    if (p.world_size() == 1) return generate(m, p, src, prompts, opt);
    std::vector<GenerationReport> reports(size_t(p.world_size()));
    run_threads(p.world_size(), [&](Communicator& world) {
        reports[size_t(world.rank())] = generate(m, p, src, prompts, opt, &world);
    });
    for (int r = 1; r < p.world_size(); ++r)
        EXPECT_EQ(reports[size_t(r)].tokens, reports[0].tokens) << "rank " << r;
    return reports[0];
}

const GenerationReport& unsharded(const std::string& model) {
    static std::map<std::string, GenerationReport> cache;
    auto it = cache.find(model);
    if (it == cache.end()) {
        const ModelSpec m = model_named(model);
        const auto src = random_tensor_source(kSeed);
        it = cache.emplace(model, run(m, ParallelConfig{}, prompts_for(m), options(), *src)).first;
    }
    return it->second;
}

struct GridCase {
    std::string model;
    std::string parallel;
};

class LayerKindsGrid : public ::testing::TestWithParam<GridCase> {};

TEST_P(LayerKindsGrid, ShardedEqualsUnsharded) {
    const auto& gc = GetParam();
    const ModelSpec m = model_named(gc.model);
    const ParallelConfig p = parse_parallel_config(gc.parallel);
    const auto src = random_tensor_source(kSeed);
    const GenerationReport& ref = unsharded(gc.model);
    const GenerationReport got = run(m, p, prompts_for(m), options(), *src);
    ASSERT_EQ(got.tokens.size(), ref.tokens.size());
    for (size_t i = 0; i < ref.tokens.size(); ++i) {
        ASSERT_EQ(got.tokens[i].size(), size_t(kSteps));
        EXPECT_EQ(got.tokens[i], ref.tokens[i]) << "prompt " << i;
        EXPECT_LT(relative_l2(got.last_logits[i], ref.last_logits[i]), 1e-4) << "prompt " << i;
    }
    for (const auto& r : got.ranks) {
        EXPECT_GT(r.kv_bytes, 0) << "rank " << r.rank;
        EXPECT_EQ(r.kv_bytes, r.kv_bytes_predicted) << "rank " << r.rank;
    }
}

INSTANTIATE_TEST_SUITE_P(
    Grid, LayerKindsGrid,
    ::testing::Values(
        GridCase{"tiny-swa", "tp=2"}, GridCase{"tiny-swa", "tp=4"},
        GridCase{"tiny-swa", "tp=8"},  // 8 ranks over 4 KV heads: replicated
        GridCase{"tiny-swa", "pp=2"}, GridCase{"tiny-swa", "dp=2"},
        GridCase{"tiny-swa", "dp=2,tp=2,pp=2"}, GridCase{"tiny-mla", "tp=2"},
        GridCase{"tiny-mla", "tp=4"}, GridCase{"tiny-mla", "tp=8"}, GridCase{"tiny-mla", "pp=2"},
        GridCase{"tiny-mla", "dp=2,tp=2"}, GridCase{"tiny-hybrid", "tp=2"},
        GridCase{"tiny-hybrid", "tp=4"},  // 2 key heads over 4 ranks: shared
        GridCase{"tiny-hybrid", "pp=2"},  // stage 0 holds only state layers
        GridCase{"tiny-hybrid", "dp=2"}, GridCase{"tiny-hybrid", "tp=2,pp=2"},
        GridCase{"tiny-chunked", "tp=2"}, GridCase{"tiny-chunked", "pp=2"},
        GridCase{"tiny-chunked", "tp=4,pp=2"},
        // Ring prefill and merged decode with windows and sinks, every scheme
        GridCase{"tiny-swa", "cp=2"}, GridCase{"tiny-swa", "cp=2,cp_scheme=zigzag"},
        GridCase{"tiny-swa", "cp=2,cp_scheme=interleave,cp_interleave=4"},
        GridCase{"tiny-swa", "cp=4,cp_scheme=zigzag"}, GridCase{"tiny-swa", "cp=2,tp=2"},
        GridCase{"tiny-chunked", "cp=2"}, GridCase{"tiny-chunked", "cp=2,cp_scheme=zigzag,tp=2"},
        // MLA under CP: the latent travels the ring as key and value
        GridCase{"tiny-mla", "cp=2"}, GridCase{"tiny-mla", "cp=2,cp_scheme=zigzag"},
        GridCase{"tiny-mla", "cp=2,cp_scheme=interleave,cp_interleave=4"},
        GridCase{"tiny-mla", "cp=2,tp=4"},
        // State layers under CP: the recurrence over the gathered rows on every rank
        GridCase{"tiny-hybrid", "cp=2"}, GridCase{"tiny-hybrid", "cp=2,cp_scheme=zigzag"},
        GridCase{"tiny-hybrid", "cp=2,cp_scheme=interleave,cp_interleave=4"},
        GridCase{"tiny-hybrid", "cp=4,tp=2,cp_scheme=zigzag"},
        // CP with PP: each stage a cp x tp grid of its layers (tiny-hybrid's stage 0 holds only
        // state layers)
        GridCase{"tiny-swa", "cp=2,tp=2,pp=2"}, GridCase{"tiny-mla", "cp=2,pp=2,cp_scheme=zigzag"},
        GridCase{"tiny-hybrid", "cp=2,pp=2"}, GridCase{"tiny-chunked", "cp=2,pp=2"}),
    [](const auto& info) {
        std::string s = info.param.model + "_" + info.param.parallel;
        for (char& ch : s)
            if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
        return s;
    });

// Every kind between a prefill and a decode group, across TP shrink and growth and a PP mismatch
// (and, for MLA, a CP prefill side): the decode side's tokens equal the unsharded run's, and the
// bytes moved are what the decode layout needs, counted here from the model: MLA's latent once per
// decode rank, a windowed group's blocks from the one holding its first kept token, a state
// group's state once per decode rank's share.
struct DisaggCase {
    std::string model, from, to;
};

class KindsDisagg : public ::testing::TestWithParam<DisaggCase> {};

// What decode layout `dc` needs of `prompts` (block size bs on both sides, dst tp <= H_kv or MLA).
int64_t expected_transfer_bytes(const ModelSpec& m, const ParallelConfig& dc,
                                const std::vector<std::vector<int32_t>>& prompts, int bs) {
    int64_t bytes = 0;
    for (const auto& p : prompts) {
        const auto len = int64_t(p.size());
        for (int l = 0; l < m.num_layers; ++l) {
            const LayerSpec s = m.layer(l);
            if (s.kind == LayerKind::kGatedDeltaNet) {
                bytes += state_bytes(m.state, dc.tp) * dc.tp;
                continue;
            }
            if (s.kind == LayerKind::kMla) {
                bytes += len * int64_t{m.mla.kv_lora_rank + m.mla.qk_rope_head_dim} * 4 * dc.tp;
                continue;
            }
            if (!holds_tokens(s.kind)) continue;
            // The decode side's first query, at position len, reads from
            // first_kept_position(len + 1); whole blocks from the one holding it move.
            const int64_t first = first_kept_position(s.kind, s.window, len + 1) / bs * bs;
            bytes += (len - first) * 2 * s.num_kv_heads * s.head_dim * 4;
        }
    }
    return bytes;
}

TEST_P(KindsDisagg, DecodeSideEqualsUnsharded) {
    const auto& dcase = GetParam();
    const ModelSpec m = model_named(dcase.model);
    const ParallelConfig pf = parse_parallel_config(dcase.from);
    const ParallelConfig dc = parse_parallel_config(dcase.to);
    const auto src = random_tensor_source(kSeed);
    const auto prompts = prompts_for(m);
    DisaggOptions o;
    o.max_new_tokens = kSteps;
    o.prefill_block_size = 4;
    o.decode_block_size = 4;
    std::vector<DisaggReport> reports(size_t(pf.world_size() + dc.world_size()));
    run_threads(pf.world_size() + dc.world_size(), [&](Communicator& world) {
        reports[size_t(world.rank())] = disagg_generate(m, pf, dc, *src, prompts, o, world);
    });
    const DisaggReport& got = reports[0];
    const GenerationReport& ref = unsharded(dcase.model);
    ASSERT_EQ(got.tokens.size(), ref.tokens.size());
    EXPECT_EQ(got.failed_requests, 0);
    for (size_t i = 0; i < ref.tokens.size(); ++i) {
        EXPECT_EQ(got.tokens[i], ref.tokens[i]) << "prompt " << i;
        EXPECT_LT(relative_l2(got.last_logits[i], ref.last_logits[i]), 1e-4) << "prompt " << i;
    }
    EXPECT_EQ(got.transfer_bytes, got.min_bytes);
    // (A CP source may no longer hold the leading slots of a windowed group's first destination
    // block, outside the window: they are not sent.)
    if (pf.cp == 1)
        EXPECT_EQ(got.min_bytes, expected_transfer_bytes(m, dc, prompts, 4));
    else
        EXPECT_LE(got.min_bytes, expected_transfer_bytes(m, dc, prompts, 4));
}

INSTANTIATE_TEST_SUITE_P(
    Pairs, KindsDisagg,
    ::testing::Values(
        DisaggCase{"tiny-mla", "tp=2", "tp=1"}, DisaggCase{"tiny-mla", "tp=1", "tp=4"},
        DisaggCase{"tiny-mla", "pp=2", "tp=2"}, DisaggCase{"tiny-mla", "cp=2", "tp=2"},
        DisaggCase{"tiny-swa", "tp=2", "tp=1"}, DisaggCase{"tiny-swa", "tp=1", "tp=4"},
        DisaggCase{"tiny-swa", "pp=2", "tp=2"}, DisaggCase{"tiny-swa", "tp=4", "pp=2"},
        // A CP prefill side: each CP rank's blocks of every group, the state from each CP rank
        DisaggCase{"tiny-swa", "cp=2", "tp=2"},
        DisaggCase{"tiny-swa", "cp=2,cp_scheme=zigzag", "tp=1"},
        DisaggCase{"tiny-hybrid", "cp=2,tp=2", "tp=4"}, DisaggCase{"tiny-hybrid", "tp=2", "tp=1"},
        DisaggCase{"tiny-hybrid", "tp=1", "tp=4"}, DisaggCase{"tiny-hybrid", "pp=2", "tp=2"},
        DisaggCase{"tiny-hybrid", "tp=4", "pp=2,tp=2"}, DisaggCase{"tiny-chunked", "tp=2", "tp=1"},
        DisaggCase{"tiny-chunked", "pp=2", "tp=4"},
        // A CP x PP prefill side: each stage's CP ranks send their groups' blocks and states
        DisaggCase{"tiny-swa", "cp=2,pp=2", "tp=2"}, DisaggCase{"tiny-mla", "cp=2,pp=2", "tp=1"},
        DisaggCase{"tiny-hybrid", "cp=2,pp=2", "tp=2"}),
    [](const auto& info) {
        std::string s = info.param.model + "_" + info.param.from + "_to_" + info.param.to;
        for (char& ch : s)
            if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
        return s;
    });

// A windowed model moves less than the same shapes with every layer full attention: the windowed
// group's bytes are what changes.
TEST(LayerKinds, WindowedDisaggMovesOnlyTheWindow) {
    const ModelSpec swa = catalog_model("tiny-swa");
    ModelSpec full = swa;
    for (auto& s : full.layers) {
        s.kind = LayerKind::kFullAttention;
        s.window = 0;
    }
    const ParallelConfig pf = parse_parallel_config("tp=2"), dc = parse_parallel_config("tp=1");
    const auto prompts = prompts_for(swa);
    EXPECT_LT(expected_transfer_bytes(swa, dc, prompts, 4),
              expected_transfer_bytes(full, dc, prompts, 4));
    const auto src = random_tensor_source(kSeed);
    DisaggOptions o;
    o.max_new_tokens = 2;
    o.prefill_block_size = 4;
    o.decode_block_size = 4;
    auto bytes_of = [&](const ModelSpec& m) {
        std::vector<DisaggReport> reports(3);
        run_threads(3, [&](Communicator& world) {
            reports[size_t(world.rank())] = disagg_generate(m, pf, dc, *src, prompts, o, world);
        });
        return reports[0].transfer_bytes;
    };
    EXPECT_EQ(bytes_of(swa), expected_transfer_bytes(swa, dc, prompts, 4));
    EXPECT_EQ(bytes_of(full), expected_transfer_bytes(full, dc, prompts, 4));
}

// Prompts that end at the window's and the chunk's boundaries (7, 8, 9, 16, 17 tokens; W = C = 8,
// blocks of 4): the decode side receives only what its first query reads (a chunk that starts at
// the prompt's end needs nothing before it) and decodes the same tokens and logits as one rank.
TEST(LayerKinds, DisaggAtWindowBoundariesMovesWhatDecodeReads) {
    for (const std::string name : {"tiny-swa", "tiny-chunked"}) {
        SCOPED_TRACE(name);
        const ModelSpec m = model_named(name);
        std::vector<std::vector<int32_t>> prompts;
        uint32_t s = 4242;
        for (int len : {7, 8, 9, 16, 17}) {
            std::vector<int32_t> p;
            for (int i = 0; i < len; ++i) {
                s = s * 1664525u + 1013904223u;
                p.push_back(int32_t((s >> 8) % uint32_t(m.vocab)));
            }
            prompts.push_back(p);
        }
        const auto src = random_tensor_source(kSeed);
        const GenerationReport ref = run(m, ParallelConfig{}, prompts, options(4), *src);
        const ParallelConfig pf = parse_parallel_config("tp=2"), dc = parse_parallel_config("tp=1");
        DisaggOptions o;
        o.max_new_tokens = 4;
        o.prefill_block_size = 4;
        o.decode_block_size = 4;
        std::vector<DisaggReport> reports(3);
        run_threads(3, [&](Communicator& world) {
            reports[size_t(world.rank())] = disagg_generate(m, pf, dc, *src, prompts, o, world);
        });
        const DisaggReport& got = reports[0];
        EXPECT_EQ(got.failed_requests, 0);
        ASSERT_EQ(got.tokens.size(), ref.tokens.size());
        for (size_t i = 0; i < ref.tokens.size(); ++i) {
            EXPECT_EQ(got.tokens[i], ref.tokens[i]) << "prompt " << i;
            EXPECT_LT(relative_l2(got.last_logits[i], ref.last_logits[i]), 1e-4) << "prompt " << i;
        }
        EXPECT_EQ(got.transfer_bytes, got.min_bytes);
        EXPECT_EQ(got.min_bytes, expected_transfer_bytes(m, dc, prompts, 4));
    }
}

// A CP decode side with a model of several KV groups is refused before anything runs, naming what
// would work.
TEST(LayerKinds, DisaggWithCpDecodeAndWindowsIsRefusedClearly) {
    const ModelSpec m = catalog_model("tiny-swa");
    const auto src = random_tensor_source(kSeed);
    DisaggOptions o;
    try {
        run_threads(3, [&](Communicator& world) {
            disagg_generate(m, parse_parallel_config("tp=1"), parse_parallel_config("cp=2"), *src,
                            prompts_for(m), o, world);
        });
        FAIL() << "expected an Error";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("use cp=1 on the decode side"), std::string::npos)
            << e.what();
    }
}

// The prefill (many rows at once, one causal conv and delta-rule sweep, windowed prefill
// attention) and the decode (one row per step, the state carried in its slot, the window's blocks
// freed) compute the same function: prefilling the prompt plus the first k generated tokens
// continues with the same tokens.
TEST(LayerKinds, PrefillOfGeneratedTokensContinuesTheSameSequence) {
    for (const std::string name : {"tiny-swa", "tiny-hybrid", "tiny-mla", "tiny-chunked"}) {
        const ModelSpec m = model_named(name);
        const auto src = random_tensor_source(kSeed);
        const auto prompts = prompts_for(m);
        const GenerationReport a = run(m, ParallelConfig{}, {prompts[0]}, options(16), *src);
        std::vector<int32_t> longer = prompts[0];
        longer.insert(longer.end(), a.tokens[0].begin(), a.tokens[0].begin() + 10);
        const GenerationReport b = run(m, ParallelConfig{}, {longer}, options(6), *src);
        EXPECT_EQ(b.tokens[0], std::vector<int32_t>(a.tokens[0].begin() + 10, a.tokens[0].end()))
            << name;
        EXPECT_LT(relative_l2(b.last_logits[0], a.last_logits[0]), 1e-4) << name;
    }
}

// Prefix hits with a windowed group (one block table per group, KvGroupManager): prompts sharing a
// 32-token prefix reuse it, the hit is what every group serves, and the result equals the run
// without a prefix cache; every rank holds what the layout predicts.
TEST(LayerKinds, HybridPrefixHitsEqualTheRunWithoutReuse) {
    for (const std::string name : {"tiny-swa", "tiny-mla", "tiny-chunked"}) {
        const ModelSpec m = model_named(name);
        const auto src = random_tensor_source(kSeed);
        std::vector<std::vector<int32_t>> prompts = prompts_for(m);
        for (auto& p : prompts) {  // 32 shared tokens, then each prompt's own
            std::vector<int32_t> shared(32);
            for (int i = 0; i < 32; ++i) shared[size_t(i)] = (i * 37 + 11) % m.vocab;
            p.insert(p.begin(), shared.begin(), shared.end());
        }
        GenerationOptions off = options();
        off.prefix_cache = false;
        const auto ref = run(m, ParallelConfig{}, prompts, off, *src);
        for (const std::string par : {"tp=1", "tp=2", "pp=2"}) {
            const auto got = run(m, parse_parallel_config(par), prompts, options(), *src);
            EXPECT_GT(got.prefix_hit_tokens, 0) << name << " " << par;
            EXPECT_EQ(got.tokens, ref.tokens) << name << " " << par;
            for (size_t i = 0; i < ref.last_logits.size(); ++i)
                EXPECT_LT(relative_l2(got.last_logits[i], ref.last_logits[i]), 1e-4)
                    << name << " " << par << " prompt " << i;
            for (const auto& r : got.ranks)
                EXPECT_EQ(r.kv_bytes, r.kv_bytes_predicted) << name << " " << par;
        }
    }
}

// The window, the chunk and the sinks change what the model computes: the same weights run as
// all-full attention (or without sinks) give other logits.
TEST(LayerKinds, WindowsChunksAndSinksChangeTheResult) {
    const auto src = random_tensor_source(kSeed);
    auto last_logits = [&](const ModelSpec& m) {
        return run(m, ParallelConfig{}, {prompts_for(m)[2]}, options(2), *src).last_logits[0];
    };
    for (const std::string name : {"tiny-swa", "tiny-chunked"}) {
        const ModelSpec m = model_named(name);
        ModelSpec full = m;
        for (auto& l : full.layers)
            if (l.kind == LayerKind::kSlidingWindow || l.kind == LayerKind::kChunkedLocal) {
                l.kind = LayerKind::kFullAttention;
                l.window = 0;
            }
        EXPECT_GT(relative_l2(last_logits(full), last_logits(m)), 1e-3) << name;
    }
    ModelSpec no_sinks = catalog_model("tiny-swa");
    for (auto& l : no_sinks.layers) l.learned_sinks = false;
    EXPECT_GT(relative_l2(last_logits(no_sinks), last_logits(catalog_model("tiny-swa"))), 1e-3);
}

// A windowed group's resident blocks stay bounded as the sequence grows past the window: from 40
// to 100 tokens the rank's bytes grow only by the full-attention group's new blocks.
TEST(LayerKinds, WindowedGroupBlocksStayBoundedAsTheSequenceGrows) {
    const ModelSpec m = catalog_model("tiny-swa");
    const auto src = random_tensor_source(kSeed);
    const std::vector<std::vector<int32_t>> prompt = {std::vector<int32_t>(20, 3)};
    GenerationOptions o = options(20);
    o.prefix_cache = false;
    const auto short_run = run(m, ParallelConfig{}, prompt, o, *src);
    o.max_new_tokens = 80;
    const auto long_run = run(m, ParallelConfig{}, prompt, o, *src);
    const int bs = o.block_size;
    // Per block: layers x K/V x heads x head_dim x 4 bytes of one group (2 full, 2 sliding layers).
    const int64_t group_block = int64_t{2} * 2 * m.num_kv_heads * m.head_dim * 4 * bs;
    const int64_t len_short = 20 + 20 - 1, len_long = 20 + 80 - 1;  // the last token is not written
    auto blocks = [&](int64_t n) { return (n + bs - 1) / bs; };
    auto window_blocks = [&](int64_t n) { return blocks(n) - (n - 8) / bs; };
    EXPECT_EQ(short_run.ranks[0].kv_bytes,
              (blocks(len_short) + window_blocks(len_short)) * group_block);
    EXPECT_EQ(long_run.ranks[0].kv_bytes,
              (blocks(len_long) + window_blocks(len_long)) * group_block);
    EXPECT_LE(window_blocks(len_long), 8 / bs + 1);
    EXPECT_EQ(long_run.ranks[0].kv_bytes - short_run.ranks[0].kv_bytes,
              (blocks(len_long) - blocks(len_short)) * group_block);
}

// Weights under the published tensor names of each family (gpt-oss sinks, DeepSeek-V3 MLA,
// Qwen3-Next linear_attn with its fused per-key-head projections and 3-D conv1d) read back from a
// safetensors file and sliced for TP exactly as the seeded source: the same tokens and logits.
TEST(LayerKinds, SafetensorsWithPublishedNamesRunLikeTheSeededWeights) {
    namespace fs = std::filesystem;
    for (const std::string name : {"tiny-swa", "tiny-mla", "tiny-hybrid"}) {
        const ModelSpec m = catalog_model(name);
        const fs::path dir = fs::temp_directory_path() / ("kvshard_layer_kinds_" + name);
        fs::create_directories(dir);
        const auto src = random_tensor_source(kSeed);
        save_hf_tensors(m, *src, (dir / "model.safetensors").string(), DType::kFp32);
        const SafetensorsCheckpoint ckpt(dir.string());
        bool saw = false;
        for (const auto& [t, shape] : hf_tensor_list(m))
            saw = saw ||
                  t.find(name == "tiny-swa"   ? "self_attn.sinks"
                         : name == "tiny-mla" ? "kv_a_proj_with_mqa"
                                              : "linear_attn.in_proj_qkvz") != std::string::npos;
        EXPECT_TRUE(saw) << name;
        const ParallelConfig p = parse_parallel_config("tp=2");
        const auto a = run(m, p, prompts_for(m), options(4), *src);
        const auto b = run(m, p, prompts_for(m), options(4), ckpt);
        EXPECT_EQ(a.tokens, b.tokens) << name;
        for (size_t i = 0; i < a.last_logits.size(); ++i)
            EXPECT_EQ(a.last_logits[i], b.last_logits[i]) << name;
        fs::remove_all(dir);
    }
}

std::string error_of(const std::function<void()>& fn) {
    try {
        fn();
    } catch (const Error& e) {
        return e.what();
    }
    return "";
}

TEST(LayerKinds, WhatTheReferenceModelDoesNotRunIsRefusedByName) {
    const auto src = random_tensor_source(kSeed);
    const std::vector<std::vector<int32_t>> prompt = {{1, 2, 3}};
    // Mamba-2 (Nemotron-H) is sized by the layout but not executed.
    EXPECT_NE(error_of([&] {
                  generate(catalog_model("nemotron-h-8b"), {}, *src, prompt, options(1));
              }).find("Mamba-2"),
              std::string::npos);
    // Gated DeltaNet value heads split across TP without replication.
    EXPECT_NE(error_of([&] {
                  const ModelSpec m = catalog_model("tiny-hybrid");
                  weight_shard(make_layout(m, parse_parallel_config("tp=8")), 0);
              }).find("does not divide the 4 Gated DeltaNet value heads"),
              std::string::npos);
    // Asking for prefix hits where the model cannot serve them: exit 2 with the reason.
    const auto r = test::run_cli("run --model tiny-hybrid --prompts 2 --shared-prefix 8");
    EXPECT_EQ(r.status, 2);
    EXPECT_NE(r.out.find("cannot restore it"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace kvshard
