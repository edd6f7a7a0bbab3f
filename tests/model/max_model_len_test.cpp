// The longest sequence a model serves (ModelSpec::max_model_len), derived from config.json as
// vLLM's _get_and_verify_max_len (vllm/config/model.py) derives it: the smallest length field,
// model_max_length winning, the RoPE factor applied except for su/longrope/llama3 and Gemma 3,
// yarn scaling original_max_position_embeddings.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
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
    // No length field: LlamaConfig's default max_position_embeddings (2048), which the RoPE
    // factor scales as it scales a stated one; yarn states original x factor.
    EXPECT_EQ(llama_with("").max_model_len, 2048);
    EXPECT_EQ(llama_with("").max_model_len_from,
              "LlamaConfig's default max_position_embeddings 2048");
    EXPECT_EQ(
        llama_with(R"(, "rope_scaling": {"rope_type": "linear", "factor": 4.0})").max_model_len,
        8192);
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

// A config.json without a length field: vLLM's getattr(hf_config, key, None) reads the config
// class's default (src/model/hf_config.cpp class_length names each class and its source file).
// Each case takes a published config of that model_type (or of a sibling whose fields the type
// reads, model_type replaced), drops every length field and the RoPE scaling, and expects the
// class's default, named in max_model_len_from.
TEST(MaxModelLen, ClassDefaultWhereTheConfigStatesNone) {
    struct Case {
        const char* model_type;
        const char* file;
        const char* config_class;
        const char* key;
        int64_t tokens;
        const char* extra = "";  // fields the type needs beyond the file's (JSON object body)
    };
    const Case cases[] = {
        {"llama", "llama-3.1-8b", "LlamaConfig", "max_position_embeddings", 2048},
        {"mistral", "mistral-7b-v0.1", "MistralConfig", "max_position_embeddings", 131072},
        {"phi3", "phi-3-mini-4k-instruct", "Phi3Config", "max_position_embeddings", 4096},
        {"mixtral", "mixtral-8x7b-v0.1", "MixtralConfig", "max_position_embeddings", 131072},
        {"qwen2", "qwen2.5-7b", "Qwen2Config", "max_position_embeddings", 32768},
        {"qwen2_moe", "qwen2.5-7b", "Qwen2MoeConfig", "max_position_embeddings", 32768},
        {"qwen3", "qwen3-8b", "Qwen3Config", "max_position_embeddings", 32768},
        {"qwen3_moe", "qwen3-30b-a3b", "Qwen3MoeConfig", "max_position_embeddings", 32768},
        {"qwen3_vl_text", "qwen3-8b", "Qwen3VLTextConfig", "max_position_embeddings", 128000},
        {"qwen3_vl_moe", "qwen3-vl-30b-a3b", "Qwen3VLMoeTextConfig", "max_position_embeddings",
         128000},
        {"qwen3_next", "qwen3-next-80b-a3b", "Qwen3NextConfig", "max_position_embeddings", 32768},
        {"qwen3_5_moe", "qwen3.5-35b-a3b", "Qwen3_5MoeTextConfig", "max_position_embeddings",
         32768},
        {"gemma2", "gemma-2-9b-it", "Gemma2Config", "max_position_embeddings", 8192},
        {"gemma3", "gemma-3-27b", "Gemma3TextConfig", "max_position_embeddings", 131072},
        {"gemma4", "gemma-4-31b", "Gemma4TextConfig", "max_position_embeddings", 131072},
        {"llama4", "llama-4-scout", "Llama4TextConfig", "max_position_embeddings", 131072},
        {"deepseek_v2", "deepseek-v3", "DeepseekV2Config", "max_position_embeddings", 2048},
        {"deepseek_v3", "deepseek-v3", "DeepseekV3Config", "max_position_embeddings", 4096},
        {"deepseek_v32", "deepseek-v3.2-exp", "DeepseekV3Config", "max_position_embeddings", 4096},
        {"chatglm", "glm-4-9b-chat", "ChatGLMConfig", "seq_length", 2048},
        {"glm4", "qwen3-8b", "Glm4Config", "max_position_embeddings", 131072},
        {"glm4_moe", "glm-4.5-air", "Glm4MoeConfig", "max_position_embeddings", 131072},
        {"minimax_m2", "minimax-m2", "MiniMaxM2Config", "max_position_embeddings", 196608},
        {"falcon", "falcon-7b-instruct", "FalconConfig", "max_position_embeddings", 2048},
        {"nemotron_h", "nemotron-h-8b", "NemotronHConfig", "max_position_embeddings", 4096},
        {"granitemoehybrid", "granite-4.0-h-tiny", "GraniteMoeHybridConfig",
         "max_position_embeddings", 2048},
        {"bamba", "bamba-9b", "BambaConfig", "max_position_embeddings", 262144},
        {"falcon_h1", "falcon-h1-7b-instruct", "FalconH1Config", "max_position_embeddings", 8192},
        {"longcat_flash", "longcat-flash-chat", "LongcatFlashConfig", "max_position_embeddings",
         131072},
        {"jamba", "jamba-v0.1", "JambaConfig", "max_position_embeddings", 262144},
        {"olmo2", "olmo-2-7b-instruct", "Olmo2Config", "max_position_embeddings", 2048},
        {"olmo3", "olmo-3-7b", "Olmo3Config", "max_position_embeddings", 2048},
        {"cohere2", "c4ai-command-r7b-12-2024", "Cohere2Config", "max_position_embeddings", 8192},
        {"exaone4", "exaone-4.0-32b", "Exaone4Config", "max_position_embeddings", 2048},
        {"smollm3", "smollm3-3b", "SmolLM3Config", "max_position_embeddings", 32768},
        {"lfm2", "lfm2-1.2b", "Lfm2Config", "max_position_embeddings", 128000},
        {"seed_oss", "seed-oss-36b-instruct", "SeedOssConfig", "max_position_embeddings", 524288},
        {"ernie4_5", "ernie-4.5-0.3b-pt", "Ernie4_5Config", "max_position_embeddings", 131072},
        {"ernie4_5_moe", "ernie-4.5-21b-a3b-pt", "Ernie4_5_MoeConfig", "max_position_embeddings",
         131072},
        {"hunyuan_v1_dense", "hy-mt2-7b", "HunYuanDenseV1Config", "max_position_embeddings", 2048},
        {"hunyuan_v1_moe", "hunyuan-a13b-instruct", "HunYuanMoEV1Config", "max_position_embeddings",
         2048},
        {"granite", "granite-3.3-8b-instruct", "GraniteConfig", "max_position_embeddings", 2048},
        {"granitemoe", "granite-3.1-3b-a800m-instruct", "GraniteMoeConfig",
         "max_position_embeddings", 2048},
    };
    const char* kLengthKeys[] = {"max_position_embeddings",
                                 "n_positions",
                                 "max_seq_len",
                                 "seq_length",
                                 "model_max_length",
                                 "max_target_positions",
                                 "max_sequence_length",
                                 "max_seq_length",
                                 "seq_len",
                                 "rope_scaling",
                                 "rope_parameters"};
    for (const Case& c : cases) {
        SCOPED_TRACE(c.model_type);
        nlohmann::json j = nlohmann::json::parse(read_config(c.file));
        nlohmann::json& text = j.contains("text_config") ? j["text_config"] : j;
        for (nlohmann::json* o : {&j, &text})
            for (const char* k : kLengthKeys) o->erase(k);
        // The text config's model_type is the one read; a wrapper keeps its own.
        if (!j.contains("text_config")) j["model_type"] = c.model_type;
        if (*c.extra) text.update(nlohmann::json::parse(std::string("{") + c.extra + "}"));
        const ModelSpec m = parse_hf_config(j.dump(), c.file);
        EXPECT_EQ(m.max_model_len, c.tokens);
        EXPECT_EQ(m.max_model_len_from, std::string(c.config_class) + "'s default " + c.key + " " +
                                            std::to_string(c.tokens));
        // A stated length still wins over the default, smaller or larger.
        text["max_position_embeddings"] = 1000;
        if (std::string(c.key) == "max_position_embeddings") {
            EXPECT_EQ(parse_hf_config(j.dump(), c.file).max_model_len, 1000);
        }
    }
    // ChatGLMConfig defaults seq_length whatever max_position_embeddings says (vLLM takes the
    // smaller): a config stating only max_position_embeddings 8192 serves 2048.
    nlohmann::json glm = nlohmann::json::parse(read_config("glm-4-9b-chat"));
    glm.erase("seq_length");
    glm["max_position_embeddings"] = 8192;
    EXPECT_EQ(parse_hf_config(glm.dump(), "glm").max_model_len, 2048);
    // A class with no length attribute (KimiLinearConfig, RWConfig) and an unconfirmed one
    // (Nemotron Super's DeciLMConfig) state none.
    nlohmann::json kimi = nlohmann::json::parse(read_config("kimi-linear-48b-a3b-instruct"));
    kimi.erase("model_max_length");
    EXPECT_EQ(parse_hf_config(kimi.dump(), "kimi").max_model_len, 0);
    nlohmann::json rw = nlohmann::json::parse(read_config("falcon-7b-instruct"));
    rw["model_type"] = "RefinedWebModel";
    EXPECT_EQ(parse_hf_config(rw.dump(), "rw").max_model_len, 0);
    nlohmann::json nas = nlohmann::json::parse(read_config("llama-3.3-nemotron-super-49b"));
    nas.erase("max_position_embeddings");
    nas.erase("rope_scaling");
    EXPECT_EQ(parse_hf_config(nas.dump(), "nas").max_model_len, 0);
}

