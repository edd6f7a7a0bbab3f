#!/usr/bin/env python3
"""A stand-in for vLLM's KV event publisher, for the tests of tests/router/.

It writes vLLM's wire format from vLLM's schema (vllm/distributed/kv_events.py; docs/router.md
names the revision): msgspec tagged structs with omit_defaults, encoded with msgpack the way
msgspec encodes them (shortest ints, float64, str8+, bin for bytes), either positional
(array_like=True: [tag, field1, field2, ...], trailing defaults omitted) or as maps
({"type": tag, field: value, ...}, defaults omitted); the EventBatch in the same form.

An event spec (JSON) is {"tag": ..., <field>: <value>, ..., "_fields": n (optional: write only the
first n positional fields, as an older vLLM revision with fewer fields did)}. A hash given as
{"hex": "..."} is sent as bytes. A batch spec is {"ts": float, "events": [...], "dp": int|null,
"form": "positional"|"map"}.

  encode FILE        prints a JSON list of hex payloads, one per batch spec in FILE
  replay EP FROM     asks the replay (ROUTER) socket at EP for every batch from FROM, as a vLLM
                     consumer does (DEALER: "", FROM as 8 bytes BE), and prints one JSON line:
                     [[seq, decoded batch], ...] up to the end marker (seq -1)
  serve [PREFIX]     binds XPUB (and a ROUTER replay socket) on 127.0.0.1, prints
                     "ports PUB REPLAY" (with PREFIX: on ipc://PREFIX.pub and ipc://PREFIX.replay,
                     prints "ipc PUB_EP REPLAY_EP"), waits for a subscriber ("subscribed"), then reads JSON
                     commands from stdin, one per line, answering "ok" after each:
                       {"seq": n, "batch": spec, "topic": "...", "drop": bool}
                           (drop: keep for replay, do not publish: a lost message)
                       {"frames_hex": ["..", ...]}    (any frames, e.g. malformed ones)
"""
import json
import sys
import threading

import msgpack
import zmq

REQUIRED = object()

# Field order and defaults of each struct, as declared in kv_events.py.
SCHEMA = {
    "BlockStored": [
        ("block_hashes", REQUIRED), ("parent_block_hash", REQUIRED), ("token_ids", REQUIRED),
        ("block_size", REQUIRED), ("lora_id", REQUIRED), ("medium", REQUIRED),
        ("lora_name", REQUIRED), ("extra_keys", None), ("group_idx", None),
        ("kv_cache_spec_kind", None), ("kv_cache_spec_sliding_window", None),
    ],
    "BlockRemoved": [("block_hashes", REQUIRED), ("medium", REQUIRED), ("group_idx", None)],
    "AllBlocksCleared": [],
}
BATCH = [("ts", REQUIRED), ("events", REQUIRED), ("data_parallel_rank", None)]


def wire_value(v):
    if isinstance(v, dict) and set(v) == {"hex"}:
        return bytes.fromhex(v["hex"])
    if isinstance(v, list):
        return [wire_value(x) for x in v]
    return v


def struct(fields, values, form, tag=None, limit=None):
    """msgspec's encoding of a struct with omit_defaults (and tag=True when tag is given)."""
    if limit is not None:
        fields = fields[:limit]
    vals = []
    for name, default in fields:
        if name in values:
            vals.append((name, values[name]))
        elif default is REQUIRED:
            raise ValueError(f"missing required field {name}")
        else:
            vals.append((name, default))
    if form == "map":
        out = {}
        if tag is not None:
            out["type"] = tag
        defaults = dict(fields)
        for name, v in vals:
            if defaults[name] is REQUIRED or v != defaults[name]:
                out[name] = v
        return out
    # Positional: trailing fields equal to their default are left off.
    while vals:
        name, v = vals[-1]
        default = dict(fields)[name]
        if default is not REQUIRED and v == default:
            vals.pop()
        else:
            break
    return ([tag] if tag is not None else []) + [v for _, v in vals]


