"""Local checkpoints → one canonical form: an `ArchConfig` plus fp32 numpy weights with Hugging Face llama names.

Two sources, never a hub:
- a Hugging Face directory (config.json + *.safetensors + tokenizer.json), read with a small safetensors parser
  (F32/F16/BF16) so the fast export path needs no torch;
- a GGUF file (llama.cpp), de-quantized with the `gguf` package; llama.cpp's convert script permutes the rows of
  q/k for its rotary layout, which is undone here (same inverse as transformers' GGUF loader).

Gemma 3's RMSNorms scale by (1 + w): the canonical form keeps the *effective* norm weights (1 + w), as llama.cpp's
GGUF stores them, so every consumer (graph, reference, smoothing, distillation) multiplies by the weight as for llama.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, asdict
from pathlib import Path

import numpy as np

SUPPORTED_ARCHITECTURES = {
    # config.json "architectures"[0] → our family name
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "llama",
    "Gemma3ForCausalLM": "gemma3",
}
# a config.json without "architectures"
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "mistral": "llama", "gemma3_text": "gemma3"}
GEMMA3_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm")


class CheckpointError(Exception):
    """A checkpoint we cannot read: the message names the file and what to do."""


@dataclass(frozen=True)
class ArchConfig:
    family: str  # "llama" | "qwen2"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rope_theta: float
    rms_eps: float
    max_positions: int
    tie_embeddings: bool
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # rope scaling as per-frequency divisors of the rotary inverse frequencies (head_dim / 2 of them; empty: none):
    # linear scaling divides all by its factor, Llama 3's scaling some (llama.cpp stores them as rope_freqs.weight)
    rope_factors: tuple[float, ...] = ()
    # Gemma 3 (family "gemma3"): sliding-window attention on `sliding_layers` (a query sees the keys less than
    # `sliding_window` positions behind it) with their own rotary base `rope_local_theta` (rope_factors apply to the
    # full-attention layers only); embeddings scaled by `embed_scale`; attention logits scaled by `attn_scale`
    # (0: 1/sqrt(head_dim)); tanh-GELU gated MLP; QK-norm and a norm after attention and after the MLP
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    rope_local_theta: float = 0.0
    embed_scale: float = 1.0
    attn_scale: float = 0.0

    def inv_freq(self, layer: int | None = None) -> np.ndarray:
        """The rotary inverse frequencies [head_dim / 2] of `layer` (default: a full-attention layer), scaling
        applied (what the graph and the reference use)."""
        if layer is not None and self.is_sliding(layer):
            return 1.0 / self.rope_local_theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim)
        inv = 1.0 / self.rope_theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim)
        return inv / np.asarray(self.rope_factors, np.float64) if self.rope_factors else inv

    def is_sliding(self, layer: int) -> bool:
        return bool(self.sliding_window) and layer in self.sliding_layers

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale or 1.0 / float(np.sqrt(self.head_dim))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["sliding_layers"] = list(self.sliding_layers)
        if self.rope_factors:
            d["rope_factors"] = [float(f) for f in self.rope_factors]
        # fields at their default are left out: exports of the llama family keep the manifest they always had
        for k, default in (("rope_factors", ()), ("sliding_window", 0), ("sliding_layers", []),
                           ("rope_local_theta", 0.0), ("embed_scale", 1.0), ("attn_scale", 0.0)):
            if d[k] == default:
                del d[k]
        return d


@dataclass
class Checkpoint:
    config: ArchConfig
    weights: dict[str, np.ndarray]  # HF names, fp32, Linear weights as [out, in]
    source: str  # path it came from
    source_format: str  # "hf" | "gguf"

    def layer(self, i: int, name: str) -> np.ndarray:
        return self.weights[f"model.layers.{i}.{name}"]

    @property
    def lm_head(self) -> np.ndarray:  # [vocab, hidden]
        return self.weights.get("lm_head.weight", self.weights["model.embed_tokens.weight"])


# ----------------------------------------------------------------------------- Hugging Face directories

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": "bf16", "F64": np.float64}


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Read a .safetensors file into fp32 numpy arrays (memory-mapped; BF16 widened by a bit shift)."""
    size = os.path.getsize(path)
    broken = f"{path}: truncated or not a safetensors file; re-save or re-copy the checkpoint"
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(broken)
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointError(broken)
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise CheckpointError(f"{broken} ({e})") from e
    base = 8 + n
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dt = _ST_DTYPES.get(meta["dtype"])
        if dt is None:
            raise CheckpointError(f"{path}: tensor {name} has dtype {meta['dtype']}; supported: {sorted(_ST_DTYPES)}")
        a, b = meta["data_offsets"]
        itemsize = 2 if dt == "bf16" else np.dtype(dt).itemsize
        if base + b > size or b - a != int(np.prod(meta["shape"], dtype=np.int64)) * itemsize:
            raise CheckpointError(f"{broken} (tensor {name} does not fit)")
        buf = raw[base + a : base + b]
        if dt == "bf16":
            arr = (buf.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            arr = buf.view(dt).astype(np.float32)
        out[name] = arr.reshape(meta["shape"])
    return out


_HF_REQUIRED = ("num_attention_heads", "hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")


def _config_from_hf(cfg: dict, where: str) -> ArchConfig:
    """The shape our graph builder needs. Every option that changes the math and that export/graph.py does not
    implement is refused here, before any work: an export that runs but computes another model than the checkpoint
    is worse than a refusal (its parity check shares the builder's assumptions and would not notice)."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else cfg.get("model_type", "?")
    family = SUPPORTED_ARCHITECTURES.get(arch) if archs else _MODEL_TYPES.get(arch)
    if family is None:
        raise CheckpointError(
            f"{where}: architecture {arch!r} is not supported by the fast exporter; supported: "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))} (other decoder-only models: edge-export --via optimum)"
        )
    via = "edge-export --via optimum exports it"
    # rope_parameters: newer transformers' name for rope_theta + rope_scaling; "type": older configs' rope_type.
    rp = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    rs = cfg.get("rope_scaling") or rp
    gemma = family == "gemma3"
    act = cfg.get("hidden_activation", cfg.get("hidden_act", "gelu_pytorch_tanh")) if gemma else \
        cfg.get("hidden_act", "silu")
    if act not in (("gelu_pytorch_tanh", "gelu_tanh") if gemma else ("silu", "swish")):
        raise CheckpointError(f"{where}: hidden_act {act!r}: the fast exporter's {arch} MLP is "
                              f"{'tanh-GELU' if gemma else 'SiLU'}-gated; {via}")
    if gemma:
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(key) is not None:
                raise CheckpointError(f"{where}: {key} {cfg[key]} is not supported by the fast exporter; {via}")
        if cfg.get("use_bidirectional_attention"):
            raise CheckpointError(f"{where}: use_bidirectional_attention (an encoder) is not a decoder the fast "
                                  "exporter builds")
    if float(cfg.get("partial_rotary_factor") or 1.0) != 1.0:
        raise CheckpointError(f"{where}: partial_rotary_factor {cfg['partial_rotary_factor']} (rotary over part of "
                              f"each head) is not supported by the fast exporter; {via}")
    if cfg.get("mlp_bias"):
        raise CheckpointError(f"{where}: mlp_bias (biases on the MLP projections) is not supported by the fast "
                              f"exporter; {via}")
    if family == "llama" and cfg.get("attention_bias"):
        raise CheckpointError(f"{where}: attention_bias (q/k/v/o biases) is not supported by the fast exporter; "
                              f"{via}")
    missing = [k for k in _HF_REQUIRED if k not in cfg]
    if missing:
        raise CheckpointError(f"{where}: no {', '.join(missing)}; not a complete {arch} config")
    max_positions = int(cfg.get("max_position_embeddings", 2048))
    # sliding-window attention (Mistral; Qwen2 with use_sliding_window) equals full attention while every position
    # is inside the window: the export is capped there, which is exact
    window = cfg.get("sliding_window") if arch == "MistralForCausalLM" or cfg.get("model_type") == "mistral" or \
        cfg.get("use_sliding_window") else None
    if window and not gemma:
        max_positions = min(max_positions, int(window))
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    rope_theta = float(cfg.get("rope_theta", rp.get("rope_theta", 10000.0)))
    head_dim = cfg.get("head_dim") or hidden // heads
    factors = _hf_rope_factors(rs, rope_theta, head_dim, f"{where}: rope scaling {rs} is not supported by the fast "
                                                          f"exporter yet; {via}")
    eos = cfg.get("eos_token_id")
    eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    extra = _gemma3_hf_fields(cfg, cfg["num_hidden_layers"], hidden, head_dim, where) if gemma else {}
    return ArchConfig(
        family=family,
        hidden=hidden,
        layers=cfg["num_hidden_layers"],
        heads=heads,
        kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        intermediate=cfg["intermediate_size"],
        vocab=cfg["vocab_size"],
        rope_theta=rope_theta,
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_positions=max_positions,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),  # transformers' defaults: Gemma ties
        qkv_bias=family == "qwen2",
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos,
        rope_factors=factors,
        **extra,
    )


def _gemma3_hf_fields(cfg: dict, layers: int, hidden: int, head_dim: int, where: str) -> dict:
    """Gemma 3's ArchConfig fields from its config.json: the sliding layers from `layer_types` (or the older
    `sliding_window_pattern`: every n-th layer is full), the local rotary base, sqrt(hidden) embedding scale and
    query_pre_attn_scalar^-0.5 attention scale, as transformers' Gemma3 text model computes them."""
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
            raise CheckpointError(f"{where}: layer_types must name sliding_attention or full_attention for each of "
                                  f"the {layers} layers")
        sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    else:
        every = int(cfg.get("sliding_window_pattern", 6))
        sliding = tuple(i for i in range(layers) if (i + 1) % every)
    scalar = float(cfg.get("query_pre_attn_scalar", head_dim))
    return dict(sliding_window=int(cfg.get("sliding_window") or 0) if sliding else 0,
                sliding_layers=sliding if cfg.get("sliding_window") else (),
                rope_local_theta=float(cfg.get("rope_local_base_freq", 10000.0)),
                embed_scale=float(np.float32(hidden ** 0.5)), attn_scale=float(scalar ** -0.5))


