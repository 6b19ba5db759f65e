"""ggml RPC as a user reaches it (issue 41, items 1 to 3): the installed package, in a fresh process
started outside the source tree, with nothing registered beforehand: the flag or the keyword alone.

The source tree's build directory holds libggml.so as a link to the libggml.so.0 that libllama
loads, which hid that an installed wheel (copies, not links) registered RPC servers with a second
ggml. Here the layers must be seen on the device: llama.cpp's "using device RPC0" and an RPC0 model
buffer in the log. A server that goes away must cost the model that used it, not the process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import ROOT, free_port, http_request, model_path

from pymoecache import rpc

MODEL = "qwen2moe-60x4"


def installed_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYMOECACHE_LIB_DIR", "LLAMA_CPP_LIB_PATH")}
    return env


def installed(tmp_path, *args, timeout=300, **kw):
    """``python -m pymoecache ARGS`` from a directory outside the source tree: the installed package."""
    return subprocess.run([sys.executable, "-m", "pymoecache", *map(str, args)], cwd=tmp_path, env=installed_env(),
                          capture_output=True, text=True, timeout=timeout, **kw)


def on_device(log: str, endpoint: str) -> bool:
    """llama.cpp's log says the model's layers went to the RPC server's device."""
    return (f"using device RPC0 ({endpoint})" in log and f"RPC0[{endpoint}] model buffer size" in log
            and "layers to GPU" in log)


def test_the_tests_see_the_installed_package(tmp_path):
    """The processes below import the package pip installed, not this checkout."""
    r = subprocess.run([sys.executable, "-c", "import pymoecache, pymoecache._lib as l; print(pymoecache.__file__); "
                        "print(l.find_lib_dir())"], cwd=tmp_path, env=installed_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    pkg, lib = r.stdout.split()
    assert "site-packages" in pkg and not pkg.startswith(str(ROOT / "pymoecache")), r.stdout
    assert lib.endswith(os.path.join("site-packages", "pymoecache", "lib")), r.stdout


@pytest.fixture()
def server():
    """An RPC server in a child process; this test process registers nothing."""
    with rpc.LocalServer(register=False) as s:
        yield s.endpoint


@pytest.mark.parametrize("command", [
    ("run", "-p", "ROMEO:", "-n", "4"),
    ("chat", "-p", "Hello", "-n", "4", "--single-turn"),
    ("bench", "-n", "4", "--reps", "1", "--routing", "lru"),
])
def test_rpc_flag_offloads_the_layers(fixture_dir, tmp_path, server, command):
    model = model_path(fixture_dir, MODEL)
    r = installed(tmp_path, command[0], "-m", model, *command[1:], "-ngl", "99", "--rpc", server, "-v",
                  "--cache-size", "0.5", input="")
    assert r.returncode == 0, r.stderr[-3000:]
    assert on_device(r.stderr, server), r.stderr[-4000:]


def test_rpc_servers_keyword_offloads_the_layers(fixture_dir, tmp_path, server):
    script = ("import sys, pymoecache\n"
              "llm = pymoecache.Llama(sys.argv[1], n_gpu_layers=99, rpc_servers=sys.argv[2], n_ctx=64, verbose=True)\n"
              "print(llm('ROMEO:', max_tokens=4)['usage']['completion_tokens'])\n")
    r = subprocess.run([sys.executable, "-c", script, str(model_path(fixture_dir, MODEL)), server], cwd=tmp_path,
                       env=installed_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert on_device(r.stderr, server), r.stderr[-4000:]


def test_serve_with_rpc_offloads_the_layers(fixture_dir, tmp_path, server):
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pymoecache", "serve", "-m", str(model_path(fixture_dir, MODEL)),
                                 "--port", str(port), "-ngl", "99", "--rpc", server, "-v", "-c", "256"],
                                cwd=tmp_path, env=installed_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                status, _ = http_request(f"http://127.0.0.1:{port}/health", timeout=5)
                if status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.25)
        status, _ = http_request(f"http://127.0.0.1:{port}/v1/completions", {"prompt": "ROMEO:", "max_tokens": 4})
        assert status == 200
        status, text = http_request(f"http://127.0.0.1:{port}/props")
        plan = json.loads(text)["moecache"]["memory_plan"]  # the model fits the server: every expert there
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert on_device(log.read_text(), server), log.read_text()[-4000:]
    from pymoecache.model_info import model_info

    info = model_info(model_path(fixture_dir, MODEL))
    assert plan["gpu_expert_layers"] == info.n_moe_layer and plan["cache_bytes"] == 0, plan
    assert plan["gpu_expert_bytes"] == int(info.expert_bytes * info.n_expert * info.n_moe_layer), plan
    # (the dense part is on the device but the input layer, which stays mapped on the CPU, a row read a token: the
    # output has its own weights, so the plan counts none of it)
    assert info.output_tied_bytes == 0 and plan["dense"] == 0 and plan["n_vram"] == 0, plan



