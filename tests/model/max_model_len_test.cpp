// The longest sequence a model serves (ModelSpec::max_model_len), derived from config.json as
// vLLM's _get_and_verify_max_len (vllm/config/model.py) derives it: the smallest length field,
// model_max_length winning, the RoPE factor applied except for su/longrope/llama3 and Gemma 3,
// yarn scaling original_max_position_embeddings.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "kvshard/common/error.h"
#include "kvshard/model/catalog.h"

namespace kvshard {
namespace {

std::string read_config(const std::string& name) {
    std::ifstream in(std::string(KVSHARD_TEST_DATA_DIR) + "/hf_configs/" + name + ".json");
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

ModelSpec llama_with(const std::string& extra) {
    return parse_hf_config(R"({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "vocab_size": 100)" + extra +
                               "}",
                           "test.json");
}

TEST(MaxModelLen, PublishedConfigs) {
    struct Case {
        const char* file;
        int64_t tokens;
        const char* from;
    };
    const Case cases[] = {
        // rope_type llama3: max_position_embeddings already counts the scaling.
        {"llama-3.1-8b", 131072, "max_position_embeddings 131072"},
        // yarn: original_max_position_embeddings 4096 x factor 40.
        {"deepseek-v3", 163840,
         "original_max_position_embeddings 4096 x rope_scaling yarn factor 40"},
        {"gpt-oss-120b", 131072,
         "original_max_position_embeddings 4096 x rope_scaling yarn factor 32"},
        // ChatGLM's seq_length.
        {"glm-4-9b-chat", 131072, "seq_length 131072"},
        // Gemma 3: rope_scaling linear factor 8 is not applied, and the length is the class's.
        {"gemma-3-27b", 131072, "Gemma3TextConfig's default max_position_embeddings 131072"},
        {"falcon-7b-instruct", 2048, "FalconConfig's default max_position_embeddings 2048"},
        // Qwen3-VL's rope_scaling is mrope of rope_type default: no factor.
        {"qwen3-vl-30b-a3b", 262144, "max_position_embeddings 262144"},
        {"phi-3-mini-4k-instruct", 4096, "max_position_embeddings 4096"},
        {"nemotron-h-8b", 8192, "max_position_embeddings 8192"},
    };
    for (const Case& c : cases) {
        SCOPED_TRACE(c.file);
        const ModelSpec m = parse_hf_config(read_config(c.file), c.file);
        EXPECT_EQ(m.max_model_len, c.tokens);
        EXPECT_EQ(m.max_model_len_from, c.from);
    }
}

TEST(MaxModelLen, CatalogAgreesWithThePublishedConfig) {
    for (const auto& [name, file] : {std::pair{"llama-3.1-8b", "llama-3.1-8b"},
                                     {"deepseek-v3", "deepseek-v3"},
                                     {"gpt-oss-120b", "gpt-oss-120b"},
                                     {"gemma-3-27b", "gemma-3-27b"},
                                     {"gemma-4-31b", "gemma-4-31b"},
                                     {"mistral-7b-v0.1", "mistral-7b-v0.1"},
                                     {"mixtral-8x7b", "mixtral-8x7b-v0.1"},
                                     {"qwen3-next-80b-a3b", "qwen3-next-80b-a3b"},
                                     {"qwen3.5-35b-a3b", "qwen3.5-35b-a3b"},
                                     {"glm-4.5-air", "glm-4.5-air"},
                                     {"minimax-m2", "minimax-m2"},
                                     {"llama-4-scout", "llama-4-scout"},
                                     {"nemotron-h-8b", "nemotron-h-8b"},
                                     {"granite-4.0-h-tiny", "granite-4.0-h-tiny"}}) {
        SCOPED_TRACE(name);
        EXPECT_EQ(catalog_model(name).max_model_len,
                  parse_hf_config(read_config(file), file).max_model_len);
    }
    EXPECT_EQ(catalog_model("tiny").max_model_len, 0);  // built-in test models state none
}

TEST(MaxModelLen, VllmsDerivation) {
    // The smallest of the length fields.
    EXPECT_EQ(llama_with(R"(, "max_position_embeddings": 8192, "seq_length": 4096)").max_model_len,
              4096);
    // model_max_length wins even when larger (Command-R).
    const ModelSpec cohere =
        llama_with(R"(, "max_position_embeddings": 8192, "model_max_length": 131072)");
    EXPECT_EQ(cohere.max_model_len, 131072);
    EXPECT_EQ(cohere.max_model_len_from, "model_max_length 131072");
    // linear and dynamic factors scale it; llama3, longrope and su do not.
    EXPECT_EQ(llama_with(R"(, "max_position_embeddings": 4096,
        "rope_scaling": {"type": "linear", "factor": 4.0})")
                  .max_model_len,
              16384);
    EXPECT_EQ(llama_with(R"(, "max_position_embeddings": 4096,
        "rope_scaling": {"rope_type": "dynamic", "factor": 2.0})")
                  .max_model_len,
              8192);
    EXPECT_EQ(llama_with(R"(, "max_position_embeddings": 131072,
        "rope_scaling": {"rope_type": "longrope", "factor": 32.0,
        "original_max_position_embeddings": 4096})")
                  .max_model_len,
              131072);
    // Qwen3 with yarn enabled as its model card says: 32768 x 4.
    EXPECT_EQ(llama_with(R"(, "max_position_embeddings": 40960,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
        "original_max_position_embeddings": 32768})")
                  .max_model_len,
              131072);
    // Transformers 5's rope_parameters, keyed by layer type.
    EXPECT_EQ(llama_with(R"(, "max_position_embeddings": 4096, "rope_parameters":
        {"full_attention": {"rope_type": "linear", "factor": 2.0},
         "sliding_attention": {"rope_type": "default"}})")
                  .max_model_len,
              8192);
    // No length field: none stated, nothing checked; but yarn states original x factor.
    EXPECT_EQ(llama_with("").max_model_len, 0);
    EXPECT_EQ(
        llama_with(R"(, "rope_scaling": {"rope_type": "linear", "factor": 4.0})").max_model_len, 0);
    EXPECT_EQ(llama_with(R"(, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
        "original_max_position_embeddings": 32768})")
                  .max_model_len,
              131072);
    // transformers' "no limit" (int(1e30)) bounds nothing: clamped to 2^40, not refused.
    EXPECT_EQ(llama_with(R"(, "model_max_length": 1000000000000000019884624838656)").max_model_len,
              int64_t{1} << 40);
    // Bad values are refused by name.
    EXPECT_THROW(llama_with(R"(, "max_position_embeddings": -5)"), Error);
    EXPECT_THROW(llama_with(R"(, "max_position_embeddings": "long")"), Error);
    EXPECT_THROW(llama_with(R"(, "max_position_embeddings": 4096,
        "rope_scaling": {"type": "linear", "factor": -1})"),
                 Error);
    try {
        llama_with(R"(, "max_position_embeddings": 0)");
        ADD_FAILURE() << "a zero length was accepted";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("'max_position_embeddings' must be a positive"),
                  std::string::npos)
            << e.what();
    }
}

