"""The session machinery shared by the server and the chat: the engine on its own thread (SyncEngine),
request preparation (template, model defaults, context), pieces pulled by a thread or pushed to a loop,
and chat history."""
from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

from colibri_aio.models import default_model_path
from colibri_aio.serve.session import ChatSession, ContextFull, Session
from colibri_aio.engine.sync import Finished, SyncEngine
from colibri_aio.text.sampling import LLAMA_CPP_DEFAULTS, SamplingParams

GREEDY = SamplingParams(logit_bias={0: -100.0, 2: -100.0})


@pytest.fixture(scope="module")
def session():
    with SyncEngine.open(None, io="pread") as engine:
        yield Session(engine)


def test_defaults_are_llama_cpp_s_when_the_model_names_none(session: Session) -> None:
    assert session.defaults == LLAMA_CPP_DEFAULTS


def test_defaults_come_from_the_models_general_sampling_keys(tmp_path: Path) -> None:
    out = tmp_path / "with-sampling.gguf"
    reader = gguf.GGUFReader(default_model_path())
    writer = gguf.GGUFWriter(out, arch=reader.fields["general.architecture"].contents(), endianess=reader.endianess)
    f32, i32 = gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.INT32
    copy_with_new_metadata(reader, writer, {"general.sampling.temp": MetadataDetails(f32, 0.25),
                                            "general.sampling.top_k": MetadataDetails(i32, 7)}, [])
    with SyncEngine.open(out, io="pread") as engine:
        d = Session(engine).defaults
    assert d.temperature == pytest.approx(0.25) and d.top_k == 7 and d.top_p == LLAMA_CPP_DEFAULTS.top_p


def test_stream_in_a_plain_thread_and_leaving_early_frees_the_engine(session: Session) -> None:
    ids = session.text_ids("The list type")
    whole = [p.token for p in session.stream(session.request(ids, max_tokens=12, sampling=GREEDY))]
    assert len(whole) == 12
    for piece in session.stream(session.request(ids, max_tokens=200, sampling=GREEDY)):
        break                                   # cancels, waits for the engine to be idle
    again = [p.token for p in session.stream(session.request(ids, max_tokens=12, sampling=GREEDY))]
    assert again == whole


def test_a_prompt_that_fills_the_context_is_refused(session: Session) -> None:
    with pytest.raises(ContextFull):
        session.request(list(range(session.n_ctx)), max_tokens=1, sampling=GREEDY)


def test_chat_keeps_history_and_the_next_turn_reuses_the_cache(session: Session) -> None:
    chat = ChatSession(session, system="You explain Python.", sampling=GREEDY, max_tokens=10)
    first = "".join(chat.say("What is a list?"))
    assert chat.last.cached_tokens < chat.last.prompt_tokens
    turn1_prompt = chat.last.prompt_tokens
    second = "".join(chat.say("And a tuple?"))
    assert [m["role"] for m in chat.messages] == ["user", "assistant", "user", "assistant"]
    assert chat.messages[1]["content"] == first and chat.messages[3]["content"] == second
    assert chat.last.cached_tokens >= turn1_prompt        # the first turn came from the KV cache
    chat.reset()
    assert chat.messages == []


def test_a_reply_cut_short_stays_in_the_history(session: Session) -> None:
    chat = ChatSession(session, sampling=GREEDY, max_tokens=50)
    reply = chat.say("What is a dict?")
    got = [next(reply) for _ in range(3)]
    reply.close()                                          # what Ctrl-C does, through the same path
    assert chat.messages[-1] == {"role": "assistant", "content": "".join(got)}


def test_old_turns_are_dropped_to_fit_the_context(session: Session) -> None:
    chat = ChatSession(session, sampling=GREEDY, max_tokens=60)
    for i in range(8):
        "".join(chat.say(f"Question {i}: what does the list type do?"))
    assert chat.dropped > 0
    assert chat.messages[-2]["content"] == "Question 7: what does the list type do?"
    assert chat.last.prompt_tokens + chat.reply_room <= session.n_ctx


def test_submit_pushes_pieces_then_one_finished_and_cancel_ends_early(session: Session) -> None:
    import queue

    ids = session.text_ids("The list type")
    events: queue.SimpleQueue = queue.SimpleQueue()
    session.engine.submit(ids, events.put, max_tokens=5, sampling=GREEDY)
    got = [events.get(timeout=60) for _ in range(6)]
    assert [type(e).__name__ for e in got] == ["GenerationPiece"] * 5 + ["Finished"]
    assert got[-1] == Finished() and got[-2].finish_reason == "length"
    job = session.engine.submit(ids, events.put, max_tokens=200, sampling=GREEDY)
    first = events.get(timeout=60)
    job.cancel()
    rest = []
    while not isinstance(event := events.get(timeout=60), Finished):
        rest.append(event)
    assert first.generated_tokens == 1 and len(rest) < 199 and event.cancelled
    assert [p.token for p in session.stream(session.request(ids, max_tokens=5, sampling=GREEDY))] == \
        [p.token for p in got[:5]]  # the engine serves the next caller


def test_closing_the_engine_cancels_a_submitted_generation() -> None:
    import queue

    events: queue.SimpleQueue = queue.SimpleQueue()
    engine = SyncEngine.open(None, io="pread")
    ids = engine.engine.prompt_ids("The list type")
    engine.submit(ids, events.put, max_tokens=200, logit_bias={0: -100.0, 2: -100.0})
    events.get(timeout=60)
    engine.close()
    while not isinstance(event := events.get(timeout=60), Finished):
        pass
    assert event.cancelled
