"""Batched decoding (issue 55): several sequences decoded together on one Llama (BatchDecoder,
Llama(n_seq_max=N)), serve -np N decoding its slots together, bench --parallel, the batched ppl
protocol. Each through the installed package in a fresh process, as a user runs it."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import textwrap
import threading

import pytest

from conftest import http_json, http_request, model_path


def get_json(url, body=None):
    return json.loads(http_request(url, body)[1])
from test_features_as_installed import installed_server
from test_rpc_as_installed import installed, installed_env

# quantized weights (ggml's CPU matmuls mostly compute each row on its own, vec_dot) and F16/F32 (olmoe-64x8:
# batched matmuls sum in another order)
MODELS = ("qwen2moe-60x4.Q8_0", "mixtral-8x2.Q4_K_M", "deepseek2-sigmoid-64x6.Q8_0", "olmoe-64x8")


def run_script(tmp_path, code: str, timeout: int = 600) -> dict:
    """A Python script in a fresh process of the installed package, outside the tree; its last line is JSON."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, env=installed_env(),
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


ENGINE = """
    import json, sys
    import numpy as np
    from pymoecache import BatchDecoder, CacheConfig, Llama   # (first: it points llama_cpp at our library)
    import llama_cpp
    from llama_cpp._internals import LlamaContext

    M = sys.argv[1] if len(sys.argv) > 1 else {model!r}
    prompts = [[1, 5, 9, 13, 17], [1, 200, 33], [1, 7, 7, 7, 7, 7, 100], [1, 50]]

    def stock():  # llama.cpp without a cache attached, its context with 4 sequences in one KV cache
        llm = llama_cpp.Llama(M, n_ctx=512, verbose=False)
        llm.context_params.n_seq_max, llm.context_params.kv_unified = 4, True
        llm._ctx = LlamaContext(model=llm._model, params=llm.context_params, verbose=False)
        return llm

    def ours():
        return Llama(M, cache=CacheConfig(size={size!r}, residency={residency!r}, prefetch={prefetch!r}), routing="top-k", n_seq_max=4,
                     n_ctx=512, verbose=False)

    def run(make, which):
        llm = make()
        dec = BatchDecoder(llm)
        seqs = [dec.add(prompts[i], max_tokens=12, keep_logits=True) for i in which]
        dec.run()
        out = [(s.tokens, np.array(s.logits)) for s in seqs]
        rs = llm.moe_stats().residency if hasattr(llm, "moe_stats") else None
        counts = (rs.decode_steps, rs.decode_tokens, rs.decode_loads) if rs is not None else None
        dec.close()
        llm.close()
        return out, counts

    batched, counts = run(ours, [0, 1, 2, 3])
    alone = [run(ours, [i])[0][0] for i in range(4)]
    ref, _ = run(stock, [0, 1, 2, 3])
    ref_alone = [run(stock, [i])[0][0] for i in range(4)]
    print(json.dumps(dict(
        same_tokens_as_alone=[a[0] == b[0] for a, b in zip(alone, batched)],
        logits_as_alone=[bool(np.array_equal(a[1], b[1])) for a, b in zip(alone, batched)],
        stock_logits_as_alone=[bool(np.array_equal(a[1], b[1])) for a, b in zip(ref_alone, ref)],
        logits_as_stock_batch=[bool(np.array_equal(a[1], b[1])) for a, b in zip(ref, batched)],
        alone_as_stock_alone=[bool(np.array_equal(a[1], b[1])) for a, b in zip(ref_alone, alone)],
        n_tokens=[len(b[0]) for b in batched], counts=counts)))
"""


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("residency,size,prefetch", [("stream", 0.25, "auto"), ("stream", 0.25, "off"),
                                                     ("mmap", 0.5, "auto")])
