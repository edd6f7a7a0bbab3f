"""Block hashing, the block manager, KV events and the router through the Python API."""

import hashlib
import json

import numpy as np
import pytest

import kvshard

cbor2 = pytest.importorskip("cbor2")


def test_hash_token_blocks():
    tokens = list(range(40))
    h = kvshard.hash_token_blocks(tokens, 16)
    assert len(h) == 2 and all(len(x) == 32 for x in h)  # the partial block is not hashed
    assert kvshard.hash_token_blocks(np.arange(40, dtype=np.int64), 16) == h
    # Chained: the second block's hash depends on the first block's tokens.
    assert kvshard.hash_token_blocks([1] + tokens[1:], 16)[1] != h[1]
    assert kvshard.hash_token_blocks(tokens, 16, cache_salt="s")[0] != h[0]
    with pytest.raises(kvshard.Error):
        kvshard.hash_token_blocks(tokens, 0)


def test_vllm_hashes_match_python():
    scheme = "vllm-sha256-cbor"
    assert scheme in kvshard.vllm_hash_schemes()
    # vLLM: NONE_HASH = sha256_cbor(PYTHONHASHSEED); block = sha256_cbor((parent, tokens, extra)).
    root = kvshard.vllm_none_hash(scheme, "0")
    assert root == hashlib.sha256(cbor2.dumps("0", canonical=True)).digest()
    tokens = list(range(100, 132))
    want0 = hashlib.sha256(cbor2.dumps((root, tuple(tokens[:16]), None), canonical=True)).digest()
    want1 = hashlib.sha256(cbor2.dumps((want0, tuple(tokens[16:]), None), canonical=True)).digest()
    assert kvshard.vllm_hash_block(scheme, root, tokens[:16]) == want0
    assert kvshard.vllm_hash_blocks(tokens, 16, root=root) == [want0, want1]
    assert kvshard.vllm_block_cbor(root, tokens[:16]) == cbor2.dumps((root, tuple(tokens[:16]), None),
                                                                     canonical=True)
    salted = hashlib.sha256(cbor2.dumps((root, tuple(tokens[:16]), ("salt",)),
                                        canonical=True)).digest()
    assert kvshard.vllm_hash_block(scheme, root, tokens[:16], ["salt"]) == salted
    assert kvshard.vllm_hash_blocks(tokens, 16, root=root, cache_salt="salt")[0] == salted
    assert kvshard.vllm_event_id(want0) == int.from_bytes(want0, "big") & (2**64 - 1)
    assert len(kvshard.vllm_none_hash("vllm-xxhash-cbor", "0")) == 16
    with pytest.raises(kvshard.Error):
        kvshard.vllm_none_hash("md5", "0")
    with pytest.raises(kvshard.Error):
        kvshard.vllm_hash_block(scheme, b"", tokens[:16])


def _vllm_pickle_chain(hash_fn, root, tokens, block_size, lora_name="", cache_salt=""):
    """vLLM's hash_block_tokens chain with generate_block_hash_extra_keys' LoRA name and salt."""
    parent, out = root, []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        keys = ([lora_name] if lora_name else []) + ([cache_salt] if start == 0 and cache_salt
                                                     else [])
        parent = hash_fn((parent, tuple(tokens[start:start + block_size]),
                          tuple(keys) if keys else None))
        out.append(parent)
    return out


