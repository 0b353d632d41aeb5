"""`edge-export --via optimum`: the general path for decoder-only architectures our own graph builder does not cover
(GPT-2, Phi-3, Gemma, Falcon, … — whatever Hugging Face optimum exports for `text-generation-with-past`).

optimum traces the transformers model with torch into a graph with a 2-D attention mask, past K/V inputs and
present K/V outputs; int4/int8 weights are then block-quantized into MatMulNBits by ONNX Runtime's weight-only
quantizer (activations as `--accuracy-level` says). The runtime drives that graph through `edge.runner.
OptimumSession`: plain decoding and chain verification (lookup, recycling, hybrid drafts); no trees (the mask is
2-D), no early-exit drafter, and one copy of the KV cache per call. The fast path (export/graph.py) stays the
default wherever it applies.

Needs the `optimum` extra: pip install 'edgespec[optimum]' (optimum-onnx, onnx-ir, torch, accelerate).
"""
from __future__ import annotations

import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from edge.manifest import PARTIAL_MARKER, FileEntry, GraphEntry, Manifest, format_for, sha256_file
from edge.text import TextCodec

from . import calibration
from .checkpoint import CheckpointError, read_config
from .evaluate import parity
from .provenance import VERIFY_SIZES, converter_versions, source_digest
from .tokenizer import hf_tokenizer_files

OPTIMUM_PRECISIONS = ("fp32", "int8", "int4")
IR_VERSION_MAX = 13  # what ONNX Runtime 1.31 loads


def _require_optimum():
    try:
        import torch  # noqa: F401
        from optimum.exporters.onnx import main_export
    except ImportError as e:
        raise CheckpointError(f"--via optimum needs optimum-onnx and torch ({e.name} is missing): "
                              "pip install 'edgespec[optimum]'") from e
    return main_export


def read_hf_config(src: Path) -> dict:
    if not src.is_dir():
        raise CheckpointError(f"{src}: --via optimum takes a Hugging Face checkpoint directory (GGUF files: use the "
                              "default fast path, which supports llama and qwen2 GGUFs)")
    cfg_file = src / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{src}: no config.json; expected a Hugging Face checkpoint directory")
    return read_config(cfg_file)


def _max_positions(cfg: dict) -> int:
    return int(cfg.get("max_position_embeddings") or cfg.get("n_positions") or 2048)


def _graph_arch(path: Path, cfg: dict) -> dict:
    """What the runtime and memory model need, read off the exported graph's K/V shapes plus config.json."""
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    past = [i for i in m.graph.input if i.name.startswith("past_key_values.") and i.name.endswith(".key")]
    if not past:
        raise CheckpointError(f"{path}: optimum's graph has no past_key_values inputs")
    dims = past[0].type.tensor_type.shape.dim
    kv_heads, head_dim = int(dims[1].dim_value), int(dims[3].dim_value)
    logits = next(o for o in m.graph.output if o.name == "logits")
    vocab = int(logits.type.tensor_type.shape.dim[2].dim_value) or int(cfg.get("vocab_size", 0))
    hidden = int(cfg.get("hidden_size") or cfg.get("n_embd") or cfg.get("d_model") or 0)
    heads = int(cfg.get("num_attention_heads") or cfg.get("n_head") or kv_heads)
    max_pos = _max_positions(cfg)
    eos = cfg.get("eos_token_id")
    return {
        "family": str(cfg.get("model_type", "?")), "hidden": hidden, "layers": len(past), "heads": heads,
        "kv_heads": kv_heads, "head_dim": head_dim,
        "intermediate": int(cfg.get("intermediate_size") or cfg.get("n_inner") or 4 * hidden),
        "vocab": vocab, "rope_theta": float(cfg.get("rope_theta", 0.0)),
        "rms_eps": float(cfg.get("rms_norm_eps", cfg.get("layer_norm_epsilon", 0.0))), "max_positions": max_pos,
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", True)), "qkv_bias": False,
        "bos_token_id": cfg.get("bos_token_id"), "eos_token_ids": eos if isinstance(eos, list) else
        ([eos] if eos is not None else []),
    }


