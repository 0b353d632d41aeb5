"""python -m export.precision_table [GGUF or HF dir] — the precision table of docs/export.md: for each precision, the
graph's size, its parity against the fp32 numpy reference on held-out chat prompts, and one-call latency."""
from __future__ import annotations

import json
import os
import sys
import tempfile

import numpy as np

from edge.text import TextCodec

from . import calibration, catalog, reference
from .checkpoint import load_checkpoint
from .evaluate import GraphRunner, parity
from .graph import GraphOptions, build_graph, save_model
from .tokenizer import write_tokenizer

VARIANTS = [("fp32", 0), ("fp16", 0), ("int8", 4), ("int4", 4), ("int4", 0), ("w8a8", 0)]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    src = argv[0] if argv else catalog.MODELS[catalog.DEFAULT].gguf_path()
    ck = load_checkpoint(src)
    c = ck.config
    with tempfile.TemporaryDirectory() as tmp:
        tf = write_tokenizer(ck, __import__("pathlib").Path(tmp))
        codec = TextCodec(os.path.join(tmp, "tokenizer.json"), tf.chat_template, tf.bos, tf.eos)
        held = [calibration.encode(codec, p, tf.chat_template is not None) for p in calibration.PROMPTS[-3:]]
        ref = [reference.forward(ck, ids) for ids in held]
        for prec, acc in VARIANTS:
            d = os.path.join(tmp, f"{prec}-a{acc}")
            os.makedirs(d)
            save_model(build_graph(ck, GraphOptions(precision=prec, accuracy_level=acc, max_len=min(8192, c.max_positions))),
                       os.path.join(d, "model.onnx"))
            size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
            r = GraphRunner(os.path.join(d, "model.onnx"), c.layers, c.kv_heads, c.head_dim,
                            kv_dtype=np.float16 if prec == "fp16" else np.float32)
            row = dict(precision=prec, accuracy_level=acc, MB=round(size / 1e6, 1),
                       **parity(ref, [r.logits(ids) for ids in held]),
                       ms_s1=round(r.latency_ms(1), 2), ms_s8=round(r.latency_ms(8), 2))
            print(json.dumps(row), flush=True)
            del r
    return 0


if __name__ == "__main__":
    sys.exit(main())
