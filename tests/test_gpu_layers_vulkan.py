"""GPU layers on Vulkan, through Mesa's lavapipe (a Vulkan driver that runs its shaders on the CPU):
ggml's Vulkan backend with its own shaders and buffers, and the one backend these machines can run
that imports host memory (VK_EXT_external_memory_host), the unified-memory path.

With ``n_gpu_layers=99`` the dense part runs in Vulkan; with ``unified="on"`` the routed experts are
computed by Vulkan too, in place on the host slot arena wrapped as Vulkan buffers
(src_cpp/moecache-unified.cpp); with ``"off"`` on the CPU (llama.cpp's --cpu-moe placement). Either
way the run must be the CPU run: the same greedy tokens, logits within Vulkan's tolerance (its
shaders accumulate in f16 in places), the same counters and cache contents.

Needs a build with ``-DGGML_VULKAN=ON`` and lavapipe (scripts/vulkan_lavapipe.sh; .ci/run does
both where it can); skipped otherwise. The Vulkan runs happen in tests/vulkan_worker.py, one process
per model: the device must be visible before ggml registers its backends, and a process that sees
one offloads large prompt matmuls to it even for the CPU reference."""

import dataclasses
import glob
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import pymoecache
import synth
from pymoecache import _lib
from conftest import MOE_FIXTURES, ROOT, model_path
from test_gpu_layers_rpc import DECODES, PROMPT, TRAINED, paths, run

LVP = sorted(glob.glob("/usr/share/vulkan/icd.d/lvp_icd*.json"))
# the worker turns Vulkan's f16 arithmetic off (GGML_VK_DISABLE_F16): with it, routing decisions
# flipped at near-ties on these random-weight models and the runs diverged from the CPU's
VK_ENV = dict(GGML_VK_VISIBLE_DEVICES="0", GGML_VK_DISABLE_F16="1")
SIZES = [0.25, 0.5]
MODELS = MOE_FIXTURES + [p.stem for p in TRAINED]


def vulkan_built() -> bool:
    return any(_lib.find_lib_dir().glob(_lib._shared_lib_name("ggml-vulkan") + "*"))


pytestmark = [
    pytest.mark.skipif(not vulkan_built(), reason="libllama built without Vulkan (scripts/vulkan_lavapipe.sh)"),
    pytest.mark.skipif(not LVP, reason="Mesa's lavapipe is not installed (mesa-vulkan-drivers)"),
]


def runs_for(path):
    """The configurations every model runs: stream with the experts in place on the device and
    on the CPU, mmap; at 1/4 and 1/2 cache, prior:0.5; lru at 1/4. Then at 1/4: stream with
    ``unified="auto"``, which lavapipe (a CPU device, which ggml's Vulkan backend calls a discrete
    GPU) leaves on the CPU, and a VRAM tier of 4 experts per layer beside it."""
    out = []
    for size in SIZES:
        for residency, unified in [("stream", "on"), ("stream", "off"), ("mmap", "auto")]:
            for routing in ["prior:0.5"] + (["lru"] if size == 0.25 and unified != "off" else []):
                out.append(dict(key=f"{residency}-{unified}-{routing}-{size}", path=str(path), residency=residency,
                                routing=routing, size=size, unified=unified))
    for unified, vram in [("auto", 0), ("auto", 4)]:
        out.append(dict(key=f"stream-{unified}-vram{vram}", path=str(path), residency="stream", routing="prior:0.5",
                        size=0.25, unified=unified, vram_size=vram))
    return out


def on_lavapipe(runs, d):
    """The worker's results for `runs`, computed in its own process on lavapipe, in directory d."""
    (d / "runs.json").write_text(json.dumps(runs))
    env = dict(os.environ, VK_DRIVER_FILES=LVP[0], VK_ICD_FILENAMES=LVP[0], **VK_ENV)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "vulkan_worker.py"), str(d / "runs.json"),
                           str(d / "out.npz")], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return dict(np.load(d / "out.npz"))


@pytest.fixture(scope="module")
def vulkan_results(fixture_dir, tmp_path_factory):
    """name -> the worker's npz (computed on first use, one worker process per model)."""
    cache = {}

    def get(name):
        if name not in cache:
            path = paths(fixture_dir).get(name)
            if path is None:
                pytest.skip(f"{name}.gguf is not in this checkout")
            cache[name] = (path, on_lavapipe(runs_for(path), tmp_path_factory.mktemp(f"vk-{name}")))
        return cache[name]

    return get


def row_diffs(a, b):
    return np.abs(a - b).max(axis=1)  # per token


