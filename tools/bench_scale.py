"""Our engine beside llama.cpp on the same GGUF: fits in RAM, larger than RAM, under a memory limit.

One command measures prefill (pp, 128 ids as one batch) and decode (tg, 64
ids fed one at a time, teacher-forced so neither engine can fall into a loop)
for both engines in three conditions:

- ``fits``: an 8-layer cut (of Qwen3-30B-A3B: ~6 GB) on this machine;
- ``larger``: the whole model (Qwen3-30B-A3B Q8_0: ~32.5 GB), larger than RAM;
- ``limit``: the ``--limit-model`` (default: the 8-layer cut) with a cgroup
  memory limit of ``--limit-share`` (60%) of its size on both engines.

Any family the engine runs: give the files (``--fits-model``,
``--larger-model``), or name a synthetic shape and type to generate
(``--shape mixtral-8x7b --type q4_k``). The receipt names each file's
architecture and description (the synthetic generator writes what it made).
``--lock PATH`` holds an exclusive flock on PATH around each run and each fio
reference (not the whole benchmark), so a shared machine is quiet while a run
is timed and free between runs; it is taken by the ``flock`` command
(colibri_aio.bench.lock), so a site's writer-preferring ``flock`` governs it.

Every run is a fresh process (so peak RSS is the run's own, and the cgroup
limit applies to all of it) started after the page cache is dropped; the two
engines alternate, with the order flipped every round. Inside a run, a warm-up
of pp + 16 tokens on other ids comes first (both engines reach their steady
state: our cache, llama.cpp's page cache), then the timed pp and tg. Our
engine runs with its defaults (budget from RAM or the cgroup limit, io auto,
prefetch auto); llama.cpp through llama-cpp-python with n_threads=2 and its
defaults (mmap, no mlock). A fio reference (random 4 MiB O_DIRECT reads, QD 8,
on the model file) gives the disk's rate in the same run, so a decode can be
placed against it: bytes read / disk rate is the time the disk alone needs.

Models not given are generated outside the repository (tools/make_synthetic_gguf.py,
realistic routing) and removed at the end.

    python tools/bench_scale.py --runs 5
    python tools/bench_scale.py --runs 5 --fits-model L8.gguf --larger-model L48.gguf --conditions fits,limit,larger
    python tools/bench_scale.py --runs 5 --conditions larger --larger-model /work/models/mixtral_q4_k.gguf \
        --pp 32 --tg 16 --lock /work/cpu.lock
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench_prefetch import make_model
from colibri_aio.bench.iobench import measure_fio
from colibri_aio.bench.lock import exclusive
from colibri_aio.bench.receipt import header as receipt_header, host_line, spread, write as write_receipt
from colibri_aio.bench.pagecache import drop_page_cache

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ("ours", "llama.cpp")
WARMUP_TG = 16


# --- one run, in its own process -------------------------------------------------------------------


def token_ids(seed: int, n: int) -> list[int]:
    """Fixed ids below 2048 (ordinary tokens of the Qwen vocabulary; the synthetic models route on weights)."""
    return np.random.default_rng(seed).integers(3, 2048, n).tolist()


def proc_read_bytes() -> int:
    """Bytes this process caused to be read from storage (/proc/self/io), page faults included."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def context(pp: int, tg: int) -> int:
    """KV positions a run needs: the longer of the warm-up and the timed part, plus slack."""
    return pp + max(tg, WARMUP_TG) + 8


