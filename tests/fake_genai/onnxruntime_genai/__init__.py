"""A stand-in for onnxruntime-genai's Python API (the part edge/tools/peer_genai.py uses), for edge-bench's peer tests.
`answer` is its whole behaviour: greedy "decoding" starts from the sum of the prompt's ids and follows a fixed
map; the n-gram mode changes the third token (as the real one changes answers when activations are quantized).
FAKE_GENAI_FAIL_AFTER=n makes the n+1-th generator raise; FAKE_GENAI_EOS_AFTER=k ends answers after k tokens with
an end token left out of the sequence, as onnxruntime-genai 0.18 does."""
import json
import os

__version__ = "0.0-fake"
_made = [0]


def answer(ids, max_new, ngram=False):
    out, last = [], sum(ids)
    stop = min(max_new, int(os.environ.get("FAKE_GENAI_EOS_AFTER", max_new)))
    while len(out) < stop:
        last = (last * 7 + 3) % 50 + 10 + (1 if ngram and len(out) == 2 else 0)
        out.append(last)
    return out


class Config:
    def __init__(self, path):
        if not os.path.isdir(path):
            raise RuntimeError(f"no genai_config.json in {path}")
        self.path, self.overlays = path, []

    def overlay(self, text):
        self.overlays.append(json.loads(text))


class Model:
    def __init__(self, cfg):
        self.cfg = cfg


class GeneratorParams:
    def __init__(self, model):
        self.max_length, self.spec = 0, None

    def set_search_options(self, max_length, do_sample=False):
        self.max_length = max_length

    def set_speculative_options(self, **kw):
        self.spec = kw


class Generator:
    def __init__(self, model, params):
        _made[0] += 1
        if _made[0] > int(os.environ.get("FAKE_GENAI_FAIL_AFTER", "1000000")):
            raise RuntimeError("fake failure")
        self.p, self.seq, self.out = params, [], []

    def append_tokens(self, ids):
        self.seq = list(ids)
        self.out = answer(ids, self.p.max_length - len(ids), ngram=self.p.spec is not None)

    def is_done(self):
        return not self.out

    def generate_next_token(self):
        self.seq.append(self.out.pop(0))

    def get_sequence(self, i):
        return self.seq

    def token_count(self):
        return len(self.seq)
