"""Samplers (greedy, temperature, top-k, top-p, min-p, seeds, logit bias, penalties, logprobs, model defaults)
and stopping (stop strings, eog, max tokens)."""
from __future__ import annotations

import numpy as np
import pytest

from colibri_aio.errors import UserError
from colibri_aio.text.sampling import (
    LLAMA_CPP_DEFAULTS, SamplingParams, StopStrings, Stopper, TokenPicker, apply_logit_bias, apply_penalties,
    keep_min_p, keep_top_k, keep_top_p, log_softmax, make_sampler, model_defaults, softmax, top_logprobs,
)

VOCAB = 2048


def random_logits(seed: int, n: int = VOCAB, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


def all_ids(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return np.arange(len(logits)), logits.astype(np.float64)


@pytest.mark.parametrize("seed", range(5))
def test_temperature_zero_is_argmax(seed: int) -> None:
    logits = random_logits(seed)
    sample = make_sampler(temperature=0.0, top_k=50, top_p=0.5, seed=seed)
    assert sample(logits) == int(np.argmax(logits))


@pytest.mark.parametrize("seed", range(5))
def test_top_k_one_is_argmax_at_any_temperature(seed: int) -> None:
    logits = random_logits(seed, scale=0.1)  # flat: a real draw would wander
    sample = make_sampler(temperature=5.0, top_k=1, seed=seed)
    assert {sample(logits) for _ in range(50)} == {int(np.argmax(logits))}


@pytest.mark.parametrize("seed", range(5))
def test_tiny_top_p_is_argmax(seed: int) -> None:
    logits = random_logits(seed, scale=0.1)
    sample = make_sampler(temperature=2.0, top_p=1e-9, seed=seed)
    assert {sample(logits) for _ in range(50)} == {int(np.argmax(logits))}


def test_top_k_keeps_the_k_largest() -> None:
    logits = random_logits(7)
    ids, kept = keep_top_k(all_ids(logits), 10)
    assert sorted(ids.tolist()) == sorted(np.argsort(-logits)[:10].tolist())
    np.testing.assert_array_equal(kept, logits[ids].astype(np.float64))
    assert len(keep_top_k(all_ids(logits), 0)[0]) == VOCAB


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = np.log(np.array([0.05, 0.5, 0.3, 0.15]))
    assert keep_top_p(all_ids(logits), 0.5)[0].tolist() == [1]
    assert keep_top_p(all_ids(logits), 0.51)[0].tolist() == [1, 2]
    assert keep_top_p(all_ids(logits), 0.9)[0].tolist() == [1, 2, 3]
    assert keep_top_p(all_ids(logits), 0.96)[0].tolist() == [1, 2, 3, 0]
    assert len(keep_top_p(all_ids(logits), 1.0)[0]) == 4


def test_min_p_removes_the_tail() -> None:
    probs = np.array([0.5, 0.3, 0.1, 0.06, 0.04])
    ids, _ = keep_min_p(all_ids(np.log(probs)), 0.15)  # threshold 0.075
    assert ids.tolist() == [0, 1, 2]
    sample = make_sampler(temperature=1.0, min_p=0.15, seed=0)
    drawn = {sample(np.log(probs).astype(np.float32)) for _ in range(500)}
    assert drawn == {0, 1, 2}


def test_same_seed_same_tokens_and_different_seed_differs() -> None:
    logits = random_logits(3, scale=1.0)

    def run(seed: int) -> list[int]:
        sample = make_sampler(temperature=0.8, top_k=200, top_p=0.95, min_p=0.01, seed=seed)
        return [sample(logits) for _ in range(64)]

    assert run(42) == run(42)
    assert run(42) != run(43)


def test_draw_frequencies_follow_the_tempered_softmax() -> None:
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], dtype=np.float32)
    n = 20_000
    for temperature in (1.0, 0.5, 2.0):
        sample = make_sampler(temperature=temperature, seed=1234)
        counts = np.bincount([sample(logits) for _ in range(n)], minlength=len(logits))
        expected = softmax(logits.astype(np.float64) / temperature)
        # ~4.5 standard deviations of a binomial proportion: loose, yet far below any real mismatch.
        bound = 4.5 * np.sqrt(expected * (1 - expected) / n) + 1e-3
        assert np.all(np.abs(counts / n - expected) <= bound), (temperature, counts / n, expected)


def test_filters_then_renormalises() -> None:
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1])).astype(np.float32)
    n = 20_000
    sample = make_sampler(temperature=1.0, top_k=2, seed=9)
    counts = np.bincount([sample(logits) for _ in range(n)], minlength=4)
    assert counts[2] == counts[3] == 0
    assert abs(counts[0] / n - 0.4 / 0.7) < 0.02


@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.1}, {"temperature": float("nan")}, {"top_k": -1},
    {"top_p": 0.0}, {"top_p": 1.5}, {"min_p": -0.1}, {"min_p": 1.1},
])
def test_meaningless_options_are_user_errors(kwargs: dict) -> None:
    with pytest.raises(UserError):
        make_sampler(**kwargs)


