#include "kvshard/exec/cp_session.h"

#include <algorithm>
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

// Bytes of one block over all layers and K/V, in page order, to and from a buffer.
std::vector<std::byte> read_block(const BlockPool& pool, BlockId b) {
    const PageGeometry& g = pool.geometry();
    std::vector<std::byte> out;
    out.reserve(static_cast<size_t>(g.block_bytes()));
    for (int l = 0; l < g.num_layers; ++l)
        for (int kv = 0; kv < g.kv_factor; ++kv) {
            const std::byte* p = pool.page(l, kv, b);
            out.insert(out.end(), p, p + g.page_bytes());
        }
    return out;
}

void write_block(BlockPool& pool, BlockId b, std::span<const std::byte> bytes) {
    const PageGeometry& g = pool.geometry();
    KVSHARD_CHECK(static_cast<int64_t>(bytes.size()) == g.block_bytes(), "block of ", bytes.size(),
                  " bytes, expected ", g.block_bytes());
    size_t at = 0;
    for (int l = 0; l < g.num_layers; ++l)
        for (int kv = 0; kv < g.kv_factor; ++kv) {
            std::memcpy(pool.page(l, kv, b), bytes.data() + at,
                        static_cast<size_t>(g.page_bytes()));
            at += static_cast<size_t>(g.page_bytes());
        }
}

WeightShard device_shard(const ModelSpec& m, int tp, int tp_rank) {
    ParallelConfig p;
    p.tp = tp;
    const KvLayout l = make_layout(m, p);
    const RankKv& r = l.ranks.at(static_cast<size_t>(tp_rank));
    require(m.intermediate % tp == 0, m.name, ": the MLP width ", m.intermediate,
            " is not divisible by tp=", tp);
    WeightShard s;
    s.layer_begin = 0;
    s.layer_end = m.num_layers;
    s.q_head_begin = r.q_head_begin;
    s.q_head_end = r.q_head_end;
    s.kv_head_begin = r.kv_heads.front();
    s.kv_head_end = r.kv_heads.back() + 1;
    const int w = m.intermediate / tp;
    s.mlp_begin = tp_rank * w;
    s.mlp_end = s.mlp_begin + w;
    s.expert_begin = r.expert_begin;
    s.expert_end = r.expert_end;
    return s;
}

}  // namespace

CpDevice::CpDevice(const ModelSpec& m, int tp, int tp_rank, const TensorSource& weights,
                   const CpOptions& opt)
    : tp_(tp),
      tp_rank_(tp_rank),
      block_size_(opt.block_size),
      blocks_(BlockManagerConfig{opt.num_blocks, opt.block_size, opt.prefix_cache}) {
    const ModelSpec spec = fp32_spec(m);
    model_ = std::make_unique<RankModel>(
        load_weights(spec, device_shard(spec, tp, tp_rank), weights), opt.num_blocks,
        opt.block_size, RankComms{}, PageOrder::kHnd, opt.pool_memory);
}

