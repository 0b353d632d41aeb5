"""`edge_model.json`: everything the runtime and the memory planner need to know about an exported model directory.

Written last and atomically by the exporter (a directory without it does not load); read with strict checks so a
stale, truncated or foreign directory fails at load time with the file and the fix named.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from memory.footprint import kv_bytes_per_token

from .errors import EngineError
from .files import write_atomic

FORMAT_VERSION = 2  # the newest format this edgespec reads (and writes when an export needs it)
OLDEST_FORMAT = 1  # format 2 adds GraphEntry.arch (a drafter from its own checkpoint); format 1 exports still load
# the graphs export.graph writes: bumped whenever they change, so a cached export from an older builder is rebuilt
# (2: the pad query row; 3: block-quantized embedding rows; 4: the default export became w8a8; 5: the on-graph head
# takes k and the temperature per call and returns probabilities; 6: w8a8 smoothed before quantization, int4 blocks
# keep their float minimum; 7: w8a8 weights as uint8 where the host's int8 GEMM saturates, `GraphEntry.w8a8_kernel`;
# 8: w8a8 activations quantized by one blocked QuantizeLinear per linear (opset 21), 6 nodes instead of 8)
GRAPH_VERSION = 8
FAST_HASH_BYTES = 16 << 20  # verify="fast" hashes files up to this size
MANIFEST_NAME = "edge_model.json"


class ModelDirError(EngineError):
    """A model directory that cannot be used; the message names the file and the fix."""


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the model directory
    bytes: int
    sha256: str


@dataclass(frozen=True)
class GraphEntry:
    role: str  # "target" | "drafter"
    name: str
    file: str  # model.onnx path, relative
    layers: int
    vocab: int  # width of the logits output
    precision: str  # fp32 | fp16 | int8 | int4 | w8a8 (int8 weights per channel, int8 activations per row)
    block_size: int = 0
    accuracy_level: int = 0
    lm_head_bits: int = 0  # 0 = float head
    w8a8_kernel: str = "u8s8"  # w8a8: int8 weights (u8s8 GEMM) or uint8 ones (u8u8, exact on CPUs without VNNI)
    embedding_bits: int = 0  # 0 = float Gather table; else block-quantized rows (GatherBlockQuantized)
    block_min: bool = False  # 4-bit layers keep their blocks' float minimums (export.quant.quantize_block_min)
    max_len: int = 0  # KV buffer capacity the rotary tables cover
    kv_dtype: str = "float32"
    tree_capable: bool = True
    io: str = "edgespec"  # graph interface: "edgespec" (export/graph.py) | "optimum" (edge-export --via optimum)
    id_map: str | None = None  # .npy: drafter logit index → target token id (trimmed vocabulary)
    arch: dict | None = None  # the graph's own shape when it is not the target's (a drafter from its own checkpoint)
    weight_bytes: int = 0  # onnx + external data on disk
    stats: dict = field(default_factory=dict)  # agreement / latency measured at export time

    @property
    def int8_activations(self) -> bool:
        """Activations quantized to int8 inside the matmuls: any change in attention summation order (a tree's
        masked siblings) can move a value across a rounding step, so trees are never exact on such graphs."""
        return self.precision == "w8a8" or (self.precision in ("int4", "int8") and self.accuracy_level == 4)


def format_for(graphs) -> int:
    """The oldest format that describes these graphs, so an export an older edgespec can run is still format 1,
    and one it cannot (a graph with its own shape, which it would read as the target's) tells it to upgrade."""
    return 2 if any(g.arch for g in graphs) else OLDEST_FORMAT


@dataclass(frozen=True)
class Manifest:
    format_version: int
    name: str
    arch: dict  # ArchConfig fields: hidden, layers, heads, kv_heads, head_dim, intermediate, vocab, ...
    graphs: tuple[GraphEntry, ...]
    files: tuple[FileEntry, ...]
    tokenizer: str  # tokenizer.json, relative
    chat_template: str | None
    special_tokens: dict  # bos, eos (list), pad
    source: dict  # path, format, sha256
    converter: dict  # versions of edgespec, onnx, onnxruntime, gguf, transformers
    parity: dict = field(default_factory=dict)

    # ---------------------------------------------------------------- queries
    @property
    def target(self) -> GraphEntry:
        for g in self.graphs:
            if g.role == "target":
                return g
        raise ModelDirError("manifest lists no target graph; re-export the model")

    @property
    def drafters(self) -> list[GraphEntry]:
        return [g for g in self.graphs if g.role == "drafter"]

    def arch_of(self, graph: GraphEntry) -> dict:
        """A graph's shape: its own (a drafter exported from a separate checkpoint), else the target's."""
        return graph.arch or self.arch

    def kv_bytes_per_token(self, graph: GraphEntry) -> int:
        return kv_bytes_per_token(self.arch_of(graph), graph.layers, graph.kv_dtype)

    # ---------------------------------------------------------------- I/O
    def to_json(self) -> str:
        d = asdict(self)
        return json.dumps(d, indent=2, sort_keys=False)

    @classmethod
    def from_dict(cls, d: dict) -> "Manifest":
        d = dict(d)
        d["graphs"] = tuple(GraphEntry(**_known(GraphEntry, g)) for g in d["graphs"])
        d["files"] = tuple(FileEntry(**_known(FileEntry, f)) for f in d["files"])
        return cls(**_known(cls, d))

    def write(self, model_dir: str | os.PathLike) -> Path:
        """Atomic: write a temp file, fsync, rename (an interrupted export leaves no manifest)."""
        path = Path(model_dir) / MANIFEST_NAME
        write_atomic(path, self.to_json())
        return path


def _known(cls, d: dict) -> dict:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in d.items() if k in names}


