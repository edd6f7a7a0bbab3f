#pragma once
// Safetensors files (https://huggingface.co/docs/safetensors): 8 bytes little-endian header length
// N, N bytes of JSON {"name": {"dtype": "F32"|"BF16"|"F16", "shape": [...], "data_offsets": [b,
// e]}, ...,
// "__metadata__": {...}}, then the data; offsets are relative to the end of the header, row-major.
// Every malformed, truncated or inconsistent file is an Error naming the file and the tensor.
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvshard/common/dtype.h"
#include "kvshard/model/weights.h"

namespace kvshard {

struct SafetensorsEntry {
    std::string name;
    DType dtype = DType::kFp32;
    std::vector<int64_t> shape;
    int64_t offset = 0;  // absolute byte offset of the data in the file
    int64_t bytes = 0;
};

// The bytes a safetensors file's header takes, its 8-byte length included, from the file's first 8
// bytes; Error when the length does not fit the file (or exceeds 100 MiB).
int64_t safetensors_header_bytes(std::string_view first8, int64_t file_size,
                                 const std::string& path);
// The tensors of a safetensors file from its first bytes (`prefix`: at least the length and the
// header), checked against the file's size: dtype, shape, offsets. Throws Error naming the tensor.
std::vector<SafetensorsEntry> parse_safetensors_header(std::string_view prefix, int64_t file_size,
                                                       const std::string& path);

class SafetensorsFile {
  public:
    // Parses and validates the header against the file size. Throws Error.
    explicit SafetensorsFile(std::string path);
    const std::string& path() const { return path_; }
    const std::vector<SafetensorsEntry>& tensors() const { return entries_; }
    const SafetensorsEntry* find(const std::string& name) const;
    // Rows [r0, r1) x columns [c0, c1) of a tensor as fp32 (1-D: n rows of one column).
    std::vector<float> read(const SafetensorsEntry& e, int64_t r0, int64_t r1, int64_t c0,
                            int64_t c1) const;

  private:
    std::string path_;
    int64_t file_size_ = 0;
    std::vector<SafetensorsEntry> entries_;
};

// A Hugging Face checkpoint directory: every *.safetensors file in it (sharded checkpoints
// included).
class SafetensorsCheckpoint final : public TensorSource {
  public:
    explicit SafetensorsCheckpoint(
        const std::string& dir);  // Error if it holds no .safetensors file
    bool has(const std::string& name) const override;
    std::vector<float> read(const std::string& name, const std::vector<int64_t>& shape,
                            int64_t row_begin, int64_t row_end, int64_t col_begin,
                            int64_t col_end) const override;
    int64_t num_tensors() const;

  private:
    std::pair<const SafetensorsFile*, const SafetensorsEntry*> lookup(
        const std::string& name) const;
    std::string dir_;
    std::vector<SafetensorsFile> files_;
};

struct TensorToWrite {
    std::string name;
    std::vector<int64_t> shape;
    const float* data = nullptr;  // row-major, product(shape) elements
};
// Writes one file with every tensor converted to `dtype` (fp32, bf16 round-to-nearest-even, fp16).
void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       DType dtype);

// Writes DIR/config.json (Llama or Mixtral fields) and DIR/model.safetensors from unsharded
// weights.
void save_hf_checkpoint(const ModelWeights& full, const std::string& dir, DType dtype);

// Writes every tensor of hf_tensor_list(m) (the published names and shapes of each layer kind's
// family) as `source` holds it to one safetensors file: a checkpoint of any model the spec
// describes, e.g. of random_tensor_source weights for a test.
void save_hf_tensors(const ModelSpec& m, const TensorSource& source, const std::string& path,
                     DType dtype);

}  // namespace kvshard