// GptOssConfig and Ministral3Config fill in a yarn RoPE scaling when the config states none
// (transformers' configuration_gpt_oss.py and configuration_ministral3.py, __post_init__), and
// vLLM's _get_and_verify_max_len (vllm/config/model.py) reads the class's rope_parameters: yarn
// takes original_max_position_embeddings x factor in place of max_position_embeddings. So such a
// config serves 4096 x 32 (GPT-OSS) or 16384 x 16 (Ministral 3) tokens whatever length it states;
// a stated rope_scaling is read as before.
TEST(MaxModelLen, ClassDefaultYarnWhereTheConfigStatesNoRope) {
    struct Case {
        const char* model_type;
        const char* file;
        const char* from;
        int64_t tokens;
        const char* extra;
    };
    const Case cases[] = {
        {"gpt_oss", "gpt-oss-20b",
         "GptOssConfig's default rope_parameters: original_max_position_embeddings 4096 x yarn "
         "factor 32",
         131072, ""},
        {"ministral3", "mistral-7b-v0.1",
         "Ministral3Config's default rope_parameters: original_max_position_embeddings 16384 x "
         "yarn factor 16",
         262144, R"("head_dim": 128)"},
    };
    for (const Case& c : cases) {
        SCOPED_TRACE(c.model_type);
        nlohmann::json j = nlohmann::json::parse(read_config(c.file));
        j.erase("rope_scaling");
        j.erase("rope_parameters");
        j["model_type"] = c.model_type;
        if (*c.extra) j.update(nlohmann::json::parse(std::string("{") + c.extra + "}"));
        for (int stated : {0, 1000, 65536, 1 << 20}) {
            if (stated > 0)
                j["max_position_embeddings"] = stated;
            else
                j.erase("max_position_embeddings");
            const ModelSpec m = parse_hf_config(j.dump(), c.file);
            EXPECT_EQ(m.max_model_len, c.tokens) << "max_position_embeddings " << stated;
            EXPECT_EQ(m.max_model_len_from, c.from);
        }
        // A stated rope_scaling is the config's, not the class's.
        j["max_position_embeddings"] = 8192;
        j["rope_scaling"] = {
            {"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 2048}};
        EXPECT_EQ(parse_hf_config(j.dump(), c.file).max_model_len, 8192);
        j["rope_scaling"] = {{"rope_type", "default"}};
        EXPECT_EQ(parse_hf_config(j.dump(), c.file).max_model_len, 8192);
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
    // A config without a length field takes the tokenizer's where it is below the class's
    // default (LlamaConfig's 2048).
    {
        std::ofstream(dir / "config.json") << R"({"model_type": "llama", "num_hidden_layers": 2,
            "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 128, "vocab_size": 100})";
        EXPECT_EQ(tokenizer(R"({"model_max_length": 1024})").max_model_len, 1024);
        EXPECT_EQ(tokenizer(R"({"model_max_length": 4096})").max_model_len, 2048);
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
