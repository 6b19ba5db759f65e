"""``pymoecache chat``: an interactive conversation with the expert cache, as ``llama-cli -cnv``.

    pymoecache chat [MODEL] --prior 0.5 -sys "You are a helpful assistant."

The turns are rendered with the model's chat template by llama.cpp itself
(``llama_chat_apply_template``, ChatML when the model has none), answers stream token by token,
and the KV cache of earlier turns is reused. Commands: /stats, /routing SPEC, /clear, /regen,
/read FILE, /save FILE, /help, /quit. Ctrl-C stops the current answer, Ctrl-D leaves (also typed
while an answer streams: the answer stops and the chat ends; lines typed ahead become the next
messages). When the conversation outgrows the context, the oldest turns are dropped, with a notice.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import threading
from typing import List, Optional

from .options import (UserError, add_conversation_options, add_hub_options, add_model_argument, add_prompt_cache_options,
                      add_routing_options, add_runtime_options, add_sampling_options, chat_template_from_args,
                      check_profile_args, load_profile_from_args, prompt_cache_from_args, prompt_text, read_text_file,
                      resolve_model, routing_from_args, sampling_kwargs, save_profile_from_args, system_prompt,
                      use_color)

HELP = """commands:
  /stats          cache statistics so far, and since the last /stats
  /routing [SPEC] show or switch the routing policy (lru, prior:0.5, max-rank:4, ...) from the next token on
  /clear          forget the conversation (the expert cache keeps its contents; also /reset)
  /regen          answer the last message again (a new sample)
  /read FILE      send a UTF-8 text file as your message
  /save FILE      write the conversation as JSON ({"messages": [{role, content}, ...]})
  /help           this text
  /quit           leave (or Ctrl-D); Ctrl-C stops an answer
  end a line with \\ to continue the message on the next line"""


class Conversation:
    """The messages of one conversation, rendered by the chat template (pymoecache.templates: the
    model's own as llama.cpp applies it unless --jinja, --chat-template or --chat-template-file say
    otherwise) and kept within the context: :meth:`fit` drops the oldest turns (never the system
    prompt) when needed."""

    def __init__(self, llm, system: Optional[str] = None, template=None):
        from ..templates import ChatTemplate

        self.llm = llm
        self.system = system
        self.messages: List[dict] = []
        self.n_answers = 0  # answers drawn so far (each draws with its own seed)
        self.template = template if template is not None else ChatTemplate(llm)
        if self.template.fallback:
            print(f"pymoecache chat: using {self.template.label}", file=sys.stderr)

    def all_messages(self) -> List[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.messages

    def prompt(self) -> str:
        """The whole conversation so far, ending where the assistant's answer begins."""
        return self.template.render(self.all_messages())[0]

    def tokens(self) -> List[int]:
        return self.template.tokens(self.all_messages())

    def n_tokens(self) -> int:
        return len(self.tokens())

    def fit(self, reserve: int) -> int:
        """Drop the oldest turns until the prompt plus ``reserve`` tokens fit the context; the number
        dropped. UserError when the last message alone (with the system prompt) does not fit."""
        n_ctx = self.llm.n_ctx()
        dropped = 0
        while self.n_tokens() + reserve > n_ctx:
            if len(self.messages) <= 1:
                n = self.n_tokens()
                self.messages.clear()
                raise UserError(f"the message ({n} tokens with the template) does not leave room for an answer in "
                                f"the context of {n_ctx} tokens: shorten it or raise -c")
            del self.messages[:2 if len(self.messages) > 2 and self.messages[1]["role"] == "assistant" else 1]
            dropped += 1
        return dropped


def _read_message(prompt: str, end: str = "") -> str:
    """One message from the user; a line ending in a backslash continues on the next line. ``end``
    is written once the message is in (or input stopped): the reset of -co's colour, which the
    prompt leaves on so that the typed text shows in it, as llama-cli shows it."""
    lines = []
    try:
        while True:
            line = input(prompt if not lines else "")
            if line.endswith("\\"):
                lines.append(line[:-1])
                continue
            lines.append(line)
            return "\n".join(lines)
    finally:
        if end:
            sys.stdout.write(end)
            sys.stdout.flush()


class _Interrupt:
    """Ctrl-C while an answer streams sets a flag (checked after each token) instead of raising
    inside llama.cpp's decode loop; the previous handler comes back afterwards."""

    def __init__(self):
        self.hit = False
        self._old = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        self.hit = True

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
        return False


class _TypedAhead:
    """What the user types while an answer streams. The terminal is in its line mode then (readline
    only takes it over inside input()), so it holds whole lines and Ctrl-D, which input() would
    lose: a read that returns nothing is Ctrl-D; lines become the next messages."""

    def __init__(self, fd: Optional[int]):
        self.fd, self.lines, self.eof = fd, [], False

    def poll(self) -> None:
        while self.fd is not None and not self.eof and select.select([self.fd], [], [], 0)[0]:
            data = os.read(self.fd, 65536)
            if not data:
                self.eof = True
                break
            self.lines += [line for line in data.decode("utf-8", "replace").splitlines() if line.strip()]