def test_a_batch_computes_each_sequence_as_stock_llama_cpp_and_as_alone(fixture_dir, tmp_path, name, residency, size,
                                                                        prefetch):
    """Under top-k routing, 4 sequences decoded together: every logit equals stock llama.cpp's for the same
    batch (no cache attached), bit for bit, and each sequence alone stock's alone; the greedy tokens are each
    sequence's alone, and its logits are too exactly where stock's are (ggml computing each row on its own:
    quantized weights here, on most builds; F16 weights, or another build's kernels, sum a batch's rows in
    another order). One step of 4 counts 4 tokens. Without spare slots (prefetch off) a layer's own slots can
    be full of the step's selections, so experts the cache keeps are read into the step slots, whose pages all
    layers share, and move to the layer's own slots when the next layer takes those pages."""
    d = run_script(tmp_path, ENGINE.format(model=str(model_path(fixture_dir, name)), size=size, residency=residency,
                                           prefetch=prefetch))
    assert d["logits_as_stock_batch"] == [True] * 4
    assert d["alone_as_stock_alone"] == [True] * 4
    assert d["same_tokens_as_alone"] == [True] * 4
    assert d["logits_as_alone"] == d["stock_logits_as_alone"]
    steps, tokens, _ = d["counts"]
    # (each sequence's first token comes from its prompt; the other 11 from 11 steps of 4)
    assert d["n_tokens"] == [12] * 4 and (steps, tokens) == (11, 44)


UNION = """
    import json
    from pymoecache import BatchDecoder, CacheConfig, Llama

    def loads(n):
        llm = Llama({model!r}, cache=CacheConfig(size=8, residency="stream", prefetch="off"), routing="top-k",
                    n_seq_max=4, n_ctx=512, verbose=False)
        dec = BatchDecoder(llm)
        seqs = [dec.add([1, 5, 9, 13, 17], max_tokens=16) for _ in range(n)]
        dec.run()
        rs = llm.moe_stats().residency
        out = (rs.decode_loads, rs.decode_tokens, rs.decode_steps, [s.tokens for s in seqs],
               [(s.hits, s.misses) for s in seqs], (rs.decode_selections, rs.decode_union))
        dec.close(); llm.close()
        return out

    one, four = loads(1), loads(4)
    print(json.dumps(dict(one=one, four=four)))
"""


def test_a_step_reads_the_union_of_its_misses_once(fixture_dir, tmp_path):
    """Four copies of one sequence decoded together select the same experts at every step: the step reads
    each of its misses once, as many reads as the one sequence alone, for four times the tokens; each
    sequence's hits and misses are counted apart. The union of a step's selections is a quarter of them
    (decode_union), and all of them alone."""
    d = run_script(tmp_path, UNION.format(model=str(model_path(fixture_dir, "qwen2moe-60x4.Q8_0"))))
    (l1, t1, s1, tok1, hm1, u1), (l4, t4, s4, tok4, hm4, u4) = d["one"], d["four"]
    # (4 experts per token, 4 MoE layers, 15 decode steps)
    assert u1 == [t1 * 4 * 4, t1 * 4 * 4] and t1 == 15
    assert u4 == [4 * u1[0], u1[0]]
    assert tok4 == tok1 * 4
    assert l1 > 0 and l4 == l1
    assert (t4, s4) == (4 * t1, s1)
    # by sequence: the first of each step misses what the one alone misses, the three after it hit all of it
    # (4 experts, 4 layers, 15 steps)
    assert hm4[0] == hm1[0] and hm1[0][1] > 0
    assert all(h == [sum(hm1[0]), 0] for h in hm4[1:])
    assert sum(hm1[0]) == 4 * 4 * 15


CONTINUOUS = """
    import json
    from pymoecache import BatchDecoder, Llama

    llm = Llama({model!r}, cache=0.25, routing="top-k", n_seq_max=2, n_ctx={n_ctx}, verbose=False)
    prompts = [[1, 5, 9], [1, 200, 33], [1, 7, 7, 100], [1, 50, 51]]
    alone = []
    dec = BatchDecoder(llm)
    for p in prompts:
        s = dec.add(p, max_tokens=10)
        dec.run()
        alone.append(s.tokens)
    dec.forget()
    dec.close()
    dec = BatchDecoder(llm, order={order!r})
    seqs = [dec.add(p, max_tokens=10) for p in prompts]   # 4 sequences, 2 slots: 2 wait
    firsts, running = [], []
    while not dec.idle():
        dec.step()
        running.append(len(dec.running))
    again = dec.add(prompts[3] + alone[3][:5], max_tokens=5)  # a conversation that comes back (still in its slot)
    dec.run()
    cancelled = dec.add(prompts[1], max_tokens=50)
    dec.step(); cancelled.cancel(); dec.run()
    long = [dec.add([1] + [9] * 20, max_tokens=400) for _ in range(2)]  # more than the context holds
    dec.run()
    print(json.dumps(dict(same=[s.tokens == a for s, a in zip(seqs, alone)], max_running=max(running),
                          reasons=[s.finish_reason for s in seqs], reused=again.n_prompt_reused,
                          again=again.tokens == alone[3][5:10], cancelled=cancelled.finish_reason,
                          n_cancelled=len(cancelled.tokens), long=[s.finish_reason for s in long],
                          long_n=[len(s.tokens) for s in long], slots=dec.n_slots)))
"""


