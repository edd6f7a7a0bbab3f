#include "kvshard/serve/inputs.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>

#include <fmt/format.h>

#include "kvshard/common/error.h"
#include "kvshard/exec/rank_model.h"
#include "kvshard/layout/kv_layout.h"
#include "kvshard/model/safetensors.h"

namespace kvshard {
namespace {

bool dir_has_safetensors(const std::string& path) {
    namespace fs = std::filesystem;
    std::error_code ec;
    if (!fs::is_directory(path, ec)) return false;
    for (const auto& e : fs::directory_iterator(path, ec))
        if (e.path().extension() == ".safetensors") return true;
    return false;
}

}  // namespace

std::vector<std::vector<int32_t>> make_prompts(const PromptSpec& f, int vocab) {
    require(f.count >= 1, "--prompts must be at least 1, got ", f.count);
    for (int32_t t : f.token_ids)
        require(t >= 0 && t < vocab, "--prompt-ids: token id ", t,
                " is outside the vocabulary [0, ", vocab, ")");
    if (!f.token_ids.empty())
        return std::vector<std::vector<int32_t>>(size_t(f.count), f.token_ids);
    require(f.length >= 1, "--prompt-len must be at least 1, got ", f.length);
    require(f.shared_prefix >= 0 && f.shared_prefix <= f.length, "--shared-prefix must be in [0, ",
            f.length, "] (the prompt length), got ", f.shared_prefix);
    auto next = [](uint64_t& s) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        return s >> 33;
    };
    uint64_t shared_state = f.seed * 2654435761ULL + 17;
    std::vector<int32_t> prefix;
    for (int i = 0; i < f.shared_prefix; ++i)
        prefix.push_back(int32_t(next(shared_state) % uint64_t(vocab)));
    std::vector<std::vector<int32_t>> out;
    for (int p = 0; p < f.count; ++p) {
        uint64_t s = f.seed * 2654435761ULL + 1000003ULL * uint64_t(p + 1);
        std::vector<int32_t> pr = prefix;
        while (int(pr.size()) < f.length) pr.push_back(int32_t(next(s) % uint64_t(vocab)));
        out.push_back(pr);
    }
    return out;
}

WeightChoice choose_weights(const std::string& model_arg, uint64_t seed) {
    if (dir_has_safetensors(model_arg))
        return {std::make_unique<SafetensorsCheckpoint>(model_arg), "safetensors"};
    return {random_tensor_source(seed), fmt::format("seed {}", seed)};
}

namespace {

std::string size_text(double b) {
    if (b >= double(1 << 30)) return fmt::format("{:.2f} GiB", b / double(1 << 30));
    if (b >= double(1 << 20)) return fmt::format("{:.1f} MiB", b / double(1 << 20));
    return fmt::format("{:.1f} KiB", b / 1024.0);
}

}  // namespace

std::string RunMemoryEstimate::breakdown() const {
    const auto g = size_text;
    std::string s = fmt::format("weights {}, KV {}, buffers {}, prompts {} over {} rank(s)",
                                g(weights), g(kv), g(buffers), g(prompts), ranks);
    if (reference > 0) s += fmt::format("; the unsharded --verify run {}", g(reference));
    return s;
}

namespace {

// Weights, KV pool and forward buffers of one rank serving `count` prompts.
struct RankBytes {
    double weights = 0, kv = 0, buffers = 0;
    double total() const { return weights + kv + buffers; }
};

RankBytes rank_bytes(const ModelSpec& m, const KvLayout& layout, int rank, int block_size,
                     int64_t count, const RunShape& shape) {
    const RankKv& r = layout.ranks[size_t(rank)];
    const WeightShard ws = weight_shard(layout, rank);
    RankBytes b;
    b.weights = weight_shard_bytes(m, ws);
    // blocks_for: one spare block, then each sequence's prompt + generated tokens rounded up.
    const double per_seq =
        std::ceil(double(shape.prompt_len + shape.gen) / double(block_size)) * block_size;
    const double tokens = count > 0 ? double(block_size) + double(count) * per_seq : 0;
    b.kv = tokens * double(r.kv_bytes_per_token);
    // The prefill batch: every prompt token's activations (hidden state, residual, norm, attention
    // output, Q/K/V of the rank's heads, the MLP's gate/up/down of its share), and one row of
    // logits per prompt.
    const double d = m.head_dim;
    const double mlp = m.moe.enabled() ? 3.0 * double(m.moe.expert_intermediate) *
                                             std::max(1, m.moe.experts_per_token)
                                       : 3.0 * ws.mlp_width();
    const double per_token =
        6.0 * m.hidden + (ws.num_q_heads() * 2.0 + ws.num_kv_heads() * 2.0) * d + mlp;
    b.buffers = (double(count) * double(shape.prompt_len) * per_token + 2.0 * count * m.vocab) *
                sizeof(float);
    return b;
}

}  // namespace

