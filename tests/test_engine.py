"""End-to-end runtime tests on a tiny random llama exported by our own exporter (no downloads).

The tiny model's weights are random, so its text is gibberish; what matters is that every drafter reproduces
plain greedy decoding token for token, that the cache/chat bookkeeping survives interruption, that stop strings,
finish reasons and sampling behave as documented, and that bad requests fail clearly. The adaptive draft length is
tested in test_engine_adaptive.py.
"""
from __future__ import annotations

import numpy as np
import pytest

import edge
from conftest import logits_alone_and_together
from edge import EngineBusy, EngineError, ModelDirError
from edge.engine import Engine
from helpers import check_against, exact_first_tokens, speculative_first_tokens


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return edge.load(tiny_dir, drafter="none", context=256)


PROMPTS = ["the quick brown fox", "def add(a, b):", "Summarize: the council met", "café 😀 日本"]
PROMPT = PROMPTS[1]


@pytest.mark.parametrize("drafter", ["lookup", "model", "recycling", "hybrid"])
@pytest.mark.parametrize("draft_len", [1, 3, 8])
def test_greedy_speculative_equals_plain(engine, drafter, draft_len):
    for p in PROMPTS:
        ref = engine.generate(p, max_tokens=40, drafter="none")
        got = engine.generate(p, max_tokens=40, drafter=drafter, draft_len=draft_len)
        assert got.token_ids == ref.token_ids, (p, drafter, draft_len)
        assert got.text == ref.text


@pytest.mark.parametrize("drafter", ["model", "recycling", "hybrid"])
def test_drafters_actually_draft(engine, drafter):
    engine.generate(PROMPTS[0], max_tokens=40, drafter="recycling")  # warms Token Recycling's matrix
    r = engine.generate(PROMPTS[0], max_tokens=40, drafter=drafter, draft_len=4)
    assert r.stats.drafted > 0 and r.stats.steps < r.stats.generated


@pytest.mark.parametrize("drafter", ["none", "hybrid", "model"])
def test_time_inside_onnx_runtime_is_counted_apart_from_python(engine, drafter):
    """Stats.ort_s is decode time inside ONNX Runtime (target and drafter graphs), so Python per step is the rest:
    never below the loop's own bookkeeping, never the whole step; prefill time is not in it."""
    r = engine.generate(PROMPTS[2] * 8, max_tokens=24, drafter=drafter)
    st = r.stats
    assert st.steps > 0 and 0 < st.ort_s <= st.target_s + st.draft_s + 1e-9
    assert st.overhead_ms_per_step <= st.python_ms_per_step < 1000 * st.decode_s / st.steps
    assert r.stats.to_dict()["python_ms_per_step"] == round(st.python_ms_per_step, 3)


def test_output_views_follow_their_buffers(engine):
    """Calls reuse one output view per shape; when a wider call replaces a buffer, views of the old one are dropped
    (not kept alive), and the rows read back are the new call's."""
    g = engine.target
    wide = g._logits.size // g.vocab + 1  # wider than any call so far: the buffers grow twice below
    for s in (1, wide, 2, wide + 2, 3):
        out = g.call(list(range(7, 7 + s)), logits=True)
        rows = out.logits
        assert rows.shape == (s, g.vocab) and np.shares_memory(rows, g._logits)
        assert all(v.base is g._logits for key, v in g._views.items() if key[0] == "logits")
        assert all(v.base is g._top for key, v in g._views.items() if key[0] == "top_ids")
    np.testing.assert_array_equal(out.top_ids[:, 0], rows.argmax(-1))


def test_a_call_width_that_comes_back_finds_its_bindings(engine):
    """Each small call width keeps its own IOBinding, so a draft length that changes from step to step rebinds
    nothing once each width has been seen (only the attention bias, whose shape changes every call). That the rows
    are still each call's own is what the exactness tests check."""
    g = engine.target

    class Counting(dict):
        sets = 0

        def __setitem__(self, key, value):
            Counting.sets += 1
            super().__setitem__(key, value)

    g._bound = Counting(g._bound)
    for s in (3, 5, 3, 5):  # first sight of each width binds its buffers
        g.forward(list(range(7, 7 + s)))
    Counting.sets = 0
    for s in (3, 5, 3, 5, 3):
        g.forward(list(range(9, 9 + s)))
    assert Counting.sets == 0


def test_plain_decoding_leaves_token_recycling_alone(engine):
    """Plain decoding is the reference and does no drafting work: its steps do not feed Token Recycling."""
    before = engine.recycling.adj.copy(), engine.recycling.pair_key.copy()
    engine.generate(PROMPTS[1], max_tokens=12, drafter="none")
    assert np.array_equal(engine.recycling.adj, before[0]) and np.array_equal(engine.recycling.pair_key, before[1])
    engine.generate(PROMPTS[1], max_tokens=12, drafter="hybrid")
    assert not np.array_equal(engine.recycling.adj, before[0])


