// The tiny model under CP x TP against the unsharded model: logits within 1e-4 relative and the
// same greedy tokens for 32 steps, for every CP size, scheme, with and without a cached prefix;
// ring bytes against the cost model; a prefix cached at cp=4 reused at cp=2 and cp=1 without
// recomputation.
#include <gtest/gtest.h>

#include <map>
#include <mutex>
#include <random>

#include "kvshard/comm/threads.h"
#include "kvshard/exec/cp_session.h"
#include "kvshard/model/catalog.h"
#include "kvshard/planner/cost_model.h"
#include "kvshard/serve/generate.h"
#include "kvshard/serve/verify.h"

namespace kvshard {
namespace {

constexpr int kSteps = 32;
constexpr int kBlock = 4;
constexpr uint64_t kSeed = 1234;

const ModelSpec& tiny() {
    static const ModelSpec m = catalog_model("tiny");
    return m;
}
const TensorSource& weights() {
    static const auto src = random_tensor_source(kSeed);
    return *src;
}

std::vector<int32_t> tokens(int n, unsigned seed) {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int32_t> d(0, tiny().vocab - 1);
    std::vector<int32_t> t(n);
    for (auto& x : t) x = d(rng);
    return t;
}

struct Reference {
    std::vector<float> prefill_logits, last_logits;
    std::vector<int32_t> tokens;
};

// The unsharded model (the model helper's executor, cp = tp = 1).
const Reference& reference(const std::vector<int32_t>& prompt) {
    static std::map<std::vector<int32_t>, Reference> memo;
    auto it = memo.find(prompt);
    if (it != memo.end()) return it->second;
    GenerationOptions o;
    o.block_size = kBlock;
    o.prefix_cache = false;
    Reference r;
    o.max_new_tokens = 1;
    r.prefill_logits = generate(tiny(), ParallelConfig{}, weights(), {prompt}, o).last_logits[0];
    o.max_new_tokens = kSteps;
    const auto full = generate(tiny(), ParallelConfig{}, weights(), {prompt}, o);
    r.tokens = full.tokens[0];
    r.last_logits = full.last_logits[0];
    return memo.emplace(prompt, r).first->second;
}

ParallelConfig config(int cp, int tp, CpScheme s) {
    ParallelConfig p;
    p.cp = cp;
    p.tp = tp;
    p.cp_scheme = s;
    p.cp_interleave = kBlock;
    return p;
}

CpOptions options() {
    CpOptions o;
    o.block_size = kBlock;
    o.num_blocks = 64;
    return o;
}

struct Outcome {
    std::vector<float> prefill_logits, last_logits;
    std::vector<int32_t> tokens;
    int64_t cached_tokens = 0;
    int64_t computed_total = 0;
};

void expect_matches(const Outcome& got, const Reference& want, const std::string& what) {
    EXPECT_LT(relative_l2(got.prefill_logits, want.prefill_logits), 1e-4) << what;
    EXPECT_LT(relative_l2(got.last_logits, want.last_logits), 1e-4) << what;
    EXPECT_EQ(got.tokens, want.tokens) << what;
}

// Serves `first` (then `second`, as a continuation of the same sequence when `continue_seq`, else
// as a new request after `first` was released) and decodes kSteps - 1 tokens after the last
// prefill.
Outcome serve(const ParallelConfig& p, const std::vector<int32_t>& first,
              const std::vector<int32_t>& second, bool continue_seq, CpDecodeMerge merge,
              std::optional<CpPrefillMode> mode = {}) {
    Outcome out;
    std::mutex mu;
    run_threads(p.world_size(), [&](Communicator& w) {
        CpOptions o = options();
        o.decode_merge = merge;
        o.prefill_mode = mode;
        CpDevice dev(tiny(), p.tp, rank_coord(p, w.rank()).tp, weights(), o);
        CpSession s(dev, w, p, o);
        std::vector<float> logits;
        SeqId seq = 0;
        if (!second.empty()) {
            logits = s.prefill(seq, first);
            if (!continue_seq) {
                s.release(seq);
                seq = 1;
            }
        }
        logits = s.prefill(seq, second.empty() ? first : second);
        const int64_t cached = s.last_step().cached_tokens;
        const int64_t computed = w.all_reduce_value<int64_t>(
            rank_coord(p, w.rank()).tp == 0 ? s.last_step().computed_tokens : 0, ReduceOp::kSum);
        Outcome o2;
        o2.prefill_logits = logits;
        o2.tokens.push_back(argmax(logits));
        for (int step = 1; step < kSteps; ++step) {
            logits = s.decode(seq, o2.tokens.back());
            o2.tokens.push_back(argmax(logits));
        }
        o2.last_logits = logits;
        o2.cached_tokens = cached;
        o2.computed_total = computed;
        std::lock_guard lk(mu);
        if (w.rank() == 0) out = o2;
        // every rank agrees
        EXPECT_EQ(o2.tokens, out.tokens.empty() ? o2.tokens : out.tokens);
    });
    return out;
}

std::string name(const ParallelConfig& p, bool cached) {
    return p.to_string() + (cached ? " cached prefix" : " no cache");
}

const CpScheme kSchemes[] = {CpScheme::kContiguous, CpScheme::kZigzag, CpScheme::kInterleave};

TEST(CpModel, MatchesUnshardedWithoutCachedPrefix) {
    const auto prompt = tokens(21, 1);
    const Reference& want = reference(prompt);
    for (int cp : {1, 2, 3, 4, 8})
        for (int tp : {1, 2})
            for (CpScheme s : kSchemes) {
                const auto p = config(cp, tp, s);
                const auto got = serve(p, prompt, {}, false, CpDecodeMerge::kAllGather);
                expect_matches(got, want, name(p, false));
                EXPECT_EQ(got.cached_tokens, 0);
                EXPECT_EQ(got.computed_total, 21);
            }
}

TEST(CpModel, MatchesUnshardedWithCachedPrefix) {
    // contiguous / zigzag: a second turn of the same sequence (13 tokens stored, 9 new);
    // interleave by block: a new request whose first 4 blocks another request left in the cache.
    const auto a = tokens(13, 2), b = tokens(9, 3);
    std::vector<int32_t> whole = a;
    whole.insert(whole.end(), b.begin(), b.end());
    const Reference& want = reference(whole);
    std::vector<int32_t> other = std::vector<int32_t>(whole.begin(), whole.begin() + 16);
    const auto tail = tokens(5, 4);
    other.insert(other.end(), tail.begin(), tail.end());  // shares blocks 0..3 with `whole`
    for (int cp : {1, 2, 3, 4, 8})
        for (int tp : {1, 2})
            for (CpScheme s : kSchemes) {
                const auto p = config(cp, tp, s);
                const bool via_cache = s == CpScheme::kInterleave;
                const auto got = via_cache ? serve(p, other, whole, false, CpDecodeMerge::kAllToAll)
                                           : serve(p, a, b, true, CpDecodeMerge::kAllToAll);
                expect_matches(got, want, name(p, true));
                EXPECT_EQ(got.cached_tokens, via_cache ? 16 : 13) << name(p, true);
                EXPECT_EQ(got.computed_total, via_cache ? 22 - 16 : 9) << name(p, true);
            }
}

TEST(CpModel, PassQAndPassKvGiveTheSameTokens) {
    const auto a = tokens(17, 5), b = tokens(3, 6);
    std::vector<int32_t> whole = a;
    whole.insert(whole.end(), b.begin(), b.end());
    const Reference& want = reference(whole);
    for (CpPrefillMode m : {CpPrefillMode::kPassKv, CpPrefillMode::kPassQ})
        for (CpScheme s : kSchemes) {
            const auto p = config(4, 2, s);
            expect_matches(serve(p, a, b, true, CpDecodeMerge::kAllGather, m), want,
                           name(p, true) + " " + std::string(cp_prefill_mode_name(m)));
        }
}

TEST(CpModel, RingBytesEqualTheCostModel) {
    const auto prompt = tokens(23, 7);
    for (int cp : {2, 3, 4, 8})
        for (int tp : {1, 2})
            for (CpScheme s : kSchemes) {
                const auto p = config(cp, tp, s);
                run_threads(p.world_size(), [&](Communicator& w) {
                    CpOptions o = options();
                    o.prefill_mode = CpPrefillMode::kPassKv;
                    CpDevice dev(tiny(), p.tp, rank_coord(p, w.rank()).tp, weights(), o);
                    CpSession sess(dev, w, p, o);
                    sess.prefill(0, prompt);
                    const CpCommStats& st = sess.last_step().comm;
                    const auto want =
                        cp_pass_kv_bytes(sess.layout(), w.rank(), cp_prompt_map(p, 23));
                    EXPECT_EQ(st.ring, want.ring) << p.to_string() << " rank " << w.rank();
                    // ... and the planner's cost model (the foundation issue's formula)
                    EXPECT_EQ(st.ring, cp_pass_kv_bytes_sent(make_layout(tiny(), p), w.rank(), 23))
                        << p.to_string() << " rank " << w.rank();
                    EXPECT_GT(st.ring, 0);
                    EXPECT_EQ(st.all_to_all, 0);
                });
            }
}

TEST(CpModel, CachedPrefixHitLengthAgreesOnEveryRank) {
    const auto first = tokens(30, 8);
    std::vector<int32_t> second(first.begin(), first.begin() + 22);  // 5 full blocks shared
    const auto tail = tokens(7, 9);
    second.insert(second.end(), tail.begin(), tail.end());
    for (int cp : {2, 3, 4}) {
        const auto p = config(cp, 1, CpScheme::kInterleave);
        run_threads(cp, [&](Communicator& w) {
            CpOptions o = options();
            CpDevice dev(tiny(), 1, 0, weights(), o);
            CpSession s(dev, w, p, o);
            s.prefill(0, first);
            s.release(0);
            s.prefill(1, second);
            // global hit: 5 blocks (tokens 0..19); rank c holds exactly its blocks among them
            EXPECT_EQ(s.last_step().cached_tokens, 5 * kBlock);
            EXPECT_EQ(s.last_step().local_hit_blocks, cp_local_blocks(5, cp, s.cp_rank()));
        });
    }
}

// Four devices serve a request at cp=4; a later request sharing its first blocks is served at cp=2
// (devices 0 and 1; 2 and 3 lend their blocks), then at cp=1.
TEST(CpModel, PrefixCachedAtCp4IsReusedAtCp2AndCp1WithoutRecomputation) {
    const auto first = tokens(37, 10);
    std::vector<int32_t> second(first.begin(), first.begin() + 32);  // 8 full blocks shared
    const auto tail = tokens(6, 11);
    second.insert(second.end(), tail.begin(), tail.end());
    const Reference& want = reference(second);
    std::mutex mu;
    run_threads(4, [&](Communicator& w) {
        CpOptions o = options();
        CpDevice dev(tiny(), 1, 0, weights(), o);
        {
            CpSession s4(dev, w, config(4, 1, CpScheme::kInterleave), o);
            s4.prefill(0, first);
            s4.release(0);
        }
        for (int cp : {2, 1}) {
            CpSession s(dev, w, config(cp, 1, CpScheme::kInterleave), o);
            const SeqId seq = 10 + cp;
            auto logits = s.prefill(seq, second);
            const CpStepStats st = s.last_step();
            // moves are exactly the plan's: from the cp=4 holder of each block to its cp owner
            const auto plan = plan_cp_prefix_reuse(cp == 2 ? 4 : 2, cp, 8);
            const int me = w.rank();
            int64_t in = 0, out = 0;
            for (const auto& m : plan.moves) {
                in += m.dst == me;
                out += m.src == me;
            }
            if (cp == 2) {
                EXPECT_EQ(st.blocks_moved_in, in) << "rank " << me;
                EXPECT_EQ(st.blocks_moved_out, out) << "rank " << me;
            }
            // Nothing shared is recomputed: the serving ranks ran exactly the tokens after the hit.
            const int64_t computed =
                w.all_reduce_value<int64_t>(s.serving() ? st.computed_tokens : 0, ReduceOp::kSum);
            if (!s.serving()) continue;
            // cp=2 finds the 8 blocks of the cp=4 request; cp=1 also the 9th, which cp=2 stored.
            const int64_t hit = cp == 2 ? 32 : 36;
            EXPECT_EQ(st.cached_tokens, hit);
            EXPECT_EQ(computed, 38 - hit);
            std::vector<int32_t> toks = {argmax(logits)};
            const auto prefill_logits = logits;
            for (int step = 1; step < kSteps; ++step) {
                logits = s.decode(seq, toks.back());
                toks.push_back(argmax(logits));
            }
            std::lock_guard lk(mu);
            EXPECT_LT(relative_l2(prefill_logits, want.prefill_logits), 1e-4) << "cp=" << cp;
            EXPECT_LT(relative_l2(logits, want.last_logits), 1e-4) << "cp=" << cp;
            EXPECT_EQ(toks, want.tokens) << "cp=" << cp;
            s.release(seq);
        }
    });
}

}  // namespace
}  // namespace kvshard

