// Transfers of models whose KV groups have their own KV head count and head size (Gemma 4: sliding
// layers of 16 KV heads x 256 beside full layers of 4 KV heads x 512, where the model's uniform
// fields say 16 x 256). Each rank's pool of a group holds the rank's TP share of that group's
// heads, as vLLM allocates each layer: max(1, H / tp) contiguous heads of the group's head size,
// each held by max(1, tp / H) ranks. Checked three ways: the whole plan's bytes and head ranges per
// (source, destination, group) against figures computed here from the model's layers; the group
// plans' pools against the layout's RankKvGroup; and the bytes that land in every destination pool
// when the group plans are packed and unpacked (and run through the executor).
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "kvshard/comm/threads.h"
#include "kvshard/transfer/descriptors.h"
#include "kvshard/transfer/transfer_exec.h"
#include "transfer/transfer_harness.h"

namespace kvshard {
namespace {

constexpr int kWindow = 8;
constexpr int kBlock = 4;
constexpr int64_t kTokens = 64;

// Gemma-4-31B's structure at test size: sliding(8) layers of 8 KV heads x 16 beside full layers
// (every third, the last one full) of 2 KV heads x 32; the model's uniform fields are the sliding
// layers' (8 x 16), as the config reader sets Gemma 4's. fp32, so every element carries its code.
ModelSpec gemma4_mini() {
    ModelSpec m = testing::llama_mini(6, 8, 16);
    m.name = "gemma4-mini";
    const ModelSpec uniform = m;
    for (int l = 0; l < m.num_layers; ++l) {
        LayerSpec s = uniform.layer(l);
        if (l % 3 == 2) {
            s.num_kv_heads = 2;
            s.head_dim = 32;
        } else {
            s.kind = LayerKind::kSlidingWindow;
            s.window = kWindow;
        }
        m.layers.push_back(s);
    }
    return m;
}

// The model's KV groups as this test sees them, from its layers alone: sliding (group 0, layer 0
// first) and full (group 1).
struct Shape {
    int heads = 0, head_dim = 0;
    bool sliding = false;
    std::vector<int> layers;
};
std::vector<Shape> shapes(const ModelSpec& m) {
    std::vector<Shape> out(2);
    for (int l = 0; l < m.num_layers; ++l) {
        const LayerSpec s = m.layer(l);
        Shape& g = out[s.kind == LayerKind::kSlidingWindow ? 0 : 1];
        g.heads = s.num_kv_heads;
        g.head_dim = s.head_dim;
        g.sliding = s.kind == LayerKind::kSlidingWindow;
        g.layers.push_back(l);
    }
    return out;
}

// Layers [begin, end) of each PP stage: as even as possible, the first L mod pp stages one more.
std::vector<std::pair<int, int>> stages(int layers, int pp) {
    std::vector<std::pair<int, int>> out;
    int at = 0;
    for (int s = 0; s < pp; ++s) {
        const int n = layers / pp + (s < layers % pp ? 1 : 0);
        out.emplace_back(at, at + n);
        at += n;
    }
    return out;
}

// TP index t's heads of a group of h heads: [first, first + per).
struct Heads {
    int first = 0, per = 0, replication = 0;
};
Heads heads_of(int h, int tp, int t) {
    Heads x;
    x.per = std::max(1, h / tp);
    x.replication = std::max(1, tp / h);
    x.first = t / x.replication * x.per;
    return x;
}

// The first position a destination of block size kBlock keeps of a group: all for full layers;
// sliding: the block holding L + 1 - W, the first position the decode side's first query (at L)
// reads.
int64_t first_moved(const Shape& g, int64_t L) {
    if (!g.sliding) return 0;
    return std::max<int64_t>(0, L + 1 - kWindow) / kBlock * kBlock;
}

struct Expected {
    int64_t bytes = 0;
    int head_begin = 0, head_end = 0;
};
using Key = std::tuple<int, int, int>;  // (source rank, destination rank, group)

// What each source rank sends each destination rank of each group, from the rule of
// docs/transfer.md: every destination takes its layers x its group heads x the group's kept tokens
// from the source stage holding each layer and a source TP rank holding each head. Where a head is
// replicated on the source (R copies), its n equal demands on one stage go whole round-robin
// (demand i from copy i mod R) when n is a multiple of R, else split into R equal token shares laid
// end to end (the cases below keep every share a whole number of tokens).
std::map<Key, Expected> expected_messages(const ModelSpec& m, const ParallelConfig& ps,
                                          const ParallelConfig& pd, int64_t L) {
    const std::vector<Shape> groups = shapes(m);
    const auto src_stages = stages(m.num_layers, ps.pp), dst_stages = stages(m.num_layers, pd.pp);
    std::map<Key, Expected> out;
    for (int k = 0; k < int(groups.size()); ++k) {
        const Shape& g = groups[size_t(k)];
        const int64_t tokens = L - first_moved(g, L);
        for (int ss = 0; ss < ps.pp; ++ss) {
            const Heads hs0 = heads_of(g.heads, ps.tp, 0);
            for (int hg = 0; hg < ps.tp / hs0.replication; ++hg) {
                const int src_first = hg * hs0.per, src_end = src_first + hs0.per;
                struct Demand {
                    int dst;
                    int layers;
                    int h0, h1;
                };
                std::vector<Demand> demands;
                for (int sd = 0; sd < pd.pp; ++sd)
                    for (int td = 0; td < pd.tp; ++td) {
                        int layers = 0;
                        for (int l : g.layers)
                            layers += l >= std::max(src_stages[size_t(ss)].first,
                                                    dst_stages[size_t(sd)].first) &&
                                      l < std::min(src_stages[size_t(ss)].second,
                                                   dst_stages[size_t(sd)].second);
                        const Heads hd = heads_of(g.heads, pd.tp, td);
                        const int h0 = std::max(src_first, hd.first);
                        const int h1 = std::min(src_end, hd.first + hd.per);
                        if (layers == 0 || h0 >= h1) continue;
                        demands.push_back({rank_of(pd, 0, sd, 0, td), layers, h0, h1});
                    }
                if (demands.empty()) continue;
                const int R = hs0.replication;
                const auto n = int64_t(demands.size());
                for (const Demand& d : demands) {
                    EXPECT_EQ(d.layers * (d.h1 - d.h0),
                              demands[0].layers * (demands[0].h1 - demands[0].h0))
                        << "the rule above covers equal demands only";
                }
                auto add = [&](int copy, const Demand& d, int64_t t) {
                    if (t == 0) return;
                    Expected& e = out[{rank_of(ps, 0, ss, 0, hg * R + copy), d.dst, k}];
                    e.bytes += int64_t{d.layers} * 2 * (d.h1 - d.h0) * t * g.head_dim * 4;
                    e.head_begin = d.h0;
                    e.head_end = d.h1;
                };
                if (n % R == 0) {
                    for (int64_t i = 0; i < n; ++i) add(int(i % R), demands[size_t(i)], tokens);
                } else {
                    EXPECT_EQ(n * tokens % R, 0) << "choose L so that the shares are whole tokens";
                    const int64_t share = n * tokens / R;
                    for (int c = 0; c < R; ++c)
                        for (int64_t i = 0; i < n; ++i) {
                            const int64_t a = std::max(c * share, i * tokens);
                            const int64_t b = std::min((c + 1) * share, (i + 1) * tokens);
                            add(c, demands[size_t(i)], std::max<int64_t>(0, b - a));
                        }
                }
            }
        }
    }
    return out;
}

TransferPlan plan_for(const ModelSpec& m, const std::string& from, const std::string& to,
                      PageOrder order_to = PageOrder::kHnd) {
    const auto src = testing::make_endpoint(m, from, kBlock, PageOrder::kHnd, kTokens);
    const auto dst = testing::make_endpoint(m, to, kBlock, order_to, kTokens);
    return make_transfer_plan(src, dst, kTokens);
}

const std::vector<std::pair<std::string, std::string>> kPairs = {
    {"tp=8", "tp=2"},           {"tp=2", "tp=8"},           {"tp=4", "tp=4"},
    {"tp=8,pp=2", "tp=2"},      {"tp=4,pp=2", "tp=2"},      {"tp=2", "tp=8,pp=2"},
    {"tp=4,pp=2", "tp=4,pp=3"}, {"tp=2,pp=3", "tp=4,pp=2"},
};

// (1) The whole plan: each (source, destination, group) message carries exactly the bytes and the
// head range computed above, and nothing else moves.
TEST(GroupHeadShapes, PlanMessagesPerGroupAreExact) {
    const ModelSpec m = gemma4_mini();
    ASSERT_EQ(kv_groups(m).size(), 2u);
    ASSERT_EQ(kv_groups(m)[1].num_kv_heads, 2);
    for (const auto& [from, to] : kPairs) {
        SCOPED_TRACE(from + " -> " + to);
        const TransferPlan plan = plan_for(m, from, to);
        const auto want =
            expected_messages(m, plan.src.layout.parallel, plan.dst.layout.parallel, kTokens);
        std::map<Key, Expected> got;
        for (const TransferMessage& msg : plan.messages) {
            const Key key{msg.src_rank, msg.dst_rank, msg.kv_group};
            EXPECT_EQ(got.count(key), 0u) << "one message per (source, destination, group)";
            got[key] = {msg.bytes, msg.head_begin, msg.head_end};
        }
        int64_t total = 0;
        for (const auto& [key, e] : want) {
            const auto [s, d, k] = key;
            SCOPED_TRACE(::testing::Message() << "src " << s << " dst " << d << " group " << k);
            ASSERT_EQ(got.count(key), 1u);
            EXPECT_EQ(got[key].bytes, e.bytes);
            EXPECT_EQ(got[key].head_begin, e.head_begin);
            EXPECT_EQ(got[key].head_end, e.head_end);
            total += e.bytes;
        }
        EXPECT_EQ(got.size(), want.size());
        EXPECT_EQ(plan.bytes, total);
        EXPECT_EQ(plan.min_bytes, total);
    }
}

// (2) Each token group's plan is executable over pools that hold the rank's share of the group's
// heads, of the group's head size: the heads and page shape make_layout's RankKvGroup gives, and
// the same bytes per token.
TEST(GroupHeadShapes, GroupPlansHoldEachRanksShareOfTheGroupsHeads) {
    const ModelSpec m = gemma4_mini();
    const std::vector<Shape> groups = shapes(m);
    for (const auto& [from, to] : kPairs) {
        SCOPED_TRACE(from + " -> " + to);
        const TransferPlan plan = plan_for(m, from, to);
        ASSERT_FALSE(plan.executable());
        for (int k = 0; k < 2; ++k) {
            SCOPED_TRACE(::testing::Message() << "group " << k);
            const TransferPlan gp = group_transfer_plan(plan, k);
            EXPECT_TRUE(gp.executable());
            EXPECT_EQ(gp.head_dim, groups[size_t(k)].head_dim);
            int64_t bytes = 0;
            for (const auto& msg : plan.messages)
                if (msg.kv_group == k) bytes += msg.bytes;
            EXPECT_EQ(gp.bytes, bytes);
            EXPECT_EQ(gp.min_bytes, bytes);
            for (const TransferEndpoint* e : {&gp.src, &gp.dst}) {
                const TransferEndpoint& whole = e == &gp.src ? plan.src : plan.dst;
                for (int r = 0; r < e->layout.world_size(); ++r) {
                    const RankKv& rk = e->layout.ranks[size_t(r)];
                    const Heads h =
                        heads_of(groups[size_t(k)].heads, e->layout.parallel.tp, rk.coord.tp);
                    std::vector<int> ids;
                    for (int i = 0; i < h.per; ++i) ids.push_back(h.first + i);
                    EXPECT_EQ(rk.kv_heads, ids) << "rank " << r;
                    EXPECT_EQ(int(rk.head_replica_ranks.size()), h.replication - 1);
                    const PageGeometry geo =
                        rank_page_geometry(e->layout, r, e->block_size, e->order);
                    EXPECT_EQ(geo.num_heads, h.per);
                    EXPECT_EQ(geo.head_dim, groups[size_t(k)].head_dim);
                    // The layout's own description of the rank's pool of this group.
                    const RankKv& full = whole.layout.ranks[size_t(r)];
                    const RankKvGroup* rg = nullptr;
                    for (const RankKvGroup& x : full.groups)
                        if (x.group == k) rg = &x;
                    if (!rg) {
                        EXPECT_EQ(geo.num_layers, 0);
                        continue;
                    }
                    EXPECT_EQ(rg->kv_heads, geo.num_heads);
                    EXPECT_EQ(int(rg->layers.size()), geo.num_layers);
                    EXPECT_EQ(rg->bytes_per_token, geo.bytes_per_token());
                    EXPECT_EQ(rk.kv_bytes_per_token, geo.bytes_per_token());
                }
            }
        }
    }
}

// The positions a destination pool of group k holds after the transfer.
int64_t from_token(const TransferPlan& plan, int k) {
    return plan.groups[size_t(k)].window > 0 ? first_moved({.sliding = true}, kTokens) : 0;
}

// Pools of one group plan's side, as the harness makes them (source: codes at the request's slots,
// garbage elsewhere; destination: the sentinel), except that a rank holding none of the group's
// layers has no pool (it takes no part in the group), as in a disaggregated run.
testing::Side group_side(const TransferEndpoint& e, bool source) {
    testing::Side s;
    s.endpoint = e;
    s.pools.resize(size_t(e.layout.world_size()));
    for (const RankKv& r : e.layout.ranks) {
        if (r.num_layers() == 0) continue;
        auto pool = std::make_unique<BlockPool>(
            rank_page_geometry(e.layout, r.coord.rank, e.block_size, e.order),
            testing::pool_blocks(e));
        testing::fill_u32(*pool, source ? testing::kGarbage : testing::kSentinel);
        if (source)
            testing::for_each_token_element(e, r.coord.rank, kTokens,
                                            [&](int layer, int ll, int kv, int head, int lh,
                                                int64_t t, int32_t b, int slot, int d) {
                                                *testing::elem_ptr(*pool, ll, kv, b, lh, slot, d) =
                                                    testing::element_code(layer, kv, head, t, d);
                                            });
        s.pools[size_t(r.coord.rank)] = std::move(pool);
    }
    return s;
}

// Elements of destination pools that differ from what their layout says they hold.
int64_t wrong_elements(const TransferPlan& gp, const testing::Side& dst, int64_t from) {
    int64_t wrong = 0;
    for (int r = 0; r < gp.dst.layout.world_size(); ++r) {
        if (!dst.pools[size_t(r)]) continue;
        const auto want = testing::expected_pool(gp.dst, r, kTokens, *dst.pools[size_t(r)], from);
        const auto* got = reinterpret_cast<const uint32_t*>(dst.pools[size_t(r)]->arena().data());
        for (size_t i = 0; i < want.size(); ++i) wrong += got[i] != want[i];
    }
    return wrong;
}

// (3) Byte-exact: source pools of every group filled with codes of (layer, K/V, head, token, dim),
// each group plan packed and unpacked in both modes (and into NHD pages): every destination pool
// holds its share of its group's heads at the kept tokens' slots and the sentinel elsewhere, and
// each byte is written once.
TEST(GroupHeadShapes, PackUnpackPerGroupIsByteExact) {
    const ModelSpec m = gemma4_mini();
    for (const auto& [from, to] : kPairs) {
        for (const PageOrder order : {PageOrder::kHnd, PageOrder::kNhd}) {
            const TransferPlan plan = plan_for(m, from, to, order);
            for (int k = 0; k < 2; ++k) {
                const TransferPlan gp = group_transfer_plan(plan, k);
                const testing::Side src = group_side(gp.src, true);
                for (const TransferMode mode :
                     {TransferMode::kPreSend, TransferMode::kPostReceive}) {
                    SCOPED_TRACE(::testing::Message()
                                 << from << " -> " << to << (order == PageOrder::kNhd ? " NHD" : "")
                                 << " group " << k << " " << transfer_mode_name(mode));
                    testing::Side dst = group_side(gp.dst, false);
                    const testing::RunResult run = testing::run_plan(gp, mode, src, dst);
                    EXPECT_EQ(run.bytes, gp.min_bytes);
                    EXPECT_EQ(wrong_elements(gp, dst, from_token(plan, k)), 0);
                    const auto counts = testing::write_counts(gp, mode, dst);
                    for (const auto& c : counts)
                        for (uint8_t n : c) ASSERT_LE(n, 1) << "a byte written twice";
                }
                // The descriptors of the group plan, each run copied from source pool to
                // destination pool, leave the same destination pools.
                SCOPED_TRACE(::testing::Message()
                             << from << " -> " << to << " group " << k << " descriptors");
                const TransferDescriptors desc = make_transfer_descriptors(
                    gp, side_pool_regions(gp, true, testing::pool_blocks(gp.src)),
                    side_pool_regions(gp, false, testing::pool_blocks(gp.dst)));
                EXPECT_EQ(desc.bytes, gp.bytes);
                testing::Side dst = group_side(gp.dst, false);
                for (const TransferDescriptor& x : desc.descriptors)
                    std::memcpy(dst.pools[size_t(x.dst_rank)]->arena().data() + x.dst_offset,
                                src.pools[size_t(x.src_rank)]->arena().data() + x.src_offset,
                                size_t(x.bytes));
                EXPECT_EQ(wrong_elements(gp, dst, from_token(plan, k)), 0);
            }
        }
    }
}

// The executor carries the group plans out between the ranks' pools of each group over the
// threads communicator, layer by layer, to the same bytes.
TEST(GroupHeadShapes, ExecutorMovesEachGroup) {
    const ModelSpec m = gemma4_mini();
    for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
             {"tp=8", "tp=2"}, {"tp=2", "tp=8"}, {"tp=4,pp=2", "tp=2"}}) {
        const auto src_e = testing::make_endpoint(m, from, kBlock, PageOrder::kHnd, kTokens);
        const auto dst_e = testing::make_endpoint(m, to, kBlock, PageOrder::kHnd, kTokens);
        const TransferPlan plan =
            make_transfer_plan(src_e, dst_e, kTokens, {.layers_per_group = 1});
        for (int k = 0; k < 2; ++k) {
            SCOPED_TRACE(::testing::Message() << from << " -> " << to << " group " << k);
            const auto gp = std::make_shared<const TransferPlan>(group_transfer_plan(plan, k));
            const testing::Side src = group_side(gp->src, true);
            testing::Side dst = group_side(gp->dst, false);
            const int P = gp->src.layout.world_size(), D = gp->dst.layout.world_size();
            TransferExecOptions opt;
            opt.src_world_base = 0;
            opt.dst_world_base = P;
            std::vector<TransferResult> sent(static_cast<size_t>(P)),
                received(static_cast<size_t>(D));
            std::mutex mu;
            run_threads(P + D, [&](Communicator& world) {
                const int me = world.rank();
                if (me < P) {
                    TransferSender s(world, gp, 7, me, *src.pools[size_t(me)], opt);
                    // The whole model's layers in order, as a prefill writes them.
                    const RankKv& rk = plan.src.layout.ranks[size_t(me)];
                    for (int l = rk.layer_begin; l < rk.layer_end; ++l) {
                        const int done = group_layers_done(plan.groups[size_t(k)].layers, l);
                        if (done > 0) s.layer_ready(done - 1);
                        s.progress();
                    }
                    s.all_layers_ready();
                    const TransferResult r = s.finish();
                    std::lock_guard lk(mu);
                    sent[size_t(me)] = r;
                } else {
                    TransferReceiver r(world, gp, 7, me - P, *dst.pools[size_t(me - P)], opt);
                    const TransferResult res = r.finish();
                    std::lock_guard lk(mu);
                    received[size_t(me - P)] = res;
                }
            });
            int64_t bytes = 0;
            for (const auto& r : sent) EXPECT_TRUE(r.ok()) << r.error;
            for (const auto& r : received) {
                EXPECT_TRUE(r.ok()) << r.error;
                bytes += r.bytes;
            }
            EXPECT_EQ(bytes, gp->min_bytes);
            EXPECT_EQ(wrong_elements(*gp, dst, from_token(plan, k)), 0);
        }
    }
}

