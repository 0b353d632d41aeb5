"""The worker behind `edge-bench --peer-model`: times onnxruntime-genai, the strongest ONNX peer, on the token ids
edge-bench sends, so both runtimes decode the same prompts in one interleaved run on one machine.

It runs in the peer's own Python (`--peer-python`): onnxruntime-genai's model builder needs transformers 5.x, which
edgespec's exporter cannot share an environment with. So this file imports only the standard library and
onnxruntime_genai, and edge-bench starts it as a script: `PYTHON peer_genai.py MODEL_DIR --threads 2 [--context N]`.

Protocol, one JSON object per line: first out {"ready": version, "peak_rss_mb"}; then for each line in
{"ids": [...], "max_new": N, "mode": "greedy" | "ngram"} one line out {"tokens", "n_gen", "prefill_s", "decode_s",
"peak_rss_mb"} or {"error": text} (a "stop" list is ignored: its end tokens are its config's). Token ids are fed
directly: onnxruntime-genai 0.18's own tokenizer mis-tokenizes SmolLM2 (../shared/peers/README.md). `n_gen` counts
the tokens decoding produced, the end-of-sequence token included: onnxruntime-genai 0.18 leaves it out of the
sequence, edgespec counts it, and decode time includes its step. With --context N its KV cache is allocated for N
tokens (max_length N, as edgespec's and llama.cpp's are sized to their context) and answers stop after max_new
tokens; without it, max_length is the prompt plus max_new. `peak_rss_mb` is this process's peak (VmHWM): once
loaded in "ready", and per request the peak since the request began (Linux resets VmHWM first).
"""
from __future__ import annotations  # the peer's Python may be older than ours

import json
import os
import sys
import time

if __package__:  # imported as edge.tools.peer_genai (the tests)
    from ..measure import peak_rss_bytes, reset_peak_rss
    from .peer_protocol import open_protocol, serve, worker_args
else:  # run as a script in the peer's own Python, which has no edgespec
    _HERE = os.path.dirname(os.path.abspath(__file__))
    _EDGE = os.path.dirname(_HERE)
    sys.path[:0] = [_HERE, _EDGE]
    from measure import peak_rss_bytes, reset_peak_rss
    from peer_protocol import open_protocol, serve, worker_args

    # then both leave the path: edge/'s text.py, kv.py, ... would shadow modules the peer runtime imports
    sys.path[:] = [p for p in sys.path if not p or os.path.abspath(p) not in (_HERE, _EDGE)]

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


def generate(og, model, ids: list[int], max_new: int, spec: dict | None, eos: set[int], context: int = 0) -> dict:
    """Greedy answer to `ids`; prefill is the prompt's forward, decode the rest (the same split as edge's Stats).
    `context`: the max_length its KV cache is allocated for (0: just the prompt plus max_new)."""
    params = og.GeneratorParams(model)
    end = len(ids) + max_new
    params.set_search_options(max_length=max(context, end), do_sample=False)
    if spec:
        params.set_speculative_options(**spec)
    gen = og.Generator(model, params)
    t0 = time.perf_counter()
    gen.append_tokens(ids)
    t1 = time.perf_counter()
    if context > end:  # max_length does not stop it at max_new: count (an n-gram step may add several tokens)
        while not gen.is_done() and gen.token_count() < end:
            gen.generate_next_token()
    else:
        while not gen.is_done():
            gen.generate_next_token()
    t2 = time.perf_counter()
    tokens = [int(t) for t in gen.get_sequence(0)[len(ids):end]]
    ended = len(tokens) < max_new and not (tokens and tokens[-1] in eos)  # by an end token left out of the sequence
    return {"tokens": tokens, "n_gen": len(tokens) + ended, "prefill_s": t1 - t0, "decode_s": t2 - t1}


def main() -> int:
    a = worker_args(__doc__, "model_dir", "max_length: the KV cache it allocates (0: per prompt)")
    say = open_protocol()

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
    say({"ready": getattr(og, "__version__", "?"), "peak_rss_mb": round(peak_rss_bytes() / 2**20, 1)})
    return serve(say, lambda req: generate(og, model, req["ids"], req["max_new"],
                                           NGRAM if req["mode"] == "ngram" else None, eos, a.context),
                 "onnxruntime-genai", (reset_peak_rss, peak_rss_bytes))

if __name__ == "__main__":
    sys.exit(main())
