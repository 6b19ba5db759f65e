"""Step order: which of the running sequences a batched decode step takes (BatchDecoder's ``order``).

Decoding sequences together shares each step's dense part and the experts they select alike; it also
makes them share the expert cache. Where the cache cannot hold what every sequence keeps selecting (a
memory cap, a routing that does not prefer the cached experts: top-k + LRU under a third of
Qwen3-30B-A3B's file), four sequences together read more per token than one at a time and are slower
(0.86x, stop 84). The orders:

* ``"together"``: every running sequence in every step (as BatchDecoder always did);
* ``"one-ahead"``: one sequence decodes alone for a turn of :data:`TURN` steps, then the next (in the
  order they joined; where the one whose turn it was ended, the first), the others waiting with their KV
  cache kept: one after another, in turns that bound how long a sequence waits. A prompt admitted then is
  prefilled at its sequence's first turn (:meth:`StepOrder.defers`), so its first token comes then;
* ``"auto"`` (serve's default): whichever of the two measured more tokens a second, per number of
  running sequences (a number not measured yet: the nearest one's verdict). Each is measured over a
  window of :data:`WINDOW` steps (the first step after a change of width not counted: the cache
  adjusts), and the one not taken is measured again after :data:`REFRESH` steps, twice as long after
  each time it lost again (up to :data:`REFRESH_MAX`): a measurement of the slower way costs more than
  its steps, since it changes what the cache holds. Together, measured again, takes two sequences (the
  one whose turn it is and the next), not all: two that lose to one at a time leave four losing too (four
  select more than two), at half the cost to the cache; where the two win, the full width is measured
  next. Steps of one sequence (one request at a time) measure one-ahead too.

>>> o = StepOrder("auto")
>>> o.pick(["a", "b"])        # nothing measured yet: together first
['a', 'b']
"""

from __future__ import annotations

from collections import deque
from typing import Deque, Dict, List, Optional, Tuple

from .errors import ConfigError

ORDERS = ("together", "one-ahead", "auto")
TURN = 32            # steps a sequence decodes alone before the next one's turn (one-ahead)
WINDOW = 3           # steps a measurement of a way takes (after the one step not counted)
REFRESH = 256        # steps after which the way not taken is measured again; doubled each time it loses again
REFRESH_MAX = 4096   #   up to this
LAST = 24            # a width's tokens a second: the tokens over the seconds of its last LAST steps counted


class StepOrder:
    """The choice of one BatchDecoder: :meth:`pick` before a step, :meth:`record` after it."""

    def __init__(self, order: str = "together"):
        if order not in ORDERS:
            raise ConfigError(f"order must be one of {', '.join(ORDERS)}, got {order!r:.40}")
        self.order = order
        self.rate: Dict[int, float] = {}  # width (sequences a step decodes; 1: one ahead) -> tokens a second
        self.steps: Dict[int, Deque[Tuple[int, float]]] = {}  # width -> its last steps' (tokens, seconds)
        self.age: Dict[int, int] = {}     # width -> steps since it was last measured
        self.holder = None                # the sequence whose turn it is (one ahead)
        self.turn_used = 0
        self.way: Optional[str] = None    # auto: "together" or "alone", kept for `window` more steps
        self.window = 0
        self.way_width: Optional[int] = None  # auto: sequences a measurement of together takes (None: all)
        self.choice: Optional[str] = None  # auto: the way measured faster (None: not both measured yet)
        self.refresh = REFRESH
        self.explored = False
        self.width = 0                    # the last step's width (a change: the next step is not counted)
        self.counted = True               # whether the step picked last is counted
        self.alone_steps = 0              # steps decoded one ahead while others waited

    def pick(self, running: List) -> List:
        """The sequences the next step decodes, of ``running`` (in the order they joined)."""
        k = len(running)
        if k < 2 or self.order == "together":
            return self._width(running)
        if self.order == "auto" and self._choose(k) == "together":
            return self._width(self._from_holder(running, self.way_width or k))
        if self.holder not in running or self.turn_used >= TURN:
            i = running.index(self.holder) + 1 if self.holder in running else 0
            self.holder, self.turn_used = running[i % k], 0
        self.turn_used += 1
        self.alone_steps += 1
        return self._width([self.holder])

    def defers(self) -> bool:
        """Whether a sequence admitted now has its prompt prefilled at its first step rather than at once with the
        others: where steps go one ahead (one-ahead, or auto's verdict one at a time). Then each prompt's experts are
        read just before its turn, as one after another would, rather than all prompts' before the first turn."""
        return self.order == "one-ahead" or (self.order == "auto" and self.choice == "alone")

    def record(self, width: int, seconds: float, tokens: int) -> None:
        """A step of ``width`` sequences took ``seconds`` and gave ``tokens``."""
        for w in self.age:
            self.age[w] += 1
        if not self.counted or seconds <= 0 or tokens <= 0:
            return
        last = self.steps.setdefault(width, deque(maxlen=LAST))
        last.append((tokens, seconds))
        # (a step's time varies with its misses: the tokens over the seconds, not the average of steps' rates)
        self.rate[width] = sum(n for n, _ in last) / sum(t for _, t in last)
        self.age[width] = 0

    def _from_holder(self, running: List, n: int) -> List:
        """``n`` of ``running``: the one whose turn it is and those after it, in the order they joined."""
        if n >= len(running):
            return running
        i = running.index(self.holder) if self.holder in running else 0
        keep = {(i + j) % len(running) for j in range(n)}
        return [s for j, s in enumerate(running) if j in keep]

    def _width(self, picked: List) -> List:
        self.counted = len(picked) == self.width
        self.width = len(picked)
        return picked

    def _choose(self, k: int) -> str:
        if self.window > 0:
            self.window -= 1
            return self.way
        self.way_width = None
        together = [w for w in self.rate if w >= 2]
        if not together:
            return self._explore("together")
        if self.choice == "alone" and min(self.age[w] for w in together) > self.refresh:
            return self._explore("together", 2)  # (the cheapest measurement of together: two sequences)
        if 1 not in self.rate or (self.choice == "together" and self.age[1] > self.refresh):
            return self._explore("alone")
        # (a width not measured yet takes the verdict of the nearest one measured: a cache that four sequences
        # together overrun, three overrun too)
        w = k if k in self.rate else min(together, key=lambda w: (abs(w - k), -w))
        choice = "alone" if self.rate[1] > self.rate[w] else "together"
        if choice == "alone" and any(v < w and self.age[v] < self.age[w] and self.rate[v] > self.rate[1]
                                     for v in together):
            return self._explore("together")  # (fewer together won since this width was measured: measure it)
        if self.explored:  # (the way not taken, measured again: lost again, so measured less often)
            self.refresh = min(REFRESH_MAX, 2 * self.refresh) if choice == self.choice else REFRESH
            self.explored = False
        self.choice = self.way = choice
        return choice

    def _explore(self, way: str, width: Optional[int] = None) -> str:
        self.explored = self.choice is not None
        self.way, self.window = way, WINDOW  # (this step, not counted, and WINDOW more)
        self.way_width = width
        return way

    def state(self) -> dict:
        """What it measured, for the server's stats: tokens a second per width, steps decoded one ahead."""
        return {"order": self.order, "tok_s": {str(w): round(r, 3) for w, r in sorted(self.rate.items())},
                "alone_steps": self.alone_steps}
