"""Step order (pymoecache/step_order.py): which running sequences a batched decode step takes. Together is slower
than one at a time where the cache cannot hold what every sequence selects (top-k + LRU under a third of
Qwen3-30B-A3B's file: 0.86x, stop 84); ``serve -np N`` now measures both and takes the faster. The policy on timings
it is given, then BatchDecoder and serve in a fresh process of the installed package, as a user reaches them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from conftest import http_request, model_path
from test_batch import _all_at_once, run_script
from test_features_as_installed import installed_server
from test_rpc_as_installed import installed_env

from pymoecache.errors import ConfigError
from pymoecache.step_order import REFRESH, TURN, WINDOW, StepOrder


def drive(order: StepOrder, n_steps: int, seconds, running=("a", "b", "c", "d")) -> list:
    """``n_steps`` steps of ``running`` through ``order``, each taking ``seconds(width)``; the widths picked."""
    widths = []
    for _ in range(n_steps):
        picked = order.pick(list(running))
        order.record(len(picked), seconds(len(picked)), len(picked))
        widths.append(len(picked))
    return widths


@pytest.mark.parametrize("alone_s, together_s, faster", [(0.20, 1.00, 1), (0.20, 0.50, 4)])
def test_auto_takes_the_way_that_measured_more_tokens_a_second(alone_s, together_s, faster):
    """Four sequences: one alone takes ``alone_s`` a token, four together ``together_s`` a step. After a window of
    each (together first) auto keeps to the faster, and measures the other again after REFRESH steps, briefly."""
    o = StepOrder("auto")
    widths = drive(o, 3 * REFRESH, lambda w: alone_s if w == 1 else together_s)
    assert widths[:WINDOW + 1] == [4] * (WINDOW + 1) and widths[WINDOW + 1:2 * WINDOW + 2] == [1] * (WINDOW + 1)
    rest = widths[2 * WINDOW + 2:]
    slower = [w for w in rest if w != faster]
    assert slower, "the way not taken is never measured again"
    assert len(slower) <= 3 * (WINDOW + 1), (len(slower), rest)
    assert o.rate[1] == pytest.approx(1 / alone_s) and o.rate[4] == pytest.approx(4 / together_s)


def test_the_way_that_keeps_losing_is_measured_less_and_less_often():
    """Measuring the slower way costs more than its steps (it changes what the cache holds): each time it loses
    again, auto waits twice as long before the next measurement (REFRESH, 2 REFRESH, 4 REFRESH...)."""
    o = StepOrder("auto")
    widths = drive(o, 8 * REFRESH, lambda w: 0.2 if w == 1 else 1.0)
    starts = [i for i in range(2 * WINDOW + 3, len(widths)) if widths[i] >= 2 and widths[i - 1] == 1]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert len(starts) >= 3 and all(b > 1.8 * a for a, b in zip(gaps, gaps[1:])) and gaps[0] > REFRESH, starts


def test_together_measured_again_takes_two_sequences_and_the_full_width_only_where_two_win():
    """Where one at a time won, together is measured again with two sequences (the one whose turn it is and the next;
    half the cache they overrun). Two that lose leave four alone; two that win bring a measurement of all four, and
    each width then takes its own verdict: here two together win, four lose."""
    o = StepOrder("auto")
    seqs = ["a", "b", "c", "d"]
    widths = drive(o, 3 * REFRESH, lambda w: 0.2 if w == 1 else 1.0, seqs)  # together always loses
    again = [w for w in widths[2 * WINDOW + 2:] if w != 1]
    assert again and set(again) == {2}, again
    assert o.pick(seqs) in ([s] for s in seqs)
    o.holder = "d"  # (the pair: the holder and the next in join order, wrapping)
    o.choice, o.window, o.age = "alone", 0, {w: 10 * REFRESH for w in o.age}
    assert len(o.pick(seqs)) == 2 and o.pick(seqs) == ["a", "d"]

    o = StepOrder("auto")
    widths = drive(o, 3 * REFRESH, lambda w: {1: 0.2, 2: 0.3}.get(w, 1.0), seqs)  # two win, four lose
    later = widths[2 * WINDOW + 2:]
    fours = [i for i in range(1, len(later)) if later[i] == 4 and later[i - 1] != 4]
    twos = [i for i in range(1, len(later)) if later[i] == 2 and later[i - 1] != 2]
    assert twos and fours and all(any(0 < f - t <= WINDOW + 2 for t in twos) for f in fours), (twos, fours)
    assert later.count(1) > 0.9 * len(later)
    assert o.pick(seqs[:2]) == seqs[:2]  # (two running: together, as measured)


def test_auto_follows_a_change_of_speed():
    """Together became slower (the cache stopped holding what the four select): auto, measuring the way it takes
    as it goes, turns to one at a time within a few steps."""
    o = StepOrder("auto")
    drive(o, 50, lambda w: 0.2 if w == 1 else 0.4)  # together 10 tok/s, alone 5
    widths = drive(o, REFRESH, lambda w: 0.2 if w == 1 else 2.0)  # together 2 tok/s now
    assert widths[-REFRESH // 2:].count(1) >= REFRESH // 2 - (WINDOW + 1), widths


def test_one_ahead_decodes_each_sequence_in_turns_in_the_order_they_joined():
    o = StepOrder("one-ahead")
    seqs = [object() for _ in range(3)]
    picked = [o.pick(seqs)[0] for _ in range(2 * TURN + 3)]
    assert picked[:TURN] == [seqs[0]] * TURN and picked[TURN:2 * TURN] == [seqs[1]] * TURN
    assert picked[2 * TURN:] == [seqs[2]] * 3
    assert o.pick([seqs[0], seqs[1]]) == [seqs[0]]  # (the holder ended: the turn goes to the first one running)
    assert StepOrder("together").pick(seqs) == seqs and StepOrder("one-ahead").pick(seqs[:1]) == seqs[:1]
    with pytest.raises(ConfigError, match="order must be one of together, one-ahead, auto"):
        StepOrder("fastest")


ONE_AHEAD = """
    import json
    from pymoecache import BatchDecoder, ConfigError, Llama

    llm = Llama({model!r}, cache=0.25, routing="top-k", n_seq_max=3, n_ctx=256, verbose=False)
    prompts = [[1, 5, 9], [1, 200, 33], [1, 7, 7, 100]]
    dec = BatchDecoder(llm)
    alone = []
    for p in prompts:
        s = dec.add(p, max_tokens=40)
        dec.run()
        alone.append(s.tokens)
    dec.close()
    dec = BatchDecoder(llm, order="one-ahead")
    seqs = [dec.add(p, max_tokens=40) for p in prompts]
    order = []  # the sequence each step decoded (a step that prefilled its prompt not counted)
    first = [None] * len(seqs)  # the step() each one's first token came at
    n = 0
    while not dec.idle():
        before = [len(s.tokens) for s in seqs]
        dec.step()
        order += [i for i, s in enumerate(seqs) if 0 < before[i] < len(s.tokens)]
        first = [n if f is None and s.tokens else f for f, s in zip(first, seqs)]
        n += 1
    try:
        BatchDecoder(llm, order="fastest")
        refused = None
    except ConfigError as e:
        refused = str(e)
    print(json.dumps(dict(same=[s.tokens == a for s, a in zip(seqs, alone)], steps=dec.steps,
                          step_tokens=dec.step_tokens, order=order, first=first, refused=refused)))
