#pragma once
// RankModel: the Llama-family decoder (docs/model.md) as one rank computes it: its layers (PP), its
// query/KV heads and MLP columns (TP), its experts (EP), with its KV in its own BlockPool.
// With no communicators it is the unsharded reference model.
//
// One forward step over a batch:
//   first stage: h = embed[token_ids]; other stages: h received from the previous stage
//   each layer:  x = rmsnorm(h); q,k,v = x Wq^T, x Wk^T, x Wv^T (+ bias); RoPE(q, k) at the global
//                positions; write k, v to the KV slots; attention; h += all_reduce_tp(attn Wo^T)
//                x = rmsnorm(h); h += all_reduce_tp(down(silu(x Wg^T) * x Wu^T))   (dense)
//                              h += sum_topk w_e * expert_e(x), dispatched over EP      (MoE)
//   last stage:  logits = rmsnorm(h of each sequence's last row) lm_head^T; other stages send h on.
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "kvshard/attention/paged_attention.h"
#include "kvshard/cache/block_pool.h"
#include "kvshard/cache/paged_kv.h"
#include "kvshard/layout/kv_layout.h"
#include "kvshard/model/weights.h"

namespace kvshard {

class Communicator;

// Whom a rank talks to during a forward step. Null / -1 members mean "nobody": a group of one.
struct RankComms {
    Communicator* world = nullptr;  // for point-to-point between pipeline stages
    Communicator* tp = nullptr;     // the TP group (rank order = tp index)
    Communicator* ep = nullptr;     // the EP group (rank order = ep index)
    int prev_stage = -1;            // world rank of the same (dp, cp, tp) in the previous stage
    int next_stage = -1;            // ... in the next stage
};

// The new tokens of one step. Sequence i owns rows [queries.q_indptr[i], queries.q_indptr[i+1]) of
// token_ids; row t has global position queries.q_pos[t] and goes to KV slot slots[t] of sequence i.
// kv describes every sequence's blocks with its length after this step.
// Models with several KV groups (kv_groups(model): full, sliding, chunked, MLA) may give each group
// its own block tables: group_kv[g] for group g of kv_groups(model) (the same sequences and
// lengths; a windowed group's table may name null blocks before its window, never read). Empty:
// every group uses kv. State layers (Gated DeltaNet) keep one state per sequence in the rank's
// state slots: sequence i uses state_slots[i] (empty: slot i); a sequence whose first row is at
// position 0 starts from the zero state, any other continues the state its slot holds.
struct ForwardBatch {
    std::vector<int32_t> token_ids;
    QueryBatch queries;
    std::vector<int64_t> slots;
    PagedKv kv;
    std::vector<PagedKv> group_kv;
    std::vector<int32_t> state_slots;

    const PagedKv& kv_of_group(int g) const {
        return group_kv.empty() ? kv : group_kv.at(size_t(g));
    }
    int32_t state_slot(int i) const { return state_slots.empty() ? i : state_slots.at(size_t(i)); }

    int batch() const { return queries.batch(); }
    int64_t rows() const { return queries.rows(); }
};

// The attention of one layer, replaceable (context parallelism puts ring attention here).
// q: [rows][num_q_heads][head_dim] with RoPE applied; k, v: [rows][num_kv_heads][head_dim];
// out: [rows][num_q_heads][head_dim].
// MLA layers (mla_latent_dim > 0) come in the absorbed form: one KV "head" of head_dim =
// kv_lora_rank + qk_rope_head_dim in a kv_factor-1 pool, k: [rows][head_dim] the new latents (v
// null), q: [rows][num_q_heads][head_dim] the absorbed queries, out: [rows][num_q_heads]
// [mla_latent_dim] the softmax-weighted latents (the value is the latent's first mla_latent_dim
// elements); see mla_attention.
struct AttentionCall {
    int layer = 0;        // global layer index
    int local_layer = 0;  // index into the pool's layers
    const ForwardBatch* batch = nullptr;
    const PagedKv* kv = nullptr;  // the block tables of the layer's group (batch->kv_of_group)
    AttentionParams params;
    const float* q = nullptr;
    const float* k = nullptr;
    const float* v = nullptr;
    float* out = nullptr;
    // Learned sinks of the layer's query heads ([num_q_heads]), or null: the attention merges each
    // once into every row's softmax (attention/merge.h, apply_attention_sinks).
    const float* sinks = nullptr;
    int mla_latent_dim = 0;  // > 0: an MLA layer (above)
    BlockPool* pool = nullptr;
};
using AttentionFn = std::function<void(const AttentionCall&)>;

// Context parallelism over a state layer: the recurrence runs over every new row of each
// sequence in position order, so the rows are gathered from every CP rank. rows: [N][width], the
// batch's sequences one after the other, each in position order; sequence i (of the batch) is
// rows [seq_ptr[i], seq_ptr[i+1]), the first at position first_pos[i]; own[j]: the index in rows
// of this rank's local row j.
struct StateRows {
    std::vector<float> rows;
    std::vector<int64_t> own;
    std::vector<int32_t> seq_ptr{0};  // batch + 1 entries
    std::vector<int64_t> first_pos;   // batch entries
};
// Given this rank's rows [n][width] of the layer's normed input, the gathered rows.
using StateRowsFn = std::function<StateRows(const std::vector<float>& local, int64_t width)>;
// The default: write_kv of the rows, then paged_attention over the pool (MLA: write_latent, then
// mla_attention).
void default_attention(const AttentionCall& call);

// The layers each kind runs (docs/model.md, "The reference model's layers"):
//   full / sliding / chunked: the attention above with a window or chunk mask; learned sinks join
//                      each head's softmax denominator (merged as a partial of lse = sink, out 0)
//   mla:               DeepSeek-V3's attention in the absorbed form over the cached latent
//                      [rmsnorm(c_kv) | RoPE(k_pe)] (one "head" of kv_lora_rank + qk_rope_head_dim)
//   gated_deltanet:    Qwen3-Next's linear attention: causal conv + SiLU, L2-normalised q and k,
//                      the gated delta rule over a per-sequence state, a gated RMSNorm
//   none:              no mixer.
class RankModel {
  public:
    // One pool per KV group with layers on this rank (kv_groups(spec) order), each holding
    // `num_blocks` blocks of `block_size` tokens for the held layers and KV heads (memory
    // kShareable: a transfer's destination in another process may read it in place).
    RankModel(ModelWeights weights, int64_t num_blocks, int block_size, RankComms comms = {},
              PageOrder order = PageOrder::kHnd, PoolMemory memory = PoolMemory::kPrivate);
    // The same, with pool i over pool_memory[i], memory the caller owns (an engine's KV tensors;
    // BlockPool's ExternalMemory rules): one entry per pool this rank holds (rank_page_geometry
    // of its groups, kv_groups order), each a whole number of blocks, all of which the pool spans
    // (the page offsets depend on the block count). Error otherwise.
    RankModel(ModelWeights weights, int block_size, const std::vector<ExternalMemory>& pool_memory,
              RankComms comms = {}, PageOrder order = PageOrder::kHnd);

