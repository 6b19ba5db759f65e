"""Chat templates, chosen as llama.cpp's tools choose them, for ``run --chat``, ``chat`` and ``serve``.

* ``--chat-template NAME``: one of llama.cpp's built-in templates (``chatml``, ``llama3``, ...),
  applied by llama.cpp (``llama_chat_apply_template``).
* ``--chat-template-file FILE``: a Jinja template, rendered by llama-cpp-python's Jinja formatter.
* ``--jinja``: the model's own template, rendered by Jinja (``serve`` does this by default, as
  llama-cpp-python's server always has).
* none: the model's own template as llama.cpp applies it (llama-cli's default); a model without one,
  or with one llama.cpp does not know, gets ChatML, and the choice says so (never llama-2 by guess).

>>> ChatTemplate.__doc__.split(":")[0]
'How messages become a prompt'
"""

from __future__ import annotations

import ctypes
import difflib
import functools
import logging
import sys
import time
from typing import List, Optional

from .errors import ConfigError

MAX_TEMPLATE_BYTES = 1 << 20
RENDER_SECONDS = 5.0  # a Jinja render's time bound (a template's own loops can run for ever)
RENDER_MIN_BYTES = 1 << 16  # its size bound is the context's bytes: 32 per position, at least this
# ChatML as a Jinja template: what llama.cpp's built-in "chatml" writes, for readers of /props
CHATML_JINJA = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


class TemplateBoundError(Exception):
    """A Jinja render went past its size or time bound."""


def _with_deadline(fn, seconds: float):
    """``fn()``, stopped with TemplateBoundError after ``seconds``: a line tracer on the template's own
    code (compiled Jinja, file "<template>") looks at the clock every 256 lines it runs."""
    deadline = time.monotonic() + seconds
    n = 0

    def in_template(frame, event, arg):
        nonlocal n
        n += 1
        if not n & 255 and time.monotonic() > deadline:
            raise TemplateBoundError(f"the render ran past {seconds:g} s")
        return in_template

    def calls(frame, event, arg):
        return in_template if frame.f_code.co_filename == "<template>" else None

    old = sys.gettrace()
    sys.settrace(calls)
    try:
        return fn()
    finally:
        sys.settrace(old)


@functools.lru_cache(maxsize=1)
def bounded_formatter():
    """llama-cpp-python's Jinja chat formatter rendering in a sandbox bounded in size and time: a
    string or list made by ``*`` or ``+``, or an integer argument of a call, past ``max_bytes`` stops
    the render, and so does a render longer than ``max_seconds``. (A class made on first use: llama_cpp
    is imported only once pymoecache has loaded its library.)"""
    import jinja2
    import llama_cpp
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    class _Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "+", "**"])
        max_bytes = RENDER_MIN_BYTES

        def _size(self, x) -> int:
            return len(x) if isinstance(x, (str, bytes, list, tuple)) else 0

        def call_binop(self, context, operator, left, right):
            big = None
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if self._size(seq) and isinstance(n, int) and self._size(seq) * max(n, 0) > self.max_bytes:
                        big = self._size(seq) * n
            elif operator == "+" and self._size(left) + self._size(right) > self.max_bytes:
                big = self._size(left) + self._size(right)
            elif operator == "**" and isinstance(right, int) and abs(right) > 4096:
                raise SecurityError(f"{left!r:.20} ** {right}: an exponent past 4096")
            if big is not None:
                raise SecurityError(f"a value of {big} items, past the bound of {self.max_bytes}")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's own signature)
            for a in list(args) + list(kwargs.values()):
                if isinstance(a, int) and not isinstance(a, bool) and a > __self.max_bytes:
                    raise SecurityError(f"an argument of {a}, past the bound of {__self.max_bytes}")
            return super().call(__context, __obj, *args, **kwargs)

    base = llama_cpp.llama_chat_format.Jinja2ChatFormatter

    class BoundedJinjaFormatter(base):
        max_bytes = RENDER_MIN_BYTES
        max_seconds = RENDER_SECONDS

        def __init__(self, template: str, *args, **kwargs):
            super().__init__(template, *args, **kwargs)
            env = _Sandbox(loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True,
                           extensions=[base.IgnoreGenerationTags, jinja2.ext.loopcontrols])
            env.filters["tojson"] = self.tojson
            env.max_bytes = self.max_bytes
            self._sandbox = env
            self._environment = _CountedTemplate(env.from_string(self.template), self)

        def bound(self, max_bytes: int) -> None:
            self.max_bytes = self._sandbox.max_bytes = max_bytes

        def __call__(self, *args, **kwargs):
            r = _with_deadline(lambda: super(BoundedJinjaFormatter, self).__call__(*args, **kwargs), self.max_seconds)
            if len(r.prompt) > self.max_bytes:
                raise TemplateBoundError(f"the prompt of {len(r.prompt)} bytes is past the bound of {self.max_bytes}")
            return r

    return BoundedJinjaFormatter


