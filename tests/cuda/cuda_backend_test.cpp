// The CUDA backend against the host implementation (GUIDE.md convention 8): every device kernel
// is run on inputs whose host result is known, and compared byte for byte (copies) or to a
// tolerance (attention, fp32 arithmetic in another order). Tests that need a GPU skip themselves
// where none is present; the argument checks run everywhere.
//
// The binary also serves as the exporting process of the CUDA IPC test (--ipc-exporter): the test
// starts itself again with that flag, so that each process has a CUDA context of its own (a
// forked child cannot use its parent's).
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kvshard/attention/merge.h"
#include "kvshard/attention/paged_attention.h"
#include "kvshard/common/error.h"
#include "kvshard/cuda/attention.h"
#include "kvshard/cuda/copy.h"
#include "kvshard/cuda/device.h"
#include "kvshard/cuda/ipc.h"
#include "kvshard/model/catalog.h"
#include "kvshard/transfer/descriptors.h"
#include "transfer/transfer_harness.h"

extern char** environ;

namespace kvshard {
namespace {

using testing::llama_mini;

#define REQUIRE_GPU()                                                            \
    do {                                                                         \
        if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device present"; \
    } while (0)

std::span<const std::byte> bytes_of(const BlockPool& p) { return p.arena(); }

// Index of the first differing byte, or -1.
int64_t first_difference(std::span<const std::byte> a, std::span<const std::byte> b) {
    if (a.size() != b.size()) return 0;
    for (size_t i = 0; i < a.size(); ++i)
        if (a[i] != b[i]) return static_cast<int64_t>(i);
    return -1;
}

// ---- copy programs ----

struct CopyCase {
    std::string name;
    ModelSpec model;
    std::string from, to;
    int bs_from = 16, bs_to = 16;
    PageOrder order_from = PageOrder::kHnd, order_to = PageOrder::kHnd;
    int64_t tokens = 100;
    uint64_t shuffle = 0;
    bool random_bytes = false;  // fill the source with random bytes (non-fp32 KV)
};

ModelSpec with_dtype(ModelSpec m, DType t) {
    m.kv_dtype = t;
    return m;
}

std::vector<CopyCase> copy_cases() {
    std::vector<CopyCase> c;
    c.push_back({"tp8_to_tp4", llama_mini(4, 8, 32), "tp=8", "tp=4"});
    c.push_back({"tp2_to_tp8", llama_mini(4, 8, 32), "tp=2", "tp=8", 16, 16, PageOrder::kHnd,
                 PageOrder::kHnd, 100, 7});
    c.push_back({"block16_to_64", llama_mini(4, 8, 32), "tp=2", "tp=2", 16, 64});
    c.push_back({"hnd_to_nhd", llama_mini(4, 8, 32), "tp=2", "tp=4", 16, 16, PageOrder::kHnd,
                 PageOrder::kNhd, 77, 3});
    c.push_back({"nhd_to_hnd", llama_mini(4, 8, 32), "tp=1", "tp=2", 16, 32, PageOrder::kNhd,
                 PageOrder::kHnd});
    c.push_back({"cp2_to_tp2", llama_mini(4, 8, 32), "cp=2", "tp=2", 16, 16, PageOrder::kHnd,
                 PageOrder::kHnd, 90});
    c.push_back({"replicated_heads_dedup", llama_mini(4, 2, 32), "tp=4", "tp=2"});
    c.push_back({"mla_latent", catalog_model("tiny-mla"), "tp=2", "tp=4", 16, 32});
    c.push_back({"pp2_to_tp2", llama_mini(4, 8, 32), "pp=2", "tp=2"});
    // 12-byte vectors: the 4-byte path; bf16 head_dim 3 (6 bytes): the single-byte path.
    c.push_back({"unaligned_fp32", llama_mini(2, 8, 3), "tp=2", "tp=4", 16, 16, PageOrder::kHnd,
                 PageOrder::kNhd});
    c.push_back({"unaligned_bf16", with_dtype(llama_mini(2, 8, 3), DType::kBf16), "tp=4", "tp=1",
                 16, 16, PageOrder::kNhd, PageOrder::kHnd, 100, 0, true});
    c.push_back({"bf16_tp8_to_tp4_nhd", with_dtype(llama_mini(4, 8, 64), DType::kBf16), "tp=8",
                 "tp=4", 16, 16, PageOrder::kHnd, PageOrder::kNhd, 300, 5, true});
    return c;
}

struct CopyParam {
    CopyCase c;
    TransferMode mode;
};

std::string copy_name(const ::testing::TestParamInfo<CopyParam>& info) {
    return info.param.c.name +
           (info.param.mode == TransferMode::kPreSend ? "_presend" : "_postrecv");
}

std::vector<CopyParam> copy_params() {
    std::vector<CopyParam> out;
    for (const auto& c : copy_cases())
        for (TransferMode m : {TransferMode::kPreSend, TransferMode::kPostReceive})
            out.push_back({c, m});
    return out;
}

class DeviceCopy : public ::testing::TestWithParam<CopyParam> {};

testing::Side make_random_source(const TransferEndpoint& e, uint64_t seed) {
    testing::Side s;
    s.endpoint = e;
    s.pools.resize(e.layout.world_size());
    std::mt19937_64 rng(seed);
    for (const auto& r : e.layout.ranks) {
        if (r.coord.dp != e.dp) continue;
        auto pool = std::make_unique<BlockPool>(
            rank_page_geometry(e.layout, r.coord.rank, e.block_size, e.order),
            testing::pool_blocks(e));
        for (std::byte& b : pool->arena()) b = static_cast<std::byte>(rng());
        s.pools[r.coord.rank] = std::move(pool);
    }
    return s;
}

TEST_P(DeviceCopy, PackUnpackAndDirectEqualTheHostBytes) {
    REQUIRE_GPU();
    const CopyCase& c = GetParam().c;
    const auto src_e =
        testing::make_endpoint(c.model, c.from, c.bs_from, c.order_from, c.tokens, 0, c.shuffle);
    const auto dst_e = testing::make_endpoint(c.model, c.to, c.bs_to, c.order_to, c.tokens, 0,
                                              c.shuffle ? c.shuffle + 1 : 0);
    const TransferPlan plan = make_transfer_plan(src_e, dst_e, c.tokens);
    ASSERT_TRUE(plan.executable());
    const TransferMode mode = GetParam().mode;
    const testing::Side src =
        c.random_bytes ? make_random_source(src_e, 42) : testing::make_source(src_e, c.tokens);
    testing::Side host_dst = testing::make_destination(dst_e);
    testing::run_plan(plan, mode, src, host_dst);
    const int64_t src_blocks = testing::pool_blocks(src_e),
                  dst_blocks = testing::pool_blocks(dst_e);

    // Device pools: the sources as on the host, the destinations at the sentinel (twice: one
    // through pack + unpack, one through the direct pool-to-pool program).
    std::vector<std::unique_ptr<cuda::DevicePool>> dsrc(src.pools.size()), dunpack, ddirect;
    for (size_t r = 0; r < src.pools.size(); ++r) {
        if (!src.pools[r]) continue;
        dsrc[r] = std::make_unique<cuda::DevicePool>(src.pools[r]->geometry(), src_blocks);
        dsrc[r]->upload(bytes_of(*src.pools[r]));
    }
    const testing::Side fresh = testing::make_destination(dst_e);
    dunpack.resize(fresh.pools.size());
    ddirect.resize(fresh.pools.size());
    for (size_t r = 0; r < fresh.pools.size(); ++r) {
        if (!fresh.pools[r]) continue;
        for (auto* v : {&dunpack, &ddirect}) {
            (*v)[r] = std::make_unique<cuda::DevicePool>(fresh.pools[r]->geometry(), dst_blocks);
            (*v)[r]->upload(bytes_of(*fresh.pools[r]));
        }
    }

    for (size_t i = 0; i < plan.messages.size(); ++i) {
        const TransferMessage& msg = plan.messages[i];
        const BlockPool& sp = *src.pools.at(msg.src_rank);
        const PageGeometry dg = fresh.pools.at(msg.dst_rank)->geometry();
        std::vector<std::byte> want(static_cast<size_t>(msg.bytes));
        pack_message(plan, msg, mode, sp, want);

        const cuda::DeviceCopyProgram pack(cuda::pack_entries(
            message_copy_runs(plan, msg, mode, true, sp.geometry(), src_blocks)));
        const cuda::DeviceCopyProgram unpack(
            cuda::unpack_entries(message_copy_runs(plan, msg, mode, false, dg, dst_blocks)));
        EXPECT_EQ(pack.bytes(), msg.bytes);
        EXPECT_EQ(unpack.bytes(), msg.bytes);
        cuda::DeviceBuffer staging(msg.bytes);
        staging.fill(0x5a);
        pack.run(*dsrc[msg.src_rank], staging);  // the checked forms: extents against sizes
        unpack.run(staging, *dunpack[msg.dst_rank]);
        cuda::synchronize();
        std::vector<std::byte> got(static_cast<size_t>(msg.bytes));
        staging.download(got);
        EXPECT_EQ(first_difference(got, want), -1) << "payload of message " << i;

        const PoolRegion sr{{sp.geometry(), src_blocks}, 0}, dr{{dg, dst_blocks}, 0};
        const cuda::DeviceCopyProgram direct(
            cuda::direct_entries(message_descriptors(plan, static_cast<int>(i), sr, dr)));
        EXPECT_EQ(direct.bytes(), msg.bytes);
        direct.run(*dsrc[msg.src_rank], *ddirect[msg.dst_rank]);
    }
    cuda::synchronize();
    for (size_t r = 0; r < host_dst.pools.size(); ++r) {
        if (!host_dst.pools[r]) continue;
        std::vector<std::byte> got(static_cast<size_t>(dunpack[r]->arena_bytes()));
        dunpack[r]->download(got);
        EXPECT_EQ(first_difference(got, bytes_of(*host_dst.pools[r])), -1)
            << "unpacked destination rank " << r;
        ddirect[r]->download(got);
        EXPECT_EQ(first_difference(got, bytes_of(*host_dst.pools[r])), -1)
            << "direct-read destination rank " << r;
        if (!c.random_bytes) {  // and the coordinates themselves, not only the host's bytes
            const auto want =
                testing::expected_pool(dst_e, static_cast<int>(r), c.tokens, *host_dst.pools[r]);
            EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size()), 0) << "rank " << r;
        }
    }
}

INSTANTIATE_TEST_SUITE_P(Grid, DeviceCopy, ::testing::ValuesIn(copy_params()), copy_name);

// One launch for all of a source rank's messages (each payload at its offset in one staging
// buffer) gives the same payloads as one launch per message.
TEST(DeviceCopyBatch, OneLaunchForEveryMessageOfASourceRank) {
    REQUIRE_GPU();
    const ModelSpec m = llama_mini(4, 8, 32);
    const auto src_e = testing::make_endpoint(m, "tp=2", 16, PageOrder::kHnd, 200);
    const auto dst_e = testing::make_endpoint(m, "tp=8", 16, PageOrder::kNhd, 200);
    const TransferPlan plan = make_transfer_plan(src_e, dst_e, 200);
    const testing::Side src = testing::make_source(src_e, 200);
    const int64_t blocks = testing::pool_blocks(src_e);
    const BlockPool& sp = *src.pools[0];
    std::vector<cuda::CopyEntry> all;
    std::vector<std::byte> want;
    for (int i : plan.messages_from(0)) {
        const TransferMessage& msg = plan.messages[static_cast<size_t>(i)];
        const auto e = cuda::pack_entries(
            message_copy_runs(plan, msg, TransferMode::kPreSend, true, sp.geometry(), blocks));
        cuda::append_entries(all, e, 0, static_cast<int64_t>(want.size()));
        std::vector<std::byte> one(static_cast<size_t>(msg.bytes));
        pack_message(plan, msg, TransferMode::kPreSend, sp, one);
        want.insert(want.end(), one.begin(), one.end());
    }
    ASSERT_GT(plan.messages_from(0).size(), 1u);
    cuda::DevicePool dp(sp.geometry(), blocks);
    dp.upload(bytes_of(sp));
    const cuda::DeviceCopyProgram prog(all);
    EXPECT_EQ(prog.dst_extent(), static_cast<int64_t>(want.size()));
    cuda::DeviceBuffer staging(static_cast<int64_t>(want.size()));
    prog.run(dp.data(), staging.data());
    // A payload buffer one byte short is refused before anything is queued.
    cuda::DeviceBuffer short_by_one(static_cast<int64_t>(want.size()) - 1);
    EXPECT_THROW(prog.run(dp, short_by_one), Error);
    std::vector<std::byte> got(want.size());
    staging.download(got);
    EXPECT_EQ(first_difference(got, want), -1);
}

// ---- entries (pure, no device) ----

TEST(CopyEntries, LongRunsAndLongStridesAreSplitAtTheEntryLimit) {
    const std::vector<CopyRun> runs = {
        {0, 0, 1000, 0, 3 * cuda::kMaxEntryBytes + 16, 1},  // one long run
        {0, 4096, 0, 256, 256, 1000},                       // 1000 strided vectors
    };
    const auto e = cuda::pack_entries(runs);
    int64_t bytes = 0;
    for (const auto& x : e) {
        EXPECT_LE(x.len * x.count, cuda::kMaxEntryBytes);
        bytes += x.len * x.count;
    }
    EXPECT_EQ(bytes, runs[0].bytes() + runs[1].bytes());
    ASSERT_EQ(e.size(), 4u + 4u);  // 3 full pieces + 16 bytes; 1000 vectors in groups of 256
    EXPECT_EQ(e[3].src, 3 * cuda::kMaxEntryBytes);
    EXPECT_EQ(e[3].dst, 1000 + 3 * cuda::kMaxEntryBytes);
    EXPECT_EQ(e[3].len, 16);
    EXPECT_EQ(e[5].src, 256 * 4096);  // the second group of the strided run
    EXPECT_EQ(e[5].dst, 256 * 256);
    EXPECT_EQ(e[7].count, 1000 - 3 * 256);
    const auto u = cuda::unpack_entries(runs);
    EXPECT_EQ(u[5].src, 256 * 256);  // unpack reads the wire
    EXPECT_EQ(u[5].dst, 256 * 4096);
}

TEST(CopyEntries, DirectDescriptorsAtConstantStepsBecomeOneStridedEntry) {
    std::vector<TransferDescriptor> d;
    for (int i = 0; i < 16; ++i) d.push_back({0, 0, 0, 256 * i, 2048 * i, 256});  // one head
    d.push_back({0, 0, 0, 100000, 50, 256});  // a break in the pattern
    d.push_back({0, 0, 0, 200000, 70, 64});
    const auto e = cuda::direct_entries(d);
    ASSERT_EQ(e.size(), 3u);
    EXPECT_EQ(e[0], (cuda::CopyEntry{0, 256, 0, 2048, 256, 16}));
    EXPECT_EQ(e[1], (cuda::CopyEntry{100000, 0, 50, 0, 256, 1}));
    EXPECT_EQ(e[2], (cuda::CopyEntry{200000, 0, 70, 0, 64, 1}));
}

TEST(CopyEntries, TheBufferCheckNamesWhatIsWrong) {
    std::vector<std::byte> a(1000), b(1000);
    const cuda::CopyExtents x{50, 100, 200};
    EXPECT_EQ(cuda::copy_buffers_error(x, a.data(), 100, b.data(), 200), "");
    EXPECT_NE(cuda::copy_buffers_error(x, a.data(), 99, b.data(), 200)
                  .find("reads 100 bytes of its source but the source buffer has 99"),
              std::string::npos);
    EXPECT_NE(cuda::copy_buffers_error(x, a.data(), 100, b.data(), 199).find("destination buffer"),
              std::string::npos);
    EXPECT_NE(cuda::copy_buffers_error(x, a.data(), 1000, a.data() + 500, 500).find("overlap"),
              std::string::npos);
    EXPECT_EQ(cuda::copy_buffers_error(x, a.data(), 500, a.data() + 500, 500), "");  // adjacent
    // The extents are those the entries reach: 3 vectors of 256 bytes 4096 apart from 0 (read)
    // to 16, 272, 528 (written), and 6 bytes at 10 -> 0.
    const std::vector<cuda::CopyEntry> e = {{0, 4096, 16, 256, 256, 3}, {10, 0, 0, 0, 6, 1}};
    EXPECT_EQ(cuda::copy_extents(e), (cuda::CopyExtents{3 * 256 + 6, 2 * 4096 + 256, 784}));
    const std::vector<cuda::CopyEntry> negative = {{-1, 0, 0, 0, 16, 1}};
    EXPECT_THROW(cuda::copy_extents(negative), Error);
    // Fields whose products would wrap around int64 are refused, not wrapped.
    const int64_t big = int64_t{1} << 62;
    const std::vector<cuda::CopyEntry> wraps_len = {{0, 0, 0, 0, big, 4}};
    EXPECT_THROW(cuda::copy_extents(wraps_len), Error);
    const std::vector<cuda::CopyEntry> wraps_step = {{0, big, 0, 16, 16, 4}};
    EXPECT_THROW(cuda::copy_extents(wraps_step), Error);
}

TEST(CopyEntries, AProgramRefusesAnEntryOverTheLimit) {
    const std::vector<cuda::CopyEntry> e = {{0, 0, 0, 0, cuda::kMaxEntryBytes + 1, 1}};
    EXPECT_THROW(cuda::copy_extents(e), Error);
    EXPECT_THROW(cuda::DeviceCopyProgram{e}, Error);  // refused before any device call
}

// ---- decode attention ----

struct DecodeCase {
    DType dtype;
    int head_dim;
    int group;
    PageOrder order;
    int chunk;  // 0: chosen by the plan
};

std::string decode_name(const ::testing::TestParamInfo<DecodeCase>& info) {
    const auto& c = info.param;
    return std::string(dtype_name(c.dtype)) + "_d" + std::to_string(c.head_dim) + "_g" +
           std::to_string(c.group) + (c.order == PageOrder::kHnd ? "_hnd" : "_nhd") + "_chunk" +
           std::to_string(c.chunk);
}

std::vector<DecodeCase> decode_cases() {
    std::vector<DecodeCase> out;
    for (DType t : {DType::kFp32, DType::kBf16, DType::kFp16})
        for (int d : {64, 128, 256})
            for (int g : {1, 2, 3, 4, 8, 16}) {
                if (t == DType::kFp32 && (g == 3 || g == 16)) continue;  // fp32: 1, 2, 4, 8
                for (PageOrder o : {PageOrder::kHnd, PageOrder::kNhd})
                    out.push_back({t, d, g, o, (g + d) % 3 == 0 ? 0 : 64});
            }
    return out;
}

class DeviceDecodeTest : public ::testing::TestWithParam<DecodeCase> {};

TEST_P(DeviceDecodeTest, MatchesTheHostPagedAttentionAndItsLse) {
    REQUIRE_GPU();
    const DecodeCase c = GetParam();
    const int kv_heads = 2;
    PageGeometry g;
    g.num_layers = 2;
    g.kv_factor = 2;
    g.num_heads = kv_heads;
    g.block_size = 16;
    g.head_dim = c.head_dim;
    g.dtype = c.dtype;
    g.order = c.order;
    const std::vector<int64_t> lens = {1, 17, 300, 1000, 64};
    int64_t blocks_needed = 0;
    for (int64_t n : lens) blocks_needed += (n + 15) / 16;
    const int64_t num_blocks = blocks_needed * 2 + 3;
    BlockPool pool(g, num_blocks);
    std::mt19937_64 rng(c.head_dim * 31 + c.group);
    std::vector<int32_t> ids(static_cast<size_t>(num_blocks));
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i);
    std::shuffle(ids.begin(), ids.end(), rng);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    PagedKv kv;
    QueryBatch qb;
    size_t next = 0;
    std::vector<float> x(static_cast<size_t>(c.head_dim));
    for (int64_t n : lens) {
        std::vector<int32_t> table;
        for (int64_t b = 0; b < (n + 15) / 16; ++b) table.push_back(ids[next++]);
        for (int layer = 0; layer < g.num_layers; ++layer)
            for (int64_t t = 0; t < n; ++t)
                for (int kvi = 0; kvi < 2; ++kvi)
                    for (int h = 0; h < kv_heads; ++h) {
                        for (float& v : x) v = nd(rng);
                        store_vector(pool, layer, kvi, table[static_cast<size_t>(t / 16)], h,
                                     static_cast<int>(t % 16), x.data());
                    }
        kv.add_sequence(table, n, 16);
        qb.add_sequence(1, n - 1);
    }
    AttentionParams p;
    p.num_q_heads = kv_heads * c.group;
    p.num_kv_heads = kv_heads;
    p.head_dim = c.head_dim;
    p.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    const int batch = static_cast<int>(lens.size());
    std::vector<float> q(static_cast<size_t>(batch) * p.num_q_heads * c.head_dim);
    for (float& v : q) v = nd(rng);
    const int layer = 1;
    std::vector<float> want_out(q.size()), want_lse(static_cast<size_t>(batch) * p.num_q_heads);
    paged_attention(pool, layer, kv, qb, p, q.data(), want_out.data(), want_lse.data());

