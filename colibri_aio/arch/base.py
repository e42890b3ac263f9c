"""What a model family declares to the loader: its hyper-parameters and its resident tensors.

Every family module (``arch/<family>.py``) holds a :class:`ModelArgs` subclass
of :class:`BaseArgs` read from the GGUF metadata, a ``block_tensors`` function
naming the resident tensors of one block with their shapes, and its forward
pass; a :class:`Family` record ties them together for the registry
(``arch/__init__.py``). Nothing here runs a model: the loader
(:mod:`colibri_aio.gguf.model`) imports this module, the forward passes import
:mod:`colibri_aio.arch.layers`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from colibri_aio.errors import ModelFormatError
from colibri_aio.gguf.header import PER_LAYER_KEYS
from colibri_aio.kernels.ops import Routing
from colibri_aio.arch.kvcache import DEFAULT_KV_TYPE, RecurrentShape, kv_nbytes
from colibri_aio.arch.rope import RopeScaling

if TYPE_CHECKING:
    from colibri_aio.gguf.split import ModelHeader


class Metadata:
    """The GGUF metadata as one architecture reads it: ``need("block_count")`` is ``<arch>.block_count``."""

    def __init__(self, reader: ModelHeader, path: Path, architecture: str) -> None:
        self.reader, self.path, self.architecture = reader, path, architecture
        self.tensor_names = frozenset(t.name for t in reader.tensors)

    def raw(self, key: str, default: Any = None) -> Any:
        """A key by its full name (``general.*``, ``tokenizer.*``), or ``default`` when absent."""
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def get(self, key: str, default: Any = None) -> Any:
        """``<arch>.<key>``, or ``default`` when absent; a key of :data:`PER_LAYER_KEYS` stored as one
        value per block is that value (see :meth:`_one_for_all_blocks`)."""
        value = self.raw(f"{self.architecture}.{key}", default)
        if key in PER_LAYER_KEYS and isinstance(value, list):
            value = self._one_for_all_blocks(key, value)
        return value

    def _one_for_all_blocks(self, key: str, values: list[Any]) -> int:
        """The value of a per-block array that holds one value for every block.

        llama.cpp reads these keys with get_key_or_arr: a scalar, or an array of exactly block_count
        values (another length is refused). Every family here has one width and one head count for all
        its blocks, so an array whose values are all equal is read as that value and runs as llama.cpp
        runs it; an array with different values describes a model this engine cannot run.
        """
        name = f"{self.architecture}.{key}"
        blocks = self.raw(f"{self.architecture}.block_count")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise ModelFormatError(f"{self.path}: {name} must hold integers")
        if len(values) != blocks:
            raise ModelFormatError(f"{self.path}: {name} holds {len(values)} values for block_count {blocks}")
        if len(set(values)) != 1:
            raise ModelFormatError(f"{self.path}: {name} differs between blocks ({sorted(set(values))}); "
                                   f"this engine runs one value for all blocks")
        return values[0]

    def block_count(self) -> int:
        """``<arch>.block_count``, refused when it cannot describe this file: every block holds at least one
        tensor, so a count above the file's tensors is a broken header (and would size per-block tables of
        billions of entries before any tensor is looked at)."""
        blocks = self.need("block_count")
        if isinstance(blocks, bool) or not isinstance(blocks, int) or not 1 <= blocks <= len(self.tensor_names):
            raise ModelFormatError(f"{self.path}: {self.architecture}.block_count {blocks!r} is not a count of "
                                   f"blocks among the file's {len(self.tensor_names)} tensors")
        return blocks

    def need(self, key: str) -> Any:
        """``<arch>.<key>``; a file without it is refused."""
        value = self.get(key)
        if value is None:
            raise ModelFormatError(f"{self.path}: missing metadata key {self.architecture}.{key}")
        return value

    def expert_width(self) -> int | None:
        """``expert_feed_forward_length``, or when it is absent or 0, ``feed_forward_length`` split over the
        ``expert_used_count`` chosen experts (llama.cpp's qwen2moe and qwen3moe loaders size the expert
        tensors so, without a warning); None when neither key gives a width."""
        width = self.get("expert_feed_forward_length")
        if width:
            return int(width)
        ff = self.get("feed_forward_length")
        return None if ff is None else int(ff) // max(int(self.need("expert_used_count")), 1)

    def routing(self, gating: str, *, normalize: bool | None = None, scale: float | None = None) -> Routing:
        """The routing llama.cpp's ``build_moe_ffn`` runs for this file: ``gating`` as the family decides it;
        renormalisation and weight scale from ``expert_weights_norm`` / ``expert_weights_scale`` unless the
        family's graph fixes them (``normalize``, ``scale``); expert groups from ``expert_group_count`` /
        ``expert_group_used_count``, which llama.cpp's loader reads for every architecture."""
        return Routing(gating,  # type: ignore[arg-type]
                       normalize=bool(self.get("expert_weights_norm", False)) if normalize is None else normalize,
                       scale=float(self.get("expert_weights_scale", 0.0)) if scale is None else scale,
                       group_count=max(int(self.get("expert_group_count", 0)), 1),
                       group_used=int(self.get("expert_group_used_count", 0)) or 1)

    def gating(self, known: dict[int, str]) -> str:
        """``expert_gating_func`` as llama.cpp numbers it, for a family whose graph takes it from the file: a
        file without it leaves llama.cpp's gating NONE (its MoE graph aborts), so it is refused, as is a
        function the family does not run."""
        value = self.get("expert_gating_func")
        if value is None or int(value) not in known:
            names = " or ".join(f"{k} ({v})" for k, v in known.items())
            raise ModelFormatError(f"{self.path}: {self.architecture} needs expert_gating_func {names}; "
                                   f"the file says {value}")
        return known[int(value)]

    def vocab_size(self) -> int:
        """Tokens in the tokenizer, else rows of ``token_embd``."""
        tokens = self.reader.fields.get("tokenizer.ggml.tokens")
        if tokens is not None:
            return len(tokens.value)
        for t in self.reader.tensors:
            if t.name == "token_embd.weight":
                return int(t.shape[-1])
        raise ModelFormatError(f"{self.path}: missing tensor token_embd.weight")


