"""`pymoecache ppl`, `trace` and `plot-timeline` through real subprocesses on the fixture models,
plus the evaluation API they are built on (pymoecache.evaluate)."""

from __future__ import annotations

import csv
import doctest
import importlib.util
import json
import struct
import subprocess
import sys

import numpy as np
import pytest

import pymoecache
from pymoecache import evaluate
from conftest import ROOT, SHARED, model_path

HAVE_MPL = importlib.util.find_spec("matplotlib") is not None
needs_mpl = pytest.mark.skipif(not HAVE_MPL, reason="matplotlib is not installed (pip install 'pymoecache[plot]')")

CTX, CHUNKS = 64, 3
ROW_KEYS = {"model", "policy", "knob", "top_j", "spec", "cache_size", "n_expert", "ppl", "nll", "miss_rate",
            "hit_rate", "lifetime", "tokens", "chunks", "ctx", "prefetch", "prefetch_recall", "loads_per_token", "eviction",
            "prefetch_min_p", "miss_path", "lowbit_per_token", "critical_mib_per_token", "lowbit_max_p", "ppl_err", "chunk_nll",
            "routing_asked", "cache_asked", "gpu_layers"}

def cli(*args):
    return subprocess.run([sys.executable, "-m", "pymoecache", *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def one_line_error(r, command: str, fragment: str) -> None:
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"pymoecache {command}: error:"), r.stderr
    assert fragment in last, last


def assert_png(path, min_bytes=5_000):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert 400 <= width <= 4000 and 300 <= height <= 3000, (width, height)
    assert len(data) >= min_bytes


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """A WikiText-2 excerpt (or, without the shared data, a repeated English paragraph)."""
    wiki = SHARED / "data" / "wikitext-2" / "valid.txt"
    if wiki.is_file():
        text = wiki.read_text(encoding="utf-8")[:40_000]
    else:
        text = (" = Lobsters = \n\n The European lobster is a species of clawed lobster from the eastern Atlantic "
                "Ocean , Mediterranean Sea and parts of the Black Sea . It may grow to a length of 60 cm . \n\n") * 150
    p = tmp_path_factory.mktemp("text") / "valid.txt"
    p.write_text(text, encoding="utf-8")
    return p


@pytest.fixture(scope="module")
def qwen(fixture_dir):
    return model_path(fixture_dir, "qwen2moe-60x4")


@pytest.fixture(scope="module")
def mixtral(fixture_dir):
    return model_path(fixture_dir, "mixtral-8x2")


# --- ppl -------------------------------------------------------------------------------------

def test_ppl_sweep_table_and_files(qwen, text_file, tmp_path):
    out_csv, out_json, out_png = tmp_path / "rows.csv", tmp_path / "rows.json", tmp_path / "pareto.png"
    args = ["ppl", qwen, "--text", text_file, "--ctx", CTX, "--chunks", CHUNKS, "--sweep", "prior=0,0.5",
            "max-rank=8", "--cache-size", "0.5", "0.25", "--csv", out_csv, "--json", out_json]
    r = cli(*args, *(["--plot", out_png] if HAVE_MPL else []))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].split() == ["policy", "eviction", "knob", "cache", "ppl", "±", "vs", "lru", "miss", "%", "hit", "%",
                                "lifetime"]
    assert [ln.split()[:4] for ln in lines[1:]] == [
        [p, "lru", k, c] for c in ("30/60", "15/60") for p, k in (("lru", "-"), ("prior", "0"), ("prior", "0.5"),
                                                                  ("max-rank", "8"))]
    vs_lru = [ln.split()[6:8] for ln in lines[1:]]  # the perplexity against top-k + LRU's, chunk by chunk
    assert vs_lru[0][0] == "-" and vs_lru[1] == ["+0.00%", "±0.00"]  # (lambda = 0 routes as top-k)

    with open(out_csv, newline="") as f:
        rows_csv = list(csv.DictReader(f))
    assert len(rows_csv) == 8 and set(rows_csv[0]) == ROW_KEYS
    rows = json.loads(out_json.read_text())
    assert len(rows) == 8 and all(set(r) == ROW_KEYS for r in rows)
    assert [r["spec"] for r in rows_csv] == [r["spec"] for r in rows]
    assert all(r["tokens"] == CHUNKS * (CTX - 1) and r["chunks"] == CHUNKS for r in rows)
    for r, rc in zip(rows, rows_csv):  # one mean NLL per chunk, whose mean is the row's; a spread, its error
        assert len(r["chunk_nll"]) == CHUNKS and [float(x) for x in rc["chunk_nll"].split()] == r["chunk_nll"]
        assert sum(r["chunk_nll"]) / CHUNKS == pytest.approx(r["nll"], rel=1e-5)
        assert 0 < r["ppl_err"] < r["ppl"]
    d, err = evaluate.paired_delta(rows[2]["chunk_nll"], rows[0]["chunk_nll"])  # prior:0.5 against lru at 30/60
    assert lines[3].split()[6] == f"{100 * d:+.2f}%" and d == pytest.approx(rows[2]["ppl"] / rows[0]["ppl"] - 1, abs=1e-4)
    assert {r["model"] for r in rows} == {"qwen2moe-60x4.gguf"}

    by = {(r["cache_size"], r["spec"]): r for r in rows}
    for size in (30, 15):
        lru, prior0, prior5 = by[size, "lru"], by[size, "prior:0"], by[size, "prior:0.5"]
        assert prior0["ppl"] == lru["ppl"] and prior0["miss_rate"] == lru["miss_rate"]  # lambda = 0 is the stock model
        assert prior5["miss_rate"] < 0.6 * lru["miss_rate"]                             # the prior keeps experts cached
        assert prior5["lifetime"] > lru["lifetime"]
        assert abs(lru["hit_rate"] + lru["miss_rate"] - 1) < 1e-12
    assert by[30, "lru"]["ppl"] == by[15, "lru"]["ppl"]          # LRU routing does not depend on the cache
    assert by[15, "lru"]["miss_rate"] > by[30, "lru"]["miss_rate"]
    if HAVE_MPL:
        assert_png(out_png)


