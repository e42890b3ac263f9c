"""Aggregate decode throughput with B concurrent streams: our engine beside llama.cpp decoding B sequences together.

By default the model fits in RAM (this measures batched compute, not the disk):
our engine holds every expert in its cache, llama.cpp maps the file. With
``--ram-budget SIZE`` ours streams experts from disk within that budget with
its default placement (a file larger than RAM), llama.cpp still maps it. For each B of
``--batches`` both engines decode B streams at once, greedy (argmax of each
stream's logits, end-of-generation tokens masked so that every stream runs
its ``--tokens``), from the same B prompts of ``--prompt`` token ids (stream
s gets the same ids at every B; ids drawn by a seeded RNG from [3, 2048), the
real tokens of the synthetic files' padded vocabulary, as in bench_decode).
Greedy, not teacher-forced: our engine's streaming API samples its own next
token. Both engines do the same kind of work; their token sequences may part
where two logits are nearly tied (the receipt says how far they agree).

- ours: ``Engine.open(..., parallel=B)`` (B slots, each with its own KV
  cache; B = 1 opens the engine without ``parallel``), then B concurrent
  ``engine.generate(ids, max_tokens=N)`` calls from B asyncio tasks, which the
  engine decodes together one batch per step. The time of each piece is kept.
  An engine without ``parallel`` is reported as "ours: parallel not available
  yet" for B > 1, and the other arms still run.
- llama.cpp: llama-cpp-python's low-level API, as llama-server drives it:
  one context with ``n_seq_max = B`` and a unified KV cache of B x (prompt +
  tokens + margin) positions, n_threads = 2; every prompt prefilled in one
  ``llama_decode`` batch (logits for each prompt's last position), then one
  ``llama_decode`` per step holding the last token of every stream (one
  ``seq_id`` each, logits for each), argmax per stream with
  ``llama_get_logits_ith``. Flash attention off by default, as in
  bench_decode's ``Llama(...)`` (llama-server's default is auto, on for CPUs):
  ``--flash-attn auto|on`` changes it.

Per run and arm: the prefill phase is from the start until every stream has
its first token (the token that follows its prompt); the decode phase from
there until the last stream's last token. Aggregate tok/s = tokens produced
in the decode phase / its wall time. Time per output token (TPOT): the gaps
between consecutive tokens of a stream inside the decode phase, pooled over
the run's streams: p50 and p99. For B = ``--join-at`` (8) also the time to
first token of a new request that arrives while B - 1 streams decode (they
start together and have ``--join-after`` tokens each when it comes), beside
its time alone on the idle engine. Ours: the B-th ``generate`` is called then,
and timed until its first piece. llama.cpp: its prompt is prefilled in the
same batch as the B - 1 decode tokens, and timed until its logits are picked.

Every arm runs in its own worker process (two copies of ggml, ggml-python's
and llama.cpp's, must not share one process), one per (arm, B): the workers
of one B start together (after the page cache is dropped, with
``--drop-caches``) and stop before the next B's start, so only one of our
engines holds the model at a time. Arms interleave run by run (the order flips
every run); run 0 of each is a warm-up (caches filled, graphs built) and not
counted, then ``--runs`` timed runs each. B values run one after the other, so
a ratio across B is between blocks measured minutes apart; the ratio
ours/llama.cpp at one B is between interleaved runs. An arm of ours is a
kernel backend, optionally with one environment setting for its worker after
an ``@``, as in bench_decode.

    python tools/bench_batch.py MODEL.gguf --runs 5 --batches 1,2,4,8 --tokens 32 --prompt 32 --lock /work/cpu.lock
    python tools/bench_batch.py MODEL.gguf --runs 1 --batches 1,8 --arms llama.cpp --no-receipt
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from colibri_aio.bench.lock import exclusive
from colibri_aio.bench.receipt import git_state, header as receipt_header, host_facts, host_line, spread, write as write_receipt
from colibri_aio.bench.arms import arm_env
from colibri_aio.bench.pagecache import drop_page_cache

ROOT = Path(__file__).resolve().parents[1]
EVERY_EXPERT = 10**6   # cache slots per layer: every expert of any model
MASKED = -1e9          # logit bias of an end-of-generation token (finite: our sampling options refuse infinities)
UNAVAILABLE = "ours: parallel not available yet"


# --- workers: one engine each, answering {"op": "decode"|"join", ...} with token times -------------------

class Unavailable(Exception):
    """This arm cannot run at this B (said in the receipt, the benchmark goes on)."""


class Ours:
    """Our engine with one kernel backend, ``parallel`` slots, every expert cached (a model in RAM)."""

    def __init__(self, path: Path, kernels: str, n_ctx: int, parallel: int, ram_budget: str | None) -> None:
        from colibri_aio.engine.engine import Engine

        self.loop = asyncio.new_event_loop()
        # In RAM: every expert cached, nothing to prefetch. Larger than RAM: the engine's defaults within the budget.
        options = (dict(prefetch="off", cache_per_layer=EVERY_EXPERT) if ram_budget is None
                   else {} if ram_budget == "auto" else dict(ram_budget=ram_budget)) \
            | dict(n_ctx=n_ctx, kernels=kernels, history=False)
        if parallel > 1:
            options["parallel"] = parallel
        try:
            self.engine = self.loop.run_until_complete(Engine.open(path, **options))
        except TypeError as exc:
            if parallel > 1 and "parallel" in str(exc):
                raise Unavailable(UNAVAILABLE) from exc
            raise
        # End-of-generation tokens are biased away, so that every stream runs its max_tokens (the llama.cpp arm
        # masks the same tokens of its vocabulary).
        self.bias = {int(t): MASKED for t in self.engine.tokenizer.eog_ids}
        self.describe = (f"{self.engine.kernels.name}: {self.engine.kernels.reason}; "
                         f"{'parallel=' + str(parallel) if parallel > 1 else 'no parallel keyword'}, "
                         f"n_ctx={n_ctx} per slot, "
                         + ("every expert cached, prefetch off" if ram_budget is None else
                            f"--ram-budget {ram_budget}: {self.engine.describe()}")
                         + f", {len(self.bias)} EOG ids masked")

    def _misses(self) -> int:
        return self.engine.stats().misses

    def _counters(self) -> dict:
        """What bounds a run: expert reads (count, bytes, wall time with one in flight), the distinct experts a
        block read per batched step, the machine's load when it starts."""
        s = self.engine.stats()
        return {"misses": s.misses, "io_bytes": s.io_bytes, "read_busy_s": s.read_busy_s,
                "batch_union": s.batch_union, "batch_union_blocks": s.batch_union_blocks}

    def _since(self, before: dict) -> dict:
        after = self._counters()
        return {k: after[k] - before[k] for k in before}

    async def _stream(self, ids: list[int], n: int, t0: float, times: list[float], tokens: list[int],
                      ready: asyncio.Event | None = None, after: int = 0) -> None:
        try:
            async for piece in self.engine.generate(ids, max_tokens=n, reuse=False, logit_bias=self.bias):
                times.append(time.perf_counter() - t0)
                tokens.append(int(piece.token))
                if ready is not None and len(times) == after:
                    ready.set()
        finally:
            if ready is not None:
                ready.set()   # a stream that ended (or failed) early ends the wait for it too

    def decode(self, prompts: list[list[int]], tokens: int) -> dict:
        async def run() -> dict:
            times: list[list[float]] = [[] for _ in prompts]
            ids: list[list[int]] = [[] for _ in prompts]
            before, load = self._counters(), os.getloadavg()[0]
            t0 = time.perf_counter()
            await asyncio.gather(*(self._stream(p, tokens, t0, times[s], ids[s]) for s, p in enumerate(prompts)))
            return {"pieces": times, "tokens": ids, **self._since(before), "load_at_start": load}

        return self.loop.run_until_complete(run())

    def join(self, prompts: list[list[int]], newcomer: list[int], tokens: int, after: int) -> dict:
        """len(prompts) streams start together; when each has ``after`` tokens, ``newcomer`` is asked for: its
        time to first token, then (everything finished) the same request's time alone."""
        async def run() -> dict:
            times: list[list[float]] = [[] for _ in prompts]
            ids: list[list[int]] = [[] for _ in prompts]
            events = [asyncio.Event() for _ in prompts]
            misses = self._misses()
            t0 = time.perf_counter()
            streams = [asyncio.ensure_future(self._stream(p, after + tokens, t0, times[s], ids[s], events[s], after))
                       for s, p in enumerate(prompts)]
            for e in events:
                await e.wait()
            done_early = [s for s in streams if s.done()]
            for s in done_early:
                if s.exception() is not None:
                    raise s.exception()
            t_join = time.perf_counter()
            first = None
            async for piece in self.engine.generate(newcomer, max_tokens=1, reuse=False, logit_bias=self.bias):
                first = time.perf_counter()
                active = sum(1 for s in streams if not s.done())   # streams still decoding at its first token
            loaded = first - t_join
            await asyncio.gather(*streams)
            t1 = time.perf_counter()
            async for piece in self.engine.generate(newcomer, max_tokens=1, reuse=False, logit_bias=self.bias):
                alone = time.perf_counter() - t1
            return {"ttft_loaded": loaded, "ttft_alone": alone, "join_at": t_join - t0,
                    "active_at_first_token": active, "ended_before_join": len(done_early),
                    "pieces": times, "misses": self._misses() - misses}

        return self.loop.run_until_complete(run())

    def close(self) -> None:
        self.loop.run_until_complete(self.engine.aclose())


