"""Users at home, round 4 (issue 77), as they reach it: the installed package in a fresh process outside the tree,
the flag or the request alone. llama.cpp's flags (-ctk/-ctv, -nkvo, -cb, -sp, -sm, -ts, -mg, -fit, --temperature,
--no-display-prompt, -j, --simple-io, -i, LLAMA_ARG_*), a single-dash option we do not have refused by its name,
run's stats line on stderr, valid JSON from a schema, lists of prompts, API key lists and X-Api-Key."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from conftest import http_json, model_path
from test_features_as_installed import installed_server
from test_rpc_as_installed import installed, installed_env

MODEL = "qwen2moe-60x4"


def test_llama_cpp_flags_are_taken_and_an_unknown_single_dash_option_is_refused_by_its_name(fixture_dir, tmp_path):
    m = model_path(fixture_dir, MODEL)
    for args in (("-ctk", "f32", "-ctv", "bf16"), ("--cache-type-k", "F16"), ("-nkvo",), ("-cb",), ("-sp",),
                 ("-sm", "none"), ("-ts", "3,1"), ("-mg", "0"), ("-fit", "on"), ("-fit",), ("-fit", "off"),
                 ("--temperature", "0"), ("--simple-io",), ("--no-display-prompt",)):
        r = installed(tmp_path, "run", m, "-p", "Once upon a time", "-n", "4", *args)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (args, r.stderr[-2000:])
    # the KV cache's type reaches llama.cpp (its log says so; a block-quantized type needs heads of a multiple of
    # its 32 values, which this fixture's 16 are not: llama.cpp's reason, one line, exit 2)
    r = installed(tmp_path, "run", m, "-p", "x", "-n", "1", "-ctk", "f32", "-ctv", "bf16", "-v")
    assert r.returncode == 0 and "K (f32)" in r.stderr and "V (bf16)" in r.stderr, r.stderr[-3000:]
    r = installed(tmp_path, "run", m, "-p", "x", "-n", "1", "-ctk", "q8_0")
    assert r.returncode == 2 and "K cache type q8_0 with block size 32 does not divide" in r.stderr, r.stderr
    for args, says in ((("-ctk", "q3_k"), "argument -ctk/--cache-type-k: expected one of f32, f16, bf16, q8_0"),
                       (("-ctv", "q8_0", "-fa", "off"), "-ctv q8_0 needs flash attention"),
                       (("-ctx", "64"), "unrecognized arguments: -ctx"),          # (was -c "tx")
                       (("-n64",), "unrecognized arguments: -n64"),
                       (("-spx",), "unrecognized arguments: -spx"),
                       (("-ts", "a,b"), "expected shares such as 3,1"),
                       (("-fit", "maybe"), "expected on or off"),
                       (("--kv-unified",), "--kv-unified is an option of pymoecache serve"),
                       (("--threads-http", "4"), "--threads-http is an option of pymoecache serve")):
        r = installed(tmp_path, "run", m, "-p", "x", "-n", "1", *args)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert "did you mean --unified" not in r.stderr and "did you mean --threads?" not in r.stderr


def test_run_writes_the_text_alone_on_stdout_and_its_stats_on_stderr(fixture_dir, tmp_path):
    m = model_path(fixture_dir, MODEL)
    r = installed(tmp_path, "run", m, "-p", "Once upon a time", "-n", "8")
    assert r.returncode == 0 and r.stdout.startswith("Once upon a time"), r.stdout
    assert "hit rate" not in r.stdout and "tok/s" not in r.stdout and "hit rate" in r.stderr, (r.stdout, r.stderr)
    text = r.stdout
    r = installed(tmp_path, "run", m, "-p", "Once upon a time", "-n", "8", "--no-display-prompt")
    assert r.returncode == 0 and "Once upon a time" + r.stdout == text, (r.stdout, text)  # greedy: the same text
    r = installed(tmp_path, "run", m, "-p", "Once upon a time", "-n", "8", "--stats-stdout")
    assert r.returncode == 0 and r.stdout.startswith(text) and "hit rate" in r.stdout.splitlines()[-1], r.stdout


def test_a_json_schema_gives_json_that_parses(fixture_dir, tmp_path):
    """-j in run, json_schema on /completion, response_format json_schema and json_object on the chat: the strings'
    characters exclude raw control characters (llama-cpp-python's converter let a newline in), whatever the seed."""
    m = model_path(fixture_dir, MODEL)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}, "required": ["name"]}
    r = installed(tmp_path, "run", m, "-p", "Answer:", "-n", "48", "--no-display-prompt", "--temp", "1.5",
                  "-s", "3", "-j", json.dumps(schema))
    assert r.returncode == 0 and json.loads(r.stdout)["name"] is not None, (r.stdout, r.stderr[-1000:])
    r = installed(tmp_path, "run", m, "-p", "x", "-j", "{not json")
    assert r.returncode == 2 and "-j: not JSON" in r.stderr, r.stderr
    schemas = [schema, {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
               {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 8}}}]
    with installed_server(tmp_path, m, "-c", "512") as base:
        for seed in range(12):
            s = schemas[seed % len(schemas)]
            st, out = http_json(base + "/completion", {"prompt": "Here:", "json_schema": s, "n_predict": 200,
                                                      "temperature": 2.0, "seed": seed})
            assert st == 200 and out["stop_type"] == "eos", out  # (the grammar ended it, within n_predict)
            json.loads(out["content"])
            st, out = http_json(base + "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 200, "temperature": 2.0, "seed": seed,
                "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": s}}})
            assert st == 200 and out["choices"][0]["finish_reason"] == "stop", out
            json.loads(out["choices"][0]["message"]["content"])
        for seed in range(6):  # any JSON object: whitespace bounded, strings as above
            st, out = http_json(base + "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 96, "temperature": 1.0, "seed": seed,
                "response_format": {"type": "json_object"}})
            content = out["choices"][0]["message"]["content"]
            assert st == 200 and "\n" * 3 not in content and " " * 24 not in content, out
            if out["choices"][0]["finish_reason"] == "stop":
                assert isinstance(json.loads(content), dict), content
        st, out = http_json(base + "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Hi"}], "grammar": 'root ::= "x"',
            "response_format": {"type": "json_object"}})
        assert st == 400 and "not both" in out["error"]["message"], out