def test_vllm_pickle_bytes_are_pythons():
    """vllm_block_pickle writes pickle.dumps(..., protocol=pickle.HIGHEST_PROTOCOL) byte for byte:
    token counts across TUPLE1-3 / MARK..TUPLE and 64 KiB frames, token ids across BININT1 /
    BININT2 / BININT, extra keys of every length class (SHORT_BINUNICODE, BINUNICODE, and one of
    64 KiB or more written outside any frame)."""
    import pickle
    import random
    assert pickle.HIGHEST_PROTOCOL == 5
    rng = random.Random(11)
    edges = [0, 1, 255, 256, 65535, 65536, 2**31 - 1]
    parents = [b"\x01", bytes(range(16)), bytes(range(32))]
    keys = [[], ["a"], ["lora", "salt"], ["l\u00f6ra-\u65e5"], ["x" * 255], ["y" * 256, "z"],
            ["k" * 70000], ["1", "2", "3", "4"]]
    counts = [0, 1, 2, 3, 4, 5, 16, 255, 256, 1000]
    # Frames are cut before the next object once 64 KiB are written: around 13,100 5-byte ints
    # (BININT), 21,830 3-byte ones, 32,750 2-byte ones.
    counts += list(range(13095, 13105)) + [21830, 21831, 32749, 32750, 32751, 40000, 70000]
    checked = 0
    for n in counts:
        for width in (1, 3, 5, None):
            if width == 1:
                tokens = [rng.randrange(256) for _ in range(n)]
            elif width == 3:
                tokens = [rng.randrange(256, 65536) for _ in range(n)]
            elif width == 5:
                tokens = [rng.randrange(65536, 2**31) for _ in range(n)]
            else:
                tokens = [rng.choice(edges) for _ in range(n)]
            parent = parents[checked % len(parents)]
            extra = keys[checked % len(keys)] if n < 5000 else keys[checked % 3]
            want = pickle.dumps((parent, tuple(tokens), tuple(extra) if extra else None),
                                protocol=pickle.HIGHEST_PROTOCOL)
            got = kvshard.vllm_block_pickle(parent, tokens, extra)
            assert got == want, (n, width, extra[:1])
            checked += 1
    for extra in keys:
        want = pickle.dumps((parents[2], (7, 8), tuple(extra) if extra else None), protocol=5)
        assert kvshard.vllm_block_pickle(parents[2], [7, 8], extra) == want


def test_vllm_pickle_schemes_match_hashlib_and_xxhash():
    """vLLM's default sha256 and its xxhash: the digest of the pickle, NONE_HASH = hash_fn(seed),
    the event id = the digest's low 64 bits big-endian."""
    import pickle
    xxhash = pytest.importorskip("xxhash")

    def sha256(x):
        return hashlib.sha256(pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)).digest()

    def xxh(x):
        return xxhash.xxh3_128_digest(pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL))

    rng = np.random.default_rng(5)
    for scheme, fn, size in (("vllm-sha256", sha256, 32), ("vllm-xxhash", xxh, 16)):
        assert scheme in kvshard.vllm_hash_schemes()
        for seed in ("0", "", "42", "s" * 300):
            assert kvshard.vllm_none_hash(scheme, seed) == fn(seed)
        root = kvshard.vllm_none_hash(scheme, "0")
        assert len(root) == size
        for bs, n in ((16, 50), (1, 5), (300, 600), (4, 8)):
            tokens = [int(t) for t in rng.integers(0, 200000, n)]
            for lora, salt in (("", ""), ("adapterA", ""), ("", "salt1"), ("ad", "s")):
                want = _vllm_pickle_chain(fn, root, tokens, bs, lora, salt)
                got = kvshard.vllm_hash_blocks(tokens, bs, scheme=scheme, root=root,
                                               lora_name=lora, cache_salt=salt)
                assert got == want, (scheme, bs, lora, salt)
                assert [kvshard.vllm_event_id(h) for h in got] == [
                    int.from_bytes(h, "big") & (2**64 - 1) for h in want]
        assert kvshard.vllm_hash_block(scheme, root, [1, 2, 3], ["k"]) == fn((root, (1, 2, 3),
                                                                                ("k",)))