@pytest.mark.parametrize("name", MODELS)
def test_vulkan_gpu_layers_run_as_the_cpu_does(vulkan_results, name):
    """Against the CPU run: the same greedy tokens; logits close (typically within 1% of their
    scale; lavapipe's arithmetic is not the CPU's, and measured single rows moved by up to 8.4%
    of it on the trained qwen2moe); the same counters to within a near-tie (the router's logits
    are the device's: one selection in 512 flipped once under lru)."""
    path, got = vulkan_results(name)
    for r in runs_for(path):
        k = r["key"]
        ref, ref_tokens, st_ref, _ = run(path, r["residency"], r["routing"], r["size"], 0, None, unified=r["unified"])
        assert np.isfinite(ref).all() and st_ref.misses > 0
        d, scale = row_diffs(got[f"{k}/logits"], ref), np.abs(ref).max()
        assert np.median(d) <= 1e-2 * scale and d.max() <= 0.15 * scale, f"{k}: max |diff| {d.max()}, scale {scale}"
        assert got[f"{k}/tokens"].tolist() == ref_tokens, k
        hits, misses, evictions, loads, bytes_read, uni_layers, uni_bytes, vram_selections = got[f"{k}/counters"].tolist()
        selections = st_ref.hits + st_ref.misses
        assert hits + misses == selections and abs(hits - st_ref.hits) <= selections // 100, k
        # where the experts were computed: every MoE layer in place under "on", none otherwise; the
        # VRAM tier saw every decoded selection where it is on
        if r["unified"] == "on":
            assert uni_layers == len(st_ref.moe_layers) and uni_bytes > 0, k
        else:
            assert (uni_layers, uni_bytes) == (0, 0), k
        n_decoded = (len(DECODES) + 8) * st_ref.n_expert_used * len(st_ref.moe_layers)
        assert vram_selections == (n_decoded if r.get("vram_size") else 0), k


@pytest.mark.parametrize("name", MODELS)
def test_vulkan_experts_in_place_run_as_on_the_cpu(vulkan_results, name):
    """The unified-memory path against the --cpu-moe placement on the same device (the dense part's
    arithmetic the same): experts computed by Vulkan in place on the host slots give the same
    tokens, exactly the same counters and cache contents, and logits within 0.1% of their scale
    up to the first decoded token whose selections differ, if one does: a near-tie between two
    cached experts that the two sides' rounding breaks differently (seen once, on the trained
    qwen2moe at a quarter cache: the counters stayed the same, the logits moved by 3.6% of their
    scale at that token, then converged)."""
    path, got = vulkan_results(name)
    for size in SIZES:
        on, off = f"stream-on-prior:0.5-{size}", f"stream-off-prior:0.5-{size}"
        d, scale = row_diffs(got[f"{on}/logits"], got[f"{off}/logits"]), np.abs(got[f"{off}/logits"]).max()
        sel_on, sel_off = got[f"{on}/selected"], got[f"{off}/selected"]
        assert sel_on.shape == sel_off.shape and len(sel_on) > 0
        differ = np.nonzero((sel_on != sel_off).any(axis=1))[0]
        first = len(PROMPT) + (int(sel_on[differ[0], 0]) if len(differ) else len(d))  # its logits row
        assert d[:first].max() <= 1e-3 * scale, f"{on}: max |diff| {d[:first].max()} before row {first}"
        assert d.max() <= 5e-2 * scale, f"{on}: max |diff| {d.max()}"
        assert got[f"{on}/tokens"].tolist() == got[f"{off}/tokens"].tolist()
        assert got[f"{on}/counters"][:5].tolist() == got[f"{off}/counters"][:5].tolist()
        assert got[f"{on}/counters"][5] > 0 and got[f"{off}/counters"][5] == 0
        assert (got[f"{on}/cached"] == got[f"{off}/cached"]).all()


def test_vulkan_in_place_on_quantized_experts_of_whole_pages(tmp_path):
    """Q8_0 experts of whole pages that start mid-page in the file: the CPU's slots are padded by a
    page so that direct I/O reads land in place (moecache-slots.cpp), a stride between experts
    that is not a whole number of Q8_0 blocks. A device steps in blocks: a layer it computes in
    place keeps the plain layout (the first version did not, and its logits were NaN).

    The CPU computes Q8_0 with its activations rounded to 8 bits, Vulkan does not: the experts in
    place are compared with Vulkan computing them from its own buffers (residency none, every
    expert on the device): the same greedy tokens, decoded tokens' logits within 1% of their scale
    (measured 0.3%) up to the first selection that differs."""
    spec = dataclasses.replace(synth.BENCH_SPEC, name="inplace-qwen2moe-8x2", n_layer=2, n_embd=256, n_head=4,
                               n_head_kv=4, n_ctx=256, n_ff=512, n_expert=8, n_expert_used=2, n_ff_exp=256,
                               n_ff_shexp=256)
    path = synth.build_model(spec, tmp_path / "inplace.gguf")
    info = pymoecache.model_info(path)
    assert info.slot_bytes > info.expert_bytes, "the model should start its expert tensors mid-page"
    runs = [dict(key=k, path=str(path), residency=res, routing="lru", size=0.5, unified=u)
            for k, res, u in [("on", "stream", "on"), ("off", "stream", "off"), ("device", "none", "auto")]]
    got = on_lavapipe(runs, tmp_path)
    on, device = got["on/logits"], got["device/logits"]
    assert np.isfinite(on).all()
    assert got["on/tokens"].tolist() == got["device/tokens"].tolist()
    assert got["on/tokens"][0] == got["off/tokens"][0]  # (with the CPU's rounding, lru's near-ties go other ways later)
    assert got["on/counters"][5] == 2 and got["off/counters"][5] == 0  # every MoE layer in place, or none
    sel_on, sel_device = got["on/selected"], got["device/selected"]
    differ = np.nonzero((sel_on != sel_device).any(axis=1))[0]
    first = len(PROMPT) + (int(sel_on[differ[0], 0]) if len(differ) else len(DECODES) + 8)
    d = row_diffs(on, device)[len(PROMPT):first]
    assert len(d) > 0 and d.max() <= 1e-2 * np.abs(device).max(), f"max |diff| {d.max()}"


