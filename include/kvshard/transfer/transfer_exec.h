#pragma once
// Carrying out a TransferPlan over a Communicator (docs/transfer.md, "Execution" and "Wire
// format").
//
// Both groups live in one communicator `world`: source layout rank r is world rank
// src_world_base + r, destination layout rank r is world rank dst_world_base + r (threads: one
// run_threads over P + D ranks; MPI: `mpirun -np P prog : -np D prog`, MPI_COMM_WORLD).
//
// Each source rank drives a TransferSender, each destination rank a TransferReceiver, one pair of
// objects per request. Both are poll-driven (progress() never blocks), so one thread can move many
// requests at once; finish() polls until done. Per request and (source, destination) pair, the
// source first sends a hello (which says whether its pool can be read in place) and the
// destination replies whether it will; then the messages go in layer-group order on the request's
// own tags. The sender sends a message as soon as all its layers are ready (layer_ready):
//  - direct read (the source pool is shareable, PoolMemory::kShareable, and the destination, on
//    the same host, could map it): a 64-byte header with the payload's checksum, and no payload;
//    the destination copies the bytes straight from the source pool into its own (copy_direct:
//    one copy) and checks the checksum, then credits the source, which announces at most
//    `direct_window` messages ahead of those credits (those announced from seals: unbounded);
//  - messages: the header and then the payload, packed (keeping at most `staging_bytes` of packed
//    payloads in flight: back-pressure, it packs the next one only when an earlier send completed)
//    or sent straight from the pool where it is one run of it. The receiver posts a payload
//    receive only while its staging allows.
//
// Failure is per request: a sender-side error (fail(), or anything that throws inside the sender's
// progress(): its remaining messages go as aborted headers), a receiver-side one (kLocalError), a
// checksum or header mismatch, or no progress for `timeout_s` ends that request on both sides with
// a non-OK status; progress() itself does not throw (the receiver
// tells every source by an ack; a source told of failure stops sending). The caller then frees the
// request's blocks; other requests, on other tags, are untouched.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvshard/cache/block_pool.h"
#include "kvshard/comm/communicator.h"
#include "kvshard/common/large_alloc.h"
#include "kvshard/common/shared_arena.h"
#include "kvshard/transfer/pack.h"
#include "kvshard/transfer/transfer_plan.h"
#include "kvshard/transfer/transfer_schedule.h"

