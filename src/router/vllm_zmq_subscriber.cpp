// The ZMQ backend of VllmEventSubscriber and VllmEventPublisher (built when libzmq is found; else
// vllm_zmq_missing.cpp).
#include <array>
#include <atomic>
#include <chrono>
#include <deque>
#include <mutex>
#include <thread>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "kvshard/common/error.h"
#include "kvshard/router/vllm_event_publisher.h"
#include "kvshard/router/vllm_event_subscriber.h"

namespace kvshard {
namespace {

// A replayed message: the replay socket's end marker is sequence -1.
constexpr uint64_t kReplayEnd = UINT64_MAX;
constexpr int kPollMs = 50;
// Messages taken from one socket per poll round, so one busy engine does not starve the others.
constexpr int kBurst = 256;

std::span<const uint8_t> bytes_of(const zmq::message_t& m) {
    return {static_cast<const uint8_t*>(m.data()), m.size()};
}

}  // namespace

struct VllmEventSubscriber::Impl {
    KvIndex* index;
    std::vector<VllmEventEndpoint> endpoints;
    VllmSubscriberOptions options;
    zmq::context_t ctx{1};
    std::vector<zmq::socket_t> subs;
    mutable std::mutex mu;  // guards *index and ingest
    VllmEventIngest ingest;
    std::atomic<bool> running{true};
    std::thread thread;
    // The receiving thread's buffers, kept from message to message.
    std::vector<zmq::message_t> parts_scratch;
    std::vector<std::span<const uint8_t>> frames_scratch;

    Impl(KvIndex& idx, std::vector<VllmEventEndpoint> eps, VllmSubscriberOptions opt)
        : index(&idx),
          endpoints(std::move(eps)),
          options(opt),
          ingest(idx, opt.max_blocks_per_replica, opt.block_size) {
        for (const auto& e : endpoints) {
            require(e.replica >= 0 && e.replica < idx.num_replicas(), "endpoint ", e.endpoint,
                    ": replica ", e.replica, " is not in 0..", idx.num_replicas() - 1);
            zmq::socket_t s(ctx, zmq::socket_type::sub);
            s.set(zmq::sockopt::rcvhwm, options.receive_hwm);
            s.set(zmq::sockopt::linger, 0);
            s.set(zmq::sockopt::subscribe, e.topic);
            try {
                s.connect(e.endpoint);
            } catch (const zmq::error_t& err) {
                throw Error(detail::concat("cannot connect to the KV event endpoint '", e.endpoint,
                                           "': ", err.what(),
                                           " (expected e.g. tcp://127.0.0.1:5557)"));
            }
            subs.push_back(std::move(s));
        }
        thread = std::thread([this] { run(); });
    }

    // Asks the replay socket for every batch from `from`; feeds what arrives. True when the gap
    // is closed (the end marker came back in time).
    bool replay(size_t i, uint64_t from) {
        const auto& e = endpoints[i];
        zmq::socket_t dealer(ctx, zmq::socket_type::dealer);
        dealer.set(zmq::sockopt::linger, 0);
        try {
            dealer.connect(e.replay_endpoint);
        } catch (const zmq::error_t&) {
            return false;
        }
        const auto seq = encode_vllm_seq(from);
        std::array<zmq::const_buffer, 2> req = {zmq::buffer(seq.data(), 0),
                                                zmq::buffer(seq.data(), seq.size())};
        if (!zmq::send_multipart(dealer, req, zmq::send_flags::dontwait)) return false;
        const auto deadline =
            std::chrono::steady_clock::now() + std::chrono::milliseconds(options.replay_timeout_ms);
        while (running) {
            const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                deadline - std::chrono::steady_clock::now());
            if (left.count() <= 0) return false;
            zmq::pollitem_t item{dealer.handle(), 0, ZMQ_POLLIN, 0};
            zmq::poll(&item, 1, left);
            if (!(item.revents & ZMQ_POLLIN)) continue;
            std::vector<zmq::message_t> parts;
            if (!zmq::recv_multipart(dealer, std::back_inserter(parts))) continue;
            // [empty delimiter, seq, payload]
            if (parts.size() != 3) continue;
            const auto s = decode_vllm_seq(bytes_of(parts[1]));
            if (s && *s == kReplayEnd) return true;
            std::lock_guard<std::mutex> lock(mu);
            ingest.on_batch(e.replica, bytes_of(parts[1]), bytes_of(parts[2]), /*replayed=*/true);
        }
        return false;
    }