def say(*parts) -> None:
    """A line for the user on stderr, at once (answers go to stdout)."""
    print(*parts, file=sys.stderr, flush=True)


def answer(llm, conv: Conversation, args, out, typed: Optional[_TypedAhead] = None) -> str:
    """Stream the assistant's answer to the conversation so far; the text (partial if stopped)."""
    n_ctx = llm.n_ctx()
    reserve = args.n if args.n > 0 else min(128, n_ctx // 4)
    dropped = conv.fit(reserve)
    if dropped:
        print(f"[context of {n_ctx} tokens full: dropped the oldest {dropped} turn{'s' * (dropped > 1)}]",
              file=sys.stderr, flush=True)
    prompt = conv.prompt()
    if args.verbose_prompt:
        say(f"[prompt]\n{prompt}\n[/prompt]")
    text, finish = [], None
    with _Interrupt() as stop:
        kw = sampling_kwargs(args, llm)
        kw["seed"] = (args.seed + conv.n_answers) % 2**32  # each answer its own draw, as llama.cpp's one sampler
        conv.n_answers += 1
        stream = llm.create_completion(conv.tokens(), max_tokens=args.n if args.n > 0 else None, stream=True, **kw)
        try:
            for chunk in stream:
                piece = chunk["choices"][0]["text"]
                finish = chunk["choices"][0].get("finish_reason") or finish
                text.append(piece)
                out.write(piece)
                out.flush()
                if typed is not None:
                    typed.poll()
                if stop.hit or (typed is not None and typed.eof):
                    break
        finally:
            stream.close()
    out.write("\n")
    if stop.hit or (typed is not None and typed.eof):
        say("[stopped]")
    elif finish == "length" and args.n <= 0:
        print(f"[the answer filled the context of {n_ctx} tokens; older turns are dropped next]", file=sys.stderr,
              flush=True)
    return "".join(text)


def save_conversation(conv: Conversation, path: str) -> int:
    """/save FILE: the messages as JSON (OpenAI's list of {role, content}), written whole or not at
    all; the number written. UserError when the file cannot be written."""
    import json

    from ..files import write_atomic

    messages = conv.all_messages()
    data = (json.dumps({"messages": messages}, ensure_ascii=False, indent=1) + "\n").encode("utf-8")
    write_atomic(path, data, "conversation file", UserError)
    return len(messages)


def cmd_chat(args) -> int:
    from ..config import parse_routing
    from ..errors import Error
    from .loading import cache_line, llama_from_args, miss_asked, print_plan

    routing = routing_from_args(args)
    args.system = system_prompt(args)
    first = prompt_text(args)  # the first user message, sent before anything is read
    pending = [first] if first is not None else []
    check_profile_args(args)
    model = resolve_model(args.model, args)
    prompts = prompt_cache_from_args(args)  # (a bad directory: said before the model loads)
    llm = llama_from_args(args, routing, model, dense_ok=True)
    llm.set_prompt_cache(prompts)
    if llm.moecache is None and args.profile:
        llm.close()
        raise UserError(f"{model} is a dense model: --profile records experts, and it has none")
    note = load_profile_from_args(args, llm)
    if note:
        say(note)
    sampling_kwargs(args, llm)  # a bad --grammar is an error now, not at the first answer
    conv = Conversation(llm, args.system or None, chat_template_from_args(args, llm))
    print_plan(llm, asked=miss_asked(args))
    out = sys.stdout
    interactive = sys.stdin.isatty()
    color = use_color(args)
    # -co: the "> " marker and what is typed after it in green, as llama-cli (\001 \002: readline skips them)
    green, reset = ("\001\x1b[32m\002", "\x1b[0m") if color else ("", "")
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    print(f"pymoecache chat: {model} {cache_line(llm, routing.spec())} seed {args.seed}\n"
          "/help for commands; Ctrl-C stops an answer, Ctrl-D leaves", file=sys.stderr, flush=True)
    dense = llm.moecache is None
    last = llm.moe_stats() if not dense else None
    typed = _TypedAhead(sys.stdin.fileno() if interactive else None)
    answered = 0

    def reply_to_last() -> None:
        nonlocal answered
        if not dense:
            llm.moecache.begin_request()  # each answer is one request (the profile, activation eviction)
        try:
            reply = answer(llm, conv, args, out, typed)
        except UserError as e:
            say(f"error: {e}")
            return
        except KeyboardInterrupt:  # Ctrl-C before the answer streamed (a long message being read in)
            out.write("\n")
            if conv.messages and conv.messages[-1]["role"] == "user":
                conv.messages.pop()
            say("(interrupted: that message was not sent; Ctrl-D or /quit leaves)")
            return
        conv.messages.append({"role": "assistant", "content": reply})
        answered += 1

    while not (args.single_turn and answered):
        typed.poll()
        if typed.eof:  # Ctrl-D typed while the last answer streamed
            out.write("\n")
            break
        try:
            if pending:
                line = pending.pop(0)
                say(f"{green.strip(chr(1) + chr(2))}> {line}{reset}")
            elif typed.lines:
                line = typed.lines.pop(0)
                say(f"{green.strip(chr(1) + chr(2))}> {line}{reset}")
            else:
                line = _read_message(green + "> ", reset)
            line.encode("utf-8")  # stdin may hand undecodable bytes over as surrogates
        except EOFError:
            out.write("\n")
            break
        except KeyboardInterrupt:
            out.write("\n")
            say("(Ctrl-D or /quit leaves)")
            continue
        except UnicodeError:  # bytes that are not UTF-8 (a terminal in another encoding, a binary pipe)
            print("error: that line is not UTF-8 text; it was not sent (set the terminal to UTF-8)",
                  file=sys.stderr, flush=True)
            continue
        cmd, _, rest = line.strip().partition(" ")
        rest = rest.strip()
        if not line.strip():
            continue
        if cmd in ("/quit", "/exit", "/bye"):
            break
        if cmd == "/help":
            say(HELP)
        elif cmd in ("/stats", "/routing") and dense:
            say("a dense model: no expert cache, no routing to show or change")
        elif cmd == "/stats":
            st = llm.moe_stats()
            d = st.since(last)
            print(f"{cache_line(llm, routing.spec())} {st.summary()}\n"
                  f"since the last /stats: {d.tokens} tokens, hit rate {100 * d.hit_rate:.1f}%, "
                  f"misses/token {d.misses_per_token:.2f}", file=sys.stderr, flush=True)
            last = st
        elif cmd == "/routing":
            if rest:
                try:
                    new = parse_routing(rest)
                    llm.set_routing(new)
                except Error as e:
                    say(f"error: {e}")
                    continue
                routing = new
            say(f"routing: {routing.spec()}")
        elif cmd in ("/clear", "/reset"):
            conv.messages.clear()
            say("conversation cleared (the expert cache keeps its contents)")
        elif cmd == "/regen":
            if not conv.messages or conv.messages[-1]["role"] != "assistant":
                say("nothing to regenerate: no answer yet")
                continue
            conv.messages.pop()
            reply_to_last()
        elif cmd == "/read":
            if not rest:
                say("/read needs a file: /read notes.txt")
                continue
            try:
                text = read_text_file(rest, "file", llm.n_ctx())
            except UserError as e:
                say(f"error: {e}")
                continue
            say(f"[{rest}: {len(text)} characters sent as your message]")
            conv.messages.append({"role": "user", "content": text})
            reply_to_last()
        elif cmd == "/save":
            if not rest:
                say("/save needs a file: /save chat.json")
                continue
            try:
                n = save_conversation(conv, rest)
            except UserError as e:
                say(f"error: {e}")
                continue
            say(f"[{n} message{'s' * (n != 1)} saved to {rest}]")
        elif cmd.startswith("/") and " " not in cmd and cmd[1:].isalpha():
            say(f"unknown command {cmd}; /help lists them")
        else:
            conv.messages.append({"role": "user", "content": line})
            reply_to_last()
    print(f"{cache_line(llm, routing.spec())} {llm.moe_stats().summary() if not dense else ''}".rstrip(),
          file=sys.stderr, flush=True)
    save_profile_from_args(args, llm)
    llm.close()
    return 0


def add_command(sub) -> None:
    """Register ``chat`` on the CLI's subparsers."""
    c = sub.add_parser(
        "chat", help="interactive conversation with the model's chat template (like llama-cli -cnv)",
        description="Talk with the model: each line you type is a user message, the answer streams back. The "
                    "conversation is rendered with the model's chat template (ChatML if it has none) and kept "
                    "within the context: the oldest turns are dropped, with a notice.\n\n" + HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_argument(c)
    c.add_argument("-p", "--prompt", default=None, metavar="TEXT",
                   help="the first user message, sent before the first line is read, as llama-cli's -p in its "
                        "conversation mode (default: none)")
    c.add_argument("-f", "--file", default=None, metavar="FILE",
                   help="the first user message read from a UTF-8 text file (default: none)")
    c.add_argument("-n", "--n-predict", "--predict", dest="n", type=int, default=-1, metavar="N",
                   help="most tokens per answer; -1 = until the model ends its turn or the context is full "
                        "(default %(default)s)")
    add_conversation_options(c)
    add_runtime_options(c)
    add_prompt_cache_options(c)
    add_sampling_options(c, temp_default=0.8)
    add_hub_options(c)
    add_routing_options(c, profile=True)
    c.set_defaults(func=cmd_chat)
