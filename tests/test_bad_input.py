"""Bad model files and dense models give clear errors or a clear notice, never a crash."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import pymoecache
from pymoecache import ModelFileError, model_info
from conftest import DENSE_FIXTURES, MOE_FIXTURES, ROOT, model_path


def cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "pymoecache", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, **kw)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="model file not found"):
        pymoecache.Llama(str(tmp_path / "nope.gguf"))


def test_not_gguf(tmp_path):
    p = tmp_path / "notes.gguf"
    p.write_text("this is not a model\n" * 10)
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        pymoecache.Llama(str(p))


def test_truncated(fixture_dir, tmp_path):
    src = model_path(fixture_dir, MOE_FIXTURES[0])
    p = tmp_path / "half.gguf"
    p.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    with pytest.raises(ModelFileError, match="truncated"):
        pymoecache.Llama(str(p))


def test_corrupt_header(fixture_dir, tmp_path):
    src = model_path(fixture_dir, MOE_FIXTURES[0])
    data = bytearray(src.read_bytes()[:4096])
    data[8:24] = b"\xff" * 16  # tensor and key/value counts become absurd
    p = tmp_path / "corrupt.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(ModelFileError):
        pymoecache.Llama(str(p))


def test_directory(tmp_path):
    with pytest.raises(ModelFileError, match="directory"):
        model_info(tmp_path)


def test_dense_model_runs_with_a_notice(fixture_dir):
    path = model_path(fixture_dir, DENSE_FIXTURES[0])
    info = model_info(path)
    assert not info.is_moe and info.n_moe_layer == 0
    with pytest.warns(UserWarning, match="no MoE layers"):
        llm = pymoecache.Llama(str(path), n_ctx=64, verbose=False)
    assert llm.moecache is None
    assert llm.preset is None  # the default preset resolves to nothing without experts
    assert llm("Hello", max_tokens=4)["choices"][0]["text"] is not None
    with pytest.raises(pymoecache.MoECacheError, match="no MoE layers"):
        llm.moe_stats()
    llm.close()


def test_cli_errors_are_one_line_and_exit_2(fixture_dir, tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_text("nope")
    cases = [
        (["run", str(tmp_path / "missing.gguf")], "not found"),
        (["run", str(bad)], "not a GGUF file"),
        (["bench", str(model_path(fixture_dir, DENSE_FIXTURES[0]))], "no MoE layers"),
        (["run", str(model_path(fixture_dir, DENSE_FIXTURES[0])), "--timeline", str(tmp_path / "t.json")],
         "is a dense model: --profile and --timeline record experts"),
        (["run", str(model_path(fixture_dir, MOE_FIXTURES[0])), "--cache-size", "1000"], "larger than"),
        (["run", str(model_path(fixture_dir, MOE_FIXTURES[0])), "--prior", "-1"], "lambda"),
        (["run", str(model_path(fixture_dir, MOE_FIXTURES[0])), "--routing", "warp:9"], "unknown routing policy"),
    ]
    for args, msg in cases:
        r = cli(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert msg in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr, (args, r.stderr)


def test_run_and_chat_run_a_dense_model_as_plain_llama_cpp(fixture_dir):
    """The Python API runs a dense model; so do `run` and `chat`: a note, the text, llama.cpp's
    speed, and no raw warning."""
    path = str(model_path(fixture_dir, DENSE_FIXTURES[0]))
    r = cli("run", path, "-p", "Hello", "-n", "4")
    assert r.returncode == 0, r.stderr
    assert "is a dense model (no routed experts): it runs as plain llama.cpp" in r.stderr
    assert "UserWarning" not in r.stderr and "plan:" not in r.stderr
    assert r.stdout.startswith("Hello") and r.stderr.strip().splitlines()[-1].startswith(
        "[dense model, no expert cache] prompt ")
    d = json.loads(cli("run", path, "-p", "Hello", "-n", "4", "--json").stdout)
    assert d["generated_tokens"] == 4 and "hit_rate" not in d
    r = subprocess.run([sys.executable, "-m", "pymoecache", "chat", path, "-n", "3"], cwd=ROOT, input="Hi\n/stats\n",
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "[dense model, no expert cache]" in r.stderr and "no expert cache, no routing" in r.stderr
