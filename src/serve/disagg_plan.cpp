// A disaggregated run's plans: the inputs checked, each side's blocks, and one transfer plan per
// request, the same on every rank.
#include <algorithm>
#include <deque>
#include <map>

#include "common/byte_buffer.h"
#include "kvshard/cache/block_manager.h"
#include "kvshard/common/error.h"
#include "kvshard/common/shared_arena.h"
#include "serve/disagg_run.h"

namespace kvshard::serve {

int pool_of_group(const RankModel& model, int kv_group) {
    for (int i = 0; i < model.num_pools(); ++i)
        if (model.pool_group(i) == kv_group) return i;
    return -1;
}

std::vector<RankPart> rank_parts(const DisaggPlan& plan, bool prefill_side, int replica,
                                 const RankModel& model) {
    std::vector<RankPart> out;
    for (int i = 0; i < plan.requests; ++i) {
        if (!plan.serves(prefill_side, replica, i)) continue;
        for (int p = 0; p < static_cast<int>(plan.parts[i].size()); ++p) {
            const int pool = pool_of_group(model, plan.parts[i][p].kv_group);
            if (pool >= 0) out.push_back({.request = i, .part = p, .pool = pool});
        }
    }
    return out;
}

StateAccess state_access(RankModel& model, int32_t slot) {
    KVSHARD_CHECK(slot >= 0, "state slot ", slot);
    return [&model, slot](int layer) {
        StateRef r;
        r.conv = model.state_conv(layer, slot);
        r.rec = model.state_rec(layer, slot);
        return r;
    };
}

namespace {

// Request i's replica on each side (docs/transfer.md, "Several replicas on a side").
void assign_replicas(DisaggPlan& plan, const std::vector<int64_t>& decode_len,
                     const DisaggOptions& opt) {
    const int n = plan.requests, pdp = plan.prefill.dp, ddp = plan.decode.dp;
    std::vector<int64_t> prompt_tokens(static_cast<size_t>(pdp), 0);
    std::vector<int64_t> decode_blocks(static_cast<size_t>(ddp), 0);
    for (int i = 0; i < n; ++i) {
        int p = i % pdp;
        if (opt.prefill_route == PrefillRoute::kLeastTokens)
            p = static_cast<int>(std::min_element(prompt_tokens.begin(), prompt_tokens.end()) -
                                 prompt_tokens.begin());
        prompt_tokens[size_t(p)] += plan.prompt_len[i];
        plan.prefill_replica.push_back(p);
        // Pools of one size: the most free blocks is the fewest assigned (first of equals).
        const int d = static_cast<int>(
            std::min_element(decode_blocks.begin(), decode_blocks.end()) - decode_blocks.begin());
        decode_blocks[size_t(d)] +=
            (decode_len[i] + opt.decode_block_size - 1) / opt.decode_block_size;
        plan.decode_replica.push_back(d);
    }
}

}  // namespace

DisaggPlan plan_requests(const ModelSpec& spec, const ParallelConfig& prefill,
                         const ParallelConfig& decode,
                         const std::vector<std::vector<int32_t>>& prompts, const DisaggOptions& opt,
                         int world_size) {
    opt.validate();
    DisaggPlan plan;
    plan.model = spec;
    const ModelSpec& m = plan.model;  // both sides' pools store m.kv_dtype
    require(m.kv_dtype != DType::kFp8 || opt.prefill_block_size == opt.decode_block_size,
            "--kv-dtype fp8 in a disaggregated run moves each block's codes with its per-block "
            "scales: use the same block size on both sides (--decode-block-size ",
            opt.decode_block_size, ", --block-size ", opt.prefill_block_size, ")");
    require(m.kv_dtype == DType::kFp32 || (prefill.cp == 1 && decode.cp == 1), "--kv-dtype ",
            dtype_name(m.kv_dtype),
            " with a cp > 1 side: the context-parallel executor stores fp32 KV only; use "
            "--kv-dtype fp32, or cp=1 on both sides");
    // Several replicas on a side (dp > 1) are groups of the plain executor; the CP executor
    // serves one group.
    require((prefill.cp == 1 || prefill.dp == 1) && (decode.cp == 1 || decode.dp == 1),
            "a disaggregated side with cp > 1 serves one replica: use dp=1 with cp > 1 (got "
            "--prefill ",
            prefill.to_string(), ", --decode ", decode.to_string(), ")");
    // A side with cp > 1 runs the CP executor (CpSession) on a cp x tp grid, one request after
    // another. A CP prefill side reserves every request's blocks before the start, so the plans are
    // known and each layer is sent as its ring attention finishes; a CP decode side allocates its
    // blocks when it takes the requests in (CpSession::adopt), before the transfer, and decodes
    // with merged partial attention.
    auto check_cp_side = [](const char* side, const ParallelConfig& p, PageOrder order) {
        if (p.cp == 1) return;
        require(order == PageOrder::kHnd, "a ", side, " side with cp > 1 stores HND pages: use --",
                side, "-order hnd with it");
    };
    check_cp_side("prefill", prefill, opt.prefill_order);
    check_cp_side("decode", decode, opt.decode_order);
    plan.cp_prefill = prefill.cp > 1;
    plan.cp_decode = decode.cp > 1;
    // Models of several KV groups (sliding, chunked, state layers beside full attention) move
    // each token group between the ranks' pools of that group and the state as state messages.
    if (!m.uniform()) {
        require(decode.cp == 1, m.name, " has ", m.layer_mix(),
                ": a disaggregated run with a cp > 1 decode side moves models whose every layer is "
                "full attention (or MLA) of one shape; use cp=1 on the decode side for this model "
                "(a cp > 1 prefill side works)");
        require(m.kv_dtype == DType::kFp32, m.name, " has ", m.layer_mix(),
                ": a disaggregated run moves its KV groups in fp32 only; use --kv-dtype fp32");
        require(!opt.rma_read, m.name, " has ", m.layer_mix(),
                ": RMA reads expose one pool per prefill rank, and this model keeps one per KV "
                "group; use --direct-read on (shared memory) or off (messages)");
    }
    for (int l = 0; l < m.num_layers; ++l)
        plan.has_state = plan.has_state || holds_state(m.layer(l).kind);
    plan.prefill = prefill;
    plan.decode = decode;
    plan.prefill_layout = make_layout(m, prefill);
    plan.decode_layout = make_layout(m, decode);
    const int P = prefill.world_size(), D = decode.world_size();
    plan.prefill_ranks = P;
    plan.decode_ranks = D;
    require(world_size == P + D, "the run has ", world_size, " ranks but prefill ",
            prefill.to_string(), " + decode ", decode.to_string(), " need ", P, " + ", D, " = ",
            P + D);
    require(!prompts.empty(), "give at least one prompt");
    check_prompts(prompts, m.vocab, opt.max_new_tokens);
    plan.requests = static_cast<int>(prompts.size());

    std::vector<int64_t> decode_len;
    for (const auto& p : prompts) {
        plan.prompt_len.push_back(static_cast<int64_t>(p.size()));
        decode_len.push_back(static_cast<int64_t>(p.size()) + opt.max_new_tokens);
    }
    assign_replicas(plan, decode_len, opt);
    // Each replica's requests get consecutive blocks of its pools; the pools are the size of the
    // largest replica's need.
    auto replica_tables = [&](const std::vector<int>& replica_of, int dp,
                              const std::vector<int64_t>& lengths, int block_size,
                              int64_t& blocks) {
        std::vector<std::vector<int32_t>> tables(static_cast<size_t>(plan.requests));
        blocks = 1;
        for (int r = 0; r < dp; ++r) {
            std::vector<int> mine;
            std::vector<int64_t> len;
            for (int i = 0; i < plan.requests; ++i)
                if (replica_of[i] == r) {
                    mine.push_back(i);
                    len.push_back(lengths[i]);
                }
            int64_t used = 0;
            auto t = consecutive_tables(len, block_size, used);
            for (size_t k = 0; k < mine.size(); ++k) tables[mine[k]] = std::move(t[k]);
            blocks = std::max(blocks, used);
        }
        return tables;
    };
    plan.prefill_tables = replica_tables(plan.prefill_replica, prefill.dp, plan.prompt_len,
                                         opt.prefill_block_size, plan.prefill_blocks);
    plan.decode_tables = replica_tables(plan.decode_replica, decode.dp, decode_len,
                                        opt.decode_block_size, plan.decode_blocks);
    plan.prefill_cached.assign(static_cast<size_t>(plan.requests), 0);
    plan.decode_cached.assign(static_cast<size_t>(plan.requests), 0);
    plan.decode_provider.assign(static_cast<size_t>(plan.requests), -1);
    // Prefix reuse needs every group to keep the whole prefix (a windowed group's earlier request
    // sent only its own window; a state group would need a state saved at the hit).
    plan.prefix_cache = opt.prefix_cache && !plan.cp_prefill && !plan.cp_decode && m.uniform();
    if (plan.prefix_cache) {
        // Both sides' blocks from a prefix-caching block manager per replica, in request order,
        // the same on every rank. The pools keep their sizes (what every request whole needs).
        const int pbs = opt.prefill_block_size, dbs = opt.decode_block_size;
        std::deque<BlockManager> pms, dms;  // (not movable)
        for (int r = 0; r < prefill.dp; ++r)
            pms.emplace_back(
                BlockManagerConfig{.num_blocks = plan.prefill_blocks, .block_size = pbs});
        for (int r = 0; r < decode.dp; ++r)
            dms.emplace_back(
                BlockManagerConfig{.num_blocks = plan.decode_blocks, .block_size = dbs});
        // (decode replica, decode block) -> the request that allocated it
        std::map<std::pair<int, int32_t>, int> first_holder;
        for (int i = 0; i < plan.requests; ++i) {
            const int64_t len = plan.prompt_len[i];
            BlockManager& pm = pms[size_t(plan.prefill_replica[i])];
            BlockManager& dm = dms[size_t(plan.decode_replica[i])];
            // At least the last prompt token is computed (its logits) and sent.
            const AllocResult a =
                pm.allocate(i, prompts[i], {}, vllm_max_cache_hit_blocks(len, pbs));
            const AllocResult d =
                dm.allocate(i, prompts[i], {}, vllm_max_cache_hit_blocks(len, dbs));
            dm.append_tokens(i, opt.max_new_tokens);  // room for the output, never hashed
            plan.prefill_cached[i] = a.cached_tokens;
            plan.decode_cached[i] = d.cached_tokens;
            const auto pt = pm.block_table(i), dt = dm.block_table(i);
            plan.prefill_tables[i].assign(pt.begin(), pt.end());
            plan.decode_tables[i].assign(dt.begin(), dt.end());
            for (size_t b = 0; b < dt.size(); ++b) {
                const auto [it, fresh] =
                    first_holder.emplace(std::pair(plan.decode_replica[i], dt[b]), i);
                if (!fresh && int64_t(b) * dbs < d.cached_tokens)
                    plan.decode_provider[i] = std::max(plan.decode_provider[i], it->second);
            }
        }
    }
    // Prefill pools in shareable memory where this process can make it (else messages).
    // RMA reads need no shared memory: the prefill pools stay private.
    plan.share_pools = opt.transfer.direct_read && !opt.rma_read && SharedArena::supported();
    if (!plan.cp_prefill && !plan.cp_decode) {  // the plain executors' blocks are known now
        CpTables st, dt;
        for (int i = 0; i < plan.requests; ++i) {
            st.push_back({plan.prefill_tables[i]});
            dt.push_back({plan.decode_tables[i]});
        }
        make_transfer_plans(plan, opt, st, dt);
    }
    return plan;
}

void make_transfer_plans(DisaggPlan& plan, const DisaggOptions& opt, const CpTables& src_tables,
                         const CpTables& dst_tables) {
    for (int i = 0; i < plan.requests; ++i) {
        TransferEndpoint src{.layout = plan.prefill_layout,
                             .dp = plan.prefill_replica[i],
                             .block_size = opt.prefill_block_size,
                             .order = opt.prefill_order,
                             .block_tables = src_tables[i]};
        TransferEndpoint dst{.layout = plan.decode_layout,
                             .dp = plan.decode_replica[i],
                             .block_size = opt.decode_block_size,
                             .order = opt.decode_order,
                             .block_tables = dst_tables[i]};
        plan.transfers.push_back(std::make_shared<const TransferPlan>(make_transfer_plan(
            src, dst, plan.prompt_len[i],
            {.layers_per_group = opt.stream_layers ? 1 : 0,
             .dst_cached_tokens = plan.decode_cached.empty() ? 0 : plan.decode_cached[i]})));
        const auto& full = plan.transfers.back();
        std::vector<DisaggPlan::TransferPart> parts;
        for (int k = 0; k < static_cast<int>(full->groups.size()); ++k) {
            if (full->groups[size_t(k)].holds_state()) continue;
            DisaggPlan::TransferPart part;
            part.kv_group = k;
            part.layers = full->groups[size_t(k)].layers;
            part.plan = full->executable()
                            ? full
                            : std::make_shared<const TransferPlan>(group_transfer_plan(*full, k));
            const TransferPlan& tp = *part.plan;
            part.schedule = std::make_shared<const TransferSchedule>(
                make_transfer_schedule(tp, side_pool_pages(tp, true, plan.pool_blocks(true)),
                                       side_pool_pages(tp, false, plan.pool_blocks(false)),
                                       {.mode = opt.transfer.mode,
                                        .direct_read = false,
                                        .staging_bytes = opt.transfer.staging_bytes}));
            parts.push_back(std::move(part));
        }
        plan.parts.push_back(std::move(parts));
    }
}

SideExecutor make_side_executor(const DisaggPlan& plan, const DisaggOptions& opt,
                                const TensorSource& weights,
                                const std::vector<std::vector<int32_t>>& prompts, bool is_prefill,
                                int local, Communicator& group) {
    const KvLayout& layout = is_prefill ? plan.prefill_layout : plan.decode_layout;
    const ParallelConfig& pc = is_prefill ? plan.prefill : plan.decode;
    const int block_size = is_prefill ? opt.prefill_block_size : opt.decode_block_size;
    const PoolMemory memory =
        is_prefill && plan.share_pools ? PoolMemory::kShareable : PoolMemory::kPrivate;
    SideExecutor side;
    side.coord = layout.ranks[local].coord;
    if (is_prefill ? plan.cp_prefill : plan.cp_decode) {
        CpOptions co;
        co.block_size = block_size;
        // every request whole fits; a CP rank holds a part
        co.num_blocks = plan.pool_blocks(is_prefill);
        co.prefix_cache = false;
        co.prefill_mode = opt.cp_prefill_mode;
        co.decode_merge = opt.cp_decode_merge;
        co.pool_memory = memory;
        side.cp_device = std::make_unique<CpDevice>(plan.model, pc, local, weights, co);
        side.cp_session = std::make_unique<CpSession>(*side.cp_device, group, pc, co);
        for (int i = 0; i < plan.requests; ++i) {
            if (is_prefill)
                side.cp_session->reserve(static_cast<SeqId>(i), prompts[i]);
            else
                side.cp_session->adopt(static_cast<SeqId>(i), prompts[i]);
        }
    } else {
        side.wiring = wire_rank(&group, pc, local);
        side.plain = std::make_unique<RankModel>(
            load_weights(plan.model, weight_shard(layout, local), weights),
            plan.pool_blocks(is_prefill), block_size, side.wiring.comms,
            is_prefill ? opt.prefill_order : opt.decode_order, memory);
    }
    return side;
}

void share_cp_tables(DisaggPlan& plan, const DisaggOptions& opt, SideExecutor& side,
                     Communicator& world) {
    const int n = plan.requests;
    ByteWriter tw;
    if (side.cp_session)
        for (int i = 0; i < n; ++i) {
            const auto id = static_cast<SeqId>(i);
            std::vector<int32_t> t;
            if (side.cp_device->blocks().contains(id)) {
                const auto span = side.cp_device->blocks().block_table(id);
                t.assign(span.begin(), span.end());
            }
            tw.put_vec(t);
        }
    const auto blobs = world.all_gather_blobs(tw.bytes());
    // Each CP rank's tables from its tp index 0; the other TP ranks of that CP index hold the same.
    auto cp_side = [&](const ParallelConfig& pcfg, int base, const char* what) {
        CpTables tables(static_cast<size_t>(n), std::vector<std::vector<int32_t>>(pcfg.cp));
        for (int cpr = 0; cpr < pcfg.cp; ++cpr)
            for (int t = 0; t < pcfg.tp; ++t) {
                ByteReader rd(blobs[base + rank_of(pcfg, 0, 0, cpr, t)]);
                for (int i = 0; i < n; ++i) {
                    auto table = rd.get_vec<int32_t>();
                    if (t == 0)
                        tables[i][cpr] = std::move(table);
                    else
                        KVSHARD_CHECK(table == tables[i][cpr], what, " cp rank ", cpr, " tp ", t,
                                      " holds request ", i, " in other blocks than tp 0");
                }
            }
        return tables;
    };
    auto plain_side = [&](const std::vector<std::vector<int32_t>>& tables) {
        CpTables out;
        for (int i = 0; i < n; ++i) out.push_back({tables[i]});
        return out;
    };
    const CpTables st =
        plan.cp_prefill ? cp_side(plan.prefill, 0, "prefill") : plain_side(plan.prefill_tables);
    const CpTables dt = plan.cp_decode ? cp_side(plan.decode, plan.prefill_ranks, "decode")
                                       : plain_side(plan.decode_tables);
    make_transfer_plans(plan, opt, st, dt);
}

}  // namespace kvshard::serve
