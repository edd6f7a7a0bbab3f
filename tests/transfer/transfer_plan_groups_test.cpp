// Transfer plans of models with several KV groups (sliding, chunked, MLA with indexer keys, Gated
// DeltaNet / Mamba-2 state, no-KV layers): the bytes each destination receives, computed here from
// the model's fields, and the tokens each windowed message carries.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "cli_runner.h"
#include "kvshard/cache/kv_group_manager.h"
#include "kvshard/common/error.h"
#include "kvshard/model/catalog.h"
#include "kvshard/transfer/pack.h"
#include "transfer/transfer_harness.h"

#include <nlohmann/json.hpp>

namespace kvshard {
namespace {

TransferPlan plan_for(const ModelSpec& m, const std::string& from, const std::string& to,
                      int64_t tokens, int bs_from = 16, int bs_to = 16, int lpg = 0,
                      int64_t cached = 0) {
    const auto src = testing::make_endpoint(m, from, bs_from, PageOrder::kHnd, tokens);
    const auto dst = testing::make_endpoint(m, to, bs_to, PageOrder::kHnd, tokens);
    return make_transfer_plan(src, dst, tokens,
                              {.layers_per_group = lpg, .dst_cached_tokens = cached});
}

// Whether the decode side's first query, at position L (the token after the L moved), reads
// position p <= L of a windowed layer, by kvshard's attention masks (paged_attention.cpp): sliding
// window W sees [L - W + 1, L], chunked C the chunk of L.
bool decode_reads(LayerKind kind, int window, int64_t L, int64_t p) {
    if (kind == LayerKind::kSlidingWindow) return L - p < window;
    if (kind == LayerKind::kChunkedLocal) return p / window == L / window;
    return true;
}

// The positions of [0, L) a destination of block size bs needs of a layer: the whole blocks from
// the one holding the first position its first query reads (that query's own position L when it
// reads no earlier one). Found position by position, not from first_kept_position.
int64_t first_moved(LayerKind kind, int window, int64_t L, int bs) {
    int64_t lowest = 0;
    while (!decode_reads(kind, window, L, lowest)) ++lowest;
    return lowest / bs * bs;
}

// What every destination of a cp=1 layout with block size bs needs for a request of L tokens,
// layer by layer from the model's fields: full attention all L tokens; sliding and chunked the
// tokens from first_moved on; MLA the latent (and indexer key) of all L tokens; state layers the
// rank's share of the state; no-KV layers nothing.
int64_t expected_bytes_cp1(const ModelSpec& m, int tp, int64_t L, int bs) {
    const auto e = static_cast<int64_t>(dtype_size(m.kv_dtype));
    int64_t sum = 0;
    for (int l = 0; l < m.num_layers; ++l) {
        const LayerSpec s = m.layer(l);
        const int64_t kept = L - first_moved(s.kind, s.window, L, bs);
        switch (s.kind) {
            case LayerKind::kFullAttention:
            case LayerKind::kSlidingWindow:
            case LayerKind::kChunkedLocal:
                // tp ranks, each max(1, H_kv / tp) heads of K and V.
                sum += int64_t{tp} * 2 * std::max(1, s.num_kv_heads / tp) * s.head_dim * e * kept;
                break;
            case LayerKind::kMla: {
                int64_t per_token = int64_t{m.mla.kv_lora_rank + m.mla.qk_rope_head_dim} * e;
                if (s.indexer)
                    per_token += int64_t{m.indexer.head_dim} *
                                     static_cast<int64_t>(dtype_size(m.indexer.dtype)) +
                                 m.indexer.scale_bytes;
                sum += int64_t{tp} * per_token * kept;  // the latent on every rank
                break;
            }
            case LayerKind::kGatedDeltaNet:
            case LayerKind::kMamba2:
            case LayerKind::kMamba1:
            case LayerKind::kShortConv:
                sum += int64_t{tp} * state_bytes(m.state, tp);
                break;
            case LayerKind::kNoKv:
                break;
        }
    }
    return sum;
}

// A windowed model at 32K tokens moves its full layers whole and only the last window's blocks of
// its sliding layers: much less than the same model with every layer full attention.
TEST(TransferPlanGroups, WindowedModelMovesOnlyTheWindow) {
    const int64_t L = 32768;
    struct Named {
        const char* model;
        const char* from;
        const char* to;
        int tp_to;
        double most_of_full;  // the windowed plan moves less than this fraction of the full one
    };
    for (const Named& c : {Named{"gpt-oss-120b", "tp=8", "tp=4", 4, 0.51},
                           Named{"gemma-3-27b", "tp=8", "tp=8", 8, 0.25},
                           Named{"llama-4-scout", "tp=8", "tp=4", 4, 0.51}}) {
        SCOPED_TRACE(c.model);
        const ModelSpec m = catalog_model(c.model);
        ASSERT_FALSE(m.uniform());
        const TransferPlan plan = plan_for(m, c.from, c.to, L);
        const int64_t want = expected_bytes_cp1(m, c.tp_to, L, 16);
        EXPECT_EQ(plan.bytes, want);
        EXPECT_EQ(plan.min_bytes, want);
        // The blocks the decode side holds for its first query, at position L (request_kv_bytes
        // of L + 1 tokens, as its KvGroupManager keeps them), less the block that query opens (L
        // is a multiple of the block size: one block of every group, request_kv_bytes of 1).
        // llama-4-scout's chunked layers start a new chunk at L = 32768: nothing of them moves.
        int64_t resident = 0;
        for (int r = 0; r < plan.dst.layout.world_size(); ++r)
            resident += request_kv_bytes(plan.dst.layout, r, L + 1, 16) -
                        request_kv_bytes(plan.dst.layout, r, 1, 16);
        EXPECT_EQ(plan.bytes, resident);

        const ModelSpec full = with_full_attention(m);
        const TransferPlan all = plan_for(full, c.from, c.to, L);
        EXPECT_EQ(all.bytes, expected_bytes_cp1(full, c.tp_to, L, 16));
        EXPECT_LT(static_cast<double>(plan.bytes), c.most_of_full * static_cast<double>(all.bytes))
            << plan.bytes << " vs " << all.bytes;
    }
}

// Each windowed message carries exactly the destination's kept blocks' tokens, in pieces that sit
// in one block on each side, and a full-attention message all tokens; across block sizes and a
// destination prefix the plan's bytes equal min_bytes.
TEST(TransferPlanGroups, WindowedPiecesStartAtTheKeptBlock) {
    const ModelSpec m = catalog_model("tiny-swa");  // window 8 on even layers
    const int64_t L = 50;
    const TransferPlan plan = plan_for(m, "tp=1", "tp=2", L, 4, 4);
    ASSERT_EQ(plan.groups.size(), 2u);
    EXPECT_EQ(plan.groups[0].kind, LayerKind::kSlidingWindow);
    EXPECT_EQ(plan.groups[0].first_kept, 43);  // the window of the next token, at 50
    std::map<int, std::set<int64_t>> tokens;   // per kv group: tokens seen
    for (const auto& msg : plan.messages) {
        EXPECT_EQ(plan.group_layers(msg), 2);  // layers {0, 2} or {1, 3}
        for (const auto& p : msg.pieces)
            for (int i = 0; i < p.count; ++i) tokens[msg.kv_group].insert(p.token_begin + i);
    }
    // Block 10 (tokens 40..43) holds token 43: tokens [40, 50) move for the sliding layers.
    std::set<int64_t> window, all;
    for (int64_t t = 40; t < L; ++t) window.insert(t);
    for (int64_t t = 0; t < L; ++t) all.insert(t);
    EXPECT_EQ(tokens[0], window);
    EXPECT_EQ(tokens[1], all);
    EXPECT_EQ(plan.bytes, expected_bytes_cp1(m, 2, L, 4));

    for (auto [bs_from, bs_to, cached] :
         {std::tuple{4, 16, 0}, std::tuple{16, 4, 0}, std::tuple{8, 8, 45}}) {
        const TransferPlan p = plan_for(m, "cp=2,tp=2", "tp=4,pp=2", L, bs_from, bs_to, 1, cached);
        EXPECT_EQ(p.bytes, p.min_bytes) << bs_from << "->" << bs_to << " cached " << cached;
        for (const auto& msg : p.messages) {
            const TransferGroup& g = p.groups[msg.kv_group];
            for (const auto& piece : msg.pieces) {
                EXPECT_GE(piece.token_begin, cached);
                // Nothing before the destination block holding the first kept token.
                if (g.first_kept > 0) {
                    EXPECT_GE(piece.token_begin, g.first_kept / bs_to * bs_to);
                }
                EXPECT_LE(piece.src_slot + piece.count, bs_from);
                EXPECT_LE(piece.dst_slot + piece.count, bs_to);
            }
        }
    }
}

// tiny with chunked-local layers (chunk 8) on layers 0 and 2.
ModelSpec tiny_chunked() {
    ModelSpec m = catalog_model("tiny");
    m.name = "tiny-chunked";
    const ModelSpec uniform = m;
    for (int l = 0; l < m.num_layers; ++l) m.layers.push_back(uniform.layer(l));
    for (int l : {0, 2}) {
        m.layers[size_t(l)].kind = LayerKind::kChunkedLocal;
        m.layers[size_t(l)].window = 8;
    }
    m.validate();
    return m;
}

// At every boundary of the window (L = W - 1, W, W + 1, multiples of W and around them), block
// size and destination prefix, each windowed message carries exactly the positions the decode
// side's first query (at L) needs, by the attention mask position by position: the whole blocks
// from the one holding the first position it reads, from the cached prefix on. The first of them
// is where the decode side's KvGroupManager keeps its table from (keep_from with L of L + 1 tokens
// committed), and the plan's bytes are min_bytes and the model's count.
TEST(TransferPlanGroups, WindowedBoundariesMoveWhatTheNextTokenReads) {
    for (const ModelSpec& m : {catalog_model("tiny-swa"), tiny_chunked()}) {
        const int W = 8;
        for (int64_t L : {1, 7, 8, 9, 15, 16, 17, 23, 24, 27}) {
            for (int bs : {1, 3, 4, 8, 16}) {
                for (const int64_t cached : {int64_t{0}, L / 2}) {
                    SCOPED_TRACE(m.name + " L=" + std::to_string(L) + " bs=" + std::to_string(bs) +
                                 " cached=" + std::to_string(cached));
                    const TransferPlan plan = plan_for(m, "tp=2", "tp=4", L, bs, bs, 0, cached);
                    EXPECT_EQ(plan.bytes, plan.min_bytes);
                    if (cached == 0) {
                        EXPECT_EQ(plan.bytes, expected_bytes_cp1(m, 4, L, bs));
                    }
                    // (kv group, destination) -> positions received
                    std::map<std::pair<int, int>, std::set<int64_t>> got;
                    for (const auto& msg : plan.messages)
                        for (const auto& p : msg.pieces)
                            for (int i = 0; i < p.count; ++i)
                                got[{msg.kv_group, msg.dst_rank}].insert(p.token_begin + i);
                    for (int k = 0; k < static_cast<int>(plan.groups.size()); ++k) {
                        const TransferGroup& g = plan.groups[size_t(k)];
                        const int64_t from = first_moved(g.kind, W, L, bs);
                        std::set<int64_t> want;
                        for (int64_t t = std::max(from, cached); t < L; ++t) want.insert(t);
                        for (int d = 0; d < 4; ++d) {
                            const std::set<int64_t>& received = got[std::pair(k, d)];
                            EXPECT_EQ(received, want) << "group " << k << " destination " << d;
                        }
                        if (g.window == 0) continue;
                        ASSERT_EQ(g.window, W);
                        KvGroupManager decode(
                            {.groups = {{.kind = g.kind, .window = W, .num_blocks = 64}},
                             .block_size = bs,
                             .enable_prefix_cache = false});
                        EXPECT_EQ(decode.keep_from(0, L, L + 1) * bs, from);
                        EXPECT_EQ(g.first_kept, first_kept_position(g.kind, W, L + 1));
                    }
                }
            }
        }
    }
}

// A state group moves exactly its state: every destination its share (state_bytes of its tp) per
// state layer, whatever the tokens, each state head and key head once per destination.
TEST(TransferPlanGroups, StateGroupMovesExactlyItsState) {
    struct Named {
        const char* model;
        const char* from;
        const char* to;
    };
    for (const Named& c :
         {Named{"tiny-hybrid", "tp=2", "tp=4"}, Named{"tiny-hybrid", "tp=4", "tp=1"},
          Named{"qwen3-next-80b-a3b", "tp=4", "tp=2"},
          Named{"nemotron-h-8b", "tp=2,pp=2", "tp=4"}}) {
        SCOPED_TRACE(std::string(c.model) + " " + c.from + " -> " + c.to);
        const ModelSpec m = catalog_model(c.model);
        int state_layers = 0;
        for (int l = 0; l < m.num_layers; ++l) state_layers += holds_state(m.layer(l).kind);
        ASSERT_GT(state_layers, 0);
        int64_t previous = -1;
        for (int64_t L : {int64_t{100}, int64_t{4096}}) {
            const TransferPlan plan = plan_for(m, c.from, c.to, L);
            const int tp_to = plan.dst.layout.parallel.tp;
            int64_t state = 0;
            // (dst, layer) -> state heads and key heads received
            std::map<int, std::multiset<int>> heads, keys;
            for (const auto& msg : plan.messages) {
                const TransferGroup& g = plan.groups[msg.kv_group];
                if (!g.holds_state()) continue;
                state += msg.bytes;
                EXPECT_EQ(msg.num_tokens, 0);
                EXPECT_TRUE(msg.pieces.empty());
                for (int h = msg.head_begin; h < msg.head_end; ++h) heads[msg.dst_rank].insert(h);
                for (int k = msg.key_begin; k < msg.key_end; ++k) keys[msg.dst_rank].insert(k);
            }
            EXPECT_EQ(state, int64_t{tp_to} * state_layers * state_bytes(m.state, tp_to));
            // Each destination rank gets its heads and key heads once (a PP split of the
            // source sends each stage's layers in its own message, so count per source stage).
            for (const auto& [d, hs] : heads) {
                const std::set<int> distinct(hs.begin(), hs.end());
                EXPECT_EQ(static_cast<int>(distinct.size()), std::max(1, m.state.heads / tp_to));
                EXPECT_EQ(hs.size() % distinct.size(), 0u);
            }
            for (const auto& [d, ks] : keys) {
                const std::set<int> distinct(ks.begin(), ks.end());
                EXPECT_EQ(static_cast<int>(distinct.size()), std::max(1, m.state.groups / tp_to));
            }
            EXPECT_EQ(plan.bytes, plan.min_bytes);
            if (previous >= 0) {
                EXPECT_EQ(state, previous);  // the same at every length
            }
            previous = state;
        }
    }
}

// Jamba-v0.1's Mamba-1 state: vLLM's mamba1_state_shape is conv (k - 1, d_inner / tp) and ssm
// (d_inner / tp, d_state), no B/C conv columns (a Mamba-2 state's groups). Computed here from the
// shape, not from state_bytes: 28 Mamba layers, d_inner 8192, d_state 16, k 4, bf16 both.
TEST(TransferPlanGroups, Mamba1StateMovesItsShapeAndNoGroupColumns) {
    const ModelSpec m = load_hf_config(KVSHARD_TEST_DATA_DIR "/hf_configs/jamba-v0.1.json");
    for (const auto& [from, to] :
         {std::pair{"tp=1", "tp=2"}, std::pair{"tp=2", "tp=4"}, std::pair{"tp=4", "tp=1"}}) {
        SCOPED_TRACE(std::string(from) + " -> " + to);
        const TransferPlan plan = plan_for(m, from, to, 1000);
        const int64_t tp = plan.dst.layout.parallel.tp, d_inner = 8192 / tp;
        const int64_t per_rank = 28 * ((4 - 1) * d_inner * 2 + d_inner * 16 * 2);
        int64_t state = 0;
        for (const auto& msg : plan.messages)
            if (plan.groups[msg.kv_group].holds_state()) state += msg.bytes;
        EXPECT_EQ(state, tp * per_rank);
        EXPECT_EQ(plan.bytes, plan.min_bytes);
    }
}

// No-KV layers send nothing; MLA with indexer keys sends latent and key once per destination.
TEST(TransferPlanGroups, NoKvLayersAndMlaIndexer) {
    const ModelSpec nem = catalog_model("nemotron-h-8b");
    const TransferPlan plan = plan_for(nem, "tp=4", "tp=2", 1000, 16, 16, 1);
    std::set<int> layers_sent;
    for (const auto& msg : plan.messages)
        for (int l = msg.layer_begin; l < msg.layer_end; ++l) layers_sent.insert(l);
    for (int l = 0; l < nem.num_layers; ++l) {
        const LayerKind k = nem.layer(l).kind;
        EXPECT_EQ(layers_sent.count(l), k == LayerKind::kNoKv ? 0u : 1u) << "layer " << l;
    }
    EXPECT_EQ(plan.bytes, expected_bytes_cp1(nem, 2, 1000, 16));

    const ModelSpec ds = catalog_model("deepseek-v3.2");
    ASSERT_TRUE(ds.uniform());  // every layer MLA with indexer keys: one page shape
    const TransferPlan mla = plan_for(ds, "tp=8", "tp=4", 1000);
    EXPECT_EQ(mla.bytes, expected_bytes_cp1(ds, 4, 1000, 16));
    EXPECT_EQ(mla.bytes, mla.min_bytes);
    std::map<int, int64_t> tokens_to;
    for (const auto& msg : mla.messages) tokens_to[msg.dst_rank] += msg.num_tokens;
    for (const auto& [d, t] : tokens_to) EXPECT_EQ(t, 1000) << "destination " << d;
    // Its pools lay the indexer key (128 fp8 + one fp32 scale) after the 576-wide bf16 latent.
    ASSERT_EQ(ds.kv_dtype, DType::kBf16);
    EXPECT_TRUE(mla.executable());
    const PageGeometry g = rank_page_geometry(mla.src.layout, 0, 16, PageOrder::kHnd);
    EXPECT_EQ(g.head_dim, 576 + 132 / 2);
    EXPECT_EQ(g.bytes_per_token(), 61 * (1152 + 132));
    EXPECT_EQ(rank_page_geometry(group_transfer_plan(mla, 0).src.layout, 0, 16, PageOrder::kHnd),
              g);
}

// DeepSeek-V3.2 at fp8: vLLM's fp8_ds_mla entries (656 bytes for the 512 + 64 latent) plus the
// indexer key move once per destination; kvshard's fp8 pages (codes + per-block scales) are not
// that layout, so a group plan of it plans and sizes but refuses page geometry.
TEST(TransferPlanGroups, SparseMlaFp8PlansFp8DsMlaBytes) {
    ModelSpec ds = catalog_model("deepseek-v3.2");
    ds.kv_dtype = DType::kFp8;
    const TransferPlan plan = plan_for(ds, "tp=8", "tp=4", 1000);
    EXPECT_EQ(plan.bytes, int64_t{4} * 1000 * 61 * (656 + 132));  // 1000 tokens to each of 4
    const TransferPlan g = group_transfer_plan(plan, 0);
    try {
        rank_page_geometry(g.src.layout, 0, 16, PageOrder::kHnd);
        FAIL() << "expected an Error";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("fp8_ds_mla"), std::string::npos) << e.what();
    }
}

// Plans of non-uniform models are not packed whole (the executor's pools have one page shape):
// they are carried out per group (group_execution_test.cpp).
TEST(TransferPlanGroups, ExecutionRefusesNonUniformModels) {
    const TransferPlan plan = plan_for(catalog_model("tiny-swa"), "tp=2", "tp=1", 40);
    EXPECT_FALSE(plan.executable());
    try {
        rank_page_geometry(plan.src.layout, 0, 16, PageOrder::kHnd);
        FAIL() << "expected an Error";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("carry it out per group: group_transfer_plan"),
                  std::string::npos)
            << e.what();
    }
    EXPECT_TRUE(plan_for(catalog_model("tiny"), "tp=2", "tp=1", 40).executable());
    // Different layer mixes are different models.
    const auto src =
        testing::make_endpoint(catalog_model("tiny-swa"), "tp=1", 16, PageOrder::kHnd, 40);
    const auto dst = testing::make_endpoint(catalog_model("tiny"), "tp=1", 16, PageOrder::kHnd, 40);
    EXPECT_THROW(make_transfer_plan(src, dst, 40), Error);
}

