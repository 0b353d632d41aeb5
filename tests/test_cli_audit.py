"""A mutation audit of edge/manifest.py, edge/text.py and edge/chat.py (session 23): each test catches a plausible
one-line bug that every other test let through (named in its docstring). Fast: no subprocesses unless noted; the
model-directory tests reuse the session export (tiny_dir) from tests/conftest.py."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from edge import args, chat as cli
from edge.manifest import MANIFEST_NAME, ModelDirError, load_manifest


# ----------------------------------------------------------------------------- edge/chat.py: flag parsing

def _parse(*argv):
    return cli._parser().parse_args(list(argv))


def test_temp_zero_is_a_valid_greedy_temperature():
    """cli.py:58 non_negative_float `0 <= x` -> `0 < x`: `--temp 0` (documented as greedy) would be refused; the
    suite never passed it explicitly (the default 0.0 bypasses the type)."""
    assert _parse("--temp", "0").temp == 0.0
    assert _parse("--temp", "0.7").temp == 0.7


def test_top_p_one_is_accepted():
    """cli.py:59 unit_fraction `x <= 1` -> `x < 1`: `--top-p 1` (the documented default, "in (0, 1]") refused."""
    assert _parse("--top-p", "1").top_p == 1.0


def test_budget_mb_zero_is_refused_by_name(capsys):
    """cli.py:57 positive_float `0 < x` -> `0 <= x`: `--budget-mb 0` accepted (the suite only tried -5)."""
    with pytest.raises(SystemExit) as ei:
        _parse("--budget-mb", "0", "--plan")
    assert ei.value.code == 2 and "--budget-mb" in capsys.readouterr().err


# ----------------------------------------------------------------------------- edge/manifest.py: bad model dirs

def test_directory_with_only_a_config_json_is_not_called_a_checkpoint(tmp_path):
    """manifest.py:165 `config.json and *.safetensors` -> `or`: a directory holding only a config.json (or only
    safetensors) is no checkpoint; it must get the "not a complete edgespec export" message, not the advice to
    export it as a checkpoint."""
    d = tmp_path / "stuff"
    d.mkdir()
    (d / "config.json").write_text("{}")
    with pytest.raises(ModelDirError) as ei:
        load_manifest(d)
    assert "holds a model checkpoint" not in str(ei.value) and "not a complete edgespec export" in str(ei.value)


@pytest.fixture
def model_copy(tiny_dir, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(tiny_dir, out)
    return out


def test_reexport_command_names_the_recorded_source_checkpoint(model_copy):
    """manifest.py:197 source path read from the wrong key (`source.format`): the fix in every load error must be
    the runnable command with the checkpoint the export was built from, not the CHECKPOINT placeholder."""
    raw = json.loads((model_copy / MANIFEST_NAME).read_text())
    src = raw["source"]["path"]
    assert src
    victim = model_copy / raw["files"][0]["path"]
    victim.write_bytes(victim.read_bytes()[:-1])  # truncated
    with pytest.raises(ModelDirError) as ei:
        load_manifest(model_copy, verify="size")
    assert f"edge-export {src} -o {model_copy}" in str(ei.value), str(ei.value)


# ----------------------------------------------------------------------------- edge/chat.py: start-up checks

def _fake_engine(context: int, empty_tokens: int, max_len: int = 256):
    from types import SimpleNamespace

    return SimpleNamespace(context=context, encode=lambda msgs: [0] * empty_tokens,
                           manifest=SimpleNamespace(target=SimpleNamespace(max_len=max_len)))


def test_context_exactly_an_empty_question_cannot_hold_a_chat():
    """cli.py:79 `engine.context > empty` -> `>=`: a context exactly as long as the empty question leaves no room
    for a single answer token and must be refused at start (one more token is enough)."""
    assert args.chat_context_problem(_fake_engine(context=20, empty_tokens=20)) is not None
    assert args.chat_context_problem(_fake_engine(context=21, empty_tokens=20)) is None


def test_context_refusal_names_the_default_this_export_allows():
    """cli.py:84 `min(DEFAULT_CONTEXT, max_len)` -> `max`: the refusal must quote the default context the export
    can actually hold (its max_len when smaller than 4096), not one edge.load would itself refuse."""
    msg = args.chat_context_problem(_fake_engine(context=10, empty_tokens=30, max_len=256))
    assert "--context 10 cannot hold a chat" in msg and "(default 256)" in msg, msg
    assert "need 94 or more" in msg, msg


def _params_of(*argv) -> dict:
    return cli._params(_parse(*argv))


def test_flag_defaults_are_the_documented_ones():
    """cli.py:98/131 a default changed (threads 2 -> 1, max-tokens 512 -> 256, ...): the help texts promise these."""
    a = _parse()
    assert (a.threads, a.max_tokens, a.temp, a.top_p, a.top_k, a.seed, a.drafter, a.overflow, a.stop) == \
        (2, 512, 0.0, 1.0, 0, None, "auto", "refuse", [])


def test_every_stop_string_and_sampling_flag_reaches_the_engine():
    """cli.py:151-152 _params dropping a flag (`stop=tuple(a.stop[:1])`, `top_k=0`): repeated --stop strings and
    --top-k must all be passed to generation."""
    p = _params_of("--stop", "A", "--stop", "B", "--top-k", "7", "--top-p", "0.5", "--temp", "0.3", "--seed", "4",
                   "--max-tokens", "9")
    assert p == dict(max_tokens=9, temperature=0.3, top_p=0.5, top_k=7, seed=4, stop=("A", "B"))


def test_json_fields_carry_the_right_counters():
    """cli.py:162-166 _result_json a wrong value behind a key (finish_reason fixed, mean_accepted_len from
    accepted/steps, prompt_tokens from reused_tokens): the suite only checked the keys exist."""
    from edge.engine import GenerationResult, Stats

    st = Stats(prompt_tokens=30, reused_tokens=12, generated=9, steps=4, drafted=6, accepted=5, prefill_s=0.25,
               decode_s=1.0, drafter="lookup")
    out = cli._result_json(GenerationResult("hey", [1, 2, 3], "stop_string"), st)
    assert out["finish_reason"] == "stop_string" and out["text"] == "hey" and out["token_ids"] == [1, 2, 3]
    assert out["mean_accepted_len"] == 2.0  # (generated - 1) / steps: tokens per verify call
    assert out["prompt_tokens"] == 30 and out["drafted"] == 6 and out["accepted"] == 5 and out["steps"] == 4
    assert out["prefill_ms"] == 250.0 and out["decode_tok_s"] == 8.0 and out["drafter"] == "lookup"


def test_json_answer_reports_load_time(capsys):
    """cli.py:359 `out["load_s"]` dropped from --prompt --json (not in the suite's key list)."""
    import argparse

    from edge.engine import Chunk, Stats

    class Engine:
        last_stats = None

        def stream(self, *a, **kw):
            self.last_stats = Stats(generated=1, steps=0, drafter="none")
            yield Chunk("Hi", [5], 0, "length")

    a = argparse.Namespace(prompt="hi", system=None, drafter="none", max_tokens=1, temp=0.0, top_p=1.0, top_k=0,
                           seed=None, stop=[])
    assert cli._answer_json(Engine(), a, 1.234) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["load_s"] == 1.23 and out["finish_reason"] == "length"


# ----------------------------------------------------------------------------- edge/chat.py: the REPL, in process

class _Chat:
    def __init__(self, engine, system, overflow):
        self.engine, self.system, self.overflow = engine, system, overflow
        self.resets, self.sends = 0, []

    def reset(self):
        self.resets += 1

    def send(self, line, **kw):
        self.sends.append((line, kw))
        return self.engine.answer(line)


class _Engine:
    """What _repl uses of an Engine; `raises` maps a question to the exception its stream raises."""

    def __init__(self, max_len=256, raises=None):
        from types import SimpleNamespace

        from edge.engine import Stats

        self.manifest = SimpleNamespace(name="fake", target=SimpleNamespace(max_len=max_len))
        self.default_drafter, self.plan, self.context = "lookup", None, 200
        self.target = SimpleNamespace(cache=SimpleNamespace(length=17))
        self.last_stats = Stats(generated=2, steps=1, drafter="lookup")
        self.raises, self.chats = raises or {}, []

    def chat(self, system=None, overflow="refuse"):
        self.chats.append(_Chat(self, system, overflow))
        return self.chats[-1]

    def answer(self, line):
        from edge.engine import Chunk

        if line in self.raises:
            raise self.raises[line]
        yield Chunk("ok", [7], 0, "length")


def _repl(monkeypatch, engine, lines, *argv):
    feed = iter(lines)

    def fake_input(prompt=""):
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)
    return cli._repl(engine, _parse(*argv))