@pytest.mark.parametrize("order", ["together", "one-ahead"])
def test_sequences_join_and_leave_the_batch(fixture_dir, tmp_path, order):
    """Continuous batching: 4 sequences on 2 slots run 2 at a time, each with its tokens alone; a
    conversation that comes back is not prefilled again (its slot kept it); a cancelled sequence ends at
    the next step; sequences longer than the context together end ("length"), not fail. One ahead too, where a
    prompt admitted is prefilled at its turn (its cells counted from its admission)."""
    d = run_script(tmp_path, CONTINUOUS.format(model=str(model_path(fixture_dir, "qwen2moe-60x4.Q8_0")), n_ctx=128,
                                               order=order))
    assert d["slots"] == 2 and d["max_running"] == 2
    assert d["same"] == [True] * 4 and d["reasons"] == ["length"] * 4
    assert d["reused"] == 3 + 5 - 1 and d["again"]  # (all but its last token: decoded again for its logits)
    assert d["cancelled"] == "cancelled" and d["n_cancelled"] < 50
    assert d["long"] == ["length", "length"] and all(n < 400 for n in d["long_n"])


def test_n_seq_max_is_checked(fixture_dir, tmp_path):
    d = run_script(tmp_path, f"""
        import json
        from pymoecache import Llama, ConfigError
        out = []
        for n in (0, 257, "4"):
            try:
                Llama({str(model_path(fixture_dir, "qwen2moe-60x4.Q8_0"))!r}, n_seq_max=n, verbose=False)
                out.append(None)
            except ConfigError as e:
                out.append(str(e))
        print(json.dumps(out))
    """)
    assert all(m is not None and "n_seq_max" in m for m in d), d


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the layers share their step slots' pages on Linux")
def test_a_batchs_step_slots_take_one_layers_memory_beside_a_cache_sized_from_memory(fixture_dir, tmp_path):
    """n_seq_max=4 gives each MoE layer 3 x K step slots for the selections the cache does not keep. Beside a cache
    sized from memory they are needed one layer at a time, so every layer maps the same pages there: the slot
    arena grows by one layer's step slots (and a few pages each layer keeps at their edges), not by every layer's,
    and the plan counts what the library allocated. Beside a cache of a stated count each layer keeps its own (they
    hold a step's selections to its next step), and the arena grows by every layer's. (The batch that reads and
    computes on them: the tests above, bit for bit.)"""
    M = str(model_path(fixture_dir, "olmoe-64x8"))
    d = run_script(tmp_path, f"""
        import json
        from pymoecache import CacheConfig, Llama
        from pymoecache.model_info import model_info
        out = dict(slot=model_info({M!r}).slot_bytes)
        for name, n, size in (("one", 1, "1.5MiB"), ("four", 4, "1.5MiB"), ("stated", 4, 16), ("stated_one", 1, 16)):
            llm = Llama({M!r}, cache=CacheConfig(size=size, residency="stream", prefetch="off"), routing="top-k",
                        n_seq_max=n, n_ctx=512, verbose=False)
            st, plan = llm.moe_stats(), llm.memory_plan()
            out[name] = dict(arena=st.residency.arena_bytes, layers=len(st.capacity_per_layer), k=st.n_expert_used,
                             cached=int(st.capacity_per_layer[0]), plan=plan.cache_bytes, line=plan.summary())
            llm.close()
        print(json.dumps(out))
    """)
    one, four, slot = d["one"], d["four"], d["slot"]
    step = 3 * four["k"] * slot  # one layer's step slots: 24 experts of olmoe's 64
    edges = four["layers"] * 3 * 2 * 4096  # (per tensor, the pages a layer shares with its own slots)
    assert four["layers"] == 4 and step >= 16 * 4096 and one["cached"] == four["cached"] == 16
    assert step - 3 * 2 * 4096 <= four["arena"] - one["arena"] <= step + edges, d
    assert "for a batch (one layer's: the layers share them)" in four["line"], four["line"]
    assert abs(four["plan"] - four["arena"]) <= edges + four["layers"] * 3 * 4096, d
    stated = d["stated"]["arena"] - d["stated_one"]["arena"]
    assert stated >= four["layers"] * step and "for a batch" in d["stated"]["line"], d
    assert "share" not in d["stated"]["line"] and abs(d["stated"]["plan"] - d["stated"]["arena"]) <= edges, d


