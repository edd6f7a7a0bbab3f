// The ring under windowed layers stops after the last step any rank's window needs: no step moves
// a shard that no query attends to. The steps (cp_window_ring_steps) from the positions, the bytes
// a CP prefill sends against the cost model, and against the same model with every layer full
// attention (the saving switched off).
#include <gtest/gtest.h>

#include <random>

#include "kvshard/comm/threads.h"
#include "kvshard/exec/cp_session.h"
#include "kvshard/layout/cp_plan.h"
#include "kvshard/layout/kv_layout.h"
#include "kvshard/model/catalog.h"
#include "kvshard/model/weights.h"

namespace kvshard {
namespace {

ParallelConfig cp_config(int cp, CpScheme scheme) {
    ParallelConfig p;
    p.cp = cp;
    p.cp_scheme = scheme;
    return p;
}

TEST(CpWindowRing, StepsFollowTheWindow) {
    // cp=4 contiguous over 64 tokens: shards [0,16) [16,32) [32,48) [48,64).
    const CpTokenMap contiguous = cp_prompt_map(cp_config(4, CpScheme::kContiguous), 64);
    EXPECT_EQ(cp_window_ring_steps(contiguous, 0, false, 0), 4);   // full attention
    EXPECT_EQ(cp_window_ring_steps(contiguous, 0, false, 8), 2);   // the previous shard's tail
    EXPECT_EQ(cp_window_ring_steps(contiguous, 0, false, 20), 3);  // 48 sees back to 29
    EXPECT_EQ(cp_window_ring_steps(contiguous, 0, false, 40), 4);  // 48 sees back to 9
    EXPECT_EQ(cp_window_ring_steps(contiguous, 0, true, 8), 1);    // chunks inside shards
    EXPECT_EQ(cp_window_ring_steps(contiguous, 0, true, 32), 2);   // a chunk spans two shards
    // Only the new queries count: a turn whose queries sit in the last shard.
    EXPECT_EQ(cp_window_ring_steps(contiguous, 60, false, 8), 1);
    // zigzag cp=2: rank 0 holds [0,16) and [48,64), rank 1 [16,48): both see the other.
    const CpTokenMap zigzag = cp_prompt_map(cp_config(2, CpScheme::kZigzag), 64);
    EXPECT_EQ(cp_window_ring_steps(zigzag, 0, false, 8), 2);
}

// tiny-swa (window 8 on layers 0 and 2) under cp=4 contiguous, 64-token prompt: the windowed
// layers' ring stops after step 1. Bytes equal cp_pass_kv_bytes, and are below those of the same
// model with every layer full attention, whose ring runs every step.
TEST(CpWindowRing, PrefillSendsOnlyTheStepsTheWindowNeeds) {
    const ModelSpec swa = catalog_model("tiny-swa");
    ModelSpec full = swa;
    for (auto& s : full.layers) {
        s.kind = LayerKind::kFullAttention;
        s.window = 0;
    }
    std::mt19937 rng(3);
    std::vector<int32_t> prompt(64);
    for (auto& t : prompt) t = int32_t(rng() % uint32_t(swa.vocab));
    const auto src = random_tensor_source(9);
    const ParallelConfig p = cp_config(4, CpScheme::kContiguous);
    auto ring_bytes = [&](const ModelSpec& m) {
        std::vector<int64_t> got(4), want(4);
        run_threads(4, [&](Communicator& w) {
            CpOptions o;
            o.block_size = 4;
            o.num_blocks = 64;
            o.prefill_mode = CpPrefillMode::kPassKv;
            CpDevice dev(m, 1, 0, *src, o);
            CpSession s(dev, w, p, o);
            s.prefill(0, prompt);
            got[size_t(w.rank())] = s.last_step().comm.ring;
            want[size_t(w.rank())] = cp_pass_kv_bytes(s.layout(), w.rank(), s.token_map(0)).ring;
        });
        EXPECT_EQ(got, want);
        int64_t sum = 0;
        for (int64_t b : got) sum += b;
        return sum;
    };
    const int64_t windowed = ring_bytes(swa), all_full = ring_bytes(full);
    // Per layer per token: 2 (K, V) x 4 heads x 8 dims x 4 bytes. Full layers send 3 of the 4
    // shards on every rank, windowed layers 1 (their own, at step 0).
    const int64_t per_token_layer = 2 * 4 * 8 * 4;
    EXPECT_EQ(all_full, 4 * 3 * 16 * 4 * per_token_layer);
    EXPECT_EQ(windowed, 4 * (3 * 16 * 2 + 1 * 16 * 2) * per_token_layer);
}

// The automatic mode counts the bytes this placement sends, windows included: tiny-swa, cp=4
// contiguous, a 40-token turn after 64 cached tokens. Meta's closed form (every partial returned,
// every ring step run) says pass-Q; the windowed layers' shortened pass-KV ring sends fewer bytes
// (212,992 against pass-Q's 215,040), so the session passes KV, and sends exactly that.
TEST(CpWindowRing, AutomaticModeCountsTheWindowsBytes) {
    const ModelSpec swa = catalog_model("tiny-swa");
    std::mt19937 rng(5);
    std::vector<int32_t> prompt(104);
    for (auto& t : prompt) t = int32_t(rng() % uint32_t(swa.vocab));
    const auto src = random_tensor_source(9);
    const ParallelConfig p = cp_config(4, CpScheme::kContiguous);
    const KvLayout layout = make_layout(swa, p);
    EXPECT_EQ(choose_cp_prefill(layout, 64, 40).mode, CpPrefillMode::kPassQ);  // Meta's rule
    std::vector<int64_t> sent(4);
    run_threads(4, [&](Communicator& w) {
        CpOptions o;
        o.block_size = 4;
        o.num_blocks = 64;
        CpDevice dev(swa, 1, 0, *src, o);
        CpSession s(dev, w, p, o);
        s.prefill(0, std::vector<int32_t>(prompt.begin(), prompt.begin() + 64));
        s.prefill(0, std::vector<int32_t>(prompt.begin() + 64, prompt.end()));
        EXPECT_EQ(s.last_step().cached_tokens, 64);
        EXPECT_EQ(s.last_step().mode, CpPrefillMode::kPassKv);
        const auto exact = choose_cp_prefill(s.layout(), s.token_map(0), 64);
        EXPECT_EQ(exact.mode, CpPrefillMode::kPassKv);
        EXPECT_EQ(exact.pass_kv_bytes, 212992);
        EXPECT_EQ(exact.pass_q_bytes, 215040);
        sent[size_t(w.rank())] = s.last_step().comm.total();
    });
    int64_t total = 0;
    for (int64_t b : sent) total += b;
    EXPECT_EQ(total, 212992);
}

}  // namespace
}  // namespace kvshard
