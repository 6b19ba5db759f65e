"""What a run did, when: the graph thread's routing decisions and waits, and every expert read on
the reader threads, as recorded by the library (``moecache_timeline_start``), plus the span of
each ``eval`` call. Pure numpy: no native library needed to read, convert or plot one.

A streamed token should cost max(compute, I/O), not their sum. The timeline shows which it was:
a layer's wait on the graph thread with reads running beside it is I/O that compute did not hide.
:meth:`Timeline.overlap` puts it in one number, the share of read time hidden behind compute.

>>> import numpy as np
>>> ev = np.zeros(3, dtype=EVENT_DTYPE)
>>> ev[0] = (KIND["route"], 0, -1, 0, 1, 0, 100, 100, 110, 0)
>>> ev[1] = (KIND["read"], 0, 5, 1, 0, 0, 110, 112, 212, 262144)
>>> ev[2] = (KIND["wait"], 0, -1, 0, 1, 0, 110, 110, 160, 0)
>>> tl = Timeline(ev, tokens=np.array([(90, 300, 1)], dtype=TOKEN_DTYPE))
>>> o = tl.overlap()
>>> o.read_ms, o.wait_ms, round(o.share, 2)
(0.1, 0.05, 0.5)
>>> [e["name"] for e in tl.chrome_events() if e.get("ph") == "X"][:4]
['token 0 (decode)', 'compute', 'route L0', 'wait L0']
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

# struct moecache_event (moecache.h), and enum moecache_event_kind in its order
EVENT_DTYPE = np.dtype([("kind", "<i4"), ("layer", "<i4"), ("expert", "<i4"), ("thread", "<i4"),
                        ("n_tokens", "<i4"), ("pad", "<i4"), ("t_queued_us", "<i8"), ("t_start_us", "<i8"),
                        ("t_end_us", "<i8"), ("bytes", "<i8")])
KINDS = ("route", "wait", "read", "read_ahead", "lock", "copy", "expert", "copy_up", "lowbit")
KIND = {name: i for i, name in enumerate(KINDS)}
# one eval call: its span on the same clock, and how many tokens it decoded (1: a generated token)
TOKEN_DTYPE = np.dtype([("t_start_us", "<i8"), ("t_end_us", "<i8"), ("n_tokens", "<i4")])

_READS = (KIND["read"], KIND["read_ahead"], KIND["lowbit"])  # (lowbit: a low-bit copy read into the pool)
# on the graph thread: routing, waits, the matmuls of an expert that arrived (overlap_experts), and
# copies up to the VRAM tier
_GRAPH = (KIND["route"], KIND["wait"], KIND["expert"], KIND["copy_up"])


def _graph_name(e) -> str:
    """'route L3', 'wait L3' (the residency op), 'wait L3 E12' (a matmul waiting for expert 12),
    'expert L3 E12' (its matmuls), 'copy_up L3 E12' (copied to the VRAM tier)."""
    return f"{KINDS[e['kind']]} L{int(e['layer'])}" + (f" E{int(e['expert'])}" if e["expert"] >= 0 else "")


def _union_us(starts: np.ndarray, ends: np.ndarray) -> int:
    """Length of the union of the intervals [starts[i], ends[i])."""
    if len(starts) == 0:
        return 0
    order = np.argsort(starts, kind="stable")
    total, cur_s, cur_e = 0, int(starts[order[0]]), int(ends[order[0]])
    for i in order[1:]:
        s, e = int(starts[i]), int(ends[i])
        if s > cur_e:
            total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + cur_e - cur_s


@dataclass
class Overlap:
    """Decoded tokens only. ``read_ms``: wall time with at least one expert read in flight;
    ``wait_ms``: time the graph thread waited for experts' bytes; ``share``: the part of
    the read time hidden behind compute, 1 - wait / read (0 when nothing was read)."""

    tokens: int
    read_ms: float
    wait_ms: float
    token_ms: float           # the tokens' eval spans, summed
    bytes_read: int

    @property
    def share(self) -> float:
        return max(0.0, 1.0 - self.wait_ms / self.read_ms) if self.read_ms > 0 else 0.0

    def summary(self) -> str:
        n = max(1, self.tokens)
        return (f"{self.tokens} decoded tokens: {self.token_ms / n:.2f} ms/token, reads in flight "
                f"{self.read_ms / n:.2f} ms/token, waited {self.wait_ms / n:.2f} ms/token, "
                f"{self.bytes_read / n / 2 ** 20:.2f} MiB/token read; overlap {100 * self.share:.0f}%")


class Timeline:
    """Events of one recording (``EVENT_DTYPE``, in the order they ended) and the eval spans."""

    def __init__(self, events: np.ndarray, tokens: Optional[np.ndarray] = None, dropped: int = 0):
        self.events = np.asarray(events, dtype=EVENT_DTYPE)
        self.tokens = np.zeros(0, dtype=TOKEN_DTYPE) if tokens is None else np.asarray(tokens, dtype=TOKEN_DTYPE)
        self.dropped = int(dropped)   # events past the recording's capacity

    def __len__(self) -> int:
        return len(self.events)

    def decode_tokens(self) -> np.ndarray:
        return self.tokens[self.tokens["n_tokens"] == 1]

    def _in(self, ev: np.ndarray, spans: np.ndarray) -> np.ndarray:
        """Mask of the events queued inside one of the spans (a read queued by a token may run on
        after the token's eval returned: the experts it caches but did not select)."""
        if len(spans) == 0 or len(ev) == 0:
            return np.zeros(len(ev), dtype=bool)
        order = np.argsort(spans["t_start_us"])
        s, e = spans["t_start_us"][order], spans["t_end_us"][order]
        i = np.searchsorted(s, ev["t_queued_us"], side="right") - 1
        ok = i >= 0
        ok[ok] = ev["t_queued_us"][ok] < e[i[ok]]
        return ok

    def overlap(self) -> Overlap:
        """The overlap of reads and compute over the decoded tokens (all events when no eval
        span was recorded)."""
        dec = self.decode_tokens()
        ev = self.events
        if len(self.tokens):
            ev = ev[self._in(ev, dec)]
        reads = ev[np.isin(ev["kind"], _READS)]
        waits = ev[(ev["kind"] == KIND["wait"]) & (ev["n_tokens"] == 1)]
        n = len(dec) if len(self.tokens) else int(np.count_nonzero(
            (self.events["kind"] == KIND["route"]) & (self.events["n_tokens"] == 1) &
            (self.events["layer"] == self.events["layer"].min(initial=0))))
        return Overlap(tokens=n, read_ms=_union_us(reads["t_start_us"], reads["t_end_us"]) / 1000.0,
                       wait_ms=float((waits["t_end_us"] - waits["t_start_us"]).sum()) / 1000.0,
                       token_ms=float((dec["t_end_us"] - dec["t_start_us"]).sum()) / 1000.0,
                       bytes_read=int(reads["bytes"].sum()))

    # --- Chrome trace-event JSON (chrome://tracing, https://ui.perfetto.dev) -----------------

    def chrome_events(self) -> List[dict]:
        """Trace events: process 1, thread 0 the graph thread (eval spans, routing, waits and the
        compute between them), threads 1.. the readers (one slice per read piece)."""
        out: List[dict] = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "pymoecache"}},
                           {"ph": "M", "pid": 1, "tid": 0, "name": "thread_name", "args": {"name": "graph thread"}}]
        t0 = int(min([self.events["t_start_us"].min(initial=2 ** 62), self.tokens["t_start_us"].min(initial=2 ** 62)]))
        readers = sorted({int(t) for t in self.events["thread"] if t > 0})
        for t in readers:
            out.append({"ph": "M", "pid": 1, "tid": int(t), "name": "thread_name", "args": {"name": f"reader {t}"}})

        def x(name, tid, start, end, cat, **args):
            out.append({"ph": "X", "pid": 1, "tid": int(tid), "name": name, "cat": cat, "ts": int(start) - t0,
                        "dur": max(0, int(end) - int(start)), "args": args})

        graph = self.events[np.isin(self.events["kind"], _GRAPH)]
        graph = graph[np.argsort(graph["t_start_us"], kind="stable")]
        for i, tok in enumerate(self.tokens):
            kind = "decode" if tok["n_tokens"] == 1 else f"prompt, {int(tok['n_tokens'])} tokens"
            x(f"token {i} ({kind})", 0, tok["t_start_us"], tok["t_end_us"], "token", n_tokens=int(tok["n_tokens"]))
            inside = graph[(graph["t_start_us"] >= tok["t_start_us"]) & (graph["t_start_us"] < tok["t_end_us"])]
            cur, after = int(tok["t_start_us"]), "eval start"
            for e in inside:
                name = _graph_name(e)
                if int(e["t_start_us"]) > cur:
                    x("compute", 0, cur, e["t_start_us"], "compute", after=after, before=name)
                x(name, 0, e["t_start_us"], e["t_end_us"], KINDS[e["kind"]], layer=int(e["layer"]),
                  expert=int(e["expert"]))
                cur, after = max(cur, int(e["t_end_us"])), name
            if int(tok["t_end_us"]) > cur:
                x("compute", 0, cur, tok["t_end_us"], "compute", after=after, before="eval end")
        if not len(self.tokens):
            for e in graph:
                x(_graph_name(e), 0, e["t_start_us"], e["t_end_us"], KINDS[e["kind"]], layer=int(e["layer"]),
                  expert=int(e["expert"]))
        for e in self.events[~np.isin(self.events["kind"], _GRAPH)]:
            kind = KINDS[e["kind"]]
            x(f"{kind.replace('_', ' ')} L{int(e['layer'])} E{int(e['expert'])}", e["thread"], e["t_start_us"],
              e["t_end_us"], kind, layer=int(e["layer"]), expert=int(e["expert"]), bytes=int(e["bytes"]),
              queued_us=int(e["t_start_us"] - e["t_queued_us"]))
        return out

    def save_chrome(self, path: "os.PathLike[str] | str", **meta) -> None:
        """Writes the Chrome trace-event JSON (whole or not at all); ``meta`` goes to otherData."""
        from .errors import Error
        from .files import write_atomic

        o = self.overlap()
        doc = {"traceEvents": self.chrome_events(), "displayTimeUnit": "ms",
               "otherData": {"overlap_share": o.share, "decode_tokens": o.tokens, "read_ms": o.read_ms,
                             "wait_ms": o.wait_ms, "token_ms": o.token_ms, "bytes_read": o.bytes_read,
                             "events": len(self.events), "events_dropped": self.dropped,
                             **{k: v for k, v in meta.items()}}}
        write_atomic(path, json.dumps(doc, separators=(",", ":")).encode(), "timeline", Error)

    # --- a picture of tokens -------------------------------------------------------------------

    def pick_token(self) -> int:
        """The decoded token whose time is the median of the decoded tokens (index into tokens)."""
        dec = np.flatnonzero(self.tokens["n_tokens"] == 1)
        if len(dec) == 0:
            raise ValueError("the timeline has no decoded token")
        dur = self.tokens["t_end_us"][dec] - self.tokens["t_start_us"][dec]
        return int(dec[np.argsort(dur, kind="stable")[len(dec) // 2]])

    def plot(self, path: "os.PathLike[str] | str", tokens: Optional[Sequence[int]] = None) -> List[str]:
        """A Gantt chart of some eval spans (default: the median decoded token and the next
        one): the graph thread's compute, routing and waits above, each reader's reads below.
        Returns the legend's labels: what was drawn, nothing else (the legend stands beside the
        chart, clear of its axis)."""
        from ._mpl import require_matplotlib

        plt = require_matplotlib()
        from matplotlib.patches import Patch

        if tokens is None:
            first = self.pick_token()
            tokens = [i for i in (first, first + 1) if i < len(self.tokens) and self.tokens["n_tokens"][i] == 1]
        spans = self.tokens[list(tokens)]
        lo, hi = int(spans["t_start_us"].min()), int(spans["t_end_us"].max())
        ev = self.events[(self.events["t_end_us"] > lo) & (self.events["t_start_us"] < hi)]
        readers = sorted({int(t) for t in ev["thread"] if t > 0})
        lanes = ["graph thread"] + [f"reader {t}" for t in readers]
        color = {"compute": "#9ecae1", "route": "#6a51a3", "wait": "#de2d26", "read": "#fd8d3c",
                 "read_ahead": "#31a354", "lock": "#756bb1", "copy": "#969696", "expert": "#3182bd",
                 "copy_up": "#e7ba52", "lowbit": "#e377c2"}
        fig, ax = plt.subplots(figsize=(12, 1.2 + 0.45 * len(lanes)))
        ms = lambda t: (t - lo) / 1000.0  # noqa: E731
        for s in spans:  # compute = the span less the graph thread's events
            ax.barh(0, ms(s["t_end_us"]) - ms(s["t_start_us"]), left=ms(s["t_start_us"]), height=0.6,
                    color=color["compute"])
        for e in ev:
            kind = KINDS[e["kind"]]
            lane = 0 if e["kind"] in _GRAPH else 1 + readers.index(int(e["thread"]))
            ax.barh(lane, max(ms(e["t_end_us"]) - ms(e["t_start_us"]), 0.002), left=ms(e["t_start_us"]),
                    height=0.6, color=color[kind], edgecolor="none")
        for s in spans[1:]:
            ax.axvline(ms(s["t_start_us"]), color="k", lw=0.8, ls="--")
        ax.set_yticks(range(len(lanes)))
        ax.set_yticklabels(lanes)
        ax.invert_yaxis()
        ax.set_xlabel("ms")
        o = Timeline(ev, spans).overlap()
        ax.set_title(f"{len(spans)} decoded token(s): {o.token_ms / max(1, o.tokens):.1f} ms/token, reads in flight "
                     f"{o.read_ms / max(1, o.tokens):.1f} ms, waited {o.wait_ms / max(1, o.tokens):.1f} ms, "
                     f"overlap {100 * o.share:.0f}%", fontsize=10)
        drawn = {"compute"} | {KINDS[k] for k in ev["kind"]}  # the legend lists what was drawn, nothing else
        labels = [k.replace("_", " ") for k in color if k in drawn]
        ax.legend(handles=[Patch(color=color[k], label=k.replace("_", " ")) for k in color if k in drawn],
                  loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)  # (beside, off the axis)
        fig.tight_layout()
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        return labels


def load_chrome(path: "os.PathLike[str] | str") -> dict:
    """A saved timeline's JSON (for its otherData: overlap share, tokens, bytes)."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)
