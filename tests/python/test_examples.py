"""The Python examples run and check themselves (each asserts its own results)."""

import os
import pathlib
import subprocess
import sys

import kvshard

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "python"


def test_disagg_descriptors_example():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(pathlib.Path(kvshard.__file__).parents[1])
    p = subprocess.run([sys.executable, str(EXAMPLES / "disagg_descriptors.py"), "--model",
                        "llama-3.1-8b", "--prefill", "tp=4", "--decode", "tp=2,pp=2",
                        "--tokens", "500", "--pool-blocks", "256"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "llama-3.1-8b: 500 tokens" in p.stdout and "descriptors" in p.stdout


def test_pack_numpy_example():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(pathlib.Path(kvshard.__file__).parents[1])
    p = subprocess.run([sys.executable, str(EXAMPLES / "pack_numpy.py")], capture_output=True,
                       text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "destination blocks equal the source blocks" in p.stdout