    cuda::DevicePool dpool(g, num_blocks);
    dpool.upload(bytes_of(pool));
    cuda::DeviceDecode plan(kv, g, num_blocks, {p.num_q_heads, p.num_kv_heads, p.head_dim, p.scale},
                            c.chunk);
    if (c.chunk == 64) {
        EXPECT_GE(plan.work_items(), 1 + 1 + 5 + 16 + 1);
    }
    cuda::DeviceBuffer dq(static_cast<int64_t>(q.size() * 4)), dout(dq.size()),
        dlse(static_cast<int64_t>(want_lse.size() * 4));
    dq.upload(std::as_bytes(std::span<const float>(q)));
    plan.run(dpool, layer, reinterpret_cast<const float*>(dq.data()),
             reinterpret_cast<float*>(dout.data()), reinterpret_cast<float*>(dlse.data()));
    cuda::synchronize();
    std::vector<float> out(q.size()), lse(want_lse.size());
    dout.download(std::as_writable_bytes(std::span<float>(out)));
    dlse.download(std::as_writable_bytes(std::span<float>(lse)));
    double worst_out = 0, worst_lse = 0;
    for (size_t i = 0; i < out.size(); ++i)
        worst_out = std::max(worst_out, std::fabs(static_cast<double>(out[i]) - want_out[i]));
    for (size_t i = 0; i < lse.size(); ++i)
        worst_lse = std::max(worst_lse, std::fabs(static_cast<double>(lse[i]) - want_lse[i]));
    EXPECT_LT(worst_out, 2e-4) << "largest |out - host out|";
    EXPECT_LT(worst_lse, 2e-4) << "largest |lse - host lse|";
}

