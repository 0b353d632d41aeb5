"""The worker behind `edge-bench --llama-model`: times llama.cpp (through llama-cpp-python, the binding most local-LLM
users already have) on the token ids edge-bench sends, so it decodes the same prompts as edgespec in one
interleaved run on one machine.

It runs in its own Python (`--llama-python`, a venv with `pip install llama-cpp-python`, edgespec's `llama` extra),
imports only the standard library and llama_cpp, and edge-bench starts it as a script:
`PYTHON peer_llama.py MODEL.gguf --threads 2 --context 4096`. The GGUF runs as it ships (its own quantization).

Protocol, one JSON object per line, as edge/tools/peer_genai.py's: first out {"ready": version, "peak_rss_mb"}; then
for each line in {"ids": [...], "max_new": N, "mode": "greedy", "stop": [...]} one line out {"tokens", "n_gen",
"prefill_s", "decode_s", "peak_rss_mb"} or {"error": text}. Greedy is `Llama.generate(ids, temp=0, top_k=1)` with
no penalties. `tokens` leave the end token out; `n_gen` counts it, as edgespec counts its own. Prefill is the time
to the first token (the prompt's forward and its pick), decode the rest: the same split as edge's Stats. Every
request starts from an empty cache (no prefix of an earlier prompt reused). `peak_rss_mb` is this process's peak
(VmHWM): once loaded in "ready", and per request the peak since the request began (Linux resets VmHWM first;
elsewhere it stays the process's peak)."""
from __future__ import annotations  # the peer's Python may be older than ours

import os
import sys
import time

if __package__:  # imported as edge.tools.peer_llama (the tests)
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


def generate(llm, ids: list[int], max_new: int, stop: set[int]) -> dict:
    """Greedy answer to `ids`, stopped at an end token (`stop`) or after `max_new` tokens."""
    llm.reset()  # an empty cache: generate() would otherwise reuse the prefix an earlier prompt shares
    tokens, n_gen, t1 = [], 0, None
    t0 = time.perf_counter()
    it = llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, frequency_penalty=0.0,
                      presence_penalty=0.0)
    try:
        for tok in it:
            if t1 is None:
                t1 = time.perf_counter()
            n_gen += 1
            if tok in stop:
                break
            tokens.append(int(tok))
            if n_gen >= max_new:
                break
    finally:
        it.close()
    t2 = time.perf_counter()
    t1 = t2 if t1 is None else t1
    return {"tokens": tokens, "n_gen": n_gen, "prefill_s": t1 - t0, "decode_s": t2 - t1}


def main() -> int:
    a = worker_args(__doc__, "model", "n_ctx: the KV cache llama.cpp allocates", 4096)
    say = open_protocol()

    try:
        import llama_cpp
    except ImportError as e:
        say({"error": f"{sys.executable} cannot import llama_cpp ({e}); install llama-cpp-python there "
                      "(pip install 'edgespec[llama]' or llama-cpp-python) or pass another --llama-python"})
        return 1
    try:
        llm = llama_cpp.Llama(model_path=a.model, n_ctx=a.context, n_threads=a.threads, n_threads_batch=a.threads,
                              verbose=False)
        eos = {int(llm.token_eos())}
    except Exception as e:  # noqa: BLE001 - its errors are untyped (ValueError, RuntimeError); edge-bench prints it
        say({"error": f"llama.cpp cannot load {a.model}: {e}"})
        return 1
    say({"ready": getattr(llama_cpp, "__version__", "?"), "peak_rss_mb": round(peak_rss_bytes() / 2**20, 1)})
    return serve(say, lambda req: generate(llm, req["ids"], req["max_new"], eos | set(req.get("stop") or ())),
                 "llama.cpp", (reset_peak_rss, peak_rss_bytes))

if __name__ == "__main__":
    sys.exit(main())
