"""`edge_model.json`: everything the runtime and the memory planner need to know about an exported model directory.

Written last and atomically by the exporter (a directory without it does not load); read with strict checks so a
stale, truncated or foreign directory fails at load time with the file and the fix named.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path, PureWindowsPath

import numpy as np

from memory.footprint import PRECISIONS, kv_bytes_per_token

from .errors import EngineError
from .files import write_atomic
from .kv import KV_DTYPES

FORMAT_VERSION = 2  # the newest format this edgespec reads (and writes when an export needs it)
OLDEST_FORMAT = 1  # format 2 adds GraphEntry.arch (a drafter from its own checkpoint); format 1 exports still load
# the graphs export.graph writes: bumped whenever they change, so a cached export from an older builder is rebuilt
# (2: the pad query row; 3: block-quantized embedding rows; 4: the default export became w8a8; 5: the on-graph head
# takes k and the temperature per call and returns probabilities; 6: w8a8 smoothed before quantization, int4 blocks
# keep their float minimum; 7: w8a8 weights as uint8 where the host's int8 GEMM saturates, `GraphEntry.w8a8_kernel`;
# 8: w8a8 activations quantized by one blocked QuantizeLinear per linear (opset 21), 6 nodes instead of 8; 9: an int8
# KV cache with static per-channel scales, the pad query row only where the host needs it; 10: the two-stage LM head,
# `GraphEntry.head_rescore`; 11: int8-cache graphs take `dequantize_past`, an attention path for prefill chunks)
GRAPH_VERSION = 11
# the bool scalar input of int8-cache graphs that picks the attention path per call (export/graph.py)
DEQUANTIZE_PAST = "dequantize_past"
FAST_HASH_BYTES = 16 << 20  # verify="fast" hashes files up to this size
MANIFEST_NAME = "edge_model.json"
# what a manifest may hold, checked before anything is sized from it. A real manifest is ~10 KB (mostly the chat
# template) nested 7 levels deep (graphs → stats → latency_ms_by_s_at → [context, [ms]]); the shape bounds are several
# times the largest published models' (126 layers, 128 heads, head_dim 256, 262k-token vocabularies), so they only
# refuse values no export has, before a KV buffer or a vocabulary-sized table is allocated from them
MAX_MANIFEST_BYTES = 16 << 20
MAX_DEPTH = 32
MAX_LAYERS = MAX_HEADS = MAX_HEAD_DIM = 1024
MAX_WIDTH = 1 << 20  # hidden, intermediate
MAX_VOCAB = 1 << 21
MIN_MAX_LEN, MAX_MAX_LEN = 8, 1 << 24  # a graph's KV capacity: the exporters write at least 8 (their latency calls)
MAX_FILE_BYTES = 1 << 48


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
    # > 0: a two-stage LM head, coarse 4-bit weights over the vocabulary, then this many candidates per row scored
    # again from the embedding's rows (export.graph `_Builder.rescored_head`); 0 = one head at lm_head_bits
    head_rescore: int = 0
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
    # what the exporter chose on its host (precision, pad row, KV cache) and the measurements behind it
    choice: dict = field(default_factory=dict)

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


_MISSING = object()


def _show(v) -> str:
    """A manifest value for an error message: short, and on one line."""
    if v is _MISSING:
        return "missing"
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _whole(v, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _inside(rel) -> bool:
    """A relative path that stays in the model directory on its face: no root, drive or `..` part (symbolic links
    are resolved against the directory separately, `_check_paths`)."""
    return (isinstance(rel, str) and 0 < len(rel) <= 4096 and "\x00" not in rel and not rel.startswith(("/", "\\"))
            and not PureWindowsPath(rel).anchor and ".." not in re.split(r"[\\/]", rel))


def _source_path(source) -> str | None:
    """The recorded source checkpoint, when it can stand in a one-line command (a tampered value cannot)."""
    src = source.get("path") if isinstance(source, dict) else None
    return src if isinstance(src, str) and src.isprintable() and 0 < len(src) <= 4096 else None


def _nesting_over(raw, limit: int) -> bool:
    """Does the parsed JSON nest objects and lists more than `limit` deep? (Iterative: no recursion to exhaust.)"""
    stack = [(raw, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > limit:
                return True
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return False


_REQUIRED = ("format_version", "name", "arch", "graphs", "files", "tokenizer", "chat_template", "special_tokens",
             "source", "converter")


def _check_schema(raw: dict, where: Path, fix: str) -> None:
    """Every field the runtime reads has its type and a sane range, and the fields agree with each other (one target,
    graph shapes within the model's, files that list what the graphs and tokenizer name). The first bad value is one
    ModelDirError naming its field, raised before anything is sized from the manifest."""

    def fail(problem: str, prefix: str = "malformed manifest: "):
        raise ModelDirError(f"{where}: {prefix}{problem}; {fix}")

    def bad(name: str, value, expected: str, prefix: str = "malformed manifest: "):
        fail(f"{name} is {_show(value)}, expected {expected}", prefix)

    def whole(d, key, name: str, lo: int, hi: int, prefix: str = "malformed manifest: ", hi_name: str = ""):
        v = d.get(key, _MISSING) if isinstance(d, dict) else d[key]
        if not _whole(v, lo, hi):
            bad(name, v, f"a whole number from {lo} to {hi}" + (f" ({hi_name})" if hi_name else ""), prefix)
        return v

    def choice(d: dict, key: str, name: str, choices: tuple, optional: bool = True):
        if key in d or not optional:
            v = d.get(key, _MISSING)
            if not (isinstance(v, type(choices[0])) and v in choices):
                bad(name, v, "one of " + ", ".join(map(repr, choices)))

    def rel_path(d: dict, key: str, name: str) -> str:
        v = d.get(key, _MISSING)
        if not _inside(v):
            bad(name, v, "a relative path inside the model directory")
        return Path(v).as_posix()

    def arch_of(a, name: str, least_width: int, prefix: str = "malformed manifest: ") -> dict:
        if not isinstance(a, dict):
            bad(name, a, "an object (the model's shape)", prefix)
        hidden = whole(a, "hidden", f"{name}.hidden", least_width, MAX_WIDTH, prefix)
        whole(a, "layers", f"{name}.layers", 1, MAX_LAYERS, prefix)
        heads = whole(a, "heads", f"{name}.heads", 1, MAX_HEADS, prefix)
        kv = whole(a, "kv_heads", f"{name}.kv_heads", 1, heads, prefix, f"{name}.heads")
        if heads % kv:
            bad(f"{name}.kv_heads", kv, f"a divisor of {name}.heads ({heads})", prefix)
        head_dim = whole(a, "head_dim", f"{name}.head_dim", 1, MAX_HEAD_DIM, prefix)
        if hidden and heads * head_dim > 8 * hidden:  # real models: within 2x of hidden (Gemma 7B: 4096 for 3072)
            fail(f"{name}.heads × {name}.head_dim is {heads * head_dim}, more than 8 × {name}.hidden ({hidden})",
                 prefix)
        whole(a, "intermediate", f"{name}.intermediate", least_width, MAX_WIDTH, prefix)
        whole(a, "vocab", f"{name}.vocab", 1, MAX_VOCAB, prefix)
        return a

    for key in _REQUIRED:
        if key not in raw:
            fail(f"{key} is missing (every manifest has it)")
    if not isinstance(raw["name"], str):
        bad("name", raw["name"], "a string")
    graphs = raw["graphs"]
    if not isinstance(graphs, list) or not graphs:
        bad("graphs", graphs, "a list of graph objects")
    # an optimum export reads hidden and intermediate off config.json, where a model may not name them (0)
    optimum = any(isinstance(g, dict) and g.get("role") == "target" and g.get("io") == "optimum" for g in graphs)
    arch = arch_of(raw["arch"], "arch", 0 if optimum else 1)
    vocab = arch["vocab"]
    named, names, has_target = [], set(), False
    for i, g in enumerate(graphs):
        n = f"graphs[{i}]"
        if not isinstance(g, dict):
            bad(n, g, "an object")
        choice(g, "role", f"{n}.role", ("target", "drafter"), optional=False)
        target = g["role"] == "target"
        if target and has_target:
            fail(f"{n}.role is a second 'target' (a manifest has one target graph)")
        has_target |= target
        name = g.get("name", _MISSING)
        if not (isinstance(name, str) and name.isprintable() and 0 < len(name) <= 200):
            bad(f"{n}.name", name, "a graph name")
        if name in names:
            fail(f"{n}.name {name!r} names two graphs")
        names.add(name)
        named.append((f"{n}.file", rel_path(g, "file", f"{n}.file")))
        own = g.get("arch")
        if own is not None:
            arch_of(own, f"{n}.arch", 1, prefix=f"graph {name!r} has a malformed shape: ")
        shape, shape_name = (own, f"{n}.arch") if own is not None else (arch, "arch")
        if target:  # the target computes the model's logits
            for key in ("layers", "vocab"):
                if not _whole(g.get(key), arch[key], arch[key]):
                    bad(f"{n}.{key}", g.get(key, _MISSING),
                        f"arch.{key} ({arch[key]}): the target graph is the whole model")
        else:  # a drafter's vocabulary against the target's is checked with its id map (check_drafter)
            whole(g, "layers", f"{n}.layers", 1, shape["layers"], hi_name=f"{shape_name}.layers")
            whole(g, "vocab", f"{n}.vocab", 1, MAX_VOCAB)
        choice(g, "precision", f"{n}.precision", PRECISIONS, optional=False)
        whole(g, "max_len", f"{n}.max_len", MIN_MAX_LEN, MAX_MAX_LEN)
        for key, hi in (("block_size", 1 << 16), ("accuracy_level", 4), ("lm_head_bits", 16), ("embedding_bits", 16),
                        ("head_rescore", MAX_VOCAB), ("weight_bytes", MAX_FILE_BYTES)):
            if key in g:
                whole(g, key, f"{n}.{key}", 0, hi)
        choice(g, "w8a8_kernel", f"{n}.w8a8_kernel", ("u8s8", "u8u8"))
        choice(g, "kv_dtype", f"{n}.kv_dtype", tuple(KV_DTYPES))
        choice(g, "io", f"{n}.io", ("edgespec", "optimum"))
        for key in ("block_min", "tree_capable"):
            if key in g and not isinstance(g[key], bool):
                bad(f"{n}.{key}", g[key], "true or false")
        if g.get("id_map") is not None:
            named.append((f"{n}.id_map", rel_path(g, "id_map", f"{n}.id_map")))
        if not isinstance(g.get("stats", {}), dict):
            bad(f"{n}.stats", g["stats"], "an object")
    if not has_target:
        fail("graphs has no graph with role 'target'")
    files = raw["files"]
    if not isinstance(files, list):
        bad("files", files, "a list of file objects")
    listed = set()
    for i, f in enumerate(files):
        if not isinstance(f, dict):
            bad(f"files[{i}]", f, "an object")
        listed.add(rel_path(f, "path", f"files[{i}].path"))
        whole(f, "bytes", f"files[{i}].bytes", 0, MAX_FILE_BYTES)
        if not (isinstance(f.get("sha256"), str) and re.fullmatch("[0-9a-f]{64}", f["sha256"])):
            bad(f"files[{i}].sha256", f.get("sha256", _MISSING), "a sha256 digest (64 hex digits)")
    named.append(("tokenizer", rel_path(raw, "tokenizer", "tokenizer")))
    for name, rel in named:  # what is verified is what is loaded
        if rel not in listed:
            fail(f"{name} {rel!r} is not listed in files (so never verified)")
    if raw["chat_template"] is not None and not isinstance(raw["chat_template"], str):
        bad("chat_template", raw["chat_template"], "a string or null")
    special = raw["special_tokens"]
    if not isinstance(special, dict):
        bad("special_tokens", special, "an object")
    for key in ("bos", "pad"):
        if special.get(key) is not None:
            whole(special, key, f"special_tokens.{key}", 0, vocab - 1, hi_name="arch.vocab - 1")
    eos = special.get("eos")
    if eos is not None:
        if not isinstance(eos, list):
            bad("special_tokens.eos", eos, "a list of token ids")
        for j in range(len(eos)):
            whole(eos, j, f"special_tokens.eos[{j}]", 0, vocab - 1, hi_name="arch.vocab - 1")
    for key in ("source", "converter", "parity"):
        if key in raw and not isinstance(raw[key], dict):
            bad(key, raw[key], "an object")
    src = raw["source"].get("path")
    if src is not None and _source_path(raw["source"]) is None:
        bad("source.path", src, "the source checkpoint's path")


def _check_paths(model_dir: Path, m: "Manifest", fix: str) -> None:
    """No file the manifest names resolves outside the model directory (a symbolic link out of it, or a directory
    on the way that is one): another export's graph must not load, nor any other file be sized or hashed."""
    root = Path(os.path.realpath(model_dir))
    named = []
    for i, g in enumerate(m.graphs):
        named += [(f"graphs[{i}].file", g.file), (f"graphs[{i}].file's external data", g.file + ".data")]
        if g.id_map is not None:
            named.append((f"graphs[{i}].id_map", g.id_map))
    named += [("tokenizer", m.tokenizer)] + [(f"files[{i}].path", f.path) for i, f in enumerate(m.files)]
    for name, rel in named:
        if not Path(os.path.realpath(model_dir / rel)).is_relative_to(root):
            raise ModelDirError(f"{model_dir / rel}: {name} leads outside the model directory {model_dir} through a "
                                f"symbolic link; {fix}")


def reexport_command(model_dir: str | os.PathLike, source: str | None = None) -> str:
    """The command that rebuilds `model_dir`: the embedded default's own flag, else its recorded source."""
    model_dir = Path(model_dir)
    try:
        from .files import default_model_dir

        if model_dir.resolve() == default_model_dir().resolve():
            return "edge-export --default --force"
    except ImportError:  # pragma: no cover - edge imported partially
        pass
    force = " --force" if (model_dir / MANIFEST_NAME).exists() else ""  # edge-export replaces an export only then
    return f"edge-export {source or 'CHECKPOINT'} -o {model_dir}{force}"


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
        fix = (f"export it first: edge-export {model_dir} -o DIR, then pass DIR" if model_dir.suffix.lower() == ".gguf"
               else "give the folder edge-export wrote")
        raise ModelDirError(f"{model_dir} is a file, not a model directory ({fix})")
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
    again = f"re-run edge-export: {reexport_command(model_dir)}"
    if not Path(os.path.realpath(path)).is_relative_to(os.path.realpath(model_dir)):
        raise ModelDirError(f"{path}: a symbolic link out of the model directory {model_dir}; {again}")
    try:
        with open(path, "rb") as f:  # read no more than a manifest can hold, whatever the file has become
            data = f.read(MAX_MANIFEST_BYTES + 1)
        if len(data) > MAX_MANIFEST_BYTES:
            raise ModelDirError(f"{path}: larger than any manifest (more than {MAX_MANIFEST_BYTES} bytes); {again}")
        raw = json.loads(data)
        if _nesting_over(raw, MAX_DEPTH):
            raise RecursionError
    except RecursionError as e:  # json's own recursion limit, or deep enough to exhaust it later (asdict, dumps)
        raise ModelDirError(f"{path}: nested more than {MAX_DEPTH} levels deep, which no manifest is; {again}") from e
    except (OSError, ValueError) as e:
        raise ModelDirError(f"{path}: unreadable ({e}); {again}") from e
    if not isinstance(raw, dict):
        raise ModelDirError(f"{path}: holds {type(raw).__name__} JSON, not a manifest object; {again}")
    src = _source_path(raw.get("source"))
    fix = f"re-run edge-export: {reexport_command(model_dir, src)}"
    version = raw.get("format_version")
    if not (isinstance(version, int) and not isinstance(version, bool) and OLDEST_FORMAT <= version <= FORMAT_VERSION):
        newer = isinstance(version, int) and version > FORMAT_VERSION
        raise ModelDirError(
            f"{path}: manifest format {version} but this edgespec reads formats {OLDEST_FORMAT}-{FORMAT_VERSION}; "
            + ("upgrade edgespec (pip install -U edgespec)" if newer else f"re-export the model with this edgespec: "
                                                                           f"{reexport_command(model_dir, src)}")
        )
    _check_schema(raw, path, fix)
    try:
        m = Manifest.from_dict(raw)
    except (TypeError, KeyError, AttributeError) as e:  # AttributeError: an entry that is not an object
        raise ModelDirError(f"{path}: malformed manifest ({e}); {fix}") from e
    _check_paths(model_dir, m, fix)
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


# ONNX Runtime's errors for a graph file it cannot load (a damaged protobuf; external data missing, short, or outside
# the graph's directory); not those of a provider that fails to start
ORT_LOAD_FAILURES = ("Fail", "InvalidArgument", "InvalidGraph", "InvalidProtobuf", "NoModel", "NoSuchFile")


def open_graph(path: str, m: Manifest, g: GraphEntry, options, providers):
    """ONNX Runtime's session over graph `g`'s file (at `path`). A file it cannot load, or whose K/V inputs and logits
    disagree with the manifest, is a ModelDirError naming the file and the re-export command, raised before the
    runtime sizes a KV cache from the manifest's numbers."""
    import onnxruntime as ort

    parts = len(Path(g.file).parts)
    model_dir = Path(path).parents[parts - 1] if 0 < parts <= len(Path(path).parents) else Path(path).parent
    fix = f"re-run edge-export: {reexport_command(model_dir, _source_path(m.source))}"
    try:
        sess = ort.InferenceSession(path, options, providers=list(providers))
    except Exception as e:
        if not (type(e).__module__.startswith("onnxruntime") and type(e).__name__ in ORT_LOAD_FAILURES):
            raise
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        why = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", why).replace(f"Load model from {path} failed:", "")
        raise ModelDirError(f"{path}: ONNX Runtime cannot load this graph ({why.strip()[:200]}); the file is damaged "
                            f"or was written for another ONNX Runtime — {fix}") from e
    i = next((j for j, x in enumerate(m.graphs) if x.name == g.name), None)
    n = f"graphs[{i}]" if i is not None else f"graph {g.name!r}"
    shape = f"{n}.arch" if g.arch else "arch"
    a = m.arch_of(g)
    keys = [x for x in sess.get_inputs() if re.fullmatch(r"past_key_values\.\d+\.key", x.name)]
    dims = keys[0].shape if keys and len(keys[0].shape) == 4 else [None] * 4
    logits = next((x.shape for x in sess.get_outputs() if x.name == "logits"), None) or [None]
    for what, got, field_name, want in (("layers", len(keys) or None, f"{n}.layers", g.layers),
                                        ("KV heads", dims[1], f"{shape}.kv_heads", a["kv_heads"]),
                                        ("KV head size", dims[3], f"{shape}.head_dim", a["head_dim"]),
                                        ("logits", logits[-1], f"{n}.vocab", g.vocab)):
        if isinstance(got, int) and got > 0 and got != want:  # (a dimension the graph leaves symbolic is not checked)
            raise ModelDirError(f"{path}: the graph has {got} {what} but the manifest's {field_name} says {want}; the "
                                f"manifest does not describe this graph — {fix}")
    cache_type = {"float32": "tensor(float)", "float16": "tensor(float16)", "int8": "tensor(int8)"}.get(g.kv_dtype)
    if keys and cache_type and keys[0].type != cache_type:
        raise ModelDirError(f"{path}: the graph's KV cache is {keys[0].type} but the manifest's {n}.kv_dtype says "
                            f"{g.kv_dtype}; the manifest does not describe this graph — {fix}")
    return sess