@pytest.mark.parametrize("np_", ["1", "2"])
def test_a_list_of_prompts_is_a_choice_each(fixture_dir, tmp_path, np_):
    m = model_path(fixture_dir, MODEL)
    prompts = ["Once upon a time", "The king", "In the morning"]
    with installed_server(tmp_path, m, "-c", "512", "-np", np_) as base:
        alone = []
        for p in prompts:
            st, out = http_json(base + "/v1/completions", {"prompt": p, "max_tokens": 8, "temperature": 0})
            assert st == 200, out
            alone.append(out["choices"][0]["text"])
        st, out = http_json(base + "/v1/completions", {"prompt": prompts, "max_tokens": 8, "temperature": 0})
        assert st == 200, out
        assert [c["index"] for c in out["choices"]] == [0, 1, 2]
        assert [c["text"] for c in out["choices"]] == alone  # greedy: each as alone
        assert out["usage"]["completion_tokens"] == sum(len(c["text"]) > 0 for c in out["choices"]) * 8 or \
            out["usage"]["completion_tokens"] > 0
        st, out = http_json(base + "/v1/completions", {"prompt": prompts, "max_tokens": 8, "stream": True})
        assert st == 400 and "stream" in out["error"]["message"], out
        st, out = http_json(base + "/v1/completions", {"prompt": ["x"] * 65, "max_tokens": 1})
        assert st == 400 and "at most 64" in out["error"]["message"], out


