"""edge-bench's bookkeeping (edge/tools/bench.py): the looping count and the comparison with a peer's fastest
mode."""
from __future__ import annotations

import pytest

from edge.tools.bench import loops, versus_peer


@pytest.mark.parametrize("tokens,looping", [
    ([], False), (list(range(7)) * 5, True), (list(range(8)) * 3, True), (list(range(8)) * 2 + list(range(7)), False),
    ([5, 6] * 12, True), (list(range(100)), False), (list(range(9)) * 2, False),
])
def test_bench_counts_looping_answers(tokens, looping):
    """An answer loops when some 8-token sequence occurs 3 times (overlaps count: a 2-token cycle loops)."""
    assert loops(tokens) is looping


def test_versus_peer_divides_by_the_peers_fastest_mode_per_category():
    def run(pid, cat, mode, tok_s):
        return {"id": pid, "turn": 0, "category": cat, "mode": mode, "decode_tok_s": tok_s, "mean_accepted": None,
                "overhead_ms_per_step": None, "target_s": None, "draft_s": None, "steps": None, "tokens": [1]}

    runs = [run("a", "qa", "none", 100), run("a", "qa", "hybrid", 150), run("a", "qa", "genai", 200),
            run("a", "qa", "genai-ngram", 120), run("b", "qa", "none", 50), run("b", "qa", "hybrid", 60),
            run("b", "qa", "genai", 100), run("b", "qa", "genai-ngram", 80),
            run("c", "rag", "none", 60), run("c", "rag", "genai", 80), run("c", "rag", "genai-ngram", 240)]
    vs = versus_peer(runs, ["none", "hybrid", "genai", "genai-ngram"])
    assert vs["qa"] == {"peer_best": "genai", "none": 0.5, "hybrid": pytest.approx(0.675)}  # median(0.75, 0.6)
    assert vs["rag"] == {"peer_best": "genai-ngram", "none": 0.25, "hybrid": None}  # hybrid did not run there