def reexport_command(model_dir: str | os.PathLike, source: str | None = None) -> str:
    """The command that rebuilds `model_dir`: the embedded default's own flag, else its recorded source."""
    model_dir = Path(model_dir)
    try:
        from . import default_model_dir

        if model_dir.resolve() == default_model_dir().resolve():
            return "edge-export --default --force"
    except ImportError:  # pragma: no cover - edge imported partially
        pass
    return f"edge-export {source or 'CHECKPOINT'} -o {model_dir}"


VERIFY_LEVELS = ("none", "size", "fast", "sha256")
PARTIAL_MARKER = ".edgespec-partial"  # in <out>.partial while edge-export writes an export
OLD_MARKER = ".edgespec-old"  # in <out>.old, a replaced export, until edge-export deletes it


def _looks_like_checkpoint(d: Path) -> bool:
    """A Hugging Face checkpoint (config.json with safetensors weights) or a directory of GGUF files."""
    return any(d.glob("*.gguf")) or ((d / "config.json").is_file() and any(d.glob("*.safetensors")))


def load_manifest(model_dir: str | os.PathLike, verify: str = "size") -> Manifest:
    """Read and check `edge_model.json`. verify: "none" | "size" (every file present with its size) | "fast" (size,
    plus sha256 of every file up to 16 MB: graph protos, tokenizer, id maps) | "sha256" (every file)."""
    if verify not in VERIFY_LEVELS:
        raise ValueError(f"verify={verify!r}: choose one of {', '.join(VERIFY_LEVELS)}")
    model_dir = Path(model_dir)
    path = model_dir / MANIFEST_NAME
    if model_dir.exists() and not model_dir.is_dir():
        raise ModelDirError(f"{model_dir} is a file, not a model directory (give the folder edge-export wrote)")
    if not model_dir.is_dir():
        raise ModelDirError(f"{model_dir}: no such model directory (export one with: edge-export CHECKPOINT -o {model_dir})")
    if not path.is_file() and _looks_like_checkpoint(model_dir):
        # never suggest exporting into the source: an export replaces its output directory as a whole
        d = Path(os.path.abspath(model_dir))  # "." has no name to derive a sibling from
        raise ModelDirError(f"{model_dir} holds a model checkpoint, not an edgespec export; export it first into a new "
                            f"directory: edge-export {model_dir} -o {d.with_name(d.name + '-edgespec')}")
    if not path.is_file():
        # edge-export accepts an empty directory, the remains of its own swap, or its own cache (--default --force);
        # anything else is refused there
        again = reexport_command(model_dir)
        ours = again.startswith("edge-export --default") or not any(p.name != OLD_MARKER for p in model_dir.iterdir())
        raise ModelDirError(f"{path}: missing — {model_dir} is not a complete edgespec export "
                            + (f"(an interrupted export never writes it); re-run edge-export into it: {again}" if ours else
                               "and holds other files; export into a new directory (edge-export CHECKPOINT -o NEW_DIR), "
                               "or, if it is a damaged export, delete it and export into it again"))
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelDirError(f"{path}: unreadable ({e}); re-run edge-export: {reexport_command(model_dir)}") from e
    src = raw.get("source", {}).get("path") if isinstance(raw, dict) and isinstance(raw.get("source"), dict) else None
    fix = f"re-run edge-export: {reexport_command(model_dir, src)}"
    version = raw.get("format_version") if isinstance(raw, dict) else None
    if not (isinstance(version, int) and not isinstance(version, bool) and OLDEST_FORMAT <= version <= FORMAT_VERSION):
        newer = isinstance(version, int) and version > FORMAT_VERSION
        raise ModelDirError(
            f"{path}: manifest format {version} but this edgespec reads formats {OLDEST_FORMAT}-{FORMAT_VERSION}; "
            + ("upgrade edgespec (pip install -U edgespec)" if newer else f"re-export the model with this edgespec: "
                                                                           f"{reexport_command(model_dir, src)}")
        )
    try:
        m = Manifest.from_dict(raw)
    except (TypeError, KeyError, AttributeError) as e:  # AttributeError: an entry that is not an object
        raise ModelDirError(f"{path}: malformed manifest ({e}); {fix}") from e
    if verify != "none":
        for f in m.files:
            p = model_dir / f.path
            if not p.is_file():
                raise ModelDirError(f"{p}: listed in the manifest but missing; {fix}")
            if p.stat().st_size != f.bytes:
                raise ModelDirError(f"{p}: {p.stat().st_size} bytes, manifest says {f.bytes} (truncated or replaced); "
                                    f"{fix}")
            hash_it = verify == "sha256" or (verify == "fast" and f.bytes <= FAST_HASH_BYTES)
            if hash_it and sha256_file(p) != f.sha256:
                raise ModelDirError(f"{p}: sha256 does not match the manifest (file changed since export); {fix}")
    return m


