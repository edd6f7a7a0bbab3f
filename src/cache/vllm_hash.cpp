#include "kvshard/cache/vllm_hash.h"

#include <cbor/encoding.h>
#include <openssl/evp.h>
#include <openssl/sha.h>
#include <xxhash.h>

#include <cstdint>
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
    void unsigned_integer(uint64_t v) { head(cbor_encode_uint, v); }
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

// parent_as_int: vLLM v0.10's sha256_cbor_64bit chains Python ints, so the parent is a CBOR
// unsigned integer (the digest's 8 bytes, big-endian) rather than a byte string.
void encode_block(std::vector<uint8_t>& out, std::span<const uint8_t> parent,
                  std::span<const int32_t> tokens, std::span<const std::string> extra_keys,
                  bool parent_as_int = false) {
    out.clear();
    out.reserve(3 * kMaxHead + parent.size() + 5 * tokens.size() + 16);
    CborWriter w(out);
    w.array_start(3);
    if (parent_as_int) {
        uint64_t v = 0;
        for (uint8_t b : parent) v = (v << 8) | b;
        w.unsigned_integer(v);
    } else {
        w.bytes(parent);
    }
    w.array_start(tokens.size());
    for (int32_t t : tokens) w.integer(t);
    if (extra_keys.empty()) {
        w.null();
    } else {
        w.array_start(extra_keys.size());
        for (const auto& k : extra_keys) w.text(k);
    }
}

// Python's pickle at protocol 5 (pickle.HIGHEST_PROTOCOL since Python 3.8), for the few values a
// vLLM block hash pickles: bytes, str, non-negative and negative ints, None and tuples of them.
// The opcodes and the framing are CPython's (Lib/pickle.py, and Modules/_pickle.c writes the same
// bytes): PROTO 5; the body in frames, a frame of 4 bytes or more announced by FRAME and its
// 8-byte little-endian length; a frame is cut before the next object once it holds 64 KiB or more;
// a str of 64 KiB or more is written outside any frame; MEMOIZE after each bytes, str and
// non-empty tuple; STOP inside the last frame.
class PickleWriter {
  public:
    explicit PickleWriter(std::vector<uint8_t>& out) : out_(out) {
        out_.clear();
        out_.push_back(kProto);
        out_.push_back(5);
        start_frame();
    }
    void none() {
        object_boundary();
        out_.push_back(kNone);
    }
    void integer(int64_t v) {
        object_boundary();
        if (v >= 0 && v <= 0xff) {
            out_.push_back(kBinInt1);
            out_.push_back(static_cast<uint8_t>(v));
        } else if (v >= 0 && v <= 0xffff) {
            out_.push_back(kBinInt2);
            le(static_cast<uint64_t>(v), 2);
        } else if (v >= INT32_MIN && v <= INT32_MAX) {
            out_.push_back(kBinInt);
            le(static_cast<uint32_t>(static_cast<int32_t>(v)), 4);
        } else {
            // LONG1: the shortest two's complement little-endian bytes (pickle.encode_long).
            uint8_t b[8];
            int n = 8;
            for (int i = 0; i < 8; ++i)
                b[i] = static_cast<uint8_t>(static_cast<uint64_t>(v) >> (8 * i));
            const uint8_t fill = v < 0 ? 0xff : 0x00;
            while (n > 1 && b[n - 1] == fill && ((b[n - 2] & 0x80) != 0) == (v < 0)) --n;
            out_.push_back(kLong1);
            out_.push_back(static_cast<uint8_t>(n));
            out_.insert(out_.end(), b, b + n);
        }
    }
    void bytes(std::span<const uint8_t> b) {
        object_boundary();
        if (b.size() < 256) {
            out_.push_back(kShortBinBytes);
            out_.push_back(static_cast<uint8_t>(b.size()));
            out_.insert(out_.end(), b.begin(), b.end());
        } else {
            payload(kBinBytes, b);
        }
        memoize();
    }
    void text(std::string_view s) {
        object_boundary();
        const auto* p = reinterpret_cast<const uint8_t*>(s.data());
        if (s.size() < 256) {
            out_.push_back(kShortBinUnicode);
            out_.push_back(static_cast<uint8_t>(s.size()));
            out_.insert(out_.end(), p, p + s.size());
        } else {
            payload(kBinUnicode, std::span<const uint8_t>(p, s.size()));
        }
        memoize();
    }
    // A tuple of n items: tuple_start(n), the n items, tuple_end(n).
    void tuple_start(size_t n) {
        object_boundary();
        if (n > 3) out_.push_back(kMark);
    }
    void tuple_end(size_t n) {
        static constexpr uint8_t kSmall[] = {kEmptyTuple, kTuple1, kTuple2, kTuple3};
        out_.push_back(n <= 3 ? kSmall[n] : kTuple);
        if (n > 0) memoize();  // () is a singleton: not memoized
    }
    void finish() {
        out_.push_back(kStop);
        commit_frame();
    }

