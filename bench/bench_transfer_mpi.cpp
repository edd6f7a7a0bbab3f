// KV transfer over the MPI backend next to plain MPI send/recv of the same bytes, same run.
//
//   mpirun -np P+D bench_transfer_mpi [--model llama-3.1-8b] [--from tp=2] [--to tp=1] [--tokens
//   1024]
//                                     [--reps 5] [--layers-per-message 1] [--mode auto]
//                                     [--bs-from 16] [--bs-to 16] [--order-from hnd] [--order-to
//                                     hnd] [--offload-check-bytes 1048576]
//                                     [--sender-sleep-us 0] [--direct on|off|rma]
//                                     [--source-checksums on|off]
//
// Ranks [0, P) hold the source layout, [P, P+D) the destination layout. Each repetition times
// (1) the transfer: TransferSender/TransferReceiver on every rank. With --direct on (default) the
// source pools are shareable and each destination reads them in place (one copy, XXH3 of the bytes
// read, checked against the source's: with --source-checksums on, the default, the unit checksums
// sealed when the source pools were filled, so the source makes no pass over its bytes; off, the
// XXH3 of the bytes from the source's pass); --direct off: messages (pack with XXH3 or send from
// the pool, receive, unpack verifying XXH3). (2) the ceiling: for every (source, destination) pair
// of the plan, one MPI message of exactly the
//     bytes the plan moves between them, sent with isend/irecv from/to plain buffers. (3) one-sided
// reads of the same bytes: each destination reads, for each of its pairs, the pair's bytes from
// the source's plain buffer (exposed in a window: Communicator::create_window, MPI_Win_create) in
// one MPI_Rget ("get_GBps"), and the plan's descriptors, one MPI_Rget each, from the source pools
// themselves, without the executor's protocol or checks ("get_runs_GBps").
// --direct rma: the transfer's direct reads go through a window over the source pools
// (TransferExecOptions::rma_window, rma_read.h: MPI_Rget of each descriptor, then the checksum of
// what landed), the pools private (no shared memory), so it works as it would across hosts.
// All are timed from a barrier to a barrier; the figure is the median over repetitions. Rank 0
// prints one JSON line: {"transfer_GBps", "mpi_GBps", "ratio", "get_GBps", "ratio_get", ...},
// ratio = mpi time / transfer time, ratio_get = get time / transfer time.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "kvshard/comm/mpi.h"
#include "kvshard/common/large_alloc.h"
#include "kvshard/model/catalog.h"
#include "kvshard/transfer/descriptors.h"
#include "kvshard/transfer/rma_read.h"
#include "kvshard/transfer/transfer_exec.h"

using namespace kvshard;

namespace {

struct Args {
    std::string model = "llama-3.1-8b", from = "tp=2", to = "tp=1", mode = "auto";
    int64_t tokens = 1024;
    int reps = 5;
    int layers_per_message = 1;
    int bs_from = 16, bs_to = 16;
    int64_t offload_check_bytes = TransferExecOptions{}.offload_check_bytes;
    int sender_sleep_us = TransferExecOptions{}.sender_idle_sleep_us;
    bool direct = true;
    bool rma = false;  // --direct rma
    bool source_checksums = true;
    int direct_window = TransferExecOptions{}.direct_window;
    PageOrder order_from = PageOrder::kHnd, order_to = PageOrder::kHnd;
};

PageOrder parse_order(const std::string& s) {
    if (s == "hnd") return PageOrder::kHnd;
    if (s == "nhd") return PageOrder::kNhd;
    std::fprintf(stderr, "bench_transfer_mpi: page order must be hnd or nhd, got %s\n", s.c_str());
    std::exit(2);
}

Args parse(int argc, char** argv) {
    Args a;
    for (int i = 1; i + 1 < argc; i += 2) {
        const std::string k = argv[i], v = argv[i + 1];
        if (k == "--model")
            a.model = v;
        else if (k == "--from")
            a.from = v;
        else if (k == "--to")
            a.to = v;
        else if (k == "--tokens")
            a.tokens = std::stoll(v);
        else if (k == "--reps")
            a.reps = std::stoi(v);
        else if (k == "--layers-per-message")
            a.layers_per_message = std::stoi(v);
        else if (k == "--mode")
            a.mode = v;
        else if (k == "--bs-from")
            a.bs_from = std::stoi(v);
        else if (k == "--bs-to")
            a.bs_to = std::stoi(v);
        else if (k == "--order-from")
            a.order_from = parse_order(v);
        else if (k == "--order-to")
            a.order_to = parse_order(v);
        else if (k == "--offload-check-bytes")
            a.offload_check_bytes = std::stoll(v);
        else if (k == "--sender-sleep-us")
            a.sender_sleep_us = std::stoi(v);
        else if (k == "--direct" && (v == "on" || v == "off" || v == "rma")) {
            a.direct = v != "off";
            a.rma = v == "rma";
        } else if (k == "--source-checksums" && (v == "on" || v == "off"))
            a.source_checksums = v == "on";
        else if (k == "--direct-window")
            a.direct_window = std::stoi(v);
        else {
            std::fprintf(stderr, "bench_transfer_mpi: unknown flag %s\n", k.c_str());
            std::exit(2);
        }
    }
    return a;
}

double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
    MpiSession mpi(&argc, &argv);
    const Args a = parse(argc, argv);
    auto world = mpi_world();
    const int me = world->rank();