def test_batched_perplexity_protocol(fixture_dir, tmp_path):
    """The ppl protocol with 4 chunks decoded together (perplexity_batched): under top-k the same
    perplexity as the chunks decoded alone, one token a step each; the default routing close to it."""
    d = run_script(tmp_path, f"""
        import json
        import numpy as np
        from pymoecache import CacheConfig, Llama
        from pymoecache.evaluate import perplexity, perplexity_batched
        rng = np.random.default_rng(0)
        toks = rng.integers(3, 200, size=8 * 32).tolist()
        out = {{}}
        for routing in ("top-k", None):
            llm = Llama({str(model_path(fixture_dir, "qwen2moe-60x4.Q8_0"))!r}, cache=CacheConfig(size=0.25),
                        n_seq_max=4, n_ctx=128, logits_all=True, verbose=False, **({{"routing": routing}} if routing else {{}}))
            llm.moecache.clear()
            a = perplexity(llm, toks, 32, decode=True, progress=False)
            llm.moecache.clear()
            b = perplexity_batched(llm, toks, 32, 4, progress=False)
            rs = b.stats.residency
            out[routing or "default"] = (a.ppl, b.ppl, b.n_tokens, rs.decode_steps, rs.decode_tokens)
            llm.close()
        print(json.dumps(out))
    """)
    a, b, n, steps, tokens = d["top-k"]
    assert n == 8 * 31 and tokens == n and steps == 2 * 31
    # (a random model on random tokens: NLL ~ 33 nats; the attention over one KV cache that interleaves the
    # chunks sums in another order, so the NLLs agree to ~1e-4 of themselves, not bit for bit)
    nll_a, nll_b = math.log(a), math.log(b)
    assert abs(nll_b - nll_a) < 1e-3 * nll_a, (a, b)
    a, b, *_ = d["default"]
    assert abs(math.log(b) - math.log(a)) < 0.02 * math.log(a), (a, b)


def _completion(base, prompt, out, i, **kw):
    out[i] = get_json(base + "/v1/completions", {"prompt": prompt, "max_tokens": 24, "temperature": 0, **kw})


PROMPTS = ["Once upon a time", "The history of the city", "Q: what is an expert?\nA:", "def fibonacci(n):"]


def _all_at_once(base) -> list:
    """PROMPTS' completions, the four requests sent at once."""
    out = [None] * len(PROMPTS)
    threads = [threading.Thread(target=_completion, args=(base, p, out, i)) for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_serve_np_decodes_its_slots_together(fixture_dir, tmp_path):
    """serve -np 4 with 4 requests at once: one decode step carries all of them (the steps are fewer than
    the tokens), each answer is the one -np 1 gives it alone under top-k routing, /slots shows them, and
    a request the batch does not take (logprobs) is still answered, between batches."""
    m = tmp_path / "model.gguf"
    shutil.copy(model_path(fixture_dir, "qwen2moe-60x4.Q8_0"), m)
    answers = {}
    for n in (1, 4):
        with installed_server(tmp_path, m, "-np", str(n), "--routing", "lru", "--cache-size", "0.25") as base:
            out = _all_at_once(base)
            answers[n] = [o["choices"][0]["text"] for o in out]
            stats = get_json(base + "/moecache/stats")
            if n == 4:
                assert all(o["moecache"]["batched"] for o in out)
                assert all(o["moecache"]["sequence"]["hits"] + o["moecache"]["sequence"]["misses"] > 0 for o in out)
                assert all(o["usage"]["completion_tokens"] > 0 for o in out)
                slots = get_json(base + "/slots")
                assert [s["id"] for s in slots] == [0, 1, 2, 3]
                res = stats  # (the residency counters are among its top-level fields)
                assert res["decode_steps"] < res["decode_tokens"], res
                lp = get_json(base + "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0,
                                                         "logprobs": 2})
                assert lp["choices"][0]["text"] == answers[4][0] and lp["choices"][0]["logprobs"] is not None
                assert "batched" not in lp.get("moecache", {})
    assert answers[4] == answers[1]