def test_repl_exit_is_an_alias_of_quit(monkeypatch):
    """cli.py:198 "/exit" dropped from the quit commands: it would fall through to "unknown command" and the
    session would go on (the question after it would be answered)."""
    e = _Engine()
    assert _repl(monkeypatch, e, ["/exit", "after exit"]) == 0
    assert e.chats[0].sends == []


def test_repl_reset_forgets_the_conversation(monkeypatch, capsys):
    """cli.py:201 chat.reset() dropped: /reset only printed "(conversation cleared)"."""
    e = _Engine()
    assert _repl(monkeypatch, e, ["hello", "/reset", "/quit"]) == 0
    assert e.chats[0].resets == 1 and "conversation cleared" in capsys.readouterr().err


def test_repl_passes_system_prompt_drafter_and_overflow(monkeypatch):
    """cli.py:186/213 --system, --overflow or --drafter not passed to the chat (engine.chat(overflow=...) without
    system; chat.send without drafter)."""
    e = _Engine()
    _repl(monkeypatch, e, ["hi", "/quit"], "--system", "be brief", "--overflow", "drop_oldest", "--drafter",
          "recycling", "--stop", "X", "--max-tokens", "5")
    c = e.chats[0]
    assert (c.system, c.overflow) == ("be brief", "drop_oldest")
    assert c.sends[0][0] == "hi" and c.sends[0][1]["drafter"] == "recycling"
    assert c.sends[0][1]["stop"] == ("X",) and c.sends[0][1]["max_tokens"] == 5


