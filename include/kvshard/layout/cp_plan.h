#pragma once
// Context parallelism (CP) as pure plans: who stores which token, what travels round the ring,
// pass-KV vs pass-Q, decode placement, and prefix-cache reuse across CP sizes.
// Formulas, rules and their derivations: docs/context-parallel.md.
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvshard/layout/kv_layout.h"
#include "kvshard/layout/parallel_config.h"

namespace kvshard {

// ---------------------------------------------------------------------------------------------
// Token placement of one sequence.

// One run of positions [begin, end) placed by one rule:
//  kContiguous / kZigzag: the rule of cp_owner applied to the run alone (seq_len = end - begin,
//    position pos - begin), so that placing new tokens never moves tokens stored earlier;
//  kInterleave: owner = (pos / unit) % cp on the GLOBAL position (runs of one unit compose).
struct CpSegment {
    int64_t begin = 0;
    int64_t end = 0;
    CpScheme scheme = CpScheme::kContiguous;
    int unit = 1;  // kInterleave only
    bool operator==(const CpSegment&) const = default;
};

// Which CP rank stores each token of one sequence. A token's owner is fixed when it is first stored
// and never changes as the sequence grows (a cached prefix stays where it is).
class CpTokenMap {
  public:
    CpTokenMap() = default;
    explicit CpTokenMap(int cp);

    int cp() const { return cp_; }
    int64_t size() const { return segments_.empty() ? 0 : segments_.back().end; }
    const std::vector<CpSegment>& segments() const { return segments_; }

    // Appends n tokens placed by `scheme` (prompt or the new tokens of a partial prefill).
    void append(int64_t n, CpScheme scheme, int unit = 1);
    // Appends n generated tokens by the decode rule: position t goes to CP rank (t / unit) % cp,
    // unit = the KV block size (or the interleave unit under kInterleave). docs §5.
    void append_generated(int64_t n, int unit);

    int owner(int64_t pos) const;
    // Ascending global positions of [begin, end) (end < 0: the whole sequence) stored on cp_rank.
    std::vector<int64_t> positions(int cp_rank, int64_t begin = 0, int64_t end = -1) const;
    // The same positions as ascending, disjoint, maximal runs (adjacent runs merged).
    std::vector<TokenRange> ranges(int cp_rank, int64_t begin = 0, int64_t end = -1) const;
    int64_t count(int cp_rank, int64_t begin = 0, int64_t end = -1) const;

    bool operator==(const CpTokenMap&) const = default;