def test_ppl_lru_row_equals_direct_perplexity(mixtral, text_file, tmp_path):
    out = tmp_path / "lru.json"
    r = cli("ppl", mixtral, "--text", text_file, "--ctx", CTX, "--chunks", CHUNKS, "--cache-size", "4",
            "--json", out, "--no-progress")
    assert r.returncode == 0, r.stderr
    lru, default = json.loads(out.read_text())  # no routing option: LRU and the default preset beside it
    assert default["spec"] == "prior:0.1:j=1" and default["eviction"] == "lfu"
    r = cli("ppl", mixtral, "--text", text_file, "--ctx", CTX, "--chunks", CHUNKS, "--cache-size", "4",
            "--json", out, "--no-progress", "--routing", "lru")
    assert r.returncode == 0, r.stderr
    [row] = json.loads(out.read_text())  # --routing lru: the LRU row only
    assert row == lru
    assert row["spec"] == "lru" and row["cache_size"] == 4 and row["n_expert"] == 8

    llm = pymoecache.Llama(str(mixtral), cache=pymoecache.CacheConfig(size=4), routing="lru", n_ctx=CTX,
                           logits_all=True, verbose=False)
    tokens = evaluate.tokenize_text(llm, evaluate.load_text(text_file))
    res = evaluate.perplexity(llm, tokens, CTX, limit_chunks=CHUNKS, progress=False)
    llm.close()
    assert res.n_chunks == CHUNKS and res.n_tokens == CHUNKS * (CTX - 1) == row["tokens"]
    assert res.ppl == pytest.approx(row["ppl"], rel=1e-9)
    assert res.stats.miss_rate == row["miss_rate"] and res.stats.lifetime == pytest.approx(row["lifetime"])
    assert res.ppl == pytest.approx(np.exp(res.nll))


def test_ppl_single_routing_vs_lru(mixtral, text_file):
    r = cli("ppl", mixtral, "--text", text_file, "--ctx", CTX, "--chunks", 2, "--prior", "0.5", "--top-j", "1")
    assert r.returncode == 0, r.stderr
    rows = [ln.split() for ln in r.stdout.strip().splitlines()[1:]]
    assert [(x[0], x[1], x[2], x[3]) for x in rows] == [("lru", "lru", "-", "4/8"), ("prior", "lru", "0.5", "4/8")]
    assert "[row 1 of 2]" in r.stderr and "chunk" not in r.stdout  # progress on stderr (a bar only on a terminal)


