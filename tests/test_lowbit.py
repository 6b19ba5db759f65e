"""Low-bit companions (issue 42 item 1): `pymoecache lowbit` as a user runs it, what the file holds,
and every companion that must be refused, refused with its reason."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import model_path, not_a_regular_file
from pymoecache import lowbit
from pymoecache.model_info import model_info

ROOT = Path(__file__).resolve().parent.parent
EXPERT_MATRIX = lowbit._EXPS_RE


def cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "pymoecache", "lowbit", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture()
def model(fixture_dir, tmp_path) -> Path:
    """A Q8_0 MoE model of its own (companions are written beside it)."""
    m = tmp_path / "qwen.gguf"
    shutil.copy(model_path(fixture_dir, "qwen2moe-60x4", ".Q8_0"), m)
    return m


def expert_tensors(path):
    import gguf

    return {t.name: t for t in gguf.GGUFReader(path).tensors if (x := EXPERT_MATRIX.match(t.name)) and x.group(3) == "weight"}


def dequantized(t) -> np.ndarray:
    import gguf

    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1)


def test_the_cli_writes_the_experts_beside_the_model_at_a_lower_type(model):
    r = cli(model)
    assert r.returncode == 0, r.stderr
    # Q8_0 experts: Q4_K by default, whose fallback the fixture's 64-wide rows take: the file is named by it
    out = model.with_name("qwen.lowbit-Q5_0.gguf")
    assert out.is_file() and sorted(p.name for p in model.parent.iterdir()) == ["qwen.gguf", "qwen.lowbit-Q5_0.gguf"]
    assert str(out.name) in r.stdout and "fewer bytes" in r.stdout
    full, low = expert_tensors(model), expert_tensors(out)
    compared = False
    import gguf

    assert set(low) == set(full) and len(low) == 3 * model_info(model).n_moe_layer  # the experts, nothing else
    assert {t.name for t in gguf.GGUFReader(out).tensors} == set(low)
    for name, t in low.items():
        assert list(t.shape) == list(full[name].shape)
        # the fixture's rows of 64 are not a multiple of Q4_K's 256: llama.cpp's fallback, said in the summary
        assert t.tensor_type.name == "Q5_0" and "Q5_0" in r.stdout
        a, b = dequantized(full[name]), dequantized(t)
        err = np.abs(a - b).max()
        assert 0 < err < 0.1 * np.abs(a).max()  # the same weights, rounded coarser
        if "ffn_gate_exps" in name:  # and not another tensor's (its layer's up matrix has the same shape)
            other = dequantized(full[name.replace("gate", "up")])
            assert np.abs(other - b).max() > 4 * err
            compared = True
    assert compared
    c = lowbit.check_companion(model)  # found beside the model
    assert c.path == str(out) and c.types == {"Q5_0": len(low)} and c.ratio > 1.5


def test_type_choice_and_the_python_api(model, tmp_path):
    out = tmp_path / "elsewhere" / "small.gguf"
    out.parent.mkdir()
    c = lowbit.make_companion(model, out, type="q4_0", progress=False)
    assert c.types == {"Q4_0": 3 * model_info(model).n_moe_layer} and c.type == "Q4_0"
    assert c.ratio == pytest.approx(34 / 18, rel=0.01)  # Q8_0 -> Q4_0: 34 bytes per 32 weights -> 18
    assert sorted(p.name for p in out.parent.iterdir()) == ["small.gguf"]  # no temporary file left
    r = cli(model, "--check", "-o", out)
    assert r.returncode == 0 and "Q4_0" in r.stdout


@pytest.mark.parametrize("args, says", [
    (["--type", "Q8_0"], "Q8_0 (8.50 bits per weight) is not lower than the model's experts"),
    (["--type", "Q2_0"], "unsupported --type 'Q2_0'"),
    (["-o", "/no/such/dir/x.gguf"], "the directory /no/such/dir does not exist"),  # (was llama.cpp's iostream error)
    (["--type", "IQ2_XS"], "needs an importance matrix"),
    (["--type", "nonsense"], "take one of"),
    (["-t", "0"], "at least 1"),
    (["--check", "--type", "Q4_0"], "--type and -t are for making one"),
])
def test_bad_requests_are_one_line_errors(model, args, says):
    r = cli(model, *args)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr
    assert sorted(p.name for p in model.parent.iterdir()) == ["qwen.gguf"]


def test_a_model_that_cannot_have_one(fixture_dir, model, tmp_path):
    r = cli(model_path(fixture_dir, "dense-llama"), "-o", tmp_path / "x.gguf")
    assert r.returncode == 2 and "no routed experts" in r.stderr
    r = cli(model, "-o", model)
    assert r.returncode == 2 and "is the model itself" in r.stderr
    q4 = tmp_path / "q4.gguf"
    shutil.copy(model_path(fixture_dir, "qwen2moe-60x4", ".Q4_K_M"), q4)
    r = cli(q4, "--type", "Q5_K")
    assert r.returncode == 2 and "not lower than the model's experts" in r.stderr


def test_companions_that_do_not_fit_are_refused_with_the_reason(fixture_dir, model, tmp_path):
    import gguf

    good = lowbit.make_companion(model, tmp_path / "good.gguf", type="Q4_0", progress=False).path

    def refused(companion, *words):
        with pytest.raises(lowbit.CompanionError) as e:
            lowbit.check_companion(model, companion)
        for w in words:
            assert w in str(e.value)

    refused(tmp_path / "none.gguf", "no low-bit companion at", "pymoecache lowbit")
    refused(model, "not a low-bit companion")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(Path(good).read_bytes()[:-1000])
    refused(cut, "truncated")
    # another model's companion
    other = tmp_path / "mixtral.gguf"
    shutil.copy(model_path(fixture_dir, "mixtral-8x2", ".Q8_0"), other)
    refused(lowbit.make_companion(other, progress=False).path, "another model", "'mixtral.gguf'")
    # the model changed after its companion was made (same name)
    with open(model, "ab") as f:
        f.write(b"\0" * 64)
    refused(good, "an earlier version of 'qwen.gguf'", "changed since")
    model.write_bytes(model.read_bytes()[:-64])
    assert lowbit.check_companion(model, good).types  # back as it was: accepted again

    def forged(name, change):  # the good companion with one tensor changed, keys kept
        r = gguf.GGUFReader(good)
        w = gguf.GGUFWriter(tmp_path / name, "qwen2moe")
        for k in ("version", "type", "parent.name", "parent.size", "parent.tensor_hash"):
            f = r.fields[lowbit.KEY + k]
            v = f.contents()
            (w.add_uint32 if k == "version" else w.add_uint64 if k == "parent.size" else w.add_string)(lowbit.KEY + k, v)
        full = expert_tensors(model)
        for i, t in enumerate(r.tensors):
            if i == 0:
                change(w, t, full[t.name])
            else:
                w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return tmp_path / name

    refused(forged("same-type.gguf", lambda w, t, f: w.add_tensor(t.name, f.data, raw_shape=f.data.shape,
                                                                   raw_dtype=f.tensor_type)),
            "is Q8_0", "not lower than the model's Q8_0")
    refused(forged("missing.gguf", lambda w, t, f: None), "has no tensor")
    refused(forged("shape.gguf", lambda w, t, f: w.add_tensor(t.name, t.data[:-1], raw_shape=t.data[:-1].shape,
                                                               raw_dtype=t.tensor_type)),
            "has shape", "the model's has")
    refused(forged("extra.gguf", lambda w, t, f: (w.add_tensor(t.name, t.data, raw_shape=t.data.shape,
                                                               raw_dtype=t.tensor_type),
                                                  w.add_tensor("output.weight", np.zeros(64, np.float32)))),
            "tensors the model's routed experts do not")


@pytest.mark.parametrize("target", ["dev-full", "fifo", "link-loop", "directory", "link-to-fifo"])
def test_output_that_is_not_a_regular_file_is_refused_and_left_as_it_was(model, tmp_path, target):
    """Issue 53 item 1: `-o /dev/null` run as root turned the device node into a regular file (the atomic
    rename lands on it); a FIFO was replaced the same way, a link loop was an internal error. Run from
    outside the tree (the installed package), the CLI and the Python API both refuse with one line."""
    path = not_a_regular_file(tmp_path, target, {"dev-full": "full.gguf", "fifo": "out.gguf", "link-loop": "loop.gguf",
                                                 "directory": "dir.gguf", "link-to-fifo": "link.gguf"}[target])
    before = os.lstat(path)
    r = cli(model, "-o", path, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert any(s in r.stderr for s in ("not a regular file", "a link loop", "is a directory")), r.stderr
    code = ("import sys\nfrom pymoecache import lowbit\ntry:\n    lowbit.make_companion(sys.argv[1], sys.argv[2], "
            "progress=False)\nexcept lowbit.CompanionError as e:\n    print('refused:', e)\n")
    r = subprocess.run([sys.executable, "-c", code, str(model), str(path)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("refused:"), (r.stdout, r.stderr)
    after = os.lstat(path)
    assert (after.st_mode, after.st_ino, after.st_rdev) == (before.st_mode, before.st_ino, before.st_rdev)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_output_through_a_link_to_a_regular_file_writes_the_file_and_keeps_the_link(model, tmp_path):
    real = tmp_path / "real.gguf"
    real.write_bytes(b"old")
    link = tmp_path / "link.gguf"
    link.symlink_to(real)
    r = cli(model, "-o", link, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert link.is_symlink() and real.stat().st_size > 1000
    assert lowbit.check_companion(model, link).path


def test_a_companion_of_experts_changed_in_place_is_refused(model, tmp_path):
    """Issue 53 item 8: expert weights changed in place (same size, same tensor table: a same-shape fine-tune or
    a re-quantization) passed `lowbit --check`, and run computed from the old copies. The companion records a
    sample of the experts' bytes; a mismatch is refused with the reason, by --check and by run."""
    r = cli(model, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert cli(model, "--check", cwd=tmp_path).returncode == 0
    h, table, size = lowbit._Header(model), lowbit.tensor_table_hash(model), model.stat().st_size
    name, t, shape, off = next(x for x in h.tensors if x[0] == "blk.0.ffn_down_exps.weight")
    start, n = h.data_start + off, lowbit._n_bytes(t, shape)
    with open(model, "r+b") as f:  # the tensor's two halves swapped (whole experts: still valid Q8_0)
        f.seek(start)
        data = f.read(n)
        f.seek(start)
        f.write(data[n // 2:] + data[: n // 2])
    assert lowbit.tensor_table_hash(model) == table and model.stat().st_size == size  # what the old check saw
    run = ["run", str(model), "-p", "Hi", "-n", "2", "--cache-size", "0.25"]
    for args in (["lowbit", str(model), "--check"], run + ["--miss", "lowbit-cache"]):
        r = subprocess.run([sys.executable, "-m", "pymoecache", *args], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 2 and "other expert weights" in r.stderr and "make it again" in r.stderr, \
            (args, r.returncode, r.stderr[-1500:])
    # the default (miss auto) says why it does not use the companion, and reads at full precision
    r = subprocess.run([sys.executable, "-m", "pymoecache", *run], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "other expert weights" in r.stderr, r.stderr[-1500:]
    assert "lowbit-cache" not in r.stdout + r.stderr.replace("miss='auto'", "")


def test_ctrl_c_while_quantizing_stops_leaves_no_file_and_exits_130(model, tmp_path):
    """Issue 53 item 9: Ctrl-C during `lowbit` was sometimes taken by the ctypes log callback ("Exception
    ignored ... KeyboardInterrupt") and quantizing went on, exit 0. SIGINT once llama.cpp's quantizer has
    started (its first tensor line): exit 130, no companion, no temporary file."""
    import signal
    import time

    p = subprocess.Popen([sys.executable, "-m", "pymoecache", "lowbit", str(model), "--verbose", "-t", "1"],
                         cwd=tmp_path, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    seen = []
    for line in p.stderr:  # (llama.cpp's quantizer log, one line per tensor)
        seen.append(line)
        if line.lstrip().startswith("["):
            p.send_signal(signal.SIGINT)
            break
    rest = p.communicate(timeout=120)[1]
    assert p.returncode == 130, (p.returncode, "".join(seen)[-500:], rest[-1500:])
    assert "Exception ignored" not in rest
    time.sleep(0.5)
    assert sorted(x.name for x in model.parent.iterdir()) == ["qwen.gguf"]


def test_quality_lowbit_table_keeps_each_row_in_the_block_of_its_memory():
    """Issue 53 item 11: scripts/quality_lowbit.py's table. Rows of a smaller copy that caches every
    expert at both sizes (the same cache_size twice) stay each in the block of the size asked for,
    and a row that reads nothing shows an infinite x, not '-'."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("quality_lowbit", ROOT / "scripts" / "quality_lowbit.py")
    q = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(q)

    def row(path, block, cache, ppl, critical):
        return dict(path=path, block=block, cache_size=cache, n_expert=32, spec="lru", ppl=ppl, miss_rate=0.1,
                    lowbit_per_token=0.0, critical_mib_per_token=critical)

    rows = [row("full", 0, 16, 10.0, 2.0), row("full", 1, 8, 11.0, 4.0),
            row("plain Q4_K (cache x4.00)", 0, 32, 10.1, 0.0), row("plain Q4_K (cache x4.00)", 1, 32, 10.2, 0.0)]
    lines = [x for x in q.table(rows, [0.5, 0.25], "m").splitlines() if x.startswith("| ") and "routing" not in x]
    assert [x.split(" | ")[3] for x in lines] == ["10.0000", "10.1000", "11.0000", "10.2000"]
    assert lines[3].endswith("| ∞ (reads nothing) |") and "+1.00%" in lines[1] and "-7.27%" in lines[3]
