// Carrying out plans of models with several KV groups: each token group as a plan of its own
// (group_transfer_plan) between pools of that group's page shape, and each state group as state
// messages (pack_state_message). Checked against the whole plan's messages and bytes, and by
// moving values that encode their coordinates.
#include <gtest/gtest.h>

#include <map>
#include <vector>

#include "kvshard/common/error.h"
#include "kvshard/model/catalog.h"
#include "kvshard/transfer/pack.h"
#include "kvshard/transfer/state_pack.h"
#include "transfer/transfer_harness.h"

namespace kvshard {
namespace {

TransferPlan plan_for(const ModelSpec& m, const std::string& from, const std::string& to,
                      int64_t tokens, int bs, int lpg = 0) {
    const auto src = testing::make_endpoint(m, from, bs, PageOrder::kHnd, tokens);
    const auto dst = testing::make_endpoint(m, to, bs, PageOrder::kHnd, tokens);
    return make_transfer_plan(src, dst, tokens, {.layers_per_group = lpg});
}

// The group plans and the state messages together are the plan: same messages (layers renumbered
// within the group), same bytes; each group plan is executable with the page shape of a pool of
// the group's layers.
TEST(GroupExecution, GroupPlansPartitionThePlan) {
    for (const char* name : {"tiny-swa", "tiny-hybrid", "gpt-oss-120b", "qwen3-next-80b-a3b"}) {
        SCOPED_TRACE(name);
        const ModelSpec m = catalog_model(name);
        const TransferPlan plan = plan_for(m, "tp=2,pp=2", "tp=4", 100, 16, 1);
        ASSERT_FALSE(plan.executable());
        int64_t bytes = 0, messages = 0;
        for (int k = 0; k < int(plan.groups.size()); ++k) {
            const TransferGroup& g = plan.groups[size_t(k)];
            if (g.holds_state()) {
                EXPECT_THROW(group_transfer_plan(plan, k), Error);
                for (const auto& msg : plan.messages)
                    if (msg.kv_group == k) {
                        bytes += msg.bytes;
                        ++messages;
                    }
                continue;
            }
            const TransferPlan gp = group_transfer_plan(plan, k);
            EXPECT_TRUE(gp.executable());
            EXPECT_EQ(gp.src.layout.model.num_layers, int(g.layers.size()));
            for (int r = 0; r < gp.src.layout.world_size(); ++r) {
                const RankKv& rk = plan.src.layout.ranks[size_t(r)];
                int here = 0;
                for (int l : g.layers) here += l >= rk.layer_begin && l < rk.layer_end;
                const PageGeometry geo =
                    rank_page_geometry(gp.src.layout, r, gp.src.block_size, gp.src.order);
                EXPECT_EQ(geo.num_layers, here);
                EXPECT_EQ(geo.kv_factor, g.kv_factor);
                EXPECT_EQ(geo.head_dim * geo.elem_size(), g.vector_bytes);
            }
            int64_t gb = 0;
            for (const auto& msg : gp.messages) {
                gb += msg.bytes;
                // Streaming layer groups keep their global numbering: layer j of the group plan
                // is the group's j-th layer.
                EXPECT_EQ(msg.layer_group, g.layers[size_t(msg.layer_begin)]);
                EXPECT_EQ(msg.num_layers(), 1);
            }
            EXPECT_EQ(gb, group_totals(plan)[size_t(k)].bytes);
            bytes += gb;
            messages += int64_t(gp.messages.size());
        }
        EXPECT_EQ(bytes, plan.bytes);
        EXPECT_EQ(messages, int64_t(plan.messages.size()));
    }
}

// The first layer ready of each group: a layer of another group readies nothing.
TEST(GroupExecution, GroupLayersDone) {
    const std::vector<int> even = {0, 2, 4, 6};
    EXPECT_EQ(group_layers_done(even, 0), 1);
    EXPECT_EQ(group_layers_done(even, 1), 1);
    EXPECT_EQ(group_layers_done(even, 5), 3);
    EXPECT_EQ(group_layers_done({1, 3}, 0), 0);
}

// One rank's states of one sequence, each element its (layer, conv/rec, global key or value head,
// position in the head) so that a wrong placement shows.
struct RankStates {
    StateShard shard;
    std::map<int, std::vector<float>> conv, rec;  // by global layer
};

float code(int layer, int part, int head, int64_t at) {
    return float(layer * 1000000 + part * 100000 + head * 1000 + at);
}

RankStates make_states(const KvLayout& l, int rank, const std::vector<int>& layers, bool fill) {
    RankStates s;
    s.shard = rank_state_shard(l, rank);
    const StateShard& sh = s.shard;
    const int rows = sh.conv_kernel - 1;
    const int64_t ch = sh.conv_channels(), kd = sh.key_dim, vd = sh.value_dim;
    for (int layer : layers) {
        std::vector<float> conv(size_t(sh.conv_elems()), -1.0f), rec(size_t(sh.rec_elems()), -1.0f);
        if (fill) {
            for (int r = 0; r < rows; ++r)
                for (int k = 0; k < sh.num_keys; ++k)
                    for (int64_t e = 0; e < kd; ++e) {
                        conv[size_t(r * ch + k * kd + e)] =
                            code(layer, 0, sh.key_begin + k, r * kd + e);
                        conv[size_t(r * ch + sh.num_keys * kd + k * kd + e)] =
                            code(layer, 1, sh.key_begin + k, r * kd + e);
                    }
            for (int r = 0; r < rows; ++r)
                for (int h = 0; h < sh.num_heads; ++h)
                    for (int64_t e = 0; e < vd; ++e)
                        conv[size_t(r * ch + 2 * sh.num_keys * kd + h * vd + e)] =
                            code(layer, 2, sh.head_begin + h, r * vd + e);
            for (int h = 0; h < sh.num_heads; ++h)
                for (int64_t e = 0; e < kd * vd; ++e)
                    rec[size_t(h * kd * vd + e)] = code(layer, 3, sh.head_begin + h, e);
        }
        s.conv[layer] = conv;
        s.rec[layer] = rec;
    }
    return s;
}

StateAccess access(RankStates& s) {
    return [&s](int layer) { return StateRef{s.conv.at(layer), s.rec.at(layer)}; };
}

// tiny-hybrid with its state in Kimi Linear's KDA shape: as many key heads as value heads, of
// one head_dim (the conv state q | k | v, the recurrent state heads x d x d).
ModelSpec tiny_kda() {
    ModelSpec m = catalog_model("tiny-hybrid");
    m.name = "tiny-kda";
    m.state.groups = m.state.heads;
    m.state.group_dim = m.state.head_dim;
    m.state.kda = true;
    m.validate();
    return m;
}

// tiny-hybrid with LFM2's short-conv layers in place of its Gated DeltaNet ones: a conv state of
// (k-1) x hidden channels, no recurrent state.
ModelSpec tiny_short_conv() {
    ModelSpec m = catalog_model("tiny-hybrid");
    m.name = "tiny-short-conv";
    for (LayerSpec& s : m.layers)
        if (s.kind == LayerKind::kGatedDeltaNet) s.kind = LayerKind::kShortConv;
    m.state.heads = m.hidden;
    m.state.head_dim = 1;
    m.state.groups = 0;
    m.state.group_dim = 0;
    m.state.conv_kernel = 3;
    m.validate();
    return m;
}

// State messages between TP 1, 2 and 4 (tiny-hybrid: 4 value heads over 2 key heads, shared where
// tp exceeds them; the same in KDA's shape; short-conv channels), with a PP split on one side:
// every destination ends up with exactly the states its shard holds, as a rank of that shard
// made them, byte for byte.
TEST(GroupExecution, StateMessagesDeliverEachShardItsState) {
    for (const ModelSpec& m : {catalog_model("tiny-hybrid"), tiny_kda(), tiny_short_conv()})
        for (auto [from, to] :
             std::vector<std::pair<std::string, std::string>>{{"tp=1", "tp=4"},
                                                              {"tp=4", "tp=1"},
                                                              {"tp=2,pp=2", "tp=4"},
                                                              {"tp=4", "pp=2,tp=2"}}) {
            SCOPED_TRACE(m.name + ": " + from + " -> " + to);
            const TransferPlan plan = plan_for(m, from, to, 30, 4);
            int state_group = -1;
            for (int k = 0; k < int(plan.groups.size()); ++k)
                if (plan.groups[size_t(k)].holds_state()) state_group = k;
            ASSERT_GE(state_group, 0);
            const std::vector<int>& layers = plan.groups[size_t(state_group)].layers;
            auto held = [&](const KvLayout& l, int r) {
                std::vector<int> out;
                for (int x : layers)
                    if (x >= l.ranks[size_t(r)].layer_begin && x < l.ranks[size_t(r)].layer_end)
                        out.push_back(x);
                return out;
            };
            std::vector<RankStates> src, dst, want;
            for (int r = 0; r < plan.src.layout.world_size(); ++r)
                src.push_back(make_states(plan.src.layout, r, held(plan.src.layout, r), true));
            for (int r = 0; r < plan.dst.layout.world_size(); ++r) {
                dst.push_back(make_states(plan.dst.layout, r, held(plan.dst.layout, r), false));
                want.push_back(make_states(plan.dst.layout, r, held(plan.dst.layout, r), true));
            }
            for (const TransferMessage& msg : plan.messages) {
                if (msg.kv_group != state_group) continue;
                std::vector<std::byte> wire(size_t(msg.bytes));
                pack_state_message(plan, msg, src[size_t(msg.src_rank)].shard,
                                   access(src[size_t(msg.src_rank)]), wire);
                unpack_state_message(plan, msg, dst[size_t(msg.dst_rank)].shard,
                                     access(dst[size_t(msg.dst_rank)]), wire);
            }
            int64_t moved = 0;
            for (const TransferMessage& msg : plan.messages) moved += msg.kv_group == state_group;
            EXPECT_GT(moved, 0);
            for (size_t r = 0; r < dst.size(); ++r) {
                for (const auto& [layer, conv] : dst[r].conv)
                    EXPECT_EQ(int64_t(conv.size()), dst[r].shard.conv_elems()) << layer;
                EXPECT_EQ(dst[r].conv, want[r].conv) << "destination " << r;
                EXPECT_EQ(dst[r].rec, want[r].rec) << "destination " << r;
            }
            // A payload of the wrong size is refused.
            for (const TransferMessage& msg : plan.messages)
                if (msg.kv_group == state_group) {
                    std::vector<std::byte> small(size_t(msg.bytes - 4));
                    EXPECT_THROW(pack_state_message(plan, msg, src[size_t(msg.src_rank)].shard,
                                                    access(src[size_t(msg.src_rank)]), small),
                                 Error);
                    break;
                }
        }
}

}  // namespace
}  // namespace kvshard
