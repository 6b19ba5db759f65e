"""The disk's speed, probed: what a read of one expert costs where the model lies (the plan's and the
forecast's reads per token are bytes over this speed)."""

from __future__ import annotations

import os
import random
import time


def probe_disk(path: "os.PathLike[str] | str", block: float = 1 << 20, seconds: float = 0.5,
               most: int = 256 << 20, threads: int = 4) -> float:
    """Read speed in bytes/s of the disk holding ``path``: reads of ``block`` bytes (an expert,
    rounded to pages, 64 KiB to 8 MiB) at random offsets from ``threads`` readers at once (the
    expert reader queue keeps several in flight), with O_DIRECT so the page cache does not answer,
    for ``seconds`` or ``most`` bytes. 0.0 where it cannot tell (no O_DIRECT, a tiny file)."""
    import mmap
    import threading

    page = 4096
    block = int(min(8 << 20, max(64 << 10, block)) // page * page)
    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    if flags == os.O_RDONLY:
        return 0.0
    try:
        fd = os.open(path, flags)
    except OSError:
        return 0.0
    done = [0] * threads
    try:
        size = os.fstat(fd).st_size
        if size < 2 * block:
            return 0.0
        t0 = time.perf_counter()

        def reader(i: int) -> None:
            buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT wants
            rng = random.Random(i)
            try:
                while sum(done) < most and time.perf_counter() - t0 < seconds:
                    n = os.preadv(fd, [buf], rng.randrange(0, (size - block) // page) * page)
                    if n <= 0:
                        return
                    done[i] += n
            except OSError:
                return
            finally:
                buf.close()

        workers = [threading.Thread(target=reader, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        dt = time.perf_counter() - t0
        return sum(done) / dt if dt > 0 and sum(done) else 0.0
    finally:
        os.close(fd)