namespace kvshard {

class RmaPoolWindow;  // rma_read.h

enum class TransferStatus : uint32_t {
    kOk = 0,
    kSourceAborted = 1,     // the source failed the request (fail()) and said so
    kChecksumMismatch = 2,  // a payload's XXH3_64 did not match its header
    kBadHeader = 3,         // a header that does not belong to this plan/request, or corrupt
    kTimeout = 4,           // no progress for timeout_s (a peer that died or hangs)
    kPeerFailed = 5,        // the other side reported a failure (in an ack)
    kLocalError = 6,        // a copy or a communicator call failed on this rank (the error says)
};
std::string_view transfer_status_name(TransferStatus s);

// Message header on the wire (docs/transfer.md): 64 bytes, native (little-endian) byte order.
struct TransferHeader {
    static constexpr uint32_t kMagic = 0x4658564B;  // "KVXF"
    static constexpr uint16_t kVersion = 2;
    // flags
    static constexpr uint32_t kDirect = 1;  // no payload follows; read it from the source pool
    // With kDirect: payload_xxh3 is the message's unit checksum (pack.h, unit_checksum) from the
    // source's seals, not the XXH3 of its bytes.
    static constexpr uint32_t kUnitChecksum = 2;
    // With kDirect, RMA read: the payload was packed, in wire order, into the source's pack area
    // (rma_read.h, RmaPoolWindow), where the destination reads it (rma_pack_offsets: where).
    static constexpr uint32_t kPacked = 4;
    uint32_t magic = kMagic;
    uint16_t version = kVersion;
    uint16_t mode = 0;  // 0 pre-send, 1 post-receive: the payload's wire order
    uint64_t request_id = 0;
    uint32_t src_rank = 0;       // source layout rank
    uint32_t dst_rank = 0;       // destination layout rank
    uint32_t message_index = 0;  // index in plan.messages
    uint32_t layer_group = 0;
    uint64_t payload_bytes = 0;  // 0 when status != kOk (no payload follows)
    uint64_t payload_xxh3 = 0;   // XXH3_64bits(payload), seed 0 (kUnitChecksum: the unit one)
    uint32_t status = 0;         // TransferStatus; kSourceAborted: no payload follows
    uint32_t flags = 0;          // kDirect, kUnitChecksum, kPacked
    uint64_t header_xxh3 = 0;    // XXH3_64bits of the 56 bytes above
};
static_assert(sizeof(TransferHeader) == 64);

// The first message from a source to each of its destinations of a request, on the header tag.
struct TransferHello {
    static constexpr uint32_t kMagic = 0x4948564B;  // "KVHI"
    static constexpr uint16_t kShareable = 1;       // flags: the source pool can be read in place
    // flags: the source pool is exposed in TransferExecOptions::rma_window (rma_read.h) and can be
    // read in place through it, from any host; num_blocks is its block count.
    static constexpr uint16_t kRmaWindow = 2;
    // flags, with kRmaWindow: this request holds the source's pack area (RmaPoolWindow; one
    // request at a time), so the destination may ask for packed reads.
    static constexpr uint16_t kPackArea = 4;
    uint32_t magic = kMagic;
    uint16_t version = TransferHeader::kVersion;
    uint16_t flags = 0;
    uint64_t request_id = 0;
    uint32_t src_rank = 0;
    uint32_t dst_rank = 0;
    // kShareable: the source pool's SharedArenaId and its block count.
    int32_t pid = 0;
    int32_t fd = -1;
    uint64_t token[2] = {0, 0};
    uint64_t arena_bytes = 0;
    int64_t num_blocks = 0;
    uint64_t hello_xxh3 = 0;  // XXH3_64bits of the 64 bytes above
};
static_assert(sizeof(TransferHello) == 72);

// From a destination rank to each of its sources, on the ack tag, in this order: a reply to the
// hello, a credit after each message it read in place, and a final ack when it is done with the
// request.
struct TransferAck {
    static constexpr uint32_t kMagic = 0x4B41564B;                 // "KVAK"
    static constexpr uint16_t kDone = 0, kReply = 1, kCredit = 2;  // kind
    static constexpr uint16_t kDirectRead = 1;  // reply flags: messages come as direct reads
    // reply flags, with kDirectRead through the RMA window: pack them into the pack area first
    static constexpr uint16_t kPacked = 2;
    uint32_t magic = kMagic;
    uint16_t kind = kDone;
    uint16_t flags = 0;
    uint32_t status = 0;  // kDone: TransferStatus seen by the destination
    uint32_t count = 0;   // kCredit: messages of this source read so far
    uint64_t request_id = 0;
};
static_assert(sizeof(TransferAck) == 24);

// Payload buffers reused across messages and requests: no zero fill, and no page faults once warm
// (a fresh 4 MiB allocation per message costs a page fault per 4 KiB). A Buffer returns its memory
// to the pool when destroyed. Buffers are allocate_large memory (4 KiB-aligned; huge pages from
// 2 MiB up: common/large_alloc.h). Thread-safe.
class StagingPool : public std::enable_shared_from_this<StagingPool> {
  public:
    class Buffer {
      public:
        Buffer() = default;
        Buffer(Buffer&&) noexcept = default;
        Buffer& operator=(Buffer&& o) noexcept;
        ~Buffer();
        std::byte* data() { return data_.get(); }
        const std::byte* data() const { return data_.get(); }
        size_t size() const { return size_; }
        bool empty() const { return size_ == 0; }
        std::byte& operator[](size_t i) { return data()[i]; }
        operator std::span<std::byte>() { return {data(), size_}; }
        operator std::span<const std::byte>() const { return {data(), size_}; }

      private:
        friend class StagingPool;
        void reset();
        std::shared_ptr<StagingPool> pool_;
        LargeBuffer data_;
        size_t capacity_ = 0, size_ = 0;
    };

