"""Which grammar library masks tokens for constrained decoding, and what the mask costs beside a decode step.

Compares llguidance (through :mod:`colibri_aio.text.grammar`), xgrammar and
outlines-core (benchmark-only peers, imported here and nowhere else) on:

* the twenty JSON schemas of the tests and one forced tool call
  (``fixtures/json_schemas.py``);
* two vocabularies of 151 936 tokens: the 8-layer Qwen3-30B-A3B-shaped cut's
  (2048 real tokens, the rest placeholders a grammar never allows, which can
  make a mask unrealistically cheap) and a byte-level BPE trained with the
  ``tokenizers`` package on the Python sources installed on this machine
  (``--bpe``: made once and kept there; every token real text);
* compile time (grammar and matcher from the schema, per schema), mask time
  per token (bitmask computed by the library, applied to a float32 logit row
  with NumPy: the same application for all three) and accept time, while
  each library replays the same token sequence (generated once per vocabulary
  with llguidance from seeded random logits, >= 200 tokens over the schemas);
* correctness: each library also generates its own reply per schema from
  seeded random logits, and the text is parsed and validated with jsonschema.

In the same run, the engine decodes on the cut in RAM (``--model``): its
decode step time (unconstrained, and constrained by llguidance with the mask
timed inside the step) gives the ratio mask ÷ step. Libraries and the engine
run interleaved, ``--runs`` rounds, the library order rotating each round.

Usage::

    python tools/bench_grammar.py /work/models/qwen3_30b_l8_q8_0.gguf --runs 5
"""
from __future__ import annotations

import argparse
import gc
import glob
import hashlib
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "fixtures"))
from json_schemas import SCHEMAS, TOOL_CALL, TOOL_CLOSE, TOOL_OPEN, tool_call_lark  # noqa: E402

from colibri_aio.bench import receipt  # noqa: E402
from colibri_aio.bench.lock import exclusive  # noqa: E402
from colibri_aio.text.grammar import GrammarConstraint, Grammars, lark_json  # noqa: E402
from colibri_aio.text.tokenizer import Tokenizer, TokenizerSpec  # noqa: E402

VOCAB = 151936
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOOL = "tool_call"
MIN_SEQUENCE = 200
EVERY_EXPERT = 10**6   # cache slots per layer: every expert of any model
SEPARATORS = (", ", ": ")


# ---------------------------------------------------------------------------------------------- vocabularies
def corpus_files(limit_bytes: float) -> list[str]:
    """Python sources installed here (the venv's packages, then the system's standard library), up to a size."""
    files = sorted(glob.glob(f"{sys.prefix}/lib/python3*/site-packages/**/*.py", recursive=True))
    files += sorted(glob.glob("/usr/lib/python3*/**/*.py", recursive=True))
    chosen, total = [], 0
    for f in files:
        if os.path.isfile(f):
            chosen.append(f)
            total += os.path.getsize(f)
            if total > limit_bytes:
                break
    return chosen


def train_bpe(path: Path, corpus_mb: float) -> dict[str, Any]:
    """A byte-level BPE of VOCAB tokens (the last ones SPECIALS) trained on local text, saved at ``path``."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    files = corpus_files(corpus_mb * 1e6)
    hf = HF(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - len(SPECIALS), min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t0 = time.perf_counter()
    hf.train(files, trainer)
    hf.add_special_tokens(list(SPECIALS))
    path.parent.mkdir(parents=True, exist_ok=True)
    hf.save(str(path))
    return {"files": len(files), "bytes": sum(os.path.getsize(f) for f in files),
            "seconds": time.perf_counter() - t0}


def bpe_tokenizer(path: Path) -> Tokenizer:
    """Our Tokenizer over a trained ``tokenizers`` BPE file (learnt tokens normal, SPECIALS control)."""
    spec = json.loads(path.read_text())
    vocab: dict[str, int] = dict(spec["model"]["vocab"])
    for added in spec["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    if [vocab[t] for t in tokens] != list(range(len(tokens))):
        raise SystemExit(f"{path}: token ids are not 0..n-1")
    types = [3 if t in SPECIALS else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    end = vocab["<|endoftext|>"]
    return Tokenizer(TokenizerSpec(tokens=tokens, token_types=types, merges=merges, bos_id=None, eos_id=end,
                                   eot_id=vocab["<|im_end|>"], eom_id=None, pad_id=end, add_bos=False,
                                   chat_template=None), origin=str(path))


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------------------- the mask
PENALTY = np.array([-np.inf, 0.0], dtype=np.float32)


def apply_bitmask(bitmask: np.ndarray, logits: np.ndarray, n: int) -> np.ndarray:
    """The masked logits of a (W,) int32 bitmask, as colibri_aio.text.grammar applies one (no Python loop)."""
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little", count=n)
    return logits + PENALTY[bits]


class Matcher:
    """One library's state for one generation: mask, accept, done."""

    def mask(self, logits: np.ndarray) -> np.ndarray: ...

    def accept(self, token: int) -> bool: ...

    def done(self) -> bool: ...


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.grammars = Grammars(tokenizer)

    def compile(self, target: str) -> Matcher:
        c = (self.grammars.lark(tool_call_lark(lark_json(TOOL_CALL))) if target == TOOL
             else self.grammars.json_schema(SCHEMAS[target]))
        return _LLMatcher(c)