    const ModelWeights& weights() const { return weights_; }
    const ModelSpec& spec() const { return weights_.spec; }
    // The pool of the first group held (every layer of a uniform model).
    BlockPool& pool() { return pools_.at(0); }
    const BlockPool& pool() const { return pools_.at(0); }
    int num_pools() const { return int(pools_.size()); }
    BlockPool& pool_at(int i) { return pools_.at(size_t(i)); }
    const BlockPool& pool_at(int i) const { return pools_.at(size_t(i)); }
    // The index in kv_groups(spec) of pool i.
    int pool_group(int i) const { return pool_group_.at(size_t(i)); }
    // Bytes of recurrent state (conv + delta-rule state, fp32) this rank keeps per sequence.
    int64_t state_bytes_per_sequence() const;
    // The Gated DeltaNet state of global layer `layer` (a state layer held here) in state slot
    // `slot`, made (zero) when new, fp32: conv [conv_kernel-1][2*keys*key_dim + heads*value_dim]
    // and recurrent [heads][key_dim][value_dim] over this rank's key and value heads (the layout
    // transfer/state_pack.h names). Valid until the next forward.
    std::span<float> state_conv(int layer, int32_t slot);
    std::span<float> state_rec(int layer, int32_t slot);
    bool first_stage() const { return comms_.prev_stage < 0; }
    bool last_stage() const { return comms_.next_stage < 0; }
    void set_attention(AttentionFn fn) { attention_ = std::move(fn); }
    // Null (the default): state layers run over the batch's own rows.
    void set_state_rows(StateRowsFn fn) { state_rows_ = std::move(fn); }
    // Who this rank talks to from now on (a device that serves under several layouts over time).
    void set_comms(RankComms comms) { comms_ = comms; }

    // Runs this rank's part of one step. Returns [batch][vocab] logits of each sequence's last row
    // on the last stage (a sequence with no rows gets zeros), an empty vector elsewhere.
    std::vector<float> forward(const ForwardBatch& b);

  private:
    // The layers, pools (over `external` when given, else of `memory`) and states.
    void build(int64_t num_blocks, int block_size, PageOrder order, PoolMemory memory,
               const std::vector<ExternalMemory>* external);
    struct StateLayer {  // one Gated DeltaNet layer's states, [slot][...]
        int64_t conv_elems = 0, rec_elems = 0;
        std::vector<float> conv, rec;
        void reserve_slot(int64_t slot);  // zero states up to slot
    };
    StateLayer& state_layer(int layer);
    void attention_block(int local_layer, const ForwardBatch& b, std::vector<float>& h);
    void mla_block(int local_layer, const ForwardBatch& b, std::vector<float>& h);
    void gated_deltanet_block(int local_layer, const ForwardBatch& b, std::vector<float>& h);
    void rope_tables(const ForwardBatch& b, int dim);
    void dense_mlp(const LayerWeights& w, const float* x, int64_t n, float* y);
    void moe_mlp(const LayerWeights& w, const float* x, int64_t n, float* y);
    void tp_all_reduce(std::span<float> data);
    // x += all_reduce_tp(in wo^T): a row-parallel output projection of n rows of `width`.
    void add_row_parallel(const float* in, int64_t n, int64_t width, const std::vector<float>& wo,
                          std::vector<float>& x);

    ModelWeights weights_;
    RankComms comms_;
    std::vector<BlockPool> pools_;
    std::vector<int> pool_group_;
    // Per local layer: (pool, layer in that pool) of token layers, the state layer index of state
    // layers, -1 otherwise.
    std::vector<int> layer_pool_, layer_in_pool_, layer_state_;
    std::vector<StateLayer> states_;
    AttentionFn attention_;
    StateRowsFn state_rows_;
    std::vector<float> rope_cos_, rope_sin_;  // [rows][dim/2] of the current step
    int rope_dim_ = 0;
};

// The slice of the weights rank `rank` holds under `layout` (Error when the dense MLP width is not
// divisible by tp).
WeightShard weight_shard(const KvLayout& layout, int rank);

// Threads each BLAS call may use (process-wide). Rank threads of the threads backend each run their
// own GEMMs, so one per call avoids oversubscribing the cores.
void set_compute_threads(int n);

// Greedy choice: the index of the largest logit (the lowest index among equal ones).
int32_t argmax(std::span<const float> logits);

}  // namespace kvshard