def test_logits_do_not_depend_on_call_length(engine):
    """The property losslessness rests on: a token's logits are the same alone or inside a longer verify call."""
    engine.reset()
    rng = np.random.default_rng(0)
    seq = [int(t) for t in rng.integers(1, 300, 8)]
    alone, together = logits_alone_and_together(engine.target, engine.encode("the quick brown fox"), seq)
    np.testing.assert_allclose(alone, together, atol=1e-4)
    engine.reset()


def test_stream_chunks_are_valid_utf8_and_add_up(engine):
    r = engine.generate("café 😀 日本", max_tokens=60)
    chunks = list(engine.stream("café 😀 日本", max_tokens=60))
    assert "".join(c.text for c in chunks) == r.text
    assert all("\ufffd" not in c.text or "\ufffd" in r.text for c in chunks)
    for c in chunks:
        c.text.encode("utf-8")  # never half a character
    assert chunks[-1].finish_reason in ("stop", "length")


def test_kv_rollback_round_trip(engine):
    """append → trim → regenerate gives identical logits."""
    s = engine.target
    engine.reset()
    ids = engine.encode("def add(a, b):")
    a = s.forward(ids).copy()
    s.cache.append(len(ids))
    s.forward([5, 6, 7])
    s.cache.append(3)
    s.cache.trim(3 + len(ids))
    b = s.forward(ids).copy()
    np.testing.assert_array_equal(a, b)
    engine.reset()


def test_chat_reuses_prefix_and_interrupt_keeps_consistency(tiny_dir):
    e = edge.load(tiny_dir, drafter="lookup", context=256)
    chat = e.chat()
    chat.ask("the quick brown fox", max_tokens=12)
    r2 = chat.ask("def add(a, b):", max_tokens=12)
    assert r2.stats.reused_tokens > 0
    # interrupt the third answer after two chunks
    stream = chat.send("Summarize: the council met", max_tokens=30)
    shown = [next(stream).text, next(stream).text]
    stream.close()
    assert chat.messages[-1] == {"role": "assistant", "content": "".join(shown)}
    assert e.target.cache.length == len(e.cached)
    # the next turn equals a fresh chat fed the same visible history
    nxt = chat.ask("café", max_tokens=20)
    fresh = edge.load(tiny_dir, drafter="none", context=256)
    ref = fresh.generate(chat.messages[:-1], max_tokens=20)
    assert nxt.token_ids == ref.token_ids


def test_stop_strings_and_max_tokens(engine):
    full = engine.generate(PROMPTS[1], max_tokens=40)
    assert len(full.token_ids) <= 40
    assert len(full.text) > 6, full.text  # 40 tokens of the tiny model's vocabulary
    stop = full.text[3:6]
    r = engine.generate(PROMPTS[1], max_tokens=40, stop=[stop], drafter="lookup")
    assert r.text == full.text[: full.text.index(stop)] and r.finish_reason == "stop"
    r = engine.generate(PROMPTS[1], max_tokens=5)
    assert len(r.token_ids) == 5 and r.finish_reason in ("length", "stop")


@pytest.mark.parametrize("kw,match", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"), (dict(drafter="bogus"), "drafter"),
    (dict(nonsense=1), "unknown"),
])
def test_bad_requests_fail_clearly(engine, kw, match):
    with pytest.raises(EngineError, match=match):
        engine.generate("hello", **kw)


def test_prompt_longer_than_context(tiny_dir):
    e = edge.load(tiny_dir, drafter="none", context=64)
    with pytest.raises(EngineError, match="context"):
        e.generate("the quick brown fox " * 40)


def test_model_dir_errors(tmp_path, tiny_dir):
    with pytest.raises(ModelDirError, match="edge_model.json"):
        Engine(tmp_path)
    with pytest.raises(ModelDirError, match="no such"):
        Engine(tmp_path / "missing")


def test_concurrent_use_is_refused_not_corrupting(engine):
    s1 = engine.stream(PROMPTS[0], max_tokens=10)
    next(s1)
    with pytest.raises(EngineBusy):
        next(engine.stream(PROMPTS[1], max_tokens=10))
    rest = list(s1)
    assert rest[-1].finish_reason is not None