    const ModelSpec m = catalog_model(a.model);
    auto endpoint = [&](const std::string& par, int bs, PageOrder order) {
        TransferEndpoint e;
        e.layout = make_layout(m, parse_parallel_config(par));
        e.block_size = bs;
        e.order = order;
        e.block_tables = sequential_block_tables(e.layout, e.block_size, a.tokens);
        return e;
    };
    auto plan = std::make_shared<const TransferPlan>(make_transfer_plan(
        endpoint(a.from, a.bs_from, a.order_from), endpoint(a.to, a.bs_to, a.order_to), a.tokens,
        {.layers_per_group = a.layers_per_message}));
    const int P = plan->src.layout.world_size(), D = plan->dst.layout.world_size();
    if (world->size() != P + D) {
        if (me == 0)
            std::fprintf(stderr, "bench_transfer_mpi: %s -> %s needs mpirun -np %d (%d + %d)\n",
                         a.from.c_str(), a.to.c_str(), P + D, P, D);
        return 2;
    }
    const bool src_side = me < P;
    const int local = src_side ? me : me - P;
    const TransferEndpoint& side = src_side ? plan->src : plan->dst;
    // Source pools shareable (direct read) or private (messages), as a prefill server would set
    // them.
    BlockPool pool(rank_page_geometry(side.layout, local, side.block_size, side.order),
                   (a.tokens + side.block_size - 1) / side.block_size,
                   src_side && a.direct && !a.rma ? PoolMemory::kShareable : PoolMemory::kPrivate);
    if (src_side) {
        auto ar = pool.arena();
        for (size_t i = 0; i < ar.size(); ++i) ar[i] = static_cast<std::byte>(i * 131 + me);
    }
    // The seals a prefill makes as it writes each layer (here after the fill, outside the timed
    // transfers; seal_s: their cost on this cold pool, an upper bound for a seal made while the
    // layer is still in cache).
    std::shared_ptr<SourceChecksums> sums;
    double seal_s = 0;
    if (src_side && a.direct && a.source_checksums && side.order == PageOrder::kHnd) {
        const double ts = now();
        sums = std::make_shared<SourceChecksums>(pool);
        for (int l = 0; l < pool.geometry().num_layers; ++l)
            sums->seal_sequence(l, side.block_tables[0], a.tokens);
        seal_s = now() - ts;
    }
    TransferExecOptions xo;
    xo.mode = parse_transfer_mode(a.mode);
    xo.dst_world_base = P;
    xo.staging_bytes = int64_t{256} << 20;
    xo.staging_pool = StagingPool::create();  // reused across repetitions, as a server reuses it
    xo.offload_check_bytes = a.offload_check_bytes;
    xo.sender_idle_sleep_us = a.sender_sleep_us;
    xo.direct_read = a.direct;
    xo.direct_window = a.direct_window;
    xo.arena_views = std::make_shared<SharedArenaViews>();  // kept across repetitions
    xo.source_checksums = sums;
    // A window over every source pool (collective; destinations expose nothing), kept across
    // repetitions as a server keeps it: the RMA path's, and the descriptors' plain reads.
    auto pool_window = std::make_shared<RmaPoolWindow>(*world, src_side ? &pool : nullptr);
    if (a.rma) xo.rma_window = pool_window;