def test_vulkan_in_place_on_low_bit_copies(fixture_dir, tmp_path):
    """lowbit-cache (the default where a companion lies beside the model) with unified memory: the
    host slots hold the companion's Q5_0 copies and Vulkan computes them in place (issue 54 item 4).
    The CPU rounds its activations to 8 bits for Q5_0, Vulkan does not (decoded logits moved by up to
    3% of their scale between the two): the experts in place are compared with Vulkan computing the
    same Q5_0 tensors from its own buffers (the model with the companion's experts, residency none),
    every token decoded alone (lowbit-cache computes a prompt's ubatch at full precision): the same
    greedy tokens and logits within 0.1% of their scale (measured: equal), every MoE layer in place."""
    import shutil

    from pymoecache import lowbit
    from test_lowbit_miss import reference_model

    m = tmp_path / "model.gguf"
    shutil.copy(model_path(fixture_dir, "qwen2moe-60x4", ".Q8_0"), m)
    c = lowbit.make_companion(m, type="Q5_0", progress=False)
    ref = reference_model(m, c.path, tmp_path / "ref.gguf")
    runs = [dict(key=k, path=str(m), residency="stream", routing="lru", size=0.25, unified=k, miss="lowbit-cache",
                 prompt_by_token=True) for k in ("on", "off")]
    runs.append(dict(key="device", path=str(ref), residency="none", routing="lru", size=1.0, unified="auto", miss="full",
                     prompt_by_token=True))
    got = on_lavapipe(runs, tmp_path)
    on, device = got["on/logits"], got["device/logits"]
    assert np.isfinite(on).all()
    assert got["on/tokens"].tolist() == got["device/tokens"].tolist()
    assert got["on/counters"][5] == 4 and got["off/counters"][5] == 0  # every MoE layer in place, or none
    assert got["on/counters"][1] > 0  # (misses: the copies were streamed)
    d = row_diffs(on, device)
    assert d.max() <= 1e-3 * np.abs(device).max(), f"max |diff| {d.max()}"


EXCLUSIVE_SCRIPT = r"""
import json, sys
import numpy as np
import pymoecache
from pymoecache import CacheConfig
path, host, vram, kw, prompt, tokens, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *map(json.loads, sys.argv[4:7]), sys.argv[7]
cache = CacheConfig(size=host, residency="stream", prefetch="off", vram_size=vram, vram_fill="copy", vram_exclusive=True)
llm = pymoecache.Llama(path, cache=cache, routing="lru", n_gpu_layers=99, **kw)
passes = []
for _ in range(2):  # (as test_gpu_layers_rpc.two_passes: the second pass's stats, the tiers warm)
    llm.reset()
    llm.reset_moe_stats()
    llm.eval(prompt)
    for t in tokens:
        llm.eval([t])
    passes.append(np.array(llm.scores[: llm.n_tokens]))
st = llm.moe_stats()
rs = st.residency
np.savez(out, first=passes[0], second=passes[1], counters=np.array([rs.vram_exclusive_layers, rs.vram_copies,
         rs.vram_copies_down, rs.decode_loads, st.evictions, len(st.moe_layers)]))
llm.close()
"""


