#include "kvshard/sim/trace.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "kvshard/common/error.h"

namespace kvshard {

TraceErrorPolicy parse_trace_error_policy(std::string_view s) {
    if (s == "fail") return TraceErrorPolicy::kFail;
    if (s == "skip") return TraceErrorPolicy::kSkip;
    throw Error(detail::concat("unknown --on-error value '", s, "': expected skip or fail"));
}

BlockHash trace_block_hash(uint64_t id) {
    uint64_t z = id + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return BlockHash{z ^ (z >> 31), id};
}

namespace {

bool blank(std::string_view s) {
    for (char c : s)
        if (c != ' ' && c != '\t' && c != '\r' && c != '\n') return false;
    return true;
}

// Parses one line into `out` (hashes appended to `hashes`); returns an empty string or what is
// wrong.
std::string parse_line(std::string_view text, int block_tokens, double prev_arrival_s,
                       TraceRequest& out, std::vector<BlockHash>& hashes) {
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return "not valid JSON";
    if (!j.is_object()) return "not a JSON object";
    for (const char* f : {"timestamp", "input_length", "output_length", "hash_ids"})
        if (!j.contains(f)) return detail::concat("missing field '", f, "'");
    const auto& ts = j["timestamp"];
    if (!ts.is_number() || !std::isfinite(ts.get<double>()) || ts.get<double>() < 0)
        return "'timestamp' must be a non-negative number of milliseconds";
    // Up to 2^40 tokens, as output_length below: a larger one overflowed ceil(input / block) into
    // a negative block count.
    const auto& in = j["input_length"];
    if (!in.is_number_integer() || in.get<int64_t>() < 1 || in.get<int64_t>() > (int64_t{1} << 40))
        return "'input_length' must be a positive integer up to 2^40 tokens";
    // At most 2^40 tokens, the longest context kvshard plans for (kMaxContextTokens): an output
    // of 10^15 tokens was replayed as a request that never ends (0 req/s) and made plan --trace
    // speak of a context nobody gave.
    const auto& outlen = j["output_length"];
    if (!outlen.is_number_integer() || outlen.get<int64_t>() < 0 ||
        outlen.get<int64_t>() > (int64_t{1} << 40))
        return "'output_length' must be a non-negative integer up to 2^40 tokens";
    const auto& ids = j["hash_ids"];
    if (!ids.is_array()) return "'hash_ids' must be an array of non-negative integers";
    const int64_t input = in.get<int64_t>();
    const int64_t want = (input + block_tokens - 1) / block_tokens;
    if (static_cast<int64_t>(ids.size()) != want)
        return detail::concat("'hash_ids' has ", ids.size(), " entries; input_length ", input,
                              " needs ceil(", input, "/", block_tokens, ") = ", want);
    const size_t begin = hashes.size();
    for (const auto& id : ids) {
        if (!id.is_number_integer() || (!id.is_number_unsigned() && id.get<int64_t>() < 0)) {
            hashes.resize(begin);
            return "'hash_ids' must be an array of non-negative integers";
        }
        hashes.push_back(trace_block_hash(id.get<uint64_t>()));
    }
    const double arrival_s = ts.get<double>() / 1000.0;
    if (arrival_s < prev_arrival_s) {
        hashes.resize(begin);
        return detail::concat("timestamp ", ts.get<double>(),
                              " ms is earlier than the previous request's ",
                              prev_arrival_s * 1000.0, " ms (the trace must be sorted by time)");
    }
    out.arrival_s = arrival_s;
    out.input_tokens = input;
    out.output_tokens = outlen.get<int64_t>();
    out.hash_begin = static_cast<int64_t>(begin);
    out.num_blocks = static_cast<int32_t>(want);
    return {};
}

}  // namespace

Trace parse_trace(std::istream& in, const std::string& source, TraceErrorPolicy on_error,
                  int block_tokens, int64_t max_requests) {
    require(max_requests >= 0, "the request limit must be >= 0 (0: all), got ", max_requests);
    require(block_tokens >= 1 && block_tokens <= (1 << 20),
            "the trace's block size must be in [1, 2^20] tokens, got ", block_tokens);
    require(block_tokens > 0, "trace: block_tokens must be positive, got ", block_tokens);
    Trace t;
    t.source = source;
    t.block_tokens = block_tokens;
    std::string line;
    int64_t line_no = 0;
    double prev = 0;
    while (std::getline(in, line)) {
        ++line_no;
        if (blank(line)) continue;
        TraceRequest r;
        std::string what = parse_line(line, block_tokens, prev, r, t.hashes);
        if (!what.empty()) {
            if (on_error == TraceErrorPolicy::kFail)
                throw Error(detail::concat(source, ":", line_no, ": malformed trace line: ", what,
                                           " (use --on-error skip to skip such lines)"));
            t.skipped.push_back({line_no, std::move(what)});
            continue;
        }
        r.line = line_no;
        prev = r.arrival_s;
        t.requests.push_back(r);
        if (max_requests > 0 && static_cast<int64_t>(t.requests.size()) >= max_requests) break;
    }
    require(!in.bad(), source, ": read error after line ", line_no);
    return t;
}

Trace load_trace(const std::string& path, TraceErrorPolicy on_error, int block_tokens,
                 int64_t max_requests) {
    std::error_code ec;
    require(!std::filesystem::is_directory(path, ec), "trace file '", path,
            "' is a directory; expected a JSON-lines file");
    std::ifstream f(path);
    require(f.good(), "cannot open trace file '", path, "'");
    return parse_trace(f, path, on_error, block_tokens, max_requests);
}

HitRates infinite_cache_hit_rates(const Trace& trace) {
    HitRates h;
    std::unordered_set<BlockHash, BlockHashHasher> seen;
    seen.reserve(trace.hashes.size());
    const int64_t bt = trace.block_tokens;
    for (const auto& r : trace.requests) {
        const auto blocks = trace.blocks(r);
        const int64_t n = static_cast<int64_t>(blocks.size());
        int64_t hit = 0;
        while (hit < n && seen.count(blocks[static_cast<size_t>(hit)])) ++hit;
        h.hit_blocks += hit;
        h.hit_tokens += hit == n ? r.input_tokens : hit * bt;
        h.total_blocks += n;
        h.total_tokens += r.input_tokens;
        seen.insert(blocks.begin(), blocks.end());
    }
    h.token_hit_rate = h.total_tokens ? static_cast<double>(h.hit_tokens) / h.total_tokens : 0.0;
    h.block_hit_rate = h.total_blocks ? static_cast<double>(h.hit_blocks) / h.total_blocks : 0.0;
    return h;
}

}  // namespace kvshard
