// libFuzzer: vLLM KV event messages as a router receives them from the network. The input is
// cut into messages (a replica byte, an 8-byte sequence frame, a 2-byte payload length, the
// payload) and fed to VllmEventIngest over a KvIndex of 3 replicas, with a small per-replica cap
// so that eviction runs. Checks: decoding never throws and says why it refused; a payload that
// decodes is encoded again (vLLM's positional form) and decodes to the same batch; ingesting
// never throws, and its counters add up (every message is applied, a gap, a restart or malformed).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvshard/cache/vllm_kv_events.h"
#include "kvshard/router/kv_index.h"
#include "kvshard/router/vllm_event_ingest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    using namespace kvshard;
    KvIndex index(3);
    VllmEventIngest ingest(index, 64);
    int64_t messages = 0, gaps = 0;
    size_t at = 0;
    while (at + 11 <= size) {
        const int replica = data[at] % 3;
        const std::span<const uint8_t> seq(data + at + 1, 8);
        const size_t len =
            std::min<size_t>(size_t{data[at + 9]} | size_t{data[at + 10]} << 8, size - at - 11);
        const std::span<const uint8_t> payload(data + at + 11, len);
        at += 11 + len;

        const VllmDecodeResult d = decode_vllm_event_batch(payload);
        if (d.batch.has_value() == !d.error.empty()) __builtin_trap();
        if (d.batch) {
            VllmEventBatch again = *d.batch;
            for (auto& e : again.events) e.hashes_as_bytes = false;
            VllmDecodeResult r = decode_vllm_event_batch(encode_vllm_event_batch(again));
            if (!r.batch) __builtin_trap();
            for (auto& e : r.batch->events) e.hashes_as_bytes = false;
            // ts is carried as it came, NaN included (a NaN never equals itself).
            if (std::isnan(again.ts) != std::isnan(r.batch->ts)) __builtin_trap();
            if (std::isnan(again.ts)) again.ts = r.batch->ts = 0;
            if (!(*r.batch == again)) __builtin_trap();
        }
        const auto res = ingest.on_batch(replica, seq, payload, false, &d);
        ++messages;
        if (res.outcome == VllmEventIngest::Outcome::kGap) {
            ++gaps;
            ingest.mark_stale(replica);
            (void)ingest.on_batch(replica, seq, payload, false, &d);
            ++messages;
        }
    }
    int64_t accounted = 0;
    for (int r = 0; r < 3; ++r) {
        const VllmFeedStatus& s = ingest.status(r);
        accounted += s.batches + s.malformed + s.gaps;
    }
    // The per-replica cap bounds distinct hashes (copies of one hash are a count, as vLLM's
    // events pair them; num_blocks counts copies and may exceed it).
    if (index.num_hashes() > 3 * 64) __builtin_trap();
    if (accounted != messages) __builtin_trap();
    (void)gaps;
    return 0;
}
