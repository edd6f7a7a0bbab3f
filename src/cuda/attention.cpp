#include "kvshard/cuda/attention.h"

#include <algorithm>
#include <vector>

#include "cuda/check.h"
#include "cuda/kernels.h"

namespace kvshard::cuda {
namespace {

bool elem_type(DType t, detail::ElemType& out) {
    switch (t) {
        case DType::kFp32:
            out = detail::ElemType::kFp32;
            return true;
        case DType::kBf16:
            out = detail::ElemType::kBf16;
            return true;
        case DType::kFp16:
            out = detail::ElemType::kFp16;
            return true;
        default:
            return false;
    }
}

template <typename T>
DeviceBuffer upload_vector(const std::vector<T>& v) {
    DeviceBuffer b(static_cast<int64_t>(std::max<size_t>(1, v.size()) * sizeof(T)));
    b.upload(std::as_bytes(std::span<const T>(v)));
    return b;
}

// The chunk length (a multiple of 64 tokens, the tile) that minimises the modelled time of the
// decode kernel: waves of thread blocks (two per SM reside at once) times the tiles each block
// reads plus a fixed cost of about 4 tiles per block (its start, its pipeline's fill and the merge
// of its warps), fitted to H200 runs of bench_cuda --sweep (docs/cuda.md). Chunks are
// the longest sequence split evenly, so that its last chunk is not a sliver.
int choose_chunk_tokens(const std::vector<int64_t>& lens, int kv_heads) {
    constexpr int64_t kTile = 64, kBlockCostTiles = 4;
    const int64_t longest = std::max<int64_t>(1, *std::max_element(lens.begin(), lens.end()));
    const int64_t slots = 2 * (device_available() ? multiprocessor_count() : 132);
    int64_t best_chunk = kTile, best_cost = -1;
    const int64_t max_split = std::min<int64_t>(256, (longest + kTile - 1) / kTile);
    for (int64_t n = 1; n <= max_split; ++n) {
        const int64_t chunk = ((longest + n - 1) / n + kTile - 1) / kTile * kTile;
        int64_t blocks = 0;
        for (int64_t len : lens) blocks += std::max<int64_t>(1, (len + chunk - 1) / chunk);
        blocks *= kv_heads;
        const int64_t cost = (blocks + slots - 1) / slots * (chunk / kTile + kBlockCostTiles);
        if (best_cost < 0 || cost < best_cost) {
            best_cost = cost;
            best_chunk = chunk;
        }
    }
    return static_cast<int>(std::min<int64_t>(best_chunk, int64_t{1} << 30));
}

}  // namespace

std::string paged_kv_error(const PagedKv& kv, int block_size, int64_t num_blocks) {
    const int batch = kv.batch();
    if (static_cast<int>(kv.indptr.size()) != batch + 1 || kv.indptr.front() != 0 ||
        kv.indptr.back() != static_cast<int32_t>(kv.indices.size()))
        return "the PagedKv's indptr must have batch + 1 = " + std::to_string(batch + 1) +
               " entries from 0 to the number of indices (" + std::to_string(kv.indices.size()) +
               "), got " + std::to_string(kv.indptr.size()) + " entries";
    for (int i = 0; i < batch; ++i) {
        const int32_t blocks = kv.indptr[i + 1] - kv.indptr[i];
        if (blocks < 0)
            return "the PagedKv's indptr decreases at sequence " + std::to_string(i) + " (" +
                   std::to_string(kv.indptr[i]) + " then " + std::to_string(kv.indptr[i + 1]) +
                   "): it must not";
        const int32_t last = kv.last_page_len[i];
        if (blocks == 0 ? last != 0 : (last < 1 || last > block_size))
            return "sequence " + std::to_string(i) + " has " + std::to_string(blocks) +
                   " blocks and last_page_len " + std::to_string(last) +
                   ": it must be 1 to the block size (" + std::to_string(block_size) +
                   ") for a sequence with blocks, 0 for one without";
    }
    for (size_t j = 0; j < kv.indices.size(); ++j)
        if (kv.indices[j] < 0 || kv.indices[j] >= num_blocks)
            return "block " + std::to_string(kv.indices[j]) + " (index " + std::to_string(j) +
                   " of the PagedKv) is outside the pool of " + std::to_string(num_blocks) +
                   " blocks";
    return "";
}

std::string decode_support_error(const PageGeometry& g, const DecodeParams& p) {
    detail::ElemType elem{};
    if (!elem_type(g.dtype, elem))
        return "device decode attention covers fp32, bf16 and fp16 pools (not fp8: its per-block "
               "scales have no device kernel yet)";
    if (g.kv_factor != 2)
        return "device decode attention needs K and V pages (kv_factor 2; MLA's latent has no "
               "device kernel yet)";
    if (p.num_kv_heads != g.num_heads || p.head_dim != g.head_dim)
        return "num_kv_heads and head_dim must be the pool's (" + std::to_string(g.num_heads) +
               " heads, head_dim " + std::to_string(g.head_dim) + ")";
    if (p.num_kv_heads < 1 || p.num_q_heads % p.num_kv_heads != 0)
        return "num_q_heads (" + std::to_string(p.num_q_heads) +
               ") must be a multiple of num_kv_heads (" + std::to_string(p.num_kv_heads) + ")";
    const int group = p.num_q_heads / p.num_kv_heads;
    if (!detail::decode_supported(p.head_dim, group, elem))
        return "device decode attention covers head_dim 64, 128 or 256, and 1 to 16 query heads "
               "per KV head on bf16 / fp16 pools (tensor cores) or 1, 2, 4 or 8 on fp32 pools "
               "(got head_dim " +
               std::to_string(p.head_dim) + ", " + std::to_string(group) + " per KV head, " +
               std::string(dtype_name(g.dtype)) + ")";
    return "";
}

DeviceDecode::DeviceDecode(const PagedKv& kv, const PageGeometry& geometry, int64_t num_blocks,
                           const DecodeParams& p, int chunk_tokens)
    : geometry_(geometry), num_blocks_(num_blocks), params_(p), batch_(kv.batch()) {
    const std::string why = decode_support_error(geometry, p);
    require(why.empty(), why);
    require(batch_ >= 1, "device decode attention needs at least one sequence");
    const std::string bad = paged_kv_error(kv, geometry.block_size, num_blocks);
    require(bad.empty(), bad);
    require(chunk_tokens >= 0, "chunk_tokens must be >= 0 (0: chosen)");
    int64_t total = 0;
    std::vector<int64_t> lens(static_cast<size_t>(batch_));
    for (int i = 0; i < batch_; ++i) {
        lens[static_cast<size_t>(i)] = kv.seq_len(i, geometry.block_size);
        total += lens[static_cast<size_t>(i)];
    }
    if (chunk_tokens == 0) chunk_tokens = choose_chunk_tokens(lens, p.num_kv_heads);
    chunk_tokens_ = chunk_tokens;
    int64_t items = 0;
    for (int64_t len : lens) items += std::max<int64_t>(1, (len + chunk_tokens - 1) / chunk_tokens);
    require(items < (int64_t{1} << 31), "chunk_tokens ", chunk_tokens, " cuts the batch into ",
            items, " chunks; the kernels take fewer than 2^31: raise chunk_tokens (0 chooses)");
    std::vector<int32_t> work, chunk_indptr{0};
    work.reserve(static_cast<size_t>(2 * items));
    for (int i = 0; i < batch_; ++i) {
        const int64_t n =
            std::max<int64_t>(1, (lens[static_cast<size_t>(i)] + chunk_tokens - 1) / chunk_tokens);
        for (int64_t c = 0; c < n; ++c) {
            work.push_back(i);
            work.push_back(static_cast<int32_t>(c));
        }
        chunk_indptr.push_back(static_cast<int32_t>(work.size() / 2));
    }
    work_items_ = items;
    kv_bytes_ =
        total * geometry.kv_factor * geometry.num_heads * geometry.head_dim * geometry.elem_size();
    indptr_ = upload_vector(kv.indptr);
    indices_ = upload_vector(kv.indices);
    last_page_len_ = upload_vector(kv.last_page_len);
    work_ = upload_vector(work);
    chunk_indptr_ = upload_vector(chunk_indptr);
    partial_out_ = DeviceBuffer(work_items_ * p.num_q_heads * p.head_dim * 4);
    partial_lse_ = DeviceBuffer(work_items_ * p.num_q_heads * 4);
}

void DeviceDecode::run(const DevicePool& pool, int layer, const float* q, float* out, float* lse,
                       void* stream) {
    require(pool.geometry() == geometry_ && pool.num_blocks() == num_blocks_,
            "device decode attention: the pool is not the one the plan was made for (geometry "
            "and ",
            num_blocks_, " blocks)");
    require(layer >= 0 && layer < geometry_.num_layers, "layer ", layer, " is outside the pool's ",
            geometry_.num_layers, " layers");
    detail::DecodeLaunch a{};
    a.pool = reinterpret_cast<const unsigned char*>(pool.data());
    a.num_blocks = num_blocks_;
    a.page_elems = geometry_.page_elems();
    a.layer = layer;
    a.kv_factor = geometry_.kv_factor;
    a.block_size = geometry_.block_size;
    a.num_kv_heads = params_.num_kv_heads;
    a.num_q_heads = params_.num_q_heads;
    a.head_dim = params_.head_dim;
    const bool hnd = geometry_.order == PageOrder::kHnd;
    a.head_stride = hnd ? geometry_.block_size * geometry_.head_dim : geometry_.head_dim;
    a.token_stride = hnd ? geometry_.head_dim : geometry_.num_heads * geometry_.head_dim;
    elem_type(geometry_.dtype, a.elem);
    a.scale = params_.scale;
    a.indptr = reinterpret_cast<const int*>(indptr_.data());
    a.indices = reinterpret_cast<const int*>(indices_.data());
    a.last_page_len = reinterpret_cast<const int*>(last_page_len_.data());
    a.work = reinterpret_cast<const int*>(work_.data());
    a.work_items = work_items_;
    a.chunk_indptr = reinterpret_cast<const int*>(chunk_indptr_.data());
    a.batch = batch_;
    a.chunk_tokens = chunk_tokens_;
    a.q = q;
    a.partial_out = reinterpret_cast<float*>(partial_out_.data());
    a.partial_lse = reinterpret_cast<float*>(partial_lse_.data());
    a.out = out;
    a.lse = lse;
    KVSHARD_CUDA_CALL(detail::launch_decode(a, detail::stream_of(stream)));
}

void merge_attention(std::span<const float* const> outs, std::span<const float* const> lses,
                     int64_t rows, int dim, float* out, float* lse, void* stream) {
    require(!outs.empty() && outs.size() == lses.size(),
            "merge_attention needs one LSE per partial and at least one partial");
    require(outs.size() <= 64, "merge_attention merges at most 64 partials (got ", outs.size(),
            ")");
    require(rows >= 0 && dim >= 1, "merge_attention: rows >= 0 and dim >= 1");
    if (rows == 0) return;
    detail::launch_merge(outs.data(), lses.data(), static_cast<int>(outs.size()), rows, dim, out,
                         lse, detail::stream_of(stream));
    KVSHARD_CUDA_CALL(cudaGetLastError());
}

}  // namespace kvshard::cuda