    // Keeps at most keep_bytes of free buffers.
    static std::shared_ptr<StagingPool> create(int64_t keep_bytes = int64_t{1} << 30);
    Buffer acquire(size_t size);  // contents undefined

  private:
    explicit StagingPool(int64_t keep_bytes) : keep_bytes_(keep_bytes) {}
    void give_back(LargeBuffer data, size_t capacity);
    std::mutex mu_;
    std::multimap<size_t, LargeBuffer> free_;  // by capacity
    int64_t kept_ = 0, keep_bytes_;
};

struct TransferExecOptions {
    TransferMode mode = TransferMode::kAuto;
    int src_world_base = 0;
    int dst_world_base = 0;
    int64_t staging_bytes = int64_t{64}
                            << 20;  // per sender and per receiver; one message always fits
    double timeout_s = 30.0;        // without progress
    std::shared_ptr<StagingPool> staging_pool;  // null: each sender/receiver makes its own
    // Receiver: a payload received straight into the pool (zero copy) of at least this many bytes
    // is checked on a worker thread of the receiver, while its own thread goes on receiving (with
    // a single-copy transport, MPI's copy runs inside the receiver's calls). Only where the
    // receiver's thread may run on more than one CPU (on one, the two would take turns: measured
    // slower). < 0: always inline.
    int64_t offload_check_bytes = int64_t{1} << 20;
    // Sender: once all its messages are posted, sleep this long between polls instead of spinning.
    // 0 (default) spins, which any transport that moves bytes inside the sender's MPI calls needs
    // (TCP, pipelined copies); > 0 frees the sender's core for others when the transport moves
    // the bytes without the sender (shared memory with a single copy done by the receiver: CMA).
    int sender_idle_sleep_us = 0;
    // Direct read (pack.h, copy_direct): where the source pool is shareable and the destination
    // can map it (the same host), the destination copies each message straight from the source
    // pool and only headers travel. Both sides must allow it; false: always messages.
    bool direct_read = true;
    // Direct read: messages a source announces to one destination ahead of the destination's
    // credits, of those it announces with a checksum pass (no seals): that pass then reads what
    // the destination reads next, and the bound keeps those bytes in the shared cache in between.
    // A message announced from the seals (unit checksum) makes no pass and is not bounded: the
    // destination then finds its next header waiting instead of a credit round trip. 0: no bound.
    int direct_window = 2;
    // Sender, direct read: the seals of its pool (source_checksums.h: computed when the KV was
    // written; the same pool as the sender's, Error otherwise). A message whose pieces read whole
    // sealed blocks is announced with its unit checksum, and the sender makes no pass over its
    // bytes; others (and all with null) with the XXH3 of their bytes, from a pass over the pool.
    std::shared_ptr<const SourceChecksums> source_checksums;
    // Direct read: views of source pools kept open across requests (a fresh mapping faults on
    // each page it reads first); null: each receiver opens its own.
    std::shared_ptr<SharedArenaViews> arena_views;
    // How each message travels (transfer_schedule.h), made once for both sides by the caller that
    // knows both (made with direct_read false: a destination that agreed to read in place reads
    // every message of its source directly instead). Null: each sender / receiver makes the
    // schedule of its own side from its pool. Its mode and its pages of this rank must match.
    std::shared_ptr<const TransferSchedule> schedule;
    // Direct read over one-sided communication (rma_read.h): non-null on both sides (the same
    // window, made collectively over `world`), a direct read goes through this window (MPI RMA:
    // one MPI_Rget per descriptor of the message, then the checksum of what landed) instead of
    // through shared memory, so it works across hosts. Needs direct_read; a source offers it
    // whatever its pool's memory kind, and a destination declines it for fp8 plans (messages).
    std::shared_ptr<RmaPoolWindow> rma_window;

