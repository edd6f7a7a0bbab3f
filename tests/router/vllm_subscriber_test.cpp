// VllmEventSubscriber against two Python publishers that speak vLLM's wire format
// (tests/router/vllm_event_publisher.py) for prompts hashed as vLLM hashes them: the index
// follows stores, removals and clears; a gap is replayed when a replay socket is configured, else
// the replica goes stale; a restart clears it; malformed messages are counted.
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <thread>

#include "kvshard/cache/block_manager.h"
#include "kvshard/cache/vllm_hash.h"
#include "kvshard/common/error.h"
#include "kvshard/router/kv_index.h"
#include "kvshard/router/vllm_event_ingest.h"
#include "kvshard/router/vllm_event_publisher.h"
#include "kvshard/router/vllm_event_subscriber.h"
#include "python_helpers.h"

namespace kvshard {
namespace {

using nlohmann::json;

constexpr int kBlock = 4;
const char* const kScheme = "vllm-sha256-cbor";

std::vector<int32_t> prompt_tokens() {
    std::vector<int32_t> t;
    for (int i = 0; i < 6 * kBlock + 1; ++i) t.push_back(1000 + 37 * i);
    return t;
}

// BlockStored of blocks [first, first + count) of the prompt, hashed by the Python reference.
json stored_blocks(int first, int count) {
    return {{"tag", "BlockStored"},
            {"_prompt",
             {{"scheme", kScheme},
              {"seed", "0"},
              {"block_size", kBlock},
              {"tokens", prompt_tokens()},
              {"first", first},
              {"count", count}}},
            {"lora_id", nullptr},
            {"medium", "GPU"},
            {"lora_name", nullptr}};
}

json batch(int seq, std::vector<json> events, const char* form = "positional") {
    return {{"seq", seq},
            {"batch", {{"ts", 1.0 + seq}, {"events", events}, {"dp", 0}, {"form", form}}}};
}

// The publisher keeps it for replay but does not send it: a lost message.
json dropped(json b) {
    b["drop"] = true;
    return b;
}

// Waits (bounded) until `done` holds; the subscriber thread works asynchronously.
bool eventually(const std::function<bool()>& done) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (std::chrono::steady_clock::now() < deadline) {
        if (done()) return true;
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return done();
}

TEST(VllmSubscriber, FollowsTwoVllmPublishers) {
    if (!VllmEventSubscriber::available()) GTEST_SKIP() << "built without libzmq";
    test::PythonPublisher p0, p1;
    ASSERT_TRUE(p0.ok() && p1.ok());
    KvIndex index(2);
    // Replica 0 has a replay socket configured, replica 1 does not.
    VllmEventSubscriber sub(
        index, {{0, p0.endpoint(), p0.replay_endpoint(), ""}, {1, p1.endpoint(), "", ""}});
    ASSERT_TRUE(p0.wait_subscribed());
    ASSERT_TRUE(p1.wait_subscribed());

    VllmBlockHasher hasher(VllmHashScheme::kSha256Cbor);
    const auto keys = vllm_prompt_keys(hasher, vllm_none_hash(VllmHashScheme::kSha256Cbor, "0"),
                                       prompt_tokens(), kBlock);
    ASSERT_EQ(keys.size(), 6u);
    auto overlap = [&] {
        std::vector<int> out(2);
        sub.with_index(
            [&](const KvIndex& idx, const VllmEventIngest&) { idx.prefix_overlap(keys, out); });
        return out;
    };
    auto batches = [&](int r) { return sub.status(r).batches; };

    // Replica 0 holds 4 blocks of the prompt, replica 1 holds 2 (map form).
    ASSERT_TRUE(p0.send(batch(0, {stored_blocks(0, 2)})));
    ASSERT_TRUE(p0.send(batch(1, {stored_blocks(2, 2)})));
    ASSERT_TRUE(p1.send(batch(0, {stored_blocks(0, 2)}, "map")));
    ASSERT_TRUE(eventually([&] { return batches(0) == 2 && batches(1) == 1; }));
    EXPECT_EQ(overlap(), (std::vector<int>{4, 2}));

    // A removed block shortens replica 0's prefix.
    ASSERT_TRUE(p0.send(batch(2, {{{"tag", "BlockRemoved"},
                                   {"block_hashes", {static_cast<uint64_t>(keys[3].lo)}},
                                   {"medium", "GPU"}}})));
    ASSERT_TRUE(eventually([&] { return batches(0) == 3; }));
    EXPECT_EQ(overlap(), (std::vector<int>{3, 2}));

    // AllBlocksCleared empties it.
    ASSERT_TRUE(p0.send(batch(3, {{{"tag", "AllBlocksCleared"}}})));
    ASSERT_TRUE(eventually([&] { return batches(0) == 4; }));
    EXPECT_EQ(overlap(), (std::vector<int>{0, 2}));

    // A lost batch on replica 0 (seq 4 never published): the replay brings it back.
    ASSERT_TRUE(p0.send(dropped(batch(4, {stored_blocks(0, 3)}))));
    ASSERT_TRUE(p0.send(batch(5, {stored_blocks(3, 2)})));
    ASSERT_TRUE(eventually([&] { return sub.status(0).last_seq == 5u; }));
    EXPECT_EQ(overlap(), (std::vector<int>{5, 2}));
    EXPECT_EQ(sub.status(0).gaps, 1);
    EXPECT_GE(sub.status(0).replayed, 1);
    EXPECT_FALSE(sub.status(0).stale);

    // A lost batch on replica 1 (no replay): stale, cleared, then what came after the gap.
    ASSERT_TRUE(p1.send(dropped(batch(1, {stored_blocks(2, 2)}))));
    ASSERT_TRUE(p1.send(batch(2, {stored_blocks(0, 1)})));
    ASSERT_TRUE(eventually([&] { return sub.status(1).last_seq == 2u; }));
    EXPECT_TRUE(sub.status(1).stale);
    EXPECT_EQ(sub.status(1).gaps, 1);
    EXPECT_EQ(overlap(), (std::vector<int>{5, 1}));

    // Malformed messages: counted and dropped.
    ASSERT_TRUE(p1.send({{"frames_hex", {"", "00000000000000"}}}));          // 2 frames
    ASSERT_TRUE(p1.send({{"frames_hex", {"", "0000000000000003", "c1"}}}));  // not msgpack
    ASSERT_TRUE(eventually([&] { return sub.status(1).malformed == 2; }));
    EXPECT_EQ(overlap(), (std::vector<int>{5, 1}));

    // A restart of replica 1's publisher (sequence back to 0) clears it.
    ASSERT_TRUE(p1.send(batch(0, {stored_blocks(0, 3)})));
    ASSERT_TRUE(eventually([&] { return sub.status(1).restarts == 1; }));
    EXPECT_EQ(overlap(), (std::vector<int>{5, 3}));
    EXPECT_FALSE(sub.status(1).stale);

    sub.stop();
}

// vLLM binds ipc:// endpoints too: the subscriber follows a publisher on ipc://, replay included.
TEST(VllmSubscriber, FollowsAPublisherOnIpc) {
    if (!VllmEventSubscriber::available()) GTEST_SKIP() << "built without libzmq";
    char dir[] = "/tmp/kvshard_ipc_XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    const std::string prefix = std::string(dir) + "/engine";
    {
        test::PythonPublisher p(prefix);
        ASSERT_TRUE(p.ok());
        ASSERT_EQ(p.endpoint(), "ipc://" + prefix + ".pub");
        const VllmEngineSpec spec =
            parse_vllm_engine_spec("e=" + p.endpoint() + ",replay=" + p.replay_endpoint());
        KvIndex index(1);
        VllmEventSubscriber sub(index, {{0, spec.endpoint, spec.replay_endpoint, ""}});
        ASSERT_TRUE(p.wait_subscribed());
        VllmBlockHasher hasher(VllmHashScheme::kSha256Cbor);
        const auto keys = vllm_prompt_keys(hasher, vllm_none_hash(VllmHashScheme::kSha256Cbor, "0"),
                                           prompt_tokens(), kBlock);
        auto overlap = [&] {
            std::vector<int> out(1);
            sub.with_index(
                [&](const KvIndex& idx, const VllmEventIngest&) { idx.prefix_overlap(keys, out); });
            return out[0];
        };
        ASSERT_TRUE(p.send(batch(0, {stored_blocks(0, 2)})));
        ASSERT_TRUE(eventually([&] { return sub.status(0).batches == 1; }));
        EXPECT_EQ(overlap(), 2);
        // A lost batch comes back through the ipc:// replay socket.
        ASSERT_TRUE(p.send(dropped(batch(1, {stored_blocks(2, 2)}))));
        ASSERT_TRUE(p.send(batch(2, {stored_blocks(4, 1)})));
        ASSERT_TRUE(eventually([&] { return sub.status(0).last_seq == 2u; }));
        EXPECT_EQ(sub.status(0).gaps, 1);
        EXPECT_GE(sub.status(0).replayed, 1);
        EXPECT_FALSE(sub.status(0).stale);
        EXPECT_EQ(overlap(), 5);
    }
    std::remove((prefix + ".pub").c_str());
    std::remove((prefix + ".replay").c_str());
    rmdir(dir);
}

TEST(VllmSubscriber, RefusesAReplicaOutsideTheIndex) {
    if (!VllmEventSubscriber::available()) GTEST_SKIP() << "built without libzmq";
    KvIndex index(1);
    EXPECT_THROW(VllmEventSubscriber(index, {{3, "tcp://127.0.0.1:1", "", ""}}), Error);
    EXPECT_THROW(VllmEventSubscriber(index, {{0, "nonsense", "", ""}}), Error);
}

// kvshard's own BlockManager, published in vLLM's format and read back by the vLLM subscriber:
// the index holds the manager's registered blocks (ids = the low 64 bits of kvshard's hashes) and
// clear_cache() empties it.
TEST(VllmSubscriber, FollowsAKvshardBlockManagerPublishedInVllmFormat) {
    if (!VllmEventSubscriber::available()) GTEST_SKIP() << "built without libzmq";
    VllmPublisherOptions opt;
    opt.replay_endpoint = "tcp://127.0.0.1:0";
    VllmEventPublisher pub(opt);
    KvIndex index(1);
    VllmEventSubscriber sub(index, {{0, pub.endpoint(), pub.replay_endpoint(), ""}});
    ASSERT_TRUE(pub.wait_for_subscriber(std::chrono::seconds(20)));

    BlockManager m({64, 4, true});
    m.subscribe(pub.block_manager_callback());
    std::vector<int32_t> tokens(18);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(5 * i + 1);
    m.allocate(1, tokens);
    const auto hashes = hash_token_blocks(tokens, 4);
    ASSERT_EQ(hashes.size(), 4u);
    std::vector<BlockHash> keys;
    for (const auto& h : hashes) keys.push_back(vllm_index_key(h.lo));
    const int64_t after_alloc = static_cast<int64_t>(m.next_event_seq());
    ASSERT_GT(after_alloc, 0);
    ASSERT_TRUE(eventually([&] { return sub.status(0).batches == after_alloc; }));
    auto overlap = [&] {
        std::vector<int> out(1);
        sub.with_index(
            [&](const KvIndex& idx, const VllmEventIngest&) { idx.prefix_overlap(keys, out); });
        return out[0];
    };
    EXPECT_EQ(overlap(), 4);

    // Freed blocks stay cached (no event); clear_cache() publishes AllBlocksCleared.
    m.free(1);
    ASSERT_TRUE(m.clear_cache());
    ASSERT_TRUE(eventually(
        [&] { return sub.status(0).batches == static_cast<int64_t>(m.next_event_seq()); }));
    EXPECT_EQ(overlap(), 0);
    EXPECT_EQ(sub.status(0).gaps, 0);
    EXPECT_EQ(sub.status(0).malformed, 0);
}

// kvshard's publisher answers a replay request from a Python client written as a vLLM consumer
// (DEALER, start sequence as 8 bytes big-endian), and what it sends decodes with plain msgpack into
// vLLM's positional form.
TEST(VllmPublisher, ReplaysItsBufferToAVllmStyleClient) {
    if (!VllmEventPublisher::available()) GTEST_SKIP() << "built without libzmq";
    VllmPublisherOptions opt;
    opt.replay_endpoint = "tcp://127.0.0.1:0";
    opt.buffer_steps = 3;
    VllmEventPublisher pub(opt);
    for (uint64_t i = 0; i < 5; ++i) {
        VllmKvEvent e;
        e.kind = VllmEventKind::kBlockStored;
        e.block_hashes = {100 + i};
        e.token_ids = {1, 2};
        e.block_size = 2;
        e.medium = "GPU";
        EXPECT_EQ(pub.publish(VllmEventBatch{10.0 + static_cast<double>(i), {e}, std::nullopt}), i);
    }
    const std::string cmd = std::string(KVSHARD_TEST_PYTHON) + " " + test::publisher_script() +
                            " replay " + pub.replay_endpoint() + " 1";
    FILE* pipe = popen(cmd.c_str(), "r");
    ASSERT_TRUE(pipe);
    std::string out;
    char buf[4096];
    size_t n = 0;
    while ((n = fread(buf, 1, sizeof buf, pipe)) > 0) out.append(buf, n);
    ASSERT_EQ(pclose(pipe), 0) << out;
    const auto got = json::parse(out);
    // Only the last 3 batches are kept (buffer_steps), all of them >= 1.
    ASSERT_EQ(got.size(), 3u) << out;
    for (size_t k = 0; k < 3; ++k) {
        const uint64_t seq = 2 + k;
        EXPECT_EQ(got[k][0], seq);
        const auto& batch = got[k][1];  // [ts, events, data_parallel_rank]
        EXPECT_EQ(batch[0], 10.0 + static_cast<double>(seq));
        EXPECT_EQ(batch[2], 0);
        EXPECT_EQ(batch[1][0], json::parse(R"(["BlockStored", [)" + std::to_string(100 + seq) +
                                           R"(], null, [1, 2], 2, null, "GPU", null])"));
    }
}

}  // namespace
}  // namespace kvshard