def worker_ours(model: Path, pp: int, tg: int, seed: int, warm_start: bool | None = None) -> dict:
    import asyncio

    from colibri_aio.engine.engine import Engine
    from colibri_aio.engine.memory import peak_rss_bytes

    async def run() -> dict:
        t_open = time.perf_counter()
        # None: the engine's default (the warm start is on by default); an earlier version passed False here
        options = {} if warm_start is None else {"warm_start": warm_start}
        engine = await Engine.open(model, n_ctx=context(pp, tg), **options)
        open_s = time.perf_counter() - t_open
        try:
            net, src = engine.net, engine.source
            warm = token_ids(seed + 1, pp + WARMUP_TG)
            await engine.prefill(warm[:pp])
            for t in warm[pp:]:
                await net.forward([t])
            ids = token_ids(seed, pp + tg)
            s0, d0 = engine.stats(), proc_read_bytes()
            t0 = time.perf_counter()
            await engine.prefill(ids[:pp])
            t1 = time.perf_counter()
            s1, w1 = engine.stats(), src.demand_wait_s
            for t in ids[pp:]:
                await net.forward([t])
            t2 = time.perf_counter()
            s2, w2, d2 = engine.stats(), src.demand_wait_s, proc_read_bytes()
            bp = src.policy.backpressure
            tg_lookups = s2.lookups - s1.lookups
            tg_hits = tg_lookups - (s2.misses - s1.misses)
            tg_wall = t2 - t1
            read_busy = s2.read_busy_s - s1.read_busy_s
            compute_busy = tg_wall - (w2 - w1)
            return {
                "pp_tok_s": pp / (t1 - t0), "tg_tok_s": tg / tg_wall, "open_s": open_s,
                "peak_rss": peak_rss_bytes(), "plan": engine.plan.one_line(),
                "cache_slots": src.policy.cache.n_slots,
                "tg_hit_rate": tg_hits / tg_lookups if tg_lookups else 0.0,
                "pp_gb_read": (s1.io_bytes - s0.io_bytes) / 1e9, "tg_gb_read": (s2.io_bytes - s1.io_bytes) / 1e9,
                "disk_gb_read": (d2 - d0) / 1e9,
                "tg_demand_wait_s": w2 - w1, "tg_read_busy_s": read_busy, "tg_compute_busy_s": compute_busy,
                "tg_overlap": (compute_busy + read_busy) / tg_wall,
                "prefetch_state": "on" if s2.prefetch_on else "off", "prefetch_reason": s2.prefetch_reason,
                "prefetch_switched_off": bp.counters.turned_off, "prefetch_switched_on": bp.counters.turned_on,
                "prefetch_reasons": dict(bp.counters.reasons),
                "prefetch_hits": s2.prefetch_hits - s1.prefetch_hits,
                "prefetch_wasted": s2.prefetch_wasted - s1.prefetch_wasted,
                "io": src.reader.backend,
            }
        finally:
            await engine.aclose()

    return asyncio.run(run())


def _without_repack() -> None:
    """llama.cpp's --no-repack (model params use_extra_bufts = false), which llama-cpp-python does not expose.

    On AVX-512 llama.cpp copies K-quant weights it can repack out of the mmap
    into its own buffer at load: for a Q4_K model larger than RAM that buffer
    cannot be allocated and the load fails; without repacking it computes from
    the mmap'd bytes.
    """
    from llama_cpp import llama_cpp as bindings  # the module Llama reads its defaults from

    defaults = bindings.llama_model_default_params

    def no_repack():
        params = defaults()
        params.use_extra_bufts = False
        return params

    bindings.llama_model_default_params = no_repack


def worker_llama(model: Path, pp: int, tg: int, seed: int, no_repack: bool = False) -> dict:
    from llama_cpp import Llama

    from colibri_aio.engine.memory import peak_rss_bytes

    if no_repack:
        _without_repack()
    t_open = time.perf_counter()
    llm = Llama(model_path=str(model), n_ctx=context(pp, tg), n_threads=2, n_threads_batch=2, n_batch=512,
                verbose=False)
    open_s = time.perf_counter() - t_open
    warm = token_ids(seed + 1, pp + WARMUP_TG)
    llm.reset()
    llm.eval(warm[:pp])
    for t in warm[pp:]:
        llm.eval([t])
    ids = token_ids(seed, pp + tg)
    llm.reset()
    d0 = proc_read_bytes()
    t0 = time.perf_counter()
    llm.eval(ids[:pp])
    t1 = time.perf_counter()
    for t in ids[pp:]:
        llm.eval([t])
    t2 = time.perf_counter()
    return {"pp_tok_s": pp / (t1 - t0), "tg_tok_s": tg / (t2 - t1), "open_s": open_s,
            "peak_rss": peak_rss_bytes(), "disk_gb_read": (proc_read_bytes() - d0) / 1e9}


