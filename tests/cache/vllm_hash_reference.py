#!/usr/bin/env python3
"""Reference block hashes written from vLLM's definition, for tests/cache/vllm_hash_test.cpp.

vLLM (docs/router.md cites the files and the commit):
  sha256(x)       = hashlib.sha256(pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)).digest()
  sha256_cbor(x)  = hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()
  xxhash(x)       = xxhash.xxh3_128_digest(pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL))
  xxhash_cbor(x)  = xxhash.xxh3_128_digest(cbor2.dumps(x, canonical=True))
  sha256_cbor_64bit(x) = int.from_bytes(sha256_cbor(x), "big") & (2**64 - 1)   (vLLM v0.10: an
                    int, chained as an int; written here as its 8 bytes big-endian)
  NONE_HASH       = hash_fn(os.environ["PYTHONHASHSEED"])          (init_none_hash)
  block i         = hash_fn((parent, tuple(tokens of block i), extra_keys or None))
  extra_keys      = [lora_name] if LoRA, then [cache_salt] on the block at token 0 if salt
  event id        = int.from_bytes(digest, "big") & (2**64 - 1)     (maybe_convert_block_hash)

Reads a JSON list of cases from the file named by argv[1]; each case has "scheme"
("vllm-sha256" | "vllm-sha256-cbor" | "vllm-xxhash" | "vllm-xxhash-cbor" |
"vllm-sha256-cbor-64bit"), either "seed" (a
string) or "parent" (hex), "block_size", "tokens", and optional "lora_name", "cache_salt". Writes a
JSON list: per case {"root": hex, "blocks": [{"digest": hex, "id": int, "encoded": hex}]}, only
full blocks; "encoded" is what the scheme hashes (pickle protocol 5, or canonical CBOR).

A case may add "group_block_sizes": [B, ...], each a multiple k of "block_size" (vLLM's
hash_block_size, the granularity of a request's block hashes when KV cache groups have different
block sizes). Block j of a group of B = k * block_size tokens is then, as a KV event carries it
(vllm/v1/core/kv_cache_utils.py, BlockHashListWithBlockSize; the two revisions of it):
  select:  digest (j + 1) * k - 1, the hash_block_size hash at the block's end (newer)
  concat:  b"".join(digests j * k .. (j + 1) * k - 1) (older)
and the output gains "groups": [{"block_size": B, "select_ids": [int], "concat_hex": [hex],
"concat_ids": [int]}] (ids as maybe_convert_block_hash gives them; not for the 64-bit int scheme,
which predates hash_block_size).
"""
import hashlib
import json
import pickle
import sys

import cbor2
import xxhash


def encode_for(scheme):
    if "-cbor" in scheme:
        return lambda obj: cbor2.dumps(obj, canonical=True)
    return lambda obj: pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def hash_fn_for(scheme):
    if scheme == "vllm-sha256":
        return lambda obj: hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    if scheme == "vllm-xxhash":
        return lambda obj: xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    if scheme == "vllm-sha256-cbor-64bit":
        # vLLM v0.10 (PR #20511): an int, chained as an int.
        return lambda obj: int.from_bytes(
            hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest(), "big") & ((1 << 64) - 1)
    if scheme == "vllm-sha256-cbor":
        return lambda obj: hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()
    if scheme == "vllm-xxhash-cbor":
        return lambda obj: xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))
    raise ValueError(scheme)


def extra_keys_for(case, start_token):
    keys = []
    if case.get("lora_name"):
        keys.append(case["lora_name"])
    if start_token == 0 and case.get("cache_salt"):
        keys.append(case["cache_salt"])
    return tuple(keys) if keys else None


def as_bytes(digest):
    return digest.to_bytes(8, "big") if isinstance(digest, int) else digest


def run_case(case):
    hash_fn = hash_fn_for(case["scheme"])
    if "seed" in case:
        root = hash_fn(case["seed"])
    else:
        root = bytes.fromhex(case["parent"])
        if case["scheme"] == "vllm-sha256-cbor-64bit":
            root = int.from_bytes(root, "big")
    bs = case["block_size"]
    tokens = case["tokens"]
    parent = root
    blocks = []
    for start in range(0, len(tokens) - bs + 1, bs):
        obj = (parent, tuple(tokens[start:start + bs]), extra_keys_for(case, start))
        digest = hash_fn(obj)
        blocks.append({
            "digest": as_bytes(digest).hex(),
            "id": int.from_bytes(as_bytes(digest), "big") & ((1 << 64) - 1),
            "encoded": encode_for(case["scheme"])(obj).hex(),
        })
        parent = digest
    out = {"root": as_bytes(root).hex(), "blocks": blocks}
    if "group_block_sizes" in case:
        digests = [bytes.fromhex(b["digest"]) for b in blocks]
        groups = []
        for gbs in case["group_block_sizes"]:
            assert gbs % bs == 0, (gbs, bs)
            k = gbs // bs
            n = len(digests) // k
            select = [digests[(j + 1) * k - 1] for j in range(n)]
            concat = [b"".join(digests[j * k:(j + 1) * k]) for j in range(n)]
            groups.append({
                "block_size": gbs,
                "select_ids": [event_id(d) for d in select],
                "concat_hex": [d.hex() for d in concat],
                "concat_ids": [event_id(d) for d in concat],
            })
        out["groups"] = groups
    return out


def event_id(digest):
    return int.from_bytes(digest, "big") & ((1 << 64) - 1)


def main():
    with open(sys.argv[1], encoding="utf-8") as f:
        cases = json.load(f)
    json.dump([run_case(c) for c in cases], sys.stdout)


if __name__ == "__main__":
    main()
