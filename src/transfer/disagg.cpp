#include "kvshard/transfer/disagg.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include <unistd.h>

#include "common/byte_buffer.h"
#include "kvshard/comm/communicator.h"
#include "kvshard/comm/groups.h"
#include "kvshard/common/error.h"
#include "kvshard/exec/cp_session.h"
#include "kvshard/exec/generate.h"
#include "kvshard/exec/rank_model.h"
#include "kvshard/layout/kv_layout.h"
#include "kvshard/transfer/source_checksums.h"
#include "kvshard/transfer/transfer_exec.h"
#include "kvshard/transfer/transfer_plan.h"

namespace kvshard {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kTagFirstTokens = 0x7A001;   // prefill last stage -> every decode rank
constexpr int kTagDecodeTokens = 0x7A002;  // decode last stage -> earlier decode stages

uint64_t host_hash() {
    char name[256] = {};
    gethostname(name, sizeof(name) - 1);
    return std::hash<std::string>{}(name);
}

double since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Blocks of each request: request i uses [base[i], base[i] + count(i)).
std::vector<std::vector<int32_t>> consecutive_tables(const std::vector<int64_t>& tokens,
                                                     int block_size, int64_t& total_blocks) {
    std::vector<std::vector<int32_t>> t;
    int32_t next = 0;
    for (int64_t n : tokens) {
        const int64_t blocks = (n + block_size - 1) / block_size;
        std::vector<int32_t> table;
        for (int64_t b = 0; b < blocks; ++b) table.push_back(next++);
        t.push_back(std::move(table));
    }
    total_blocks = std::max<int64_t>(1, next);
    return t;
}

RankComms rank_comms(Communicator& group, const ParallelGroups& g, const ParallelConfig& p,
                     const RankCoord& c) {
    RankComms comms;
    comms.world = &group;
    comms.tp = g.tp.get();
    comms.ep = g.ep.get();
    if (c.pp > 0) comms.prev_stage = rank_of(p, c.dp, c.pp - 1, c.cp, c.tp);
    if (c.pp < p.pp - 1) comms.next_stage = rank_of(p, c.dp, c.pp + 1, c.cp, c.tp);
    return comms;
}

// What each rank contributes to the report.
// Times are seconds from the rank's own start (after the common barrier). On one host the ranks'
// starts are put on one clock (steady_clock is system-wide there): a rank that is scheduled late
// after the barrier would otherwise see a transfer that began before its start as ending before it.
struct RankTimes {
    double start_abs = 0;       // the rank's start on the steady clock
    uint64_t host = 0;          // hash of the host name
    double prefill_end = -1;    // prefill ranks: forward done
    double first_send = -1;     // prefill ranks: first message out
    double transfer_done = -1;  // decode ranks: every request's transfer finished
    double decode_seconds = 0;
    int64_t bytes = 0;  // decode ranks: payload bytes received
    int64_t messages = 0;
    int64_t direct_messages = 0;
    int64_t unit_checksum_messages = 0;
};

}  // namespace

