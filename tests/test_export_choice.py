"""The exporter's per-host choice of the target graph: precision (--precision auto), the attention pad row
(--pad-row auto) and the KV cache (--kv-cache auto), recorded in the manifest with the measurements behind it.

Kinds: exact cases for the decision rule; an end-to-end export of the tiny model whose recorded choice must agree
with what its graphs compute on this host (never an assertion of how a particular CPU behaves)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from conftest import MAX_LEN, VOCAB, tiny_export_options
from export import pipeline
from export.pipeline import FIDELITY_FLOOR, ExportOptions, _Target, choose_target


def target(precision, top1, curve_128, curve_1k=None, positions=10**6):
    return _Target(opts=ExportOptions(precision=precision), graph_opts=None, dir=Path("."), ck=None, kv_scales=None,
                   smoothing=None, parity={"top1_agreement": top1, "positions": positions},
                   latency_ms={128: curve_128, 1024: curve_1k or curve_128})


def test_expected_tokens_per_s_prices_plain_and_chains():
    a = pipeline.CHOICE_ACCEPTANCE
    t = target("int4", 0.95, [10.0, 100.0, 100.0])  # wide calls so dear that plain decoding wins
    assert t.tokens_per_s == pytest.approx(100.0)
    t = target("int4", 0.95, [10.0, 11.0])  # a 2-row call expects 1 + a tokens
    assert t.tokens_per_s == pytest.approx((1 + a) * 1000 / 11.0)


@pytest.mark.parametrize("cands,want", [
    ([("int4", 0.95, [8.0]), ("w8a8", 0.94, [9.0])], "int4"),  # both faithful: the faster
    ([("int4", 0.95, [9.0]), ("w8a8", 0.94, [8.0])], "w8a8"),
    ([("int4", 0.95, [9.0]), ("w8a8", 0.90, [5.0])], "int4"),  # the faster one is below the floor
    ([("int4", 0.91, [9.0]), ("w8a8", 0.92, [12.0])], "w8a8"),  # none faithful: the most faithful
    ([("w8a8", 0.50, [12.0])], "w8a8"),  # one candidate: itself
    # at the floor on a small sample only: 0.937 over 653 positions is 0.937 ± 0.0095
    ([("int8", 0.96, [12.0], None, 653), ("w8a8", 0.937, [8.0], None, 653)], "int8"),
    ([("int8", 0.96, [12.0], None, 653), ("w8a8", 0.937, [8.0], None, 100_000)], "w8a8"),
])
def test_the_fastest_faithful_candidate_is_chosen(cands, want):
    assert FIDELITY_FLOOR == 0.93
    assert choose_target([target(*c) for c in cands]).opts.precision == want


def test_options_refuse_unknown_choices():
    with pytest.raises(ValueError, match="pad_row"):
        ExportOptions(pad_row="maybe")
    with pytest.raises(ValueError, match="precision"):
        ExportOptions(precision="int2")
    with pytest.raises(ValueError, match="kv_cache"):
        ExportOptions(kv_cache="int4")
    assert ExportOptions(precision="fp32").resolved_kv_cache == "float32"
    assert ExportOptions(precision="int4").resolved_kv_cache == "int8"
    assert ExportOptions(precision="fp16", kv_cache="int8").resolved_kv_cache == "float32"


def test_the_host_signature_is_part_of_what_a_cached_export_is_compared_on(monkeypatch):
    a = ExportOptions().recorded()
    monkeypatch.setattr(pipeline, "host_signature", lambda: "another cpu")
    b = ExportOptions().recorded()
    assert a["host"] != b["host"] and a != b
    assert "host" in ExportOptions(pad_row="on").recorded()  # the precision is still measured here
    assert "host" in ExportOptions(precision="int4").recorded()  # and the pad row
    assert "host" not in ExportOptions(pad_row="on", precision="int4").recorded()  # nothing decided by measuring


@pytest.fixture(scope="module")
def auto_export(tmp_path_factory, tiny_llama_dir):
    from export.pipeline import export_model

    out = tmp_path_factory.mktemp("auto") / "m"
    m = export_model(tiny_llama_dir, out, tiny_export_options(precision="auto", kv_cache="auto", pad_row="auto"),
                     progress=False)
    return out, m


def test_auto_export_records_its_choice_and_evidence(auto_export):
    d, m = auto_export
    ch = m.choice
    assert ch["host"] == pipeline.host_signature()
    first = ch["candidates"][: len(pipeline.AUTO_PRECISIONS)]
    for c in ch["candidates"]:
        assert c["faithful"] == pipeline.reaches_floor(c["top1_agreement"], c["positions"]) and c["positions"] > 0
    fallback = [pipeline.FALLBACK_PRECISION] if not any(c["faithful"] for c in first) else []
    assert [c["precision"] for c in ch["candidates"]] == list(pipeline.AUTO_PRECISIONS) + fallback
    assert ch["precision"] == m.target.precision
    for c in ch["candidates"]:
        assert 0 <= c["top1_agreement"] <= 1 and c["expected_tokens_per_s"] > 0
        assert [ctx for ctx, _ in c["latency_ms_by_s_at"]] == [128, MAX_LEN - pipeline.VERIFY_SIZES]
    by = {c["precision"]: c for c in ch["candidates"]}
    faithful = [c for c in ch["candidates"] if c["faithful"]]
    pool = faithful or ch["candidates"]
    key = (lambda c: c["expected_tokens_per_s"]) if faithful else (lambda c: c["top1_agreement"])
    assert by[ch["precision"]] is max(pool, key=key)
    assert m.target.kv_dtype == ch["kv_cache"] == "int8"
    assert m.source["options"]["precision"] == "auto"  # the request is recorded, the choice beside it
    assert not any(Path(d, p).exists() for p in ("candidate-int4", "candidate-w8a8", "candidate-int8"))


def test_auto_export_falls_back_to_int8_when_no_candidate_is_faithful(tmp_path, tiny_llama_dir, monkeypatch):
    """A floor no fast candidate reaches: the export builds the fallback precision too and, none being at the
    floor, keeps the most faithful of the three."""
    from export.pipeline import export_model

    monkeypatch.setattr(pipeline, "FIDELITY_FLOOR", 1.01)
    m = export_model(tiny_llama_dir, tmp_path / "m", tiny_export_options(precision="auto", drafters=()),
                     progress=False)
    cands = m.choice["candidates"]
    assert [c["precision"] for c in cands] == list(pipeline.AUTO_PRECISIONS) + [pipeline.FALLBACK_PRECISION]
    assert m.target.precision == max(cands, key=lambda c: c["top1_agreement"])["precision"]


def test_the_pad_row_choice_agrees_with_what_the_graph_computes(auto_export, shared_kv, tiny_llama):
    """Whether or not the export left the pad row out on this host, the graph it kept computes a decode step bit for
    bit as wider calls do: a 1-token call, or 2 rows where the runtime's probe finds a lone row computed another
    way (the export's probe saw exactly that; without the row where it was needed, this fails). The manifest
    records the runtime's probe for the graph it kept."""
    from conftest import causal

    d, m = auto_export
    c = tiny_llama.config
    prompt = np.random.default_rng(4).integers(0, VOCAB, 29)
    s = shared_kv(d / m.target.file, c.layers, c.kv_heads, c.head_dim, MAX_LEN)
    min_call = s.min_call()
    if "min_call" in m.parity:  # recorded when the export timed the graph (a tiny one may be too short for that)
        assert m.parity["min_call"] == min_call
    n = len(prompt)
    s.run(prompt, np.arange(n), causal(n, 0), keep=1)
    one = s.step(9, n, min_call)
    for w in (2, 3, 5, 8):
        assert np.array_equal(one, s.run([9] + [4] * (w - 1), np.arange(n, n + w), causal(w, n))[:1])


def test_auto_export_is_lossless_through_the_engine(auto_export):
    import edge

    d, m = auto_export
    eng = edge.load(str(d))
    prompt = "red green blue red green blue red green"
    plain = eng.generate(prompt, max_tokens=24, drafter="none", raw=True).token_ids
    for drafter in ("lookup", "hybrid", "model"):
        assert eng.generate(prompt, max_tokens=24, drafter=drafter, raw=True).token_ids == plain, drafter


def test_the_cli_says_what_it_chose_and_why():
    from export.cli import choice_line

    choice = {"precision": "int4", "kv_cache": "int8", "pad_row": False, "fidelity_floor": 0.93,
              "candidates": [{"precision": "int4", "top1_agreement": 0.957, "expected_tokens_per_s": 142.8},
                             {"precision": "w8a8", "top1_agreement": 0.879, "expected_tokens_per_s": 145.0}]}
    line = choice_line(choice)
    assert line.startswith("chosen on this machine: int4, KV cache int8, pad row not needed")
    assert "w8a8 top-1 0.879, 145.0 tok/s expected (below the floor)" in line
    assert "int4 top-1 0.957, 142.8 tok/s expected;" in line
    assert choice_line({}) is None  # exports made before the choice existed


@pytest.mark.parametrize("unpadded,padded,want_row", [
    ((True, 1), None, False),  # a lone row is exact without the row: no row
    ((False, 1), None, True),  # the lone row needs the row (attention's single-query path differs)
    ((True, 2), (True, 2), False),  # the runtime pads decode steps either way: the row would buy nothing
    ((True, 2), (True, 1), True),  # the row makes a lone row exact, which is cheaper than a padded step
    ((True, 2), (False, 1), False),  # the padded graph is no better: the exact unpadded one is kept
])
def test_the_pad_row_is_kept_only_where_it_buys_an_exact_lone_row(tmp_path, tiny_llama_dir, monkeypatch, unpadded,
                                                                    padded, want_row):
    """The exporter's rule, over the probes it reads (stood in for here; what they read is tested above): left out
    where a decode step is exact without it, at whatever width the runtime gives a decode step."""
    from export.pipeline import export_model

    seen = []

    def probe(path, *a):
        seen.append(path)
        return unpadded if len(seen) == 1 else padded

    monkeypatch.setattr(pipeline, "_decode_steps_exact", probe)
    m = export_model(tiny_llama_dir, tmp_path / "m", tiny_export_options(precision="int4", pad_row="auto",
                                                                        drafters=()), progress=False)
    assert m.choice["pad_row"] is want_row
    assert len(seen) == (1 if padded is None else 2)
    # the graph kept is the one the choice names (the pad row is sliced off after each attention)
    kept = onnx.load(str(tmp_path / "m" / m.target.file), load_external_data=False)
    assert any(n.name.endswith("attn_unpad") for n in kept.graph.node) is want_row
