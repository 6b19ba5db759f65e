"""This stop's user-facing features as a user reaches them: the installed package, a fresh process
started outside the source tree, the flag alone (pymoecache lowbit, --miss lowbit, --miss auto, --lowbit-in-ram,
--lowbit-max-p, info's companion rows, ppl --miss, the reads ahead's flags, --chat-template,
llama-server's /completion and /tokenize, logprobs)."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import sys
import time

from conftest import free_port, http_json, http_request, model_path
from test_rpc_as_installed import installed, installed_env

MODEL = "qwen2moe-60x4"


@contextlib.contextmanager
def installed_server(tmp_path, model, *args):
    """`python -m pymoecache serve MODEL ARGS` of the installed package, from outside the tree, on a free
    port: yields its base URL once /health answers; stopped after."""
    port = free_port()
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "pymoecache", "serve", str(model), "--port", str(port), *args],
                            cwd=tmp_path, env=installed_env(), stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-2000:]
            try:
                http_request(base + "/health", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not answer"
                time.sleep(0.25)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=15)
        log.close()


def test_lowbit_companion_and_miss_path(fixture_dir, tmp_path):
    m = tmp_path / "model.gguf"
    shutil.copy(model_path(fixture_dir, MODEL, ".Q8_0"), m)
    # (no companion yet, a cache size given: no tip, which is for a cache the memory left short: test_real_size.py)
    r = installed(tmp_path, "run", m, "--cache-size", "8", "-n", "4", "-p", "Once upon a time")
    assert r.returncode == 0 and "tip:" not in r.stderr, r.stderr
    r = installed(tmp_path, "lowbit", m)
    # (named by what llama.cpp made: the fixture's 64-wide rows take Q4_K's fallback, Q5_0)
    assert r.returncode == 0 and (tmp_path / "model.lowbit-Q5_0.gguf").is_file(), r.stderr
    r = installed(tmp_path, "run", m, "--cache-size", "8", "--miss", "lowbit", "-n", "8", "-p", "Once upon a time")
    assert r.returncode == 0 and "experts/tok from the companion" in r.stderr, r.stderr
    r = installed(tmp_path, "run", m, "--cache-size", "8", "--miss", "lowbit", "--lowbit-in-ram", "-n", "4")
    assert r.returncode == 0 and "no read (its copies are in memory)" in r.stderr, r.stderr
    r = installed(tmp_path, "run", m, "--cache-size", "8", "--miss", "lowbit", "--lowbit-max-p", "0.3", "-n", "4")
    assert r.returncode == 0 and "experts/tok from the companion" in r.stderr, r.stderr
    r = installed(tmp_path, "run", m, "--cache-size", "8", "--miss", "auto", "-n", "4", "-p", "Once upon a time")
    # (auto: the companion beside the model as the cache's source; the fixture's rows take Q4_K's fallback
    # Q5_0: 8 Q8_0 experts' bytes hold 12)
    assert r.returncode == 0 and "12 of 60 per layer low-bit" in r.stderr and "(lowbit-cache)" in r.stderr, r.stderr
    r = installed(tmp_path, "run", m, "--cache-size", "8", "-n", "4", "-p", "Once upon a time")  # no flag: the default
    assert r.returncode == 0 and "12 of 60 per layer low-bit" in r.stderr and "(lowbit-cache)" in r.stderr, r.stderr
    assert "tip:" not in r.stderr, r.stderr
    r = installed(tmp_path, "info", m)
    assert r.returncode == 0 and "low-bit companion" in r.stdout and "--lowbit-in-ram" in r.stdout, r.stderr
    text = tmp_path / "text.txt"
    text.write_text("Once upon a time there was a little cat. It liked to play in the sun. " * 20)
    r = installed(tmp_path, "ppl", m, "-f", text, "--ctx", "32", "--chunks", "2", "--cache-size", "8",
                  "--routing", "lru", "--miss", "full", "lowbit", "lowbit-cache", "--no-progress")
    assert r.returncode == 0 and "critical MiB/tok" in r.stdout and "lowbit-cache" in r.stdout, r.stderr


def test_reads_ahead_flags(fixture_dir, tmp_path):
    """The reads ahead as a user gets them with no flag (prefetch auto: 2 spare slots, a budget of 0,
    counted by the prior), then --prefetch-budget, --no-prefetch-route and --prefetch-adaptive, each
    alone: without the prior counting the reads (--no-prefetch-route, or the timed trial) the hits are
    those without reads ahead; no budget reads more ahead than the default's."""
    m = model_path(fixture_dir, MODEL)
    base = ["run", m, "--cache-size", "15", "--residency", "stream", "--routing", "prior:0.5", "--miss", "full",
            "-n", "24", "-p", "Once upon a time"]

    def stats(*flags):
        r = installed(tmp_path, *base, *flags)
        assert r.returncode == 0, r.stderr
        hit = re.search(r"hit rate ([0-9.]+)%", r.stderr)
        issued = re.search(r"(\d+) issued", r.stderr)
        on = re.search(r"on for (\d+)/(\d+) tokens", r.stderr)
        return hit.group(1), int(issued.group(1)) if issued else 0, on and int(on.group(1)) < int(on.group(2))

    off = stats("--prefetch", "off")
    default = stats()
    every = stats("--prefetch-budget", "-1")
    blind = stats("--no-prefetch-route")
    trial = stats("--prefetch-adaptive")
    assert off[1] == 0 and 0 < default[1] < every[1]
    assert every[0] != off[0]  # (the prior picks experts in flight: other hits)
    assert blind[0] == off[0] and blind[1] > 0
    assert trial[0] == off[0] and trial[2] and not default[2]  # (the trial had them on for part of the tokens)
    r = installed(tmp_path, *base, "--prefetch-budget", "65")
    assert r.returncode != 0 and "prefetch_budget" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_chat_template_flag(fixture_dir, tmp_path):
    r = installed(tmp_path, "chat", model_path(fixture_dir, MODEL), "--chat-template", "llama3", "--verbose-prompt",
                  "-st", "-n", "1", input="Hello\n")
    assert r.returncode == 0, r.stderr
    assert "<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>" in r.stderr


