"""The CLI through a real subprocess: outputs, files, exit codes and one-line errors."""

from __future__ import annotations

import csv
import json
import os
import re
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
    assert r.stdout.startswith("Hello") and "tok/s" not in r.stdout  # the text alone; the stats line on stderr
    last = r.stderr.strip().splitlines()[-1]
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
    for text in ("deepseek2", "routed experts N", "64", "sigmoid, 8 groups", "shared experts",
                 "memory plan with --cache-size auto, a budget of 1MiB", "memory budget   1.00 MiB"):
        assert text in r.stdout, text
    r = cli("info", model_path(fixture_dir, DENSE_FIXTURES[0]))
    assert r.returncode == 0 and "dense model" in r.stdout and "memory plan" not in r.stdout


def test_info_plans_a_gpu_only_where_ggml_sees_one(fixture_dir):
    """Without a GPU (this build's backends see none: lavapipe is not made visible here) `info` plans no
    GPU layers, and `--gpu-mem auto` says why and what to give instead; `--gpu-mem SIZE` still plans them."""
    seen = subprocess.run([sys.executable, "-c", "from pymoecache import plan; print(plan.has_gpu())"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120).stdout.strip()
    if seen == "True":
        pytest.skip("ggml sees a GPU on this machine (tests/test_gpu_layers_vulkan.py tests info with one)")
    m = model_path(fixture_dir, QWEN)
    d = json.loads(cli("info", m, "--json").stdout)
    assert d["gpu_plan"] is None and d["gpu_free"] is None
    r = cli("info", m, "--gpu-mem", "auto")
    assert r.returncode == 2 and "--gpu-mem auto: ggml sees no GPU here" in r.stderr and "--gpu-mem 8G" in r.stderr, \
        r.stderr[-2000:]
    d = json.loads(cli("info", m, "--json", "--gpu-mem", "8G").stdout)
    assert d["gpu_free"] == 8 << 30 and "every expert on the GPU" in d["gpu_plan"]["-ngl 99"]
    r = cli("info", model_path(fixture_dir, DENSE_FIXTURES[0]), "--gpu-mem", "auto")
    assert r.returncode == 2 and "has no routed experts" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("name, exact", [("mixtral-8x2", True), ("qwen2moe-60x4", True), ("deepseek2-sigmoid-64x6", False)])
def test_the_plan_counts_the_kv_cache_llama_cpp_allocates(fixture_dir, name, exact):
    """The plan's KV cache (what --cache-size auto, -ngl auto and the GPU fit set aside) is the one
    llama.cpp allocates at F16: its KV heads' K and V, half the heads' on the mixtral fixture (GQA;
    it was planned n_embd wide, twice that). deepseek2's MLA keeps no V: there the plan is above it."""
    m = model_path(fixture_dir, name)
    plan = json.loads(cli("info", m, "--json", "-c", "256").stdout)["plan"]
    r = cli("run", m, "-p", "hi", "-n", "1", "-c", "256", "-v")
    assert r.returncode == 0, r.stderr[-3000:]
    got = re.search(r"llama_kv_cache: size = +([0-9.]+) MiB \( *256 cells", r.stderr)
    assert got, r.stderr[-3000:]
    theirs, ours = float(got.group(1)), plan["kv"] / 2**20
    assert abs(ours - theirs) < 0.006 if exact else theirs <= ours <= 2 * theirs, (ours, theirs)  # (printed to 0.01)


@pytest.mark.parametrize("ram,budget", [("64M", 64 << 20), ("64MiB", 64 << 20), ("0.0625G", 64 << 20),
                                        ("67108864b", 64 << 20), ("50%", None)])
def test_info_ram_budgets_everything_and_plans_what_auto_picks(fixture_dir, ram, budget):
    """--ram is the whole budget: the dense part, the KV cache of the context, the expert cache and
    the headroom add up to it; the cache is what --cache-size auto picks for that budget."""
    from pymoecache import auto_cache_size, model_info
    from pymoecache.plan import total_memory

    m = model_path(fixture_dir, "deepseek2-sigmoid-64x6")
    budget = budget if budget is not None else total_memory() // 2
    d = json.loads(cli("info", m, "--json", "--ram", ram, "-c", "128").stdout)
    p = d["plan"]
    assert p["available"] == budget and p["budget_from"] == "budget" and p["n_ctx"] == 128
    assert p["dense"] + p["kv"] + p["cache_bytes"] + p["headroom"] == budget
    info = model_info(m)
    assert p["n_cached"] == d["cache_size_for_budget"] == auto_cache_size(info, 128, available=budget).n_cached
    # (the dense part: all but an input layer that the output does not reuse, read a row a token from the mapping)
    assert p["dense"] == info.non_expert_bytes - (0 if info.output_tied_bytes else info.input_bytes) and p["kv"] > 0
    if p["n_cached"] < info.n_expert:  # streamed: the disk was probed and the reads per token are planned
        assert p["read_per_token"] > 0 and p["disk_bytes_per_s"] > 0 and p["io_tok_s"] > 0


@pytest.mark.parametrize("size", ["0", "0.0", "0%", "0G", "0MiB"])
def test_a_cache_size_of_zero_is_refused(size):
    r = cli("run", "--cache-size", size, "-n", "1")
    assert r.returncode == 2 and "is zero" in r.stderr, r.stderr


@pytest.mark.parametrize("size,per_layer", [("50%", 30), ("25%", 15), ("4G", 60), ("1M", None)])
def test_cache_sizes_with_units_and_percentages(fixture_dir, size, per_layer):
    from pymoecache import model_info

    m = model_path(fixture_dir, QWEN)
    r = cli("run", m, "--cache-size", size, "-n", "2", "--json", "--prefetch", "off")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    info = model_info(m)
    want = per_layer if per_layer is not None else info.cache_size_for_budget(1 << 20)
    assert d["cache_size"] == max(want, info.n_expert_used)
    assert r.stderr.count("plan: ") == 1 and "expert cache" in r.stderr  # the memory plan, printed at load


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


def test_bench_keeps_finished_repetitions_on_ctrl_c(fixture_dir, tmp_path):
    """The CSV holds every setting's finished repetitions while bench runs; Ctrl-C prints them,
    says where they are and exits 130."""
    import signal
    import time

    out = tmp_path / "b.csv"
    proc = subprocess.Popen([sys.executable, "-m", "pymoecache", "bench", str(model_path(fixture_dir, QWEN)),
                             "--routing", "lru,prior:0.5", "-n", "8", "--reps", "50", "--cache-size", "0.5", "--csv",
                             str(out)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not out.exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.poll()
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert re.search(r"interrupted after (\d+) of 100 runs: \d row\(s\) from the finished repetitions kept in ", stderr)
    rows = list(csv.DictReader(out.open()))
    assert 1 <= len(rows) <= 2 and all(1 <= int(r_["reps"]) < 50 for r_ in rows)
    assert stdout.splitlines()[0].split()[:2] == ["routing", "cache"] and len(stdout.strip().splitlines()) >= 2


def test_every_command_has_help_with_defaults():
    r = cli("--help")
    assert r.returncode == 0
    for cmd in ("run", "info", "bench", "chat", "serve"):
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
    (["--cache-size", "1.5"], "cache share 1.5 must be in (0, 1]"),
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


def test_hf_file_needs_hf_repo():
    r = cli("run", "-hff", "m.gguf")
    assert r.returncode == 2 and "--hf-file needs --hf-repo" in r.stderr


def test_run_without_a_model_uses_the_embedded_trained_model():
    r = cli("run", "-p", "ROMEO:", "-n", "24", "--prior", "0.5")
    assert r.returncode == 0, r.stderr
    assert "using the embedded default model" in r.stderr and "tiny-shakespeare-qwen2moe-60x4.gguf" in r.stderr
    text, last = r.stdout.strip(), r.stderr.strip().splitlines()[-1]  # (the stats line on stderr, as llama-cli's)
    # cache size auto (the default): the 21 MB model fits this machine, so every expert stays resident
    assert last.startswith("[prior:0.5, cache 60/60 experts per layer; auto: 60 of 60 experts per layer fit in ")
    assert "all resident, nothing streamed" in last and "stream:" not in last
    assert text.startswith("ROMEO:") and len(text.split()) >= 6


# --- first contact: cache size auto, llama.cpp's flags and sampling options ---------------------

LLAMA_CPP_FLAGS = {  # command -> options a llama.cpp user types, each must be in --help with a default
    "run": ["-m", "-p", "-f", "-n", "-c", "--ctx-size", "-t", "--threads", "-ngl", "--n-gpu-layers", "-s", "--temp",
            "--top-k", "--top-p", "--min-p", "--repeat-penalty", "--ignore-eos", "--cache-size"],
    "chat": ["-m", "-sys", "-sysf", "-n", "-c", "--ctx-size", "-t", "--threads", "-ngl", "-s", "--temp", "--top-k",
             "--top-p", "--min-p", "--repeat-penalty", "--ignore-eos", "--cache-size"],
    "bench": ["-m", "-f", "-n", "-c", "-t", "-ngl", "--temp", "--top-k", "--top-p", "--min-p", "--repeat-penalty",
              "--cache-size"],
    "serve": ["-m", "-c", "--ctx-size", "-t", "--threads", "-ngl", "--cache-size"],
}


@pytest.mark.parametrize("cmd", sorted(LLAMA_CPP_FLAGS))
def test_llama_cpp_flags_have_help_with_defaults(cmd):
    from pymoecache.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[cmd]
    by_flag = {f: a for a in sub._actions for f in a.option_strings}
    for flag in LLAMA_CPP_FLAGS[cmd]:
        assert flag in by_flag, f"{cmd} has no {flag}"
        assert "default" in by_flag[flag].help, f"{cmd} {flag}: the help does not say the default"
    assert "default auto" in by_flag["--cache-size"].help
    text = cli(cmd, "--help").stdout
    assert all(f in text for f in LLAMA_CPP_FLAGS[cmd])


def _auto_run(monkeypatch, capsys, available, *args):
    """`pymoecache run` in this process, with the free-memory reading replaced by ``available``."""
    import pymoecache.plan
    from pymoecache.cli import main

    monkeypatch.setattr(pymoecache.plan, "_available_memory", lambda: available)
    rc = main(["run", "-n", "8", "--prior", "0.5", *args])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return err.strip().splitlines()[-1]  # (the stats line)


def test_cache_size_auto_fits_the_memory_left(monkeypatch, capsys):
    from pymoecache import auto_cache_size, default_model_path, model_info

    info = model_info(default_model_path())
    per_expert = info.cache_bytes * info.n_moe_layer  # one more cached expert per layer, all layers
    # the dense weights but the input layer: the output has its own, so a token reads a row of it from the mapping
    assert info.input_bytes > 0 and info.output_tied_bytes == 0
    dense = info.non_expert_bytes - info.input_bytes
    for want in (20, 45):
        # what 'want' experts per layer need beside the dense weights, the KV cache and the 128 MiB margin
        kv = 2 * 2 * info.n_ctx_train * info.n_layer * info.n_embd
        available = dense + kv + (128 << 20) + int((want + 0.5) * per_expert)
        assert auto_cache_size(info, info.n_ctx_train, available=available).n_cached == want
        last = _auto_run(monkeypatch, capsys, available, "--prefetch", "off")
        assert last.startswith(f"[prior:0.5, cache {want}/60 experts per layer; auto: {want} of 60 experts per layer "
                               f"fit in {available / 2**20:.0f} MiB free (less "), last
        assert "stream: read" in last  # what does not fit is streamed from the file
        # the default prefetch reads ahead into 2 spare slots per layer, out of the same memory
        last = _auto_run(monkeypatch, capsys, available)
        assert last.startswith(f"[prior:0.5, cache {want - 2}/60 experts per layer; auto: {want} of 60 experts per "
                               f"layer fit in {available / 2**20:.0f} MiB free (less "), last
        assert "; 2 of them per layer are spare slots for reading ahead" in last and "prefetch gate:" in last

    # fewer than K fit: a streamed token needs K slots per layer anyway, and they cache the last experts
    kv = 2 * 2 * info.n_ctx_train * info.n_layer * info.n_embd
    last = _auto_run(monkeypatch, capsys, dense + kv + (128 << 20) + int(2.5 * per_expert))
    assert last.startswith("[prior:0.5, cache 4/60 experts per layer; auto: 2 of 60 experts per layer fit"), last
    assert "a streamed token needs K = 4 slots per layer, which cache 4 experts and leave 128 MiB for the runtime" in last
    assert "too little memory" not in last and "stream: read" in last
    # less memory than the model's file: nothing fits; the run still works, on K streamed slots, and says so
    last = _auto_run(monkeypatch, capsys, info.file_bytes // 8)
    assert last.startswith("[prior:0.5, cache 4/60 experts per layer; auto: 0 of 60 experts per layer fit"), last
    assert "too little memory, expect page faults" in last and "stream: read" in last

    # an explicit size is taken as given, whatever the memory, with a warning where it leaves no room
    with pytest.warns(UserWarning, match="cache size 30 leaves no room"):
        last = _auto_run(monkeypatch, capsys, info.file_bytes // 2, "--cache-size", "30")
    assert last.startswith("[prior:0.5, cache 30/60 experts per layer]")


def test_cache_size_auto_reads_a_cgroup_limit(monkeypatch, tmp_path):
    """In a container the cgroup's limit, not the host's MemAvailable, is what the process can have;
    where the OS tells neither (macOS), half of the physical memory."""
    import os

    import pymoecache.plan as L

    assert L._available_memory() > 0
    monkeypatch.setattr(L, "_cgroup_available", lambda: 123 << 20)
    assert L._available_memory() == 123 << 20
    # no /proc/meminfo and no free-page count (macOS): half of the physical memory
    monkeypatch.setattr(L, "_cgroup_available", lambda: None)
    monkeypatch.setattr(L, "_MEMINFO", str(tmp_path / "no-meminfo"))
    real = os.sysconf

    def sysconf(name):
        if name == "SC_AVPHYS_PAGES":
            raise ValueError("unrecognized configuration name")
        return real(name)

    monkeypatch.setattr(os, "sysconf", sysconf)
    assert L._available_memory() == real("SC_PHYS_PAGES") * real("SC_PAGE_SIZE") // 2


def test_model_option_prompt_file_threads_ctx(fixture_dir, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("ROMEO: What light")
    r = cli("run", "-m", model_path(fixture_dir, QWEN), "-f", prompt, "-n", "4", "-t", "1", "-c", "512", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["model"].endswith(f"{QWEN}.gguf") and d["n_threads"] == 1 and d["n_ctx"] == 512
    assert d["generated_tokens"] == 4
    r = cli("run", "--model", model_path(fixture_dir, QWEN), "--file", prompt, "-n", "2", "--threads", "2",
            "--ctx-size", "256", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["n_threads"] == 2
    r = cli("run", model_path(fixture_dir, QWEN), "-m", model_path(fixture_dir, "mixtral-8x2"), "-n", "1")
    assert r.returncode == 2 and "two models given" in r.stderr
    r = cli("run", model_path(fixture_dir, QWEN), "-f", prompt, "-p", "x", "-n", "1")
    assert r.returncode == 2 and "either -p/--prompt or -f/--file" in r.stderr
    r = cli("run", model_path(fixture_dir, QWEN), "-f", tmp_path / "missing.txt", "-n", "1")
    assert r.returncode == 2 and "cannot read prompt file" in r.stderr
    prompt.write_text("word " * 300)  # longer than -c: refused up front
    r = cli("run", model_path(fixture_dir, QWEN), "-f", prompt, "-n", "1", "-c", "256")
    assert r.returncode == 2 and "do not fit in the context of 256 tokens" in r.stderr


def _text(*args):
    r = cli("run", *args, "-p", "ROMEO:", "-n", "24", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["text"]


def test_sampling_options_take_effect():
    greedy = _text("--temp", "0")
    hot = ("--temp", "1.5", "--top-k", "0", "--top-p", "1.0", "--min-p", "0.0")
    assert _text(*hot, "-s", "1") != _text(*hot, "-s", "2")  # really sampling: the seed matters
    assert _text(*hot, "-s", "1") == _text(*hot, "--seed", "1")  # ... and only the seed
    # each filter alone, at its strictest, leaves only the most likely token: greedy again
    assert _text("--temp", "1.5", "--top-k", "1", "--top-p", "1.0", "--min-p", "0.0", "-s", "1") == greedy
    assert _text("--temp", "1.5", "--top-k", "0", "--top-p", "0.0", "--min-p", "0.0", "-s", "1") == greedy
    assert _text("--temp", "1.5", "--top-k", "0", "--top-p", "1.0", "--min-p", "1.0", "-s", "1") == greedy
    assert _text("--temp", "0", "--repeat-penalty", "3.0") != greedy  # the tiny model repeats itself


def test_ignore_eos_bans_every_end_of_generation_token():
    import argparse

    import llama_cpp
    import pymoecache
    from pymoecache.cli.options import sampling_kwargs

    llm = pymoecache.Llama(str(pymoecache.default_model_path()), n_ctx=64, verbose=False)
    args = argparse.Namespace(temp=0.0, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0, seed=0, ignore_eos=True)
    bias = sampling_kwargs(args, llm)["logit_bias"]
    assert llm.token_eos() in bias and all(v == float("-inf") for v in bias.values())
    assert all(llama_cpp.llama_vocab_is_eog(llm._model.vocab, t) for t in bias)
    args.ignore_eos = False
    assert "logit_bias" not in sampling_kwargs(args, llm)
    llm.close()
    r = cli("run", "-p", "ROMEO:", "-n", "40", "--ignore-eos", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["generated_tokens"] == 40


@pytest.mark.parametrize("args,msg", [
    (["--top-k", "-1"], "--top-k must be >= 0"),
    (["--top-p", "1.5"], "--top-p must be in [0, 1]"),
    (["--min-p", "nan"], "--min-p must be in [0, 1]"),
    (["--temp", "-1"], "--temp must be in"),
    (["--repeat-penalty", "0"], "--repeat-penalty must be in"),
    (["-ngl", "-2"], "-ngl must be >= -1"),
    (["-n", "-2"], "-n must be in [-1"),
])
def test_bad_sampling_and_runtime_options(args, msg):
    r = cli("run", "-n", "1", *args) if args[0] != "-n" else cli("run", *args)
    assert r.returncode == 2 and msg in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_gpu_layers_with_streaming_run_without_a_gpu():
    # no GPU device in this build: llama.cpp offloads nothing and the run is the CPU's
    r0 = cli("run", "-p", "ROMEO:", "--cache-size", "0.5", "-n", "6", "--temp", "0", "--json")
    r = cli("run", "-p", "ROMEO:", "-ngl", "99", "--cache-size", "0.5", "-n", "6", "--temp", "0", "--json")
    assert r.returncode == 0 and r0.returncode == 0, r.stderr + r0.stderr
    assert json.loads(r.stdout)["text"] == json.loads(r0.stdout)["text"]
    r = cli("run", "-ngl", "99", "--residency", "none", "--cache-size", "0.5", "-n", "4", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["generated_tokens"] == 4


def test_gpu_layers_on_an_rpc_server_from_the_command_line():
    from pymoecache import rpc

    with rpc.LocalServer(register=False) as server:  # (the runs below register it, in their processes)
        args = ("run", "-p", "ROMEO:", "--prior", "0.5", "--cache-size", "0.25", "-n", "8", "--temp", "0", "--json")
        r0 = cli(*args)
        r = cli(*args, "-ngl", "99", "--rpc", server.endpoint, "-v", "--residency", "stream")  # (auto: a GPU tier)
        rv = cli(*args, "-ngl", "99", "--rpc", server.endpoint, "--vram-size", "6", "--vram-fill", "copy",
                 "--vram-copy", "async")
    assert r.returncode == 0 and r0.returncode == 0 and rv.returncode == 0, r.stderr + r0.stderr + rv.stderr
    assert "layers to GPU" in r.stderr and f"RPC0[{server.endpoint}]" in r.stderr
    got, ref, vram = json.loads(r.stdout), json.loads(r0.stdout), json.loads(rv.stdout)
    assert got["text"] == ref["text"] == vram["text"] and got["generated_tokens"] == 8
    # (6 device slots, K = 4: copy always finds a slot no selection of the token holds)
    assert vram["vram_bytes"] > 0 and vram["vram_copies"] > 0 and vram["vram_cpu"] == 0 and ref["vram_bytes"] == 0
    bad = cli("run", "-n", "1", "-ngl", "99", "--rpc", "localhost")
    assert bad.returncode == 2 and "--rpc" in bad.stderr and "HOST:PORT" in bad.stderr, bad.stderr


def test_bench_prompt_file_and_sampling(fixture_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nThe king said\n")
    r = cli("bench", "-m", model_path(fixture_dir, QWEN), "-f", prompts, "--routing", "lru", "-n", "4", "-t", "1",
            "--temp", "0.7", "--top-k", "10", "--cache-size", "0.5", "--json", tmp_path / "b.json")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "b.json").read_text())[0]["routing"] == "lru"


def test_n_minus_one_generates_until_the_context_is_full():
    r = cli("run", "-p", "ROMEO:", "-n", "-1", "--ignore-eos", "-c", "256", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["prompt_tokens"] + d["generated_tokens"] == 256


def test_readme_llama_cpp_table_names_real_options():
    """Every option the README's "Coming from llama.cpp" table promises exists on our CLI."""
    import re

    from pymoecache.cli import build_parser

    top = build_parser()
    ours = {f for a in top._actions for f in a.option_strings}  # (--version)
    for sub in next(a for a in top._actions if a.dest == "command").choices.values():
        ours.update(f for a in sub._actions for f in a.option_strings)
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Coming from llama.cpp", 1)[1].split("\n## ", 1)[0]
    rows = [ln.split("|")[2] for ln in table.splitlines() if ln.startswith("| ") and not ln.startswith("| llama.cpp")]
    assert len(rows) >= 10
    flags = {f for row in rows for code in re.findall(r"`([^`]*)`", row) for f in re.findall(r"(?<![\w-])(-{1,2}[a-z][\w-]*)", code)}
    assert {"-m", "-c", "-t", "-ngl", "-sys", "-f", "--top-k", "--ignore-eos"} <= flags, flags
    assert flags <= ours, flags - ours


def test_a_reader_that_leaves_early_is_no_error(fixture_dir):
    """`pymoecache run | head -1`: quiet and exit 0, like other Unix tools (issue 25 item 11)."""
    p = subprocess.Popen([sys.executable, "-m", "pymoecache", "run", str(model_path(fixture_dir, QWEN)), "-p", "Hello",
                          "-n", "200", "--ignore-eos"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = p.stdout.read(5)   # the reader takes a few bytes, then goes away
    p.stdout.close()
    _, err = p.communicate(timeout=300)
    assert first.startswith(b"Hello")
    assert p.returncode == 0, err.decode()
    assert b"Broken pipe" not in err and b"Traceback" not in err and b"Exception ignored" not in err, err.decode()


def test_exit_after_a_run_prints_no_ignored_exception(fixture_dir):
    """A model still open at interpreter exit logs while Python shuts down; the log callback must
    neither import nor raise then (it printed "Exception ignored ... sys.meta_path is None")."""
    code = ("import sys, pymoecache, pymoecache._llamalog as L\n"
            f"llm = pymoecache.Llama({str(model_path(fixture_dir, QWEN))!r}, cache=pymoecache.CacheConfig(size=0.5))\n"
            "llm('Hello', max_tokens=4)\n"
            "# what shutdown does to the import system, then a log line, as a model freed at exit sends one\n"
            "for m in [m for m in sys.modules if m.startswith('llama_cpp')]:\n"
            "    del sys.modules[m]\n"
            "sys.meta_path = None\n"
            "L._log_callback(4, b'error: logged during shutdown\\n', None)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Exception ignored" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = cli("run", model_path(fixture_dir, QWEN), "-p", "Hello", "-n", "4", "--cache-size", "0.5")
    assert r.returncode == 0 and "Exception ignored" not in r.stderr, r.stderr


@pytest.mark.parametrize("command", ["run -f", "ppl --text", "simulate --text", "bench --prompts"])
def test_text_that_is_not_utf8_is_refused_clearly(fixture_dir, tmp_path, command):
    """Issue 25 item 7: files of text are refused with where the bad byte is, never a traceback."""
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("Caf\u00e9 au lait, tr\u00e8s bien.\n".encode("latin-1") * 50)
    sub, flag = command.split()
    r = cli(sub, model_path(fixture_dir, QWEN), flag, bad)
    assert r.returncode == 2, r.stderr
    assert "not UTF-8 text" in r.stderr and "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr


def test_random_bytes_are_not_text_for_ppl(fixture_dir, tmp_path):
    junk = tmp_path / "junk.bin"
    junk.write_bytes(bytes(range(256)) * 40)
    r = cli("ppl", model_path(fixture_dir, QWEN), "--text", junk)
    assert r.returncode == 2 and "is not a text file" in r.stderr, r.stderr


def test_prompt_argument_that_is_not_utf8(fixture_dir):
    r = subprocess.run([sys.executable.encode(), b"-m", b"pymoecache", b"run", str(model_path(fixture_dir, QWEN)).encode(),
                        b"-p", b"Hi \xff", b"-n", b"2"], cwd=ROOT, capture_output=True, timeout=300)
    assert r.returncode == 2 and b"-p/--prompt is not UTF-8 text" in r.stderr, r.stderr


def test_chat_line_that_is_not_utf8_is_refused_and_the_chat_goes_on(fixture_dir):
    for env in ({}, {"PYTHONIOENCODING": "utf-8"}):  # surrogates (C locale) or a strict decoder
        r = subprocess.run([sys.executable, "-m", "pymoecache", "chat", str(model_path(fixture_dir, QWEN)), "-n", "2"],
                           cwd=ROOT, input=b"Hi \xff\nHello\n/quit\n", capture_output=True, timeout=300,
                           env=dict(os.environ, **env))
        assert r.returncode == 0, r.stderr
        assert b"that line is not UTF-8 text" in r.stderr and b"internal error" not in r.stderr, r.stderr


@pytest.mark.parametrize("args, msg", [
    (["--cache-size", "1GiB"], "simulate takes cache sizes as counts"),
    (["--cache-size", "auto"], "simulate takes cache sizes as counts"),
    (["--cache-size", "abc"], "cannot parse cache size 'abc'"),
])
def test_simulate_cache_sizes_are_checked_before_any_work(fixture_dir, args, msg):
    r = cli("simulate", model_path(fixture_dir, QWEN), "--text", ROOT / "README.md", *args)
    assert r.returncode == 2 and msg in r.stderr and "internal error" not in r.stderr, r.stderr


@pytest.mark.parametrize("content", [b"not a zip at all", b"PK\x03\x04 truncated zip", b""])
def test_simulate_bad_router_trace_file(tmp_path, content):
    f = tmp_path / "trace.npz"
    f.write_bytes(content)
    r = cli("simulate", "--router-trace", f)
    assert r.returncode == 2 and "cannot read router trace" in r.stderr and "internal error" not in r.stderr, r.stderr


def test_simulate_router_trace_with_impossible_contents(tmp_path):
    import numpy as np

    f = tmp_path / "trace.npz"
    np.savez(f, logits=np.zeros((4, 2, 8), np.float32), n_expert_used=np.array(9))
    r = cli("simulate", "--router-trace", f)
    assert r.returncode == 2 and "n_expert_used 9 of 8" in r.stderr, r.stderr
    np.savez(f, logits=np.full((4, 2, 8), np.inf, np.float32), n_expert_used=np.array(2))
    r = cli("simulate", "--router-trace", f)
    assert r.returncode == 2 and "non-finite" in r.stderr, r.stderr


# --- llama.cpp's spellings (issue 27 item 1) ---------------------------------------------------

LLAMA_CPP_SPELLINGS = [  # command line -> (option it sets, value)
    (["run", "-m", "a.gguf"], "model_opt", "a.gguf"),
    (["run", "-hf", "owner/repo"], "hf_repo", "owner/repo"),       # not -h -f
    (["run", "-hfr", "owner/repo"], "hf_repo", "owner/repo"),
    (["run", "--hf-repo", "owner/repo"], "hf_repo", "owner/repo"),
    (["run", "-hff", "m.gguf"], "hf_file", "m.gguf"),
    (["chat", "-hf", "owner/repo"], "hf_repo", "owner/repo"),
    (["run", "-p", "hi"], "prompt", "hi"),
    (["run", "-n", "5"], "n", 5),
    (["chat", "-sys", "be brief"], "system", "be brief"),
    (["run", "-sys", "be brief"], "system", "be brief"),
    (["run", "-sysf", "s.txt"], "system_file", "s.txt"),
    (["run", "-f", "p.txt"], "file", "p.txt"),
    (["chat", "-p", "hi"], "prompt", "hi"),                          # conversation mode: the first message
    (["run", "-c", "128"], "ctx", 128),
    (["run", "--ctx-size", "128"], "ctx", 128),
    (["run", "-t", "3"], "threads", 3),
    (["run", "-tb", "3"], "threads_batch", 3),                      # not -t b
    (["run", "--threads-batch", "3"], "threads_batch", 3),
    (["run", "-b", "64"], "batch_size", 64),
    (["run", "--batch-size", "64"], "batch_size", 64),
    (["run", "-ub", "32"], "ubatch_size", 32),                      # not -u b
    (["run", "--ubatch-size", "32"], "ubatch_size", 32),
    (["run", "-s", "7"], "seed", 7),
    (["run"], "seed", -1),                                          # llama.cpp's default: a random seed
    (["run", "--temp", "0.7"], "temp", 0.7),
    (["run", "--top-k", "5"], "top_k", 5),
    (["run", "--top-p", "0.5"], "top_p", 0.5),
    (["run", "--min-p", "0.1"], "min_p", 0.1),
    (["run", "--repeat-penalty", "1.1"], "repeat_penalty", 1.1),
    (["run", "-ngl", "0"], "n_gpu_layers", 0),
    (["run", "--n-gpu-layers", "0"], "n_gpu_layers", 0),
    (["run", "-ngl", "all"], "n_gpu_layers", -1),
    (["run", "-ngl", "auto"], "n_gpu_layers", "auto"),              # as many as fit: Llama resolves it
    (["run", "-fa", "on"], "flash_attn", "on"),                      # not -f a
    (["run", "-fa", "enabled"], "flash_attn", "on"),
    (["run", "--flash-attn", "off"], "flash_attn", "off"),
    (["run", "-fa", "auto"], "flash_attn", "auto"),
    (["run", "-cnv"], "conversation", True),                         # not -c nv
    (["run", "--conversation"], "conversation", True),
    (["run", "-no-cnv"], "conversation", False),
    (["run", "-st"], "single_turn", True),
    (["run", "-co", "on"], "color", "on"),                           # not -c o
    (["run", "--color", "off"], "color", "off"),
    (["run", "-ot", "exps=CPU"], "override_tensor", "exps=CPU"),     # not -o t
    (["run", "--override-tensor", "exps=CPU"], "override_tensor", "exps=CPU"),
    (["run", "-cmoe"], "cpu_moe", True),
    (["run", "--cpu-moe"], "cpu_moe", True),
    (["run", "-ncmoe", "4"], "n_cpu_moe", 4),
    (["run", "--n-cpu-moe", "4"], "n_cpu_moe", 4),
    (["run", "--mlock"], "mlock", True),
    (["run", "--no-mmap"], "no_mmap", True),
    (["run", "-v"], "verbose", True),
    (["run", "--verbose"], "verbose", True),
    (["run", "--log-verbose"], "verbose", True),
    (["run", "-v", "--log-disable"], "verbose", False),
    (["serve", "-tb", "2"], "threads_batch", 2),
    (["chat", "-fa", "on"], "flash_attn", "on"),
    (["bench", "-ub", "16"], "ubatch_size", 16),
]

# what each option becomes in pymoecache.Llama's keyword arguments
LLAMA_KWARGS = [
    (["run", "-tb", "3"], "n_threads_batch", 3),
    (["run", "-t", "2"], "n_threads_batch", 2),     # -tb defaults to -t, as in llama.cpp
    (["run", "-b", "64"], "n_batch", 64),
    (["run", "-ub", "32"], "n_ubatch", 32),
    (["run", "-fa", "on"], "flash_attn", True),
    (["run", "-fa", "auto"], "flash_attn", "auto"),  # llama.cpp's own choice (Llama sets its context's type)
    (["run"], "flash_attn", "auto"),                 # the default, as llama-cli's
    (["run", "-fa", "off"], "flash_attn", False),
    (["run", "--mlock"], "use_mlock", True),
    (["run", "--no-mmap"], "use_mmap", False),
    (["run", "-v"], "verbose", True),
    (["run"], "verbose", False),
    (["run", "-c", "99"], "n_ctx", 99),
    (["run", "--n-cpu-moe", "4"], "n_cpu_moe", 4),   # tensor buffer overrides, as llama-cli's
    (["run", "--cpu-moe"], "n_cpu_moe", "all"),
    (["run", "-ot", "exps=CPU"], "override_tensor", "exps=CPU"),
]


@pytest.mark.parametrize("argv,key,value", LLAMA_KWARGS, ids=[" ".join(a) for a, _, _ in LLAMA_KWARGS])
def test_llama_cpp_flags_reach_llama_as_llama_cpp_means_them(argv, key, value):
    from pymoecache.cli import build_parser
    from pymoecache.cli.options import runtime_kwargs

    assert runtime_kwargs(build_parser().parse_args(argv))[key] == value


@pytest.mark.parametrize("argv,message", [
    (["-ot", "exps=CUDA0"], "buffer type 'CUDA0' is not available"),
    (["-ot", "exps"], "expected PATTERN=BUFFER_TYPE"),
    (["--mlock", "--no-mlock"], "not both"),
    (["-ub", "0"], "--ubatch-size must be >= 1"),
    (["-fa", "maybe"], "expected on, off or auto"),
    (["-cnv", "-sys", "a", "-sysf", "b.txt"], "not both"),
])
def test_llama_cpp_flags_that_cannot_mean_anything_here_say_why(argv, message):
    r = cli("run", *argv, "-n", "1")
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_flash_attn_and_verbose_do_what_llama_cli_does(fixture_dir):
    """-fa on / off / auto and the default (auto, as llama-cli) reach llama.cpp's context (its own log, shown
    by -v, says so: auto is resolved by llama.cpp, on where the devices support it, as the CPU does)."""
    for value, want in ((["-fa", "on"], "enabled"), (["-fa", "off"], "disabled"), (["-fa", "auto"], "auto"),
                        ([], "auto")):
        r = cli("run", model_path(fixture_dir, QWEN), "-p", "Hi", "-n", "2", *value, "-v", "--temp", "0")
        assert r.returncode == 0, r.stderr
        assert re.search(rf"llama_context: flash_attn +=\s*{want}\n", r.stderr), r.stderr[-2000:]
        assert ("(FLASH_ATTN_EXT)" in r.stderr) == (want != "disabled")  # its graph (auto: llama.cpp chose on here)
    r = cli("run", model_path(fixture_dir, QWEN), "-p", "Hi", "-n", "2")
    assert "flash_attn" not in r.stderr  # no log without -v


def test_system_prompt_and_conversation_as_in_llama_cli(fixture_dir, tmp_path):
    m = model_path(fixture_dir, QWEN)
    plain = json.loads(cli("run", m, "-p", "Hi", "-n", "2", "--json").stdout)
    with_sys = json.loads(cli("run", m, "-p", "Hi", "-n", "2", "--json", "-sys", "You speak in verse.").stdout)
    assert with_sys["prompt_tokens"] > plain["prompt_tokens"] + 4  # the system prompt and the template went in
    # -cnv: the conversation, -p its first message, -st one turn and leave (stdin is never read)
    r = subprocess.run([sys.executable, "-m", "pymoecache", "run", str(m), "-cnv", "-st", "-sys", "SYSTEXT", "-p",
                        "FIRSTMSG", "-n", "3", "--verbose-prompt"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    assert "pymoecache chat:" in r.stderr and "> FIRSTMSG" in r.stderr
    prompt = r.stderr.split("[prompt]\n", 1)[1].split("\n[/prompt]", 1)[0]
    assert prompt.index("SYSTEXT") < prompt.index("FIRSTMSG")


def test_the_default_seed_is_random_and_printed(fixture_dir):
    m = model_path(fixture_dir, QWEN)
    seeds, texts = [], set()
    for _ in range(2):
        d = json.loads(cli("run", m, "-p", "Hi", "-n", "12", "--temp", "1.5", "--json").stdout)
        seeds.append(d["seed"])
        texts.add(d["text"])
    assert seeds[0] != seeds[1] and all(0 <= s < 2**31 for s in seeds)
    again = json.loads(cli("run", m, "-p", "Hi", "-n", "12", "--temp", "1.5", "--json", "-s", str(seeds[0])).stdout)
    assert again["seed"] == seeds[0] and again["text"] in texts  # a printed seed replays its text
    r = cli("run", m, "-p", "Hi", "-n", "2", "--temp", "0.8", "-s", "42")
    assert r.stderr.strip().splitlines()[-1].endswith("| seed 42")


def test_color_marks_the_prompt_only_when_asked(fixture_dir):
    m = model_path(fixture_dir, QWEN)
    on = cli("run", m, "-p", "Hello", "-n", "2", "-co", "on", "--temp", "0")
    assert on.stdout.startswith("\x1b[33mHello\x1b[0m"), on.stdout[:40]
    auto = cli("run", m, "-p", "Hello", "-n", "2", "--temp", "0")  # auto, and stdout is a pipe here
    assert auto.stdout.startswith("Hello") and "\x1b[" not in auto.stdout


@pytest.mark.parametrize("argv,dest,value", LLAMA_CPP_SPELLINGS, ids=[" ".join(a) for a, _, _ in LLAMA_CPP_SPELLINGS])
def test_llama_cpp_flags_set_the_option_they_set_there(argv, dest, value):
    from pymoecache.cli import build_parser

    args = build_parser().parse_args(argv)
    assert getattr(args, dest) == value


def test_version_names_the_package_llama_cpp_and_the_backend():
    import pymoecache

    r = subprocess.run([sys.executable, "-m", "pymoecache", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"pymoecache {pymoecache.__version__}"
    assert lines[1].startswith("llama-cpp-python 0.") and lines[2].startswith("backend: CPU")


@pytest.mark.parametrize("typo,meant", [("--cache-szie", "--cache-size"), ("--prior-x", "--prior"),
                                        ("--hf-rpo", "--hf-repo")])
def test_an_unknown_option_gets_a_did_you_mean(typo, meant):
    r = subprocess.run([sys.executable, "-m", "pymoecache", "run", typo, "1"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2
    assert f"unrecognized arguments: {typo}" in r.stderr and f"did you mean {meant}?" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "pymoecache", "run", "--zzzzzz"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "did you mean" not in r.stderr  # nothing close: no guess


def test_a_warning_is_one_line_in_the_clis_words(fixture_dir):
    """Python's "file:line: UserWarning:" and the source line never reach the user."""
    r = cli("run", model_path(fixture_dir, QWEN), "-n", "1", "--vram-size", "30", "--cache-size", "1.0")
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "vram_size=30" in ln]
    assert lines and lines[0].startswith("pymoecache run: warning: vram_size=30 ignored"), r.stderr
    assert "UserWarning" not in r.stderr and ".py:" not in r.stderr, r.stderr


def test_reverse_prompt_no_warmup_and_gpu_layers_without_a_gpu():
    """llama.cpp's -r stops where its text appears; --no-warmup is accepted and said to do nothing,
    once; -ngl without a GPU device says the layers stay on the CPU (issue 43 item 2)."""
    base = ("run", "-p", "Once upon a time", "-n", "30", "--temp", "0", "--json")
    full = json.loads(cli(*base).stdout)["text"]
    assert "POMPEY" in full  # (what the embedded model says greedily)
    r = cli(*base, "-r", "POMPEY", "--reverse-prompt", "nothing-like-this", "--no-warmup")
    assert r.returncode == 0, r.stderr
    cut = json.loads(r.stdout)["text"]
    assert "POMPEY" not in cut and full.startswith(cut) and len(cut) < len(full)
    assert r.stderr.count("--no-warmup: pymoecache runs no warm-up pass") == 1, r.stderr
    probe = subprocess.run([sys.executable, "-c", "from pymoecache._lib import has_gpu_device; print(has_gpu_device())"],
                           cwd=ROOT, capture_output=True, text=True)
    r = cli("run", "-p", "Hi", "-n", "1", "-ngl", "99")
    assert r.returncode == 0, r.stderr
    said = "-ngl 99: this build has no GPU device" in r.stderr
    assert said == (probe.stdout.strip() == "False"), (probe.stdout, r.stderr)


def _fake_cgroups(tmp_path, monkeypatch, proc_cgroup: str, files: dict, mountinfo: str = ""):
    import pymoecache.plan as L

    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "proc_cgroup").write_text(proc_cgroup)
    (tmp_path / "mountinfo").write_text(mountinfo)
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.setattr(L, "_PROC_CGROUP", str(tmp_path / "proc_cgroup"))
    monkeypatch.setattr(L, "_MOUNTINFO", str(tmp_path / "mountinfo"))
    monkeypatch.setattr(L, "_CGROUP_ROOT", str(tmp_path / "cg"))
    return L


def test_cgroup_limits_v1_and_v2_are_read_with_their_ancestors(monkeypatch, tmp_path):
    """Issue 76 item 3: auto sizing read a cgroup v2 limit only; under cgroup v1 (this project's development
    machines, many container hosts, Android) a capped run sized its cache from the machine's memory. v1: the
    memory controller's hierarchical limit less its usage, found through mountinfo; v2: the tightest of the
    cgroup's and its ancestors' memory.max less memory.current; no limit is None."""
    mb = 1 << 20
    L = _fake_cgroups(tmp_path / "v1", monkeypatch, "5:cpu:/\n4:memory:/box/job\n0::/\n", {
        "mnt/box/job/memory.limit_in_bytes": str(9223372036854771712),
        "mnt/box/job/memory.stat": f"cache 1\nhierarchical_memory_limit {900 * mb}\n",
        "mnt/box/job/memory.usage_in_bytes": str(100 * mb)},
        "35 31 0:32 / " + str(tmp_path / "v1" / "mnt") + " rw,relatime - cgroup cgroup rw,memory\n")
    assert L._cgroup_limit() == (800 * mb, "cgroup v1") and L._cgroup_available() == 800 * mb
    assert L._free_source() == "cgroup v1"  # (this machine has more than 800 MiB available)
    L = _fake_cgroups(tmp_path / "v1-none", monkeypatch, "4:memory:/\n", {
        "cg/memory/memory.limit_in_bytes": str(9223372036854771712), "cg/memory/memory.usage_in_bytes": "5"})
    assert L._cgroup_limit() is None and L._free_source() == "free"
    L = _fake_cgroups(tmp_path / "v2", monkeypatch, "0::/user.slice/app\n", {
        "cg/user.slice/app/memory.max": "max", "cg/user.slice/app/memory.current": str(50 * mb),
        "cg/user.slice/memory.max": str(600 * mb), "cg/user.slice/memory.current": str(200 * mb)})
    assert L._cgroup_limit() == (400 * mb, "cgroup v2")
    plan = L.memory_plan(_info_for_plan(), 256, 30, disk_bytes_per_s=1e9)
    assert plan.budget_from == "cgroup v2" and "free under the cgroup v2 limit =" in plan.summary(), plan.summary()


def _info_for_plan():
    from pymoecache.model_info import ModelInfo

    return ModelInfo(path="m.gguf", arch="qwen2moe", name="m", file_bytes=1 << 30, n_layer=8, moe_layers=list(range(8)),
                     n_expert=60, n_expert_used=4, n_expert_shared=0, gating="softmax", n_expert_groups=1,
                     expert_bytes=2 << 20, expert_bytes_total=8 * 60 * (2 << 20), expert_types=["Q8_0"], n_embd=1024,
                     n_embd_kv=1024, n_ctx_train=4096, slot_bytes=2 << 20, input_bytes=1 << 20, output_bytes=1 << 20,
                     output_tied_bytes=0)


def _own_cgroup(tmp_path, limit: int):
    """A memory cgroup of this process's own, limited to ``limit`` bytes, as (its cgroup.procs, "v1"/"v2"); skips
    with the reason where none can be made here."""
    import pymoecache.plan as L

    try:
        lines = open(L._PROC_CGROUP).read().splitlines()
    except OSError as e:
        pytest.skip(f"no {L._PROC_CGROUP}: {e}")
    v1 = next((p.split(":", 2)[2] for p in lines if len(p.split(":", 2)) == 3 and "memory" in p.split(":")[1].split(",")),
              None)
    rel = next((ln[3:] for ln in lines if ln.startswith("0::")), None)
    d = os.path.join(L._cgroup_v1_dir(v1), f"pmc-test-{os.getpid()}") if v1 is not None else \
        os.path.join(L._CGROUP_ROOT, (rel or "/").lstrip("/"), f"pmc-test-{os.getpid()}")
    try:
        os.mkdir(d)
        with open(os.path.join(d, "memory.limit_in_bytes" if v1 is not None else "memory.max"), "w") as f:
            f.write(str(limit))
    except OSError as e:
        try:
            os.rmdir(d)
        except OSError:
            pass
        pytest.skip(f"cannot make a memory cgroup here ({d}: {e.strerror})")
    return d, "cgroup v1" if v1 is not None else "cgroup v2"


def test_run_sizes_its_cache_by_the_cgroup_it_runs_in(fixture_dir, tmp_path):
    """Issue 76 item 3, as users have it: `pymoecache run M` started in a memory cgroup of 120 MiB (made here, v1
    or v2) sizes `--cache-size auto` by what the cgroup leaves, and its plan line says which limit it read."""
    d, which = _own_cgroup(tmp_path, 120 << 20)
    try:
        procs = os.path.join(d, "cgroup.procs")
        r = subprocess.run([sys.executable, "-m", "pymoecache", "run", str(model_path(fixture_dir, QWEN)), "-n", "2",
                            "-p", "Hi", "--cache-size", "auto"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300, preexec_fn=lambda: open(procs, "w").write(str(os.getpid())))
    finally:
        os.rmdir(d)
    assert r.returncode == 0, r.stderr[-2000:]
    m = re.search(r"^plan: ([\d.]+) (MiB|GiB) free under the (cgroup v\d) limit =", r.stderr, re.M)
    assert m and m.group(3) == which, r.stderr[-2000:]
    assert float(m.group(1)) * (1024 if m.group(2) == "GiB" else 1) <= 120, m.group(0)
    assert f"free under the {which} limit" in r.stdout + r.stderr  # (auto's reason names it too)