def test_ppl_help_explains_every_option():
    r = cli("ppl", "--help")
    assert r.returncode == 0
    for opt in ("--text", "--ctx", "--chunks", "--sweep", "--cache-size", "--csv", "--json", "--plot", "--threads",
                "--prior", "--max-rank", "--cumsum", "--prune", "--top-j"):
        assert opt in r.stdout
    assert "default 256" in r.stdout and "default 0.5" in r.stdout


# --- the evaluation API ----------------------------------------------------------------------

def test_sweep_two_cache_sizes(mixtral, text_file):
    rows = evaluate.sweep(mixtral, text_file, evaluate.parse_sweep(["prior=0,1", "lru"]), [4, 2], ctx=CTX,
                          max_chunks=2, progress=False)
    assert [(r["cache_size"], r["spec"]) for r in rows] == [
        (4, "lru"), (4, "prior:0"), (4, "prior:1"), (2, "lru"), (2, "prior:0"), (2, "prior:1")]
    assert all(set(r) == ROW_KEYS for r in rows)
    # (experts resident: no miss path, nothing read; ppl --miss streams them: test_lowbit_miss.py)
    assert all((r["miss_path"], r["lowbit_per_token"], r["critical_mib_per_token"], r["lowbit_max_p"]) ==
               ("full", 0.0, 0.0, None) for r in rows)
    big, small = rows[:3], rows[3:]
    for group in (big, small):
        assert group[1]["ppl"] == group[0]["ppl"] and group[1]["miss_rate"] == group[0]["miss_rate"]
        assert group[2]["miss_rate"] < group[0]["miss_rate"]
        assert group[0]["knob"] is None and group[2]["knob"] == 1.0 and group[2]["policy"] == "prior"
    assert small[0]["miss_rate"] > big[0]["miss_rate"] and small[0]["ppl"] == big[0]["ppl"]


def test_parse_sweep():
    rs = evaluate.parse_sweep(["prior=0,0.25", "max-rank=2", "cumsum=0.9", "prune=1,2", "lru"], top_j=2)
    assert [r.spec() for r in rs] == ["prior:0:j=2", "prior:0.25:j=2", "max-rank:2:j=2", "cumsum:0.9:j=2",
                                      "prune:1:j=2", "prune:2:j=2", "lru"]
    assert all(getattr(r, "top_j", 2) == 2 for r in rs)
    assert [r.spec() for r in evaluate.with_lru(rs)][:2] == ["lru", "prior:0:j=2"]
    assert [pymoecache.parse_routing(r.spec()) for r in rs] == rs  # specs round-trip
    for bad in ("prior", "prior=", "prior=x", "max-rank=1.5", "speed=1", "lru=1"):
        with pytest.raises(evaluate.EvalError):
            evaluate.parse_sweep(bad)
    with pytest.raises(pymoecache.ConfigError):
        evaluate.parse_sweep("cumsum=2")


def test_perplexity_refuses_a_llama_it_cannot_use(mixtral):
    llm = pymoecache.Llama(str(mixtral), n_ctx=CTX, verbose=False)  # logits_all=False
    with pytest.raises(evaluate.EvalError, match="logits_all=True"):
        evaluate.perplexity(llm, list(range(3 * CTX)), CTX)
    llm.close()
    llm = pymoecache.Llama(str(mixtral), n_ctx=CTX, logits_all=True, verbose=False)
    with pytest.raises(evaluate.EvalError, match="n_ctx"):
        evaluate.perplexity(llm, list(range(3 * CTX)), 2 * CTX)
    with pytest.raises(evaluate.EvalError, match="fewer than one chunk"):
        evaluate.perplexity(llm, [1, 2, 3], CTX)
    llm.close()


