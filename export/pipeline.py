"""checkpoint → model directory: target graph, trimmed (and self-distilled) early-exit drafters, tokenizer, parity
report, manifest.

Atomic by construction: everything is written into `<out>.partial/`, the manifest last, and the directory is renamed
into place only when complete. An interrupted export leaves at most a `.partial` directory, which never loads and is
cleared by the next run. One export at a time writes an OUT: `export_lock` (an advisory lock on `.<out>.edge-export.lock`).
"""
from __future__ import annotations

import contextlib
import errno
import math
import os
import platform
import shutil
import stat
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from edge.manifest import (MANIFEST_NAME, OLD_MARKER, PARTIAL_MARKER, FileEntry, GraphEntry, Manifest, format_for,
                           sha256_file)
from edge.text import TextCodec
from memory.footprint import HEAD_RESCORE
from memory.planner import FREE_CHAIN_ACCEPTANCE

from . import calibration, distill, kvquant, reference, smooth
from .checkpoint import Checkpoint, load_checkpoint
from .provenance import VERIFY_SIZES, converter_versions, source_digest
from .evaluate import GraphRunner, parity, rank_vocabulary, reference_top
from .graph import (GRAPH_VERSION, KV_CACHES, PRECISIONS, GraphOptions, build_graph, host_w8a8_kernel,
                    reuse_quantization, save_model)
from .tokenizer import write_tokenizer

# "auto": the candidates (AUTO_PRECISIONS) are built and measured on this host, and the fastest whose top-1 agreement
# with the source reaches FIDELITY_FLOOR is kept (docs/design-decisions.md has the figures behind it)
DEFAULT_PRECISION = "auto"
# "auto": an int8 cache under quantized weights (int4, int8, w8a8), the graph's float type under fp32/fp16 ones
DEFAULT_KV_CACHE = "auto"
PAD_ROWS = ("auto", "on", "off")
# Early-exit layers, trimmed vocabulary: the best expected chain speedup of N ∈ {2,4,6,8} × K ∈ {2k,8k,16k,full}
# on the 2-core dev VM (distilled top-1 agreement ≈ 0.13 for every N ≤ 4, so the cheapest call wins; (2, 8192) is
# within noise). Even this one stays below plain decoding for chains (≈ 0.96×): the engine's auto mode prefers
# lookup/recycling drafts, and the drafter is shipped for `--drafter model` and tree experiments.
DEFAULT_DRAFTER = (2, 2048)
# Models whose LM head holds at least as many weights as all their layers (a large vocabulary on a small body: Gemma 3
# 270M's 262,144 × 640 head against 100M body weights) spend most of each step in the head; their drafter keeps
# every layer and only this many of the most likely tokens in its head. Measured there (int8, 384 held-out
# positions): 16,384 tokens agree with the target on 0.971 of them at 6.2 ms per call, 32,768 on 0.997 at 6.9 ms,
# against 13.3 ms for the target
HEAD_DRAFTER_VOCAB = 32768


def default_drafters(c) -> tuple[tuple[int, int], ...]:
    """The drafter the exporter builds when none is asked for: an early exit (DEFAULT_DRAFTER) where the layers
    dominate a step's cost, the whole body with a trimmed head (HEAD_DRAFTER_VOCAB) where the LM head does."""
    q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
    body = c.layers * (c.hidden * (2 * q + 2 * kv) + 3 * c.hidden * c.intermediate)
    if c.vocab * c.hidden >= body and c.vocab > HEAD_DRAFTER_VOCAB:
        return ((c.layers, HEAD_DRAFTER_VOCAB),)
    return (DEFAULT_DRAFTER,)


# ... at 128 cached tokens and again at this many (each row reads the whole cache: the planner interpolates between
# the two and extends beyond at their slope, so a long chat is not priced like a short one without edge-profile)
VERIFY_LONG_CONTEXT = 1024


@dataclass(frozen=True)
class ExportOptions:
    precision: str = DEFAULT_PRECISION
    block_size: int = 32
    accuracy_level: int = 4
    lm_head_bits: int | None = None
    head_rescore: int = HEAD_RESCORE  # the two-stage head's candidates per row (0: one head at lm_head_bits)
    block_min: bool = True  # 4-bit layers keep their blocks' float minimums (export.quant.quantize_block_min)
    smooth: bool = True  # w8a8: even out the target's (and its early-exit drafters') linear inputs (export/smooth.py);
    # a separate --drafter-checkpoint is not smoothed
    max_len: int = 8192  # KV capacity (capped by the model's own max positions)
    # (layers, vocab); vocab 0 = full. None: the exporter picks for the model (`default_drafters`)
    drafters: tuple[tuple[int, int], ...] | None = None
    # separate small checkpoints (HF dir or .gguf) sharing the target's tokenizer, each exported whole with its LM
    # head trimmed to the target's most frequent tokens: (path, vocab); vocab 0 = full
    drafter_checkpoints: tuple[tuple[str, int], ...] = ()
    calib_new_tokens: int = 64
    distill: bool = True  # fit each early-exit drafter's residual-stream correction on the calibration text
    parity: bool = True
    threads: int = 2
    name: str | None = None
    extra: dict = field(default_factory=dict)
    # w8a8 weight layout (export/graph.py GraphOptions.w8a8_kernel); None: what is exact on this host, u8s8 where its
    # int8 GEMM does not saturate (VNNI), else u8u8. Resolved here so the manifest records, and a cached default
    # export is compared on, the layout actually written
    w8a8_kernel: str | None = None
    # the target's (and its early-exit drafters') KV cache: "int8" codes with static per-channel scales fitted on the
    # calibration prompts (export/kvquant.py; a quarter of float32's bytes), "float32", or "auto" (int8 under
    # quantized weights)
    kv_cache: str = DEFAULT_KV_CACHE
    # the attention pad query row (export/graph.py): "auto" keeps it only where this host's single-query attention
    # path computes a lone row differently from wider calls (probed on the graph at export); "on" / "off" force it
    pad_row: str = "auto"

    def __post_init__(self):
        if self.pad_row not in PAD_ROWS:
            raise ValueError(f"pad_row {self.pad_row!r}: choose one of {', '.join(PAD_ROWS)}")
        if self.precision not in ("auto",) + PRECISIONS:
            raise ValueError(f"precision {self.precision!r}: choose one of auto, {', '.join(PRECISIONS)}")
        if self.kv_cache not in ("auto",) + KV_CACHES:
            raise ValueError(f"kv_cache {self.kv_cache!r}: choose one of auto, {', '.join(KV_CACHES)}")
        # refused before any work: a negative drafter vocabulary or no calibration text writes a broken model
        for field_name in ("max_len", "calib_new_tokens", "threads"):
            if getattr(self, field_name) < 1:
                raise ValueError(f"{field_name}={getattr(self, field_name)}: must be at least 1")
        bad = [d for d in self.drafters or () if d[0] < 1 or d[1] < 0] + \
            [d for d in self.drafter_checkpoints if d[1] < 0]
        if bad:
            raise ValueError(f"drafter {bad[0]}: layers must be at least 1 and vocab at least 0 (0 = full vocabulary)")
        if self.w8a8_kernel is None and self.precision == "w8a8":
            object.__setattr__(self, "w8a8_kernel", host_w8a8_kernel())

    def recorded(self) -> dict:
        """The options as the manifest records them (JSON lists; the checkpoint list only when there is one, so
        exports from before it existed still compare equal)."""
        d = {**asdict(self), "drafters": "auto" if self.drafters is None else [list(x) for x in self.drafters],
             "drafter_checkpoints": [[str(p), k] for p, k in self.drafter_checkpoints]}
        if not self.drafter_checkpoints:
            del d["drafter_checkpoints"]
        if self.w8a8_kernel is None:  # not w8a8
            del d["w8a8_kernel"]
        if self.kv_cache == "float32":  # exports from before the option compare equal
            del d["kv_cache"]
        if self.pad_row == "auto" or self.precision == "auto":  # decided by measuring this host: another may differ
            d["host"] = host_signature()
        return d

    @property
    def resolved_kv_cache(self) -> str:
        if self.precision == "fp16" or (self.kv_cache == "auto" and self.precision in ("fp32", "fp16")):
            return "float32"  # (an fp16 graph's float cache is fp16)
        return "int8" if self.kv_cache == "auto" else self.kv_cache

    def graph_options(self, max_len: int, layers: int | None = None) -> GraphOptions:
        return GraphOptions(precision=self.precision, block_size=self.block_size, accuracy_level=self.accuracy_level,
                            lm_head_bits=self.lm_head_bits, head_rescore=self.head_rescore, block_min=self.block_min,
                            layers=layers, max_len=max_len,
                            w8a8_kernel=self.w8a8_kernel,
                            kv_cache=self.resolved_kv_cache,
                            pad_query=self.pad_row != "off")


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # replaced by an object without it, or closed
        return False


