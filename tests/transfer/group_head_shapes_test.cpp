// Transfers of models whose KV groups have their own KV head count and head size (Gemma 4: sliding
// layers of 16 KV heads x 256 beside full layers of 4 KV heads x 512, where the model's uniform
// fields say 16 x 256). Each rank holds its TP share of each group's heads, as vLLM allocates each
// layer: max(1, H / tp) contiguous heads of the group's head size, each held by max(1, tp / H)
// ranks. The whole plan's bytes and head ranges per (source, destination, group) are checked
// against figures computed here from the model's layers.
#include <gtest/gtest.h>

#include <map>
#include <tuple>

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

}  // namespace
}  // namespace kvshard