def require_drafter_graph(model_dir: str | os.PathLike, m: Manifest) -> None:
    """The model drafter runs an exported drafter graph: refused the same way by `edge.load` and `edge-chat --plan`
    (which plans from the manifest without loading the target)."""
    if not m.drafters:
        raise ModelDirError(f"{model_dir}: no drafter graph in this export for the model drafter (re-export with "
                            "--drafter-layers), or use another drafter (drafter='lookup', --drafter lookup)")


def check_drafter(model_dir: str | os.PathLike, m: Manifest, g: GraphEntry) -> None:
    """A drafter graph belongs to this target: its vocabulary and id map (trimmed logit index → target token id)
    fit the target's vocabulary. Checked at load time, before the drafter's session is ever built."""
    model_dir = Path(model_dir)
    fix = f"re-run edge-export: {reexport_command(model_dir, m.source.get('path'))}"
    if g.arch is not None:  # a drafter from its own checkpoint: its shape sizes the session's KV buffers
        a = g.arch
        bad = not isinstance(a, dict) or not all(
            isinstance(a.get(k), int) and not isinstance(a.get(k), bool) and a.get(k) > 0
            for k in ("hidden", "layers", "kv_heads", "head_dim", "vocab"))
        if bad or a["layers"] < g.layers:
            raise ModelDirError(f"{model_dir / MANIFEST_NAME}: drafter {g.name!r} has a malformed shape ({a!r}); {fix}")
    vocab = m.arch.get("vocab")
    if not 0 < g.vocab <= vocab:
        raise ModelDirError(f"{model_dir / g.file}: drafter {g.name!r} has a {g.vocab}-token vocabulary but the target "
                            f"{vocab}; it was built for another tokenizer — {fix}")
    if g.id_map is None:
        if g.vocab != vocab:
            raise ModelDirError(f"{model_dir / g.file}: drafter {g.name!r} has {g.vocab} logits, no id map, and the "
                                f"target {vocab} tokens; it was built for another vocabulary — {fix}")
        return
    p = model_dir / g.id_map
    try:
        ids = np.load(p, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ModelDirError(f"{p}: drafter id map unreadable ({e}); {fix}") from e
    if ids.ndim != 1 or ids.dtype.kind not in "iu" or len(ids) != g.vocab:
        raise ModelDirError(f"{p}: drafter id map has shape {ids.shape} ({ids.dtype}) but the drafter {g.vocab} "
                            f"logits; {fix}")
    if len(ids) and (ids.min() < 0 or ids.max() >= vocab):
        raise ModelDirError(f"{p}: drafter id map holds ids in [{ids.min()}, {ids.max()}], outside the target "
                            f"vocabulary [0, {vocab}); the drafter was built for another tokenizer — {fix}")
    if np.unique(ids).size != ids.size:
        raise ModelDirError(f"{p}: drafter id map repeats token ids; {fix}")
