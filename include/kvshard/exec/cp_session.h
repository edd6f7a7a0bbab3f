#pragma once
// Serving sequences under context parallelism with the reference model (docs/context-parallel.md
// §8): every CP rank runs the model over the new tokens it owns, attention is the CP ring (prefill)
// or the merged partials (decode), and the prefix cache works across CP ranks and CP sizes.
//
// A CpDevice is what outlives a request and a CP size: one device's weight slice (its TP index,
// and its pipeline stage and experts where the layout has pp or ep > 1), KV pools and BlockManager.
// A CpSession is one collective run over a world of devices. With pp > 1 each stage is a cp x tp
// grid of its layers: stage s's rank (cp c, tp t) hands its rows on to stage s+1's rank (c, t),
// every stage runs its own rings and merges, and the last stage's logits are broadcast back to
// every stage. With ep > 1 the routed experts are spread over the EP groups of a stage (the
// layout's EP numbering), so the CP ranks of a group dispatch their own rows to each other.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "kvshard/cache/block_manager.h"
#include "kvshard/comm/communicator.h"
#include "kvshard/comm/groups.h"
#include "kvshard/exec/cp_ring.h"
#include "kvshard/exec/rank_model.h"
#include "kvshard/layout/cp_plan.h"
#include "kvshard/layout/kv_layout.h"
#include "kvshard/model/weights.h"

namespace kvshard {

struct CpOptions {
    int block_size = 16;
    int64_t num_blocks = 256;  // per device
    // Prefix caching needs block-granular interleave (--cp-scheme interleave --cp-interleave
    // block_size) when cp > 1; under other placements it is off.
    bool prefix_cache = true;
    std::optional<CpPrefillMode> prefill_mode;  // empty: choose_cp_prefill (pass-Q for short turns)
    CpDecodeMerge decode_merge = CpDecodeMerge::kAllGather;
    PoolMemory pool_memory = PoolMemory::kPrivate;  // the device's pool (kShareable: see BlockPool)
};

class CpDevice {
  public:
    // The device holds the TP slice tp_rank of tp of model m (fp32 weights and KV).
    CpDevice(const ModelSpec& m, int tp, int tp_rank, const TensorSource& weights,
             const CpOptions& opt);
    // The device of rank `rank` under layout p (p.dp == 1): its stage's layers, its TP slice and,
    // with ep > 1, its experts (weight_shard of make_layout(m, p)).
    CpDevice(const ModelSpec& m, const ParallelConfig& p, int rank, const TensorSource& weights,
             const CpOptions& opt);
    RankModel& model() { return *model_; }
    BlockManager& blocks() { return blocks_; }
    const ModelSpec& spec() const { return model_->spec(); }
    int tp() const { return tp_; }
    int tp_rank() const { return tp_rank_; }
    int pp() const { return pp_; }
    int pp_rank() const { return pp_rank_; }
    int ep() const { return ep_; }
    int ep_rank() const { return ep_rank_; }
    int block_size() const { return block_size_; }

  private:
    int tp_, tp_rank_, block_size_;
    int pp_ = 1, pp_rank_ = 0, ep_ = 1, ep_rank_ = 0;
    std::unique_ptr<RankModel> model_;
    BlockManager blocks_;
};

// What the last prefill or decode did on this rank.
struct CpStepStats {
    CpPrefillMode mode = CpPrefillMode::kPassKv;
    int64_t computed_tokens = 0;    // rows this rank ran through the model
    int64_t cached_tokens = 0;      // leading tokens of the sequence not recomputed (all ranks)
    int64_t local_hit_blocks = 0;   // of this rank's blocks, found in its own prefix cache
    int64_t blocks_moved_in = 0;    // blocks received from other devices (cross-CP-size reuse)
    int64_t blocks_moved_out = 0;   // blocks sent to other devices
    int64_t block_bytes_moved = 0;  // bytes of those blocks, sent or received
    CpCommStats comm;               // attention traffic of this step
    double merge_seconds = 0;       // decode: wall time of this rank's merges (exchange + merge)
};

class CpSession {
  public:
    // Collective over `world`. Ranks [0, p.world_size()) serve under p (the layout's rank order,
    // their devices must hold the slice of their coordinates: TP index, stage, experts); the others
    // only lend cached blocks in prefill (to devices of the same tp and pp sizes, TP index and
    // stage). Requires dp = 1 and the device's tp, pp and ep equal to p's.
    CpSession(CpDevice& device, Communicator& world, const ParallelConfig& p, CpOptions opt);
    CpSession(const CpSession&) = delete;
    CpSession& operator=(const CpSession&) = delete;
    ~CpSession();

    bool serving() const { return serving_; }
    const KvLayout& layout() const { return layout_; }
    int cp_rank() const { return coord_.cp; }