# --- conditions ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Condition:
    name: str
    model: Path
    limit: int | None  # bytes, applied to both engines through a cgroup


class MemoryCgroup:
    """A child memory cgroup with a limit (v1 ``memory.limit_in_bytes`` or v2 ``memory.max``)."""

    def __init__(self, limit: int) -> None:
        v2 = Path("/sys/fs/cgroup")
        if (v2 / "cgroup.controllers").exists():
            self.version, base = 2, v2
            self.limit_file, self.peak_file = "memory.max", "memory.peak"
        elif (v2 / "memory" / "memory.limit_in_bytes").exists():
            self.version, base = 1, v2 / "memory"
            self.limit_file, self.peak_file = "memory.limit_in_bytes", "memory.max_usage_in_bytes"
        else:
            raise SystemExit("no cgroup memory controller at /sys/fs/cgroup: the limit condition cannot run")
        self.path = base / f"colibri-bench-{os.getpid()}"
        self.path.mkdir()
        (self.path / self.limit_file).write_text(str(limit))
        self.limit = int((self.path / self.limit_file).read_text().strip())

    def reset_peak(self) -> None:
        if self.version == 1:  # v2's memory.peak is per cgroup lifetime; a fresh group per run would be needed
            (self.path / self.peak_file).write_text("0")
            (self.path / "memory.failcnt").write_text("0")

    def peak(self) -> int | None:
        try:
            return int((self.path / self.peak_file).read_text().strip())
        except OSError:
            return None

    def failcnt(self) -> int | None:
        try:
            return int((self.path / "memory.failcnt").read_text().strip())
        except OSError:
            return None

    def enter(self) -> None:
        """Move the calling process into the group (run in the child before exec)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def one_run(engine: str, cond: Condition, args: argparse.Namespace, cgroup: MemoryCgroup | None) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", engine, "--model", str(cond.model),
           "--pp", str(args.pp), "--tg", str(args.tg), "--seed", str(args.seed)]
    if args.llama_no_repack:
        cmd.append("--llama-no-repack")
    if args.ours_warm_start:
        cmd.append("--ours-warm-start")
    dropped = drop_page_cache()
    if cgroup is not None:
        cgroup.reset_peak()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                          preexec_fn=cgroup.enter if cgroup is not None else None)
    wall = time.perf_counter() - t0
    result: dict = {"engine": engine, "condition": cond.name, "wall_s": wall, "page_cache_dropped": dropped,
                    "returncode": proc.returncode}
    if cgroup is not None:
        result.update(cgroup_peak=cgroup.peak(), cgroup_failcnt=cgroup.failcnt())
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        result["error"] = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        if proc.returncode == -9:
            result["error"] = "killed (SIGKILL: the memory limit's OOM killer)"
        return result
    result.update(json.loads(lines[-1]))
    return result


def describe_model(path: Path) -> dict:
    """What a condition's file is: its architecture, name and description (general.* keys)."""
    from gguf import GGUFReader

    fields = GGUFReader(path).fields

    def key(name: str) -> str | None:
        f = fields.get(name)
        return None if f is None else str(f.contents())

    return {"architecture": key("general.architecture"), "name": key("general.name"),
            "description": key("general.description")}


def fio_reference(model: Path, seconds: int) -> dict | None:
    """The disk's random-read rate on the model file: 4 MiB O_DIRECT reads at QD 8 (an expert is ~5 MB)."""
    if shutil.which("fio") is None:
        return None
    drop_page_cache()
    try:
        r = measure_fio(model, 4 << 20, 8, "rand", seconds, direct=True, seed=0)
    except RuntimeError:
        return None
    return {"gb_s": r["gbps"], "iops": r["iops"], "seconds": r["seconds"], "command": r["command"]}


# --- summary ----------------------------------------------------------------------------------------------