    // The ceiling: one message per (src, dst) pair of the plan, of the bytes the plan moves.
    std::map<std::pair<int, int>, int64_t> pair_bytes;
    for (const auto& msg : plan->messages) pair_bytes[{msg.src_rank, msg.dst_rank}] += msg.bytes;
    // This rank's pairs, each with a buffer of the same kind of memory as the pools and staging
    // buffers (allocate_large: huge pages).
    auto mine = [&](const std::pair<int, int>& pr) {
        return src_side ? pr.first == local : pr.second == local;
    };
    // One buffer per rank holding its pairs' buffers one after the other (pair order), so that
    // one window exposes them all.
    int64_t raw_total = 0;
    std::map<std::pair<int, int>, int64_t> raw_offset;  // of the pair in its source's buffer
    std::map<int, int64_t> src_total;
    for (const auto& [pr, b] : pair_bytes) {
        raw_offset[pr] = src_total[pr.first];
        src_total[pr.first] += b;
        if (mine(pr)) raw_total += b;
    }
    LargeBuffer raw_mem = allocate_large(static_cast<size_t>(std::max<int64_t>(raw_total, 1)));
    std::map<std::pair<int, int>, std::span<std::byte>> raw_bufs;
    int64_t at = 0;
    for (const auto& [pr, b] : pair_bytes)
        if (mine(pr)) {
            const std::span<std::byte> buf(raw_mem.get() + at, static_cast<size_t>(b));
            std::fill(buf.begin(), buf.end(), std::byte{1});
            raw_bufs[pr] = buf;
            at += b;
        }
    auto raw_window = world->create_window(
        src_side ? std::span<std::byte>(raw_mem.get(), static_cast<size_t>(raw_total))
                 : std::span<std::byte>());
    // The plan's descriptors of this destination rank, per source: (source world rank, runs).
    std::map<int, std::vector<TransferDescriptor>> my_runs;
    if (!src_side) {
        const int64_t src_blocks = (a.tokens + plan->src.block_size - 1) / plan->src.block_size;
        const PoolRegion mine_region{pool_pages(pool), 0};
        for (size_t i = 0; i < plan->messages.size(); ++i) {
            const TransferMessage& msg = plan->messages[i];
            if (msg.dst_rank != local) continue;
            const PoolRegion src_region{{rank_page_geometry(plan->src.layout, msg.src_rank,
                                                            plan->src.block_size, plan->src.order),
                                         src_blocks},
                                        0};
            for (const auto& d :
                 message_descriptors(*plan, static_cast<int>(i), src_region, mine_region))
                my_runs[msg.src_rank].push_back(d);
        }
    }
    int64_t run_count = 0;
    for (const auto& [s, runs] : my_runs) run_count += static_cast<int64_t>(runs.size());
    // A plain send (source side) or receive (destination side) of `buf` to/from the pair's peer.
    auto post = [&](const std::pair<int, int>& pr, std::span<std::byte> buf, int tag) {
        return src_side ? world->isend(std::span<const std::byte>(buf), P + pr.second, tag)
                        : world->irecv(buf, pr.first, tag);
    };

