"""The command line: bad flags exit 2 with one line and no traceback; generate prints its output;
the module starts without importing torch."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from minisgl.frontend.cli import main as cli
from minisgl.frontend.options import Number, NumberList
from minisgl.mechanisms import MECHANISMS

from .conftest import assert_one_line_exit_2, run_cli, tiered

ROOT = Path(__file__).resolve().parents[1]


def run_cli_process(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minisgl", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("extra", [
    ["--max-new-tokens", "0"],
    ["--temperature", "-1"],
    ["--top-p", "2"],
    ["--disable", "warp_drive"],
    ["--prompt", ""],
])
def test_cli_bad_input_exits_2_without_traceback(qwen3, capsys, extra):
    assert_one_line_exit_2(capsys, "generate", "--model", qwen3, "--prompt", "hi", *extra)


@pytest.mark.full  # a fresh interpreter (python -m minisgl); in-process cases run in both tiers
def test_cli_missing_model_exits_2(tmp_path):
    proc = run_cli_process("generate", "--model", str(tmp_path / "missing"), "--prompt", "hi")
    assert proc.returncode == 2
    assert "error" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.full  # a fresh interpreter, as above
def test_cli_generate_prints_output(qwen3):
    proc = run_cli_process("generate", "--model", qwen3, "--prompt", "hello", "--max-new-tokens", "5", "--loop", "normal")
    assert proc.returncode == 0, proc.stderr
    assert "length" in proc.stdout


@pytest.mark.parametrize("argv", [["generate", "--device", "bogus", "--prompt", "hi"],
                                  ["bench", "--num-requests", "-1"], ["bench", "--num-requests", "0"],
                                  ["trace", "--num-requests", "0"]])
def test_cli_bad_device_and_counts_exit_2(qwen3, capsys, argv):
    assert_one_line_exit_2(capsys, *argv, "--model", qwen3)


# train-demo had its own parser outside the CLI's error handling: --steps 0 trained nothing and
# wrote the untrained model (by default over the shipped demo checkpoint), --steps -1 never
# ended, and --batch-size 0, --lr nan or --threads 0 were tracebacks (exit 1).
@pytest.mark.parametrize("bad", [["--steps", "0"], ["--steps", "-1"], ["--batch-size", "0"], ["--lr", "nan"],
                                 ["--threads", "0"], ["--eval", "-1"]])
def test_train_demo_bad_flags_exit_2_and_write_nothing(tmp_path, capsys, bad):
    out = tmp_path / "demo"
    assert_one_line_exit_2(capsys, "train-demo", "--out", str(out), "--steps", "1", "--eval", "0", *bad)
    assert not out.exists()


# `python -m minisgl` imported torch and transformers from minisgl/__init__ before the command
# line's Ctrl-C handling began: a Ctrl-C in those seconds was a traceback, not "interrupted".
def test_the_command_line_module_starts_without_torch():
    import subprocess
    import sys

    code = "import sys, minisgl.__main__; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


# A Ctrl-C after the command had finished landed in the interpreter's clean-up (torch's
# finalizers): a traceback, and exit code 0 (an attack trial, timing a SIGINT just after the
# last line). Once the command returns, SIGINT is ignored: the exit code stands.
def test_a_ctrl_c_after_the_command_is_ignored(tmp_path):
    code = ("import signal, sys; from minisgl.__main__ import main; "
            "assert signal.getsignal(signal.SIGINT) is signal.default_int_handler; "
            f"rc = main(['make-tiny', {str(tmp_path / 'm')!r}, '--preset', 'tiny']); "
            "print(rc, signal.getsignal(signal.SIGINT) is signal.SIG_IGN)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.stdout.split()[-2:] == ["0", "True"], out.stderr


def test_course_commands_run_the_lessons_scripts_without_make(capsys):
    """`python -m minisgl course ...` is the path without make: it lists the lessons, passes a
    hint request on to the exercises' script, and refuses an unknown lesson or command with exit 2."""
    done = subprocess.run([sys.executable, "-m", "minisgl", "course", "lessons"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.splitlines()[0].startswith("Lesson 0"), done.stderr
    done = subprocess.run([sys.executable, "-m", "minisgl", "course", "hint", "1", "--level", "2"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0 and "exercise 1" in done.stdout and "hint 2 of 3" in done.stdout, done.stderr
    assert_one_line_exit_2(capsys, "course", "lesson", "99")
    assert_one_line_exit_2(capsys, "course", "no-such-command")


# Issue 26, finding 11: a switched-off mechanism whose symptom is detected (a double free, lost
# requests, a DeviceError) ended in a traceback. Each switch, and each pair the docs name, either
# runs (exit 0) or reports its symptom in one line naming the switch (exit 1); never a traceback.
SWITCH_CASES = [(name,) for name in MECHANISMS] + [("staging_double_buffer,staging_war_wait",),
                                                   ("row_generation_check,deferred_row_free",)]


@pytest.mark.parametrize("disable", tiered(SWITCH_CASES, [("skip_finished",), ("staging_double_buffer,staging_war_wait",),
                                                          ("row_generation_check,deferred_row_free",)],
                                           id=lambda case: case[0]))
def test_cli_switched_off_mechanism_shows_its_symptom_in_one_line(capsys, disable):
    code, err = run_cli(capsys, "generate", "--disable", disable, "--num-demo-prompts", "16")
    assert not any("Traceback" in line for line in err), err
    if disable == "skip_finished":  # the demo prompts stop on EOS: the late result is freed twice, always
        assert code == 1
    if code != 0:
        assert code == 1 and len(err) == 1 and err[0].startswith("error:") and disable in err[0], (code, err)


# Issue 26, finding 11: every numeric flag of every subcommand, given nan, inf, 0, a negative or a
# huge value, exits 2 with one error line before anything runs (--rate nan spun forever, --rate
# 1e-300 and lab --points 1e300 were OverflowError tracebacks, huge counts ran unbounded). The
# table is built from the parsers, so a new flag is in it; 0 is left out where the flag's own
# range (frontend/options.py) says it is valid (a delay of 0, --eval 0).
def _parsers() -> dict:
    from minisgl.demo.train_demo import parser as train_demo_parser
    from minisgl.frontend.cli import parser

    (sub,) = [a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return {**{name: p for name, p in sub.choices.items() if name not in ("train-demo", "course")},
            "train-demo": train_demo_parser()}


def _numeric_flag_cases() -> list[tuple[str, str, str]]:
    cases = []
    for command, p in _parsers().items():
        for action in p._actions:
            if not action.option_strings or action.nargs == 0 or action.choices:
                continue  # positionals, --help, switches, choices
            assert action.type not in (int, float), f"{command} {action.option_strings[0]}: use options.Number"
            if not isinstance(action.type, (Number, NumberList)):
                continue  # a path, a name, a prompt
            number = action.type.item if isinstance(action.type, NumberList) else action.type
            huge = "9" * 300 if number.kind is int else "1e300"
            for value in ("nan", "inf", "-7", "0", huge):
                if value != "0" or not number.valid(0):
                    cases.append((command, action.option_strings[0], value))
    return cases


NUMERIC_FLAG_CASES = _numeric_flag_cases()
_FIRST_FLAG_OF_EACH_COMMAND = {c for c in NUMERIC_FLAG_CASES
                               if c[1] == next(f for cmd, f, _ in NUMERIC_FLAG_CASES if cmd == c[0])}


@pytest.mark.parametrize("command, flag, value", tiered(NUMERIC_FLAG_CASES, _FIRST_FLAG_OF_EACH_COMMAND,
                                                        id=lambda c: f"{c[0]} {c[1]} {c[2][:6]}"))
def test_every_numeric_flag_refuses_nan_inf_zero_negative_and_huge(capsys, tmp_path, command, flag, value):
    positional = [str(tmp_path / "out")] if command == "make-tiny" else []
    assert_one_line_exit_2(capsys, command, *positional, f"{flag}={value}")
    assert not (tmp_path / "out").exists()


def test_serve_help_gives_the_default_host_and_port(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert exit_.value.code == 0
    assert "--host HOST the address to listen on (default: 127.0.0.1)" in out
    assert "--port PORT the port to listen on (default: 30000)" in out


def test_the_flag_table_covers_every_command():
    assert {c[0] for c in NUMERIC_FLAG_CASES} == set(_parsers()) and len(NUMERIC_FLAG_CASES) > 100


def test_unwritable_json_is_refused_before_the_run(capsys, tmp_path):
    """An output path that cannot be written (here a directory) was reported after the whole run."""
    for argv in (["bench", "--json", str(tmp_path)], ["lab", "--json", str(tmp_path)],
                 ["trace", "--out", str(tmp_path)]):
        code = cli(argv)
        captured = capsys.readouterr()
        assert code == 2 and captured.out == "" and captured.err.startswith("error:"), (argv, captured)


@pytest.mark.parametrize("argv", [
    *(["hint", v] for v in ("nan", "inf", "0", "-1", "1e300", str(10**30), "1.5", "")),
    *(["hint", "1", "--level", v] for v in ("nan", "inf", "0", "-1", "1e300", str(10**30), "1.5", "")),
    *(["check", v] for v in ("nan", "inf", "0", "-1", "1e300", str(10**30), "1.5", "")),
    *(["generate", v] for v in ("nan", "0", "1.5")), *(["wrong", v] for v in ("nan", "0")),
])
def test_course_exercise_numbers_refuse_bad_values_in_one_line(capsys, argv):
    """`python -m minisgl course hint|exercise N` runs make_exercise.py: its numbers follow the
    CLI's rule, exit 2 with one `error:` line (it printed argparse's usage, or exit 1 with
    "no exercise -1" for nan)."""

    from minisgl.course import make_exercise as tool
    with pytest.raises(SystemExit) as exit_:
        tool.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), (exit_.value.code, err)


def test_install_accepts_exactly_the_pythons_the_package_declares():
    """install.py's range and pyproject's requires-python are one statement: 3.10 to 3.14."""
    import ast
    import re

    declared = re.search(r'^requires-python = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]
    tree = ast.parse((ROOT / "install.py").read_text())
    (low, high), = [ast.literal_eval(n.value) for n in tree.body
                    if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "SUPPORTED_PYTHONS"]
    assert declared == f">={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}" and (low, high) == ((3, 10), (3, 14))