DisaggReport disagg_generate(const ModelSpec& spec, const ParallelConfig& prefill,
                             const ParallelConfig& decode, const TensorSource& weights,
                             const std::vector<std::vector<int32_t>>& prompts,
                             const DisaggOptions& opt, Communicator& world) {
    ModelSpec m = spec;
    m.kv_dtype = DType::kFp32;  // the reference model caches fp32 KV
    require(
        prefill.dp == 1 && decode.dp == 1,
        "disaggregated runs serve one replica on each side: use dp=1 for --prefill and --decode");
    // A side with cp > 1 runs the CP executor (CpSession) on a cp x tp grid, one request after
    // another. A CP prefill side reserves every request's blocks before the start, so the plans are
    // known and each layer is sent as its ring attention finishes; a CP decode side allocates its
    // blocks when it takes the requests in (CpSession::adopt), before the transfer, and decodes
    // with merged partial attention.
    auto check_cp_side = [](const char* side, const ParallelConfig& p, PageOrder order) {
        if (p.cp == 1) return;
        require(p.pp == 1 && p.ep == 1, "a ", side,
                " side with cp > 1 runs context parallelism on a cp x tp grid: use pp=1 and ep=1 "
                "with it, got --",
                side, " ", p.to_string());
        require(order == PageOrder::kHnd, "a ", side, " side with cp > 1 stores HND pages: use --",
                side, "-order hnd with it");
    };
    check_cp_side("prefill", prefill, opt.prefill_order);
    check_cp_side("decode", decode, opt.decode_order);
    const bool cp_prefill = prefill.cp > 1, cp_decode = decode.cp > 1;
    require(!m.is_mla(), m.name, " uses MLA, which the reference model does not run");
    const KvLayout lp = make_layout(m, prefill);
    const KvLayout ld = make_layout(m, decode);
    const int P = prefill.world_size(), D = decode.world_size();
    require(world.size() == P + D, "the run has ", world.size(), " ranks but prefill ",
            prefill.to_string(), " + decode ", decode.to_string(), " need ", P, " + ", D, " = ",
            P + D);
    require(!prompts.empty(), "give at least one prompt");
    check_prompts(prompts, m.vocab, opt.max_new_tokens);
    const int n = static_cast<int>(prompts.size());
    const int gen = opt.max_new_tokens;

    // The plans: pure functions of the two layouts and the block tables, the same on every rank.
    std::vector<int64_t> prompt_len, decode_len;
    for (const auto& p : prompts) {
        prompt_len.push_back(static_cast<int64_t>(p.size()));
        decode_len.push_back(static_cast<int64_t>(p.size()) + gen);
    }
    int64_t prefill_blocks = 0, decode_blocks = 0;
    const auto ptables = consecutive_tables(prompt_len, opt.prefill_block_size, prefill_blocks);
    const auto dtables = consecutive_tables(decode_len, opt.decode_block_size, decode_blocks);
    const bool streamed = opt.stream_layers;
    std::vector<std::shared_ptr<const TransferPlan>> plans;
    // src_tables[i][c] / dst_tables[i][c]: request i's blocks on prefill / decode CP rank c.
    using Tables = std::vector<std::vector<std::vector<int32_t>>>;
    auto make_plans = [&](const Tables& src_tables, const Tables& dst_tables) {
        for (int i = 0; i < n; ++i) {
            TransferEndpoint src{.layout = lp,
                                 .dp = 0,
                                 .block_size = opt.prefill_block_size,
                                 .order = opt.prefill_order,
                                 .block_tables = src_tables[i]};
            TransferEndpoint dst{.layout = ld,
                                 .dp = 0,
                                 .block_size = opt.decode_block_size,
                                 .order = opt.decode_order,
                                 .block_tables = dst_tables[i]};
            plans.push_back(std::make_shared<const TransferPlan>(make_transfer_plan(
                src, dst, prompt_len[i], {.layers_per_group = streamed ? 1 : 0})));
        }
    };
    if (!cp_prefill && !cp_decode) {  // the plain executors' blocks are known now
        Tables st, dt;
        for (int i = 0; i < n; ++i) {
            st.push_back({ptables[i]});
            dt.push_back({dtables[i]});
        }
        make_plans(st, dt);
    }
    TransferExecOptions xo;
    xo.mode = opt.mode;
    xo.src_world_base = 0;
    xo.dst_world_base = P;
    xo.staging_bytes = opt.staging_bytes;
    xo.timeout_s = opt.timeout_s;
    xo.sender_idle_sleep_us = opt.sender_idle_sleep_us;
    xo.offload_check_bytes = opt.offload_check_bytes;
    // Prefill pools in shareable memory where this process can make it (else messages).
    const bool share_pools = opt.direct_read && SharedArena::supported();
    xo.direct_read = opt.direct_read;
    xo.direct_window = opt.direct_window;
    xo.arena_views = std::make_shared<SharedArenaViews>();  // this rank's, for its requests

    const int me = world.rank();
    const bool is_prefill = me < P;
    auto group = world.split(is_prefill ? 0 : 1, me);
    const int prefill_last = rank_of(prefill, 0, prefill.pp - 1, 0, 0);

    // Models first (weights are loaded outside the timed part), then a common start.
    const KvLayout& mine = is_prefill ? lp : ld;
    const ParallelConfig& pc = is_prefill ? prefill : decode;
    const int local = is_prefill ? me : me - P;
    const RankCoord c = mine.ranks[local].coord;
    const ParallelGroups g = make_groups(*group, pc);
    std::unique_ptr<RankModel> plain;
    std::unique_ptr<CpDevice> cp_device;
    std::unique_ptr<CpSession> cp_session;
    if (is_prefill ? cp_prefill : cp_decode) {
        CpOptions co;
        co.block_size = is_prefill ? opt.prefill_block_size : opt.decode_block_size;
        // every request whole fits; a CP rank holds a part
        co.num_blocks = (is_prefill ? prefill_blocks : decode_blocks) + 1;
        co.prefix_cache = false;
        co.prefill_mode = opt.cp_prefill_mode;
        co.decode_merge = opt.cp_decode_merge;
        if (is_prefill && share_pools) co.pool_memory = PoolMemory::kShareable;
        cp_device = std::make_unique<CpDevice>(m, pc.tp, c.tp, weights, co);
        cp_session = std::make_unique<CpSession>(*cp_device, *group, pc, co);
        for (int i = 0; i < n; ++i) {
            if (is_prefill)
                cp_session->reserve(static_cast<SeqId>(i), prompts[i]);
            else
                cp_session->adopt(static_cast<SeqId>(i), prompts[i]);
        }
    } else {
        plain = std::make_unique<RankModel>(
            load_weights(m, weight_shard(mine, local), weights),
            is_prefill ? prefill_blocks : decode_blocks,
            is_prefill ? opt.prefill_block_size : opt.decode_block_size,
            rank_comms(*group, g, pc, c), is_prefill ? opt.prefill_order : opt.decode_order,
            is_prefill && share_pools ? PoolMemory::kShareable : PoolMemory::kPrivate);
    }
    RankModel& model = plain ? *plain : cp_device->model();
    xo.staging_pool = StagingPool::create();  // this rank's, shared by its requests

    // The CP executors' block tables (reserved or adopted above): every world rank learns each CP
    // rank's tables (from its tp index 0; the other TP ranks of that CP index hold the same) and
    // builds the plans, before the start.
    auto share_cp_tables = [&]() {
        ByteWriter tw;
        if (cp_session)
            for (int i = 0; i < n; ++i) {
                const auto id = static_cast<SeqId>(i);
                std::vector<int32_t> t;
                if (cp_device->blocks().contains(id)) {
                    const auto span = cp_device->blocks().block_table(id);
                    t.assign(span.begin(), span.end());
                }
                tw.put_vec(t);
            }
        const auto blobs = world.all_gather_blobs(tw.bytes());
        auto side = [&](const ParallelConfig& pcfg, int base, const char* what) {
            Tables tables(static_cast<size_t>(n), std::vector<std::vector<int32_t>>(pcfg.cp));
            for (int cpr = 0; cpr < pcfg.cp; ++cpr)
                for (int t = 0; t < pcfg.tp; ++t) {
                    ByteReader rd(blobs[base + rank_of(pcfg, 0, 0, cpr, t)]);
                    for (int i = 0; i < n; ++i) {
                        auto table = rd.get_vec<int32_t>();
                        if (t == 0)
                            tables[i][cpr] = std::move(table);
                        else
                            KVSHARD_CHECK(table == tables[i][cpr], what, " cp rank ", cpr, " tp ",
                                          t, " holds request ", i, " in other blocks than tp 0");
                    }
                }
            return tables;
        };
        Tables st, dt;
        if (cp_prefill) {
            st = side(prefill, 0, "prefill");
        } else {
            for (int i = 0; i < n; ++i) st.push_back({ptables[i]});
        }
        if (cp_decode) {
            dt = side(decode, P, "decode");
        } else {
            for (int i = 0; i < n; ++i) dt.push_back({dtables[i]});
        }
        make_plans(st, dt);
    };
    if (cp_prefill || cp_decode) share_cp_tables();
    world.barrier();
    const auto t0 = Clock::now();
    RankTimes times;
    times.start_abs = std::chrono::duration<double>(t0.time_since_epoch()).count();
    times.host = host_hash();
    ByteWriter w;

    if (is_prefill) {
        // Seals of this rank's pool, made as each layer's KV is written (below).
        std::shared_ptr<SourceChecksums> sums;
        if (share_pools && opt.source_checksums && opt.prefill_order == PageOrder::kHnd)
            sums = std::make_shared<SourceChecksums>(model.pool());
        std::vector<std::unique_ptr<TransferSender>> senders;
        double senders_at = 0;
        auto make_senders = [&]() {
            senders_at = since(t0);
            for (int i = 0; i < n; ++i) {
                TransferExecOptions o = xo;
                o.source_checksums = sums;
                if (i == opt.corrupt_request) o.faults.corrupt_message = 0;
                senders.push_back(std::make_unique<TransferSender>(
                    world, plans[i], static_cast<uint64_t>(i), me, model.pool(), o));
            }
            // Every destination's answer to the hello (direct reads or messages) before the
            // prefill starts: the first layer then leaves as soon as it is done.
            for (;;) {
                bool all = true;
                for (auto& s : senders) {
                    s->progress();
                    all &= s->connected() || s->done();
                }
                if (all) break;
                std::this_thread::yield();
            }
        };
        std::vector<float> logits;
        if (cp_prefill) {
            // One prompt after another (CpSession serves one sequence per prefill call); the
            // logits of its last token come back on every CP rank.
            make_senders();
            cp_session->set_layer_hook([&](SeqId seq, int layer) {
                if (sums) {  // this CP rank's blocks of the prompt, over the tokens it holds
                    const int i = static_cast<int>(seq);
                    int64_t held = 0;
                    for (const auto& tr : cp_token_ranges(prefill, c.cp, prompt_len[i]))
                        held += tr.size();
                    sums->seal_sequence(layer, cp_device->blocks().block_table(seq), held);
                }
                senders[static_cast<size_t>(seq)]->layer_ready(layer);
                for (auto& s : senders) s->progress();
            });
            logits.resize(static_cast<size_t>(n) * m.vocab);
            for (int i = 0; i < n; ++i) {
                const std::vector<float> lg = cp_session->prefill_reserved(static_cast<SeqId>(i));
                KVSHARD_CHECK(static_cast<int64_t>(lg.size()) == m.vocab, "CP prefill gave ",
                              lg.size(), " logits, expected ", m.vocab);
                std::copy(lg.begin(), lg.end(), logits.begin() + int64_t{i} * m.vocab);
            }
            times.prefill_end = since(t0);
            cp_session->set_layer_hook({});
        } else {
            make_senders();
            model.set_attention([&](const AttentionCall& call) {
                default_attention(call);  // writes this layer's KV, then attends
                if (sums)                 // while that KV is still in cache
                    for (int i = 0; i < n; ++i)
                        sums->seal_sequence(call.local_layer, ptables[i], prompt_len[i]);
                for (auto& s : senders) {
                    s->layer_ready(call.layer);
                    s->progress();
                }
            });
            ForwardBatch fb;
            for (int i = 0; i < n; ++i) {
                for (int64_t t = 0; t < prompt_len[i]; ++t) {
                    fb.token_ids.push_back(prompts[i][t]);
                    fb.slots.push_back(t);
                }
                fb.queries.add_sequence(prompt_len[i], 0);
                fb.kv.add_sequence(ptables[i], prompt_len[i], opt.prefill_block_size);
            }
            logits = model.forward(fb);
            times.prefill_end = since(t0);
        }
        for (auto& s : senders) s->all_layers_ready();
        // Finish every transfer before anything blocking: the decode ranks need our sends to finish
        // theirs.
        std::vector<TransferSender*> sp;
        for (auto& s : senders) sp.push_back(s.get());
        progress_until_done(sp, {});
        for (auto& s : senders) {
            const TransferResult r = s->finish();
            if (r.first_send_s >= 0) {
                const double at =
                    senders_at + r.first_send_s;  // first_send_s counts from construction
                times.first_send = times.first_send < 0 ? at : std::min(times.first_send, at);
            }
        }
        std::vector<int32_t> first(static_cast<size_t>(n), 0);
        if (me == prefill_last) {
            for (int i = 0; i < n; ++i)
                first[i] =
                    argmax({logits.data() + int64_t{i} * m.vocab, static_cast<size_t>(m.vocab)});
            std::vector<Request> reqs;
            for (int d = 0; d < D; ++d)
                reqs.push_back(
                    world.isend(std::span<const int32_t>(first), P + d, kTagFirstTokens));
            wait_all(reqs);
        }
        w.put(times);
        w.put<int32_t>(me == prefill_last ? 1 : 0);
        if (me == prefill_last) w.put_vec(logits);
        w.put<int32_t>(0);  // no per-request errors
        w.put<int32_t>(0);  // no per-request results
    } else {
        const int d = local;
        std::vector<std::unique_ptr<TransferReceiver>> receivers;
        for (int i = 0; i < n; ++i)
            receivers.push_back(std::make_unique<TransferReceiver>(
                world, plans[i], static_cast<uint64_t>(i), d, model.pool(), xo));
        std::vector<TransferReceiver*> rp;
        for (auto& r : receivers) rp.push_back(r.get());
        progress_until_done({}, rp);
        times.transfer_done = since(t0);
        std::vector<std::string> errors(static_cast<size_t>(n));
        std::vector<int32_t> failed(static_cast<size_t>(n), 0);
        for (int i = 0; i < n; ++i) {
            const TransferResult r = receivers[i]->finish();
            times.bytes += r.bytes;
            times.messages += r.messages;
            times.direct_messages += r.direct_messages;
            times.unit_checksum_messages += r.unit_checksum_messages;
            if (!r.ok()) {
                failed[i] = 1;
                errors[i] = std::string(transfer_status_name(r.status)) + ": " + r.error;
            }
        }
        receivers.clear();
        // One verdict per request for the whole decode group.
        group->all_reduce(std::span<int32_t>(failed), ReduceOp::kMax);

        std::vector<int32_t> first(static_cast<size_t>(n), 0);
        world.recv(std::span<int32_t>(first), prefill_last, kTagFirstTokens);
        std::vector<std::vector<int32_t>> out(static_cast<size_t>(n));
        std::vector<int> active;
        for (int i = 0; i < n; ++i)
            if (!failed[i]) {
                out[i].push_back(first[i]);
                active.push_back(i);
            }
        const bool last_stage = c.pp == decode.pp - 1;
        std::vector<std::vector<float>> last(static_cast<size_t>(n));  // per request, last step
        const auto td = Clock::now();
        if (cp_decode) {
            // CpSession decodes one sequence per collective step; every CP rank gets the logits.
            for (int i = 0; i < n; ++i)
                if (failed[i]) cp_session->release(static_cast<SeqId>(i));
            for (int step = 1; step < gen; ++step)
                for (int i : active) {
                    last[i] = cp_session->decode(static_cast<SeqId>(i), out[i].back());
                    out[i].push_back(argmax(last[i]));
                }
        }
        for (int step = 1; step < gen && !active.empty() && !cp_decode; ++step) {
            ForwardBatch fb;
            for (int i : active) {
                const int64_t pos = prompt_len[i] + step - 1;
                fb.token_ids.push_back(out[i].back());
                fb.slots.push_back(pos);
                fb.queries.add_sequence(1, pos);
                const int64_t blocks =
                    (pos + 1 + opt.decode_block_size - 1) / opt.decode_block_size;
                fb.kv.add_sequence(
                    std::vector<int32_t>(dtables[i].begin(), dtables[i].begin() + blocks), pos + 1,
                    opt.decode_block_size);
            }
            const std::vector<float> logits = model.forward(fb);
            std::vector<int32_t> toks(active.size(), 0);
            if (last_stage) {
                for (size_t k = 0; k < active.size(); ++k)
                    toks[k] = argmax({logits.data() + static_cast<int64_t>(k) * m.vocab,
                                      static_cast<size_t>(m.vocab)});
                for (int s = 0; s < decode.pp - 1; ++s)
                    group->send(std::span<const int32_t>(toks), rank_of(decode, 0, s, 0, c.tp),
                                kTagDecodeTokens);
            } else {
                group->recv(std::span<int32_t>(toks), rank_of(decode, 0, decode.pp - 1, 0, c.tp),
                            kTagDecodeTokens);
            }
            for (size_t k = 0; k < active.size(); ++k) {
                out[active[k]].push_back(toks[k]);
                if (last_stage)
                    last[active[k]].assign(logits.begin() + static_cast<int64_t>(k) * m.vocab,
                                           logits.begin() + static_cast<int64_t>(k + 1) * m.vocab);
            }
        }
        times.decode_seconds = since(td);
        w.put(times);
        w.put<int32_t>(0);  // no prefill logits
        w.put<int32_t>(1);
        for (int i = 0; i < n; ++i) w.put_str(errors[i]);
        const bool brings = last_stage && c.tp == 0 && c.cp == 0;
        w.put<int32_t>(brings ? 1 : 0);
        if (brings) {
            for (int i = 0; i < n; ++i) {
                w.put_vec(out[i]);
                w.put<int32_t>(failed[i]);
                w.put_vec(last[i]);  // empty when gen == 1 or the request failed
            }
        }
    }

    const auto blobs = world.all_gather_blobs(w.bytes());
    DisaggReport rep;
    rep.tokens.resize(n);
    rep.last_logits.resize(n);
    rep.errors.resize(n);
    std::vector<float> prefill_logits;
    std::vector<int32_t> failed_flags(static_cast<size_t>(n), 0);
    rep.transfer_start_s = -1;
    // One host: shift every rank's times onto the earliest start.
    const uint64_t host0 = ByteReader(blobs[0]).get<RankTimes>().host;
    double first_start = 0;
    bool one_host = true;
    for (int r = 0; r < static_cast<int>(blobs.size()); ++r) {
        const auto t = ByteReader(blobs[r]).get<RankTimes>();
        first_start = r == 0 ? t.start_abs : std::min(first_start, t.start_abs);
        one_host = one_host && t.host == host0;
    }
    for (int r = 0; r < static_cast<int>(blobs.size()); ++r) {
        ByteReader rd(blobs[r]);
        auto t = rd.get<RankTimes>();
        if (one_host) {
            const double shift = t.start_abs - first_start;
            for (double* x : {&t.prefill_end, &t.first_send, &t.transfer_done})
                if (*x >= 0) *x += shift;
        }
        if (rd.get<int32_t>()) prefill_logits = rd.get_vec<float>();
        if (rd.get<int32_t>())
            for (int i = 0; i < n; ++i) {
                std::string e = rd.get_str();
                if (!e.empty() && rep.errors[i].empty())
                    rep.errors[i] = "decode rank " + std::to_string(r - P) + ": " + e;
            }
        if (rd.get<int32_t>())
            for (int i = 0; i < n; ++i) {
                rep.tokens[i] = rd.get_vec<int32_t>();
                failed_flags[i] = rd.get<int32_t>();
                rep.last_logits[i] = rd.get_vec<float>();
            }
        rep.prefill_seconds = std::max(rep.prefill_seconds, t.prefill_end);
        if (t.first_send >= 0)
            rep.transfer_start_s = rep.transfer_start_s < 0
                                       ? t.first_send
                                       : std::min(rep.transfer_start_s, t.first_send);
        rep.transfer_end_s = std::max(rep.transfer_end_s, t.transfer_done);
        rep.decode_seconds = std::max(rep.decode_seconds, t.decode_seconds);
        rep.transfer_bytes += t.bytes;
        rep.messages += t.messages;
        rep.direct_messages += t.direct_messages;
        rep.unit_checksum_messages += t.unit_checksum_messages;
    }
    if (rep.transfer_start_s < 0) rep.transfer_start_s = rep.transfer_end_s;
    rep.transfer_seconds = std::max(0.0, rep.transfer_end_s - rep.transfer_start_s);
    rep.overlap_seconds =
        std::max(0.0, std::min(rep.prefill_seconds, rep.transfer_end_s) - rep.transfer_start_s);
    for (int i = 0; i < n; ++i) {
        if (failed_flags[i] && rep.errors[i].empty()) rep.errors[i] = "failed";
        rep.min_bytes += plans[i]->min_bytes;
        if (!rep.errors[i].empty()) ++rep.failed_requests;
        if (gen == 1 && rep.errors[i].empty() && !prefill_logits.empty())
            rep.last_logits[i].assign(prefill_logits.begin() + int64_t{i} * m.vocab,
                                      prefill_logits.begin() + int64_t{i + 1} * m.vocab);
    }
    rep.mode = std::string(transfer_mode_name(resolve_mode(*plans[0], opt.mode)));
    rep.streamed = streamed;
    return rep;
}

}  // namespace kvshard
