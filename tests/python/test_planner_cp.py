"""Hardware, capacity, cost, the planner and CP plans through the Python API."""

import pytest

import kvshard


def test_hardware():
    names = kvshard.hardware_names()
    assert "h100-sxm" in names and "h200" in names
    h = kvshard.resolve_hardware("h100-sxm")
    assert h == kvshard.HardwareSpec("h100-sxm") and h != kvshard.HardwareSpec("h200")
    assert h.memory_bytes == 80 << 30 and h.gpus_per_node == 8
    assert kvshard.HardwareSpec.from_json(h.to_json()) == h
    assert h.to_dict()["name"] == "h100-sxm" and "h100-sxm" in repr(h)
    with pytest.raises(kvshard.Error):
        kvshard.resolve_hardware("no-such-gpu")


def test_capacity():
    c = kvshard.compute_capacity("llama-3.1-8b", "tp=1", "h100-sxm")
    assert c["fits"] and c["why_not"] == "" and len(c["ranks"]) == 1
    r = c["ranks"][0]
    m = kvshard.catalog_model("llama-3.1-8b")
    assert r["kv_bytes_per_token"] == m.kv_bytes_per_token()
    # The budget: 90% of memory less weights and the 2 GiB reserve; whole blocks of 16 tokens.
    assert r["kv_budget_bytes"] == int(0.9 * (80 << 30)) - r["weights"]["total"] - (2 << 30)
    assert r["kv_tokens"] == r["kv_budget_bytes"] // (16 * r["kv_bytes_per_token"]) * 16
    c2 = kvshard.compute_capacity("llama-3.1-8b", "tp=2", "h100-sxm")
    assert c2["kv_tokens_per_gpu"] > c["kv_tokens_per_gpu"]
    too_big = kvshard.compute_capacity("llama-3.1-405b", "tp=1", "h100-sxm")
    assert not too_big["fits"] and too_big["why_not"]
    with pytest.raises(kvshard.Error):
        kvshard.compute_capacity("llama-3.1-8b", "tp=1", "h100-sxm", mem_util=1.5)
    # A context past the model's max_model_len (131072, from max_position_embeddings) is refused
    # as vLLM refuses it, unless allowed as VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 allows it.
    assert kvshard.catalog_model("llama-3.1-8b").max_model_len == 131072
    with pytest.raises(kvshard.Error, match="max_model_len 131072"):
        kvshard.compute_capacity("llama-3.1-8b", "tp=1", "h100-sxm", context_tokens=131073)
    long = kvshard.compute_capacity("llama-3.1-8b", "tp=1", "h100-sxm", context_tokens=131073,
                                    allow_long_context=True)
    assert long["requests_per_replica"] >= 1
    with pytest.raises(kvshard.Error, match="longer than model"):
        kvshard.plan("llama-3.1-8b", "h100-sxm", 1, 200000)
    assert kvshard.plan("llama-3.1-8b", "h100-sxm", 1, 200000, allow_long_context=True)["configs"]


def test_cost():
    a = kvshard.estimate_cost("llama-3.1-70b", "tp=8", "h100-sxm", prompt_tokens=4096,
                              context_tokens=4096, batch=8)
    b = kvshard.estimate_cost("llama-3.1-70b", "tp=8", "h100-sxm", prompt_tokens=8192,
                              context_tokens=4096, batch=8)
    assert 0 < a["ttft_s"] < b["ttft_s"]
    assert a["tpot_s"] == pytest.approx(b["tpot_s"])
    assert a["decode"]["tp_bytes"] > 0 and a["decode"]["pp_bytes"] == 0
    assert a["decode_tokens_per_s"] == pytest.approx(8 / a["tpot_s"])
    with pytest.raises(kvshard.Error):
        kvshard.estimate_cost("llama-3.1-70b", "tp=8", "h100-sxm", prompt_tokens=-1,
                              context_tokens=1)


def test_plan_and_configs():
    configs = kvshard.enumerate_configs("llama-3.1-70b", 8)
    assert any((c.tp, c.dp, c.pp, c.cp) == (8, 1, 1, 1) for c in configs)
    assert len(configs) == len({str(c) for c in configs})
    assert all(c.world_size == 8 for c in configs)
    p = kvshard.plan("llama-3.1-70b", "h100-sxm", 8, 8192)
    assert p  # a dict (the CLI's --json; test_cli_equal compares it)
    svg = kvshard.plan_svg("llama-3.1-70b", "h100-sxm", 8, 8192)
    assert svg.lstrip().startswith("<") and "svg" in svg
    e = kvshard.explain_plan("llama-3.1-70b", "h100-sxm", 8, 8192, "tp=8")
    assert e
    with pytest.raises(kvshard.Error):
        kvshard.plan("llama-3.1-70b", "h100-sxm", 8, 8192, objective="speed")
    with pytest.raises(kvshard.Error):
        kvshard.enumerate_configs("llama-3.1-70b", 0)


