#include "kvshard/sim/trace_lengths.h"

#include <algorithm>

#include "kvshard/common/error.h"

namespace kvshard {

int64_t check_trace_lengths(const Trace& trace, const ModelSpec& m, bool allow_long,
                            std::string_view allow_long_how) {
    if (m.max_model_len <= 0) return 0;
    int64_t longer = 0;
    const TraceRequest* first = nullptr;
    for (const TraceRequest& r : trace.requests) {
        // An output_length of 0 is replayed as one token (the prefill samples one): vLLM asks
        // for max_tokens >= 1 and refuses a prompt of max_model_len tokens, which leaves no room
        // for it (vllm/v1/engine/input_processor.py, InputProcessor._validate_prompt_len).
        if (r.input_tokens + std::max<int64_t>(r.output_tokens, 1) <= m.max_model_len) continue;
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
        first->output_tokens,
        first->output_tokens == 0 ? " of output (replayed as 1, the token its prefill samples: "
                                    "at least "
                                  : " of output (",
        first->input_tokens + std::max<int64_t>(first->output_tokens, 1),
        " tokens). A vLLM server starts with this model but refuses each such request when it "
        "arrives, so replaying them would measure a cluster vLLM is not: filter the trace to "
        "requests of at most ",
        m.max_model_len, " tokens, or replay them anyway (", allow_long_how,
        ") as a server started with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 and a longer --max-model-len "
        "would serve them"));
}

}  // namespace kvshard