class _Steps:
    """One progress bar over the export's named steps (tqdm when available, wanted and stderr is a terminal), else
    one plain line per step: a bar's carriage-return frames would fill a redirected log."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.finished = total, 0
        self.bar = None
        if enabled and _is_terminal(sys.stderr):
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc="export", unit="step", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                pass
        self.enabled = enabled

    def start(self, what: str):
        if self.bar is not None:
            self.bar.set_description(what)
        elif self.enabled:
            print(f"[export] {what} …", file=sys.stderr, flush=True)

    def done(self):
        self.finished += 1
        if self.bar is not None:
            self.bar.update(1)

    def drop(self, n: int):
        """`n` counted steps turned out not to be needed (a drafter graph that another one already is); a negative
        `n` adds steps that turned out to be needed (the fallback precision)."""
        self.total -= n
        if self.bar is not None:
            self.bar.total = self.total
            self.bar.refresh()

    def close(self, failed: bool = False):
        if self.bar is not None:
            if failed:
                self.bar.leave = False  # an error message should stand alone, not under a half bar
            self.bar.close()


def _generated(prompt_len: int, text_len: int) -> np.ndarray:
    """bool [text_len]: the positions whose next token the target generated (prompt_len-1 … text_len-2)."""
    m = np.zeros(text_len, bool)
    m[prompt_len - 1 : text_len - 1] = True
    return m


def _agreement(path: Path, layers: int, c, threads: int, ids_kept: np.ndarray, held: list) -> float:
    """Drafter top-1 == target top-1 over the scored held-out positions; held: (text, target top-1 [S], scored [S])."""
    dr = GraphRunner(str(path), layers, c.kv_heads, c.head_dim, threads)
    # a target id beyond the drafter's embedding rows (a padding row) is read as id 0, as at runtime
    agree = np.concatenate([(ids_kept[dr.logits(np.where(np.asarray(t) < c.vocab, t, 0)).argmax(-1)] == tgt)[m]
                            for t, tgt, m in held])
    return round(float(agree.mean()), 4) if agree.size else 0.0


def _distill_data(target: Path, c, layers: list[int], texts: list[tuple[list[int], list[int]]], threads: int) -> dict:
    """Residual streams of the exported target on (prompt, continuation) pairs, for `distill.fit_adapter`:
    hidden {n: [[S, H] per text]} for each drafter depth and n = c.layers, teacher [[S]] top-1, scored [[S]]."""
    probe = distill.HiddenProbe(target, c.layers, c.kv_heads, c.head_dim, tuple(layers), threads)
    out = {"hidden": {n: [] for n in probe.capture}, "teacher": [], "scored": []}
    for ids, gen in texts:
        hidden, top = probe(ids + gen)
        for n, h in hidden.items():
            out["hidden"][n].append(h)
        out["teacher"].append(top)
        out["scored"].append(_generated(len(ids), len(ids) + len(gen)))
    return out


def _drafter_latency_ms(path: Path, layers: int, c, threads: int, max_len: int) -> float:
    """One drafter call of one row with up to 128 cached tokens, as the manifest's latency_ms_s1 records it."""
    dr = GraphRunner(str(path), layers, c.kv_heads, c.head_dim, threads)
    return round(dr.latency_ms(1, past=min(128, max_len - 1)), 3)


def _check_head_dim(c, what: str, instead: str) -> None:
    """ONNX Runtime's CPU GroupQueryAttention (our graph's attention) runs head dims that are multiples of 16 only;
    say so before the long steps instead of failing in the first call after them."""
    if c.head_dim % 16:
        raise ValueError(f"{what}: head dim {c.head_dim} is not a multiple of 16, which ONNX Runtime's "
                         f"GroupQueryAttention needs; {instead}")


