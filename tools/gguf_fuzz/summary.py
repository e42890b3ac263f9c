"""Tallies of a campaign: outcome classes per action, per mutation kind and per fixture, refusals by
message, peak memory, and the failures themselves (what a receipt and a test assert on)."""
from __future__ import annotations

import re
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from gguf_fuzz.campaign import CaseResult
from gguf_fuzz.cases import ACTIONS, GOOD

# What one case may add to its worker's RSS: the fixtures are at most 6 MB, the engine's own start (trunk,
# pool, KV cache, tokenizer, kernels) takes tens of MB; a case that needs more allocated what it should not.
GROWTH_BOUND = 512 << 20

_NUMBER = re.compile(r"\d+")
_PATH = re.compile(r"\S*mutant\.gguf")
_QUOTED = re.compile(r"'[^']*'|`[^`]*`|\"[^\"]*\"")


def message_class(line: str) -> str:
    """A refusal line without the file's path, quoted text and numbers: one class per kind of message."""
    return _NUMBER.sub("N", _QUOTED.sub("Q", _PATH.sub("FILE", line)))[:160]


@dataclass(slots=True)
class Summary:
    growth_bound: int = GROWTH_BOUND
    cases: int = 0
    hangs: int = 0
    crashes: int = 0
    over_memory: int = 0                 # cases whose peak RSS grew past growth_bound
    tracebacks: int = 0                  # outcomes where an exception escaped
    failures: list[dict] = field(default_factory=list)
    by_action: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    by_kind: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    by_fixture: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    refusals: Counter = field(default_factory=Counter)
    refusals_naming_file: int = 0
    refusals_total: int = 0
    deepest: Counter = field(default_factory=Counter)  # the last action each case got through cleanly
    peak_rss: list[int] = field(default_factory=list)
    rss_before: list[int] = field(default_factory=list)
    peak_growth: list[int] = field(default_factory=list)  # peak RSS of a case above the worker's RSS before it
    action_seconds_max: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def add(self, r: CaseResult) -> None:
        self.cases += 1
        fixture = r.key.split("/")[0]
        if r.hang is not None or r.crash is not None:
            self.hangs += r.hang is not None
            self.crashes += r.crash is not None
            self.failures.append({"key": r.key, "kinds": r.kinds, "notes": r.notes, "hang": r.hang,
                                  "crash": r.crash})
            self.by_fixture[fixture]["hang" if r.hang else "crash"] += 1
            return
        classes = {o["action"]: o["cls"] for o in r.outcomes}
        for o in r.outcomes:
            self.by_action[o["action"]][o["cls"]] += 1
            self.action_seconds_max[o["action"]] = max(self.action_seconds_max[o["action"]], o["seconds"])
            if o["cls"] == "refused":
                self.refusals[message_class(o["detail"])] += 1
                self.refusals_total += 1
                self.refusals_naming_file += "mutant.gguf" in o["detail"]
            elif o["cls"] not in GOOD:
                self.tracebacks += o["cls"] == "traceback"
                self.failures.append({"key": r.key, "kinds": r.kinds, "notes": r.notes, "action": o["action"],
                                      "cls": o["cls"], "detail": o["detail"]})
        worst = "ok" if all(c == "ok" for c in classes.values()) else (
            "refused" if all(c in GOOD for c in classes.values()) else "failed")
        for kind in set(r.kinds):
            self.by_kind[kind][worst] += 1
        self.by_fixture[fixture][worst] += 1
        self.deepest[_deepest(classes)] += 1
        self.peak_rss.append(r.peak_rss)
        self.rss_before.append(r.rss_before)
        growth = max(0, r.peak_rss - r.rss_before)
        self.peak_growth.append(growth)
        if growth > self.growth_bound:
            self.over_memory += 1
            self.failures.append({"key": r.key, "kinds": r.kinds, "notes": r.notes, "memory": growth})

    @property
    def failed(self) -> int:
        """Cases that hung or crashed, outcomes that were not clean, cases over the memory bound."""
        return len(self.failures)

    def memory(self) -> dict:
        mib = 1 << 20
        return {
            "peak_rss_max_mib": round(max(self.peak_rss, default=0) / mib, 1),
            "peak_rss_median_mib": round(statistics.median(self.peak_rss) / mib, 1) if self.peak_rss else 0,
            "rss_before_case_min_max_mib": [round(min(self.rss_before, default=0) / mib, 1),
                                            round(max(self.rss_before, default=0) / mib, 1)],
            "peak_growth_in_one_case_max_mib": round(max(self.peak_growth, default=0) / mib, 1),
            "growth_bound_mib": self.growth_bound // mib, "cases_over_the_bound": self.over_memory,
        }

    def as_dict(self) -> dict:
        return {
            "cases": self.cases, "hangs": self.hangs, "crashes": self.crashes, "tracebacks": self.tracebacks,
            "over_memory": self.over_memory, "failures": len(self.failures),
            "outcomes_by_action": {a: dict(self.by_action[a]) for a in ACTIONS if a in self.by_action},
            "cases_by_mutation_kind": {k: dict(v) for k, v in sorted(self.by_kind.items())},
            "cases_by_fixture": {k: dict(v) for k, v in sorted(self.by_fixture.items())},
            "cases_by_last_clean_action": dict(self.deepest),
            "refusals_naming_the_file": f"{self.refusals_naming_file}/{self.refusals_total}",
            "refusal_messages": dict(self.refusals.most_common()),
            "memory": self.memory(),
            "action_seconds_max": {a: round(s, 2) for a, s in self.action_seconds_max.items()},
            "first_failures": self.failures[:100],
        }


def _deepest(classes: dict[str, str]) -> str:
    """How far a mutant got: the first action refused, or 'chat' when everything succeeded."""
    for action in ACTIONS:
        cls = classes.get(action)
        if cls is None:
            return f"{action} not run"
        if cls != "ok":
            return f"refused at {action}"
    return "every action ok"