def test_a_companion_beside_the_model_feeds_the_cpu_and_the_vram_tier_on_the_device(fixture_dir, tmp_path, server):
    """`run -ngl 99 --rpc HOST --vram-size 6` with a low-bit companion beside the model: the default,
    lowbit-cache, runs beside GPU layers too (issue 54 item 4). The plan line says what each tier holds:
    the host slots and the VRAM tier hold the companion's copies, the tier as many as fit in the GPU
    bytes of 6 full experts (9 of Q5_0 for Q8_0), and the stats line shows selections computed there."""
    import shutil

    model = tmp_path / "model.gguf"
    shutil.copy(model_path(fixture_dir, MODEL, ".Q8_0"), model)
    made = installed(tmp_path, "lowbit", model, "--type", "Q5_0")
    assert made.returncode == 0, made.stderr[-3000:]
    r = installed(tmp_path, "run", "-m", model, "-p", "ROMEO:", "-n", "8", "-ngl", "99", "--rpc", server, "-v",
                  "--cache-size", "8", "--vram-size", "6", "--vram-fill", "copy", "--routing", "lru", input="")
    assert r.returncode == 0, r.stderr[-3000:]
    assert on_device(r.stderr, server), r.stderr[-4000:]
    out = r.stdout + r.stderr
    assert "(12 of 60 per layer low-bit" in out and "VRAM tier 9 of 60 per layer low-bit in" in out, out[-3000:]
    assert "(lowbit-cache)" in out
    vram = re.search(r"selections from vram (\d+)", out)
    assert vram and int(vram.group(1)) > 0, out[-3000:]



def test_a_q8_0_companion_doubles_the_vram_tier_and_the_preset_is_resolved_for_what_it_holds(fixture_dir, tmp_path,
                                                                                              server):
    """`lowbit --type Q8_0` of a model with wider experts (the fixture's are F32), then `run -ngl 99 --rpc HOST
    --cache-size 1.0 --vram-size 15 --routing preset:balanced`: the tier holds the Q8_0 copies that fit
    in the bytes of 15 full experts (56 of 60), and the preset is resolved for that share (Top-J 1 at
    >= half the experts), not for 15 of 60 (Top-J 2, what `--miss full` still gets)."""
    import shutil

    model = tmp_path / "model.gguf"
    shutil.copy(model_path(fixture_dir, MODEL), model)
    made = installed(tmp_path, "lowbit", model, "--type", "Q8_0")
    assert made.returncode == 0 and (tmp_path / "model.lowbit-Q8_0.gguf").is_file(), made.stderr[-3000:]
    assert "3.76x fewer bytes" in made.stdout, made.stdout  # F32 -> Q8_0: 34 bytes per 32 weights
    out = {}
    for miss in ("auto", "full"):
        r = installed(tmp_path, "run", "-m", model, "-p", "ROMEO:", "-n", "8", "-ngl", "99", "--rpc", server, "-v",
                      "--residency", "stream", "--cache-size", "1.0", "--vram-size", "15", "--routing",
                      "preset:balanced", "--miss", miss, input="")
        assert r.returncode == 0, r.stderr[-3000:]
        assert on_device(r.stderr, server), r.stderr[-4000:]
        out[miss] = r.stdout + r.stderr
    assert "VRAM tier 56 of 60 per layer low-bit in" in out["auto"], out["auto"][-3000:]
    assert "[preset balanced: prior:0.2:j=1," in out["auto"], out["auto"][-3000:]
    assert "VRAM tier 15 of 60 per layer in" in out["full"], out["full"][-3000:]
    assert "[preset balanced: prior:0.2:j=2," in out["full"], out["full"][-3000:]
    for text in out.values():
        vram = re.search(r"selections from vram (\d+)", text)
        assert vram and int(vram.group(1)) > 0, text[-3000:]


def test_a_vram_tier_over_a_model_that_fits_in_ram_is_the_seeds_scenario(fixture_dir, tmp_path, server):
    """`run -ngl 99 --rpc HOST --vram-size 15` and nothing else, the model fitting in RAM: every expert in the
    cache's host slots (not all of them on the device, as llama.cpp would put them with residency none),
    15 per layer in the tier, the default routing steered to them. Without -ngl the tier is refused in
    one warning line."""
    model = model_path(fixture_dir, MODEL)
    r = installed(tmp_path, "run", "-m", model, "-p", "ROMEO:", "-n", "16", "-ngl", "99", "--rpc", server, "-v",
                  "--vram-size", "15", input="")
    assert r.returncode == 0, r.stderr[-3000:]
    assert on_device(r.stderr, server), r.stderr[-4000:]
    out = r.stdout + r.stderr
    assert "warning" not in out, out[-3000:]
    assert "(60 of 60 per layer)" in out and "VRAM tier 15 of 60 per layer in" in out, out[-3000:]
    assert re.search(r"\[preset quality: prior:[0-9.]+:j=1,", out), out[-3000:]  # steered to the tier
    m = re.search(r"selections from vram (\d+), ram (\d+)", out)  # (the device's, the CPU's host slots)
    assert m and int(m.group(1)) > 0 and int(m.group(2)) > 0, out[-3000:]
    r = installed(tmp_path, "run", "-m", model, "-p", "ROMEO:", "-n", "2", "--vram-size", "15", input="")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "pymoecache run: warning: vram_size=15 ignored: no layer is on a GPU" in r.stderr, r.stderr[-3000:]


