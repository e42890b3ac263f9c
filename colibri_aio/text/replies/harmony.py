"""gpt-oss's harmony format: a reply is a run of messages, each a header and a body,

    <|channel|>analysis<|message|>Look up the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Rome"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

(the generation prompt ends with ``<|start|>assistant``, so the first header comes without it). The channel
says what a body is: ``analysis`` is reasoning, ``final`` (and ``commentary`` addressed to no one) is content;
a body addressed ``to=functions.NAME`` is a call of NAME with the body as its JSON arguments (the recipient
may come before the channel, as the template writes it, or after). ``<|call|>``, ``<|return|>`` and
``<|end|>`` may be end-of-generation tokens whose text is not shown: a body still open at the end is settled
as if its end had come.
"""
from __future__ import annotations

import re

from colibri_aio.text.replies.base import (ChatSyntax, FunctionSpec, Lark, ReplyDelta, ReplyParser, Tools,
                                           first_marker, make_call)
from colibri_aio.text.sampling import longest_partial_suffix

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
BODY_ENDS = (END, CALL, RETURN, START)
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
FUNCTIONS = "functions."


def body_kind(header: str, tools: bool) -> tuple[str, str]:
    """What the body after ``header`` is: ("call", NAME), ("reasoning", "") or ("content", "")."""
    recipient = _RECIPIENT.search(header)
    if recipient is not None and tools and recipient.group(1).startswith(FUNCTIONS):
        return "call", recipient.group(1)[len(FUNCTIONS):]
    channel = _CHANNEL.search(header)
    if channel is not None and channel.group(1) == "analysis":
        return "reasoning", ""
    return "content", ""


class HarmonyParser(ReplyParser):
    """States: ``header`` (reading a header up to ``<|message|>``), ``body`` (of the kind its header said) and
    ``between`` (after a message's end, before the next ``<|start|>``)."""

    def __init__(self, *, prompt: str, tools: bool) -> None:
        super().__init__()
        self._tools = tools
        self._buf = ""
        self._kind, self._name = "content", ""
        tail = prompt[prompt.rfind(START) + len(START):] if START in prompt else ""
        if MESSAGE in tail:     # the prompt opened a message (e.g. a forced final channel)
            self._state = "body"
            self._kind, self._name = body_kind(tail[: tail.rfind(MESSAGE)], tools)
            self._header = ""
        else:
            self._state, self._header = "header", tail
        self._scanned = 0   # how far a call's body has been searched for its end

    @property
    def in_reasoning(self) -> bool:
        return self._state == "body" and self._kind == "reasoning"

    def _feed(self, text: str, delta: ReplyDelta) -> None:
        self._buf += text
        while self._step(delta):
            pass

    def _step(self, delta: ReplyDelta) -> bool:
        if self._state == "header":
            found = first_marker(self._buf, (MESSAGE, START))
            if found is None:
                return False
            i, marker = found
            header, self._buf = self._header + self._buf[:i], self._buf[i + len(marker):]
            if marker == START:      # a header that never got a body: markup only
                self._header = ""
                return True
            self._kind, self._name = body_kind(header, self._tools)
            self._state, self._header = "body", ""
            return True
        if self._state == "between":
            found = first_marker(self._buf, (START, CHANNEL))
            if found is None:
                keep = longest_partial_suffix(self._buf, (START, CHANNEL))
                stray = self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(stray):]
                delta.content += stray.strip() and stray
                return False
            i, marker = found
            delta.content += self._buf[:i].strip() and self._buf[:i]
            self._state = "header"
            self._header = CHANNEL if marker == CHANNEL else ""
            self._buf = self._buf[i + len(marker):]
            return True
        return self._step_body(delta)

    def _step_body(self, delta: ReplyDelta) -> bool:
        found = first_marker(self._buf, BODY_ENDS, self._scanned)
        if found is None:
            keep = longest_partial_suffix(self._buf, BODY_ENDS)
            if self._kind == "call":     # held whole until it ends; searched from where the last search left
                self._scanned = len(self._buf) - keep
            else:
                self._put(self._buf[: len(self._buf) - keep], delta)
                self._buf = self._buf[len(self._buf) - keep:]
            return False
        self._scanned = 0
        i, marker = found
        body, self._buf = self._buf[:i], self._buf[i + len(marker):]
        self._close_body(body, delta)
        if marker == START:
            self._state, self._header = "header", ""
        else:
            self._state = "between"
        return True

    def _put(self, text: str, delta: ReplyDelta) -> None:
        if self._kind == "reasoning":
            delta.reasoning += text
        else:
            delta.content += text

    def _close_body(self, body: str, delta: ReplyDelta) -> None:
        if self._kind != "call":
            self._put(body, delta)
            return
        call = make_call(self._name, body) if body.strip() else None
        if call is None:
            delta.content += body
        else:
            delta.tool_calls.append(call)

    def _finish(self, delta: ReplyDelta) -> None:
        rest, self._buf = self._buf, ""
        if self._state == "body":
            self._close_body(rest, delta)
        elif self._state == "between":
            delta.content += rest.strip() and rest
        elif CHANNEL not in rest and MESSAGE not in rest:
            # text where a header should be, with none of a header's markers: the model's words, not markup
            delta.content += rest
        self._state = "between"


class HarmonySyntax(ChatSyntax):
    name = "harmony"
    thinks = True
    reasoning_close = END + START + "assistant" + CHANNEL + "final" + MESSAGE

    def parser(self, *, prompt: str, tools: bool | Tools) -> ReplyParser:
        return HarmonyParser(prompt=prompt, tools=bool(tools))

    def _call(self, g: Lark, spec: FunctionSpec, i: int) -> str:
        to = g.text(f"{FUNCTIONS}{spec.name}")
        args = g.json_rule(f"args_{i}", spec.parameters)
        channel_first = f'{g.marker(CHANNEL)} "commentary to=" {to} (" " {g.marker(CONSTRAIN)} "json")?'
        recipient_first = f'" to=" {to} {g.marker(CHANNEL)} "commentary" (" json")?'
        return f"({channel_first} | {recipient_first}) {g.marker(MESSAGE)} {args}"

    def _calls(self, g: Lark, parallel: bool) -> str:
        """One call (a harmony message addresses one recipient, and ``<|call|>`` ends the generation, so
        ``parallel`` changes nothing), from where a header starts: right after the prompt's
        ``<|start|>assistant``, or after an ``<|end|>`` (then with its own ``<|start|>assistant``). The
        grammar ends with the arguments: ``<|call|>`` is the end-of-generation token that follows."""
        return f'({g.marker(START)} "assistant")? call'
