#!/usr/bin/env python3
"""The one table of a device check: scripts/gpu_check.sh's acceptance rows, read from the JSON its steps write.

    python scripts/gpu_check_table.py OUTDIR      # OUTDIR/device.json, share.json, direct.json, batch.json

Each row: what was measured, ours, what it is against (stock llama.cpp's, or one request after another), ours over
it as a speed (a time: its inverse) and the goal (issue 78). A step that did not run (a short
lease, GPU_CHECK_STEPS) leaves its rows out, and the table says which files it did not find.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(d: Path, name: str):
    f = d / f"{name}.json"
    return json.loads(f.read_text()) if f.exists() else None


def share_rows(rows: list, label: str) -> list:
    """bench_vram_share.py's rows: each of ours against stock --n-cpu-moe (its first row), decode and prompt."""
    stock, out = rows[0], []
    for r in rows[1:]:
        if "tok_s" in r and "tok_s" in stock:
            out.append((f"{label}, {r['routing']}: decode tok/s", r["tok_s"], stock["tok_s"], ">= 1.5x"))  # (issue 78)
        if "prompt_tok_s" in r and "prompt_tok_s" in stock:
            out.append((f"{label}, {r['routing']}: prompt tok/s", r["prompt_tok_s"], stock["prompt_tok_s"], ">= 1.0x"))
    return out


def table(d: Path) -> str:
    rows, missing = [], []
    device = load(d, "device")
    if device and "stock" in device:
        stock = device["stock"]
        for name, what in (("device", "every expert on the GPU, top-k"), ("default", "every expert on the GPU, defaults")):
            if name in device:  # (ms per token: stock's over ours is ours' speed over stock's)
                rows.append((f"{what}: decode ms/token, against stock's", device[name]["decode_ms"], stock["decode_ms"],
                             ">= 0.95x", True))
        for name, what in (("tier", "the tier with its round trip"), ("direct", "the direct tier")):
            if name in device:
                rows.append((f"{what}: graph splits per token, against stock's", device[name]["splits"],
                             stock["splits"], "<= stock + 1", None))
    else:
        missing.append("device.json")
    for name, label in (("share", "a quarter in VRAM, against stock --n-cpu-moe"),
                        ("direct", "the direct tier, against stock --n-cpu-moe")):
        got = load(d, name)
        if got:
            rows += [r + (False,) for r in share_rows(got, label)]
        else:
            missing.append(f"{name}.json")
    batch = load(d, "batch")
    if batch:
        alone = {(r["routing"], r["np"]): r for r in batch if r["way"] == "one after another"}
        for r in batch:
            if r["way"] == "together" and (r["routing"], r["np"]) in alone:
                rows.append((f"-np {r['np']} with the tier, {r['routing']}: tok/s together, against one after another",
                             r["tok_s"], alone[(r["routing"], r["np"])]["tok_s"], "> 1.0x", False))
    else:
        missing.append("batch.json")
    out = ["| check | ours | against | x | goal |", "|---|---|---|---|---|"]
    for what, ours, theirs, goal, lower_is_better in rows:
        if lower_is_better is None:  # (counts: the difference is what the goal speaks of)
            ratio = f"{ours - theirs:+d}"
        else:
            ratio = f"{(theirs / ours if lower_is_better else ours / theirs):.2f}x" if ours and theirs else "-"
        out.append(f"| {what} | {ours:.4g} | {theirs:.4g} | {ratio} | {goal} |")
    if missing:
        out.append(f"\n(not run: {', '.join(missing)})")
    return "\n".join(out)


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print(__doc__, file=sys.stderr)
        return 2
    print(table(Path(args[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