def test_serve_np_with_a_vram_tier_over_rpc_decodes_its_slots_together_through_the_tier(fixture_dir, tmp_path):
    """serve -np 4 -ngl 99 with a VRAM tier on an RPC server (issue 78, item 3): the 4 requests decode in steps
    fewer than their tokens, each answer the one -np 1 gives it alone under top-k, and every selection of
    every decoded step is counted by the tier (on the device, copied up or on the CPU beside it): a batch step
    runs through the tier's slots, not through the model's mapping (where it used to bypass the tier)."""
    from pymoecache import rpc

    m = tmp_path / "model.gguf"
    shutil.copy(model_path(fixture_dir, "qwen2moe-60x4.Q8_0"), m)
    answers = {}
    with rpc.LocalServer(threads=1, register=False) as server:
        for n in (1, 4):
            args = ("-np", str(n), "--routing", "lru", "--cache-size", "0.25", "-ngl", "99", "--rpc", server.endpoint,
                    "--vram-size", "8")
            with installed_server(tmp_path, m, *args) as base:
                out = _all_at_once(base)
                answers[n] = [o["choices"][0]["text"] for o in out]
                stats = get_json(base + "/moecache/stats")
                assert stats["vram_slots"] == 8, stats
                on_tier = stats["vram_hits"] + stats["vram_from_ram"] + stats["vram_from_file"]
                assert on_tier == stats["decode_selections"] > 0, stats
                if n == 4:
                    assert all(o["moecache"]["batched"] for o in out)
                    assert stats["decode_steps"] < stats["decode_tokens"], stats
                    assert stats["vram_hits"] > 0, stats
    assert answers[4] == answers[1]


def test_openai_client_sends_four_at_once(fixture_dir, tmp_path):
    """The official openai client, from outside the tree, 4 requests at once to serve -np 4 (2 chats, a
    streamed chat and a completion with a stop string): every one answered, the stop string cut off (top-k
    routing: the same text with and without the stop, whatever ran beside it)."""
    m = tmp_path / "model.gguf"
    shutil.copy(model_path(fixture_dir, "qwen2moe-60x4.Q8_0"), m)
    with installed_server(tmp_path, m, "-np", "4", "--cache-size", "0.25", "--routing", "lru") as base:
        d = run_script(tmp_path, f"""
            import json, threading
            from openai import OpenAI
            client = OpenAI(base_url={base + "/v1"!r}, api_key="none")
            out = {{}}
            def chat(i):
                r = client.chat.completions.create(model="m", messages=[{{"role": "user", "content": f"hi {{i}}"}}],
                                                   max_tokens=16, temperature=0)
                out[i] = (r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens)
            def stream():
                pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
                    model="m", messages=[{{"role": "user", "content": "a story"}}], max_tokens=16, temperature=0,
                    stream=True) if c.choices]
                out["stream"] = "".join(pieces)
            def stopped():
                full = client.completions.create(model="m", prompt="Once upon a time", max_tokens=24, temperature=0)
                text = full.choices[0].text
                stop = text[8:10]
                cut = client.completions.create(model="m", prompt="Once upon a time", max_tokens=24, temperature=0,
                                                stop=[stop])
                out["stop"] = (text, stop, cut.choices[0].text, cut.choices[0].finish_reason)
            ts = [threading.Thread(target=chat, args=(i,)) for i in range(2)]
            ts += [threading.Thread(target=stream), threading.Thread(target=stopped)]
            [t.start() for t in ts]; [t.join() for t in ts]
            print(json.dumps(out))
        """, timeout=300)
    for i in ("0", "1"):
        text, reason, n = d[i]
        assert isinstance(text, str) and reason in ("stop", "length") and n > 0
    assert d["stream"]
    text, stop, cut, reason = d["stop"]
    assert cut == text[:text.index(stop)] and reason == "stop"


