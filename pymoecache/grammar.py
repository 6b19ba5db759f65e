"""GBNF grammars are checked here before llama.cpp sees them.

llama-cpp-python hands a grammar to llama.cpp when it builds the sampler and does not look at the
answer: a grammar llama.cpp cannot parse leaves a NULL sampler that crashes the process (SIGSEGV),
and a grammar whose only choice at some point is the NUL character makes llama.cpp throw from
inside sampling (SIGABRT: its grammar engine works on C strings and cannot match NUL). The server,
the CLI and ``pymoecache.Llama`` all call :func:`check_grammar` first, so a bad grammar is a
:class:`~pymoecache.errors.GrammarError`, never a signal.

>>> check_grammar('root ::= "yes" | "no"')
>>> check_grammar('root ::= ((')
Traceback (most recent call last):
...
pymoecache.errors.GrammarError: grammar: not a valid GBNF grammar with a 'root' rule: ...
"""

from __future__ import annotations

import re
from typing import List, Optional, Tuple

from .errors import GrammarError

MAX_CHARS = 128 << 10  # characters of a grammar
MAX_DEPTH = 200        # nested parentheses (llama.cpp's parser recurses once per level)

_QUANTIFIER = re.compile(r"\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")  # a regex's {m}, {m,}, {m,n}

_SIMPLE_ESCAPES = {"n": 10, "r": 13, "t": 9, "\\": 92, '"': 34, "[": 91, "]": 93, "-": 45}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}


def _escape(text: str, i: int) -> Tuple[int, int]:
    """The code point of the escape at text[i] == '\\\\' and the index after it."""
    c = text[i + 1] if i + 1 < len(text) else ""
    if c in _HEX_ESCAPES:
        n = _HEX_ESCAPES[c]
        digits = text[i + 2:i + 2 + n]
        try:
            return int(digits, 16), i + 2 + len(digits)
        except ValueError:
            return -1, i + 2  # llama.cpp's parser reports it
    return _SIMPLE_ESCAPES.get(c, ord(c) if c else -1), i + 2


def _scan(text: str) -> Tuple[int, Optional[str]]:
    """(deepest nesting of parentheses, the first construct whose only character is NUL or None),
    reading literals "...", classes [...] and comments as llama.cpp's parser does."""
    depth = deepest = 0
    nul = None
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch == "#":  # a comment, to the end of the line
            while i < n and text[i] not in "\r\n":
                i += 1
        elif ch == '"':
            start, i = i, i + 1
            while i < n and text[i] != '"':
                if text[i] == "\\":
                    cp, i = _escape(text, i)
                else:
                    cp, i = ord(text[i]), i + 1
                if cp == 0 and nul is None:
                    nul = text[start:i + 1][:40]
            i += 1
        elif ch == "[":
            start, i = i, i + 1
            negated = i < n and text[i] == "^"
            i += negated
            points: List[int] = []
            while i < n and text[i] != "]":
                if text[i] == "\\":
                    cp, i = _escape(text, i)
                else:
                    cp, i = ord(text[i]), i + 1
                points.append(cp)
            i += 1
            # [\x00] or [\x00-\x00]: NUL is the only character it matches
            if not negated and points and all(p == 0 or p == ord("-") for p in points) and 0 in points \
                    and nul is None:
                nul = text[start:i][:40]
        else:
            if ch == "(":
                depth += 1
                deepest = max(deepest, depth)
            elif ch == ")":
                depth = max(0, depth - 1)
            i += 1
    return deepest, nul


