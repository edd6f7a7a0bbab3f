// Quantized checkpoints (config.json's quantization_config): the weights are sized and read part by
// part as the checkpoint stores them (docs/model.md, "Quantized weights"), against hand counts.
#include <gtest/gtest.h>

#include <string>

#include "kvshard/common/error.h"
#include "kvshard/model/catalog.h"
#include "kvshard/planner/capacity.h"
#include "kvshard/planner/cost_model.h"
#include "kvshard/planner/hardware.h"

namespace kvshard {
namespace {

const std::string kData = KVSHARD_TEST_DATA_DIR;

ParallelConfig tp(int n) {
    ParallelConfig p;
    p.tp = n;
    return p;
}

// A small dense config with a quantization_config (Qwen3's shape: 4 layers).
std::string qwen_with(const std::string& quantization_config) {
    return R"({"model_type": "qwen3", "num_hidden_layers": 4, "hidden_size": 1024,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 3072, "vocab_size": 151936, "torch_dtype": "bfloat16",
        "quantization_config": )" +
           quantization_config + "}";
}

TEST(WeightStorage, ReadsThePublishedQuantizationConfigs) {
    // gpt-oss: MXFP4 experts (4-bit values, one 8-bit scale per 32), the rest bf16.
    const ModelSpec oss = load_hf_config(kData + "/hf_configs/gpt-oss-120b.json");
    EXPECT_EQ(oss.weight_storage, (WeightStorage{"mxfp4", 0, 0, 4.25, false}));
    EXPECT_EQ(weight_storage_name(oss), "mxfp4");
    // DeepSeek-V3: fp8 e4m3, one fp32 scale per 128 x 128 block, fp8 matmuls.
    const ModelSpec ds = load_hf_config(kData + "/hf_configs/deepseek-v3.json");
    const double b = 8 + 32.0 / 16384;
    EXPECT_EQ(ds.weight_storage, (WeightStorage{"fp8", b, b, b, true}));
    // The catalog entries are the published checkpoints.
    EXPECT_EQ(catalog_model("gpt-oss-120b").weight_storage, oss.weight_storage);
    EXPECT_EQ(catalog_model("deepseek-v3").weight_storage, ds.weight_storage);
    EXPECT_EQ(catalog_model("deepseek-v3.2").weight_storage, ds.weight_storage);
    EXPECT_FALSE(catalog_model("llama-3.1-70b").weight_storage.quantized());
    // The bits each part is sized and read at, and the matmul rate, for the planner.
    const WeightPartBits o = weight_part_bits(oss, weight_bits(oss, WeightDtype::kModel));
    EXPECT_EQ(o.experts, 4.25);
    EXPECT_EQ(o.attention, 16);
    EXPECT_EQ(o.base, 16);
    EXPECT_FALSE(o.fp8_matmuls);
    const WeightPartBits d = weight_part_bits(ds, weight_bits(ds, WeightDtype::kModel));
    EXPECT_EQ(d.experts, b);
    EXPECT_EQ(d.dense_mlp, b);
    EXPECT_EQ(d.base, 16);
    EXPECT_TRUE(d.fp8_matmuls);
    const WeightPartBits f = weight_part_bits(oss, weight_bits(oss, WeightDtype::kFp8));
    EXPECT_EQ(f.experts, 8);
    EXPECT_EQ(f.base, 8);
    EXPECT_TRUE(f.fp8_matmuls);
    // The spec's JSON carries it.
    EXPECT_EQ(model_spec_from_json(to_json(oss)), oss);
}

TEST(WeightStorage, RefusesWhatItCannotSize) {
    // An fp8 checkpoint that leaves a layer's MLP unquantized: kvshard sizes parts, not layers.
    EXPECT_THROW(parse_hf_config(qwen_with(R"({"quant_method": "fp8",
        "modules_to_not_convert": ["model.layers.0.mlp"]})"),
                                 "q.json"),
                 Error);
    // Leaving the LM head, embedding and router alone changes nothing kvshard sizes.
    EXPECT_NO_THROW(parse_hf_config(qwen_with(R"({"quant_method": "fp8",
        "modules_to_not_convert": ["lm_head", "model.embed_tokens"]})"),
                                    "q.json"));
    EXPECT_THROW(parse_hf_config(qwen_with(R"({"quant_method": "fp8", "fmt": "e3m4"})"), "q.json"),
                 Error);
    EXPECT_THROW(
        parse_hf_config(qwen_with(R"({"quant_method": "fp8", "weight_block_size": [0, 128]})"),
                        "q.json"),
        Error);
    EXPECT_THROW(parse_hf_config(qwen_with(R"({"bits": 4})"), "q.json"), Error);
    // A method kvshard does not read: the KV figures stand, the weights need --weight-dtype.
    const ModelSpec awq = parse_hf_config(
        qwen_with(R"({"quant_method": "awq", "bits": 4, "group_size": 128})"), "q.json");
    EXPECT_FALSE(awq.weight_storage.sized);
    EXPECT_EQ(awq.kv_bytes_per_token(), 4 * 2 * 8 * 128 * 2);
    try {
        (void)compute_capacity(awq, tp(1), hardware_by_name("h100-sxm"));
        FAIL() << "sized a checkpoint whose quantization kvshard does not read";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("--weight-dtype"), std::string::npos) << e.what();
    }
    CapacityOptions o;
    o.weight_dtype = WeightDtype::kFp4;
    EXPECT_NO_THROW(compute_capacity(awq, tp(1), hardware_by_name("h100-sxm"), o));
}

