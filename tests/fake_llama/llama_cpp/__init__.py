"""A stand-in for llama-cpp-python's `Llama` (the part edge/tools/peer_llama.py uses), for edge-bench's llama.cpp peer
tests. `answer` is its whole behaviour: greedy "decoding" starts from the sum of the prompt's ids and follows a fixed
map, endlessly, as Llama.generate does (the caller stops it). It insists on what a fair greedy run needs: temperature
0, top-k 1, no penalties, and a reset cache before every prompt (generate would otherwise reuse a shared prefix).
FAKE_LLAMA_EOS_AFTER=k yields the end token after k tokens; FAKE_LLAMA_LOG=FILE appends each Llama's arguments;
FAKE_LLAMA_FAIL_AFTER=n makes the n+1-th generate raise."""
import json
import os

__version__ = "0.0-fake-llama"
EOS = 2
_made = [0]


def answer(ids, n):
    out, last = [], sum(ids)
    while len(out) < n:
        last = (last * 5 + 1) % 40 + 10
        out.append(last)
    return out


class Llama:
    def __init__(self, model_path, n_ctx=512, n_threads=None, n_threads_batch=None, verbose=True, **kw):
        if not os.path.isfile(model_path):
            raise ValueError(f"Model path does not exist: {model_path}")
        print("llama_model_loader: a library's chatter", flush=True)  # on stdout: must not reach the protocol
        if os.environ.get("FAKE_LLAMA_LOG"):
            with open(os.environ["FAKE_LLAMA_LOG"], "a") as f:
                f.write(json.dumps({"n_ctx": n_ctx, "n_threads": n_threads, "n_threads_batch": n_threads_batch,
                                    "verbose": verbose}) + "\n")
        self.n_ctx, self.n_tokens = n_ctx, 0

    def token_eos(self):
        return EOS

    def reset(self):
        self.n_tokens = 0

    def generate(self, tokens, top_k=40, top_p=0.95, min_p=0.05, temp=0.8, repeat_penalty=1.0, frequency_penalty=0.0,
                 presence_penalty=0.0, **kw):
        _made[0] += 1
        if _made[0] > int(os.environ.get("FAKE_LLAMA_FAIL_AFTER", "1000000")):
            raise RuntimeError("fake llama failure")
        if (temp, top_k, repeat_penalty, frequency_penalty, presence_penalty) != (0.0, 1, 1.0, 0.0, 0.0):
            raise AssertionError("not greedy")
        if self.n_tokens:
            raise AssertionError("generate without reset: it would reuse the earlier prompt's prefix")
        if len(tokens) > self.n_ctx:
            raise ValueError(f"Requested tokens ({len(tokens)}) exceed context window of {self.n_ctx}")
        self.n_tokens = len(tokens)
        eos_after = int(os.environ.get("FAKE_LLAMA_EOS_AFTER", "-1"))
        for i, t in enumerate(answer(tokens, self.n_ctx - len(tokens))):
            if i == eos_after:
                t = EOS
            self.n_tokens += 1
            yield t
        raise RuntimeError("llama_decode returned 1")  # the context is full