// Each KV group of a plan that is carried out per group moves in the mode of its own group plan
// (what the executor uses); state groups in none. The CLI prints that, not a placeholder.
TEST(TransferPlanGroups, ResolvesEachGroupsMode) {
    const ModelSpec m = catalog_model("tiny-swa");
    const auto src = testing::make_endpoint(m, "tp=2", 16, PageOrder::kHnd, 100);
    const auto dst = testing::make_endpoint(m, "tp=1", 16, PageOrder::kNhd, 100);
    const TransferPlan plan = make_transfer_plan(src, dst, 100);
    ASSERT_FALSE(plan.executable());
    for (const TransferMode asked :
         {TransferMode::kAuto, TransferMode::kPreSend, TransferMode::kPostReceive}) {
        const auto modes = resolve_group_modes(plan, asked);
        ASSERT_EQ(modes.size(), plan.groups.size());
        for (size_t k = 0; k < modes.size(); ++k) {
            ASSERT_TRUE(modes[k].has_value()) << k;
            EXPECT_EQ(*modes[k],
                      resolve_mode(group_transfer_plan(plan, static_cast<int>(k)), asked));
            if (asked != TransferMode::kAuto) {
                EXPECT_EQ(*modes[k], asked);
            }
        }
        EXPECT_EQ(group_modes_text(plan, asked), transfer_mode_name(*modes[0]));
    }
    // HND -> NHD ties on copies and transposes in the receiver.
    EXPECT_EQ(group_modes_text(plan, TransferMode::kAuto), "post-receive");

    const ModelSpec h = catalog_model("tiny-hybrid");
    const TransferPlan hp = plan_for(h, "tp=2", "tp=1", 100);
    const auto hm = resolve_group_modes(hp, TransferMode::kAuto);
    ASSERT_EQ(hm.size(), hp.groups.size());
    int state = 0;
    for (size_t k = 0; k < hm.size(); ++k) {
        EXPECT_EQ(hm[k].has_value(), !hp.groups[k].holds_state()) << k;
        state += hp.groups[k].holds_state();
    }
    EXPECT_EQ(state, 1);
    EXPECT_EQ(group_modes_text(hp, TransferMode::kAuto), "pre-send");
    // A uniform model: the plan's own mode.
    const TransferPlan up = plan_for(catalog_model("tiny"), "tp=2", "tp=1", 40);
    EXPECT_EQ(resolve_group_modes(up, TransferMode::kAuto),
              (std::vector<std::optional<TransferMode>>{resolve_mode(up, TransferMode::kAuto)}));

    using kvshard::test::run_cli;
    const auto r = run_cli(
        "transfer-plan --model tiny-hybrid --from tp=2 --to tp=1 --tokens 100 --order-to nhd");
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_NE(r.out.find("mode post-receive,"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("whole state"), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("per KV group"), std::string::npos) << r.out;
}

TEST(TransferPlanGroups, Cli) {
    using kvshard::test::run_cli;
    const auto r =
        run_cli("transfer-plan --model gpt-oss-120b --from tp=8 --to tp=4 --tokens 32768 --json");
    ASSERT_EQ(r.status, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["bytes"], j["min_bytes"]);
    ASSERT_EQ(j["kv_groups"].size(), 2u);
    int64_t sum = 0;
    for (const auto& g : j["kv_groups"]) sum += g["bytes"].get<int64_t>();
    EXPECT_EQ(sum, j["bytes"].get<int64_t>());
    EXPECT_EQ(j["kv_groups"][0]["kind"], "sliding");
    EXPECT_EQ(j["kv_groups"][0]["first_kept"], 32768 - 127);  // the window of the token at L
    // 18 sliding layers x 128 tokens (block 2040 on) x K,V x 8 heads x 64 x bf16 over the 4
    // destinations.
    EXPECT_EQ(j["kv_groups"][0]["bytes"].get<int64_t>(), int64_t{18} * 128 * 2 * 8 * 64 * 2);
    const auto text =
        run_cli("transfer-plan --model tiny-hybrid --from tp=2 --to tp=4 --tokens 100");
    ASSERT_EQ(text.status, 0) << text.out;
    EXPECT_NE(text.out.find("gated_deltanet"), std::string::npos) << text.out;
    const auto sched =
        run_cli("transfer-plan --model tiny-swa --from tp=2 --to tp=1 --tokens 100 --schedule");
    EXPECT_EQ(sched.status, 2) << sched.out;
    EXPECT_NE(sched.out.find("carry it out per group"), std::string::npos) << sched.out;
}

}  // namespace
}  // namespace kvshard