def test_sampling_is_reproducible_for_a_seed(engine):
    # a seed reproduces the output for a fixed drafter and draft length (adaptive lengths consume randomness
    # differently from one request to the next; the distribution is the same, the sample is not)
    a = engine.generate(PROMPTS[0], max_tokens=8, temperature=1.0, seed=3, drafter="model", draft_len=3)
    b = engine.generate(PROMPTS[0], max_tokens=8, temperature=1.0, seed=3, drafter="model", draft_len=3)
    assert a.token_ids == b.token_ids
    c = engine.generate(PROMPTS[0], max_tokens=8, temperature=1.0, seed=3, drafter="none")
    assert c.token_ids == engine.generate(PROMPTS[0], max_tokens=8, temperature=1.0, seed=3, drafter="none").token_ids


@pytest.mark.parametrize("drafter,sampling", [
    ("model", dict(temperature=1.5, top_k=4)), ("model", dict(temperature=1.0, top_k=6, top_p=0.7)),
    ("recycling", dict(temperature=1.5, top_k=4))])
def test_speculative_sampling_draws_the_targets_distribution(engine, drafter, sampling):
    """End to end through the engine: speculative sampling with the trimmed-vocabulary model drafter (unseeded:
    drafts sampled from its q, with q = 0 outside its vocabulary) and with Token Recycling (deterministic drafts)
    gives the first three tokens the target's exact joint distribution (top-k 4 at temperature 1.5: 64 outcomes;
    with top-p too, so q must be cut as p is; 2000 samples, chi-square and TV at alpha 1e-6). The drafted tokens
    must be both accepted and rejected, or the test would not exercise the rule. (Every answer here was seeded,
    which since the seeded model drafter drafts its argmax left the q path untested: a q that ignored top-p, or
    was not the distribution drafted from, passed.)"""
    dist = exact_first_tokens(engine, PROMPTS[2], 3, **sampling)  # from the full logits (process_logits)
    engine.generate(PROMPTS[2], max_tokens=40, drafter="recycling")  # warms Token Recycling's matrix
    hits = engine.head_hits
    counts, drafted, accepted = speculative_first_tokens(engine, PROMPTS[2], 2000, drafter,
                                                          seeded=drafter != "model", **sampling)
    assert engine.head_hits > hits  # verification read p from the on-graph head's top 4
    assert 0 < accepted < drafted, (drafted, accepted)
    check = check_against(dist, counts)
    assert check.ok, check


@pytest.mark.parametrize("temperature", [1e-39, 1e-46, 5e-324])
@pytest.mark.parametrize("kw", [dict(top_k=1), dict(top_k=5), dict(top_p=0.9)])
def test_sampling_at_a_vanishing_temperature_is_greedy(engine, kw, temperature):
    """At a vanishing temperature the distribution is the argmax (the head shifts by the row max before dividing,
    so logits / T neither overflows nor rounds near-ties together; a temperature below float32's smallest, which
    would reach the graph as 0, is fed as that smallest): the answer is the greedy one."""
    greedy = engine.generate(PROMPTS[1], max_tokens=12, drafter="recycling")
    r = engine.generate(PROMPTS[1], max_tokens=12, temperature=temperature, seed=2, drafter="recycling", **kw)
    assert r.token_ids == greedy.token_ids


def test_sampling_at_a_huge_temperature_warns_nothing(engine, recwarn):
    r = engine.generate(PROMPTS[1], max_tokens=6, temperature=1e39, top_k=5, seed=2, drafter="recycling")
    assert r.stats.steps > 0 and not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_corrupt_model_output_while_sampling_is_a_clear_error(engine, monkeypatch):
    """A top-k cut reads only the head; a NaN row there (a corrupt model output) is a ValueError that says so."""
    import edge.engine as engine_mod

    real = engine_mod.probs_from_top

    def nan_rows(ids, probs, *a):
        return real(ids, np.full_like(probs, np.nan), *a)

    monkeypatch.setattr(engine_mod, "probs_from_top", nan_rows)
    with pytest.raises(ValueError, match="not finite; the model output is corrupt"):
        engine.generate(PROMPTS[1], max_tokens=6, temperature=0.8, top_k=5, seed=2, drafter="recycling")
    monkeypatch.undo()
    assert engine.generate(PROMPTS[1], max_tokens=4).finish_reason  # the engine still answers


