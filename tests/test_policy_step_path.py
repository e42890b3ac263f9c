"""The one-graph guess: try while steps seldom miss, stop at once on a miss, come back after clean steps."""
from __future__ import annotations

import math

from colibri_aio.policy.step_path import BREAK_EVEN, WEIGHT, StepPathGuess


def clean_steps_to_try(guess: StepPathGuess) -> int:
    """Resident steps observed before the guess tries again."""
    n = 0
    while not guess.try_one_graph():
        guess.observe(True)
        n += 1
    return n


def test_a_resident_model_tries_from_its_first_step() -> None:
    guess = StepPathGuess()
    for _ in range(100):
        assert guess.try_one_graph()
        guess.observe(True)
    assert (guess.tried, guess.declined) == (100, 0)


def test_one_miss_stops_the_next_try_and_a_few_clean_steps_bring_it_back() -> None:
    guess = StepPathGuess()
    guess.observe(False)
    assert not guess.try_one_graph()
    assert 1 <= clean_steps_to_try(guess) <= 3


def test_a_cold_cache_declines_until_the_rate_is_past_break_even() -> None:
    """After a run of misses (a cache filling, or smaller than the working set) the estimate is near 0;
    the guess declines every step until about log(0.1) / log(1 - weight) clean ones have passed."""
    guess = StepPathGuess()
    for _ in range(50):
        guess.observe(False)
    assert guess.resident_rate < 0.01
    assert sum(guess.try_one_graph() for _ in range(10)) == 0
    need = math.ceil(math.log(1 - BREAK_EVEN) / math.log(1 - WEIGHT))
    assert abs(clean_steps_to_try(guess) - need) <= 1


def test_misses_every_few_steps_keep_the_guess_off() -> None:
    """One step in four missing (P = 0.75 < break-even): trying would compute a quarter of the steps twice
    to save ~10% on the rest, so the guess settles on declining."""
    guess = StepPathGuess()
    tries = 0
    for step in range(200):
        tries += guess.try_one_graph()
        guess.observe(step % 4 != 3)
    assert tries <= 10


def test_rare_misses_cost_only_the_steps_right_after_them() -> None:
    guess = StepPathGuess()
    tries = 0
    for step in range(1000):
        tries += guess.try_one_graph()
        guess.observe(step % 100 != 99)
    assert tries >= 950