def _hf_rope_factors(rs, theta: float, head_dim: int, refusal: str) -> tuple[float, ...]:
    """ArchConfig.rope_factors of a transformers rope_scaling entry, as transformers computes the frequencies:
    none for default and dynamic NTK (plain rope up to max_position_embeddings, which the export never passes),
    the factor for linear, Llama 3's smoothed per-frequency factors (`_compute_llama3_parameters`). Any other kind
    (YaRN, LongRoPE, ...) changes attention scaling too and is refused with `refusal`."""
    kind = rs.get("rope_type", rs.get("type", "default")) if isinstance(rs, dict) else rs
    if kind in ("default", "dynamic", None):
        return ()
    try:
        factor = float(rs["factor"])
        if kind == "linear":
            low = high = old = 1.0
        elif kind == "llama3":
            low, high = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
            old = float(rs["original_max_position_embeddings"])
        else:
            raise CheckpointError(refusal)
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(refusal) from None
    if not all(0 < x < np.inf for x in (factor, low, high, old)) or (kind == "llama3" and high <= low):
        raise CheckpointError(f"{refusal} (factors must be finite and positive, high_freq_factor above "
                              "low_freq_factor)")
    if kind == "linear":
        return (factor,) * (head_dim // 2)
    return _llama3_factors(theta, head_dim, factor, low, high, old)


def _llama3_factors(theta: float, head_dim: int, factor: float, low: float, high: float,
                    old: float) -> tuple[float, ...]:
    """Llama 3.1's rope scaling as divisors of the plain inverse frequencies (llama.cpp's rope_freqs): high
    frequencies kept, low ones divided by `factor`, a smooth blend between."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv
    smooth = (old / wavelen - low) / (high - low)
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    scaled = np.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    return tuple(float(f) for f in inv / scaled)


def read_config(cfg_file: Path) -> dict:
    """A checkpoint's config.json as a dict, or one CheckpointError naming the file: not valid JSON, or valid JSON
    that is not an object (a list, a string), which would otherwise fail later as an AttributeError traceback."""
    try:
        cfg = json.loads(cfg_file.read_text())
    except ValueError as e:  # UnicodeDecodeError too
        raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_file}: a JSON {type(cfg).__name__}, not an object of config fields; expected a "
                              "Hugging Face config.json")
    return cfg


def load_hf_dir(path: str | os.PathLike) -> Checkpoint:
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: no config.json; expected a Hugging Face checkpoint directory or a .gguf file")
    config = _config_from_hf(read_config(cfg_file), str(cfg_file))
    files = _weight_files(path)
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weights (pytorch .bin files: re-save with safe_serialization=True)")
    weights: dict[str, np.ndarray] = {}
    for f in files:
        weights.update(read_safetensors(f))
    _check_weights(config, weights, str(path))
    if config.family == "gemma3":  # the canonical form keeps effective (1 + w) norm weights
        norms = ["model.norm.weight"] + [f"model.layers.{i}.{n}.weight" for i in range(config.layers)
                                         for n in GEMMA3_NORMS]
        weights.update({n: weights[n] + np.float32(1) for n in norms})
    return Checkpoint(config, weights, str(path), "hf")


def _weight_files(path: Path) -> list[Path]:
    """The transformers weights of a checkpoint directory, in transformers' order: model.safetensors, else the
    shards its index names, else every *.safetensors but a native copy (Mistral's repos ship
    consolidated.safetensors beside the HF shards, with other tensor names)."""
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise CheckpointError(f"{index}: names {missing[0]}, which is not in {path}")
        return [path / n for n in names]
    return sorted(p for p in path.glob("*.safetensors") if not p.name.startswith("consolidated"))


def _check_weights(config: ArchConfig, w: dict, where: str) -> None:
    shapes = _expected_shapes(config)
    missing = [n for n in shapes if n != "lm_head.weight" and n not in w]
    if missing:
        raise CheckpointError(f"{where}: {len(missing)} weights missing, e.g. {missing[0]}")
    if not config.tie_embeddings and "lm_head.weight" not in w:
        raise CheckpointError(f"{where}: untied embeddings but no lm_head.weight")
    # a config that disagrees with its weights (a stale or hand-edited config.json: a lost head_dim, another kv-head
    # count or vocabulary) is refused here, as transformers refuses it ("size mismatch"), instead of an ONNX Runtime
    # error mid-export or an export that cannot run
    for name, want in shapes.items():
        got = tuple(getattr(w.get(name), "shape", want))
        if got != want:
            raise CheckpointError(
                f"{where}: {name} has shape {list(got)} but the config (hidden {config.hidden}, heads "
                f"{config.heads}, kv heads {config.kv_heads}, head_dim {config.head_dim}, intermediate "
                f"{config.intermediate}, vocab {config.vocab}) implies {list(want)}; the config does not describe "
                "these weights")
    # a tensor the graph would not use (a bias, a norm) means the checkpoint computes something the export would not
    unused = sorted(n for n in set(w) - set(shapes) if not n.endswith("rotary_emb.inv_freq"))
    if unused:
        raise CheckpointError(f"{where}: {len(unused)} weight(s) the fast exporter does not implement, e.g. "
                              f"{unused[0]}; edge-export --via optimum exports other layer variants")


def _expected_shapes(c: ArchConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the graph reads (transformers' names, in checkpoint order), with the shape ([out, in]) the config
    gives it; lm_head.weight is read only when the embeddings are untied."""
    q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab, c.hidden), "model.norm.weight": (c.hidden,),
              "lm_head.weight": (c.vocab, c.hidden)}
    per_layer = {"self_attn.q_proj.weight": (q, c.hidden), "self_attn.k_proj.weight": (kv, c.hidden),
                 "self_attn.v_proj.weight": (kv, c.hidden), "self_attn.o_proj.weight": (c.hidden, q),
                 "mlp.gate_proj.weight": (c.intermediate, c.hidden), "mlp.up_proj.weight": (c.intermediate, c.hidden),
                 "mlp.down_proj.weight": (c.hidden, c.intermediate), "input_layernorm.weight": (c.hidden,),
                 "post_attention_layernorm.weight": (c.hidden,)}
    if c.qkv_bias:
        per_layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                          "self_attn.v_proj.bias": (kv,)})
    if c.family == "gemma3":
        per_layer.update({f"{n}.weight": (c.head_dim,) if n.startswith("self_attn") else (c.hidden,)
                          for n in GEMMA3_NORMS})
    for i in range(c.layers):
        shapes.update({f"model.layers.{i}.{n}": s for n, s in per_layer.items()})
    return shapes


