#pragma once
// Request traces in the Mooncake JSON-lines format, one request a line:
//   {"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [ids...]}
// hash_ids cut the prompt into block_tokens-token blocks (512 in Mooncake); id k at position i
// means "the first (i+1)*block_tokens tokens are the same as in every other request with id k
// there" (a chained prefix hash), so equal ids map to equal BlockHashes (trace_block_hash).
//
// A line is malformed when it is not a JSON object, a field is missing or of the wrong type or
// range, len(hash_ids) != ceil(input_length / block_tokens), or its timestamp is earlier than the
// previous request's. Blank lines are ignored. Malformed lines are either fatal (Error naming
// FILE:LINE) or skipped and listed, per TraceErrorPolicy; nothing is silently misread.
#include <cstdint>
#include <istream>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvshard/cache/block_hash.h"

namespace kvshard {

// The block hash of trace id `id`: hi = id, lo = a 64-bit mix of id (uniform low bits for hashing).
BlockHash trace_block_hash(uint64_t id);

enum class TraceErrorPolicy { kFail, kSkip };
TraceErrorPolicy parse_trace_error_policy(std::string_view s);  // "fail" | "skip"

struct TraceRequest {
    double arrival_s = 0;  // timestamp / 1000
    int64_t input_tokens = 0;
    int64_t output_tokens = 0;
    int64_t hash_begin =
        0;  // this request's hashes are Trace::hashes[hash_begin, hash_begin + num_blocks)
    int32_t num_blocks = 0;
    int64_t line = 0;  // 1-based line in the file
};

struct TraceIssue {
    int64_t line = 0;
    std::string message;
};

struct Trace {
    std::string source;  // file name, for messages
    int block_tokens = 512;
    std::vector<TraceRequest> requests;
    std::vector<BlockHash> hashes;
    std::vector<TraceIssue> skipped;  // malformed lines under TraceErrorPolicy::kSkip

    std::span<const BlockHash> blocks(const TraceRequest& r) const {
        return {hashes.data() + r.hash_begin, static_cast<size_t>(r.num_blocks)};
    }
    double duration_s() const {
        return requests.empty() ? 0.0 : requests.back().arrival_s - requests.front().arrival_s;
    }
};

// Throws Error (FILE:LINE: what) on the first malformed line under kFail, or when the file cannot
// be read. max_requests > 0 stops after that many requests.
Trace parse_trace(std::istream& in, const std::string& source, TraceErrorPolicy on_error,
                  int block_tokens = 512, int64_t max_requests = 0);
Trace load_trace(const std::string& path, TraceErrorPolicy on_error, int block_tokens = 512,
                 int64_t max_requests = 0);

struct HitRates {
    double token_hit_rate = 0;  // hit prompt tokens / prompt tokens
    double block_hit_rate = 0;  // hit blocks / blocks
    int64_t hit_tokens = 0, total_tokens = 0, hit_blocks = 0, total_blocks = 0;
};

// The trace README's bound: one replica with an infinite cache; a request hits its longest prefix
// of already-seen ids (a hit block counts its tokens, the last one possibly partial).
HitRates infinite_cache_hit_rates(const Trace& trace);

}  // namespace kvshard
