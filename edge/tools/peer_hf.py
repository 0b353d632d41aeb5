"""The worker behind `edge-bench --reference-hf`: transformers' fp32 greedy answer on the token ids edge-bench sends,
the reference every runtime's greedy answer is compared with ("tokens before divergence"). Not timed.

It runs as a script in a Python with torch and transformers (`--reference-python`, default edge-bench's own):
`PYTHON peer_hf.py HF_DIR --threads 2`, so its hundreds of MB never count in edge-bench's own peak RSS. HF_DIR
is a Hugging Face checkpoint folder (config.json + safetensors); for the embedded model, the GGUF de-quantized
with transformers 4.57:
`AutoModelForCausalLM.from_pretrained(dir, gguf_file=f, dtype=torch.float32).save_pretrained(HF_DIR)`.

Protocol, one JSON object per line, as edge/tools/peer_genai.py's: first out {"ready": "transformers X, torch Y"}; then
for each line in {"ids": [...], "max_new": N, "mode": "greedy", "stop": [...]} one line out {"tokens"} (the end
token left out) or {"error": text}. Greedy is the argmax of every step's fp32 logits, with the model's KV cache,
stopped at the model's end tokens or `stop`."""
from __future__ import annotations

import os
import sys

if __package__:  # imported as edge.tools.peer_hf (the tests)
    from .peer_protocol import open_protocol, serve, worker_args
else:  # run as a script: then edge/ leaves the path, or its profile.py, text.py, ... would shadow modules torch and
    _HERE = os.path.dirname(os.path.abspath(__file__))  # transformers import
    sys.path.insert(0, _HERE)
    from peer_protocol import open_protocol, serve, worker_args

    sys.path[:] = [p for p in sys.path if not p or os.path.abspath(p) != _HERE]


def eos_ids(config) -> set[int]:
    """The end-of-sequence ids a transformers config names (an int, a list, or none)."""
    e = getattr(config, "eos_token_id", None)
    return {x for x in (e if isinstance(e, (list, tuple)) else [e]) if isinstance(x, int) and not isinstance(x, bool)}


def greedy(torch, model, ids: list[int], max_new: int, stop: set[int]) -> list[int]:
    """Up to `max_new` argmax tokens after `ids`, the end token left out."""
    tokens = []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
        while len(tokens) < max_new:
            t = int(out.logits[0, -1].argmax())
            if t in stop:
                break
            tokens.append(t)
            if len(tokens) < max_new:
                out = model(input_ids=torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def main() -> int:
    a = worker_args(__doc__, "hf_dir", "ignored: the reference is not measured")
    say = open_protocol()

    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        say({"error": f"{sys.executable} cannot import torch and transformers ({e}); install them there or pass "
                      "another --reference-python"})
        return 1
    try:
        torch.set_num_threads(a.threads)
        major_minor = tuple(int(x) for x in transformers.__version__.split(".")[:2])
        dtype = {"dtype": torch.float32} if major_minor >= (4, 56) else {"torch_dtype": torch.float32}
        model = AutoModelForCausalLM.from_pretrained(a.hf_dir, **dtype).eval()
        model.float()  # fp32 whatever the checkpoint stores
    except Exception as e:  # noqa: BLE001 - OSError, ValueError, ...: edge-bench prints this line
        say({"error": f"transformers cannot load {a.hf_dir}: {str(e).splitlines()[0] if str(e) else e!r}"})
        return 1
    eos = eos_ids(model.config) | eos_ids(getattr(model, "generation_config", None))
    say({"ready": f"transformers {transformers.__version__}, torch {torch.__version__}"})
    return serve(say, lambda req: {"tokens": greedy(torch, model, req["ids"], req["max_new"],
                                                    eos | set(req.get("stop") or ()))}, "transformers")

if __name__ == "__main__":
    sys.exit(main())