def prompt_fields(p):
    """block_hashes, parent_block_hash, token_ids, block_size of blocks [first, first + count) of
    a prompt, hashed as vLLM does (tests/cache/vllm_hash_reference.py), with the request's
    optional "lora_name" and "cache_salt" as extra keys."""
    import os
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cache"))
    import vllm_hash_reference as ref
    case = {"scheme": p["scheme"], "seed": p["seed"], "block_size": p["block_size"],
            "tokens": p["tokens"], "lora_name": p.get("lora_name"),
            "cache_salt": p.get("cache_salt")}
    blocks = ref.run_case(case)["blocks"]
    first, count, bs = p["first"], p["count"], p["block_size"]
    return {
        "block_hashes": [b["id"] for b in blocks[first:first + count]],
        "parent_block_hash": blocks[first - 1]["id"] if first > 0 else None,
        "token_ids": p["tokens"][first * bs:(first + count) * bs],
        "block_size": bs,
    }


def encode_event(spec, form):
    if "_prompt" in spec:
        spec = {**prompt_fields(spec["_prompt"]), **spec}
    tag = spec["tag"]
    values = {k: wire_value(v) for k, v in spec.items() if not k.startswith("_") and k != "tag"}
    return struct(SCHEMA[tag], values, form, tag=tag, limit=spec.get("_fields"))


def encode_batch(spec):
    form = spec.get("form", "positional")
    values = {"ts": float(spec["ts"]), "events": [encode_event(e, form) for e in spec["events"]]}
    if spec.get("dp") is not None:
        values["data_parallel_rank"] = spec["dp"]
    return msgpack.packb(struct(BATCH, values, form), use_bin_type=True)


def serve(ipc_prefix=None):
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.XPUB)  # a PUB that also tells when a subscriber has joined
    replay = ctx.socket(zmq.ROUTER)
    if ipc_prefix:
        pub.bind(f"ipc://{ipc_prefix}.pub")
        replay.bind(f"ipc://{ipc_prefix}.replay")
        print(f"ipc ipc://{ipc_prefix}.pub ipc://{ipc_prefix}.replay", flush=True)
    else:
        pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
        replay_port = replay.bind_to_random_port("tcp://127.0.0.1")
        print(f"ports {pub_port} {replay_port}", flush=True)
    pub.recv()  # the subscription message
    print("subscribed", flush=True)

    buffer = []
    lock = threading.Lock()
    stop = threading.Event()

    def replay_loop():
        while not stop.is_set():
            if not replay.poll(50):
                continue
            frames = replay.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            with lock:
                todo = [(s, p) for s, p in buffer if s >= start_seq]
            for s, p in todo:
                replay.send_multipart((client, b"", s.to_bytes(8, "big"), p))
            replay.send_multipart((client, b"", (-1).to_bytes(8, "big", signed=True), b""))

    t = threading.Thread(target=replay_loop, daemon=True)
    t.start()
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        cmd = json.loads(line)
        if "frames_hex" in cmd:
            pub.send_multipart([bytes.fromhex(f) for f in cmd["frames_hex"]])
        else:
            payload = encode_batch(cmd["batch"])
            seq = cmd["seq"]
            with lock:
                buffer.append((seq, payload))
            if not cmd.get("drop"):
                topic = cmd.get("topic", "").encode()
                pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
        print("ok", flush=True)
    stop.set()
    t.join()


def replay_request(endpoint, start):
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart((b"", start.to_bytes(8, "big")))
    out = []
    while True:
        if not dealer.poll(10000):
            raise SystemExit("no replay answer within 10 s")
        _, seq, payload = dealer.recv_multipart()
        seq = int.from_bytes(seq, "big", signed=True)
        if seq == -1:
            break
        batch = msgpack.unpackb(payload, raw=False)
        out.append([seq, batch])
    print(json.dumps(out), flush=True)


def main():
    if sys.argv[1] == "replay":
        replay_request(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1] == "encode":
        with open(sys.argv[2], encoding="utf-8") as f:
            specs = json.load(f)
        json.dump([encode_batch(s).hex() for s in specs], sys.stdout)
    elif sys.argv[1] == "serve":
        serve(sys.argv[2] if len(sys.argv) > 2 else None)
    else:
        raise SystemExit("usage: vllm_event_publisher.py encode FILE | replay EP FROM | "
                         "serve [IPC_PREFIX]")


if __name__ == "__main__":
    main()