    void handle(size_t i, std::vector<zmq::message_t>& parts) {
        const int replica = endpoints[i].replica;
        frames_scratch.clear();
        for (const auto& p : parts) frames_scratch.push_back(bytes_of(p));
        const std::span<const std::span<const uint8_t>> frames = frames_scratch;
        // The payload is decoded before the lock is taken: routes wait only for the index
        // updates, not for the msgpack decode.
        VllmDecodeResult decoded;
        if (frames.size() == 3) decoded = decode_vllm_event_batch(frames[2]);
        const VllmDecodeResult* pre = frames.size() == 3 ? &decoded : nullptr;
        VllmEventIngest::Result r;
        {
            std::lock_guard<std::mutex> lock(mu);
            r = ingest.on_message(replica, frames, pre);
        }
        if (r.outcome != VllmEventIngest::Outcome::kGap) return;
        if (!endpoints[i].replay_endpoint.empty()) {
            replay(i, r.missing_from);
            std::lock_guard<std::mutex> lock(mu);
            // The replay may have brought this very batch (it was in the publisher's buffer).
            const auto seq = decode_vllm_seq(frames[1]);
            const auto& last = ingest.status(replica).last_seq;
            if (seq && last && *last >= *seq) return;
            r = ingest.on_message(replica, frames, pre);
            if (r.outcome != VllmEventIngest::Outcome::kGap) return;
        }
        std::lock_guard<std::mutex> lock(mu);
        ingest.mark_stale(replica);
        ingest.on_message(replica, frames, pre);
    }

    void run() {
        std::vector<zmq::pollitem_t> items;
        for (auto& s : subs) items.push_back({s.handle(), 0, ZMQ_POLLIN, 0});
        while (running) {
            try {
                zmq::poll(items.data(), items.size(), std::chrono::milliseconds(kPollMs));
            } catch (const zmq::error_t&) {
                continue;  // EINTR
            }
            for (size_t i = 0; i < subs.size(); ++i) {
                if (!(items[i].revents & ZMQ_POLLIN)) continue;
                for (int n = 0; n < kBurst && running; ++n) {
                    std::vector<zmq::message_t>& parts = parts_scratch;
                    parts.clear();
                    zmq::recv_result_t got;
                    try {
                        got = zmq::recv_multipart(subs[i], std::back_inserter(parts),
                                                  zmq::recv_flags::dontwait);
                    } catch (const zmq::error_t&) {
                        break;
                    }
                    if (!got) break;
                    handle(i, parts);
                }
            }
        }
    }

    void stop() {
        if (!running.exchange(false)) return;
        if (thread.joinable()) thread.join();
        subs.clear();
    }
};

bool VllmEventSubscriber::available() { return true; }

VllmEventSubscriber::VllmEventSubscriber(KvIndex& index, std::vector<VllmEventEndpoint> endpoints,
                                         VllmSubscriberOptions options)
    : impl_(std::make_unique<Impl>(index, std::move(endpoints), options)) {}

VllmEventSubscriber::~VllmEventSubscriber() { stop(); }

void VllmEventSubscriber::stop() {
    if (impl_) impl_->stop();
}

void VllmEventSubscriber::with_index(
    const std::function<void(const KvIndex&, const VllmEventIngest&)>& fn) const {
    std::lock_guard<std::mutex> lock(impl_->mu);
    fn(*impl_->index, impl_->ingest);
}

VllmFeedStatus VllmEventSubscriber::status(int replica) const {
    std::lock_guard<std::mutex> lock(impl_->mu);
    return impl_->ingest.status(replica);
}

// ---- publisher ------------------------------------------------------------------------------

struct VllmEventPublisher::Impl {
    VllmPublisherOptions options;
    zmq::context_t ctx{1};
    zmq::socket_t pub{ctx, zmq::socket_type::xpub};
    std::optional<zmq::socket_t> replay;
    std::string bound, replay_bound;
    uint64_t next_seq = 0;
    std::mutex mu;  // guards buffer (the publishing thread appends, the replay thread reads)
    std::deque<std::pair<uint64_t, std::vector<uint8_t>>> buffer;
    std::atomic<bool> running{true};
    std::thread replay_thread;

