// RouteService without sockets: an index fed through VllmEventIngest by encoded batches, routes,
// load accounting, the replica and metrics views, bad input.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <optional>
#include <random>

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
        // The service's default scheme: vLLM's default, sha256 over pickle.
        const VllmHashScheme scheme = RouteServiceConfig{}.scheme;
        VllmBlockHasher h(scheme);
        for (const auto& d : h.hash_blocks(vllm_none_hash(scheme, "0"), t, 4))
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

// vLLM hashes a request's LoRA adapter name into every block and its cache salt into the first:
// A router left on its defaults hashes as an engine left on its defaults: vLLM's
// prefix_caching_hash_algo "sha256" (pickle).
// vLLM recomputes the last prompt token (vllm/v1/core/kv_cache_manager.py,
// KVCacheManager.get_computed_blocks: max_cache_hit_length = request.num_tokens - 1): a prompt of
// exactly 5 blocks, all cached, hits 4; one token more and the 5 full blocks all hit.
TEST(RouteService, AFullyCachedPromptHitsAllButItsLastBlock) {
    Fixture f;
    f.store(1, 0, 5);
    auto svc = f.service();
    const std::vector<int64_t> five_blocks(f.prompt.begin(), f.prompt.begin() + 20);
    EXPECT_EQ(svc.route("", five_blocks).matched_blocks, (std::vector<int>{0, 4}));
    const std::vector<int64_t> plus_one(f.prompt.begin(), f.prompt.begin() + 21);
    EXPECT_EQ(svc.route("", plus_one).matched_blocks, (std::vector<int>{0, 5}));
    const std::vector<int64_t> one_block(f.prompt.begin(), f.prompt.begin() + 4);
    EXPECT_EQ(svc.route("", one_block).matched_blocks, (std::vector<int>{0, 0}));
    const std::string m = svc.metrics_text();
    EXPECT_NE(m.find("kvshard_router_hit_blocks_total 9\n"), std::string::npos) << m;
}

// With a group of 8-token blocks beside the 4-token one, vLLM's hit is a multiple of the
// scheduler block, lcm(4, 8) = 8 tokens, within num_tokens - 1: for 16 tokens fully cached, the
// 4-token group finds 15 // 4 = 3 blocks, aligned down to 2 (alignment_tokens = 8, FullAttention-
// Manager.find_longest_cache_hit in vllm/v1/core/single_type_kv_cache_manager.py); the 8-token
// group 15 // 8 = 1 block; the fixed point of HybridKVCacheCoordinator.find_longest_cache_hit
// (vllm/v1/core/kv_cache_coordinator.py) is 8 tokens = 2 router blocks. With 17 tokens: 16 = 4.
TEST(RouteService, TheCapMeetsTheAlignmentOfLargerBlockGroups) {
    const Fixture f;  // the prompt and its 4-token block ids
    KvIndex index(2);
    VllmEventIngest ingest(index, VllmEventIngest::kDefaultMaxBlocksPerReplica, 4);
    VllmKvEvent fine;
    fine.kind = VllmEventKind::kBlockStored;
    fine.block_hashes.assign(f.ids.begin(), f.ids.begin() + 4);
    fine.block_size = 4;
    // Group 1's 8-token blocks carry the 4-token hash at their end (BlockHashListWithBlockSize).
    VllmKvEvent coarse = fine;
    coarse.block_hashes = {f.ids[1], f.ids[3]};
    coarse.block_size = 8;
    coarse.group_idx = 1;
    const auto p = encode_vllm_event_batch(VllmEventBatch{0.0, {fine, coarse}, 1});
    ASSERT_EQ(ingest.on_batch(1, encode_vllm_seq(0), p).outcome,
              VllmEventIngest::Outcome::kApplied);
    ASSERT_EQ(index.group_block_scale(1, 1), 2);
    RouteServiceConfig c;
    c.replica_names = {"a", "b"};
    c.block_size = 4;
    c.hash_seed = "0";
    RouteService svc(c, [&](const auto& fn) { fn(index, &ingest); });
    auto prefix = [&](int n) {
        return std::vector<int64_t>(f.prompt.begin(), f.prompt.begin() + n);
    };
    EXPECT_EQ(svc.route("", prefix(16)).matched_blocks, (std::vector<int>{0, 2}));
    EXPECT_EQ(svc.route("", prefix(17)).matched_blocks, (std::vector<int>{0, 4}));
    EXPECT_EQ(svc.route("", prefix(21)).matched_blocks, (std::vector<int>{0, 4}));
    EXPECT_EQ(svc.route("", prefix(8)).matched_blocks, (std::vector<int>{0, 0}));
    EXPECT_EQ(svc.route("", prefix(9)).matched_blocks, (std::vector<int>{0, 2}));
    EXPECT_EQ(svc.route("", prefix(12)).matched_blocks, (std::vector<int>{0, 2}));
}