@pytest.fixture(scope="module")
def nan_model(tiny_dir, tmp_path_factory):
    """A copy of the tiny export whose target outputs NaN logits once token `token` is in the context (its
    embedding row is NaN), as an fp16 overflow or corrupt weights would make it (None: from the first token on)."""
    import shutil

    import onnx
    from onnx import numpy_helper

    def make(token: int | None):
        d = tmp_path_factory.mktemp("nan") / "m"
        shutil.copytree(tiny_dir, d)
        path = d / "target" / "model.onnx"
        m = onnx.load(str(path))
        for init in m.graph.initializer:
            if init.name == ("final_norm" if token is None else "embed_tokens"):
                a = numpy_helper.to_array(init).copy()
                a[... if token is None else token] = np.nan
                init.CopyFrom(numpy_helper.from_array(a, init.name))
        (d / "target" / "model.onnx.data").unlink()
        onnx.save(m, str(path), save_as_external_data=True, location="model.onnx.data")
        return d
    return make


@pytest.mark.parametrize("drafter", ["none", "lookup", "recycling"])
def test_nan_model_output_is_a_clear_error_when_greedy_too(nan_model, engine, drafter):
    """Greedy decoding streamed token 0 to max_tokens with no error (argmax and ONNX Runtime's TopK pick index 0
    of an all-NaN row); sampling already raised. Now both say the output is corrupt, from the prefill's logits
    and from a verify call's (the on-graph TopK's logits, or the full logits)."""
    ids = engine.encode(PROMPTS[1])
    answer = engine.generate(PROMPTS[1], max_tokens=12, drafter="none").token_ids
    later = next(t for t in answer[1:] if t not in ids and t != answer[0])  # fed to a call after the prefill
    for token in (None, later):  # the prompt's own logits, then a later call's
        e = edge.load(nan_model(token), context=256, verify="none")
        with pytest.raises(ValueError, match="NaN.*the model output is corrupt"):
            e.generate(PROMPTS[1], max_tokens=12, drafter=drafter)
        with pytest.raises(ValueError, match="NaN|not finite"):
            e.generate(PROMPTS[1], max_tokens=12, drafter=drafter, temperature=0.8, seed=1)


@pytest.mark.parametrize("kw,from_head", [(dict(top_k=5), True), (dict(top_k=5, top_p=0.5), True),
                                          (dict(top_k=10**6, top_p=0.5), True),  # a cut at the vocabulary: none
                                          (dict(top_k=300), False), (dict(), False)])
def test_sampling_reads_the_on_graph_head_when_it_holds_the_cut(engine, kw, from_head):
    """A top-k cut inside the head's k is read from its probabilities; a wider one (over edge.runner.HEAD_TOPK_MAX)
    or plain temperature sampling (every token can be drawn) is processed from the logits."""
    h, m = engine.head_hits, engine.head_misses
    r = engine.generate(PROMPTS[0], max_tokens=6, temperature=0.8, seed=1, drafter="recycling", **kw)
    assert r.stats.steps > 0
    assert (engine.head_hits > h, engine.head_misses > m) == (from_head, not from_head)


def test_speculative_sampling_check_catches_a_wrong_rule(engine, monkeypatch):
    """Negative control for the test above: accepting every drafted token (no rejection, no residual) must fail
    the same check."""
    import edge.engine as engine_mod
    from kernels.sampling import sample_from

    def accept_all(tokens, P, q, rng):
        return len(tokens), sample_from(P[len(tokens)], rng)

    sampling = dict(temperature=1.5, top_k=4)
    dist = exact_first_tokens(engine, PROMPTS[2], 3, **sampling)
    monkeypatch.setattr(engine_mod, "verify_sampling", accept_all)
    counts, drafted, accepted = speculative_first_tokens(engine, PROMPTS[2], 2000, "model", **sampling)
    assert accepted == drafted > 0
    assert not check_against(dist, counts).ok


def test_memory_plan_drives_the_drafter_and_refuses_too_small_budgets(tiny_dir):
    e = edge.load(tiny_dir, drafter="auto", context=256, budget_mb=4096)
    assert e.plan is not None and e.plan.peak_mb <= 4096
    r = e.generate(PROMPTS[0], max_tokens=20)
    # the plan's drafter; a plan for plain decoding still runs the engine's own drafter within the budget
    assert r.stats.drafter == (e.plan.drafter if e.plan.drafter != "none" else e._own)
    ref = edge.load(tiny_dir, drafter="none", context=256).generate(PROMPTS[0], max_tokens=20)
    assert r.token_ids == ref.token_ids
    with pytest.raises(EngineError, match="MB") as e:
        edge.load(tiny_dir, context=256, budget_mb=1)
    assert "context 128 needs" in str(e.value) and "--plan --context 256" in str(e.value)  # which context, and how
    # to see the whole one