    explicit Impl(VllmPublisherOptions opt) : options(std::move(opt)) {
        pub.set(zmq::sockopt::linger, 0);
        bound = bind(pub, options.endpoint);
        if (!options.replay_endpoint.empty()) {
            replay.emplace(ctx, zmq::socket_type::router);
            replay->set(zmq::sockopt::linger, 0);
            replay_bound = bind(*replay, options.replay_endpoint);
            replay_thread = std::thread([this] { serve_replay(); });
        }
    }
    ~Impl() {
        running = false;
        if (replay_thread.joinable()) replay_thread.join();
    }

    static std::string bind(zmq::socket_t& s, const std::string& endpoint) {
        try {
            s.bind(endpoint);
        } catch (const zmq::error_t& err) {
            throw Error(detail::concat("cannot bind the KV event endpoint '", endpoint,
                                       "': ", err.what(), " (expected e.g. tcp://127.0.0.1:5557)"));
        }
        return s.get(zmq::sockopt::last_endpoint);
    }

    void serve_replay() {
        while (running) {
            zmq::pollitem_t item{replay->handle(), 0, ZMQ_POLLIN, 0};
            try {
                zmq::poll(&item, 1, std::chrono::milliseconds(kPollMs));
            } catch (const zmq::error_t&) {
                continue;
            }
            if (!(item.revents & ZMQ_POLLIN)) continue;
            std::vector<zmq::message_t> req;
            if (!zmq::recv_multipart(*replay, std::back_inserter(req))) continue;
            // [client identity, empty delimiter, start sequence]
            if (req.size() != 3) continue;
            const auto from = decode_vllm_seq(bytes_of(req[2]));
            if (!from) continue;
            std::vector<std::pair<uint64_t, std::vector<uint8_t>>> todo;
            {
                std::lock_guard<std::mutex> lock(mu);
                for (const auto& b : buffer)
                    if (b.first >= *from) todo.push_back(b);
            }
            const std::string id(static_cast<const char*>(req[0].data()), req[0].size());
            for (const auto& [seq, payload] : todo) {
                const auto s = encode_vllm_seq(seq);
                std::array<zmq::const_buffer, 4> msg = {zmq::buffer(id),
                                                        zmq::const_buffer(nullptr, 0),
                                                        zmq::buffer(s), zmq::buffer(payload)};
                zmq::send_multipart(*replay, msg);
            }
            const auto end = encode_vllm_seq(kReplayEnd);
            std::array<zmq::const_buffer, 4> msg = {zmq::buffer(id), zmq::const_buffer(nullptr, 0),
                                                    zmq::buffer(end),
                                                    zmq::const_buffer(nullptr, 0)};
            zmq::send_multipart(*replay, msg);
        }
    }
};

bool VllmEventPublisher::available() { return true; }

VllmEventPublisher::VllmEventPublisher(VllmPublisherOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}

VllmEventPublisher::~VllmEventPublisher() = default;

std::string VllmEventPublisher::endpoint() const { return impl_->bound; }
std::string VllmEventPublisher::replay_endpoint() const { return impl_->replay_bound; }

bool VllmEventPublisher::wait_for_subscriber(std::chrono::milliseconds timeout) {
    zmq::pollitem_t item{impl_->pub.handle(), 0, ZMQ_POLLIN, 0};
    zmq::poll(&item, 1, timeout);
    if (!(item.revents & ZMQ_POLLIN)) return false;
    zmq::message_t m;
    (void)impl_->pub.recv(m, zmq::recv_flags::dontwait);
    return m.size() >= 1 && static_cast<const uint8_t*>(m.data())[0] == 1;  // 1 = subscribe
}

uint64_t VllmEventPublisher::publish(VllmEventBatch batch) {
    if (!batch.data_parallel_rank) batch.data_parallel_rank = impl_->options.data_parallel_rank;
    const uint64_t seq = impl_->next_seq++;
    auto payload = encode_vllm_event_batch(batch, impl_->options.form);
    const auto s = encode_vllm_seq(seq);
    std::array<zmq::const_buffer, 3> msg = {zmq::buffer(impl_->options.topic), zmq::buffer(s),
                                            zmq::buffer(payload)};
    zmq::send_multipart(impl_->pub, msg, zmq::send_flags::dontwait);
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->buffer.emplace_back(seq, std::move(payload));
    while (impl_->buffer.size() > impl_->options.buffer_steps) impl_->buffer.pop_front();
    return seq;
}

KvEventCallback VllmEventPublisher::block_manager_callback() {
    return [this](const KvEvent& e) {
        const double ts =
            std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
                .count();
        publish(VllmEventBatch{ts, {to_vllm_event(e)}, std::nullopt});
    };
}

}  // namespace kvshard
