#include "kvshard/exec/cp_session.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>

#include "kvshard/attention/merge.h"
#include "kvshard/attention/paged_attention.h"
#include "kvshard/cache/block_hash.h"
#include "kvshard/common/error.h"

namespace kvshard {

namespace {

constexpr int kTagBlockMove = 0x5c10;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

ModelSpec fp32_spec(ModelSpec m) {
    m.kv_dtype = DType::kFp32;  // the reference model computes and caches in fp32
    return m;
}

// K and V of local slots [0, n) of one sequence in one layer, packed [n][heads][D] each.
void pack_kv(const BlockPool& pool, int layer, std::span<const BlockId> table, int64_t n, float* k,
             float* v) {
    const PageGeometry& g = pool.geometry();
    const int64_t row = int64_t{g.num_heads} * g.head_dim;
    for (int64_t t = 0; t < n; ++t) {
        const BlockId b = table[static_cast<size_t>(t / g.block_size)];
        const int slot = static_cast<int>(t % g.block_size);
        const float* kp = pool.page_f32(layer, 0, b);
        const float* vp = pool.page_f32(layer, 1, b);
        for (int h = 0; h < g.num_heads; ++h) {
            const int64_t at = g.elem_in_page(h, slot, 0);
            std::memcpy(k + t * row + int64_t{h} * g.head_dim, kp + at, sizeof(float) * g.head_dim);
            std::memcpy(v + t * row + int64_t{h} * g.head_dim, vp + at, sizeof(float) * g.head_dim);
        }
    }
}

// Bytes of one block over every pool of the device (each KV group's), all its layers and K/V, in
// page order, to and from a buffer.
int64_t block_bytes_of(const RankModel& model) {
    int64_t n = 0;
    for (int i = 0; i < model.num_pools(); ++i) n += model.pool_at(i).geometry().block_bytes();
    return n;
}

std::vector<std::byte> read_block(const RankModel& model, BlockId b) {
    std::vector<std::byte> out;
    out.reserve(static_cast<size_t>(block_bytes_of(model)));
    for (int i = 0; i < model.num_pools(); ++i) {
        const BlockPool& pool = model.pool_at(i);
        const PageGeometry& g = pool.geometry();
        for (int l = 0; l < g.num_layers; ++l)
            for (int kv = 0; kv < g.kv_factor; ++kv) {
                const std::byte* p = pool.page(l, kv, b);
                out.insert(out.end(), p, p + g.page_bytes());
            }
    }
    return out;
}

void write_block(RankModel& model, BlockId b, std::span<const std::byte> bytes) {
    KVSHARD_CHECK(static_cast<int64_t>(bytes.size()) == block_bytes_of(model), "block of ",
                  bytes.size(), " bytes, expected ", block_bytes_of(model));
    size_t at = 0;
    for (int i = 0; i < model.num_pools(); ++i) {
        BlockPool& pool = model.pool_at(i);
        const PageGeometry& g = pool.geometry();
        for (int l = 0; l < g.num_layers; ++l)
            for (int kv = 0; kv < g.kv_factor; ++kv) {
                std::memcpy(pool.page(l, kv, b), bytes.data() + at,
                            static_cast<size_t>(g.page_bytes()));
                at += static_cast<size_t>(g.page_bytes());
            }
    }
}

ParallelConfig tp_only(int tp) {
    ParallelConfig p;
    p.tp = tp;
    return p;
}

}  // namespace

// The device's slice: the whole model's layers, its TP share (rank tp_rank of a tp-only layout).
CpDevice::CpDevice(const ModelSpec& m, int tp, int tp_rank, const TensorSource& weights,
                   const CpOptions& opt)
    : CpDevice(m, tp_only(tp), tp_rank, weights, opt) {}

CpDevice::CpDevice(const ModelSpec& m, const ParallelConfig& p, int rank,
                   const TensorSource& weights, const CpOptions& opt)
    : tp_(p.tp),
      tp_rank_(0),
      block_size_(opt.block_size),
      pp_(p.pp),
      ep_(p.ep),
      blocks_(BlockManagerConfig{opt.num_blocks, opt.block_size, opt.prefix_cache}) {
    require(p.dp == 1, "a context-parallel device serves one replica (dp=1), got ", p.to_string());
    require(rank >= 0 && rank < p.world_size(), "rank ", rank, " is outside ", p.to_string(), " (",
            p.world_size(), " ranks)");
    const ModelSpec spec = fp32_spec(m);
    const RankCoord c = rank_coord(p, rank);
    tp_rank_ = c.tp;
    pp_rank_ = c.pp;
    ep_rank_ = c.ep;
    model_ = std::make_unique<RankModel>(
        load_weights(spec, weight_shard(make_layout(spec, p), rank), weights), opt.num_blocks,
        opt.block_size, RankComms{}, PageOrder::kHnd, opt.pool_memory);
}

CpSession::CpSession(CpDevice& device, Communicator& world, const ParallelConfig& p, CpOptions opt)
    : dev_(device), world_(world), p_(p), opt_(opt) {
    require(p.dp == 1, "context parallelism runs one replica (dp=1) per session, got ",
            p.to_string());
    require(device.pp() == p.pp && device.ep() == p.ep,
            "this device holds a slice for pp=", device.pp(), " ep=", device.ep(),
            " but the run uses ", p.to_string(), ": build the device with the run's layout");
    require(world.size() >= p.world_size(), "the run has ", world.size(), " ranks but ",
            p.to_string(), " needs ", p.world_size());
    require(device.tp() == p.tp, "this device holds a tp=", device.tp(),
            " slice but the run uses tp=", p.tp);
    require(opt.block_size == device.block_size(), "block size ", opt.block_size,
            " differs from the device's ", device.block_size());
    layout_ = make_layout(fp32_spec(device.spec()), p);
    serving_ = world.rank() < p.world_size();
    serving_comm_ = world.split(serving_ ? 0 : Communicator::kUndefinedColor, world.rank());
    if (!serving_) return;
    coord_ = rank_coord(p, world.rank());
    require(device.tp_rank() == coord_.tp, "rank ", world.rank(), " is tp index ", coord_.tp,
            " but its device holds tp slice ", device.tp_rank());
    require(device.pp_rank() == coord_.pp && device.ep_rank() == coord_.ep, "rank ", world.rank(),
            " is stage ", coord_.pp, ", ep index ", coord_.ep, " but its device holds stage ",
            device.pp_rank(), ", ep index ", device.ep_rank());
    groups_ = make_groups(*serving_comm_, p);
    RankComms comms;
    comms.world = serving_comm_.get();  // serving rank i is world rank i
    comms.tp = p.tp > 1 ? groups_.tp.get() : nullptr;
    comms.ep = p.ep > 1 ? groups_.ep.get() : nullptr;
    if (coord_.pp > 0) comms.prev_stage = rank_of(p, 0, coord_.pp - 1, coord_.cp, coord_.tp);
    if (coord_.pp < p.pp - 1) comms.next_stage = rank_of(p, 0, coord_.pp + 1, coord_.cp, coord_.tp);
    dev_.model().set_comms(comms);
}

CpSession::~CpSession() {
    if (serving_) dev_.model().set_attention(default_attention);
}

bool CpSession::prefix_cache_active() const {
    if (!opt_.prefix_cache) return false;
    if (p_.cp == 1) return true;
    return p_.cp_scheme == CpScheme::kInterleave && p_.cp_interleave == opt_.block_size;
}

const CpTokenMap& CpSession::token_map(SeqId seq) const { return seqs_.at(seq).map; }

int64_t CpSession::discover_and_move(std::span<const int32_t> tokens) {
    const int B = opt_.block_size;
    const int64_t len = static_cast<int64_t>(tokens.size());
    BlockHasher hasher;
    const std::vector<BlockHash> hashes = hasher.hash_blocks(tokens, B, {});
    // Keep at least the last token to compute: it gives the logits.
    const int64_t limit =
        std::min<int64_t>(static_cast<int64_t>(hashes.size()), vllm_max_cache_hit_blocks(len, B));
    BlockManager& bm = dev_.blocks();

    // Every device says which of the prompt's blocks it holds: [tp, tp_rank, pp, pp_rank,
    // has[0..limit)]. A block moves only between devices of the same TP index and stage (the same
    // heads of the same layers).
    std::vector<int32_t> mine = {dev_.tp(), dev_.tp_rank(), dev_.pp(), dev_.pp_rank()};
    for (int64_t b = 0; b < limit; ++b)
        mine.push_back(
            bm.lookup_hashes(std::span(&hashes[static_cast<size_t>(b)], 1)).blocks.empty() ? 0 : 1);
    const auto blobs = world_.all_gather_blobs(std::as_bytes(std::span<const int32_t>(mine)));
    const int W = world_.size();
    auto info = [&](int d, int64_t i) {
        int32_t x;
        std::memcpy(&x, blobs[static_cast<size_t>(d)].data() + i * 4, 4);
        return x;
    };
    auto has = [&](int d, int64_t b) {
        return info(d, 0) == p_.tp && info(d, 2) == p_.pp && info(d, 4 + b) != 0;
    };
    auto slice = [&](int d, int t, int s) { return info(d, 1) == t && info(d, 3) == s; };
    // The lowest device of TP index t in stage s holding block b.
    auto holder = [&](int64_t b, int t, int s) {
        for (int d = 0; d < W; ++d)
            if (slice(d, t, s) && has(d, b)) return d;
        return -1;
    };
    int64_t K = 0;
    for (; K < limit; ++K) {
        bool everywhere = true;
        for (int s = 0; s < p_.pp && everywhere; ++s)
            for (int t = 0; t < p_.tp && everywhere; ++t) everywhere = holder(K, t, s) >= 0;
        if (!everywhere) break;
    }

    // Moves (plan_cp_prefix_moves, per stage s and TP index t over the devices of that slice):
    // block b (< K) belongs to CP rank b % cp; a device of the serving group that lacks it receives
    // it from the lowest device of its slice that holds it. Same order on every rank: by block,
    // then stage and TP.
    struct Move {
        int64_t b;
        int src, dst;
    };
    std::vector<Move> moves;
    for (int s = 0; s < p_.pp; ++s)
        for (int t = 0; t < p_.tp; ++t) {
            std::vector<std::vector<int>> holders(static_cast<size_t>(K));
            for (int64_t b = 0; b < K; ++b)
                for (int d = 0; d < W; ++d)
                    if (slice(d, t, s) && has(d, b)) holders[static_cast<size_t>(b)].push_back(d);
            std::vector<int> dst_device;
            for (int c = 0; c < p_.cp; ++c) dst_device.push_back(rank_of(p_, 0, s, c, t));
            for (const CpBlockMove& m : plan_cp_prefix_moves(holders, dst_device).moves)
                moves.push_back({m.block, m.src, m.dst});
        }
    std::stable_sort(moves.begin(), moves.end(),
                     [](const Move& a, const Move& b) { return a.b < b.b; });
    const int me = world_.rank();
    std::vector<std::vector<std::byte>> out_bufs, in_bufs;
    std::vector<Request> reqs;
    std::vector<std::pair<int64_t, BlockId>> imported;  // (global block, local block id)
    std::vector<SeqId> tmps;
    const int64_t block_bytes = block_bytes_of(dev_.model());
    for (const Move& m : moves) {
        if (m.src == me) {
            const auto found = bm.lookup_hashes(std::span(&hashes[static_cast<size_t>(m.b)], 1));
            KVSHARD_CHECK(!found.blocks.empty(), "block ", m.b, " announced but not found");
            out_bufs.push_back(read_block(dev_.model(), found.blocks.front()));
            ++last_.blocks_moved_out;
            last_.block_bytes_moved += block_bytes;
        }
    }
    {
        size_t o = 0;
        for (const Move& m : moves)
            if (m.src == me)
                reqs.push_back(
                    world_.isend(std::span<const std::byte>(out_bufs[o++]), m.dst, kTagBlockMove));
    }
    for (const Move& m : moves) {
        if (m.dst != me) continue;
        // Import: a temporary sequence of this rank's blocks up to b (the earlier ones are already
        // registered, here or by an earlier import) gets a fresh block registered under b's hash.
        std::vector<BlockHash> local;
        for (int64_t g = coord_.cp; g <= m.b; g += p_.cp)
            local.push_back(hashes[static_cast<size_t>(g)]);
        const SeqId tmp = next_tmp_seq_--;
        const auto r = bm.allocate_with_hashes(tmp, local, static_cast<int64_t>(local.size()) * B);
        KVSHARD_CHECK(r.cached_blocks + 1 == static_cast<int64_t>(local.size()), "import of block ",
                      m.b, " found ", r.cached_blocks, " of ", local.size(), " blocks before it");
        tmps.push_back(tmp);
        imported.emplace_back(m.b, bm.block_table(tmp).back());
        in_bufs.emplace_back(static_cast<size_t>(block_bytes));
        reqs.push_back(world_.irecv(std::span<std::byte>(in_bufs.back()), m.src, kTagBlockMove));
        ++last_.blocks_moved_in;
        last_.block_bytes_moved += block_bytes;
    }
    wait_all(reqs);
    for (size_t i = 0; i < imported.size(); ++i)
        write_block(dev_.model(), imported[i].second, in_bufs[i]);
    for (SeqId t : tmps) bm.free(t);  // the imported blocks stay, cached under their hashes
    return K;
}

std::vector<float> CpSession::prefill(SeqId seq, std::span<const int32_t> tokens) {
    if (!reserve(seq, tokens)) return {};
    return prefill_reserved(seq);
}

std::vector<float> CpSession::prefill(std::span<const SeqId> seqs,
                                      std::span<const std::vector<int32_t>> tokens) {
    require(seqs.size() == tokens.size(), "a batch prefill of ", seqs.size(), " sequences got ",
            tokens.size(), " token lists");
    CpStepStats sum;
    bool serves = false;
    for (size_t i = 0; i < seqs.size(); ++i) {
        serves = reserve(seqs[i], tokens[i]);
        sum.blocks_moved_in += last_.blocks_moved_in;
        sum.blocks_moved_out += last_.blocks_moved_out;
        sum.block_bytes_moved += last_.block_bytes_moved;
    }
    if (!serves) {
        last_ = sum;
        return {};
    }
    return prefill_reserved(seqs);
}

bool CpSession::reserve(SeqId seq, std::span<const int32_t> tokens) {
    require(!tokens.empty(), "a prefill needs at least one token");
    require(!seqs_.contains(seq) || !seqs_.at(seq).reserved, "sequence ", seq,
            " already has a prefill reserved");
    last_ = {};
    const bool is_new = !seqs_.contains(seq);
    const int B = opt_.block_size;
    const int cp = p_.cp;
    std::vector<int32_t> all;
    if (!is_new) all = seqs_.at(seq).tokens;
    all.insert(all.end(), tokens.begin(), tokens.end());
    int64_t K = 0;
    if (is_new && prefix_cache_active()) K = discover_and_move(all);
    if (!serving_) return false;

    if (is_new) {
        Seq s;
        s.map = CpTokenMap(cp);
        seqs_.emplace(seq, std::move(s));
    }
    Seq& s = seqs_.at(seq);
    const int64_t stored = is_new ? K * B : static_cast<int64_t>(s.tokens.size());
    const int64_t len = static_cast<int64_t>(all.size());
    s.tokens = all;
    if (is_new && stored > 0) s.map.append(stored, p_.cp_scheme, p_.cp_interleave);
    s.map.append(len - stored, p_.cp_scheme, p_.cp_interleave);
    const int c = coord_.cp;
    std::vector<int64_t> rows = s.map.positions(c, stored);

    BlockManager& bm = dev_.blocks();
    if (is_new) {
        // This rank's tokens; under block interleave its local block j is global block c + j*cp.
        std::vector<int64_t> local = s.map.positions(c);
        std::vector<BlockHash> local_hashes;
        if (prefix_cache_active()) {
            BlockHasher hasher;
            const auto hashes = hasher.hash_blocks(all, B, {});
            for (size_t g = static_cast<size_t>(c); g < hashes.size(); g += static_cast<size_t>(cp))
                local_hashes.push_back(hashes[g]);
            // Only the agreed prefix may be shared: a block of this rank cached beyond it would be
            // recomputed into a shared block (it can happen after evictions elsewhere).
            const int64_t expect = cp_local_blocks(K, cp, c);
            const auto found = bm.lookup_hashes(local_hashes);
            // Break the match there with a hash no token sequence produces (the manager needs a
            // hash for every full block).
            if (static_cast<int64_t>(found.blocks.size()) > expect) {
                BlockHash& h = local_hashes[static_cast<size_t>(expect)];
                h = BlockHash{~h.lo, ~h.hi};
            }
        }
        // Without prefix caching the blocks are never hashed (an empty sequence, then tokens).
        const int64_t n_local = static_cast<int64_t>(local.size());
        const auto r =
            bm.allocate_with_hashes(seq, local_hashes, prefix_cache_active() ? n_local : 0);
        if (!prefix_cache_active()) bm.append_tokens(seq, n_local);
        last_.local_hit_blocks = r.cached_blocks;
        KVSHARD_CHECK(!prefix_cache_active() || r.cached_blocks == cp_local_blocks(K, cp, c),
                      "rank ", c, " hit ", r.cached_blocks, " blocks but the agreed prefix of ", K,
                      " global blocks puts ", cp_local_blocks(K, cp, c), " on it");
        s.local_pos.assign(local.begin(),
                           local.begin() + static_cast<int64_t>(local.size() - rows.size()));
    } else {
        bm.append_tokens(seq, static_cast<int64_t>(rows.size()));
    }
    last_.cached_tokens = stored;
    // The mode: given, else the one that sends fewer bytes for this placement (`stored` cached).
    last_.mode =
        opt_.prefill_mode ? *opt_.prefill_mode : choose_cp_prefill(layout_, s.map, stored).mode;
    s.reserved = Seq::Reserved{std::move(rows), last_};
    return true;
}

std::vector<float> CpSession::prefill_reserved(SeqId seq) {
    return prefill_reserved(std::span<const SeqId>(&seq, 1));
}

std::vector<float> CpSession::prefill_reserved(std::span<const SeqId> seqs) {
    require(serving_, "a lending rank does not prefill");
    for (size_t i = 0; i < seqs.size(); ++i) {  // every sequence checked before any is changed
        require(seqs_.contains(seqs[i]) && seqs_.at(seqs[i]).reserved, "sequence ", seqs[i],
                " has no prefill reserved");
        for (size_t j = 0; j < i; ++j)
            require(seqs[j] != seqs[i], "sequence ", seqs[i], " appears twice in one prefill");
    }
    std::vector<Step> steps;
    for (SeqId seq : seqs) {
        Seq& s = seqs_.at(seq);
        Step st;
        st.id = seq;
        st.s = &s;
        st.stats = s.reserved->stats;
        st.rows = std::move(s.reserved->rows);
        st.stored_before = st.stats.cached_tokens;
        st.writes = true;
        s.reserved.reset();
        steps.push_back(std::move(st));
    }
    return run(steps, false);
}

void CpSession::adopt(SeqId seq, std::span<const int32_t> tokens) {
    require(serving_, "a lending rank serves no sequence");
    require(!tokens.empty(), "an adopted sequence needs at least one token");
    require(!seqs_.contains(seq), "sequence ", seq, " is already served here");
    Seq s;
    s.map = CpTokenMap(p_.cp);
    s.tokens.assign(tokens.begin(), tokens.end());
    s.map.append(static_cast<int64_t>(tokens.size()), p_.cp_scheme, p_.cp_interleave);
    s.local_pos = s.map.positions(coord_.cp);
    BlockManager& bm = dev_.blocks();
    bm.allocate_with_hashes(seq, {}, 0);  // never hashed: an empty sequence, then its tokens
    bm.append_tokens(seq, static_cast<int64_t>(s.local_pos.size()));
    seqs_.emplace(seq, std::move(s));
}

std::vector<float> CpSession::decode(SeqId seq, int32_t token) {
    return decode(std::span<const SeqId>(&seq, 1), std::span<const int32_t>(&token, 1));
}

std::vector<float> CpSession::decode(std::span<const SeqId> seqs, std::span<const int32_t> tokens) {
    require(serving_, "a lending rank does not decode");
    require(seqs.size() == tokens.size(), "a decode step of ", seqs.size(), " sequences got ",
            tokens.size(), " tokens");
    const int unit = p_.cp_scheme == CpScheme::kInterleave ? p_.cp_interleave : opt_.block_size;
    // Every sequence checked before any is changed.
    for (size_t i = 0; i < seqs.size(); ++i) {
        require(seqs_.contains(seqs[i]), "sequence ", seqs[i], " is not served here");
        require(!seqs_.at(seqs[i]).reserved, "sequence ", seqs[i],
                " has a prefill reserved and cannot decode yet");
        for (size_t j = 0; j < i; ++j)
            require(seqs[j] != seqs[i], "sequence ", seqs[i], " appears twice in one decode step");
    }
    std::vector<Step> steps;
    for (size_t i = 0; i < seqs.size(); ++i) {
        const SeqId seq = seqs[i];
        Seq& s = seqs_.at(seq);
        const int64_t pos = static_cast<int64_t>(s.tokens.size());
        s.tokens.push_back(tokens[i]);
        s.map.append_generated(1, unit);
        Step st;
        st.id = seq;
        st.s = &s;
        st.rows = {pos};
        st.stored_before = pos;
        st.writes = s.map.owner(pos) == coord_.cp;
        if (st.writes) dev_.blocks().append_tokens(seq, 1);
        st.stats.cached_tokens = pos;
        steps.push_back(std::move(st));
    }
    return run(steps, true);
}

namespace {

// Writes rows [r0, r0 + n) of the call, those of batch sequence i, to their slots (call.batch
// ->slots). MLA: the latent rows.
void write_rows(const AttentionCall& call, int i, int32_t r0, int32_t n) {
    const PagedKv& kv = call.batch->kv;
    PagedKv one;
    one.indices.assign(kv.indices.begin() + kv.indptr[size_t(i)],
                       kv.indices.begin() + kv.indptr[size_t(i) + 1]);
    one.indptr = {0, static_cast<int32_t>(one.indices.size())};
    one.last_page_len = {kv.last_page_len[size_t(i)]};
    const int32_t ptr[] = {0, n};
    const std::span<const int64_t> slots(call.batch->slots.data() + r0, size_t(n));
    const PageGeometry& g = call.pool->geometry();
    const int64_t row = int64_t{g.num_heads} * g.head_dim;
    if (call.mla_latent_dim > 0)
        write_latent(*call.pool, call.local_layer, one, ptr, slots, call.k + r0 * row);
    else
        write_kv(*call.pool, call.local_layer, one, ptr, slots, call.k + r0 * row,
                 call.v + r0 * row);
}

// The latent rows [c | k_pe] of local slots [0, n) of one sequence in one MLA layer, packed
// [n][dq] (docs/context-parallel.md section 8: under CP they are the ring's keys and values).
void read_latents(const BlockPool& pool, int layer, std::span<const BlockId> table, int64_t n,
                  float* lat) {
    const auto& g = pool.geometry();
    const int dq = g.head_dim;
    for (int64_t t = 0; t < n; ++t) {
        const float* page = pool.page_f32(layer, 0, table[size_t(t / g.block_size)]);
        std::copy_n(page + g.elem_in_page(0, int(t % g.block_size), 0), dq, lat + t * dq);
    }
}

}  // namespace

int32_t CpSession::state_slot(SeqId seq) {
    auto [it, fresh] = state_slot_.try_emplace(seq, 0);
    if (fresh) {
        if (free_state_slots_.empty()) {
            it->second = static_cast<int32_t>(state_slot_.size() - 1);
        } else {
            it->second = free_state_slots_.back();
            free_state_slots_.pop_back();
        }
    }
    return it->second;
}

std::vector<float> CpSession::run(std::vector<Step>& steps, bool decode) {
    const int c = coord_.cp;
    const int n_seq = static_cast<int>(steps.size());
    ForwardBatch fb;
    std::vector<SeqId> ids;
    std::vector<int32_t> row_at = {
        0};  // steps[i]'s rows are the batch rows [row_at[i], row_at[i+1])
    bool all_write = true;
    for (Step& st : steps) {
        Seq& s = *st.s;
        // Rows this rank stores: every prefill row; in decode the new token only on its owner.
        const int64_t first_new_slot = static_cast<int64_t>(s.local_pos.size());
        if (st.writes) s.local_pos.insert(s.local_pos.end(), st.rows.begin(), st.rows.end());
        all_write = all_write && st.writes;
        fb.queries.q_pos.insert(fb.queries.q_pos.end(), st.rows.begin(), st.rows.end());
        fb.queries.q_indptr.push_back(static_cast<int32_t>(fb.queries.q_pos.size()));
        if (fb.queries.kv_pos_indptr.empty()) fb.queries.kv_pos_indptr.push_back(0);
        fb.queries.kv_pos.insert(fb.queries.kv_pos.end(), s.local_pos.begin(), s.local_pos.end());
        fb.queries.kv_pos_indptr.push_back(static_cast<int64_t>(fb.queries.kv_pos.size()));
        for (size_t i = 0; i < st.rows.size(); ++i) {
            fb.token_ids.push_back(s.tokens[static_cast<size_t>(st.rows[i])]);
            fb.slots.push_back(st.writes ? first_new_slot + static_cast<int64_t>(i) : -1);
        }
        row_at.push_back(static_cast<int32_t>(fb.token_ids.size()));
        ids.push_back(st.id);
    }
    fb.kv = dev_.blocks().paged_kv(ids);
    std::vector<std::span<const BlockId>> tables;
    for (int i = 0; i < n_seq; ++i) {
        const Seq& s = *steps[size_t(i)].s;
        KVSHARD_CHECK(fb.kv.seq_len(i, opt_.block_size) == static_cast<int64_t>(s.local_pos.size()),
                      "block table of sequence ", ids[size_t(i)], " holds ",
                      fb.kv.seq_len(i, opt_.block_size), " tokens, expected ", s.local_pos.size());
        tables.push_back(dev_.blocks().block_table(ids[size_t(i)]));
    }

    Communicator& cpc = *groups_.cp;
    CpCommStats ring_stats;   // prefill: the batch's rings and state-row gathers
    CpCommStats merge_stats;  // decode: the batch's merges, shared by its sequences
    double merge_seconds = 0;
    auto merge = [&](int64_t rows, int heads, int dim, const float* part, const float* lse,
                     float* out) {
        const auto t0 = std::chrono::steady_clock::now();
        cp_merge_partials(cpc, opt_.decode_merge, rows, heads, dim, part, lse, out, &merge_stats);
        merge_seconds +=
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    dev_.model().set_attention([&](const AttentionCall& call) {
        const AttentionParams& ap = call.params;
        const bool mla = call.mla_latent_dim > 0;
        // Every row's KV of the layer first: a later sequence of the batch may read an earlier
        // one's (a prefix shared within the batch), on this rank and, through the ring, others.
        if (all_write) {
            if (call.batch->rows() > 0) {
                if (mla)
                    write_latent(*call.pool, call.local_layer, call.batch->kv,
                                 call.batch->queries.q_indptr, call.batch->slots, call.k);
                else
                    write_kv(*call.pool, call.local_layer, call.batch->kv,
                             call.batch->queries.q_indptr, call.batch->slots, call.k, call.v);
            }
        } else {
            for (int i = 0; i < n_seq; ++i)
                if (steps[size_t(i)].writes && row_at[size_t(i) + 1] > row_at[size_t(i)])
                    write_rows(call, i, row_at[size_t(i)],
                               row_at[size_t(i) + 1] - row_at[size_t(i)]);
        }
        const std::span<const float> sinks =
            call.sinks ? std::span<const float>(call.sinks, size_t(ap.num_q_heads))
                       : std::span<const float>();
        if (!decode) {
            // One ring for the batch per prefill mode (pass-KV sequences, then pass-Q ones; the
            // same order on every rank), its messages the shards of every sequence of that mode.
            // MLA: the latent rows are K and V (MQA over the latent, outputs of dl + dr of which
            // the first dl are the weighted latents).
            const int dq = ap.head_dim, nq = ap.num_q_heads;
            const int dout = mla ? call.mla_latent_dim : dq;
            const CpAttnShape shape =
                mla ? CpAttnShape{nq, 1, dq, ap.scale}
                    : CpAttnShape{nq, ap.num_kv_heads, dq, ap.scale, ap.window, ap.chunked};
            const int64_t kvrow = int64_t{shape.num_kv_heads} * dq;
            std::vector<std::vector<float>> k(static_cast<size_t>(n_seq)),
                v(static_cast<size_t>(n_seq)), full(static_cast<size_t>(n_seq));
            std::vector<CpRingSequence> ring[2];  // by mode: pass-KV, pass-Q
            for (int i = 0; i < n_seq; ++i) {
                Step& st = steps[size_t(i)];
                const int64_t r0 = row_at[size_t(i)];
                const int64_t n = row_at[size_t(i) + 1] - r0;
                const int64_t n_local = static_cast<int64_t>(st.s->local_pos.size());
                k[size_t(i)].resize(size_t(n_local * kvrow));
                CpRingSequence rs{&st.s->map,          st.stored_before, call.q + r0 * nq * dq,
                                  k[size_t(i)].data(), nullptr,          call.out + r0 * nq * dout};
                if (mla) {
                    read_latents(*call.pool, call.local_layer, tables[size_t(i)], n_local,
                                 k[size_t(i)].data());
                    rs.v = k[size_t(i)].data();
                    full[size_t(i)].resize(size_t(n * nq * dq));
                    rs.out = full[size_t(i)].data();
                } else {
                    v[size_t(i)].resize(size_t(n_local * kvrow));
                    pack_kv(*call.pool, call.local_layer, tables[size_t(i)], n_local,
                            k[size_t(i)].data(), v[size_t(i)].data());
                    rs.v = v[size_t(i)].data();
                }
                ring[st.stats.mode == CpPrefillMode::kPassKv ? 0 : 1].push_back(rs);
            }
            cp_prefill_attention(cpc, CpPrefillMode::kPassKv, shape, ring[0], &ring_stats,
                                 mla ? std::span<const float>() : sinks);
            cp_prefill_attention(cpc, CpPrefillMode::kPassQ, shape, ring[1], &ring_stats,
                                 mla ? std::span<const float>() : sinks);
            for (int i = 0; i < n_seq; ++i) {
                const Step& st = steps[size_t(i)];
                if (mla) {
                    const int64_t rows = (row_at[size_t(i) + 1] - row_at[size_t(i)]) * nq;
                    float* out = call.out + int64_t{row_at[size_t(i)]} * nq * dout;
                    for (int64_t r = 0; r < rows; ++r)
                        std::copy_n(full[size_t(i)].data() + r * dq, dout, out + r * dout);
                }
                if (layer_hook_) layer_hook_(st.id, call.layer, call.local_layer);
            }
            return;
        }
        // Decode: each rank's partial of every row over its own pages, then one merge for the
        // whole batch (rows = sequences).
        const int64_t n = call.batch->rows();
        if (mla) {
            const int dq = ap.head_dim, dl = call.mla_latent_dim, nq = ap.num_q_heads;
            std::vector<float> part(size_t(n * nq * dl)), lse(size_t(n * nq), kNegInf);
            const MlaParams mp{
                .num_heads = nq, .latent_dim = dl, .rope_dim = dq - dl, .scale = ap.scale};
            mla_attention(*call.pool, call.local_layer, call.batch->kv, call.batch->queries, mp,
                          call.q, part.data(), lse.data());
            merge(n, nq, dl, part.data(), lse.data(), call.out);
            return;
        }
        std::vector<float> part(n * ap.num_q_heads * ap.head_dim), lse(n * ap.num_q_heads, kNegInf);
        paged_attention(*call.pool, call.local_layer, call.batch->kv, call.batch->queries, ap,
                        call.q, part.data(), lse.data());
        // The sinks join one rank's partial, so that the merge counts each once.
        if (!sinks.empty() && cpc.rank() == 0)
            apply_attention_sinks(part.data(), lse.data(), n, ap.num_q_heads, ap.head_dim,
                                  sinks.data());
        merge(n, ap.num_q_heads, ap.head_dim, part.data(), lse.data(), call.out);
    });
    // State layers: each sequence has its own state slot, and a prefill runs the recurrence over
    // every new row of each sequence on every CP rank (the rows all-gathered in position order),
    // so every rank holds the state and a decode step (the same row on every rank) needs no
    // exchange.
    const bool state = dev_.model().state_bytes_per_sequence() > 0;
    if (state)
        for (const Step& st : steps) fb.state_slots.push_back(state_slot(st.id));
    if (!decode && state)
        dev_.model().set_state_rows([&](const std::vector<float>& local, int64_t width) {
            // One all-gather for the batch: rank r sends its rows of every sequence, sequence by
            // sequence, each in position order; `g.rows` is sequence by sequence, by position.
            const int cp = cpc.size();
            StateRows g;
            std::vector<size_t> counts(static_cast<size_t>(cp), 0);
            for (const Step& st : steps) {
                const CpTokenMap& map = st.s->map;
                for (int r = 0; r < cp; ++r)
                    counts[size_t(r)] +=
                        static_cast<size_t>(map.count(r, st.stored_before) * width) * sizeof(float);
                g.first_pos.push_back(st.stored_before);
                g.seq_ptr.push_back(g.seq_ptr.back() +
                                    static_cast<int32_t>(map.size() - st.stored_before));
            }
            std::vector<float> all(static_cast<size_t>(g.seq_ptr.back() * width));
            cpc.all_gather_v(std::as_bytes(std::span<const float>(local)),
                             std::as_writable_bytes(std::span<float>(all)), counts);
            g.rows.resize(all.size());
            int64_t at = 0;
            for (int r = 0; r < cp; ++r)
                for (size_t i = 0; i < steps.size(); ++i) {
                    const Step& st = steps[i];
                    for (int64_t p : st.s->map.positions(r, st.stored_before)) {
                        std::copy_n(all.data() + at * width, width,
                                    g.rows.data() + (g.seq_ptr[i] + p - st.stored_before) * width);
                        ++at;
                    }
                }
            ring_stats.all_gather += static_cast<int64_t>(local.size() * sizeof(float)) * (cp - 1);
            for (size_t i = 0; i < steps.size(); ++i)
                for (int64_t p : steps[i].rows)
                    g.own.push_back(g.seq_ptr[i] + p - steps[i].stored_before);
            return g;
        });
    std::vector<float> logits = dev_.model().forward(fb);
    dev_.model().set_attention(default_attention);
    dev_.model().set_state_rows(nullptr);
    const int vocab = dev_.spec().vocab;
    if (!decode && dev_.model().last_stage()) {
        // The last token's owner of each sequence has its logits: the others' rows are zeroed
        // and one sum over the CP group gives every rank every row exactly (x + 0 = x).
        for (int i = 0; i < n_seq; ++i) {
            const CpTokenMap& map = steps[size_t(i)].s->map;
            if (map.owner(map.size() - 1) != c)
                std::fill_n(logits.begin() + int64_t{i} * vocab, vocab, 0.0f);
        }
        cpc.all_reduce_sum(std::span<float>(logits));
    }
    if (p_.pp > 1) {  // the last stage's logits to every stage (the same (cp, tp) of each)
        logits.resize(static_cast<size_t>(n_seq) * static_cast<size_t>(vocab));
        groups_.pp->broadcast(std::span<float>(logits), p_.pp - 1);
    }
    last_ = {};
    for (Step& st : steps) {
        st.stats.computed_tokens = static_cast<int64_t>(st.rows.size());
        if (!decode) st.s->prefill = st.stats;
        last_.mode = st.stats.mode;
        last_.computed_tokens += st.stats.computed_tokens;
        last_.cached_tokens += st.stats.cached_tokens;
        last_.local_hit_blocks += st.stats.local_hit_blocks;
        last_.blocks_moved_in += st.stats.blocks_moved_in;
        last_.blocks_moved_out += st.stats.blocks_moved_out;
        last_.block_bytes_moved += st.stats.block_bytes_moved;
        last_.comm += st.stats.comm;
    }
    last_.comm += ring_stats;
    last_.comm += merge_stats;
    // A sequence alone in its step owns the step's traffic; in a batch it is shared (last_step()).
    if (n_seq == 1 && !decode) steps[0].s->prefill.comm += ring_stats;
    last_.merge_seconds = merge_seconds;
    total_ += last_.comm;
    return logits;
}

void CpSession::release(SeqId seq) {
    if (!serving_) return;
    dev_.blocks().free(seq);
    seqs_.erase(seq);
    if (auto it = state_slot_.find(seq); it != state_slot_.end()) {
        free_state_slots_.push_back(it->second);
        state_slot_.erase(it);
    }
}

}  // namespace kvshard