def test_write_rows_and_load_text(tmp_path):
    rows = [{"policy": "lru", "knob": None, "ppl": 1.5}, {"policy": "prior", "knob": 0.5, "ppl": 1.25}]
    evaluate.write_rows(rows, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text()) == rows
    evaluate.write_rows(rows, tmp_path / "r.csv")
    assert (tmp_path / "r.csv").read_text().splitlines() == ["policy,knob,ppl", "lru,,1.5", "prior,0.5,1.25"]
    with pytest.raises(evaluate.EvalError, match="csv or .json"):
        evaluate.write_rows(rows, tmp_path / "r.txt")
    with pytest.raises(evaluate.EvalError, match="not found"):
        evaluate.load_text(tmp_path / "missing.txt")


def test_doctests():
    assert doctest.testmod(evaluate).failed == 0


# --- trace and plot-timeline -----------------------------------------------------------------

def check_trace(d, T, moe_layers, N, K, M):
    assert d["selected"].shape == (T, len(moe_layers), K) and d["selected"].dtype == np.int32
    assert d["hit"].shape == (T, len(moe_layers), K) and d["hit"].dtype == bool
    assert d["cached"].shape == (T, len(moe_layers), N) and d["cached"].dtype == bool
    assert d["moe_layers"].tolist() == moe_layers
    assert (d["n_expert"], d["n_expert_used"], d["cache_size"]) == (N, K, M)
    sel, hit, cached = d["selected"], d["hit"], d["cached"]
    assert not hit[sel < 0].any()                         # a dropped slot is never a hit
    assert not hit[0].any()                               # the cache starts empty
    assert (cached.sum(axis=2) <= M).all()
    t, j, k = np.nonzero(sel >= 0)
    before = np.zeros_like(hit)
    before[t[t > 0], j[t > 0], k[t > 0]] = cached[t[t > 0] - 1, j[t > 0], sel[t, j, k][t > 0]]
    assert (hit == before).all()                          # hit <=> the expert was cached before the token
    if K <= M:
        assert cached[t, j, sel[t, j, k]].all()          # selected experts are cached after the token


def test_trace_and_timeline(qwen, text_file, tmp_path):
    out = tmp_path / "trace.npz"
    r = cli("trace", qwen, "--text", text_file, "--out", out, "--tokens", 96, "--cache-size", "0.25",
            "--prior", "0.5")
    assert r.returncode == 0, r.stderr
    assert "96 tokens x 4 MoE layers" in r.stdout and "prior:0.5" in r.stdout
    d = evaluate.load_trace_npz(out)
    check_trace(d, 96, [0, 1, 2, 3], 60, 4, 15)
    assert d["routing"] == "prior:0.5" and d["model"] == "qwen2moe-60x4.gguf"
    assert (d["selected"] >= 0).all()
    miss = ((d["selected"] >= 0) & ~d["hit"]).mean()
    assert f"miss rate {100 * miss:.1f}%" in r.stdout
    with np.load(out) as z:  # a plain npz, readable without pymoecache
        assert {"selected", "hit", "cached", "moe_layers"} <= set(z.files)

    if not HAVE_MPL:
        return
    png = tmp_path / "timeline.png"
    r = cli("plot-timeline", out, "--layer", 1, png, "--tokens", 64)
    assert r.returncode == 0, r.stderr
    assert_png(png)
    r = cli("plot-timeline", out, tmp_path / "x.png", "--layer", 4)
    one_line_error(r, "plot-timeline", "layer 4 is out of range")
    assert not (tmp_path / "x.png").exists()


def test_trace_pruned_with_a_dense_lead_layer(fixture_dir, text_file, tmp_path):
    out = tmp_path / "ds.npz"
    r = cli("trace", model_path(fixture_dir, "deepseek2-sigmoid-64x6"), "--text", text_file, "--out", out,
            "--tokens", 48, "--prune", 3, "--no-progress")
    assert r.returncode == 0, r.stderr
    d = evaluate.load_trace_npz(out)
    check_trace(d, 48, [1, 2, 3], 64, 6, 32)
    assert (d["selected"][:, :, :3] >= 0).all() and (d["selected"][:, :, 3:] == -1).all()
    assert d["routing"] == "prune:3" and d["n_layer"] == 4
    miss = ((d["selected"] >= 0) & ~d["hit"]).sum() / (48 * 3 * 6)  # normalised by K, not by the 3 kept
    assert f"miss rate {100 * miss:.1f}%" in r.stdout
    r = cli("plot-timeline", out, tmp_path / "x.png", "--layer", 0)
    one_line_error(r, "plot-timeline", "layer 0 is not a MoE layer")


