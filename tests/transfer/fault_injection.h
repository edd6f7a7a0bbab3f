#pragma once
// Faults made on purpose, by a communicator rather than by hooks in the transfer executor: a
// FaultyCommunicator forwards everything to the communicator it wraps, except what one rank's
// TransferSender sends for the requests it is told to spoil (tags of transfer_tag(request, kind)).
// It reads the wire format (transfer_exec.h) and changes it as a broken link or peer would.
#include <cstring>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <vector>

#include "kvshard/comm/communicator.h"
#include "kvshard/common/error.h"
#include "kvshard/transfer/transfer_exec.h"

namespace kvshard::testing {

struct TransferFaults {
    // Plan message index whose payload is corrupted on the way (a direct read: whose announced
    // checksum is, so that the bytes read no longer match it).
    int corrupt_message = -1;
    int stall_after = -1;  // the sender's first this many messages go out, then nothing more
    // The hello offers the shareable pool with a wrong token: the destinations cannot map it and
    // take messages instead.
    bool wrong_arena_token = false;
    // The link fails: posting a payload send (a sender) or a payload receive (a receiver) of the
    // request throws kvshard::Error.
    bool payload_send_throws = false;
    bool payload_recv_throws = false;
    bool any() const {
        return corrupt_message >= 0 || stall_after >= 0 || wrong_arena_token ||
               payload_send_throws || payload_recv_throws;
    }
};

class FaultyCommunicator : public Communicator {
  public:
    explicit FaultyCommunicator(Communicator& inner) : inner_(inner) {}
    // Spoils what this rank sends for `request_id` as `faults` says.
    void add(uint64_t request_id, TransferFaults faults) { requests_[request_id].faults = faults; }

    int rank() const override { return inner_.rank(); }
    int size() const override { return inner_.size(); }
    Backend backend() const override { return inner_.backend(); }

  protected:
    void do_send(std::span<const std::byte> d, int dest, int tag) override {
        inner_.send(d, dest, tag);
    }
    void do_recv(std::span<std::byte> d, int src, int tag) override { inner_.recv(d, src, tag); }
    std::vector<std::byte> do_recv_any_size(int src, int tag) override {
        return inner_.recv_any_size(src, tag);
    }
    Request do_irecv(std::span<std::byte> d, int src, int tag) override {
        for (auto& [id, r] : requests_)
            if (r.faults.payload_recv_throws && tag == transfer_tag(id, kTransferPayloadKind))
                throw Error("injected fault: the payload receive failed");
        return inner_.irecv(d, src, tag);
    }
    void do_barrier() override { inner_.barrier(); }
    void do_broadcast(std::span<std::byte> d, int root) override { inner_.broadcast(d, root); }
    void do_all_gather(std::span<const std::byte> s, std::span<std::byte> r) override {
        inner_.all_gather(s, r);
    }
    void do_all_gather_v(std::span<const std::byte> s, std::span<std::byte> r,
                         std::span<const std::size_t> counts) override {
        inner_.all_gather_v(s, r, counts);
    }
    void do_all_to_all_v(std::span<const std::byte> s, std::span<const std::size_t> sc,
                         std::span<std::byte> r, std::span<const std::size_t> rc) override {
        inner_.all_to_all_v(s, sc, r, rc);
    }
    void do_all_reduce(std::span<std::byte> d, detail::ElemType type, ReduceOp op) override {
        switch (type) {
            case detail::ElemType::kF32:
                return inner_.all_reduce(as<float>(d), op);
            case detail::ElemType::kF64:
                return inner_.all_reduce(as<double>(d), op);
            case detail::ElemType::kI32:
                return inner_.all_reduce(as<std::int32_t>(d), op);
            case detail::ElemType::kI64:
                return inner_.all_reduce(as<std::int64_t>(d), op);
        }
    }
    std::unique_ptr<Communicator> do_split(int color, int key) override {
        return inner_.split(color, key);
    }

    Request do_isend(std::span<const std::byte> d, int dest, int tag) override {
        for (auto& [id, r] : requests_) {
            if (tag == transfer_tag(id, kTransferHeaderKind)) return on_header(r, d, dest, tag);
            if (tag == transfer_tag(id, kTransferPayloadKind)) {
                if (r.faults.payload_send_throws)
                    throw Error("injected fault: the payload send failed");
                return on_payload(r, d, dest, tag);
            }
        }
        return inner_.isend(d, dest, tag);
    }

