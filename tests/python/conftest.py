"""Shared fixtures: the CLI of this build (KVSHARD_CLI, set by CTest) and a --json runner."""

import json
import os
import pathlib
import subprocess

import pytest

SOURCE_DIR = pathlib.Path(os.environ.get("KVSHARD_SOURCE_DIR",
                                         pathlib.Path(__file__).resolve().parents[2]))


def cli_path():
    path = os.environ.get("KVSHARD_CLI", str(SOURCE_DIR / "build" / "kvshard"))
    return path if os.path.exists(path) else None


@pytest.fixture(scope="session")
def cli():
    """Runs the CLI; returns (exit code, stdout, stderr)."""
    path = cli_path()
    if path is None:
        pytest.skip("the kvshard CLI was not found (set KVSHARD_CLI)")

    def run(*args):
        p = subprocess.run([path, *args], capture_output=True, text=True, timeout=600)
        return p.returncode, p.stdout, p.stderr

    return run


@pytest.fixture(scope="session")
def cli_json(cli):
    """Runs the CLI with --json and returns the parsed document."""

    def run(*args):
        rc, out, err = cli(*args, "--json")
        assert rc == 0, err
        return json.loads(out)

    return run
