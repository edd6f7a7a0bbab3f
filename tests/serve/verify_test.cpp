// verify_against_reference fails on non-finite logits: a NaN must not vanish from the maximum.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "kvshard/model/catalog.h"
#include "kvshard/model/weights.h"
#include "kvshard/serve/generate.h"
#include "kvshard/serve/verify.h"

namespace kvshard {
namespace {

TEST(Verify, NonFiniteLogitsFail) {
    const ModelSpec m = catalog_model("tiny");
    const auto source = random_tensor_source(7);
    const std::vector<std::vector<int32_t>> prompts = {{1, 2, 3, 4, 5, 6, 7, 8}};
    GenerationOptions o;
    o.max_new_tokens = 2;
    const GenerationReport run = generate(m, ParallelConfig{}, *source, prompts, o);
    const VerifyResult good =
        verify_against_reference(m, *source, prompts, 2, o.block_size, run.tokens, run.last_logits);
    EXPECT_TRUE(good.ok());
    EXPECT_EQ(good.non_finite_logits, 0);
    for (float bad :
         {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
        auto logits = run.last_logits;
        logits[0][3] = bad;
        const VerifyResult v =
            verify_against_reference(m, *source, prompts, 2, o.block_size, run.tokens, logits);
        EXPECT_FALSE(v.ok());
        EXPECT_EQ(v.non_finite_logits, 1);
        EXPECT_TRUE(std::isinf(v.max_rel_err));
    }
}

}  // namespace
}  // namespace kvshard
