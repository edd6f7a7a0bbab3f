#include "kvshard/cuda/device.h"

#include <utility>

#include "cuda/check.h"

namespace kvshard::cuda {

bool device_available() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();  // clear the sticky "no device" error
        return false;
    }
    return n > 0;
}

std::string device_description() {
    if (!device_available()) return "";
    cudaDeviceProp p{};
    KVSHARD_CUDA_CALL(cudaGetDeviceProperties(&p, 0));
    const size_t gib = p.totalGlobalMem >> 30;
    return std::string(p.name) + ", sm_" + std::to_string(p.major) + std::to_string(p.minor) +
           ", " + std::to_string(p.multiProcessorCount) + " SMs, " + std::to_string(gib) + " GiB";
}

int multiprocessor_count() {
    int device = 0, n = 0;
    KVSHARD_CUDA_CALL(cudaGetDevice(&device));
    KVSHARD_CUDA_CALL(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    return n;
}

void synchronize() { KVSHARD_CUDA_CALL(cudaDeviceSynchronize()); }

DeviceBuffer::DeviceBuffer(int64_t bytes) : size_(bytes) {
    require(bytes >= 0, "a device buffer of ", bytes, " bytes: the size must be >= 0");
    if (bytes > 0) {
        void* p = nullptr;
        KVSHARD_CUDA_CALL(cudaMalloc(&p, static_cast<size_t>(bytes)));
        data_ = static_cast<std::byte*>(p);
    }
}

DeviceBuffer::~DeviceBuffer() {
    if (data_ != nullptr) (void)cudaFree(data_);
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
        if (data_ != nullptr) (void)cudaFree(data_);
        data_ = std::exchange(other.data_, nullptr);
        size_ = std::exchange(other.size_, 0);
    }
    return *this;
}

void DeviceBuffer::upload(std::span<const std::byte> host, int64_t offset) {
    require(offset >= 0 && offset + static_cast<int64_t>(host.size()) <= size_, "upload of ",
            host.size(), " bytes at offset ", offset, " into a device buffer of ", size_, " bytes");
    if (host.empty()) return;
    KVSHARD_CUDA_CALL(cudaMemcpy(data_ + offset, host.data(), host.size(), cudaMemcpyHostToDevice));
}

void DeviceBuffer::download(std::span<std::byte> host, int64_t offset) const {
    require(offset >= 0 && offset + static_cast<int64_t>(host.size()) <= size_, "download of ",
            host.size(), " bytes at offset ", offset, " from a device buffer of ", size_, " bytes");
    if (host.empty()) return;
    KVSHARD_CUDA_CALL(cudaMemcpy(host.data(), data_ + offset, host.size(), cudaMemcpyDeviceToHost));
}

void DeviceBuffer::fill(uint8_t value) {
    if (size_ == 0) return;
    KVSHARD_CUDA_CALL(cudaMemset(data_, value, static_cast<size_t>(size_)));
    KVSHARD_CUDA_CALL(cudaDeviceSynchronize());
}

namespace {
int64_t checked_arena_bytes(const PageGeometry& g, int64_t num_blocks) {
    require(num_blocks >= 1, "a device pool needs at least one block (got ", num_blocks, ")");
    require(g.num_layers >= 1 && g.kv_factor >= 1 && g.num_heads >= 1 && g.block_size >= 1 &&
                g.head_dim >= 1,
            "a device pool needs a non-empty page geometry (layers, heads, block size and "
            "head_dim >= 1)");
    return num_blocks * g.block_bytes();
}
}  // namespace

DevicePool::DevicePool(const PageGeometry& geometry, int64_t num_blocks)
    : geometry_(geometry),
      num_blocks_(num_blocks),
      arena_(checked_arena_bytes(geometry, num_blocks)) {}

void DevicePool::upload(std::span<const std::byte> host_arena) {
    require(static_cast<int64_t>(host_arena.size()) == arena_bytes(), "upload of a ",
            host_arena.size(), "-byte arena into a device pool of ", arena_bytes(), " bytes");
    arena_.upload(host_arena);
}

void DevicePool::download(std::span<std::byte> host_arena) const {
    require(static_cast<int64_t>(host_arena.size()) == arena_bytes(), "download of a ",
            arena_bytes(), "-byte device pool into ", host_arena.size(), " bytes");
    arena_.download(host_arena);
}

}  // namespace kvshard::cuda