CpSession::CpSession(CpDevice& device, Communicator& world, const ParallelConfig& p, CpOptions opt)
    : dev_(device), world_(world), p_(p), opt_(opt) {
    require(p.dp == 1 && p.pp == 1, "context parallelism runs with dp=1 and pp=1 here, got ",
            p.to_string());
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
    groups_ = make_groups(*serving_comm_, p);
    RankComms comms;
    comms.world = serving_comm_.get();
    comms.tp = p.tp > 1 ? groups_.tp.get() : nullptr;
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
    const int64_t limit = std::min<int64_t>(static_cast<int64_t>(hashes.size()), (len - 1) / B);
    BlockManager& bm = dev_.blocks();

    // Every device says which of the prompt's blocks it holds: [tp, tp_rank, has[0..limit)].
    std::vector<int32_t> mine = {dev_.tp(), dev_.tp_rank()};
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
    auto has = [&](int d, int64_t b) { return info(d, 0) == p_.tp && info(d, 2 + b) != 0; };
    auto holder = [&](int64_t b, int t) {  // the lowest device of TP index t holding block b
        for (int d = 0; d < W; ++d)
            if (info(d, 1) == t && has(d, b)) return d;
        return -1;
    };
    int64_t K = 0;
    for (; K < limit; ++K) {
        bool everywhere = true;
        for (int t = 0; t < p_.tp && everywhere; ++t) everywhere = holder(K, t) >= 0;
        if (!everywhere) break;
    }

    // Moves (plan_cp_prefix_moves, per TP index t over the devices of that index): block b (< K)
    // belongs to CP rank b % cp; a device of the serving group that lacks it receives it from the
    // lowest device of its TP index that holds it. Same order on every rank: by block, then TP.
    struct Move {
        int64_t b;
        int src, dst;
    };
    std::vector<Move> moves;
    for (int t = 0; t < p_.tp; ++t) {
        std::vector<std::vector<int>> holders(static_cast<size_t>(K));
        for (int64_t b = 0; b < K; ++b)
            for (int d = 0; d < W; ++d)
                if (info(d, 1) == t && has(d, b)) holders[static_cast<size_t>(b)].push_back(d);
        std::vector<int> dst_device;
        for (int c = 0; c < p_.cp; ++c) dst_device.push_back(rank_of(p_, 0, 0, c, t));
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
    const int64_t block_bytes = dev_.model().pool().geometry().block_bytes();
    for (const Move& m : moves) {
        if (m.src == me) {
            const auto found = bm.lookup_hashes(std::span(&hashes[static_cast<size_t>(m.b)], 1));
            KVSHARD_CHECK(!found.blocks.empty(), "block ", m.b, " announced but not found");
            out_bufs.push_back(read_block(dev_.model().pool(), found.blocks.front()));
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
        write_block(dev_.model().pool(), imported[i].second, in_bufs[i]);
    for (SeqId t : tmps) bm.free(t);  // the imported blocks stay, cached under their hashes
    return K;
}

std::vector<float> CpSession::prefill(SeqId seq, std::span<const int32_t> tokens) {
    if (!reserve(seq, tokens)) return {};
    return prefill_reserved(seq);
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
    // The mode: given, else the cheaper in bytes for `stored` cached and the new tokens.
    last_.mode = opt_.prefill_mode ? *opt_.prefill_mode
                                   : choose_cp_prefill(layout_, stored, len - stored).mode;
    s.reserved = Seq::Reserved{std::move(rows), last_};
    return true;
}

std::vector<float> CpSession::prefill_reserved(SeqId seq) {
    require(serving_, "a lending rank does not prefill");
    require(seqs_.contains(seq) && seqs_.at(seq).reserved, "sequence ", seq,
            " has no prefill reserved");
    Seq& s = seqs_.at(seq);
    last_ = s.reserved->stats;
    std::vector<int64_t> rows = std::move(s.reserved->rows);
    s.reserved.reset();
    return run(s, seq, std::move(rows), false);
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
    require(serving_, "a lending rank does not decode");
    last_ = {};
    Seq& s = seqs_.at(seq);
    const int64_t pos = static_cast<int64_t>(s.tokens.size());
    s.tokens.push_back(token);
    const int unit = p_.cp_scheme == CpScheme::kInterleave ? p_.cp_interleave : opt_.block_size;
    s.map.append_generated(1, unit);
    if (s.map.owner(pos) == coord_.cp) dev_.blocks().append_tokens(seq, 1);
    last_.cached_tokens = pos;
    return run(s, seq, {pos}, true);
}

namespace {

// One MLA layer under CP (absorbed form, docs/context-parallel.md section 8): the latent row
// [c | k_pe] is one KV head of dl + dr elements that serves as the key and as the value, so ring
// prefill is MQA over it with outputs of dl + dr of which the first dl are the weighted latents;
// decode merges mla_attention's partials of dl.
void mla_cp_attention(const AttentionCall& call, Communicator& cpc, CpPrefillMode mode,
                      const CpTokenMap& map, int64_t stored_before, bool writes, bool decode,
                      std::span<const BlockId> table, int64_t n_local, CpCommStats& stats,
                      CpDecodeMerge merge) {
    const AttentionParams& ap = call.params;
    const int dq = ap.head_dim, dl = call.mla_latent_dim, nq = ap.num_q_heads;
    BlockPool& pool = *call.pool;
    if (writes)
        write_latent(pool, call.local_layer, call.batch->kv, call.batch->queries.q_indptr,
                     call.batch->slots, call.k);
    const int64_t n = call.batch->rows();
    if (!decode) {
        const auto& g = pool.geometry();
        std::vector<float> lat(size_t(n_local * dq));
        for (int64_t t = 0; t < n_local; ++t) {
            const float* page = pool.page_f32(call.local_layer, 0, table[size_t(t / g.block_size)]);
            std::copy_n(page + g.elem_in_page(0, int(t % g.block_size), 0), dq,
                        lat.data() + t * dq);
        }
        std::vector<float> full(size_t(n * nq * dq));
        const CpAttnShape shape{nq, 1, dq, ap.scale};
        cp_prefill_attention(cpc, mode, shape, map, stored_before, call.q, lat.data(), lat.data(),
                             full.data(), &stats);
        for (int64_t r = 0; r < n * nq; ++r)
            std::copy_n(full.data() + r * dq, dl, call.out + r * dl);
        return;
    }
    std::vector<float> part(size_t(n * nq * dl)), lse(size_t(n * nq), kNegInf);
    const MlaParams mp{.num_heads = nq, .latent_dim = dl, .rope_dim = dq - dl, .scale = ap.scale};
    mla_attention(pool, call.local_layer, call.batch->kv, call.batch->queries, mp, call.q,
                  part.data(), lse.data());
    cp_merge_partials(cpc, merge, n, nq, dl, part.data(), lse.data(), call.out, &stats);
}

}  // namespace

std::vector<float> CpSession::run(Seq& s, SeqId seq, std::vector<int64_t> rows, bool decode) {
    const int c = coord_.cp;
    const int64_t first_new_slot = static_cast<int64_t>(s.local_pos.size());
    const int64_t stored_before = decode ? rows.front() : last_.cached_tokens;
    // Rows this rank stores: every prefill row; in decode the new token only on its owner.
    std::vector<int64_t> written;
    for (int64_t p : rows)
        if (!decode || s.map.owner(p) == c) written.push_back(p);
    s.local_pos.insert(s.local_pos.end(), written.begin(), written.end());

    ForwardBatch fb;
    fb.queries.q_pos = rows;
    fb.queries.q_indptr = {0, static_cast<int32_t>(rows.size())};
    fb.queries.kv_pos = s.local_pos;
    fb.queries.kv_pos_indptr = {0, static_cast<int64_t>(s.local_pos.size())};
    for (size_t i = 0; i < rows.size(); ++i) {
        fb.token_ids.push_back(s.tokens[static_cast<size_t>(rows[i])]);
        fb.slots.push_back(written.size() == rows.size() ? first_new_slot + static_cast<int64_t>(i)
                                                         : -1);
    }
    const SeqId ids[] = {seq};
    fb.kv = dev_.blocks().paged_kv(ids);
    KVSHARD_CHECK(fb.kv.seq_len(0, opt_.block_size) == static_cast<int64_t>(s.local_pos.size()),
                  "block table holds ", fb.kv.seq_len(0, opt_.block_size), " tokens, expected ",
                  s.local_pos.size());

    Communicator& cpc = *groups_.cp;
    const auto table = dev_.blocks().block_table(seq);
    const int64_t n_local = static_cast<int64_t>(s.local_pos.size());
    const bool owner_writes = written.size() == rows.size();
    const CpPrefillMode mode = last_.mode;
    CpCommStats& stats = last_.comm;
    const CpTokenMap& map = s.map;
    dev_.model().set_attention([&](const AttentionCall& call) {
        const AttentionParams& ap = call.params;
        if (call.mla_latent_dim > 0) {  // MLA: the latent travels the ring as K and as V
            mla_cp_attention(call, cpc, mode, map, stored_before, owner_writes && !rows.empty(),
                             decode, table, n_local, stats, opt_.decode_merge);
            if (!decode && layer_hook_) layer_hook_(seq, call.layer);
            return;
        }
        const CpAttnShape shape{ap.num_q_heads, ap.num_kv_heads, ap.head_dim,
                                ap.scale,       ap.window,       ap.chunked};
        const std::span<const float> sinks =
            call.sinks ? std::span<const float>(call.sinks, size_t(ap.num_q_heads))
                       : std::span<const float>();
        if (owner_writes && !rows.empty())
            write_kv(*call.pool, call.local_layer, call.batch->kv, call.batch->queries.q_indptr,
                     call.batch->slots, call.k, call.v);
        if (!decode) {
            const int64_t row = int64_t{ap.num_kv_heads} * ap.head_dim;
            std::vector<float> k(n_local * row), v(n_local * row);
            pack_kv(*call.pool, call.local_layer, table, n_local, k.data(), v.data());
            cp_prefill_attention(cpc, mode, shape, map, stored_before, call.q, k.data(), v.data(),
                                 call.out, &stats, sinks);
            if (layer_hook_) layer_hook_(seq, call.layer);
        } else {
            const int64_t n = call.batch->rows();
            std::vector<float> part(n * ap.num_q_heads * ap.head_dim),
                lse(n * ap.num_q_heads, kNegInf);
            paged_attention(*call.pool, call.local_layer, call.batch->kv, call.batch->queries, ap,
                            call.q, part.data(), lse.data());
            // The sinks join one rank's partial, so that the merge counts each once.
            if (!sinks.empty() && cpc.rank() == 0)
                apply_attention_sinks(part.data(), lse.data(), n, ap.num_q_heads, ap.head_dim,
                                      sinks.data());
            cp_merge_partials(cpc, opt_.decode_merge, n, ap.num_q_heads, ap.head_dim, part.data(),
                              lse.data(), call.out, &stats);
        }
    });
    std::vector<float> logits = dev_.model().forward(fb);
    dev_.model().set_attention(default_attention);
    last_.computed_tokens = static_cast<int64_t>(rows.size());
    total_ += stats;
    if (!decode) {  // the last token's owner has the logits
        const int owner = s.map.owner(s.map.size() - 1);
        cpc.broadcast(std::span<float>(logits), owner);
    }
    return logits;
}

void CpSession::release(SeqId seq) {
    if (!serving_) return;
    dev_.blocks().free(seq);
    seqs_.erase(seq);
}

}  // namespace kvshard
