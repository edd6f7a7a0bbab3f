#pragma once
// VllmEventSubscriber: ZMQ SUB sockets on vLLM engines' KV event publishers, feeding a KvIndex
// through VllmEventIngest (vllm_event_ingest.h) on a thread of its own.
//
// One endpoint per replica (a vLLM DP rank publishes on its own port: base port + rank). On a gap
// it asks the endpoint's replay socket (vLLM's ROUTER: request = the first missing sequence
// number, 8 bytes big-endian; replies (seq, payload) ..., then (-1, "")) when one is configured,
// else, or when the replay does not close the gap within replay_timeout_ms, it marks the replica
// stale. The ZMQ backend is optional: without libzmq, available() is false and the constructor
// throws Error.
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvshard/router/kv_index.h"
#include "kvshard/router/vllm_event_ingest.h"

namespace kvshard {

struct VllmEventEndpoint {
    int replica = 0;              // index of the replica in the KvIndex
    std::string endpoint;         // e.g. tcp://127.0.0.1:5557 or ipc:///tmp/kv (connected)
    std::string replay_endpoint;  // e.g. tcp://127.0.0.1:5567; empty: no replay
    std::string topic;            // subscription prefix; empty: every topic
};

struct VllmSubscriberOptions {
    int replay_timeout_ms = 1000;
    int receive_hwm = 100000;  // messages queued per socket before ZMQ drops (bounded memory)
    int64_t max_blocks_per_replica = VllmEventIngest::kDefaultMaxBlocksPerReplica;
    int block_size = 0;  // the engines' block size; BlockStored of another size: not indexed
};

// One engine of `kvshard router serve --engine
// NAME=tcp://HOST:PORT[,dp=K,replay=tcp://HOST:PORT,spec=METHOD]`
// (or ipc://PATH for either endpoint, with dp=1):
// K data-parallel ranks, rank k publishing on PORT + k (and replaying on its replay PORT + k), as
// vLLM's offset_endpoint_port does.
struct VllmEngineSpec {
    std::string name;
    std::string endpoint;
    int dp = 1;
    std::string replay_endpoint;
    // spec=METHOD: the engine's --speculative-config method ("" or none: no speculation). Set per
    // engine because vLLM's SpeculativeConfig is per `vllm serve` (all its DP ranks share it) and
    // a fleet may mix drafting and plain engines. eagle / eagle3 / mtp turn on the EAGLE block drop
    // (vllm_eagle_block_drop); the other methods change nothing the router sees.
    std::string speculative_method;
};
// An endpoint is tcp://HOST:PORT or ipc://PATH (vLLM binds either; inproc:// is refused: it
// cannot be reached from another process). Error naming what is wrong (no '=', a name that is
// empty or has characters other than letters, digits and . _ - : (names are JSON keys and
// Prometheus label values), an endpoint of neither form, a tcp:// endpoint with an empty host or
// the wildcard host * (the engine binds there; the router connects to its address), dp outside
// 1..64, dp above 1 with an ipc:// endpoint, an unknown option or speculative method).
VllmEngineSpec parse_vllm_engine_spec(std::string_view text);

// The router's replicas from its engines, in order: an engine with dp = K gives K replicas,
// NAME/dp0 .. NAME/dp(K-1), rank k on the endpoints offset by k (offset_endpoint_port); dp = 1
// gives one replica, NAME. Error on no engine, more than KvIndex::kMaxReplicas replicas, a replica
// name twice, or an event or replay endpoint that two replicas would share (each engine rank
// publishes on its own socket; two replicas fed by one publisher would each claim its blocks).
struct VllmReplicaFeeds {
    std::vector<std::string> names;            // replica index order
    std::vector<VllmEventEndpoint> endpoints;  // endpoints[r].replica == r
    std::vector<bool> eagle_block_drop;        // [r]: its engine's spec= drops a block
};
VllmReplicaFeeds expand_vllm_engines(std::span<const VllmEngineSpec> engines);
// Sets what the engines' options say about their prefix caches on the index (today: the EAGLE
// block drop, KvIndex::set_eagle_block_drop). Error when the index has another replica count.
void configure_vllm_index(KvIndex& index, const VllmReplicaFeeds& feeds);
// tcp://host:port with port + rank (rank 0: unchanged); Error when there is no numeric port or
// the endpoint is ipc:// (vLLM's offset_endpoint_port refuses it for a rank above 0).
std::string offset_endpoint_port(const std::string& endpoint, int rank);

class VllmEventSubscriber {
  public:
    static bool available();  // built with libzmq

    // Connects every endpoint and starts the receiving thread. Error on a replica outside the
    // index or an endpoint ZMQ refuses.
    VllmEventSubscriber(KvIndex& index, std::vector<VllmEventEndpoint> endpoints,
                        VllmSubscriberOptions options = {});
    ~VllmEventSubscriber();  // stop()
    VllmEventSubscriber(const VllmEventSubscriber&) = delete;
    VllmEventSubscriber& operator=(const VllmEventSubscriber&) = delete;

    // Stops the thread and closes the sockets; idempotent.
    void stop();

    // Runs `fn` with the index and the feed state held still (the receiving thread waits).
    void with_index(const std::function<void(const KvIndex&, const VllmEventIngest&)>& fn) const;
    VllmFeedStatus status(int replica) const;

  private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace kvshard