# --- errors: one line, exit code 2 -----------------------------------------------------------

def test_errors(qwen, text_file, tmp_path):
    one_line_error(cli("ppl", qwen, "--text", tmp_path / "nope.txt"), "ppl", "text file not found")
    one_line_error(cli("ppl", qwen, "--text", text_file, "--ctx", 4096), "ppl",
                   "ctx 4096 is larger than the model's context length 512")
    one_line_error(cli("ppl", qwen, "--text", text_file, "--sweep", "prior=0,x"), "ppl", "'x' is not a valid number")
    one_line_error(cli("ppl", qwen, "--text", text_file, "--sweep", "speed=1"), "ppl", "cannot parse sweep 'speed=1'")
    one_line_error(cli("trace", qwen, "--text", text_file, "--out", tmp_path / "t.npz", "--tokens", 4096), "trace",
                   "--tokens 4096 is larger than the model's context length 512")
    one_line_error(cli("plot-timeline", text_file, tmp_path / "x.png"), "plot-timeline", "is not a pymoecache trace")


def test_ppl_takes_llamas_f_says_k_of_n_and_keeps_finished_rows_on_ctrl_c(qwen, text_file, tmp_path):
    """`ppl -f FILE` as llama-perplexity; "[row k of N, about ... left]" on stderr; the CSV holds
    every finished row while the sweep runs; Ctrl-C (SIGINT) keeps them and says where."""
    import signal
    import time

    out = tmp_path / "rows.csv"
    proc = subprocess.Popen([sys.executable, "-m", "pymoecache", "ppl", str(qwen), "-f", str(text_file), "--ctx",
                             str(CTX), "--chunks", "4", "--sweep", "prior=0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1",
                             "--cache-size", "0.5", "--csv", str(out), "--no-progress"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not out.exists():  # written once the first row (lru) has finished
        assert time.monotonic() < deadline and proc.poll() is None, proc.poll()
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    rows = list(csv.DictReader(out.open()))
    assert 1 <= len(rows) < 11 and rows[0]["policy"] == "lru"
    assert f"finished row{'s' * (len(rows) != 1)} kept in {out}" in stderr, stderr
    assert stdout.splitlines()[0].split()[:3] == ["policy", "eviction", "knob"]  # the finished rows, printed
    assert len(stdout.strip().splitlines()) == len(rows) + 1

    r = cli("ppl", qwen, "-f", text_file, "--ctx", CTX, "--chunks", 1, "--prior", "0.5", "--eviction", "lfu")
    assert r.returncode == 0, r.stderr
    assert "[row 1 of 2]" in r.stderr and "[row 2 of 2, about " in r.stderr and " left]" in r.stderr
    table = [ln.split() for ln in r.stdout.strip().splitlines()]
    assert table[0][:2] == ["policy", "eviction"] and [t[:2] for t in table[1:]] == [["lru", "lfu"], ["prior", "lfu"]]


def test_ppl_to_a_log_prints_each_progress_line_once(qwen, text_file, tmp_path):
    """Issue 56 item 6: with stderr a file (not a terminal), ppl writes each "[row k of N]" line once and
    no progress-bar redraws (each would be a line of its own there)."""
    log = tmp_path / "ppl.log"
    with open(log, "w") as err:
        r = subprocess.run([sys.executable, "-m", "pymoecache", "ppl", str(qwen), "--text", str(text_file), "--ctx",
                            str(CTX), "--chunks", "3", "--cache-size", "0.5"],
                           cwd=tmp_path, stdout=subprocess.PIPE, stderr=err, text=True, timeout=300)
    text = log.read_text()
    assert r.returncode == 0, text
    assert "\r" not in text and "chunk/s" not in text, text[-500:]
    rows = [x for x in text.splitlines() if x.startswith("[row ")]
    assert len(rows) == 2 and rows[0] == "[row 1 of 2]" and len(set(rows)) == 2, text
