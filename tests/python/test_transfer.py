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


def coded_pool(geometry, num_blocks, rank):
    """A float32 pool whose every element encodes (rank, layer, kv, block, head, slot, dim)."""
    g = geometry
    shape = (g["num_layers"], g["kv_factor"], num_blocks, g["num_heads"], g["block_size"],
             g["head_dim"])
    idx = np.indices(shape)
    code = rank
    for axis, size in enumerate(shape):
        code = code * size + idx[axis]
    return (code + 1).astype(np.float32)


def test_pack_unpack_numpy_pools_tp2_to_tp1():
    m = kvshard.catalog_model("tiny")  # fp32 KV, 4 KV heads
    src, dst = layouts(m, "tp=2", "tp=1")
    n, blocks = 64, 4  # 4 full blocks of 16 on each side, tables 0..3
    plan = kvshard.transfer_plan(src, dst, n)
    g0 = kvshard.pool_geometry(plan, True, 0)
    assert g0["num_heads"] == 2 and g0["dtype"] == "fp32" and g0["order"] == "hnd"
    pools = [coded_pool(kvshard.pool_geometry(plan, True, r), blocks, r) for r in range(2)]
    gd = kvshard.pool_geometry(plan, False, 0)
    out = np.zeros((gd["num_layers"], gd["kv_factor"], blocks, gd["num_heads"], gd["block_size"],
                    gd["head_dim"]), dtype=np.float32)
    for mode in ("pre-send", "post-receive"):
        out[:] = 0
        for i, msg in enumerate(plan.messages()):
            payload = kvshard.pack_message(plan, i, pools[msg["src"]], mode)
            assert payload.dtype == np.uint8 and payload.nbytes == msg["bytes"]
            kvshard.unpack_message(plan, i, payload, out, mode)
        # TP=1 holds all 4 heads: rank 0's heads 0-1 then rank 1's heads 2-3, value for value.
        assert np.array_equal(out, np.concatenate(pools, axis=3)), mode
    with pytest.raises(kvshard.Error):
        kvshard.pack_message(plan, 0, pools[0][:, :, :1].copy()[..., :3])  # not whole blocks
    with pytest.raises(kvshard.Error):
        kvshard.unpack_message(plan, 0, np.zeros(3, np.uint8), out)
    with pytest.raises(kvshard.Error):
        kvshard.pack_message(plan, 2, pools[0])


