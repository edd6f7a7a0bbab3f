#pragma once
// CUDA IPC (docs/cuda.md, "Direct read between processes"): the GPU counterpart of the host
// direct read. A prefill process exports its device pool's memory as a handle; a decode process on
// the same host opens it and reads the pool in place with a direct-copy program (copy.h), the
// bytes going GPU to GPU with no staging and no host copy.
#include <array>
#include <cstddef>
#include <cstdint>

#include "kvshard/cuda/device.h"

namespace kvshard::cuda {

// cudaIpcMemHandle_t's bytes, to send to another process (a pipe, a socket, MPI).
struct IpcHandle {
    std::array<std::byte, 64> bytes{};
    int64_t size = 0;  // bytes of the exported allocation
};

IpcHandle export_memory(const DevicePool& pool);

// Another process's device memory, opened from its handle (cudaIpcOpenMemHandle), closed on
// destruction. Move-only.
class ImportedMemory {
  public:
    explicit ImportedMemory(const IpcHandle& handle);
    ~ImportedMemory();
    ImportedMemory(ImportedMemory&& other) noexcept;
    ImportedMemory& operator=(ImportedMemory&&) = delete;
    ImportedMemory(const ImportedMemory&) = delete;
    ImportedMemory& operator=(const ImportedMemory&) = delete;
    const std::byte* data() const { return data_; }
    int64_t size() const { return size_; }

  private:
    std::byte* data_ = nullptr;
    int64_t size_ = 0;
};

}  // namespace kvshard::cuda