def test_repl_stats_reports_the_cache_length_as_context_tokens(monkeypatch, capsys):
    """cli.py:173 /stats "context_tokens" from the wrong field (engine.context instead of the KV cache length)."""
    e = _Engine()
    _repl(monkeypatch, e, ["hi", "/stats json", "/quit"])
    err = capsys.readouterr().err
    info = json.loads(err[err.index("{"): err.rindex("}") + 1])
    assert info["context_tokens"] == 17 and info["last_answer"]["generated"] == 2


def test_repl_question_too_long_for_the_whole_export_says_so(monkeypatch, capsys):
    """cli.py:227 `e.context < most` -> `<=`: at the export's maximum context, "restart with a larger --context"
    is advice that cannot work; it must say the export holds no more."""
    from edge.engine import ContextFull

    e = _Engine(max_len=256, raises={"long": ContextFull("too long", n=300, context=256, alone=True),
                                     "mid": ContextFull("too long", n=300, context=128, alone=True)})
    assert _repl(monkeypatch, e, ["long", "mid", "/quit"]) == 0
    err = capsys.readouterr().err.splitlines()
    first, second = [ln for ln in err if ln.startswith("error:")]
    assert "this export holds no more" in first and "larger --context" not in first, first
    assert "larger --context (this export holds up to 256)" in second, second


def test_repl_drop_oldest_refusal_is_the_engines_message(monkeypatch, capsys):
    """cli.py:232 overflow test inverted: with --overflow drop_oldest, advising "--overflow drop_oldest" is wrong."""
    from edge.engine import ContextFull

    e = _Engine(raises={"q": ContextFull("the engine's own words", n=300, context=128, alone=False)})
    _repl(monkeypatch, e, ["q", "/quit"], "--overflow", "drop_oldest")
    err = capsys.readouterr().err
    assert "error: the engine's own words" in err and "restart edge-chat with --overflow" not in err, err