def test_vllm_sha256_cbor_64bit_matches_vllm_v0_10():
    """vLLM v0.10's sha256_cbor_64bit (PR #20511): the low 64 bits of SHA-256 of the canonical CBOR,
    an int, chained as an int; NONE_HASH = the same of the seed; events carry the int itself."""
    def fn(x):
        return int.from_bytes(hashlib.sha256(cbor2.dumps(x, canonical=True)).digest(),
                              "big") & (2**64 - 1)

    scheme = "vllm-sha256-cbor-64bit"
    assert scheme in kvshard.vllm_hash_schemes()
    root = kvshard.vllm_none_hash(scheme, "0")
    assert root == fn("0").to_bytes(8, "big")
    tokens = [7, 300, 70000, 2**31 - 1] * 8
    for salt in ("", "tenant"):
        parent, want = fn("0"), []
        for start in range(0, len(tokens), 4):
            extra = (salt,) if salt and start == 0 else None
            obj = (parent, tuple(tokens[start:start + 4]), extra)
            if start == 0:
                got_enc = kvshard.vllm_block_encoding(scheme, root, tokens[:4],
                                                      [salt] if salt else [])
                assert got_enc == cbor2.dumps(obj, canonical=True)
            parent = fn(obj)
            want.append(parent)
        got = kvshard.vllm_hash_blocks(tokens, 4, scheme=scheme, root=root, cache_salt=salt)
        assert [kvshard.vllm_event_id(h) for h in got] == want
    with pytest.raises(kvshard.Error, match="lora_int_id"):
        kvshard.vllm_hash_blocks(tokens, 4, scheme=scheme, root=root, lora_name="a")


def test_block_manager_prefix_cache_and_events():
    bm = kvshard.BlockManager(num_blocks=8, block_size=4)
    events = []
    sub = bm.subscribe(events.append)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    r = bm.allocate(1, prompt)
    assert r == {"cached_tokens": 0, "cached_blocks": 0, "new_blocks": 3}
    assert 1 in bm and 2 not in bm
    table = bm.block_table(1)
    assert table.dtype == np.int32 and len(table) == 3 and len(set(table)) == 3
    assert bm.num_tokens(1) == 10
    assert bm.block_hashes(1) == kvshard.hash_token_blocks(prompt, 4)
    stored = [e for e in events if e["type"] == "BlockStored"]
    assert stored and [h for e in stored for h in e["block_hashes"]] == bm.block_hashes(1)
    # A second sequence with the same prefix shares the two full blocks.
    r2 = bm.allocate(2, prompt[:8] + [99, 98])
    assert r2["cached_tokens"] == 8 and r2["cached_blocks"] == 2 and r2["new_blocks"] == 1
    assert list(bm.block_table(2)[:2]) == list(table[:2])
    assert bm.ref_count(int(table[0])) == 2 and bm.block_state(int(table[0])) == "used"
    assert bm.lookup(prompt)["num_tokens"] == 8
    bm.append(1, [10, 11])  # completes block 3 of seq 1
    assert bm.num_tokens(1) == 12 and len(bm.block_hashes(1)) == 3
    bm.append_tokens(2, 1)
    assert bm.can_append(2, 1) and bm.can_allocate([1, 2, 3])
    # Like vLLM's BlockPool.reset_prefix_cache (vllm/v1/core/block_pool.py): refused, with no
    # event, while blocks are in use.
    n_events = len(events)
    assert bm.clear_cache() is False and len(events) == n_events
    bm.free(1)
    bm.free(2)
    m = bm.metrics()
    assert m["used_blocks"] == 0 and m["cached_blocks"] > 0 and m["hit_tokens"] == 8
    assert m["token_hit_rate"] == pytest.approx(8 / 20)
    assert bm.eviction_order() and bm.block_state(bm.eviction_order()[0]) == "cached"
    bm.check_invariants()
    assert bm.clear_cache() is True
    assert events[-1]["type"] == "AllCleared"
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(seqs) and bm.next_event_seq == seqs[-1] + 1
    bm.unsubscribe(sub)
    n = len(events)
    bm.allocate(3, prompt)
    assert len(events) == n
    assert bm.num_available_blocks == 8 - 3 and "num_blocks=8" in repr(bm)
    with pytest.raises(kvshard.OutOfBlocksError) as e:
        bm.allocate(4, list(range(500, 524)))  # 6 blocks, 5 available
    assert isinstance(e.value, kvshard.Error)
    with pytest.raises(kvshard.Error):
        bm.free(12345)
    with pytest.raises(kvshard.Error):
        bm.allocate(5, list(range(100)))  # longer than the whole pool


