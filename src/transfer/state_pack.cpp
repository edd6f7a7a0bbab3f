#include "kvshard/transfer/state_pack.h"

#include <algorithm>
#include <cstring>

#include "kvshard/common/error.h"

namespace kvshard {
namespace {

// Visits msg's payload as (state pointer, element count) runs in wire order; Fn(float*, int64_t).
template <typename Fn>
void walk_state(const TransferPlan& plan, const TransferMessage& msg, const StateShard& sh,
                const StateAccess& state, Fn&& fn) {
    KVSHARD_CHECK(msg.kv_group >= 0 && msg.kv_group < static_cast<int>(plan.groups.size()),
                  "message of KV group ", msg.kv_group, " outside the plan");
    const TransferGroup& g = plan.groups[size_t(msg.kv_group)];
    require(g.holds_state(), "message of KV group ", msg.kv_group,
            " carries pages, not state: use pack_message");
    const ModelSpec& m = plan.src.layout.model;
    require(m.state.conv_dtype == DType::kFp32 && m.state.state_dtype == DType::kFp32, m.name,
            ": state messages move fp32 state (the reference model's), got conv ",
            dtype_name(m.state.conv_dtype), ", state ", dtype_name(m.state.state_dtype));
    // (An empty range, e.g. keys that come from another copy, is anywhere.)
    const bool keys_in =
        msg.key_begin >= msg.key_end ||
        (msg.key_begin >= sh.key_begin && msg.key_end <= sh.key_begin + sh.num_keys);
    const bool heads_in =
        msg.head_begin >= msg.head_end ||
        (msg.head_begin >= sh.head_begin && msg.head_end <= sh.head_begin + sh.num_heads);
    require(keys_in && heads_in, "state message keys [", msg.key_begin, ", ", msg.key_end,
            ") and heads [", msg.head_begin, ", ", msg.head_end, ") outside the rank's keys [",
            sh.key_begin, ", ", sh.key_begin + sh.num_keys, ") and heads [", sh.head_begin, ", ",
            sh.head_begin + sh.num_heads, ")");
    const int rows = sh.conv_kernel - 1;
    const int64_t ch = sh.conv_channels(), kd = sh.key_dim, vd = sh.value_dim;
    // A part of no elements (a short-conv state has no keys and no recurrent state) may have no
    // storage at all: it is skipped, never handed on as a null pointer.
    auto emit = [&fn](auto* p, int64_t n) {
        if (n > 0) fn(p, n);
    };
    const int64_t q_cols = 0, k_cols = int64_t{sh.num_keys} * kd, v_cols = 2 * k_cols;
    for (int l : g.layers) {
        if (l < msg.layer_begin || l >= msg.layer_end) continue;
        const StateRef s = state(l);
        KVSHARD_CHECK(
            int64_t(s.conv.size()) == sh.conv_elems() && int64_t(s.rec.size()) == sh.rec_elems(),
            "layer ", l, "'s state has ", s.conv.size(), " + ", s.rec.size(),
            " elements, its shard ", sh.conv_elems(), " + ", sh.rec_elems());
        for (int k = msg.key_begin; k < msg.key_end; ++k) {
            const int64_t kl = k - sh.key_begin;
            for (int r = 0; r < rows; ++r) {
                emit(s.conv.data() + r * ch + q_cols + kl * kd, kd);
                emit(s.conv.data() + r * ch + k_cols + kl * kd, kd);
            }
        }
        for (int h = msg.head_begin; h < msg.head_end; ++h) {
            const int64_t hl = h - sh.head_begin;
            for (int r = 0; r < rows; ++r) emit(s.conv.data() + r * ch + v_cols + hl * vd, vd);
            emit(s.rec.data() + hl * kd * vd, kd * vd);
        }
    }
}

}  // namespace

StateShard rank_state_shard(const KvLayout& layout, int rank) {
    KVSHARD_CHECK(rank >= 0 && rank < layout.world_size(), "rank ", rank, " outside the layout");
    const StateSpec& st = layout.model.state;
    const int tp = layout.parallel.tp, t = layout.ranks[size_t(rank)].coord.tp;
    // Split n over tp ranks, each keeping at least one (replicated where tp exceeds n).
    auto split = [&](int n, int& begin, int& count) {
        count = std::max(1, n / tp);
        const int replication = std::max(1, tp / std::max(1, n));
        begin = t / replication * count;
    };
    StateShard s;
    split(st.groups, s.key_begin, s.num_keys);
    if (st.groups == 0) s.key_begin = s.num_keys = 0;  // Mamba-1, short conv: no B/C columns
    split(st.heads, s.head_begin, s.num_heads);
    s.conv_kernel = st.conv_kernel;
    s.key_dim = st.group_dim;
    s.value_dim = st.head_dim;
    return s;
}

void pack_state_message(const TransferPlan& plan, const TransferMessage& msg, const StateShard& src,
                        const StateAccess& state, std::span<std::byte> out) {
    require(int64_t(out.size()) == msg.bytes, "a state payload of ", out.size(),
            " bytes for a message of ", msg.bytes);
    int64_t at = 0;
    walk_state(plan, msg, src, state, [&](const float* p, int64_t n) {
        const int64_t b = n * int64_t(sizeof(float));
        KVSHARD_CHECK(at + b <= msg.bytes, "state message walks past its ", msg.bytes, " bytes");
        std::memcpy(out.data() + at, p, size_t(b));
        at += b;
    });
    KVSHARD_CHECK(at == msg.bytes, "state message of ", msg.bytes, " bytes packed ", at);
}

void unpack_state_message(const TransferPlan& plan, const TransferMessage& msg,
                          const StateShard& dst, const StateAccess& state,
                          std::span<const std::byte> in) {
    require(int64_t(in.size()) == msg.bytes, "a state payload of ", in.size(),
            " bytes for a message of ", msg.bytes);
    int64_t at = 0;
    walk_state(plan, msg, dst, state, [&](float* p, int64_t n) {
        const int64_t b = n * int64_t(sizeof(float));
        KVSHARD_CHECK(at + b <= msg.bytes, "state message walks past its ", msg.bytes, " bytes");
        std::memcpy(p, in.data() + at, size_t(b));
        at += b;
    });
    KVSHARD_CHECK(at == msg.bytes, "state message of ", msg.bytes, " bytes unpacked ", at);
}

}  // namespace kvshard
