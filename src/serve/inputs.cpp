#include "kvshard/serve/inputs.h"

#include <unistd.h>

#include <filesystem>
#include <string>

#include <fmt/format.h>

#include "kvshard/common/error.h"
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

void check_kv_fits(const ModelSpec& spec, const std::vector<std::vector<int32_t>>& prompts,
                   int gen) {
    ModelSpec m = spec;
    m.kv_dtype = DType::kFp32;
    const double per_token = double(make_layout(m, ParallelConfig{}).ranks[0].kv_bytes_per_token);
    double tokens = 0;
    for (const auto& p : prompts) tokens += double(p.size()) + gen;
    const double need = tokens * per_token;
    const double have = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE));
    require(need <= have, "the prompts and --gen ", gen, " need ", fmt::format("{:.0f}", tokens),
            " tokens of fp32 KV, ", fmt::format("{:.1f}", need / double(1 << 30)),
            " GiB, more than this machine's ", fmt::format("{:.1f}", have / double(1 << 30)),
            " GiB of memory: lower --gen, --prompt-len or --prompts");
}

}  // namespace kvshard