def test_serve_native_endpoints_and_logprobs(fixture_dir, tmp_path):
    with installed_server(tmp_path, model_path(fixture_dir, MODEL)) as base:
        _, text = http_request(base + "/completion", {"prompt": "Once upon a time", "n_predict": 4})
        r = json.loads(text)
        assert r["stop"] is True and r["tokens_predicted"] >= 1 and "timings" in r
        _, text = http_request(base + "/tokenize", {"content": "Hello"})
        assert json.loads(text)["tokens"]
        _, text = http_request(base + "/v1/completions", {"prompt": "Once", "max_tokens": 2, "logprobs": 2})
        assert len(json.loads(text)["choices"][0]["logprobs"]["tokens"]) >= 1


def test_llama_cpp_names_and_escapes(fixture_dir, tmp_path):
    """Issue 56 item 1, as a llama-cli user types them: --predict, the penalties over --repeat-last-n,
    escapes in -p (on by default, as llama-cli; --no-escape takes it as typed), and the names that mean
    nothing here refused with the reason (serve's --slots and --metrics are accepted, both always on: the
    port is what that line is refused for)."""
    m = model_path(fixture_dir, MODEL)

    def text(*args):
        r = installed(tmp_path, "run", m, "-p", "ROMEO:", "--predict", "48", "--temp", "0", "--stats-stderr", *args)
        assert r.returncode == 0, r.stderr
        return r.stdout

    plain = text()
    assert len(plain) > len("ROMEO:") + 20
    penalized = text("--presence-penalty", "2", "--frequency-penalty", "1")
    assert penalized != plain  # the penalties reach the sampler
    assert text("--presence-penalty", "2", "--frequency-penalty", "1", "--repeat-last-n", "0") == plain  # over no token
    r = installed(tmp_path, "run", m, "-p", r"A:\nB:\x41\q", "-n", "0", "--stats-stderr")
    assert r.returncode == 0 and r.stdout.startswith("A:\nB:A\\q"), (r.stdout, r.stderr)
    r = installed(tmp_path, "run", m, "-p", r"A:\nB:", "--no-escape", "-n", "0", "--stats-stderr")
    assert r.returncode == 0 and r.stdout.startswith("A:\\nB:"), (r.stdout, r.stderr)
    for args, says in ((("run", m, "--keep", "4"), "never shifts the context"),
                       (("run", m, "--repeat-last-n", "-2"), "--repeat-last-n must be >= 0"),
                       (("run", m, "--mirostat", "2"), "llama.cpp's --mirostat is not available here"),
                       (("run", m, "--max_tokens", "5"), "did you mean -n?"),
                       (("run", m, "-u", "7"), "unrecognized arguments: -u"),
                       (("serve", m, "-n", "64"), "each request says how many tokens"),
                       (("serve", m, "--embeddings"), "computes no embeddings"),
                       (("serve", m, "--slots", "--metrics", "--port", "99999"), "--port must be in [0, 65535]")):
        r = installed(tmp_path, *args)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)