TEST(RouteService, DefaultsToVllmsDefaultHash) {
    EXPECT_EQ(RouteServiceConfig{}.scheme, VllmHashScheme::kSha256Pickle);
}

// blocks stored for a salted or a LoRA prompt match a route with the same keys only.
TEST(RouteService, HashesTheLoraNameAndTheCacheSaltAsVllmDoes) {
    Fixture f;
    const std::vector<int32_t> t(f.prompt.begin(), f.prompt.end());
    VllmBlockHasher h(RouteServiceConfig{}.scheme);
    const auto root = vllm_none_hash(RouteServiceConfig{}.scheme, "0");
    auto ids_of = [&](const VllmExtraKeys& keys) {
        std::vector<uint64_t> ids;
        for (const auto& d : h.hash_blocks(root, t, 4, keys)) ids.push_back(d.event_id());
        return ids;
    };
    f.ids = ids_of({.lora_name = "", .cache_salt = "salt1"});
    f.store(0, 0, 2);
    f.ids = ids_of({.lora_name = "adapterA", .cache_salt = ""});
    f.store(1, 0, 2);
    auto svc = f.service();
    EXPECT_EQ(svc.route("", f.prompt, {.lora_name = "", .cache_salt = "salt1"}).matched_blocks,
              (std::vector<int>{2, 0}));
    EXPECT_EQ(svc.route("", f.prompt, {.lora_name = "adapterA", .cache_salt = ""}).matched_blocks,
              (std::vector<int>{0, 2}));
    EXPECT_EQ(svc.route("", f.prompt).matched_blocks, (std::vector<int>{0, 0}));
    EXPECT_EQ(svc.route("", f.prompt, {.lora_name = "", .cache_salt = "salt2"}).matched_blocks,
              (std::vector<int>{0, 0}));
    EXPECT_EQ(svc.route("", f.prompt, {.lora_name = "adapterB", .cache_salt = ""}).matched_blocks,
              (std::vector<int>{0, 0}));
    // vLLM v0.10's sha256_cbor_64bit hashed lora_int_id, which a route does not carry: refused.
    RouteServiceConfig c64;
    c64.replica_names = {"a", "b"};
    c64.block_size = 4;
    c64.scheme = VllmHashScheme::kSha256Cbor64;
    RouteService svc64(c64, [&](const auto& fn) { fn(f.index, nullptr); });
    EXPECT_THROW(svc64.route("", f.prompt, {.lora_name = "adapterA", .cache_salt = ""}), Error);
    EXPECT_NO_THROW(svc64.route("", f.prompt, {.lora_name = "", .cache_salt = "s"}));
    // The salt enters block 0 only, so it changes every id of the chain; the LoRA name enters every
    // block.
    const auto salted = ids_of({.lora_name = "", .cache_salt = "salt1"});
    const auto plain = ids_of({});
    for (size_t i = 0; i < plain.size(); ++i) EXPECT_NE(salted[i], plain[i]) << i;
}