@pytest.mark.parametrize("name, host, vram", [("qwen2moe-60x4", 45, 15), ("mixtral-8x2", 6, 2)])
def test_vulkan_exclusive_tiers_move_experts_down_through_the_copier(fixture_dir, tmp_path, name, host, vram):
    """The installed package in a fresh process: exclusive tiers on a device that computes asynchronously, with a host buffer type (pinned memory
    on a GPU): a copy up's victim moves down into the host slot it frees, its bytes read back by the
    copier into the pinned staging ahead of the copies up that overwrite its device slot, and settled
    once the copier is waited for (src_cpp/moecache-vram.cpp, exclusive_claim). vram_fill copy makes
    every miss a swap. The logits of both passes are the CPU run's with every expert resident (an
    expert moved down with the wrong bytes computes garbage the next time it is used), and the warm
    pass reads nothing from the file."""
    from test_gpu_layers_rpc import KW, two_passes
    from test_rpc_as_installed import installed_env

    path = model_path(fixture_dir, name)
    ref, _, _, _ = two_passes(path, None, pymoecache.CacheConfig(size=1.0, residency="none"), n_gpu_layers=0)
    env = dict(installed_env(), VK_DRIVER_FILES=LVP[0], VK_ICD_FILENAMES=LVP[0], **VK_ENV)
    r = subprocess.run([sys.executable, "-c", EXCLUSIVE_SCRIPT, str(path), str(host), str(vram), json.dumps(KW),
                        json.dumps(PROMPT), json.dumps(DECODES + list(range(2000, 2040))), str(tmp_path / "out.npz")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)  # (the installed package)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    got = np.load(tmp_path / "out.npz")
    layers, copies, down, loads, evictions, n_moe = got["counters"].tolist()
    assert layers == n_moe and copies > 0 and down == copies  # (the warm pass: every copy up a swap)
    assert loads == 0 and evictions == 0
    for g, want in ((got["first"], ref[0]), (got["second"], ref[1])):
        d, scale = row_diffs(g, want), np.abs(want).max()
        assert np.median(d) <= 1e-2 * scale and d.max() <= 0.15 * scale, f"max |diff| {d.max()}, scale {scale}"


CLOSE_SCRIPT = r"""
import sys
import pymoecache
from pymoecache import CacheConfig
for residency, vram_size, n in (("stream", 15, 8), ("none", 0, 2)):  # a VRAM tier; the device path's rows
    for _ in range(n):
        llm = pymoecache.Llama(sys.argv[1], cache=CacheConfig(size=1.0, residency=residency, vram_size=vram_size),
                               n_gpu_layers=99, n_ctx=128, verbose=False)
        tokens = llm.tokenize(b"ROMEO: But soft, what light through yonder window breaks?")
        llm.eval(tokens)
        for t in tokens[:4]:
            llm.eval([t])
        llm.close()  # (nothing read the last logits: its graph may still be running on the device)
print("closed")
"""


def test_a_llama_closed_right_after_a_decode_frees_its_device_buffers_after_the_graph(fixture_dir, tmp_path):
    """The installed package in a fresh process: a Llama with GPU layers on Vulkan closed right after
    a decode whose logits nobody read. Its last graph may still run on the device then, with the VRAM
    tier's slots (or the device path's rows) in it: the cache's free waits for it. It freed them under
    the running graph, and lavapipe's queue thread corrupted the heap: the process aborted ("corrupted
    size vs. prev_size") or segfaulted, a race lost in about 1 of 3 closes of the trained model (so 8
    of them here)."""
    from test_rpc_as_installed import installed_env

    model = TRAINED[0] if TRAINED[0].exists() else model_path(fixture_dir, "qwen2moe-60x4")
    env = dict(installed_env(), VK_DRIVER_FILES=LVP[0], VK_ICD_FILENAMES=LVP[0], **VK_ENV)
    r = subprocess.run([sys.executable, "-c", CLOSE_SCRIPT, str(model)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("closed"), (r.returncode, r.stdout[-2000:], r.stderr[-3000:])


def test_info_plans_gpu_layers_for_the_gpu_ggml_sees(fixture_dir, tmp_path):
    """`info MODEL` from the installed package where ggml sees a GPU (lavapipe, made visible): the GPU plan
    is there without --gpu-mem, from the free memory the device reports (the same number a load reads),
    and `--gpu-mem none` leaves it out. Without a GPU it is left out (tests/test_cli.py)."""
    from test_rpc_as_installed import installed_env

    env = dict(installed_env(), VK_DRIVER_FILES=LVP[0], VK_ICD_FILENAMES=LVP[0], **VK_ENV)

    def py(*args):
        r = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stdout

    model = model_path(fixture_dir, "qwen2moe-60x4")
    free = int(py("-c", "from pymoecache import plan; print(plan.device_free_memory())").strip())
    d = json.loads(py("-m", "pymoecache", "info", str(model), "--json"))
    assert d["gpu_free"] == free > 0 and "-ngl 99" in d["gpu_plan"], d["gpu_plan"]
    assert "GPU layers on this machine's GPU (its free memory as it reports it)" in py("-m", "pymoecache", "info",
                                                                                       str(model))
    assert json.loads(py("-m", "pymoecache", "info", str(model), "--json", "--gpu-mem", "none"))["gpu_plan"] is None



def test_hold_vram_stops_where_the_device_does_not_count_what_it_holds(tmp_path):
    """scripts/hold_vram.py (gpu_check.sh's auto step: a lent GPU held to a user's free memory) on lavapipe, whose
    reported memory does not follow its buffers: it stops after its first buffer and says so (exit 2), instead of
    allocating until the machine's memory is gone (its first version was killed by the OOM killer here); and
    a --leave-gib above what is free is refused."""
    from test_rpc_as_installed import installed_env

    env = dict(installed_env(), VK_DRIVER_FILES=LVP[0], VK_ICD_FILENAMES=LVP[0], **VK_ENV)
    script = str(ROOT / "scripts" / "hold_vram.py")
    r = subprocess.run([sys.executable, script, "--leave-gib", "1.5"], cwd=tmp_path, env=env, input="",
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "does not change with what is held" in r.stderr, (r.returncode, r.stderr[-2000:])
    r = subprocess.run([sys.executable, script, "--leave-gib", "4096"], cwd=tmp_path, env=env, input="",
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "less than --leave-gib 4096" in r.stderr, (r.returncode, r.stderr[-2000:])

STOCK_SCRIPT = r"""
import sys
import pymoecache  # (llama_cpp on the package's libllama, as every stock run here)
import llama_cpp
llm = llama_cpp.Llama(sys.argv[1], n_gpu_layers=99, n_ctx=128, verbose=False)
llm.eval(llm.tokenize(b"The cat"))
for _ in range(4):
    llm.eval([llm.sample(temp=0.0)])
llm.close()
"""


def vulkan_dispatches(stderr: str) -> dict:
    """op -> dispatches in the last graph ggml-vulkan's perf logger printed (GGML_VK_PERF_LOGGER: one
    block per graph, a line per op or fused ops, e.g. 'TOPK_MOE_EARLY_SOFTMAX SOFT_MAX: 4 x 88.3 us = ...')."""
    block = stderr.rsplit("Vulkan Timings:", 1)[-1].split("Total time:")[0]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(.+?): (\d+) x ", block, re.M)}


@pytest.mark.parametrize("model", ["tiny-shakespeare-qwen2moe-32x4-w256", "tiny-shakespeare-mixtral-8x2", "olmoe-64x8"])
def test_every_expert_on_the_gpu_dispatches_what_stock_does_and_a_gating_copy(fixture_dir, tmp_path, model):
    """`pymoecache run MODEL -ngl 99` from the installed package where every expert fits the GPU (the cache
    only counts, top-k; `-fa off`, llama-cpp-python's default): a decoded token dispatches on the GPU what stock llama.cpp's does, its routing
    fused into ggml-vulkan's one top-k MoE kernel per MoE layer, plus one op per MoE layer (the counting's
    own softmax of the router's logits; what it reads is computed straight into its staging buffer,
    src_cpp/moecache-device.cpp). Before, the counting's copies used llama.cpp's softmax and came between
    its routing ops, so nothing was fused: 6 dispatches more per MoE layer (the softmax, argsort and get_rows
    apart, a cast and three copies). ggml-cuda fuses the same ops the same way."""
    from test_rpc_as_installed import installed_env

    path = ROOT / "models" / f"{model}.gguf" if model.startswith("tiny") else model_path(fixture_dir, model)
    if not path.exists():
        pytest.skip(f"{path.name} is not in this checkout")
    env = dict(installed_env(), VK_DRIVER_FILES=LVP[0], VK_ICD_FILENAMES=LVP[0], GGML_VK_PERF_LOGGER="1", **VK_ENV)
    stock = subprocess.run([sys.executable, "-c", STOCK_SCRIPT, str(path)], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=300)
    assert stock.returncode == 0, stock.stderr[-3000:]
    ours = subprocess.run([sys.executable, "-m", "pymoecache", "run", str(path), "-ngl", "99", "-p", "The cat", "-n", "5",
                           "--temp", "0", "-fa", "off"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert ours.returncode == 0, ours.stderr[-3000:]
    assert "routing counted after the graph" in ours.stderr + ours.stdout, ours.stderr[-2000:]  # (the device path ran)
    n_moe = len(pymoecache.model_info(str(path)).moe_layers)
    want, got = vulkan_dispatches(stock.stderr), vulkan_dispatches(ours.stderr)
    fused = {op: n for op, n in want.items() if op.startswith("TOPK_MOE")}
    assert fused and sum(fused.values()) == n_moe, want  # (lavapipe fuses stock's routing)
    more = {op: got.get(op, 0) - want.get(op, 0) for op in set(want) | set(got) if got.get(op, 0) != want.get(op, 0)}
    assert more == {"SOFT_MAX": n_moe}, (more, want, got)


FUSED_SCRIPT = r"""
import json
import sys
import pymoecache
from pymoecache import BatchDecoder, CacheConfig

PROMPT, DECODES = list(range(300, 320)), list(range(1000, 1040))
PROMPTS, LENGTHS = [[1, 5, 9, 13, 17], [1, 200, 33], [1, 7, 7, 7, 7, 7, 100], [1, 50], [1, 9, 2000]], [24, 9, 17, 24, 10]


def llama(record, **kw):  # recording the router keeps the CPU routing op (the op path)
    cache = CacheConfig(size=0.25, residency="none", trace=4096, router_record=record, eviction="router-mass")
    return pymoecache.Llama(sys.argv[1], cache=cache, routing="top-k", verbose=False, n_threads=1, n_gpu_layers=99,
                            flash_attn=False, **kw)


def result(llm, **more):
    st = llm.moe_stats()
    trace = [(int(r["token"]), int(r["layer"]), sorted(r["experts"][:r["n_selected"]].tolist()),
              sorted(int(e) for i, e in enumerate(r["experts"][:r["n_selected"]]) if int(r["hit_mask"]) >> i & 1))
             for r in llm.moecache.trace()]  # (token, layer, the experts selected, those of them cached)
    return dict(hits=st.hits, misses=st.misses, evictions=st.evictions, trace=trace,
                device_steps=st.residency.device_steps, **more)


out = {}
for record in (0, 1 << 16):
    llm = llama(record, n_ctx=128, n_batch=32, n_ubatch=32)
    llm.eval(PROMPT)
    llm.reset_moe_stats()
    for t in DECODES:
        llm.eval([t])
    single = result(llm)
    llm.close()
    llm = llama(record, n_ctx=512, n_seq_max=4)
    dec = BatchDecoder(llm)
    seqs = [dec.add(p, max_tokens=n) for p, n in zip(PROMPTS, LENGTHS)]
    dec.run()
    batch = result(llm, tokens=[s.tokens for s in seqs], rows=[(s.hits, s.misses) for s in seqs])
    dec.close()
    llm.close()
    out["op" if record else "device"] = dict(single=single, batch=batch)
print(json.dumps(out))
"""


@pytest.mark.parametrize("model", ["qwen2moe-60x4", "olmoe-64x8"])
def test_the_device_path_on_a_device_that_fuses_the_routing_counts_what_the_op_counts(fixture_dir, tmp_path, model):
    """Every expert on the GPU, the cache only counting (top-k): where ggml-vulkan fuses llama.cpp's routing
    into its top-k MoE kernel (as ggml-cuda does), that kernel writes only the top K of each row of the
    argsort, which the counting reads from its staging buffer; over RPC, whose CPU fuses nothing, every
    entry is written. Decoded one token at a time and four sequences at a time (BatchDecoder: a row per
    sequence), from the installed package on lavapipe, the device path counts what the CPU routing op
    counts on the same device, under router-mass eviction, which reads the router's probabilities (the
    fused kernel computes none that the graph keeps: the counting computes its own beside it): hits,
    misses, evictions, each sequence's hits and misses, and each token's selected experts in every layer
    (as sets: where two experts' scores tie, the fused kernel orders them its own way, and the trace
    records the order the device computed)."""
    from test_rpc_as_installed import installed_env

    env = dict(installed_env(), VK_DRIVER_FILES=LVP[0], VK_ICD_FILENAMES=LVP[0], GGML_VK_PERF_LOGGER="1", **VK_ENV)
    r = subprocess.run([sys.executable, "-c", FUSED_SCRIPT, str(model_path(fixture_dir, model))], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "TOPK_MOE" in r.stderr  # (the device fused the routing: what this test is about)
    got = json.loads(r.stdout.strip().splitlines()[-1])
    device, op = got["device"], got["op"]
    for kind in ("single", "batch"):
        a, b = device[kind], op[kind]
        assert a["device_steps"] > 0 and b["device_steps"] == 0, kind  # (each took its path)
        assert a["misses"] > 0 and a["evictions"] > 0, kind
        for key in ("hits", "misses", "evictions", "trace") + (("tokens", "rows") if kind == "batch" else ()):
            assert a[key] == b[key], (kind, key)


DIRECT_SCRIPT = r"""
import json, sys
import numpy as np
import pymoecache
import llama_cpp
from pymoecache import CacheConfig
from pymoecache import _moecache_cpp as C
path, vram, kw, prompt, tokens, out, routing = sys.argv[1], int(sys.argv[2]), *map(json.loads, sys.argv[3:6]), *sys.argv[6:8]
modes, n_greedy = json.loads(sys.argv[8]), int(sys.argv[9])
arrays = {}
stock = llama_cpp.Llama(path, n_gpu_layers=99, **kw)  # (every expert on the device: the splits to match)
stock.eval(prompt)
stock.eval(tokens[:1])
arrays["stock_splits"] = np.array(C.moecache_context_graph_splits(stock._ctx.ctx))
stock.close()
for unified in modes:  # the tier with its round trip per layer, then direct (on), or as the trial decides (auto)
    cache = CacheConfig(size=1.0, residency="stream", prefetch="off", vram_size=vram, vram_fill="copy", trace=4096,
                        **({} if unified == "auto" else {"unified": unified}))  # (auto: the default, not given)
    llm = pymoecache.Llama(path, cache=cache, routing=routing, n_gpu_layers=99, **kw)
    llm.eval(prompt)
    llm.reset_moe_stats()
    greedy = []
    for t in tokens:
        llm.eval([t])
    for _ in range(n_greedy):
        greedy.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([greedy[-1]])
    st = llm.moe_stats()
    rs = st.residency
    arrays[unified + "/logits"] = np.array(llm.scores[len(prompt): llm.n_tokens])
    arrays[unified + "/tokens"] = np.array(greedy)
    arrays[unified + "/counters"] = np.array([st.hits, st.misses, rs.vram_hits, rs.vram_from_ram, rs.vram_from_file,
                                              rs.unified_layers, rs.device_steps, len(st.moe_layers)])
    arrays[unified + "/splits"] = np.array(C.moecache_context_graph_splits(llm._ctx.ctx))
    arrays[unified + "/miss"] = np.array(rs.miss)
    arrays[unified + "/direct"] = np.array([rs.direct_tokens, rs.direct_ms, rs.round_trip_ms])
    arrays[unified + "/choice"] = np.array(rs.direct_choice)
    arrays[unified + "/selected"] = np.array(sorted([int(r["token"]), int(r["layer"])] + r["experts"][:st.n_expert_used].tolist()
                                                    for r in llm.moecache.trace()))
    llm.close()
np.savez(out, **arrays)
"""


@pytest.mark.parametrize("name, vram, routing, reuse", [
    ("qwen2moe-60x4", 15, "lru", True), ("mixtral-8x2", 2, "lru", True), ("olmoe-64x8", 16, "lru", True),
    ("qwen2moe-60x4", 15, "prior:0.5", True), ("deepseek2-sigmoid-64x6", 16, "prior:0.5", True),
    ("qwen2moe-60x4.Q8_0+Q5_0", 15, "lru", True), ("qwen2moe-60x4", 15, "lru", False)])
def test_vulkan_direct_tier_runs_each_layer_on_the_device_alone(fixture_dir, tmp_path, name, vram, routing, reuse):
    """The direct tier (issue 78, item 1), the installed package in a fresh process: every expert cached in RAM,
    a quarter of them in a VRAM tier, the host slots wrapped for the device (unified on): each decoded token is
    routed on the device (top-k, or the prior's ops with the tier's contents as its boosts) and each MoE layer
    computed there, the tier's hits from its slots and the rest from the
    host slots over the bus, with no CPU split in a layer. Against the tier with its round trip per layer (unified
    off: the CPU routes each layer and computes the tier's misses; both copy every miss up): the same selections
    token by token, the same hits and tier counters, the same greedy tokens, logits within the rounding of the two
    sides; and a decoded token's graph splits are stock llama.cpp's with every expert on the device (the round
    trip's are 2 a layer more). Also beside a low-bit companion (the default miss, lowbit-cache: the host slots and
    the tier hold its Q5_0 copies), and with llama.cpp's graph reuse off (LLAMA_GRAPH_REUSE_DISABLE: every token's
    graph built afresh, the table written there; it was written only before a reused graph, and the tokens'
    logits were NaN)."""
    from test_gpu_layers_rpc import KW
    from test_rpc_as_installed import installed_env

    if "+" in name:  # a Q8_0 model with a Q5_0 companion beside it: lowbit-cache, both tiers hold the copies
        import shutil

        from pymoecache import lowbit

        base, variant = name.split("+")[0].split(".")
        path = tmp_path / "model.gguf"
        shutil.copy(model_path(fixture_dir, base, "." + variant), path)
        lowbit.make_companion(path, type=name.split("+")[1], progress=False)
    else:
        path = model_path(fixture_dir, name)
    env = dict(installed_env(), VK_DRIVER_FILES=LVP[0], VK_ICD_FILENAMES=LVP[0], **VK_ENV,
               **({} if reuse else {"LLAMA_GRAPH_REUSE_DISABLE": "1"}))
    r = subprocess.run([sys.executable, "-c", DIRECT_SCRIPT, str(path), str(vram), json.dumps(KW), json.dumps(PROMPT),
                        json.dumps(DECODES), str(tmp_path / "out.npz"), routing, '["off", "on"]', "12"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    got = np.load(tmp_path / "out.npz")
    off, on = got["off/counters"].tolist(), got["on/counters"].tolist()
    n_moe = on[-1]
    assert on[5] == n_moe and on[6] > 0, on  # every MoE layer in place, the device path counting the tokens
    assert off[5] == 0 and off[6] == 0, off
    assert np.array_equal(got["on/selected"], got["off/selected"])
    assert on[:5] == off[:5] and on[2] > 0 and on[3] > 0, (on, off)  # hits, misses, tier hits, from RAM, file
    assert got["on/tokens"].tolist() == got["off/tokens"].tolist()
    assert str(got["on/miss"]) == str(got["off/miss"]) == ("lowbit-cache" if "+" in name else "full")
    d, scale = row_diffs(got["on/logits"], got["off/logits"]), np.abs(got["off/logits"]).max()
    assert d.max() <= 1e-2 * scale, f"max |diff| {d.max()}, scale {scale}"
    assert int(got["on/splits"]) <= int(got["stock_splits"]) + 1 < int(got["off/splits"]), \
        (int(got["on/splits"]), int(got["stock_splits"]), int(got["off/splits"]))


@pytest.mark.parametrize("routing", ["lru", "prior:0.5"])
def test_vulkan_auto_direct_tier_times_both_ways_and_keeps_the_faster(fixture_dir, tmp_path, routing):
    """unified's default (auto) beside a VRAM tier and a cache of every expert on a discrete GPU (lavapipe is one to
    ggml): the direct tier or the tier's round trip, decided per model from a measurement (issue 78, item 1). The
    trial's 32 first decoded tokens run direct, round trip, round trip, direct (8 each), timed; the faster side by
    its median token then runs for good. Against unified off (the round trip throughout), the installed package in a
    fresh process: the same selections, counters and greedy tokens through the four changes of side, logits within
    the two sides' rounding; 16 tokens of the trial ran direct, and the 16 after it ran what the trial chose, which
    its medians say; the last graph's splits are the winner's (direct: stock's; the round trip: those of off)."""
    from test_gpu_layers_rpc import KW
    from test_rpc_as_installed import installed_env

    env = dict(installed_env(), VK_DRIVER_FILES=LVP[0], VK_ICD_FILENAMES=LVP[0], **VK_ENV)
    r = subprocess.run([sys.executable, "-c", DIRECT_SCRIPT, str(model_path(fixture_dir, "qwen2moe-60x4")), "15",
                        json.dumps(KW), json.dumps(PROMPT), json.dumps(DECODES), str(tmp_path / "out.npz"), routing,
                        '["off", "auto"]', "24"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    got = np.load(tmp_path / "out.npz")
    off, auto = got["off/counters"].tolist(), got["auto/counters"].tolist()
    assert np.array_equal(got["auto/selected"], got["off/selected"])
    assert auto[:5] == off[:5] and auto[2] > 0 and auto[3] > 0, (auto, off)
    assert got["auto/tokens"].tolist() == got["off/tokens"].tolist()
    d, scale = row_diffs(got["auto/logits"], got["off/logits"]), np.abs(got["off/logits"]).max()
    assert d.max() <= 1e-2 * scale, f"max |diff| {d.max()}, scale {scale}"
    tokens, ms_direct, ms_round = got["auto/direct"].tolist()
    choice = str(got["auto/choice"])
    assert ms_direct > 0 and ms_round > 0 and got["off/direct"].tolist() == [0, 0, 0]
    assert choice == ("round trip" if ms_round < 0.98 * ms_direct else "direct"), (choice, ms_direct, ms_round)
    assert tokens == (32 if choice == "direct" else 16), (tokens, choice)  # 48 decoded: 32 in the trial, 16 after
    splits = int(got["auto/splits"])
    assert splits <= int(got["stock_splits"]) + 1 if choice == "direct" else splits == int(got["off/splits"]), \
        (splits, int(got["stock_splits"]), int(got["off/splits"]), choice)


def test_slots_past_the_devices_largest_buffer_stay_on_the_cpu_or_are_refused(tmp_path):
    """Host slots wrapped for a device that cannot compute on them as one tensor (a layer's slots of Mixtral's shape
    are 283 MiB a tensor; lavapipe's storage buffers hold less) used to abort in ggml's scheduler at the first graph
    ("pre-allocated tensor ... in a buffer that cannot run the operation"), and unified auto beside a tier and a cache
    of every expert now wraps them on any discrete GPU. From the installed package's CLI, a fresh process: with auto
    (the flags alone) the layers stay on the CPU beside the tier (its round trip) and the run decodes; with
    --unified on the run is refused with the reason (exit 2, as a bad option), no abort."""
    from test_rpc_as_installed import installed_env

    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "real_size.py"), "mixtral-8x7b", "--layers", "1",
                        "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    model = r.stdout.strip().splitlines()[-1]
    env = dict(installed_env(), VK_DRIVER_FILES=LVP[0], VK_ICD_FILENAMES=LVP[0], **VK_ENV)
    cmd = [sys.executable, "-m", "pymoecache", "run", "-m", model, "-p", "The", "-n", "4", "-c", "256", "-ngl", "99",
           "--cache-size", "1.0", "--vram-size", "1", "-v"]
    auto = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert auto.returncode == 0, auto.stderr[-3000:]
    assert "cannot compute on 283 MiB of host slots of blk.0.ffn_gate_exps.weight" in auto.stderr, auto.stderr[-3000:]
    assert "direct tier" not in auto.stderr and "decode 4 tok" in auto.stderr + auto.stdout
    on = subprocess.run(cmd + ["--unified", "on"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert on.returncode == 2 and "error: unified = on: device Vulkan0 cannot compute on 283 MiB" in on.stderr, \
        (on.returncode, on.stderr[-3000:])
