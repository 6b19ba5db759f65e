#!/usr/bin/env python3
"""Compare two `moecache-run --trace` reports of the same run on two machines (scripts/test_aarch64.sh).

    python scripts/compare_traces.py A.txt B.txt        # prints one line; exit 0 same or near-tie, 1 differ

Identical reports (the `z` lines aside) are "same". Otherwise the runs parted somewhere. They part
at a near-tie when, up to the first selection that differs, every router logit z agrees within
rounding (|dz| <= 3e-3 (1 + max|z|)): the two machines computed the same numbers and a choice that
was within rounding of another went the other way; from there on the runs differ and are not
compared. A larger |dz| before or at the parting point is a real difference.
"""

from __future__ import annotations

import sys

# F16 runs on x86-64 and NEON drift apart by up to 7.6e-4 over 25 tokens (measured); an F16 model
# against its own Q8_0 copy parts by 1.3e-2 at the first token: 3e-3 tells the two apart
TOL = 3e-3


def parse(path):
    sel, z, gen, rest = {}, {}, [], []
    with open(path) as f:
        for line in f:
            head, _, tail = line.rstrip("\n").partition(" ")
            if head == "sel":
                lt, tt, body = tail.split(" ", 2)
                sel[(int(tt[2:]), int(lt[2:]))] = body
            elif head == "z":
                lt, tt, *vals = tail.split()
                z[(int(tt[2:]), int(lt[2:]))] = [float(v) for v in vals]
            elif head == "gen":
                gen.append(tail)
            else:
                rest.append(line)
    return sel, z, gen, rest


def compare(a_path, b_path):
    sa, za, ga, ra = parse(a_path)
    sb, zb, gb, rb = parse(b_path)
    if sa == sb and ga == gb and ra == rb:
        return True, f"same ({len(sa)} selections)"
    keys = sorted(set(sa) | set(sb))
    first = next((k for k in keys if sa.get(k) != sb.get(k)), None)
    first_gen = next((i for i in range(max(len(ga), len(gb))) if ga[i:i + 1] != gb[i:i + 1]), None)
    where = f"L={first[1]} T={first[0]}" if first is not None else f"generated token {first_gen}"
    worst, worst_at = 0.0, None
    for k in keys:
        if first is not None and k > first:
            break
        if k in za and k in zb:
            scale = 1.0 + max(abs(v) for v in za[k])
            d = (max(abs(x - y) for x, y in zip(za[k], zb[k])) / scale if len(za[k]) == len(zb[k])
                 else float("inf"))
            if d > worst:
                worst, worst_at = d, k
    if worst > TOL:
        return False, (f"differ: router logits part by {worst:.2e} (relative) at L={worst_at[1]} T={worst_at[0]}, "
                       f"selections part at {where}")
    return True, f"near-tie at {where}: router logits agree within {worst:.1e} up to there"


def main(argv):
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    ok, msg = compare(argv[1], argv[2])
    print(msg)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
