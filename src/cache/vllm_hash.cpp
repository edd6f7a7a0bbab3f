#include "kvshard/cache/vllm_hash.h"

#include <cbor/encoding.h>
#include <openssl/evp.h>
#include <openssl/sha.h>
#include <xxhash.h>

#include <cstring>
#include <memory>

#include "kvshard/common/error.h"

namespace kvshard {
namespace {

// The longest CBOR head: the initial byte and an 8-byte argument (RFC 8949 §3).
constexpr size_t kMaxHead = 9;

int hex_digit(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

// Appends CBOR items to a byte vector. libcbor's cbor_encode_* write each head in its shortest
// form (an argument below 24 in the initial byte, else 1, 2, 4 or 8 bytes), which is what
// cbor2.dumps(canonical=True) writes too (RFC 8949 §4.2.1, "preferred serialization").
class CborWriter {
  public:
    explicit CborWriter(std::vector<uint8_t>& out) : out_(out) {}
    void array_start(size_t n) { head(cbor_encode_array_start, n); }
    void bytes(std::span<const uint8_t> b) {
        head(cbor_encode_bytestring_start, b.size());
        out_.insert(out_.end(), b.begin(), b.end());
    }
    void text(std::string_view s) {
        head(cbor_encode_string_start, s.size());
        out_.insert(out_.end(), s.begin(), s.end());
    }
    void integer(int64_t v) {
        // Major type 0 for v >= 0, else major type 1 with argument -1 - v.
        if (v >= 0) {
            head(cbor_encode_uint, static_cast<uint64_t>(v));
        } else {
            head(cbor_encode_negint, static_cast<uint64_t>(-(v + 1)));
        }
    }
    void null() {
        const size_t at = out_.size();
        out_.resize(at + 1);
        const size_t n = cbor_encode_null(out_.data() + at, 1);
        KVSHARD_CHECK(n == 1, "cbor_encode_null wrote ", n, " bytes");
    }

  private:
    template <typename Fn>
    void head(Fn fn, uint64_t arg) {
        const size_t at = out_.size();
        out_.resize(at + kMaxHead);
        const size_t n = fn(arg, out_.data() + at, kMaxHead);
        KVSHARD_CHECK(n >= 1 && n <= kMaxHead, "a CBOR head is 1 to 9 bytes, libcbor wrote ", n);
        out_.resize(at + n);
    }
    std::vector<uint8_t>& out_;
};

void encode_block(std::vector<uint8_t>& out, std::span<const uint8_t> parent,
                  std::span<const int32_t> tokens, std::span<const std::string> extra_keys) {
    out.clear();
    out.reserve(3 * kMaxHead + parent.size() + 5 * tokens.size() + 16);
    CborWriter w(out);
    w.array_start(3);
    w.bytes(parent);
    w.array_start(tokens.size());
    for (int32_t t : tokens) w.integer(t);
    if (extra_keys.empty()) {
        w.null();
    } else {
        w.array_start(extra_keys.size());
        for (const auto& k : extra_keys) w.text(k);
    }
}

// SHA-256 through EVP with the algorithm fetched once per process and a context per thread:
// OpenSSL 3's one-shot SHA256() fetches the implementation (a lookup under a lock) on every call,
// which a prompt of many blocks pays once per block.
void sha256(std::span<const uint8_t> data, uint8_t* md) {
    static EVP_MD* const alg = EVP_MD_fetch(nullptr, "SHA256", nullptr);
    thread_local const std::unique_ptr<EVP_MD_CTX, void (*)(EVP_MD_CTX*)> ctx(EVP_MD_CTX_new(),
                                                                              EVP_MD_CTX_free);
    unsigned int len = 0;
    KVSHARD_CHECK(alg != nullptr && ctx != nullptr &&
                      EVP_DigestInit_ex2(ctx.get(), alg, nullptr) == 1 &&
                      EVP_DigestUpdate(ctx.get(), data.data(), data.size()) == 1 &&
                      EVP_DigestFinal_ex(ctx.get(), md, &len) == 1 && len == SHA256_DIGEST_LENGTH,
                  "OpenSSL's SHA-256 failed");
}

VllmBlockHash digest(VllmHashScheme s, std::span<const uint8_t> data) {
    if (s == VllmHashScheme::kSha256Cbor) {
        uint8_t md[SHA256_DIGEST_LENGTH];
        sha256(data, md);
        return VllmBlockHash(std::span<const uint8_t>(md, sizeof md));
    }
    // xxhash.xxh3_128_digest: XXH128's canonical form, high 64 bits first, each big-endian.
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits(data.data(), data.size()));
    return VllmBlockHash(std::span<const uint8_t>(c.digest, sizeof c.digest));
}

}  // namespace

std::string_view vllm_hash_scheme_name(VllmHashScheme s) {
    return s == VllmHashScheme::kSha256Cbor ? "vllm-sha256-cbor" : "vllm-xxhash-cbor";
}

VllmHashScheme parse_vllm_hash_scheme(std::string_view name) {
    if (name == "vllm-sha256-cbor") return VllmHashScheme::kSha256Cbor;
    if (name == "vllm-xxhash-cbor") return VllmHashScheme::kXxhashCbor;
    throw Error(detail::concat("unknown vLLM hash scheme '", name,
                               "'; expected vllm-sha256-cbor (vLLM's sha256_cbor) or "
                               "vllm-xxhash-cbor (vLLM's xxhash_cbor)"));
}

size_t vllm_digest_size(VllmHashScheme s) { return s == VllmHashScheme::kSha256Cbor ? 32 : 16; }

VllmBlockHash::VllmBlockHash(std::span<const uint8_t> bytes) {
    require(!bytes.empty() && bytes.size() <= kMaxSize, "a vLLM block hash is 1 to ", kMaxSize,
            " bytes, got ", bytes.size());
    std::memcpy(bytes_.data(), bytes.data(), bytes.size());
    size_ = static_cast<uint8_t>(bytes.size());
}

VllmBlockHash VllmBlockHash::from_hex(std::string_view text) {
    require(!text.empty() && text.size() % 2 == 0 && text.size() <= 2 * kMaxSize,
            "a vLLM block hash is an even number of hex digits, 2 to ", 2 * kMaxSize,
            " (64 for sha256_cbor, 32 for xxhash_cbor), got '", text, "' (", text.size(),
            " characters)");
    std::array<uint8_t, kMaxSize> b{};
    for (size_t i = 0; i < text.size(); i += 2) {
        const int hi = hex_digit(text[i]);
        const int lo = hex_digit(text[i + 1]);
        require(hi >= 0 && lo >= 0, "a vLLM block hash is hex digits, got '", text,
                "' (bad character at position ", (hi < 0 ? i : i + 1), ")");
        b[i / 2] = static_cast<uint8_t>(hi * 16 + lo);
    }
    return VllmBlockHash(std::span<const uint8_t>(b.data(), text.size() / 2));
}

std::string VllmBlockHash::hex() const {
    static constexpr char kDigits[] = "0123456789abcdef";
    std::string s(2 * size_, '0');
    for (size_t i = 0; i < size_; ++i) {
        s[2 * i] = kDigits[bytes_[i] >> 4];
        s[2 * i + 1] = kDigits[bytes_[i] & 0xf];
    }
    return s;
}

uint64_t VllmBlockHash::event_id() const {
    uint64_t v = 0;
    const size_t from = size_ > 8 ? size_ - 8 : 0;
    for (size_t i = from; i < size_; ++i) v = (v << 8) | bytes_[i];
    return v;
}

bool VllmBlockHash::operator==(const VllmBlockHash& o) const {
    return size_ == o.size_ && std::memcmp(bytes_.data(), o.bytes_.data(), size_) == 0;
}

VllmBlockHash vllm_none_hash(VllmHashScheme s, std::string_view python_hash_seed) {
    std::vector<uint8_t> buf;
    CborWriter w(buf);
    w.text(python_hash_seed);
    return digest(s, buf);
}

std::vector<uint8_t> vllm_block_cbor(std::span<const uint8_t> parent,
                                     std::span<const int32_t> tokens,
                                     std::span<const std::string> extra_keys) {
    std::vector<uint8_t> out;
    encode_block(out, parent, tokens, extra_keys);
    return out;
}

VllmBlockHash vllm_hash_block(VllmHashScheme s, const VllmBlockHash& parent,
                              std::span<const int32_t> tokens,
                              std::span<const std::string> extra_keys) {
    VllmBlockHasher h(s);
    return h.hash(parent, tokens, extra_keys);
}

std::vector<std::string> vllm_block_extra_keys(const VllmExtraKeys& keys, int64_t start_token) {
    std::vector<std::string> out;
    if (!keys.lora_name.empty()) out.push_back(keys.lora_name);
    if (start_token == 0 && !keys.cache_salt.empty()) out.push_back(keys.cache_salt);
    return out;
}

VllmBlockHash VllmBlockHasher::hash(const VllmBlockHash& parent, std::span<const int32_t> tokens,
                                    std::span<const std::string> extra_keys) {
    require(!parent.empty(),
            "a vLLM block hash needs its parent digest (NONE_HASH for a request's first block: "
            "vllm_none_hash(scheme, PYTHONHASHSEED))");
    encode_block(buf_, parent.bytes(), tokens, extra_keys);
    return digest(scheme_, buf_);
}

std::vector<VllmBlockHash> VllmBlockHasher::hash_blocks(const VllmBlockHash& root,
                                                        std::span<const int32_t> tokens,
                                                        int block_size, const VllmExtraKeys& keys) {
    require(block_size >= 1, "block size must be at least 1 token, got ", block_size);
    const size_t bs = static_cast<size_t>(block_size);
    const size_t full = tokens.size() / bs;
    std::vector<VllmBlockHash> out;
    out.reserve(full);
    VllmBlockHash parent = root;
    std::vector<std::string> extra;
    for (size_t i = 0; i < full; ++i) {
        if (i <= 1) extra = vllm_block_extra_keys(keys, static_cast<int64_t>(i * bs));
        parent = hash(parent, tokens.subspan(i * bs, bs), extra);
        out.push_back(parent);
    }
    return out;
}

}  // namespace kvshard
