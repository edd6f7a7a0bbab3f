#include "kvshard/model/safetensors.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "kvshard/common/checked.h"
#include "kvshard/common/error.h"

namespace kvshard {
namespace {

std::string shape_text(const std::vector<int64_t>& s) {
    std::string t = "[";
    for (size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
    return t + "]";
}

float bf16_to_f32(uint16_t b) {
    const uint32_t u = uint32_t{b} << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

uint16_t f32_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return uint16_t((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fff + ((u >> 16) & 1);                                         // round to nearest even
    return uint16_t(u >> 16);
}

float f16_to_f32(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000) << 16;
    const int exp = (h >> 10) & 0x1f;
    const uint32_t mant = h & 0x3ff;
    float f;
    if (exp == 0) {
        f = std::ldexp(float(mant), -24);  // zero and subnormals
        return sign ? -f : f;
    }
    uint32_t u;
    if (exp == 31)
        u = sign | 0x7f800000 | (mant << 13);
    else
        u = sign | (uint32_t(exp - 15 + 127) << 23) | (mant << 13);
    std::memcpy(&f, &u, 4);
    return f;
}

uint16_t f32_to_f16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint16_t sign = uint16_t((u >> 16) & 0x8000);
    const float a = std::fabs(f);
    if (std::isnan(f)) return sign | 0x7e00;
    if (a >= 65520.0f) return sign | 0x7c00;  // overflow to infinity
    if (a < 6.103515625e-05f) {               // subnormal half: multiples of 2^-24
        return sign | uint16_t(std::nearbyint(a * 16777216.0f));
    }
    int e;
    const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
    uint32_t mant = uint32_t(std::nearbyint((m * 2.0f - 1.0f) * 1024.0f));
    int exp = e - 1 + 15;
    if (mant == 1024) {
        mant = 0;
        ++exp;
    }
    if (exp >= 31) return sign | 0x7c00;
    return sign | uint16_t(exp << 10) | uint16_t(mant);
}

const char* st_dtype_name(DType t) {
    switch (t) {
        case DType::kFp32:
            return "F32";
        case DType::kBf16:
            return "BF16";
        case DType::kFp16:
            return "F16";
        default:
            return nullptr;
    }
}

}  // namespace

int64_t safetensors_header_bytes(std::string_view first8, int64_t file_size,
                                 const std::string& path) {
    require(file_size >= 8 && first8.size() >= 8, path, ": truncated safetensors file (", file_size,
            " bytes, less than the 8-byte header length)");
    uint64_t header_len = 0;
    for (int i = 7; i >= 0; --i)
        header_len = (header_len << 8) | static_cast<unsigned char>(first8[static_cast<size_t>(i)]);
    require(header_len <= uint64_t(file_size - 8) && header_len <= (uint64_t{100} << 20), path,
            ": malformed safetensors file: header length ", header_len, " does not fit in the ",
            file_size, "-byte file");
    return 8 + static_cast<int64_t>(header_len);
}

std::vector<SafetensorsEntry> parse_safetensors_header(std::string_view prefix, int64_t file_size,
                                                       const std::string& path) {
    const int64_t data_begin = safetensors_header_bytes(prefix, file_size, path);
    require(static_cast<int64_t>(prefix.size()) >= data_begin, path,
            ": truncated safetensors header");
    const std::string_view header = prefix.substr(8, static_cast<size_t>(data_begin - 8));
    const int64_t data_size = file_size - data_begin;
    std::vector<SafetensorsEntry> entries;

    nlohmann::json j;
    try {
        j = nlohmann::json::parse(header);
    } catch (const nlohmann::json::exception& e) {
        throw Error(detail::concat(path, ": malformed safetensors header, not valid JSON (",
                                   e.what(), ")"));
    }
    require(j.is_object(), path, ": malformed safetensors header, expected a JSON object");
    for (const auto& item : j.items()) {
        const std::string name = item.key();
        const auto& v = item.value();
        if (name == "__metadata__") continue;
        auto bad = [&](const std::string& why) {
            return Error(detail::concat(path, ": tensor '", name, "': ", why));
        };
        if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") ||
            !v.contains("data_offsets"))
            throw bad("header entry needs dtype, shape and data_offsets");
        SafetensorsEntry e;
        e.name = name;
        const auto& dt = v["dtype"];
        if (!dt.is_string()) throw bad("dtype must be a string");
        const std::string d = dt.get<std::string>();
        if (d == "F32")
            e.dtype = DType::kFp32;
        else if (d == "BF16")
            e.dtype = DType::kBf16;
        else if (d == "F16")
            e.dtype = DType::kFp16;
        else
            throw bad("dtype " + d + " is not supported (expected F32, BF16 or F16)");
        if (!v["shape"].is_array()) throw bad("shape must be an array");
        int64_t numel = 1;
        for (const auto& s : v["shape"]) {
            if (!s.is_number_integer() || s.get<int64_t>() < 0 ||
                s.get<int64_t>() > (int64_t{1} << 40))
                throw bad("shape must hold non-negative integers, got " + v["shape"].dump());
            e.shape.push_back(s.get<int64_t>());
            numel = sat_mul(numel, e.shape.back());  // each <= 2^40: the product may not fit
            if (numel > (int64_t{1} << 40)) throw bad("shape too large: " + v["shape"].dump());
        }
        const auto& off = v["data_offsets"];
        if (!off.is_array() || off.size() != 2 || !off[0].is_number_integer() ||
            !off[1].is_number_integer())
            throw bad("data_offsets must be [begin, end]");
        const int64_t b = off[0].get<int64_t>(), en = off[1].get<int64_t>();
        if (b < 0 || en < b)
            throw bad("data_offsets " + off.dump() + " are not an ascending range");
        if (en > data_size)
            throw bad(detail::concat("data_offsets ", off.dump(), " run past the end of the data (",
                                     data_size, " bytes): the file is truncated"));
        if (en - b != numel * int64_t(dtype_size(e.dtype)))
            throw bad(detail::concat("data_offsets ", off.dump(), " hold ", en - b,
                                     " bytes but shape ", shape_text(e.shape), " of ", d, " needs ",
                                     numel * int64_t(dtype_size(e.dtype))));
        e.offset = data_begin + b;
        e.bytes = en - b;
        entries.push_back(std::move(e));
    }
    std::sort(entries.begin(), entries.end(),
              [](const auto& a, const auto& b) { return a.name < b.name; });
    return entries;
}

SafetensorsFile::SafetensorsFile(std::string path) : path_(std::move(path)) {
    std::ifstream in(path_, std::ios::binary | std::ios::ate);
    require(bool(in), "cannot open safetensors file '", path_, "'");
    file_size_ = int64_t(in.tellg());
    in.seekg(0);
    std::string prefix(8, '\0');
    in.read(prefix.data(), 8);
    const int64_t n =
        safetensors_header_bytes(prefix.substr(0, size_t(in.gcount())), file_size_, path_);
    prefix.resize(static_cast<size_t>(n));
    in.read(prefix.data() + 8, std::streamsize(n - 8));
    require(bool(in), path_, ": truncated safetensors header");
    entries_ = parse_safetensors_header(prefix, file_size_, path_);
}

const SafetensorsEntry* SafetensorsFile::find(const std::string& name) const {
    auto it = std::lower_bound(
        entries_.begin(), entries_.end(), name,
        [](const SafetensorsEntry& e, const std::string& n) { return e.name < n; });
    return it != entries_.end() && it->name == name ? &*it : nullptr;
}

std::vector<float> SafetensorsFile::read(const SafetensorsEntry& e, int64_t r0, int64_t r1,
                                         int64_t c0, int64_t c1) const {
    int64_t cols = 1;  // a row is every trailing dimension (conv1d's [C][1][K]: K per row)
    for (size_t i = 1; i < e.shape.size(); ++i) cols *= e.shape[i];
    const int64_t es = int64_t(dtype_size(e.dtype));
    std::ifstream in(path_, std::ios::binary);
    require(bool(in), "cannot open safetensors file '", path_, "'");
    std::vector<char> raw(size_t((r1 - r0) * cols * es));
    in.seekg(e.offset + r0 * cols * es);
    in.read(raw.data(), std::streamsize(raw.size()));
    require(bool(in), path_, ": tensor '", e.name, "': read failed (file truncated?)");
    std::vector<float> out;
    out.reserve(size_t((r1 - r0) * (c1 - c0)));
    for (int64_t r = 0; r < r1 - r0; ++r)
        for (int64_t c = c0; c < c1; ++c) {
            const char* p = raw.data() + (r * cols + c) * es;
            switch (e.dtype) {
                case DType::kFp32: {
                    float f;
                    std::memcpy(&f, p, 4);
                    out.push_back(f);
                    break;
                }
                case DType::kBf16:
                case DType::kFp16: {
                    uint16_t u;
                    std::memcpy(&u, p, 2);
                    out.push_back(e.dtype == DType::kBf16 ? bf16_to_f32(u) : f16_to_f32(u));
                    break;
                }
                default:
                    KVSHARD_CHECK(false, "unreachable dtype");
            }
        }
    return out;
}

SafetensorsCheckpoint::SafetensorsCheckpoint(const std::string& dir) : dir_(dir) {
    namespace fs = std::filesystem;
    std::error_code ec;
    std::vector<std::string> paths;
    if (fs::is_regular_file(dir, ec)) {
        paths.push_back(dir);
    } else {
        require(fs::is_directory(dir, ec), "checkpoint '", dir,
                "' is neither a directory nor a file");
        for (const auto& ent : fs::directory_iterator(dir, ec))
            if (ent.path().extension() == ".safetensors") paths.push_back(ent.path().string());
    }
    std::sort(paths.begin(), paths.end());
    require(!paths.empty(), "checkpoint directory '", dir,
            "' holds no *.safetensors file: expected model.safetensors or "
            "model-0000N-of-0000M.safetensors");
    for (const auto& p : paths) files_.emplace_back(p);
}

std::pair<const SafetensorsFile*, const SafetensorsEntry*> SafetensorsCheckpoint::lookup(
    const std::string& name) const {
    for (const auto& f : files_)
        if (const auto* e = f.find(name)) return {&f, e};
    return {nullptr, nullptr};
}

bool SafetensorsCheckpoint::has(const std::string& name) const {
    return lookup(name).second != nullptr;
}

int64_t SafetensorsCheckpoint::num_tensors() const {
    int64_t n = 0;
    for (const auto& f : files_) n += int64_t(f.tensors().size());
    return n;
}

std::vector<float> SafetensorsCheckpoint::read(const std::string& name,
                                               const std::vector<int64_t>& shape, int64_t row_begin,
                                               int64_t row_end, int64_t col_begin,
                                               int64_t col_end) const {
    const auto [file, e] = lookup(name);
    if (!e)
        throw Error(detail::concat("checkpoint '", dir_, "': missing tensor '", name, "' (",
                                   num_tensors(), " tensors in ", files_.size(), " file(s))"));
    if (e->shape != shape)
        throw Error(detail::concat(file->path(), ": tensor '", name, "' has shape ",
                                   shape_text(e->shape), " but the model config needs ",
                                   shape_text(shape)));
    int64_t cols = 1;
    for (size_t i = 1; i < shape.size(); ++i) cols *= shape[i];
    const int64_t rows = shape[0];
    KVSHARD_CHECK(0 <= row_begin && row_begin <= row_end && row_end <= rows && 0 <= col_begin &&
                      col_begin <= col_end && col_end <= cols,
                  "slice out of range for ", name);
    return file->read(*e, row_begin, row_end, col_begin, col_end);
}

void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       DType dtype) {
    const char* dname = st_dtype_name(dtype);
    require(dname != nullptr, "safetensors output dtype must be fp32, bf16 or fp16, got ",
            dtype_name(dtype));
    const int64_t es = int64_t(dtype_size(dtype));
    nlohmann::ordered_json header = nlohmann::ordered_json::object();
    header["__metadata__"] = {{"format", "pt"}};
    int64_t off = 0;
    for (const auto& t : tensors) {
        int64_t n = 1;
        for (auto s : t.shape) n *= s;
        header[t.name] = {
            {"dtype", dname}, {"shape", t.shape}, {"data_offsets", {off, off + n * es}}};
        off += n * es;
    }
    std::string h = header.dump();
    while ((h.size() + 8) % 8 != 0) h += ' ';  // data 8-byte aligned, as the reference writer does
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    require(bool(out), "cannot write '", path, "'");
    unsigned char len[8];
    for (int i = 0; i < 8; ++i)
        len[i] = static_cast<unsigned char>((uint64_t(h.size()) >> (8 * i)) & 0xff);
    out.write(reinterpret_cast<const char*>(len), 8);
    out.write(h.data(), std::streamsize(h.size()));
    std::vector<char> buf;
    for (const auto& t : tensors) {
        int64_t n = 1;
        for (auto s : t.shape) n *= s;
        buf.resize(size_t(n * es));
        for (int64_t i = 0; i < n; ++i) {
            if (dtype == DType::kFp32) {
                std::memcpy(buf.data() + i * 4, &t.data[i], 4);
            } else {
                const uint16_t u =
                    dtype == DType::kBf16 ? f32_to_bf16(t.data[i]) : f32_to_f16(t.data[i]);
                std::memcpy(buf.data() + i * 2, &u, 2);
            }
        }
        out.write(buf.data(), std::streamsize(buf.size()));
    }
    require(bool(out), "write to '", path, "' failed");
}

