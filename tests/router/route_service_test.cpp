// RouteService without sockets: an index fed through VllmEventIngest by encoded batches, routes,
// load accounting, the replica and metrics views, bad input.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "kvshard/cache/vllm_hash.h"
#include "kvshard/cache/vllm_kv_events.h"
#include "kvshard/common/error.h"
#include "kvshard/router/route_service.h"
#include "kvshard/router/vllm_event_ingest.h"

namespace kvshard {
namespace {

struct Fixture {
    KvIndex index{2};
    VllmEventIngest ingest{index};
    std::vector<int64_t> prompt;
    std::vector<uint64_t> ids;  // vLLM ids of the prompt's full blocks
    uint64_t seq[2] = {0, 0};

    Fixture() {
        for (int i = 0; i < 21; ++i) prompt.push_back(100 + 3 * i);
        std::vector<int32_t> t(prompt.begin(), prompt.end());
        VllmBlockHasher h(VllmHashScheme::kSha256Cbor);
        for (const auto& d : h.hash_blocks(vllm_none_hash(VllmHashScheme::kSha256Cbor, "0"), t, 4))
            ids.push_back(d.event_id());
    }
    void store(int replica, int first, int count) {
        VllmKvEvent e;
        e.kind = VllmEventKind::kBlockStored;
        e.block_hashes.assign(ids.begin() + first, ids.begin() + first + count);
        e.block_size = 4;
        const auto s = encode_vllm_seq(seq[replica]++);
        const auto p = encode_vllm_event_batch(VllmEventBatch{0.0, {e}, replica});
        ASSERT_EQ(ingest.on_batch(replica, s, p).outcome, VllmEventIngest::Outcome::kApplied);
    }
    RouteService service(RoutingPolicy policy = RoutingPolicy::kKvshard) {
        RouteServiceConfig c;
        c.replica_names = {"a", "b"};
        c.policy = policy;
        c.block_size = 4;
        c.hash_seed = "0";
        return RouteService(c, [this](const auto& fn) { fn(index, &ingest); });
    }
};

TEST(RouteService, RoutesToTheLongestPrefixAndAccountsLoad) {
    Fixture f;
    f.store(0, 0, 2);
    f.store(1, 0, 5);
    auto svc = f.service();
    const auto o = svc.route("r1", f.prompt);
    EXPECT_EQ(o.replica_name, "b");
    EXPECT_EQ(o.matched_blocks, (std::vector<int>{2, 5}));
    EXPECT_EQ(o.load_blocks, (std::vector<int64_t>{0, 6}));  // ceil(21 / 4)
    EXPECT_TRUE(svc.finished("r1"));
    EXPECT_FALSE(svc.finished("r1"));
    const auto reps = nlohmann::json::parse(svc.replicas_json())["replicas"];
    EXPECT_EQ(reps[1]["index_blocks"], 5);
    EXPECT_EQ(reps[1]["load_blocks"], 0);
    EXPECT_EQ(reps[0]["last_seq"], 0);
    const std::string m = svc.metrics_text();
    EXPECT_NE(m.find("kvshard_router_routes_total 1\n"), std::string::npos) << m;
    EXPECT_NE(m.find("kvshard_router_hit_blocks_total 5\n"), std::string::npos) << m;
    EXPECT_NE(m.find("kvshard_router_events_total{replica=\"b\"} 1\n"), std::string::npos) << m;
    EXPECT_NE(m.find("kvshard_router_route_seconds_count 1\n"), std::string::npos) << m;
}

TEST(RouteService, RoundRobinIgnoresThePrefixes) {
    Fixture f;
    f.store(1, 0, 5);
    auto svc = f.service(RoutingPolicy::kRoundRobin);
    EXPECT_EQ(svc.route("x", f.prompt).replica_name, "a");
    EXPECT_EQ(svc.route("y", f.prompt).replica_name, "b");
}

TEST(RouteService, RefusesBadInput) {
    Fixture f;
    auto svc = f.service();
    const std::vector<int64_t> negative = {1, -1}, empty = {}, big = {int64_t{1} << 40};
    EXPECT_THROW(svc.route("r", negative), Error);
    EXPECT_THROW(svc.route("r", empty), Error);
    EXPECT_THROW(svc.route("r", big), Error);
    RouteServiceConfig none;
    EXPECT_THROW(RouteService(none, [](const auto&) {}), Error);
}

}  // namespace
}  // namespace kvshard