INSTANTIATE_TEST_SUITE_P(Grid, DeviceDecodeTest, ::testing::ValuesIn(decode_cases()), decode_name);

TEST(DeviceDecodePlan, AnEmptySequenceHasLseMinusInfinityAndOutputZero) {
    REQUIRE_GPU();
    PageGeometry g;
    g.num_layers = 1;
    g.num_heads = 1;
    g.block_size = 16;
    g.head_dim = 64;
    g.dtype = DType::kBf16;
    BlockPool pool(g, 4);
    std::vector<float> x(64, 0.5f);
    for (int t = 0; t < 5; ++t)
        for (int kvi = 0; kvi < 2; ++kvi) store_vector(pool, 0, kvi, 2, 0, t, x.data());
    PagedKv kv;
    kv.add_sequence({}, 0, 16);
    kv.add_sequence({2}, 5, 16);
    cuda::DevicePool dpool(g, 4);
    dpool.upload(bytes_of(pool));
    cuda::DeviceDecode plan(kv, g, 4, {1, 1, 64, 0.125f});
    std::vector<float> q(2 * 64, 1.0f), out(2 * 64, 7.0f), lse(2, 7.0f);
    cuda::DeviceBuffer dq(512), dout(512), dlse(8);
    dq.upload(std::as_bytes(std::span<const float>(q)));
    plan.run(dpool, 0, reinterpret_cast<const float*>(dq.data()),
             reinterpret_cast<float*>(dout.data()), reinterpret_cast<float*>(dlse.data()));
    dout.download(std::as_writable_bytes(std::span<float>(out)));
    dlse.download(std::as_writable_bytes(std::span<float>(lse)));
    EXPECT_TRUE(std::isinf(lse[0]) && lse[0] < 0);
    for (int d = 0; d < 64; ++d) EXPECT_EQ(out[static_cast<size_t>(d)], 0.0f);
    // Five equal keys: the output is the value, the LSE log(5) + the score.
    EXPECT_NEAR(lse[1], std::log(5.0f) + 64 * 0.5f * 0.125f, 1e-4);
    for (int d = 0; d < 64; ++d) EXPECT_NEAR(out[64 + static_cast<size_t>(d)], 0.5f, 1e-6);
}

