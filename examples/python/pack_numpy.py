#!/usr/bin/env python3
"""Reshape KV from a TP=2 prefill to a TP=1 decode with numpy pools: pack, send, unpack.

Each rank's KV pool is a numpy array [layers, K/V, blocks, heads, block_size, head_dim] (HND, as
pool_geometry says), the shape a vLLM / SGLang engine's per-layer caches take when stacked.
kvshard packs each message of the transfer plan from the source pool into one contiguous payload
(what goes on the wire) and unpacks it into the destination pool.

    PYTHONPATH=build/python python3 examples/python/pack_numpy.py
"""

import numpy as np

import kvshard


def pool(plan, source, rank, num_blocks):
    # [layers, K/V, blocks, heads, block_size, head_dim] of the KV dtype (the "tiny" model keeps
    # fp32 KV), 64-byte aligned, so that pack and unpack work on it in place (a plain np.zeros
    # array works too, through a copy per call).
    return kvshard.pool_array(plan, source, rank, num_blocks)


def main():
    model = kvshard.catalog_model("tiny")
    prefill, decode = kvshard.make_layout(model, "tp=2"), kvshard.make_layout(model, "tp=1")
    tokens, num_blocks = 48, 8
    plan = kvshard.transfer_plan(prefill, decode, tokens,
                                 src_block_tables=[[5, 1, 7]], dst_block_tables=[[2, 6, 0]])
    rng = np.random.default_rng(0)
    src = [pool(plan, True, r, num_blocks) for r in range(prefill.world_size)]
    for p in src:
        p[:] = rng.standard_normal(p.shape, dtype=np.float32)
    dst = pool(plan, False, 0, num_blocks)

    for i, msg in enumerate(plan.messages()):
        payload = kvshard.pack_message(plan, i, src[msg["src"]])  # bytes on the wire
        kvshard.unpack_message(plan, i, payload, dst)
        print(f"message {i}: rank {msg['src']} -> rank {msg['dst']}, heads {msg['heads']}, "
              f"layers {msg['layers']}, {payload.nbytes} B")

    # Decode block j holds what prefill block j held, the two ranks' heads side by side.
    for j, (s, d) in enumerate(zip([5, 1, 7], [2, 6, 0])):
        want = np.concatenate([p[:, :, s] for p in src], axis=2)
        assert np.array_equal(dst[:, :, d], want), j
    print(f"{tokens} tokens of {model.name} moved {prefill.parallel} -> {decode.parallel}: "
          f"{plan.bytes} B, destination blocks equal the source blocks")


if __name__ == "__main__":
    main()