def summarise(runs: list[dict]) -> dict:
    out: dict = {}
    for cond in dict.fromkeys(r["condition"] for r in runs):
        out[cond] = {}
        for engine in ENGINES:
            ok = [r for r in runs if r["condition"] == cond and r["engine"] == engine and "error" not in r]
            failed = [r for r in runs if r["condition"] == cond and r["engine"] == engine and "error" in r]
            entry: dict = {"failed": len(failed), "errors": sorted({r["error"] for r in failed})}
            if ok:
                for key in ("pp_tok_s", "tg_tok_s", "peak_rss", "disk_gb_read", "open_s"):
                    entry[key] = spread([r[key] for r in ok])
                if ok[0].get("cgroup_peak") is not None:
                    entry["cgroup_peak"] = spread([r["cgroup_peak"] for r in ok])
                if engine == "ours":
                    for key in ("tg_hit_rate", "tg_gb_read", "pp_gb_read", "tg_overlap", "tg_demand_wait_s",
                                "tg_compute_busy_s", "tg_read_busy_s"):
                        entry[key] = spread([r[key] for r in ok])
                    entry["prefetch_final"] = {s: sum(r["prefetch_state"] == s for r in ok) for s in ("on", "off")}
                    entry["prefetch_switches"] = [r["prefetch_switched_off"] + r["prefetch_switched_on"] for r in ok]
            out[cond][engine] = entry
        o, ll = out[cond]["ours"], out[cond]["llama.cpp"]
        if "tg_tok_s" in o and "tg_tok_s" in ll:
            out[cond]["ratio"] = {k: o[k]["median"] / ll[k]["median"] for k in ("tg_tok_s", "pp_tok_s")}
    if "limit" in out and "fits" in out and "tg_tok_s" in out["limit"]["ours"] and "tg_tok_s" in out["fits"]["ours"]:
        out["limit"]["ours_vs_unlimited_tg"] = (out["limit"]["ours"]["tg_tok_s"]["median"]
                                                / out["fits"]["ours"]["tg_tok_s"]["median"])
    return out


