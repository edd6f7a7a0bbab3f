#!/usr/bin/env python3
"""Starts `mpirun -np N kvshard run --backend mpi ...`, then really stops (SIGSTOP) or kills
(SIGKILL) the process of one rank while the run is going, and checks that the job ends by itself
with an error that names that rank.

usage: stop_rank.py MPIRUN KVSHARD SIGNAL RANK NP [kvshard run arguments...]

SIGNAL is STOP or KILL. The rank's process is found among mpirun's descendants by the
OMPI_COMM_WORLD_RANK in its environment. The job must end within a bound (a hang fails the test;
the bound is not a performance figure). Exit 0 when the checks hold, 1 otherwise.
"""
import os
import signal
import subprocess
import sys
import time


def descendants(pid):
    children = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in children.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def rank_of(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    for kv in env:
        if kv.startswith(b"OMPI_COMM_WORLD_RANK="):
            return int(kv.split(b"=", 1)[1])
    return None


def main():
    mpirun, kvshard, sig_name, rank, np_ = sys.argv[1:6]
    rank, np_ = int(rank), int(np_)
    args = sys.argv[6:]
    cmd = [mpirun, "-np", str(np_), "--oversubscribe", kvshard] + args
    print("running:", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # Wait until every rank's process exists, then give the run time to be under way.
    target = None
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        ranks = {rank_of(p): p for p in descendants(proc.pid)}
        if all(r in ranks for r in range(np_)):
            target = ranks[rank]
            break
        time.sleep(0.1)
    if target is None:
        print("FAIL: the rank processes did not appear", proc.communicate()[0])
        return 1
    time.sleep(2.0)
    if proc.poll() is not None:
        print("FAIL: the run ended before the signal; make it longer\n", proc.communicate()[0])
        return 1
    sig = signal.SIGSTOP if sig_name == "STOP" else signal.SIGKILL
    print(f"sending SIG{sig_name} to rank {rank} (pid {target})", flush=True)
    os.kill(target, sig)
    t0 = time.time()
    try:
        out, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        for p in descendants(proc.pid):
            os.kill(p, signal.SIGKILL)
        proc.kill()
        print("FAIL: the job did not end within 90 s after the signal", proc.communicate()[0])
        return 1
    print(out)
    print(f"job ended {time.time() - t0:.1f} s after the signal, exit status {proc.returncode}")
    ok = proc.returncode != 0
    if sig_name == "STOP":
        # Every other rank names the stopped one.
        for r in range(np_):
            if r == rank:
                continue
            line = f"kvshard: rank {r}: error: "
            named = [l for l in out.splitlines() if l.startswith(line) and "timeout" in l]
            if not named:
                print(f"FAIL: no timeout error from rank {r}")
                ok = False
            elif not any(f"rank(s) {rank} did not answer" in l for l in named):
                print(f"FAIL: rank {r}'s error does not name rank {rank}: {named}")
                ok = False
    else:
        # mpirun ends the job when a process dies and names it.
        if f"rank {rank}" not in out or "signal 9" not in out:
            print(f"FAIL: the output does not name rank {rank} killed by signal 9")
            ok = False
    for p in descendants(proc.pid) + [target]:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