def test_experts_that_do_not_fit_the_gpu_stay_in_ram_and_the_tier_takes_what_fits(fixture_dir, tmp_path):
    """`run -ngl 99 --rpc HOST` and nothing else, against `rpc-server --mem` (a GPU of that much memory):
    every expert of the model fits in RAM, half of them beside the dense part, the KV cache and
    llama.cpp's 1 GiB margin on the GPU. The run keeps every expert in the cache and as many per
    layer in a VRAM tier as fit there (the plan line says why), where llama.cpp (residency none) would
    put all of them on the GPU. The same run against a server with the machine's memory is unchanged
    (every expert on the device, stock graph splits), and llama.cpp's --cpu-moe keeps its placement.
    `-ngl auto` (llama.cpp's) offloads every layer whose dense part and KV cache fit, then places the
    experts as above."""
    from pymoecache.model_info import model_info

    model = model_path(fixture_dir, MODEL)
    info = model_info(model)
    # -ngl 99 puts the dense part there but the input layer (token_embd), and the KV cache: F16 K and V, -c 256
    dense, kv = info.dense_bytes(info.n_layer)[1], 2 * 256 * info.n_layer * info.n_embd_kv
    one = int(info.expert_bytes * info.n_moe_layer)  # an expert of every layer
    want = 30
    mem = (1 << 30) + dense + kv + want * one + one // 2  # (a GPU with room for 30.5 experts per layer)
    output = info.output_bytes + info.output_tied_bytes  # -ngl auto: the output layer, then each repeating one's
    per_layer = (dense - output + kv) / info.n_layer     # share of the dense part and the KV cache
    few = (1 << 30) + output + int(1.5 * per_layer)     # (a GPU with room for the output and 1.5 layers: -ngl 2)
    with rpc.LocalServer(register=False, mem=mem) as small, rpc.LocalServer(register=False) as large, \
            rpc.LocalServer(register=False, mem=few) as tiny:
        out = {}
        for name, endpoint, flags in (("small", small.endpoint, ()), ("large", large.endpoint, ()),
                                      ("cpu-moe", small.endpoint, ("--cpu-moe",)),
                                      ("auto", small.endpoint, ("--cache-size", "0.5", "--vram-size", "auto")),
                                      ("ngl-auto", small.endpoint, ("-ngl", "auto")),
                                      ("ngl-auto-large", large.endpoint, ("-ngl", "auto")),
                                      ("ngl-auto-tiny", tiny.endpoint, ("-ngl", "auto"))):
            ngl = () if "-ngl" in flags else ("-ngl", "99")
            r = installed(tmp_path, "run", "-m", model, "-p", "ROMEO:", "-n", "16", "-c", "256", *ngl,
                          "--rpc", endpoint, "-v", *flags, input="")
            assert r.returncode == 0, r.stderr[-3000:]
            assert name == "ngl-auto-tiny" or on_device(r.stderr, endpoint), r.stderr[-4000:]
            out[name] = r.stdout + r.stderr
        # `info --rpc HOST`: the plan from the server's own report of its free memory, before any load
        r = installed(tmp_path, "info", model, "-c", "256", "--rpc", small.endpoint)
        assert r.returncode == 0 and "GPU layers on the --rpc server's device (its free memory as it reports it)" in \
            r.stdout and f"every expert in RAM, {want} per layer also in GPU memory" in r.stdout, r.stdout[-3000:]
        d = json.loads(installed(tmp_path, "info", model, "-c", "256", "--rpc", tiny.endpoint, "--json").stdout)
        assert d["gpu_free"] == few and f"2 of {info.n_layer + 1} layers" in d["gpu_plan"]["-ngl auto"], d["gpu_plan"]
    # -ngl auto: every layer where its dense part fits, then the experts as -ngl 99; the dense part of 2 layers
    n = info.n_layer + 1  # (llama.cpp counts the output layer)
    for name in ("ngl-auto", "ngl-auto-large"):
        assert f"offloaded {n}/{n} layers to GPU" in out[name], out[name][-3000:]
    assert f"VRAM tier {want} of 60 per layer in" in out["ngl-auto"] and "VRAM tier" not in out["ngl-auto-large"]
    assert f"offloaded 2/{n} layers to GPU" in out["ngl-auto-tiny"], out["ngl-auto-tiny"][-3000:]
    # `info --gpu-mem` says it all before a load, with the same rules
    for size, says in ((mem, f"every expert in RAM, {want} per layer also in GPU memory"), (few, f"2 of {info.n_layer + 1} layers"), (64 << 30, "every expert on the GPU")):
        r = installed(tmp_path, "info", model, "-c", "256", "--gpu-mem", f"{size}b")
        assert r.returncode == 0 and says in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    text = out["small"]
    assert f"VRAM tier {want} of 60 per layer in" in text, text[-3000:]
    assert f"the experts do not fit in the {mem / 2**20:.0f} MiB free on the GPU (less a 1024 MiB margin" in text, \
        text[-3000:]
    assert "(60 of 60 per layer)" in text and "warning" not in text, text[-3000:]
    m = re.search(r"selections from vram (\d+), ram (\d+)", text)
    assert m and int(m.group(1)) > 0, text[-3000:]
    assert not re.search(r"blk\.\d+\.ffn_\w+_exps\.weight .* buffer type overridden", text)  # (not llama.cpp's)
    for name in ("large", "cpu-moe"):
        assert "VRAM tier" not in out[name] and "do not fit" not in out[name], out[name][-3000:]
        assert "none: device:" in out[name], out[name][-3000:]  # every expert where llama.cpp puts it
    assert "device: 2.0 graph splits/tok" in out["large"], out["large"][-3000:]
    assert f"VRAM tier {want} of 60 per layer in" in out["auto"] and "VRAM tier sized to the" in out["auto"]
    assert "(30 of 60 per layer" in out["auto"], out["auto"][-3000:]


