#include "kvshard/cuda/ipc.h"

#include <cstring>
#include <utility>

#include "cuda/check.h"

namespace kvshard::cuda {

static_assert(sizeof(cudaIpcMemHandle_t) == 64);

IpcHandle export_memory(const DevicePool& pool) {
    cudaIpcMemHandle_t h{};
    KVSHARD_CUDA_CALL(cudaIpcGetMemHandle(&h, const_cast<std::byte*>(pool.data())));
    IpcHandle out;
    std::memcpy(out.bytes.data(), &h, sizeof h);
    out.size = pool.arena_bytes();
    return out;
}

ImportedMemory::ImportedMemory(const IpcHandle& handle) : size_(handle.size) {
    require(handle.size > 0, "an IPC handle of ", handle.size, " bytes");
    cudaIpcMemHandle_t h{};
    std::memcpy(&h, handle.bytes.data(), sizeof h);
    void* p = nullptr;
    KVSHARD_CUDA_CALL(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
    data_ = static_cast<std::byte*>(p);
}

ImportedMemory::~ImportedMemory() {
    if (data_ != nullptr) (void)cudaIpcCloseMemHandle(data_);
}

ImportedMemory::ImportedMemory(ImportedMemory&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

}  // namespace kvshard::cuda
