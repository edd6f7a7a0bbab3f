// CP plans (layout/cp_plan.h): token placement, ring schedule, bytes, pass-KV/pass-Q choice, decode
// placement, prefix-cache alignment and reuse across CP sizes.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <set>
#include <string>

#include "kvshard/common/error.h"
#include "kvshard/layout/cp_plan.h"
#include "kvshard/model/catalog.h"
#include "kvshard/planner/cost_model.h"

namespace kvshard {
namespace {

ParallelConfig cfg(int cp, CpScheme s, int unit = 1, int tp = 1) {
    ParallelConfig p;
    p.cp = cp;
    p.tp = tp;
    p.cp_scheme = s;
    p.cp_interleave = unit;
    return p;
}

const CpScheme kSchemes[] = {CpScheme::kContiguous, CpScheme::kZigzag, CpScheme::kInterleave};

TEST(CpTokenMap, PromptMapAgreesWithLayoutOwnership) {
    for (int cp : {1, 2, 3, 4, 8})
        for (CpScheme s : kSchemes)
            for (int unit : {1, 4})
                for (int64_t n : {0, 1, 5, 16, 37, 64}) {
                    const auto p = cfg(cp, s, unit);
                    const auto m = cp_prompt_map(p, n);
                    ASSERT_EQ(m.size(), n);
                    std::vector<int> seen(n, -1);
                    for (int c = 0; c < cp; ++c) {
                        const auto pos = m.positions(c);
                        ASSERT_TRUE(std::is_sorted(pos.begin(), pos.end()));
                        int64_t total = 0;
                        for (const auto& r : cp_token_ranges(p, c, n)) total += r.size();
                        EXPECT_EQ(static_cast<int64_t>(pos.size()), total);
                        for (int64_t x : pos) {
                            ASSERT_EQ(seen[x], -1) << "position " << x << " on two ranks";
                            seen[x] = c;
                        }
                    }
                    for (int64_t x = 0; x < n; ++x) {
                        EXPECT_EQ(seen[x], cp_owner(p, n, x)) << x;
                        EXPECT_EQ(m.owner(x), seen[x]);
                    }
                }
}

TEST(CpTokenMap, AppendingNeverMovesStoredTokens) {
    for (CpScheme s : kSchemes) {
        CpTokenMap m(4);
        m.append(30, s, 4);
        std::vector<int> before;
        for (int64_t x = 0; x < 30; ++x) before.push_back(m.owner(x));
        m.append(21, s, 4);         // the new tokens of a second turn
        m.append_generated(9, 16);  // decode
        ASSERT_EQ(m.size(), 60);
        for (int64_t x = 0; x < 30; ++x) EXPECT_EQ(m.owner(x), before[x]);
        // the new segment is placed by the scheme relative to itself
        const auto p = cfg(4, s, 4);
        for (int64_t x = 30; x < 51; ++x)
            EXPECT_EQ(m.owner(x),
                      s == CpScheme::kInterleave ? (x / 4) % 4 : cp_owner(p, 21, x - 30));
        // decode rule: (t / 16) % cp on the global position
        for (int64_t x = 51; x < 60; ++x) EXPECT_EQ(m.owner(x), (x / 16) % 4);
        int64_t total = 0;
        for (int c = 0; c < 4; ++c) total += m.count(c);
        EXPECT_EQ(total, 60);
        EXPECT_EQ(m.count(1, 30, 51) + m.count(0, 30, 51) + m.count(2, 30, 51) + m.count(3, 30, 51),
                  21);
    }
}

TEST(CpTokenMap, DecodeSpreadsGeneratedBlocksRoundRobin) {
    CpTokenMap m(3);
    m.append(10, CpScheme::kZigzag);
    m.append_generated(16 * 9, 16);
    // generated tokens: every rank receives whole blocks in turn, so they differ by at most a block
    std::vector<int64_t> gen(3);
    for (int c = 0; c < 3; ++c) gen[c] = m.count(c, 10);
    EXPECT_LE(*std::max_element(gen.begin(), gen.end()) - *std::min_element(gen.begin(), gen.end()),
              16);
}

// ranges() lists positions() as maximal runs, and the visibility test over runs (what the planner
// asks of long prompts) agrees with the one over positions on maps of mixed schemes, every pair of
// ranks, sliding and chunked windows, with and without a cached part.
TEST(CpTokenMap, RangesAndTheirVisibilityAgreeWithPositions) {
    std::mt19937 rng(11);
    const CpScheme schemes[] = {CpScheme::kContiguous, CpScheme::kZigzag, CpScheme::kInterleave};
    for (int trial = 0; trial < 200; ++trial) {
        const int cp = 2 + int(rng() % 4);
        CpTokenMap map(cp);
        for (int seg = 0, n = 1 + int(rng() % 3); seg < n; ++seg)
            map.append(1 + int64_t(rng() % 60), schemes[rng() % 3], 1 + int(rng() % 5));
        const int64_t new_begin = int64_t(rng() % uint64_t(map.size()));
        for (int c = 0; c < cp; ++c) {
            const auto pos = map.positions(c, new_begin);
            const auto runs = map.ranges(c, new_begin);
            std::vector<int64_t> expanded;
            for (size_t i = 0; i < runs.size(); ++i) {
                ASSERT_LT(runs[i].begin, runs[i].end);
                if (i > 0) {
                    ASSERT_LT(runs[i - 1].end, runs[i].begin);  // disjoint, not adjacent
                }
                for (int64_t x = runs[i].begin; x < runs[i].end; ++x) expanded.push_back(x);
            }
            ASSERT_EQ(expanded, pos);
            ASSERT_EQ(map.count(c, new_begin), int64_t(pos.size()));
        }
        for (int q = 0; q < cp; ++q)
            for (int k = 0; k < cp; ++k)
                for (bool chunked : {false, true})
                    for (int window : {0, 1, 3, 8, 20}) {
                        const bool by_pos = cp_shard_sees(map.positions(q, new_begin),
                                                          map.positions(k), chunked, window);
                        const bool by_run =
                            cp_shard_sees(map.ranges(q, new_begin), map.ranges(k), chunked, window);
                        ASSERT_EQ(by_pos, by_run) << "trial " << trial << " q " << q << " k " << k
                                                  << " chunked " << chunked << " w " << window;
                    }
    }
}

// The prompt form (what the planner asks for every configuration) equals the counts over the full
// map, for every scheme; interleaved placements are counted over one period past the first
// window, which must not change the answer.
TEST(CpWindowSteps, PromptFormEqualsTheFullMapsCount) {
    for (CpScheme scheme : {CpScheme::kContiguous, CpScheme::kZigzag, CpScheme::kInterleave})
        for (int cp : {2, 3, 4, 8})
            for (int unit : {1, 3, 16})
                for (int64_t n : {1, 7, 64, 100, 1000, 4099})
                    for (bool chunked : {false, true})
                        for (int window : {1, 5, 16, 128}) {
                            ParallelConfig p = cfg(cp, scheme, unit);
                            const CpTokenMap map = cp_prompt_map(p, n);
                            const auto got = cp_prompt_window_ring_steps(p, n, chunked, window);
                            ASSERT_EQ(got.first, cp_window_ring_steps(map, 0, chunked, window))
                                << cp_scheme_name(scheme) << " cp " << cp << " unit " << unit
                                << " n " << n << " chunked " << chunked << " w " << window;
                            ASSERT_EQ(got.second,
                                      cp_pass_q_window_ring_steps(map, 0, chunked, window))
                                << cp_scheme_name(scheme) << " cp " << cp << " unit " << unit
                                << " n " << n << " chunked " << chunked << " w " << window;
                        }
}

// The attention pairs each rank computes, counted one query at a time from the placement (every
// position's owner, every query's visible keys), against the closed forms over runs.
TEST(CpAttentionPairs, EqualABruteForceCountOverEveryQuery) {
    for (CpScheme scheme : kSchemes)
        for (int cp : {1, 2, 3, 4, 8})
            for (int unit : {1, 3, 16})
                for (int64_t n : {1, 7, 64, 100, 1000, 4099})
                    for (int window : {0, 1, 5, 16, 128})
                        for (bool chunked : {false, true}) {
                            if (window == 0 && chunked) continue;
                            const ParallelConfig p = cfg(cp, scheme, unit);
                            std::vector<int64_t> per(static_cast<size_t>(cp), 0);
                            for (int64_t q = 0; q < n; ++q) {
                                const int64_t seen = window == 0 ? q + 1
                                                     : chunked   ? q % window + 1
                                                                 : std::min<int64_t>(q + 1, window);
                                per[static_cast<size_t>(cp_owner(p, n, q))] += seen;
                            }
                            const auto got = cp_prompt_attention_pairs(p, n, chunked, window);
                            ASSERT_EQ(got.total,
                                      std::accumulate(per.begin(), per.end(), int64_t{0}))
                                << cp_scheme_name(scheme) << " cp " << cp << " n " << n;
                            ASSERT_EQ(got.busiest,
                                      double(*std::max_element(per.begin(), per.end())))
                                << cp_scheme_name(scheme) << " cp " << cp << " unit " << unit
                                << " n " << n << " w " << window << " chunked " << chunked;
                        }
}

TEST(CpAttentionPairs, ContiguousShardsLoadTheLastRankZigzagBalances) {
    const int64_t n = 1 << 16;
    for (int cp : {2, 4, 8, 16}) {
        const auto contiguous =
            cp_prompt_attention_pairs(cfg(cp, CpScheme::kContiguous), n, false, 0);
        const auto zigzag = cp_prompt_attention_pairs(cfg(cp, CpScheme::kZigzag), n, false, 0);
        EXPECT_EQ(contiguous.total, double(n * (n + 1) / 2));
        EXPECT_EQ(zigzag.total, contiguous.total);
        // The last contiguous rank: its n / cp queries see (cp - 1) n / cp keys before them plus
        // its own causal triangle, (2 cp - 1) / cp^2 of the prompt's pairs.
        EXPECT_NEAR(double(contiguous.busiest) / contiguous.total, (2.0 * cp - 1) / (cp * cp),
                    1e-4);
        EXPECT_NEAR(double(zigzag.busiest) / zigzag.total, 1.0 / cp, 1e-4);
        // A sliding window of 4K: every query past the first window sees 4K keys; balanced either
        // way.
        const auto windowed =
            cp_prompt_attention_pairs(cfg(cp, CpScheme::kContiguous), n, false, 4096);
        EXPECT_NEAR(double(windowed.busiest) / windowed.total, 1.0 / cp, 0.05);
    }
    // Long interleaved prompts: chunked attention counted over one lcm span and scaled, equal to
    // the count over every query; full and sliding taken as balanced, within 1 / periods.
    for (int cp : {2, 4})
        for (int unit : {1, 3})
            for (int window : {0, 1000, 1024})
                for (bool chunked : {false, true}) {
                    if (window == 0 && chunked) continue;
                    const ParallelConfig p = cfg(cp, CpScheme::kInterleave, unit);
                    const int64_t n = 300001;
                    std::vector<int64_t> per(static_cast<size_t>(cp), 0);
                    for (int64_t q = 0; q < n; ++q)
                        per[static_cast<size_t>(cp_owner(p, n, q))] +=
                            window == 0 ? q + 1
                            : chunked   ? q % window + 1
                                        : std::min<int64_t>(q + 1, window);
                    const auto got = cp_prompt_attention_pairs(p, n, chunked, window);
                    const int64_t busiest = *std::max_element(per.begin(), per.end());
                    ASSERT_EQ(got.total,
                              double(std::accumulate(per.begin(), per.end(), int64_t{0})));
                    if (chunked) {
                        ASSERT_EQ(got.busiest, double(busiest)) << "cp " << cp << " unit " << unit;
                    } else {
                        ASSERT_NEAR(double(got.busiest) / busiest, 1.0, 1e-4)
                            << "cp " << cp << " unit " << unit << " w " << window;
                    }
                }
    // A long interleaved prompt is taken as balanced (its true imbalance is below 1 / periods).
    const auto big =
        cp_prompt_attention_pairs(cfg(4, CpScheme::kInterleave, 1), int64_t{1} << 20, false, 0);
    EXPECT_EQ(big.total, double((int64_t{1} << 20) * ((int64_t{1} << 20) + 1) / 2));
    EXPECT_EQ(big.busiest, big.total / 4);
    // A planner context of 2^40 tokens (the fuzz target's find): no overflow, the closed form.
    const double n40 = double(int64_t{1} << 40);
    const auto huge =
        cp_prompt_attention_pairs(cfg(8, CpScheme::kContiguous), int64_t{1} << 40, false, 0);
    EXPECT_NEAR(huge.total / (n40 * (n40 + 1) / 2), 1.0, 1e-12);
    EXPECT_NEAR(huge.busiest / huge.total, 15.0 / 64, 1e-9);
    const auto chunked = cp_prompt_attention_pairs(cfg(64, CpScheme::kInterleave, 1 << 30),
                                                   int64_t{1} << 40, true, 2147483647);
    EXPECT_GT(chunked.total, 0.0);
}

// The busiest rank's visible keys at decode, counted from the documented placement (the prompt
// by cp_owner, generated tokens round-robin by unit) one position at a time.
TEST(CpDecodeKeys, EqualACountOverThePlacement) {
    for (CpScheme scheme : kSchemes)
        for (int cp : {1, 2, 3, 4})
            for (int unit : {1, 16})
                for (int64_t prompt : {0, 1, 100, 1000})
                    for (int64_t generated : {0, 1, 37, 300})
                        for (int64_t window : {0, 8, 100, 1024}) {
                            const ParallelConfig p = cfg(cp, scheme, unit);
                            const int64_t context = prompt + generated;
                            if (context == 0) continue;
                            const int64_t first =
                                window == 0 ? 0 : std::max<int64_t>(0, context - window);
                            const int gen_unit = scheme == CpScheme::kInterleave ? unit : 16;
                            std::vector<int64_t> per(static_cast<size_t>(cp), 0);
                            for (int64_t t = first; t < context; ++t) {
                                const int owner = t < prompt
                                                      ? cp_owner(p, prompt, t)
                                                      : static_cast<int>((t / gen_unit) % cp);
                                ++per[static_cast<size_t>(owner)];
                            }
                            ASSERT_EQ(cp_decode_busiest_keys(p, prompt, context, 16, first),
                                      *std::max_element(per.begin(), per.end()))
                                << cp_scheme_name(scheme) << " cp " << cp << " unit " << unit
                                << " prompt " << prompt << " gen " << generated << " w " << window;
                        }
    EXPECT_THROW(cp_decode_busiest_keys(cfg(2, CpScheme::kZigzag), 10, 5, 16, 0), Error);
    EXPECT_THROW(cp_decode_busiest_keys(cfg(2, CpScheme::kZigzag), 10, 10, 0, 0), Error);
}

TEST(CpRing, EveryRankSeesEveryShardOnceAndSendsWhatTheNextReceives) {
    for (int cp : {1, 2, 3, 4, 8}) {
        for (int c = 0; c < cp; ++c) {
            const auto st = cp_ring_schedule(cp, c);
            ASSERT_EQ(static_cast<int>(st.size()), cp);
            std::set<int> held;
            for (const auto& x : st) held.insert(x.holds);
            EXPECT_EQ(static_cast<int>(held.size()), cp);
            EXPECT_EQ(st[0].holds, c);  // own shard first
            const auto nx = cp_ring_schedule(cp, cp_ring_next(cp, c));
            for (int s = 0; s + 1 < cp; ++s) {
                EXPECT_EQ(st[s].sends, st[s].holds);
                EXPECT_EQ(nx[s].receives, st[s].sends);      // what I send, next receives
                EXPECT_EQ(st[s + 1].holds, st[s].receives);  // and works on it in the next step
            }
            EXPECT_EQ(st.back().sends, -1);
        }
    }
}

TEST(CpRing, PassKvBytesFollowTheScheduleShardSizes) {
    const auto model = catalog_model("tiny");
    for (int cp : {2, 3, 4, 8})
        for (int tp : {1, 2})
            for (CpScheme s : kSchemes) {
                const auto p = cfg(cp, s, 4, tp);
                const auto l = make_layout(model, p);
                const auto map = cp_prompt_map(p, 45);
                for (int r = 0; r < l.world_size(); ++r) {
                    int64_t tokens = 0;
                    for (const auto& st : cp_ring_schedule(cp, l.ranks[r].coord.cp))
                        if (st.sends >= 0) tokens += map.count(st.sends);
                    EXPECT_EQ(cp_pass_kv_bytes(l, r, map).ring,
                              tokens * l.ranks[r].kv_bytes_per_token);
                    EXPECT_EQ(cp_pass_kv_bytes(l, r, map).all_to_all, 0);
                    EXPECT_EQ(cp_pass_kv_bytes(l, r, map).ring, cp_pass_kv_bytes_sent(l, r, 45));
                }
            }
}

// The choice from a placement's exact bytes: the sums of cp_pass_kv_bytes and cp_pass_q_bytes over
// the ranks, pass-Q iff strictly fewer; it agrees with Meta's closed form where that count is exact
// (full attention, a cached prefix on every rank) and follows the bytes where it is not.
TEST(CpPrefillChoice, ExactChoiceFollowsThePlacementsBytes) {
    struct Case {
        const char* model;
        int cp;
        CpScheme scheme;
        int64_t cached, fresh;
    } cases[] = {{"tiny", 4, CpScheme::kZigzag, 100, 7},
                 {"tiny", 4, CpScheme::kContiguous, 0, 40},
                 {"llama-3.1-8b", 4, CpScheme::kZigzag, 1000, 100},
                 {"tiny-swa", 4, CpScheme::kContiguous, 64, 40},
                 {"tiny-swa", 3, CpScheme::kZigzag, 1000, 1000},
                 {"tiny-swa", 4, CpScheme::kZigzag, 1000, 1000}};
    int disagreements = 0;
    for (const Case& k : cases) {
        const auto l = make_layout(catalog_model(k.model), cfg(k.cp, k.scheme, 1, 1));
        CpTokenMap map(k.cp);
        map.append(k.cached, k.scheme);
        map.append(k.fresh, k.scheme);
        const auto exact = choose_cp_prefill(l, map, k.cached);
        const auto rule = choose_cp_prefill(l, k.cached, k.fresh);
        int64_t kv = 0, q = 0;
        for (int r = 0; r < l.world_size(); ++r) {
            kv += cp_pass_kv_bytes(l, r, map).total();
            q += cp_pass_q_bytes(l, r, map, k.cached).total();
        }
        EXPECT_EQ(exact.pass_kv_bytes, kv) << k.model;
        EXPECT_EQ(exact.pass_q_bytes, q) << k.model;
        EXPECT_EQ(exact.mode == CpPrefillMode::kPassQ, q < kv) << k.model;
        EXPECT_DOUBLE_EQ(exact.new_fraction, rule.new_fraction);
        EXPECT_DOUBLE_EQ(exact.threshold, rule.threshold);
        const bool full = std::string(k.model) != "tiny-swa";
        if (full && k.cached > 0) {
            EXPECT_EQ(exact.mode, rule.mode) << k.model;
        }
        disagreements += exact.mode != rule.mode;
    }
    // tiny-swa: the shortened pass-KV ring wins where the rule says pass-Q (64 + 40, contiguous),
    // the unreturned partials let pass-Q win where it says pass-KV (1000 + 1000, zigzag).
    EXPECT_EQ(disagreements, 3);
    CpTokenMap all_cached(2);
    all_cached.append(8, CpScheme::kZigzag);
    EXPECT_THROW(
        choose_cp_prefill(make_layout(catalog_model("tiny"), cfg(2, CpScheme::kZigzag, 1, 1)),
                          all_cached, 8),
        Error);
}

TEST(CpPrefillChoice, PassQWinsExactlyBelowTheThreshold) {
    for (const char* name : {"tiny", "llama-3.1-70b", "llama-3.1-8b"}) {
        const auto model = catalog_model(name);
        for (int tp : {1, 2, 8}) {
            if (model.num_heads % tp != 0) continue;
            const auto l = make_layout(model, cfg(4, CpScheme::kZigzag, 1, tp));
            const double th = cp_pass_q_threshold(l);
            ASSERT_GT(th, 0.0);
            ASSERT_LT(th, 1.0);
            for (int64_t fresh : {1, 7, 100, 1000}) {
                for (int64_t cached : {0, 1, 10, 100, 1000, 100000}) {
                    const auto c = choose_cp_prefill(l, cached, fresh);
                    // the totals are the per-rank bytes summed
                    const auto map = [&] {
                        CpTokenMap m(4);
                        m.append(cached, CpScheme::kZigzag);
                        m.append(fresh, CpScheme::kZigzag);
                        return m;
                    }();
                    int64_t kv = 0, q = 0;
                    for (int r = 0; r < l.world_size(); ++r) {
                        kv += cp_pass_kv_bytes(l, r, map).total();
                        q += cp_pass_q_bytes(l, r, map, cached).total();
                    }
                    EXPECT_EQ(c.pass_kv_bytes, kv);
                    // Partials that see no key are not returned: the choice's count (Meta's)
                    // bounds the sum, and equals it once every rank holds a cached key.
                    EXPECT_LE(q, c.pass_q_bytes);
                    if (cached >= 100) {
                        EXPECT_EQ(c.pass_q_bytes, q);
                        EXPECT_EQ(c.mode == CpPrefillMode::kPassQ, q < kv);
                    }
                    const double frac = double(fresh) / double(cached + fresh);
                    if (std::abs(frac - th) > 1e-9) {
                        EXPECT_EQ(c.mode == CpPrefillMode::kPassQ, frac < th)
                            << name << " " << frac;
                    }
                }
            }
        }
    }
    // A full prefill (nothing cached) always passes KV; a long cached context with a short turn
    // passes Q.
    const auto l = make_layout(catalog_model("llama-3.1-70b"), cfg(4, CpScheme::kZigzag, 1, 8));
    EXPECT_EQ(choose_cp_prefill(l, 0, 4096).mode, CpPrefillMode::kPassKv);
    EXPECT_EQ(choose_cp_prefill(l, 128000, 1000).mode, CpPrefillMode::kPassQ);
    // Llama-3.1-70B, bf16: 2*8*2*128 / (64*(2*128+4*128+4)) = 4096/49408
    EXPECT_NEAR(cp_pass_q_threshold(l), 4096.0 / 49408.0, 1e-12);
    EXPECT_THROW(choose_cp_prefill(l, 10, 0), Error);
}

// Queries travel and partials merge only in the layers that attend over tokens. Falcon-H1 7B
// (tests/data/hf_configs/falcon-h1-7b-instruct.json): 44 decoder layers of 2 cache layers each, an
// attention one (12 query heads, 2 KV heads, head dim 128, bf16) and a Mamba-2 one. Pass-Q of 1000
// new tokens at cp 2 moves 44 x 12 x (128*2 + 4*128 + 4) x 1000 = 407,616,000 B: the counts took
// all 88 cache layers (815,232,000 B) before 2026-12-05, which halved the threshold (0.0553 instead
// of 45056 / 407616 = 0.1105), so 900 new tokens after 8000 cached (0.101) passed KV although
// pass-Q moves fewer bytes.
TEST(CpPrefillChoice, OnlyTokenHoldingLayersPassQueries) {
    const ModelSpec m = load_hf_config(std::string(KVSHARD_TEST_DATA_DIR) +
                                       "/hf_configs/falcon-h1-7b-instruct.json");
    ASSERT_EQ(m.num_layers, 88);
    ASSERT_EQ(m.num_heads, 12);
    ASSERT_EQ(m.head_dim, 128);
    const auto l = make_layout(m, cfg(2, CpScheme::kContiguous));
    const CpPrefillChoice c = choose_cp_prefill(l, 8000, 1000);
    EXPECT_EQ(c.pass_q_bytes, int64_t{44} * 12 * (128 * 2 + 4 * 128 + 4) * 1000);
    EXPECT_EQ(c.pass_kv_bytes, int64_t{44} * 2 * 2 * 128 * 2 * 9000);
    EXPECT_NEAR(c.threshold, 45056.0 / 407616.0, 1e-12);
    EXPECT_EQ(c.mode, CpPrefillMode::kPassKv);  // 1000 / 9000 = 0.111 > 0.1105
    EXPECT_EQ(choose_cp_prefill(l, 8000, 900).mode, CpPrefillMode::kPassQ);
    // The placement's exact count: each segment in contiguous halves at cp 2, so each rank holds
    // 450 of the new tokens, sends their query rows, and returns the other's 450 partials (each
    // rank's new queries see keys of the other's cached half): the same as the closed form.
    CpTokenMap map(2);
    map.append(8000, CpScheme::kContiguous, 1);
    map.append(900, CpScheme::kContiguous, 1);
    const int64_t rows = 44 * 12;
    for (int r = 0; r < 2; ++r) {
        const CpPrefillBytes q = cp_pass_q_bytes(l, r, map, 8000);
        EXPECT_EQ(map.count(r, 8000), 450);
        EXPECT_EQ(q.ring, 450 * rows * 128 * 2) << r;
        EXPECT_EQ(q.all_to_all, 450 * rows * 129 * 4) << r;
    }
    EXPECT_EQ(choose_cp_prefill(l, map, 8000).mode, CpPrefillMode::kPassQ);
    // Decode: one merge per attention layer.
    EXPECT_EQ(cp_decode_merge_bytes(l, 0, CpDecodeMerge::kAllGather), rows * 129 * 4);
}

// Every config of tests/data/hf_configs at cp 2 (pp 1, tp 1): pass-Q and the decode merge count
// the layers whose kind holds tokens (from the ModelSpec's layer list, not its KV groups), each at
// its own dims: Falcon-H1 44 of 88 layers, LongCat-Flash 56 of 84, the SSM / Gated DeltaNet /
// short-conv layers of Bamba, Nemotron-H, Granite 4.0-H, Jamba, Qwen3-Next, Qwen3.5, Kimi Linear
// and LFM2 none; Gemma 4's full layers at their head_dim 512, its sliding ones at 256; MLA
// (DeepSeek-V3, LongCat-Flash) as the session runs it, absorbed: a query of kv_lora_rank +
// qk_rope_head_dim (576), prefill partials of as many, decode partials of kv_lora_rank (512).
TEST(CpPrefillChoice, EveryConfigCountsItsAttentionLayers) {
    const std::string dir = std::string(KVSHARD_TEST_DATA_DIR) + "/hf_configs/";
    int hybrids = 0;
    for (const char* name :
         {"apertus-8b-instruct-2509", "bamba-9b", "deepseek-v3", "falcon-h1-7b-instruct",
          "gemma-3-27b", "gemma-4-31b", "gpt-oss-20b", "granite-4.0-h-tiny", "jamba-1.5-mini",
          "kimi-linear-48b-a3b-instruct", "lfm2-1.2b", "lfm2-8b-a1b",
          "llama-3.3-nemotron-super-49b", "llama-4-scout", "longcat-flash-chat", "nemotron-h-8b",
          "qwen3-next-80b-a3b", "qwen3.5-35b-a3b", "qwen3-8b"}) {
        const ModelSpec m = load_hf_config(dir + name + ".json");
        const int64_t e = dtype_size(m.kv_dtype), h = m.num_heads;
        int64_t attention = 0, q_bytes = 0, merge_bytes = 0;
        for (int i = 0; i < m.num_layers; ++i) {
            const LayerSpec ls = m.layer(i);
            if (!holds_tokens(ls.kind)) continue;
            ++attention;
            const bool mla = ls.kind == LayerKind::kMla;
            const int64_t q = mla ? m.mla.kv_lora_rank + m.mla.qk_rope_head_dim : ls.head_dim;
            const int64_t out = mla ? m.mla.kv_lora_rank : ls.head_dim;
            q_bytes += h * (q * e + 4 * q + 4);
            merge_bytes += h * (out + 1) * 4;
        }
        if (attention < m.num_layers) ++hybrids;
        const auto l = make_layout(m, cfg(2, CpScheme::kZigzag));
        EXPECT_EQ(choose_cp_prefill(l, 4000, 100).pass_q_bytes, 100 * q_bytes) << name;
        EXPECT_EQ(cp_decode_merge_bytes(l, 1, CpDecodeMerge::kAllGather), merge_bytes) << name;
    }
    EXPECT_EQ(hybrids, 12);
}

TEST(CpDecode, HelixMovesLessThanAllGatherBeyondTwoRanks) {
    const auto model = catalog_model("tiny");
    for (int cp : {2, 3, 4, 8}) {
        const auto l = make_layout(model, cfg(cp, CpScheme::kZigzag));
        int heads = 0;
        for (int c = 0; c < cp; ++c) heads += static_cast<int>(cp_helix_heads(8, cp, c).size());
        EXPECT_EQ(heads, 8);
        int64_t ag = 0, a2a = 0;
        for (int r = 0; r < l.world_size(); ++r) {
            ag += cp_decode_merge_bytes(l, r, CpDecodeMerge::kAllGather);
            a2a += cp_decode_merge_bytes(l, r, CpDecodeMerge::kAllToAll);
        }
        // all-gather: 4 layers * cp(cp-1) * 8 heads * 9 floats
        EXPECT_EQ(ag, 4 * cp * (cp - 1) * 8 * 9 * 4);
        if (cp > 2) {
            EXPECT_LT(a2a, ag);
        }
    }
}

TEST(CpBalance, ZigzagBalancesCausalWorkAndContiguousDoesNot) {
    for (int cp : {2, 4, 8}) {
        const int64_t n = 2 * cp * 64;
        auto ratio = [&](CpScheme s) {
            const auto pairs = cp_causal_pairs(cp_prompt_map(cfg(cp, s), n));
            const double total = std::accumulate(pairs.begin(), pairs.end(), 0.0);
            EXPECT_EQ(total, double(n) * (n + 1) / 2);  // every (query, key<=query) pair once
            return *std::max_element(pairs.begin(), pairs.end()) / (total / cp);
        };
        EXPECT_LE(ratio(CpScheme::kZigzag), 1.0 + 1e-12);
        EXPECT_GT(ratio(CpScheme::kContiguous), 1.4);  // (2cp-1)/cp for large n
    }
}

// Counted over runs, not positions: a prompt of 2^31 tokens takes microseconds (it took minutes
// and gigabytes position by position), with the closed form n(n+1)/2 over all ranks; past 2^63 - 1
// pairs a rank's count is refused, not wrapped.
TEST(CpBalance, CausalPairsOfLongPromptsAreCountedOverRunsAndRefusedPast64Bits) {
    const int64_t n = int64_t{1} << 31;
    for (CpScheme s : kSchemes) {
        const auto pairs = cp_causal_pairs(cp_prompt_map(cfg(4, s, 16), n));
        __int128 total = 0;
        for (int64_t x : pairs) {
            EXPECT_GT(x, 0);
            total += x;
        }
        EXPECT_TRUE(total == static_cast<__int128>(n) * (n + 1) / 2);
    }
    // Contiguous cp=2: rank 1 holds [n/2, n) of n = 2^40, pairs ~ 3 * 2^77.
    try {
        cp_causal_pairs(cp_prompt_map(cfg(2, CpScheme::kContiguous), int64_t{1} << 40));
        ADD_FAILURE() << "no error for 2^40 tokens";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("exceed 2^63 - 1"), std::string::npos) << e.what();
    }
}

// cp-plan's report: a reuse plan lists each cached block's move, so it is bounded; the CP size it
// reuses from and the block size are held to their ranges.
TEST(CpPlanReport, ReuseAndBlockSizeAreBounded) {
    const ModelSpec m = catalog_model("tiny");
    const ParallelConfig p = cfg(2, CpScheme::kContiguous);
    auto error_of = [&](int64_t cached, int block_size, int reuse_from) -> std::string {
        try {
            cp_plan_report_json(m, p, cached, 1, block_size, reuse_from);
        } catch (const Error& e) {
            return e.what();
        }
        return "";
    };
    EXPECT_NE(error_of(int64_t{1} << 39, 16, 1).find("more than the 1048576 kvshard lists"),
              std::string::npos);
    EXPECT_EQ(error_of(kMaxCpReuseBlocks * 16, 16, 2), "");
    EXPECT_NE(error_of(64, 16, 2147483647).find("must be in [1, 1048576]"), std::string::npos);
    EXPECT_NE(error_of(64, (1 << 20) + 1, 1).find("at most 2^20 tokens"), std::string::npos);
    // Without a reuse plan a long cached prefix is fine.
    EXPECT_EQ(error_of(int64_t{1} << 31, 16, 0), "");
}

TEST(CpPrefixCache, BlockInterleaveMakesACachedPrefixAPrefixOnEveryRank) {
    const int block = 16;
    for (int cp : {1, 2, 3, 4, 8}) {
        const auto p = cfg(cp, CpScheme::kInterleave, block);
        const auto long_map = cp_prompt_map(p, 40 * block + 5);
        for (int64_t k : {0, 1, 3, 7, 12}) {  // cached global blocks
            const auto short_map = cp_prompt_map(p, k * block);
            for (int c = 0; c < cp; ++c) {
                const auto mine = long_map.positions(c);
                const auto cached = short_map.positions(c);
                // the cached tokens of rank c are the first ones it stores for the longer request
                ASSERT_LE(cached.size(), mine.size());
                EXPECT_TRUE(std::equal(cached.begin(), cached.end(), mine.begin()));
                EXPECT_EQ(static_cast<int64_t>(cached.size()), cp_local_blocks(k, cp, c) * block);
            }
        }
    }
    // Contiguous placement is not stable: a longer request puts the prefix's tokens elsewhere.
    const auto p = cfg(4, CpScheme::kContiguous);
    const auto short_pos = cp_prompt_map(p, 64).positions(1);  // 16..31
    const auto long_pos = cp_prompt_map(p, 128).positions(1);  // 32..63
    EXPECT_NE(short_pos, std::vector<int64_t>(long_pos.begin(), long_pos.begin() + 16));
}

TEST(CpPrefixCache, ReusePlanAcrossCpSizesMovesOnlyMisplacedBlocks) {
    const auto a = plan_cp_prefix_reuse(4, 2, 10);
    EXPECT_EQ(a.kept + static_cast<int64_t>(a.moves.size()), 10);
    EXPECT_EQ(a.kept, 6);  // blocks 0,1,4,5,8,9
    for (const auto& m : a.moves) {
        EXPECT_EQ(m.src, m.block % 4);
        EXPECT_EQ(m.dst, m.block % 2);
        EXPECT_NE(m.src, m.dst);
    }
    EXPECT_EQ(plan_cp_prefix_reuse(4, 1, 8).kept, 2);
    EXPECT_EQ(plan_cp_prefix_reuse(4, 4, 8).moves.size(), 0u);
    EXPECT_EQ(plan_cp_prefix_reuse(2, 4, 8).moves.size(), 4u);  // blocks 2,3,6,7 go to ranks 2,3
    EXPECT_THROW(plan_cp_prefix_reuse(0, 2, 1), Error);
}

}  // namespace
}  // namespace kvshard

