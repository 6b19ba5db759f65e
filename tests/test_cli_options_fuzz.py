"""Every numeric option of every command refuses out-of-range values with exit 2 and one line
(issue 25 item 8): NaN, infinities, overflowing integers, values past llama.cpp's and our bounds.
The parser is walked, so an option added later is checked too. Runs in-process (pymoecache.cli.main)
on a fixture model: a value that slips through runs the command and fails the test."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest

from pymoecache import cli
from conftest import ROOT, model_path

BAD_FLOATS = ["nan", "inf", "-inf", "1e400", "-1e400"]
BAD_INTS = ["99999999999999999999", "-99999999999999999999"]


def _numeric_options():
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command, p in sub.choices.items():
        for a in p._actions:
            if a.option_strings and a.type in (int, float) and a.nargs is None:
                yield command, a.option_strings[-1], a.type


CASES = [(c, o, v) for c, o, t in _numeric_options() for v in (BAD_FLOATS if t is float else BAD_INTS)]


def _argv(fixture_dir, command, option, value, tmp_path):
    m = str(model_path(fixture_dir, "qwen2moe-60x4"))
    text = str(ROOT / "README.md")
    base = {
        "run": [command, m, "-n", "1", "-p", "Hi"],
        "bench": [command, m, "-n", "1", "--reps", "1"],
        "chat": [command, m, "-n", "1"],
        "ppl": [command, m, "--text", text, "--chunks", "1", "-c", "64", "--no-progress"],
        "trace": [command, m, "--text", text, "--tokens", "8", "--out", str(tmp_path / "t.npz")],
        "plot-timeline": [command, str(tmp_path / "missing.npz"), "--out", str(tmp_path / "p.png")],
        "simulate": [command, m, "--text", text, "--tokens", "16", "--no-progress"],
        "serve": [command, m],
        "info": [command, m],
        "rpc-server": [command],
        "lowbit": [command, m, "-o", str(tmp_path / "c.gguf")],
    }[command]
    return base + [option, value]


@pytest.mark.parametrize("command, option, value", CASES, ids=[f"{c}{o}={v}" for c, o, v in CASES])
def test_out_of_range_numbers_exit_2_with_one_line(fixture_dir, tmp_path, monkeypatch, command, option, value):
    import uvicorn

    def no_server(*a, **k):
        raise AssertionError("the server would start: the value was accepted")

    monkeypatch.setattr(uvicorn, "run", no_server)
    monkeypatch.setattr("pymoecache.rpc.serve", no_server)
    monkeypatch.setattr("sys.stdin", io.StringIO("/quit\n"))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = cli.main(_argv(fixture_dir, command, option, value, tmp_path))
        except SystemExit as e:  # argparse's own refusals
            rc = e.code
    msg = err.getvalue().strip()
    assert rc == 2, f"exit {rc}: {msg[-400:]}"
    assert "internal error" not in msg and "Traceback" not in msg, msg
    assert option.lstrip("-").split("-")[0] in msg or "argument" in msg or "must" in msg, msg


# --- no option is taken by a prefix of its name (issue 43 item 2) ----------------------------------

def _prefix_cases():
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command, p in sub.choices.items():
        names = {o for a in p._actions for o in a.option_strings}
        for a in p._actions:
            for name in a.option_strings:
                if not name.startswith("--"):
                    continue
                for n in range(3, len(name)):
                    if name[:n] not in names:
                        yield command, name, name[:n]


PREFIXES = list(_prefix_cases())


def test_every_prefix_of_every_option_is_refused_with_the_commands_own_guess(capsys):
    """llama.cpp takes no prefixes: `run --prio 0.5` must not run prior:0.5. Each proper prefix of every
    long option of every command exits 2, names the command's --help, and a guess is one of that
    command's options."""
    assert len(PREFIXES) > 1000
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    required = {"ppl": ["--text", "t"], "trace": ["--text", "t", "--out", "o"], "simulate": ["--text", "t"],
                "plot-timeline": ["t.npz"]}
    for command, name, prefix in PREFIXES:
        with pytest.raises(SystemExit) as e:
            cli.build_parser().parse_args([command, *required.get(command, []), prefix, "1"])
        err = capsys.readouterr().err
        assert e.value.code == 2, (command, prefix)
        assert f"pymoecache {command}: error: unrecognized arguments: {prefix}" in err, (command, prefix, err)
        assert f"(see pymoecache {command} --help)" in err, err
        guess = err.partition("did you mean ")[2].partition("?")[0]
        own = {o for a in sub.choices[command]._actions for o in a.option_strings}
        assert not guess or guess in own, (command, prefix, guess)


def _short_prefix_cases():
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command, p in sub.choices.items():
        names = {o for a in p._actions for o in a.option_strings}
        for name in sorted(names):
            if name.startswith("--") or len(name) <= 2:
                continue
            for n in range(2, len(name)):
                if name[:n] not in names:
                    yield command, name, name[:n]


def test_no_single_dash_option_is_taken_by_a_prefix(capsys):
    """Issue 56 item 1: argparse's allow_abbrev=False still matched single-dash options by a prefix:
    `run -u 7` ran with -ub 7, `-o exps=CUDA0` was -ot, `run -hf_` printed help and exited 0. Every
    proper prefix of every single-dash option of every command is refused (exit 2), by its name (issue 77: no
    option takes a value run on, so `-sy` is no longer `-s y` and `-ctk` no longer `-c tk`)."""
    cases = list(_short_prefix_cases())
    assert len(cases) > 30
    required = {"ppl": ["--text", "t"], "trace": ["--text", "t", "--out", "o"], "simulate": ["--text", "t"],
                "plot-timeline": ["t.npz"]}
    for command, name, prefix in cases:
        names = {o for a in cli.build_parser()._subparsers._group_actions[0].choices[command]._actions
                 for o in a.option_strings}
        with pytest.raises(SystemExit) as e:
            cli.build_parser().parse_args([command, *required.get(command, []), prefix, "exps=CPU"])
        err = capsys.readouterr().err
        assert e.value.code == 2, (command, name, prefix, err)
        if prefix[:2] not in names:
            assert f"unrecognized arguments: {prefix}" in err, (command, prefix, err)
    for argv, says in ((["run", "-p", "x", "-n", "2", "-u", "7", "-v"], "unrecognized arguments: -u "),
                       (["run", "-o", "exps=CPU"], "unrecognized arguments: -o "),
                       (["run", "-hf_"], "unrecognized arguments: -hf_; did you mean -hf?")):
        with pytest.raises(SystemExit) as e:
            cli.build_parser().parse_args(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and says in err, (argv, err)
    with pytest.raises(SystemExit) as e:  # (no value run on: llama.cpp's parser takes none, and "-ctk" was "-c tk")
        cli.build_parser().parse_args(["run", "-n64"])
    assert e.value.code == 2 and "unrecognized arguments: -n64" in capsys.readouterr().err


def test_a_guess_is_never_an_option_the_command_does_not_have(capsys):
    for argv, wrong in ((["bench", "-p", "x"], "-p"), (["serve", "--jsonl"], "--json"), (["info", "--prior", "1"], None)):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(argv)
        err = capsys.readouterr().err
        assert f"(see pymoecache {argv[0]} --help)" in err, err
        if wrong:
            assert f"did you mean {wrong}?" not in err, err