TEST(DeviceDecodePlan, ABatchTheKernelsCouldReadPastIsRefused) {
    PagedKv kv;
    kv.add_sequence({0, 1}, 20, 16);
    kv.add_sequence({2}, 3, 16);
    EXPECT_EQ(cuda::paged_kv_error(kv, 16, 3), "");
    EXPECT_NE(cuda::paged_kv_error(kv, 16, 2).find("block 2 (index 2"), std::string::npos);
    PagedKv decreasing = kv;
    decreasing.indptr = {0, 3, 2};
    decreasing.indices = {0, 1};
    EXPECT_NE(cuda::paged_kv_error(decreasing, 16, 3).find("decreases at sequence"),
              std::string::npos);
    PagedKv long_page = kv;
    long_page.last_page_len[1] = 17;
    EXPECT_NE(cuda::paged_kv_error(long_page, 16, 3).find("last_page_len 17"), std::string::npos);
    PagedKv empty_page = kv;
    empty_page.last_page_len[0] = 0;
    EXPECT_NE(cuda::paged_kv_error(empty_page, 16, 3), "");
    PagedKv short_indptr = kv;
    short_indptr.indptr.pop_back();
    short_indptr.last_page_len.pop_back();
    EXPECT_NE(cuda::paged_kv_error(short_indptr, 16, 3).find("indptr"), std::string::npos);
    // The plan refuses it before any device call.
    PageGeometry g;
    g.num_heads = 1;
    g.head_dim = 64;
    g.dtype = DType::kBf16;
    EXPECT_THROW(cuda::DeviceDecode(long_page, g, 3, {1, 1, 64, 0.125f}), Error);
}

