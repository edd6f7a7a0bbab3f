#!/usr/bin/env python3
"""Prefill/decode disaggregation: which bytes go where, as NIXL-style transfer descriptors.

A prefill instance (TP=8) has computed a prompt's KV; a decode instance (TP=4) will continue it.
Each side's scheduler gave the request a block table (here from kvshard's BlockManager, standing in
for vLLM's KVCacheManager / SGLang's token-to-KV pool). kvshard turns the two layouts and block
tables into a transfer plan and then into (src_rank, dst_rank, src_offset, dst_offset, bytes)
descriptors: byte offsets into each rank's KV pool, ready for a NIXL / Mooncake transfer list.

    PYTHONPATH=build/python python3 examples/python/disagg_descriptors.py
"""

import argparse

import numpy as np

import kvshard


def block_table(num_blocks, block_size, seq, prompt, warmup):
    """A scheduler's block table for `prompt` after `warmup` other requests came and went."""
    bm = kvshard.BlockManager(num_blocks, block_size)
    for i, n in enumerate(warmup):
        bm.allocate(1000 + i, np.arange(n, dtype=np.int32) + 10_000 * (i + 1))
    for i in range(0, len(warmup), 2):
        bm.free(1000 + i)  # leaves holes: the request's blocks are not contiguous
    bm.allocate(seq, prompt)
    return bm.block_table(seq)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-70b")
    ap.add_argument("--prefill", default="tp=8", help="prefill layout, e.g. tp=8")
    ap.add_argument("--decode", default="tp=4", help="decode layout, e.g. tp=4 or tp=4,pp=2")
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--pool-blocks", type=int, default=1024, help="blocks in each rank's pool")
    args = ap.parse_args()

    model = kvshard.catalog_model(args.model)
    prefill = kvshard.make_layout(model, args.prefill)
    decode = kvshard.make_layout(model, args.decode)
    prompt = np.random.default_rng(0).integers(0, 128_000, args.tokens, dtype=np.int32)
    src_table = block_table(args.pool_blocks, args.block_size, 1, prompt, [700, 300, 900])
    dst_table = block_table(args.pool_blocks, args.block_size, 1, prompt, [500, 1200])

    plan = kvshard.transfer_plan(prefill, decode, args.tokens,
                                 src_block_size=args.block_size, dst_block_size=args.block_size,
                                 src_block_tables=[src_table], dst_block_tables=[dst_table])
    desc = kvshard.transfer_descriptors(plan, src_pool_blocks=args.pool_blocks,
                                        dst_pool_blocks=args.pool_blocks)
    d = desc.descriptors
    print(f"{model.name}: {args.tokens} tokens, {prefill.parallel} -> {decode.parallel}")
    print(f"prefill blocks {src_table[:6].tolist()}..., decode blocks {dst_table[:6].tolist()}...")
    print(f"{plan.num_messages} messages, {plan.bytes / 2**20:.1f} MiB "
          f"(minimum {plan.min_bytes / 2**20:.1f} MiB), {desc.descriptor_count} descriptors "
          f"(one per block and layer would be {desc.per_block_descriptor_count})")
    print(f"{'src':>4} {'dst':>4} {'descriptors':>11} {'MiB':>8}")
    for src in range(prefill.world_size):
        for dst in np.unique(d["dst_rank"][d["src_rank"] == src]):
            sel = (d["src_rank"] == src) & (d["dst_rank"] == dst)
            print(f"{src:>4} {dst:>4} {int(sel.sum()):>11} {d['bytes'][sel].sum() / 2**20:>8.2f}")
    print("first descriptors (byte offsets into the ranks' pools):")
    for row in d[:4]:
        print(f"  rank {row['src_rank']} +{row['src_offset']} -> rank {row['dst_rank']} "
              f"+{row['dst_offset']}: {row['bytes']} B")
    # Every byte the decode side needs arrives exactly once.
    assert int(d["bytes"].sum()) == plan.bytes
    assert all(plan.needed_bytes(r) > 0 for r in range(decode.world_size))


if __name__ == "__main__":
    main()