class _LLMatcher(Matcher):
    def __init__(self, c: GrammarConstraint) -> None:
        self.c = c

    def mask(self, logits: np.ndarray) -> np.ndarray:
        return self.c.mask(logits)

    def accept(self, token: int) -> bool:
        try:
            self.c.accept(token)
        except RuntimeError:
            return False
        return True

    def done(self) -> bool:
        return self.c.done


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Tokenizer) -> None:
        import xgrammar as xgr
        self.xgr = xgr
        special = _special_ids(tokenizer)
        vocab = [b"" if i in special else tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=tokenizer.vocab_size,
                                 stop_token_ids=sorted(tokenizer.eog_ids))
        # No cache: every request compiles its schema afresh, as a server meeting a new schema does.
        self.compiler = xgr.GrammarCompiler(info, max_threads=os.cpu_count() or 1, cache_enabled=False)
        self.n = tokenizer.vocab_size

    def compile(self, target: str) -> Matcher:
        xgr = self.xgr
        if target == TOOL:
            call = xgr.Grammar.from_json_schema(json.dumps(TOOL_CALL), any_whitespace=False, separators=SEPARATORS)
            grammar = xgr.Grammar.concat(xgr.Grammar.from_ebnf(f"root ::= {json.dumps(TOOL_OPEN)}"), call,
                                         xgr.Grammar.from_ebnf(f"root ::= {json.dumps(TOOL_CLOSE)}"))
            compiled = self.compiler.compile_grammar(grammar)
        else:
            compiled = self.compiler.compile_json_schema(json.dumps(SCHEMAS[target]), any_whitespace=False,
                                                         separators=SEPARATORS)
        return _XGMatcher(xgr.GrammarMatcher(compiled), self.n)


