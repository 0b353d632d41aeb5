"""The worker behind `edge-bench --peer-model`: times onnxruntime-genai, the strongest ONNX peer, on the token ids
edge-bench sends, so both runtimes decode the same prompts in one interleaved run on one machine.

It runs in the peer's own Python (`--peer-python`): onnxruntime-genai's model builder needs transformers 5.x, which
edgespec's exporter cannot share an environment with. So this file imports only the standard library and
onnxruntime_genai, and edge-bench starts it as a script: `PYTHON peer_genai.py MODEL_DIR --threads 2`.

Protocol, one JSON object per line: first out {"ready": version}; then for each line in
{"ids": [...], "max_new": N, "mode": "greedy" | "ngram"} one line out {"tokens", "n_gen", "prefill_s", "decode_s"}
or {"error": text}. Token ids are fed directly: onnxruntime-genai 0.18's own tokenizer mis-tokenizes SmolLM2
(../shared/peers/README.md). `n_gen` counts the tokens decoding produced, the end-of-sequence token included:
onnxruntime-genai 0.18 leaves it out of the sequence, edgespec counts it, and decode time includes its step.
"""
from __future__ import annotations  # the peer's Python may be older than ours

import argparse
import json
import os
import sys
import time

# its n-gram speculation as ../shared/peers/README.md measured it (size 3, up to 10 draft tokens)
NGRAM = {"ngram_size": 3, "max_draft_tokens": 10}


def eos_ids(model_dir: str) -> set[int]:
    """The end-of-sequence ids the model folder's genai_config.json names (its builder writes an int or a list)."""
    try:
        with open(os.path.join(model_dir, "genai_config.json")) as f:
            e = json.load(f)["model"]["eos_token_id"]
    except (OSError, ValueError, KeyError, TypeError):
        return set()
    # the usable ids only: a null or a name among them (a hand-edited config) is no end token, not a crash
    return {x for x in (e if isinstance(e, list) else [e]) if isinstance(x, int) and not isinstance(x, bool)}


def generate(og, model, ids: list[int], max_new: int, spec: dict | None, eos: set[int]) -> dict:
    """Greedy answer to `ids`; prefill is the prompt's forward, decode the rest (the same split as edge's Stats)."""
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + max_new, do_sample=False)
    if spec:
        params.set_speculative_options(**spec)
    gen = og.Generator(model, params)
    t0 = time.perf_counter()
    gen.append_tokens(ids)
    t1 = time.perf_counter()
    while not gen.is_done():
        gen.generate_next_token()
    t2 = time.perf_counter()
    tokens = [int(t) for t in gen.get_sequence(0)[len(ids):]]
    ended = len(tokens) < max_new and not (tokens and tokens[-1] in eos)  # by an end token left out of the sequence
    return {"tokens": tokens, "n_gen": len(tokens) + ended, "prefill_s": t1 - t0, "decode_s": t2 - t1}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    proto = os.fdopen(os.dup(1), "w")  # the protocol's own copy of stdout; whatever a library prints goes to stderr
    os.dup2(2, 1)

    def say(msg: dict) -> None:
        proto.write(json.dumps(msg) + "\n")
        proto.flush()

    try:
        import onnxruntime_genai as og
    except ImportError as e:
        say({"error": f"{sys.executable} cannot import onnxruntime_genai ({e}); install onnxruntime-genai there "
                      "or pass another --peer-python"})
        return 1
    try:
        cfg = og.Config(a.model_dir)
        cfg.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": a.threads, "inter_op_num_threads": 1}}}}))
        model = og.Model(cfg)
    except Exception as e:  # noqa: BLE001 - its errors are untyped; edge-bench prints this line
        say({"error": f"onnxruntime-genai cannot load {a.model_dir}: {e}"})
        return 1
    eos = eos_ids(a.model_dir)
    say({"ready": getattr(og, "__version__", "?")})
    try:
        for line in sys.stdin:
            req = json.loads(line)
            try:
                say(generate(og, model, req["ids"], req["max_new"], NGRAM if req["mode"] == "ngram" else None, eos))
            except Exception as e:  # noqa: BLE001 - reported per request; edge-bench stops with it
                say({"error": f"onnxruntime-genai failed: {e}"})
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group; edge-bench summarizes what ran
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