void save_hf_checkpoint(const ModelWeights& w, const std::string& dir, DType dtype) {
    const ModelSpec& m = w.spec;
    require(w.shard == WeightShard::full(m), "save_hf_checkpoint needs unsharded weights");
    namespace fs = std::filesystem;
    std::error_code ec;
    fs::create_directories(dir, ec);
    require(!ec, "cannot create directory '", dir, "': ", ec.message());

    nlohmann::ordered_json cfg;
    cfg["_name_or_path"] = m.name;
    cfg["architectures"] = {m.moe.enabled() ? "MixtralForCausalLM" : "LlamaForCausalLM"};
    cfg["model_type"] = m.moe.enabled() ? "mixtral" : "llama";
    cfg["hidden_size"] = m.hidden;
    cfg["num_hidden_layers"] = m.num_layers;
    cfg["num_attention_heads"] = m.num_heads;
    cfg["num_key_value_heads"] = m.num_kv_heads;
    cfg["head_dim"] = m.head_dim;
    cfg["intermediate_size"] = m.moe.enabled() ? m.moe.expert_intermediate : m.intermediate;
    if (m.moe.enabled()) {
        cfg["num_local_experts"] = m.moe.num_experts;
        cfg["num_experts_per_tok"] = m.moe.experts_per_token;
    }
    cfg["vocab_size"] = m.vocab;
    cfg["rope_theta"] = m.rope_theta;
    cfg["rms_norm_eps"] = m.rms_norm_eps;
    cfg["tie_word_embeddings"] = m.tie_embeddings;
    cfg["torch_dtype"] = dtype == DType::kFp32   ? "float32"
                         : dtype == DType::kBf16 ? "bfloat16"
                                                 : "float16";
    {
        std::ofstream out(fs::path(dir) / "config.json");
        require(bool(out), "cannot write config.json in '", dir, "'");
        out << cfg.dump(2) << "\n";
    }

    std::vector<TensorToWrite> ts;
    const auto list = hf_tensor_list(m);
    for (const auto& [name, shape] : list) {
        const float* data = nullptr;
        if (name == hf_names::kEmbed)
            data = w.embed.data();
        else if (name == hf_names::kFinalNorm)
            data = w.final_norm.data();
        else if (name == hf_names::kLmHead)
            data = w.lm_head.data();
        else {
            // model.layers.N.<rest>
            const size_t p0 = std::strlen("model.layers.");
            const size_t dot = name.find('.', p0);
            const int l = std::stoi(name.substr(p0, dot - p0));
            const std::string rest = name.substr(dot + 1);
            const LayerWeights& lw = w.layers[l];
            if (rest == "input_layernorm.weight")
                data = lw.attn_norm.data();
            else if (rest == "self_attn.q_proj.weight")
                data = lw.wq.data();
            else if (rest == "self_attn.k_proj.weight")
                data = lw.wk.data();
            else if (rest == "self_attn.v_proj.weight")
                data = lw.wv.data();
            else if (rest == "self_attn.o_proj.weight")
                data = lw.wo.data();
            else if (rest == "post_attention_layernorm.weight")
                data = lw.mlp_norm.data();
            else if (rest == "mlp.gate_proj.weight")
                data = lw.gate.data();
            else if (rest == "mlp.up_proj.weight")
                data = lw.up.data();
            else if (rest == "mlp.down_proj.weight")
                data = lw.down.data();
            else if (rest == "block_sparse_moe.gate.weight")
                data = lw.router.data();
            else {
                const std::string pre = "block_sparse_moe.experts.";
                KVSHARD_CHECK(rest.rfind(pre, 0) == 0, "unexpected tensor ", name);
                const size_t d2 = rest.find('.', pre.size());
                const int e = std::stoi(rest.substr(pre.size(), d2 - pre.size()));
                const std::string wname = rest.substr(d2 + 1);
                const ExpertWeights& ew = lw.experts[e];
                data = wname == "w1.weight"   ? ew.gate.data()
                       : wname == "w3.weight" ? ew.up.data()
                                              : ew.down.data();
            }
        }
        ts.push_back({name, shape, data});
    }
    for (size_t l = 0; l < w.layers.size(); ++l) {
        const auto& lw = w.layers[l];
        const std::string p = hf_names::layer_prefix(int(l));
        if (!lw.bq.empty()) {
            ts.push_back({p + "self_attn.q_proj.bias", {int64_t(lw.bq.size())}, lw.bq.data()});
            ts.push_back({p + "self_attn.k_proj.bias", {int64_t(lw.bk.size())}, lw.bk.data()});
            ts.push_back({p + "self_attn.v_proj.bias", {int64_t(lw.bv.size())}, lw.bv.data()});
        }
    }
    write_safetensors((fs::path(dir) / "model.safetensors").string(), ts, dtype);
}

void save_hf_tensors(const ModelSpec& m, const TensorSource& source, const std::string& path,
                     DType dtype) {
    const auto list = hf_tensor_list(m);
    std::vector<std::vector<float>> data;
    data.reserve(list.size());
    std::vector<TensorToWrite> ts;
    for (const auto& [name, shape] : list) {
        int64_t cols = 1;
        for (size_t i = 1; i < shape.size(); ++i) cols *= shape[i];
        data.push_back(source.read(name, shape, 0, shape[0], 0, cols));
        ts.push_back({name, shape, data.back().data()});
    }
    write_safetensors(path, ts, dtype);
}

}  // namespace kvshard