class _XGMatcher(Matcher):
    def __init__(self, m: Any, n: int) -> None:
        self.m, self.n = m, n
        self.bitmask = np.zeros((1, (n + 31) // 32), dtype=np.int32)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        self.m.fill_next_token_bitmask(self.bitmask)
        return apply_bitmask(self.bitmask[0], logits, self.n)

    def accept(self, token: int) -> bool:
        return bool(self.m.accept_token(token))

    def done(self) -> bool:
        return bool(self.m.is_terminated() or self.m.is_completed())


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer: Tokenizer) -> None:
        import outlines_core
        self.oc = outlines_core
        special = _special_ids(tokenizer)
        eos = tokenizer.eos_id
        ids: dict[bytes, list[int]] = {}
        for i in range(tokenizer.vocab_size):
            if i not in special and i != eos:
                ids.setdefault(tokenizer.token_bytes(i), []).append(i)
        self.vocab = outlines_core.Vocabulary(eos, ids)
        self.n = tokenizer.vocab_size

    def regex(self, target: str) -> str:
        from outlines_core.json_schema import build_regex_from_schema
        ws = r"[ ]?"   # accepts ", " and ": " (and no space): outlines-core has no fixed separators
        if target == TOOL:
            return re.escape(TOOL_OPEN) + build_regex_from_schema(json.dumps(TOOL_CALL), ws) + re.escape(TOOL_CLOSE)
        return build_regex_from_schema(json.dumps(SCHEMAS[target]), ws)

    def compile(self, target: str) -> Matcher:
        index = self.oc.Index(self.regex(target), self.vocab)
        return _OCMatcher(self.oc.Guide(index), self.n)


class _OCMatcher(Matcher):
    def __init__(self, guide: Any, n: int) -> None:
        self.g, self.n = guide, n
        self.bitmask = np.zeros((1, (n + 31) // 32), dtype=np.int32)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        self.g.write_mask_into(self.bitmask.ctypes.data, self.bitmask.size, 4)
        return apply_bitmask(self.bitmask[0], logits, self.n)

    def accept(self, token: int) -> bool:
        try:
            self.g.advance(token, return_tokens=False)
        except (ValueError, RuntimeError):
            return False
        return True

    def done(self) -> bool:
        return bool(self.g.is_finished())


LIBRARIES: dict[str, Callable[[Tokenizer], Any]] = {"llguidance": LLGuidance, "xgrammar": XGrammar,
                                                    "outlines-core": OutlinesCore}


def _special_ids(tokenizer: Tokenizer) -> set[int]:
    from colibri_aio.text.grammar import is_special
    return {i for i in range(tokenizer.vocab_size) if is_special(tokenizer, i)}


# ---------------------------------------------------------------------------------------------- runs
TARGETS = [*SCHEMAS, TOOL]


def schema_of(target: str) -> dict:
    return TOOL_CALL if target == TOOL else SCHEMAS[target]


def parse(target: str, text: str) -> Any:
    if target == TOOL:
        if not (text.startswith(TOOL_OPEN) and text.endswith(TOOL_CLOSE)):
            raise ValueError("tool-call markers missing")
        text = text[len(TOOL_OPEN):-len(TOOL_CLOSE)]
    return json.loads(text)


WALK_CAP = 400   # tokens a random walk may take before it counts as one that does not end


def random_walk(matcher: Matcher, rng: np.random.Generator, n: int, eog: set[int], cap: int = WALK_CAP) -> list[int]:
    """Tokens a matcher lets through when every pick is the argmax of random logits (the final end token not kept)."""
    out: list[int] = []
    for _ in range(cap):
        masked = matcher.mask(rng.standard_normal(n, dtype=np.float32))
        token = int(np.argmax(masked))
        if not np.isfinite(masked[token]):
            raise RuntimeError("the mask allowed nothing")
        if token in eog:
            return out
        if not matcher.accept(token):
            raise RuntimeError(f"token {token} refused after the mask allowed it")
        out.append(token)
    return out


def correctness(lib: Any, tokenizer: Tokenizer, seed: int) -> dict[str, Any]:
    """Each target generated by the library itself from random logits: does the text parse and validate?"""
    rows: dict[str, Any] = {}
    eog = set(tokenizer.eog_ids)
    for k, target in enumerate(TARGETS):
        try:
            ids = random_walk(lib.compile(target), np.random.default_rng(seed + k), tokenizer.vocab_size, eog)
            if len(ids) == WALK_CAP:
                raise RuntimeError(f"no end within {WALK_CAP} tokens")
            text = tokenizer.decode(ids)
            jsonschema.validate(parse(target, text), schema_of(target))
            rows[target] = {"valid": True, "tokens": len(ids), "text": text}
        except Exception as exc:  # noqa: BLE001 - a library's failure is the measurement
            rows[target] = {"valid": False, "error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"}
    return rows


@dataclass
class Sequence:
    target: str
    ids: list[int]
    logits_seed: int


def sequences(tokenizer: Tokenizer, seed: int) -> list[Sequence]:
    """One llguidance-generated token sequence per target (random logits, seeded), >= MIN_SEQUENCE in all."""
    lib = LLGuidance(tokenizer)
    eog = set(tokenizer.eog_ids)
    out, round_ = [], 0
    while sum(len(s.ids) for s in out) < MIN_SEQUENCE or round_ == 0:
        for k, target in enumerate(TARGETS):
            s = seed + 1000 * round_ + k
            out.append(Sequence(target, random_walk(lib.compile(target), np.random.default_rng(s),
                                                    tokenizer.vocab_size, eog), s))
        round_ += 1
    return out


def replay(lib: Any, seqs: list[Sequence], n: int) -> dict[str, Any]:
    """Compile each target and walk its sequence: compile, mask and accept times (seconds), refusals."""
    compile_s: dict[str, list[float]] = {}
    mask_s: dict[str, list[float]] = {}
    accept_s: list[float] = []
    refused: list[str] = []
    for seq in seqs:
        gc.collect()
        t0 = time.perf_counter()
        matcher = lib.compile(seq.target)
        compile_s.setdefault(seq.target, []).append(time.perf_counter() - t0)
        rng = np.random.default_rng(seq.logits_seed)
        for i, token in enumerate(seq.ids):
            logits = rng.standard_normal(n, dtype=np.float32)
            t0 = time.perf_counter()
            masked = matcher.mask(logits)
            t1 = time.perf_counter()
            ok = np.isfinite(masked[token]) and matcher.accept(token)
            accept_s.append(time.perf_counter() - t1)
            if not ok:
                refused.append(f"{seq.target}@{i}")
                break
            mask_s.setdefault(seq.target, []).append(t1 - t0)
    return {"compile_s": compile_s, "mask_s": mask_s, "accept_s": accept_s, "refused": refused}


class TimedConstraint:
    """A GrammarConstraint whose mask calls are timed (inside the engine's decode loop)."""

    def __init__(self, c: GrammarConstraint) -> None:
        self.c, self.mask_s = c, []

    def mask(self, logits: np.ndarray) -> np.ndarray:
        t0 = time.perf_counter()
        out = self.c.mask(logits)
        self.mask_s.append(time.perf_counter() - t0)
        return out

    def accept(self, token: int) -> None:
        self.c.accept(token)


def step_times(pieces: list) -> list[float]:
    """Seconds between consecutive tokens (the first token, which follows the prefill, left out)."""
    t = [p.decode_seconds for p in pieces]
    return [b - a for a, b in zip(t, t[1:])]


def decode_run(engine: Any, grammars: Grammars, tokens: int, seed: int) -> dict[str, Any]:
    """On the cut: an unconstrained decode, and constrained ones (a schema, the tool call) with the mask timed."""
    prompt = "Write the JSON for the order:"
    free = list(engine.generate(prompt, max_tokens=tokens, temperature=1.0, seed=seed, reuse=False))
    out: dict[str, Any] = {"free_step_s": step_times(free)}
    for label, make in (("schema", lambda: grammars.json_schema(SCHEMAS["object_array"])),
                        (TOOL, lambda: grammars.lark(tool_call_lark(lark_json(TOOL_CALL))))):
        c = TimedConstraint(make())
        pieces = list(engine.generate(prompt, max_tokens=tokens, temperature=1.0, seed=seed, reuse=False,
                                      constraint=c))
        out[f"{label}_step_s"] = step_times(pieces)
        out[f"{label}_mask_s"] = c.mask_s
        out[f"{label}_finish"] = pieces[-1].finish_reason
    return out


# ---------------------------------------------------------------------------------------------- summary
def flat(d: dict[str, list[float]]) -> list[float]:
    return [x for xs in d.values() for x in xs]


def fmt(s: dict[str, float], scale: float, digits: int = 1) -> str:
    return f"{s['median'] * scale:.{digits}f} [{s['min'] * scale:.{digits}f}–{s['max'] * scale:.{digits}f}]"


def summarize(rec: dict[str, Any]) -> dict[str, Any]:
    """Medians [min–max] per vocabulary and library, and the ratios mask ÷ decode step."""
    out: dict[str, Any] = {}
    steps = [x for r in rec["decode"] for x in r["free_step_s"]]
    out["decode_step_s"] = receipt.spread(steps)
    for vocab, per_lib in rec["replays"].items():
        for lib, runs in per_lib.items():
            mask = [x for r in runs for x in flat({k: v for k, v in r["mask_s"].items() if k != TOOL})]
            tool = [x for r in runs for x in r["mask_s"].get(TOOL, [])]
            comp = [x for r in runs for x in flat({k: v for k, v in r["compile_s"].items() if k != TOOL})]
            tcomp = [x for r in runs for x in r["compile_s"].get(TOOL, [])]
            row = {"mask_schema_s": receipt.spread(mask) if mask else None,
                   "mask_tool_s": receipt.spread(tool) if tool else None,
                   "compile_schema_s": receipt.spread(comp) if comp else None,
                   "compile_tool_s": receipt.spread(tcomp) if tcomp else None,
                   "accept_s": receipt.spread([x for r in runs for x in r["accept_s"]]),
                   "refused": sorted({x for r in runs for x in r["refused"]}),
                   "run_medians_mask_schema_s": [statistics.median(flat(
                       {k: v for k, v in r["mask_s"].items() if k != TOOL}) or [float("nan")]) for r in runs]}
            if mask:
                row["ratio_schema"] = row["mask_schema_s"]["median"] / out["decode_step_s"]["median"]
            if tool:
                row["ratio_tool"] = row["mask_tool_s"]["median"] / out["decode_step_s"]["median"]
            out[f"{vocab}/{lib}"] = row
    inside = {k: [x for r in rec["decode"] for x in r[f"{k}_mask_s"]] for k in ("schema", TOOL)}
    csteps = {k: [x for r in rec["decode"] for x in r[f"{k}_step_s"]] for k in ("schema", TOOL)}
    for k in ("schema", TOOL):
        out[f"engine_{k}"] = {"mask_s": receipt.spread(inside[k]), "step_s": receipt.spread(csteps[k]),
                              "ratio": statistics.median(inside[k]) / statistics.median(steps)}
    return out


def markdown(rec: dict[str, Any], summary: dict[str, Any]) -> str:
    h = rec["host_facts"]
    lines = [f"# Grammar libraries for constrained decoding — {rec['date']}", "",
             f"host `{h['hostname']}` ({h['cpu_described']}, {h['cpus']} CPUs), commit `{rec['commit']}`, "
             f"load average at end {tuple(round(x, 2) for x in os.getloadavg())}", "",
             f"Command: `{rec['command']}`", "",
             f"Versions: {', '.join(f'{k} {v}' for k, v in rec['versions'].items())}", "",
             f"Vocabularies ({VOCAB} tokens each): `cut` = {rec['model']}'s (2048 real tokens, placeholders after); "
             f"`bpe` = byte-level BPE trained on {rec['bpe']['corpus']} (sha256 {rec['bpe']['sha256'][:12]}…). "
             f"Replayed sequences: {rec['sequence_tokens']} tokens per vocabulary over 20 schemas + the tool call. "
             f"{rec['runs']} runs, libraries interleaved (order rotating), the engine's decode between them. "
             "Medians [min–max] over every sample of every run; mask = the library's bitmask + NumPy application to "
             "a float32 row of 151 936 logits.", "",
             f"Decode step on the cut (engine in RAM, unconstrained, temperature 1): "
             f"**{fmt(summary['decode_step_s'], 1e3)} ms**", "",
             "| vocab | library | compile ms (schema) | compile ms (tool) | mask µs/token (schemas) | "
             "mask µs/token (tool) | mask ÷ step (schema / tool) | accept µs | replay refused | own output valid |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for vocab in rec["replays"]:
        for lib in rec["replays"][vocab]:
            row = summary[f"{vocab}/{lib}"]
            valid = rec["correctness"][vocab][lib]
            n_ok = sum(v["valid"] for v in valid.values())
            ratio = (f"{row.get('ratio_schema', float('nan')):.4f} / {row.get('ratio_tool', float('nan')):.4f}")
            lines.append(
                f"| {vocab} | {lib} | {fmt(row['compile_schema_s'], 1e3) if row['compile_schema_s'] else '—'} | "
                f"{fmt(row['compile_tool_s'], 1e3) if row['compile_tool_s'] else '—'} | "
                f"{fmt(row['mask_schema_s'], 1e6, 0) if row['mask_schema_s'] else '—'} | "
                f"{fmt(row['mask_tool_s'], 1e6, 0) if row['mask_tool_s'] else '—'} | {ratio} | "
                f"{fmt(row['accept_s'], 1e6, 0)} | {len(row['refused'])} | {n_ok}/{len(valid)} |")
    lines += ["", "Inside the engine (llguidance, cut vocabulary, mask timed within the decode loop):", ""]
    for k in ("schema", TOOL):
        e = summary[f"engine_{k}"]
        lines.append(f"- {k}: mask {fmt(e['mask_s'], 1e6, 0)} µs, step {fmt(e['step_s'], 1e3)} ms; "
                     f"mask ÷ unconstrained step **{e['ratio']:.4f}** (target < 0.05)")
    failures = [f"{v}/{lib}/{t}: {r['error']}" for v, libs in rec["correctness"].items()
                for lib, rows in libs.items() for t, r in rows.items() if not r["valid"]]
    if failures:
        lines += ["", "Own outputs that failed:", ""] + [f"- {f}" for f in failures]
    refusals = [f"{key}: {', '.join(summary[key]['refused'])}" for key in summary
                if isinstance(summary[key], dict) and summary[key].get("refused")]
    if refusals:
        lines += ["", "Replays refused (the library would not take llguidance's token here):", ""] + \
                 [f"- {r}" for r in refusals]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- main
def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for name in ("llguidance", "xgrammar", "outlines-core", "numpy", "tokenizers"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", type=Path, help="the 8-layer cut (tools/make_synthetic_gguf.py --shape "
                                             "qwen3-30b-a3b --layers 8 --type q8_0)")
    ap.add_argument("--bpe", type=Path, default=Path("/work/models/bpe_151936.json"),
                    help="the trained BPE (made here when missing)")
    ap.add_argument("--corpus-mb", type=float, default=120.0, help="text to train the BPE on")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--libraries", default=",".join(LIBRARIES))
    ap.add_argument("--vocabs", default="cut,bpe", help="which vocabularies (cut, bpe)")
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lock", type=Path, default=None,
                    help="hold this lock file exclusively around each run (e.g. /work/cpu.lock)")
    ap.add_argument("--out", type=Path, default=ROOT / "evidence")
    args = ap.parse_args(argv)

    from colibri_aio import SyncEngine

    rec: dict[str, Any] = {**receipt.header("tools/bench_grammar.py"), "host_facts": receipt.host_facts(),
                           "git": receipt.git_state("colibri_aio/text/grammar.py", "tools/bench_grammar.py"),
                           "model": args.model.name, "runs": args.runs, "versions": versions()}
    wanted = args.vocabs.split(",")
    if "bpe" in wanted and not args.bpe.exists():
        print(f"training the BPE vocabulary into {args.bpe} ...", file=sys.stderr)
        rec["bpe_training"] = train_bpe(args.bpe, args.corpus_mb)
    vocabs = {"cut": lambda: Tokenizer.from_path(args.model), "bpe": lambda: bpe_tokenizer(args.bpe)}
    vocabs = {v: vocabs[v]() for v in wanted}
    for name, tok in vocabs.items():
        if tok.vocab_size != VOCAB:
            raise SystemExit(f"the {name} vocabulary has {tok.vocab_size} tokens, not {VOCAB}")
    rec["bpe"] = {"path": str(args.bpe), "sha256": file_sha256(args.bpe) if args.bpe.exists() else "",
                  "corpus": f"the first {args.corpus_mb:.0f} MB of the Python sources under {sys.prefix} and "
                            "/usr/lib/python3* (tokenizers BpeTrainer, min_frequency 2)"}
    names = args.libraries.split(",")
    libs: dict[str, dict[str, Any]] = {}
    for vname, tok in vocabs.items():
        for lname in names:
            t0 = time.perf_counter()
            libs.setdefault(vname, {})[lname] = LIBRARIES[lname](tok)
            rec.setdefault("vocab_setup_s", {}).setdefault(vname, {})[lname] = time.perf_counter() - t0
    seqs = {v: sequences(tok, args.seed) for v, tok in vocabs.items()}
    rec["sequence_tokens"] = {v: sum(len(s.ids) for s in ss) for v, ss in seqs.items()}
    rec["sequences"] = {v: [{"target": s.target, "ids": s.ids, "logits_seed": s.logits_seed} for s in ss]
                        for v, ss in seqs.items()}
    rec["correctness"] = {v: {ln: correctness(libs[v][ln], vocabs[v], args.seed + 77) for ln in names}
                          for v in vocabs}
    rec["replays"] = {v: {ln: [] for ln in names} for v in vocabs}
    rec["decode"] = []
    # In RAM: a cache slot for every expert, no prefetch; a prefill of 256 ids brings (nearly) all experts in.
    with SyncEngine.open(args.model, prefetch="off", cache_per_layer=EVERY_EXPERT, n_ctx=512) as engine:
        grammars = Grammars(engine.engine.tokenizer)
        engine.logits(list(range(100, 356)))
        decode_run(engine, grammars, 8, args.seed)   # warm-up: kernels, graphs
        for run in range(args.runs):
            order = names[run % len(names):] + names[:run % len(names)]
            with exclusive(args.lock):
                rec["decode"].append(decode_run(engine, grammars, args.decode_tokens, args.seed + run))
                for v in vocabs:
                    for ln in order:
                        rec["replays"][v][ln].append(replay(libs[v][ln], seqs[v], VOCAB))
            print(f"run {run + 1}/{args.runs} done", file=sys.stderr)
    summary = summarize(rec)
    rec["summary"] = summary
    md = markdown(rec, summary)
    paths = receipt.write(args.out, f"grammar_{rec['date']}", rec, md)
    print(md)
    print(*paths, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
