#include "kvshard/sim/trace_lengths.h"

#include "kvshard/common/error.h"

namespace kvshard {

int64_t check_trace_lengths(const Trace& trace, const ModelSpec& m, bool allow_long,
                            std::string_view allow_long_how) {
    if (m.max_model_len <= 0) return 0;
    int64_t longer = 0;
    const TraceRequest* first = nullptr;
    for (const TraceRequest& r : trace.requests) {
        if (r.input_tokens + r.output_tokens <= m.max_model_len) continue;
        if (first == nullptr) first = &r;
        ++longer;
    }
    if (first == nullptr || allow_long) return longer;
    // Not check_sequence_length's wording: a server given these requests starts (its
    // --max-model-len is the model's) and refuses each one when it arrives, so the cure is the
    // trace, not the server's length.
    throw Error(detail::concat(
        "trace '", trace.source, "': ", longer, " of ", trace.requests.size(),
        " requests are longer than model '", m.name,
        "' serves (prompt + max_tokens > max_model_len ", m.max_model_len,
        ", which vLLM derives from its config: ", m.max_model_len_from, "); the first, at line ",
        first->line, ", is a prompt of ", first->input_tokens, " tokens plus ",
        first->output_tokens, " of output (", first->input_tokens + first->output_tokens,
        " tokens). A vLLM server starts with this model but refuses each such request when it "
        "arrives, so replaying them would measure a cluster vLLM is not: filter the trace to "
        "requests of at most ",
        m.max_model_len, " tokens, or replay them anyway (", allow_long_how,
        ") as a server started with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 and a longer --max-model-len "
        "would serve them"));
}

}  // namespace kvshard