def test_bench_parallel(fixture_dir, tmp_path):
    """bench --parallel 4 from the installed CLI: a row per way, the together row's ratio, the CSV."""
    m = tmp_path / "model.gguf"
    shutil.copy(model_path(fixture_dir, "qwen2moe-60x4.Q8_0"), m)
    r = installed(tmp_path, "bench", m, "--parallel", "4", "--routing", "lru", "-n", "8", "--cache-size", "0.25",
                  "--temp", "0", "--csv", tmp_path / "p.csv")
    assert r.returncode == 0, r.stderr
    assert "one after another" in r.stdout and "together" in r.stdout
    rows = (tmp_path / "p.csv").read_text().splitlines()
    assert len(rows) == 3 and "x_one_after_another" in rows[0]
    together = dict(zip(rows[0].split(","), rows[2].split(",")))
    assert together["way"] == "together" and int(together["decode_steps"]) == 7  # (8 tokens: 1 from the prompt)
    r = installed(tmp_path, "bench", m, "--parallel", "0")
    assert r.returncode != 0 and "--parallel" in r.stderr


def test_serve_np_slot_files_are_per_sequence(fixture_dir, tmp_path):
    """-np 2 --slot-save-path: a slot's conversation saved, erased, restored into the other slot; the next
    request that continues it reads no prefill for its history (routed tokens fewer than its prompt) and
    answers as a server that was never interrupted; a -np 1 session file is refused with the reason."""
    m = tmp_path / "model.gguf"
    shutil.copy(model_path(fixture_dir, "qwen2moe-60x4.Q8_0"), m)
    slots = tmp_path / "slots"

    def post(base, path, body):
        return http_json(base + path, body)

    greedy = {"max_tokens": 8, "temperature": 0}
    first = {"prompt": "Once upon a time", **greedy}
    args = ("-np", "2", "--routing", "lru", "--cache-size", "0.25", "--slot-save-path", slots)
    with installed_server(tmp_path, m, *args) as base:
        _, a = post(base, "/v1/completions", first)
        follow = {"prompt": "Once upon a time" + a["choices"][0]["text"] + " and then", **greedy}
        _, uninterrupted = post(base, "/v1/completions", follow)
    with installed_server(tmp_path, m, *args) as base:
        _, a2 = post(base, "/v1/completions", first)
        assert a2["choices"][0]["text"] == a["choices"][0]["text"]
        status, saved = post(base, "/slots/0?action=save", {"filename": "conversation.bin"})
        assert status == 200 and saved["n_saved"] > 0, saved
        status, erased = post(base, "/slots/0?action=erase", {})
        assert status == 200 and erased["n_erased"] == saved["n_saved"]
        status, restored = post(base, "/slots/1?action=restore", {"filename": "conversation.bin"})
        assert status == 200 and restored["n_restored"] == saved["n_saved"], restored
        slots_now = get_json(base + "/slots")
        assert [s["state"] for s in slots_now] == ["idle", "idle"]
        _, cont = post(base, "/v1/completions", follow)
        assert cont["choices"][0]["text"] == uninterrupted["choices"][0]["text"]
        assert cont["moecache"]["tokens"] < cont["usage"]["prompt_tokens"], (cont["moecache"], cont["usage"])
    with installed_server(tmp_path, m, "--routing", "lru", "--slot-save-path", slots) as base:  # -np 1
        post(base, "/v1/completions", first)
        status, _ = post(base, "/slots/0?action=save", {"filename": "session.bin"})
        assert status == 200
    with installed_server(tmp_path, m, *args) as base:
        status, r = post(base, "/slots/0?action=restore", {"filename": "session.bin"})
        assert status == 400 and "-np 1" in r["error"]["message"], r
        (slots / "junk.bin").write_bytes((slots / "conversation.bin").read_bytes()[:12] + b"\xff" * 64)
        status, r = post(base, "/slots/0?action=restore", {"filename": "junk.bin"})
        assert status == 400 and "truncated or damaged" in r["error"]["message"], r
        _, again = post(base, "/v1/completions", first)  # the server goes on
        assert again["choices"][0]["text"] == a["choices"][0]["text"]