LARGER_THAN_RAM_SCRIPT = r"""
import json, sys
import pymoecache
from pymoecache import CacheConfig
path, endpoint, residency = sys.argv[1:4]
llm = pymoecache.Llama(path, cache=CacheConfig(size=30, residency=residency), routing="lru", n_gpu_layers=99,
                       rpc_servers=endpoint, n_ctx=256, verbose=False)
tokens = llm.tokenize(b"ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun.")
for p in range(2):  # the same tokens twice, each decoded alone: top-k selects the same experts in the second pass
    llm.reset()
    llm.reset_moe_stats()
    for t in tokens:
        llm.eval([t])
st = llm.moe_stats()
rs = st.residency
print(json.dumps(dict(loads=rs.decode_loads, evictions=st.evictions, tokens=rs.decode_tokens, vram=rs.vram_slots,
                      exclusive=rs.vram_exclusive_layers, vram_hits=rs.vram_hits, from_file=rs.vram_from_file,
                      plan=llm.memory_plan().summary())))
"""


def test_a_model_larger_than_ram_keeps_its_share_there_and_the_gpu_holds_others(fixture_dir, tmp_path):
    """`run -ngl 99 --rpc HOST --cache-size 30`, the cache holding half of each layer's experts as it does
    on a machine whose RAM is smaller than the model: the GPU's free memory holds others, exclusive
    tiers (an expert in GPU memory keeps no RAM slot), so the two hold more than RAM alone and the file is
    read less. Against a server with room for 20.5 experts per layer beside the rest the tier is 20 (the
    two hold 50 of 60); against one with the machine's memory it is the other 30: once every expert was
    read, none is read again (the Python API, the same keywords alone, top-k decoding the same tokens
    twice), where `--residency stream` (the previous default: no tier) keeps reading. `info --gpu-mem`
    says the same before a load, and with a RAM budget smaller than the model (`--ram`) and a GPU that
    holds every expert, llama.cpp's placement: every expert on the GPU, none in RAM."""
    from pymoecache.model_info import model_info

    model = model_path(fixture_dir, MODEL)
    info = model_info(model)
    dense, kv = info.dense_bytes(info.n_layer)[1], 2 * 256 * info.n_layer * info.n_embd_kv  # KV: F16 K and V, -c 256
    one = int(info.expert_bytes * info.n_moe_layer)  # an expert of every layer
    mem = (1 << 30) + dense + kv + 20 * one + one // 2  # (a GPU with room for 20.5 experts per layer)
    with rpc.LocalServer(register=False, mem=mem) as small, rpc.LocalServer(register=False) as large:
        out = {}
        for name, endpoint, ngl in (("small", small.endpoint, "99"), ("large", large.endpoint, "99"),
                                    ("partial", large.endpoint, "3")):  # (-ngl 3: the output layer and 2 more)
            r = installed(tmp_path, "run", "-m", model, "-p", "ROMEO:", "-n", "16", "-c", "256", "-ngl", ngl,
                          "--rpc", endpoint, "-v", "--cache-size", "30", input="")
            assert r.returncode == 0 and on_device(r.stderr, endpoint), r.stderr[-3000:]
            out[name] = r.stdout + r.stderr
        got = {}
        for residency in ("auto", "stream"):
            r = subprocess.run([sys.executable, "-c", LARGER_THAN_RAM_SCRIPT, str(model), large.endpoint, residency],
                               cwd=tmp_path, env=installed_env(), capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stderr[-3000:]
            got[residency] = json.loads(r.stdout.splitlines()[-1])
    for name, n_vram, held in (("small", 20, "50 of 60"), ("large", 30, "60 of 60 (all")):
        text = out[name]
        assert f"VRAM tier {n_vram} of 60 per layer in" in text and f"exclusive: RAM and VRAM hold {held}" in text, \
            text[-3000:]
        assert "the cache holds fewer than every expert: the tier holds others, sized to the" in text, text[-3000:]
        assert "(30 of 60 per layer" in text and "warning" not in text, text[-3000:]
        # what decoding reads counts both tiers: 10 of 60 not held, or none once warm
        assert ("decode reads ~" in text and "(17% misses if routing were uniform)" in text if name == "small" else
                "decode from memory once warm: RAM and VRAM hold every expert" in text), text[-3000:]
        m = re.search(r"selections from vram (\d+), ram (\d+), file (\d+).*; exclusive", text)
        assert m and int(m.group(1)) > 0, text[-3000:]
    # -ngl 3: the tiers of the 2 MoE layers on the GPU hold every expert, the other layers the cache's 30
    text = out["partial"]
    assert ("VRAM tier 30 of 60 per layer in" in text and "exclusive: RAM and VRAM hold 60 of 60 in the 2 MoE layers "
            "on the GPU (the others 30);" in text and "(25% misses if routing were uniform)" in text), text[-3000:]
    tiers, stream = got["auto"], got["stream"]
    assert tiers["vram"] == 30 and tiers["exclusive"] == info.n_moe_layer, tiers
    assert tiers["tokens"] > 0 and tiers["loads"] == 0 and tiers["evictions"] == 0, tiers  # (the second pass)
    assert tiers["vram_hits"] > 0 and tiers["from_file"] == 0, tiers
    assert stream["vram"] == 0 and stream["loads"] > 0 and stream["evictions"] > 0, stream
    assert "VRAM tier" not in stream["plan"], stream["plan"]
    # `info --gpu-mem`: the same rule before a load; a RAM budget that holds a fifth of the experts and a GPU
    # that holds them all: every expert on the GPU
    budget = int(info.non_expert_bytes + kv + 0.2 * info.expert_bytes_total) + (128 << 20)
    for flags, says in ((("--cache-size", "30", "--gpu-mem", f"{mem}b"),
                         "30 per layer in RAM, 20 others in GPU memory (exclusive: the two hold 50 of 60)"),
                        (("--cache-size", "30", "--gpu-mem", "64G"),
                         "30 per layer in RAM, 30 others in GPU memory (exclusive: the two hold all)"),
                        (("--ram", f"{budget}b", "--gpu-mem", "64G"), "every expert on the GPU, none in RAM")):
        r = installed(tmp_path, "info", model, "-c", "256", *flags)
        assert r.returncode == 0 and says in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


SMALL_RAM_SCRIPT = r"""
import sys
import pymoecache.plan as plan
plan._available_memory = lambda: int(sys.argv[1])  # (a machine with this much memory free)
from pymoecache.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_auto_cache_size_on_a_machine_smaller_than_the_model_puts_the_experts_where_the_gpu_holds_them(fixture_dir,
                                                                                                       tmp_path):
    """`run -ngl N --rpc HOST` with `--cache-size auto` (the default) on a machine whose free memory holds a
    third of the experts and a GPU that holds them all. -ngl 99: llama.cpp's placement, every expert on the
    GPU, and the plan line says so (it counted them as an expert cache in RAM, over the memory free, with
    the dense part and KV cache that the GPU holds). -ngl 3 leaves 2 of the 4 MoE layers on the CPU, whose
    experts alone are more than RAM holds: llama.cpp's placement would load every one of them, so the
    cache streams there and the GPU layers' tiers hold what it does not (it was residency none: all of
    them in RAM). -ngl 99 --vram-size auto: exclusive tiers, sized and said for the RAM cache that the
    spare slots for reading ahead leave."""
    from pymoecache.model_info import model_info

    model = model_path(fixture_dir, MODEL)
    info = model_info(model)
    free = int(0.3 * info.expert_bytes_total) + (128 << 20)  # (-ngl 99: the dense part and the KV cache on the GPU;
    #                                                          the input layer, read a row a token, is not counted)
    with rpc.LocalServer(register=False) as server:
        out = {}
        for ngl in ("99", "3", "99 --vram-size auto"):
            r = subprocess.run([sys.executable, "-c", SMALL_RAM_SCRIPT, str(free), "run", "-m", str(model), "-p",
                                "ROMEO:", "-n", "8", "-c", "256", "-ngl", *ngl.split(), "--rpc", server.endpoint, "-v"],
                               cwd=tmp_path, env=installed_env(), capture_output=True, text=True, timeout=300, input="")
            assert r.returncode == 0 and on_device(r.stderr, server.endpoint), r.stderr[-3000:]
            out[ngl] = r.stdout + r.stderr
    experts = info.expert_bytes * info.n_expert * info.n_moe_layer
    text = out["99"]
    assert "expert cache 0.00 MiB (60 of 60 per layer; every expert on the GPU: " in text, text[-3000:]
    m = re.search(r"every expert on the GPU: ([\d.]+) MiB of GPU memory\)", text)
    assert m and abs(float(m.group(1)) - experts / 2**20) < 0.01, text[-3000:]
    assert "dense part 0.00 MiB + KV cache 0.00 MiB" in text and "too little" not in text, \
        text[-3000:]
    assert "decode from memory: every expert is in RAM or on the GPU" in text, text[-3000:]
    assert "every expert of the 4 MoE layers on the GPU goes there (llama.cpp's placement)" in text, text[-3000:]
    assert re.search(r"\| none: device: ", text), text[-3000:]
    text = out["3"]
    m = re.search(r"expert cache [\d.]+ MiB \((\d+) of 60 per layer(?: \+ (\d+) spare)?\)", text)
    assert m and int(m.group(1)) < 30, text[-3000:]  # (a third of 60, less the margin and the spare slots)
    assert (f"VRAM tier {60 - int(m.group(1))} of 60 per layer" in text and "exclusive: RAM and VRAM hold 60 of 60 in "
            f"the 2 MoE layers on the GPU (the others {m.group(1)})" in text), text[-3000:]
    assert "| stream: read " in text and "; exclusive, " in text, text[-3000:]
    # a tier asked for (--vram-size auto) beside every layer: sized, and said, for the cache that the spare slots
    # for reading ahead leave (it was sized before they were taken: the line said 2 more in RAM, 2 fewer in VRAM)
    text = out["99 --vram-size auto"]
    m = re.search(r"expert cache [\d.]+ MiB \((\d+) of 60 per layer \+ (\d+) spare\)", text)
    assert m, text[-3000:]
    n = int(m.group(1))
    assert (f"VRAM tier {60 - n} of 60 per layer" in text and f": {n} per layer in RAM, {60 - n} others in GPU memory "
            "(exclusive: the two hold all)" in text), text[-3000:]


def test_ppl_with_gpu_layers_on_an_rpc_server_scores_as_the_cpu_does(fixture_dir, tmp_path, server):
    """`ppl -ngl 99 --rpc HOST` (it took neither flag): the layers, their experts with them, on the
    server's device, every row saying so (gpu_layers), and the same perplexities and miss rates as on
    the CPU, for top-k and a cache-aware routing, batched and one token at a time; the CPU's rows say
    0 layers."""
    model = model_path(fixture_dir, MODEL)
    text = tmp_path / "text.txt"
    text.write_text("ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the "
                    "sun. Arise, fair sun, and kill the envious moon, who is already sick and pale with grief.\n" * 12)
    rows = {}
    for where, flags in (("cpu", ()), ("gpu", ("-ngl", "99", "--rpc", server))):
        for decode in ((), ("--decode",)):
            out = tmp_path / f"{where}{len(decode)}.json"
            r = installed(tmp_path, "ppl", "-m", model, "-f", text, "-c", "64", "--chunks", "3", "--prior", "0.5",
                          "--cache-size", "0.5", "--no-progress", "--json", out, *decode, *flags)
            assert r.returncode == 0, r.stderr[-3000:]
            rows[where, bool(decode)] = json.loads(out.read_text())
    n_layer = 4  # (the fixture's)
    for decode in (False, True):
        cpu, gpu = rows["cpu", decode], rows["gpu", decode]
        assert [r["policy"] for r in gpu] == ["lru", "prior"] == [r["policy"] for r in cpu], gpu
        for c, g in zip(cpu, gpu):
            assert c["gpu_layers"] == 0 and g["gpu_layers"] == n_layer, (c, g)
            assert g["tokens"] == c["tokens"] > 0 and abs(g["ppl"] / c["ppl"] - 1) < 1e-3, (c, g)
            assert abs(g["miss_rate"] - c["miss_rate"]) < 0.01, (c, g)


@pytest.mark.parametrize("mem", ["0", "-5", "lots", "512k"])
def test_rpc_server_mem_refuses_what_is_not_a_size(tmp_path, mem):
    r = installed(tmp_path, "rpc-server", "--port", str(free_port()), "--mem", mem, timeout=60)
    assert r.returncode == 2 and f"--mem {mem}: give the memory to report" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_exclusive_tiers_as_users_run_them(fixture_dir, tmp_path, server):
    """`run -ngl 99 --rpc HOST --cache-size 45 --vram-size 15 --vram-exclusive`: the plan line says the
    two tiers hold all 60 experts of a layer, and the stats line that the tiers are exclusive."""
    r = installed(tmp_path, "run", "-m", model_path(fixture_dir, MODEL), "-p", "ROMEO:", "-n", "16", "-ngl", "99",
                  "--rpc", server, "-v", "--cache-size", "45", "--vram-size", "15", "--vram-exclusive",
                  "--vram-fill", "copy", "--prefetch", "off", input="")
    assert r.returncode == 0, r.stderr[-3000:]
    assert on_device(r.stderr, server), r.stderr[-4000:]
    out = r.stdout + r.stderr
    assert "VRAM tier 15 of 60 per layer in" in out and "exclusive: RAM and VRAM hold 60 of 60 (all" in out, out[-3000:]
    down = re.search(r"; exclusive, (\d+) moved down", out)
    assert down, out[-3000:]
    r = installed(tmp_path, "run", "-m", model_path(fixture_dir, MODEL), "-p", "ROMEO:", "-n", "2", "--cache-size", "45",
                  "--vram-exclusive", input="")
    assert r.returncode == 2 and "vram_exclusive needs a VRAM tier" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("flags, on_cpu, splits", [
    ((), [], 2),                                    # every layer and expert on the device
    (("--n-cpu-moe", "2"), [0, 1], 6),              # llama.cpp's static split: the first 2 layers' experts in RAM
    (("-ot", "exps=CPU"), [0, 1, 2, 3], 10),        # every expert in RAM (--cpu-moe's placement)
    (("--cpu-moe",), [0, 1, 2, 3], 10),
])
def test_n_cpu_moe_and_override_tensor_place_the_experts_as_llama_cpp(fixture_dir, tmp_path, server, flags, on_cpu,
                                                                      splits):
    """`run -ngl 99 --rpc HOST --residency none` with llama-cli's --n-cpu-moe / -ot / --cpu-moe: the
    experts those name stay in CPU memory (llama.cpp's log names each tensor overridden), the others go
    to the device, and the decoded token's graph splits say where they were computed (two more for each
    layer whose experts the CPU computes)."""
    r = installed(tmp_path, "run", "-m", model_path(fixture_dir, MODEL), "-p", "ROMEO:", "-n", "4", "-ngl", "99",
                  "--rpc", server, "-v", "--residency", "none", *flags, input="")
    assert r.returncode == 0, r.stderr[-3000:]
    assert on_device(r.stderr, server), r.stderr[-4000:]
    moved = sorted({int(m) for m in re.findall(r"tensor blk\.(\d+)\.ffn_\w+_exps\.weight .* buffer type overridden "
                                                  r"to CPU", r.stderr)})
    assert moved == on_cpu, r.stderr[-4000:]
    assert f"{splits:.1f} graph splits/tok" in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]

CACHE_GONE_SCRIPT = r"""
import gc, sys
import pymoecache
from pymoecache import CacheConfig, rpc
server = rpc.LocalServer(register=False).__enter__()
llm = pymoecache.Llama(sys.argv[1], n_gpu_layers=99, rpc_servers=server.endpoint, n_ctx=128, verbose=False,
                       cache=CacheConfig(size=0.25, residency="stream", vram_size=4))
