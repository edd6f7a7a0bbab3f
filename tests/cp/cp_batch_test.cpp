// Batches under CP against the unsharded model: a batch of 4 requests of different prompt lengths,
// with cached prefixes (a continuation of a sequence, a prefix-cache hit on another request's
// blocks), prefilled in one forward and decoded together (one merge per layer for the batch),
// for every scheme, TP and merge; and continuous batching in the CP runner, requests joining
// mid-decode, for every layer kind. Identical greedy tokens for every request, last-step logits
// within 1e-4 relative L2.
#include <gtest/gtest.h>

#include <map>
#include <mutex>
#include <random>

#include "kvshard/comm/threads.h"
#include "kvshard/common/error.h"
#include "kvshard/exec/cp_session.h"
#include "kvshard/model/catalog.h"
#include "kvshard/serve/generate.h"
#include "kvshard/serve/verify.h"

namespace kvshard {
namespace {

constexpr int kSteps = 24;
constexpr int kBlock = 4;

const ModelSpec& tiny() {
    static const ModelSpec m = catalog_model("tiny");
    return m;
}
const TensorSource& weights() {
    static const auto src = random_tensor_source(4321);
    return *src;
}

std::vector<int32_t> tokens(int n, unsigned seed) {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int32_t> d(0, tiny().vocab - 1);
    std::vector<int32_t> t(static_cast<size_t>(n));
    for (auto& x : t) x = d(rng);
    return t;
}

std::vector<int32_t> cat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
}

struct Reference {
    std::vector<float> prefill_logits, last_logits;
    std::vector<int32_t> tokens;
};

// Each prompt alone on the unsharded model.
Reference reference(const std::vector<int32_t>& prompt) {
    GenerationOptions o;
    o.block_size = kBlock;
    o.prefix_cache = false;
    Reference r;
    o.max_new_tokens = 1;
    r.prefill_logits = generate(tiny(), ParallelConfig{}, weights(), {prompt}, o).last_logits[0];
    o.max_new_tokens = kSteps;
    const auto g = generate(tiny(), ParallelConfig{}, weights(), {prompt}, o);
    r.tokens = g.tokens[0];
    r.last_logits = g.last_logits[0];
    return r;
}

ParallelConfig config(int cp, int tp, CpScheme s) {
    ParallelConfig p;
    p.cp = cp;
    p.tp = tp;
    p.cp_scheme = s;
    p.cp_interleave = kBlock;
    return p;
}

// The batch: four requests of 9, 17, 21 and 26 tokens.
//  0: new, 9 tokens.       1: new, 17 tokens.
//  2: a second turn: 13 tokens prefilled (and released from the batch's view) before, 8 new.
//  3: interleave (prefix caching on): a new request whose first 4 blocks an earlier, released
//     request left in the cache; other schemes: a second turn after 6 tokens.
struct Batch {
    std::vector<std::vector<int32_t>> whole;  // each request's whole prompt
    std::vector<std::vector<int32_t>> first;  // a first turn (empty: none)
    std::vector<int32_t> earlier;             // a released request sharing 3's prefix
    std::vector<int64_t> cached;              // tokens each request does not recompute
};

Batch batch(CpScheme s) {
    Batch b;
    const auto t3 = tokens(26, 24);
    b.whole = {tokens(9, 21), tokens(17, 22), cat(tokens(13, 23), tokens(8, 33)), t3};
    b.first = {{}, {}, std::vector<int32_t>(b.whole[2].begin(), b.whole[2].begin() + 13), {}};
    if (s == CpScheme::kInterleave) {
        b.earlier = cat(std::vector<int32_t>(t3.begin(), t3.begin() + 16), tokens(3, 25));
        b.cached = {0, 0, 13, 16};
    } else {
        b.first[3].assign(t3.begin(), t3.begin() + 6);
        b.cached = {0, 0, 13, 6};
    }
    return b;
}

const Reference& reference_of(const std::vector<int32_t>& prompt) {
    static std::map<std::vector<int32_t>, Reference> memo;
    auto it = memo.find(prompt);
    if (it == memo.end()) it = memo.emplace(prompt, reference(prompt)).first;
    return it->second;
}

TEST(CpBatch, FourRequestsWithCachedPrefixesPrefillAndDecodeTogether) {
    for (int cp : {2, 3, 4})
        for (int tp : {1, 2})
            for (CpScheme scheme :
                 {CpScheme::kContiguous, CpScheme::kZigzag, CpScheme::kInterleave})
                for (CpDecodeMerge merge : {CpDecodeMerge::kAllGather, CpDecodeMerge::kAllToAll}) {
                    const ParallelConfig p = config(cp, tp, scheme);
                    const Batch b = batch(scheme);
                    const std::string what =
                        p.to_string() + " " + std::string(cp_decode_merge_name(merge));
                    std::mutex mu;
                    run_threads(p.world_size(), [&](Communicator& w) {
                        CpOptions o;
                        o.block_size = kBlock;
                        o.num_blocks = 64;
                        o.decode_merge = merge;
                        CpDevice dev(tiny(), tp, rank_coord(p, w.rank()).tp, weights(), o);
                        CpSession s(dev, w, p, o);
                        if (!b.earlier.empty()) {
                            s.prefill(100, b.earlier);
                            s.release(100);
                        }
                        const std::vector<SeqId> seqs = {0, 1, 2, 3};
                        std::vector<std::vector<int32_t>> feed;
                        for (SeqId q : seqs) {
                            const auto i = static_cast<size_t>(q);
                            if (!b.first[i].empty()) s.prefill(q, b.first[i]);
                            feed.push_back(b.first[i].empty() ? b.whole[i]
                                                              : std::vector<int32_t>(
                                                                    b.whole[i].begin() +
                                                                        int64_t(b.first[i].size()),
                                                                    b.whole[i].end()));
                        }
                        std::vector<float> logits = s.prefill(seqs, feed);
                        // One ring per mode for the batch: the bytes of every sequence's own.
                        int64_t ring_bytes = 0;
                        for (size_t i = 0; i < seqs.size(); ++i) {
                            const CpTokenMap& map = s.token_map(seqs[i]);
                            ring_bytes +=
                                s.prefill_stats(seqs[i]).mode == CpPrefillMode::kPassKv
                                    ? cp_pass_kv_bytes(s.layout(), w.rank(), map).total()
                                    : cp_pass_q_bytes(s.layout(), w.rank(), map, b.cached[i])
                                          .total();
                        }
                        EXPECT_EQ(s.last_step().comm.total(), ring_bytes) << what;
                        const int V = tiny().vocab;
                        auto row = [&](size_t i) {
                            return std::vector<float>(logits.begin() + int64_t(i) * V,
                                                      logits.begin() + int64_t(i + 1) * V);
                        };
                        std::vector<std::vector<float>> prefill_rows;
                        std::vector<std::vector<int32_t>> toks(seqs.size());
                        for (size_t i = 0; i < seqs.size(); ++i) {
                            prefill_rows.push_back(row(i));
                            toks[i].push_back(argmax(prefill_rows.back()));
                            EXPECT_EQ(s.prefill_stats(seqs[i]).cached_tokens, b.cached[i])
                                << what << " request " << i;
                        }
                        for (int step = 1; step < kSteps; ++step) {
                            std::vector<int32_t> next;
                            for (const auto& t : toks) next.push_back(t.back());
                            logits = s.decode(seqs, next);
                            for (size_t i = 0; i < seqs.size(); ++i)
                                toks[i].push_back(argmax(row(i)));
                            // One merge per layer for the whole batch: the all-gather carries
                            // the [n][Hq_r][D+1] fp32 partials of every row at once.
                            if (merge == CpDecodeMerge::kAllGather) {
                                EXPECT_EQ(s.last_step().comm.all_gather,
                                          int64_t{tiny().num_layers} * (cp - 1) * 4 *
                                              (tiny().num_heads / tp) * (tiny().head_dim + 1) * 4)
                                    << what;
                            }
                        }
                        std::lock_guard lk(mu);
                        for (size_t i = 0; i < seqs.size(); ++i) {
                            const Reference& want = reference_of(b.whole[i]);
                            EXPECT_EQ(toks[i], want.tokens) << what << " request " << i;
                            EXPECT_LT(relative_l2(prefill_rows[i], want.prefill_logits), 1e-4)
                                << what << " request " << i;
                            EXPECT_LT(relative_l2(row(i), want.last_logits), 1e-4)
                                << what << " request " << i;
                        }
                    });
                }
}

// A prefix shared inside one batch: request 1 hits request 0's blocks, which the same forward
// computes (every layer writes the batch's KV before any attention reads it).
TEST(CpBatch, APrefixSharedWithinTheBatchIsReadAfterItIsWritten) {
    const auto a = tokens(23, 41);
    const auto b = cat(std::vector<int32_t>(a.begin(), a.begin() + 20), tokens(7, 42));
    for (int cp : {2, 4}) {
        const ParallelConfig p = config(cp, 1, CpScheme::kInterleave);
        std::mutex mu;
        run_threads(cp, [&](Communicator& w) {
            CpOptions o;
            o.block_size = kBlock;
            o.num_blocks = 64;
            CpDevice dev(tiny(), 1, 0, weights(), o);
            CpSession s(dev, w, p, o);
            const std::vector<SeqId> seqs = {0, 1};
            const std::vector<std::vector<int32_t>> feed = {a, b};
            const auto logits = s.prefill(seqs, feed);
            EXPECT_EQ(s.prefill_stats(1).cached_tokens, 20);
            EXPECT_EQ(s.last_step().computed_tokens,
                      s.token_map(0).count(w.rank()) + s.token_map(1).count(w.rank(), 20));
            const int V = tiny().vocab;
            std::lock_guard lk(mu);
            EXPECT_LT(relative_l2(std::vector<float>(logits.begin(), logits.begin() + V),
                                  reference_of(a).prefill_logits),
                      1e-4);
            EXPECT_LT(relative_l2(std::vector<float>(logits.begin() + V, logits.end()),
                                  reference_of(b).prefill_logits),
                      1e-4);
        });
    }
}

// Continuous batching in the CP runner: prompts of different lengths with shared prefixes, two
// joining mid-decode (one while the request whose prefix it shares is still running), every
// request leaving after its own max_new_tokens; against the unsharded run of every prompt.
struct RunCase {
    std::string model;
    std::string parallel;
};

std::vector<std::vector<int32_t>> runner_prompts(const ModelSpec& m) {
    std::vector<std::vector<int32_t>> out;
    uint32_t s = 99;
    for (int len : {21, 9, 14, 30, 6}) {
        std::vector<int32_t> p;
        for (int i = 0; i < len; ++i) {
            s = s * 1664525u + 1013904223u;
            p.push_back(int32_t((s >> 8) % uint32_t(m.vocab)));
        }
        out.push_back(p);
    }
    // 2 starts like 0 (joins with it), 3 like 0 (joins mid-decode while 0 runs), 4 like 1.
    out[2].insert(out[2].begin(), out[0].begin(), out[0].begin() + 12);
    out[3].insert(out[3].begin(), out[0].begin(), out[0].begin() + 16);
    out[4].insert(out[4].begin(), out[1].begin(), out[1].begin() + 8);
    return out;
}

class CpContinuousBatching : public ::testing::TestWithParam<RunCase> {};

TEST_P(CpContinuousBatching, RequestsJoiningMidDecodeGetTheUnshardedTokens) {
    const RunCase& rc = GetParam();
    const ModelSpec m = catalog_model(rc.model);
    const ParallelConfig p = parse_parallel_config(rc.parallel);
    const auto src = random_tensor_source(8);
    const auto prompts = runner_prompts(m);
    GenerationOptions o;
    o.block_size = kBlock;
    o.max_new_tokens = 12;
    const GenerationReport ref = generate(m, ParallelConfig{}, *src, prompts, o);
    o.arrival_step = {0, 0, 0, 4, 9};
    std::vector<GenerationReport> reps(static_cast<size_t>(p.world_size()));
    run_threads(p.world_size(), [&](Communicator& w) {
        reps[static_cast<size_t>(w.rank())] = generate(m, p, *src, prompts, o, &w);
    });
    const GenerationReport& got = reps[0];
    ASSERT_EQ(got.tokens.size(), prompts.size());
    for (size_t i = 0; i < prompts.size(); ++i) {
        EXPECT_EQ(got.tokens[i], ref.tokens[i]) << "prompt " << i;
        EXPECT_LT(relative_l2(got.last_logits[i], ref.last_logits[i]), 1e-4) << "prompt " << i;
        for (const auto& r : reps) EXPECT_EQ(r.tokens[i], got.tokens[i]) << "prompt " << i;
    }
    // Under block interleave the shared prefixes are found (within the first batch and by the
    // requests that join later); a state model reuses none.
    if (p.cp_scheme == CpScheme::kInterleave && p.cp_interleave == kBlock &&
        m.state_bytes_per_sequence() == 0) {
        EXPECT_EQ(got.prefix_hit_tokens, 12 + 16 + 8);
    }
    EXPECT_EQ(got.prompt_tokens, 21 + 9 + 26 + 46 + 14);
}

INSTANTIATE_TEST_SUITE_P(
    Grid, CpContinuousBatching,
    ::testing::Values(RunCase{"tiny", "cp=2,cp_scheme=interleave,cp_interleave=4"},
                      RunCase{"tiny", "cp=4,tp=2,cp_scheme=interleave,cp_interleave=4"},
                      RunCase{"tiny", "cp=2"}, RunCase{"tiny", "cp=3,cp_scheme=zigzag"},
                      RunCase{"tiny", "cp=4,tp=2,cp_scheme=zigzag"},
                      RunCase{"tiny-swa", "cp=2,cp_scheme=interleave,cp_interleave=4"},
                      RunCase{"tiny-mla", "cp=2,cp_scheme=zigzag"},
                      RunCase{"tiny-mla", "cp=2,tp=2,cp_scheme=interleave,cp_interleave=4"},
                      RunCase{"tiny-hybrid", "cp=2,cp_scheme=interleave,cp_interleave=4"},
                      RunCase{"tiny-hybrid", "cp=4,tp=2,cp_scheme=zigzag"}),
    [](const auto& info) {
        std::string s = info.param.model + "_" + info.param.parallel;
        for (char& ch : s)
            if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
        return s;
    });

TEST(CpContinuousBatching, TheScheduleJoinsDecodesAndLeavesByTheTable) {
    using V = std::vector<int64_t>;
    // 3 tokens each: the prefill's and two decode steps; nothing runs at steps 4..8 (skipped).
    EXPECT_EQ(continuous_batch_schedule({0, 0, 2, 9}, 4, 3),
              (std::vector<BatchStep>{{0, V{0, 1}, V{0, 1}, V{}},
                                      {1, V{}, V{0, 1}, V{0, 1}},
                                      {2, V{2}, V{2}, V{}},
                                      {3, V{}, V{2}, V{2}},
                                      {9, V{3}, V{3}, V{}},
                                      {10, V{}, V{3}, V{3}}}));
    // Later arrivals first in the list join at their step; one token each: no decode at all.
    EXPECT_EQ(continuous_batch_schedule({5, 0}, 2, 1),
              (std::vector<BatchStep>{{0, V{1}, V{}, V{1}}, {5, V{0}, V{}, V{0}}}));
    // A request joining mid-decode decodes in the same step as the running ones.
    EXPECT_EQ(continuous_batch_schedule({0, 1}, 2, 3),
              (std::vector<BatchStep>{
                  {0, V{0}, V{0}, V{}}, {1, V{1}, V{0, 1}, V{0}}, {2, V{}, V{1}, V{1}}}));
    EXPECT_EQ(continuous_batch_schedule({}, 2, 2),
              (std::vector<BatchStep>{{0, V{0, 1}, V{0, 1}, V{0, 1}}}));
}

TEST(CpContinuousBatching, TheRunnersRefuseBadArrivals) {
    const auto src = random_tensor_source(8);
    GenerationOptions o;
    o.arrival_step = {0, 1};
    EXPECT_THROW(generate(tiny(), ParallelConfig{}, *src, {{1, 2}, {3}}, o), Error);
    EXPECT_THROW(continuous_batch_schedule({0, -1}, 2, 4), Error);
    o.arrival_step = {0};
    run_threads(2, [&](Communicator& w) {
        EXPECT_THROW(generate(tiny(), parse_parallel_config("cp=2"), *src, {{1, 2}, {3}}, o, &w),
                     Error);
    });
}

}  // namespace
}  // namespace kvshard