namespace kvshard {
namespace {
TEST(CpModel, AutomaticPrefillModeFollowsTheByteRule) {
    // tiny: threshold 0.4706. A full prefill passes KV; a 3-token turn after 17 passes Q.
    const auto p = config(4, 1, CpScheme::kZigzag);
    run_threads(4, [&](Communicator& w) {
        CpOptions o = options();
        CpDevice dev(tiny(), 1, 0, weights(), o);
        CpSession s(dev, w, p, o);
        s.prefill(0, tokens(17, 12));
        EXPECT_EQ(s.last_step().mode, CpPrefillMode::kPassKv);
        EXPECT_GT(s.last_step().comm.ring, 0);
        s.prefill(0, tokens(3, 13));
        EXPECT_EQ(s.last_step().mode, CpPrefillMode::kPassQ);
        EXPECT_EQ(s.last_step().comm.total(),
                  cp_pass_q_bytes(s.layout(), w.rank(), s.token_map(0), 17).total());
        s.prefill(0, tokens(30, 14));  // 30 / 50 = 0.6 > 0.47: back to pass-KV
        EXPECT_EQ(s.last_step().mode, CpPrefillMode::kPassKv);
        EXPECT_EQ(s.last_step().comm.ring,
                  cp_pass_kv_bytes(s.layout(), w.rank(), s.token_map(0)).ring);
    });
}
}  // namespace
}  // namespace kvshard