def test_batch_decoder_refuses_what_it_cannot_do_and_outlives_a_raising_callback(fixture_dir, tmp_path):
    """Issue 74 items 7, 8, 11: a BatchDecoder used after close() (its own or the Llama's) segfaulted; NaN or
    infinite temperature, NaN min_p, top_k=2**40 and malformed penalties were taken; an on_token that raised once
    raised again on every later run(); a completion on the Llama between steps gave a bare RuntimeError;
    set_kept(99) an IndexError; n_seq_max above n_batch aborted at load. Each is now an error of the package
    that says why, and the decoder goes on where it can."""
    out = run_script(tmp_path, f"""
        import json
        from pymoecache import BatchDecoder, Llama
        from pymoecache.errors import ClosedError, ConfigError
        M = {str(model_path(fixture_dir, "qwen2moe-60x4")) !r}
        said = {{}}

        def refused(name, call, kind=ConfigError):
            try:
                call()
                said[name] = "accepted"
            except kind as e:
                said[name] = "refused: " + str(e)

        refused("n_batch", lambda: Llama(M, n_seq_max=4, n_batch=2, verbose=False))
        llm = Llama(M, n_seq_max=2, n_ctx=256, verbose=False)
        dec = BatchDecoder(llm)
        p = [1, 5, 9, 13]
        for name, kw in (("temp_nan", dict(temperature=float("nan"))), ("temp_inf", dict(temperature=float("inf"))),
                         ("min_p_nan", dict(min_p=float("nan"))), ("top_k", dict(top_k=2**40)),
                         ("penalties", dict(penalties=(1.0, "x", 0.0))), ("penalties_len", dict(penalties=(1.0,))),
                         ("max_tokens", dict(max_tokens=2.5))):
            refused(name, lambda: dec.add(p, **kw))
        refused("set_kept", lambda: dec.set_kept(99, []))
        refused("kept", lambda: dec.kept(-1))

        def boom(seq, tok):
            raise ValueError("from on_token")
        a = dec.add(p, max_tokens=4, on_token=boom)
        b = dec.add([1, 200, 33], max_tokens=4)
        refused("on_token", dec.run, ValueError)
        dec.run()  # (raised once; the other sequence goes on)
        said["on_token_seq"] = [a.finish_reason, type(a.error).__name__, b.finish_reason, len(b.tokens)]
        c = dec.add(p, max_tokens=8)
        dec.step()
        llm.create_completion("Hi", max_tokens=2)
        refused("between_steps", dec.step)
        said["between_steps_seq"] = c.finish_reason
        d = dec.add(p, max_tokens=3)
        dec.run()
        said["after"] = [d.finish_reason, len(d.tokens)]
        dec.close()
        refused("closed_add", lambda: dec.add(p), ClosedError)
        refused("closed_run", dec.run, ClosedError)
        dec2 = BatchDecoder(llm)
        dec2.add(p, max_tokens=2)
        llm.close()
        refused("llama_closed_step", dec2.step, ClosedError)
        refused("llama_closed_add", lambda: dec2.add(p), ClosedError)
        print(json.dumps(said))
    """)
    for name in ("n_batch", "temp_nan", "temp_inf", "min_p_nan", "top_k", "penalties", "penalties_len", "max_tokens",
                 "set_kept", "kept", "on_token", "between_steps", "closed_add", "closed_run", "llama_closed_step",
                 "llama_closed_add"):
        assert out[name].startswith("refused"), (name, out[name])
    assert "n_seq_max" in out["n_batch"] and "from on_token" in out["on_token"], out
    assert out["on_token_seq"][:3] == ["error", "ValueError", "length"] and out["on_token_seq"][3] == 4, out
    assert out["between_steps_seq"] == "error" and out["after"] == ["length", 3], out