  private:
    static constexpr uint8_t kProto = 0x80, kFrame = 0x95, kNone = 'N', kBinInt1 = 'K',
                             kBinInt2 = 'M', kBinInt = 'J', kLong1 = 0x8a, kShortBinBytes = 'C',
                             kBinBytes = 'B', kShortBinUnicode = 0x8c, kBinUnicode = 'X',
                             kMark = '(', kEmptyTuple = ')', kTuple1 = 0x85, kTuple2 = 0x86,
                             kTuple3 = 0x87, kTuple = 't', kMemoize = 0x94, kStop = '.';
    static constexpr size_t kFrameHeader = 9;          // FRAME and its 8-byte length
    static constexpr size_t kFrameSizeMin = 4;         // pickle._Framer._FRAME_SIZE_MIN
    static constexpr size_t kFrameSizeTarget = 65536;  // pickle._Framer._FRAME_SIZE_TARGET

    void le(uint64_t v, int n) {
        for (int i = 0; i < n; ++i) out_.push_back(static_cast<uint8_t>(v >> (8 * i)));
    }
    void memoize() { out_.push_back(kMemoize); }
    size_t frame_size() const { return out_.size() - frame_at_ - kFrameHeader; }
    void start_frame() {
        frame_at_ = out_.size();
        out_.resize(out_.size() + kFrameHeader);
    }
    // Ends the current frame: its header filled in, or removed when the frame is under 4 bytes.
    void commit_frame() {
        const size_t n = frame_size();
        if (n >= kFrameSizeMin) {
            out_[frame_at_] = kFrame;
            for (size_t i = 0; i < 8; ++i)
                out_[frame_at_ + 1 + i] = static_cast<uint8_t>(static_cast<uint64_t>(n) >> (8 * i));
        } else {
            out_.erase(out_.begin() + static_cast<std::ptrdiff_t>(frame_at_),
                       out_.begin() + static_cast<std::ptrdiff_t>(frame_at_ + kFrameHeader));
        }
    }
    // Framer.commit_frame() at the start of Pickler.save(): a full frame is cut here.
    void object_boundary() {
        if (frame_size() >= kFrameSizeTarget) {
            commit_frame();
            start_frame();
        }
    }
    // BINBYTES / BINUNICODE: a 4-byte length; from 64 KiB on, outside any frame
    // (Framer.write_large_bytes).
    void payload(uint8_t op, std::span<const uint8_t> b) {
        KVSHARD_CHECK(b.size() <= 0xffffffffu, "a pickled string over 4 GiB");
        const bool large = b.size() >= kFrameSizeTarget;
        if (large) commit_frame();
        out_.push_back(op);
        le(b.size(), 4);
        out_.insert(out_.end(), b.begin(), b.end());
        if (large) start_frame();
    }

    std::vector<uint8_t>& out_;
    size_t frame_at_ = 0;  // where the current frame's header is reserved
};

void encode_block_pickle(std::vector<uint8_t>& out, std::span<const uint8_t> parent,
                         std::span<const int32_t> tokens, std::span<const std::string> extra_keys) {
    out.reserve(32 + parent.size() + 5 * tokens.size());
    PickleWriter w(out);
    w.tuple_start(3);
    w.bytes(parent);
    w.tuple_start(tokens.size());
    for (int32_t t : tokens) w.integer(t);
    w.tuple_end(tokens.size());
    if (extra_keys.empty()) {
        w.none();
    } else {
        w.tuple_start(extra_keys.size());
        for (const auto& k : extra_keys) w.text(k);
        w.tuple_end(extra_keys.size());
    }
    w.tuple_end(3);
    w.finish();
}

bool is_pickle(VllmHashScheme s) {
    return s == VllmHashScheme::kSha256Pickle || s == VllmHashScheme::kXxhashPickle;
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
    if (s == VllmHashScheme::kSha256Cbor || s == VllmHashScheme::kSha256Pickle ||
        s == VllmHashScheme::kSha256Cbor64) {
        uint8_t md[SHA256_DIGEST_LENGTH];
        sha256(data, md);
        // sha256_cbor_64bit: int.from_bytes(digest, "big") & (2**64 - 1), its last 8 bytes.
        const size_t keep = s == VllmHashScheme::kSha256Cbor64 ? 8 : sizeof md;
        return VllmBlockHash(std::span<const uint8_t>(md + sizeof md - keep, keep));
    }
    // xxhash.xxh3_128_digest: XXH128's canonical form, high 64 bits first, each big-endian.
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits(data.data(), data.size()));
    return VllmBlockHash(std::span<const uint8_t>(c.digest, sizeof c.digest));
}

}  // namespace

std::string_view vllm_hash_scheme_name(VllmHashScheme s) {
    switch (s) {
        case VllmHashScheme::kSha256Cbor:
            return "vllm-sha256-cbor";
        case VllmHashScheme::kXxhashCbor:
            return "vllm-xxhash-cbor";
        case VllmHashScheme::kSha256Pickle:
            return "vllm-sha256";
        case VllmHashScheme::kXxhashPickle:
            return "vllm-xxhash";
        case VllmHashScheme::kSha256Cbor64:
            return "vllm-sha256-cbor-64bit";
    }
    KVSHARD_CHECK(false, "a VllmHashScheme out of range: ", static_cast<int>(s));
    return {};
}