def _status(url, headers):
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_api_key_lists_and_x_api_key(fixture_dir, tmp_path):
    m = model_path(fixture_dir, MODEL)
    with installed_server(tmp_path, m, "-c", "256", "--api-key", "A1,B2") as base:
        for headers, want in (({}, 401), ({"Authorization": "Bearer A1"}, 200), ({"Authorization": "Bearer B2"}, 200),
                              ({"Authorization": "Bearer A1,B2"}, 401), ({"X-Api-Key": "B2"}, 200),
                              ({"X-Api-Key": "C3"}, 401), ({"Authorization": "Bearer C3"}, 401)):
            for path in ("/v1/models", "/props", "/moecache/stats"):
                assert _status(base + path, headers) == want, (path, headers)
        assert _status(base + "/health", {}) == 200


def test_llama_arg_environment_variables(fixture_dir, tmp_path):
    import subprocess
    import sys

    m = model_path(fixture_dir, MODEL)

    def run(env, *args):
        return subprocess.run([sys.executable, "-m", "pymoecache", "run", str(m), "-p", "x", "-n", "2", "--json",
                               *args], cwd=tmp_path, env={**installed_env(), **env}, capture_output=True, text=True,
                              timeout=300)

    r = run({"LLAMA_ARG_CTX_SIZE": "512"})
    assert r.returncode == 0 and json.loads(r.stdout)["n_ctx"] == 512, r.stderr
    r = run({"LLAMA_ARG_CTX_SIZE": "512"}, "-c", "768")
    assert r.returncode == 0 and json.loads(r.stdout)["n_ctx"] == 768, r.stderr  # the command line wins
    r = run({"LLAMA_ARG_THREADS": "1"})
    assert r.returncode == 0 and json.loads(r.stdout)["n_threads"] == 1, r.stderr
    r = run({"LLAMA_ARG_CTX_SIZE": "lots"})
    assert r.returncode == 2 and "invalid int value: 'lots'" in r.stderr, r.stderr


def test_special_tokens_in_the_text_with_sp(fixture_dir):
    """-sp sets Llama.special_text: a control token the model samples shows in the completion's text."""
    import pymoecache

    llm = pymoecache.Llama(str(model_path(fixture_dir, MODEL)), n_ctx=128, verbose=False)
    import llama_cpp

    vocab = llm._model.vocab
    control = [t for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_get_attr(vocab, t) & 1  # LLAMA_TOKEN_ATTR_CONTROL
               and not llama_cpp.llama_vocab_is_eog(vocab, t)]
    assert control, "the fixture has a control token that ends nothing"
    t = control[0]
    piece = llm.detokenize([t], special=True).decode()
    texts = []
    for special in (False, True):
        llm.special_text = special
        out = llm.create_completion("Hi", max_tokens=1, temperature=0, logit_bias={t: 100.0})
        texts.append(out["choices"][0]["text"])
    llm.close()
    assert texts == ["", piece], (texts, piece)