print("tokens", llm("ROMEO:", max_tokens=3, temperature=0)["usage"]["completion_tokens"], flush=True)
cycle = [llm]
cycle.append(cycle)  # the Llama and its cache collected by the garbage collector, in no set order
server.__exit__(None, None, None)
llm.moecache.close()  # what the collector may do first: the cache alone, its device buffers on the gone server
del llm, cycle
gc.collect()
print("exits", flush=True)
"""


def test_a_cache_whose_rpc_server_is_gone_is_dropped_not_freed(fixture_dir, tmp_path):
    """A VRAM tier's buffers live on the RPC server: freeing them after the server stopped would wait
    forever for its answer (seen: a test process that never exited, its Llamas collected after the
    session's server stopped). The cache, closed or collected apart from its Llama, drops them."""
    r = subprocess.run([sys.executable, "-c", CACHE_GONE_SCRIPT, str(model_path(fixture_dir, MODEL))], cwd=tmp_path,
                       env=installed_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tokens 3" in r.stdout and "exits" in r.stdout, r.stdout + r.stderr[-3000:]

GONE_SCRIPT = r"""
import sys
import pymoecache
from pymoecache import rpc
from pymoecache.errors import ClosedError, ConfigError, DeviceLostError
path, how = sys.argv[1], sys.argv[2]
server = rpc.LocalServer(register=False).__enter__()
llm = pymoecache.Llama(path, n_gpu_layers=99, rpc_servers=server.endpoint, n_ctx=128, verbose=False)
print("tokens", llm("ROMEO:", max_tokens=3, temperature=0)["usage"]["completion_tokens"], flush=True)
try:
    if how == "between":
        server.__exit__(None, None, None)
        llm("ROMEO:", max_tokens=3)
    else:  # mid-stream: between two chunks of a streamed answer
        stream = llm("ROMEO:", max_tokens=16, stream=True)
        next(stream)
        server.__exit__(None, None, None)
        for _ in stream:
            pass
    print("no error")
except DeviceLostError as e:
    print("lost:", e, flush=True)
try:
    llm("ROMEO:", max_tokens=1)
except ClosedError as e:
    print("closed:", e, flush=True)
cpu = pymoecache.Llama(path, n_gpu_layers=0, n_ctx=128, verbose=False)   # the process goes on, on the CPU
print("cpu tokens", cpu("ROMEO:", max_tokens=3)["usage"]["completion_tokens"], flush=True)
cpu.close()
try:
    pymoecache.Llama(path, n_gpu_layers=99, rpc_servers=server.endpoint, n_ctx=128, verbose=False)
    print("loaded on a gone server")
except ConfigError as e:
    print("refused:", e, flush=True)
"""


@pytest.mark.parametrize("how", ["between", "mid-stream"])
def test_a_server_that_goes_away_costs_the_model_not_the_process(fixture_dir, tmp_path, how):
    r = subprocess.run([sys.executable, "-c", GONE_SCRIPT, str(model_path(fixture_dir, MODEL)), how], cwd=tmp_path,
                       env=installed_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-3000:])
    lines = r.stdout.strip().splitlines()
    assert lines[0] == "tokens 3", r.stdout
    assert lines[1].startswith("lost: rpc server 127.0.0.1:") and "is gone" in lines[1], r.stdout
    assert lines[2].startswith("closed: ") and "is gone" in lines[2], r.stdout
    assert lines[3] == "cpu tokens 3", r.stdout
    assert lines[4].startswith("refused: rpc server 127.0.0.1:") and "new process" in lines[4], r.stdout


def test_a_server_that_dies_during_a_decode_ends_the_run_with_an_error_not_an_abort(fixture_dir, tmp_path):
    """Issue 53 item 10: the server killed while `run` decodes. ggml's RPC client aborts on its own thread
    with no way back to the caller; the process ends as an error does: the text printed so far is kept,
    one line names the server, exit status 2 (the CLI's for an error), no abort (SIGABRT, core, debugger
    output). (A server gone between two tokens is seen before the next one: a DeviceLostError, the same
    status.)"""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "pymoecache", "rpc-server", "--port", str(port)], cwd=tmp_path,
                              env=installed_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not _listening(port):
            assert server.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        run = subprocess.Popen([sys.executable, "-m", "pymoecache", "run", "-m", str(model_path(fixture_dir, MODEL)),
                                "-ngl", "99", "--rpc", f"127.0.0.1:{port}", "-c", "4096", "-n", "4000", "--ignore-eos",
                                "-p", "ROMEO:", "--cache-size", "0.5"],
                               cwd=tmp_path, env=installed_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        first = run.stdout.read(64)  # decoding has begun
        server.kill()
        out, err = run.communicate(timeout=120)
    finally:
        for p in (server, locals().get("run")):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    n_out = len(first + out)  # (bytes: the text printed before the death, kept)
    out, err = (first + out).decode(errors="replace"), err.decode(errors="replace")
    assert run.returncode == 2, (run.returncode, err[-3000:])
    assert (f"pymoecache: error: rpc server 127.0.0.1:{port} stopped answering" in err
            or f"pymoecache run: error: rpc server 127.0.0.1:{port} is gone" in err), err[-3000:]
    assert out.startswith("ROMEO:") and n_out >= 64 and "in _start" not in out + err, out[-2000:]


CUT_DURING_LOAD_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[2])
import pymoecache
from pymoecache import rpc
from bench_device import CommandCounter  # (with cut_after: a link that drops the connection mid-way)