# ----------------------------------------------------------------------------- edge/manifest.py: drafter checks

def test_zero_logit_drafter_with_an_empty_id_map_is_refused(tiny_dir, tmp_path):
    """manifest.py:246 `0 < g.vocab` -> `0 <= g.vocab`: a drafter with no logits (and an empty id map, which every
    later check passes vacuously) must be refused at load time, not crash at its first draft."""
    import dataclasses

    import numpy as np

    from edge.manifest import check_drafter

    m = load_manifest(tiny_dir, verify="none")
    np.save(tmp_path / "empty.npy", np.zeros(0, np.int64))
    g = dataclasses.replace(m.drafters[0], vocab=0, id_map="empty.npy")
    with pytest.raises(ModelDirError, match="0-token vocabulary"):
        check_drafter(tmp_path, m, g)
    check_drafter(tiny_dir, m, m.drafters[0])  # the real one passes


@pytest.mark.parametrize("ids, why", [
    (lambda m, g: np.arange(g.vocab - 1, dtype=np.int64), "shorter than the drafter's logits"),
    (lambda m, g: np.arange(m.arch["vocab"] - g.vocab + 1, m.arch["vocab"] + 1, dtype=np.int64), "id == vocab"),
    (lambda m, g: np.arange(g.vocab, dtype=np.float64), "float ids"),
    (lambda m, g: np.arange(-1, g.vocab - 1, dtype=np.int64), "id -1"),
])
def test_id_map_off_by_one_is_refused(tiny_dir, tmp_path, ids, why):
    """manifest.py:259 `len(ids) != g.vocab` -> `>` (a map one entry short: logit index g.vocab-1 has no token) and
    manifest.py:262 `ids.max() >= vocab` -> `>` (a map naming token id == vocab, one past the target's table), and
    manifest.py:259 `kind not in "iu"` -> `"iuf"` (a float map, which cannot index token ids), and
    manifest.py:262 `ids.min() < 0` -> `< -1` (id -1, which numpy would silently read as the last token)."""
    import dataclasses

    from edge.manifest import check_drafter

    m = load_manifest(tiny_dir, verify="none")
    g = m.drafters[0]
    np.save(tmp_path / "map.npy", ids(m, g))
    with pytest.raises(ModelDirError, match="drafter id map"):
        check_drafter(tmp_path, m, dataclasses.replace(g, id_map="map.npy"))


# ----------------------------------------------------------------------------- edge/text.py: byte-level detection

def _codec(tmp_path, vocab: dict, decoder: dict | None):
    from tokenizers import Tokenizer, models

    from edge.text import TextCodec

    spec = json.loads(Tokenizer(models.WordLevel(vocab, unk_token=next(iter(vocab)))).to_str())
    spec["decoder"] = decoder
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    return TextCodec(tmp_path / "tokenizer.json", None, None, ())


def _streamed(codec, ids, cuts=()):
    from edge.text import StreamDecoder

    dec, out, prev = StreamDecoder(codec), [], 0
    for c in list(cuts) + [len(ids)]:
        out.append(dec.push(ids[prev:c]))
        prev = c
    return out + [dec.flush()]


BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}


def test_an_unknown_decoder_step_before_byte_level_takes_the_redecoding_path(tmp_path):
    """text.py:97 the allowed steps before ByteLevel widened (e.g. Strip added): a Strip decoder changes the text,
    so streaming token bytes would print "ab ba" where the tokenizer decodes "b b"."""
    codec = _codec(tmp_path, {"a": 0, "Ġb": 1, "ab": 2}, {"type": "Sequence", "decoders": [
        {"type": "Strip", "content": "a", "start": 1, "stop": 0}, BYTE_LEVEL]})
    assert not codec.byte_level
    assert "".join(_streamed(codec, [2, 1, 0], [1])) == codec.decode([2, 1, 0])


# ----------------------------------------------------------------------------- edge/chat.py: --plan (no model load)