def test_the_cost_of_cache_conditional_routing_per_reply(fixture_dir, tmp_path):
    """Issue 56 item 4: the selections the routing took from outside the router's own top K and the
    router probability given up, in run's stats line, each answer's "moecache" object and /metrics; a
    request's own "moecache": {"routing": "lru"} answers as the model's top-k would (nothing rerouted),
    and the server's routing is back for the next request."""
    m = model_path(fixture_dir, MODEL)
    r = installed(tmp_path, "run", m, "-p", "ROMEO:", "-n", "32", "--prior", "0.5", "--cache-size", "0.25")
    assert r.returncode == 0 and re.search(r"\| rerouted \d+\.\d\d/token \(router probability given up "
                                           r"\d+\.\d\d% per layer\) \|", r.stderr), r.stderr[-600:]
    r = installed(tmp_path, "run", m, "-p", "ROMEO:", "-n", "32", "--routing", "lru", "--cache-size", "0.25")
    assert r.returncode == 0 and "rerouted" not in r.stderr, r.stderr[-600:]

    with installed_server(tmp_path, m, "--prior", "0.5", "--cache-size", "0.25") as base:

        def complete(**extra):
            status, text = http_request(base + "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 24,
                                                                   "temperature": 0, **extra})
            assert status == 200, text
            return json.loads(text)["moecache"]

        served = complete()
        assert served["rerouted"] > 0 and served["p_given_up"] > 0 and served["rerouted_per_token"] > 0, served
        own = complete(moecache={"routing": "lru"})
        assert own["rerouted"] == 0 and own["p_given_up"] == 0.0 and own["tokens"] > 0, own
        again = complete()
        assert again["rerouted"] > 0  # the server's routing again
        # issue 56 item 2: llama-server's /v1/health, and OpenAI's developer role, rendered as the system role
        status, text = http_request(base + "/v1/health")
        assert status == 200 and json.loads(text)["status"] == "ok", text
        chats = {}
        for role in ("developer", "system"):
            status, text = http_request(base + "/v1/chat/completions", {
                "messages": [{"role": role, "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                "max_tokens": 4, "temperature": 0, "moecache": {"routing": "lru"}})
            assert status == 200, text
            chats[role] = json.loads(text)
        assert chats["developer"]["usage"] == chats["system"]["usage"], chats
        assert chats["developer"]["choices"][0]["message"] == chats["system"]["choices"][0]["message"], chats
        status, text = http_request(base + "/apply-template", {"messages": [{"role": "developer", "content": "Be brief."},
                                                                             {"role": "user", "content": "Hi"}]})
        assert status == 200 and json.loads(text)["prompt"] == (  # (ChatML: the fixture has no template)
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"), text
        _, text = http_request(base + "/props")  # (issue 56 item 6: the residency and miss mode as resolved)
        props = json.loads(text)["moecache"]
        assert (props["residency"], props["miss"], props["lowbit"]) == ("stream", "full", None), props
        _, text = http_request(base + "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 24, "temperature": 0,
                                                          "stream": True, "moecache": {"routing": "lru"}})
        last = [json.loads(x[6:]) for x in text.splitlines() if x.startswith("data: {")][-1]
        assert last["moecache"]["rerouted"] == 0 and last["moecache"]["tokens"] > 0, last  # streamed: the same
        assert complete()["rerouted"] > 0
        import urllib.error

        for bad in ({"routing": "nonsense"}, {"routing": "preset:speed"}, {"eviction": "lfu"}, "lru"):
            try:
                http_request(base + "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 2, "moecache": bad})
                raise AssertionError(f"accepted {bad!r}")
            except urllib.error.HTTPError as e:
                text = e.read().decode()
                assert e.code == 400 and "moecache" in text, (bad, e.code, text)
        _, text = http_request(base + "/metrics")
        total = int(re.search(r"^pymoecache:rerouted_total (\d+)$", text, re.M).group(1))
        assert total >= served["rerouted"] + again["rerouted"] and "pymoecache:router_probability_given_up " in text


def test_python_api_falls_back_to_chatml_as_the_cli_does(fixture_dir, tmp_path):
    """Issue 56 item 6: a model without a chat template chats in ChatML from the Python API too (as run,
    chat and serve), not llama-cpp-python's llama-2 by guess; an explicit chat_format is kept."""
    script = ("import sys, pymoecache\n"
              "llm = pymoecache.Llama(sys.argv[1], n_ctx=128, verbose=False)\n"
              "out = llm.create_chat_completion([{'role': 'user', 'content': 'Hi'}], max_tokens=2)\n"
              "print(llm.chat_format, out['usage']['prompt_tokens'] > 0)\n"
              "print(pymoecache.Llama(sys.argv[1], n_ctx=128, verbose=False, chat_format='llama-2').chat_format)\n")
    r = subprocess.run([sys.executable, "-c", script, str(model_path(fixture_dir, "mixtral-8x2"))], cwd=tmp_path,
                       env=installed_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split("\n")[:2] == ["chatml True", "llama-2"], (r.stdout, r.stderr[-2000:])


def test_verbose_prompt_in_one_shot_run(fixture_dir, tmp_path):
    """Issue 56 item 6: --verbose-prompt in a one-shot run prints the prompt and its tokens as llama-cli
    does (the chat template's rendering with --chat); a CPU-only stats line says nothing of devices."""
    m = model_path(fixture_dir, "mixtral-8x2")
    r = installed(tmp_path, "run", m, "-p", "Hello", "-n", "2", "--verbose-prompt")
    assert r.returncode == 0 and "prompt: 'Hello'" in r.stderr, r.stderr
    n = int(re.search(r"number of tokens in prompt = (\d+)", r.stderr).group(1))
    assert n >= 2 and len(re.findall(r"^ *\d+ -> '", r.stderr, re.M)) == n, r.stderr
    assert "device:" not in r.stdout, r.stdout  # one backend computes everything: nothing crosses
    r = installed(tmp_path, "run", m, "-p", "Hello", "-n", "2", "--chat", "--verbose-prompt")
    assert r.returncode == 0 and "<|im_start|>user\\nHello<|im_end|>" in r.stderr, r.stderr


def test_lowbit_help_says_what_run_does_with_the_file(tmp_path):
    """Issue 56 items 3 and 6: `lowbit --help` has its examples one per line and says that run uses the
    companion as the cache's source by default (lowbit-cache), not only for misses."""
    r = installed(tmp_path, "lowbit", "--help")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    examples = lines[lines.index("examples:") + 1:]
    assert [x.strip() for x in examples if x.strip()] == [
        "pymoecache lowbit model.gguf", "pymoecache lowbit model.gguf --type Q3_K -o small.gguf",
        "pymoecache lowbit model.gguf --check"], r.stdout
    assert "--miss lowbit-cache" in " ".join(r.stdout.split()), r.stdout


def test_several_companions_the_default_type_is_used_and_check_lists_them(fixture_dir, tmp_path):
    """Issue 56 item 3: with a Q2_K companion made once beside a model and the default one (Q4_K for Q8_0
    experts), run uses the default type's, not the first by name, and its plan line names the file
    and the types llama.cpp made (its fallbacks: the fixture's rows take Q5_0); --check lists both."""
    m = tmp_path / "model.gguf"
    shutil.copy(model_path(fixture_dir, MODEL, ".Q8_0"), m)
    for args in (("--type", "Q2_K"), ()):
        r = installed(tmp_path, "lowbit", m, *args)
        assert r.returncode == 0, r.stderr
    r = installed(tmp_path, "lowbit", m, "--check")
    assert r.returncode == 0, r.stderr
    # each file named by the types llama.cpp made (the fixture's 64-wide rows: Q4_K -> Q5_0, Q2_K -> Q4_0); the
    # default is the one made for the default type, Q4_K, whatever its name
    assert sorted(p.name for p in tmp_path.glob("model.lowbit-*")) == ["model.lowbit-Q4_0.gguf", "model.lowbit-Q5_0.gguf"]
    assert r.stdout.startswith("used by default: ") and "model.lowbit-Q5_0.gguf" in r.stdout.splitlines()[0], r.stdout
    assert "also here: " in r.stdout and "model.lowbit-Q4_0.gguf" in r.stdout, r.stdout
    r = installed(tmp_path, "run", m, "--cache-size", "8", "-n", "2")
    assert r.returncode == 0, r.stderr
    assert "in the companion model.lowbit-Q5_0.gguf (experts at Q5_0) (lowbit-cache)" in r.stderr, r.stderr


def test_a_companion_that_is_not_used_is_said_so_once(fixture_dir, tmp_path):
    """Issue 56 item 3: a companion beside a model whose experts all fit in memory does nothing (every
    expert resident at full precision): run says so once; --miss full (asked for) says nothing."""
    m = tmp_path / "model.gguf"
    shutil.copy(model_path(fixture_dir, MODEL, ".Q8_0"), m)
    assert installed(tmp_path, "lowbit", m).returncode == 0
    r = installed(tmp_path, "run", m, "-n", "2")
    assert r.returncode == 0 and r.stderr.count("model.lowbit-Q5_0.gguf is not used: every expert fits") == 1, r.stderr
    r = installed(tmp_path, "run", m, "-n", "2", "--miss", "full")
    assert r.returncode == 0 and "is not used" not in r.stderr, r.stderr


def test_ppl_miss_auto_does_what_run_does_and_compares_with_full(fixture_dir, tmp_path):
    """Issue 56 item 3: ppl's default --miss is auto, as run's: with a companion beside the model its
    rows are lowbit-cache's (said on stderr); --miss full lowbit-cache gives a 'vs full' column."""
    m = tmp_path / "model.gguf"
    shutil.copy(model_path(fixture_dir, MODEL, ".Q8_0"), m)
    text = tmp_path / "text.txt"
    text.write_text("Once upon a time there was a little cat. It liked to play in the sun. " * 20)
    common = ("ppl", m, "-f", text, "--ctx", "32", "--chunks", "2", "--cache-size", "8", "--routing", "lru",
              "--no-progress")
    r = installed(tmp_path, *common)
    assert r.returncode == 0 and "lowbit-cache" not in r.stdout, r.stdout  # no companion yet: full precision
    assert installed(tmp_path, "lowbit", m).returncode == 0
    r = installed(tmp_path, *common)
    assert r.returncode == 0 and "--miss auto: the companion model.lowbit-Q5_0.gguf" in r.stderr, r.stderr
    rows = r.stdout.strip().splitlines()
    assert "miss path" in rows[0] and all("lowbit-cache" in x for x in rows[1:]), r.stdout
    r = installed(tmp_path, *common, "--miss", "full", "lowbit-cache")
    assert r.returncode == 0 and "vs full" in r.stdout.splitlines()[0], r.stdout
    low = next(x for x in r.stdout.splitlines() if "lowbit-cache" in x)
    assert re.search(r"[+-]\d+\.\d\d% ±", low), r.stdout


def test_llama_server_fields_n_probs_json_schema_return_tokens_prompt_lists(fixture_dir, tmp_path):
    """/completion's n_probs, return_tokens, json_schema and a list of prompts, and OpenAI's response_format
    json_schema through the official client, against the installed server (issue 56 item 2)."""
    import openai

    def post(base, body, path="/completion"):
        return json.loads(http_request(base + path, body)[1])

    def post_stream(base, body):
        text = http_request(base + "/completion", {**body, "stream": True})[1]
        return [json.loads(ln[6:]) for ln in text.splitlines() if ln.startswith("data: ")]

    greedy = {"n_predict": 6, "temperature": 0}
    with installed_server(tmp_path, model_path(fixture_dir, MODEL), "--routing", "lru") as base:
        r = post(base, {"prompt": "Once upon a time", **greedy, "n_probs": 3, "return_tokens": True})
        probs, ids = r["completion_probabilities"], r["tokens"]
        assert len(probs) == len(ids) == r["tokens_predicted"] > 0
        assert post(base, {"tokens": ids}, "/detokenize")["content"] == r["content"]
        for p, tok in zip(probs, ids):  # greedy: the token drawn is the most likely one, its logprob the top's
            top = p["top_logprobs"]
            assert p["id"] == tok == top[0]["id"] and p["logprob"] == top[0]["logprob"] <= 0 and len(top) == 3
            assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
            assert sum(2.718281828 ** t["logprob"] for t in top) <= 1 + 1e-6 and bytes(p["bytes"]).decode() == p["token"]
        assert post(base, {"prompt": "Once upon a time", **greedy})["tokens"] == []  # (only with return_tokens)
        chunks = post_stream(base, {"prompt": "Once upon a time", **greedy, "n_probs": 3})
        assert [t for c in chunks for t in c["tokens"]] == ids  # streamed: every piece carries its tokens
        streamed = [e for c in chunks[:-1] for e in c["completion_probabilities"]]
        # (the same ids; the logprobs to float noise: the prompt's prefix is kept, its last token evaluated alone)
        assert [[e["id"], *(t["id"] for t in e["top_logprobs"])] for e in streamed] == \
            [[e["id"], *(t["id"] for t in e["top_logprobs"])] for e in probs]
        assert max(abs(a["logprob"] - b["logprob"]) for a, b in zip(streamed, probs)) < 1e-3
        # json_schema: the answer is constrained by a grammar made from the schema
        s = post(base, {"prompt": "Answer:", "n_predict": 16, "json_schema": {"enum": ["yes", "no"]}})
        assert json.loads(s["content"]) in ("yes", "no") and s["stop_type"] == "eos", s
        # a list of prompts: one answer per prompt, each what the prompt alone gives
        many = post(base, {"prompt": ["Once upon a time", "The king"], **greedy})
        assert isinstance(many, list) and [m["index"] for m in many] == [0, 1]
        assert [m["content"] for m in many] == [post(base, {"prompt": p, **greedy})["content"]
                                               for p in ("Once upon a time", "The king")]
        chunks = post_stream(base, {"prompt": ["Once upon a time", "The king"], **greedy})
        assert [c["index"] for c in chunks if c["stop"]] == [0, 1]
        assert "".join(c["content"] for c in chunks if c["index"] == 1) == many[1]["content"]
        # mixed strings and ids are one prompt
        king = post(base, {"content": " king"}, "/tokenize")["tokens"]
        mixed = post(base, {"prompt": ["The", *king], **greedy})
        the = post(base, {"content": "The", "add_special": True}, "/tokenize")["tokens"]
        assert isinstance(mixed, dict) and mixed["tokens_evaluated"] == len(the) + len(king)
        for bad, param in (({"json_schema": {"type": "string"}, "grammar": "root ::= \"a\""}, "json_schema"),
                           ({"json_schema": "string"}, "json_schema"), ({"n_probs": -1}, "n_probs"),
                           ({"post_sampling_probs": True}, "post_sampling_probs"), ({"prompt": ["a", 5.5]}, "prompt")):
            try:
                http_request(base + "/completion", {"prompt": "Hi", **bad})
                raise AssertionError(f"{bad} was accepted")
            except Exception as e:  # urllib's HTTPError: a 400 naming the field
                assert getattr(e, "code", None) == 400, e
                assert json.loads(e.read())["error"]["param"] == param
        # OpenAI's response_format json_schema, through the official client
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        c = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "yes or no?"}],
                                           max_tokens=16, response_format={"type": "json_schema", "json_schema": {
                                               "name": "answer", "schema": {"enum": ["yes", "no"]}}})
        assert json.loads(c.choices[0].message.content) in ("yes", "no")


def test_speed_forecast_in_info_bench_and_the_plan(fixture_dir, tmp_path):
    """Issue 56 item 5: info --forecast (text and JSON), the line after run's plan where the cache streams,
    and bench's forecast beside the measured figure; --forecast on a dense model is refused."""
    m = model_path(fixture_dir, MODEL)
    r = installed(tmp_path, "info", m, "--forecast", "--cache-size", "0.5")
    assert r.returncode == 0 and re.search(r"forecast, the default routing with 50% of the experts cached, \d+ "
                                           r"thread\(s\): decode ~[\d.]+ tok/s \(band [\d.]+ to [\d.]+\)", r.stdout), r.stdout
    r = installed(tmp_path, "info", m, "--forecast", "--cache-size", "15", "-t", "2", "--json")
    assert r.returncode == 0, r.stderr
    f = json.loads(r.stdout)["forecast"]
    assert f["share"] == 0.25 and 0 < f["low"] < f["tok_s"] < f["high"] and f["compute_ms"] > 0 and f["read_ms"] > 0
    full = json.loads(installed(tmp_path, "info", m, "--forecast", "--cache-size", "60", "--json").stdout)["forecast"]
    assert full["share"] == 1.0 and full["read_ms"] == 0 and full["miss_rate"] == 0  # every expert cached: no read
    r = installed(tmp_path, "run", m, "--cache-size", "15", "-n", "2", "-p", "Hi")
    assert r.returncode == 0 and re.search(r"^forecast: decode ~[\d.]+ tok/s \(band ", r.stderr, re.M), r.stderr
    r = installed(tmp_path, "bench", m, "--cache-size", "15", "--routing", "lru,preset:quality", "-n", "4")
    assert r.returncode == 0, r.stderr
    said = re.search(r"forecast for preset:quality: [\d.]+ tok/s \(band [\d.]+ to [\d.]+\); measured [\d.]+: "
                     r"(inside|outside) the band", r.stdout)
    assert said and "forecast for lru" not in r.stdout, r.stdout
    r = installed(tmp_path, "info", model_path(fixture_dir, "dense-llama"), "--forecast")
    assert r.returncode == 2 and "--forecast is for MoE models" in r.stderr, r.stderr


def test_slot_save_and_restore(fixture_dir, tmp_path):
    """Issue 55 item 4 (llama-server's slot files): a conversation saved to a slot file and restored after
    another request continues with the same tokens as one never interrupted, its history evaluated by
    no one (prompt_n) and routed through no expert; bad files and names are refused and the server goes on."""
    m = model_path(fixture_dir, MODEL)
    slots = tmp_path / "slots"

    def post(base, path, body):
        return http_json(base + path, body)

    (tmp_path / "a-file").write_text("x")
    r = installed(tmp_path, "serve", m, "--slot-save-path", tmp_path / "a-file", "--port", str(free_port()))
    assert r.returncode == 2 and "is not a directory" in r.stderr, r.stderr
    greedy = {"n_predict": 8, "temperature": 0}
    first = {"prompt": "Once upon a time", **greedy}
    with installed_server(tmp_path, m, "--routing", "lru") as base:  # (no --slot-save-path: off)
        status, r = post(base, "/slots/0?action=save", {"filename": "a.bin"})
        assert status == 501 and "--slot-save-path" in r["error"]["message"], r
        _, a = post(base, "/completion", first)
        follow = {"prompt": "Once upon a time" + a["content"] + " and then", **greedy}
        _, uninterrupted = post(base, "/completion", follow)
    with installed_server(tmp_path, m, "--routing", "lru", "--slot-save-path", slots) as base:
        _, a2 = post(base, "/completion", first)
        assert a2["content"] == a["content"]
        status, saved = post(base, "/slots/0?action=save", {"filename": "conversation.bin"})
        assert status == 200 and saved["n_saved"] > 0 and (slots / "conversation.bin").stat().st_size == saved["n_written"]
        post(base, "/completion", {"prompt": "The king said nothing at all to", **greedy})  # another conversation
        status, restored = post(base, "/slots/0?action=restore", {"filename": "conversation.bin"})
        assert status == 200 and restored["n_restored"] == saved["n_saved"], restored
        _, cont = post(base, "/completion", follow)
        assert cont["content"] == uninterrupted["content"]
        # only what follows the restored conversation was evaluated, and routed through the experts
        assert cont["timings"]["prompt_n"] <= cont["tokens_evaluated"] - saved["n_saved"] + 1
        assert cont["moecache"]["tokens"] < cont["tokens_evaluated"], cont["moecache"]
        # refused: a file that is not one, a path, a missing file, a slot that does not exist, an unknown action
        good = (slots / "conversation.bin").read_bytes()  # its header, then garbage
        (slots / "junk.bin").write_bytes(good[:96] + b"\xff" * 256)
        (slots / "text.bin").write_text("hello")
        (slots / "cut.bin").write_bytes(good[:len(good) // 2])  # truncated
        for path, body, status, words in (
                ("/slots/0?action=restore", {"filename": "junk.bin"}, 400, "truncated or damaged"),
                ("/slots/0?action=restore", {"filename": "text.bin"}, 400, "is not a pymoecache state file"),
                ("/slots/0?action=restore", {"filename": "cut.bin"}, 400, "truncated or damaged"),
                ("/slots/0?action=restore", {"filename": "../x.bin"}, 400, "not a plain file name"),
                ("/slots/0?action=save", {"filename": ".hidden"}, 400, "not a plain file name"),
                ("/slots/0?action=restore", {"filename": "none.bin"}, 404, "no slot file"),
                ("/slots/3?action=save", {"filename": "a.bin"}, 400, "does not exist"),
                ("/slots/0?action=copy", {"filename": "a.bin"}, 400, "unknown action")):
            got, r = post(base, path, body)
            assert got == status and words in r["error"]["message"], (path, body, r)
        status, erased = post(base, "/slots/0?action=erase", {})
        assert status == 200 and erased["n_erased"] == 0  # (the junk file emptied the slot)
        _, again = post(base, "/completion", first)  # the server goes on
        assert again["content"] == a["content"]
        assert sorted(p.name for p in slots.iterdir()) == ["conversation.bin", "cut.bin", "junk.bin", "text.bin"]


def test_prompt_cache_on_disk(fixture_dir, tmp_path):
    """Issue 55 item 4 (a disk prompt cache keyed by tokens, for serve and chat): a prompt that begins with a
    kept conversation, after another conversation and after a restart, decodes only the rest (prompt_n; its
    history routes through no expert) and gives the same tokens as never interrupted."""
    m = model_path(fixture_dir, MODEL)
    store = tmp_path / "prompts"
    greedy = {"n_predict": 8, "temperature": 0}
    first = {"prompt": "Once upon a time there was a little cat who lived in a house", **greedy}

    def post(base, body):
        return json.loads(http_request(base + "/completion", body)[1])

    with installed_server(tmp_path, m, "--routing", "lru") as base:
        a = post(base, first)
        follow = {"prompt": first["prompt"] + a["content"] + " and then", **greedy}
        uninterrupted = post(base, follow)
    with installed_server(tmp_path, m, "--routing", "lru", "--prompt-cache-dir", store) as base:
        assert post(base, first)["content"] == a["content"]
        post(base, {"prompt": "The king said nothing at all to the queen that night", **greedy})  # another one
        cont = post(base, follow)
    assert cont["content"] == uninterrupted["content"]
    n_kept = len(first["prompt"]) // 8  # (well below the first conversation's tokens)
    assert cont["timings"]["prompt_n"] < cont["tokens_evaluated"] - n_kept, cont["timings"]
    assert cont["moecache"]["tokens"] < cont["tokens_evaluated"] - n_kept, cont["moecache"]
    assert list(store.glob("*.prompt"))
    with installed_server(tmp_path, m, "--routing", "lru", "--prompt-cache-dir", store) as base:  # a restart
        again = post(base, follow)
    assert again["content"] == uninterrupted["content"] and again["timings"]["prompt_n"] < again["tokens_evaluated"] - n_kept
    # chat: the same system prompt again in a new process is not prefilled again
    runs = [installed(tmp_path, "chat", m, "--prompt-cache-dir", store, "-sys", "You are a helpful assistant who "
                      "answers every question about cats in one short sentence.", "-p", "Hi", "-st", "-n", "4",
                      "--temp", "0", "--routing", "lru") for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr
    answers = [r.stdout.split("> Hi", 1)[-1].strip().splitlines()[0] for r in runs]
    loaded = [float(re.search(r"loaded ([\d.]+) MiB", r.stdout + r.stderr).group(1)) for r in runs]
    assert answers[0] == answers[1] and loaded[1] < loaded[0], (answers, loaded)  # (the second routed the reply only)
    (tmp_path / "not-a-dir").write_text("x")
    r = installed(tmp_path, "chat", m, "--prompt-cache-dir", tmp_path / "not-a-dir", "-p", "Hi", "-st")
    assert r.returncode == 2 and "is not a directory" in r.stderr, r.stderr
