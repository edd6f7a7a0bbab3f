// kvshard hash: the prefix-cache digests of a token sequence's full blocks, under vLLM's
// sha256 / sha256_cbor / xxhash / xxhash_cbor or kvshard's own scheme.
#include <fmt/format.h>

#include <charconv>
#include <cstdint>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "command.h"
#include "kvshard/cache/block_hash.h"
#include "kvshard/cache/vllm_hash.h"
#include "kvshard/common/error.h"
#include "options.h"

namespace kvshard::cli {
namespace {

struct HashFlags {
    std::string scheme;
    int64_t block_size = 0;
    std::string hash_seed;
    bool have_seed = false;
    std::string parent;
    std::string tokens;
    std::string lora_name;
    std::string cache_salt;
    bool json = false;
};

constexpr int64_t kMaxBlockSize = 1 << 20;

std::vector<int32_t> parse_tokens(const std::string& text) {
    require(!text.empty(), "--tokens is a comma-separated list of token ids, e.g. 1,2,3; got ''");
    std::vector<int32_t> out;
    size_t pos = 0;
    while (true) {
        const size_t comma = text.find(',', pos);
        const std::string_view item(text.data() + pos,
                                    (comma == std::string::npos ? text.size() : comma) - pos);
        int64_t v = 0;
        const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
        require(!item.empty() && ec == std::errc() && end == item.data() + item.size(),
                "--tokens: item ", out.size() + 1, " is '", item,
                "', not a token id; expected comma-separated integers 0 to ",
                std::numeric_limits<int32_t>::max(), ", e.g. 1,2,3");
        require(v >= 0 && v <= std::numeric_limits<int32_t>::max(), "--tokens: token id ", v,
                " (item ", out.size() + 1, ") is out of range; token ids are 0 to ",
                std::numeric_limits<int32_t>::max());
        out.push_back(static_cast<int32_t>(v));
        if (comma == std::string::npos) break;
        pos = comma + 1;
    }
    return out;
}

struct Digest {
    std::string hex;
    uint64_t id;
};

std::vector<Digest> vllm_digests(const HashFlags& f, VllmHashScheme scheme,
                                 const std::vector<int32_t>& tokens) {
    // No --parent: the chain starts at NONE_HASH of the engine's PYTHONHASHSEED, or of vLLM's
    // default seed when the engine has none (vllm_engine_hash_seed refuses that for xxhash).
    const VllmBlockHash root =
        f.parent.empty() ? vllm_none_hash(scheme, vllm_engine_hash_seed(scheme, f.hash_seed))
                         : VllmBlockHash::from_hex(f.parent);
    if (!f.parent.empty())
        require(root.size() == vllm_digest_size(scheme), "--parent for ",
                vllm_hash_scheme_name(scheme), " is ", 2 * vllm_digest_size(scheme),
                " hex digits (a ", vllm_digest_size(scheme), "-byte digest), got ",
                f.parent.size());
    VllmBlockHasher hasher(scheme);
    std::vector<Digest> out;
    for (const auto& h : hasher.hash_blocks(root, tokens, static_cast<int>(f.block_size),
                                            VllmExtraKeys{f.lora_name, f.cache_salt}))
        out.push_back({h.hex(), h.event_id()});
    return out;
}

std::vector<Digest> kvshard_digests(const HashFlags& f, const std::vector<int32_t>& tokens) {
    require(!f.have_seed,
            "--hash-seed applies to the vLLM schemes only; kvshard's chain starts at the all-zero "
            "parent (or give --parent HEX)");
    const BlockHash root = f.parent.empty() ? kRootParentHash : BlockHash::from_hex(f.parent);
    const auto extra = encode_extra_keys(f.cache_salt, f.lora_name);
    BlockHasher hasher;
    std::vector<BlockHash> hashes;
    hasher.hash_blocks(root, tokens, static_cast<int>(f.block_size), extra, hashes);
    std::vector<Digest> out;
    // The id is the low 64 bits of the big-endian digest, as for vLLM.
    for (const auto& h : hashes) out.push_back({h.hex(), h.lo});
    return out;
}

void run(const HashFlags& f) {
    require(f.block_size >= 1 && f.block_size <= kMaxBlockSize, "--block-size must be 1 to ",
            kMaxBlockSize, " tokens, got ", f.block_size);
    const std::vector<int32_t> tokens = parse_tokens(f.tokens);
    std::vector<Digest> digests;
    if (f.scheme == "kvshard") {
        digests = kvshard_digests(f, tokens);
    } else {
        VllmHashScheme scheme{};
        try {
            scheme = parse_vllm_hash_scheme(f.scheme);
        } catch (const Error&) {
            throw Error(
                detail::concat("--scheme must be vllm-sha256, vllm-sha256-cbor, "
                               "vllm-xxhash, vllm-xxhash-cbor, vllm-sha256-cbor-64bit or "
                               "kvshard, got '",
                               f.scheme, "'"));
        }
        digests = vllm_digests(f, scheme, tokens);
    }
    if (f.json) {
        nlohmann::json blocks = nlohmann::json::array();
        for (const auto& d : digests) blocks.push_back({{"digest", d.hex}, {"id", d.id}});
        print_json(nlohmann::json{{"blocks", blocks}}.dump());
        return;
    }
    fmt::print("{} full block(s) of {} tokens ({} token(s) not in a full block)\n", digests.size(),
               f.block_size, tokens.size() - digests.size() * static_cast<size_t>(f.block_size));
    for (size_t i = 0; i < digests.size(); ++i)
        fmt::print("{:>5} {} {}\n", i, digests[i].hex, digests[i].id);
}

void setup(CLI::App& app) {
    auto f = std::make_shared<HashFlags>();
    auto* sub = app.add_subcommand(
        "hash", "Print the prefix-cache digest of each full block of a token sequence");
    sub->add_option("--scheme", f->scheme,
                    "vllm-sha256 | vllm-sha256-cbor | vllm-xxhash | vllm-xxhash-cbor | "
                    "vllm-sha256-cbor-64bit (vLLM's sha256 / sha256_cbor / xxhash / xxhash_cbor "
                    "/ v0.10's sha256_cbor_64bit) | kvshard")
        ->required();
    sub->add_option("--block-size", f->block_size, "tokens per block")->required();
    auto* seed = sub->add_option(
        "--hash-seed", f->hash_seed,
        "the engine's PYTHONHASHSEED (vLLM's NONE_HASH comes from it); left out: vLLM's "
        "default seed \"vllm-none-hash\" (sha256 schemes)");
    auto* parent = sub->add_option("--parent", f->parent, "hex digest the first block chains from");
    seed->excludes(parent);
    sub->add_option("--tokens", f->tokens, "comma-separated token ids, e.g. 1,2,3")->required();
    auto* lora = sub->add_option("--lora-name", f->lora_name,
                                 "LoRA adapter name (an extra key on every block)");
    auto* salt = sub->add_option("--cache-salt", f->cache_salt,
                                 "cache salt (an extra key on the first block)");
    sub->add_flag("--json", f->json, "print {\"blocks\": [{\"digest\": hex, \"id\": uint64}]}");
    sub->callback([f, seed, parent, lora, salt] {
        HashFlags copy = *f;
        copy.have_seed = seed->count() > 0;
        // An empty value would be taken as the flag left out: refused, so that a flag given does
        // what it says (vLLM's server refuses an empty cache_salt too).
        for (const auto& [opt, value, what] :
             {std::tuple{seed, &f->hash_seed, "the engines' PYTHONHASHSEED"},
              std::tuple{parent, &f->parent, "a hex digest"},
              std::tuple{lora, &f->lora_name, "the LoRA adapter's name"},
              std::tuple{salt, &f->cache_salt, "the request's cache salt"}})
            require(opt->count() == 0 || !value->empty(), opt->get_name(), " is empty; give ", what,
                    " or leave the flag out");
        run(copy);
    });
}

KVSHARD_COMMAND("hash", setup);

}  // namespace
}  // namespace kvshard::cli