def test_cp():
    layout = kvshard.make_layout("llama-3.1-70b", "tp=2,cp=4,cp_scheme=zigzag")
    long = kvshard.choose_cp_prefill(layout, 120000, 8000)
    short = kvshard.choose_cp_prefill(layout, 0, 8000)
    # Few new tokens after a long cache: move the queries, not the KV.
    assert long["mode"] == "pass-q" and short["mode"] == "pass-kv"
    assert 0 < kvshard.cp_pass_q_threshold(layout) < 1
    assert long["threshold"] == kvshard.cp_pass_q_threshold(layout)
    steps = kvshard.cp_ring_schedule(4, 1)
    assert len(steps) == 4 and steps[0]["holds"] == 1 and steps[-1]["sends"] == -1
    assert sum(kvshard.cp_token_count(layout.parallel, c, 1001) for c in range(4)) == 1001
    heads = [kvshard.cp_helix_heads(64, 4, c) for c in range(4)]
    assert heads[0] == (0, 16) and heads[3] == (48, 64)
    assert kvshard.cp_decode_merge_bytes(layout, 0, "all-to-all") > 0
    reuse = kvshard.plan_cp_prefix_reuse(2, 4, 100)
    assert reuse["blocks"] == 100
    plan = kvshard.cp_plan("llama-3.1-70b", layout.parallel, 120000, 8000)
    assert plan["choice"]["mode"] == "pass-q"
    assert sum(r["new_tokens"] for r in plan["ranks"] if r["tp"] == 0) == 8000
    with pytest.raises(kvshard.Error):
        kvshard.cp_plan("llama-3.1-70b", layout.parallel, 0, 0)
    with pytest.raises(kvshard.Error):
        kvshard.cp_ring_schedule(4, 4)


def _disagg(**kw):
    return kvshard.plan_disagg("llama-3.1-70b", "h100-sxm", 16, 8192, ttft_slo=2, tpot_slo=0.05,
                               **kw)


def test_plan_disagg():
    d = _disagg()
    assert d["model"] == "llama-3.1-70b" and d["gpus"] == 16 and d["prompt_tokens"] == 8192
    configs = d["configs"]
    assert any(c["disaggregated"] for c in configs) and any(not c["disaggregated"] for c in configs)
    # Those meeting both SLOs come first, by output tokens/s per GPU.
    ok = [c for c in configs if c["meets_slo"]]
    assert ok and configs[: len(ok)] == ok
    rates = [c["tokens_per_s_per_gpu"] for c in ok]
    assert rates == sorted(rates, reverse=True)
    # A disaggregated entry's KV bytes per request are those of the transfer plan of its layouts.
    dis = next(c for c in configs if c["disaggregated"])
    src = kvshard.make_layout("llama-3.1-70b", dis["prefill"]["layout"])
    dst = kvshard.make_layout("llama-3.1-70b", dis["decode"]["layout"])
    assert dis["transfer"]["bytes"] == kvshard.transfer_plan(src, dst, 8192).bytes
    priced = kvshard.price_kv_transfer("llama-3.1-70b", dis["prefill"]["layout"],
                                       dis["decode"]["layout"], "h100-sxm", 8192,
                                       prefill_s=dis["prefill_s"])
    assert priced == dis["transfer"]
    # Aggregated only, and a prefix hit that leaves less to prefill.
    agg = _disagg(disaggregated=False)["configs"]
    assert agg and not any(c["disaggregated"] for c in agg)
    hit = _disagg(prefix_hit_rate=0.5)["configs"]
    assert all(c["prefill_tokens"] == 4096 for c in hit)
    assert _disagg(weight_dtype="fp8")["weight_dtype"] == "fp8"
    svg = kvshard.plan_disagg_svg("llama-3.1-70b", "h100-sxm", 16, 8192, ttft_slo=2,
                                  tpot_slo=0.05)
    assert svg.startswith("<svg") or svg.startswith("<?xml")
    with pytest.raises(kvshard.Error):
        _disagg(prefix_hit_rate=1.0)
    # Each prompt of the distribution, not only the mean, is a prompt vLLM accepts: below
    # max_model_len (131072; vllm/v1/engine/input_processor.py, _validate_prompt_len).
    assert _disagg(prompt_samples=[1024, 131071])["configs"]
    with pytest.raises(kvshard.Error, match=r"prompt 1 of the distribution \(131072 tokens\).*"
                                            r"allow_long_context=True"):
        _disagg(prompt_samples=[1024, 131072])
    assert _disagg(prompt_samples=[1024, 131072], allow_long_context=True)["configs"]
    with pytest.raises(kvshard.Error, match="every prompt length of the distribution"):
        _disagg(prompt_samples=[1024, 0])
    with pytest.raises(kvshard.Error):
        kvshard.plan_disagg("llama-3.1-70b", "h100-sxm", 16, 8192, ttft_slo=0, tpot_slo=0.05)
    with pytest.raises(kvshard.Error):
        kvshard.price_kv_transfer("llama-3.1-70b", "tp=3", "tp=8", "h100-sxm", 8192)