// vLLM bounds the length by the tokenizer's model_max_length (tokenizer_config.json in the model
// directory), before the RoPE factor.
TEST(MaxModelLen, TokenizerConfigBesideTheConfig) {
    namespace fs = std::filesystem;
    const fs::path dir = fs::path(testing::TempDir()) / "kvshard_max_len_tokenizer";
    fs::create_directories(dir);
    fs::copy_file(std::string(KVSHARD_TEST_DATA_DIR) + "/hf_configs/qwen2.5-7b.json",
                  dir / "config.json", fs::copy_options::overwrite_existing);
    fs::remove(dir / "tokenizer_config.json");
    EXPECT_EQ(resolve_model(dir.string()).max_model_len, 131072);
    auto tokenizer = [&](const std::string& text) {
        std::ofstream(dir / "tokenizer_config.json") << text;
        return resolve_model(dir.string());
    };
    const ModelSpec bounded = tokenizer(R"({"model_max_length": 32768})");
    EXPECT_EQ(bounded.max_model_len, 32768);
    EXPECT_EQ(bounded.max_model_len_from, "tokenizer_config.json's model_max_length 32768");
    // transformers' "no limit" sentinel (int(1e30)) and a larger length leave it alone.
    EXPECT_EQ(tokenizer(R"({"model_max_length": 1000000000000000019884624838656})").max_model_len,
              131072);
    EXPECT_EQ(tokenizer(R"({"model_max_length": 262144})").max_model_len, 131072);
    EXPECT_EQ(tokenizer(R"({"tokenizer_class": "Qwen2Tokenizer"})").max_model_len, 131072);
    EXPECT_THROW(tokenizer(R"({"model_max_length": "long"})"), Error);
    // A config without a length field takes the tokenizer's.
    {
        std::ofstream(dir / "config.json") << R"({"model_type": "llama", "num_hidden_layers": 2,
            "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 128, "vocab_size": 100})";
        EXPECT_EQ(tokenizer(R"({"model_max_length": 4096})").max_model_len, 4096);
    }
    EXPECT_THROW(tokenizer("{not json"), Error);
    fs::remove_all(dir);
}

TEST(MaxModelLen, LongerSequencesAreRefusedUnlessAllowed) {
    const ModelSpec m = catalog_model("llama-3.1-8b");
    EXPECT_NO_THROW(m.check_sequence_length(131072, false, "a context"));
    EXPECT_THROW(m.check_sequence_length(131073, false, "a context"), Error);
    EXPECT_NO_THROW(m.check_sequence_length(131073, true, "a context"));
    EXPECT_NO_THROW(catalog_model("tiny").check_sequence_length(int64_t{1} << 40, false, "x"));
    // The length survives the model's JSON.
    EXPECT_EQ(model_spec_from_json(to_json(m)), m);
}

}  // namespace
}  // namespace kvshard