namespace kvshard {
namespace {
// The plan's pass-Q and decode bytes are the session's. tiny-hybrid, 3 Gated DeltaNet layers and
// 1 full-attention layer: a state layer runs no ring and no merge (docs/context-parallel.md §8: its
// rows are all-gathered instead), so the ring, the all-to-all and the merge carry that one layer's
// bytes (the plan counted all 4 layers before 2026-12-05). tiny-mla, run absorbed: queries and
// prefill partials of kv_lora_rank + qk_rope_head_dim = 40, decode partials of kv_lora_rank = 32
// (the plan counted head_dim = 16 for each before).
TEST(CpModel, PlanBytesEqualTheSessionForStateAndMlaLayers) {
    const auto p = config(2, 1, CpScheme::kZigzag);
    for (const char* name : {"tiny-hybrid", "tiny-mla"}) {
        const ModelSpec model = catalog_model(name);
        for (CpDecodeMerge merge : {CpDecodeMerge::kAllGather, CpDecodeMerge::kAllToAll}) {
            run_threads(2, [&](Communicator& w) {
                CpOptions o = options();
                o.prefill_mode = CpPrefillMode::kPassQ;
                o.decode_merge = merge;
                CpDevice dev(model, 1, 0, weights(), o);
                CpSession s(dev, w, p, o);
                s.prefill(0, tokens(16, 31));
                ASSERT_EQ(s.last_step().mode, CpPrefillMode::kPassQ);
                const CpPrefillBytes want =
                    cp_pass_q_bytes(s.layout(), w.rank(), s.token_map(0), 0);
                // 8 query rows of 8 heads, fp32: tiny-hybrid 1 layer of 8, tiny-mla 2 of 40.
                EXPECT_EQ(want.ring,
                          std::string(name) == "tiny-mla" ? 2 * 8 * 8 * 40 * 4 : 8 * 8 * 8 * 4);
                EXPECT_EQ(s.last_step().comm.ring, want.ring) << name;
                EXPECT_EQ(s.last_step().comm.all_to_all, want.all_to_all) << name;
                s.decode(0, 5);
                EXPECT_EQ(s.last_step().comm.total(),
                          cp_decode_merge_bytes(s.layout(), w.rank(), merge))
                    << name << " " << cp_decode_merge_name(merge);
            });
        }
    }
}
}  // namespace
}  // namespace kvshard