def test_each_slot_has_its_share_of_the_context_unless_kvu(fixture_dir, tmp_path):
    """serve -np N: each slot n_ctx / N, as llama-server (-c is the total): what cannot fit its slot is a 400 at
    once, what fills it ends with "length" only then, and /slots, /props and the start line say so; -kvu shares
    the whole context. 4 requests of 200 tokens at -c 1024 -np 4 get their 200, together."""
    import concurrent.futures

    m = model_path(fixture_dir, MODEL)
    with installed_server(tmp_path, m, "-c", "256", "-np", "4") as base:
        st, slots = http_json(base + "/slots")
        assert st == 200 and [s["n_ctx"] for s in slots] == [64] * 4, slots
        st, props = http_json(base + "/props")
        assert props["default_generation_settings"]["n_ctx"] == 64 and props["n_ctx"] == 256, props
        assert props["kv_unified"] is False
        params = props["default_generation_settings"]["params"]  # (/completion's defaults, llama-server's names)
        assert params["n_predict"] == -1 and params["seed"] == -1 and params["temperature"] == 0.8 \
            and params["stop"] == [] and len(params) >= 12, params
        for path, body in (("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 60}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                     "max_tokens": 60}),
                           ("/v1/completions", {"prompt": "x", "max_tokens": 65})):
            st, out = http_json(base + path, body)
            assert st == 400 and "64" in out["error"]["message"], (path, out)
        st, out = http_json(base + "/v1/completions", {"prompt": "Once upon a time", "temperature": 0,
                                                      "logit_bias": {}})
        assert st == 200 and out["choices"][0]["finish_reason"] in ("length", "stop"), out
        assert out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"] <= 64, out["usage"]
    log = (tmp_path / "server.log").read_text()
    assert "(64 per slot; -kvu shares it)" in log, log[-2000:]
    with installed_server(tmp_path, m, "-c", "256", "-np", "4", "-kvu") as base:
        st, slots = http_json(base + "/slots")
        assert [s["n_ctx"] for s in slots] == [256] * 4 and http_json(base + "/props")[1]["kv_unified"] is True
        st, out = http_json(base + "/v1/completions", {"prompt": "x", "max_tokens": 65, "temperature": 0})
        assert st == 200, out
    with installed_server(tmp_path, m, "-c", "1024", "-np", "4") as base:
        body = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0.8}  # (the batch: plain sampling)

        def one(i):
            return http_json(base + "/v1/completions", dict(body, seed=i))

        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            outs = list(ex.map(one, range(4)))
        for st, out in outs:
            assert st == 200 and out["usage"]["completion_tokens"] == 200, out


