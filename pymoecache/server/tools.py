"""Tool calls on ``/v1/chat/completions``: in the chat template's own format where it is Hermes' (below), else in
llama-server's generic format: with ``tools`` and ``tool_choice`` absent, ``"auto"`` or ``"required"``, the model
is shown the tools in a system message and answers in JSON that a grammar holds it to, ``{"tool_call": {"name":
..., "arguments": {...}}}`` (or, under auto, ``{"response": "..."}``);
the answer's JSON becomes OpenAI's ``tool_calls`` (finish_reason ``"tool_calls"``) or its text. An assistant
message that called a tool, and the tool's answer (role ``tool``), go back to the model in the same words.

Where the chat template is a Jinja one that speaks Hermes' tool format (Qwen2 to Qwen3, Hermes: it names ``tools`` and
writes ``<tool_call>``), the template is given the tools and the conversation as they are, and the answer is read in
that format instead: each ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` is a call, the text around them
the content; under ``"required"`` a grammar holds the answer to one such call (:func:`template_format`).

A request naming one function (``tool_choice: {"type": "function", ...}``) keeps llama-cpp-python's path, which
constrains the answer to that function's arguments; ``"none"`` sends no tools.

    >>> plan = plan_request({"messages": [{"role": "user", "content": "Weather?"}], "tool_choice": "required",
    ...                      "tools": [{"type": "function", "function": {"name": "get_weather", "parameters":
    ...                                 {"type": "object", "properties": {"city": {"type": "string"}}}}}]})
    >>> plan.names, plan.required, "tools" in plan.request, plan.request["messages"][0]["role"]
    (['get_weather'], True, False, 'system')
    >>> answer(plan, {"choices": [{"index": 0, "message": {"role": "assistant", "content":
    ...     '{"tool_call": {"name": "get_weather", "arguments": {"city": "Oslo"}}}'}, "finish_reason": "stop"}]}
    ...        )["choices"][0]["message"]["tool_calls"][0]["function"]
    {'name': 'get_weather', 'arguments': '{"city": "Oslo"}'}
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import List, Optional

from ..grammar import json_schema_grammar
from ..templates import json_or_text
from .requests import RequestError, check_schema

_INSTRUCTIONS = ("You can call these tools (JSON schemas of their arguments):\n{tools}\n\nAnswer with one JSON object: "
                 '{{"tool_call": {{"name": <a tool\'s name>, "arguments": <its arguments>}}}} to call one{response}.')


GENERIC, HERMES = "generic", "hermes"  # the tool-call formats: llama-server's fallback, Hermes' <tool_call> tags
_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


@dataclass
class ToolPlan:
    request: dict                      # the request as the model gets it (generic: the tools in a system message)
    names: List[str] = field(default_factory=list)
    required: bool = False             # tool_choice "required": the answer is a call
    format: str = GENERIC              # how the answer is read (GENERIC, HERMES)


def template_format(template) -> str:
    """The tool-call format of a chat template (a :class:`~pymoecache.templates.ChatTemplate`, or None): HERMES for
    a Jinja template that is given ``tools`` and writes ``<tool_call>`` (Qwen2 to Qwen3, Hermes 2/3), else GENERIC.

    >>> from types import SimpleNamespace as T
    >>> template_format(T(text="{% if tools %}<tools>{{ tools }}</tools> <tool_call>{% endif %}")), template_format(None)
    ('hermes', 'generic')
    """
    text = getattr(template, "text", None)
    return _format_of(text) if isinstance(text, str) else GENERIC


@functools.lru_cache(maxsize=4)
def _format_of(text: str) -> str:
    """(looked at once per template, not per request)"""
    return HERMES if "<tool_call>" in text and re.search(r"\btools\b", text) else GENERIC


def _tools(d: dict) -> list:
    tools = d.get("tools")
    if not isinstance(tools, list) or not tools:
        raise RequestError("'tools' must be a non-empty list of {\"type\": \"function\", \"function\": {...}}", 400,
                           "tools")
    out = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise RequestError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", 400,
                               "tools")
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise RequestError(f"tools[{i}].function.parameters must be a JSON schema object", 400, "tools")
        if params is not None:
            check_schema(params, f"tools[{i}].function.parameters")  # (bounded before its grammar is built)
        out.append(f)
    return out


def _schema(tools: list, required: bool) -> dict:
    calls = [{"type": "object", "properties": {
        "name": {"const": f["name"]},
        "arguments": f.get("parameters") or {"type": "object"}}, "required": ["name", "arguments"]} for f in tools]
    choices = [{"type": "object", "properties": {"tool_call": {"anyOf": calls}}, "required": ["tool_call"]}]
    if not required:
        choices.append({"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"]})
    return {"anyOf": choices} if len(choices) > 1 else choices[0]


def _messages(fmt: str, messages: list) -> list:
    """The conversation in the format's words: generic writes a call and a tool's answer as JSON text; a Hermes
    template writes them itself (ChatTemplate gives it a call's arguments as an object)."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        if calls and (not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                              for c in calls)):
            raise RequestError(f"messages[{i}].tool_calls must be a list of {{\"function\": {{\"name\", "
                               "\"arguments\"}} objects", 400, "messages")
        if calls and fmt == GENERIC:
            calls = [{"name": c["function"].get("name"), "arguments": json_or_text(c["function"].get("arguments"))}
                     for c in calls]
            body = {"tool_call": calls[0]} if len(calls) == 1 else {"tool_calls": calls}
            m = {"role": "assistant", "content": json.dumps(body)}
        elif m.get("role") == "tool" and fmt == GENERIC:
            content = m.get("content")
            text = content if isinstance(content, str) else json.dumps(content)
            m = {"role": "tool", "tool_call_id": str(m.get("tool_call_id") or ""),
                 "content": json.dumps({"tool_response": text})}
        out.append(m)
    return out


def plan_request(d: dict, fmt: str = GENERIC) -> Optional[ToolPlan]:
    """The request the model gets where it asks for tool calls, in the format ``fmt`` (:func:`template_format`; None:
    it does not ask; a request naming one function stays with llama-cpp-python's path)."""
    choice = d.get("tool_choice")
    if not d.get("tools") or choice == "none" or isinstance(choice, dict):
        if choice == "none":
            d = {k: v for k, v in d.items() if k not in ("tools", "tool_choice")}
            d["messages"] = _messages(fmt, d.get("messages") or [])
            return ToolPlan(request=d)
        return None
    if choice not in (None, "auto", "required"):
        raise RequestError("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                           "\"function\": {\"name\": ...}}", 400, "tool_choice")
    if d.get("stream"):
        raise RequestError("tool calls are answered whole here: send the request without \"stream\"", 400, "stream")
    if d.get("grammar") is not None or d.get("response_format") not in (None, {"type": "text"}):
        raise RequestError("give 'tools' or a grammar / response_format, not both", 400, "tools")
    tools = _tools(d)
    required = choice == "required"
    if fmt == HERMES:
        return _hermes_plan(d, tools, required)
    listing = json.dumps([{"name": f["name"], "description": f.get("description", ""),
                           "parameters": f.get("parameters") or {"type": "object"}} for f in tools], indent=1)
    text = _INSTRUCTIONS.format(tools=listing, response="" if required else
                                ', or {"response": <your answer>} to answer without one')
    messages = _messages(GENERIC, d.get("messages") or [])
    if messages and messages[0].get("role") in ("system", "developer") and isinstance(messages[0].get("content"), str):
        messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + text}
    else:
        messages.insert(0, {"role": "system", "content": text})
    req = {k: v for k, v in d.items() if k not in ("tools", "tool_choice")}
    req.update(messages=messages, grammar=json_schema_grammar(_schema(tools, required)))
    return ToolPlan(request=req, names=[f["name"] for f in tools], required=required)


