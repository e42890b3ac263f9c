"""Requantise a GGUF to one weight type with llama.cpp's quantiser (benchmark files of types the generator lacks).

    python tools/requantize_gguf.py IN.gguf OUT.gguf --type q4_0

Every matrix (token_embd and output included: llama.cpp's ``--pure``) becomes
the chosen type; norms, biases and routers stay F32, as llama.cpp keeps them.
Requantising from Q8_0 loses precision, which a benchmark of random weights
does not mind; the routers, and so a file's routing, are copied unchanged.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

FTYPES = {"q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1",
          "q5_0": "LLAMA_FTYPE_MOSTLY_Q5_0", "q5_1": "LLAMA_FTYPE_MOSTLY_Q5_1", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--type", choices=sorted(FTYPES), required=True)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if not args.model.is_file():
        p.error(f"{args.model}: no such file")
    if args.out.exists():
        p.error(f"{args.out} exists; remove it first")
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[args.type])
    params.nthread = args.threads
    params.allow_requantize = True
    params.pure = True
    if llama_cpp.llama_model_quantize(str(args.model).encode(), str(args.out).encode(), params) != 0:
        args.out.unlink(missing_ok=True)
        print(f"{args.model}: llama.cpp could not requantise it to {args.type}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