  private:
    template <typename T>
    static std::span<T> as(std::span<std::byte> d) {
        return {reinterpret_cast<T*>(d.data()), d.size() / sizeof(T)};
    }

    enum class Action { kPass, kCorrupt, kDrop };
    // A send the wrapper decides on later (a payload sent ahead of its header: zero copy), or one
    // it dropped (complete at once, never delivered).
    struct Deferred {
        std::span<const std::byte> data;
        int dest = 0, tag = 0;
        bool decided = false;
        Request sent;  // once forwarded
    };
    class DeferredRequest : public detail::RequestImpl {
      public:
        explicit DeferredRequest(std::shared_ptr<Deferred> d) : d_(std::move(d)) {}
        bool test() override { return d_->decided && d_->sent.test(); }
        void wait() override {
            KVSHARD_CHECK(d_->decided, "a payload whose header was never sent");
            d_->sent.wait();
        }

      private:
        std::shared_ptr<Deferred> d_;
    };
    struct PerRequest {
        TransferFaults faults;
        int headers = 0;  // message headers this sender has sent (or dropped)
        // Per destination: actions for payloads that follow their header (staged), and payloads
        // that came ahead of their header (zero copy), waiting for it.
        std::map<int, std::deque<Action>> owed;
        std::map<int, std::deque<std::shared_ptr<Deferred>>> ahead;
    };

    std::span<const std::byte> keep(std::span<const std::byte> d) {
        copies_.emplace_back(d.begin(), d.end());
        return copies_.back();
    }
    Request forward(std::span<const std::byte> d, int dest, int tag, Action a) {
        if (a == Action::kDrop) return Request();
        if (a == Action::kCorrupt && !d.empty()) {
            copies_.emplace_back(d.begin(), d.end());
            copies_.back()[copies_.back().size() / 2] ^= std::byte{0x5A};
            d = copies_.back();
        }
        return inner_.isend(d, dest, tag);
    }
    void decide(Deferred& x, Action a) {
        x.decided = true;
        x.sent = forward(x.data, x.dest, x.tag, a);
    }

    Request on_header(PerRequest& r, std::span<const std::byte> d, int dest, int tag) {
        if (d.size() == sizeof(TransferHello)) {
            if (!r.faults.wrong_arena_token) return inner_.isend(d, dest, tag);
            TransferHello h;
            std::memcpy(&h, d.data(), sizeof(h));
            h.token[1] ^= 1;
            seal_hello(h);
            return inner_.isend(keep(std::as_bytes(std::span(&h, 1))), dest, tag);
        }
        KVSHARD_CHECK(d.size() == sizeof(TransferHeader), "a header of ", d.size(), " bytes");
        TransferHeader h;
        std::memcpy(&h, d.data(), sizeof(h));
        const bool stalled = r.faults.stall_after >= 0 && r.headers >= r.faults.stall_after;
        ++r.headers;
        const bool corrupt = static_cast<int>(h.message_index) == r.faults.corrupt_message;
        const bool has_payload = h.payload_bytes > 0 && (h.flags & TransferHeader::kDirect) == 0 &&
                                 h.status == static_cast<uint32_t>(TransferStatus::kOk);
        const Action payload = stalled ? Action::kDrop : corrupt ? Action::kCorrupt : Action::kPass;
        if (has_payload) {
            auto& ahead = r.ahead[dest];
            if (!ahead.empty()) {
                decide(*ahead.front(), payload);
                ahead.pop_front();
            } else {
                r.owed[dest].push_back(payload);
            }
        }
        if (stalled) return Request();
        if (corrupt && (h.flags & TransferHeader::kDirect) != 0) {
            h.payload_xxh3 ^= 0x5A;
            seal_header(h);
            return inner_.isend(keep(std::as_bytes(std::span(&h, 1))), dest, tag);
        }
        return inner_.isend(d, dest, tag);
    }

    Request on_payload(PerRequest& r, std::span<const std::byte> d, int dest, int tag) {
        auto& owed = r.owed[dest];
        if (!owed.empty()) {
            const Action a = owed.front();
            owed.pop_front();
            return forward(d, dest, tag, a);
        }
        auto x = std::make_shared<Deferred>();
        x->data = d;
        x->dest = dest;
        x->tag = tag;
        r.ahead[dest].push_back(x);
        return Request(std::make_unique<DeferredRequest>(x));
    }

    Communicator& inner_;
    std::map<uint64_t, PerRequest> requests_;
    std::list<std::vector<std::byte>> copies_;  // spoiled or rewritten sends, kept until the end
};

}  // namespace kvshard::testing