def _at_offset(shape, dtype, offset):
    """A zeroed C-contiguous array whose data starts `offset` bytes past a 64-byte boundary."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.zeros(n + 128, dtype=np.uint8)
    start = (-raw.ctypes.data) % 64 + offset
    return raw[start:start + n].view(dtype).reshape(shape)


def test_pack_unpack_in_place_and_through_a_copy_agree():
    # A 64-byte aligned array is the pool itself (ExternalMemory, zero copy); another is copied.
    m = kvshard.catalog_model("tiny")
    src, dst = layouts(m, "tp=2", "tp=1")
    n, blocks = 64, 4
    plan = kvshard.transfer_plan(src, dst, n)
    gd = kvshard.pool_geometry(plan, False, 0)
    shape = (gd["num_layers"], gd["kv_factor"], blocks, gd["num_heads"], gd["block_size"],
             gd["head_dim"])
    results = []
    for offset in (0, 4):
        pools = []
        for r in range(2):
            g = kvshard.pool_geometry(plan, True, r)
            p = _at_offset((g["num_layers"], g["kv_factor"], blocks, g["num_heads"],
                            g["block_size"], g["head_dim"]), np.float32, offset)
            p[:] = coded_pool(g, blocks, r)
            pools.append(p)
        out = _at_offset(shape, np.float32, offset)
        assert (out.ctypes.data % 64 == 0) == (offset == 0)
        for i, msg in enumerate(plan.messages()):
            kvshard.unpack_message(plan, i, kvshard.pack_message(plan, i, pools[msg["src"]]), out)
        assert np.array_equal(out, np.concatenate(pools, axis=3)), offset
        results.append(out.copy())
    assert np.array_equal(results[0], results[1])


def test_pool_array_and_pack_into_out():
    m = kvshard.catalog_model("tiny")
    src, dst = layouts(m, "tp=2", "tp=1")
    n, blocks = 64, 4
    plan = kvshard.transfer_plan(src, dst, n)
    g = kvshard.pool_geometry(plan, True, 0)
    p = kvshard.pool_array(plan, True, 0, blocks)
    # Aligned (read and written in place), zeroed, the geometry's shape and dtype.
    assert p.ctypes.data % 64 == 0 and p.flags["C_CONTIGUOUS"] and not p.any()
    assert p.shape == (g["num_layers"], g["kv_factor"], blocks, g["num_heads"], g["block_size"],
                       g["head_dim"]) and p.dtype == np.float32
    assert p.nbytes == blocks * g["block_bytes"]
    p[...] = coded_pool(g, blocks, 0)
    want = kvshard.pack_message(plan, 0, p)
    # out=: written in place and returned; any dtype of exactly the message's bytes.
    out = np.full(want.nbytes, 0xAB, np.uint8)
    got = kvshard.pack_message(plan, 0, p, out=out)
    assert got is out and np.array_equal(out, want)
    out32 = np.zeros(want.nbytes // 4, np.float32)
    kvshard.pack_message(plan, 0, p, "pre-send", out=out32)
    assert np.array_equal(out32.view(np.uint8), kvshard.pack_message(plan, 0, p, "pre-send"))
    # A bf16 model's pools hold the bf16 bits as uint16 (numpy has no bfloat16); NHD swaps axes.
    b = kvshard.transfer_plan(*layouts("llama-3.1-8b", "tp=8", "tp=4"), 32, dst_order="nhd")
    assert kvshard.pool_array(b, True, 0, 2).dtype == np.uint16
    gd = kvshard.pool_geometry(b, False, 0)
    assert kvshard.pool_array(b, False, 0, 2).shape == (
        gd["num_layers"], gd["kv_factor"], 2, gd["block_size"], gd["num_heads"], gd["head_dim"])
    with pytest.raises(kvshard.Error):
        kvshard.pack_message(plan, 0, p, out=np.zeros(want.nbytes + 1, np.uint8))
    with pytest.raises(kvshard.Error):
        kvshard.pack_message(plan, 0, p, out=np.zeros(2 * want.nbytes, np.uint8)[::2])
    with pytest.raises(kvshard.Error):
        kvshard.pack_message(plan, 0, p, out=bytearray(want.nbytes))
    with pytest.raises(kvshard.Error):
        kvshard.pool_array(plan, True, 2, blocks)
    with pytest.raises(kvshard.Error):
        kvshard.pool_array(plan, True, 0, 0)


def test_prefill_into_numpy_pools_then_transfer_equals_own_pools():
    # The engine's side: a TP=2 prefill writes its KV in place into numpy pool arrays (the
    # engine's memory) at the blocks its block table names, then the KV moves to TP=1. Both are
    # byte-identical to the same prefill on kvshard's own pools.
    m = kvshard.catalog_model("tiny")
    src, dst = layouts(m, "tp=2", "tp=1")
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, m.vocab, 40).astype(np.int32)
    bs, blocks = 8, 8
    table = np.array([6, 1, 4, 0, 3], dtype=np.int32)  # 40 tokens: 5 full blocks
    plan = kvshard.transfer_plan(src, dst, len(tokens), src_block_size=bs, dst_block_size=bs,
                                 src_block_tables=[table], dst_block_tables=[[0, 1, 2, 3, 4]])
    pools = [kvshard.pool_array(plan, True, r, blocks) for r in range(2)]
    for p in pools:
        p.fill(-7.0)  # the engine's bytes before the prefill
    logits = kvshard.prefill_into(src, tokens, table, pools, block_size=bs, seed=3)
    own_logits, own = kvshard.prefill_own_pools(src, tokens, table, blocks, block_size=bs, seed=3)
    assert logits.shape == (m.vocab,) and np.array_equal(logits, own_logits)
    for r in range(2):
        mine = pools[r]
        theirs = own[r][0].view(np.float32).reshape(mine.shape)
        assert np.array_equal(mine[:, :, table], theirs[:, :, table]), r
        untouched = np.setdiff1d(np.arange(blocks), table)
        assert np.all(mine[:, :, untouched] == -7.0), r
        assert np.any(mine[:, :, table] != 0.0)
    # The transfer from the engine's arrays and from kvshard's own pools gives the same bytes.
    outs = []
    for srcs in (pools, [own[r][0].view(np.float32).reshape(pools[r].shape) for r in range(2)]):
        out = kvshard.pool_array(plan, False, 0, 5)
        for i, msg in enumerate(plan.messages()):
            kvshard.unpack_message(plan, i, kvshard.pack_message(plan, i, srcs[msg["src"]]), out)
        outs.append(out)
    assert np.array_equal(outs[0], outs[1])
    # TP=1 holds rank 0's heads then rank 1's: the same values as the prefill wrote.
    assert np.array_equal(outs[0], np.concatenate([p[:, :, table] for p in pools], axis=3))
    # The first greedy token equals the CLI's unsharded run of the same weights and prompt.
    assert int(np.argmax(logits)) == int(np.argmax(
        kvshard.prefill_own_pools(dst, tokens, [0, 1, 2, 3, 4], 5, block_size=bs, seed=3)[0]))


def test_prefill_into_refuses_what_it_cannot_write_in_place():
    m = kvshard.catalog_model("tiny")
    src, dst = layouts(m, "tp=2", "tp=1")
    plan = kvshard.transfer_plan(src, dst, 16, src_block_size=8, dst_block_size=8)
    good = [kvshard.pool_array(plan, True, r, 2) for r in range(2)]
    tokens = np.arange(16, dtype=np.int32)
    shifted = _at_offset(good[0].shape, np.float32, 4)  # a copy would leave it unwritten
    with pytest.raises(kvshard.Error, match="64-byte boundary"):
        kvshard.prefill_into(src, tokens, [0, 1], [shifted, good[1]], block_size=8)
    with pytest.raises(kvshard.Error, match="appears twice"):
        kvshard.prefill_into(src, tokens, [1, 1], good, block_size=8)
    with pytest.raises(kvshard.Error, match="memory for 1 rank"):
        kvshard.prefill_into(src, tokens, [0, 1], good[:1], block_size=8)
    with pytest.raises(kvshard.Error, match="outside pool 0's 2 blocks"):
        kvshard.prefill_into(src, tokens, [0, 5], good, block_size=8)
    with pytest.raises(kvshard.Error, match="not a whole number of blocks"):
        kvshard.prefill_into(src, tokens, [0, 1], [good[0].reshape(-1)[:-4], good[1]], block_size=8)
    with pytest.raises(kvshard.Error, match="order must be"):
        kvshard.prefill_into(src, tokens, [0, 1], good, block_size=8, order="xyz")


def carry_out(runs, pool_bytes, wire, pack):
    """The copies of message_copy_runs done one by one with numpy (a copy engine's view)."""
    for r in runs:
        for k in range(int(r["count"])):
            p = int(r["pool"]) + k * int(r["pool_step"])
            w = int(r["wire"]) + k * int(r["wire_step"])
            n = int(r["len"])
            if pack:
                wire[w:w + n] = pool_bytes[p:p + n]
            else:
                pool_bytes[p:p + n] = wire[w:w + n]


@pytest.mark.parametrize("src_par,dst_par,dst_order", [("tp=2", "tp=1", "hnd"),
                                                         ("tp=1", "tp=2", "nhd")])
def test_message_copy_runs_carried_out_equal_pack_and_unpack(src_par, dst_par, dst_order):
    m = kvshard.catalog_model("tiny")
    src, dst = layouts(m, src_par, dst_par)
    n, blocks = 40, 4
    plan = kvshard.transfer_plan(src, dst, n, dst_order=dst_order)
    for i, msg in enumerate(plan.messages()):
        sp = kvshard.pool_array(plan, True, msg["src"], blocks)
        sp[...] = coded_pool(kvshard.pool_geometry(plan, True, msg["src"]), blocks, msg["src"])
        for mode in ("pre-send", "post-receive"):
            runs = kvshard.message_copy_runs(plan, i, mode, source=True, num_blocks=blocks)
            assert runs.dtype.names == ("pool", "pool_step", "wire", "wire_step", "len", "count")
            assert int((runs["len"] * runs["count"]).sum()) == msg["bytes"]
            wire = np.zeros(msg["bytes"], np.uint8)
            carry_out(runs, sp.reshape(-1).view(np.uint8), wire, True)
            assert np.array_equal(wire, kvshard.pack_message(plan, i, sp, mode))
            want = kvshard.pool_array(plan, False, msg["dst"], blocks)
            kvshard.unpack_message(plan, i, wire, want, mode)
            got = kvshard.pool_array(plan, False, msg["dst"], blocks)
            carry_out(kvshard.message_copy_runs(plan, i, mode, source=False, num_blocks=blocks),
                      got.reshape(-1).view(np.uint8), wire, False)
            assert np.array_equal(got, want) and got.any()
    if dst_order == "nhd":  # a transpose: strided runs (count > 1) on the pool side
        runs = kvshard.message_copy_runs(plan, 0, "pre-send", source=True, num_blocks=blocks)
        assert (runs["count"] > 1).any()
    with pytest.raises(kvshard.Error):
        kvshard.message_copy_runs(plan, 0, "sideways", source=True, num_blocks=blocks)
    with pytest.raises(kvshard.Error):
        kvshard.message_copy_runs(plan, 0, source=True, num_blocks=1)  # blocks outside the pool
    with pytest.raises(kvshard.Error):
        kvshard.message_copy_runs(plan, 99, source=True, num_blocks=blocks)