    // Error naming the field unless every value is in range.
    void validate() const;
};

// Tags of a request, by kind: header (and hello), payload, ack (and reply, credits); request_id
// modulo 65536 slots above 2^19.
inline constexpr int kTransferHeaderKind = 0, kTransferPayloadKind = 1, kTransferAckKind = 2;
int transfer_tag(uint64_t request_id, int kind);

struct TransferResult {
    TransferStatus status = TransferStatus::kOk;
    std::string error;  // empty when ok
    int64_t bytes = 0;  // payload bytes sent or announced for a direct read (sender), received and
                        // unpacked or read in place (receiver)
    int messages = 0;
    int zero_copy_messages = 0;      // sent from / received into the pool itself (no staging copy)
    int direct_messages = 0;         // read by the destination straight from the source pool
    int unit_checksum_messages = 0;  // of those, checked by unit checksums (no source pass)
    int packed_messages = 0;  // of the direct ones, packed into the source's RMA pack area first
    double seconds = 0;       // from construction to done
    double pack_seconds =
        0;  // sender: packing + checksums; receiver: checks, unpacking, direct reads
    double first_send_s = -1;   // sender: when the first message went out, from construction
    double last_send_s = -1;    // sender: when the last message went out
    int64_t peak_staging = 0;   // most payload bytes held at once
    int peak_direct_ahead = 0;  // sender: most messages announced to one destination ahead of
                                // its credits (at most direct_window when that is > 0 and no
                                // message was announced from seals)
    bool ok() const { return status == TransferStatus::kOk; }
};

class TransferSender {
  public:
    TransferSender(Communicator& world, std::shared_ptr<const TransferPlan> plan,
                   uint64_t request_id, int src_rank, const BlockPool& pool,
                   TransferExecOptions options = {});
    ~TransferSender();
    TransferSender(const TransferSender&) = delete;
    TransferSender& operator=(const TransferSender&) = delete;

    // Layers [0, layer] of the model are final in the pool (layers are produced in order).
    void layer_ready(int layer);
    void all_layers_ready();
    // The source failed (e.g. prefill threw): every message not yet sent goes as a header with
    // status kSourceAborted and no payload.
    void fail(const std::string& reason);

    bool progress();  // non-blocking; true when done
    bool done() const { return done_; }
    // Every destination has answered the hello (or this sender offered it no choice): from now
    // on a ready message leaves at the next progress(). A prefill that polls until this holds
    // before it starts streams its first layer without waiting for a round trip.
    bool connected() const;
    TransferResult finish();      // polls until done
    double idle_seconds() const;  // since something last moved
    // How long to sleep between polls now: options.sender_idle_sleep_us once every message is
    // posted and only completions are awaited, else 0 (spin).
    int idle_sleep_us() const;

  private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
    bool done_ = false;
};

class TransferReceiver {
  public:
    TransferReceiver(Communicator& world, std::shared_ptr<const TransferPlan> plan,
                     uint64_t request_id, int dst_rank, BlockPool& pool,
                     TransferExecOptions options = {});
    ~TransferReceiver();
    TransferReceiver(const TransferReceiver&) = delete;
    TransferReceiver& operator=(const TransferReceiver&) = delete;

    bool progress();  // non-blocking; true when done
    bool done() const { return done_; }
    TransferResult finish();
    double idle_seconds() const;  // since something last moved

  private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
    bool done_ = false;
};

// Polls all of them until every one is done. While data moves it spins (MPI progresses large
// messages only inside its calls, so a sleeping poller would stall them); after 50 ms without
// progress it sleeps between polls. Senders alone, all of them with everything posted and
// sender_idle_sleep_us > 0, sleep that long between polls.
void progress_until_done(std::span<TransferSender* const> senders,
                         std::span<TransferReceiver* const> receivers);

// Checks a received header against what the plan expects; returns an error text or "".
std::string check_header(const TransferHeader& h, const TransferPlan& plan, uint64_t request_id,
                         int message_index);
// Fills header_xxh3.
void seal_header(TransferHeader& h);
// Checks a received hello against the plan and request; returns an error text or "".
std::string check_hello(const TransferHello& h, uint64_t request_id, int src_rank, int dst_rank);
// Fills hello_xxh3.
void seal_hello(TransferHello& h);

}  // namespace kvshard
