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
from typing import List, Optional

from .errors import ConfigError

MAX_TEMPLATE_BYTES = 1 << 20


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

    def _jinja(self):
        import jinja2
        import llama_cpp

        vocab = self.llm._model.vocab
        piece = (lambda tok: self.llm.detokenize([tok], special=True).decode("utf-8", "replace") if tok >= 0 else "")
        self._bos = piece(llama_cpp.llama_vocab_bos(vocab))
        try:
            return llama_cpp.llama_chat_format.Jinja2ChatFormatter(
                template=self.text, eos_token=piece(llama_cpp.llama_vocab_eos(vocab)), bos_token=self._bos,
                add_generation_prompt=True)
        except jinja2.TemplateError as e:
            raise ConfigError(f"{self.label} is not a valid Jinja template: {type(e).__name__}: {e}") from None

    def render(self, messages: List[dict]) -> "tuple[str, bool]":
        """(the prompt, whether it already begins with the model's BOS: a Jinja template may write
        ``bos_token`` itself; tokenize without adding one then). ConfigError where the template cannot
        render these messages."""
        if self._formatter is not None:
            import jinja2

            try:
                r = self._formatter(messages=[{**m, "content": _text(m.get("content"))} for m in messages])
            except jinja2.TemplateError as e:
                raise ConfigError(f"{self.label} could not render the conversation: {type(e).__name__}: {e}") from None
            return r.prompt, bool(self._bos) and r.prompt.startswith(self._bos)
        text = apply_builtin(self.name, messages)
        if text is None:
            raise ConfigError(f"llama.cpp could not apply {self.label}")
        return text, False

    def tokens(self, messages: List[dict]) -> List[int]:
        prompt, special = self.render(messages)
        return self.llm.tokenize(prompt.encode("utf-8"), add_bos=not special, special=True)

    def handler(self):
        """A llama-cpp-python chat handler (``Llama.chat_handler``) that renders with this template."""
        import llama_cpp

        def format(messages, **kwargs):
            prompt, special = self.render(messages)
            return llama_cpp.llama_chat_format.ChatFormatterResponse(prompt=prompt, added_special=special)

        return llama_cpp.llama_chat_format.chat_formatter_to_chat_completion_handler(format)


def _read_template(path: str) -> str:
    from .files import read_user_text

    text = read_user_text(path, "--chat-template-file", MAX_TEMPLATE_BYTES, ConfigError)
    if not text.strip():
        raise ConfigError(f"--chat-template-file {path} is empty")
    return text