@dataclass(frozen=True, slots=True)
class BaseArgs:
    """Hyper-parameters every family has, named as their GGUF keys; the shared code reads only these.

    The first fields are positional (the original qwen3moe set); the ones with
    defaults describe what families vary: rotated dims, routing, skipped blocks,
    RoPE scaling (``rope.scaling.*``, read for every family as llama.cpp reads it).
    """

    architecture: str
    vocab_size: int
    context_length: int
    embedding_length: int
    block_count: int            # blocks the forward pass runs
    head_count: int
    head_count_kv: int
    key_length: int
    value_length: int
    rope_freq_base: float
    rms_eps: float
    expert_count: int
    expert_used_count: int
    expert_feed_forward_length: int
    tied_output: bool
    rope_dimension_count: int | None = None   # rotated dims of a head (None: all of key_length)
    routing: Routing = Routing()
    skipped_blocks: int = 0                   # blocks after block_count the file holds and no pass runs (NextN)
    leading_dense_block_count: int = 0        # the first blocks have a dense FFN and no routed experts
    rope_scaling: RopeScaling = RopeScaling()  # linear or YaRN angles, from rope.scaling.* (default: none)

    @property
    def n_rot(self) -> int:
        return self.rope_dimension_count or self.key_length

    def is_moe(self, layer: int) -> bool:
        """Block ``layer`` has routed experts (the leading dense blocks have none)."""
        return layer >= self.leading_dense_block_count

    @property
    def layers_text(self) -> str:
        """``"61 layers (3 dense)"``, or ``"48 layers"`` when every block has experts."""
        dense = self.block_count - self.moe_block_count
        return f"{self.block_count} layers" + (f" ({dense} dense)" if dense else "")

    @property
    def moe_block_count(self) -> int:
        """Blocks with routed experts (:meth:`is_moe`, wherever they lie): the cache keeps a quota for each,
        the plan counts their experts."""
        return sum(self.is_moe(layer) for layer in range(self.block_count))

    @classmethod
    def common(cls, meta: Metadata, **overrides: Any) -> dict[str, Any]:
        """The BaseArgs fields from their usual keys; ``overrides`` replace any of them.

        A family that reads a field from another key (or defaults it otherwise)
        passes it here rather than reading the usual key.
        """
        values: dict[str, Any] = dict(overrides)

        def put(name: str, read: Callable[[], Any]) -> None:
            if name not in values:
                values[name] = read()

        put("architecture", lambda: meta.architecture)
        put("vocab_size", meta.vocab_size)
        put("context_length", lambda: int(meta.need("context_length")))
        put("embedding_length", lambda: int(meta.need("embedding_length")))
        put("block_count", meta.block_count)
        put("head_count", lambda: int(meta.need("attention.head_count")))
        put("head_count_kv", lambda: int(meta.get("attention.head_count_kv", values["head_count"])))
        put("key_length", lambda: int(meta.get("attention.key_length",
                                               values["embedding_length"] // max(values["head_count"], 1))))
        put("value_length", lambda: int(meta.get("attention.value_length", values["key_length"])))
        # llama.cpp falls back to 1e4 when the key is absent (Qwen uses 1e6), and so do we.
        put("rope_freq_base", lambda: float(meta.get("rope.freq_base", 10000.0)))
        put("rms_eps", lambda: float(meta.need("attention.layer_norm_rms_epsilon")))
        put("expert_count", lambda: int(meta.need("expert_count")))
        put("expert_used_count", lambda: int(meta.need("expert_used_count")))
        put("expert_feed_forward_length", lambda: int(meta.need("expert_feed_forward_length")))
        put("tied_output", lambda: "output.weight" not in meta.tensor_names)
        rot = meta.get("rope.dimension_count")
        put("rope_dimension_count", lambda: int(rot) if rot is not None else None)
        put("leading_dense_block_count", lambda: int(meta.get("leading_dense_block_count", 0)))
        put("rope_scaling", lambda: RopeScaling.from_gguf(meta))
        return values

    @classmethod
    def from_gguf(cls, meta: Metadata) -> Self:
        """Read from the metadata (families with keys of their own override this)."""
        return cls(**cls.common(meta))

    def check(self, path: Path) -> None:
        """Refuse sizes the forward pass cannot run (families add their own conditions)."""
        if self.expert_count < 1:
            raise ModelFormatError(f"{path}: {self.architecture} without experts (expert_count "
                                   f"{self.expert_count}) is a dense model; this engine runs mixture-of-experts models")
        if self.expert_used_count > self.expert_count:
            raise ModelFormatError(
                f"{path}: expert_used_count {self.expert_used_count} > expert_count {self.expert_count}")
        if min(self.expert_used_count, self.block_count, self.head_count, self.head_count_kv, self.key_length,
               self.expert_feed_forward_length, self.embedding_length) < 1:
            raise ModelFormatError(f"{path}: a size in the metadata is zero or negative")
        if not 0 <= self.leading_dense_block_count < self.block_count:
            raise ModelFormatError(f"{path}: leading_dense_block_count {self.leading_dense_block_count} leaves no "
                                   f"block with experts among {self.block_count}; this engine runs "
                                   f"mixture-of-experts models")
        if self.head_count % self.head_count_kv:
            raise ModelFormatError(
                f"{path}: head_count {self.head_count} is not a multiple of head_count_kv {self.head_count_kv}")
        if self.n_rot % 2 or self.n_rot > self.key_length:
            raise ModelFormatError(f"{path}: rope.dimension_count {self.n_rot} must be even and at most "
                                   f"key_length {self.key_length}")
        r = self.routing
        if r.group_count > 1 and (self.expert_count % r.group_count or not 1 <= r.group_used <= r.group_count):
            raise ModelFormatError(f"{path}: {self.expert_count} experts do not split into "
                                   f"{r.group_count} groups of which {r.group_used} are used")

    def check_equal_head_widths(self, path: Path) -> None:
        """Refuse value heads of another width than key heads (the families whose attention assumes them equal)."""
        if self.value_length != self.key_length:
            raise ModelFormatError(f"{path}: {self.architecture} heads have equal key and value widths (key_length "
                                   f"{self.key_length}, value_length {self.value_length})")

    def check_dense_width(self, path: Path, feed_forward_length: int) -> None:
        """Refuse leading dense blocks without ``feed_forward_length``, their FFN's width."""
        if self.leading_dense_block_count and feed_forward_length < 1:
            raise ModelFormatError(f"{path}: missing metadata key {self.architecture}.feed_forward_length "
                                   f"(the width of the leading dense blocks)")

    def kv_layout(self) -> KVLayout:
        """What the KV cache holds per position and block: head_count_kv keys and values
        (families caching something else, such as MLA's latent, override this)."""
        return KVLayout(self.head_count_kv, self.key_length, self.value_length)

    def kv_window(self, layer: int) -> int | None:
        """The sliding window of block ``layer`` (a query at p sees keys at p' > p - window, and the cache
        keeps that many positions), or None: it attends to the whole context."""
        return None

    def kv_windows(self) -> list[int | None]:
        """:meth:`kv_window` of every block, as the cache and the plan take them."""
        return [self.kv_window(layer) for layer in range(self.block_count)]

    def kv_chunked(self, layer: int) -> bool:
        """Whether block ``layer``'s window is a chunk (llama4): a query at p sees the keys from the start
        of its chunk, (p // window) * window, not the last ``window`` positions. The ring is the same."""
        return False

    def recurrent_state(self, layer: int) -> RecurrentShape | None:
        """The state block ``layer`` keeps of the sequence instead of keys and values when it is a
        recurrent block (qwen3next's linear attention), else None."""
        return None

    def recurrent_states(self) -> list[RecurrentShape | None]:
        """:meth:`recurrent_state` of every block, as the cache and the plan take them."""
        return [self.recurrent_state(layer) for layer in range(self.block_count)]

    def kv_cache_nbytes(self, context: int, kv_type: str = DEFAULT_KV_TYPE) -> int:
        """Bytes of the KV cache for ``context`` positions stored as ``kv_type`` (a sliding-window block
        holds its window, a recurrent block its state): what the plan reserves and the pass allocates."""
        return kv_nbytes(self.block_count, context, self.kv_layout(), kv_type, self.kv_windows(),
                         self.recurrent_states())


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The KV cache of one block at one position: ``heads`` keys of ``key_width`` floats and values of
    ``value_width``; ``values_in_keys``: each value is the first ``value_width`` floats of its key,
    stored once (MLA's latent is both its key's first part and its value)."""

    heads: int
    key_width: int
    value_width: int
    values_in_keys: bool = False

    @property
    def floats_per_position(self) -> int:
        """Numbers stored per position and block (each value once when it lives in its key)."""
        return self.heads * (self.key_width + (0 if self.values_in_keys else self.value_width))


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A resident tensor of a block: its name in the block, NumPy-order shape, and form in RAM.

    ``name`` ``attn_q`` is the file's ``blk.<i>.attn_q.weight``; a name with a
    dot is taken as written (``attn_q.bias`` is ``blk.<i>.attn_q.bias``).
    ``dense``: dequantised to a float32 array (norms, biases, routers);
    otherwise kept as its raw bytes (a :class:`QTensor` for the kernels).
    ``optional``: absent from some files of the family. ``bare``: the file names it without a
    ``.weight`` (``blk.<i>.ssm_a``).
    """

    name: str
    shape: tuple[int, ...]
    dense: bool = False
    optional: bool = False
    bare: bool = False

    def file_name(self, layer: int) -> str:
        return f"blk.{layer}.{self.name}" + ("" if "." in self.name or self.bare else ".weight")


def matrix(name: str, rows: int, cols: int, *, optional: bool = False) -> TensorSpec:
    """A weight matrix kept as raw bytes: (rows, cols) = (output features, input features)."""
    return TensorSpec(name, (rows, cols), optional=optional)


def vector(name: str, *shape: int, optional: bool = False, bare: bool = False) -> TensorSpec:
    """A float32 tensor: norm weights, biases, routers."""
    return TensorSpec(name, tuple(shape), dense=True, optional=optional, bare=bare)


def attention_tensors(a: BaseArgs) -> list[TensorSpec]:
    """attn_norm, attn_q/k/v with their optional biases (llama.cpp's create_tensor_qkv accepts
    them in every family here) and attn_output: the attention tensors the families share."""
    d, q, kv, v = (a.embedding_length, a.head_count * a.key_length, a.head_count_kv * a.key_length,
                   a.head_count_kv * a.value_length)
    return [vector("attn_norm", d), matrix("attn_q", q, d), matrix("attn_k", kv, d), matrix("attn_v", v, d),
            vector("attn_q.bias", q, optional=True), vector("attn_k.bias", kv, optional=True),
            vector("attn_v.bias", v, optional=True), matrix("attn_output", d, a.head_count * a.value_length)]


def ffn_tensors(d: int, width: int, suffix: str = "") -> list[TensorSpec]:
    """A SwiGLU FFN of resident matrices ``ffn_{gate,up,down}<suffix>``: a dense block's FFN (no suffix)
    or a shared expert (``_shexp``), ``width`` wide."""
    return [matrix("ffn_gate" + suffix, width, d), matrix("ffn_up" + suffix, width, d),
            matrix("ffn_down" + suffix, d, width)]


def router_tensors(a: BaseArgs) -> list[TensorSpec]:
    """ffn_norm (the MoE input norm) and ffn_gate_inp (the router, float32)."""
    return [vector("ffn_norm", a.embedding_length), vector("ffn_gate_inp", a.expert_count, a.embedding_length)]


@dataclass(frozen=True, slots=True)
class Family:
    """One architecture in the registry.

    ``net`` is built as ``net(model, experts, n_ctx, kernels, kv_type)``; ``moe_norm`` names the
    block tensor that norms the MoE input (the router's input, which the
    lookahead applies to the previous layer's hidden state); ``checked_against``
    names the transformers class its oracle tests ran.
    """

    architecture: str
    args: type[BaseArgs]
    block_tensors: Callable[[Any, int], list[TensorSpec]]
    net: type
    checked_against: str
    moe_norm: str = "ffn_norm"
    # model-wide float32 tensors besides the embeddings and the head (``<name>.weight``, no block): llama4's
    # rope_freqs; the loader reads them into ``Model.globals``
    global_tensors: Callable[[Any], list[TensorSpec]] = lambda args: []