def test_kv_events_and_index():
    bm = kvshard.BlockManager(num_blocks=8, block_size=4)
    events = []
    bm.subscribe(events.append)
    bm.allocate(1, list(range(8)))
    line = kvshard.kv_event_to_json(events[0])
    assert json.loads(line) == events[0]
    assert kvshard.kv_event_from_json(line) == events[0]
    assert json.loads(kvshard.kv_event_to_json(line, "engine-0"))["source"] == "engine-0"
    idx = kvshard.KvEventIndex()
    for e in events:
        idx.apply(e)
    hashes = bm.block_hashes(1)
    assert len(idx) == 2 and hashes[0] in idx and idx.next_seq == events[-1]["seq"] + 1
    assert idx.match_length(hashes + ["0" * 32]) == 2
    with pytest.raises(kvshard.Error):
        kvshard.kv_event_from_json('{"seq": 1, "type": "Nope"}')


def test_kv_index_and_router():
    names = kvshard.routing_policy_names()
    assert {"round-robin", "least-loaded", "cache-aware", "cost", "kvshard"} <= set(names)
    hashes = kvshard.hash_token_blocks(list(range(64)), 16)
    idx = kvshard.KvIndex(3)
    idx.block_stored(2, hashes[:3])
    assert idx.prefix_overlap(hashes) == [0, 0, 3]
    assert idx.contains(2, hashes[0]) and not idx.contains(1, hashes[0])
    assert idx.num_blocks(2) == 3 and idx.num_hashes == 3 and idx.mode == "exact"
    idx.block_removed(2, hashes[2:3])
    assert idx.prefix_overlap(hashes) == [0, 0, 2]
    idx.all_cleared(2)
    assert idx.num_hashes == 0
    # A hybrid model: a second KV group bounds the prefix; as a 1-block window it needs only the
    # block before the hit.
    idx.block_stored(0, hashes)
    idx.block_stored(0, hashes[3:4], group=1)
    assert idx.prefix_overlap(hashes)[0] == 0
    assert idx.contains(0, hashes[3], group=1) and not idx.contains(0, hashes[0], group=1)
    idx.set_group_window(0, 1, 1)
    assert idx.prefix_overlap(hashes)[0] == 4
    idx.set_group_full(0, 1)
    assert idx.prefix_overlap(hashes)[0] == 0
    # Blocks of 2 router blocks (vLLM's hash_block_size): group 1's block 1 is hash 3, its end.
    idx.block_stored(0, hashes[1:2], group=1)
    idx.set_group_block_scale(0, 1, 2)
    assert idx.group_block_scale(0, 1) == 2 and idx.prefix_overlap(hashes)[0] == 4
    idx.set_group_block_scale(0, 1, 1)
    idx.all_cleared(0)
    bm = kvshard.BlockManager(num_blocks=8, block_size=16)
    events = []
    bm.subscribe(events.append)
    bm.allocate(1, list(range(64)))
    for e in events:
        idx.apply(1, e)
    assert idx.prefix_overlap(hashes) == [0, 4, 0]
    approx = kvshard.KvIndex(2, mode="approximate", ttl_s=10)
    approx.record_routed(0, hashes, 0.0)
    assert approx.prefix_overlap(hashes) == [4, 0]
    approx.expire(11.0)
    assert approx.prefix_overlap(hashes) == [0, 0]
    with pytest.raises(kvshard.Error):
        kvshard.KvIndex(0)
    with pytest.raises(kvshard.Error):
        idx.num_blocks(3)

    router = kvshard.Router(3, "kvshard", kvshard.PolicyParams(block_tokens=16))
    assert router.policy == "kvshard" and router.num_replicas == 3
    router.index.block_stored(1, hashes)
    d = router.route(hashes, 65)
    assert d["replica"] == 1 and d["matched_blocks"] == 4
    # 64 tokens are exactly 4 blocks: vLLM recomputes the last token, so the hit is 3 blocks
    # (vllm/v1/core/kv_cache_manager.py, get_computed_blocks: max_cache_hit_length = num_tokens - 1).
    assert router.route(hashes, 64)["matched_blocks"] == 3
    assert kvshard.vllm_max_cache_hit_blocks(64, 16) == 3
    # An engine drafting with EAGLE/MTP pops one more block (vllm/v1/core/
    # single_type_kv_cache_manager.py, find_longest_cache_hit: drop_eagle_block).
    assert kvshard.vllm_eagle_block_drop("eagle3") and not kvshard.vllm_eagle_block_drop("ngram")
    with pytest.raises(kvshard.Error, match="unknown speculative method 'Eagle'"):
        kvshard.vllm_eagle_block_drop("Eagle")
    router.index.set_eagle_block_drop(1, True)
    assert router.index.eagle_block_drop(1) and not router.index.eagle_block_drop(0)
    assert router.route(hashes, 65)["matched_blocks"] == 3
    assert router.route(hashes, 64)["matched_blocks"] == 2
    router.index.set_eagle_block_drop(1, False)
    busy = [kvshard.ReplicaLoad(), kvshard.ReplicaLoad(queued_prefill_tokens=10**7),
            kvshard.ReplicaLoad()]
    spilled = router.route(hashes, 64, busy)
    assert spilled["replica"] != 1
    # More hashes than the token count has blocks (here: a forgotten count) is refused.
    with pytest.raises(kvshard.Error, match="4 block hashes for a prompt of 0 tokens"):
        router.route(hashes, 0)
    rr = kvshard.Router(3, "round-robin", kvshard.PolicyParams(block_tokens=16))
    assert [rr.route(hashes, 64)["replica"] for _ in range(4)] == [0, 1, 2, 0]
    pure = kvshard.decide_route("least-loaded", hashes, 64, [0, 0, 0],
                                [kvshard.ReplicaLoad(active_blocks=5), kvshard.ReplicaLoad(),
                                 kvshard.ReplicaLoad(active_blocks=5)])
    assert pure["replica"] == 1 and pure["reason"] == "least-loaded"
    assert kvshard.ReplicaLoad(active_blocks=1) == kvshard.ReplicaLoad(active_blocks=1)
    with pytest.raises(kvshard.Error):
        kvshard.Router(3, "random")
    with pytest.raises(kvshard.Error):
        kvshard.PolicyParams(no_such_knob=1)
    with pytest.raises(kvshard.Error):
        router.route(hashes, 64, busy[:2])


