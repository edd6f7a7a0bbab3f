#include "kvshard/sim/trace_lengths.h"

#include "kvshard/common/error.h"

namespace kvshard {

int64_t check_trace_lengths(const Trace& trace, const ModelSpec& m, bool allow_long) {
    if (m.max_model_len <= 0) return 0;
    int64_t longer = 0;
    const TraceRequest* first = nullptr;
    for (const TraceRequest& r : trace.requests) {
        if (r.input_tokens + r.output_tokens <= m.max_model_len) continue;
        if (first == nullptr) first = &r;
        ++longer;
    }
    if (first != nullptr)
        m.check_sequence_length(
            first->input_tokens + first->output_tokens, allow_long,
            detail::concat("trace '", trace.source, "': ", longer, " of ", trace.requests.size(),
                           " requests are ones a vLLM server refuses (prompt + max_tokens > "
                           "max_model_len); the first, at line ",
                           first->line, ", a prompt of ", first->input_tokens, " tokens plus ",
                           first->output_tokens, " of output"));
    return longer;
}

}  // namespace kvshard