def test_models_meta_and_logprob_bytes(fixture_dir, tmp_path):
    """/v1/models as llama-server's (owned_by "llamacpp", the model's meta); a chat answer's logprobs carry each
    token's UTF-8 bytes (llama-cpp-python left them null)."""
    from pymoecache import model_info

    m = model_path(fixture_dir, MODEL)
    info = model_info(str(m))
    with installed_server(tmp_path, m, "-c", "256") as base:
        st, out = http_json(base + "/v1/models")
        assert st == 200 and out["object"] == "list" and len(out["data"]) == 1, out
        model = out["data"][0]
        assert model["id"] == m.name and model["owned_by"] == "llamacpp" and model["created"] > 0, model
        meta = model["meta"]
        assert meta["n_ctx_train"] == info.n_ctx_train and meta["n_embd"] == info.n_embd and meta["n_params"] > 0
        assert meta["n_expert"] == info.n_expert and 0 < meta["size"] <= m.stat().st_size, meta
        st, out = http_json(base + "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                             "max_tokens": 4, "logprobs": True, "top_logprobs": 2})
        assert st == 200, out
        content = out["choices"][0]["logprobs"]["content"]
        assert content and all(e["bytes"] == list(e["token"].encode("utf-8")) for e in content), content
        assert all(t["bytes"] == list(t["token"].encode("utf-8")) for e in content for t in e["top_logprobs"])


def test_tool_calls_with_the_openai_client(fixture_dir, tmp_path):
    """tools with tool_choice required and auto (llama-server's generic format: the tools in a system message, a
    grammar holding the answer to a call or, under auto, a response): the openai client gets tool_calls it can
    parse, sends the tool's answer back, and gets an answer; many seeds under auto, each a call or a text."""
    from test_batch import run_script

    m = model_path(fixture_dir, MODEL)
    with installed_server(tmp_path, m, "-c", "1024") as base:
        d = run_script(tmp_path, f"""
            import json
            from openai import OpenAI
            client = OpenAI(base_url={base + "/v1"!r}, api_key="none")
            tools = [{{"type": "function", "function": {{"name": "get_weather", "description": "today's weather",
                      "parameters": {{"type": "object", "properties": {{"city": {{"type": "string", "maxLength": 12}}}},
                                     "required": ["city"]}}}}}},
                     {{"type": "function", "function": {{"name": "get_time", "parameters": {{"type": "object",
                      "properties": {{}}}}}}}}]
            msgs = [{{"role": "user", "content": "What is the weather in Oslo?"}}]
            r = client.chat.completions.create(model="m", messages=msgs, tools=tools, tool_choice="required",
                                               max_tokens=96, temperature=0)
            call = r.choices[0].message.tool_calls[0]
            out = {{"finish": r.choices[0].finish_reason, "name": call.function.name,
                    "args": json.loads(call.function.arguments), "content": r.choices[0].message.content}}
            msgs += [r.choices[0].message.model_dump(exclude_none=True),
                     {{"role": "tool", "tool_call_id": call.id, "content": json.dumps({{"sky": "clear"}})}}]
            back = client.chat.completions.create(model="m", messages=msgs, tools=tools, max_tokens=96,
                                                  temperature=0)
            out["back"] = [back.choices[0].message.content, bool(back.choices[0].message.tool_calls)]
            auto = []
            for seed in range(6):
                a = client.chat.completions.create(model="m", messages=msgs[:1], tools=tools, max_tokens=128,
                                                   temperature=1.0, seed=seed)
                c = a.choices[0]
                auto.append([c.finish_reason, c.message.content, [t.function.name for t in c.message.tool_calls or []],
                             [json.loads(t.function.arguments) for t in c.message.tool_calls or []]])
            out["auto"] = auto
            print(json.dumps(out))
        """)
    assert d["finish"] == "tool_calls" and d["content"] is None, d
    assert d["name"] in ("get_weather", "get_time") and isinstance(d["args"], dict), d
    assert d["back"][0] is not None or d["back"][1], d  # an answer to the tool's result: text or another call
    assert sum(f in ("stop", "tool_calls") for f, *_ in d["auto"]) >= 4, d["auto"]  # (answers that ended)
    for finish, content, names, args in d["auto"]:
        if finish == "tool_calls":
            assert names and set(names) <= {"get_weather", "get_time"} and all(isinstance(a, dict) for a in args)
        elif finish == "stop":
            assert isinstance(content, str) and not content.lstrip().startswith('{"response"'), content


# A chat template in Hermes' tool format (the one of Qwen2 to Qwen3 and Hermes: the tools listed in <tools>, each call
# in <tool_call> tags, a tool's answer in <tool_response>), written here in ChatML's turns.
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}Functions you may call, one JSON signature per line:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
To call one, answer <tool_call>
{"name": NAME, "arguments": ARGUMENTS}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}{% if m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{% if m.content %}{{ m.content }}
{% endif %}{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif m.role != 'system' or not loop.first %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_tool_calls_in_the_templates_own_format(fixture_dir, tmp_path):
    """A template in Hermes' format (as Qwen3-30B-A3B's) is given the tools and writes the calls and answers in its own
    words; under required the answer is one <tool_call> block, read back as OpenAI's tool_calls; the round trip of the
    openai client renders the call and the tool's answer in the template's tags (/apply-template shows it)."""
    from test_batch import run_script

    m = model_path(fixture_dir, MODEL)
    (tmp_path / "hermes.jinja").write_text(HERMES_TEMPLATE)
    with installed_server(tmp_path, m, "-c", "1024", "--chat-template-file", str(tmp_path / "hermes.jinja")) as base:
        d = run_script(tmp_path, f"""
            import json, urllib.request
            from openai import OpenAI
            client = OpenAI(base_url={base + "/v1"!r}, api_key="none")
            tools = [{{"type": "function", "function": {{"name": "get_weather", "parameters": {{"type": "object",
                      "properties": {{"city": {{"type": "string", "maxLength": 12}}}}, "required": ["city"]}}}}}}]
            msgs = [{{"role": "user", "content": "What is the weather in Oslo?"}}]
            out = {{"required": []}}
            for seed in range(4):
                r = client.chat.completions.create(model="m", messages=msgs, tools=tools, tool_choice="required",
                                                   max_tokens=64, temperature=1.0, seed=seed)
                c = r.choices[0]
                out["required"].append([c.finish_reason, c.message.content,
                                        [[t.function.name, json.loads(t.function.arguments)] for t in c.message.tool_calls or []]])
            call = r.choices[0].message.tool_calls[0]
            msgs += [r.choices[0].message.model_dump(exclude_none=True),
                     {{"role": "tool", "tool_call_id": call.id, "content": "sunny"}}]
            back = client.chat.completions.create(model="m", messages=msgs, tools=tools, max_tokens=16, temperature=0)
            out["back"] = back.choices[0].finish_reason
            req = urllib.request.Request({base + "/apply-template"!r}, method="POST",
                                         data=json.dumps({{"messages": msgs, "tools": tools}}).encode(),
                                         headers={{"Content-Type": "application/json"}})
            out["prompt"] = json.loads(urllib.request.urlopen(req).read())["prompt"]
            out["args"] = json.loads(call.function.arguments)
            print(json.dumps(out))
        """)
    for finish, content, calls in d["required"]:
        assert finish == "tool_calls" and len(calls) == 1 and calls[0][0] == "get_weather", d["required"]
        assert isinstance(calls[0][1].get("city"), str) and content is None, d["required"]
    assert d["back"] in ("stop", "length", "tool_calls"), d
    prompt = d["prompt"]
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt, prompt
    assert ('<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(d["args"], ensure_ascii=False) + "}\n</tool_call>") in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt and prompt.endswith("<|im_start|>assistant\n"), prompt


def test_tool_calls_refusals(fixture_dir, tmp_path):
    m = model_path(fixture_dir, MODEL)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "Hi"}]
    with installed_server(tmp_path, m, "-c", "512") as base:
        for body, says in (({"tools": tools, "stream": True}, "without \"stream\""),
                           ({"tools": tools, "tool_choice": "sometimes"}, "'tool_choice' must be"),
                           ({"tools": [{"type": "function", "function": {}}]}, "tools[0] must be"),
                           ({"tools": tools, "grammar": 'root ::= "x"'}, "not both")):
            st, out = http_json(base + "/v1/chat/completions", {"messages": msgs, "max_tokens": 4, **body})
            assert st == 400 and says in out["error"]["message"], (body, out)
        st, out = http_json(base + "/v1/chat/completions", {"messages": msgs, "max_tokens": 4, "tools": tools,
                                                             "tool_choice": "none"})
        assert st == 200 and out["choices"][0]["message"].get("tool_calls") in (None, []), out


def test_bench_progress_is_a_line_each_in_a_pipe(fixture_dir, tmp_path):
    r = installed(tmp_path, "bench", model_path(fixture_dir, MODEL), "--routing", "lru,prior:0.5", "-n", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stderr.splitlines()
    assert "\r" not in r.stderr and any(ln.startswith("[1 of 2] lru") for ln in lines) \
        and any(ln.startswith("[2 of 2] prior:0.5") for ln in lines), r.stderr


def test_ppl_beside_a_companion_prints_each_row_once(fixture_dir, tmp_path):
    """Plain `ppl` on a model with a low-bit companion beside it: its rows (lru, prior, on the companion's miss path)
    each once; with one routing, one row."""
    import shutil

    from conftest import SHARED

    m = tmp_path / "model.gguf"
    shutil.copy(model_path(fixture_dir, MODEL, ".Q8_0"), m)
    assert installed(tmp_path, "lowbit", m).returncode == 0
    text = tmp_path / "text.txt"
    text.write_text((SHARED / "data" / "tinyshakespeare" / "input.txt").read_text()[:4000])
    for args, n_rows in (((), 2), (("--routing", "lru"), 1)):
        r = installed(tmp_path, "ppl", m, "-f", text, "-c", "64", "--chunks", "1", *args)
        assert r.returncode == 0, r.stderr[-2000:]
        lines = r.stdout.strip().splitlines()
        assert lines[0].startswith("policy") and "lowbit-cache" in r.stdout, r.stdout
        keys = [tuple(line.split()[:5]) for line in lines[1:]]
        assert len(keys) == n_rows == len(set(keys)), r.stdout
