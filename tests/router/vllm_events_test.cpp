// vLLM's KV event codec (kvshard/cache/vllm_kv_events.h), tested by bytes that
// tests/router/vllm_event_publisher.py writes from vLLM's schema, and the ingestion state machine
// (kvshard/router/vllm_event_ingest.h) that feeds a KvIndex from decoded batches.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <random>

#include "kvshard/cache/vllm_hash.h"
#include "kvshard/cache/vllm_kv_events.h"
#include "kvshard/common/error.h"
#include "kvshard/router/kv_index.h"
#include "kvshard/router/vllm_event_ingest.h"
#include "python_helpers.h"

namespace kvshard {
namespace {

using nlohmann::json;

VllmKvEvent stored(std::vector<uint64_t> hashes, std::optional<uint64_t> parent,
                   std::vector<int64_t> tokens, int64_t bs) {
    VllmKvEvent e;
    e.kind = VllmEventKind::kBlockStored;
    e.block_hashes = std::move(hashes);
    e.parent_block_hash = parent;
    e.token_ids = std::move(tokens);
    e.block_size = bs;
    e.medium = "GPU";
    return e;
}

VllmKvEvent removed(std::vector<uint64_t> hashes) {
    VllmKvEvent e;
    e.kind = VllmEventKind::kBlockRemoved;
    e.block_hashes = std::move(hashes);
    e.medium = "GPU";
    return e;
}

VllmKvEvent cleared() {
    VllmKvEvent e;
    e.kind = VllmEventKind::kAllBlocksCleared;
    return e;
}

// tests/cache/vllm_hash_reference.py for one prompt hashed at vLLM's hash_block_size `bs`, with
// the ids a KV cache group of each of `group_block_sizes` publishes (its "groups"); null on
// failure.
json hash_block_size_reference(const std::vector<int32_t>& tokens, int bs,
                               const std::vector<int>& group_block_sizes) {
    char path[] = "/tmp/kvshard_vllm_hybrid_XXXXXX";
    const int fd = mkstemp(path);
    if (fd < 0) return nullptr;
    close(fd);
    const json cases = json::array({{{"scheme", "vllm-sha256"},
                                     {"seed", "0"},
                                     {"block_size", bs},
                                     {"tokens", tokens},
                                     {"group_block_sizes", group_block_sizes}}});
    std::ofstream(path) << cases.dump();
    const std::string cmd = std::string(KVSHARD_TEST_PYTHON) + " " + KVSHARD_TEST_SOURCE_DIR +
                            "/cache/vllm_hash_reference.py " + path;
    const test::CliResult ran = test::run_command(cmd);
    std::remove(path);
    if (ran.status != 0) {
        ADD_FAILURE() << "the reference script failed: " << cmd;
        return nullptr;
    }
    return json::parse(ran.out)[0];
}

std::vector<uint64_t> ids_of(const json& a) { return a.get<std::vector<uint64_t>>(); }

struct CodecCase {
    json spec;                // for the Python encoder
    VllmEventBatch expected;  // what it must decode to
    bool byte_exact;          // kvshard's encoder must write the same bytes
    VllmWireForm form;
};

std::vector<CodecCase> codec_cases() {
    std::vector<CodecCase> cases;
    const uint64_t big = 0xfedcba9876543210ull;  // a uint64 over INT64_MAX
    for (const char* form : {"positional", "map"}) {
        const VllmWireForm f =
            std::string(form) == "map" ? VllmWireForm::kMap : VllmWireForm::kPositional;
        {  // Every event kind, every optional field, hashes as ints.
            VllmEventBatch b;
            b.ts = 1733100000.25;
            b.data_parallel_rank = 3;
            auto s = stored({1, 300, big}, 77, {1, 2, 3, 4, 5, 6}, 2);
            s.lora_id = 5;
            s.lora_name = "sql";
            b.events.push_back(s);
            auto s2 = stored({9}, std::nullopt, {7, 8}, 2);
            s2.group_idx = 1;
            b.events.push_back(s2);
            auto r = removed({300, big});
            r.group_idx = 0;
            b.events.push_back(r);
            b.events.push_back(removed({1}));
            b.events.push_back(cleared());
            json spec = {{"ts", b.ts},
                         {"dp", 3},
                         {"form", form},
                         {"events",
                          {{{"tag", "BlockStored"},
                            {"block_hashes", {1, 300, big}},
                            {"parent_block_hash", 77},
                            {"token_ids", {1, 2, 3, 4, 5, 6}},
                            {"block_size", 2},
                            {"lora_id", 5},
                            {"medium", "GPU"},
                            {"lora_name", "sql"}},
                           {{"tag", "BlockStored"},
                            {"block_hashes", {9}},
                            {"parent_block_hash", nullptr},
                            {"token_ids", {7, 8}},
                            {"block_size", 2},
                            {"lora_id", nullptr},
                            {"medium", "GPU"},
                            {"lora_name", nullptr},
                            {"group_idx", 1}},
                           {{"tag", "BlockRemoved"},
                            {"block_hashes", {300, big}},
                            {"medium", "GPU"},
                            {"group_idx", 0}},
                           {{"tag", "BlockRemoved"}, {"block_hashes", {1}}, {"medium", "GPU"}},
                           {{"tag", "AllBlocksCleared"}}}}};
            cases.push_back({spec, b, true, f});
        }
        {  // A hybrid model's groups: group_idx with the newest revision's kv_cache_spec_* fields
           // (a kind alone, then a kind and its window; trailing defaults omitted).
            VllmEventBatch b;
            b.ts = 4.0;
            auto full = stored({11, 12}, std::nullopt, {1, 2, 3, 4}, 2);
            full.group_idx = 0;
            full.kv_cache_spec_kind = "full_attention";
            auto swa = stored({11, 12}, std::nullopt, {1, 2, 3, 4}, 2);
            swa.group_idx = 1;
            swa.kv_cache_spec_kind = "sliding_window";
            swa.kv_cache_spec_sliding_window = 4096;
            auto gone = removed({11});
            gone.group_idx = 1;
            b.events = {full, swa, gone};
            json spec = {{"ts", 4.0},
                         {"form", form},
                         {"events",
                          {{{"tag", "BlockStored"},
                            {"block_hashes", {11, 12}},
                            {"parent_block_hash", nullptr},
                            {"token_ids", {1, 2, 3, 4}},
                            {"block_size", 2},
                            {"lora_id", nullptr},
                            {"medium", "GPU"},
                            {"lora_name", nullptr},
                            {"group_idx", 0},
                            {"kv_cache_spec_kind", "full_attention"}},
                           {{"tag", "BlockStored"},
                            {"block_hashes", {11, 12}},
                            {"parent_block_hash", nullptr},
                            {"token_ids", {1, 2, 3, 4}},
                            {"block_size", 2},
                            {"lora_id", nullptr},
                            {"medium", "GPU"},
                            {"lora_name", nullptr},
                            {"group_idx", 1},
                            {"kv_cache_spec_kind", "sliding_window"},
                            {"kv_cache_spec_sliding_window", 4096}},
                           {{"tag", "BlockRemoved"},
                            {"block_hashes", {11}},
                            {"medium", "GPU"},
                            {"group_idx", 1}}}}};
            cases.push_back({spec, b, true, f});
        }
        {  // Hashes as bytes (the raw digest): the id is the last 8 bytes, big-endian; extra
           // fields of newer revisions (extra_keys, kv_cache_spec_kind) are accepted.
            VllmEventBatch b;
            b.ts = 2.0;
            auto s = stored({0x2233445566778899ull, 0x0102ull}, 0x1112131415161718ull, {5, 6}, 1);
            s.hashes_as_bytes = true;
            s.medium = "CPU";
            s.kv_cache_spec_kind = "full_attention";
            b.events.push_back(s);
            json spec = {
                {"ts", 2.0},
                {"form", form},
                {"events",
                 {{{"tag", "BlockStored"},
                   {"block_hashes", {{{"hex", "00112233445566778899"}}, {{"hex", "0102"}}}},
                   {"parent_block_hash", {{"hex", std::string(48, 'a') + "1112131415161718"}}},
                   {"token_ids", {5, 6}},
                   {"block_size", 1},
                   {"lora_id", nullptr},
                   {"medium", "CPU"},
                   {"lora_name", nullptr},
                   {"extra_keys", {{"lora-x"}, nullptr}},
                   {"kv_cache_spec_kind", "full_attention"}}}}};
            cases.push_back({spec, b, false, f});
        }
    }
    {  // An early revision: BlockStored with 4 fields (no lora_id, no medium), BlockRemoved with
       // only its hashes, and a batch without data_parallel_rank.
        VllmEventBatch b;
        b.ts = 3.5;
        auto s = stored({4, 5}, std::nullopt, {1, 2}, 1);
        s.medium.reset();
        b.events.push_back(s);
        auto r = removed({4});
        r.medium.reset();
        b.events.push_back(r);
        json spec = {{"ts", 3.5},
                     {"form", "positional"},
                     {"events",
                      {{{"tag", "BlockStored"},
                        {"_fields", 4},
                        {"block_hashes", {4, 5}},
                        {"parent_block_hash", nullptr},
                        {"token_ids", {1, 2}},
                        {"block_size", 1},
                        {"lora_id", nullptr},
                        {"medium", nullptr},
                        {"lora_name", nullptr}},
                       {{"tag", "BlockRemoved"},
                        {"_fields", 1},
                        {"block_hashes", {4}},
                        {"medium", nullptr}}}}};
        cases.push_back({spec, b, false, VllmWireForm::kPositional});
    }
    return cases;
}

TEST(VllmEvents, DecodesWhatTheVllmSchemaEncodes) {
    const auto cases = codec_cases();
    json specs = json::array();
    for (const auto& c : cases) specs.push_back(c.spec);
    const json hex = test::python_encode(specs);
    ASSERT_TRUE(hex.is_array());
    ASSERT_EQ(hex.size(), cases.size());
    for (size_t i = 0; i < cases.size(); ++i) {
        SCOPED_TRACE("case " + std::to_string(i) + ": " + cases[i].spec.dump().substr(0, 200));
        const auto bytes = test::from_hex(hex[i].get<std::string>());
        const auto r = decode_vllm_event_batch(bytes);
        ASSERT_TRUE(r.batch) << r.error;
        EXPECT_EQ(*r.batch, cases[i].expected);
        if (cases[i].byte_exact) {
            EXPECT_EQ(encode_vllm_event_batch(cases[i].expected, cases[i].form), bytes)
                << "kvshard's encoder writes other bytes than vLLM's schema gives";
        }
        // Round trip through kvshard's encoder in both forms (bytes hashes come back as ints).
        for (auto f : {VllmWireForm::kPositional, VllmWireForm::kMap}) {
            auto want = cases[i].expected;
            for (auto& e : want.events) e.hashes_as_bytes = false;
            const auto again = decode_vllm_event_batch(encode_vllm_event_batch(want, f));
            ASSERT_TRUE(again.batch) << again.error;
            EXPECT_EQ(*again.batch, want);
        }
    }
}

TEST(VllmEvents, MalformedPayloadsAreErrorsNeverCrashes) {
    VllmEventBatch b;
    b.ts = 1.0;
    b.events = {stored({1, 2, 3}, std::nullopt, {1, 2, 3}, 1), removed({2}), cleared()};
    const auto good = encode_vllm_event_batch(b);
    ASSERT_TRUE(decode_vllm_event_batch(good).batch);
    // Every strict prefix is incomplete msgpack.
    for (size_t n = 0; n < good.size(); ++n) {
        const auto r = decode_vllm_event_batch(std::span<const uint8_t>(good.data(), n));
        EXPECT_FALSE(r.batch) << "prefix of " << n << " bytes";
        EXPECT_FALSE(r.error.empty());
    }
    auto with_trailing = good;
    with_trailing.push_back(0xc0);
    EXPECT_NE(decode_vllm_event_batch(with_trailing).error.find("trailing"), std::string::npos);

    const std::vector<std::pair<std::vector<uint8_t>, std::string>> bad = {
        {{0xc1}, "not msgpack"},                          // never-used byte
        {{0xdd, 0xff, 0xff, 0xff, 0xff}, "not msgpack"},  // array of 2^32-1, no items
        {{0xdf, 0x7f, 0xff, 0xff, 0xff}, "not msgpack"},  // map of 2^31-1
        {{0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x91, 0xa3, 'F', 'o', 'o'},
         "unknown event tag"},
        {{0x92, 0xa1, 'x', 0x90}, "ts must be"},
        {{0x91, 0x00}, "EventBatch array has 1"},
        {{0x92, 0x00, 0x91, 0x90}, "event array is empty"},
        {{0x92, 0x00, 0x91, 0x92, 0xab, 'B', 'l', 'o', 'c', 'k', 'S', 't', 'o', 'r', 'e', 'd',
          0x90},
         "needs at least 4"},
        {{0x92, 0x00, 0x91, 0x92, 0xac, 'B', 'l', 'o',  'c',  'k',
          'R',  'e',  'm',  'o',  'v',  'e', 'd', 0x91, 0xa1, 'x'},
         "must be an int or bytes"},
        {{0x92, 0x00, 0x91, 0x81, 0xa1, 'a', 0x00}, "no \"type\""},
        {{0x2a}, "EventBatch must be"},
    };
    for (const auto& [bytes, msg] : bad) {
        const auto r = decode_vllm_event_batch(bytes);
        EXPECT_FALSE(r.batch);
        EXPECT_NE(r.error.find(msg), std::string::npos) << "got: " << r.error;
    }
    // Nesting deeper than the limit.
    std::vector<uint8_t> deep(100, 0x91);
    deep.push_back(0x00);
    EXPECT_FALSE(decode_vllm_event_batch(deep).batch);

    // Random mutations of a good payload: decoded or refused, never a crash.
    std::mt19937 rng(7);
    int refused = 0;
    for (int i = 0; i < 3000; ++i) {
        auto m = good;
        const int flips = 1 + static_cast<int>(rng() % 4);
        for (int k = 0; k < flips; ++k) m[rng() % m.size()] = static_cast<uint8_t>(rng());
        const auto r = decode_vllm_event_batch(m);
        if (!r.batch) {
            ++refused;
            EXPECT_FALSE(r.error.empty());
        }
    }
    EXPECT_GT(refused, 0);
}

// vLLM revisions whose BlockHashListWithBlockSize concatenated the hash_block_size digests of a
// larger group's block publish, with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0, that concatenation
// (here 2 x 32 bytes of sha256): its id is its last 8 bytes, the same as the newer revisions' (the
// last digest alone) and as the int the default publishes. A 64-byte hash used to be refused,
// losing the whole batch.
TEST(VllmEvents, ConcatenatedDigestsOfALargerGroupsBlockDecodeToItsLastDigestsId) {
    std::vector<int32_t> tokens(16);
    for (int i = 0; i < 16; ++i) tokens[static_cast<size_t>(i)] = 1000 + i;
    const json ref = hash_block_size_reference(tokens, 4, {8});
    ASSERT_TRUE(ref.is_object());
    const json& g = ref["groups"][0];
    ASSERT_EQ(g["concat_hex"].size(), 2u);
    ASSERT_EQ(g["concat_hex"][0].get<std::string>().size(), 128u);
    EXPECT_EQ(ids_of(g["concat_ids"]), ids_of(g["select_ids"]));
    json hashes = json::array();
    for (const auto& h : g["concat_hex"]) hashes.push_back({{"hex", h}});
    const json spec = json::array({{{"ts", 1.0},
                                    {"form", "positional"},
                                    {"events",
                                     {{{"tag", "BlockStored"},
                                       {"block_hashes", hashes},
                                       {"parent_block_hash", nullptr},
                                       {"token_ids", tokens},
                                       {"block_size", 8},
                                       {"lora_id", nullptr},
                                       {"medium", "GPU"},
                                       {"lora_name", nullptr},
                                       {"group_idx", 1}}}}}});
    const json hex = test::python_encode(spec);
    ASSERT_TRUE(hex.is_array());
    const auto r = decode_vllm_event_batch(test::from_hex(hex[0].get<std::string>()));
    ASSERT_TRUE(r.batch) << r.error;
    ASSERT_EQ(r.batch->events.size(), 1u);
    EXPECT_EQ(r.batch->events[0].block_hashes, ids_of(g["select_ids"]));
    EXPECT_TRUE(r.batch->events[0].hashes_as_bytes);
    EXPECT_EQ(r.batch->events[0].group_idx, 1);
}

TEST(VllmEvents, SequenceFrames) {
    EXPECT_EQ(decode_vllm_seq(encode_vllm_seq(0x0102030405060708ull)), 0x0102030405060708ull);
    const std::vector<uint8_t> five = {0, 0, 0, 0, 0, 0, 0, 5};
    EXPECT_EQ(decode_vllm_seq(five), 5u);
    EXPECT_EQ(decode_vllm_seq(std::vector<uint8_t>(8, 0xff)), UINT64_MAX);  // replay end (-1)
    EXPECT_FALSE(decode_vllm_seq(std::vector<uint8_t>(7, 0)));
    EXPECT_FALSE(decode_vllm_seq(std::vector<uint8_t>(9, 0)));
}

TEST(VllmEvents, KvshardBlockManagerEventsInVllmTerms) {
    KvEvent e;
    e.kind = KvEventKind::kBlockStored;
    e.block_hashes = {BlockHash{11, 99}, BlockHash{12, 98}};
    e.parent_hash = BlockHash{10, 97};
    e.block_size = 16;
    const auto v = to_vllm_event(e);
    EXPECT_EQ(v.block_hashes, (std::vector<uint64_t>{11, 12}));
    EXPECT_EQ(v.parent_block_hash, 10u);
    EXPECT_EQ(v.block_size, 16);
    EXPECT_EQ(v.medium, "GPU");
    VllmEventBatch b{5.0, {v}, 0};
    const auto r = decode_vllm_event_batch(encode_vllm_event_batch(b));
    ASSERT_TRUE(r.batch);
    EXPECT_EQ(r.batch->events[0], v);
}

// --- ingestion -----------------------------------------------------------------------------

struct Feed {
    KvIndex index{2};
    VllmEventIngest ingest{index};
    VllmEventIngest::Result send(int replica, uint64_t seq, std::vector<VllmKvEvent> events) {
        const auto s = encode_vllm_seq(seq);
        const auto p = encode_vllm_event_batch(VllmEventBatch{1.0, std::move(events), replica});
        const std::vector<uint8_t> topic;
        const std::span<const uint8_t> frames[3] = {topic, s, p};
        return ingest.on_message(replica, frames);
    }
    int overlap(int replica, const std::vector<uint64_t>& ids) {
        std::vector<BlockHash> keys;
        for (auto id : ids) keys.push_back(vllm_index_key(id));
        std::vector<int> out(2);
        index.prefix_overlap(keys, out);
        return out[static_cast<size_t>(replica)];
    }
};

using Outcome = VllmEventIngest::Outcome;

// An engine at block 24 against a router at 16: its blocks' hashes cover 24 tokens each and could
// never match a route hashed at 16, so they are counted and kept out of the index. A block of 32
// (a multiple) from a replica that has stored blocks of 16 is a hybrid group with larger blocks
// (vLLM's hash_block_size): indexed, at scale 2; before any block of 16 it is an engine at 32.
TEST(VllmIngest, BlockStoredOfAnotherBlockSizeIsCountedNotIndexed) {
    KvIndex index(2);
    VllmEventIngest ingest(index, VllmEventIngest::kDefaultMaxBlocksPerReplica, 16);
    auto send = [&](int replica, uint64_t seq, std::vector<VllmKvEvent> events) {
        const auto s = encode_vllm_seq(seq);
        const auto p = encode_vllm_event_batch(VllmEventBatch{1.0, std::move(events), replica});
        return ingest.on_batch(replica, s, p).outcome;
    };
    EXPECT_EQ(send(0, 0,
                   {stored({1, 2}, std::nullopt, {}, 24), stored({7}, std::nullopt, {}, 16),
                    stored({3}, std::nullopt, {}, 8)}),
              Outcome::kApplied);
    EXPECT_EQ(send(1, 0, {stored({8}, std::nullopt, {}, 32), stored({1, 2}, std::nullopt, {}, 16)}),
              Outcome::kApplied);
    EXPECT_FALSE(index.contains(1, vllm_index_key(8)));
    EXPECT_EQ(ingest.status(1).block_size_mismatch, 1);
    EXPECT_EQ(index.num_blocks(0), 1);
    EXPECT_FALSE(index.contains(0, vllm_index_key(1)));
    EXPECT_FALSE(index.contains(0, vllm_index_key(3)));
    EXPECT_TRUE(index.contains(0, vllm_index_key(7)));
    EXPECT_EQ(index.num_blocks(1), 2);
    EXPECT_EQ(ingest.status(0).block_size_mismatch, 2);
    EXPECT_EQ(ingest.status(0).last_event_block_size, 8);
    EXPECT_EQ(ingest.status(0).events, 1);
    auto g1 = stored({5, 6}, std::nullopt, {}, 32);
    g1.group_idx = 1;
    EXPECT_EQ(send(1, 1, {g1}), Outcome::kApplied);
    EXPECT_TRUE(index.contains(1, vllm_index_key(5), 1));
    EXPECT_EQ(index.group_block_scale(1, 1), 2);
    EXPECT_EQ(index.group_block_scale(1, 0), 1);
    EXPECT_EQ(ingest.status(1).larger_block_events, 1);
    EXPECT_EQ(ingest.status(1).block_size_mismatch, 1);
    // Unchecked (0) by default: any block size is indexed.
    KvIndex any(1);
    VllmEventIngest unchecked(any);
    const auto s = encode_vllm_seq(0);
    const auto p =
        encode_vllm_event_batch(VllmEventBatch{1.0, {stored({1, 2}, std::nullopt, {}, 32)}, 0});
    EXPECT_EQ(unchecked.on_batch(0, s, p).outcome, Outcome::kApplied);
    EXPECT_EQ(any.num_blocks(0), 2);
    EXPECT_THROW(VllmEventIngest(any, 4, -1), Error);
}

TEST(VllmIngest, AppliesInOrderAndDetectsGapsAndRestarts) {
    Feed f;
    const std::vector<uint64_t> req = {1, 2, 3, 4};
    EXPECT_EQ(f.send(0, 10, {stored({1, 2, 3}, std::nullopt, {}, 16)}).outcome, Outcome::kApplied);
    EXPECT_EQ(f.overlap(0, req), 3);
    EXPECT_EQ(f.send(0, 11, {removed({3})}).outcome, Outcome::kApplied);
    EXPECT_EQ(f.overlap(0, req), 2);
    EXPECT_EQ(f.overlap(1, req), 0);
    // A gap: reported, nothing applied.
    const auto g = f.send(0, 14, {stored({3, 4}, 2, {}, 16)});
    EXPECT_EQ(g.outcome, Outcome::kGap);
    EXPECT_EQ(g.missing_from, 12u);
    EXPECT_EQ(f.overlap(0, req), 2);
    EXPECT_EQ(f.ingest.status(0).gaps, 1);
    // No replay: stale and cleared, then the batch that showed the gap.
    f.ingest.mark_stale(0);
    EXPECT_TRUE(f.ingest.status(0).stale);
    EXPECT_EQ(f.overlap(0, req), 0);
    EXPECT_EQ(f.send(0, 14, {stored({1, 2}, std::nullopt, {}, 16)}).outcome, Outcome::kApplied);
    EXPECT_EQ(f.overlap(0, req), 2);
    EXPECT_TRUE(f.ingest.status(0).stale);
    // AllBlocksCleared makes it exact again.
    EXPECT_EQ(f.send(0, 15, {cleared()}).outcome, Outcome::kApplied);
    EXPECT_FALSE(f.ingest.status(0).stale);
    EXPECT_EQ(f.overlap(0, req), 0);
    // A restart (sequence back to 0) clears, then applies.
    EXPECT_EQ(f.send(0, 16, {stored({1, 2, 3}, std::nullopt, {}, 16)}).outcome, Outcome::kApplied);
    EXPECT_EQ(f.send(0, 0, {stored({1}, std::nullopt, {}, 16)}).outcome, Outcome::kRestarted);
    EXPECT_EQ(f.overlap(0, req), 1);
    EXPECT_EQ(f.ingest.status(0).restarts, 1);
    EXPECT_EQ(f.ingest.status(0).last_seq, 0u);
}

TEST(VllmIngest, MalformedIsCountedAndDoesNotAdvance) {
    Feed f;
    f.send(1, 0, {stored({1}, std::nullopt, {}, 16)});
    const std::vector<uint8_t> topic, seq = encode_vllm_seq(1), junk = {0xc1};
    const std::span<const uint8_t> bad[3] = {topic, seq, junk};
    EXPECT_EQ(f.ingest.on_message(1, bad).outcome, Outcome::kMalformed);
    const std::span<const uint8_t> two[2] = {topic, seq};
    EXPECT_EQ(f.ingest.on_message(1, two).outcome, Outcome::kMalformed);
    const std::vector<uint8_t> short_seq = {1, 2, 3};
    const auto p = encode_vllm_event_batch(VllmEventBatch{1.0, {cleared()}, 1});
    const std::span<const uint8_t> bad_seq[3] = {topic, short_seq, p};
    EXPECT_EQ(f.ingest.on_message(1, bad_seq).outcome, Outcome::kMalformed);
    EXPECT_EQ(f.ingest.status(1).malformed, 3);
    EXPECT_EQ(f.ingest.status(1).last_seq, 0u);
    // seq 1 is still the next one expected.
    EXPECT_EQ(f.send(1, 1, {stored({2}, 1, {}, 16)}).outcome, Outcome::kApplied);
    EXPECT_EQ(f.overlap(1, {1, 2}), 2);
    // A malformed payload with an old sequence number is no restart: nothing is cleared.
    const auto old_seq = encode_vllm_seq(0);
    const std::span<const uint8_t> stale_garbage[3] = {topic, old_seq, junk};
    EXPECT_EQ(f.ingest.on_message(1, stale_garbage).outcome, Outcome::kMalformed);
    EXPECT_EQ(f.ingest.status(1).restarts, 0);
    EXPECT_EQ(f.overlap(1, {1, 2}), 2);
}

TEST(VllmIngest, OtherTiersStayOutOfTheIndex) {
    Feed f;
    auto cpu = stored({1, 2}, std::nullopt, {}, 16);
    cpu.medium = "CPU";
    auto unnamed = stored({1}, std::nullopt, {}, 16);
    unnamed.medium.reset();
    auto far_group = stored({1, 2}, std::nullopt, {}, 16);
    far_group.group_idx = KvIndex::kMaxGroups;
    f.send(0, 0, {cpu, unnamed, far_group});
    EXPECT_EQ(f.overlap(0, {1, 2}), 1);
    EXPECT_EQ(f.ingest.status(0).ignored, 2);
    EXPECT_EQ(f.ingest.status(0).events, 1);
}

// A hybrid model (vLLM's group_idx): each group stores and evicts on its own, and a prefix counts
// only as far as every group serves it.
TEST(VllmIngest, HybridGroupsEachBoundTheOverlap) {
    Feed f;
    auto g0 = stored({1, 2, 3, 4}, std::nullopt, {}, 16);
    g0.group_idx = 0;
    auto g1 = stored({1, 2}, std::nullopt, {}, 16);  // no kind: the full-attention rule
    g1.group_idx = 1;
    f.send(0, 0, {g0, g1});
    EXPECT_EQ(f.overlap(0, {1, 2, 3, 4}), 2);
    EXPECT_EQ(f.index.num_blocks(0, 0), 4);
    EXPECT_EQ(f.index.num_blocks(0, 1), 2);
    EXPECT_EQ(f.index.num_blocks(0), 6);
    auto g1_more = stored({3, 4}, 2, {}, 16);
    g1_more.group_idx = 1;
    f.send(0, 1, {g1_more});
    EXPECT_EQ(f.overlap(0, {1, 2, 3, 4}), 4);
    auto g1_gone = removed({3});
    g1_gone.group_idx = 1;
    f.send(0, 2, {g1_gone});  // only group 1 lost block 3
    EXPECT_EQ(f.overlap(0, {1, 2, 3, 4}), 2);
    EXPECT_TRUE(f.index.contains(0, vllm_index_key(3), 0));
    EXPECT_FALSE(f.index.contains(0, vllm_index_key(3), 1));
    // A sliding-window group (33 tokens, 16-token blocks: the last 2 blocks before the hit)
    // serves 4 blocks with blocks 2 and 3 (indices) alone.
    auto swa = stored({3, 4}, 2, {}, 16);
    swa.group_idx = 1;
    swa.kv_cache_spec_kind = "sliding_window";
    swa.kv_cache_spec_sliding_window = 33;
    auto swa_gone = removed({1, 2});
    swa_gone.group_idx = 1;
    f.send(0, 3, {swa, swa_gone});
    EXPECT_EQ(f.overlap(0, {1, 2, 3, 4}), 4);
    // 3 blocks: the window before 3 is ids 2 and 3; id 2 is gone, and so is id 1 (no shorter
    // run from block 0 either).
    EXPECT_EQ(f.overlap(0, {1, 2, 3}), 0);
    // Replica 1 published group 0 only: the walk of group 0 alone.
    f.send(1, 0, {stored({1, 2, 3}, std::nullopt, {}, 16)});
    EXPECT_EQ(f.overlap(1, {1, 2, 3, 4}), 3);
    // Then a Mamba group with the state after block id 2 only: the hit ends there.
    auto mamba = stored({2}, 1, {}, 16);
    mamba.group_idx = 2;
    mamba.kv_cache_spec_kind = "mamba";
    f.send(1, 1, {mamba});
    EXPECT_EQ(f.overlap(1, {1, 2, 3, 4}), 2);
    // AllBlocksCleared empties every group.
    f.send(0, 4, {cleared()});
    EXPECT_EQ(f.overlap(0, {1, 2, 3, 4}), 0);
    EXPECT_EQ(f.index.num_blocks(0), 0);
    EXPECT_EQ(f.index.groups(0), 0u);
}

// Groups with different block sizes (vLLM hashes a request at hash_block_size H, the router's
// block size; a group of k * H tokens per block publishes the H-granular hash at each block's
// end). Ids from tests/cache/vllm_hash_reference.py. Full attention at H = 4 and a group at 8:
// the route, hashed at 4, matches both, and hits are whole 8-token blocks (vLLM aligns them to
// the LCM of the groups' block sizes). These events used to be dropped as another block size, so
// the overlap ignored the larger group: 6 (or 5) blocks where vLLM hits 4.
TEST(VllmIngest, AGroupWithLargerBlocksMatchesAtTheRoutersBlockSize) {
    std::vector<int32_t> tokens(26);
    for (int i = 0; i < 26; ++i) tokens[static_cast<size_t>(i)] = 7 * i + 3;
    const json ref = hash_block_size_reference(tokens, 4, {8});
    ASSERT_TRUE(ref.is_object());
    std::vector<uint64_t> fine;
    for (const auto& b : ref["blocks"]) fine.push_back(b["id"].get<uint64_t>());
    ASSERT_EQ(fine.size(), 6u);
    const auto coarse = ids_of(ref["groups"][0]["select_ids"]);
    ASSERT_EQ(coarse.size(), 3u);
    // The route's keys, as the router hashes the prompt: vLLM's hashes at 4 tokens per block.
    VllmBlockHasher hasher(VllmHashScheme::kSha256Pickle);
    const auto keys =
        vllm_prompt_keys(hasher, vllm_none_hash(VllmHashScheme::kSha256Pickle, "0"), tokens, 4);
    ASSERT_EQ(keys.size(), 6u);
    for (size_t i = 0; i < 6; ++i) EXPECT_EQ(keys[i], vllm_index_key(fine[i]));

    KvIndex index(2);
    VllmEventIngest ingest(index, VllmEventIngest::kDefaultMaxBlocksPerReplica, 4);
    uint64_t seq[2] = {0, 0};
    auto send = [&](int replica, std::vector<VllmKvEvent> events) {
        const auto s = encode_vllm_seq(seq[replica]++);
        const auto p = encode_vllm_event_batch(VllmEventBatch{1.0, std::move(events), replica});
        return ingest.on_batch(replica, s, p).outcome;
    };
    auto at = [](VllmKvEvent e, int group, const char* kind = nullptr) {
        e.group_idx = group;
        if (kind) e.kv_cache_spec_kind = kind;
        return e;
    };
    auto overlap = [&](int replica) {
        std::vector<int> out(2);
        index.prefix_overlap(keys, out);
        return out[static_cast<size_t>(replica)];
    };
    // Replica 0: all 6 blocks of group 0, all 3 of group 1.
    EXPECT_EQ(send(0, {at(stored(fine, std::nullopt, {}, 4), 0),
                       at(stored(coarse, std::nullopt, {}, 8), 1)}),
              Outcome::kApplied);
    EXPECT_EQ(overlap(0), 6);
    EXPECT_EQ(ingest.status(0).block_size_mismatch, 0);
    EXPECT_EQ(ingest.status(0).larger_block_events, 1);
    // Group 1 loses its last block: 4 blocks of 4 tokens (2 of 8).
    send(0, {at(removed({coarse[2]}), 1)});
    EXPECT_EQ(overlap(0), 4);
    // Replica 1: group 0 holds 5 blocks, group 1 all 3: the hit is cut to a whole 8-token block.
    send(1, {at(stored({fine.begin(), fine.begin() + 5}, std::nullopt, {}, 4), 0),
             at(stored(coarse, std::nullopt, {}, 8), 1)});
    EXPECT_EQ(overlap(1), 4);
    // A Mamba group at 8 tokens per block holding only the state at the end of its block 1
    // (tokens 0-15), instead of group 1: the hit is 16 tokens.
    send(1, {cleared(), at(stored(fine, std::nullopt, {}, 4), 0),
             at(stored({coarse[1]}, coarse[0], {}, 8), 2, "mamba")});
    EXPECT_EQ(overlap(1), 4);
    // A sliding window of 9 tokens (cdiv(8, 8) = 1 block of 8 before the hit) holding its blocks
    // 1 and 2 (block 0 left the window): it serves 16 and 24 tokens.
    auto swa = at(stored({coarse[1], coarse[2]}, coarse[0], {}, 8), 3, "sliding_window");
    swa.kv_cache_spec_sliding_window = 9;
    send(1, {swa});
    EXPECT_EQ(overlap(1), 4);  // the Mamba group still ends it at 16
    send(1, {at(stored({coarse[2]}, coarse[1], {}, 8), 2, "mamba")});
    EXPECT_EQ(overlap(1), 6);
}

TEST(VllmIngest, GroupWindowRules) {
    EXPECT_EQ(vllm_group_window_blocks("sliding_window", 4096, 16), 256);  // cdiv(4095, 16)
    EXPECT_EQ(vllm_group_window_blocks("sliding_window", 4097, 16), 256);
    EXPECT_EQ(vllm_group_window_blocks("sliding_window", 4098, 16), 257);
    EXPECT_EQ(vllm_group_window_blocks("sliding_window_mla", 1, 16), 0);
    EXPECT_EQ(vllm_group_window_blocks("mamba", std::nullopt, 16), 1);
    EXPECT_EQ(vllm_group_window_blocks("sliding_window", std::nullopt, 16), std::nullopt);
    EXPECT_EQ(vllm_group_window_blocks("full_attention", std::nullopt, 16), std::nullopt);
    EXPECT_EQ(vllm_group_window_blocks("chunked_local_attention", 8192, 16), std::nullopt);
}

TEST(VllmIngest, TheIndexCapCountsEachGroupsBlocks) {
    KvIndex index(1);
    VllmEventIngest ingest(index, 3);
    auto g0 = stored({1, 2}, std::nullopt, {}, 16);
    g0.group_idx = 0;
    auto g1 = stored({1, 2}, std::nullopt, {}, 16);
    g1.group_idx = 1;
    const auto s = encode_vllm_seq(0);
    const auto p = encode_vllm_event_batch(VllmEventBatch{1.0, {g0, g1}, 0});
    ingest.on_batch(0, s, p);
    // Four (block, group) entries over a cap of 3: the oldest, group 0's block 1, is dropped.
    EXPECT_EQ(ingest.status(0).evicted, 1);
    EXPECT_FALSE(index.contains(0, vllm_index_key(1), 0));
    EXPECT_TRUE(index.contains(0, vllm_index_key(1), 1));
    EXPECT_EQ(index.num_blocks(0), 3);
}

TEST(VllmIngest, PromptKeysAreTheEventIdsOfVllmHashes) {
    VllmBlockHasher h(VllmHashScheme::kSha256Cbor);
    const auto root = vllm_none_hash(VllmHashScheme::kSha256Cbor, "0");
    const std::vector<int32_t> tokens = {1, 2, 3, 4, 5};
    const auto keys = vllm_prompt_keys(h, root, tokens, 2);
    const auto digests = h.hash_blocks(root, tokens, 2);
    ASSERT_EQ(keys.size(), 2u);
    EXPECT_EQ(keys[1], vllm_index_key(digests[1].event_id()));
}

TEST(VllmIngest, TheIndexCapDropsTheOldestStoredBlocks) {
    KvIndex index(1);
    VllmEventIngest ingest(index, 3);
    uint64_t seq = 0;
    auto send = [&](std::vector<VllmKvEvent> events) {
        const auto s = encode_vllm_seq(seq++);
        const auto p = encode_vllm_event_batch(VllmEventBatch{1.0, std::move(events), 0});
        ASSERT_EQ(ingest.on_batch(0, s, p).outcome, VllmEventIngest::Outcome::kApplied);
    };
    auto holds = [&](uint64_t id) { return index.contains(0, vllm_index_key(id)); };
    send({stored({1, 2, 3}, std::nullopt, {}, 16)});
    EXPECT_EQ(index.num_blocks(0), 3);
    // 1 is now the newest, and a second block of it: vLLM registers the same content again in
    // another block (BlockPool.cache_full_blocks), so the replica holds 4 blocks of 3 hashes.
    send({stored({1}, std::nullopt, {}, 16)});
    EXPECT_EQ(index.num_blocks(0), 4);
    send({stored({4}, 1, {}, 16)});  // 4 hashes, over the cap: 2 (the oldest) goes
    EXPECT_EQ(index.num_blocks(0), 4);
    EXPECT_FALSE(holds(2));
    EXPECT_TRUE(holds(1) && holds(3) && holds(4));
    send({removed({3})});
    send({stored({5, 6}, 4, {}, 16)});  // 1, 4, 5, 6: 1 goes, both its blocks
    EXPECT_FALSE(holds(1));
    EXPECT_EQ(index.num_blocks(0), 3);
    EXPECT_TRUE(holds(4) && holds(5) && holds(6));
    EXPECT_EQ(ingest.status(0).evicted, 2);
    send({cleared()});
    send({stored({7, 8, 9}, std::nullopt, {}, 16)});
    EXPECT_EQ(index.num_blocks(0), 3);
    EXPECT_EQ(ingest.status(0).evicted, 2);
    EXPECT_THROW(VllmEventIngest(index, 0), Error);
}

// Randomized: the cap against a naive LRU of hashes by latest store, through stores, re-stores
// (another copy of the hash: it is held until removed as often as stored; the cap forgets every
// copy) and removals in two groups; caps small enough that the store-order map is built mid-stream
// (the replica past half its cap) and large enough that it is built to compact the FIFO first.
TEST(VllmIngest, TheIndexCapMatchesANaiveLruUnderRandomEvents) {
    for (int64_t cap : {int64_t{40}, int64_t{100000}}) {
        SCOPED_TRACE("cap " + std::to_string(cap));
        std::mt19937_64 rng(static_cast<uint64_t>(cap));
        KvIndex index(1);
        VllmEventIngest ingest(index, cap);
        std::vector<std::pair<uint64_t, int>> lru;  // (id, group), oldest first
        std::map<std::pair<uint64_t, int>, int64_t> copies;
        auto find = [&](uint64_t id, int g) {
            return std::find(lru.begin(), lru.end(), std::make_pair(id, g));
        };
        int64_t evicted = 0;
        for (uint64_t seq = 0; seq < 6000; ++seq) {
            const int g = static_cast<int>(rng() % 2);
            std::vector<uint64_t> ids;
            for (int k = 0; k < 3; ++k) ids.push_back(1 + rng() % 120);
            VllmKvEvent e = rng() % 3 == 0 ? removed(ids) : stored(ids, std::nullopt, {}, 16);
            e.group_idx = g;
            for (uint64_t id : ids) {
                const auto it = find(id, g);
                if (e.kind == VllmEventKind::kBlockStored) {
                    if (it != lru.end()) lru.erase(it);
                    lru.emplace_back(id, g);
                    ++copies[{id, g}];
                } else if (it != lru.end() && --copies[{id, g}] == 0) {
                    lru.erase(it);
                    copies.erase({id, g});
                }
            }
            while (static_cast<int64_t>(lru.size()) > cap) {
                copies.erase(lru.front());
                lru.erase(lru.begin());
                ++evicted;
            }
            int64_t blocks = 0;
            for (const auto& [key, c] : copies) blocks += c;
            const auto s = encode_vllm_seq(seq);
            const auto p = encode_vllm_event_batch(VllmEventBatch{1.0, {e}, 0});
            ASSERT_EQ(ingest.on_batch(0, s, p).outcome, VllmEventIngest::Outcome::kApplied);
            ASSERT_EQ(index.num_blocks(0), blocks) << "seq " << seq;
            ASSERT_EQ(index.num_hashes(), static_cast<int64_t>(lru.size())) << "seq " << seq;
            for (const auto& [id, gg] : lru)
                ASSERT_TRUE(index.contains(0, vllm_index_key(id), gg)) << "seq " << seq;
            ASSERT_EQ(ingest.status(0).evicted, evicted) << "seq " << seq;
        }
    }
}

}  // namespace
}  // namespace kvshard