def _gemm_to_matmul(model) -> int:
    """Gemm(x, W const, b) → MatMul(x, W) + Add(b) (GPT-2's Conv1D layers trace to Gemm), so the weight-only
    quantizer, which rewrites MatMul, quantizes them too. Returns how many were rewritten."""
    from onnx import helper, numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    uses: dict[str, int] = {}
    for node in model.graph.node:
        for x in node.input:
            uses[x] = uses.get(x, 0) + 1
    nodes, n = [], 0
    for node in model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if (node.op_type != "Gemm" or len(node.input) < 2 or node.input[1] not in inits or attrs.get("transA", 0)
                or uses[node.input[1]] > 1
                or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0):
            nodes.append(node)
            continue
        if attrs.get("transB", 0):
            w = inits[node.input[1]]
            t = numpy_helper.from_array(numpy_helper.to_array(w).T.copy(), w.name)
            w.CopyFrom(t)
        has_bias = len(node.input) > 2 and node.input[2]
        mm_out = node.output[0] + "_mm" if has_bias else node.output[0]
        nodes.append(helper.make_node("MatMul", [node.input[0], node.input[1]], [mm_out], name=node.name + "_mm"))
        if has_bias:
            nodes.append(helper.make_node("Add", [mm_out, node.input[2]], [node.output[0]], name=node.name + "_bias"))
        n += 1
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return n


def _quantize(src: Path, dst: Path, bits: int, block_size: int, accuracy_level: int) -> None:
    """MatMul weights → MatMulNBits (per-block asymmetric, `bits`), written with external data next to `dst`."""
    import onnx

    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    except ImportError as e:  # it imports onnx_ir, which onnxruntime does not declare
        raise CheckpointError(f"--via optimum --precision int4/int8 needs {e.name}: pip install "
                              "'edgespec[optimum]'") from e

    import logging

    # the quantizer logs one INFO line per MatMul (hundreds) through a root handler it installs on import
    logging.getLogger(MatMulNBitsQuantizer.__module__).setLevel(logging.WARNING)
    model = onnx.load(str(src))
    _gemm_to_matmul(model)
    q = MatMulNBitsQuantizer(model, bits=bits, block_size=block_size, is_symmetric=False,
                             accuracy_level=accuracy_level, op_types_to_quantize=("MatMul",))
    q.process()
    out = q.model.model
    out.ir_version = min(out.ir_version, IR_VERSION_MAX)
    onnx.save_model(out, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=dst.name + ".data", size_threshold=1024)


def _source_logits(src: Path, prompts: list[list[int]]) -> list[np.ndarray]:
    import torch
    from transformers import AutoModelForCausalLM

    # eager attention: the checkpoint's own math (sdpa kernels skip e.g. softcapping), so parity sees any loss
    model = AutoModelForCausalLM.from_pretrained(str(src), local_files_only=True, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0].numpy() for ids in prompts]