RunMemoryEstimate estimate_run_memory(const ModelSpec& spec, const std::vector<RunGroup>& groups,
                                      const RunShape& shape) {
    check_executable(spec);  // a model the reference model cannot run is refused before sizing
    ModelSpec m = spec;
    // fp32: the largest KV dtype (an upper bound at any --kv-dtype), and what --verify's fp32-KV
    // reference stores (a run at another dtype also runs its reference at that dtype, after it).
    m.kv_dtype = DType::kFp32;
    RunMemoryEstimate e;
    for (const RunGroup& g : groups) {
        require(g.block_size >= 1, "block size must be at least 1, got ", g.block_size);
        const KvLayout layout = make_layout(m, g.parallel);
        const int dp = g.parallel.dp;
        RankBytes sum, most;
        for (int rank = 0; rank < layout.world_size(); ++rank) {
            const int replica = layout.ranks[size_t(rank)].coord.dp;
            // Prompt i runs on replica i % dp.
            const int64_t count = shape.prompts / dp + (replica < shape.prompts % dp ? 1 : 0);
            const RankBytes b = rank_bytes(m, layout, rank, g.block_size, count, shape);
            sum.weights += b.weights;
            sum.kv += b.kv;
            sum.buffers += b.buffers;
            if (b.total() > most.total()) most = b;
        }
        if (shape.local_ranks > 0) {  // one rank per process: the host holds local_ranks of them
            const int here = std::min(shape.local_ranks, layout.world_size());
            e.weights += most.weights * here;
            e.kv += most.kv * here;
            e.buffers += most.buffers * here;
            e.ranks += here;
        } else {
            e.weights += sum.weights;
            e.kv += sum.kv;
            e.buffers += sum.buffers;
            e.ranks += layout.world_size();
        }
    }
    if (shape.verify) {
        const KvLayout one = make_layout(m, ParallelConfig{});
        e.reference = rank_bytes(m, one, 0, groups.empty() ? 16 : groups.front().block_size,
                                 shape.prompts, shape)
                          .total();
    }
    // The prompts, and the runner's copy of them in its first batch.
    e.prompts = 2.0 * double(shape.prompts) * double(shape.prompt_len) * sizeof(int32_t);
    return e;
}

double available_memory_gib() {
    std::ifstream in("/proc/meminfo");
    std::string key;
    double kib = 0;
    while (in >> key >> kib) {
        if (key == "MemAvailable:") return kib / double(1 << 20);
        in.ignore(1 << 10, '\n');
    }
    return double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE)) / double(1 << 30);
}

void check_run_memory(const RunMemoryEstimate& e, double max_gib, bool given) {
    require(std::isfinite(max_gib) && max_gib > 0,
            "--max-memory-gib must be a finite number of GiB above 0, got ", max_gib);
    const double need = e.peak() / double(1 << 30);
    require(need <= max_gib, "the run needs about ", size_text(e.peak()), " (", e.breakdown(),
            "), more than ",
            given ? fmt::format("--max-memory-gib {:.2f}", max_gib)
                  : fmt::format("this machine's available memory, {:.2f} GiB", max_gib),
            ": lower --prompts, --prompt-len, --gen or --block-size, use fewer ranks per host, or "
            "set --max-memory-gib");
}

}  // namespace kvshard
