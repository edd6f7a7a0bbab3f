#include "kvshard/exec/cp_ring.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <vector>

#include "kvshard/attention/merge.h"
#include "kvshard/common/error.h"

namespace kvshard {

namespace {

constexpr int kTagPassKv = 0x5c01;
constexpr int kTagPassQ = 0x5c02;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

int64_t as_bytes(int64_t floats) { return floats * static_cast<int64_t>(sizeof(float)); }

// True when no key of `kp` is visible to any query of `qp` (both ascending): skip the work. Under
// a window, a shard whose keys all lie before every query's window is skipped too.
bool all_masked(const CpAttnShape& s, const std::vector<int64_t>& qp,
                const std::vector<int64_t>& kp) {
    return !cp_shard_sees(qp, kp, s.chunked, s.window);
}

// Merges the sink partial (lse = sink, out = 0) into every row of out/lse [rows][Hq][D].
void merge_sinks(const CpAttnShape& s, std::span<const float> sinks, int64_t tokens, float* out,
                 float* lse) {
    if (sinks.empty()) return;
    apply_attention_sinks(out, lse, tokens, s.num_q_heads, s.head_dim, sinks.data());
}

// The ring steps the batch needs under the layer's window (cp_window_ring_steps for pass-KV,
// cp_pass_q_window_ring_steps for pass-Q; cp without a window).
int ring_steps(const CpAttnShape& s, int cp, std::span<const CpRingSequence> seqs, bool pass_q) {
    if (s.window <= 0) return cp;
    int steps = 1;
    for (const CpRingSequence& q : seqs)
        steps = std::max(
            steps, pass_q ? cp_pass_q_window_ring_steps(*q.map, q.new_begin, s.chunked, s.window)
                          : cp_window_ring_steps(*q.map, q.new_begin, s.chunked, s.window));
    return steps;
}

// The ring of pass-KV and pass-Q: buf[s % 2] holds the shard worked on in step s. work(step, cur)
// runs while the shard goes on to next() and the one of step s + 1 (`floats(owner)` floats of
// CP rank owner's) arrives from prev(). Only steps [0, steps) run (every rank stops after the same
// step, which sends nothing).
template <typename Floats, typename Work>
void run_ring(Communicator& comm, int tag, std::vector<float> (&buf)[2], Floats floats, int steps,
              CpCommStats& st, Work work) {
    const int cp = comm.size(), c = comm.rank();
    const int next = cp_ring_next(cp, c), prev = cp_ring_prev(cp, c);
    for (const CpRingStep& step : cp_ring_schedule(cp, c)) {
        if (step.step >= steps) break;
        std::vector<float>& cur = buf[step.step % 2];
        std::vector<float>& nxt = buf[(step.step + 1) % 2];
        Request send, recv;
        if (step.sends >= 0 && step.step + 1 < steps) {
            nxt.resize(static_cast<size_t>(floats(step.receives)));
            recv = comm.irecv(std::span<float>(nxt), prev, tag);
            send = comm.isend(std::span<const float>(cur), next, tag);
            st.ring += as_bytes(static_cast<int64_t>(cur.size()));
        }
        work(step, cur);
        send.wait();
        recv.wait();
    }
}

// Pass-KV of a batch: one ring whose message at step s is the shards of CP rank (c - s) of every
// sequence of the batch, one after the other (K then V of each); the work of a step is each
// sequence's partial over its own part of the message.
void pass_kv(Communicator& comm, const CpAttnShape& s, std::span<const CpRingSequence> seqs,
             CpCommStats& st, std::span<const float> sinks) {
    const int cp = comm.size(), c = comm.rank();
    const int64_t kvrow = int64_t{s.num_kv_heads} * s.head_dim;
    const size_t n = seqs.size();
    // at[r][i]: where sequence i's shard of CP rank r starts in r's message; at[r][n]: its size
    std::vector<std::vector<int64_t>> at(static_cast<size_t>(cp), std::vector<int64_t>(n + 1, 0));
    for (int r = 0; r < cp; ++r)
        for (size_t i = 0; i < n; ++i)
            at[size_t(r)][i + 1] = at[size_t(r)][i] + 2 * seqs[i].map->count(r) * kvrow;
    std::vector<std::vector<int64_t>> qp(n);
    std::vector<std::vector<float>> lse(n), part(n), part_lse(n);
    for (size_t i = 0; i < n; ++i) {
        qp[i] = seqs[i].map->positions(c, seqs[i].new_begin);
        const int64_t rows = static_cast<int64_t>(qp[i].size()) * s.num_q_heads;
        lse[i].assign(size_t(rows), kNegInf);
        part[i].resize(size_t(rows * s.head_dim));
        part_lse[i].resize(size_t(rows));
        std::fill(seqs[i].out, seqs[i].out + rows * s.head_dim, 0.0f);
    }

    // buf[s % 2] holds the message worked on in step s.
    std::vector<float> buf[2];
    buf[0].resize(size_t(at[size_t(c)][n]));
    for (size_t i = 0; i < n; ++i) {
        const int64_t own = seqs[i].map->count(c);
        float* dst = buf[0].data() + at[size_t(c)][i];
        std::copy(seqs[i].k, seqs[i].k + own * kvrow, dst);
        std::copy(seqs[i].v, seqs[i].v + own * kvrow, dst + own * kvrow);
    }
    run_ring(
        comm, kTagPassKv, buf, [&](int owner) { return at[size_t(owner)][n]; },
        ring_steps(s, cp, seqs, false), st,
        [&](const CpRingStep& step, const std::vector<float>& cur) {
            for (size_t i = 0; i < n; ++i) {
                const auto kp = seqs[i].map->positions(step.holds);
                if (all_masked(s, qp[i], kp)) continue;
                const int64_t nk = static_cast<int64_t>(kp.size());
                const float* shard = cur.data() + at[size_t(step.holds)][i];
                cp_partial_attention(s, seqs[i].q, qp[i], shard, shard + nk * kvrow, kp,
                                     part[i].data(), part_lse[i].data());
                merge_attention_into(seqs[i].out, lse[i].data(), part[i].data(), part_lse[i].data(),
                                     static_cast<int64_t>(lse[i].size()), s.head_dim);
            }
        });
    for (size_t i = 0; i < n; ++i)
        merge_sinks(s, sinks, static_cast<int64_t>(qp[i].size()), seqs[i].out, lse[i].data());
}

// Pass-Q of a batch: one ring whose message at step s is the query shards of CP rank (c - s) of
// every sequence, then one all_to_all_v that returns every sequence's partials to their owners.
void pass_q(Communicator& comm, const CpAttnShape& s, std::span<const CpRingSequence> seqs,
            CpCommStats& st, std::span<const float> sinks) {
    const int cp = comm.size(), c = comm.rank();
    const size_t n = seqs.size();
    const int64_t qrow = int64_t{s.num_q_heads} * s.head_dim;
    const int64_t prow = int64_t{s.num_q_heads} * (s.head_dim + 1);  // O then LSE, per token
    // tq[r][i]: new tokens of sequence i on CP rank r; qat[r][i]: where they start in r's
    // message of queries (qat[r][n]: its size)
    std::vector<std::vector<int64_t>> tq(static_cast<size_t>(cp), std::vector<int64_t>(n)),
        qat(static_cast<size_t>(cp), std::vector<int64_t>(n + 1, 0));
    for (int r = 0; r < cp; ++r)
        for (size_t i = 0; i < n; ++i) {
            tq[size_t(r)][i] = seqs[i].map->count(r, seqs[i].new_begin);
            qat[size_t(r)][i + 1] = qat[size_t(r)][i] + tq[size_t(r)][i] * qrow;
        }
    std::vector<std::vector<int64_t>> kp(n);
    for (size_t i = 0; i < n; ++i) kp[i] = seqs[i].map->positions(c);

    // Partials of every rank's queries over this rank's KV: for owner r, per sequence i,
    // [tq[r][i]][Hq][D] then [tq[r][i]][Hq], at off[r] + poff[r][i] of `parts`.
    std::vector<int64_t> off(static_cast<size_t>(cp) + 1, 0);
    std::vector<std::vector<int64_t>> poff(static_cast<size_t>(cp), std::vector<int64_t>(n + 1, 0));
    for (int r = 0; r < cp; ++r) {
        for (size_t i = 0; i < n; ++i)
            poff[size_t(r)][i + 1] = poff[size_t(r)][i] + tq[size_t(r)][i] * prow;
        off[size_t(r) + 1] = off[size_t(r)] + poff[size_t(r)][n];
    }
    // Only partials that hold something travel: rank c returns owner r's partial of sequence i
    // when some query of r's sees some key of c's (sends[r][i]), and receives holder h's when some
    // query of its own sees some key of h's (gets[h][i]). Both sides decide from the token maps
    // alone, so they agree; a partial that is not sent would be empty (out 0, lse -inf).
    std::vector<std::vector<char>> sends(static_cast<size_t>(cp), std::vector<char>(n, 0)),
        gets(static_cast<size_t>(cp), std::vector<char>(n, 0));
    std::vector<size_t> send_counts(static_cast<size_t>(cp), 0),
        recv_counts(static_cast<size_t>(cp), 0);
    std::vector<std::vector<int64_t>> own_q(n);
    for (size_t i = 0; i < n; ++i) own_q[i] = seqs[i].map->positions(c, seqs[i].new_begin);
    for (int r = 0; r < cp; ++r) {
        if (r == c) continue;
        for (size_t i = 0; i < n; ++i) {
            const int64_t to = tq[size_t(r)][i], mine = tq[size_t(c)][i];
            if (to > 0 && !all_masked(s, seqs[i].map->positions(r, seqs[i].new_begin), kp[i])) {
                sends[size_t(r)][i] = 1;
                send_counts[size_t(r)] += static_cast<size_t>(to * prow);
            }
            if (mine > 0 && !all_masked(s, own_q[i], seqs[i].map->positions(r))) {
                gets[size_t(r)][i] = 1;
                recv_counts[size_t(r)] += static_cast<size_t>(mine * prow);
            }
        }
    }
    std::vector<float> parts(static_cast<size_t>(off.back()));

    std::vector<float> buf[2];
    buf[0].resize(size_t(qat[size_t(c)][n]));
    for (size_t i = 0; i < n; ++i)
        std::copy(seqs[i].q, seqs[i].q + tq[size_t(c)][i] * qrow,
                  buf[0].begin() + qat[size_t(c)][i]);
    // Under a window the ring may stop early: the owners of the steps it skips see none of this
    // rank's keys, so their partials are neither computed nor sent (sends[][] is 0 for them).
    const int steps = ring_steps(s, cp, seqs, true);
    run_ring(
        comm, kTagPassQ, buf, [&](int owner) { return qat[size_t(owner)][n]; }, steps, st,
        [&](const CpRingStep& step, const std::vector<float>& cur) {
            const int h = step.holds;
            for (size_t i = 0; i < n; ++i) {
                const auto qp = seqs[i].map->positions(h, seqs[i].new_begin);
                const int64_t t = tq[size_t(h)][i];
                float* po = parts.data() + off[size_t(h)] + poff[size_t(h)][i];
                float* pl = po + t * qrow;
                if (all_masked(s, qp, kp[i]))
                    std::fill(pl, pl + t * s.num_q_heads, kNegInf);
                else
                    cp_partial_attention(s, cur.data() + qat[size_t(h)][i], qp, seqs[i].k,
                                         seqs[i].v, kp[i], po, pl);
            }
        });
    // Return the partials to the query owners. The own partials stay (count 0 to self).
    std::vector<float> send_buf;
    send_buf.reserve(std::accumulate(send_counts.begin(), send_counts.end(), size_t{0}));
    for (int r = 0; r < cp; ++r)
        for (size_t i = 0; i < n; ++i)
            if (sends[size_t(r)][i])
                send_buf.insert(send_buf.end(), parts.begin() + off[size_t(r)] + poff[size_t(r)][i],
                                parts.begin() + off[size_t(r)] + poff[size_t(r)][i + 1]);
    std::vector<float> recv_buf(std::accumulate(recv_counts.begin(), recv_counts.end(), size_t{0}));
    comm.all_to_all_v<float>(send_buf, send_counts, recv_buf, recv_counts);
    st.all_to_all += as_bytes(static_cast<int64_t>(send_buf.size()));

    // at[h]: where holder h's next partial starts in recv_buf (peers in rank order, each its
    // received sequences in order).
    std::vector<int64_t> at(static_cast<size_t>(cp), 0);
    for (int h = 1; h < cp; ++h)
        at[size_t(h)] = at[size_t(h) - 1] + static_cast<int64_t>(recv_counts[size_t(h) - 1]);
    for (size_t i = 0; i < n; ++i) {
        const int64_t t = tq[size_t(c)][i];
        std::vector<const float*> outs, lses;
        const float* own = parts.data() + off[size_t(c)] + poff[size_t(c)][i];
        outs.push_back(own);
        lses.push_back(own + t * qrow);
        for (int h = 0; h < cp; ++h) {
            if (!gets[size_t(h)][i]) continue;
            const float* p = recv_buf.data() + at[size_t(h)];
            outs.push_back(p);
            lses.push_back(p + t * qrow);
            at[size_t(h)] += t * prow;
        }
        std::vector<float> lse(size_t(t * s.num_q_heads));
        merge_attention(outs, lses, t * s.num_q_heads, s.head_dim, seqs[i].out, lse.data());
        merge_sinks(s, sinks, t, seqs[i].out, lse.data());
    }
}

}  // namespace

void cp_prefill_attention(Communicator& cp_comm, CpPrefillMode mode, const CpAttnShape& shape,
                          const CpTokenMap& map, int64_t new_begin, const float* q, const float* k,
                          const float* v, float* out, CpCommStats* stats,
                          std::span<const float> sinks) {
    const CpRingSequence one{&map, new_begin, q, k, v, out};
    cp_prefill_attention(cp_comm, mode, shape, std::span<const CpRingSequence>(&one, 1), stats,
                         sinks);
}

void cp_prefill_attention(Communicator& cp_comm, CpPrefillMode mode, const CpAttnShape& shape,
                          std::span<const CpRingSequence> seqs, CpCommStats* stats,
                          std::span<const float> sinks) {
    KVSHARD_CHECK(sinks.empty() || int64_t(sinks.size()) == shape.num_q_heads,
                  "one sink per query head");
    for (const CpRingSequence& sq : seqs) {
        KVSHARD_CHECK(cp_comm.size() == sq.map->cp(), "CP communicator of ", cp_comm.size(),
                      " ranks for a token map of cp=", sq.map->cp());
        KVSHARD_CHECK(sq.new_begin >= 0 && sq.new_begin <= sq.map->size(),
                      "new tokens start outside the sequence");
    }
    if (seqs.empty()) return;
    CpCommStats st;
    if (mode == CpPrefillMode::kPassKv)
        pass_kv(cp_comm, shape, seqs, st, sinks);
    else
        pass_q(cp_comm, shape, seqs, st, sinks);
    if (stats) *stats += st;
}

void cp_merge_partials(Communicator& comm, CpDecodeMerge merge, int64_t rows, int num_heads,
                       int head_dim, const float* part_out, const float* part_lse, float* out,
                       CpCommStats* stats) {
    const int cp = comm.size(), c = comm.rank();
    const int64_t d = head_dim;
    CpCommStats st;
    if (cp == 1) {
        std::copy(part_out, part_out + rows * num_heads * d, out);
        // a row with no key at all stays 0, as the merge would leave it
        for (int64_t i = 0; i < rows * num_heads; ++i)
            if (part_lse[i] == kNegInf) std::fill(out + i * d, out + (i + 1) * d, 0.0f);
        return;
    }
    if (merge == CpDecodeMerge::kAllGather) {
        const int64_t blk = rows * num_heads * (d + 1);
        std::vector<float> mine(blk), all(blk * cp);
        std::copy(part_out, part_out + rows * num_heads * d, mine.begin());
        std::copy(part_lse, part_lse + rows * num_heads, mine.begin() + rows * num_heads * d);
        comm.all_gather(mine, all);
        st.all_gather += as_bytes(blk) * (cp - 1);
        std::vector<const float*> outs, lses;
        for (int r = 0; r < cp; ++r) {
            outs.push_back(all.data() + r * blk);
            lses.push_back(all.data() + r * blk + rows * num_heads * d);
        }
        std::vector<float> lse(rows * num_heads);
        merge_attention(outs, lses, rows * num_heads, head_dim, out, lse.data());
    } else {
        // Helix: rank r merges heads cp_helix_heads(num_heads, cp, r) of every row.
        std::vector<TokenRange> hr(cp);
        for (int r = 0; r < cp; ++r) hr[r] = cp_helix_heads(num_heads, cp, r);
        std::vector<size_t> send_counts(cp), recv_counts(cp);
        std::vector<float> send_buf;
        for (int r = 0; r < cp; ++r) {  // for peer r: O [rows][h_r][D] then LSE [rows][h_r]
            const size_t before = send_buf.size();
            for (int64_t i = 0; i < rows; ++i)
                for (int64_t h = hr[r].begin; h < hr[r].end; ++h) {
                    const float* o = part_out + (i * num_heads + h) * d;
                    send_buf.insert(send_buf.end(), o, o + d);
                }
            for (int64_t i = 0; i < rows; ++i)
                for (int64_t h = hr[r].begin; h < hr[r].end; ++h)
                    send_buf.push_back(part_lse[i * num_heads + h]);
            send_counts[r] = send_buf.size() - before;
            recv_counts[r] = static_cast<size_t>(rows * hr[c].size() * (d + 1));
            if (r != c) st.all_to_all += as_bytes(static_cast<int64_t>(send_counts[r]));
        }
        std::vector<float> recv_buf(recv_counts[0] * cp);
        comm.all_to_all_v<float>(send_buf, send_counts, recv_buf, recv_counts);
        const int64_t mh = hr[c].size();
        std::vector<const float*> outs, lses;
        for (int r = 0; r < cp; ++r) {
            const float* p = recv_buf.data() + r * recv_counts[0];
            outs.push_back(p);
            lses.push_back(p + rows * mh * d);
        }
        std::vector<float> merged(rows * mh * d), lse(rows * mh);
        merge_attention(outs, lses, rows * mh, head_dim, merged.data(), lse.data());
        // every rank needs every head: all-gather the merged heads (sizes differ by rank)
        std::vector<size_t> counts(cp);
        for (int r = 0; r < cp; ++r)
            counts[r] = static_cast<size_t>(rows * hr[r].size() * d) * sizeof(float);
        std::vector<float> all(rows * num_heads * d);
        comm.all_gather_v(std::as_bytes(std::span<const float>(merged)),
                          std::as_writable_bytes(std::span<float>(all)), counts);
        st.all_gather += as_bytes(static_cast<int64_t>(merged.size())) * (cp - 1);
        int64_t at = 0;
        for (int r = 0; r < cp; ++r) {
            const int64_t h_r = hr[r].size();
            for (int64_t i = 0; i < rows; ++i)
                for (int64_t h = 0; h < h_r; ++h)
                    std::copy(all.begin() + at + (i * h_r + h) * d,
                              all.begin() + at + (i * h_r + h + 1) * d,
                              out + (i * num_heads + hr[r].begin + h) * d);
            at += rows * h_r * d;
        }
    }
    if (stats) *stats += st;
}

void cp_decode_attention(Communicator& cp_comm, CpDecodeMerge merge, const CpAttnShape& shape,
                         const float* q, std::span<const int64_t> q_pos, const float* k,
                         const float* v, std::span<const int64_t> kv_pos, float* out,
                         CpCommStats* stats) {
    const int64_t rows = static_cast<int64_t>(q_pos.size());
    std::vector<float> part(rows * shape.num_q_heads * shape.head_dim),
        lse(rows * shape.num_q_heads);
    cp_partial_attention(shape, q, q_pos, k, v, kv_pos, part.data(), lse.data());
    cp_merge_partials(cp_comm, merge, rows, shape.num_q_heads, shape.head_dim, part.data(),
                      lse.data(), out, stats);
}

}  // namespace kvshard
