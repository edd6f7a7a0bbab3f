#include "exec/collectives.h"

#include <algorithm>

#include "kvshard/comm/communicator.h"
#include "kvshard/common/error.h"

namespace kvshard::coll {

int rank(const Communicator* c) { return c ? c->rank() : 0; }
int size(const Communicator* c) { return c ? c->size() : 1; }

void all_reduce_sum(Communicator* c, std::span<float> data) {
    if (c) c->all_reduce_sum(data);
}

void all_to_all(Communicator* c, std::span<const int32_t> send,
                std::span<const std::size_t> send_counts, std::vector<int32_t>& recv,
                std::vector<std::size_t>& recv_counts) {
    if (!c) {
        recv.assign(send.begin(), send.end());
        recv_counts.assign(send_counts.begin(), send_counts.end());
        return;
    }
    recv_counts = c->all_to_all_counts(send_counts);
    std::size_t total = 0;
    for (auto n : recv_counts) total += n;
    recv.resize(total);
    c->all_to_all_v<int32_t>(send, send_counts, recv, recv_counts);
}

void all_to_all(Communicator* c, std::span<const float> send,
                std::span<const std::size_t> send_counts, std::span<float> recv,
                std::span<const std::size_t> recv_counts) {
    if (!c) {
        KVSHARD_CHECK(send.size() == recv.size(), "local all-to-all sizes differ");
        std::copy(send.begin(), send.end(), recv.begin());
        return;
    }
    c->all_to_all_v<float>(send, send_counts, recv, recv_counts);
}

void send(Communicator* w, std::span<const float> data, int dest, int tag) {
    KVSHARD_CHECK(w != nullptr, "pipeline send without a communicator");
    w->send(data, dest, tag);
}
void recv(Communicator* w, std::span<float> data, int source, int tag) {
    KVSHARD_CHECK(w != nullptr, "pipeline recv without a communicator");
    w->recv(data, source, tag);
}
}  // namespace kvshard::coll