namespace kvshard {
namespace {
TEST(CpRing, PassKvBytesEqualThePlannerForLargeModelsToo) {
    for (const char* name : {"llama-3.1-70b", "llama-3.1-8b"})
        for (CpScheme s : kSchemes)
            for (int64_t n : {1, 1000, 131072 + 7}) {
                const auto p = cfg(4, s, 16, 8);
                const auto l = make_layout(catalog_model(name), p);
                const auto map = cp_prompt_map(p, n);
                for (int r = 0; r < l.world_size(); ++r)
                    EXPECT_EQ(cp_pass_kv_bytes(l, r, map).ring, cp_pass_kv_bytes_sent(l, r, n))
                        << name << " " << p.to_string() << " n=" << n << " rank " << r;
            }
}
}  // namespace
}  // namespace kvshard

namespace kvshard {
namespace {

// The general reuse plan (what CpSession carries out) on blocks cached anywhere, and its special
// case plan_cp_prefix_reuse.
TEST(CpPrefixMoves, BlocksCachedAnywhere) {
    // Devices 0..3 serve CP ranks 0..3 (dst_device = {0, 1, 2, 3}); device 5 lends.
    const std::vector<std::vector<int>> holders = {{0}, {0, 5}, {5}, {3}, {1, 2}, {2}};
    const CpPrefixReusePlan plan = plan_cp_prefix_moves(holders, {0, 1, 2, 3});
    EXPECT_EQ(plan.blocks, 6);
    EXPECT_EQ(plan.dst_cp, 4);
    EXPECT_EQ(plan.kept, 2);  // block 0 on device 0, block 3 on device 3
    const std::vector<CpBlockMove> want = {{1, 0, 1}, {2, 5, 2}, {4, 1, 0}, {5, 2, 1}};
    EXPECT_EQ(plan.moves, want);
}

TEST(CpPrefixMoves, SpecialCaseIsPlanCpPrefixReuse) {
    for (int src = 1; src <= 4; ++src)
        for (int dst = 1; dst <= 4; ++dst) {
            std::vector<std::vector<int>> holders;
            for (int64_t b = 0; b < 11; ++b) holders.push_back({static_cast<int>(b % src)});
            std::vector<int> devices;
            for (int c = 0; c < dst; ++c) devices.push_back(c);
            const auto general = plan_cp_prefix_moves(holders, devices);
            const auto special = plan_cp_prefix_reuse(src, dst, 11);
            EXPECT_EQ(general.moves, special.moves) << src << " -> " << dst;
            EXPECT_EQ(general.kept, special.kept) << src << " -> " << dst;
        }
}

}  // namespace
}  // namespace kvshard
