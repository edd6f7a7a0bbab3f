#!/usr/bin/env python3
"""What the Python API costs over the C++ library, measured in the same process.

    PYTHONPATH=build/python /usr/bin/python3 bench/bench_python.py [--repeats N]

(a) Call overhead: a few typical calls (a layout, a routing decision, a small transfer plan) timed
    from Python, next to the same C++ call run in a C++ loop over the same values
    (kvshard._kvshard._bench), and a binding that does nothing (the floor of any call into the
    module).
(b) Pack of a 64 MiB message from numpy pools: kvshard.pack_message called from Python, next to
    the C++ pack_message loop over the very same arrays, and memcpy of the same bytes (the
    physical ceiling: glibc's memcpy from the same pool array into the same payload array), in
    the same run. Also the paths that cost more: a payload array allocated
    per call (no out=), and a plain numpy pool, which numpy places 16 bytes past a 64-byte
    boundary, so it is copied into a kvshard pool on every call.

Times are this thread's CPU time (time.thread_time / CLOCK_THREAD_CPUTIME_ID; the machine is
shared, so time spent descheduled does not count; page faults do), best of --repeats rounds, the
cases interleaved within each round. A benchmark, not a test: nothing here asserts a duration.
"""

import argparse
import os
import platform
import time

import numpy as np

import kvshard
from kvshard import _kvshard

B = _kvshard._bench


def py_per_call(fn, iterations):
    """Seconds of thread CPU time per call of fn() from a Python loop."""
    t0 = time.thread_time()
    for _ in range(iterations):
        fn()
    return (time.thread_time() - t0) / iterations


def best(rounds, cases):
    """cases: name -> callable returning seconds per call; the best of `rounds` interleaved."""
    out = {name: float("inf") for name in cases}
    for _ in range(rounds):
        for name, run in cases.items():
            out[name] = min(out[name], run())
    return out


def call_overhead(rounds):
    model = kvshard.catalog_model("llama-3.1-70b")
    tp8 = kvshard.ParallelConfig(tp=8)
    n = 20000

    small = kvshard.catalog_model("small-100m")
    src, dst = kvshard.make_layout(small, "tp=2"), kvshard.make_layout(small, "tp=1")
    plan_tokens, plan_n = 1024, 20000

    replicas, block = 8, 16
    router = kvshard.Router(replicas, "kvshard")
    prompt = np.arange(64 * block, dtype=np.int32)  # 64 full blocks
    hashes = kvshard.hash_token_blocks(prompt, block)
    for r in range(replicas):  # replica r holds the first 8 r blocks of the prompt
        if r:
            router.index.block_stored(r, hashes[: 8 * r])
    loads = [kvshard.ReplicaLoad(queued_prefill_tokens=100 * r, active_blocks=50,
                                 capacity_blocks=1000) for r in range(replicas)]
    route_n = 20000
    assert router.route(hashes, len(prompt), loads)["replica"] >= 0

    rows = [
        ("no-op binding (the floor)", lambda: py_per_call(B.noop, n), None),
        ("make_layout(ModelSpec, ParallelConfig), 70B tp8",
         lambda: py_per_call(lambda: kvshard.make_layout(model, tp8), n),
         lambda: B.make_layout(model, tp8, n)),
        ('make_layout("llama-3.1-70b", "tp=8") (str conversions)',
         lambda: py_per_call(lambda: kvshard.make_layout("llama-3.1-70b", "tp=8"), n),
         lambda: B.make_layout(model, tp8, n)),
        ("Router.route, 8 replicas, 64-block prompt",
         lambda: py_per_call(lambda: router.route(hashes, len(prompt), loads), route_n),
         lambda: B.route(router, hashes, len(prompt), loads, route_n)),
        ("transfer_plan, small-100m tp2 -> tp1, 1024 tokens",
         lambda: py_per_call(lambda: kvshard.transfer_plan(src, dst, plan_tokens), plan_n),
         lambda: B.transfer_plan(src, dst, plan_tokens, plan_n)),
    ]
    cases = {}
    for name, py, cpp in rows:
        cases[(name, "py")] = py
        if cpp:
            cases[(name, "cpp")] = cpp
    t = best(rounds, cases)
    print("(a) call overhead, us per call (thread CPU time, best of %d)" % rounds)
    print(f"{'call':58} {'Python':>9} {'C++':>9} {'overhead':>9}")
    for name, _, cpp in rows:
        p = t[(name, "py")] * 1e6
        if cpp:
            c = t[(name, "cpp")] * 1e6
            print(f"{name:58} {p:9.2f} {c:9.2f} {p - c:9.2f}")
        else:
            print(f"{name:58} {p:9.2f} {'-':>9} {p:9.2f}")


