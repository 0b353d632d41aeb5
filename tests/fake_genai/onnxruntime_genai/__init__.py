"""A stand-in for onnxruntime-genai's Python API (the part edge/peer_genai.py uses), for edge-bench's peer tests:
greedy "decoding" is a fixed function of the last token; its n-gram mode changes the third token, as the real one
changes answers when activations are quantized. FAKE_GENAI_FAIL_AFTER=n makes the n+1-th generator raise."""
import json
import os

__version__ = "0.0-fake"
_made = [0]


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
        self.p, self.seq, self.n_prompt = params, [], 0

    def append_tokens(self, ids):
        self.seq, self.n_prompt = list(ids), len(ids)

    def is_done(self):
        return len(self.seq) >= self.p.max_length

    def generate_next_token(self):
        nxt = (self.seq[-1] * 7 + 3) % 50 + 10
        if self.p.spec and len(self.seq) - self.n_prompt == 2:
            nxt += 1
        self.seq.append(nxt)

    def get_sequence(self, i):
        return self.seq
