r"""Several sequences generated together on one :class:`pymoecache.Llama` (batched decoding).

Each step is one ``llama_decode`` over one token of every running sequence, each in its own KV
sequence (a slot, of the context's ``n_seq_max``). The MoE layers read the union of the step's
misses once, into the slots the cache keeps for a batch (``Llama(n_seq_max=N)``: (N - 1) x K more
per layer), and compute every sequence's selection from them as they would its own alone: under
top-k routing each sequence's tokens are those it decodes alone. A sequence that arrives while
others run joins the batch at the next step (continuous batching): its prompt is prefilled alone,
from the longest prefix a free slot already holds (a conversation that comes back is not prefilled
again), and it leaves the batch when it ends.

>>> from pymoecache import Llama, BatchDecoder
>>> llm = Llama("model.gguf", cache=0.25, n_seq_max=4)                 # doctest: +SKIP
>>> dec = BatchDecoder(llm)                                             # doctest: +SKIP
>>> a = dec.add(llm.tokenize(b"Once upon a time"), max_tokens=32)       # doctest: +SKIP
>>> b = dec.add(llm.tokenize(b"The sea"), max_tokens=32)                # doctest: +SKIP
>>> dec.run()                                                           # doctest: +SKIP
>>> llm.detokenize(a.tokens)                                            # doctest: +SKIP
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence as Seq

import llama_cpp
import numpy as np

from . import kv
from .config import ConfigError
from .errors import ClosedError
from .step_order import StepOrder


@dataclass(eq=False)
class Sequence:
    """One sequence of a :class:`BatchDecoder`: its prompt, its tokens so far, and its timings."""

    prompt: List[int]
    max_tokens: int
    tokens: List[int] = field(default_factory=list)  # generated so far
    slot: int = -1                     # the KV sequence (slot) it runs in; -1 while it waits
    finish_reason: Optional[str] = None  # "stop" (an end-of-generation token), "length"; None while it runs
    n_prompt_reused: int = 0           # prompt tokens a slot held already (not prefilled again)
    hits: int = 0                      # its decoded tokens' selections the cache held, over the MoE layers
    misses: int = 0                    #   and those it did not (the step read them, for it or another);
    #                                    both counted when the running sequences change and when it ends
    t_submit: float = 0.0              # time.perf_counter() of add()
    t_first: float = 0.0               #   of its first token
    t_done: float = 0.0                #   of its end
    prefill_s: float = 0.0             # seconds its prompt took to prefill (alone)
    on_token: Optional[Callable[["Sequence", int], None]] = None  # called with each token as it comes
    logits: Optional[list] = None      # add(keep_logits=True): each token's logits row (numpy float32 [n_vocab])
    forced: Optional[List[int]] = None  # add(forced=...): the tokens it takes instead of sampling (a text scored)
    nll: Optional[List[float]] = None   #   and each one's negative log-likelihood under the model
    error: Optional[BaseException] = None  # what its on_token raised (it then ended, finish_reason "error")
    _sampler: object = None
    _cancel: bool = False
    _unfilled: bool = False            # admitted, its prompt prefilled at its first step (step order one ahead)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def latency_s(self) -> float:
        """Seconds from add() to its end (0 while it runs)."""
        return self.t_done - self.t_submit if self.t_done else 0.0

    def cancel(self) -> None:
        """End it at the next step (finish_reason "cancelled"), from any thread."""
        self._cancel = True


def _sampler(n_vocab: int, temperature: float, top_k: int, top_p: float, min_p: float, seed: int,
             penalties: tuple):
    """llama-cpp-python's sampler chain (Llama._init_sampler), so a sequence samples here as it does alone:
    the penalties (repeat, frequency, presence) over the generated tokens, then a draw from the
    distribution (temperature < 0), greedy (0), or top-k, typical, top-p, min-p, temperature and a
    seeded draw."""
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    add = functools.partial(llama_cpp.llama_sampler_chain_add, chain)
    repeat, freq, present = penalties
    # (called as llama-cpp-python calls it, with the same arguments: the same window of tokens)
    add(llama_cpp.llama_sampler_init_penalties(n_vocab, 64, repeat, freq, present))
    if temperature < 0:
        add(llama_cpp.llama_sampler_init_dist(seed & 0xFFFFFFFF))
    elif temperature == 0:
        add(llama_cpp.llama_sampler_init_greedy())
    else:
        add(llama_cpp.llama_sampler_init_top_k(top_k))
        add(llama_cpp.llama_sampler_init_typical(1.0, 1))
        add(llama_cpp.llama_sampler_init_top_p(top_p, 1))
        add(llama_cpp.llama_sampler_init_min_p(min_p, 1))
        add(llama_cpp.llama_sampler_init_temp(temperature))
        add(llama_cpp.llama_sampler_init_dist(seed & 0xFFFFFFFF))
    return chain


def _check_sampling(max_tokens, temperature, top_k, top_p, min_p, seed, penalties) -> None:
    """ConfigError for what the sampler chain would misread: NaN or infinite numbers, probabilities
    outside [0, 1], integers beyond what llama.cpp takes (32 bits), penalties not three numbers."""
    import math
    import numbers

    def number(name, v, lo, hi, integer=False):
        ok = (not isinstance(v, bool) and isinstance(v, numbers.Integral if integer else numbers.Real)
              and not math.isnan(v) and lo <= v <= hi)
        if not ok:
            raise ConfigError(f"{name} must be {'an integer' if integer else 'a number'} in [{lo:g}, {hi:g}], "
                              f"got {v!r:.40}")

    number("max_tokens", max_tokens, 1, 2**31 - 1, integer=True)
    number("temperature", temperature, -1e6, 1e6)
    number("top_k", top_k, -2**31, 2**31 - 1, integer=True)
    number("top_p", top_p, 0.0, 1.0)
    number("min_p", min_p, 0.0, 1.0)
    number("seed", seed, -2**63, 2**64 - 1, integer=True)
    if not isinstance(penalties, (tuple, list)) or len(penalties) != 3:
        raise ConfigError(f"penalties must be (repeat, frequency, presence), got {penalties!r:.60}")
    for name, v in zip(("repeat", "frequency", "presence"), penalties):
        number(f"penalties' {name}", v, -1e6, 1e6)


class BatchDecoder:
    """Sequences decoded together on ``llm`` (a :class:`pymoecache.Llama` made with ``n_seq_max`` > 1:
    that many run at once; more wait for a slot). One thread drives it (:meth:`step` or :meth:`run`);
    :meth:`add` may be called from any thread. The Llama's own ``eval`` shares the context's slot 0.
    ``order``: which running sequences a step decodes: ``"together"`` (all), ``"one-ahead"`` (one at a
    time, in turns), ``"auto"`` (whichever measured faster; ``serve -np N``'s default): step_order.py."""

    def __init__(self, llm, *, order: str = "together"):
        self.order = StepOrder(order)  # (first: a bad order raises before anything is allocated)
        n = int(llama_cpp.llama_n_seq_max(llm._ctx.ctx))  # (a llama_cpp.Llama's context too: stock llama.cpp)
        self.llm = llm
        self.n_slots = n
        # sequences one llama_decode computes together: n, or fewer where the memory did not hold their slots
        self._step_max = max(1, min(n, getattr(getattr(llm, "placement", None), "n_seq_step", n) or n))
        self._ctx = llm._ctx.ctx
        self._vocab = llm._model.vocab
        self._n_ctx = llm.n_ctx()
        self._n_batch = max(1, int(llm.n_batch))
        self._n_vocab_n = llm.n_vocab()
        self._batch = llama_cpp.llama_batch_init(max(self._n_batch, n), 0, 1)
        self._kept: List[List[int]] = [[] for _ in range(n)]  # the tokens each slot's KV sequence holds
        self._running: List[Sequence] = []
        self._rows: List[Sequence] = []  # the sequences of the rows the engine sums hits and misses for
        self._waiting: deque = deque()
        self._lock = threading.Lock()
        self.steps = 0              # batched decode steps
        self.step_tokens = 0        # tokens they decoded (a step of 3 sequences: 3)
        self._closed = False
        self._evals = getattr(llm, "n_evals", 0)  # the Llama's own evals so far (they use the context too)
        self._raised: List[BaseException] = []   # what on_token raised during a step, raised after it
        # the slots start empty: the Llama's own conversation (slot 0) is forgotten
        kv.clear(llm)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            llama_cpp.llama_batch_free(self._batch)
            for s in self._running:
                self._free_sampler(s)

    def __enter__(self) -> "BatchDecoder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def _check_open(self) -> None:
        """ClosedError once this decoder or its Llama is closed (their memory is freed: llama.cpp would crash)."""
        if self._closed:
            raise ClosedError("BatchDecoder: it was closed (close(), or the end of its with block)")
        if "_closed_why" in self.llm.__dict__ or getattr(self.llm._ctx, "ctx", None) is None:
            raise ClosedError("BatchDecoder: its Llama was closed")

    # --- what callers see -------------------------------------------------------------------
    def add(self, prompt: Seq[int], *, max_tokens: int = 16, temperature: float = 0.0, top_k: int = 40,
            top_p: float = 0.95, min_p: float = 0.05, seed: int = 0,
            penalties: tuple = (1.0, 0.0, 0.0), on_token: Optional[Callable[[Sequence, int], None]] = None,
            keep_logits: bool = False, forced: Optional[Seq[int]] = None) -> Sequence:
        """Queue a sequence: ``prompt`` (token ids, at least one) continued by at most ``max_tokens``
        tokens, sampled as llama-cpp-python samples (greedy at ``temperature`` 0; ``penalties``: repeat,
        frequency, presence). It joins the batch at the next step with a free slot. ``on_token(seq,
        token)`` is called on the decoding thread with each token; ``keep_logits`` keeps each token's
        logits row in ``seq.logits``; ``forced`` makes it take these tokens instead of sampling (at most
        ``max_tokens`` of them) and score each (``seq.nll``), as perplexity does, one token a step."""
        self._check_open()
        prompt = [int(t) for t in prompt]
        _check_sampling(max_tokens, temperature, top_k, top_p, min_p, seed, penalties)
        if not prompt:
            raise ConfigError("a sequence needs a prompt of at least one token")
        if len(prompt) >= self._n_ctx:
            raise ConfigError(f"the prompt has {len(prompt)} tokens; the context holds {self._n_ctx} (n_ctx)")
        n_vocab = self._n_vocab_n
        bad = [t for t in prompt if not 0 <= t < n_vocab]
        if bad:
            raise ConfigError(f"token id {bad[0]} is not in the vocabulary (0 to {n_vocab - 1})")
        if forced is not None:
            forced = [int(t) for t in forced]
            bad = [t for t in forced if not 0 <= t < self._n_vocab_n]
            if bad or not forced:
                raise ConfigError(f"forced token id {bad[0]} is not in the vocabulary" if bad else "forced is empty")
            max_tokens = min(int(max_tokens), len(forced))
        seq = Sequence(prompt=prompt, max_tokens=int(max_tokens), t_submit=time.perf_counter(), on_token=on_token,
                       logits=[] if keep_logits else None, forced=forced, nll=[] if forced is not None else None)
        seq._sampler = (float(temperature), int(top_k), float(top_p), float(min_p), int(seed),
                        tuple(float(x) for x in penalties))
        with self._lock:
            self._waiting.append(seq)
        return seq

    @property
    def running(self) -> List[Sequence]:
        return list(self._running)

    @property
    def n_waiting(self) -> int:
        return len(self._waiting)

    def kept(self, slot: int) -> List[int]:
        """The tokens slot ``slot``'s KV sequence holds (a free slot: what a prompt may continue)."""
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.n_slots:
            raise ConfigError(f"slot {slot!r} does not exist: slots are 0 to {self.n_slots - 1}")
        return list(self._kept[slot])

    def set_kept(self, slot: int, tokens: List[int], in_cache: bool = False) -> None:
        """A free slot's KV sequence: emptied (``tokens`` empty), or ``tokens`` that llama.cpp has just put in
        the KV cache for it (``in_cache``: a sequence state restored from a file)."""
        self._check_open()
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.n_slots:
            raise ConfigError(f"slot {slot!r} does not exist: slots are 0 to {self.n_slots - 1}")
        if any(s.slot == slot for s in self._running):
            raise ConfigError(f"slot {slot} is decoding a sequence")
        if not in_cache:
            kv.remove(self._ctx, slot)
            tokens = []
        self._kept[slot] = [int(t) for t in tokens]

    def forget(self) -> None:
        """Forget what the free slots hold (another user of the context changed its KV cache): the
        next sequences are prefilled whole."""
        self._check_open()
        self._evals = getattr(self.llm, "n_evals", 0)
        busy = {s.slot for s in self._running}
        for slot in range(self.n_slots):
            if slot not in busy:
                self._kept[slot] = []
                kv.remove(self._ctx, slot)

    def idle(self) -> bool:
        return not self._running and not self._waiting

    def run(self) -> None:
        """Steps until every sequence added so far (and while running) has ended."""
        self._check_open()
        while not self.idle():
            self.step()

    def step(self) -> List[tuple]:
        """Admit waiting sequences into free slots (their prompts prefilled together, each one's first token
        sampled; where the step order goes one ahead, each prompt at its sequence's first turn instead), then
        decode one token of the running sequences the step order picks (all, with "together") in one
        llama_decode. Returns the (sequence, token) pairs of this step. What an ``on_token`` raised is raised
        after the step (its sequence ended, finish_reason "error"); ConfigError where the Llama's own completion
        used the context since the last step (the running sequences' KV cache is gone: they end, "error")."""
        self._check_open()
        out = []
        if getattr(self.llm, "n_evals", 0) != self._evals:
            self._evals = getattr(self.llm, "n_evals", 0)
            lost = list(self._running)
            for s in lost:
                self._end(s, "error")
            self.forget()
            if lost:
                raise ConfigError(f"the Llama decoded on its own (a completion, eval) while this BatchDecoder ran "
                                  f"{len(lost)} sequence(s): their KV cache is gone, they ended (finish_reason "
                                  "\"error\"); use the Llama between runs, not between steps")
        self._admit(out)
        self._end_cancelled()
        if self._running:
            self._decode_step(out)
        if self._raised:
            e, self._raised = self._raised[0], []
            raise e
        return out

    # --- internals ----------------------------------------------------------------------------
    def _free_sampler(self, s: Sequence) -> None:
        if s._sampler is not None and not isinstance(s._sampler, tuple):
            llama_cpp.llama_sampler_free(s._sampler)
        s._sampler = None

    def _count_rows(self) -> None:
        """The hits and misses the engine summed per row since the last read, to the sequences of those
        rows: read when the rows change and when one of them ends, not every step (on the device path a
        read waits for the step's read of the device)."""
        mc = getattr(self.llm, "moecache", None)
        if mc is not None:  # (read with no rows too: the sums of steps no sequence takes start over)
            hits, misses = mc.step_rows(len(self._rows) + 1)
            if self._rows and len(hits) == len(self._rows):  # (other rows: a step of another size started over)
                for i, s in enumerate(self._rows):
                    s.hits += int(hits[i])
                    s.misses += int(misses[i])

    def _end(self, s: Sequence, why: str) -> None:
        if s in self._rows:
            self._count_rows()
        s.finish_reason = why
        s.t_done = time.perf_counter()
        self._free_sampler(s)
        if s in self._running:
            self._running.remove(s)

    def _end_cancelled(self) -> None:
        for s in list(self._running):
            if s._cancel:
                self._end(s, "cancelled")

    def _free_slot(self, prompt: List[int]) -> tuple:
        """The free slot whose kept tokens share the longest prefix with ``prompt``, and that length."""
        busy = {s.slot for s in self._running}
        best, n_best = -1, -1
        for slot in range(self.n_slots):
            if slot in busy:
                continue
            kept = self._kept[slot]
            n = 0
            m = min(len(kept), len(prompt) - 1)  # (the last prompt token is decoded again: its logits)
            while n < m and kept[n] == prompt[n]:
                n += 1
            if n > n_best:
                best, n_best = slot, n
        return best, n_best

    def _fill(self, items: List[tuple]) -> None:
        """The batch = items of (token, pos, seq_id, logits)."""
        b = self._batch
        for i, (tok, pos, sid, want) in enumerate(items):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = sid
            b.logits[i] = want
        b.n_tokens = len(items)

    def _decode(self, n: int) -> None:
        def run():
            rc = llama_cpp.llama_decode(self._ctx, self._batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
        checked = getattr(self.llm, "_decode_checked", None)  # (pymoecache.Llama's checks around the decode)
        checked(run, n) if checked is not None else run()

    def _sample(self, s: Sequence, idx: int, out: list) -> None:
        if s.logits is not None:
            row = llama_cpp.llama_get_logits_ith(self._ctx, idx)
            s.logits.append(np.ctypeslib.as_array(row, shape=(self._n_vocab_n,)).copy())
        if s.forced is not None:  # scored, not sampled
            row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self._ctx, idx), shape=(self._n_vocab_n,))
            tok = s.forced[len(s.tokens)]
            top = float(row.max())
            s.nll.append(float(top + np.log(np.exp(row.astype(np.float64) - top).sum()) - row[tok]))
        else:
            tok = int(llama_cpp.llama_sampler_sample(s._sampler, self._ctx, idx))
        s.tokens.append(tok)  # (in the slot's KV sequence once the next step decodes it)
        if len(s.tokens) == 1:
            s.t_first = time.perf_counter()
        out.append((s, tok))
        if s.on_token is not None:
            try:
                s.on_token(s, tok)
            except Exception as e:  # (its sequence ends; the step goes on for the others, then raises it)
                s.error = e
                self._end(s, "error")
                self._raised.append(e)
                return
        if llama_cpp.llama_vocab_is_eog(self._vocab, tok) and s.forced is None:
            self._end(s, "stop")
        elif len(s.tokens) >= s.max_tokens or len(self._kept[s.slot]) + 1 >= self._n_ctx:
            self._end(s, "length")

    def _admit(self, out: list) -> None:
        """Waiting sequences into free slots, their prompts prefilled together (:meth:`_prefill`), or, where the
        step order goes one ahead, each at its first turn (step_order.StepOrder.defers)."""
        new = []
        pending = 0  # cells the prompts admitted in this step will take (not in _kept before their prefill)
        while len(self._running) < self.n_slots:
            with self._lock:
                if not self._waiting:
                    break
                s = self._waiting.popleft()
            if s._cancel:
                s.finish_reason, s.t_done = "cancelled", time.perf_counter()
                continue
            slot, n_keep = self._free_slot(s.prompt)
            # the context's cells are shared (one KV cache): the running sequences', the new prompts', what
            # the free slots keep for prefixes that come back. Those go first; a prompt that still does
            # not fit waits for the running sequences to end
            need = len(s.prompt) - n_keep + 1
            if self._cells() + pending - len(self._kept[slot]) + n_keep + need > self._n_ctx:
                self.forget()
                slot, n_keep = self._free_slot(s.prompt)
                need = len(s.prompt) + 1
                if self._cells() + pending + need > self._n_ctx and (self._running or new):
                    with self._lock:
                        self._waiting.appendleft(s)
                    break
            pending += need
            s.slot, s.n_prompt_reused = slot, n_keep
            kv.remove(self._ctx, slot, n_keep)
            self._kept[slot] = list(s.prompt[:n_keep])
            s._sampler = _sampler(self._n_vocab_n, *s._sampler)
            self._running.append(s)
            new.append(s)
        if not new:
            return
        if self.order.defers():  # (one at a time: each prompt at its turn, as one after another would)
            for s in new:
                s._unfilled = True
            return
        self._prefill(new, out)

    def _prefill(self, new: list, out: list) -> None:
        """The prompts of ``new`` (admitted) in one ubatch of all their tokens (n_batch at a time), so an expert the
        prompts share is read once; each one's first token sampled."""
        items = []  # (token, pos, slot, logits, sequence)
        for s in new:
            s._unfilled = False
            n_keep = len(self._kept[s.slot])
            todo = s.prompt[n_keep:]
            items += [(t, n_keep + j, s.slot, j == len(todo) - 1, s) for j, t in enumerate(todo)]
        self._count_rows()  # (the running sequences' sums, before prompt steps count theirs)
        self._rows = []
        t0 = time.perf_counter()
        try:
            for i in range(0, len(items), self._n_batch):
                part = items[i:i + self._n_batch]
                self._fill([x[:4] for x in part])
                self._decode(len(part))
                for j, (tok, _, slot, last, s) in enumerate(part):
                    self._kept[slot].append(tok)
                    if last:
                        s.prefill_s = time.perf_counter() - t0
                        self._sample(s, j, out)
        except BaseException:
            for s in new:
                if not s.tokens:  # (those whose prompt was not prefilled whole)
                    self._kept[s.slot] = []
                    kv.remove(self._ctx, s.slot)
                    self._end(s, "error")
            raise

    def _cells(self) -> int:
        """Cells of the KV cache the slots hold, and those the prompts admitted but not prefilled yet will."""
        return (sum(len(k) for k in self._kept)
                + sum(len(s.prompt) - len(self._kept[s.slot]) for s in self._running if s._unfilled))

    def _decode_step(self, out: list) -> None:
        if self._cells() + len(self._running) > self._n_ctx:  # (each running sequence takes one more cell)
            self.forget()
            while self._running and self._cells() + len(self._running) > self._n_ctx:
                longest = max(self._running, key=lambda q: len(self._kept[q.slot]))
                self._end(longest, "length")  # the context is full: the longest sequence ends, as one alone would
                kv.remove(self._ctx, longest.slot)
                self._kept[longest.slot] = []
            if not self._running:
                return
        running = self.order.pick(list(self._running))
        fresh = [s for s in running if s._unfilled]
        if fresh:  # (their turn came: their prompts, which this step's time is not measured with)
            self._prefill(fresh, out)
        t0, n_out = time.perf_counter(), len(out)
        decode = [s for s in running if s not in fresh and s in self._running]
        for i in range(0, len(decode), self._step_max):  # (more sequences than a step's slots: several steps)
            self._decode_part(decode[i:i + self._step_max], out)
        if not fresh:
            self.order.record(len(running), time.perf_counter() - t0, len(out) - n_out)

    def _decode_part(self, run: list, out: list) -> None:
        if run != self._rows:  # (the engine's sums are for the rows of the steps before)
            self._count_rows()
            self._rows = run
        self._fill([(s.tokens[-1], len(self._kept[s.slot]), s.slot, True) for s in run])
        try:
            self._decode(len(run))
        except BaseException:
            for s in run:  # (their KV sequences may hold the step half done)
                kv.remove(self._ctx, s.slot, len(self._kept[s.slot]))
                self._end(s, "error")
            raise
        self.steps += 1
        self.step_tokens += len(run)
        for i, s in enumerate(run):
            self._kept[s.slot].append(s.tokens[-1])
            self._sample(s, i, out)
