"""README's CLI tour is real output: every `$ kvshard ...` line of its code blocks is run here and its
output compared with the lines that follow it, so that a change of the CLI's output that leaves the
README behind fails. Conventions of the README that the comparison follows:
- a line `...` (indented or not) stands for any number of lines (an elided part of a long table);
- `; echo "exit $?"` after a command: the exit code is printed after the output;
- `--svg PATH`: the chart goes to a temporary file instead (and "Chart written to PATH" names it);
- `kvshard run` prints wall times and rates, and its verify line a floating-point error that depends
  on the order threads add in: on its `prefill:`, `decode:`, `transfer:` and `verify:` lines numbers
  are compared as numbers' places, not values (the rest of its output, e.g. the per-rank KV bytes
  against the layout's prediction and the generated tokens, exactly).
"""

import re
import shlex
import subprocess

import pytest

from conftest import SOURCE_DIR, cli_path

EXIT_SUFFIX = '; echo "exit $?"'
TIMED_LINE = re.compile(r"^(prefill|decode|transfer|verify):")
NUMBER = re.compile(r"\d+(\.\d+)?(e[-+]?\d+)?")


def readme_commands():
    """(command, expected output lines) for every `$ kvshard` line of README's code blocks."""
    text = (SOURCE_DIR / "README.md").read_text()
    found = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        lines = block.rstrip("\n").split("\n")
        i = 0
        while i < len(lines):
            if not lines[i].startswith("$ kvshard "):
                i += 1
                continue
            j = i + 1
            while j < len(lines) and not lines[j].startswith("$ "):
                j += 1
            expected = lines[i + 1:j]
            while expected and expected[-1] == "":
                expected.pop()
            found.append((lines[i][2:], expected))
            i = j
    return found


def matches(expected, got):
    """Whether `got` equals `expected`, each `...` line of expected standing for any lines."""
    memo = {}

    def match(e, g):
        if (e, g) not in memo:
            if e == len(expected):
                memo[e, g] = g == len(got)
            elif expected[e].strip() == "...":
                memo[e, g] = any(match(e + 1, k) for k in range(g, len(got) + 1))
            else:
                memo[e, g] = g < len(got) and expected[e] == got[g] and match(e + 1, g + 1)
        return memo[e, g]

    return match(0, 0)


def mask_times(lines):
    return [NUMBER.sub("#", l) if TIMED_LINE.match(l) else l for l in lines]


COMMANDS = readme_commands()


def test_readme_has_a_cli_tour():
    assert len(COMMANDS) >= 30
    assert any(c.startswith("kvshard plan ") for c, _ in COMMANDS)


def test_matcher():
    assert matches(["a", "...", "d"], ["a", "b", "c", "d"])
    assert matches(["a", "...", "d"], ["a", "d"])
    assert not matches(["a", "...", "d"], ["a", "b", "c"])
    assert not matches(["a", "b"], ["a", "b", "c"])
    assert matches(["a", "    ...", "d"], ["a", "b", "d"])
    assert mask_times(["decode: 14 tokens in 0.79 ms", "rank 0"]) == ["decode: # tokens in # ms",
                                                                      "rank 0"]


@pytest.mark.parametrize("command,expected", COMMANDS, ids=[c for c, _ in COMMANDS])
def test_readme_output_is_real(command, expected, tmp_path):
    path = cli_path()
    if path is None:
        pytest.skip("the kvshard CLI was not found (set KVSHARD_CLI)")
    echo_exit = command.endswith(EXIT_SUFFIX)
    args = shlex.split(command[:-len(EXIT_SUFFIX)] if echo_exit else command)[1:]
    if "--svg" in args:
        k = args.index("--svg") + 1
        documented, args[k] = args[k], str(tmp_path / "chart.svg")
        expected = [l.replace(documented, args[k]) for l in expected]
    p = subprocess.run([path, *args], capture_output=True, text=True, timeout=600, cwd=SOURCE_DIR)
    got = (p.stdout + p.stderr).rstrip("\n").split("\n") if p.stdout + p.stderr else []
    if echo_exit:
        got.append(f"exit {p.returncode}")
    else:
        assert p.returncode == 0, p.stderr
    if args[0] == "run":
        expected, got = mask_times(expected), mask_times(got)
    assert matches(expected, got), "\n".join(["README says:", *expected, "", "the CLI printed:", *got])


def test_readme_python_session_is_real():
    """The README's Python session (the code block of `>>> ` lines) runs as a doctest."""
    import doctest

    text = (SOURCE_DIR / "README.md").read_text()
    sessions = [b for b in re.findall(r"```[a-z]*\n(.*?)```", text, re.S) if b.startswith(">>> ")]
    assert sessions, "README has no Python session"
    for i, block in enumerate(sessions):
        test = doctest.DocTestParser().get_doctest(block, {}, f"README session {i}", "README.md", 0)
        assert len(test.examples) >= 5
        runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
        runner.run(test)
        assert runner.failures == 0, f"README's Python session {i}: see the doctest report above"