@functools.lru_cache(maxsize=1)
def tolerant_formatter():
    """The Jinja formatter ``pymoecache.Llama`` installs for the duration of a load. llama-cpp-python compiles
    every chat template of a GGUF while it loads the model, and a template its Jinja cannot parse would abort
    the load: with this one such a template loads, warns once, and fails only when used. It renders in
    :func:`bounded_formatter`'s sandbox; its errors are ConfigErrors. (A class made on first use.)"""
    class TolerantChatFormatter(bounded_formatter()):
        def __init__(self, template: str, *args, **kwargs):
            import jinja2

            try:
                super().__init__(template, *args, **kwargs)
                self.error = None
            except jinja2.TemplateError as e:
                self.template, self.error = template, f"{type(e).__name__}: {e}"
                logging.getLogger("pymoecache").warning(
                    "the model's chat template is not valid Jinja (%s): create_chat_completion needs chat_format= or "
                    "a chat_handler; `pymoecache chat` uses llama.cpp's own templates", self.error)

        def __call__(self, *args, **kwargs):
            if self.error is not None:
                raise ConfigError(f"the model's chat template cannot be used ({self.error}): pass chat_format= "
                                  "(e.g. 'chatml') or a chat_handler to pymoecache.Llama")
            try:
                return super().__call__(*args, **kwargs)
            except Exception as e:  # the template's own errors, its size and time bounds
                raise ConfigError(f"the model's chat template could not render the conversation: {type(e).__name__}: "
                                  f"{str(e)[:300]}") from None

    return TolerantChatFormatter


class _CountedTemplate:
    """A Jinja template whose ``render`` counts its output as it is made (``generate``) and stops it past
    its formatter's ``max_bytes``: a loop of pieces each under the bound is stopped at the bound, not
    after gigabytes and the time bound."""

    def __init__(self, template, formatter):
        self.template, self.formatter = template, formatter

    def render(self, *args, **kwargs) -> str:
        out, n = [], 0
        for piece in self.template.generate(*args, **kwargs):
            n += len(piece)
            if n > self.formatter.max_bytes:
                raise TemplateBoundError(f"the prompt grew past the bound of {self.formatter.max_bytes} bytes")
            out.append(piece)
        return "".join(out)


def builtin_names() -> List[str]:
    """llama.cpp's built-in template names (``llama_chat_builtin_templates``)."""
    import llama_cpp

    n = llama_cpp.llama_chat_builtin_templates(None, 0)
    names = (ctypes.c_char_p * n)()
    llama_cpp.llama_chat_builtin_templates(names, n)
    return [x.decode() for x in names]


def apply_builtin(template: bytes, messages: List[dict], add_assistant: bool = True) -> Optional[str]:
    """``messages`` through llama.cpp's ``llama_chat_apply_template`` (``template``: a built-in name or a
    template llama.cpp recognizes); None where llama.cpp does not know the template."""
    import llama_cpp

    keep = [(m["role"].encode("utf-8"), _text(m.get("content")).encode("utf-8")) for m in messages]  # alive for the call
    chat = (llama_cpp.llama_chat_message * len(keep))(*[llama_cpp.llama_chat_message(r, c) for r, c in keep])
    size = 2 * sum(len(r) + len(c) for r, c in keep) + 1024
    for _ in range(2):
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_chat_apply_template(template, chat, len(keep), add_assistant, buf, size)
        if n < 0:
            return None
        if n <= size:
            return buf.raw[:n].decode("utf-8", errors="replace")
        size = n + 1
    return None


def _for_jinja(m: dict) -> dict:
    """A message as Jinja templates take it: its content as text, and the arguments of its tool calls (OpenAI's
    JSON strings) as objects, which templates write with ``tojson``."""
    m = {**m, "content": _text(m.get("content"))}
    calls = m.get("tool_calls")
    if isinstance(calls, list):
        m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json_or_text(c["function"].get("arguments"))}}
                           if isinstance(c, dict) and isinstance(c.get("function"), dict) else c for c in calls]
    return m


def json_or_text(v):
    """``v`` parsed where it is a string of JSON, else as it is."""
    import json

    if isinstance(v, str):
        try:
            return json.loads(v)
        except ValueError:
            pass
    return v