class LlamaCpp:
    """llama.cpp through llama-cpp-python's low-level API: one context, n_seq_max sequences, a unified KV cache."""

    FLASH = {"off": "LLAMA_FLASH_ATTN_TYPE_DISABLED", "on": "LLAMA_FLASH_ATTN_TYPE_ENABLED",
             "auto": "LLAMA_FLASH_ATTN_TYPE_AUTO"}

    def __init__(self, path: Path, n_seq: int, n_ctx_seq: int, n_batch: int, flash_attn: str) -> None:
        import llama_cpp as lc
        from llama_cpp import _logger

        _logger.set_verbose(False)  # llama.cpp's log lines: errors only (on stderr; stdout carries the replies)
        self.lc = lc
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        mp.n_gpu_layers = 0
        mp.load_mode = lc.LLAMA_LOAD_MODE_MMAP
        self.model = lc.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {path}")
        cp = lc.llama_context_default_params()
        cp.n_ctx = n_seq * n_ctx_seq
        cp.n_batch = cp.n_ubatch = n_batch
        cp.n_seq_max = n_seq
        cp.kv_unified = True
        cp.n_threads = cp.n_threads_batch = 2
        cp.flash_attn_type = getattr(lc, self.FLASH[flash_attn])
        cp.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise SystemExit("llama.cpp could not make a context")
        self.mem = lc.llama_get_memory(self.ctx)
        vocab = lc.llama_model_get_vocab(self.model)
        self.n_vocab = lc.llama_vocab_n_tokens(vocab)
        self.eog = np.array([t for t in range(self.n_vocab) if lc.llama_vocab_is_eog(vocab, t)], dtype=np.int64)
        self.n_batch = n_batch
        self.batch = lc.llama_batch_init(n_batch, 0, 1)   # one seq_id per token
        self.describe = (f"llama-cpp-python {lc.__version__}, low-level batch API, n_seq_max={n_seq}, unified KV "
                         f"cache of {lc.llama_n_ctx(self.ctx)} positions (n_ctx_seq {lc.llama_n_ctx_seq(self.ctx)}), "
                         f"n_batch=n_ubatch={n_batch}, n_threads=2, flash attention {flash_attn}, mmap, "
                         f"{len(self.eog)} EOG ids masked")

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) entries."""
        if len(entries) > self.n_batch:
            raise SystemExit(f"a batch of {len(entries)} tokens is above n_batch {self.n_batch}")
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i] = token
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(entries)
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise SystemExit(f"llama_decode returned {rc} for a batch of {len(entries)} tokens")

    def _pick(self, i: int) -> int:
        """Greedy: the argmax of the logits of batch entry ``i``, EOG tokens masked (as ours biases them)."""
        logits = np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
        if self.eog.size:
            logits = logits.copy()
            logits[self.eog] += MASKED
        return int(np.argmax(logits))

    def _prefill(self, prompts: list[list[int]], seqs: list[int]) -> list[int]:
        """The prompts' entries in one batch, logits at each prompt's last position; returns those indices."""
        entries, last = [], []
        for seq, p in zip(seqs, prompts):
            entries += [(t, j, seq, j == len(p) - 1) for j, t in enumerate(p)]
            last.append(len(entries) - 1)
        self._decode(entries)
        return last

    def decode(self, prompts: list[list[int]], tokens: int) -> dict:
        lc = self.lc
        lc.llama_memory_clear(self.mem, True)
        seqs = list(range(len(prompts)))
        times: list[list[float]] = [[] for _ in prompts]
        ids: list[list[int]] = [[] for _ in prompts]
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        last = self._prefill(prompts, seqs)
        for s, i in enumerate(last):
            ids[s].append(self._pick(i))
            times[s].append(time.perf_counter() - t0)
        steps = []
        for k in range(1, tokens):
            ts = time.perf_counter()
            self._decode([(ids[s][-1], len(prompts[s]) + k - 1, s, True) for s in seqs])
            for s in seqs:
                ids[s].append(self._pick(s))
                times[s].append(time.perf_counter() - t0)
            steps.append(time.perf_counter() - ts)
        return {"pieces": times, "tokens": ids, "steps": steps, "load_at_start": load}

    def join(self, prompts: list[list[int]], newcomer: list[int], tokens: int, after: int) -> dict:
        """len(prompts) streams prefilled together and decoded to ``after`` tokens each; then one batch of their
        next decode tokens and ``newcomer``'s prompt (a new sequence): the time until its first token is picked.
        Then the same prompt alone in an empty cache."""
        lc = self.lc
        lc.llama_memory_clear(self.mem, True)
        seqs = list(range(len(prompts)))
        new = len(prompts)
        last = self._prefill(prompts, seqs)
        ids = [[self._pick(i)] for i in last]
        for k in range(1, after):
            self._decode([(ids[s][-1], len(prompts[s]) + k - 1, s, True) for s in seqs])
            for s in seqs:
                ids[s].append(self._pick(s))
        entries = [(ids[s][-1], len(prompts[s]) + after - 1, s, True) for s in seqs]
        entries += [(t, j, new, j == len(newcomer) - 1) for j, t in enumerate(newcomer)]
        t1 = time.perf_counter()
        self._decode(entries)
        self._pick(len(entries) - 1)
        loaded = time.perf_counter() - t1
        for s in seqs:   # the streams' tokens of that step, after the clock stopped (ours picks them in the step)
            self._pick(s)
        lc.llama_memory_clear(self.mem, True)
        t2 = time.perf_counter()
        self._decode([(t, j, new, j == len(newcomer) - 1) for j, t in enumerate(newcomer)])
        self._pick(len(newcomer) - 1)
        alone = time.perf_counter() - t2
        return {"ttft_loaded": loaded, "ttft_alone": alone, "active_at_first_token": len(prompts),
                "ended_before_join": 0}

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)


def worker(arm: str, path: Path, parallel: int, n_ctx: int, n_batch: int, flash_attn: str,
           ram_budget: str | None) -> int:
    try:
        engine = (LlamaCpp(path, parallel, n_ctx, n_batch, flash_attn) if arm == "llama.cpp"
                  else Ours(path, arm, n_ctx, parallel, ram_budget))
    except Unavailable as exc:
        print(json.dumps({"unavailable": str(exc)}), flush=True)
        return 0
    print(json.dumps({"ready": engine.describe}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        print(json.dumps(getattr(engine, cmd.pop("op"))(**cmd)), flush=True)
    engine.close()
    return 0


class Worker:
    def __init__(self, arm: str, path: Path, parallel: int, n_ctx: int, n_batch: int, flash_attn: str,
                 ram_budget: str | None) -> None:
        self.arm = arm
        backend, env = arm_env(arm)
        # Started outside the checkout: its top-level io/ and kernels/ must not shadow real modules.
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", backend, str(path), "--parallel", str(parallel),
             "--n-ctx", str(n_ctx), "--n-batch", str(n_batch), "--flash-attn", flash_attn,
             *(["--ram-budget", ram_budget] if ram_budget else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=tempfile.gettempdir())
        self.describe = self.unavailable = None

    def ready(self) -> "Worker":
        reply = self._reply()
        self.describe, self.unavailable = reply.get("ready"), reply.get("unavailable")
        if self.unavailable:
            self.proc.wait()
        return self

    def _reply(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise SystemExit(f"worker {self.arm} died (exit {self.proc.wait()})")
            if line.startswith("{"):
                return json.loads(line)
            print(f"[{self.arm}] {line.rstrip()}", file=sys.stderr)   # something else wrote to stdout

    def ask(self, op: str, **options) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **options}) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait()


# --- what a run's token times say ------------------------------------------------------------------------------

def run_metrics(pieces: list[list[float]]) -> dict:
    """Prefill phase, decode phase, aggregate tok/s and TPOT percentiles of one run (times from its start)."""
    t0 = max(p[0] for p in pieces)        # every stream has its first token: the decode phase begins
    t1 = max(p[-1] for p in pieces)
    produced = sum(1 for p in pieces for t in p if t > t0)
    gaps = [b - a for p in pieces for a, b in zip(p, p[1:]) if a >= t0]
    # Streams overlapped when every one had its first token before any had its last (serialized streams do not).
    overlapped = t0 < min(p[-1] for p in pieces)
    return {"prefill_s": t0, "decode_s": t1 - t0, "decode_tokens": produced,
            "agg_tok_s": produced / (t1 - t0) if t1 > t0 else float("nan"),
            "tpot_p50_ms": 1e3 * float(np.percentile(gaps, 50)) if gaps else float("nan"),
            "tpot_p99_ms": 1e3 * float(np.percentile(gaps, 99)) if gaps else float("nan"),
            "overlapped": overlapped}


def agreement(a: list[int], b: list[int]) -> int:
    """How many leading tokens two streams share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _fmt(s: dict | None, digits: int = 2) -> str:
    if not s:
        return "-"
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}–{s['max']:.{digits}f}]"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--batches", default="1,2,4,8", help="numbers of concurrent streams, comma-separated")
    p.add_argument("--runs", type=int, default=5, help="timed runs per (arm, B), after one warm-up")
    p.add_argument("--tokens", type=int, default=32, help="tokens generated per stream (greedy)")
    p.add_argument("--prompt", type=int, default=32, help="prompt length in token ids, per stream")
    p.add_argument("--arms", default="ggml,llama.cpp")
    p.add_argument("--join-at", type=int, default=8,
                   help="at this B, also time a new request's first token while B - 1 streams decode (0: never)")
    p.add_argument("--join-after", type=int, default=4, help="tokens each decoding stream has when it arrives")
    p.add_argument("--flash-attn", choices=("off", "on", "auto"), default="off", help="llama.cpp's flash attention")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "evidence")
    p.add_argument("--no-receipt", action="store_true", help="print the summary, write nothing")
    p.add_argument("--lock", type=Path, default=None, help="hold this lock file exclusively during each run")
    p.add_argument("--drop-caches", action="store_true",
                   help="drop the page cache before each B's workers start (needs root)")
    p.add_argument("--ram-budget", default=None, metavar="SIZE",
                   help="ours within this budget (auto: the engine's default, a share of usable RAM), experts "
                        "streamed from disk with its default placement (a model larger than RAM; llama.cpp maps the "
                        "file); default: every expert cached (in RAM)")
    p.add_argument("--fresh-prompts", action="store_true",
                   help="new prompts every timed run (same for every arm): the experts a run needs are not all "
                        "those the run before read (for a model larger than RAM, whose caches persist across runs)")
    p.add_argument("--cold-runs", action="store_true",
                   help="every run of every arm in a fresh worker, the page cache dropped before it (needs root): "
                        "one engine in memory at a time, each from a cold start; no warm-up run")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--parallel", type=int, help=argparse.SUPPRESS)
    p.add_argument("--n-ctx", type=int, help=argparse.SUPPRESS)
    p.add_argument("--n-batch", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.model, args.parallel, args.n_ctx, args.n_batch, args.flash_attn,
                      args.ram_budget)
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        p.error("--batches takes comma-separated integers")
    if min(batches) < 1 or args.runs < 1 or args.tokens < 2 or args.prompt < 1 or args.join_after < 1:
        p.error("--batches, --runs, --prompt and --join-after must be positive, --tokens at least 2")
    if not args.model.is_file():
        p.error(f"{args.model}: no such file")
    model = args.model.resolve()
    arms = args.arms.split(",")
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(3, 2048, (max(batches), args.prompt)).tolist()

    def prompts_of(run: int) -> list[list[int]]:
        """The prompts of timed run ``run``: the same every run, or with --fresh-prompts drawn anew per run (the
        same for every arm and B), so that a cache kept from the run before does not hold the next run's experts."""
        if not args.fresh_prompts or run == 0:
            return prompts
        return np.random.default_rng([args.seed, run]).integers(3, 2048, (max(batches), args.prompt)).tolist()
    # Positions per sequence: prompt, tokens (the join's decoding streams run join_after more), a margin.
    n_ctx = args.prompt + args.tokens + args.join_after + 8

    dropped: dict[int, bool] = {}
    describe: dict[int, dict[str, str]] = {}
    unavailable: dict[int, dict[str, str]] = {}
    raw: dict[int, dict[str, list[dict]]] = {}
    def record(B: int, a: str, run: int, d: dict, j: dict | None, warmup: bool) -> None:
        rec = {"run": run, "warmup": warmup, **d, "metrics": run_metrics(d["pieces"])}
        if j is not None:
            rec["join"] = j
        raw[B][a].append(rec)
        line = {"B": B, "arm": a, "run": run, **{k: v for k, v in rec["metrics"].items()}}
        if j is not None:
            line |= {"ttft_loaded_s": j["ttft_loaded"], "ttft_alone_s": j["ttft_alone"]}
        print(json.dumps(line), flush=True)

    def measure(worker: Worker, B: int, run: int) -> tuple[dict, dict | None]:
        these = prompts_of(run)
        d = worker.ask("decode", prompts=these[:B], tokens=args.tokens)
        j = (worker.ask("join", prompts=these[:B - 1], newcomer=these[B - 1], tokens=args.tokens,
                        after=args.join_after) if B == args.join_at and B >= 2 else None)
        return d, j

    for B in batches:
        n_batch = max(512, B * args.prompt + B)
        describe[B], unavailable[B] = {}, {}
        raw[B] = {a: [] for a in arms}
        if args.cold_runs:
            # Every (run, arm) in a process of its own, the page cache dropped before it: one engine holds
            # memory at a time (ours' expert cache would otherwise squeeze llama.cpp's page cache), each cold.
            for run in range(args.runs):
                for a in (arms if run % 2 == 0 else arms[::-1]):
                    if a in unavailable[B]:
                        continue
                    with exclusive(args.lock):
                        if not drop_page_cache():
                            raise SystemExit("--cold-runs: cannot write /proc/sys/vm/drop_caches here")
                        w = Worker(a, model, B, n_ctx, n_batch, args.flash_attn, args.ram_budget).ready()
                        try:
                            if w.unavailable:
                                unavailable[B][a] = w.unavailable
                                continue
                            describe[B][a] = w.describe
                            d, j = measure(w, B, run)
                        finally:
                            w.close()
                    record(B, a, run, d, j, warmup=False)
            dropped[B] = True
        else:
            with exclusive(args.lock):
                if args.drop_caches:
                    dropped[B] = drop_page_cache()
                    if not dropped[B]:
                        raise SystemExit("--drop-caches: cannot write /proc/sys/vm/drop_caches here")
                started = [Worker(a, model, B, n_ctx, n_batch, args.flash_attn, args.ram_budget) for a in arms]
                workers = {w.arm: w.ready() for w in started}
            describe[B] = {a: w.describe for a, w in workers.items() if w.describe}
            unavailable[B] = {a: w.unavailable for a, w in workers.items() if w.unavailable}
            live = [a for a in arms if a not in unavailable[B]]
            try:
                for run in range(args.runs + 1):
                    for a in (live if run % 2 == 0 else live[::-1]):
                        with exclusive(args.lock):
                            d, j = measure(workers[a], B, run)
                        record(B, a, run, d, j, warmup=run == 0)
            finally:
                for w in workers.values():
                    w.close()
        for a, why in unavailable[B].items():
            print(f"B={B} {a}: {why}", file=sys.stderr, flush=True)
            raw[B].pop(a, None)

    # --- summary ---
    keys = ("agg_tok_s", "tpot_p50_ms", "tpot_p99_ms", "prefill_s")
    summary: dict[int, dict[str, dict]] = {}
    for B in batches:
        summary[B] = {}
        for a, recs in raw[B].items():
            timed = [r for r in recs if not r["warmup"]]
            s = {k: spread([r["metrics"][k] for r in timed]) | {"samples": [r["metrics"][k] for r in timed]}
                 for k in keys}
            s["all_overlapped"] = all(r["metrics"]["overlapped"] for r in timed)
            if "misses" in timed[0]:
                s["expert_misses_per_run"] = [r["misses"] for r in timed]
            if "read_busy_s" in timed[0]:
                s["read_busy_s_per_run"] = [round(r["read_busy_s"], 3) for r in timed]
                s["io_gb_per_run"] = [round(r["io_bytes"] / 1e9, 3) for r in timed]
                s["union_mean_per_run"] = [round(r["batch_union"] / r["batch_union_blocks"], 2)
                                           for r in timed if r["batch_union_blocks"]]
            if "load_at_start" in timed[0]:
                s["load_at_start"] = [round(r["load_at_start"], 2) for r in timed]
            if "join" in timed[0]:
                for k in ("ttft_loaded", "ttft_alone"):
                    xs = [r["join"][k] for r in timed]
                    s[k] = spread(xs) | {"samples": xs}
                s["join_active_at_first_token"] = [r["join"]["active_at_first_token"] for r in timed]
            summary[B][a] = s
    ours = [a for a in arms if a != "llama.cpp"]
    ratios: dict[int, dict[str, dict[str, float]]] = {}
    for B in batches:
        ratios[B] = {}
        for a in summary[B]:
            r = {}
            if a != "llama.cpp" and "llama.cpp" in summary[B]:
                r["agg_vs_llama_cpp"] = summary[B][a]["agg_tok_s"]["median"] / summary[B]["llama.cpp"]["agg_tok_s"]["median"]
            if 1 in summary and a in summary[1]:
                r["agg_vs_own_b1"] = summary[B][a]["agg_tok_s"]["median"] / summary[1][a]["agg_tok_s"]["median"]
            if "ttft_loaded" in summary[B][a]:
                r["ttft_loaded_vs_alone"] = summary[B][a]["ttft_loaded"]["median"] / summary[B][a]["ttft_alone"]["median"]
            ratios[B][a] = r
    # How far each arm's streams agree: with llama.cpp (same B), and with its own B = 1 (stream 0), last timed run.
    agree: dict[str, dict] = {}
    for B in batches:
        last = {a: recs[-1]["tokens"] for a, recs in raw[B].items()}
        for a in ours:
            if a in last and "llama.cpp" in last:
                agree.setdefault(a, {})[f"B={B} vs llama.cpp"] = [agreement(x, y) for x, y in zip(last[a], last["llama.cpp"])]
        if 1 in raw and B != 1:
            for a in last:
                if a in raw[1]:
                    agree.setdefault(a, {})[f"stream 0 B={B} vs B=1"] = agreement(last[a][0], raw[1][a][-1]["tokens"][0])

    receipt = {
        **receipt_header("tools/bench_batch.py"), "host_facts": host_facts(),
        "git": git_state("colibri_aio", "kernels", "io", "tools/bench_batch.py"),
        "model": model.name, "model_bytes": model.stat().st_size, "batches": batches, "tokens": args.tokens,
        "prompt": args.prompt, "runs": args.runs, "join_at": args.join_at, "join_after": args.join_after,
        "n_ctx_per_sequence": n_ctx, "flash_attn": args.flash_attn, "seed": args.seed, "ram_budget": args.ram_budget,
        "fresh_prompts": args.fresh_prompts, "cold_runs": args.cold_runs,
        "page_cache_dropped": dropped if args.drop_caches else False,
        "arms": {str(B): describe[B] for B in batches}, "unavailable": {str(B): unavailable[B] for B in batches},
        "summary": {str(B): summary[B] for B in batches}, "ratios": {str(B): ratios[B] for B in batches},
        "token_agreement": agree, "prompts": prompts,
        "samples": {str(B): raw[B] for B in batches},
    }
    stamp = receipt["date"]
    where = "in RAM" if args.ram_budget is None else f"ours within --ram-budget {args.ram_budget}"
    lines = [f"# Batched decode, {where}: B = {', '.join(map(str, batches))} concurrent streams — {stamp}", "",
             f"{host_line(receipt)}, commit `{receipt['commit']}`"
             + (f" with uncommitted changes in {len(receipt['git']['modified'])} files" if receipt["git"]["modified"] else "")
             + f", model `{model.name}` ({receipt['model_bytes'] / 1e9:.2f} GB), load average at end "
             f"{receipt['load_average']}", "",
             f"Command: `{receipt['command']}`", "",
             f"B streams decode together, greedy, {args.tokens} tokens each after a prompt of {args.prompt} ids "
             f"(different per stream, the same at every B"
             + ("; drawn anew for every timed run, the same for every arm" if args.fresh_prompts else "")
             + f"). Aggregate tok/s: tokens produced after every stream "
             f"had its first one, over the time from then to the last token; TPOT: gaps between a stream's tokens "
             f"in that phase, pooled over streams (p50, p99, medians over runs); prefill: time until every stream "
             f"had its first token. One worker process per (arm, B)"
             + (", page cache dropped before each B's workers started" if args.drop_caches and not args.cold_runs
                else "")
             + (f"; {args.runs} timed runs per (arm, B), each in a fresh worker after the page cache was dropped "
                f"(one engine in memory at a time, every run cold)" if args.cold_runs else
                f"; {args.runs} timed runs per (arm, B) after one warm-up")
             + ", arms interleaved (order flipped every run). Medians [min–max].", ""]
    for B in batches:
        lines += [f"- B={B} {a}: {d}" for a, d in describe[B].items()]
        lines += [f"- B={B} {a}: **{why}**" for a, why in unavailable[B].items()]
    lines += ["", "| B | arm | aggregate tok/s | ÷ llama.cpp | ÷ own B=1 | TPOT p50 ms | TPOT p99 ms | prefill s |",
              "|---|---|---|---|---|---|---|---|"]
    for B in batches:
        for a in arms:
            if a in unavailable[B]:
                lines.append(f"| {B} | {a} | {unavailable[B][a]} | | | | | |")
                continue
            s, r = summary[B][a], ratios[B][a]
            vs = "1.000" if a == "llama.cpp" else (f"{r['agg_vs_llama_cpp']:.3f}" if "agg_vs_llama_cpp" in r else "-")
            own = f"{r['agg_vs_own_b1']:.3f}" if "agg_vs_own_b1" in r else "-"
            warn = "" if s["all_overlapped"] else " (streams did not overlap)"
            lines.append(f"| {B} | {a} | {_fmt(s['agg_tok_s'])}{warn} | {vs} | {own} | {_fmt(s['tpot_p50_ms'], 1)} | "
                         f"{_fmt(s['tpot_p99_ms'], 1)} | {_fmt(s['prefill_s'], 3)} |")
    joined = [B for B in batches if any("ttft_loaded" in s for s in summary[B].values())]
    for B in joined:
        lines += ["", f"Time to first token of a new request ({args.prompt} ids) arriving while {B - 1} streams "
                  f"decode (each has {args.join_after} tokens), beside the same request alone on the idle engine:", "",
                  "| arm | TTFT with others decoding s | TTFT alone s | ratio | streams still decoding at its first token |",
                  "|---|---|---|---|---|"]
        for a, s in summary[B].items():
            if "ttft_loaded" in s:
                lines.append(f"| {a} | {_fmt(s['ttft_loaded'], 3)} | {_fmt(s['ttft_alone'], 3)} | "
                             f"{ratios[B][a]['ttft_loaded_vs_alone']:.2f} | {s['join_active_at_first_token']} |")
    misses = {(B, a): s["expert_misses_per_run"] for B in batches for a, s in summary[B].items()
              if "expert_misses_per_run" in s and any(s["expert_misses_per_run"])}
    if misses:
        lines += ["", "Expert cache misses in timed runs (reads, not in RAM): "
                  + "; ".join(f"B={B} {a}: {m}" for (B, a), m in misses.items())]
    reads = {(B, a): s for B in batches for a, s in summary[B].items() if "read_busy_s_per_run" in s}
    if reads:
        lines += ["", ("What bounds ours, per timed run (whole run, prefill included): expert bytes asked of the "
                       "disk (GB), wall time with an expert read in flight (s), run time (s), distinct experts a MoE "
                       "block read per step of several streams:")]
        lines += [f"- B={B} {a}: read {s['io_gb_per_run']} GB; reads in flight {s['read_busy_s_per_run']} s of "
                  f"{[round(r['pieces'] and max(max(p) for p in r['pieces']), 2) for r in raw[B][a] if not r['warmup']]} s"
                  + (f"; union {s['union_mean_per_run']}" if s["union_mean_per_run"] else "")
                  for (B, a), s in reads.items()]
    loads = {(B, a): s["load_at_start"] for B in batches for a, s in summary[B].items() if "load_at_start" in s}
    if loads:
        lines += ["", "Load average (1 min) at each timed run's start: "
                  + "; ".join(f"B={B} {a}: {v}" for (B, a), v in loads.items())]
    if agree:
        lines += ["", "Greedy tokens in common from the start (last timed run; of " f"{args.tokens}):"]
        lines += [f"- {a}: " + "; ".join(f"{k}: {v}" for k, v in d.items()) for a, d in agree.items()]
    if not args.no_receipt:
        paths = write_receipt(args.out, f"batch_{stamp}", receipt, "\n".join(lines) + "\n")
        print(f"receipt: {paths[0]} {paths[1]}", file=sys.stderr)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
