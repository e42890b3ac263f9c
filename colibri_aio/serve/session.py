"""The session machinery the server and the terminal chat share.

A :class:`Session` is a :class:`~colibri_aio.SyncEngine` (the engine on its
own thread and event loop, so its compute never holds up the server's loop
or the chat's input) plus what turns a prompt into a
:class:`GenerationRequest`: the chat template, the model's sampling
defaults, the context budget. The engine keeps the token ids behind its KV
cache, so a request that repeats the start of the previous one (the next turn
of a chat) prefills only what is new. Pieces come back through
:meth:`Session.stream` (plain iterator, for the chat) or
:class:`AsyncGeneration` (pushed to an asyncio loop, for the server).
"""
from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from colibri_aio.engine.engine import GenerationPiece
from colibri_aio.engine.sync import Event, Finished, SyncEngine
from colibri_aio.errors import UserError
from colibri_aio.text.sampling import GGUF_SAMPLING_KEYS, SamplingParams, TokenConstraint, model_defaults

if TYPE_CHECKING:
    from colibri_aio.text.grammar import Grammars
    from colibri_aio.text.replies import ChatSyntax, ReplyDelta
    from colibri_aio.text.template_form import TemplateForm


class ContextFull(UserError):
    """The prompt leaves no room in the context for a single new token."""


class GenerationCancelled(Exception):
    """The engine stopped the generation (it is closing)."""


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate: prompt ids, a token budget (None: to the end of the context), how to choose tokens."""

    ids: list[int]
    max_tokens: int | None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    logprobs: int | None = None   # n: each piece carries its log-probability and the n most likely tokens
    reuse: bool = True            # start from the longest prefix the KV cache holds
    constraint: TokenConstraint | None = None  # a grammar (or a forced span) masking every pick
    special: bool = False         # pieces show special tokens (a reply parser reads tool-call markers)

    def options(self) -> dict[str, Any]:
        """:meth:`Engine.generate`'s keywords."""
        return dict(max_tokens=self.max_tokens, sampling=self.sampling, stop=self.stop, logprobs=self.logprobs,
                    reuse=self.reuse, constraint=self.constraint, special=self.special)


class Session:
    """One engine (on its own thread) and the rules that prepare its requests."""

    def __init__(self, engine: SyncEngine) -> None:
        self.engine = engine
        model = engine.model
        self.tokenizer = engine.tokenizer
        self.n_ctx = engine.engine.net.n_ctx
        self.vocab_size = model.args.vocab_size
        self.model_name = model.path.name
        fields = model.reader.fields
        self.defaults = model_defaults({k: fields[k].contents() for k in GGUF_SAMPLING_KEYS if k in fields})
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()  # first use indexes the vocabulary once, whichever thread asks

    @functools.cached_property
    def syntax(self) -> ChatSyntax:
        """How the model's replies write thinking and tool calls (from its chat template)."""
        from colibri_aio.text.replies import chat_syntax

        return chat_syntax(self.tokenizer.spec.chat_template)

    @functools.cached_property
    def template_form(self) -> TemplateForm:
        """How the chat template wants tool calls written (probed once)."""
        from colibri_aio.text.template_form import probe_template_form

        return probe_template_form(self.engine.engine.render_chat, self.syntax.name)

    @property
    def grammars(self) -> Grammars:
        """Grammar constraints over this model's vocabulary (indexed on first use, then kept)."""
        from colibri_aio.text.grammar import Grammars

        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer)
        return self._grammars

    def chat_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Prompt ids of chat messages, rendered with the model's chat template."""
        return self.engine.engine.prompt_ids(list(messages))

    def text_ids(self, text: str) -> list[int]:
        """Prompt ids of plain text."""
        return self.engine.engine.prompt_ids(text)

    def request(self, ids: list[int], *, max_tokens: int | None, sampling: SamplingParams,
                stop: Sequence[str] = (), logprobs: int | None = None, reuse: bool = True,
                constraint: TokenConstraint | None = None, special: bool = False) -> GenerationRequest:
        """A request for ``ids``; refuses a prompt that leaves no room in the context."""
        if len(ids) >= self.n_ctx:
            raise ContextFull(f"the prompt has {len(ids)} tokens; the context holds {self.n_ctx}")
        sampling.check(self.vocab_size)
        return GenerationRequest(ids=ids, max_tokens=max_tokens, sampling=sampling, stop=tuple(stop),
                                 logprobs=logprobs, reuse=reuse, constraint=constraint, special=special)

    def stream(self, request: GenerationRequest) -> Iterator[GenerationPiece]:
        """Generate and yield the pieces in the caller's thread; leaving early (``break``, Ctrl-C)
        cancels the generation and returns once the engine is idle again."""
        return self.engine.generate(request.ids, **request.options())


