"""A receipt of ``plan`` with default options on a model file: what it prints, and its JSON.

    python tools/plan_receipt.py /work/models/q30b_48_q8_real.gguf
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from colibri_aio.bench.receipt import header as receipt_header, host_line, write as write_receipt

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--out", type=Path, default=ROOT / "evidence")
    args = p.parse_args()
    base = [sys.executable, "-m", "colibri_aio", "plan", str(args.model)]
    table = subprocess.run(base, capture_output=True, text=True, check=True).stdout
    doc = json.loads(subprocess.run([*base, "--json"], capture_output=True, text=True, check=True).stdout)
    receipt = {**receipt_header("tools/plan_receipt.py"), "model": str(args.model),
               "model_bytes": args.model.stat().st_size, "plan_command": " ".join(base[1:]), "plan": doc}
    md = (f"# `plan` with default options — {receipt['date']}\n\n"
          f"{host_line(receipt)}, commit `{receipt['commit']}`, model {args.model} "
          f"({receipt['model_bytes'] / 1e9:.2f} GB)\n\nCommand: `{receipt['command']}` "
          f"(runs `python {receipt['plan_command']}`)\n\n"
          f"KV cache: {doc['kv_cache'] / 2**30:.3f} GiB {doc['kv_type']} for {doc['context']} positions "
          f"({doc['context_source']}).\n\n```\n{table}```\n")
    write_receipt(args.out, f"plan_{receipt['date']}", receipt, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