    std::vector<double> t_transfer, t_mpi, t_mpi_msgs, t_get, t_get_runs;
    int direct_messages = 0;  // of the last repetition, over all destination ranks
    int unit_messages = 0;    // of those, checked by unit checksums
    int packed_messages = 0;  // of those, packed into the source's RMA pack area first
    for (int rep = 0; rep < a.reps + 1; ++rep) {  // the first round warms up
        world->barrier();
        double t0 = now();
        const uint64_t rid = static_cast<uint64_t>(rep);
        if (src_side) {
            TransferSender s(*world, plan, rid, local, pool, xo);
            s.all_layers_ready();
            TransferSender* one[] = {&s};
            progress_until_done(one, {});
            const auto r = s.finish();
            if (!r.ok()) std::fprintf(stderr, "rank %d: %s\n", me, r.error.c_str());
            if (std::getenv("KVSHARD_BENCH_VERBOSE"))
                std::fprintf(stderr, "rank %d send: %.4f s, pack+xxh3 %.4f s\n", me, r.seconds,
                             r.pack_seconds);
        } else {
            TransferReceiver r(*world, plan, rid, local, pool, xo);
            TransferReceiver* one[] = {&r};
            progress_until_done({}, one);
            const auto res = r.finish();
            if (!res.ok()) std::fprintf(stderr, "rank %d: %s\n", me, res.error.c_str());
            direct_messages = res.direct_messages;
            unit_messages = res.unit_checksum_messages;
            packed_messages = res.packed_messages;
            if (std::getenv("KVSHARD_BENCH_VERBOSE"))
                std::fprintf(stderr, "rank %d recv: %.4f s, xxh3+unpack %.4f s\n", me, res.seconds,
                             res.pack_seconds);
        }
        world->barrier();
        double t1 = now();
        if (rep > 0) t_transfer.push_back(t1 - t0);

        world->barrier();
        t0 = now();
        std::vector<Request> reqs;
        for (const auto& [pr, buf] : raw_bufs) reqs.push_back(post(pr, buf, 77));
        wait_all(reqs);
        world->barrier();
        t1 = now();
        if (rep > 0) t_mpi.push_back(t1 - t0);

        // The same bytes as the plan's messages (one MPI message each, all posted at once), from/to
        // the same plain buffers: what the message count alone costs plain MPI.
        world->barrier();
        t0 = now();
        reqs.clear();
        std::map<std::pair<int, int>, size_t> offset;
        for (const auto& msg : plan->messages) {
            const std::pair<int, int> pr{msg.src_rank, msg.dst_rank};
            if (!mine(pr)) continue;
            const auto n = static_cast<size_t>(msg.bytes);
            reqs.push_back(post(pr, raw_bufs[pr].subspan(offset[pr], n), 78));
            offset[pr] += n;
        }
        wait_all(reqs);
        world->barrier();
        t1 = now();
        if (rep > 0) t_mpi_msgs.push_back(t1 - t0);

        // One-sided: each destination reads each pair's bytes from the source's plain buffer in
        // one get, into its own plain buffer.
        world->barrier();
        t0 = now();
        reqs.clear();
        if (!src_side)
            for (const auto& [pr, buf] : raw_bufs)
                reqs.push_back(raw_window->get(buf, pr.first, raw_offset[pr]));
        wait_all(reqs);
        world->barrier();
        t1 = now();
        if (rep > 0) t_get.push_back(t1 - t0);

        // ... and the plan's descriptors, one get each, from the source pools into this pool.
        world->barrier();
        t0 = now();
        reqs.clear();
        for (const auto& [s, runs] : my_runs) {
            std::vector<std::byte*> outs;
            std::vector<int64_t> offs, sizes;
            for (const auto& d : runs) {
                outs.push_back(pool.arena().data() + d.dst_offset);
                offs.push_back(d.src_offset);
                sizes.push_back(d.bytes);
            }
            reqs.push_back(pool_window->window().get_many(outs, offs, sizes, s));
        }
        wait_all(reqs);
        world->barrier();
        t1 = now();
        if (rep > 0) t_get_runs.push_back(t1 - t0);
    }
    run_count = world->all_reduce_value<int64_t>(run_count, ReduceOp::kSum);
    direct_messages =
        static_cast<int>(world->all_reduce_value<int32_t>(direct_messages, ReduceOp::kSum));
    unit_messages =
        static_cast<int>(world->all_reduce_value<int32_t>(unit_messages, ReduceOp::kSum));
    packed_messages =
        static_cast<int>(world->all_reduce_value<int32_t>(packed_messages, ReduceOp::kSum));
    seal_s = world->all_reduce_value<double>(seal_s, ReduceOp::kMax);
    if (me == 0) {
        const double tt = median(t_transfer), tm = median(t_mpi), tg = median(t_get),
                     tr = median(t_get_runs);
        const double gb = static_cast<double>(plan->bytes) / 1e9;
        std::printf(
            "{\"model\": \"%s\", \"from\": \"%s\", \"to\": \"%s\", \"tokens\": %lld, \"messages\": "
            "%zu, "
            "\"bytes\": %lld, \"block_size\": \"%d->%d\", \"order\": \"%s->%s\", \"mode\": \"%s\", "
            "\"offload_check_bytes\": %lld, \"sender_sleep_us\": %d, \"direct\": %s, "
            "\"direct_window\": %d, \"direct_messages\": %d, \"unit_checksum_messages\": %d, "
            "\"packed_messages\": %d, "
            "\"seal_s\": %.6f, \"transfer_s\": %.6f, "
            "\"mpi_s\": %.6f, "
            "\"transfer_GBps\": %.3f, "
            "\"mpi_GBps\": %.3f, \"ratio\": %.3f, \"mpi_per_message_s\": %.6f, "
            "\"ratio_per_message\": %.3f, \"rma\": %s, \"get_s\": %.6f, \"get_GBps\": %.3f, "
            "\"ratio_get\": %.3f, \"descriptors\": %lld, \"get_runs_s\": %.6f, "
            "\"get_runs_GBps\": %.3f, \"ratio_get_runs\": %.3f}\n",
            a.model.c_str(), a.from.c_str(), a.to.c_str(), static_cast<long long>(a.tokens),
            plan->messages.size(), static_cast<long long>(plan->bytes), a.bs_from, a.bs_to,
            a.order_from == PageOrder::kHnd ? "hnd" : "nhd",
            a.order_to == PageOrder::kHnd ? "hnd" : "nhd",
            std::string(transfer_mode_name(resolve_mode(*plan, xo.mode))).c_str(),
            static_cast<long long>(a.offload_check_bytes), a.sender_sleep_us,
            a.direct ? "true" : "false", a.direct_window, direct_messages, unit_messages,
            packed_messages, seal_s, tt, tm, gb / tt, gb / tm, tm / tt, median(t_mpi_msgs),
            median(t_mpi_msgs) / tt, a.rma ? "true" : "false", tg, gb / tg, tg / tt,
            static_cast<long long>(run_count), tr, gb / tr, tr / tt);
    }
    return 0;
}