def test_kv_group_manager_windows_hits_and_events():
    groups = [{"kind": "full", "num_blocks": 16},
              {"kind": "sliding", "window": 8, "num_blocks": 16}]
    k = kvshard.KvGroupManager(groups, 4)
    assert k.num_groups == 2 and k.block_size == 4
    assert k.group(1) == {"kind": "sliding", "window": 8, "num_blocks": 16}
    assert "sliding(8)" in repr(k)
    events = []
    k.subscribe(events.append)
    tokens = np.arange(20, dtype=np.int32)
    r = k.allocate(1, tokens)
    assert r["cached_tokens"] == 0 and r["new_blocks"][0] == 5
    # Full attention holds all 5 blocks; the window of 8 keeps tokens [12, 20): blocks 3 and 4.
    full, sliding = k.block_table(0, 1), k.block_table(1, 1)
    assert full.dtype == np.int32 and len(full) == len(sliding) == 5 and (full >= 0).all()
    assert k.keep_from(1, 20, 20) == 3
    assert list(sliding[:3]) == [-1, -1, -1] and (sliding[3:] >= 0).all()
    assert k.resident_blocks(0, 1) == 5 and k.resident_blocks(1, 1) == 2
    assert k.num_used_blocks(0) == 5 and k.num_used_blocks(1) == 2
    assert k.num_available_blocks(0) == 11
    assert k.block_state(0, int(full[0])) == "used" and k.ref_count(0, int(full[0])) == 1
    pk = k.paged_kv(0, [1])
    assert list(pk["indptr"]) == [0, 5] and list(pk["indices"]) == list(full)
    assert list(pk["last_page_len"]) == [4]
    assert 1 in k and k.num_tokens(1) == 20 and k.num_committed_tokens(1) == 20
    assert k.can_append(1, 4)
    k.append(1, [20, 21, 22, 23])
    assert len(k.block_table(0, 1)) == 6 and k.resident_blocks(1, 1) == 2
    assert events and all(e["type"] in ("BlockStored", "BlockRemoved", "AllCleared")
                          for e in events)
    assert any(e.get("group") == 1 for e in events)  # events name their group
    k.free(1)
    assert 1 not in k and k.eviction_order(0)
    # A second request with the same prompt: the hybrid hit is the longest prefix of whole
    # blocks both groups serve (the sliding group kept the last window's blocks cached).
    hit = k.lookup(tokens)
    assert 0 < hit <= 20 and hit % 4 == 0
    assert k.can_allocate(tokens)
    assert k.allocate(2, tokens)["cached_tokens"] == hit
    k.check_invariants()
    with pytest.raises(kvshard.Error):
        k.allocate(2, tokens)  # sequence exists
    with pytest.raises(kvshard.Error):
        k.group(2)
    with pytest.raises(kvshard.Error):
        k.block_table(0, 99)
    with pytest.raises(kvshard.Error):
        kvshard.KvGroupManager([{"kind": "sliding", "num_blocks": 4}])  # no window
    with pytest.raises(kvshard.Error):
        kvshard.KvGroupManager([{"kind": "full", "num_blocks": 4, "windw": 2}])


