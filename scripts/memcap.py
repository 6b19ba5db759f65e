"""A smaller machine on any machine, for the benchmarks: a memory cgroup of its own for each run, the page cache
charged to it, as a phone's or a container's memory is.

    with MemoryCap(6 << 30) as cap:                       # cgroup v1 memory.limit_in_bytes, or v2 memory.max
        subprocess.run(cmd, preexec_fn=cap.join)           # the child, its threads and the pages it reads
        cap.peak(), cap.oom_kills()                        # the group's peak usage (bytes), kills by the cap

The group is made below this process's own memory cgroup (where a container's limit still binds it); it needs
root or a delegated cgroup. MemoryCapError says what was tried where none can be made.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]


class MemoryCapError(RuntimeError):
    pass


def _own_groups():
    """(this process's v1 memory cgroup directory or None, its v2 directory or None)."""
    import sys

    sys.path.insert(0, str(ROOT))
    from pymoecache import plan  # (where the project finds cgroups: mountinfo for v1)

    lines = Path(plan._PROC_CGROUP).read_text().splitlines()
    v1 = next((p.split(":", 2)[2] for p in lines if len(p.split(":", 2)) == 3 and "memory" in p.split(":")[1].split(",")),
              None)
    rel = next((ln[3:] for ln in lines if ln.startswith("0::")), None)
    v1_dir = Path(plan._cgroup_v1_dir(v1)) if v1 is not None else None
    v2_dir = None
    for root in (Path(plan._CGROUP_ROOT) / "unified", Path(plan._CGROUP_ROOT)):
        if rel is not None and (root / "cgroup.controllers").exists():
            v2_dir = root / (rel or "/").lstrip("/")
            break
    return v1_dir, v2_dir


class MemoryCap:
    """A memory cgroup limited to ``limit`` bytes (the page cache included); ``join`` moves the calling process
    into it (use as preexec_fn)."""

    def __init__(self, limit: int):
        self.limit = int(limit)
        self.dir: Optional[Path] = None
        self.kind = "none"

    def __enter__(self) -> "MemoryCap":
        v1, v2 = _own_groups()
        name = f"pymoecache-cap-{os.getpid()}-{self.limit >> 20}m"
        tried = []
        for parent, limit_file, kind in ((v1, "memory.limit_in_bytes", "cgroup v1"), (v2, "memory.max", "cgroup v2")):
            if parent is None or not parent.is_dir():
                continue
            d = parent / name
            try:
                if kind == "cgroup v2":
                    control = parent / "cgroup.subtree_control"
                    if "memory" not in control.read_text().split():
                        control.write_text("+memory\n")
                d.mkdir(exist_ok=True)
                if kind == "cgroup v1":
                    (d / "memory.swappiness").write_text("0\n") if (d / "memory.swappiness").exists() else None
                (d / limit_file).write_text(f"{self.limit}\n")
                self.dir, self.kind = d, kind
                return self
            except OSError as e:
                tried.append(f"{kind} {d}: {e.strerror or e}")
                try:
                    d.rmdir()
                except OSError:
                    pass
        raise MemoryCapError("cannot make a memory cgroup: " + ("; ".join(tried) or "no cgroup v1 memory controller "
                             "or v2 hierarchy found") + " (needs root, or a cgroup delegated to this user)")

    def join(self) -> None:
        (self.dir / "cgroup.procs").write_text(f"{os.getpid()}\n")

    def _read(self, name: str) -> Optional[int]:
        try:
            return int((self.dir / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def peak(self) -> Optional[int]:
        """The group's peak usage so far (bytes: its processes' memory and the page cache charged to it)."""
        return self._read("memory.max_usage_in_bytes" if self.kind == "cgroup v1" else "memory.peak")

    def reset_peak(self) -> None:
        if self.kind == "cgroup v1":
            (self.dir / "memory.max_usage_in_bytes").write_text("0\n")

    def oom_kills(self) -> int:
        """Processes the kernel killed for the cap."""
        name = "memory.oom_control" if self.kind == "cgroup v1" else "memory.events"
        try:
            for line in (self.dir / name).read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        except (OSError, ValueError):
            pass
        return 0

    def __exit__(self, *exc) -> None:
        if self.dir is not None:
            if self.kind == "cgroup v1" and (self.dir / "memory.force_empty").exists():
                try:
                    (self.dir / "memory.force_empty").write_text("0\n")
                except OSError:
                    pass
            for _ in range(100):  # the last process of the group may still be exiting
                try:
                    self.dir.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)
            self.dir = None

    def __str__(self) -> str:
        return f"{self.limit / 2**30:.2f} GiB ({self.kind})"