# ----------------------------------------------------------------------------- GGUF

_GGUF_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp convert's `permute` on q/k rows ([out, in])."""
    out, inp = w.shape
    return w.reshape(n_head, out // n_head // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


_GGUF_REQUIRED = ("attention.head_count", "embedding_length", "block_count", "feed_forward_length",
                  "attention.layer_norm_rms_epsilon")


# Gemma 3's GGUF names for its four norms per layer and its QK-norm (llama.cpp's gemma3 conversion)
_GGUF_GEMMA3_NAMES = {**_GGUF_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                      "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
                      "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
GGUF_ARCHITECTURES = ("llama", "qwen2", "gemma3")


def load_gguf(path: str | os.PathLike) -> Checkpoint:
    try:
        from gguf.quants import dequantize
    except ImportError as e:  # pragma: no cover - dependency message
        raise CheckpointError("reading GGUF needs the `gguf` package: pip install gguf") from e
    from .gguf_read import GGUFFormatError, read_gguf

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such GGUF file")
    try:
        r = read_gguf(path)
    except (OSError, GGUFFormatError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from e
    f = r.fields
    arch = f.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:  # before any tensor is read
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} not supported; supported: "
                              f"{', '.join(GGUF_ARCHITECTURES)}")
    p = arch + "."
    missing = [p + k for k in _GGUF_REQUIRED if p + k not in f]
    if missing:
        raise CheckpointError(f"{path}: GGUF metadata lacks {', '.join(missing)}")
    # llama.cpp: a missing scaling type with a factor means linear; the factor may sit under the legacy
    # rope.scale_linear key; a factor of 0 means none
    linear = float(f.get(p + "rope.scaling.factor") or f.get(p + "rope.scale_linear") or 0.0)
    scaling = f.get(p + "rope.scaling.type") or ("linear" if linear else "none")
    if scaling not in ("none", "linear"):
        raise CheckpointError(f"{path}: rope scaling {scaling!r} is not supported by the fast exporter yet")
    heads = int(f[p + "attention.head_count"])
    rope_freqs = None
    kv_heads = int(f.get(p + "attention.head_count_kv", heads))
    hidden = int(f[p + "embedding_length"])
    names = _GGUF_GEMMA3_NAMES if arch == "gemma3" else _GGUF_NAMES
    weights: dict[str, np.ndarray] = {}
    for t in r.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims innermost-first
        arr = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)
        name = t.name
        if name == "rope_freqs.weight":  # llama.cpp's per-frequency rope divisors (Llama 3.1's rope scaling)
            rope_freqs = tuple(float(x) for x in arr.reshape(-1))
            continue
        if name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            hf = "model.norm.weight"
        elif name == "output.weight":
            hf = "lm_head.weight"
        elif name.startswith("blk."):
            _, i, kind, suffix = name.split(".", 3)
            # a kind we do not map keeps its GGUF name: _check_weights refuses it rather than the export dropping it
            hf = f"model.layers.{i}.{names[kind]}.{suffix}" if kind in names else name
            if arch == "llama" and kind == "attn_q" and suffix == "weight":
                arr = _unpermute(arr, heads)
            elif arch == "llama" and kind == "attn_k" and suffix == "weight":
                arr = _unpermute(arr, kv_heads)
        else:
            hf = name  # refused by _check_weights
        weights[hf] = np.ascontiguousarray(arr)
    emb = weights.get("model.embed_tokens.weight")
    vocab = int(f.get(p + "vocab_size", emb.shape[0] if emb is not None else 0))
    eos = f.get("tokenizer.ggml.eos_token_id")
    head_dim = int(f.get(p + "attention.key_length", hidden // heads))
    rot = int(f.get(p + "rope.dimension_count", head_dim))
    if rot != head_dim:
        raise CheckpointError(f"{path}: rotary over {rot} of {head_dim} head dims (partial rotary) is not supported "
                              "by the fast exporter yet")
    # llama.cpp divides each rotary frequency by rope_freqs[i] and, for linear scaling, all of them by the factor
    factors = np.ones(head_dim // 2)
    if rope_freqs is not None:
        if len(rope_freqs) != head_dim // 2 or not all(x > 0 for x in rope_freqs):
            raise CheckpointError(f"{path}: rope_freqs.weight has {len(rope_freqs)} entries, not head dim / 2 = "
                                  f"{head_dim // 2} positive factors")
        factors = factors * np.asarray(rope_freqs)
    if scaling == "linear" and linear > 0:
        factors = factors * linear
    config = ArchConfig(
        family=arch,
        hidden=hidden,
        layers=int(f[p + "block_count"]),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=int(f[p + "feed_forward_length"]),
        vocab=vocab,
        rope_theta=float(f.get(p + "rope.freq_base", 10000.0)),
        rms_eps=float(f[p + "attention.layer_norm_rms_epsilon"]),
        max_positions=int(f.get(p + "context_length", 2048)),
        tie_embeddings="lm_head.weight" not in weights,
        qkv_bias=arch == "qwen2",
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
        rope_factors=tuple(float(x) for x in factors) if np.any(factors != 1) else (),
        **(_gemma3_gguf_fields(f, int(f[p + "block_count"]), hidden, heads, head_dim) if arch == "gemma3" else {}),
    )
    _check_weights(config, weights, str(path))
    return Checkpoint(config, weights, str(path), "gguf")


def _gemma3_gguf_fields(f: dict, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
    """What llama.cpp's gemma3 model fixes rather than stores: every 6th layer full attention, the others sliding
    with rotary base 10k, sqrt(hidden) embedding scale, and attention scaled by 1/sqrt(head dim) except for the 27B
    model (hidden 5376), whose query_pre_attn_scalar is hidden / heads. Norm weights are stored as (1 + w)."""
    window = int(f.get("gemma3.attention.sliding_window", 0))
    scalar = hidden / heads if hidden == 5376 else head_dim
    return dict(sliding_window=window, sliding_layers=tuple(i for i in range(layers) if (i + 1) % 6) if window else (),
                rope_local_theta=10000.0, embed_scale=float(np.float32(hidden ** 0.5)),
                attn_scale=float(scalar ** -0.5))


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or directory")
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise CheckpointError(f"{p}: a file must be a .gguf; a Hugging Face checkpoint is a directory")
        return load_gguf(p)
    ggufs = sorted(p.glob("*.gguf"))
    if not (p / "config.json").exists() and len(ggufs) == 1:
        return load_gguf(ggufs[0])
    return load_hf_dir(p)