def test_model_drafter_without_drafter_graph_is_a_clear_error(tmp_path, tiny_llama_dir, capsys):
    from export.pipeline import ExportOptions, export_model

    out = tmp_path / "nodrafter"
    export_model(tiny_llama_dir, out, ExportOptions(precision="fp32", drafters=(), calib_new_tokens=4, max_len=256,
                                                    parity=False), progress=False)
    e = edge.load(out, drafter="lookup", context=256)
    with pytest.raises(ModelDirError, match="no drafter graph"):
        e.generate("hi", max_tokens=4, drafter="model")
    from edge.chat import main  # --plan plans from the manifest alone, and refuses the same way

    assert main(["--model", str(out), "--plan", "--drafter", "model", "--context", "64"]) == 2
    assert f"edge-chat: error: {out}: no drafter graph" in capsys.readouterr().err


@pytest.mark.parametrize("drafter", ["none", "model", "recycling"])
def test_eos_is_a_token_not_text(tiny_dir, drafter):
    """An end-of-sequence token stops the answer where it is generated, stays in token_ids and never reaches the
    text. With recycling it arrives inside an accepted draft (a check of only the step's last token fails that
    case; the model drafter's few accepted drafts do not reach it). The random tiny model seldom emits its real
    EOS, so a token of its plain answer is made the EOS."""
    e = edge.load(tiny_dir, drafter="none", context=256)
    refs = {p: e.generate(p, max_tokens=30).token_ids for p in PROMPTS}
    # a token first generated at position >= 5 (the random model's answers are mostly repeats)
    p, j = next((p, i) for p, ref in refs.items() for i in range(5, len(ref)) if ref[i] not in ref[:i])
    ref = refs[p]
    e.eos = {ref[j]}
    r = e.generate(p, max_tokens=30, drafter=drafter, draft_len=4)
    assert r.finish_reason == "stop" and r.token_ids == ref[: j + 1]
    assert r.text == e.codec.decode(ref[:j])


def test_drafts_accepted_after_an_eos_are_not_counted(tiny_dir, monkeypatch):
    """A step whose accepted drafts run past an EOS emits only up to the EOS; the drafts after it were verified
    but never emitted, so neither the chunk's `drafted` nor `Stats.accepted` counts them (a 1-token last chunk
    reported 2 drafted). The tiny model never accepts a run like that by itself, so the step is staged: lookup
    drafts [a, EOS, b] and the verify call accepts all three."""
    from edge.drafters import Draft, LookupDrafter

    e = edge.load(tiny_dir, drafter="lookup", context=256)
    first = e.generate("hi", max_tokens=1, drafter="none").token_ids[0]
    a, eos, b, bonus = [t for t in range(3, 20) if t != first][:4]  # ids other than the answer's first token
    e.eos = {eos}
    monkeypatch.setattr(LookupDrafter, "draft", lambda self, budget: Draft.chain([a, eos, b]))
    monkeypatch.setattr(e, "_verify", lambda root, d, *args, **kw: ([root] + d.tokens.tolist(), None, bonus))
    chunks = list(e.stream("hi", max_tokens=16, drafter="lookup", draft_len=3))
    st = e.last_stats
    assert [t for c in chunks for t in c.token_ids] == [first, a, eos] and chunks[-1].finish_reason == "stop"
    assert chunks[-1].drafted == 2  # a and the EOS; b was accepted but never emitted
    assert st.accepted == 2 and st.drafted == 3 and st.generated == 3


def _without_head(model_dir, out_dir):
    """A copy of `model_dir` whose target graph is as export graph version 4 wrote it: a TopK with a constant k of
    8 and no head inputs or probabilities (the exports users made before the head)."""
    import json
    import shutil

    import onnx
    from onnx import helper, numpy_helper

    from edge.manifest import sha256_file

    shutil.copytree(model_dir, out_dir)
    m = json.loads((out_dir / "edge_model.json").read_text())
    path = out_dir / next(g["file"] for g in m["graphs"] if g["role"] == "target")
    model = onnx.load(str(path), load_external_data=False)
    g = model.graph
    topk = next(n for n in g.node if n.op_type == "TopK")
    topk.input[1] = "topk_k"
    g.initializer.append(numpy_helper.from_array(np.array([8], np.int64), "topk_k"))
    keep = [n for n in g.node if n.op_type != "If"]
    del g.node[:]
    g.node.extend(keep)
    for name in ("top_k", "temperature", "sample"):
        g.input.remove(next(i for i in g.input if i.name == name))
    for o in [o for o in g.output if o.name.startswith("top_")]:
        g.output.remove(o)
        if o.name != "top_probs":
            g.output.append(helper.make_tensor_value_info(o.name, o.type.tensor_type.elem_type, [1, "R", 8]))
    onnx.save(model, str(path))
    rel = str(path.relative_to(out_dir))
    for f in m["files"]:
        if f["path"] == rel:
            f.update(bytes=path.stat().st_size, sha256=sha256_file(path))
    (out_dir / "edge_model.json").write_text(json.dumps(m))
    return out_dir