const std::vector<VllmHashScheme>& all_vllm_hash_schemes() {
    static const std::vector<VllmHashScheme> all = {
        VllmHashScheme::kSha256Cbor, VllmHashScheme::kXxhashCbor, VllmHashScheme::kSha256Pickle,
        VllmHashScheme::kXxhashPickle, VllmHashScheme::kSha256Cbor64};
    return all;
}

VllmHashScheme parse_vllm_hash_scheme(std::string_view name) {
    for (VllmHashScheme s : all_vllm_hash_schemes())
        if (name == vllm_hash_scheme_name(s)) return s;
    throw Error(detail::concat(
        "unknown vLLM hash scheme '", name,
        "'; expected vllm-sha256 (vLLM's default prefix_caching_hash_algo sha256: pickle), "
        "vllm-sha256-cbor (sha256_cbor), vllm-xxhash (xxhash: pickle), vllm-xxhash-cbor "
        "(xxhash_cbor) or vllm-sha256-cbor-64bit (vLLM v0.10's sha256_cbor_64bit)"));
}

size_t vllm_digest_size(VllmHashScheme s) {
    if (s == VllmHashScheme::kSha256Cbor64) return 8;
    return s == VllmHashScheme::kSha256Cbor || s == VllmHashScheme::kSha256Pickle ? 32 : 16;
}

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
    if (is_pickle(s)) {
        PickleWriter w(buf);
        w.text(python_hash_seed);
        w.finish();
    } else {
        CborWriter w(buf);
        w.text(python_hash_seed);
    }
    return digest(s, buf);
}

std::string vllm_engine_hash_seed(VllmHashScheme s, std::string_view seed) {
    if (seed.empty()) {
        require(s != VllmHashScheme::kXxhashCbor && s != VllmHashScheme::kXxhashPickle,
                "without PYTHONHASHSEED vLLM draws a random NONE_HASH per process for ",
                vllm_hash_scheme_name(s),
                " (a non-cryptographic hash), so no router can reproduce its hashes: start the "
                "engines with PYTHONHASHSEED set and give the same value with --hash-seed");
        return std::string(kVllmDefaultNoneHashSeed);
    }
    if (seed == "random" || seed == kVllmDefaultNoneHashSeed) return std::string(seed);
    bool digits = seed.size() <= 10;
    for (char c : seed) digits = digits && c >= '0' && c <= '9';
    require(digits && std::stoull(std::string(seed)) <= 4294967295ull, "hash seed '", seed,
            "' is not a PYTHONHASHSEED Python starts with: give \"random\" or an integer in [0, "
            "4294967295], the engines' value (or leave it out for vLLM's default seed, \"",
            kVllmDefaultNoneHashSeed, "\", with the sha256 schemes)");
    return std::string(seed);
}

std::vector<uint8_t> vllm_block_pickle(std::span<const uint8_t> parent,
                                       std::span<const int32_t> tokens,
                                       std::span<const std::string> extra_keys) {
    std::vector<uint8_t> out;
    encode_block_pickle(out, parent, tokens, extra_keys);
    return out;
}

std::vector<uint8_t> vllm_block_cbor(std::span<const uint8_t> parent,
                                     std::span<const int32_t> tokens,
                                     std::span<const std::string> extra_keys) {
    std::vector<uint8_t> out;
    encode_block(out, parent, tokens, extra_keys);
    return out;
}

std::vector<uint8_t> vllm_block_encoding(VllmHashScheme s, std::span<const uint8_t> parent,
                                         std::span<const int32_t> tokens,
                                         std::span<const std::string> extra_keys) {
    std::vector<uint8_t> out;
    if (is_pickle(s)) {
        encode_block_pickle(out, parent, tokens, extra_keys);
    } else {
        encode_block(out, parent, tokens, extra_keys, s == VllmHashScheme::kSha256Cbor64);
    }
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
    if (is_pickle(scheme_)) {
        encode_block_pickle(buf_, parent.bytes(), tokens, extra_keys);
    } else {
        const bool as_int = scheme_ == VllmHashScheme::kSha256Cbor64;
        require(!as_int || parent.size() <= 8, "a vllm-sha256-cbor-64bit parent is 8 bytes, got ",
                parent.size());
        encode_block(buf_, parent.bytes(), tokens, extra_keys, as_int);
    }
    return digest(scheme_, buf_);
}

std::vector<VllmBlockHash> VllmBlockHasher::hash_blocks(const VllmBlockHash& root,
                                                        std::span<const int32_t> tokens,
                                                        int block_size, const VllmExtraKeys& keys) {
    require(block_size >= 1, "block size must be at least 1 token, got ", block_size);
    require(scheme_ != VllmHashScheme::kSha256Cbor64 || keys.lora_name.empty(),
            "LoRA requests are not modelled under vllm-sha256-cbor-64bit: vLLM v0.10 hashed the "
            "adapter's lora_int_id, not its name; route LoRA requests with a scheme of a vLLM that "
            "hashes lora_name (vllm-sha256, vllm-sha256-cbor, vllm-xxhash, vllm-xxhash-cbor)");
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
