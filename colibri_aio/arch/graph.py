"""The language a family's block is written in once, and its NumPy interpreter.

A family module describes its attention, shared expert and dense FFN as
functions of a :class:`Builder` ``f`` (``f.linear``, ``f.rms_norm``,
``f.rope``, ``f.attend`` ...) on the block's tensors (a
:class:`~colibri_aio.gguf.model.BlockWeights`: QTensor matrices, float32
vectors). Each backend interprets that one description:

- :class:`NumpyBuilder` (here) runs each operation at once on arrays: the
  float32 reference with the NumPy kernels, and the per-operation pass on the
  ggml kernels (products on ggml, everything else in NumPy), which prefill,
  tracing and the naming of a non-finite value take;
- :class:`~colibri_aio.kernels.ggml_graph.GgmlBuilder` adds each operation to
  a ggml graph, built once and run at every decode step
  (:mod:`colibri_aio.arch.decode_graphs` decides which graphs a step runs).

Values are opaque to the description: arrays here, graph nodes there. Shapes
are NumPy's, positions first: (T, ...) with T the positions of this call.
Routing (``args.routing``) and the routed experts (``expert_activation``
and the ``ffn_*_exps.bias`` tensors) are declared, not written, and read by
both backends.

Shape legend as in :mod:`colibri_aio.arch.layers`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from colibri_aio.kernels.ops import (attention, attention_temperature, causal_conv, gated_delta_rule, l2_norm,
                                     rms_norm, rope_neox, rope_norm, sigmoid, silu, softplus, swiglu)
from colibri_aio.kernels.qtensor import QTensor

if TYPE_CHECKING:
    from colibri_aio.arch.kvcache import KVCache
    from colibri_aio.kernels.backend import Kernels

Value = Any   # an array (NumpyBuilder) or a graph node (GgmlBuilder)
Tensor = Any  # a block tensor: a QTensor matrix or a float32 array


@dataclass(frozen=True, slots=True)
class RopeParams:
    """How RoPE turns positions into angles, as ggml's ``rope_ext`` takes it (and the NumPy tables follow).

    ``freq_scale`` multiplies every angle (1 / the linear or YaRN factor); ``ext_factor`` 1 blends
    YaRN's interpolated and original angles by a ramp over the dims between the correction dims of
    ``beta_fast``/``beta_slow`` (0: no YaRN); ``attn_factor`` multiplies cos and sin (ggml multiplies
    its own 1 + 0.1 ln(1 / freq_scale) in under YaRN); ``n_ctx_orig`` the context the ramp is for.
    """

    n_rot: int
    freq_base: float
    n_ctx_orig: int
    freq_scale: float = 1.0
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    freq_factors: tuple[float, ...] | None = None   # (n_rot/2,) each frequency divided by one (rope_freqs)


class Builder(Protocol):
    """The operations a block is written with; each backend's builder implements them.

    Every product goes through :meth:`linear` / :meth:`linears` (a QTensor runs on the backend's kernels,
    a float32 matrix, such as a router, as a float32 product). ``x`` (T, n) inputs; vectors broadcast
    over the leading axes as NumPy broadcasts.
    """

    def linear(self, w: Tensor, x: Value) -> Value:
        """x (T, cols) -> (T, rows): x @ w.T."""

    def linears(self, ws: Sequence[Tensor], x: Value) -> list[Value]:
        """Several products on one input (one product over their rows where the weights follow each other)."""

    def add(self, a: Value, b: Value | Tensor) -> Value: ...

    def mul(self, a: Value, b: Value | Tensor) -> Value: ...

    def rms_norm(self, x: Value, weight: Tensor) -> Value:
        """RMSNorm over the last axis, times ``weight``."""

    def heads(self, x: Value, n: int, width: int) -> Value:
        """(T, n * width) -> (T, n, width)."""

    def flat(self, x: Value) -> Value:
        """(T, n, width) -> (T, n * width)."""

    def split(self, x: Value, sizes: Sequence[int]) -> list[Value]:
        """Pieces of the last axis, ``sizes`` wide each."""

    def concat(self, a: Value, b: Value) -> Value:
        """a and b side by side on the last axis (their other axes equal)."""

    def rope(self, x: Value, neox: bool) -> Value:
        """(T, heads, d) with the first n_rot dims of each head rotated by this call's positions: NEOX
        (dimension i with i + n_rot/2) or NORMAL (2i with 2i + 1)."""

    def head_products(self, m: Tensor, x: Value) -> Value:
        """x (T, H, a), m (H, b, a) (float32, or the file's bytes as a 3-D QTensor): (T, H, b), head h's rows
        multiplied by m[h]."""

    def attend(self, layer: int, q: Value, k: Value, v: Value | None, *, scale: float | None = None,
               sinks: Tensor | None = None) -> Value:
        """Store k (T, Hkv, dk) and v (T, Hkv, dv; None when the cache keeps values in the keys) at this
        call's positions in layer ``layer``'s cache and attend over it: (T, H * dv). ``scale`` on q·k
        (default 1/sqrt(dk)); ``sinks`` (H,) one extra logit per head; the layer's sliding window is the
        cache's."""

    def swiglu(self, gate: Value, up: Value) -> Value:
        """silu(gate) * up."""

    def sigmoid(self, x: Value) -> Value: ...

    def temperature(self, x: Value, floor_scale: int, scale: float) -> Value:
        """x (T, heads, d) times :func:`~colibri_aio.kernels.ops.attention_temperature` of each of this
        call's positions (llama4's NoPE queries)."""

    def silu(self, x: Value) -> Value: ...

    def softplus(self, x: Value) -> Value: ...

    def l2_norm(self, x: Value) -> Value:
        """x / sqrt(sum(x²) + eps) over the last axis (eps: the model's RMS epsilon)."""

    def repeat_heads(self, x: Value, times: int) -> Value:
        """(T, n, d) -> (T, n * times, d), head j being head j // times of x."""

    def causal_conv(self, layer: int, x: Value, weight: Tensor) -> Value:
        """x (T, C) through block ``layer``'s causal depthwise convolution ``weight`` (C, K), continued from
        its recurrent state (:func:`~colibri_aio.kernels.ops.causal_conv`); the state moves on."""

    def delta_net(self, layer: int, q: Value, k: Value, v: Value, g: Value, beta: Value) -> Value:
        """Block ``layer``'s gated delta rule (:func:`~colibri_aio.kernels.ops.gated_delta_rule`) from its
        recurrent state: q, k (T, H, dk), v (T, H, dv), g and beta (T, H); (T, H, dv)."""


class NumpyBuilder:
    """Runs a description at once: products on ``kernels``, the rest with :mod:`colibri_aio.kernels.ops`.

    Bound to one call: its ``positions`` (T,), the RoPE tables of those positions and the net's cache.
    """

    def __init__(self, kernels: Kernels, cache: KVCache, positions: np.ndarray,
                 rope: tuple[np.ndarray, np.ndarray], eps: float) -> None:
        self.kernels, self.cache, self.positions, self.rope_tables, self.eps = kernels, cache, positions, rope, eps

    def linear(self, w: Tensor, x: np.ndarray) -> np.ndarray:
        if isinstance(w, QTensor):
            return self.kernels.linear(w, x)
        return x @ w.T

    def linears(self, ws: Sequence[Tensor], x: np.ndarray) -> list[np.ndarray]:
        if all(isinstance(w, QTensor) for w in ws):
            return self.kernels.linears(ws, x)
        return [self.linear(w, x) for w in ws]

    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a + b

    def mul(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a * b

    def rms_norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return rms_norm(x, weight, self.eps)

    def heads(self, x: np.ndarray, n: int, width: int) -> np.ndarray:
        return x.reshape(x.shape[0], n, width)

    def flat(self, x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x).reshape(x.shape[0], -1)

    def split(self, x: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
        return np.split(x, np.cumsum(sizes)[:-1], axis=-1)

    def concat(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.concatenate([a, b], axis=-1)

    def rope(self, x: np.ndarray, neox: bool) -> np.ndarray:
        return (rope_neox if neox else rope_norm)(x, *self.rope_tables)

    def head_products(self, m: Tensor, x: np.ndarray) -> np.ndarray:
        if isinstance(m, QTensor):
            return self.kernels.head_linears(m, x)
        return np.matmul(x.transpose(1, 0, 2), m.transpose(0, 2, 1)).transpose(1, 0, 2)

    def attend(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray | None, *, scale: float | None = None,
               sinks: np.ndarray | None = None) -> np.ndarray:
        keys, values, key_positions = self.cache.update(layer, self.positions, k, v)
        return attention(q, keys, values, self.positions, window=self.cache.windows[layer],
                         key_positions=key_positions, scale=scale, sinks=sinks, chunked=self.cache.chunked[layer])

    def swiglu(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        return swiglu(gate, up)

    def sigmoid(self, x: np.ndarray) -> np.ndarray:
        return sigmoid(x)

    def temperature(self, x: np.ndarray, floor_scale: int, scale: float) -> np.ndarray:
        return x * attention_temperature(self.positions, floor_scale, scale)[:, None, None]

    def silu(self, x: np.ndarray) -> np.ndarray:
        return silu(x)

    def softplus(self, x: np.ndarray) -> np.ndarray:
        return softplus(x)

    def l2_norm(self, x: np.ndarray) -> np.ndarray:
        return l2_norm(x, self.eps)

    def repeat_heads(self, x: np.ndarray, times: int) -> np.ndarray:
        return np.repeat(x, times, axis=1)

    def causal_conv(self, layer: int, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        c = self.cache
        out, state = causal_conv(x, c.conv[layer], weight)
        np.copyto(c.conv_next[layer], state)
        return out

    def delta_net(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                  beta: np.ndarray) -> np.ndarray:
        c = self.cache
        out, state = gated_delta_rule(q, k, v, g, beta, c.ssm[layer])
        np.copyto(c.ssm_next[layer], state)
        return out