def test_exports_from_before_the_head_still_decode_and_sample(tiny_dir, engine, tmp_path):
    old = edge.load(_without_head(tiny_dir, tmp_path / "v4"), drafter="none", context=256)
    assert not old.target.head and engine.target.head and old.target.topk == 8
    for drafter in ("none", "recycling"):
        assert old.generate(PROMPTS[2], max_tokens=16, drafter=drafter).token_ids == \
            engine.generate(PROMPTS[2], max_tokens=16, drafter=drafter).token_ids
    r = old.generate(PROMPTS[2], max_tokens=16, temperature=0.8, top_k=5, seed=4, drafter="recycling")
    assert r.stats.steps > 0 and old.head_hits == 0 and old.head_misses > 0  # p from the logits, as before


def test_blank_prompts_are_refused(engine):
    """A blank question is refused with a reason (edge-chat's REPL skips blank lines; the API said nothing and
    answered a template with an empty user turn)."""
    for bad in ("", "   \n"):
        with pytest.raises(EngineError, match="empty prompt"):
            engine.generate(bad, max_tokens=4)
        with pytest.raises(EngineError, match="empty message"):
            engine.chat().ask(bad, max_tokens=4)
    with pytest.raises(EngineError, match="a chat message is a string"):
        engine.chat().ask(123, max_tokens=4)
    assert engine.generate("hi", max_tokens=2).token_ids  # a real question still goes through


def test_load_names_what_is_wrong_with_its_arguments(tmp_path):
    f = tmp_path / "model.onnx"
    f.write_text("not a directory")
    with pytest.raises(ModelDirError, match="is a file, not a model directory"):
        edge.load(f)
    with pytest.raises(EngineError, match="budget_mb must be a number"):
        edge.load(tmp_path, budget_mb="600")
    with pytest.raises(ModelDirError):  # a numpy number is a number: the next problem is the empty directory
        edge.load(tmp_path, budget_mb=np.int64(600))


def test_an_unfinished_stream_makes_the_next_call_busy_and_says_so(engine):
    s = engine.stream("hi", max_tokens=8)
    next(s)
    with pytest.raises(EngineBusy, match="earlier stream"):
        engine.generate("hi", max_tokens=2)
    s.close()
    assert engine.generate("hi", max_tokens=2).token_ids


def test_sessions_do_not_trace_memory_patterns():
    """Decoding never repeats an input shape (the mask grows a column per token), so ORT's per-shape memory pattern
    cache only ever grew (~49 KB per token on the embedded model, about as much as the KV cache itself). Every
    runtime and export-time session is built with it off."""
    from edge.runner import session_options

    assert session_options(2).enable_mem_pattern is False


# ------------------------------------------------------------------------------ bookkeeping behind correct answers
# A loop can get each of these wrong and still answer correctly (an extra call at max_tokens, counters, reuse, reset,
# the drafters' own state, the cache after a stop), so they are checked directly.


def test_an_answer_ending_at_max_tokens_costs_no_extra_call(fresh):
    chunks = list(fresh.stream("def add(a, b):", max_tokens=5, drafter="none"))
    assert all(c.token_ids for c in chunks)  # no empty last chunk
    assert fresh.last_stats.steps == 4 and sum(len(c.token_ids) for c in chunks) == 5  # the prefill gave the first


@pytest.mark.parametrize("drafter", ["lookup", "hybrid", "model"])
def test_chunk_provenance_adds_up_to_the_accepted_drafts(fresh, drafter):
    chunks = list(fresh.stream("abc abc abc abc abc", max_tokens=40, drafter=drafter, draft_len=4))
    assert chunks[0].drafted == 0  # the prefill's token was never drafted
    assert all(c.drafted <= max(0, len(c.token_ids) - 1) for c in chunks)  # a step's bonus token was not drafted
    assert sum(c.drafted for c in chunks) == fresh.last_stats.accepted


def test_drafted_counts_every_drafted_token_and_only_those(fresh, monkeypatch):
    from edge.drafters import LookupDrafter

    made, real = [], LookupDrafter.draft

    def draft(self, budget):
        d = real(self, budget)
        made.append(len(d.tokens))
        return d
    monkeypatch.setattr(LookupDrafter, "draft", draft)
    st = fresh.generate("abc abc abc abc abc", max_tokens=40, drafter="lookup", draft_len=4).stats
    assert st.drafted == sum(made) > 0