// The feed's counts of BlockStored events at another block size (not indexed) and at a multiple of
// it (a group with larger blocks, indexed) show in /replicas and /metrics.
TEST(RouteService, ShowsBlockSizeMismatches) {
    KvIndex index(2);
    VllmEventIngest ingest(index, VllmEventIngest::kDefaultMaxBlocksPerReplica, 4);
    VllmKvEvent e;
    e.kind = VllmEventKind::kBlockStored;
    e.block_hashes = {5, 6};
    e.block_size = 8;
    const auto s = encode_vllm_seq(0);
    const auto p = encode_vllm_event_batch(VllmEventBatch{0.0, {e}, 1});
    ASSERT_EQ(ingest.on_batch(1, s, p).outcome, VllmEventIngest::Outcome::kApplied);
    // Replica a: a block of 4, then a group of 8-token blocks (a hybrid group with larger blocks).
    VllmKvEvent fine = e, coarse = e;
    fine.block_size = 4;
    coarse.group_idx = 1;
    const auto p0 = encode_vllm_event_batch(VllmEventBatch{0.0, {fine, coarse}, 0});
    ASSERT_EQ(ingest.on_batch(0, s, p0).outcome, VllmEventIngest::Outcome::kApplied);
    RouteServiceConfig c;
    c.replica_names = {"a", "b"};
    c.block_size = 4;
    RouteService svc(c, [&](const auto& fn) { fn(index, &ingest); });
    const auto reps = nlohmann::json::parse(svc.replicas_json())["replicas"];
    EXPECT_EQ(reps[0]["block_size_mismatch"], 0);
    EXPECT_EQ(reps[1]["block_size_mismatch"], 1);
    EXPECT_EQ(reps[1]["index_blocks"], 0);
    EXPECT_EQ(reps[0]["larger_block_events"], 1);
    EXPECT_EQ(reps[1]["larger_block_events"], 0);
    EXPECT_EQ(reps[0]["index_blocks"], 4);
    const std::string m = svc.metrics_text();
    EXPECT_NE(m.find("kvshard_router_block_size_mismatch_total{replica=\"b\"} 1\n"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("kvshard_router_larger_block_events_total{replica=\"a\"} 1\n"),
              std::string::npos)
        << m;
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

// The /route body the simple way (nlohmann::json), for the one-pass reader to agree with.
std::optional<RouteRequestBody> reference_parse(const std::string& body) {
    nlohmann::json j = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object() || !j.contains("token_ids") ||
        !j["token_ids"].is_array())
        return std::nullopt;
    RouteRequestBody out;
    for (const auto& t : j["token_ids"]) {
        if (!t.is_number_integer()) return std::nullopt;
        if (t.is_number_unsigned() ? t.get<uint64_t>() > 2147483647u
                                   : (t.get<int64_t>() < 0 || t.get<int64_t>() > 2147483647))
            return std::nullopt;
        out.token_ids.push_back(static_cast<int32_t>(t.get<int64_t>()));
    }
    if (j.contains("request_id")) {
        if (!j["request_id"].is_string()) return std::nullopt;
        out.request_id = j["request_id"].get<std::string>();
    }
    for (const char* key : {"lora_name", "cache_salt"}) {
        if (!j.contains(key) || j[key].is_null()) continue;
        if (!j[key].is_string() || j[key].get<std::string>().empty()) return std::nullopt;
        (std::string(key) == "lora_name" ? out.extra.lora_name : out.extra.cache_salt) =
            j[key].get<std::string>();
    }
    return out;
}

TEST(RouteService, RouteBodiesParseAsAFullJsonParserSays) {
    const std::vector<std::string> bodies = {
        R"({"token_ids": [1, 2, 3], "request_id": "r-1"})",
        R"({"token_ids":[0,2147483647]})",
        " \n{ \"request_id\" : \"x\" ,\t\"token_ids\" : [ 5 , 6 ] }\r\n",
        R"({"token_ids": []})",
        R"({"token_ids": [1], "model": "m", "n": [1, {"a": 2}]})",  // other keys: ignored
        R"({"token_ids": [1], "request_id": "a\"b\u00e9"})",        // escapes
        "{\"token_ids\": [1], \"request_id\": \"caf\xc3\xa9\"}",    // UTF-8 text
        R"({"token_ids": [1], "token_ids": [2]})",                  // a key twice
        R"({"token_ids": [-1]})",
        R"({"token_ids": [-0]})",
        R"({"token_ids": [2147483648]})",
        R"({"token_ids": [18446744073709551616]})",
        R"({"token_ids": [1.0]})",
        R"({"token_ids": [1e3]})",
        R"({"token_ids": [01]})",
        R"({"token_ids": [1,]})",
        R"({"token_ids": [1 2]})",
        R"({"token_ids": "1,2"})",
        R"({"token_ids": [true]})",
        R"({"token_ids": [1]} x)",
        R"({"token_ids": [1]}})",
        R"({"token_ids": [1], "request_id": 7})",
        R"({"request_id": "r"})",
        R"([1, 2])",
        R"({"token_ids": [1)",
        R"({"token_ids": [1], })",
        R"({})",
        "",
        "{\"token_ids\": [1], \"request_id\": \"a\tb\"}",  // a raw control character
        R"({"token_ids": [1], "lora_name": "ad-1", "cache_salt": "s"})",
        R"({"cache_salt": "s\u00e9", "token_ids": [1], "request_id": "r"})",
        R"({"token_ids": [1], "lora_name": null, "cache_salt": null})",
        R"({"token_ids": [1], "lora_name": "a", "lora_name": "b"})",
        R"({"token_ids": [1], "cache_salt": ""})",
        R"({"token_ids": [1], "lora_name": ""})",
        R"({"token_ids": [1], "cache_salt": 7})",
        R"({"token_ids": [1], "lora_name": {"name": "a"}})",
        R"({"token_ids": [1], "cache_salt": true})",
    };
    for (const auto& b : bodies) {
        SCOPED_TRACE(b);
        const auto want = reference_parse(b);
        if (!want) {
            EXPECT_THROW(parse_route_request(b), Error);
            continue;
        }
        RouteRequestBody got;
        ASSERT_NO_THROW(got = parse_route_request(b));
        EXPECT_EQ(got.token_ids, want->token_ids);
        EXPECT_EQ(got.request_id, want->request_id);
        EXPECT_EQ(got.extra.lora_name, want->extra.lora_name);
        EXPECT_EQ(got.extra.cache_salt, want->extra.cache_salt);
    }
    const auto keys =
        parse_route_request(R"({"token_ids": [1], "lora_name": "ad", "cache_salt": "s"})");
    EXPECT_EQ(keys.extra.lora_name, "ad");
    EXPECT_EQ(keys.extra.cache_salt, "s");
    try {
        parse_route_request(R"({"token_ids": [1], "cache_salt": 7})");
        ADD_FAILURE() << "no error";
    } catch (const Error& e) {
        EXPECT_STREQ(e.what(),
                     "\"cache_salt\" must be a non-empty string (the request's cache salt, as "
                     "sent to vLLM) or null, got number");
    }
    try {
        parse_route_request(R"({"token_ids": [3, 4294967296]})");
        ADD_FAILURE() << "no error";
    } catch (const Error& e) {
        EXPECT_STREQ(e.what(),
                     "\"token_ids\"[1] = 4294967296 is out of range; token ids are 0 to "
                     "2147483647");
    }
}