TEST(DeviceDecodePlan, RefusesWhatNoKernelCovers) {
    PageGeometry g;
    g.num_heads = 2;
    g.head_dim = 96;
    g.dtype = DType::kBf16;
    PagedKv kv;
    kv.add_sequence({0}, 3, 16);
    EXPECT_NE(cuda::decode_support_error(g, {4, 2, 96, 1.0f}).find("head_dim 64, 128 or 256"),
              std::string::npos);
    EXPECT_NE(cuda::decode_support_error(g, {4, 2, 96, 1.0f}).find("got head_dim 96"),
              std::string::npos);
    EXPECT_THROW(cuda::DeviceDecode(kv, g, 1, {4, 2, 96, 1.0f}), Error);
    g.head_dim = 128;
    EXPECT_EQ(cuda::decode_support_error(g, {4, 2, 128, 1.0f}), "");
    EXPECT_EQ(cuda::decode_support_error(g, {32, 2, 128, 1.0f}), "");  // 16 per KV head: bf16
    EXPECT_NE(cuda::decode_support_error(g, {64, 2, 128, 1.0f}), "");  // 32 per KV head
    g.dtype = DType::kFp32;
    EXPECT_NE(cuda::decode_support_error(g, {32, 2, 128, 1.0f}), "");  // fp32: at most 8
    EXPECT_NE(cuda::decode_support_error(g, {6, 2, 128, 1.0f}), "");   // fp32: 3 is not covered
    g.dtype = DType::kBf16;
    EXPECT_NE(cuda::decode_support_error(g, {6, 4, 128, 1.0f}), "");  // not the pool's heads
    g.dtype = DType::kFp8;
    EXPECT_NE(cuda::decode_support_error(g, {4, 2, 128, 1.0f}).find("fp8"), std::string::npos);
}

