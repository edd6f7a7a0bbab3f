// vLLM-compatible block hashes: every digest, event id and CBOR encoding is compared with what
// tests/cache/vllm_hash_reference.py computes from vLLM's definition with cbor2, hashlib and
// xxhash, for the library and for `kvshard hash --json`.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cli_runner.h"
#include "kvshard/cache/block_hash.h"
#include "kvshard/cache/vllm_hash.h"
#include "kvshard/common/error.h"

namespace kvshard {
namespace {

struct Case {
    VllmHashScheme scheme;
    std::optional<std::string> seed;  // PYTHONHASHSEED, or
    std::string parent_hex;           // an explicit parent digest
    int block_size;
    std::vector<int32_t> tokens;
    std::string lora_name;
    std::string cache_salt;
};

std::string hex_of(const std::vector<uint8_t>& b) {
    static constexpr char kDigits[] = "0123456789abcdef";
    std::string s;
    for (uint8_t x : b) {
        s += kDigits[x >> 4];
        s += kDigits[x & 0xf];
    }
    return s;
}

std::string random_hex(std::mt19937& rng, size_t bytes) {
    std::vector<uint8_t> b(bytes);
    for (auto& x : b) x = static_cast<uint8_t>(rng());
    return hex_of(b);
}

nlohmann::json to_json(const Case& c) {
    nlohmann::json j{{"scheme", std::string(vllm_hash_scheme_name(c.scheme))},
                     {"block_size", c.block_size},
                     {"tokens", c.tokens},
                     {"lora_name", c.lora_name},
                     {"cache_salt", c.cache_salt}};
    if (c.seed) {
        j["seed"] = *c.seed;
    } else {
        j["parent"] = c.parent_hex;
    }
    return j;
}

// Runs the Python reference over `cases`; fails the test (and returns null) if it cannot.
nlohmann::json python_reference(const std::vector<Case>& cases) {
    char path[] = "/tmp/kvshard_vllm_hash_XXXXXX";
    const int fd = mkstemp(path);
    EXPECT_GE(fd, 0);
    if (fd < 0) return nullptr;
    close(fd);
    {
        nlohmann::json all = nlohmann::json::array();
        for (const auto& c : cases) all.push_back(to_json(c));
        std::ofstream(path) << all.dump();
    }
    const std::string cmd = std::string(KVSHARD_TEST_PYTHON) + " " + KVSHARD_TEST_SOURCE_DIR +
                            "/cache/vllm_hash_reference.py " + path;
    const test::CliResult ran = test::run_command(cmd);
    const std::string& out = ran.out;
    const int st = ran.status;
    std::remove(path);
    EXPECT_EQ(st, 0) << "the reference script failed (needs python3-cbor2 and python3-xxhash: "
                        "scripts/install-deps.sh): "
                     << cmd;
    if (st != 0) return nullptr;
    return nlohmann::json::parse(out);
}

std::vector<Case> make_cases() {
    std::mt19937 rng(20261202);
    std::vector<Case> cases;
    // Token ids at every CBOR integer width boundary: 1-byte (<24), 2-, 3-, 5-byte heads.
    const std::vector<int32_t> edges = {0, 1, 23, 24, 255, 256, 65535, 65536, 2147483647, 151643};
    auto random_tokens = [&](size_t n) {
        std::vector<int32_t> t(n);
        for (auto& x : t) x = static_cast<int32_t>(rng() % 160000);
        return t;
    };
    for (VllmHashScheme s : all_vllm_hash_schemes()) {
        const size_t digest_bytes = vllm_digest_size(s);
        // Seeded roots, two chained blocks and a partial one that must not be hashed.
        cases.push_back({s, "0", "", 16, random_tokens(40), "", ""});
        cases.push_back({s, "42", "", 4, {1, 2, 3, 4, 5, 6, 7, 8}, "", ""});
        cases.push_back({s, "", "", 3, random_tokens(7), "", ""});  // PYTHONHASHSEED=""
        // Explicit parents.
        cases.push_back(
            {s, std::nullopt, random_hex(rng, digest_bytes), 16, random_tokens(32), "", ""});
        cases.push_back({s, std::nullopt, random_hex(rng, digest_bytes), 5, edges, "", ""});
        // Array lengths with 1-, 2- and 3-byte heads (block sizes 23, 24, 300).
        cases.push_back({s, "7", "", 23, random_tokens(46), "", ""});
        cases.push_back({s, "7", "", 24, random_tokens(48), "", ""});
        cases.push_back({s, "7", "", 300, random_tokens(600), "", ""});
        // Extra keys: a LoRA name on every block, a cache salt on the first only, both, and
        // non-ASCII text (UTF-8 bytes).
        cases.push_back({s, "0", "", 8, random_tokens(24), "sql-adapter", ""});
        cases.push_back({s, "0", "", 8, random_tokens(24), "", "tenant-7"});
        cases.push_back({s, "0", "", 8, random_tokens(24), "adapter", "salt"});
        cases.push_back({s, std::nullopt, random_hex(rng, digest_bytes), 10, random_tokens(20),
                         "l\xc3\xb6ra-\xe6\x97\xa5", std::string(40, 's')});
        cases.push_back({s, "0", "", 1, edges, "", ""});
    }
    // vLLM v0.10's sha256_cbor_64bit hashed a LoRA request's lora_int_id, not its name: salts only.
    for (auto& c : cases)
        if (c.scheme == VllmHashScheme::kSha256Cbor64) c.lora_name.clear();
    return cases;
}

VllmBlockHash root_of(const Case& c) {
    return c.seed ? vllm_none_hash(c.scheme, *c.seed) : VllmBlockHash::from_hex(c.parent_hex);
}

TEST(VllmHash, MatchesPythonReferenceOfVllmDefinition) {
    const auto cases = make_cases();
    const nlohmann::json ref = python_reference(cases);
    ASSERT_TRUE(ref.is_array());
    ASSERT_EQ(ref.size(), cases.size());
    size_t blocks_checked = 0;
    for (size_t i = 0; i < cases.size(); ++i) {
        const Case& c = cases[i];
        SCOPED_TRACE("case " + std::to_string(i) + " " + to_json(c).dump().substr(0, 160));
        const VllmBlockHash root = root_of(c);
        EXPECT_EQ(root.hex(), ref[i]["root"].get<std::string>());
        EXPECT_EQ(root.size(), c.seed ? vllm_digest_size(c.scheme) : c.parent_hex.size() / 2);

        VllmBlockHasher hasher(c.scheme);
        const auto got = hasher.hash_blocks(root, c.tokens, c.block_size,
                                            VllmExtraKeys{c.lora_name, c.cache_salt});
        const auto& want = ref[i]["blocks"];
        ASSERT_EQ(got.size(), want.size());
        ASSERT_EQ(got.size(), c.tokens.size() / static_cast<size_t>(c.block_size));
        VllmBlockHash parent = root;
        for (size_t b = 0; b < got.size(); ++b) {
            EXPECT_EQ(got[b].hex(), want[b]["digest"].get<std::string>()) << "block " << b;
            EXPECT_EQ(got[b].event_id(), want[b]["id"].get<uint64_t>()) << "block " << b;
            EXPECT_EQ(got[b].size(), vllm_digest_size(c.scheme));
            // The encoding itself, byte for byte.
            const std::span<const int32_t> block(c.tokens.data() + b * c.block_size,
                                                 static_cast<size_t>(c.block_size));
            const auto extra = vllm_block_extra_keys({c.lora_name, c.cache_salt},
                                                     static_cast<int64_t>(b) * c.block_size);
            EXPECT_EQ(hex_of(vllm_block_encoding(c.scheme, parent.bytes(), block, extra)),
                      want[b]["encoded"].get<std::string>())
                << "block " << b;
            if (c.scheme == VllmHashScheme::kSha256Pickle ||
                c.scheme == VllmHashScheme::kXxhashPickle) {
                EXPECT_EQ(vllm_block_pickle(parent.bytes(), block, extra),
                          vllm_block_encoding(c.scheme, parent.bytes(), block, extra));
            } else if (c.scheme != VllmHashScheme::kSha256Cbor64) {
                EXPECT_EQ(vllm_block_cbor(parent.bytes(), block, extra),
                          vllm_block_encoding(c.scheme, parent.bytes(), block, extra));
            }
            // The one-block entry point agrees with the chain.
            EXPECT_EQ(vllm_hash_block(c.scheme, parent, block, extra), got[b]);
            parent = got[b];
            ++blocks_checked;
        }
    }
    EXPECT_GT(blocks_checked, 50u);
}

std::string join(const std::vector<int32_t>& t) {
    std::string s;
    for (size_t i = 0; i < t.size(); ++i) s += (i ? "," : "") + std::to_string(t[i]);
    return s;
}

TEST(VllmHash, CliJsonMatchesPythonReference) {
    std::vector<Case> cases;
    for (const Case& c : make_cases())
        if (!c.seed || !c.seed->empty()) cases.push_back(c);  // (an empty flag value aside)
    const nlohmann::json ref = python_reference(cases);
    ASSERT_TRUE(ref.is_array());
    for (size_t i = 0; i < cases.size(); ++i) {
        const Case& c = cases[i];
        std::string args = "hash --json --scheme " + std::string(vllm_hash_scheme_name(c.scheme)) +
                           " --block-size " + std::to_string(c.block_size) + " --tokens " +
                           join(c.tokens);
        args += c.seed ? " --hash-seed " + *c.seed : " --parent " + c.parent_hex;
        if (!c.lora_name.empty()) args += " --lora-name '" + c.lora_name + "'";
        if (!c.cache_salt.empty()) args += " --cache-salt '" + c.cache_salt + "'";
        const auto r = test::run_cli(args);
        ASSERT_EQ(r.status, 0) << args << "\n" << r.out;
        const auto out = nlohmann::json::parse(r.out);
        const auto& want = ref[i]["blocks"];
        ASSERT_EQ(out["blocks"].size(), want.size()) << args;
        for (size_t b = 0; b < want.size(); ++b) {
            EXPECT_EQ(out["blocks"][b]["digest"], want[b]["digest"]) << args;
            EXPECT_EQ(out["blocks"][b]["id"].get<uint64_t>(), want[b]["id"].get<uint64_t>())
                << args;
        }
    }
}

TEST(VllmHash, ChainAndExtraKeysChangeWhatTheyShould) {
    const auto s = VllmHashScheme::kSha256Cbor;
    const auto root = vllm_none_hash(s, "0");
    std::vector<int32_t> a = {1, 2, 3, 4, 5, 6, 7, 8};
    VllmBlockHasher h(s);
    const auto base = h.hash_blocks(root, a, 4);
    ASSERT_EQ(base.size(), 2u);
    EXPECT_EQ(base[1], h.hash(base[0], std::span<const int32_t>(a).subspan(4)));
    // A change in block 0 changes both; a change in block 1 only block 1.
    auto b = a;
    b[0] = 9;
    auto changed = h.hash_blocks(root, b, 4);
    EXPECT_NE(changed[0], base[0]);
    EXPECT_NE(changed[1], base[1]);
    b = a;
    b[7] = 9;
    changed = h.hash_blocks(root, b, 4);
    EXPECT_EQ(changed[0], base[0]);
    EXPECT_NE(changed[1], base[1]);
    // A salt enters block 0 only (block 1 differs through its parent); a LoRA name enters every
    // block: with the same parent, block 1's own hash differs.
    const auto salted = h.hash_blocks(root, a, 4, {"", "salt"});
    EXPECT_NE(salted[0], base[0]);
    EXPECT_EQ(h.hash(salted[0], std::span<const int32_t>(a).subspan(4)), salted[1]);
    const auto lora = h.hash_blocks(root, a, 4, {"ad", ""});
    EXPECT_NE(h.hash(lora[0], std::span<const int32_t>(a).subspan(4)), lora[1]);
    // Different seeds, different roots; the two schemes' digests have their own sizes.
    EXPECT_NE(vllm_none_hash(s, "0"), vllm_none_hash(s, "1"));
    EXPECT_EQ(vllm_none_hash(VllmHashScheme::kXxhashCbor, "0").size(), 16u);
}

TEST(VllmHash, EventIdIsTheLowSixtyFourBitsOfTheBigEndianDigest) {
    std::vector<uint8_t> b(32);
    for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint8_t>(i + 1);
    EXPECT_EQ(VllmBlockHash(b).event_id(), 0x191a1b1c1d1e1f20ull);
    EXPECT_EQ(VllmBlockHash(std::span<const uint8_t>(b.data(), 3)).event_id(), 0x010203ull);
    EXPECT_EQ(VllmBlockHash::from_hex(VllmBlockHash(b).hex()), VllmBlockHash(b));
}

TEST(VllmHash, Sha256Cbor64ChainsAnIntAndRefusesLoraNames) {
    const auto s = VllmHashScheme::kSha256Cbor64;
    const auto root = vllm_none_hash(s, "0");
    ASSERT_EQ(root.size(), 8u);
    // The parent is CBOR major type 0 (an int), not a byte string: 0x83, then 0x1b + 8 bytes.
    const std::vector<int32_t> t = {1, 2, 3, 4};
    const auto enc = vllm_block_encoding(s, root.bytes(), t);
    ASSERT_GE(enc.size(), 10u);
    EXPECT_EQ(enc[0], 0x83);
    EXPECT_EQ(enc[1] >> 5, 0) << "major type of the parent";
    VllmBlockHasher h(s);
    EXPECT_EQ(h.hash_blocks(root, t, 2, {"", "salt"}).size(), 2u);
    EXPECT_THROW(h.hash_blocks(root, t, 2, {"adapter", ""}), Error);
}

TEST(VllmHash, RefusesBadInput) {
    EXPECT_THROW(VllmBlockHash::from_hex("abc"), Error);
    EXPECT_THROW(VllmBlockHash::from_hex("zz"), Error);
    EXPECT_THROW(VllmBlockHash::from_hex(std::string(66, 'a')), Error);
    EXPECT_THROW(parse_vllm_hash_scheme("sha256"), Error);
    VllmBlockHasher h(VllmHashScheme::kXxhashCbor);
    const std::vector<int32_t> t = {1, 2};
    EXPECT_THROW(h.hash_blocks(vllm_none_hash(VllmHashScheme::kXxhashCbor, "0"), t, 0), Error);
    EXPECT_THROW(h.hash(VllmBlockHash(), t), Error);
}

struct BadCli {
    std::string args;
    std::string message;
};

TEST(VllmHash, CliRefusesBadInputWithExitTwo) {
    const std::string ok = " --scheme vllm-sha256-cbor --hash-seed 0";
    const std::vector<BadCli> bad = {
        {"hash --block-size 0 --tokens 1,2" + ok, "--block-size must be 1 to"},
        {"hash --block-size 2000000 --tokens 1,2" + ok, "--block-size must be 1 to"},
        {"hash --block-size 2 --tokens 1,-2" + ok, "out of range"},
        {"hash --block-size 2 --tokens 1,2147483648" + ok, "out of range"},
        {"hash --block-size 2 --tokens 1,x" + ok, "not a token id"},
        {"hash --block-size 2 --tokens 1,,2" + ok, "not a token id"},
        {"hash --block-size 2 --tokens 1,2 --scheme vllm-sha256-cbor --parent 12zz", "hex digits"},
        {"hash --block-size 2 --tokens 1,2 --scheme vllm-sha256-cbor --parent abcd",
         "64 hex digits"},
        {"hash --block-size 2 --tokens 1,2 --scheme vllm-xxhash-cbor", "random NONE_HASH"},
        {"hash --block-size 2 --tokens 1,2 --scheme vllm-sha256 --hash-seed abc", "PYTHONHASHSEED"},
        {"hash --block-size 2 --tokens 1,2 --scheme vllm-sha256 --hash-seed -1", "PYTHONHASHSEED"},
        {"hash --block-size 2 --tokens 1,2 --scheme vllm-sha256 --hash-seed 4294967296",
         "PYTHONHASHSEED"},
        {"hash --block-size 2 --tokens 1,2 --scheme md5 --hash-seed 0", "--scheme must be"},
        {"hash --block-size 2 --tokens 1,2 --scheme kvshard --hash-seed 0", "vLLM schemes only"},
        {"hash --block-size 2 --tokens 1,2 --scheme kvshard --parent 00", "32 hex digits"},
        // An empty value was taken as the flag left out.
        {"hash --block-size 2 --tokens 1,2 --scheme vllm-sha256 --hash-seed ''",
         "--hash-seed is empty; give the engines' PYTHONHASHSEED or leave the flag out"},
        {"hash --block-size 2 --tokens 1,2 --scheme vllm-sha256-cbor --parent ''",
         "--parent is empty"},
        {"hash --block-size 2 --tokens 1,2" + ok + " --cache-salt ''", "--cache-salt is empty"},
        {"hash --block-size 2 --tokens 1,2" + ok + " --lora-name ''", "--lora-name is empty"},
    };
    for (const auto& b : bad) {
        const auto r = test::run_cli(b.args);
        EXPECT_EQ(r.status, 2) << b.args << "\n" << r.out;
        EXPECT_NE(r.out.find(b.message), std::string::npos) << b.args << "\n" << r.out;
        EXPECT_NE(r.out.find("kvshard: error:"), std::string::npos) << b.args << "\n" << r.out;
    }
}

// Engines without PYTHONHASHSEED: vLLM's sha256 schemes derive NONE_HASH from the fixed
// DEFAULT_NONE_HASH_SEED, so a seed left out means that string; the xxhash schemes are random per
// process and refused. A seed given must be one Python starts with.
TEST(VllmHash, EngineSeedDefaultsToVllmsFixedSeed) {
    for (VllmHashScheme s : {VllmHashScheme::kSha256Pickle, VllmHashScheme::kSha256Cbor,
                             VllmHashScheme::kSha256Cbor64})
        EXPECT_EQ(vllm_engine_hash_seed(s, ""), "vllm-none-hash");
    EXPECT_THROW(vllm_engine_hash_seed(VllmHashScheme::kXxhashCbor, ""), Error);
    EXPECT_THROW(vllm_engine_hash_seed(VllmHashScheme::kXxhashPickle, ""), Error);
    for (const char* ok : {"0", "42", "4294967295", "random", "007"})
        EXPECT_EQ(vllm_engine_hash_seed(VllmHashScheme::kXxhashCbor, ok), ok);
    for (const char* bad : {"abc", "-1", "+1", " 1", "4294967296", "18446744073709551616", "0x10"})
        EXPECT_THROW(vllm_engine_hash_seed(VllmHashScheme::kSha256Cbor, bad), Error) << bad;
    // The CLI with no seed hashes from the default seed's root.
    const auto a =
        test::run_cli("hash --json --scheme vllm-sha256-cbor --block-size 2 --tokens 1,2");
    const auto b = test::run_cli(
        "hash --json --scheme vllm-sha256-cbor --block-size 2 --tokens 1,2 --hash-seed "
        "vllm-none-hash");
    ASSERT_EQ(a.status, 0) << a.out;
    EXPECT_EQ(a.out, b.out);
    const auto c = test::run_cli(
        "hash --json --scheme vllm-sha256-cbor --block-size 2 --tokens 1,2 --hash-seed 0");
    EXPECT_NE(a.out, c.out);
}

TEST(VllmHash, CliKvshardSchemeMatchesTheLibrary) {
    const auto r = test::run_cli("hash --json --scheme kvshard --block-size 2 --tokens 1,2,3,4,5");
    ASSERT_EQ(r.status, 0) << r.out;
    const auto out = nlohmann::json::parse(r.out);
    ASSERT_EQ(out["blocks"].size(), 2u);
    const std::vector<int32_t> t = {1, 2, 3, 4};
    const auto want = hash_token_blocks(t, 2);
    EXPECT_EQ(out["blocks"][1]["digest"], want[1].hex());
    EXPECT_EQ(out["blocks"][1]["id"].get<uint64_t>(), want[1].lo);
}

}  // namespace
}  // namespace kvshard
