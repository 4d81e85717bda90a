"""Quantization configs: one frozen, hashable object parsed from one string grammar.

The same strings are accepted everywhere (Python API, CLI flags, the vLLM `--kv-cache-dtype` flag),
so `KVQuantConfig.parse` is the single place that knows the grammar. Configs are hashable and compare
by value, so they are static data under `jax.jit` (pytree aux data, `static_argnames`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Union

# What the grammar accepts; also listed verbatim in error messages.
KVARN_BITS = (2, 4, 8)
KVARN_GROUPS = (32, 64, 128)
KIVI_BITS = (2, 4)
KIVI_GROUPS = (32, 64, 128)
INT_BITS = (2, 4, 8)
INT_GROUPS = (8, 16, 32, 64, 128, 256)
PASSTHROUGH = {"fp16": "float16", "float16": "float16", "half": "float16",
               "bf16": "bfloat16", "bfloat16": "bfloat16",
               "fp32": "float32", "float32": "float32"}
PRESETS = ("kvarn_k4v2_g128", "kvarn_k4v4_g128", "kvarn_k4v2_g64", "kvarn_k4v4_g64")
GRAMMAR = (
    "kvarn_k{2,4,8}v{2,4,8}_g{32,64,128} (presets: " + ", ".join(PRESETS) + "); "
    "kivi_k{2,4}v{2,4}_g{32,64,128}; "
    "int{2,4,8}[_g{8,16,32,64,128,256}] or int_k{2,4,8}v{2,4,8}[_g...], and int{2,4,8}_static / int_k..v.._static; "
    "fp8 (alias fp8_e4m3), fp8_static; fp16, bf16, fp32 (passthrough); "
    "suffix _clip (keys and values) or _clipv (values only) on a dynamic kvarn, kivi or int scheme "
    "(e.g. kvarn_k4v2_g128_clip): clipped-range RTN; "
    "quantized schemes take the high-precision storage suffixes _hp{int8,fp16,bf16,fp32} and _sink{1,2,4,...,512}"
)
# Clipped range search (`schemes.rtn.clip_search`): same stored format, a per-row range that
# minimizes squared error instead of min..max.
CLIP_SUFFIX = "_clip"
CLIP_VALUES_SUFFIX = "_clipv"
CLIP_METHODS = ("kvarn", "kivi", "int")

_METHODS = ("kvarn", "kivi", "int", "fp8", "passthrough")

_KVARN_RE = re.compile(r"^kvarn_k(\d+)v(\d+)_g(\d+)$")
_KIVI_RE = re.compile(r"^kivi_k(\d+)v(\d+)_g(\d+)$")
_INT_RE = re.compile(r"^int(?:(\d+)|_k(\d+)v(\d+))(?:_g(\d+))?(_static)?$")

# fp8 e4m3 (OCP "fn" variant) largest finite magnitude.
FP8_E4M3_MAX = 448.0


def _check_choice(value: int, allowed: tuple[int, ...], what: str, text: str) -> None:
    if value not in allowed:
        raise ValueError(
            f"kv_cache_dtype {text!r}: {what} {value} is not accepted; {what} must be one of "
            f"{list(allowed)}. Accepted strings: {GRAMMAR}")


_PASSTHROUGH_BITS = {"float16": 16, "bfloat16": 16, "float32": 32}
# (key/value bits, groups, whether the group may be 0) per quantized method
_CHOICES = {"kvarn": (KVARN_BITS, KVARN_GROUPS, False), "kivi": (KIVI_BITS, KIVI_GROUPS, False),
            "int": (INT_BITS, INT_GROUPS, True)}
MAX_SINKHORN_ITERS = 64


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ---------------------------------------------------------------- high-precision storage options
# How a quantized cache keeps the tokens it serves exactly (each sequence's attention sink and the
# block it is filling): "auto" (`kvarn_jax.cache.hp.hp_format` decides from the model dtype), a
# float dtype, or "int8" (per-token int8 codes with a 16-bit scale and zero point). sink_tokens: 0
# keeps the sequence's whole first block; S keeps its first S tokens and quantizes the rest of that
# block like any other. Both are suffixes of the scheme string (`_hpint8`, `_sink16`), in any order.
HP_FORMATS = ("auto", "int8", "fp16", "bf16", "fp32")
MAX_SINK_TOKENS = 512
_HP_SUFFIX_RE = re.compile(r"_(?:hp([a-z0-9]+)|sink(\d+))(?=_|$)")


def _split_hp_suffixes(text: str, spec: str) -> tuple[str, dict]:
    """(the string without its high-precision suffixes, {field: value} they set)."""
    opts = {}
    for m in _HP_SUFFIX_RE.finditer(text):
        key, value = ("hp", m.group(1)) if m.group(1) is not None else ("sink_tokens", int(m.group(2)))
        if key in opts:
            raise ValueError(f"kv_cache_dtype {spec!r}: the {'_hp' if key == 'hp' else '_sink'} suffix is given twice")
        opts[key] = value
    return _HP_SUFFIX_RE.sub("", text), opts


def _hp_suffix(cfg: "KVQuantConfig") -> str:
    return (f"_hp{cfg.hp}" if cfg.hp != "auto" else "") + (f"_sink{cfg.sink_tokens}" if cfg.sink_tokens else "")


def _check_hp_fields(cfg: "KVQuantConfig", name: str) -> None:
    if cfg.hp not in HP_FORMATS:
        raise ValueError(f"{name}: hp (high-precision storage) must be one of {list(HP_FORMATS)}, got {cfg.hp!r}")
    s = cfg.sink_tokens
    if not _is_int(s) or s < 0 or s > MAX_SINK_TOKENS or (s and s & (s - 1)):
        raise ValueError(f"{name}: sink_tokens must be 0 (the whole first block) or a power of two up to "
                         f"{MAX_SINK_TOKENS}, got {s!r}")
    if cfg.method == "passthrough" and (cfg.hp != "auto" or s):
        raise ValueError(f"{name}: passthrough {cfg.dtype} stores every token as it is: it has no high-precision "
                         "sink or tail to configure (hp and sink_tokens apply to quantized schemes)")


def _check_fields(cfg: "KVQuantConfig") -> None:
    """The rules `parse` applies to a string, applied to the fields (ValueError naming the field)."""
    name = f"KVQuantConfig(method={cfg.method!r}, k_bits={cfg.k_bits!r}, v_bits={cfg.v_bits!r}, group={cfg.group!r}, ...)"
    if cfg.method not in _METHODS:
        raise ValueError(f"method {cfg.method!r} is not one of {list(_METHODS)}")
    for field in ("k_bits", "v_bits", "group", "sinkhorn_iters"):
        if not _is_int(getattr(cfg, field)):
            raise ValueError(f"{name}: {field} must be an int, got {getattr(cfg, field)!r}")
    if not isinstance(cfg.static, bool):
        raise ValueError(f"{name}: static must be a bool, got {cfg.static!r}")
    if not isinstance(cfg.clip, bool):
        raise ValueError(f"{name}: clip must be a bool, got {cfg.clip!r}")
    if cfg.clip and (cfg.method not in CLIP_METHODS or cfg.static):
        raise ValueError(f"{name}: clip (the {CLIP_SUFFIX} suffix) applies to dynamic kvarn, kivi and int schemes only")
    if not isinstance(cfg.clip_keys, bool) or (not cfg.clip_keys and not cfg.clip):
        raise ValueError(f"{name}: clip_keys must be a bool, and False only with clip=True (the {CLIP_VALUES_SUFFIX} "
                         f"suffix), got {cfg.clip_keys!r}")
    _check_hp_fields(cfg, name)
    if cfg.method == "kvarn":
        if not 0 <= cfg.sinkhorn_iters <= MAX_SINKHORN_ITERS:
            raise ValueError(f"{name}: sinkhorn_iters must be in [0, {MAX_SINKHORN_ITERS}], got {cfg.sinkhorn_iters}")
    elif cfg.sinkhorn_iters != 8:
        raise ValueError(f"{name}: sinkhorn_iters applies to kvarn only (leave it at 8), got {cfg.sinkhorn_iters}")
    if cfg.method == "passthrough":
        if cfg.dtype not in _PASSTHROUGH_BITS:
            raise ValueError(f"{name}: a passthrough dtype must be one of {list(_PASSTHROUGH_BITS)}, got {cfg.dtype!r}")
        bits = _PASSTHROUGH_BITS[cfg.dtype]
        if (cfg.k_bits, cfg.v_bits, cfg.group, cfg.static) != (bits, bits, 0, False):
            raise ValueError(f"{name}: passthrough {cfg.dtype} stores {bits}-bit values: k_bits = v_bits = {bits}, "
                             "group 0, static False")
        return
    if cfg.dtype:
        raise ValueError(f"{name}: dtype names a passthrough storage dtype; {cfg.method} takes none, got {cfg.dtype!r}")
    if cfg.method == "fp8":
        if (cfg.k_bits, cfg.v_bits, cfg.group) != (8, 8, 0):
            raise ValueError(f"{name}: fp8 (e4m3) has k_bits = v_bits = 8 and group 0")
        return
    bits, groups, group_optional = _CHOICES[cfg.method]
    for what, b in (("key bits", cfg.k_bits), ("value bits", cfg.v_bits)):
        if b not in bits:
            raise ValueError(f"{name}: {what} {b} is not accepted; {what} must be one of {list(bits)}")
    what = "group (channels per scale)" if cfg.method == "int" else "group (tile tokens)"
    if not (cfg.group in groups or (group_optional and cfg.group == 0)):
        raise ValueError(f"{name}: {what} {cfg.group} is not accepted; {what} must be one of "
                         f"{([0] if group_optional else []) + list(groups)}")
    if cfg.static and cfg.method != "int":
        raise ValueError(f"{name}: static scales exist for int and fp8 only")
    if cfg.static and cfg.group:
        raise ValueError(f"{name}: static int scales are per channel, so a group does not apply (group must be 0)")


@dataclasses.dataclass(frozen=True)
class KVQuantConfig:
    """How K and V are stored in the cache.

    method: "kvarn" (Hadamard + Sinkhorn + RTN, tiled), "kivi" (keys per channel over a tile of
      tokens, values per token), "int" (per-token asymmetric RTN), "fp8" (e4m3) or "passthrough".
    k_bits / v_bits: code widths (16/32 for passthrough, 8 for fp8).
    group: kvarn/kivi: tokens per tile (the quantization unit along the sequence); int: channels
      per scale along head_dim (0 = the whole head_dim).
    static: scales come from a `Calibration` instead of being computed at write time (int, fp8).
    dtype: storage dtype name of passthrough configs.
    sinkhorn_iters: KVarN variance-normalization iterations (docs/design.md §1.2).
    clip: RTN over the per-row range that minimizes squared error among a few clip ratios (keys: a
      milder set, `schemes.rtn.clip_ratios`; suffix `_clip`; docs/schemes.md) instead of the row's
      min..max. Same stored fields.
    clip_keys: with clip, whether keys are clipped too (False: suffix `_clipv`, values only).
    hp: how the cache keeps each sequence's sink and the block it is filling: "auto", "int8",
      "fp16", "bf16" or "fp32" (`kvarn_jax.cache.hp`). sink_tokens: tokens of the attention sink
      kept that way; 0 = the whole first block.
    """

    method: str
    k_bits: int
    v_bits: int
    group: int = 0
    static: bool = False
    dtype: str = ""
    sinkhorn_iters: int = 8
    clip: bool = False
    clip_keys: bool = True
    hp: str = "auto"
    sink_tokens: int = 0

    def __post_init__(self):
        _check_fields(self)  # hand-built configs obey the grammar's rules too

    # ---------------------------------------------------------------- grammar
    @classmethod
    def parse(cls, spec: Union[str, "KVQuantConfig"]) -> "KVQuantConfig":
        """Parse a scheme string (or return a config unchanged). Raises ValueError naming the string."""
        if isinstance(spec, KVQuantConfig):
            return spec
        if not isinstance(spec, str):
            raise ValueError(f"kv_cache_dtype must be a string or KVQuantConfig, got {type(spec).__name__}")
        text, hp_opts = _split_hp_suffixes(spec.strip().lower(), spec)
        cfg = cls._parse_base(text, spec)
        if not hp_opts:
            return cfg
        try:
            return dataclasses.replace(cfg, **hp_opts)
        except ValueError as e:
            raise ValueError(f"kv_cache_dtype {spec!r}: {str(e).split(': ', 1)[-1]}. Accepted strings: {GRAMMAR}") from None

    @classmethod
    def _parse_base(cls, text: str, spec: str) -> "KVQuantConfig":
        """A scheme string without high-precision suffixes (lower case, stripped)."""
        for suffix, keys in ((CLIP_SUFFIX, True), (CLIP_VALUES_SUFFIX, False)):
            if text.endswith(suffix):
                base = cls._parse_base(text[:-len(suffix)], spec)
                if base.method not in CLIP_METHODS or base.static or base.clip:
                    raise ValueError(f"kv_cache_dtype {spec!r}: the {suffix} suffix applies to dynamic kvarn, kivi and "
                                     f"int schemes only (e.g. kvarn_k4v2_g128{suffix}). Accepted strings: {GRAMMAR}")
                return dataclasses.replace(base, clip=True, clip_keys=keys)
        if text in PASSTHROUGH:
            bits = {"float16": 16, "bfloat16": 16, "float32": 32}[PASSTHROUGH[text]]
            return cls("passthrough", bits, bits, dtype=PASSTHROUGH[text])
        if text == "kvarn":
            text = PRESETS[0]
        if text in ("fp8", "fp8_e4m3"):
            return cls("fp8", 8, 8)
        if text in ("fp8_static", "fp8_e4m3_static"):
            return cls("fp8", 8, 8, static=True)
        for method, regex, bits, groups in (("kvarn", _KVARN_RE, KVARN_BITS, KVARN_GROUPS),
                                            ("kivi", _KIVI_RE, KIVI_BITS, KIVI_GROUPS)):
            m = regex.match(text)
            if m:
                kb, vb, g = map(int, m.groups())
                _check_choice(kb, bits, "key bits", spec)
                _check_choice(vb, bits, "value bits", spec)
                _check_choice(g, groups, "group (tile tokens)", spec)
                return cls(method, kb, vb, group=g)
        m = _INT_RE.match(text)
        if m:
            both, kb, vb, g, static = m.groups()
            kb, vb = (int(both), int(both)) if both else (int(kb), int(vb))
            _check_choice(kb, INT_BITS, "key bits", spec)
            _check_choice(vb, INT_BITS, "value bits", spec)
            group = int(g) if g else 0
            if g:
                _check_choice(group, INT_GROUPS, "group (channels per scale)", spec)
                if static:
                    raise ValueError(f"kv_cache_dtype {spec!r}: static int scales are per channel, so a "
                                     f"group suffix does not apply; use e.g. 'int{kb}_static'")
            return cls("int", kb, vb, group=group, static=bool(static))
        raise ValueError(f"kv_cache_dtype {spec!r} is not a known scheme. Accepted strings: {GRAMMAR}")

    @property
    def name(self) -> str:
        """Canonical string; `KVQuantConfig.parse(cfg.name) == cfg`."""
        return self._base_name() + _hp_suffix(self)

    def _base_name(self) -> str:
        if self.clip:
            return (dataclasses.replace(self, clip=False, clip_keys=True)._base_name()
                    + (CLIP_SUFFIX if self.clip_keys else CLIP_VALUES_SUFFIX))
        if self.method == "passthrough":
            return {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}[self.dtype]
        if self.method == "fp8":
            return "fp8_static" if self.static else "fp8"
        if self.method in ("kvarn", "kivi"):
            return f"{self.method}_k{self.k_bits}v{self.v_bits}_g{self.group}"
        base = f"int{self.k_bits}" if self.k_bits == self.v_bits else f"int_k{self.k_bits}v{self.v_bits}"
        return base + (f"_g{self.group}" if self.group else "") + ("_static" if self.static else "")

    def __str__(self) -> str:
        return self.name

    # ---------------------------------------------------------------- derived facts
    @property
    def is_passthrough(self) -> bool:
        return self.method == "passthrough"

    @property
    def rotated(self) -> bool:
        """Stored values live in the Hadamard-rotated frame (q is rotated, the output un-rotated)."""
        return self.method == "kvarn"

    @property
    def tile_tokens(self) -> int:
        """Tokens quantized together; a cache block must hold a whole number of tiles."""
        return self.group if self.method in ("kvarn", "kivi") else 1

    def bits(self, side: str) -> int:
        return self.k_bits if side == "k" else self.v_bits

    def channel_group(self, side: str, head_dim: int) -> int:
        """Channels sharing one scale for per-token rows (int values/keys, KIVI values)."""
        if self.method == "int":
            return self.group or head_dim
        if self.method == "kivi" and side == "v":
            return min(self.group, head_dim)
        return head_dim

    def check_head_dim(self, head_dim: int, arg: str = "head_dim") -> None:
        """Raise ValueError (naming `arg`) if this scheme cannot store vectors of `head_dim`."""
        if not isinstance(head_dim, int) or head_dim <= 0:
            raise ValueError(f"{arg} must be a positive int, got {head_dim!r}")
        if self.method == "kvarn":
            ok = head_dim >= 16 and head_dim <= 1024 and head_dim & (head_dim - 1) == 0
            if not ok:
                raise ValueError(
                    f"{arg}={head_dim} cannot be used with {self.name}: the Hadamard rotation needs a "
                    "power-of-two head_dim in [16, 1024] (e.g. 64, 128, 256)")
            return
        for side in ("k", "v"):
            b = self.bits(side)
            cg = self.channel_group(side, head_dim)
            if head_dim % cg:
                raise ValueError(
                    f"{arg}={head_dim} cannot be used with {self.name}: the channel group {cg} must "
                    f"divide head_dim (accepted head_dims: multiples of {cg})")
            if self.method in ("int", "kivi") and (head_dim * b) % 8:
                raise ValueError(
                    f"{arg}={head_dim} cannot be used with {self.name}: {b}-bit codes of a row must fill "
                    f"whole bytes (accepted head_dims: multiples of {8 // b})")

    def check_block_size(self, block_size: int, arg: str = "block_size") -> None:
        """A cache block holds whole tiles; block sizes from 1 to 1024 tokens are accepted. A sink
        of `sink_tokens` must be shorter than a block (the rest of the block is quantized)."""
        t = self.tile_tokens
        if not isinstance(block_size, int) or block_size <= 0 or block_size > 1024 or block_size % t:
            raise ValueError(
                f"{arg}={block_size!r} cannot be used with {self.name}: it must be a multiple of the "
                f"scheme's tile of {t} token(s) and at most 1024 (e.g. "
                f"{', '.join([str(m) for m in (16, 64, 128, 256, 512, 1024) if m % t == 0 and m >= t][:3])})")
        if self.sink_tokens >= block_size:
            raise ValueError(
                f"{arg}={block_size} cannot be used with {self.name}: a sink of {self.sink_tokens} tokens must be "
                f"shorter than a block (without the _sink suffix the whole first block is the sink)")


def parse(spec: Union[str, KVQuantConfig]) -> KVQuantConfig:
    """Module-level shorthand for `KVQuantConfig.parse`."""
    return KVQuantConfig.parse(spec)