# --- stop strings -----------------------------------------------------------------------------


def feed_all(pieces: list[str], stops: list[str]) -> tuple[str, bool]:
    checker = StopStrings(stops)
    out = []
    for piece in pieces:
        text, hit = checker.feed(piece)
        out.append(text)
        if hit:
            return "".join(out), True
    return "".join(out) + checker.flush(), False


def test_stop_inside_one_piece() -> None:
    assert feed_all(["Hello STOP world"], ["STOP"]) == ("Hello ", True)


def test_stop_split_across_pieces_is_never_shown() -> None:
    checker = StopStrings(["</answer>"])
    assert checker.feed("42</") == ("42", False)  # "</" may begin the stop: held back
    assert checker.feed("ans") == ("", False)
    assert checker.feed("wer> trailing") == ("", True)
    assert checker.stopped == "</answer>"
    assert checker.feed("more") == ("", True)


def test_false_start_is_released() -> None:
    checker = StopStrings(["\n\nUser:"])
    assert checker.feed("a\n\nUs") == ("a", False)
    assert checker.feed("ually") == ("\n\nUsually", False)
    assert checker.flush() == ""


def test_held_back_text_is_released_at_the_end() -> None:
    assert feed_all(["value: <"], ["<stop>"]) == ("value: <", False)


def test_overlapping_partial_matches() -> None:
    # "ababc": the first "ab" is a false start, the second begins the stop.
    assert feed_all(list("xababcy"), ["abc"]) == ("xab", True)
    assert feed_all(["xaba", "bcy"], ["abc"]) == ("xab", True)


def test_first_stop_to_complete_wins_whatever_the_chunking() -> None:
    stops = ["abcd", "bc", "zz"]
    assert feed_all(["abcd"], stops) == ("a", True)
    assert feed_all(list("abcd"), stops) == ("a", True)
    # Same end: the longer (earlier-starting) stop cuts more.
    assert feed_all(["xabc"], ["abc", "bc"]) == ("x", True)


def test_stop_results_do_not_depend_on_chunking() -> None:
    rng = np.random.default_rng(5)
    stops = ["aba", "bb", "cab"]
    for _ in range(300):
        text = "".join(rng.choice(list("abc"), size=int(rng.integers(0, 15))))
        whole = feed_all([text], stops)
        cuts = sorted(rng.choice(len(text) + 1, size=min(3, len(text) + 1), replace=False).tolist())
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        assert feed_all(pieces, stops) == whole
        assert feed_all(list(text), stops) == whole
        # What is shown is a prefix of the text that contains no stop string.
        assert text.startswith(whole[0]) and not any(s in whole[0] for s in stops)


def test_empty_stop_strings_are_ignored() -> None:
    assert feed_all(["abc"], ["", "zz"]) == ("abc", False)


# --- Stopper: eog, max tokens, stop strings over a detokenizer --------------------------------


class CharDecoder:
    """A stand-in detokenizer: token id i is chr(i); 0xFF00+ ids complete only at the next push."""

    def __init__(self) -> None:
        self.pending = ""

    def push(self, token_id: int) -> str:
        out, self.pending = self.pending, ""
        if token_id >= 0xFF00:
            self.pending = "?"
            return out
        return out + chr(token_id)

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


EOG = 3


def run(ids: list[int], **kwargs) -> tuple[str, str | None, int]:
    stopper = Stopper(CharDecoder(), lambda i: i == EOG, **kwargs)
    out = []
    for i in ids:
        step = stopper.step(i)
        out.append(step.text)
        if step.finish_reason:
            return "".join(out), step.finish_reason, stopper.n_tokens
    return "".join(out), None, stopper.n_tokens


def ords(s: str) -> list[int]:
    return [ord(c) for c in s]


def test_stopper_eog_ends_without_its_text_and_releases_held_text() -> None:
    assert run([*ords("hi <"), EOG, *ords("x")], stop=["<end>"]) == ("hi <", "stop", 5)


def test_stopper_max_tokens() -> None:
    assert run(ords("abcdef"), max_tokens=4) == ("abcd", "length", 4)
    assert run(ords("abcdef")) == ("abcdef", None, 6)


def test_stopper_max_tokens_flushes_the_decoder_and_held_text() -> None:
    assert run([*ords("ab<"), 0xFF00], max_tokens=4, stop=["<end>"]) == ("ab<?", "length", 4)


def test_stopper_stop_string_wins_over_length_on_the_same_token() -> None:
    assert run(ords("ab<end>zz"), max_tokens=7, stop=["<end>"]) == ("ab", "stop", 7)


def test_stopper_refuses_steps_after_the_end_and_bad_budgets() -> None:
    stopper = Stopper(CharDecoder(), lambda i: i == EOG, max_tokens=1)
    assert stopper.step(ord("a")).finish_reason == "length"
    with pytest.raises(RuntimeError):
        stopper.step(ord("b"))
    with pytest.raises(UserError):
        Stopper(CharDecoder(), lambda i: False, max_tokens=0)