def test_kv_group_manager_from_model_and_out_of_blocks():
    model = kvshard.catalog_model("tiny-swa")  # 2 sliding(8) + 2 full layers
    k = kvshard.KvGroupManager(model, 4, 4)
    kinds = sorted(k.group(g)["kind"] for g in range(k.num_groups))
    assert kinds == sorted(g["kind"] for g in kvshard.kv_groups(model)) == ["full", "sliding"]
    assert all(k.group(g)["num_blocks"] == 4 for g in range(k.num_groups))
    k.allocate(1, list(range(16)))  # 4 blocks of the full group: all of them
    assert not k.can_allocate([1, 2, 3])
    with pytest.raises(kvshard.OutOfBlocksError):
        k.allocate(2, [1, 2, 3])
    assert 2 not in k  # nothing changed
    # A state group cannot use the prefix cache.
    with pytest.raises(kvshard.Error):
        kvshard.KvGroupManager("tiny-hybrid", 4)
    assert kvshard.KvGroupManager("tiny-hybrid", 4, enable_prefix_cache=False).num_groups == 2


def test_block_hashes_from_any_sequence_of_hex_strings():
    hashes = kvshard.hash_token_blocks(np.arange(64, dtype=np.int32), 16)
    idx = kvshard.KvIndex(2)
    idx.block_stored(1, hashes[:3])
    for seq in (hashes, tuple(hashes), np.array(hashes)):
        assert idx.prefix_overlap(seq) == [0, 3]
    with pytest.raises(TypeError):
        idx.prefix_overlap(hashes[0])  # one string, not a sequence of them
    with pytest.raises(TypeError):
        idx.prefix_overlap([1, 2])
    with pytest.raises(kvshard.Error):
        idx.prefix_overlap(["zz"])


def test_engines_without_pythonhashseed_use_vllms_default_seed(cli_json, cli):
    """vLLM's sha256 schemes derive NONE_HASH from DEFAULT_NONE_HASH_SEED = "vllm-none-hash" when
    PYTHONHASHSEED is unset (resolve_none_hash_seed); `kvshard hash` without --hash-seed matches
    that chain, computed here with cbor2 + hashlib; xxhash without a seed is refused."""
    tokens = [5, 6, 7, 8, 9, 10, 11, 12]
    root = hashlib.sha256(cbor2.dumps("vllm-none-hash", canonical=True)).digest()
    b0 = hashlib.sha256(cbor2.dumps((root, tuple(tokens[:4]), None), canonical=True)).digest()
    b1 = hashlib.sha256(cbor2.dumps((b0, tuple(tokens[4:]), None), canonical=True)).digest()
    doc = cli_json("hash", "--scheme", "vllm-sha256-cbor", "--block-size", "4", "--tokens",
                   ",".join(map(str, tokens)))
    assert [b["digest"] for b in doc["blocks"]] == [b0.hex(), b1.hex()]
    rc, _, err = cli("hash", "--scheme", "vllm-xxhash-cbor", "--block-size", "4", "--tokens", "1,2,3,4")
    assert rc == 2 and "PYTHONHASHSEED" in err