// The real config: Gemma-4-31B's plans per group at 5000 tokens, TP=8 -> TP=2, each group plan
// executable with the group's heads (the full group's 4 heads replicated twice at tp=8).
TEST(GroupHeadShapes, Gemma4_31bGroupPlans) {
    const ModelSpec m = load_hf_config(KVSHARD_TEST_DATA_DIR "/hf_configs/gemma-4-31b.json");
    const std::vector<KvGroup> groups = kv_groups(m);
    ASSERT_EQ(groups.size(), 2u);
    const auto src = testing::make_endpoint(m, "tp=8", 16, PageOrder::kHnd, 5000);
    const auto dst = testing::make_endpoint(m, "tp=2", 16, PageOrder::kHnd, 5000);
    const TransferPlan plan = make_transfer_plan(src, dst, 5000);
    EXPECT_EQ(plan.bytes, plan.min_bytes);
    for (int k = 0; k < 2; ++k) {
        const TransferPlan gp = group_transfer_plan(plan, k);
        const KvGroup& g = groups[size_t(k)];
        for (int r = 0; r < 8; ++r) {
            const PageGeometry geo = rank_page_geometry(gp.src.layout, r, 16, PageOrder::kHnd);
            EXPECT_EQ(geo.num_heads, std::max(1, g.num_kv_heads / 8));
            EXPECT_EQ(geo.head_dim, g.head_dim);
        }
        for (int r = 0; r < 2; ++r)
            EXPECT_EQ(rank_page_geometry(gp.dst.layout, r, 16, PageOrder::kHnd).num_heads,
                      g.num_kv_heads / 2);
    }
}

}  // namespace
}  // namespace kvshard