def test_sampler_refuses_a_batch_of_logits() -> None:
    sample = make_sampler(temperature=1.0, seed=0)
    with pytest.raises(ValueError, match="shape"):
        sample(random_logits(0).reshape(2, -1))


# --- logit bias, penalties, logprobs, defaults ------------------------------------------------------------------


def test_logit_bias_adds_to_the_named_tokens_only() -> None:
    logits = random_logits(1)
    out = apply_logit_bias(logits, {3: 5.0, 7: -100.0})
    assert out[3] == logits[3] + np.float32(5.0) and out[7] == logits[7] + np.float32(-100.0)
    keep = np.ones(VOCAB, bool)
    keep[[3, 7]] = False
    assert np.array_equal(out[keep], logits[keep]) and out.dtype == logits.dtype
    assert apply_logit_bias(logits, {}) is logits


def test_penalties_follow_llama_cpp() -> None:
    logits = np.array([2.0, -1.0, 0.5, 3.0, 0.0], np.float32)
    recent = [0, 0, 1, 4]  # token 0 twice, 1 and 4 once, 2 and 3 never
    out = apply_penalties(logits, recent, repeat=2.0, frequency=0.5, presence=0.25)
    # positive logits are divided by the repeat penalty, the others multiplied; then count x frequency + presence
    expected = np.array([2.0 / 2 - 2 * 0.5 - 0.25, -1.0 * 2 - 0.5 - 0.25, 0.5, 3.0, 0.0 * 2 - 0.5 - 0.25])
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert apply_penalties(logits, recent) is logits and apply_penalties(logits, [], repeat=2.0) is logits


def test_log_softmax_and_top_logprobs() -> None:
    logits = random_logits(2)
    lp = log_softmax(logits)
    np.testing.assert_allclose(np.exp(lp), softmax(logits.astype(np.float64)), rtol=1e-9)
    top = top_logprobs(lp, 5)
    assert [i for i, _ in top] == list(np.argsort(-lp, kind="stable")[:5])
    assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    assert top_logprobs(lp, 0) == []
    tie = top_logprobs(np.zeros(4), 2)
    assert [i for i, _ in tie] == [0, 1]  # lower id first on ties


def test_picker_greedy_sees_bias_and_penalties() -> None:
    logits = np.array([1.0, 3.0, 2.0], np.float32)
    assert TokenPicker(SamplingParams())(logits) == 1
    assert TokenPicker(SamplingParams(logit_bias={1: -5.0}))(logits) == 2
    # token 1 was just said: a presence penalty of 1.5 makes 2 the best
    assert TokenPicker(SamplingParams(presence_penalty=1.5), context=[1])(logits) == 2
    # ... unless it lies outside the window the penalties see
    assert TokenPicker(SamplingParams(presence_penalty=1.5, penalty_last_n=1), context=[1, 0])(logits) == 1


def test_picker_counts_its_own_tokens_in_the_window() -> None:
    pick = TokenPicker(SamplingParams(frequency_penalty=1.5), context=[])
    logits = np.array([1.0, 3.0, 2.0], np.float32)
    assert [pick(logits) for _ in range(3)] == [1, 2, 1]  # 1, then 1 is penalised 1.5 < 2's lead, ...


def test_picker_with_a_seed_is_reproducible() -> None:
    logits = random_logits(3)
    params = SamplingParams(temperature=1.0, seed=11, repeat_penalty=1.3)
    a, b = TokenPicker(params, [1, 2]), TokenPicker(params, [1, 2])
    assert [a(logits) for _ in range(20)] == [b(logits) for _ in range(20)]


@pytest.mark.parametrize("params", [
    SamplingParams(seed=-1), SamplingParams(repeat_penalty=0.0), SamplingParams(presence_penalty=float("inf")),
    SamplingParams(penalty_last_n=-2), SamplingParams(logit_bias={5: float("nan")}), SamplingParams(top_k=-1),
])
def test_meaningless_params_are_user_errors(params: SamplingParams) -> None:
    with pytest.raises(UserError):
        params.check()


def test_logit_bias_outside_the_vocabulary_is_refused() -> None:
    with pytest.raises(UserError, match="token id 99"):
        SamplingParams(logit_bias={99: 1.0}).check(vocab_size=10)


def test_model_defaults_come_from_general_sampling_keys_else_llama_cpp() -> None:
    assert model_defaults({}) == LLAMA_CPP_DEFAULTS
    got = model_defaults({"general.sampling.temp": 0.6, "general.sampling.top_k": 20, "general.sampling.top_p": 0.9,
                          "general.sampling.penalty_last_n": 32, "general.other": 1})
    assert (got.temperature, got.top_k, got.top_p, got.penalty_last_n) == (pytest.approx(0.6), 20, 0.9, 32)
    assert got.min_p == LLAMA_CPP_DEFAULTS.min_p == 0.05
    assert isinstance(got.top_k, int)


def test_override_keeps_what_is_not_given() -> None:
    p = LLAMA_CPP_DEFAULTS.override({"temperature": 0.0, "top_k": None})
    assert p.temperature == 0.0 and p.top_k == 40
