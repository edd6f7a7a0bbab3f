#pragma once
// A trace's request lengths against the model's max_model_len (ModelSpec::check_sequence_length).
//
// A request of a trace is served by an OpenAI-compatible vLLM server as a prompt of input_length
// tokens asking for output_length tokens (max_tokens). The server refuses it, before it reaches the
// engine, when prompt + max_tokens > max_model_len (vllm/renderers/params.py,
// TokenizeParams._token_len_check: "You passed N input tokens and requested M output tokens.
// However, the model's context length is only ..."); the engine itself refuses a prompt of
// max_model_len tokens or more (vllm/v1/engine/input_processor.py, _validate_prompt_len). So a
// request of prompt + output > max_model_len is one vLLM never serves: replaying it would measure
// a cluster vLLM is not.
#include <cstdint>

#include "kvshard/model/model_spec.h"
#include "kvshard/sim/trace.h"

namespace kvshard {

// The requests of `trace` whose input_tokens + max(output_tokens, 1) exceed m.max_model_len (none
// when the model states no length; an output of 0 is replayed as the one token a prefill samples,
// and vLLM refuses a prompt of max_model_len tokens). Unless allow_long
// (VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 and a --max-model-len that long), throws Error when there is
// one: the count, the first (its line and lengths), the model's length and where it came from, that
// a server refuses each such request when it arrives (not at startup), and the cures: filter the
// trace, or the override `allow_long_how` names (kAllowLongContextFlag from the CLI). Returns the
// count.
int64_t check_trace_lengths(const Trace& trace, const ModelSpec& m, bool allow_long,
                            std::string_view allow_long_how);

}  // namespace kvshard