def pack(rounds):
    # llama-3.1-8b TP=8 -> TP=4: each prefill rank holds one KV head (16 KiB per token over 32
    # layers), so message 0 of a 4096-token request is one 64 MiB payload.
    model = kvshard.catalog_model("llama-3.1-8b")
    tokens = 4096
    plan = kvshard.transfer_plan(kvshard.make_layout(model, "tp=8"),
                                 kvshard.make_layout(model, "tp=4"), tokens)
    msg = plan.messages()[0]
    nbytes = msg["bytes"]
    blocks = tokens // 16
    mode = "pre-send"

    pool = kvshard.pool_array(plan, True, msg["src"], blocks)  # 64-byte aligned: read in place
    pool.reshape(-1).view(np.uint8)[:] = np.random.default_rng(0).integers(
        0, 256, pool.nbytes, dtype=np.uint8)
    plain = np.zeros(pool.shape, pool.dtype)  # numpy's own placement: 16 bytes past 64
    plain[...] = pool
    out = np.empty(nbytes, np.uint8)
    out[...] = 1
    assert pool.nbytes == nbytes  # the pool holds exactly the message: memcpy pool -> out

    # Same bytes on every path.
    want = kvshard.pack_message(plan, 0, plain, mode)
    assert np.array_equal(kvshard.pack_message(plan, 0, pool, mode, out=out), want)
    B.pack_message(plan, 0, pool, out, mode, 1)
    assert np.array_equal(out, want)

    n = 5
    cases = {
        "C++ pack_message loop (same arrays)": lambda: B.pack_message(plan, 0, pool, out, mode, n),
        "Python pack_message(pool_array, out=)":
            lambda: py_per_call(lambda: kvshard.pack_message(plan, 0, pool, mode, out=out), n),
        "Python pack_message(pool_array), new payload per call":
            lambda: py_per_call(lambda: kvshard.pack_message(plan, 0, pool, mode), n),
        "Python pack_message(np.zeros pool), new payload":
            lambda: py_per_call(lambda: kvshard.pack_message(plan, 0, plain, mode), n),
        "memcpy of the same bytes (ceiling)": lambda: B.memcpy(out, pool, n),
    }
    t = best(rounds, cases)
    cpp = t["C++ pack_message loop (same arrays)"]
    ceiling = t["memcpy of the same bytes (ceiling)"]
    print()
    print(f"(b) pack of one {nbytes / 2**20:.0f} MiB message (llama-3.1-8b tp8 -> tp4, {tokens} "
          f"tokens, {mode}), thread CPU time, best of {rounds} rounds of {n}")
    print(f"{'path':56} {'ms':>8} {'GB/s':>7} {'C++/this':>9} {'memcpy/this':>12}")
    for name, s in t.items():
        print(f"{name:56} {s * 1e3:8.2f} {nbytes / s / 1e9:7.2f} {cpp / s:9.3f} "
              f"{ceiling / s:12.3f}")
    print(f"pool_array base % 64 = {pool.ctypes.data % 64}, np.zeros pool base % 64 = "
          f"{plain.ctypes.data % 64}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=9, help="rounds; the best of them is shown")
    args = ap.parse_args()
    print(f"kvshard {kvshard.__version__}, Python {platform.python_version()}, numpy "
          f"{np.__version__}, {os.cpu_count()} CPUs, load average "
          f"{' '.join('%.1f' % x for x in os.getloadavg())}")
    call_overhead(args.repeats)
    pack(args.repeats)


if __name__ == "__main__":
    main()