def _cell(entry: dict, key: str, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    if key not in entry:
        return "—"
    s = entry[key]
    return f"{fmt.format(s['median'] * scale)} [{fmt.format(s['min'] * scale)}–{fmt.format(s['max'] * scale)}]"


def markdown(receipt: dict) -> str:
    lines = [f"# Scale: our engine beside llama.cpp — {receipt['date']}", "",
             f"{host_line(receipt)}, {receipt['ram_gib']:.1f} GiB RAM, commit "
             f"`{receipt['commit']}`, load average at end {receipt['load_average']}", "",
             f"Command: `{receipt['command']}`", "",
             f"pp = {receipt['pp']} ids as one batch, tg = {receipt['tg']} ids one at a time (teacher-forced), "
             f"after a warm-up of pp + {WARMUP_TG} on other ids; one fresh process per run, page cache dropped "
             f"before each ({'yes' if receipt['page_cache_dropped'] else 'NOT permitted here'}); engines "
             "alternate, order flipped every round. Models below (synthetic ones: tools/make_synthetic_gguf.py).",
             ""]
    if receipt.get("user_note"):
        lines += [receipt["user_note"], ""]
    if receipt.get("ours_warm_start"):
        lines += ["Our engine ran with its warm start (`Engine.open(warm_start=True)`), not its defaults: the "
                  "expert cache fills from the open on, behind the reads the model waits for.", ""]
    if receipt.get("llama_no_repack"):
        lines += ["llama.cpp ran without weight repacking (`--no-repack`): with it, its load allocates a "
                  "repacked copy of the K-quant weights outside the mmap, which for a model larger than RAM "
                  "fails (`unable to allocate CPU_REPACK buffer`).", ""]
    for cond in receipt["conditions"]:
        c = receipt["conditions"][cond]
        s = receipt["summary"].get(cond, {})
        fio = c.get("fio")
        lines += [f"## {cond}: `{c['model']}` ({c['model_bytes'] / 1e9:.2f} GB)"
                  + (f", cgroup v{c['cgroup_version']} limit {c['limit'] / 2**30:.2f} GiB" if c.get("limit") else ""),
                  "", f"Model: `{c['about']['architecture']}` {c['about']['name']}: {c['about']['description']}", "",
                  "Disk reference (fio, random 4 MiB O_DIRECT reads, QD 8, on the model file): "
                  + (f"{fio['gb_s']:.2f} GB/s" if fio else "not measured"), "",
                  "| engine | n ok / failed | pp tok/s median [min–max] | tg tok/s median [min–max] | peak RSS GiB "
                  "| cgroup peak GiB | GB read from disk (pp+tg) |", "|---|---|---|---|---|---|---|"]
        for engine in ENGINES:
            e = s.get(engine, {})
            n_ok = e.get("tg_tok_s", {}).get("n", 0)
            lines.append(f"| {engine} | {n_ok} / {e.get('failed', 0)} | {_cell(e, 'pp_tok_s')} | "
                         f"{_cell(e, 'tg_tok_s', fmt='{:.3f}')} | {_cell(e, 'peak_rss', 1 / 2**30)} | "
                         f"{_cell(e, 'cgroup_peak', 1 / 2**30)} | {_cell(e, 'disk_gb_read')} |")
        if "ratio" in s:
            lines += ["", f"**ours ÷ llama.cpp: tg {s['ratio']['tg_tok_s']:.3f}, pp {s['ratio']['pp_tok_s']:.3f}** "
                      "(medians of the same run)"]
        if "ours_vs_unlimited_tg" in s:
            lines += ["", f"**ours under the limit ÷ ours in the fits condition (tg): {s['ours_vs_unlimited_tg']:.3f}**"]
        o = s.get("ours", {})
        if "tg_hit_rate" in o:
            lines += ["", f"Ours during tg: expert hit rate {_cell(o, 'tg_hit_rate', 100, '{:.1f}')} %, "
                      f"GB read {_cell(o, 'tg_gb_read')} (pp {_cell(o, 'pp_gb_read')}), waited for demand reads "
                      f"{_cell(o, 'tg_demand_wait_s')} s, compute busy {_cell(o, 'tg_compute_busy_s')} s, read busy "
                      f"{_cell(o, 'tg_read_busy_s')} s, overlap {_cell(o, 'tg_overlap')}; prefetch at the end "
                      f"{o['prefetch_final']}, switches per run {o['prefetch_switches']}."]
            if fio and "tg_gb_read" in o:
                disk_s = o["tg_gb_read"]["median"] / fio["gb_s"]
                lines += ["", f"Bound: tg read {o['tg_gb_read']['median']:.2f} GB, which the disk alone needs "
                          f"{disk_s:.1f} s for at the fio rate; compute was busy "
                          f"{o['tg_compute_busy_s']['median']:.1f} s; wall {receipt['tg'] / o['tg_tok_s']['median']:.1f} s."]
        for engine in ENGINES:
            for err in s.get(engine, {}).get("errors", []):
                lines.append(f"\n{engine} failed: {err}")
        lines.append("")
    lines.append("Every sample (and each of our runs' plan line, prefetch reasons and read counters) is in the "
                 "JSON receipt beside this file.")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conditions", default="fits,limit,larger")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--pp", type=int, default=128)
    p.add_argument("--tg", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fits-model", type=Path, help="8-layer cut (default: generated from --shape, then removed)")
    p.add_argument("--larger-model", type=Path, help="the whole model (default: generated from --shape, then removed)")
    p.add_argument("--shape", default="qwen3-30b-a3b", help="synthetic shape of generated models (make_synthetic_gguf)")
    p.add_argument("--type", default="q8_0", help="tensor types of generated models (make_synthetic_gguf --type)")
    p.add_argument("--lock", type=Path, help="hold an exclusive flock on this file around each run")
    p.add_argument("--llama-no-repack", action="store_true",
                   help="llama.cpp without weight repacking (its --no-repack): needed where the repacked copy "
                        "of a K-quant model does not fit in RAM")
    p.add_argument("--ours-warm-start", action="store_true",
                   help="our engine with its warm start (Engine.open(warm_start=True): the expert cache fills "
                        "from the open on, behind demand reads) instead of its defaults")
    p.add_argument("--limit-model", type=Path, help="model of the limit condition (default: the fits model)")
    p.add_argument("--limit-share", type=float, default=0.6, help="cgroup limit as a share of the GGUF size")
    p.add_argument("--fio-seconds", type=int, default=5)
    p.add_argument("--timeout", type=float, default=3600, help="seconds one run may take")
    p.add_argument("--workdir", type=Path, default=Path("/work/artifacts"), help="where generated models go")
    p.add_argument("--out", type=Path, default=ROOT / "evidence")
    p.add_argument("--note", default="", help="said in the receipt (what the files are, and why)")
    p.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        if args.worker == "ours":
            result = worker_ours(args.model, args.pp, args.tg, args.seed, True if args.ours_warm_start else None)
        else:
            result = worker_llama(args.model, args.pp, args.tg, args.seed, args.llama_no_repack)
        print(json.dumps(result), flush=True)
        return 0
    conds = args.conditions.split(",")
    made: list[Path] = []
    tmp = Path(tempfile.mkdtemp(dir=args.workdir, prefix="bench-scale-"))

    def model_for(given: Path | None, layers: int | None) -> Path:
        if given is not None:
            return given
        path = tmp / f"{args.shape}_{'l%d' % layers if layers else 'all'}_{args.type}_real.gguf"
        make_model(path, layers, args.shape, args.type)
        made.append(path)
        return path

    runs: list[dict] = []
    info: dict = {}
    dropped = True
    try:
        fits = model_for(args.fits_model, 8) if {"fits", "limit"} & set(conds) else None
        for name in conds:
            if name == "fits":
                cond = Condition("fits", fits, None)
            elif name == "larger":
                cond = Condition("larger", model_for(args.larger_model, None), None)
            elif name == "limit":
                model = args.limit_model or fits
                cond = Condition("limit", model, int(args.limit_share * model.stat().st_size))
            else:
                raise SystemExit(f"unknown condition {name!r} (fits, limit, larger)")
            cgroup = MemoryCgroup(cond.limit) if cond.limit else None
            with exclusive(args.lock):
                fio = fio_reference(cond.model, args.fio_seconds)
            info[name] = {"model": cond.model.name, "model_bytes": cond.model.stat().st_size,
                          "about": describe_model(cond.model), "limit": cgroup.limit if cgroup else None,
                          "cgroup_version": cgroup.version if cgroup else None, "fio": fio}
            try:
                for i in range(args.runs):
                    order = ENGINES if i % 2 == 0 else ENGINES[::-1]
                    for engine in order:
                        with exclusive(args.lock):
                            r = one_run(engine, cond, args, cgroup)
                        r["run"] = i
                        dropped &= r["page_cache_dropped"]
                        runs.append(r)
                        print(json.dumps({k: r.get(k) for k in ("condition", "engine", "run", "pp_tok_s", "tg_tok_s",
                                                                "peak_rss", "tg_hit_rate", "error")}), flush=True)
            finally:
                if cgroup is not None:
                    cgroup.remove()
    finally:
        for path in made:
            path.unlink(missing_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    from colibri_aio.engine.memory import meminfo

    receipt = {**receipt_header("tools/bench_scale.py"), "ram_gib": meminfo()["MemTotal"] / 2**30,
               "pp": args.pp, "tg": args.tg, "page_cache_dropped": dropped, "conditions": info,
               "summary": summarise(runs), "runs": runs,
               "llama_cpp": _llama_version(), "llama_no_repack": args.llama_no_repack,
               "ours_warm_start": args.ours_warm_start,
               "note": "shared 2-vCPU machine; llama-cpp-python built from source, n_threads=2, mmap on, mlock off"
               + (", weight repacking off (--no-repack)" if args.llama_no_repack else ""),
               "user_note": args.note}
    write_receipt(args.out, f"scale_{receipt['date']}", receipt, markdown(receipt))
    print(markdown(receipt))
    return 0


def _llama_version() -> str | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp.__version__


if __name__ == "__main__":
    sys.exit(main())
