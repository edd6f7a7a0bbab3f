#pragma once
// The CUDA backend's memory (docs/cuda.md): device buffers and device block pools. A DevicePool
// has BlockPool's byte layout (cache/block_pool.h) bit for bit, so the host reference checks what
// the kernels write by comparing bytes. Memory is cudaMalloc'd (never managed memory) and freed
// by the owner's destructor.
//
// Errors: a CUDA call that fails throws kvshard::Error naming the call and CUDA's message; wrong
// arguments (sizes, offsets outside a buffer) throw kvshard::Error before any work is queued.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "kvshard/cache/block_pool.h"

namespace kvshard::cuda {

// Whether a CUDA device can be used here (a driver and at least one device). Never throws: the
// tests and benchmarks skip themselves when it is false.
bool device_available();
// "NVIDIA H200, sm_90, 132 SMs, 141 GB" for device 0; "" without one.
std::string device_description();
// SMs of the current device (cudaGetDevice).
int multiprocessor_count();
// Waits for all work queued on the device (cudaDeviceSynchronize); throws on a CUDA error.
void synchronize();

// `bytes` of device memory (cudaMalloc), released on destruction. Move-only.
class DeviceBuffer {
  public:
    DeviceBuffer() = default;
    explicit DeviceBuffer(int64_t bytes);
    ~DeviceBuffer();
    DeviceBuffer(DeviceBuffer&& other) noexcept;
    DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;

    std::byte* data() { return data_; }
    const std::byte* data() const { return data_; }
    int64_t size() const { return size_; }
    // Host <-> device copies of host.size() bytes at byte `offset` (synchronous).
    void upload(std::span<const std::byte> host, int64_t offset = 0);
    void download(std::span<std::byte> host, int64_t offset = 0) const;
    // Every byte := value (synchronous).
    void fill(uint8_t value);

  private:
    std::byte* data_ = nullptr;
    int64_t size_ = 0;
};

// A rank's paged KV on the device: num_blocks blocks of `geometry`, BlockPool's byte layout
// (pages [layer][kv][block], HND or NHD inside a page, fp8 scales after the pages).
class DevicePool {
  public:
    // Throws Error when num_blocks < 1 or the geometry is empty.
    DevicePool(const PageGeometry& geometry, int64_t num_blocks);

    const PageGeometry& geometry() const { return geometry_; }
    int64_t num_blocks() const { return num_blocks_; }
    int64_t arena_bytes() const { return arena_.size(); }
    std::byte* data() { return arena_.data(); }
    const std::byte* data() const { return arena_.data(); }
    int64_t page_offset(int layer, int kv, int64_t block) const {
        return ((int64_t{layer} * geometry_.kv_factor + kv) * num_blocks_ + block) *
               geometry_.page_bytes();
    }
    // The whole arena from / to a host BlockPool's arena() (arena_bytes() bytes; Error otherwise).
    void upload(std::span<const std::byte> host_arena);
    void download(std::span<std::byte> host_arena) const;

  private:
    PageGeometry geometry_;
    int64_t num_blocks_ = 0;
    DeviceBuffer arena_;
};

}  // namespace kvshard::cuda