with rpc.LocalServer(threads=1, register=False) as server:
    link = CommandCounter(server.endpoint, cut_after=200000)  # (the model's weights going up are more)
    llm = pymoecache.Llama(sys.argv[1], n_gpu_layers=99, rpc_servers=link.endpoint, n_ctx=64, verbose=False)
    print("loaded")
"""


def test_a_server_lost_during_a_quiet_load_says_so(fixture_dir, tmp_path):
    """The link to the server dropped while the model's weights go up, verbose=False: llama-cpp-python
    points stderr at /dev/null while it loads, and the process ended with status 2 and not a word. The
    line that names the server reaches the process's stderr."""
    r = subprocess.run([sys.executable, "-c", CUT_DURING_LOAD_SCRIPT, str(model_path(fixture_dir, MODEL)),
                        str(ROOT / "scripts")],
                       cwd=tmp_path, env=installed_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == rpc.EXIT_RPC_LOST and "loaded" not in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])
    assert "stopped answering during a command" in r.stderr, r.stderr[-2000:]


UNUSED_GONE_SCRIPT = r"""
import sys
import pymoecache
from pymoecache import rpc
path = sys.argv[1]
server = rpc.LocalServer(register=False).__enter__()
llm = pymoecache.Llama(path, n_gpu_layers=99, rpc_servers=server.endpoint, n_ctx=64, verbose=False)
print("tokens", llm("ROMEO:", max_tokens=2)["usage"]["completion_tokens"])
server.proc.kill(); server.proc.wait()   # gone; llm is not used again, so nothing has noticed
cpu = pymoecache.Llama(path, n_gpu_layers=0, n_ctx=64, verbose=False)
print("cpu tokens", cpu("ROMEO:", max_tokens=2)["usage"]["completion_tokens"])
cpu.close()
if sys.argv[2] == "close":
    llm.close()
print("end", flush=True)
"""