def test_plan_at_the_exports_full_context_and_as_json(tiny_dir, capsys):
    """cli.py:266 `a.context > max_len` -> `>=` (the export's own maximum refused), cli.py:295 `--json` refused with
    --plan (`not a.plan` dropped), cli.py:277 a plan over budget exiting 2 (a usage error) instead of 3."""
    from edge.manifest import load_manifest as lm

    most = lm(tiny_dir, verify="none").target.max_len
    rc = cli.main(["--model", str(tiny_dir), "--plan", "--json", "--context", str(most), "--drafter", "lookup"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == (0 if rep["fits"] else 3)
    rc = cli.main(["--model", str(tiny_dir), "--plan", "--json", "--budget-mb", "1", "--drafter", "lookup"])
    rep = json.loads(capsys.readouterr().out)
    assert rep["fits"] is False and rc == 3
    assert cli.main(["--model", str(tiny_dir), "--plan", "--context", str(most + 1)]) == 2
    assert f"--context {most + 1} is more than the {most} tokens" in capsys.readouterr().err


# ----------------------------------------------------------------------------- edge/text.py: chat templates

def _template_codec(tmp_path, template, bos=1, eos=(2, 3)):
    from tokenizers import Tokenizer, models

    from edge.text import TextCodec

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|eot|>": 3}
    (tmp_path / "tokenizer.json").write_text(Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).to_str())
    return TextCodec(tmp_path / "tokenizer.json", template, bos, eos)


def test_template_gets_bos_and_the_first_eos_token(tmp_path):
    """text.py:69-70 bos_token/eos_token rendered from the wrong id (bos from eos, or eos[-1] when the export lists
    several end tokens): templates that write {{ bos_token }} / {{ eos_token }} (Llama, Mistral, Gemma) prompt
    with the wrong special tokens."""
    codec = _template_codec(tmp_path, "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}"
                                      "{% endfor %}")
    assert codec.render([{"role": "user", "content": "hi"}]) == "<s>hi</s>"


def test_template_blocks_on_their_own_lines_leave_no_newlines(tmp_path):
    """text.py:64 trim_blocks=True dropped: Hugging Face renders chat templates with trim_blocks and lstrip_blocks,
    so a template written one block per line must not put a newline before every message."""
    codec = _template_codec(tmp_path, "{% for m in messages %}\n  {% if m['role'] == 'user' %}\n"
                                      "U:{{ m['content'] }}\n  {% endif %}\n{% endfor %}\n"
                                      "{% if add_generation_prompt %}\nA:{% endif %}")
    assert codec.render([{"role": "user", "content": "hi"}]) == "U:hi\nA:"
    assert codec.render([{"role": "user", "content": "hi"}], add_generation_prompt=False) == "U:hi\n"


def test_no_template_adds_the_assistant_prefix_only_when_asked(tmp_path):
    """text.py:57 the plain "role: content" fallback ignoring add_generation_prompt=False (always "assistant: ")."""
    codec = _template_codec(tmp_path, None)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert codec.render(msgs) == "system: be brief\nuser: hi\nassistant: "
    assert codec.render(msgs, add_generation_prompt=False) == "system: be brief\nuser: hi\n"


# ----------------------------------------------------------------------------- edge/chat.py: main() with a fake load

class _PromptEngine:
    def __init__(self):
        from types import SimpleNamespace

        from edge.engine import Stats

        self.context, self.calls = 256, []
        self.manifest = SimpleNamespace(target=SimpleNamespace(max_len=256))
        self.last_stats = Stats(generated=1, drafter="none")

    def encode(self, msgs):
        return [0] * 10

    def stream(self, msgs, **kw):
        from edge.engine import Chunk

        self.calls.append((msgs, kw))
        yield Chunk("answer", [5], 0, "length")


@pytest.mark.parametrize("json_out", [False, True])
def test_prompt_sends_the_system_prompt_and_flags(monkeypatch, capsys, json_out):
    """cli.py:334 / 351 --system dropped from the one-shot --prompt (plain or --json), or --drafter not passed."""
    import edge

    e = _PromptEngine()
    monkeypatch.setattr(edge, "load", lambda *a, **kw: e)
    rc = cli.main(["--model", "x", "--prompt", "hi", "--system", "be brief", "--drafter", "lookup",
                   *(["--json"] if json_out else [])])
    assert rc == 0
    msgs, kw = e.calls[0]
    assert msgs == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert kw["drafter"] == "lookup"
    out = capsys.readouterr().out
    assert (json.loads(out)["text"] if json_out else out) == ("answer" if json_out else "answer\n")


def test_a_value_error_while_loading_is_one_line_and_exit_2(monkeypatch, capsys):
    """cli.py:340 ValueError dropped from the caught errors: a bad value found at load is a traceback, not
    "edge-chat: error: ..." with exit status 2."""
    import edge

    def bad(*a, **kw):
        raise ValueError("calibration.json: not a calibration")

    monkeypatch.setattr(edge, "load", bad)
    assert cli.main(["--model", "x", "--prompt", "hi"]) == 2
    assert capsys.readouterr().err.strip() == "edge-chat: error: calibration.json: not a calibration"


def test_ctrl_c_while_loading_exits_130(monkeypatch, capsys):
    """cli.py:312 the interrupted exit status changed from 130 (128 + SIGINT, what shells and scripts expect)."""
    import edge

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(edge, "load", interrupted)
    assert cli.main(["--model", "x", "--prompt", "hi"]) == 130
    assert "edge-chat: interrupted" in capsys.readouterr().err


# ----------------------------------------------------------------------------- edge/manifest.py: more bad dirs

def test_a_boolean_format_version_is_not_format_1(model_copy):
    """manifest.py:200 the bool exclusion dropped: JSON `true` is an int in Python (== 1) and would load as a
    format-1 manifest; it is a damaged manifest and must be refused with the re-export command."""
    raw = json.loads((model_copy / MANIFEST_NAME).read_text())
    raw["format_version"] = True
    (model_copy / MANIFEST_NAME).write_text(json.dumps(raw))
    with pytest.raises(ModelDirError, match="manifest format True"):
        load_manifest(model_copy, verify="none")


def test_a_file_given_as_the_model_dir_says_so(tmp_path):
    """manifest.py:175 the file-not-directory check dropped: --model pointing at a file (model.onnx, the
    manifest itself) would be told "no such model directory", which is false."""
    f = tmp_path / "model.onnx"
    f.write_bytes(b"x")
    with pytest.raises(ModelDirError, match="is a file, not a model directory"):
        load_manifest(f)


def test_special_tokens_are_decoded_the_same_on_both_streaming_paths(tiny_dir):
    """text.py:29 decode(skip_special_tokens=True): a special token the model emits mid-answer (<|im_start|>)
    would vanish from the re-decoding path and from `decode` while the byte path prints it, so the same answer
    streams differently depending on the tokenizer kind."""
    import copy

    from edge.text import TextCodec

    m = load_manifest(tiny_dir, verify="none")
    codec = TextCodec(tiny_dir / m.tokenizer, None, None, ())
    hi = codec.encode("hi")
    ids = hi + [1] + hi
    assert codec.decode(ids) == "hi<|im_start|>hi"
    slow = copy.copy(codec)
    slow._byte_level = False
    for c in (codec, slow):
        assert "".join(_streamed(c, ids, [len(hi)])) == "hi<|im_start|>hi"


def test_plan_is_for_greedy_or_sampled_answers_as_the_temp_says(tiny_dir, capsys):
    """cli.py:271 `sampling=a.temp > 0` -> `>= 0`: --plan must show the plan the engine runs for these flags; a
    greedy chat (--temp 0, the default) is not planned as a sampled one."""
    for temp, sampled in (("0", False), ("0.8", True)):
        rc = cli.main(["--model", str(tiny_dir), "--plan", "--json", "--context", "128", "--budget-mb", "4096",
                       "--temp", temp])
        rep = json.loads(capsys.readouterr().out)
        assert rc == 0 and rep["plan"]["sampling"] is sampled, rep
