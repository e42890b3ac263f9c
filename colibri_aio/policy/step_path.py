"""Whether the next decode step tries the one-graph path: a guess that pays only when it is seldom wrong.

A step run as one graph picks each block's experts through the pool's slot table while it runs, so
whether every chosen expert is resident is known only afterwards. When one was not, the step was
computed for nothing and runs again block by block: a wrong guess costs a whole step. A right one saves
only what the per-block graphs cost beyond the one graph, x1.04-x1.14 of a step in the one-variable
A/Bs (evidence/decode_20261202T034143Z.md, decode_20261202T042320Z.md). So trying pays while

    P(every expert the step routes to is resident)  >  t_one_graph / t_block_graphs  ~  0.9

That probability moves: near 0 while a cold cache fills, near 1 once a model in RAM is resident,
in between for a model larger than RAM. It is estimated from every step, tried or not (a step run block
by block that read nothing would have been resident), as an exponential average over about the last
``1 / weight`` steps. The estimate starts at 1, so a model already resident tries from its first step;
a step that missed pulls it below the threshold at once (1 - weight < threshold), and it takes
``log(0.1) / log(1 - weight)`` (18) clean steps to come back from 0.
"""
from __future__ import annotations

from dataclasses import dataclass

BREAK_EVEN = 0.9     # ~ 1 / 1.1: the per-block graphs' cost over the one graph's, from the A/Bs above
WEIGHT = 1 / 8       # the newest step's weight in the estimate


@dataclass
class StepPathGuess:
    """Sans-I/O: observe each decode step's residency, answer whether the next one tries the one graph."""

    threshold: float = BREAK_EVEN
    weight: float = WEIGHT
    resident_rate: float = 1.0      # estimated P(a step finds every chosen expert resident)
    tried: int = 0                  # one-graph tries
    declined: int = 0               # steps that did not try (the estimate was below the threshold)

    def try_one_graph(self) -> bool:
        """Whether the next step should try the one-graph path (counted as tried or declined)."""
        if self.resident_rate >= self.threshold:
            self.tried += 1
            return True
        self.declined += 1
        return False

    def observe(self, resident: bool) -> None:
        """One step ran: ``resident`` when every expert it routed to was in the pool when it started."""
        self.resident_rate += self.weight * (float(resident) - self.resident_rate)