    // New tokens of sequence `seq`. A new sequence first asks the prefix cache of every device of
    // the world (moving blocks that another device holds rather than recomputing them); an existing
    // one is continued (a partial prefill with what it holds as the cached prefix). Returns the
    // [vocab] logits of the last token on every serving rank; empty on lending ranks. Collective
    // over the world for a new sequence with prefix caching on, else over the serving ranks.
    std::vector<float> prefill(SeqId seq, std::span<const int32_t> tokens);
    // prefill() in two halves: reserve() does everything before the model runs (the prefix-cache
    // lookup and block moves, the token map, this rank's blocks: block_table(seq) is final after
    // it) and returns whether this rank serves; prefill_reserved() runs the model (collective over
    // the serving ranks). One reservation per sequence at a time.
    bool reserve(SeqId seq, std::span<const int32_t> tokens);
    std::vector<float> prefill_reserved(SeqId seq);
    // Called on every serving rank after each layer's prefill attention, once that layer's KV of
    // the sequence is in the pool (e.g. to send it on). Empty: none.
    // `layer` is the global layer index, `pool_layer` its index in its pool (the rank's layers
    // of its KV group: under PP a stage's pool holds only its layers).
    using LayerHook = std::function<void(SeqId seq, int layer, int pool_layer)>;
    void set_layer_hook(LayerHook hook) { layer_hook_ = std::move(hook); }
    // Takes in a new sequence whose KV is computed elsewhere (a disaggregated prefill): builds
    // its token map for `tokens`, allocates this rank's blocks for the positions it holds (not
    // hashed) and computes nothing. The caller writes their KV (device().blocks().block_table(seq),
    // local token j in block j / block_size, slot j % block_size) before decode(). Serving ranks
    // only; not collective.
    void adopt(SeqId seq, std::span<const int32_t> tokens);
    // Feeds one token (usually the last greedy one) to `seq`; returns the [vocab] logits.
    std::vector<float> decode(SeqId seq, int32_t token);

    // Batches (continuous batching: the caller may change the set of sequences between steps).
    //
    // Prefill of several sequences in one forward step: each is reserved as by reserve(seq,
    // tokens) in the given order (its own prefix-cache hit, which may be blocks of an earlier
    // sequence of the same batch, token map and prefill mode), then one forward runs the model
    // over this rank's new rows of every sequence; each layer writes the KV of all the batch's
    // rows before any attention reads it, then runs the ring of each sequence in turn. Returns
    // [n][vocab], row i the logits of the last token of seqs[i], on every serving rank; empty on
    // lending ranks. Collective like prefill(seq, tokens).
    std::vector<float> prefill(std::span<const SeqId> seqs,
                               std::span<const std::vector<int32_t>> tokens);
    // prefill_reserved(seq) of several reserved sequences in one forward, as above.
    std::vector<float> prefill_reserved(std::span<const SeqId> seqs);
    // One decode step of several distinct sequences, seqs[i] fed tokens[i]: one forward over the
    // n rows, each sequence's new token stored by its owner (its own token map), each rank's
    // partials of all n rows over its pages, and per layer one merge for the whole batch (one
    // all-gather of [n][Hq][D+1], or one all-to-all and one all-gather). Returns [n][vocab].
    std::vector<float> decode(std::span<const SeqId> seqs, std::span<const int32_t> tokens);
    // Releases the sequence; its hashed blocks stay in the device's prefix cache.
    void release(SeqId seq);

    const CpTokenMap& token_map(SeqId seq) const;
    // The state slot (RankModel::state_conv / state_rec) of `seq` on this rank's device once a
    // prefill or decode of it has run with state layers; -1 otherwise.
    int32_t held_state_slot(SeqId seq) const {
        const auto it = state_slot_.find(seq);
        return it == state_slot_.end() ? -1 : it->second;
    }
    // The last prefill or decode step; of a batch, the sums over its sequences (mode: the last
    // sequence's).
    const CpStepStats& last_step() const { return last_; }
    // The last prefill of `seq`: its rows, cached tokens and prefix hits; its `comm` is the step's
    // traffic when it was prefilled alone, zero in a batch (whose traffic is in last_step()).
    const CpStepStats& prefill_stats(SeqId seq) const { return seqs_.at(seq).prefill; }
    const CpCommStats& comm_total() const { return total_; }
    // Whether prefix caching is in effect (cp == 1, or interleave with unit == block size).
    bool prefix_cache_active() const;

  private:
    struct Seq {
        std::vector<int32_t> tokens;
        CpTokenMap map;
        std::vector<int64_t> local_pos;  // ascending positions stored here, slot i = local_pos[i]
        // A reserved prefill (reserve -> prefill_reserved): its rows on this rank and step stats.
        struct Reserved {
            std::vector<int64_t> rows;
            CpStepStats stats;
        };
        std::optional<Reserved> reserved;
        CpStepStats prefill;  // its last prefill
    };
    // One sequence of a forward step: the rows this rank computes, whether it stores them.
    struct Step {
        SeqId id = 0;
        Seq* s = nullptr;
        std::vector<int64_t> rows;  // ascending global positions
        int64_t stored_before = 0;  // tokens of the sequence before this step
        bool writes = true;         // prefill: always; decode: this rank owns the new token
        CpStepStats stats;
    };
    // Finds the longest prefix cached on the world's devices, moves the blocks that are not on
    // their owner, and returns the number of global blocks found.
    int64_t discover_and_move(std::span<const int32_t> tokens);
    // One forward step over the sequences of `steps` (every serving rank, the same order).
    std::vector<float> run(std::vector<Step>& steps, bool decode);
    int32_t state_slot(SeqId seq);  // state layers: the sequence's slot, assigned on first use

    CpDevice& dev_;
    Communicator& world_;
    ParallelConfig p_;
    CpOptions opt_;
    KvLayout layout_;
    bool serving_ = false;
    RankCoord coord_;
    std::unique_ptr<Communicator> serving_comm_;
    ParallelGroups groups_;
    std::unordered_map<SeqId, Seq> seqs_;
    std::unordered_map<SeqId, int32_t> state_slot_;  // state layers: each served sequence's slot
    std::vector<int32_t> free_state_slots_;
    CpStepStats last_;
    CpCommStats total_;
    int64_t next_tmp_seq_ = -1;
    LayerHook layer_hook_;
};

}  // namespace kvshard
