"""Models, parallel configurations and layouts through the Python API."""

import json

import pytest
from conftest import SOURCE_DIR

import kvshard


def test_catalog():
    names = kvshard.catalog_names()
    assert "llama-3.1-8b" in names and len(names) == len(set(names))
    assert kvshard.in_catalog("llama-3.1-8b") and not kvshard.in_catalog("no-such-model")
    m = kvshard.catalog_model("llama-3.1-8b")
    assert (m.num_layers, m.num_kv_heads, m.head_dim) == (32, 8, 128)
    # K and V of every layer and head, bf16.
    assert m.kv_bytes_per_token() == 32 * 2 * 8 * 128 * 2
    assert m.attention == "GQA" and m.kv_dtype == "bf16" and m.weight_dtype == "bf16"
    assert m.weight_storage == "bf16" and not m.to_dict()["weight_storage"]["method"]
    # A quantized checkpoint: gpt-oss's experts in MXFP4 (4.25 bits a weight), the rest bf16.
    oss = kvshard.catalog_model("gpt-oss-120b")
    assert oss.weight_storage == "mxfp4" and oss.weight_dtype == "bf16"
    assert oss.to_dict()["weight_storage"]["experts_bits"] == 4.25
    assert m.uniform() and not m.is_mla() and "32" in m.layer_mix()
    assert 7e9 < m.total_params() < 9e9 and m.active_params_per_token() <= m.total_params()
    assert m.state_bytes_per_sequence() == 0
    m.validate()
    assert "llama-3.1-8b" in repr(m)


def test_catalog_error_lists_names():
    with pytest.raises(kvshard.Error) as e:
        kvshard.catalog_model("no-such-model")
    assert "llama-3.1-8b" in str(e.value)
    assert isinstance(e.value, ValueError)


def test_model_values_and_json():
    a = kvshard.catalog_model("llama-3.1-8b")
    b = kvshard.ModelSpec("llama-3.1-8b")
    assert a == b and kvshard.resolve_model("llama-3.1-8b") == a
    assert a != kvshard.catalog_model("llama-3.1-70b")
    d = a.to_dict()
    assert d == json.loads(a.to_json()) and d["name"] == "llama-3.1-8b"
    assert kvshard.ModelSpec.from_json(a.to_json()) == a
    fp8 = a.with_kv_dtype("fp8")
    assert fp8.kv_dtype == "fp8" and fp8.kv_bytes_per_token() * 2 == a.kv_bytes_per_token()
    assert fp8 != a
    with pytest.raises(kvshard.Error):
        a.with_kv_dtype("int3")
    gpt = kvshard.catalog_model("gpt-oss-120b")
    assert len(kvshard.kv_groups(gpt)) == 2
    assert len(kvshard.kv_groups(gpt.with_full_attention())) == 1


def test_hf_config(tmp_path):
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
        "intermediate_size": 1024, "vocab_size": 1000, "torch_dtype": "bfloat16",
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    m = kvshard.load_hf_config(str(path))
    assert (m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim) == (4, 8, 2, 64)
    assert kvshard.resolve_model(str(tmp_path)) == m
    assert kvshard.parse_hf_config(json.dumps(config), "x").kv_bytes_per_token() == \
        m.kv_bytes_per_token() == 4 * 2 * 2 * 64 * 2
    del config["num_hidden_layers"]
    with pytest.raises(kvshard.Error) as e:
        kvshard.parse_hf_config(json.dumps(config), "mine.json")
    assert "num_hidden_layers" in str(e.value)


def test_parallel_config():
    p = kvshard.ParallelConfig.parse("tp=4,pp=2")
    assert (p.tp, p.pp, p.dp, p.cp, p.ep) == (4, 2, 1, 1, 1)
    assert p == kvshard.ParallelConfig(tp=4, pp=2) == kvshard.parse_parallel_config("pp=2 tp=4")
    assert p == kvshard.ParallelConfig("tp=4,pp=2")
    assert p != kvshard.ParallelConfig(tp=4)
    assert p.world_size == 8 and p.stage_size == 4
    assert str(p) == "dp=1 pp=2 cp=1 tp=4 ep=1"
    assert repr(p) == "ParallelConfig(dp=1, pp=2, cp=1, tp=4, ep=1)"
    assert p.to_dict()["tp"] == 4
    # Rank order: tp fastest, then cp, then pp, then dp.
    assert p.rank_of(pp=1, tp=3) == 7
    assert p.rank_coord(7) == {"rank": 7, "dp": 0, "pp": 1, "cp": 0, "tp": 3, "ep": 0,
                               "ep_group": 3}
    z = kvshard.ParallelConfig(tp=2, cp=4, cp_scheme="zigzag", pp_layers=[])
    assert z.cp_scheme == "zigzag" and "zigzag" in repr(z)
    with pytest.raises(kvshard.Error):
        kvshard.ParallelConfig.parse("tq=4")
    with pytest.raises(kvshard.Error):
        kvshard.ParallelConfig(tp=0)
    with pytest.raises(kvshard.Error):
        p.rank_coord(8)


