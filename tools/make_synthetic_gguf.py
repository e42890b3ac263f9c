"""Write a random but valid MoE GGUF with a real model's shapes (for benchmarks).

    python tools/make_synthetic_gguf.py --shape qwen3-30b-a3b --type q8_0 --out /work/artifacts/q30b_q8_0.gguf
    python tools/make_synthetic_gguf.py --shape qwen3-30b-a3b --layers 8 --type q4_k \\
        --routing realistic --out /work/artifacts/q30b_8l_q4_k_real.gguf
    python tools/make_synthetic_gguf.py --shape deepseek-v3 --layers 8 --type q4_k --out /work/models/dsv3_8l.gguf

Shapes (tools/synthetic/shapes.py): qwen3-30b-a3b (qwen3moe), mixtral-8x7b (llama),
olmoe-1b-7b, qwen2-57b-a14b (qwen2moe), deepseek-v3 (deepseek2, MLA, 3 dense
blocks), glm-4.5-air (glm4moe, with its NextN block), gpt-oss-120b (gpt-oss),
minimax-m2 (minimax-m2), qwen3-next-80b-a3b (qwen3next: gated DeltaNet on 3 of 4
blocks), and tiny-* versions of each for tests. Tensors and keys per family are those
of fixtures/families.md.

Weights are random bytes turned into valid Q8_0 / Q4_K / Q6_K blocks with a
chosen standard deviation (tools/synthetic/blocks.py): no float weights exist
at any point, and the file is streamed, so a 32 GB model needs ~0.3 GB of RAM.
Type census:

    --type q8_0   matrices, token_embd and output Q8_0            (llama.cpp's MOSTLY_Q8_0)
    --type q4_k   matrices and token_embd Q4_K, output Q6_K        (Q4_K_M's output head; Q4_K_M
                  would also move some attn_v/ffn_down to Q6_K — here every expert has one size)
    --type mxfp4  routed experts MXFP4, everything else Q8_0      (llama.cpp's MOSTLY_MXFP4_MOE, gpt-oss)
    --type iq2_xxs (iq1_s, iq3_xxs)  routed experts IQ2_XXS (IQ1_S, IQ3_XXS), the other matrices and
                  token_embd Q4_K, output Q6_K                    (as unsloth's dynamic UD-IQ* files put them)
    all           norms, biases and routers (ffn_gate_inp) F32, as llama.cpp keeps them; a matrix
                  whose rows do not fill the type's blocks (DeepSeek's attn_k_b, GLM-4.5-Air's
                  1408-wide experts, gpt-oss's 2880) takes llama.cpp's fallback: Q5_0 for Q4_K, else Q8_0

Routing (tools/synthetic/routing.py): ``uniform`` independent random routers,
or ``realistic`` popularity-biased, layer-correlated routers. In both modes a
short forward pass of our engine on the written file then fits the routers
(tools/synthetic/calibrate.py): their random part is made blind to the mean
hidden state of their layer (a fixed per-expert offset otherwise) and the
realistic bias is scaled to its design; --calibration-passes 0 skips it. Only
files of the families the engine runs are fitted (the fitting runs its forward
pass: qwen3moe, llama, olmoe, qwen2moe); the others keep their routers as
drawn, which the description says. The mode, seed and
targets are in general.description and in ``synthetic.*`` keys.

The tokenizer is the shared 2048-token one padded with unused placeholders to
the shape's vocabulary (tools/synthetic/vocab.py). Same arguments and seed give
the same bytes; a cut (--layers N) holds the first N layers of the full model
(before the fitting pass, which fits each file on its own).

Prints one JSON summary line (sizes, timings, throughput, peak RSS, calibration)
on stdout; --report PATH writes it to a file too.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import gguf
from gguf import GGMLQuantizationType as T

from colibri_aio.arch import SUPPORTED_ARCHITECTURES

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic.routing import MODES, RouterSet, RoutingTargets, make_routers  # noqa: E402
from synthetic.keys import add_shape_keys  # noqa: E402
from synthetic.shapes import SHAPES, Shape, resolve  # noqa: E402
from synthetic.tensors import CODE_CHANNELS, TensorPlan, plan_tensors  # noqa: E402
from synthetic.vocab import add_padded_tokenizer  # noqa: E402
from synthetic.writer import write_gguf  # noqa: E402

# --type -> (matrices, token_embd, output, general.file_type)
TYPE_MIXES: dict[str, tuple[T, T, T, gguf.LlamaFileType]] = {
    "q8_0": (T.Q8_0, T.Q8_0, T.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "q4_k": (T.Q4_K, T.Q4_K, T.Q6_K, gguf.LlamaFileType.MOSTLY_Q4_K_M),
    "mxfp4": (T.Q8_0, T.Q8_0, T.Q8_0, gguf.LlamaFileType.MOSTLY_MXFP4_MOE),
    # unsloth's dynamic low-bit files: experts at the low-bit type, the trunk at Q4_K, the head at Q6_K
    "iq1_s": (T.Q4_K, T.Q4_K, T.Q6_K, gguf.LlamaFileType.MOSTLY_IQ1_S),
    "iq2_xxs": (T.Q4_K, T.Q4_K, T.Q6_K, gguf.LlamaFileType.MOSTLY_IQ2_XXS),
    "iq3_xxs": (T.Q4_K, T.Q4_K, T.Q6_K, gguf.LlamaFileType.MOSTLY_IQ3_XXS),
}
# routed experts' type where it is not the matrices' one
EXPERT_TYPES: dict[str, T] = {"mxfp4": T.MXFP4, "iq1_s": T.IQ1_S, "iq2_xxs": T.IQ2_XXS, "iq3_xxs": T.IQ3_XXS}
CALIBRATED_FAMILIES = SUPPORTED_ARCHITECTURES  # families the engine's forward pass (calibrate.py) runs
FREE_SPACE_MARGIN = 1 << 30  # leave at least this much free on the target disk


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=None, help="keep the first N blocks (default: all)")
    p.add_argument("--context", type=int, default=None, help="context_length (default: the shape's)")
    p.add_argument("--type", choices=sorted(TYPE_MIXES), default="q8_0")
    p.add_argument("--routing", choices=MODES, default="uniform")
    p.add_argument("--target-entropy", type=float, default=RoutingTargets.entropy,
                   help="realistic mode: population expert-use entropy / log E (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="output .gguf (keep it outside the repository)")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument("--chunk-mb", type=int, default=16, help="bytes generated per write (default: %(default)s MB)")
    p.add_argument("--calibration-tokens", type=int, default=16,
                   help="tokens of the forward pass that fits the routers (default: %(default)s)")
    p.add_argument("--calibration-passes", type=int, default=2,
                   help="forward passes fitting the routers; 0 keeps them as drawn (default: %(default)s)")
    p.add_argument("--report", type=Path, default=None, help="also write the JSON summary here")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p.parse_args(argv)


def description(shape: Shape, full: Shape, qtype: str, routers: RouterSet, seed: int, fitted: bool = True) -> str:
    """general.description: what this file is, including the routing mode, in one sentence or two."""
    cut = f" cut to {shape.block_count} of {full.block_count} layers" if shape.block_count != full.block_count else ""
    routing = f"routing={routers.mode}"
    if routers.mode == "realistic":
        t = routers.targets
        routing += (f" (popularity-biased routers: target expert-use entropy {t.entropy:.2f}, "
                    f"popularity correlation {t.bias_corr} and router correlation {t.router_corr} "
                    f"between consecutive layers, {'fitted by a forward pass' if fitted else 'not fitted'})")
    elif fitted:
        routing += (" (independent Gaussian routers, made orthogonal to each layer's mean state by a "
                    "forward pass: near-uniform expert use)")
    else:
        routing += " (independent Gaussian routers, not fitted)"
    return (f"Synthetic random-weight {full.family} with the shape of {full.name}{cut}, {qtype.upper()}, "
            f"{routing}, seed {seed}. Not a trained model: its output is noise.")


def metadata_adder(shape: Shape, full: Shape, qtype: str, routers: RouterSet, seed: int, fitted: bool = True):
    """A callback adding the family's keys, the tokenizer and the synthetic.* provenance keys."""
    def add(w: gguf.GGUFWriter) -> None:
        w.add_name(f"synthetic-{full.name}-{shape.block_count}l-{qtype}-{routers.mode}")
        w.add_description(description(shape, full, qtype, routers, seed, fitted))
        w.add_file_type(TYPE_MIXES[qtype][3])
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        add_shape_keys(w, shape)
        add_padded_tokenizer(w, shape.vocab_size)
        w.add_string("synthetic.shape", full.name)
        w.add_string("synthetic.routing", routers.mode)
        w.add_string("synthetic.type", qtype)
        w.add_uint64("synthetic.seed", seed)
        w.add_string("synthetic.targets", json.dumps(routers.targets.as_dict()))
        w.add_uint32("synthetic.code_channels", CODE_CHANNELS)
    return add


