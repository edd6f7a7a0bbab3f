#include "kvshard/planner/capacity.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>

#include "kvshard/common/checked.h"
#include "kvshard/common/error.h"

namespace kvshard {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

void CapacityOptions::validate() const {
    require(mem_util > 0 && mem_util <= 1, "mem_util must be in (0, 1], got ", mem_util);
    require(activation_reserve_bytes >= 0, "the activation reserve must be >= 0 bytes, got ",
            activation_reserve_bytes);
    require(block_size >= 1 && block_size <= (1 << 20),
            "block_size must be an integer in [1, 2^20] tokens, got ", block_size);
    require(context_tokens >= 0 && context_tokens <= kMaxContextTokens,
            "the context length must be in [0, 2^40] tokens, got ", context_tokens);
    require(max_num_batched_tokens >= 1 && max_num_batched_tokens <= kMaxContextTokens,
            "max_num_batched_tokens must be in [1, 2^40] tokens, got ", max_num_batched_tokens);
    require(speculative_tokens >= 0 && speculative_tokens <= 1024,
            "speculative_tokens must be in [0, 1024] (0: no speculative decoding), got ",
            speculative_tokens);
}

int64_t cp_tokens_per_rank(const ParallelConfig& p, int64_t context_tokens) {
    int64_t most = 0;
    for (int r = 0; r < p.cp; ++r)
        most = std::max(most, cp_tokens_before(p, r, context_tokens, context_tokens));
    return most;
}

std::string_view weight_dtype_name(WeightDtype w) {
    switch (w) {
        case WeightDtype::kModel:
            return "model";
        case WeightDtype::kBf16:
            return "bf16";
        case WeightDtype::kFp8:
            return "fp8";
        case WeightDtype::kFp4:
            return "fp4";
    }
    return "?";
}

WeightDtype parse_weight_dtype(std::string_view s) {
    if (s == "model") return WeightDtype::kModel;
    if (s == "bf16") return WeightDtype::kBf16;
    if (s == "fp8") return WeightDtype::kFp8;
    if (s == "fp4") return WeightDtype::kFp4;
    throw Error(detail::concat("unknown weight dtype '", s, "': expected bf16, fp8 or fp4"));
}

int weight_bits(const ModelSpec& m, WeightDtype w) {
    switch (w) {
        case WeightDtype::kBf16:
            return 16;
        case WeightDtype::kFp8:
            return 8;
        case WeightDtype::kFp4:
            return 4;
        case WeightDtype::kModel:
            break;
    }
    const WeightStorage& ws = m.weight_storage;
    require(ws.sized, "model '", m.name, "' is quantized with '", ws.method,
            "' (its quantization_config), whose storage kvshard does not size: give it with "
            "--weight-dtype bf16|fp8|fp4");
    return ws.quantized() ? 0 : 8 * static_cast<int>(dtype_size(m.weight_dtype));
}

WeightPartBits weight_part_bits(const ModelSpec& m, int bits) {
    KVSHARD_CHECK(bits >= 0, "bits per weight must be >= 0, got ", bits);
    const WeightStorage& ws = m.weight_storage;
    WeightPartBits b;
    b.base = bits > 0 ? bits : 8.0 * static_cast<double>(dtype_size(m.weight_dtype));
    auto part = [&](double stored) { return bits > 0 || stored == 0 ? b.base : stored; };
    b.attention = part(ws.attention_bits);
    b.dense_mlp = part(ws.dense_mlp_bits);
    b.experts = part(ws.experts_bits);
    // fp4 runs on the fp8 tensor cores here (no fp4 FLOP/s in HardwareSpec); a checkpoint that only
    // stores narrower weights (MXFP4) widens them to bf16 for its matmuls.
    b.fp8_matmuls = bits > 0 ? bits <= 8 : ws.fp8_compute || b.base <= 8;
    return b;
}

WeightBytes rank_weight_bytes(const KvLayout& layout, int rank, int bits) {
    const ModelSpec& m = layout.model;
    const ParallelConfig& p = layout.parallel;
    const RankKv& rk = layout.ranks.at(rank);
    const int64_t h = m.hidden;
    const int64_t tp = p.tp;
    const int64_t q_heads = m.num_heads / p.tp;

    const WeightPartBits pb = weight_part_bits(m, bits);
    const double base = pb.base, attn_bits = pb.attention, mlp_bits = pb.dense_mlp,
                 expert_bits = pb.experts;
    // Bytes of `elems` weights at `b` bits each (whole bytes, rounded up).
    auto bytes_at = [](int64_t elems, double b) {
        return static_cast<int64_t>(std::ceil(static_cast<double>(elems) * b / 8.0));
    };
    auto bytes = [&](int64_t elems) { return bytes_at(elems, base); };
    WeightBytes w;
    // Norm weights and biases (ModelSpec::norms), at the unquantized bits: norms are replicated,
    // as are the biases of row-parallel layers (o_proj, down_proj: added once after the
    // all-reduce); the biases of column-parallel ones (q, k, v, gate, up) are split like their
    // outputs.
    const NormsAndBiases& nb = m.norms;
    int64_t norm_elems = 0;
    for (int l = rk.layer_begin; l < rk.layer_end; ++l) {
        const LayerSpec s = m.layer(l);
        int64_t attn = 0;
        norm_elems += m.norm_params_of_layer(l);
        switch (s.kind) {
            case LayerKind::kMla: {
                const MlaSpec& a = m.mla;
                const int64_t qk_dim = int64_t{a.qk_nope_head_dim} + a.qk_rope_head_dim;
                // q_a and kv_a (down-projections) are replicated; q_b, kv_b, o are split by head.
                const int64_t q = a.q_lora_rank > 0 ? h * a.q_lora_rank +
                                                          int64_t{a.q_lora_rank} * q_heads * qk_dim
                                                    : h * q_heads * qk_dim;
                const int64_t kv_a = h * (int64_t{a.kv_lora_rank} + a.qk_rope_head_dim);
                const int64_t kv_b = int64_t{a.kv_lora_rank} * q_heads *
                                     (int64_t{a.qk_nope_head_dim} + a.v_head_dim);
                const int64_t o = q_heads * a.v_head_dim * h;
                attn = q + kv_a + kv_b + o;
                norm_elems += a.kv_lora_rank + a.q_lora_rank;
                break;
            }
            case LayerKind::kFullAttention:
            case LayerKind::kSlidingWindow:
            case LayerKind::kChunkedLocal: {
                const int64_t d = s.head_dim;
                const int64_t kv_local = std::max(1, s.num_kv_heads / p.tp);
                // Q and O, then K and V (replicated heads counted on every holder), sinks.
                attn = 2 * h * q_heads * d + 2 * h * kv_local * d + (s.learned_sinks ? q_heads : 0);
                if (nb.attention_output_gate) attn += h * q_heads * d;  // split like q
                // q_norm / k_norm whole on every rank (OLMo 2's all-heads norms run after an
                // all-gather of q and k), q / k / v biases of the held heads, o_proj's whole.
                if (nb.qk == QkNorm::kPerHead) norm_elems += 2 * d;
                if (nb.qk == QkNorm::kAllHeads)
                    norm_elems += (int64_t{m.num_heads} + s.num_kv_heads) * d;
                if (nb.qkv_bias) norm_elems += (q_heads + 2 * kv_local) * d;
                if (nb.o_bias) norm_elems += h;
                break;
            }
            case LayerKind::kGatedDeltaNet:
            case LayerKind::kMamba2:
            case LayerKind::kMamba1:
            case LayerKind::kShortConv:
                // Every projection of the mixer is split by head (docs/model.md).
                attn = m.mixer_params_of_layer(l) / tp;
                break;
            case LayerKind::kNoKv:
                break;
        }
        if (s.indexer && !holds_state(s.kind)) {
            // The indexer's projections are replicated: its keys are one head shared by all.
            const IndexerSpec& ix = m.indexer;
            attn += int64_t{m.mla.q_lora_rank} * ix.heads * ix.head_dim + h * ix.head_dim +
                    2 * int64_t{ix.head_dim} + h * ix.heads;
        }
        w.attention += bytes_at(attn, attn_bits);
        // An MLP's biases: gate / up split like their outputs, down whole.
        auto mlp_bias = [&](int64_t width_on_rank) {
            return nb.mlp_bias ? (m.mlp_projections - 1) * width_on_rank + h : 0;
        };
        if (s.mlp == MlpKind::kDense) {
            w.dense_mlp += bytes_at(m.mlp_projections * h * s.intermediate / tp, mlp_bits);
            norm_elems += mlp_bias(s.intermediate / tp);
        } else if (s.mlp == MlpKind::kMoe) {
            // The experts' matrices (their biases, gpt-oss's, in norm_elems below).
            const int64_t width = m.moe.latent_size > 0 ? m.moe.latent_size : h;
            const int64_t routed_matrix =
                int64_t{m.mlp_projections} * width * m.moe.expert_intermediate;
            const int64_t shared_matrix =
                int64_t{m.mlp_projections} * h * m.moe.expert_intermediate;
            const int64_t routed = p.ep > 1 ? int64_t{m.moe.num_experts / p.ep} * routed_matrix
                                            : int64_t{m.moe.num_experts} * routed_matrix / tp;
            // LatentMoE's fc1 / fc2_latent_proj are ReplicatedLinear in vLLM's NemotronHMoE
            // (models/nemotron_h.py): whole on every rank, stored like the experts.
            const int64_t shared =
                int64_t{m.moe.shared_experts} * shared_matrix / tp + m.latent_projection_params();
            // The router with its bias and a shared-expert gate, replicated.
            const int64_t router = m.router_params();
            if (nb.mlp_bias) {
                // Whole experts under EP; split by tp like their outputs otherwise (down's bias,
                // of hidden, whole on every rank).
                const int64_t ei = m.moe.expert_intermediate;
                norm_elems +=
                    p.ep > 1
                        ? int64_t{m.moe.num_experts / p.ep} * ((m.mlp_projections - 1) * ei + width)
                        : int64_t{m.moe.num_experts} * ((m.mlp_projections - 1) * ei / tp + width);
                norm_elems += int64_t{m.moe.shared_experts} * mlp_bias(ei / tp);
            }
            w.experts += expert_bits == base
                             ? bytes(routed + shared + router)
                             : bytes_at(routed + shared, expert_bits) + bytes(router);
        }
    }
    const int64_t vocab_shard = ceil_div(m.vocab, tp) * h;
    const bool first = rk.coord.pp == 0;
    const bool last = rk.coord.pp == p.pp - 1;
    if (first) w.embedding = bytes(vocab_shard);
    // A tied LM head reuses the embedding only when both live on the same stage.
    if (last && (!m.tie_embeddings || p.pp > 1)) w.lm_head = bytes(vocab_shard);
    w.norms = bytes(norm_elems + (last ? m.final_norm_params() : 0));
    return w;
}

namespace {

// The ParallelConfig of the model with its MTP layers appended: at pp > 1 vLLM puts the whole
// drafter on the last stage (GPUModelRunner.__init__, vllm/v1/worker/gpu_model_runner.py:
// "currently we put the entire draft model on the last PP rank"), so the model's own layers keep
// their stages and the MTP layers join the last one.
ParallelConfig with_mtp_parallel(const ModelSpec& target, const ParallelConfig& p) {
    ParallelConfig out = p;
    if (p.pp > 1) {
        out.pp_layers = pp_layer_split(target, p);
        out.pp_layers.back() += target.mtp.layers * target.mtp.layers_per_step();
    }
    return out;
}

// rank_drafter_weight_bytes over layouts already made: `target` of the model, `with_mtp` of
// with_mtp_layers(model) at with_mtp_parallel.
int64_t drafter_bytes(const KvLayout& target, const KvLayout& with_mtp, int rank, int bits) {
    const ModelSpec& m = target.model;
    const ParallelConfig& p = target.parallel;
    // The decoder layers: what the model with them appended holds beyond the model itself (0
    // off the last stage).
    const int64_t layers = rank_weight_bytes(with_mtp, rank, bits).total() -
                           rank_weight_bytes(target, rank, bits).total();
    if (target.ranks.at(rank).coord.pp != p.pp - 1) return layers;
    const double base = weight_part_bits(m, bits).base;
    auto bytes = [&](int64_t elems) {
        return static_cast<int64_t>(std::ceil(static_cast<double>(elems) * base / 8.0));
    };
    const int64_t h = m.hidden;
    const int64_t proj = 2 * h * h / (m.mtp.proj_split_by_tp ? p.tp : 1);
    // At pp > 1 the drafter keeps its own vocab embedding (a VocabParallelEmbedding, split by tp):
    // LLMBaseProposer._maybe_share_embeddings shares the target's only when the PP group has one
    // rank ("The draft model's vocab embedding will be loaded separately from the target
    // model"); the LM head, on the last stage with the drafter, is still shared.
    const int64_t embedding = p.pp > 1 ? bytes((m.vocab + p.tp - 1) / p.tp * h) : 0;
    return layers + bytes(proj + 3 * h) * m.mtp.layers + embedding;
}

}  // namespace

int64_t rank_drafter_weight_bytes(const ModelSpec& m, const ParallelConfig& p, int rank, int bits) {
    require(m.mtp.enabled(), "model '", m.name,
            "' carries no MTP layers (num_nextn_predict_layers / mtp_num_hidden_layers)");
    return drafter_bytes(make_layout(m, p),
                         make_layout(with_mtp_layers(m), with_mtp_parallel(m, p)), rank, bits);
}

CapacityReport compute_capacity(const ModelSpec& target, const ParallelConfig& p,
                                const HardwareSpec& hw, const CapacityOptions& options) {
    options.validate();
    hw.validate();
    target.check_sequence_length(options.context_tokens, options.allow_long_context, "the context");
    const bool speculating = options.speculative_tokens > 0;
    if (speculating && !target.mtp.enabled()) {
        // Where the reader dropped the checkpoint's MTP layers on purpose it says why
        // (MtpSpec::not_modelled): vLLM builds no drafter for the model, or kvshard does not model
        // the one vLLM builds. Otherwise the config names none.
        const std::string why = target.mtp.not_modelled.empty()
                                    ? detail::concat(
                                          "' carries none (no num_nextn_predict_layers / "
                                          "mtp_num_hidden_layers)")
                                    : detail::concat("' carries MTP layers that are not modelled: ",
                                                     target.mtp.not_modelled);
        throw Error(detail::concat("speculative decoding with MTP needs MTP layers, and model '",
                                   target.name, why,
                                   ": leave speculation off, or use a checkpoint whose MTP layers "
                                   "kvshard models (DeepSeek-V3/R1, GLM-4.5, Qwen3-Next, "
                                   "Qwen3.5)"));
    }
    // Speculating, the KV cache holds the MTP layers beside the model's own.
    ModelSpec m = speculating ? with_mtp_layers(target) : target;
    // Speculating, a Gated DeltaNet or Mamba-2 layer's conv state keeps conv_kernel - 1 + N rows
    // (its weights do not change), so that the verify step's N + 1 tokens slide through it. vLLM
    // (vllm/model_executor/layers/mamba/mamba_utils.py, MambaStateShapeCalculator):
    // GatedDeltaNet.get_state_shape passes num_spec = num_speculative_tokens to
    // gated_delta_net_state_shape, and Mamba2Base.get_state_shape (mamba2/base.py; MambaMixer2
    // hands it vllm_config.num_speculative_tokens) to mamba2_state_shape. Kimi's KDA layer calls
    // kda_state_shape without num_spec (gdn/kimi_gdn_linear_attn.py,
    // KimiGatedDeltaNetAttention.get_state_shape) and a short conv's short_conv_state_shape takes
    // none: both keep conv_kernel - 1.
    if (speculating && !m.state.kda &&
        std::any_of(m.layers.begin(), m.layers.end(), [](const LayerSpec& s) {
            return s.kind == LayerKind::kGatedDeltaNet || s.kind == LayerKind::kMamba2;
        }))
        m.state.spec_conv_rows = options.speculative_tokens;
    // At pp > 1 the MTP layers' KV and weights are on the last stage (with_mtp_parallel).
    const KvLayout layout = make_layout(m, speculating ? with_mtp_parallel(target, p) : p);
    const int64_t usable =
        static_cast<int64_t>(static_cast<double>(hw.memory_bytes) * options.mem_util);

    CapacityReport rep;
    rep.engine = engine_kv_arrangement(layout, options.block_size, options.raise_block_size,
                                       options.mamba_cache_mode);
    rep.engine.speculative_blocks = options.speculative_tokens;
    const int bits = weight_bits(target, options.weight_dtype);
    const KvLayout target_layout = speculating ? make_layout(target, p) : layout;
    const EngineKvArrangement& eng = rep.engine;
    const bool separate = eng.kind == EngineKvKind::kSeparate;
    const int64_t bs = eng.block_size;
    // vLLM logs num_blocks // len(groups) * min block size (_report_kv_cache_config); kSeparate
    // and kUniform hold every layer's tokens in one block.
    const int64_t log_groups = separate ? 1 : std::max<int64_t>(1, eng.groups.size());
    int64_t min_block = bs;
    for (const EngineKvGroup& g : eng.groups)
        if (holds_tokens(g.kind)) min_block = std::min<int64_t>(min_block, g.block_size);
    rep.ranks.resize(layout.world_size());
    for (int r = 0; r < layout.world_size(); ++r) {
        RankCapacity& rc = rep.ranks[r];
        rc.rank = r;
        rc.weights = rank_weight_bytes(target_layout, r, bits);
        if (speculating) rc.weights.drafter = drafter_bytes(target_layout, layout, r, bits);
        rc.kv_bytes_per_token = layout.ranks[r].kv_bytes_per_token;
        rc.state_bytes_per_sequence = layout.ranks[r].state_bytes_per_sequence;
        rc.kv_budget_bytes = usable - rc.weights.total() - options.activation_reserve_bytes;
        const int64_t per_block = eng.block_bytes[r];
        rc.kv_blocks = rc.kv_budget_bytes > 0 && per_block > 0 ? rc.kv_budget_bytes / per_block : 0;
        rc.kv_tokens =
            separate && rc.kv_bytes_per_token == 0 ? 0 : rc.kv_blocks / log_groups * min_block;
    }
    int lim = 0;
    for (int r = 0; r < layout.world_size(); ++r) {
        if (rep.ranks[r].kv_blocks < rep.ranks[lim].kv_blocks) lim = r;
        rep.weight_bytes_per_gpu = std::max(rep.weight_bytes_per_gpu, rep.ranks[r].weights.total());
    }
    rep.limiting_rank = lim;
    // The most any rank stores, as weight_bytes_per_gpu: the limiting rank may be a PP stage of
    // only state layers (Mamba), which stores no KV per token while the other stages do.
    for (const RankCapacity& rc : rep.ranks)
        rep.kv_bytes_per_token = std::max(rep.kv_bytes_per_token, rc.kv_bytes_per_token);
    rep.state_bytes_per_sequence = rep.ranks[lim].state_bytes_per_sequence;
    rep.kv_blocks_per_gpu = rep.ranks[lim].kv_blocks;
    rep.kv_tokens_per_gpu = rep.ranks[lim].kv_tokens;

    // kSeparate: a request's peak bytes on rank r, with a state per speculative token beside each
    // state layer's own (MambaSpec.num_speculative_blocks).
    auto separate_request_bytes = [&](int r, int64_t len) {
        const int64_t need = request_kv_bytes_peak(layout, r, len, options.block_size);
        if (need <= 0) return need;
        return sat_add(
            need, sat_mul(options.speculative_tokens, layout.ranks[r].state_bytes_per_sequence));
    };
    // Whether vLLM starts with max_model_len = len (kSeparate: whether a request of len fits on
    // every rank at once, each windowed group counted at the most blocks it holds on the way).
    // Non-decreasing in len, so a bisection finds the longest.
    auto fits_len = [&](int64_t len) {
        if (!separate)
            return engine_startup_blocks(eng, p, len, options.max_num_batched_tokens) <=
                   rep.kv_blocks_per_gpu;
        for (int r = 0; r < layout.world_size(); ++r) {
            const int64_t need = separate_request_bytes(r, len);
            if (need > 0 && need > rep.ranks[r].kv_budget_bytes) return false;
        }
        return true;
    };
    if (fits_len(kMaxContextTokens)) {
        rep.max_context = kMaxContextTokens;
        rep.context_unbounded = true;
    } else {
        int64_t lo = 0, hi = kMaxContextTokens - 1;
        while (lo < hi) {  // invariant: fits(lo), !fits(hi + 1)
            const int64_t mid = lo + (hi - lo + 1) / 2;
            if (fits_len(mid))
                lo = mid;
            else
                hi = mid - 1;
        }
        rep.max_context = lo;
    }
    if (target.max_model_len > 0 && !options.allow_long_context &&
        rep.max_context > target.max_model_len) {
        rep.max_context = target.max_model_len;
        rep.context_unbounded = false;
        rep.context_limited_by_model = true;
    }

    if (options.context_tokens > 0 && !separate) {
        rep.request_blocks = engine_request_blocks(eng, p, options.context_tokens);
        rep.request_kv_bytes = sat_mul(rep.request_blocks, eng.block_bytes[lim]);
        rep.requests_per_replica =
            rep.request_blocks > 0 ? rep.kv_blocks_per_gpu / rep.request_blocks : 0;
        rep.max_concurrency = rep.requests_per_replica * p.dp;
    } else if (options.context_tokens > 0) {
        int64_t fewest = INT64_MAX;
        for (int r = 0; r < layout.world_size(); ++r) {
            const int64_t need = separate_request_bytes(r, options.context_tokens);
            if (r == lim) rep.request_kv_bytes = need;
            if (need <= 0) continue;
            const int64_t budget = std::max<int64_t>(0, rep.ranks[r].kv_budget_bytes);
            fewest = std::min(fewest, budget / need);
        }
        rep.requests_per_replica = fewest == INT64_MAX ? 0 : fewest;
        rep.max_concurrency = rep.requests_per_replica * p.dp;
    }

    const RankCapacity& worst = rep.ranks[lim];
    if (worst.kv_budget_bytes <= 0) {
        char buf[160];
        std::snprintf(buf, sizeof buf,
                      "weights %.1f GiB + reserve %.1f GiB exceed %.1f GiB (%.2f x %.1f GiB)",
                      rep.weight_bytes_per_gpu / kGiB, options.activation_reserve_bytes / kGiB,
                      usable / kGiB, options.mem_util, hw.memory_bytes / kGiB);
        rep.why_not = buf;
    } else if (rep.kv_blocks_per_gpu < 1 && worst.kv_bytes_per_token > 0) {
        rep.why_not =
            detail::concat("less than one KV block of ", bs, " tokens fits on rank ", lim);
    } else if (options.context_tokens > 0 && rep.requests_per_replica == 0) {
        rep.why_not = detail::concat("a ", options.context_tokens,
                                     "-token context needs more KV than fits (max ",
                                     rep.max_context, " tokens)");
    } else if (options.context_tokens > rep.max_context) {
        rep.why_not = detail::concat(
            "vLLM would not start with max_model_len ", options.context_tokens,
            ": its check charges each sliding layer W - 1 + max_num_batched_tokens (",
            options.max_num_batched_tokens, ") tokens, so at most ", rep.max_context,
            " tokens fit");
    }
    rep.fits = rep.why_not.empty();
    return rep;
}

}  // namespace kvshard