def _check_drafter_checkpoint(path: Path, dck: Checkpoint, target_tokenizer: Path, max_len: int) -> None:
    """A separate drafter must share the target's tokenizer (same token → id map: a drafted id means the same text
    to both), embed every token of it, run in our graph and cover the export's context."""
    import tempfile
    from tokenizers import Tokenizer

    _check_head_dim(dck.config, f"drafter checkpoint {path}", "choose another drafter")
    vocab = Tokenizer.from_file(str(target_tokenizer)).get_vocab(with_added_tokens=True)
    if dck.config.vocab < len(vocab):
        raise ValueError(f"drafter checkpoint {path}: {dck.config.vocab} embedding rows but the tokenizer has "
                         f"{len(vocab)} tokens; it cannot read every token the target writes")

    with tempfile.TemporaryDirectory() as tmp:
        write_tokenizer(dck, Path(tmp))
        if Tokenizer.from_file(str(Path(tmp) / "tokenizer.json")).get_vocab(with_added_tokens=True) != vocab:
            raise ValueError(f"drafter checkpoint {path}: its tokenizer differs from the target's (another token → "
                             "id map), so its drafts would mean other text; give a drafter of the same model family")
    if dck.config.max_positions < max_len:
        raise ValueError(f"drafter checkpoint {path}: {dck.config.max_positions} positions, but the target is "
                         f"exported for {max_len}; export with --max-len {dck.config.max_positions} or less")


def _checkpoint_drafter(path: Path, dck: Checkpoint, k: int, part: Path, opts: ExportOptions, c, ranked: np.ndarray,
                        max_len: int, target_ms: float, target: GraphEntry, held: list, steps: "_Steps") -> GraphEntry:
    """A separate small checkpoint as a drafter (checked by `_check_drafter_checkpoint`): all its layers, the
    target's precision, its LM head trimmed to the target's k most frequent tokens; its own shape goes into the
    manifest entry (`GraphEntry.arch`)."""
    steps.start(f"drafter checkpoint {path.name}")
    dc = dck.config
    usable = min(dc.vocab, c.vocab)  # embedding rows beyond the tokenizer's tokens are padding in one of them
    ids = ranked[ranked < usable] if k else np.arange(usable)
    ids_kept = np.sort(ids[: k or usable]).astype(np.int64)
    src = Path(dck.source)  # a directory holding one .gguf loads as that file
    stem = "".join(ch if ch.isalnum() else "-" for ch in (src.stem if src.is_file() else src.name).lower())
    name = base = f"draft-{stem.strip('-') or 'model'}-v{len(ids_kept)}"
    n = 1
    while (part / name).exists():  # two checkpoints with one name (ck/model.gguf, ck2/model.gguf)
        n += 1
        name = f"{base}-{n}"
    (part / name).mkdir()
    np.save(part / name / "id_map.npy", ids_kept)
    graph = part / name / "model.onnx"
    head_ids = ids_kept if len(ids_kept) < dc.vocab else None
    gopts = opts.graph_options(max_len)
    save_model(build_graph(dck, gopts, head_ids), str(graph))
    steps.done()
    steps.start(f"drafter checkpoint {path.name}: agreement")
    agree = _agreement(graph, dc.layers, dc, opts.threads, ids_kept, held)
    ms = _drafter_latency_ms(graph, dc.layers, dc, opts.threads, max_len)
    steps.done()
    scored = int(sum(np.asarray(tgt)[m].size for _, tgt, m in held))
    stats = {"top1_agreement": agree, "top1_agreement_raw": agree, "held_out_positions": scored,
             "latency_ms_s1": ms, "latency_vs_target": round(ms / target_ms, 3),
             "checkpoint": {"path": str(src.resolve()), "sha256": source_digest(src)}}
    return GraphEntry(role="drafter", name=name, file=f"{name}/model.onnx", layers=dc.layers, vocab=len(ids_kept),
                      precision=opts.precision, block_size=opts.block_size, accuracy_level=target.accuracy_level,
                      lm_head_bits=target.lm_head_bits, w8a8_kernel=gopts.w8a8_kernel,
                      block_min=gopts.uses_block_min(dc.hidden, dc.heads * dc.head_dim, dc.intermediate),
                      embedding_bits=gopts.embedding_bits(dc.hidden),
                      max_len=max_len, id_map=f"{name}/id_map.npy", arch=dc.to_dict(),
                      stats=stats)


def lock_path(out_dir: Path) -> Path:
    """`export_lock`'s file: hidden beside OUT, with a name no other tool uses (a `uv.lock` or `poetry.lock` beside
    an OUT named `uv` must never be touched)."""
    return out_dir.with_name(f".{out_dir.name}.edge-export.lock")