def test_layout():
    layout = kvshard.make_layout("llama-3.1-70b", "tp=16")
    assert layout.world_size == 16
    # 8 KV heads over 16 TP ranks: each head on two ranks.
    assert layout.kv_heads_per_rank == 1 and layout.head_replication == 2
    assert layout.model == kvshard.catalog_model("llama-3.1-70b")
    assert layout.parallel == kvshard.ParallelConfig(tp=16)
    r = layout.ranks
    assert len(r) == 16 and r[0]["kv_heads"] == [0] and r[1]["kv_heads"] == [0]
    assert r[2]["kv_heads"] == [1]
    assert layout == kvshard.make_layout("llama-3.1-70b", kvshard.ParallelConfig(tp=16))
    assert layout != kvshard.make_layout("llama-3.1-70b", "tp=8")
    per_token = r[0]["kv_bytes_per_token"]
    assert per_token == 80 * 2 * 1 * 128 * 2
    # 100 tokens in blocks of 16: 7 blocks.
    assert layout.request_kv_bytes(0, 100, 16) == 7 * 16 * per_token
    assert layout.request_kv_bytes_peak(0, 100, 16) >= layout.request_kv_bytes(0, 100, 16)
    assert "world_size=16" in repr(layout)
    with pytest.raises(kvshard.Error):
        layout.request_kv_bytes(16, 100)
    with pytest.raises(kvshard.Error) as e:
        kvshard.make_layout("llama-3.1-70b", "tp=12")
    assert "tp" in str(e.value)
    with pytest.raises(kvshard.Error):
        kvshard.validate("llama-3.1-70b", "tp=12")
    kvshard.validate("llama-3.1-70b", "tp=8")


def test_decoder_layers_of_several_cache_layers():
    # Falcon-H1-7B: 44 decoder layers, each an attention and a Mamba-2 cache layer; PP splits the
    # decoder layers as vLLM's get_pp_indices (44 on pp=3: 15, 15, 14).
    m = kvshard.load_hf_config(str(SOURCE_DIR / "tests/data/hf_configs/falcon-h1-7b-instruct.json"))
    assert (m.num_decoder_layers, m.cache_layers_per_decoder_layer, m.num_layers) == (44, 2, 88)
    assert kvshard.pp_layer_split(m, "pp=3") == [15, 15, 14]
    assert kvshard.pp_cache_layer_split(m, "pp=3") == [30, 30, 28]
    assert m.kv_bytes_per_token() == 44 * 2 * 2 * 128 * 2
    assert kvshard.catalog_model("llama-3.1-70b").num_decoder_layers == 80
    # The repr says decoder layers x cache layers, as `kvshard layout` does, not an unlabelled 88.
    assert "decoder_layers=44 x 2," in repr(m) and "layers=88" not in repr(m)
    assert "layers=80," in repr(kvshard.catalog_model("llama-3.1-70b"))


def test_layout_helpers():
    m = kvshard.catalog_model("llama-3.1-70b")
    tps = kvshard.valid_tp_sizes(m)
    assert 8 in tps and 16 in tps and 12 not in tps
    split = kvshard.pp_layer_split(m, "pp=3")
    assert sum(split) == 80 and max(split) - min(split) <= 1
    stage = kvshard.pp_stage_kv_bytes(m, "pp=2", 1000)
    assert len(stage) == 2 and sum(stage) == 1000 * m.kv_bytes_per_token()
    assert sum(kvshard.pp_layer_split_kv_balanced(m, "pp=2", 1000)) == 80
    groups = kvshard.kv_groups(kvshard.catalog_model("gpt-oss-120b"))
    assert len(groups) == 2 and {g["kind"] for g in groups} == {"full", "sliding"}
    assert sum(len(g["layers"]) for g in groups) == 36
    p = kvshard.ParallelConfig(cp=4, cp_scheme="zigzag")
    owners = [kvshard.cp_owner(p, 80, t) for t in range(80)]
    # Zigzag: 8 chunks of 10, rank r holds chunks r and 7 - r.
    assert owners[:10] == [0] * 10 and owners[70:] == [0] * 10 and owners[30:40] == [3] * 10
    assert kvshard.cp_token_ranges(p, 0, 80) == [(0, 10), (70, 80)]
    assert "1" in kvshard.cp_token_rule(p, 1)
    with pytest.raises(kvshard.Error):
        kvshard.cp_owner(p, 80, 80)
