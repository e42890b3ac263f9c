"""Route traces: what every layer chose at every position, and what lookahead predicted.

``python -m colibri_aio trace MODEL --prompt TEXT --out FILE.jsonl`` writes one
JSON object per line. The first line is a header::

    {"kind": "header", "format": "colibri-aio-route-trace", "version": 1,
     "model": "...", "files": [the model's files: one, or each part of a split model],
     "block_count": L, "leading_dense_block_count": n, "expert_count": E,
     "expert_used_count": k, "expert_nbytes": bytes of one expert's three ranges,
     "predictors": ["moe_input", "residual_next_norm", "layer_input_next_norm", "raw_residual"]}

then one record per (run, position, layer)::

    {"kind": "route", "run": 0, "phase": "prefill" | "decode", "pos": 7, "token": 123,
     "layer": 3, "experts": [5, 17], "weights": [0.61, 0.39],
     "predicted": {"moe_input": [..2k ids..], ...}}

``experts`` are in the order chosen: descending weight (descending biased score
where the router has a selection bias, ``exp_probs_b``); a leading dense block (the first
``leading_dense_block_count`` layers; absent from the header means 0) routes
nothing and its records have ``experts`` and ``weights`` ``[]``. ``predicted``
(absent on the last layer and where layer + 1 is dense) ranks 2k candidate
experts for layer + 1, each predictor applying router
layer + 1 (``blk.{layer+1}.ffn_gate_inp``) to a hidden state of this layer
(the MoE norm is the family's: ``ffn_norm`` unless its module says otherwise):

- ``moe_input``: this layer's MoE input (the residual after attention, after
  this layer's ffn_norm) — known as early as this layer's own routing;
- ``residual_next_norm``: the residual after attention, normed with the
  *next* layer's ffn_norm — known as early;
- ``raw_residual``: the residual after attention, un-normed;
- ``layer_input_next_norm``: this layer's input (before attention), normed
  with the next layer's ffn_norm — known before this layer's attention runs.

``token`` is the id fed at ``pos`` (the routing of position ``pos`` is computed
from it and everything before it). A run is one context: positions restart at 0.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from colibri_aio.gguf.model import Model
from colibri_aio.arch.lookahead import PREDICTORS, predictor_state, rank_experts

if TYPE_CHECKING:
    from colibri_aio.arch.layers import MoETransformer

FORMAT, VERSION = "colibri-aio-route-trace", 1


@dataclass
class TraceRecorder:
    """A RouteObserver that writes route records to a JSONL stream."""

    model: Model
    out: IO[str]
    run: int = 0
    phase: str = "prefill"
    tokens: list[int] = field(default_factory=list)  # every id fed in this run, by position
    _layer_input: np.ndarray | None = None

    def header(self) -> None:
        a = self.model.args
        self.out.write(json.dumps({
            "kind": "header", "format": FORMAT, "version": VERSION, "model": str(self.model.path),
            "files": [str(p) for p in self.model.paths],
            "block_count": a.block_count, "leading_dense_block_count": a.leading_dense_block_count,
            "expert_count": a.expert_count,
            "expert_used_count": a.expert_used_count, "expert_nbytes": self.model.expert_nbytes_max,
            "predictors": list(PREDICTORS)}) + "\n")

    def on_layer_input(self, layer: int, x: np.ndarray) -> None:
        self._layer_input = x

    def on_route(self, layer: int, positions: np.ndarray, residual: np.ndarray,
                 moe_input: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> None:
        a = self.model.args
        predicted: dict[str, np.ndarray] = {}
        if layer + 1 < a.block_count and a.is_moe(layer + 1):
            assert self._layer_input is not None
            predicted = {
                name: rank_experts(self.model, layer + 1, predictor_state(self.model, name, layer, self._layer_input,
                                                                          residual, moe_input), 2 * a.expert_used_count)
                for name in PREDICTORS}
        for i, pos in enumerate(positions.tolist()):
            rec: dict[str, Any] = {
                "kind": "route", "run": self.run, "phase": self.phase, "pos": pos,
                "token": int(self.tokens[pos]), "layer": layer, "experts": ids[i].tolist(),
                "weights": [round(float(w), 6) for w in weights[i]]}
            if predicted:
                rec["predicted"] = {k: v[i].tolist() for k, v in predicted.items()}
            self.out.write(json.dumps(rec, separators=(",", ":")) + "\n")


def read_trace(path: str) -> Iterator[dict[str, Any]]:
    """Records of a trace file, header first, each checked as it is read.

    Anything that is not a whole trace of this format (a missing, empty,
    truncated or damaged file, another format or version, a record whose
    fields are missing or out of range) is a :class:`UserError` naming the
    file and the line.
    """
    from colibri_aio.errors import UserError

    header: dict[str, Any] | None = None
    routes = 0
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                try:
                    rec = json.loads(line)
                except ValueError:
                    raise UserError(f"{path}: line {n} is not JSON (a truncated or damaged trace)") from None
                if header is None:
                    header = _check_header(rec, path)
                elif not isinstance(rec, dict):
                    raise UserError(f"{path}: line {n} is not a trace record")
                elif rec.get("kind") == "route":
                    _check_route(rec, header, path, n)
                    routes += 1
                yield rec
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a text file (not a {FORMAT} file)") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read the trace ({exc.strerror or exc})") from None
    if header is None:
        raise UserError(f"{path}: the file is empty (not a {FORMAT} file)")
    if not routes:
        raise UserError(f"{path}: a header and no route records (a truncated trace)")


_HEADER_COUNTS = ("block_count", "expert_count", "expert_used_count", "expert_nbytes")


def _check_header(rec: Any, path: str) -> dict[str, Any]:
    from colibri_aio.errors import UserError

    if not isinstance(rec, dict) or rec.get("format") != FORMAT or rec.get("version") != VERSION:
        raise UserError(f"{path}: not a {FORMAT} v{VERSION} file")
    if not all(isinstance(rec.get(k), int) and rec[k] > 0 for k in _HEADER_COUNTS):
        raise UserError(f"{path}: a damaged header (needs positive {', '.join(_HEADER_COUNTS)})")
    dense = rec.get("leading_dense_block_count", 0)
    if not isinstance(dense, int) or not 0 <= dense < rec["block_count"]:
        raise UserError(f"{path}: a damaged header (leading_dense_block_count must be in [0, block_count))")
    return rec


def _check_route(rec: dict[str, Any], header: dict[str, Any], path: str, n: int) -> None:
    """The fields every reader of a route record relies on, with their ranges."""
    from colibri_aio.errors import UserError

    def ids_ok(ids: Any) -> bool:
        return isinstance(ids, list) and all(isinstance(i, int) and 0 <= i < header["expert_count"] for i in ids)

    predicted = rec.get("predicted", {})
    ok = (all(isinstance(rec.get(k), int) and rec[k] >= 0 for k in ("run", "pos"))
          and isinstance(rec.get("layer"), int) and 0 <= rec["layer"] < header["block_count"]
          and rec.get("phase") in ("prefill", "decode") and ids_ok(rec.get("experts"))
          and isinstance(predicted, dict) and all(ids_ok(v) for v in predicted.values()))
    if not ok:
        raise UserError(f"{path}: line {n} is a damaged route record (run, pos, layer, phase, experts)")


async def trace_run(net: MoETransformer, recorder: TraceRecorder, run: int, prompt: list[int],
                    max_tokens: int, sample: Callable[[np.ndarray], int],
                    is_eog: Callable[[int], bool]) -> list[int]:
    """Prefill ``prompt`` and decode up to ``max_tokens``, recording every route; returns new tokens."""
    net.reset()
    recorder.run, recorder.phase, recorder.tokens = run, "prefill", list(prompt)
    logits = await net.prefill(prompt, observer=recorder)
    recorder.phase, out = "decode", []
    for _ in range(min(max_tokens, net.n_ctx - len(prompt))):
        token = sample(logits)
        if is_eog(token):
            break
        out.append(token)
        recorder.tokens.append(token)
        logits = await net.forward([token], observer=recorder)
    return out