// ---- LSE merge ----

TEST(DeviceMerge, MatchesTheHostMergeWithEmptyShards) {
    REQUIRE_GPU();
    const int n = 5, rows = 37, dim = 72;
    std::mt19937_64 rng(3);
    std::normal_distribution<float> nd(0.0f, 3.0f);
    std::vector<std::vector<float>> outs(n, std::vector<float>(rows * dim)),
        lses(n, std::vector<float>(rows));
    for (int k = 0; k < n; ++k) {
        for (float& v : outs[k]) v = nd(rng);
        for (int r = 0; r < rows; ++r) {
            const bool empty = (r + k) % 4 == 0 || r == 5;  // row 5: every shard empty
            lses[k][r] = empty ? -INFINITY : nd(rng);
            if (empty) outs[k][r * dim] = NAN;  // never read
        }
    }
    std::vector<const float*> ho, hl;
    for (int k = 0; k < n; ++k) {
        ho.push_back(outs[k].data());
        hl.push_back(lses[k].data());
    }
    std::vector<float> want(rows * dim), want_lse(rows);
    merge_attention(ho, hl, rows, dim, want.data(), want_lse.data());

    std::vector<cuda::DeviceBuffer> dbufs;
    std::vector<const float*> dout, dlse;
    for (int k = 0; k < n; ++k) {
        dbufs.emplace_back(rows * dim * 4);
        dbufs.back().upload(std::as_bytes(std::span<const float>(outs[k])));
        dout.push_back(reinterpret_cast<const float*>(dbufs.back().data()));
        dbufs.emplace_back(rows * 4);
        dbufs.back().upload(std::as_bytes(std::span<const float>(lses[k])));
        dlse.push_back(reinterpret_cast<const float*>(dbufs.back().data()));
    }
    cuda::DeviceBuffer o(rows * dim * 4), l(rows * 4);
    cuda::merge_attention(dout, dlse, rows, dim, reinterpret_cast<float*>(o.data()),
                          reinterpret_cast<float*>(l.data()));
    std::vector<float> got(rows * dim), got_lse(rows);
    o.download(std::as_writable_bytes(std::span<float>(got)));
    l.download(std::as_writable_bytes(std::span<float>(got_lse)));
    for (int r = 0; r < rows; ++r) {
        if (std::isinf(want_lse[r])) {
            EXPECT_TRUE(std::isinf(got_lse[r]) && got_lse[r] < 0) << "row " << r;
        } else {
            EXPECT_NEAR(got_lse[r], want_lse[r], 1e-5) << "row " << r;
        }
        for (int d = 0; d < dim; ++d)
            ASSERT_NEAR(got[r * dim + d], want[r * dim + d], 1e-5) << "row " << r << " dim " << d;
    }
    EXPECT_EQ(got[5 * dim], 0.0f);  // every shard empty: 0, not NaN
}

