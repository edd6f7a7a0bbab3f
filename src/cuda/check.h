#pragma once
// CUDA runtime calls that fail throw kvshard::Error with the call and CUDA's message.
#include <cuda_runtime.h>

#include <string>

#include "kvshard/common/error.h"

namespace kvshard::cuda::detail {

inline void check(cudaError_t e, const char* call) {
    if (e != cudaSuccess)
        throw Error(std::string("CUDA: ") + call + " failed: " + cudaGetErrorString(e));
}

inline cudaStream_t stream_of(void* s) { return static_cast<cudaStream_t>(s); }

}  // namespace kvshard::cuda::detail

#define KVSHARD_CUDA_CALL(call) ::kvshard::cuda::detail::check((call), #call)
