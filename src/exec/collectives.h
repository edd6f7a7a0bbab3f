#pragma once
// The few collectives the forward pass needs, over the Communicator of a group; a null communicator
// is a group of one (the call is then a no-op or a local copy). Internal to src/exec.
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace kvshard {

class Communicator;

namespace coll {

inline constexpr int kTagActivations = 101;

int rank(const Communicator* c);
int size(const Communicator* c);
void all_reduce_sum(Communicator* c, std::span<float> data);
// Personalized exchange in elements of T (int32 or float); recv is resized to what arrives.
void all_to_all(Communicator* c, std::span<const int32_t> send,
                std::span<const std::size_t> send_counts, std::vector<int32_t>& recv,
                std::vector<std::size_t>& recv_counts);
void all_to_all(Communicator* c, std::span<const float> send,
                std::span<const std::size_t> send_counts, std::span<float> recv,
                std::span<const std::size_t> recv_counts);
void send(Communicator* world, std::span<const float> data, int dest, int tag);
void recv(Communicator* world, std::span<float> data, int source, int tag);

}  // namespace coll
}  // namespace kvshard