// Long token lists (the one-pass reader takes up to 8 bytes at a time): numbers of 1 to 11
// digits, whitespace or none around the commas, now and then a leading zero, a sign, a fraction,
// a value past 2^31 - 1 or a non-digit glued to a number.
TEST(RouteService, LongRandomTokenListsParseAsAFullJsonParserSays) {
    std::mt19937_64 rng(7);
    const char* const glue[] = {"", " ", "\n", " \t "};
    const char* const odd[] = {"0", "-", ".5", "e1", "x", "00", "-0"};
    for (int round = 0; round < 400; ++round) {
        std::string body = round % 2 ? R"({"request_id":"r","token_ids":[)" : R"({"token_ids":[)";
        const int n = static_cast<int>(rng() % 300);
        for (int i = 0; i < n; ++i) {
            if (i) body += glue[rng() % 4], body += ',', body += glue[rng() % 4];
            const int digits = 1 + static_cast<int>(rng() % (round % 5 == 0 ? 11 : 10));
            uint64_t v = rng() % 10;
            for (int d = 1; d < digits; ++d) v = v * 10 + rng() % 10;
            if (round % 3 == 0 && rng() % 200 == 0) {
                body += odd[rng() % 7];
                body += std::to_string(v);
            } else {
                body += std::to_string(v);
                if (round % 3 == 0 && rng() % 200 == 0) body += odd[rng() % 7];
            }
        }
        body += round % 2 ? "]}" : R"(],"request_id":"q"})";
        SCOPED_TRACE(body);
        const auto want = reference_parse(body);
        if (!want) {
            EXPECT_THROW(parse_route_request(body), Error);
            continue;
        }
        RouteRequestBody got;
        ASSERT_NO_THROW(got = parse_route_request(body));
        EXPECT_EQ(got.token_ids, want->token_ids);
        EXPECT_EQ(got.request_id, want->request_id);
    }
}

TEST(RouteService, TheRouteReplyIsWhatNlohmannJsonWrites) {
    KvIndex index(3);
    RouteServiceConfig c;
    c.replica_names = {"b/dp1", "a\"q", "b/dp0"};  // unsorted, one to escape
    c.block_size = 4;
    RouteService svc(c, [&index](const auto& fn) { fn(index, nullptr); });
    const std::vector<int64_t> prompt = {1, 2, 3, 4, 5};
    for (const char* id : {"x", "y", "z"}) {
        const RouteOutcome o = svc.route(id, prompt);
        nlohmann::json matched = nlohmann::json::object(), load = nlohmann::json::object();
        for (size_t r = 0; r < 3; ++r) {
            matched[c.replica_names[r]] = o.matched_blocks[r];
            load[c.replica_names[r]] = o.load_blocks[r];
        }
        const std::string want =
            nlohmann::json{{"replica", o.replica_name},
                           {"matched_blocks", matched},
                           {"load", load},
                           {"reason", std::string(route_reason_name(o.reason))}}
                .dump();
        EXPECT_EQ(svc.route_reply_json(o), want);
    }
}

}  // namespace
}  // namespace kvshard
