"""Transfer plans and descriptors through the Python API."""

import numpy as np
import pytest

import kvshard


def layouts(model, src, dst):
    return kvshard.make_layout(model, src), kvshard.make_layout(model, dst)


def test_transfer_plan_tp8_to_tp4():
    m = kvshard.catalog_model("llama-3.1-8b")
    src, dst = layouts(m, "tp=8", "tp=4")
    plan = kvshard.transfer_plan(src, dst, 1024)
    # Every byte of KV moves once: layers * 2 * heads * head_dim * 2 B per token.
    assert plan.bytes == plan.min_bytes == 1024 * m.kv_bytes_per_token()
    assert plan.num_tokens == 1024 and plan.executable()
    assert plan.src_layout == src and plan.dst_layout == dst
    # Each decode rank gathers two prefill ranks' heads.
    assert all(len(plan.messages_to(r)) == 2 for r in range(4))
    assert sum(plan.needed_bytes(r) for r in range(4)) == plan.bytes
    msgs = plan.messages()
    assert len(msgs) == plan.num_messages == 8
    assert [msgs[i]["dst"] for i in plan.messages_to(3)] == [3, 3]
    assert plan.mode() in ("pre-send", "post-receive")
    counts = plan.copy_counts("pre-send")
    assert counts["pack"] > 0 and counts["unpack"] > 0
    assert plan.tail_bytes() >= 0
    assert "tokens=1024" in repr(plan)
    with pytest.raises(kvshard.Error):
        plan.needed_bytes(4)
    with pytest.raises(kvshard.Error):
        plan.mode("sideways")


def test_transfer_plan_block_tables():
    src, dst = layouts("llama-3.1-8b", "tp=2", "tp=2")
    n = 64  # 4 blocks of 16
    seq = kvshard.transfer_plan(src, dst, n)
    shuffled = kvshard.transfer_plan(src, dst, n, src_block_tables=[[3, 2, 1, 0]],
                                     dst_block_tables=[np.array([7, 5, 6, 4], dtype=np.int32)])
    assert shuffled.bytes == seq.bytes
    assert shuffled.num_messages == seq.num_messages == 2
    for i in range(shuffled.num_messages):
        pieces = shuffled.pieces(i)
        assert int(pieces["count"].sum()) == n == shuffled.messages()[i]["tokens"]
        # Source token block j lives in src table[j], destination block j in dst table[j].
        for p in pieces:
            j = p["token_begin"] // 16
            assert p["src_block"] == [3, 2, 1, 0][j] and p["dst_block"] == [7, 5, 6, 4][j]
    with pytest.raises(kvshard.Error):
        shuffled.pieces(2)
    with pytest.raises(kvshard.Error):
        kvshard.transfer_plan(src, dst, n, src_block_tables=[[0]])  # too short
    with pytest.raises(kvshard.Error):
        kvshard.transfer_plan(src, dst, 0)


def test_descriptors():
    m = kvshard.catalog_model("llama-3.1-8b")
    src, dst = layouts(m, "tp=8", "tp=4")
    plan = kvshard.transfer_plan(src, dst, 1024)
    d = kvshard.transfer_descriptors(plan)
    a = d.descriptors
    assert a.dtype.names == ("src_rank", "dst_rank", "layer_group", "src_offset", "dst_offset",
                             "bytes")
    assert len(a) == d.descriptor_count and int(a["bytes"].sum()) == d.bytes == plan.bytes
    assert set(a["src_rank"]) == set(range(8)) and set(a["dst_rank"]) == set(range(4))
    # Pool to pool per block: 8 source ranks x 32 layers x K,V x 64 blocks.
    assert d.per_block_descriptor_count == 8 * 32 * 2 * 64
    g = d.groups
    assert int(g["count"].sum()) == d.descriptor_count and int(g["bytes"].sum()) == d.bytes
    assert d.fewer_mode in ("pre-send", "post-receive")
    assert d.to_dict()["descriptor_count"] == d.descriptor_count
    few = kvshard.transfer_descriptors(plan, max_listed=3)
    assert len(few.descriptors) == 3 and few.descriptor_count == d.descriptor_count
    assert np.array_equal(few.descriptors, a[:3])
    assert "count=" in repr(d)
    with pytest.raises(kvshard.Error):
        kvshard.transfer_descriptors(plan, max_listed=-2)