def export_via_optimum(source, part: Path, opts, steps) -> Manifest:
    """Writes the export into `part` (export.pipeline.export_model swaps it into place when complete)."""
    from edge.measure import call_latency
    from edge.runner import OptimumSession

    src = Path(source)
    if opts.precision == "auto":  # nothing to choose between here: ORT's weight-only quantizer at 4 bits
        opts = replace(opts, precision="int4")
    if opts.precision not in OPTIMUM_PRECISIONS:
        raise ValueError(f"--precision {opts.precision} is not available --via optimum (choose "
                         f"{', '.join(OPTIMUM_PRECISIONS)})")
    if opts.drafters:
        raise ValueError("--via optimum builds no early-exit drafter (lookup, recycling and hybrid drafting still "
                         "work); pass --drafter-layers with no value")
    if opts.drafter_checkpoints:
        raise ValueError("--drafter-checkpoint needs edgespec's own graph builder (--via builder)")
    if opts.lm_head_bits is not None:  # ORT's quantizer takes every MatMul, the LM head's too, at --precision
        raise ValueError(f"--lm-head-bits needs edgespec's own graph builder (--via builder); --via optimum "
                         f"quantizes the LM head as every other MatMul, at --precision {opts.precision}")
    t0 = time.time()
    steps.start("loading checkpoint")
    cfg = read_hf_config(src)
    if cfg.get("attn_logit_softcapping") is not None:  # gemma2: its sdpa path drops the cap, which the trace uses
        raise CheckpointError(f"{src}: attention logit softcapping ({cfg['attn_logit_softcapping']}) is lost in "
                              "optimum's trace (max |Δlogit| 6.3 against transformers measured at a cap of 5); not "
                              "exported")
    positions = _max_positions(cfg)
    max_len = min(opts.max_len, positions)
    if max_len < VERIFY_SIZES:  # the latency calls below are that wide: refused here, not after the trace
        if opts.max_len < positions:
            raise ValueError(f"--max-len {max_len} is shorter than the {VERIFY_SIZES}-token calls the export "
                             f"measures; use --max-len {VERIFY_SIZES} or more")
        raise CheckpointError(f"{src}: the model's context of {max_len} positions is shorter than the "
                              f"{VERIFY_SIZES}-token calls the export measures")
    main_export = _require_optimum()
    steps.done()

    steps.start("tokenizer")
    tf = hf_tokenizer_files(src, part, cfg)
    codec = TextCodec(part / "tokenizer.json", tf.chat_template, tf.bos, tf.eos)
    steps.done()

    steps.start("optimum export (torch trace)")
    raw = part / "optimum"
    try:
        main_export(str(src), output=str(raw), task="text-generation-with-past", device="cpu",
                    local_files_only=True, do_validation=False)
    except (ValueError, KeyError, NotImplementedError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{src}: optimum cannot export this model for text generation: {first}") from e
    steps.done()

    target_file = "target/model.onnx"
    (part / "target").mkdir()
    steps.start(f"target graph ({opts.precision})")
    if opts.precision == "fp32":
        import onnx

        model = onnx.load(str(raw / "model.onnx"))
        model.ir_version = min(model.ir_version, IR_VERSION_MAX)
        onnx.save_model(model, str(part / target_file), save_as_external_data=True, all_tensors_to_one_file=True,
                        location="model.onnx.data", size_threshold=1024)
    else:
        _quantize(raw / "model.onnx", part / target_file, 4 if opts.precision == "int4" else 8, opts.block_size,
                  opts.accuracy_level)
    shutil.rmtree(raw)
    arch = _graph_arch(part / target_file, cfg)
    steps.done()

    steps.start("parity vs the transformers model")
    sess = OptimumSession(str(part / target_file), arch["layers"], arch["kv_heads"], arch["head_dim"], arch["vocab"],
                          min(max_len, 1024), opts.threads)
    prompts = [calibration.encode(codec, p, tf.chat_template is not None)[-(sess.cache.capacity // 2):]
               for p in calibration.PROMPTS[-calibration.HELD_OUT:][:3]]
    report = {}
    if opts.parity:
        got = []
        for ids in prompts:
            got.append(sess.forward(ids).copy())
            sess.cache.trim(sess.cache.length)
        report = parity(_source_logits(src, prompts), got)
        report["prompts"] = len(prompts)
    report.update(min_call=sess.min_call, chains_exact=sess.chains_exact)
    # timed as edge-profile times any session; the calls (up to VERIFY_SIZES tokens) follow a prefill of `past`
    # tokens, so a short --max-len still leaves them room
    past = min(128, sess.cache.capacity // 2, sess.cache.capacity - VERIFY_SIZES)
    lat = [ms for _, ms in call_latency(sess, list(range(1, VERIFY_SIZES + 1)), past, reps=5)]
    del sess
    steps.done()

    steps.start("manifest")
    files = [FileEntry(f.relative_to(part).as_posix(), f.stat().st_size, sha256_file(f))
             for f in sorted(part.rglob("*")) if f.is_file() and f.name != PARTIAL_MARKER]
    sizes = {f.path: f.bytes for f in files}
    graph = GraphEntry(role="target", name="target", file=target_file, layers=arch["layers"], vocab=arch["vocab"],
                       precision=opts.precision, block_size=opts.block_size if opts.precision != "fp32" else 0,
                       accuracy_level=opts.accuracy_level if opts.precision != "fp32" else 0, max_len=max_len,
                       tree_capable=False, io="optimum",
                       weight_bytes=sizes[target_file] + sizes.get(target_file + ".data", 0),
                       stats={"latency_ms_s1": lat[0], "latency_ms_by_s": lat})
    report["export_seconds"] = round(time.time() - t0, 1)
    from importlib.metadata import version

    m = Manifest(
        format_version=format_for((graph,)), name=opts.name or src.name, arch=arch, graphs=(graph,), files=tuple(files),
        tokenizer="tokenizer.json", chat_template=tf.chat_template,
        special_tokens={"bos": tf.bos, "eos": list(tf.eos), "pad": tf.pad},
        source={"path": str(src.resolve()), "format": "hf", "sha256": source_digest(src), "via": "optimum",
                "options": {**asdict(opts), "drafters": []}},
        converter={**converter_versions(), "optimum-onnx": version("optimum-onnx"), "torch": version("torch")},
        parity=report,
    )
    m.write(part)
    steps.done()
    return m