  private:
    int cp_ = 1;
    std::vector<CpSegment> segments_;
};

// The placement of a prompt of n tokens under p (one segment of p.cp_scheme, unit p.cp_interleave).
// Equals cp_owner(p, n, pos) for every pos.
CpTokenMap cp_prompt_map(const ParallelConfig& p, int64_t n);
// Tokens CP rank cp_rank stores of a prompt of n tokens under p: cp_tokens_before(p, cp_rank, n, n)
// (kv_layout.h, equal to the sizes of cp_token_ranges summed, without listing them), the one count
// used by the executors, `kvshard cp-plan`, capacity and the cost model.
int64_t cp_token_count(const ParallelConfig& p, int cp_rank, int64_t n);

// ---------------------------------------------------------------------------------------------
// The ring (pass-KV: KV shards travel; pass-Q: query shards travel).

// At step s = 0..cp-1 CP rank c works on the shard that CP rank (c - s) mod cp owns; at step
// s <= cp-2 it sends that shard to (c + 1) mod cp and receives shard (c - s - 1) mod cp from
// (c - 1) mod cp, so after cp-1 steps every rank has seen every shard exactly once.
struct CpRingStep {
    int step = 0;
    int holds = 0;      // CP rank whose shard is worked on in this step
    int sends = -1;     // CP rank whose shard is sent to next(), -1 in the last step
    int receives = -1;  // CP rank whose shard arrives from prev(), -1 in the last step
    bool operator==(const CpRingStep&) const = default;
};
int cp_ring_next(int cp, int cp_rank);
int cp_ring_prev(int cp, int cp_rank);
std::vector<CpRingStep> cp_ring_schedule(int cp, int cp_rank);
// The ring steps a layer of a sequence placed by `map` needs: 1 + the last step s at which some CP
// rank's new queries (positions >= new_begin) see a key of the CP rank s behind it, causally and
// within a sliding window of `window` tokens (keys (p - W, p]) or, chunked, the query's chunk of
// `window` tokens; window 0 (full attention, MLA): cp. The ring stops after that step: later
// steps would move shards no query attends to (docs/context-parallel.md §8).
int cp_window_ring_steps(const CpTokenMap& map, int64_t new_begin, bool chunked, int window);
// The same for pass-Q, whose ring carries the queries: at step s rank c pairs the new queries of
// the CP rank s behind it with its own keys, so the step is needed when some rank's queries see a
// key of the rank s ahead of it (cyclically). Mirror image of cp_window_ring_steps: the two agree
// where placement is symmetric (zigzag), not for contiguous or interleaved shards at cp >= 3.
int cp_pass_q_window_ring_steps(const CpTokenMap& map, int64_t new_begin, bool chunked, int window);
// Both counts {pass-KV, pass-Q} for a whole prompt of n tokens placed by p (cp_prompt_map), as the
// planner asks them for every configuration. Interleaved placements are periodic (period
// unit x cp, and the chunk length for chunked windows), so the count over n tokens equals the
// count over the first min(n, period + window) tokens: every later query's window and owners
// repeat an earlier one's. The others are counted over the map itself.
std::pair<int, int> cp_prompt_window_ring_steps(const ParallelConfig& p, int64_t n, bool chunked,
                                                int window);

// Attention work of a CP prefill: the (query, key) pairs each CP rank computes for a prompt of n
// tokens placed by p, its queries against every key they see (causal; window > 0: the last
// `window` positions, or chunked, the query's chunk of `window`), summed exactly over the rank's
// runs of positions. {total over ranks, the busiest rank's}: a ring runs at its busiest rank's
// pace, so a CP prefill's attention time is busiest / total of the unsharded work, not 1 / cp:
// contiguous shards leave the last rank (2 cp - 1) / cp^2 of a full-attention prompt, zigzag
// balances it to 1 / cp when 2 cp divides n (docs/context-parallel.md §8). An interleaved
// placement of more than 65,536 periods (unit x cp) is taken as balanced under full or sliding
// attention (busiest = total / cp; its exact imbalance is below 1 / periods); under chunked
// attention it is counted over one span of lcm(period, window) positions and scaled (taken as
// balanced too where that span is over 2^24 positions or half the prompt). Counted in 128 bits and
// returned as doubles: exact up to 2^53 pairs (prompts of about 2^26 tokens, every length the
// executors take), close beyond (a planner context may be 2^40 tokens).
struct CpAttentionPairs {
    double total = 0;
    double busiest = 0;
    bool operator==(const CpAttentionPairs&) const = default;
};
CpAttentionPairs cp_prompt_attention_pairs(const ParallelConfig& p, int64_t n, bool chunked,
                                           int window);

// Decode under CP: the keys the newest token of a sequence sees on its busiest CP rank. The first
// `prompt` positions were placed by p (cp_prompt_map), the rest generated
// (CpTokenMap::append_generated, unit p.cp_interleave under the interleave scheme, else
// block_size); the token at position context - 1 sees [first_visible, context). Full attention
// (first_visible 0) is balanced to within a unit; a windowed layer's window lies in the last
// positions of the sequence, so one rank may hold all of it (the last chunk of a contiguous or
// zigzag prompt belongs to one rank).
int64_t cp_decode_busiest_keys(const ParallelConfig& p, int64_t prompt, int64_t context,
                               int block_size, int64_t first_visible);

// Whether some query at q_pos sees some key at kv_pos (both ascending): causally (key <= query)
// and, under a window (window > 0), inside it (sliding: the last `window` positions; chunked: the
// query's chunk). A shard pair that does not is skipped: no ring step, no partial returned.
bool cp_shard_sees(std::span<const int64_t> q_pos, std::span<const int64_t> kv_pos, bool chunked,
                   int window);
// The same over runs of positions (CpTokenMap::ranges): O(runs of q x log runs of kv), so the
// planner can ask it of a million-token prompt.
bool cp_shard_sees(std::span<const TokenRange> q, std::span<const TokenRange> kv, bool chunked,
                   int window);

// Bytes rank `rank` of `layout` sends for one sequence placed by `map`, all its layers together.
// Queries travel and partials merge only in the layers that attend over tokens (its token-holding
// KV groups); state layers and layers without KV add nothing (Falcon-H1: 44 of 88 cache layers).
struct CpPrefillBytes {
    int64_t ring = 0;        // pass-KV: K/V shards; pass-Q: query shards
    int64_t all_to_all = 0;  // pass-Q only: partial outputs + LSEs returned to the query owners
    int64_t total() const { return ring + all_to_all; }
};
// pass-KV: sum over layers of KV(all map.size() tokens) - KV(shard of next rank). Equals the
// planner's cp_pass_kv_bytes_sent(layout, rank, n) when map == cp_prompt_map(layout.parallel, n).
CpPrefillBytes cp_pass_kv_bytes(const KvLayout& layout, int rank, const CpTokenMap& map);
// pass-Q for the new tokens [new_begin, map.size()): Q of those tokens minus the next rank's,
// in the KV dtype (windowed groups: only the steps cp_pass_q_window_ring_steps runs); then, for
// the new tokens of every other rank whose queries see one of this rank's keys (cp_shard_sees,
// per layer kind), the fp32 partial output (D) and fp32 LSE per query head. D is each layer's
// head_dim; MLA runs absorbed: queries and partials of kv_lora_rank + qk_rope_head_dim.
CpPrefillBytes cp_pass_q_bytes(const KvLayout& layout, int rank, const CpTokenMap& map,
                               int64_t new_begin);

enum class CpPrefillMode { kPassKv, kPassQ };
std::string_view cp_prefill_mode_name(CpPrefillMode m);   // "pass-kv" | "pass-q"
CpPrefillMode parse_cp_prefill_mode(std::string_view s);  // pass-kv|pass-q; throws Error

// The automatic choice for a partial prefill with `cached` tokens already stored and `fresh` new
// ones (Meta, arXiv:2411.01783): pass-Q iff its total bytes over all ranks are strictly smaller,
// which is iff fresh / (cached + fresh) < cp_pass_q_threshold(layout). cp = 1: pass-KV (no ring).
struct CpPrefillChoice {
    CpPrefillMode mode = CpPrefillMode::kPassKv;
    double new_fraction = 1.0;  // fresh / (cached + fresh)
    double threshold = 0.0;     // cp_pass_q_threshold
    int64_t pass_kv_bytes = 0;  // totals over all ranks of the layout
    // Meta's count: every rank's partials returned to every other. The ring returns only those
    // that see a key (cp_pass_q_bytes), so this is an upper bound, equal to the sum of
    // cp_pass_q_bytes where every rank holds a key before every new query (a cached prefix
    // spread over all ranks, full attention).
    int64_t pass_q_bytes = 0;
};
// 2 * Hkv_r * e_kv * D / (Hq_r * (e_kv * D + 4 * D + 4)), summed over the layers of one CP slice
// (the denominator over its token-holding layers only).
double cp_pass_q_threshold(const KvLayout& layout);
CpPrefillChoice choose_cp_prefill(const KvLayout& layout, int64_t cached, int64_t fresh);
// The same choice from one placement's exact bytes, what the executor sends: pass_kv_bytes and
// pass_q_bytes are the sums over the layout's ranks of cp_pass_kv_bytes(map) and
// cp_pass_q_bytes(map, cached), so a windowed group's shortened ring and the partials that see no
// key are left out; pass-Q iff strictly fewer. Where Meta's count is exact (full attention, a
// cached prefix spread over every rank) it agrees with the closed form; elsewhere it can differ
// (a full prefill of contiguous shards returns half of Meta's partials). new_fraction and
// threshold are the closed form's. Throws Error when map holds no new token after `cached`.
CpPrefillChoice choose_cp_prefill(const KvLayout& layout, const CpTokenMap& map, int64_t cached);

// ---------------------------------------------------------------------------------------------
// Decode: every CP rank attends the new queries to its own shard and the (O, LSE) partials are
// merged exactly.
enum class CpDecodeMerge {
    kAllGather,  // all-gather every partial, every rank merges all heads
    kAllToAll,   // Helix: all-to-all over heads, each rank merges its heads, all-gather merged O
};
std::string_view cp_decode_merge_name(CpDecodeMerge m);  // "all-gather" | "all-to-all"
CpDecodeMerge parse_cp_decode_merge(std::string_view s);
// Query heads [begin, end) that CP rank c merges in the Helix form (num_heads split as evenly as
// possible; some ranks get none when num_heads < cp).
TokenRange cp_helix_heads(int num_heads, int cp, int cp_rank);
// Bytes one rank sends per decoded token, all its token-holding layers (no merge in a state layer),
// under each merge (fp32 O and LSE of each layer's head_dim; MLA: of kv_lora_rank).
int64_t cp_decode_merge_bytes(const KvLayout& layout, int rank, CpDecodeMerge merge);

// ---------------------------------------------------------------------------------------------
// Work balance: number of (query, visible key) pairs each CP rank computes when the queries are
// the positions [q_begin, map.size()) it owns and every key at a position <= the query's is visible
// (the causal attention work; FLOPs = 4 * pairs * Hq * D). O(runs); Error where a rank's pairs
// exceed 2^63 - 1 (sequences of more than about 2^32 tokens).
std::vector<int64_t> cp_causal_pairs(const CpTokenMap& map, int64_t q_begin = 0);

// ---------------------------------------------------------------------------------------------
// Prefix cache under CP: block-granular interleave (unit = block size B) puts global block b on CP
// rank b % cp, so the cached prefix of k blocks is on rank r exactly its local blocks
// 0 .. cp_local_blocks(k, cp, r) - 1: a prefix on every rank at once.
int64_t cp_local_blocks(int64_t global_blocks, int cp, int cp_rank);

// Reusing a prefix of `blocks` global blocks cached at CP size src_cp (block b on CP rank b %
// src_cp) for a request served at dst_cp (block b needed on CP rank b % dst_cp). CP rank i of the
// destination group is the same device as CP rank i of the source group (same dp, pp, tp). Blocks
// already in place stay; the others are moved, none is recomputed.
struct CpBlockMove {
    int64_t block = 0;  // global block index
    int src = 0;        // CP rank in the source group
    int dst = 0;        // CP rank in the destination group
    bool operator==(const CpBlockMove&) const = default;
};
struct CpPrefixReusePlan {
    int src_cp = 1;
    int dst_cp = 1;
    int64_t blocks = 0;
    int64_t kept = 0;                // blocks already on their destination device
    std::vector<CpBlockMove> moves;  // ascending block
};
CpPrefixReusePlan plan_cp_prefix_reuse(int src_cp, int dst_cp, int64_t blocks);

// The general form that CpSession carries out, for prefix blocks cached anywhere: holders[b] lists
// the devices (ascending) that hold global block b, and device dst_device[c] serves CP rank c
// (dst_cp = dst_device.size()). Block b stays where dst_device[b % dst_cp] holds it, else moves
// from its lowest holder; src and dst of the moves are device ids. plan_cp_prefix_reuse is this
// with holders[b] = {b % src_cp} and dst_device[c] = c. Every holders[b] must be non-empty.
CpPrefixReusePlan plan_cp_prefix_moves(const std::vector<std::vector<int>>& holders,
                                       const std::vector<int>& dst_device);

std::string to_json(const CpPrefixReusePlan& plan);

// The plan of one request under CP, as `kvshard cp-plan --json` prints it and kvshard.cp_plan
// returns it (docs/context-parallel.md §9): model, parallel, cached, new, the automatic prefill
// choice, per rank of DP replica 0 its tokens, new tokens, causal pairs, pass-KV and pass-Q bytes
// and decode merge bytes, and with reuse_from > 0 the prefix-reuse plan from that CP size over the
// cached blocks of block_size tokens (else null). Error on invalid input (cached < 0, fresh < 1,
// block_size outside [1, 2^20], reuse_from outside [0, 2^20], a reuse plan of more than
// kMaxCpReuseBlocks blocks, causal pairs past 2^63 - 1, or a model and layout that do not fit).
inline constexpr int64_t kMaxCpReuseBlocks = int64_t{1} << 20;
std::string cp_plan_report_json(const ModelSpec& m, const ParallelConfig& p, int64_t cached,
                                int64_t fresh, int block_size, int reuse_from);

}  // namespace kvshard