TEST(DeviceMerge, RefusesNoPartialsAndMismatchedLists) {
    const float* one[] = {nullptr};
    EXPECT_THROW(cuda::merge_attention({}, {}, 1, 1, nullptr, nullptr), Error);
    EXPECT_THROW(cuda::merge_attention(one, {}, 1, 1, nullptr, nullptr), Error);
}

// ---- CUDA IPC: a decode process reads a prefill process's pool in place ----

// The IPC case: TP=2 (prefill, rank 0 exported) -> TP=1 (decode), 120 tokens of llama-mini.
struct IpcCase {
    ModelSpec model = llama_mini(4, 8, 32);
    TransferEndpoint src = testing::make_endpoint(model, "tp=2", 16, PageOrder::kHnd, 120);
    TransferEndpoint dst = testing::make_endpoint(model, "tp=1", 16, PageOrder::kNhd, 120);
    TransferPlan plan = make_transfer_plan(src, dst, 120);
};

// The exporting process: its rank-0 pool on the device, the handle written to `out_fd`, then it
// waits for a byte on `in_fd` (the reader is done) before freeing the pool.
int run_ipc_exporter(int in_fd, int out_fd) {
    const IpcCase c;
    const testing::Side src = testing::make_source(c.src, 120);
    cuda::DevicePool pool(src.pools[0]->geometry(), testing::pool_blocks(c.src));
    pool.upload(bytes_of(*src.pools[0]));
    cuda::synchronize();
    const cuda::IpcHandle h = cuda::export_memory(pool);
    if (write(out_fd, &h, sizeof h) != static_cast<ssize_t>(sizeof h)) return 3;
    char done = 0;
    if (read(in_fd, &done, 1) != 1) return 4;
    return 0;
}