def test_reset_forgets_the_drafters_unless_asked(fresh):
    fresh.generate("the quick brown fox", max_tokens=16, drafter="recycling")
    adj = fresh.recycling.adj.copy()
    fresh.reset(keep_drafter_state=True)
    assert fresh.recycling.seen.any() and np.array_equal(fresh.recycling.adj, adj)
    fresh.reset()
    assert not fresh.recycling.seen.any() and fresh.lookup.history == []


def test_reused_tokens_is_the_real_common_prefix(fresh):
    fresh.generate("the quick brown fox", max_tokens=8)
    before = list(fresh.cached)
    ids = fresh.encode("def add(a, b):")
    lcp = next((i for i, (a, b) in enumerate(zip(before, ids)) if a != b), min(len(before), len(ids)))
    assert fresh.generate("def add(a, b):", max_tokens=4).stats.reused_tokens == min(lcp, len(ids) - 1)


def test_a_chat_turn_prefills_only_its_new_tokens(tiny_dir):
    """Re-prefilling the whole history every turn gave the same answers, only slower, with the stats still
    claiming reuse: count the rows the target actually ran."""
    e = edge.load(tiny_dir, drafter="lookup", context=256)
    chat = e.chat()
    chat.ask("the quick brown fox", max_tokens=12)
    rows, real = [], e.target.forward
    e.target.forward = lambda ids, *a, **k: (rows.append(len(ids)), real(ids, *a, **k))[1]
    r = chat.ask("def add(a, b):", max_tokens=1)
    del e.target.forward
    assert r.stats.reused_tokens > 0 and rows[0] == r.stats.prompt_tokens - r.stats.reused_tokens


def test_recycling_pairs_are_keyed_on_the_committed_token_before(fresh):
    prompt = fresh.encode("def add(a, b):")
    r = fresh.generate("def add(a, b):", max_tokens=30, drafter="recycling", draft_len=0)
    t = prompt + r.token_ids
    last = {(t[i - 1], t[i]): i for i in range(len(prompt), len(t) - 1)}  # a pair's latest verify call wins
    idx = [i for (a, b), i in last.items() if a != b]
    assert len(idx) >= 5
    assert all(fresh.recycling.pair_successor(t[i - 1], t[i]) == t[i + 1] for i in idx)


def test_the_model_drafters_context_tracks_the_target(tiny_dir, monkeypatch):
    """Keeping a rejected draft in the drafter's own cache stays lossless but conditions every later draft on a
    token the target never accepted."""
    from edge.drafters import ModelDrafter

    e = edge.load(tiny_dir, drafter="model", context=256)
    real, checked = ModelDrafter.accept, []

    def accept(self, tokens):
        real(self, tokens)
        assert self.sess.cache.tokens + self.pending == e.cached + [int(tokens[-1])]
        checked.append(len(tokens))
    monkeypatch.setattr(ModelDrafter, "accept", accept)
    for p in ("def add(a, b):", "Summarize: the council met"):
        e.generate(p, max_tokens=30, draft_len=4)
    assert any(n < 5 for n in checked) and e.last_stats.drafted > 0  # some drafts were rejected


def test_the_cache_holds_exactly_the_emitted_tokens_after_a_stop(fresh):
    prompt = "abc abc abc abc abc abc abc abc abc abc"
    text = fresh.generate(prompt, max_tokens=40).text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    for kind in ("lookup", "hybrid"):
        fresh.reset()
        r = fresh.generate(prompt, max_tokens=40, drafter=kind, stop=[stop])
        assert r.finish_reason == "stop"
        assert fresh.cached == fresh.encode(prompt) + r.token_ids[:-1]
        assert fresh.target.cache.length == len(fresh.cached)


def test_drafter_state_round_trip(model):
    import numpy as np

    import edge

    e = edge.load(model, drafter="none", context=256)
    e.generate("the quick brown fox", max_tokens=8, drafter="recycling")
    state = e.drafter_state()
    adj = e.recycling.adj.copy()
    e.generate("one two three four five", max_tokens=8, drafter="recycling")
    assert not np.array_equal(e.recycling.adj, adj)  # the second answer taught it something
    e.set_drafter_state(state)
    assert np.array_equal(e.recycling.adj, adj)
    e.recycling.adj[:] = 0  # the snapshot is a copy, not the live tables
    e.set_drafter_state(state)
    assert np.array_equal(e.recycling.adj, adj)


def test_chat_reset_keeps_the_system_message(fresh):
    chat = fresh.chat(system="Be terse.")
    chat.ask("hi", max_tokens=3)
    chat.reset()
    assert chat.messages == [{"role": "system", "content": "Be terse."}]


# ------------------------------------------------------------------------------ stop strings and finish reasons