def check_grammar(text, vocab=None, root: str = "root") -> None:
    """GrammarError unless ``text`` is a GBNF grammar llama.cpp parses, with a ``root`` rule, that
    llama.cpp can sample from. The parse is llama.cpp's own (the sampler llama-cpp-python would
    build, then freed); ``vocab`` (a model's ``llama_vocab *``) is optional: parsing needs none."""
    if not isinstance(text, str) or not text.strip():
        raise GrammarError("grammar: must be a non-empty GBNF grammar string")
    if len(text) > MAX_CHARS:
        raise GrammarError(f"grammar: {len(text)} characters, at most {MAX_CHARS}")
    if "\0" in text:
        raise GrammarError("grammar: contains a NUL character")
    deepest, nul = _scan(text)
    if deepest > MAX_DEPTH:
        raise GrammarError(f"grammar: parentheses nested {deepest} deep, at most {MAX_DEPTH}")
    if nul is not None:
        raise GrammarError(f"grammar: {nul!r} can only match the NUL character (\\x00), which llama.cpp's "
                           "grammar engine cannot produce")
    import llama_cpp

    from ._logtail import take_log_lines

    take_log_lines()
    sampler = llama_cpp.llama_sampler_init_grammar(vocab, text.encode("utf-8"), root.encode("utf-8"))
    if not sampler:
        why = take_log_lines(2)
        raise GrammarError(f"grammar: not a valid GBNF grammar with a {root!r} rule" + (f": {why}" if why else ""))
    llama_cpp.llama_sampler_free(sampler)


def _count(v) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else 0.0


def check_schema_size(schema, limit: int = MAX_CHARS) -> None:
    """GrammarError where a JSON schema asks for more repetitions than a grammar of ``limit`` characters
    holds, before any grammar is built. llama-cpp-python's converter writes every repetition a schema asks
    for out in full (``minLength``/``maxLength``, ``minItems``/``maxItems``, a pattern's ``{m,n}``), at least
    one character each: ``{"type": "string", "minLength": 1000000000}`` would take minutes and gigabytes
    before check_grammar refused the result. The walk is iterative (no recursion on deep schemas).

    >>> check_schema_size({"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 8})
    >>> check_schema_size({"type": "string", "minLength": 10**9})
    Traceback (most recent call last):
    ...
    pymoecache.errors.GrammarError: schema: asks for 1000000000 repetitions (minLength, maxItems, a pattern's {m,n}, ...); its grammar would be larger than 131072 characters
    """
    total, stack = 0.0, [schema]
    while stack and total <= limit:
        x = stack.pop()
        if isinstance(x, dict):
            total += max(_count(x.get("minLength")), _count(x.get("maxLength")))
            total += max(_count(x.get("minItems")), _count(x.get("maxItems")))
            pattern = x.get("pattern")
            if isinstance(pattern, str):
                for m in _QUANTIFIER.finditer(pattern):
                    total += max((float(g) if len(g) < 20 else float("inf")) if g else 0.0 for g in m.groups(""))
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    if total > limit:
        many = f"{total:.0f}" if total < 1e19 else "more than 10^19"
        raise GrammarError(f"schema: asks for {many} repetitions (minLength, maxItems, a pattern's {{m,n}}, ...); "
                           f"its grammar would be larger than {limit} characters")


# any JSON value, as llama.cpp's grammars/json.gbnf: no control character inside a string (JSON has none unescaped),
# whitespace bounded (a newline and at most 20 spaces or tabs), so a model cannot fill max_tokens with it
JSON_GRAMMAR = r'''root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws
ws     ::= | " " | "\n" [ \t]{0,20}
'''


def json_schema_grammar(schema: dict) -> str:
    r"""The GBNF grammar of a JSON schema: llama-cpp-python's converter, with its string characters
    as llama.cpp's converter has them (no control character: its ``[^"\\]`` let a model write a raw
    newline into a string, which ``json.loads`` refuses). Raises what the converter raises.

    >>> [line for line in json_schema_grammar({"type": "string"}).splitlines() if line.startswith("char")]
    ['char ::= [^"\\\\\\x7F\\x00-\\x1F] | "\\\\" (["\\\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])']
    """
    import json

    from llama_cpp.llama_grammar import json_schema_to_gbnf

    return json_schema_to_gbnf(json.dumps(schema)).replace('[^"\\\\]', '[^"\\\\\\x7F\\x00-\\x1F]')