"""


def test_a_batch_decoder_one_ahead_decodes_one_sequence_a_step_in_turns(fixture_dir, tmp_path):
    """BatchDecoder(order="one-ahead"): each step decodes one sequence, the first for TURN steps, then the next;
    each prompt is prefilled at its turn (its first token then), as one after another; each sequence's tokens are
    those it decodes alone (top-k routing); a misspelt order is refused."""
    d = run_script(tmp_path, ONE_AHEAD.format(model=str(model_path(fixture_dir, "qwen2moe-60x4.Q8_0"))))
    assert d["same"] == [True] * 3
    assert d["first"] == [0, TURN, 2 * TURN], d["first"]
    assert d["steps"] == d["step_tokens"] and d["steps"] > 0
    runs = [[d["order"][0], 0]]  # (sequence, steps in a row)
    for i in d["order"]:
        runs = runs + [[i, 0]] if i != runs[-1][0] else runs
        runs[-1][1] += 1
    assert runs[0][0] == 0 and len(runs) >= 3 and all(n <= TURN for _, n in runs), runs
    assert {i for i, _ in runs} == {0, 1, 2} and max(n for _, n in runs) >= TURN - 1, runs
    assert "order must be one of" in d["refused"]


def test_serve_batch_order_reaches_the_batch_and_says_what_it_measured(fixture_dir, tmp_path):
    """`serve -np 4 --batch-order one-ahead`: four requests at once are decoded one a step (the steps are the
    tokens) with the answers -np 1 gives; /moecache/stats says the order and what it measured; the default, auto,
    decodes them together first; a misspelt order is refused before the model loads."""
    m = tmp_path / "model.gguf"
    shutil.copy(model_path(fixture_dir, "qwen2moe-60x4.Q8_0"), m)

    def all_at_once(base):
        out = _all_at_once(base)
        return [o["choices"][0]["text"] for o in out], json.loads(http_request(base + "/moecache/stats")[1])

    common = ("--routing", "lru", "--cache-size", "0.25")
    with installed_server(tmp_path, m, "-np", "1", *common) as base:
        expect, _ = all_at_once(base)
    with installed_server(tmp_path, m, "-np", "4", "--batch-order", "one-ahead", *common) as base:
        texts, st = all_at_once(base)
    assert texts == expect
    assert st["decode_steps"] == st["decode_tokens"] > 0, st
    assert st["batch_order"]["order"] == "one-ahead" and st["batch_order"]["alone_steps"] > 0
    with installed_server(tmp_path, m, "-np", "4", *common) as base:
        texts, st = all_at_once(base)
    assert texts == expect
    assert st["batch_order"]["order"] == "auto" and st["decode_steps"] < st["decode_tokens"], st
    r = subprocess.run([sys.executable, "-m", "pymoecache", "serve", str(m), "-np", "4", "--batch-order", "fastest"],
                       cwd=tmp_path, env=installed_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--batch-order: invalid choice: 'fastest'" in r.stderr, r.stderr[-2000:]