@contextlib.contextmanager
def export_lock(out_dir: str | os.PathLike, wait: bool = False, notify=None):
    """Hold the right to write OUT (and its `.partial`/`.old`): an advisory `flock` on `lock_path(OUT)`, released
    when the process ends however it ends, so a crash never leaves it held. Another holder → ValueError, or with
    `wait` block until it is done (`notify(message)` first). The file is removed while still held; a waiter that
    then holds the removed file's lock notices (another file at the path) and locks again. Without `fcntl`
    (Windows), or on a file system that cannot lock, there is no lock."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    out_dir = Path(os.path.abspath(out_dir))
    lock = lock_path(out_dir)
    if lock.parent.exists() and not lock.parent.is_dir():
        raise ValueError(f"{lock.parent} is not a directory")
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create {lock.parent} ({e.strerror or e})") from None
    while True:
        try:  # never through a symlink, never anything but a regular file
            fd = os.open(lock, os.O_RDONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except OSError as e:
            if not os.path.lexists(lock):  # nothing there to delete: the directory refuses new files
                raise ValueError(f"cannot write in {lock.parent}, the output directory's parent ({e.strerror or e}); "
                                 "choose an output directory in a writable location") from None
            raise ValueError(f"cannot open the export lock {lock} ({e.strerror or e}); if no edge-export is running, "
                             "delete it") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError(f"{lock} is not edge-export's lock file; remove it")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not wait:
                    raise ValueError(f"another edge-export is writing {out_dir} (it holds {lock}); wait for it to "
                                     "finish, or choose another -o") from None
                if notify:
                    notify(f"another edge-export is writing {out_dir}; waiting for it to finish")
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as e:
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP):
                    raise
                os.close(fd)  # this file system cannot lock: go on without
                fd = None
                break
            held = os.fstat(fd)
            try:
                now = os.stat(lock, follow_symlinks=False)
                if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                    break
            except FileNotFoundError:
                pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # we locked a file its holder removed on release: lock the one at the path now
    if fd is None:
        yield
        return
    try:
        yield
    finally:
        try:
            lock.unlink(missing_ok=True)
        finally:
            os.close(fd)  # even if an interrupt lands in the unlink: the lock must not outlive this block


def export_model(source: str | os.PathLike, out_dir: str | os.PathLike, opts: ExportOptions = ExportOptions(),
                 progress: bool = True, checkpoint: Checkpoint | None = None, via: str = "builder",
                 cache_dir: bool = False, lock: bool = True) -> Manifest:
    """via: "builder" (our own graph, export/graph.py) or "optimum" (export/via_optimum.py: other architectures).
    Everything is written into `<out>.partial/` and swapped into place only when complete. `cache_dir`: OUT is
    edgespec's own cache (the embedded default), replaced even when a damaged export there lost its manifest.
    `lock`: take `export_lock` (refused if another export holds it); False when the caller holds it already."""
    with export_lock(out_dir) if lock else contextlib.nullcontext():
        return _export_locked(source, out_dir, opts, progress, checkpoint, via, cache_dir)


def _export_locked(source, out_dir, opts: ExportOptions, progress: bool, checkpoint: Checkpoint | None, via: str,
                   cache_dir: bool) -> Manifest:
    out_dir = Path(os.path.abspath(out_dir))  # "." has no name to derive <out>.partial from
    part = out_dir.with_name(out_dir.name + ".partial")
    check_output_dir(source, out_dir, cache_dir)
    if part.exists():
        _remove_ours(part, PARTIAL_MARKER)  # an earlier interrupted export (check_output_dir saw its marker)
    part.mkdir(parents=True)
    (part / PARTIAL_MARKER).touch()
    if via == "optimum":
        from .via_optimum import export_via_optimum

        steps = _Steps(6, progress)
        build = lambda: export_via_optimum(source, part, opts, steps)  # noqa: E731
    else:
        drafters = 1 if opts.drafters is None else len(opts.drafters)  # the exporter picks one
        distilling = opts.distill and bool(drafters)
        candidates = len(AUTO_PRECISIONS) if opts.precision == "auto" else 1
        steps = _Steps(4 + candidates + (3 if distilling else 2) * drafters + distilling
                       + 2 * len(opts.drafter_checkpoints), progress)
        build = lambda: _build(source, part, opts, steps, checkpoint)  # noqa: E731
    try:
        m = build()
    except BaseException:
        steps.close(failed=True)
        _remove_ours(part, PARTIAL_MARKER, ignore_errors=True)
        raise
    steps.close()
    drop_from_page_cache(part)
    _swap_into_place(part, out_dir)
    return m


PAGE_CACHE_MIN_BYTES = 1 << 20  # files smaller than this (manifest, tokenizer, protobufs) are left cached


def drop_from_page_cache(directory: Path) -> int:
    """Write the export's large files to disk and drop them from the OS page cache → bytes dropped. Pages an export
    has just written sit in the page cache as large folios (ext4 on Linux 6.x), and a later memory-mapped read of
    one row maps the whole folio: on Gemma 3 270M a request mapped 40-90 MB of the model file instead of 10-30 MB
    (the runtime gives those pages back after each request, but not during it). Read back from disk later, the
    pages come in small. Linux only (posix_fadvise); never raises."""
    if not hasattr(os, "posix_fadvise"):
        return 0
    dropped = 0
    for path in sorted(Path(directory).rglob("*")):
        try:
            size = path.stat().st_size if path.is_file() else 0
            if size < PAGE_CACHE_MIN_BYTES:
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)  # only clean pages can be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                dropped += size
            finally:
                os.close(fd)
        except OSError:
            continue
    return dropped


def _smoothing(opts: ExportOptions) -> bool:
    """Is the target smoothed before quantization? (w8a8's per-row activation scales are what it helps)"""
    return opts.smooth and opts.precision == "w8a8"


def _build(source, part: Path, opts: ExportOptions, steps: _Steps, checkpoint: Checkpoint | None) -> Manifest:
    """The builder path: checkpoint → graphs, drafters, tokenizer, parity, manifest, all inside `part`."""
    with reuse_quantization():
        return _build_graphs(source, part, opts, steps, checkpoint)


def _build_graphs(source, part: Path, opts: ExportOptions, steps: _Steps, checkpoint: Checkpoint | None) -> Manifest:
    t0 = time.time()
    steps.start("loading checkpoint")
    ck = checkpoint or load_checkpoint(source)
    c = ck.config
    requested = opts
    if opts.drafters is None:
        opts = replace(opts, drafters=default_drafters(c))
    # an adapter corrects an early exit toward the last layer: a drafter with every layer has nothing to correct
    distilling = opts.distill and any(n < c.layers for n, _ in opts.drafters)
    if opts.distill and not distilling and opts.drafters:
        steps.drop(1 + len(opts.drafters))  # the data step and each drafter's fit
    max_len = min(opts.max_len, c.max_positions)
    bad = [n for n, _ in opts.drafters if not 1 <= n <= c.layers]
    if bad:  # before the long steps (and the distillation probe, which reads layer n's output)
        raise ValueError(f"drafter layers={bad[0]}: the model has {c.layers}")
    kept = [(n, min(k or c.vocab, c.vocab)) for n, k in opts.drafters]  # a vocab >= the model's keeps it whole
    twice = next((d for i, d in enumerate(kept) if d in kept[:i]), None)
    if twice:
        whole = f" (0 and every size of {c.vocab} or more keep the whole vocabulary)" if twice[1] == c.vocab else ""
        raise ValueError(f"drafter layers={twice[0]}, vocab={twice[1]} asked for twice{whole}; give each size once")
    _check_head_dim(c, str(source), "--via optimum exports it")
    separate = {p: load_checkpoint(p) for p, _ in opts.drafter_checkpoints}  # each once, whatever its vocab sizes
    steps.done()

    steps.start("tokenizer")
    tf = write_tokenizer(ck, part)
    codec = TextCodec(part / "tokenizer.json", tf.chat_template, tf.bos, tf.eos)
    for p, dck in separate.items():  # refused before the long steps, like bad layer counts
        _check_drafter_checkpoint(Path(p), dck, part / "tokenizer.json", min(opts.max_len, c.max_positions))
    steps.done()

    prompts = [calibration.encode(codec, p, tf.chat_template is not None) for p in calibration.PROMPTS]
    room = max_len - opts.calib_new_tokens  # calibration prompt + continuation must fit the graph's context
    if room < 16:
        cap = (f"--max-len {max_len}" if opts.max_len < c.max_positions else
               f"the model's context of {max_len} positions (its max_position_embeddings, or its sliding window, "
               "beyond which the export would not be exact)")
        fix = " or ".join(([f"--calib-tokens {max_len - 16} or fewer"] if max_len > 16 else [])
                          + ([f"a larger --max-len (up to the model's {c.max_positions})"]
                             if opts.max_len < c.max_positions else [])) or "a model with a longer context"
        raise ValueError(f"{cap} leaves no room for calibration ({opts.calib_new_tokens} new tokens per prompt "
                         f"need {opts.calib_new_tokens + 16} positions); use {fix}")
    prompts = [p[-room:] for p in prompts]
    calib, held = prompts[: -calibration.HELD_OUT], prompts[-calibration.HELD_OUT :]

    # parity: the held-out prompts and the longer held-out texts, against the reference's best tokens
    checked = held + [calibration.encode(codec, t, tf.chat_template is not None)[-room:]
                      for t in calibration.PARITY_TEXTS]
    ref = ([reference_top(reference.forward(ck, ids)) for ids in checked]
           if opts.parity or opts.precision == "auto" else [])
    candidates = [_target_candidate(ck, replace(opts, precision=p, w8a8_kernel=opts.w8a8_kernel
                                                if p == opts.precision else None), part, max_len, calib, checked,
                                    ref, steps)
                  for p in (AUTO_PRECISIONS if opts.precision == "auto" else (opts.precision,))]
    if opts.precision == "auto" and not any(t.faithful for t in candidates):
        # neither fast precision is faithful to this model (Gemma 3: int4 re-quantizes its 5- and 6-bit GGUF
        # blocks, w8a8's per-row activation scales meet its activation outliers): 8-bit blocks with per-block
        # activation scales, at the cost of twice int4's weight bytes
        steps.drop(-1)
        candidates.append(_target_candidate(ck, replace(opts, precision=FALLBACK_PRECISION, w8a8_kernel=None),
                                            part, max_len, calib, checked, ref, steps))
    chosen = choose_target(candidates)
    # the decision and its evidence, host named: a cached default export is rebuilt where another host decides
    choice = {"host": host_signature(), "precision": chosen.opts.precision, "pad_row": chosen.graph_opts.pad_query,
              "kv_cache": chosen.graph_opts.kv_cache, "fidelity_floor": FIDELITY_FLOOR,
              "candidates": [t.summary() for t in candidates]}
    for t in candidates:
        if t is not chosen:
            shutil.rmtree(t.dir)
    chosen.dir.rename(part / "target")
    target_file = "target/model.onnx"
    ck, opts, target_opts = chosen.ck, chosen.opts, chosen.graph_opts
    kv_scales, smoothing = chosen.kv_scales, chosen.smoothing
    del candidates
    sess = _session(part / target_file, c, target_opts, max_len, opts.threads, capacity=max_len)
    report = dict(chosen.parity) if requested.parity else {}

    steps.start("calibration text (target greedy)")
    stop = tf.eos
    produced = []
    mass = np.zeros(c.vocab, np.float64)  # the target's next-token probabilities, summed over the calibration text
    for ids in calib:
        gen, logits = _greedy(sess, ids, opts.calib_new_tokens, stop)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        mass += (p / p.sum(-1, keepdims=True)).sum(0)
        produced.append((list(logits[: len(ids)].argmax(-1)), gen, ids))  # the predictions over the prompt
    # held-out text: prompt + the target's own continuation, and the target's predictions over it. Agreement is
    # scored where the target generated (the positions a drafter proposes for), not over the system prompt every
    # chat shares.
    held_text, held_target, held_scored = [], [], []
    for ids in held:
        gen, logits = _greedy(sess, ids, opts.calib_new_tokens, stop)
        last = sess.forward([gen[-1]])  # the row after the last token, which the greedy run did not feed
        held_text.append(ids + gen)
        held_target.append(np.concatenate([logits, last]).argmax(-1))
        held_scored.append(_generated(len(ids), len(ids) + len(gen)))
    del sess
    steps.done()
    # vocabulary ranking: what the target produces (its own continuations + its next-token predictions), then,
    # among the many ids a few thousand tokens never show, the probability the target gave them
    ranked = rank_vocabulary([p[0] + p[1] for p in produced], c.vocab,
                             always=tuple(tf.eos) + ((tf.bos,) if tf.bos is not None else ()), mass=mass)
    past = min(128, max_len - VERIFY_SIZES)  # a short --max-len still leaves room for the probe
    runner = GraphRunner(str(part / target_file), c.layers, c.kv_heads, c.head_dim, opts.threads)
    target_ms = [runner.latency_ms(s, past=past, reps=20 if s == 1 else 10) for s in range(1, VERIFY_SIZES + 1)]
    del runner

    fit_data = None
    if distilling:
        steps.start("distillation data (target hidden states)")
        t = time.perf_counter()
        fit_data = _distill_data(part / target_file, c, sorted({n for n, _ in opts.drafters if n < c.layers}),
                                 [(ids, gen) for _, gen, ids in produced], opts.threads)
        fit_data["seconds"] = time.perf_counter() - t
        steps.done()

    graphs = [GraphEntry(role="target", name="target", file=target_file, layers=c.layers, vocab=c.vocab,
                         precision=opts.precision, block_size=opts.block_size,
                         accuracy_level=opts.accuracy_level if opts.precision in ("int4", "int8") else 0,
                         lm_head_bits=target_opts.head_bits or 0, w8a8_kernel=target_opts.w8a8_kernel,
                         block_min=target_opts.uses_block_min(c.hidden, c.heads * c.head_dim, c.intermediate),
                         embedding_bits=target_opts.embedding_bits(c.hidden), max_len=max_len,
                         head_rescore=target_opts.head_rescore
                         if target_opts.rescores(c.tie_embeddings, c.hidden, c.vocab) else 0,
                         kv_dtype=target_opts.kv_cache,
                         stats={"latency_ms_s1": round(target_ms[0], 3),
                                "latency_ms_by_s": [round(t, 3) for t in target_ms],
                                **({"smoothing": smoothing} if smoothing else {})})]
    for layers, k in opts.drafters:
        k = min(k or c.vocab, c.vocab)
        name = f"drafter-l{layers}-v{k}"
        steps.start(f"drafter {name}")
        (part / name).mkdir()
        ids_kept = np.sort(ranked[:k]).astype(np.int64)
        np.save(part / name / "id_map.npy", ids_kept)
        path = part / name / "model.onnx"
        gopts = replace(opts.graph_options(max_len, layers), pad_query=target_opts.pad_query)
        head_ids = ids_kept if k < c.vocab else None
        save_model(build_graph(ck, gopts, head_ids, kv_scales=kv_scales), str(path))
        steps.done()

        steps.start(f"drafter {name}: agreement")
        measure = dict(layers=layers, c=c, threads=opts.threads, ids_kept=ids_kept,
                       held=list(zip(held_text, held_target, held_scored)))
        raw = _agreement(path, **measure)
        covered = np.concatenate([np.isin(t[m], ids_kept) for t, m in zip(held_target, held_scored)])
        stats = {"top1_agreement": raw, "top1_agreement_raw": raw,
                 "vocab_coverage": round(float(covered.mean()), 4), "held_out_positions": int(covered.size)}
        steps.done()

        if fit_data is not None and layers == c.layers:
            steps.drop(1)
        elif fit_data is not None:
            steps.start(f"drafter {name}: distillation")
            t = time.perf_counter()
            fit = distill.fit_adapter(fit_data["hidden"][layers], fit_data["hidden"][c.layers], fit_data["teacher"],
                                      fit_data["scored"], ck.lm_head[ids_kept], ck.weights["model.norm.weight"],
                                      c.rms_eps, ids_kept)
            if fit.adapter is not None:
                _remove_graph(path)
                save_model(build_graph(ck, gopts, head_ids, adapter=fit.adapter, kv_scales=kv_scales), str(path))
                stats["top1_agreement"] = _agreement(path, **measure)
            stats["distill"] = {**fit.stats(), "seconds": round(time.perf_counter() - t, 2),
                                "data_seconds": round(fit_data["seconds"], 2)}
            steps.done()
        stats["latency_ms_s1"] = _drafter_latency_ms(path, layers, c, opts.threads, max_len)
        stats["latency_vs_target"] = round(stats["latency_ms_s1"] / target_ms[0], 3)
        graphs.append(GraphEntry(role="drafter", name=name, file=f"{name}/model.onnx", layers=layers, vocab=k,
                                 precision=opts.precision, block_size=opts.block_size,
                                 accuracy_level=graphs[0].accuracy_level, lm_head_bits=graphs[0].lm_head_bits,
                                 w8a8_kernel=graphs[0].w8a8_kernel,
                                 block_min=graphs[0].block_min, embedding_bits=graphs[0].embedding_bits,
                                 max_len=max_len, kv_dtype=gopts.kv_cache, id_map=f"{name}/id_map.npy",
                                 stats=stats))

    built = set()
    for path, k in opts.drafter_checkpoints:
        usable = min(separate[path].config.vocab, c.vocab)
        key = (str(Path(separate[path].source).resolve()), min(k or usable, usable))
        if key in built:  # the same checkpoint at the same effective vocabulary (e.g. --drafter-vocab 0 and its size)
            steps.drop(2)  # its export and its measurement
            continue
        built.add(key)
        graphs.append(_checkpoint_drafter(Path(path), separate[path], k, part, opts, c, ranked, max_len,
                                          target_ms[0], graphs[0], list(zip(held_text, held_target, held_scored)),
                                          steps))

    steps.start("manifest")
    files = []
    for f in sorted(part.rglob("*")):
        if f.is_file() and f.name != PARTIAL_MARKER:
            rel = f.relative_to(part).as_posix()
            files.append(FileEntry(rel, f.stat().st_size, sha256_file(f)))
    sizes = {f.path: f.bytes for f in files}
    # fp16 graphs keep an fp16 KV cache (what the runtime allocates and the footprint model counts)
    graphs = [GraphEntry(**{**asdict(g), "weight_bytes": sizes[g.file] + sizes.get(g.file + ".data", 0),
                            "kv_dtype": "float16" if g.precision == "fp16" else g.kv_dtype})
              for g in graphs]
    report["export_seconds"] = round(time.time() - t0, 1)
    m = Manifest(
        format_version=format_for(graphs),
        name=opts.name or Path(ck.source).stem,
        arch=c.to_dict(),
        graphs=tuple(graphs),
        files=tuple(files),
        tokenizer="tokenizer.json",
        chat_template=tf.chat_template,
        special_tokens={"bos": tf.bos, "eos": list(tf.eos), "pad": tf.pad},
        source={"path": str(Path(ck.source).resolve()), "format": ck.source_format,
                "sha256": source_digest(ck.source), "options": requested.recorded(),
                "graph_version": GRAPH_VERSION},
        converter=converter_versions(),
        parity=report,
        choice=choice,
    )
    m = _time_contexts(m, part, past, opts.threads)
    m.write(part)
    steps.done()
    return m


# `--precision auto`: the candidates the exporter builds, measures and chooses between on the host it runs on
AUTO_PRECISIONS = ("int4", "w8a8")
FALLBACK_PRECISION = "int8"  # built too when no AUTO_PRECISIONS candidate reaches FIDELITY_FLOOR
FIDELITY_FLOOR = 0.93  # parity top-1 against the fp32 source a chosen precision must reach (if any candidate does)
# the chain acceptance per draft token that prices speculation when candidates are compared (hybrid's typical rate)
CHOICE_ACCEPTANCE = FREE_CHAIN_ACCEPTANCE
CHOICE_CONTEXTS = (128, VERIFY_LONG_CONTEXT)


def host_signature() -> str:
    """What decides the fastest exact kernels here: the CPU's model and vector features, and ONNX Runtime's version.
    A cached export whose recorded signature differs was chosen for another machine."""
    import onnxruntime as ort

    from devices import cpu_features

    return f"{platform.machine()} {cpu_features()} onnxruntime {ort.__version__}"


@dataclass
class _Target:
    """One candidate target graph, written to `dir`, with what was measured of it."""
    opts: ExportOptions
    graph_opts: GraphOptions
    dir: Path
    ck: Checkpoint
    kv_scales: np.ndarray | None
    smoothing: dict | None
    parity: dict
    latency_ms: dict  # context -> [ms for S = 1..VERIFY_SIZES]

    @property
    def tokens_per_s(self) -> float:
        """Expected greedy tokens/s: per context, the best of plain decoding and chains of k drafts accepted at
        CHOICE_ACCEPTANCE each (E[tokens] = (1 - a^(k+1)) / (1 - a) per verify call of k + 1 rows), averaged."""
        a = CHOICE_ACCEPTANCE
        per = [max((1 - a ** s) / (1 - a) * 1000 / ms for s, ms in enumerate(curve, 1))
               for curve in self.latency_ms.values()]
        return sum(per) / len(per)

    @property
    def fidelity(self) -> float:
        return self.parity.get("top1_agreement", 0.0)

    @property
    def faithful(self) -> bool:
        return reaches_floor(self.fidelity, self.parity.get("positions", 0))

    def summary(self) -> dict:
        return {"precision": self.opts.precision, "top1_agreement": self.fidelity,
                "positions": self.parity.get("positions", 0), "faithful": self.faithful,
                "max_abs_diff": self.parity.get("max_abs_diff"), "pad_row": self.graph_opts.pad_query,
                "expected_tokens_per_s": round(self.tokens_per_s, 1),
                "latency_ms_by_s_at": [[c, [round(x, 3) for x in v]] for c, v in self.latency_ms.items()]}


def reaches_floor(top1: float, positions: int) -> bool:
    """Is a parity top-1 agreement measured over `positions` at FIDELITY_FLOOR with one standard error to spare?
    A sample's agreement spreads by sqrt(p(1 - p) / n): ±0.01 over ~650 positions, enough to put a precision that
    agrees on 0.91 of longer text at 0.937 on the export's own sample (Gemma 3 270M's w8a8)."""
    if positions <= 0:
        return False
    return top1 - math.sqrt(top1 * (1 - top1) / positions) >= FIDELITY_FLOOR


def choose_target(candidates: list[_Target]) -> _Target:
    """The fastest candidate (expected tokens/s) among those at the fidelity floor (`reaches_floor`); if none
    reaches it, the most faithful one."""
    if len(candidates) == 1:
        return candidates[0]
    faithful = [t for t in candidates if t.faithful]
    if not faithful:
        return max(candidates, key=lambda t: t.fidelity)
    return max(faithful, key=lambda t: t.tokens_per_s)


def _target_candidate(ck: Checkpoint, opts: ExportOptions, part: Path, max_len: int, calib, checked, ref,
                      steps: _Steps) -> _Target:
    """Build one target graph at `opts.precision` into part/candidate-<precision>: smoothing (w8a8), the KV
    cache's scales (int8), the pad query row only where this host needs it (`--pad-row auto`), then its parity
    on the `checked` prompts against their reference `ref` and its call latency at CHOICE_CONTEXTS."""
    c = ck.config
    smoothing = None
    if _smoothing(opts):
        steps.start("smoothing activations (w8a8)")
        t = time.perf_counter()
        ck = smooth.smooth(ck, smooth.activation_maxima(ck, calib))
        smoothing = {"alpha": smooth.ALPHA, "prompts": len(calib), "seconds": round(time.perf_counter() - t, 2)}
    steps.start(f"target graph ({opts.precision})")
    d = part / f"candidate-{opts.precision}"
    d.mkdir()
    path = d / "model.onnx"
    gopts = opts.graph_options(max_len)
    kv_scales = None
    # graphs built only to be measured live in a scratch directory beside the export, never inside it
    with tempfile.TemporaryDirectory(prefix="edgespec-probe-") as scratch:
        probe = Path(scratch) / "model.onnx"
        if gopts.kv_cache == "int8":  # scales from the float-cache graph's own K/V (its head: one id, unread)
            save_model(build_graph(ck, replace(gopts, kv_cache="float32", pad_query=False, topk=0),
                                   vocab_ids=np.zeros(1, np.int64)), str(probe))
            kv_scales = kvquant.kv_scales(GraphRunner(str(probe), c.layers, c.kv_heads, c.head_dim, opts.threads),
                                          calib)
            _remove_graph(probe)
        pad = opts.pad_row != "off"
        if opts.pad_row == "auto":
            # without the row first: left out where a decode step, as the runtime runs it, computes what wider
            # calls do. Where the runtime pads decode steps to 2 rows anyway (a kernel outside attention, such as
            # MatMulNBits' on AVX2 without VNNI, computes a lone row another way), the row is kept only if it
            # makes a lone row exact: otherwise it would cost every call an attention row and buy nothing
            save_model(build_graph(ck, replace(gopts, pad_query=False), kv_scales=kv_scales), str(probe))
            exact, min_call = _decode_steps_exact(probe, c, gopts, max_len, opts.threads)
            pad = not exact
            if exact and min_call > 1:
                save_model(build_graph(ck, replace(gopts, pad_query=True), kv_scales=kv_scales), str(path))
                padded, padded_min_call = _decode_steps_exact(path, c, gopts, max_len, opts.threads)
                pad = padded and padded_min_call == 1
                if not pad:
                    _remove_graph(path)
            if not pad:
                for f in (probe, probe.with_name(probe.name + ".data")):
                    shutil.move(str(f), str(d / f.name))
    gopts = replace(gopts, pad_query=pad)
    if not path.exists():
        save_model(build_graph(ck, gopts, kv_scales=kv_scales), str(path))
    runner = GraphRunner(str(path), c.layers, c.kv_heads, c.head_dim, opts.threads)
    report = {}
    if ref:
        report = parity(ref, [runner.logits(ids) for ids in checked])
        report["prompts"] = len(ref)
    latency = {}
    for ctx in CHOICE_CONTEXTS:
        past = min(ctx, max_len - VERIFY_SIZES)
        latency[past] = [runner.latency_ms(s, past=past, reps=10) for s in range(1, VERIFY_SIZES + 1)]
    steps.done()
    return _Target(opts, gopts, d, ck, kv_scales, smoothing, report, latency)


def _session(path: Path, c, gopts: GraphOptions, max_len: int, threads: int, capacity: int):
    """The runtime's own session (edge.runner.GraphSession: IOBinding, the KV cache written in place) over a graph
    built with `gopts`, before the manifest that will describe it exists."""
    from edge.runner import GraphSession

    entry = GraphEntry(role="target", name="target", file=path.name, layers=c.layers, vocab=c.vocab,
                       precision=gopts.precision, w8a8_kernel=gopts.w8a8_kernel or "u8s8", max_len=max_len,
                       kv_dtype="float16" if gopts.precision == "fp16" else gopts.kv_cache,
                       accuracy_level=gopts.accuracy_level)
    probe = Manifest(format_version=1, name="probe", arch=c.to_dict(), graphs=(entry,), files=(), tokenizer="",
                     chat_template=None, special_tokens={}, source={}, converter={})
    return GraphSession(str(path), probe, entry, capacity=capacity, threads=threads)


def _decode_steps_exact(path: Path, c, gopts: GraphOptions, max_len: int, threads: int) -> tuple[bool, int]:
    """The runtime's own session over the graph at `path`: does a decode step equal the same token in wider calls
    (edge.runner.decode_steps_exact), and how many rows does the runtime give a decode step (its min_call probe)?"""
    from edge.runner import decode_steps_exact

    sess = _session(path, c, gopts, max_len, threads, capacity=min(max_len, 512))
    return decode_steps_exact(sess), sess.min_call


def _greedy(sess, ids: list[int], n: int, stop: tuple[int, ...] = ()) -> tuple[list[int], np.ndarray]:
    """Up to `n` greedy tokens after `ids`, the stop token included (`GraphRunner.greedy`'s continuation), and the
    logits [len(ids) + len(tokens) - 1, V] of the prompt and of every token but the last, one token a call through
    the runtime's session: on Gemma 3 270M 12 ms a token where feeding the cache back as inputs took ~19 ms, and
    calibration text is the export's longest step. A width-independent graph computes those rows as one call over
    the whole text would, so no teacher-forced pass follows."""
    sess.cache.trim(sess.cache.length)
    rows = []
    for i in range(0, len(ids), sess.max_call):
        part = ids[i : i + sess.max_call]
        rows.append(sess.forward(part).copy())
        sess.cache.append(len(part), part)
    tok = int(rows[-1][-1].argmax())
    gen = [tok]
    while len(gen) < n and tok not in stop:
        out = sess.call([tok])
        sess.cache.append(1, [tok])
        rows.append(out.logits.copy())
        tok = int(out.top_ids[0, 0]) if out.top_ids is not None else int(out.logits[0].argmax())
        gen.append(tok)
    return gen, np.concatenate(rows)


def _remove_graph(path: Path) -> None:
    """Delete a written graph before writing another in its place (onnx appends to an existing external-data file)."""
    for f in (path, path.with_name(path.name + ".data")):
        f.unlink()


def _time_contexts(m: Manifest, part: Path, past: int, threads: int, reps: int = 7) -> Manifest:
    """`m` with the target timed the way the engine runs it (IOBinding over one preallocated cache) at S = 1..8 over
    `past` cached tokens and over VERIFY_LONG_CONTEXT (or what max_len leaves room for): latency_ms_by_s_at, which
    the planner prices long chats from without a calibration; each drafter graph likewise over `past`, so that a
    model drafter is priced on the same scale as the target it saves calls of. Skipped when the graph has no room
    for twice `past` (too close to tell a slope from noise). The numpy-fed timings above copy the cache into every
    call's outputs: one row over 1,024 tokens measured 27.2 ms that way against 22.4 ms the engine's way (medians
    of 4 alternating rounds on the 2-core dev VM), 16.2 against 12.7 over 128. The target's session also records
    its min_call probe in the parity report."""
    from edge.measure import call_latency
    from edge.runner import open_session

    long_past = min(VERIFY_LONG_CONTEXT, m.target.max_len - VERIFY_SIZES)
    if long_past < 2 * past:
        return m
    sizes = list(range(1, VERIFY_SIZES + 1))

    probed = {}

    def timed(g: GraphEntry, contexts: tuple[int, ...]) -> GraphEntry:
        sess = open_session(str(part / g.file), m, g, contexts[-1] + VERIFY_SIZES, threads)
        if g is m.target:  # its load-time probe on this host, for plans made without loading (expected_min_call)
            probed["min_call"] = sess.min_call
        curves = [[c, [ms for _, ms in call_latency(sess, sizes, c, reps)]] for c in contexts]
        return replace(g, stats={**g.stats, "latency_ms_by_s_at": curves})

    graphs = tuple(timed(g, (past, long_past) if g is m.target else (past,)) for g in m.graphs)
    return replace(m, graphs=graphs, parity={**m.parity, **probed})


def _ours(d: Path, marker: str) -> bool:
    return (d / marker).is_file() or not any(d.iterdir())


def _remove_ours(d: Path, marker: str, ignore_errors: bool = False) -> None:
    """Delete a work directory of ours with its marker last, so a cleanup cut short (a second Ctrl-C, a kill)
    leaves a directory the next run still recognizes and clears."""
    if not d.exists():
        return
    try:
        for entry in d.iterdir():
            if entry.name == marker:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        (d / marker).unlink(missing_ok=True)
        d.rmdir()
    except OSError:
        if not ignore_errors:
            raise


def check_output_dir(source, out_dir: Path, cache_dir: bool = False) -> None:
    """An export replaces OUT as a whole (and uses <OUT>.partial / <OUT>.old beside it), so refuse before any work
    if that would delete anything that is not an earlier export: a non-empty OUT without a manifest, the source
    itself or a directory holding it, or sibling work directories without our marker."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir} exists and is not a directory")
    src = Path(os.path.abspath(source))
    if src == out_dir or out_dir in src.parents:
        raise ValueError(f"-o {out_dir} would replace the source {src}: export into a new directory")
    if out_dir.is_dir() and not (cache_dir or (out_dir / MANIFEST_NAME).is_file() or _ours(out_dir, OLD_MARKER)):
        raise ValueError(f"{out_dir} is not empty and holds no edgespec export ({MANIFEST_NAME}); an export replaces "
                         "its output directory as a whole, so give a new or empty directory")
    for d, marker in ((out_dir.with_name(out_dir.name + ".partial"), PARTIAL_MARKER),
                      (out_dir.with_name(out_dir.name + ".old"), OLD_MARKER)):
        if d.exists() and not (d.is_dir() and _ours(d, marker)):
            raise ValueError(f"{d} exists without edgespec's marker (someone else's files, or left by an older "
                             "edgespec): delete it if it is an old export, or choose another -o")


def _swap_into_place(part: Path, out_dir: Path) -> None:
    old = out_dir.with_name(out_dir.name + ".old")
    if old.exists():  # left by a crash between the two renames below (check_output_dir saw its marker)
        _remove_ours(old, OLD_MARKER)
    if out_dir.exists():
        # the old export stays loadable until the new one is complete; its manifest goes first so a crash
        # between the two renames cannot leave a half-old directory that loads
        (out_dir / OLD_MARKER).touch()
        (out_dir / MANIFEST_NAME).unlink(missing_ok=True)
        os.replace(out_dir, old)
    os.replace(part, out_dir)
    # the marker (not in the manifest) stays until here, so a crash before this rename leaves a <out>.partial that
    # the next run recognizes as its own and clears
    (out_dir / PARTIAL_MARKER).unlink(missing_ok=True)
    _remove_ours(old, OLD_MARKER, ignore_errors=True)