class AsyncGeneration:
    """A generation pushed to an asyncio loop: :meth:`next` piece until None; :meth:`cancel`.

    ``on_idle`` runs on this loop once the engine is idle again (after the
    last piece, an error or a cancellation): the server hands the engine to
    the next request there.
    """

    def __init__(self, session: Session, request: GenerationRequest, on_idle: Callable[[], None]) -> None:
        loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._on_idle = on_idle
        self.finished = False

        def deliver(event: Event) -> None:  # on the engine's thread
            try:
                loop.call_soon_threadsafe(self._deliver, event)
            except RuntimeError:  # this loop has closed: nobody is listening any more
                pass

        self._job = session.engine.submit(request.ids, deliver, **request.options())

    def _deliver(self, event: Event) -> None:
        if isinstance(event, Finished):
            self._on_idle()
        self._events.put_nowait(event)

    async def next(self) -> GenerationPiece | None:
        """The next piece; None after the last. Raises the error that ended the generation."""
        if self.finished:
            return None
        event = await self._events.get()
        if isinstance(event, Finished):
            self.finished = True
            if event.error is not None:
                raise event.error
            if event.cancelled:
                raise GenerationCancelled("the generation was cancelled")
            return None
        return event

    def cancel(self) -> None:
        """Stop generating (the engine drains its reads, then ``on_idle`` runs). Safe to call twice."""
        if not self.finished:
            self._job.cancel()


class ChatSession:
    """A conversation on a :class:`Session`: its messages, and one generated reply per turn.

    Each turn renders the whole conversation with the chat template; the
    engine finds the earlier turns in its KV cache and prefills only the new
    message. When the conversation outgrows the context, the oldest turns
    are dropped (the system message stays) so that a reply of
    ``reply_room`` tokens still fits.
    """

    def __init__(self, session: Session, *, system: str | None = None, sampling: SamplingParams | None = None,
                 max_tokens: int | None = None, reply_room: int | None = None) -> None:
        self.session = session
        self.system = system
        self.sampling = sampling or session.defaults
        self.max_tokens = max_tokens
        self.reply_room = reply_room or min(max_tokens or 256, max(1, session.n_ctx // 4))
        self.messages: list[dict[str, str]] = []
        self.last: GenerationPiece | None = None  # the final piece of the last reply (usage, timing)
        self.dropped = 0                          # turns dropped to fit the context

    def reset(self) -> None:
        """Forget the conversation (the engine's KV cache is simply not reused by the next turn)."""
        self.messages.clear()
        self.last = None

    def say(self, text: str) -> Iterator[str]:
        """Add a user message and stream the reply's answer text (its thinking left out)."""
        for delta in self.turn(text):
            if delta.content:
                yield delta.content

    def turn(self, text: str) -> Iterator[ReplyDelta]:
        """Add a user message and stream the reply as thinking and answer text (a model whose template has no
        thinking span answers only); the answer joins the conversation even if cut short."""
        self.messages.append({"role": "user", "content": text})
        try:
            prompt, ids = self._fitting_prompt()
        except UserError:
            self.messages.pop()
            raise
        syntax = self.session.syntax
        parser = syntax.parser(prompt=prompt, tools=False)
        request = self.session.request(ids, max_tokens=self.max_tokens, sampling=self.sampling,
                                       special=syntax.name != "plain")
        try:
            with closing(self.session.stream(request)) as pieces:  # leaving early cancels and drains at once
                for piece in pieces:
                    self.last = piece
                    delta = parser.feed(piece.text)
                    if delta.content or delta.reasoning:
                        yield delta
                    if piece.finish_reason is not None:
                        tail = parser.finish()
                        if tail.content or tail.reasoning:
                            yield tail
        finally:
            self.messages.append({"role": "assistant", "content": parser.reply.content})

    def _fitting_prompt(self) -> tuple[str, list[int]]:
        """The conversation's prompt and its ids, dropping the oldest turns until a reply fits after them."""
        engine = self.session.engine.engine
        while True:
            head = [{"role": "system", "content": self.system}] if self.system else []
            prompt = engine.render_chat(head + self.messages)
            ids = engine.text_ids(prompt, templated=True)
            if len(ids) + self.reply_room <= self.session.n_ctx or len(self.messages) <= 1:
                break
            del self.messages[:2]  # the oldest user message and its reply
            self.dropped += 1
        if len(ids) >= self.session.n_ctx:
            raise ContextFull(f"the message has {len(ids)} tokens with the chat template; the context holds "
                              f"{self.session.n_ctx}")
        return prompt, ids
