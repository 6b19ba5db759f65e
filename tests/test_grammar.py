"""Grammars are checked before llama.cpp sees them (issue 25 item 4): from the Python API, the CLI
and the server (tests/test_hostile.py), a bad grammar is a clear error, never a signal. Each API
case runs in a child process, so a crash fails the test instead of taking pytest down."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pymoecache.errors import GrammarError
from pymoecache.grammar import check_grammar
from conftest import ROOT, model_path

QWEN = "qwen2moe-60x4"

# SIGSEGV before: llama.cpp's parser fails and llama-cpp-python adds the NULL sampler anyway
UNPARSABLE = ["root ::= ((", "root ::= x", 'foo ::= "a"', "root ::= [", 'root ::= root "a"']
# SIGABRT before: parsed, then llama.cpp throws from inside sampling when NUL is the only choice
NUL_ONLY = ['root ::= "\\x00"', 'root ::= "a" "\\u0000"', "root ::= [\\x00]", 'root ::= "\\U00000000" | "\\x00"']


@pytest.mark.parametrize("text", NUL_ONLY + ["", "   ", "root ::= " + "(" * 300 + '"a"' + ")" * 300, 'root ::= "a\0"'])
def test_refused_without_a_model(text):
    with pytest.raises(GrammarError, match="^grammar: "):
        check_grammar(text)


@pytest.mark.parametrize("text", [
    'root ::= "yes" | "no"',
    'root ::= [^"\\\\\\x7F\\x00-\\x1F]+',        # NUL excluded from a class: fine (JSON string grammars do this)
    "root ::= [\\x00-\\x05]+",                  # NUL one choice among others: fine
    'root ::= "(" [()]* ")"  # a comment with "\\x00"',
    'root ::= "\\\\x00"',                       # a backslash, then "x00": not NUL
])
def test_accepted_without_a_model(text):
    check_grammar(text)


def test_llama_cpp_pythons_own_grammars_pass(fixture_dir):
    import llama_cpp
    from llama_cpp import llama_grammar

    import pymoecache

    llm = pymoecache.Llama(str(model_path(fixture_dir, QWEN)), verbose=False)
    names = [n for n in dir(llama_grammar) if n.endswith("_GBNF")]
    assert len(names) >= 5
    for name in names:
        check_grammar(getattr(llama_grammar, name), llm._model.vocab)
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "string"}}})
    check_grammar(llama_grammar.json_schema_to_gbnf(schema), llm._model.vocab)
    assert llama_cpp.LlamaGrammar.from_json_schema(schema, verbose=False)
    llm.close()


def _api(fixture_dir, grammar: str, how: str = "call"):
    code = f"""
import pymoecache, llama_cpp
llm = pymoecache.Llama({str(model_path(fixture_dir, QWEN))!r}, cache=pymoecache.CacheConfig(size=0.5), verbose=False)
g = llama_cpp.LlamaGrammar.from_string({grammar!r}, verbose=False)
try:
    if {how!r} == "call":
        print("TEXT", repr(llm("Hello", max_tokens=4, temperature=0, grammar=g)["choices"][0]["text"]))
    elif {how!r} == "stream":
        print("TEXT", repr("".join(c["choices"][0]["text"] for c in llm("Hello", max_tokens=4, stream=True, grammar=g))))
    else:
        llm.eval(llm.tokenize(b"Hello"))
        print("TEXT", repr(llm.detokenize([llm.sample(grammar=g)]).decode("utf-8", "replace")))
except pymoecache.GrammarError as e:
    print("GrammarError", e)
# the model still works after the refusal
print("AFTER", repr(llm("Hello", max_tokens=2, temperature=0)["choices"][0]["text"]))
"""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("how", ["call", "stream", "sample"])
@pytest.mark.parametrize("grammar", [UNPARSABLE[0], NUL_ONLY[0]])
def test_python_api_bad_grammar_is_an_error(fixture_dir, grammar, how):
    r = _api(fixture_dir, grammar, how)
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"
    assert "GrammarError grammar: " in r.stdout, r.stdout
    assert "AFTER '" in r.stdout


def test_python_api_every_unparsable_grammar(fixture_dir):
    code = f"""
import pymoecache, llama_cpp
llm = pymoecache.Llama({str(model_path(fixture_dir, QWEN))!r}, verbose=False)
for text in {UNPARSABLE + NUL_ONLY!r}:
    try:
        llm("Hello", max_tokens=2, grammar=llama_cpp.LlamaGrammar.from_string(text, verbose=False))
        print("ACCEPTED", text)
    except pymoecache.GrammarError as e:
        print("REFUSED", e)
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"
    assert r.stdout.count("REFUSED grammar: ") == len(UNPARSABLE + NUL_ONLY), r.stdout


def test_python_api_good_grammar_constrains(fixture_dir):
    r = _api(fixture_dir, 'root ::= "yes" | "no"')
    assert r.returncode == 0, r.stderr[-2000:]
    assert "TEXT 'yes'" in r.stdout or "TEXT 'no'" in r.stdout, r.stdout


def test_cli_grammar_options(fixture_dir, tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "pymoecache", *map(str, args)], cwd=ROOT, capture_output=True,
                              text=True, timeout=300)

    m = model_path(fixture_dir, QWEN)
    r = cli("run", m, "-p", "Answer:", "-n", "4", "--grammar", 'root ::= "yes" | "no"')
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[0].removeprefix("Answer:") in ("yes", "no"), r.stdout
    for bad in (UNPARSABLE[0], NUL_ONLY[0]):
        r = cli("run", m, "-p", "Answer:", "-n", "4", "--grammar", bad)
        assert r.returncode == 2 and "error: grammar: " in r.stderr, (r.returncode, r.stderr)
    f = tmp_path / "g.gbnf"
    f.write_text('root ::= "maybe"\n')
    r = cli("run", m, "-p", "Answer:", "-n", "4", "--grammar-file", f)
    assert r.returncode == 0 and r.stdout.startswith("Answer:maybe"), (r.stdout, r.stderr)
    r = cli("run", m, "-p", "x", "--grammar-file", tmp_path / "missing.gbnf")
    assert r.returncode == 2 and "cannot read grammar file" in r.stderr
    r = cli("chat", m, "--grammar", "root ::= ((")
    assert r.returncode == 2 and "error: grammar: " in r.stderr, r.stderr