// compressed-tensors, as llm-compressor writes it (RedHatAI's Llama-3.1-8B-Instruct-FP8-dynamic,
// ...-quantized.w4a16 and ...-NVFP4 shapes: one group over every Linear layer, the LM head
// ignored).
std::string ct(const std::string& weights, const std::string& activations,
               const std::string& ignore = R"(["lm_head"])") {
    return qwen_with(R"({"quant_method": "compressed-tensors", "format": "x",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": )" +
                     weights + R"(, "input_activations": )" + activations + R"(}},
        "ignore": )" +
                     ignore + "}");
}

TEST(WeightStorage, ReadsCompressedTensorsWithOneGroupOverEveryLinearLayer) {
    auto storage = [](const std::string& config) {
        return parse_hf_config(config, "ct.json").weight_storage;
    };
    const std::string fp8_w = R"({"num_bits": 8, "type": "float", "strategy": "channel",
        "symmetric": true, "group_size": null})";
    const std::string fp8_a = R"({"num_bits": 8, "type": "float", "strategy": "token",
        "dynamic": true})";
    EXPECT_EQ(storage(ct(fp8_w, fp8_a)), (WeightStorage{"compressed-tensors", 8, 8, 8, true}));
    // Weight-only fp8 (no activation quantization): the bf16 rate.
    EXPECT_EQ(storage(ct(fp8_w, "null")), (WeightStorage{"compressed-tensors", 8, 8, 8, false}));
    // W4A16, groups of 128 with a bf16 scale: 4 + 16/128 bits; asymmetric adds a 4-bit zero point.
    const std::string w4 = R"({"num_bits": 4, "type": "int", "strategy": "group",
        "group_size": 128, "symmetric": true})";
    EXPECT_EQ(storage(ct(w4, "null")),
              (WeightStorage{"compressed-tensors", 4.125, 4.125, 4.125, false}));
    const std::string w4a = R"({"num_bits": 4, "type": "int", "strategy": "group",
        "group_size": 128, "symmetric": false})";
    EXPECT_EQ(storage(ct(w4a, "null")),
              (WeightStorage{"compressed-tensors", 4.15625, 4.15625, 4.15625, false}));
    // NVFP4: 4-bit floats, an fp8 scale per 16.
    const std::string nvfp4 = R"({"num_bits": 4, "type": "float", "strategy": "tensor_group",
        "group_size": 16})";
    EXPECT_EQ(storage(ct(nvfp4, R"({"num_bits": 4, "type": "float"})")),
              (WeightStorage{"compressed-tensors", 4.5, 4.5, 4.5, false}));
    // Every layer's attention left in bf16.
    EXPECT_EQ(storage(ct(fp8_w, fp8_a, R"(["lm_head", "re:.*self_attn.*"])")),
              (WeightStorage{"compressed-tensors", 0, 8, 8, true}));
    // What it cannot size part by part: recorded unsized (the weights then need --weight-dtype).
    EXPECT_FALSE(storage(ct(fp8_w, fp8_a, R"(["lm_head", "model.layers.0.mlp.down_proj"])")).sized);
    EXPECT_FALSE(storage(ct(R"({"num_bits": 2, "type": "int", "strategy": "group",
        "group_size": 64})",
                            "null"))
                     .sized);
    EXPECT_FALSE(storage(qwen_with(R"({"quant_method": "compressed-tensors", "config_groups":
        {"a": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
        "strategy": "channel"}}, "b": {"targets": ["Linear"], "weights": {"num_bits": 4,
        "type": "int", "strategy": "group", "group_size": 128}}}})"))
                     .sized);
    // Sized: W4A16 weights are about a quarter of bf16's.
    const ModelSpec m = parse_hf_config(ct(w4, "null"), "ct.json");
    const KvLayout layout = make_layout(m, tp(1));
    const WeightBytes q = rank_weight_bytes(layout, 0), b = rank_weight_bytes(layout, 0, 16);
    EXPECT_EQ(q.dense_mlp, int64_t{4} * 3 * 1024 * 3072 * 4125 / 8000);
    EXPECT_EQ(q.embedding, b.embedding);
}