def _text(content) -> str:
    """A message's content as text: a string, or OpenAI's list of parts (their text joined), or none."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text")
    return str(content)


class ChatTemplate:
    """How messages become a prompt: ``kind`` is "builtin" (llama.cpp applies ``name``, a built-in
    name or the model's template) or "jinja" (``text`` rendered by Jinja); ``label`` says which, for
    the user. ConfigError for an unknown name, an unreadable or invalid file, or both at once.

    >>> ChatTemplate(llm, name="chatml").render([{"role": "user", "content": "Hi"}])  # doctest: +SKIP
    ('<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n', False)
    """

    def __init__(self, llm, *, name: Optional[str] = None, file: Optional[str] = None, jinja: bool = False,
                 default_jinja: bool = False):
        import llama_cpp

        self.llm, self.kind, self.name, self.text, self.fallback = llm, "builtin", None, None, False
        if name is not None and file is not None:
            raise ConfigError("give --chat-template NAME or --chat-template-file FILE, not both")
        if name is not None:
            names = builtin_names()
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1)
                raise ConfigError(f"--chat-template {name!r} is not one of llama.cpp's built-in templates"
                                  + (f"; did you mean {close[0]!r}?" if close else "")
                                  + f" (they are: {', '.join(names)})")
            self.name, self.label = name.encode(), f"llama.cpp's built-in template '{name}'"
        elif file is not None:
            self.kind, self.text, self.label = "jinja", _read_template(file), f"{file} (Jinja)"
        else:
            model = llama_cpp.llama_model_chat_template(llm._model.model, None)
            if not model:
                self.name, self.fallback = b"chatml", True
                self.label = "ChatML (the model has no chat template)"
            elif jinja or default_jinja:
                self.kind, self.text = "jinja", model.decode("utf-8", "replace")
                self.label = "the model's chat template (Jinja)"
            elif apply_builtin(model, [{"role": "user", "content": "x"}]) is None:
                self.name, self.fallback = b"chatml", True
                self.label = ("ChatML: llama.cpp does not know this model's chat template (--jinja renders it with "
                              "Jinja)")
            else:
                self.name, self.label = model, "the model's chat template"
        self._formatter = self._jinja() if self.kind == "jinja" else None
        if self._formatter is not None:  # a template that cannot render one user message is refused now
            try:
                self.render([{"role": "user", "content": "Hello"}])
            except ConfigError as e:
                raise ConfigError(f"{e} (a probe conversation of one user message); give another template "
                                  "(--chat-template NAME takes one of llama.cpp's)") from None

    @property
    def source(self) -> str:
        """The template's text: the Jinja source, the model's template llama.cpp applies, ChatML's as Jinja
        (:data:`CHATML_JINJA`), or the name of another built-in template (llama.cpp's are code)."""
        if self.text is not None:
            return self.text
        return CHATML_JINJA if self.name == b"chatml" else self.name.decode("utf-8", "replace")

    def _jinja(self):
        import jinja2
        import llama_cpp

        vocab = self.llm._model.vocab
        piece = (lambda tok: self.llm.detokenize([tok], special=True).decode("utf-8", "replace") if tok >= 0 else "")
        self._bos, self._eos = piece(llama_cpp.llama_vocab_bos(vocab)), piece(llama_cpp.llama_vocab_eos(vocab))
        try:
            f = bounded_formatter()(template=self.text, eos_token=self._eos,
                                    bos_token=self._bos, add_generation_prompt=True)
        except (jinja2.TemplateError, RecursionError, MemoryError) as e:
            raise ConfigError(f"{self.label} is not a valid Jinja template: {type(e).__name__}: {e}") from None
        f.bound(max(RENDER_MIN_BYTES, 32 * self.llm.n_ctx()))  # (a longer prompt cannot fit the context anyway)
        return f

    def render(self, messages: List[dict], tools: Optional[list] = None) -> "tuple[str, bool]":
        """(the prompt, whether it already begins with the model's BOS: a Jinja template may write
        ``bos_token`` itself; tokenize without adding one then). ConfigError where the template cannot
        render these messages. ``tools``: OpenAI's tool list, given to a Jinja template (llama.cpp's
        built-in templates have no tools)."""
        if self._formatter is not None:
            try:
                r = self._formatter(messages=[_for_jinja(m) for m in messages], tools=tools)
            except Exception as e:  # the template's own errors (raise_exception, 1/0, types), its bounds, recursion
                what = "ran past its bounds" if isinstance(e, TemplateBoundError) else "could not render the conversation"
                raise ConfigError(f"{self.label} {what}: {type(e).__name__}: {str(e)[:300]}") from None
            return r.prompt, bool(self._bos) and r.prompt.startswith(self._bos)
        text = apply_builtin(self.name, messages)
        if text is None:
            raise ConfigError(f"llama.cpp could not apply {self.label}")
        return text, False

    def tokens(self, messages: List[dict], tools: Optional[list] = None) -> List[int]:
        prompt, special = self.render(messages, tools)
        return self.llm.tokenize(prompt.encode("utf-8"), add_bos=not special, special=True)

    def handler(self):
        """A llama-cpp-python chat handler (``Llama.chat_handler``) that renders with this template."""
        import llama_cpp

        def format(messages, tools=None, **kwargs):
            prompt, special = self.render(messages, tools)
            stop = [self._eos] if self._formatter is not None and self._eos else None  # (as llama-cpp-python's Jinja)
            return llama_cpp.llama_chat_format.ChatFormatterResponse(prompt=prompt, added_special=special, stop=stop)

        return llama_cpp.llama_chat_format.chat_formatter_to_chat_completion_handler(format)


def _read_template(path: str) -> str:
    from .files import read_user_text

    text = read_user_text(path, "--chat-template-file", MAX_TEMPLATE_BYTES, ConfigError)
    if not text.strip():
        raise ConfigError(f"--chat-template-file {path} is empty")
    return text
