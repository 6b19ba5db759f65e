"""The CLI through a real subprocess: outputs, files, exit codes and one-line errors."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from conftest import DENSE_FIXTURES, ROOT, model_path

QWEN = "qwen2moe-60x4"


def cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "pymoecache", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_run_prints_text_then_one_stats_line(fixture_dir):
    r = cli("run", model_path(fixture_dir, QWEN), "-p", "Hello", "-n", "12", "--prior", "0.5", "--cache-size", "30")
    assert r.returncode == 0, r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("[prior:0.5, cache 30/60 experts per layer]")
    for field in ("prompt", "decode", "tok/s", "hit rate", "misses/token", "layer hit rate min"):
        assert field in last
    assert r.stdout.startswith("Hello")


def test_run_json(fixture_dir):
    r = cli("run", model_path(fixture_dir, QWEN), "-p", "Hello", "-n", "10", "--routing", "max-rank:8", "--top-j", "2",
            "--cache-size", "0.25", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["routing"] == "max-rank:8:j=2" and d["cache_size"] == 15 and d["n_expert"] == 60
    assert d["generated_tokens"] == 10 and d["decode_tok_s"] > 0 and d["prompt_tokens"] >= 1
    assert 0.0 <= d["hit_rate"] <= 1.0 and abs(d["hit_rate"] + d["miss_rate"] - 1.0) < 1e-9
    assert d["layer_hit_rate_min"] <= d["hit_rate"] <= d["layer_hit_rate_max"]


def test_run_chat(fixture_dir):
    r = cli("run", model_path(fixture_dir, QWEN), "-p", "Hi there", "-n", "6", "--chat", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["generated_tokens"] >= 1


def test_info_table_and_json(fixture_dir):
    r = cli("info", model_path(fixture_dir, "deepseek2-sigmoid-64x6"), "--ram", "1MiB")
    assert r.returncode == 0, r.stderr
    for text in ("deepseek2", "routed experts N", "64", "sigmoid, 8 groups", "shared experts", "cache size for 1.00 MiB"):
        assert text in r.stdout, text
    d = json.loads(cli("info", model_path(fixture_dir, QWEN), "--json", "--ram", "1MiB").stdout)
    assert d["n_expert"] == 60 and d["n_expert_used"] == 4 and d["n_moe_layer"] == 4 and d["is_moe"]
    assert d["cache_size_for_budget"] == int(2**20 // (d["expert_bytes"] * 4))
    r = cli("info", model_path(fixture_dir, DENSE_FIXTURES[0]))
    assert r.returncode == 0 and "dense model" in r.stdout


def test_bench_table_csv_json(fixture_dir, tmp_path):
    out_csv, out_json = tmp_path / "b.csv", tmp_path / "b.json"
    r = cli("bench", model_path(fixture_dir, QWEN), "--routing", "lru,prior:0.5,prune:2", "-n", "8",
            "--cache-size", "0.5", "--csv", out_csv, "--json", out_json)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].split()[:3] == ["routing", "cache", "prompt"]
    assert [ln.split()[0] for ln in lines[1:]] == ["lru", "prior:0.5", "prune:2"]
    rows = list(csv.DictReader(open(out_csv)))
    assert [r_["routing"] for r_ in rows] == ["lru", "prior:0.5", "prune:2"]
    data = json.loads(out_json.read_text())
    by = {d["routing"]: d for d in data}
    assert all(d["decode_tok_s"] > 0 and d["cache_size"] == 30 for d in data)
    # the prior keeps more experts cached than LRU on the same prompts: fewer misses, longer lifetimes
    assert by["prior:0.5"]["miss_rate"] < by["lru"]["miss_rate"]
    assert by["prior:0.5"]["lifetime"] > by["lru"]["lifetime"]
    assert by["prune:2"]["misses_per_token"] < by["lru"]["misses_per_token"]


def test_every_command_has_help_with_defaults():
    r = cli("--help")
    assert r.returncode == 0
    for cmd in ("run", "info", "bench"):
        assert cmd in r.stdout
        h = cli(cmd, "--help")
        assert h.returncode == 0, h.stderr
        assert "default" in h.stdout
    assert "--cache-size" in cli("run", "--help").stdout and "--prior" in cli("run", "--help").stdout
    assert cli().returncode == 2  # no command: usage and exit 2


@pytest.mark.parametrize("args,msg", [
    (["--prior", "0.5", "--top-j", "5"], "top_j = 5 is larger than the model's K = 4"),
    (["--top-j", "1"], "--top-j needs a policy"),
    (["--cache-size", "61"], "larger than the model's 60 routed experts"),
    (["--cache-size", "1.5"], "cache fraction 1.5 must be in [0, 1]"),
    (["--cache-size", "lots"], "cannot parse cache size"),
    (["--prior", "-0.5"], "lambda"),
    (["--routing", "prior:abc"], "not a valid number"),
    (["--cumsum", "2"], "tau"),
    (["--prune", "0"], "prune rank"),
])
def test_run_bad_parameters(fixture_dir, args, msg):
    r = cli("run", model_path(fixture_dir, QWEN), "-n", "2", *args)
    assert r.returncode == 2, r.stderr
    assert msg in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_bench_bad_parameters(fixture_dir, tmp_path):
    r = cli("bench", model_path(fixture_dir, QWEN), "--routing", "lru,warp:2")
    assert r.returncode == 2 and "unknown routing policy 'warp'" in r.stderr
    r = cli("bench", model_path(fixture_dir, QWEN), "--prompts", tmp_path / "none.txt")
    assert r.returncode == 2 and "cannot read --prompts" in r.stderr


def test_hf_options_go_together():
    r = cli("run", "--hf-repo", "someone/model")
    assert r.returncode == 2 and "--hf-repo and --hf-file go together" in r.stderr


def test_run_without_a_model_uses_the_embedded_trained_model():
    r = cli("run", "-p", "ROMEO:", "-n", "24", "--prior", "0.5")
    assert r.returncode == 0, r.stderr
    assert "using the embedded default model" in r.stderr and "tiny-shakespeare-qwen2moe-60x4.gguf" in r.stderr
    text, last = r.stdout.strip().rsplit("\n", 1)
    assert last.startswith("[prior:0.5, cache 30/60 experts per layer]")
    assert text.startswith("ROMEO:") and len(text.split()) >= 6