TEST(WeightStorage, GptOssExpertsAreSizedInMxfp4) {
    const ModelSpec m = catalog_model("gpt-oss-120b");
    const KvLayout layout = make_layout(m, tp(1));
    const WeightBytes w = rank_weight_bytes(layout, 0);
    // Per layer: 128 experts of 3 x 2880 x 2880 at 4.25 bits, the router (2880 x 128 and its
    // bias of 128) in bf16. The experts' biases (gate_up 2 x 2880, down 2880 each) are bf16
    // too, counted with the norms.
    const int64_t experts_per_layer =
        128LL * 3 * 2880 * 2880 * 425 / 800 + (2880LL * 128 + 128) * 2;
    EXPECT_EQ(w.experts, 36 * experts_per_layer);
    EXPECT_EQ(w.experts, 60940624896LL);
    EXPECT_EQ(w.norms, 2 * (36 * (2 * 2880 + (64 + 2 * 8) * 64 + 2880 + 128 * 3 * 2880) + 2880));
    // Attention, embedding and LM head as in bf16.
    const WeightBytes bf16 = rank_weight_bytes(layout, 0, 16);
    EXPECT_EQ(w.attention, bf16.attention);
    EXPECT_EQ(w.embedding, bf16.embedding);
    EXPECT_EQ(w.lm_head, bf16.lm_head);
    EXPECT_EQ(bf16.experts, 36 * (128LL * 3 * 2880 * 2880 * 2 + (2880LL * 128 + 128) * 2));
    // The whole checkpoint is 60.7 GiB (OpenAI: "fits on a single 80 GB GPU"); in bf16, 217.5.
    const double total =
        double(w.attention + w.dense_mlp + w.experts + w.embedding + w.lm_head + w.norms) /
        double(int64_t{1} << 30);
    EXPECT_GT(total, 59);
    EXPECT_LT(total, 62);
    // So it fits one H100 with KV to spare, where bf16 does not fit.
    EXPECT_TRUE(compute_capacity(m, tp(1), hardware_by_name("h100-sxm")).fits);
    CapacityOptions o;
    o.weight_dtype = WeightDtype::kBf16;
    EXPECT_FALSE(compute_capacity(m, tp(1), hardware_by_name("h100-sxm"), o).fits);
}

TEST(WeightStorage, DecodeReadsTheStoredBytesAndMatmulsRunAtTheStoredRate) {
    const HardwareSpec hw = hardware_by_name("h200");
    Workload work;
    work.prompt_tokens = work.context_tokens = 8192;
    work.batch = 1;
    auto cost = [&](const ModelSpec& m, WeightDtype w) {
        CostOptions o;
        o.weight_dtype = w;
        return estimate_cost(m, tp(8), hw, work, o);
    };
    // gpt-oss: the experts' bytes at 4.25 bits, fewer bytes per decode step than bf16 weights;
    // MXFP4 is widened to bf16 for the matmuls, so prefill compute is bf16's.
    const ModelSpec oss = catalog_model("gpt-oss-120b");
    const CostReport q = cost(oss, WeightDtype::kModel), b = cost(oss, WeightDtype::kBf16);
    // (batch 1 on tp 8: 4 of 128 experts a layer, about half the bytes read; the rest is
    // attention, the LM head and the KV, all bf16 either way)
    EXPECT_LT(q.decode.memory_s, 0.55 * b.decode.memory_s);
    EXPECT_DOUBLE_EQ(q.prefill.compute_s, b.prefill.compute_s);
    // DeepSeek-V3: fp8 matmuls, as --weight-dtype fp8; bytes read a little above it (the block
    // scales, and the routers and the LM head in bf16).
    const ModelSpec ds = catalog_model("deepseek-v3");
    const CostReport d = cost(ds, WeightDtype::kModel), f = cost(ds, WeightDtype::kFp8);
    EXPECT_DOUBLE_EQ(d.prefill.compute_s, f.prefill.compute_s);
    EXPECT_GT(d.decode.memory_s, f.decode.memory_s);
    EXPECT_LT(d.decode.memory_s, 1.05 * f.decode.memory_s);
}

}  // namespace
}  // namespace kvshard
