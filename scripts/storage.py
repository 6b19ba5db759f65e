"""Slower storage on any machine, for the benchmarks: a process's reads throttled by the kernel on
the disk that holds the model, and a probe of what that disk gives to expert-sized direct reads.

    with ReadThrottle(model_path, mbps=300) as t:       # cgroup v1 blkio, or cgroup v2 io.max
        subprocess.run(cmd, preexec_fn=t.join)           # the child and its threads read at <= 300 MB/s
    probe(model_path, expert_bytes, depths=(1, 8, 32))   # {depth: MB/s}, O_DIRECT at random offsets

The throttle needs root (or a delegated cgroup) on Linux; where neither cgroup interface can be
written, ReadThrottle raises ThrottleError saying what it tried. MB here is 10^6 bytes, as the
kernel's limits count.
"""

from __future__ import annotations

import mmap
import os
import random
import threading
import time
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

V1 = Path("/sys/fs/cgroup/blkio")
V2_ROOTS = (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))


class ThrottleError(RuntimeError):
    pass


def disk_of(path: "os.PathLike[str] | str") -> Tuple[int, int]:
    """(major, minor) of the whole disk holding ``path`` (a partition's disk; the device under a
    device-mapper or loop device is not followed)."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    if major == 0:  # overlayfs, tmpfs, btrfs subvolumes: an anonymous device number
        raise ThrottleError(f"{path} is on a file system without a block device of its own (device {major}:{minor}, "
                            "e.g. overlayfs or tmpfs): put the model on a disk-backed file system to throttle its reads")
    sys_dev = Path(f"/sys/dev/block/{major}:{minor}")
    if (sys_dev / "partition").exists():  # the throttle applies to whole disks: take the partition's parent
        major, minor = map(int, (sys_dev.resolve().parent / "dev").read_text().split(":"))
    return major, minor


class ReadThrottle:
    """A cgroup whose processes read from the disk of ``path`` at most ``mbps`` MB/s (None: no
    limit, and nothing is created). ``join`` puts the calling process into it (use as preexec_fn)."""

    def __init__(self, path: "os.PathLike[str] | str", mbps: Optional[float]):
        self.path, self.mbps = Path(path), mbps
        self.dir: Optional[Path] = None
        self.kind = "none"

    def __enter__(self) -> "ReadThrottle":
        if self.mbps is None:
            return self
        if not self.mbps > 0:
            raise ThrottleError(f"a storage limit must be a positive number of MB/s, got {self.mbps}")
        major, minor = disk_of(self.path)
        bps = int(self.mbps * 1e6)
        name = f"pymoecache-bench-{os.getpid()}-{int(self.mbps)}"
        # (the hierarchy's root, the file that takes the limit, its line, what it is called)
        candidates = [(V1, "blkio.throttle.read_bps_device", f"{major}:{minor} {bps}",
                       "cgroup v1 blkio.throttle.read_bps_device")] if (V1 / "blkio.throttle.read_bps_device").exists() else []
        candidates += [(root, "io.max", f"{major}:{minor} rbps={bps}", "cgroup v2 io.max")
                       for root in V2_ROOTS if (root / "cgroup.subtree_control").exists()]
        tried = []
        for root, limit_file, line, kind in candidates:
            d = root / name
            try:
                control = root / "cgroup.subtree_control"
                if kind.startswith("cgroup v2") and "io" not in control.read_text().split():
                    control.write_text("+io\n")  # the io controller for the groups below the root
                d.mkdir(exist_ok=True)
                (d / limit_file).write_text(line + "\n")
                self.dir, self.kind = d, kind
                return self
            except OSError as e:
                tried.append(f"{kind} {d}: {e.strerror or e}")
                self._rmdir(d)
        raise ThrottleError(f"cannot throttle reads from {self.path} (disk {major}:{minor}): "
                            + ("; ".join(tried) if tried else "no writable cgroup v1 blkio or v2 io controller")
                            + " (needs root, or a cgroup delegated to this user)")

    def join(self) -> None:
        """Moves the calling process into the throttled group (a no-op without a limit)."""
        if self.dir is not None:
            (self.dir / "cgroup.procs").write_text(f"{os.getpid()}\n")

    def leave(self) -> None:
        """Moves the calling process back to the hierarchy's root, so that the group can go."""
        if self.dir is not None:
            (self.dir.parent / "cgroup.procs").write_text(f"{os.getpid()}\n")

    @staticmethod
    def _rmdir(d: Path) -> None:
        try:
            d.rmdir()
        except OSError:
            pass

    def __exit__(self, *exc) -> None:
        if self.dir is not None:
            for _ in range(50):  # the last process of the group may still be exiting
                try:
                    self.dir.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)
            self.dir = None

    def __str__(self) -> str:
        return "unthrottled" if self.mbps is None else f"{self.mbps:g} MB/s ({self.kind})"


def drop_page_cache(path: "os.PathLike[str] | str") -> str:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return "fadvise"


def probe(path: "os.PathLike[str] | str", read_bytes: int, depths: Sequence[int] = (1, 8, 32),
          seconds: float = 1.5, max_mib: int = 512, seed: int = 0) -> Dict[int, float]:
    """MB/s of ``read_bytes``-sized O_DIRECT reads (rounded up to 4 KiB) at random 4 KiB-aligned
    offsets of ``path``, with ``depth`` reads in flight (one thread each), for each depth: each
    runs for about ``seconds`` (at most ``max_mib`` MiB), page cache dropped first. Run it in the
    process whose reads are throttled to see the throttled disk."""
    size = Path(path).stat().st_size
    n = (max(4096, read_bytes) + 4095) // 4096 * 4096
    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    out = {}
    for depth in depths:
        drop_page_cache(path)
        rng = random.Random(seed + depth)
        fd = os.open(path, flags)
        done, lock = [0], threading.Lock()
        stop_at = time.perf_counter() + seconds
        budget = max_mib << 20

        def reader(r: random.Random) -> None:
            buf = mmap.mmap(-1, n)  # page-aligned, as O_DIRECT needs
            while time.perf_counter() < stop_at:
                with lock:
                    if done[0] >= budget:
                        return
                    done[0] += n
                os.preadv(fd, [buf], r.randrange(0, (size - n) // 4096) * 4096)

        try:
            threads = [threading.Thread(target=reader, args=(random.Random(rng.random()),)) for _ in range(depth)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            out[depth] = done[0] / 1e6 / (time.perf_counter() - t0)
        finally:
            os.close(fd)
    return out


def probe_summary(p: Dict[int, float]) -> str:
    return ", ".join(f"QD{d} {v:.0f}" for d, v in p.items()) + " MB/s"

