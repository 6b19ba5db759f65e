"""scripts/storage.py, the benchmarks' slower storage: the kernel throttles the reads of the
processes that join the group, on the disk that holds the model, and the group is gone after.
What is checked is where the limit is written and whose reads the group accounts, not a speed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
from storage import ReadThrottle, ThrottleError, disk_of, probe  # noqa: E402

MODEL = ROOT / "models" / "tiny-shakespeare-qwen2moe-60x4.gguf"


def _throttle_possible() -> bool:
    try:
        disk_of(MODEL)
    except ThrottleError:
        return False
    return os.geteuid() == 0 and Path("/sys/fs/cgroup/blkio/blkio.throttle.read_bps_device").exists()


needs_cgroup = pytest.mark.skipif(not _throttle_possible(), reason="needs root, cgroup v1 blkio and a disk-backed file")


@needs_cgroup
def test_the_limit_is_on_the_models_disk_and_the_reads_of_the_joined_process_count():
    major, minor = disk_of(MODEL)
    read = 4 << 20
    child = ("import mmap, os, sys\n"
             f"fd = os.open({str(MODEL)!r}, os.O_RDONLY | os.O_DIRECT)\n"
             "buf = mmap.mmap(-1, 1 << 20)\n"
             f"for i in range({read >> 20}):\n"
             "    os.preadv(fd, [buf], i << 20)\n"
             "print(open('/proc/self/cgroup').read())\n")
    with ReadThrottle(MODEL, 200) as t:
        assert t.dir is not None and t.dir.is_dir() and "v1" in t.kind
        assert (t.dir / "blkio.throttle.read_bps_device").read_text().split() == [f"{major}:{minor}", "200000000"]
        r = subprocess.run([sys.executable, "-c", child], preexec_fn=t.join, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        assert f"blkio:/{t.dir.name}" in r.stdout  # the child ran inside the group
        counted = [line.split() for line in (t.dir / "blkio.throttle.io_service_bytes").read_text().splitlines()]
        reads = sum(int(f[2]) for f in counted if len(f) == 3 and f[0] == f"{major}:{minor}" and f[1] == "Read")
        assert reads >= read  # the group saw (and so throttled) the child's direct reads
        d = t.dir
    assert not d.exists()  # removed after


@needs_cgroup
def test_no_limit_creates_nothing_and_joins_nothing():
    with ReadThrottle(MODEL, None) as t:
        assert t.dir is None and str(t) == "unthrottled"
        before = Path("/proc/self/cgroup").read_text()
        t.join()  # a no-op: this process stays where it was
        assert Path("/proc/self/cgroup").read_text() == before


def test_bad_limits_and_files_without_a_disk_are_clear_errors(tmp_path):
    for bad in (0, -5, float("nan")):
        with pytest.raises(ThrottleError, match="positive number of MB/s"):
            with ReadThrottle(MODEL, bad):
                pass
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        f = shm / f"pymoecache-test-{os.getpid()}"
        f.write_bytes(b"x" * 4096)
        try:
            with pytest.raises(ThrottleError, match="without a block device"):
                with ReadThrottle(f, 100):
                    pass
        finally:
            f.unlink()


def test_probe_reads_at_every_depth():
    p = probe(MODEL, 1 << 20, depths=(1, 4), seconds=0.2, max_mib=8)
    assert set(p) == {1, 4} and all(v > 0 for v in p.values())


def test_bench_refuses_bad_storage_limits():
    for bad in ("fast", "-3"):
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_residency.py"), "--storage-mbps", bad],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and "--storage-mbps" in r.stderr
