#include "exec/collectives.h"

#include <algorithm>

#include "kvshard/common/error.h"

// Stand-in until the Communicator lands: groups of one only.
namespace kvshard::coll {

int rank(const Communicator* c) {
    KVSHARD_CHECK(c == nullptr, "no communicator backend yet");
    return 0;
}
int size(const Communicator* c) {
    KVSHARD_CHECK(c == nullptr, "no communicator backend yet");
    return 1;
}
void all_reduce_sum(Communicator* c, std::span<float>) { KVSHARD_CHECK(c == nullptr, "no backend"); }
void all_to_all(Communicator* c, std::span<const int32_t> send, std::span<const std::size_t> send_counts,
                std::vector<int32_t>& recv, std::vector<std::size_t>& recv_counts) {
    KVSHARD_CHECK(c == nullptr, "no backend");
    recv.assign(send.begin(), send.end());
    recv_counts.assign(send_counts.begin(), send_counts.end());
}
void all_to_all(Communicator* c, std::span<const float> send, std::span<const std::size_t>,
                std::span<float> recv, std::span<const std::size_t>) {
    KVSHARD_CHECK(c == nullptr && send.size() == recv.size(), "no backend");
    std::copy(send.begin(), send.end(), recv.begin());
}
void send(Communicator* w, std::span<const float>, int, int) { KVSHARD_CHECK(w == nullptr, "no backend"); }
void recv(Communicator* w, std::span<float>, int, int) { KVSHARD_CHECK(w == nullptr, "no backend"); }
void send(Communicator* w, std::span<const int32_t>, int, int) { KVSHARD_CHECK(w == nullptr, "no backend"); }
void recv(Communicator* w, std::span<int32_t>, int, int) { KVSHARD_CHECK(w == nullptr, "no backend"); }

}  // namespace kvshard::coll

namespace kvshard::coll {
Groups make_groups(Communicator* world, const ParallelConfig&) {
    KVSHARD_CHECK(world == nullptr, "no backend");
    return {};
}
std::vector<std::vector<std::byte>> all_gather_blobs(Communicator* world, std::span<const std::byte> mine) {
    KVSHARD_CHECK(world == nullptr, "no backend");
    return {std::vector<std::byte>(mine.begin(), mine.end())};
}
}  // namespace kvshard::coll
