#pragma once
// Context-parallel attention over a CP communicator (docs/context-parallel.md §3-5): ring prefill
// (pass-KV, pass-Q) and the exact merge of decode partials (all-gather or Helix all-to-all).
// Every function is collective over cp_comm (the ranks with the same dp, pp, tp; rank() = CP index)
// and works on one layer of one sequence (or, cp_prefill_attention over CpRingSequence, of a
// batch), over this rank's heads only (TP happens around it).
#include <cstdint>
#include <span>

#include "kvshard/comm/communicator.h"
#include "kvshard/exec/cp_attention.h"
#include "kvshard/layout/cp_plan.h"

namespace kvshard {

// Payload bytes this rank handed to the communicator (what the cost model counts: not the
// backend's own framing, and nothing a rank sends to itself).
struct CpCommStats {
    int64_t ring = 0;        // ring point-to-point (K/V shards or query shards)
    int64_t all_to_all = 0;  // partial outputs + LSEs (pass-Q; Helix decode)
    int64_t all_gather = 0;  // decode partials or merged outputs
    int64_t total() const { return ring + all_to_all + all_gather; }
    CpCommStats& operator+=(const CpCommStats& o) {
        ring += o.ring;
        all_to_all += o.all_to_all;
        all_gather += o.all_gather;
        return *this;
    }
};

// Prefill attention of this rank's new tokens.
//  map: the sequence's placement, the same on every rank; new tokens are [new_begin, map.size()).
//  q:    [t_c][Hq][D], the rank's new positions map.positions(c, new_begin), in that order (roped).
//  k, v: [n_c][Hkv][D], everything the rank stores for this layer, map.positions(c), in order
//        (its cached tokens and its new ones, already written).
//  out:  [t_c][Hq][D].
// pass-KV sends the K/V shard to the next rank while attending to the current one (isend/irecv of
// step s+1 overlap the attention of step s); pass-Q does the same with the query shards and returns
// the partials with one all_to_all_v.
// sinks: [Hq] learned sink logits (gpt-oss) merged once into each query row's result, or empty.
void cp_prefill_attention(Communicator& cp_comm, CpPrefillMode mode, const CpAttnShape& shape,
                          const CpTokenMap& map, int64_t new_begin, const float* q, const float* k,
                          const float* v, float* out, CpCommStats* stats = nullptr,
                          std::span<const float> sinks = {});

// One sequence of a batch prefill: its map, new tokens [new_begin, map->size()) and its q, k, v,
// out as above.
struct CpRingSequence {
    const CpTokenMap* map = nullptr;
    int64_t new_begin = 0;
    const float* q = nullptr;
    const float* k = nullptr;
    const float* v = nullptr;
    float* out = nullptr;
};
// The prefill attention of several sequences in ONE ring: the message of each step carries the
// shards (pass-KV) or query shards (pass-Q) of every sequence one after the other, and pass-Q
// returns the partials of all of them in one all_to_all_v. The bytes are the sum of the
// sequences' own (cp_pass_kv_bytes, cp_pass_q_bytes); the rounds are those of one sequence.
// Every rank passes the same sequences in the same order.
void cp_prefill_attention(Communicator& cp_comm, CpPrefillMode mode, const CpAttnShape& shape,
                          std::span<const CpRingSequence> seqs, CpCommStats* stats = nullptr,
                          std::span<const float> sinks = {});

// Merges the decode partials of every CP rank exactly; the result is the same on every rank.
//  part_out: [rows][Hq][D], part_lse: [rows][Hq] this rank's partial over its own KV (lse = -inf
//  where it has no visible key). out: [rows][Hq][D].
void cp_merge_partials(Communicator& cp_comm, CpDecodeMerge merge, int64_t rows, int num_heads,
                       int head_dim, const float* part_out, const float* part_lse, float* out,
                       CpCommStats* stats = nullptr);

// Decode attention: q [rows][Hq][D] at q_pos, identical on every CP rank; k, v [n_c][Hkv][D] this
// rank's stored KV at kv_pos. The partial over the own shard, then cp_merge_partials.
void cp_decode_attention(Communicator& cp_comm, CpDecodeMerge merge, const CpAttnShape& shape,
                         const float* q, std::span<const int64_t> q_pos, const float* k,
                         const float* v, std::span<const int64_t> kv_pos, float* out,
                         CpCommStats* stats = nullptr);

}  // namespace kvshard
