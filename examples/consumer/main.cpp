// Uses the installed library as any project would: a catalog model, its layout under TP=8,
// and one run of the reference model on two thread ranks, checked against the unsharded one.
#include <cstdio>

#include "kvshard/comm/threads.h"
#include "kvshard/layout/kv_layout.h"
#include "kvshard/model/catalog.h"
#include "kvshard/serve/generate.h"
#include "kvshard/serve/verify.h"

int main() {
    using namespace kvshard;
    const ModelSpec m = catalog_model("tiny");
    const KvLayout tp8 = make_layout(m, parse_parallel_config("tp=8"));
    std::printf("%s: %lld KV bytes per token on rank 0 of tp=8\n", m.name.c_str(),
                static_cast<long long>(tp8.ranks[0].kv_bytes_per_token));

    const ParallelConfig p = parse_parallel_config("tp=2");
    const auto weights = random_tensor_source(1);
    const std::vector<std::vector<int32_t>> prompts = {{1, 2, 3, 4, 5}};
    GenerationOptions opt;
    opt.max_new_tokens = 4;
    GenerationReport report;
    run_threads(p.world_size(), [&](Communicator& world) {
        GenerationReport r = generate(m, p, *weights, prompts, opt, &world);
        if (world.rank() == 0) report = std::move(r);
    });
    const VerifyResult v =
        verify_against_reference(m, *weights, prompts, opt.max_new_tokens, opt.block_size,
                                 report.tokens, report.last_logits);
    std::printf("tp=2 generated %zu tokens; verify: %s\n", report.tokens[0].size(),
                v.ok() ? "ok" : "DIFFER");
    return v.ok() ? 0 : 1;
}