@pytest.mark.parametrize("how", ["close", "exit"])
def test_a_process_whose_server_died_exits(fixture_dir, tmp_path, how):
    """Issue 53 item 10: a Llama whose server died, closed (or left to the end of the process) without a
    decode after the death: freeing it would wait forever for the server (llama_free -> ggml's RPC
    client); it is given up instead, and the process exits."""
    r = subprocess.run([sys.executable, "-c", UNUSED_GONE_SCRIPT, str(model_path(fixture_dir, MODEL)), how],
                       cwd=tmp_path, env=installed_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-3000:])
    assert r.stdout.split("\n")[:3] == ["tokens 2", "cpu tokens 2", "end"], r.stdout


def _listening(port: int) -> bool:
    """Something accepts connections on the loopback's `port` (a connection to itself, which the kernel
    makes when it picks `port` as the ephemeral source port of a free one, does not count)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            return s.getsockname()[1] != port
    except OSError:
        return False


ORPHAN_SCRIPT = r"""
import sys, time
from pymoecache import rpc
server = rpc.LocalServer(threads=1).__enter__()  # (never left: the process is killed in it)
print(server.proc.pid, server.port, flush=True)
time.sleep(300)
"""


def test_a_local_server_ends_with_the_process_that_started_it(tmp_path):
    """A LocalServer's child, its parent killed inside the ``with`` block (SIGKILL: no cleanup runs), does
    not listen on as an orphan: it exits within seconds."""
    proc = subprocess.Popen([sys.executable, "-c", ORPHAN_SCRIPT], cwd=tmp_path, env=installed_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pid, port = map(int, proc.stdout.readline().split())
        assert _listening(port)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 20  # (the leader shows as a zombie while its threads still exit: wait for the port too)
    while (_alive(pid) or _listening(port)) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = _alive(pid)
    if alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive and not _listening(port)


def _alive(pid: int) -> bool:
    """pid runs (a zombie, exited and not yet reaped by init, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_rpc_server_resolves_names_and_stops_on_ctrl_c(tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pymoecache", "rpc-server", "--host", "localhost", "--port", str(port)],
                            cwd=tmp_path, env=installed_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not _listening(port):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "localhost (127.0.0.1)" in err and "stopped" in err, err
    assert not _listening(port)


@pytest.mark.parametrize("args, says", [
    (("--host", "::1"), "IPv4"),
    (("--host", "no-such-host.invalid"), "no IPv4 address"),
    (("--port", "0"), "from 1 to 65535"),
])
def test_rpc_server_refuses_what_ggml_cannot_serve(tmp_path, args, says):
    r = installed(tmp_path, "rpc-server", *args, timeout=60)
    assert r.returncode == 2 and says in r.stderr and "serving" not in r.stderr, r.stderr