def _hermes_plan(d: dict, tools: list, required: bool) -> ToolPlan:
    """The request as it goes to a Hermes template: the tools and messages as they are; under required, a grammar of
    one ``<tool_call>``."""
    req = {k: v for k, v in d.items() if k != "tool_choice"}
    req["messages"] = _messages(HERMES, d.get("messages") or [])
    if required:
        call = json_schema_grammar(_schema(tools, True)["properties"]["tool_call"])
        req["grammar"] = ('root ::= "<tool_call>\\n" tool-call-body "\\n</tool_call>"\n'
                          + re.sub(r"^root ::=", "tool-call-body ::=", call, flags=re.M))
    return ToolPlan(request=req, names=[f["name"] for f in tools], required=required, format=HERMES)


def _hermes_calls(text: str):
    """(the calls, the text around them) of an answer in Hermes' format; no calls where a block is not a JSON
    object with a name (the text stays as it is).

    >>> _hermes_calls('Let me look.\\n<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>')
    ([{'name': 'f', 'arguments': {'x': 1}}], 'Let me look.')
    """
    calls = []
    for block in _HERMES_CALL.findall(text):
        try:
            c = json.loads(block)
        except ValueError:
            return [], text
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            return [], text
        calls.append(c)
    return calls, _HERMES_CALL.sub("", text).strip() if calls else text


def _as_openai_calls(calls: list) -> list:
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c.get("name"), "arguments": json.dumps(c.get("arguments", {}))}} for c in calls]


def answer(plan: ToolPlan, result: dict) -> dict:
    """The model's answer as OpenAI's: ``tool_calls`` (finish_reason "tool_calls") and the text beside them (generic:
    the response's text)."""
    if not plan.names:
        return result
    for choice in result.get("choices") or ():
        msg = choice.get("message") or {}
        if plan.format == HERMES:
            calls, text = _hermes_calls(msg.get("content") or "")
            if calls:
                msg.update(tool_calls=_as_openai_calls(calls), content=text or None)
                choice["finish_reason"] = "tool_calls"
            continue
        try:
            got = json.loads(msg.get("content") or "")
        except ValueError:  # (cut short by max_tokens: the text as it is)
            continue
        if not isinstance(got, dict):
            continue
        calls = got.get("tool_calls") if isinstance(got.get("tool_calls"), list) else \
            [got["tool_call"]] if isinstance(got.get("tool_call"), dict) else None
        if calls:
            msg["tool_calls"] = _as_openai_calls(calls)
            msg["content"] = None
            choice["finish_reason"] = "tool_calls"
        elif isinstance(got.get("response"), str):
            msg["content"] = got["response"]
    return result
