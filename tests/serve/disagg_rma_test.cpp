// End to end with RMA reads (DisaggOptions::rma_read) on the threads backend: the decode ranks read
// their KV from private prefill pools through a window; tokens and logits equal to the unsharded
// model's, every message read through the window.
#include <gtest/gtest.h>

#include "kvshard/comm/threads.h"
#include "kvshard/exec/rank_model.h"
#include "kvshard/model/catalog.h"
#include "kvshard/serve/disagg.h"
#include "kvshard/serve/generate.h"
#include "kvshard/serve/verify.h"

namespace kvshard {
namespace {

struct RmaCase {
    std::string prefill, decode;
    int bs_prefill = 16, bs_decode = 16;
};

TEST(DisaggRma, TokensMatchUnshardedModel) {
    set_compute_threads(1);
    const ModelSpec m = catalog_model("tiny");
    std::vector<std::vector<int32_t>> prompts;
    for (int p = 0; p < 3; ++p) {
        std::vector<int32_t> pr;
        for (int i = 0; i < 11 + 3 * p; ++i) pr.push_back((i * 37 + p * 11 + 5) % m.vocab);
        prompts.push_back(pr);
    }
    const auto src = random_tensor_source(7);
    const int gen = 5;
    GenerationOptions go;
    go.max_new_tokens = gen;
    const GenerationReport ref = generate(m, ParallelConfig{}, *src, prompts, go);
    for (const RmaCase& c : {RmaCase{"tp=8", "tp=4"}, RmaCase{"tp=2", "tp=1", 4, 16},
                             RmaCase{"tp=4,pp=2", "tp=2"}, RmaCase{"cp=2", "tp=1"}}) {
        SCOPED_TRACE(c.prefill + " -> " + c.decode);
        const ParallelConfig pp = parse_parallel_config(c.prefill),
                             pd = parse_parallel_config(c.decode);
        DisaggOptions opt;
        opt.max_new_tokens = gen;
        opt.prefill_block_size = c.bs_prefill;
        opt.decode_block_size = c.bs_decode;
        opt.rma_read = true;
        DisaggReport r;
        run_threads(pp.world_size() + pd.world_size(), [&](Communicator& world) {
            DisaggReport x = disagg_generate(m, pp, pd, *src, prompts, opt, world);
            if (world.rank() == 0) r = std::move(x);
        });
        EXPECT_EQ(r.failed_requests, 0);
        for (size_t i = 0; i < prompts.size(); ++i) {
            EXPECT_EQ(r.errors[i], "");
            EXPECT_EQ(r.tokens[i], ref.tokens[i]) << "prompt " << i;
            EXPECT_LT(relative_l2(r.last_logits[i], ref.last_logits[i]), 1e-4) << "prompt " << i;
        }
        EXPECT_EQ(r.transfer_bytes, r.min_bytes);
        EXPECT_GT(r.messages, 0);
        EXPECT_EQ(r.direct_messages, r.messages);  // the prefill pools are private: the window
    }
}

TEST(DisaggRma, RefusedBetweenPageOrdersAndWithoutDirectRead) {
    DisaggOptions opt;
    opt.rma_read = true;
    EXPECT_NO_THROW(opt.validate());
    opt.decode_order = PageOrder::kNhd;
    EXPECT_THROW(opt.validate(), Error);
    opt.decode_order = PageOrder::kHnd;
    opt.transfer.direct_read = false;
    EXPECT_THROW(opt.validate(), Error);
}

}  // namespace
}  // namespace kvshard
