#pragma once
// ParallelConfig: how a deployment is cut. A value with ==, JSON and a one-line string.
//
// Rank order (docs/layout.md): tp varies fastest, then cp, then pp, then dp:
//   rank = ((dp_idx * pp + pp_idx) * cp + cp_idx) * tp + tp_idx,   world_size = dp * pp * cp * tp.
// EP does not add GPUs: it spreads the routed experts of each MoE layer over `ep` of the
// dp*cp*tp ranks of one pipeline stage (vLLM/SGLang style: TP=4 x DP=2 with EP=8 is 8 GPUs).
// Within a stage, ranks are numbered local = (dp_idx * cp + cp_idx) * tp + tp_idx;
// ep_idx = local % ep and ep_group = local / ep.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kvshard {

// Which CP rank owns which token of a sequence (docs/layout.md):
//  kContiguous: cp equal segments; kZigzag: 2*cp chunks, rank r holds chunks r and 2*cp-1-r;
//  kInterleave: token t lives on rank (t / cp_interleave) % cp.
enum class CpScheme { kContiguous, kZigzag, kInterleave };
std::string_view cp_scheme_name(CpScheme s);
CpScheme parse_cp_scheme(std::string_view s);  // contiguous|zigzag|interleave

struct ParallelConfig {
    int dp = 1;
    int pp = 1;
    int cp = 1;
    int tp = 1;
    int ep = 1;
    CpScheme cp_scheme = CpScheme::kContiguous;
    int cp_interleave = 1;  // tokens per round-robin unit under kInterleave
    // Explicit decoder layers per stage (ModelSpec::num_decoder_layers); empty: as even as possible
    std::vector<int> pp_layers;

    // The most ranks a layout may have (and the most of any one size): a layout holds a record per
    // rank, so this bounds its memory (docs/cli-inputs.md).
    static constexpr int kMaxWorldSize = 1 << 20;
    // Throws Error unless every size is in [1, kMaxWorldSize], cp_interleave in [1, 2^30] and
    // dp*pp*cp*tp <= kMaxWorldSize.
    void validate_sizes() const;

    int world_size() const { return dp * pp * cp * tp; }
    int stage_size() const { return dp * cp * tp; }  // ranks of one pipeline stage
    bool operator==(const ParallelConfig&) const = default;

    // "dp=1 pp=2 cp=1 tp=8 ep=1" (+ cp scheme when cp > 1, + pp split when explicit)
    std::string to_string() const;
};

// The divisors of n >= 1, ascending (O(sqrt n)).
std::vector<int> divisors(int n);

// Parses "tp=8,pp=2,cp=4,dp=1,ep=1,cp_scheme=zigzag,cp_interleave=16,pp_layers=10/12/10"
// (comma or space separated, any order, any subset). Throws Error on an unknown key or a bad value.
ParallelConfig parse_parallel_config(std::string_view text);

std::string to_json(const ParallelConfig& p);

struct RankCoord {
    int rank = 0;
    int dp = 0, pp = 0, cp = 0, tp = 0;
    int ep = 0;        // index within its EP group
    int ep_group = 0;  // which EP group of its stage
    bool operator==(const RankCoord&) const = default;
};

RankCoord rank_coord(const ParallelConfig& p, int rank);
int rank_of(const ParallelConfig& p, int dp, int pp, int cp, int tp);

}  // namespace kvshard
