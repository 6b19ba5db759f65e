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