def check_destination(out: Path, force: bool, nbytes: int) -> None:
    """Refuse to overwrite without --force, and to start a file the disk cannot hold."""
    if out.exists() and not force:
        raise SystemExit(f"make_synthetic_gguf: {out} exists; pass --force to overwrite")
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free + (out.stat().st_size if out.exists() else 0)
    if nbytes + FREE_SPACE_MARGIN > free:
        raise SystemExit(f"make_synthetic_gguf: {out.parent} has {free / 1e9:.1f} GB free, "
                         f"the model needs {nbytes / 1e9:.1f} GB (+1 GB margin)")


def _progress(quiet: bool, total: int):
    last = [0.0]
    t0 = time.perf_counter()

    def report(name: str, position: int) -> None:
        now = time.perf_counter()
        if quiet or (now - last[0] < 5 and position < total):
            return
        last[0] = now
        print(f"  {position / 1e9:7.2f} / {total / 1e9:.2f} GB  {position / 1e9 / (now - t0):.2f} GB/s  {name}",
              file=sys.stderr, flush=True)
    return report


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    full = SHAPES[args.shape]
    matrix, embd, output, _ = TYPE_MIXES[args.type]
    targets = RoutingTargets(entropy=args.target_entropy)
    try:
        shape = resolve(args.shape, args.layers, args.context)
        # one router per block, NextN blocks included (layer i's depends only on layers <= i)
        routers = make_routers(replace(shape, block_count=shape.total_blocks), args.routing, targets, args.seed)
        plans: list[TensorPlan] = plan_tensors(shape, matrix, embd, output, routers.routers, args.seed,
                                               expert=EXPERT_TYPES.get(args.type))
    except ValueError as exc:
        raise SystemExit(f"make_synthetic_gguf: {exc}") from None
    fitted = args.calibration_passes > 0 and shape.family in CALIBRATED_FAMILIES
    data_bytes = sum(p.nbytes for p in plans)
    check_destination(args.out, args.force, data_bytes)
    partial = args.out.with_name(args.out.name + ".partial")
    try:
        stats = write_gguf(partial, metadata_adder(shape, full, args.type, routers, args.seed, fitted), plans,
                           args.seed, chunk_bytes=args.chunk_mb << 20, progress=_progress(args.quiet, data_bytes),
                           arch=shape.family)
        write_rss = peak_rss_bytes()  # before calibration maps (and counts) the file's pages
        calibration, cal_seconds = None, 0.0
        if fitted:
            from synthetic.calibrate import calibrate

            t0 = time.perf_counter()
            history = calibrate(partial, args.seed, targets.logit_std, args.calibration_tokens,
                                args.calibration_passes)
            cal_seconds = time.perf_counter() - t0
            calibration = [[asdict(f) for f in fits] for fits in history]
        os.replace(partial, args.out)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    summary = {
        "out": str(args.out), "shape": asdict(shape), "type": args.type, "routing": args.routing,
        "seed": args.seed, "targets": targets.as_dict() if args.routing == "realistic" else None,
        "bias_scale_tau": routers.bias_scale, "expected_top10_share": routers.expected_top10_share,
        "file_bytes": stats.nbytes, "write_seconds": round(stats.seconds, 3),
        "write_gb_per_s": round(stats.bytes_per_second / 1e9, 3),
        "calibration_seconds": round(cal_seconds, 3), "calibration": calibration,
        "write_peak_rss_bytes": write_rss, "peak_rss_bytes": peak_rss_bytes(),
    }
    line = json.dumps(summary)
    print(line)
    if args.report is not None:
        args.report.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    return summary


if __name__ == "__main__":
    main()
