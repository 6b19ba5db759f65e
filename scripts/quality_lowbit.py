#!/usr/bin/env python3
"""What the low-bit miss path costs in quality: perplexity per companion type and policy, against the
same routing with full-precision misses, against top-k + LRU, and against the plain alternative
(every expert at the low type, the cache holding as many more as the experts are smaller), and
--cache-source: the companion as the cache's source (miss='lowbit-cache', the same memory).

    python scripts/quality_lowbit.py models/tiny-shakespeare-qwen2moe-32x4-w256.gguf --types Q4_K,Q3_K,Q2_K
    python scripts/quality_lowbit.py models/tiny-shakespeare-qwen2moe-60x4.gguf --types Q4_0 --max-p 1,0.2
    python scripts/quality_lowbit.py models/tiny-shakespeare-fine-128x8-w256.gguf --as-type Q4_K_M \
        --types Q2_K,Q3_K,IQ3_S --cache-sizes 0.25,0.125

--as-type Q4_K_M: the model first as llama-quantize writes it at that file type (what users download; made once
into --work), whose experts the companions are then made from: which companion a Q4_K_M model should get.

The `ppl` protocol (chunks of --ctx tokens from an empty KV cache, the expert cache carried over),
each token decoded alone with the experts streamed, since the miss path serves decoded tokens; the
text is the held-out tenth of Tiny Shakespeare that the trained models never saw (--text for
another). Companions and plain-alternative models are made once into --work. Prints a markdown
table: perplexity and its change against the same routing at full precision, the miss rate,
experts per token from the companion, and the MiB a token waited for (critical path), with the
ratio against top-k + LRU at full precision.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

def held_out_text(work: Path) -> Path:
    """The held-out tenth of Tiny Shakespeare, as scripts/train_tiny_moe.py holds it out, in a file."""
    from train_tiny_moe import split_text

    out = work / "tinyshakespeare-held-out.txt"
    out.write_text(split_text()[1], encoding="utf-8")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="GGUF model (its experts at F16, Q8_0, or a 4-6 bit type)")
    ap.add_argument("--types", default="Q4_K", help="companion types, comma-separated (default %(default)s)")
    ap.add_argument("--cache-sizes", default="0.5,0.25", help="cache sizes, shares of N (default %(default)s)")
    ap.add_argument("--routings", default="lru,preset:quality",
                    help="routings; lru (top-k + LRU at full precision) is the reference (default %(default)s)")
    ap.add_argument("--max-p", default="1", help="lowbit_max_p values of the miss path (default %(default)s)")
    ap.add_argument("--no-plain", action="store_true", help="skip the plain alternative rows")
    ap.add_argument("--plain-only", action="store_true", help="only the full-precision and plain alternative rows")
    ap.add_argument("--cache-source", action="store_true",
                    help="also the rows of miss='lowbit-cache': the companion as the cache's source, as many copies "
                         "as fit in the same memory (what --miss auto runs), beside the plain alternative")
    ap.add_argument("--text", help="text file (default: the held-out tenth of Tiny Shakespeare)")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default=str(ROOT / "models" / "_bench" / "quality"),
                    help="where companions and plain models are made (default %(default)s)")
    ap.add_argument("--as-type", metavar="FTYPE",
                    help="quantize the model first to this llama.cpp file type (Q4_K_M, Q5_K_M, Q8_0...), once into --work")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()

    from pymoecache import lowbit, model_info
    from pymoecache.config import parse_routing
    from pymoecache.evaluate import sweep

    model = Path(args.model).resolve()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.as_type:
        model = quantized(model, args.as_type.upper(), work, args.threads)
    text = Path(args.text) if args.text else held_out_text(work)
    sizes = [float(x) for x in args.cache_sizes.split(",")]
    routings = [parse_routing(r.strip()) for r in args.routings.split(",") if r.strip()]
    max_ps = [float(x) for x in args.max_p.split(",")]
    common = dict(ctx=args.ctx, max_chunks=args.chunks, n_threads=args.threads, progress=False, decode=True,
                  stream=True)
    rows = []

    def run(path, sizes_, label, **kw):
        got = []
        for block, size in enumerate(sizes_):  # (block: the i-th size asked, whose memory the row has)
            for r in sweep(path, text, routings, [size], **common, **kw):
                r["block"] = block
                got.append(r)
        for r in got:
            r["path"] = label
            print(f"  {label} {r['spec']} cache {r['cache_size']}/{r['n_expert']}: ppl {r['ppl']:.4f} "
                  f"miss {100 * r['miss_rate']:.1f}% critical {r['critical_mib_per_token']:.3f} MiB/tok",
                  file=sys.stderr, flush=True)
        rows.extend(got)

    print(f"{model.name}: full precision", file=sys.stderr)
    run(model, sizes, "full")
    info = model_info(model)
    for t in args.types.split(","):
        t = t.strip().upper()
        companion = work / f"{model.stem}.lowbit-{t}.gguf"
        try:
            lowbit.check_companion(model, companion)
        except lowbit.CompanionError:
            lowbit.make_companion(model, companion, type=t, progress=False)
        c = lowbit.check_companion(model, companion)
        made = "/".join(c.types)
        for p in ([] if args.plain_only else max_ps):
            run(model, sizes, f"lowbit {made}" + (f" p<{p:g}" if p < 1 else ""), miss="lowbit", lowbit=companion,
                lowbit_max_p=p)
        if args.cache_source:
            run(model, sizes, f"lowbit-cache {made}", miss="lowbit-cache", lowbit=companion)
        if not args.no_plain:
            plain = work / f"{model.stem}.experts-{t}.gguf"
            if not plain.exists():
                lowbit.quantize_experts(model, plain, t, progress=False)
            scale = info.expert_bytes / model_info(plain).expert_bytes
            run(plain, [min(1.0, s * scale) for s in sizes], f"plain {made} (cache x{scale:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    print(table(rows, sizes, model.name))
    return 0


def quantized(model: Path, ftype: str, work: Path, threads: int) -> Path:
    """``model`` as llama-quantize writes it at file type ``ftype`` (its own mix: Q4_K_M's experts at Q4_K, some down
    projections at Q6_K), made once into ``work``."""
    import ctypes
    import os

    import logging

    from pymoecache import _llamalog  # (points llama_cpp at our library; its log goes through this logger)
    import llama_cpp

    out = work / f"{model.stem}.{ftype}.gguf"
    if out.is_file() and out.stat().st_mtime >= model.stat().st_mtime:
        return out
    code = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}", None)
    if code is None:
        raise SystemExit(f"--as-type {ftype}: not a llama.cpp file type (Q4_K_M, Q5_K_M, Q6_K, Q8_0...)")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(code)
    params.nthread = threads
    params.allow_requantize = True  # (a Q8_0 model too: a second rounding, said in the message below)
    part = out.with_name(out.name + ".tmp")
    print(f"quantizing {model.name} to {ftype} (once) ...", file=sys.stderr, flush=True)
    logger = _llamalog.LLAMA_CPP_LOGGER.logger
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)  # (a line per tensor otherwise)
    try:
        if llama_cpp.llama_model_quantize(str(model).encode(), str(part).encode(), ctypes.byref(params)) != 0:
            raise SystemExit(f"llama.cpp could not quantize {model} to {ftype}")
        os.replace(part, out)
    finally:
        logger.setLevel(level)
        part.unlink(missing_ok=True)
    return out


def table(rows, sizes, name) -> str:
    """Markdown: one block of rows per cache size (the plain rows: the cache of the same memory)."""
    full = {(r["block"], r["spec"]): r for r in rows if r["path"] == "full"}
    out = [f"{name}: `ppl --ctx 256 --decode`, Δ against the same routing at full precision; x: critical-path "
           "bytes of top-k + LRU at full precision ÷ this row's", "",
           "| cache | routing | misses from | ppl | Δ ppl | Δ vs top-k + LRU | miss rate | low-bit experts/token | "
           "critical MiB/token | x |", "|---|---|---|---|---|---|---|---|---|---|"]
    for b in sorted(range(len(sizes)), key=lambda b: -sizes[b]):  # (block b: the b-th size asked, largest first)
        lru = full.get((b, "lru"))
        for r in rows:
            # a plain or lowbit-cache row belongs to the size whose memory it has: the block of the size it was asked
            # for, even where two sizes give it the same cache (every expert of a smaller copy fits in both)
            if r["block"] != b:
                continue
            ref = full.get((b, r["spec"]))
            d = f"{100 * (r['ppl'] / ref['ppl'] - 1):+.2f}%" if ref else "-"
            dl = f"{100 * (r['ppl'] / lru['ppl'] - 1):+.2f}%" if lru else "-"
            x = ("-" if not lru else f"{lru['critical_mib_per_token'] / r['critical_mib_per_token']:.2f}x"
                 if r["critical_mib_per_token"] > 0 else "∞ (reads nothing)")
            out.append(f"| {r['cache_size']}/{r['n_expert']} | {r['spec']} | {r['path']} | {r['ppl']:.4f} | {d} | "
                       f"{dl} | {100 * r['miss_rate']:.1f}% | {r['lowbit_per_token']:.2f} | "
                       f"{r['critical_mib_per_token']:.3f} | {x} |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
