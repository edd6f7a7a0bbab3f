"""Every entry point that takes a model and a length checks it against the model's max_model_len
(ModelSpec::check_sequence_length, as `plan`; KV a request has computed, cp_plan's and
transfer_plan's, by check_computed_length: below it): kvshard.Error naming the model's length and
allow_long_context; accepted with allow_long_context=True; no check for a model that states no
length (the built-in tiny models)."""
import pytest

import kvshard

MODEL = "llama-3.1-8b"  # max_model_len 131072 (max_position_embeddings)


def test_cp_plan():
    with pytest.raises(kvshard.Error, match=r"cached 131000 \+ new 100 \(131100 tokens\) is "
                                            r"more KV than model 'llama-3.1-8b' computes.*"
                                            r"max_model_len 131072.*allow_long_context=True"):
        kvshard.cp_plan(MODEL, "cp=2", 131000, 100)
    # KV of max_model_len tokens: vLLM computes at most max_model_len - 1 of a request
    # (vllm/v1/core/sched/scheduler.py, Scheduler.schedule; input_processor.py,
    # _validate_prompt_len refuses a prompt of max_model_len tokens).
    with pytest.raises(kvshard.Error, match=r"\(131072 tokens\).*give at most 131071 tokens"):
        kvshard.cp_plan(MODEL, "cp=2", 131000, 72)
    # A Python caller is told the keyword, not the CLI's flag.
    with pytest.raises(kvshard.Error) as refused:
        kvshard.cp_plan(MODEL, "cp=2", 131000, 100)
    assert "allow long contexts (Python allow_long_context=True)" in str(refused.value)
    assert "--allow-long-context" not in str(refused.value)
    assert kvshard.cp_plan(MODEL, "cp=2", 131000, 71)["ranks"]
    assert kvshard.cp_plan(MODEL, "cp=2", 131000, 100, allow_long_context=True)["ranks"]
    assert kvshard.cp_plan("tiny", "cp=2", 10**6, 100)["ranks"]


def test_transfer_plan():
    src, dst = kvshard.make_layout(MODEL, "tp=2"), kvshard.make_layout(MODEL, "tp=1")
    with pytest.raises(kvshard.Error, match=r"num_tokens \(131073 tokens\) is more KV.*"
                                            r"max_model_len 131072"):
        kvshard.transfer_plan(src, dst, 131073)
    with pytest.raises(kvshard.Error, match=r"num_tokens \(131072 tokens\) is more KV"):
        kvshard.transfer_plan(src, dst, 131072)
    with pytest.raises(kvshard.Error, match=r"\(Python allow_long_context=True\)") as refused:
        kvshard.transfer_plan(src, dst, 131073)
    assert "--allow-long-context" not in str(refused.value)
    assert kvshard.transfer_plan(src, dst, 131071).num_tokens == 131071
    assert kvshard.transfer_plan(src, dst, 131073, allow_long_context=True).num_tokens == 131073
    tiny = kvshard.make_layout("tiny", "tp=1")
    assert kvshard.transfer_plan(tiny, tiny, 10**6).num_tokens == 10**6


@pytest.mark.parametrize("fn", [kvshard.pp_stage_kv_bytes, kvshard.pp_layer_split_kv_balanced])
def test_pp_split_context(fn):
    with pytest.raises(kvshard.Error, match=r"context_tokens \(131073 tokens\) is longer.*"
                                            r"max_model_len 131072"):
        fn(MODEL, "pp=2", 131073)
    with pytest.raises(kvshard.Error, match=r"\(Python allow_long_context=True\)") as refused:
        fn(MODEL, "pp=2", 131073)
    assert "--allow-long-context" not in str(refused.value)
    assert len(fn(MODEL, "pp=2", 131072)) == 2
    assert len(fn(MODEL, "pp=2", 131073, allow_long_context=True)) == 2
    assert len(fn("tiny", "pp=2", 10**6)) == 2
