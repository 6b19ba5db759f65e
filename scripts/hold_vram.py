#!/usr/bin/env python3
"""hold_vram.py - a smaller GPU: holds the first discrete GPU's memory but --leave-gib GiB, until stdin closes.

A GPU machine lent for a check is bigger than the GPUs users have: an H200 holds every model the disk
can take, so `-ngl 99` alone never sizes a VRAM tier there (`--vram-size auto` finds every expert fits). This
allocates device buffers (1 GiB each, through ggml, as llama.cpp's own would be) until the GPU reports
--leave-gib free, prints what it holds, and keeps them while its standard input stays open:

    python scripts/hold_vram.py --leave-gib 6 < <(sleep 600) &   # the GPU now reports about 6 GiB free
    pymoecache run -m M -ngl 99 --cache-size 1.0 -v              # the plan sizes the tier to what is left

Exit 2 where no discrete GPU is visible or it has less than --leave-gib free already.
"""

import argparse
import ctypes
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--leave-gib", type=float, required=True, help="GiB the GPU should report free while held")
    args = ap.parse_args(argv)

    from pymoecache._lib import GGML_BACKEND_DEVICE_TYPE_GPU, load_ggml

    ggml = load_ggml()
    # GGML_API ggml_backend_buffer_type_t ggml_backend_dev_buffer_type(ggml_backend_dev_t device);
    ggml.ggml_backend_dev_buffer_type.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p
    # GGML_API ggml_backend_buffer_t ggml_backend_buft_alloc_buffer(ggml_backend_buffer_type_t buft, size_t size);
    ggml.ggml_backend_buft_alloc_buffer.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    ggml.ggml_backend_buft_alloc_buffer.restype = ctypes.c_void_p
    # GGML_API void ggml_backend_buffer_clear(ggml_backend_buffer_t buffer, uint8_t value);
    ggml.ggml_backend_buffer_clear.argtypes = [ctypes.c_void_p, ctypes.c_uint8]
    ggml.ggml_backend_buffer_clear.restype = None

    dev = next((ggml.ggml_backend_dev_get(i) for i in range(ggml.ggml_backend_dev_count())
                if ggml.ggml_backend_dev_type(ggml.ggml_backend_dev_get(i)) == GGML_BACKEND_DEVICE_TYPE_GPU), None)
    if not dev:
        print("hold_vram: no discrete GPU visible", file=sys.stderr)
        return 2
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)

    def free_now() -> int:
        ggml.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        return free.value

    leave, gib = int(args.leave_gib * 2**30), 2**30
    if free_now() < leave:
        print(f"hold_vram: {free_now() / gib:.1f} GiB free already, less than --leave-gib {args.leave_gib:g}",
              file=sys.stderr)
        return 2
    buft, held, want = ggml.ggml_backend_dev_buffer_type(dev), [], free_now() - leave
    while want >= 2**20 and free_now() > leave:
        before = free_now()
        buf = ggml.ggml_backend_buft_alloc_buffer(buft, min(gib, want))
        if not buf:
            break
        ggml.ggml_backend_buffer_clear(buf, 0)  # (touched: a driver that commits lazily reports it used now)
        held.append(buf)
        want -= min(gib, want)
        if free_now() >= before:  # (a device whose reported memory does not follow its buffers: lavapipe)
            print("hold_vram: the device's free memory does not change with what is held: nothing to gain",
                  file=sys.stderr)
            return 2
    desc = ggml.ggml_backend_dev_description(dev).decode(errors="replace")
    print(f"hold_vram: {desc}: holding {len(held)} buffers, {free_now() / gib:.2f} of {total.value / gib:.1f} GiB "
          f"free; until stdin closes", flush=True)
    sys.stdin.read()
    return 0


if __name__ == "__main__":
    sys.exit(main())