@pytest.mark.parametrize("drafter", ["none", "lookup"])
def test_an_eos_that_is_also_the_last_allowed_token_finishes_as_stop(fresh, monkeypatch, drafter):
    """The answer ended because the model ended it: finish_reason "stop", even when max_tokens ends there too."""
    refs = {p: fresh.generate(p, max_tokens=30).token_ids for p in (PROMPT, "the quick brown fox", "café 😀 日本")}
    p, j = next((p, i) for p, ref in refs.items() for i in range(3, len(ref)) if ref[i] not in ref[:i])
    monkeypatch.setattr(fresh, "eos", {refs[p][j]})
    r = fresh.generate(p, max_tokens=j + 1, drafter=drafter)
    assert r.token_ids == refs[p][: j + 1] and r.finish_reason == "stop"


def test_a_stop_string_given_as_a_string_is_one_stop_string(fresh):
    full = fresh.generate(PROMPT, max_tokens=40).text
    # a stop string some of whose characters occur before it: each of them alone would cut the answer earlier
    stop = next(s for s in (full[i : i + 3] for i in range(3, len(full) - 3))
                if min(map(full.index, s)) < full.index(s))
    r = fresh.generate(PROMPT, max_tokens=40, stop=stop)
    assert r.text == full[: full.index(stop)] and r.finish_reason == "stop"


def test_of_two_stop_strings_completed_by_one_token_the_earlier_one_cuts(fresh):
    """Two stop strings ending at the same character: the answer ends before the one that starts first."""
    full = fresh.generate(PROMPT, max_tokens=40).text
    # both first occur where they end at i + 3 (else one of them alone would stop the answer earlier)
    i = next(i for i in range(2, len(full) - 3)
             if full.find(full[i : i + 3]) == i and full.find(full[i + 1 : i + 3]) == i + 1)
    long, short = full[i : i + 3], full[i + 1 : i + 3]
    for stop in ([long, short], [short, long]):
        r = fresh.generate(PROMPT, max_tokens=40, stop=stop)
        assert r.text == full[:i] and r.finish_reason == "stop", stop


def test_stop_none_means_no_stop_strings(fresh):
    assert fresh.generate(PROMPT, max_tokens=6, stop=None).token_ids == fresh.generate(PROMPT, max_tokens=6).token_ids


# ------------------------------------------------------------------------------ sampling details

@pytest.mark.parametrize("top_k", [255, 256])
def test_a_top_k_cut_at_the_heads_full_k_is_read_from_the_head(fresh, top_k):
    """top_k up to HEAD_TOPK_MAX (256) is inside the on-graph head's k: read exactly from its probabilities, the
    logits never fetched."""
    from edge.runner import HEAD_TOPK_MAX

    assert HEAD_TOPK_MAX == 256 < fresh.target.vocab
    r = fresh.generate(PROMPT, max_tokens=6, temperature=0.8, top_k=top_k, seed=1, drafter="recycling")
    assert r.stats.steps > 0 and fresh.head_hits > 0 and fresh.head_misses == 0


@pytest.mark.parametrize("kw", [dict(top_p=1e-6), dict(top_k=1)])
def test_an_unseeded_model_drafter_drafts_from_its_distribution_cut_as_the_request_asks(fresh, monkeypatch, kw):
    """Sampled drafts come from the drafter's distribution under the request's top-k and top-p, like the target's
    p: with a cut that keeps one token, every q row is a point mass (a q over the whole vocabulary stays lossless
    but drafts tokens the target can never accept)."""
    from edge.drafters import ModelDrafter

    qs, real = [], ModelDrafter.draft

    def draft(self, budget):
        d = real(self, budget)
        qs.extend([] if d.q is None else d.q)
        return d
    monkeypatch.setattr(ModelDrafter, "draft", draft)
    fresh.generate(PROMPT, max_tokens=12, temperature=1.0, drafter="model", draft_len=3, **kw)
    assert qs and all(q.max() == 1.0 for q in qs)


def test_unseeded_sampling_differs_between_requests_and_a_seed_repeats(fresh):
    """seed=None draws fresh randomness for every request, never a fixed seed; the same seed repeats its answer. On
    the tiny random model the next-token distribution is nearly flat over its vocabulary, so two unseeded 16-token
    answers coincide with negligible probability."""
    runs = [fresh.generate(PROMPT, max_tokens=16, temperature=1.0).token_ids for _ in range(3)]
    assert len({tuple(r) for r in runs}) > 1
    a, b = (fresh.generate(PROMPT, max_tokens=16, temperature=1.0, seed=7).token_ids for _ in range(2))
    assert a == b
