#pragma once
// VllmEventPublisher: publishes KV events in vLLM's wire format (docs/router.md, "vLLM's KV event
// stream"), so a consumer of vLLM's stream (llm-d, Dynamo, kvshard's own subscriber) can follow a
// kvshard BlockManager. Frames (topic, 8-byte big-endian sequence from 0, msgpack EventBatch) on a
// ZMQ XPUB socket (a PUB that also sees subscriptions), and, when a replay endpoint is given, a
// ROUTER that answers replay requests from a bounded buffer of past batches as vLLM's does. The
// ZMQ backend is optional: without libzmq, available() is false and the constructor throws Error.
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "kvshard/cache/kv_events.h"
#include "kvshard/cache/vllm_kv_events.h"

namespace kvshard {

struct VllmPublisherOptions {
    std::string endpoint = "tcp://127.0.0.1:0";  // bound; port 0 picks a free one
    std::string replay_endpoint;                 // bound when non-empty
    std::string topic;
    int data_parallel_rank = 0;
    size_t buffer_steps = 10000;  // batches kept for replay
    VllmWireForm form = VllmWireForm::kPositional;
};

class VllmEventPublisher {
  public:
    static bool available();

    // Binds the sockets; Error when ZMQ refuses an endpoint.
    explicit VllmEventPublisher(VllmPublisherOptions options = {});
    ~VllmEventPublisher();
    VllmEventPublisher(const VllmEventPublisher&) = delete;
    VllmEventPublisher& operator=(const VllmEventPublisher&) = delete;

    std::string endpoint() const;  // as bound, e.g. tcp://127.0.0.1:41234
    std::string replay_endpoint() const;

    // True once a subscriber has joined (within `timeout`): messages sent before are lost (PUB).
    bool wait_for_subscriber(std::chrono::milliseconds timeout);
    // Sends one batch (data_parallel_rank filled in when absent); returns its sequence number.
    // Not thread-safe: one publishing thread.
    uint64_t publish(VllmEventBatch batch);
    // A BlockManager subscriber (BlockManager::subscribe) that publishes each event as a batch of
    // one (to_vllm_event), stamped with the wall clock. The publisher must outlive it.
    KvEventCallback block_manager_callback();

  private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace kvshard
