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
struct ForwardBatch {
    std::vector<int32_t> token_ids;
    QueryBatch queries;
    std::vector<int64_t> slots;
    PagedKv kv;

    int batch() const { return queries.batch(); }
    int64_t rows() const { return queries.rows(); }
};

// The attention of one layer, replaceable (context parallelism puts ring attention here).
// q: [rows][num_q_heads][head_dim] with RoPE applied; k, v: [rows][num_kv_heads][head_dim];
// out: [rows][num_q_heads][head_dim].
struct AttentionCall {
    int layer = 0;        // global layer index
    int local_layer = 0;  // index into the rank's pool
    const ForwardBatch* batch = nullptr;
    AttentionParams params;
    const float* q = nullptr;
    const float* k = nullptr;
    const float* v = nullptr;
    float* out = nullptr;
    BlockPool* pool = nullptr;
};
using AttentionFn = std::function<void(const AttentionCall&)>;
// The default: write_kv of the rows, then paged_attention over the pool.
void default_attention(const AttentionCall& call);

class RankModel {
  public:
    // The pool holds `num_blocks` blocks of `block_size` tokens for the held layers and KV heads
    // (memory kShareable: a transfer's destination in another process may read it in place).
    RankModel(ModelWeights weights, int64_t num_blocks, int block_size, RankComms comms = {},
              PageOrder order = PageOrder::kHnd, PoolMemory memory = PoolMemory::kPrivate);

    const ModelWeights& weights() const { return weights_; }
    const ModelSpec& spec() const { return weights_.spec; }
    BlockPool& pool() { return pool_; }
    const BlockPool& pool() const { return pool_; }
    bool first_stage() const { return comms_.prev_stage < 0; }
    bool last_stage() const { return comms_.next_stage < 0; }
    void set_attention(AttentionFn fn) { attention_ = std::move(fn); }
    // Who this rank talks to from now on (a device that serves under several layouts over time).
    void set_comms(RankComms comms) { comms_ = comms; }

    // Runs this rank's part of one step. Returns [batch][vocab] logits of each sequence's last row
    // on the last stage (a sequence with no rows gets zeros), an empty vector elsewhere.
    std::vector<float> forward(const ForwardBatch& b);

  private:
    void attention_block(int local_layer, const ForwardBatch& b, std::vector<float>& h);
    void dense_mlp(const LayerWeights& w, const float* x, int64_t n, float* y);
    void moe_mlp(const LayerWeights& w, const float* x, int64_t n, float* y);
    void tp_all_reduce(std::span<float> data);

    ModelWeights weights_;
    RankComms comms_;
    BlockPool pool_;
    AttentionFn attention_;
    std::vector<float> rope_cos_, rope_sin_;  // [rows][head_dim/2] of the current step
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