TEST(DeviceIpc, ADecodeProcessReadsAPrefillProcessPoolInPlace) {
    REQUIRE_GPU();
    int to_child[2], from_child[2];
    ASSERT_EQ(pipe(to_child), 0);
    ASSERT_EQ(pipe(from_child), 0);
    const std::string in = std::to_string(to_child[0]), out = std::to_string(from_child[1]);
    std::string self = "/proc/self/exe", flag = "--ipc-exporter";
    char* argv[] = {self.data(), flag.data(), const_cast<char*>(in.c_str()),
                    const_cast<char*>(out.c_str()), nullptr};
    pid_t pid = 0;
    ASSERT_EQ(posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv, environ), 0);
    close(to_child[0]);
    close(from_child[1]);
    cuda::IpcHandle h;
    ASSERT_EQ(read(from_child[0], &h, sizeof h), static_cast<ssize_t>(sizeof h));

    const IpcCase c;
    const testing::Side host_src = testing::make_source(c.src, 120);
    testing::Side host_dst = testing::make_destination(c.dst);
    std::vector<int> from0 = c.plan.messages_from(0);
    ASSERT_FALSE(from0.empty());
    {
        const cuda::ImportedMemory remote(h);
        EXPECT_EQ(remote.size(), static_cast<int64_t>(host_src.pools[0]->arena().size()));
        const BlockPool& dp = *host_dst.pools[0];
        cuda::DevicePool mine(dp.geometry(), dp.num_blocks());
        mine.upload(bytes_of(dp));
        const PoolRegion sr{{host_src.pools[0]->geometry(), testing::pool_blocks(c.src)}, 0};
        const PoolRegion dr{{dp.geometry(), dp.num_blocks()}, 0};
        for (int i : from0) {
            const cuda::DeviceCopyProgram prog(
                cuda::direct_entries(message_descriptors(c.plan, i, sr, dr)));
            prog.run(remote.data(), mine.data());
        }
        cuda::synchronize();
        // The host does the same: rank 0's messages, packed and unpacked.
        for (int i : from0) {
            const TransferMessage& msg = c.plan.messages[static_cast<size_t>(i)];
            std::vector<std::byte> buf(static_cast<size_t>(msg.bytes));
            pack_message(c.plan, msg, TransferMode::kPreSend, *host_src.pools[0], buf);
            unpack_message(c.plan, msg, TransferMode::kPreSend, buf, *host_dst.pools[0]);
        }
        std::vector<std::byte> got(static_cast<size_t>(mine.arena_bytes()));
        mine.download(got);
        EXPECT_EQ(first_difference(got, bytes_of(*host_dst.pools[0])), -1);
    }
    const char done = 1;
    EXPECT_EQ(write(to_child[1], &done, 1), 1);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "exporter status " << status;
}

}  // namespace
}  // namespace kvshard

int main(int argc, char** argv) {
    if (argc == 4 && std::string(argv[1]) == "--ipc-exporter") {
        try {
            return kvshard::run_ipc_exporter(std::stoi(argv[2]), std::stoi(argv[3]));
        } catch (const std::exception& e) {
            std::fprintf(stderr, "ipc exporter: %s\n", e.what());
            return 2;
        }
    }
    ::testing::InitGoogleTest(&argc, argv);
    return RUN_ALL_TESTS();
}
