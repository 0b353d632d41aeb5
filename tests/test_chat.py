"""edge-chat (edge/chat.py): as a user runs it (subprocesses on the tiny exported model), and in process: flag
defaults and what reaches the engine, the JSON answer, the REPL's commands and refusals over a stand-in engine,
--plan without loading a model, and main() with a faked load."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from edge import chat as cli
from helpers import run_module


# ----------------------------------------------------------------------------- as a user runs it

def test_chat_prompt_json(model):
    r = run_module(["edge.chat", "--model", model, "--prompt", "the quick brown fox", "--json", "--max-tokens", "12",
                    "--drafter", "lookup", "--context", "256"])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("text", "token_ids", "prefill_ms", "decode_tok_s", "drafted", "accepted", "mean_accepted_len",
                "peak_rss_mb"):
        assert key in out
    assert 0 < len(out["token_ids"]) <= 12 and out["peak_rss_mb"] > 10
    assert out["python_ms_per_step"] > 0  # a share of decoding (Stats.python_ms_per_step)


def test_chat_repl_commands(model):
    r = run_module(["edge.chat", "--model", model, "--max-tokens", "8", "--context", "256"],
                   stdin="hello there\n/stats json\n/reset\nagain\n/quit\n")
    assert r.returncode == 0, r.stderr
    assert "conversation cleared" in r.stderr and '"generated"' in r.stderr
    assert r.stderr.count("tok/s decode") == 2  # one stats line per answer


def test_chat_repl_survives_refusals_and_unknown_commands(model):
    """A first question that does not fit the context is refused with what to do in the REPL (no traceback, no
    stats line for it), a mistyped /command is not sent to the model, and the session goes on; piped in, the
    refusal still makes the exit status 2, as it does for --prompt."""
    long_q = "tell me a long story about rivers and mountains " * 12
    r = run_module(["edge.chat", "--model", model, "--max-tokens", "4", "--context", "40"],
                   stdin=f"{long_q}\n/qiut\nhi\n/quit\n")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "shorten it, or restart edge-chat with a larger --context (this export holds up to 256)" in r.stderr
    err = next(ln for ln in r.stderr.splitlines() if ln.startswith("error:"))
    assert "Chat(overflow" not in err and "/reset" not in err  # neither helps a question that is too long
    assert "unknown command /qiut" in r.stderr
    assert r.stderr.count("tok/s decode") == 1  # only the answered turn has a stats line
    # after some turns a question that would fit alone: /reset or --overflow drop_oldest help
    r = run_module(["edge.chat", "--model", model, "--max-tokens", "8", "--context", "64"],
                   stdin="".join(f"tell me about rivers number {i}\n" for i in range(8)) + "/quit\n")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "/reset to start over, or restart edge-chat with --overflow drop_oldest" in r.stderr, r.stderr


@pytest.mark.parametrize("flags,needle", [
    (["--context", "-5"], "--context"), (["--context", "0"], "--context"), (["--threads", "0"], "--threads"),
    (["--budget-mb", "-5", "--plan"], "--budget-mb"), (["--context", "100000"], "exported for"),
    (["--context", "5"], "--context 5 cannot hold a chat"),
])
def test_chat_bad_engine_flags(model, flags, needle):
    r = run_module(["edge.chat", "--model", model, "--prompt", "hi", "--max-tokens", "2", *flags])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert needle in r.stderr, r.stderr


def test_chat_prompt_uses_the_system_prompt_and_counts_it(model):
    """--system applies to --prompt as well as to the REPL (it was ignored there), and the start-up context check
    counts it: a context that holds an empty question alone but not with the system prompt is refused."""
    import edge

    e = edge.load(model, drafter="none", context=256)
    system = "you answer in rhymes about rivers and mountains " * 3
    want = e.generate([{"role": "system", "content": system}, {"role": "user", "content": "hi"}], max_tokens=8)
    assert want.token_ids != e.generate("hi", max_tokens=8).token_ids  # the system prompt changes the answer
    r = run_module(["edge.chat", "--model", model, "--prompt", "hi", "--system", system, "--json", "--max-tokens", "8",
                    "--drafter", "none", "--context", "256"])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["token_ids"] == want.token_ids
    alone = len(e.encode([{"role": "user", "content": ""}]))
    r = run_module(["edge.chat", "--model", model, "--prompt", "hi", "--system", system, "--context", str(alone + 2)])
    assert r.returncode == 2 and "with the chat template and the system prompt" in r.stderr, r.stderr


def test_chat_on_a_checkpoint_dir_says_export_it_elsewhere(tiny_llama_dir):
    """Pointing --model at a checkpoint suggests exporting it into a new directory, never into itself (an export
    replaces its output directory)."""
    r = run_module(["edge.chat", "--model", str(tiny_llama_dir), "--prompt", "hi"])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "holds a model checkpoint" in r.stderr and f"-o {tiny_llama_dir}-edgespec" in r.stderr


def test_chat_bad_model_dir_is_one_clear_line(tmp_path):
    r = run_module(["edge.chat", "--model", str(tmp_path / "nope"), "--prompt", "hi"])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().startswith("edge-chat: error:") and "edge-export" in r.stderr


@pytest.mark.parametrize("flags,needle", [
    (["--temp", "-1"], "--temp"), (["--temp", "inf"], "--temp"), (["--top-p", "0"], "--top-p"),
    (["--top-p", "1.5"], "--top-p"), (["--top-k", "-2"], "--top-k"), (["--seed", "-1"], "--seed"),
    (["--max-tokens", "0"], "--max-tokens"), (["--stop", ""], "--stop"), (["--json"], "--json needs --prompt"),
    (["--simulate"], "--simulate runs a --device profile"), (["--prompt", "  "], "--prompt is empty"),
])
def test_chat_bad_generation_flags_fail_before_loading(tmp_path, flags, needle):
    """Each is refused by the flag's name before the model loads (a first run's export takes minutes; the REPL
    used to start and then refuse every question): the model directory given does not even exist."""
    args = ["edge.chat", "--model", str(tmp_path / "absent"), *flags]
    if "--prompt" not in flags and "--json" not in flags:
        args += ["--prompt", "hi"]
    r = run_module(args)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert needle in r.stderr and "no such model directory" not in r.stderr, r.stderr


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("flags,stdin", [
    (["--prompt", "hi"], None), (["--prompt", "hi", "--json"], None), ([], "hi\n"), (["--plan"], None),
])
def test_chat_output_that_cannot_be_written_is_one_line(model, flags, stdin):
    """stdout on a full disk (/dev/full): one line naming the problem and exit status 1 in every output mode, not an
    OSError traceback from the write."""
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "edge.chat", "--model", model, "--max-tokens", "4", "--context",
                            "256", *flags], input=stdin, stdout=full, stderr=subprocess.PIPE, text=True, timeout=240,
                           env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 1 and "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
    assert "edge-chat: error: cannot write the output: No space left on device\n" in r.stderr, r.stderr


def test_chat_piped_session_ctrl_c_ends_it_with_130(model, tmp_path):
    """SIGINT during a piped session ends it with exit status 130, as it ends --prompt, keeping what was printed
    (on a line of its own); it used to print "(stopped)" and go on with the next line, then exit 0."""
    import os
    import signal

    questions = tmp_path / "questions.txt"
    questions.write_text("".join(f"tell me about rivers number {i}\n" for i in range(50)))
    with open(questions) as stdin:
        p = subprocess.Popen([sys.executable, "-m", "edge.chat", "--model", model, "--max-tokens", "64", "--context",
                              "256", "--drafter", "none"], stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"},
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as from a shell
        shown = p.stdout.read(1)  # an answer is under way
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    err = err.decode()
    assert p.returncode == 130 and "(stopped)" not in err and "Traceback" not in err, err
    assert (shown + out).endswith(b"\n") and err.count("tok/s decode") < 10, err


def test_chat_output_closed_early_is_quiet(model):
    """`edge-chat --prompt ... | head -c 5`: the closed pipe ends the answer without a traceback."""
    p = subprocess.Popen([sys.executable, "-m", "edge.chat", "--model", model, "--prompt", "the quick brown fox",
                          "--max-tokens", "200", "--drafter", "none", "--context", "256"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**__import__("os").environ,
                                                                             "HF_HUB_OFFLINE": "1"})
    p.stdout.read(1)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and "Traceback" not in err and "Exception ignored" not in err, err


# ----------------------------------------------------------------------------- flags and the JSON answer

def _parse(*argv):
    return cli._parser().parse_args(list(argv))


def _params_of(*argv) -> dict:
    return cli._params(_parse(*argv))


def test_flag_defaults_are_the_documented_ones():
    """The defaults are the ones the help texts promise: threads left to the engine (2, or fewer cores), 512 tokens,
    greedy, top-p 1, no top-k, no seed, drafter auto, overflow refuse, no stop strings, files checked fast."""
    a = _parse()
    assert (a.threads, a.max_tokens, a.temp, a.top_p, a.top_k, a.seed, a.drafter, a.overflow, a.stop, a.verify) == \
        (None, 512, 0.0, 1.0, 0, None, "auto", "refuse", [], "fast")


def test_every_stop_string_and_sampling_flag_reaches_the_engine():
    """Every repeated --stop string, --top-k and each other sampling flag is passed to generation."""
    p = _params_of("--stop", "A", "--stop", "B", "--top-k", "7", "--top-p", "0.5", "--temp", "0.3", "--seed", "4",
                   "--max-tokens", "9")
    assert p == dict(max_tokens=9, temperature=0.3, top_p=0.5, top_k=7, seed=4, stop=("A", "B"))


def test_json_fields_carry_the_right_counters():
    """Each key of the JSON answer carries its own counter: finish_reason as the engine gave it, mean_accepted_len in
    tokens per verify call, prompt_tokens the whole prompt (not the reused part), times in ms and tokens/s."""
    from edge.engine import GenerationResult, Stats

    st = Stats(prompt_tokens=30, reused_tokens=12, generated=9, steps=4, drafted=6, accepted=5, prefill_s=0.25,
               decode_s=1.0, drafter="lookup")
    out = cli._result_json(GenerationResult("hey", [1, 2, 3], "stop_string"), st)
    assert out["finish_reason"] == "stop_string" and out["text"] == "hey" and out["token_ids"] == [1, 2, 3]
    assert out["mean_accepted_len"] == 2.0  # (generated - 1) / steps: tokens per verify call
    assert out["prompt_tokens"] == 30 and out["drafted"] == 6 and out["accepted"] == 5 and out["steps"] == 4
    assert out["prefill_ms"] == 250.0 and out["decode_tok_s"] == 8.0 and out["drafter"] == "lookup"


def test_json_answer_reports_load_time(capsys):
    """`--prompt --json` reports the model's load time (load_s)."""
    import argparse

    from edge.engine import Chunk, Stats

    class Engine:
        last_stats, has_chat_template = None, True

        def stream(self, *a, **kw):
            self.last_stats = Stats(generated=1, steps=0, drafter="none")
            yield Chunk("Hi", [5], 0, "length")

    a = argparse.Namespace(prompt="hi", system=None, drafter="none", max_tokens=1, temp=0.0, top_p=1.0, top_k=0,
                           seed=None, stop=[])
    assert cli._answer_json(Engine(), a, 1.234) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["load_s"] == 1.23 and out["finish_reason"] == "length"


def test_chat_json_interrupted_still_prints_what_ran(monkeypatch, capsys):
    """--prompt --json after Ctrl-C: one JSON object with the text so far and finish_reason "interrupted", exit
    130 (it printed nothing before)."""
    import argparse

    from edge.engine import Chunk, Stats

    class Engine:
        last_stats, has_chat_template = None, True

        def stream(self, *a, **kw):
            self.last_stats = Stats(generated=2, steps=1, drafter="none")
            yield Chunk("Hello", [5, 6], 0)
            raise KeyboardInterrupt

    a = argparse.Namespace(prompt="hi", system=None, drafter="none", max_tokens=8, temp=0.0, top_p=1.0, top_k=0,
                           seed=None, stop=[])
    assert cli._answer_json(Engine(), a, 0.5) == 130
    out = json.loads(capsys.readouterr().out)
    assert out["text"] == "Hello" and out["token_ids"] == [5, 6] and out["finish_reason"] == "interrupted"


# ----------------------------------------------------------------------------- the REPL, in process

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
        self.default_drafter, self.plan, self.context, self.has_chat_template = "lookup", None, 200, True
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
    """/exit ends the session as /quit does: the question after it is never answered."""
    e = _Engine()
    assert _repl(monkeypatch, e, ["/exit", "after exit"]) == 0
    assert e.chats[0].sends == []


def test_repl_reset_forgets_the_conversation(monkeypatch, capsys):
    """/reset clears the chat's history, and says so."""
    e = _Engine()
    assert _repl(monkeypatch, e, ["hello", "/reset", "/quit"]) == 0
    assert e.chats[0].resets == 1 and "conversation cleared" in capsys.readouterr().err


def test_repl_passes_system_prompt_drafter_and_overflow(monkeypatch):
    """--system and --overflow reach the chat; --drafter, --stop and --max-tokens reach every question sent."""
    e = _Engine()
    _repl(monkeypatch, e, ["hi", "/quit"], "--system", "be brief", "--overflow", "drop_oldest", "--drafter",
          "recycling", "--stop", "X", "--max-tokens", "5")
    c = e.chats[0]
    assert (c.system, c.overflow) == ("be brief", "drop_oldest")
    assert c.sends[0][0] == "hi" and c.sends[0][1]["drafter"] == "recycling"
    assert c.sends[0][1]["stop"] == ("X",) and c.sends[0][1]["max_tokens"] == 5


def test_repl_stats_reports_the_cache_length_as_context_tokens(monkeypatch, capsys):
    """/stats reports context_tokens as the KV cache's length, not the engine's context window."""
    e = _Engine()
    _repl(monkeypatch, e, ["hi", "/stats json", "/quit"])
    err = capsys.readouterr().err
    info = json.loads(err[err.index("{"): err.rindex("}") + 1])
    assert info["context_tokens"] == 17 and info["last_answer"]["generated"] == 2


def test_repl_question_too_long_for_the_whole_export_says_so(monkeypatch, capsys):
    """At the export's maximum context, "restart with a larger --context" is advice that cannot work: the refusal
    says the export holds no more. Below it, the advice names the largest context the export holds."""
    from edge.engine import ContextFull

    e = _Engine(max_len=256, raises={"long": ContextFull("too long", n=300, context=256, alone=True),
                                     "mid": ContextFull("too long", n=300, context=128, alone=True)})
    assert _repl(monkeypatch, e, ["long", "mid", "/quit"]) == 2  # piped in: refused turns make the status 2
    err = capsys.readouterr().err.splitlines()
    first, second = [ln for ln in err if ln.startswith("error:")]
    assert "this export holds no more" in first and "larger --context" not in first, first
    assert "larger --context (this export holds up to 256)" in second, second


@pytest.mark.parametrize("end", [["/quit"], []])  # /quit, or the end of input
def test_repl_piped_refused_turn_makes_the_exit_status_2(monkeypatch, capsys, end):
    """Piped in, a refused turn is said on stderr and the turns after it are answered, but the session exits 2 (as
    --prompt does for the same refusal) instead of 0, so a script sees that a question went unanswered."""
    from edge.engine import ContextFull

    e = _Engine(raises={"long": ContextFull("too long", n=300, context=200, alone=True)})
    assert _repl(monkeypatch, e, ["hi", "long", "after", *end]) == 2
    assert [q for q, _ in e.chats[0].sends] == ["hi", "long", "after"]
    assert capsys.readouterr().out == "ok\nok\n"
    assert _repl(monkeypatch, _Engine(raises=e.raises), ["hi", *end]) == 0  # all answered


def test_repl_on_a_terminal_keeps_exit_status_0_after_a_refusal(monkeypatch):
    """On a terminal the person saw the refusal and went on: the session's status stays 0."""
    from edge.engine import ContextFull

    e = _Engine(raises={"long": ContextFull("too long", n=300, context=200, alone=True)})
    monkeypatch.setattr(cli, "_isatty", lambda stream: True)
    assert _repl(monkeypatch, e, ["long", "hi", "/quit"], "--no-history", "--color", "never") == 0


def test_repl_drop_oldest_refusal_is_the_engines_message(monkeypatch, capsys):
    """With --overflow drop_oldest already on, a refusal is the engine's own message, never the advice to restart
    with --overflow drop_oldest."""
    from edge.engine import ContextFull

    e = _Engine(raises={"q": ContextFull("the engine's own words", n=300, context=128, alone=False)})
    _repl(monkeypatch, e, ["q", "/quit"], "--overflow", "drop_oldest")
    err = capsys.readouterr().err
    assert "error: the engine's own words" in err and "restart edge-chat with --overflow" not in err, err


# ----------------------------------------------------------------------------- --plan (no model load)

def test_plan_at_the_exports_full_context_and_as_json(tiny_dir, capsys):
    """--plan accepts the export's own maximum context and --json (one JSON report); a plan over budget exits 3, not
    2 (a usage error); a context beyond the export's maximum is refused with exit 2."""
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


def test_plan_is_for_greedy_or_sampled_answers_as_the_temp_says(tiny_dir, capsys):
    """--plan shows the plan the engine runs for these flags: a greedy chat (--temp 0, the default) is planned
    greedy, --temp 0.8 sampled."""
    for temp, sampled in (("0", False), ("0.8", True)):
        rc = cli.main(["--model", str(tiny_dir), "--plan", "--json", "--context", "128", "--budget-mb", "4096",
                       "--temp", temp])
        rep = json.loads(capsys.readouterr().out)
        assert rc == 0 and rep["plan"]["sampling"] is sampled, rep


# ----------------------------------------------------------------------------- main() with a fake load

class _PromptEngine:
    def __init__(self):
        from types import SimpleNamespace

        from edge.engine import Stats

        self.context, self.calls, self.has_chat_template = 256, [], True
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
    """The one-shot --prompt (plain or --json) sends the --system prompt before the question and passes --drafter."""
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


def test_every_engine_flag_reaches_edge_load(monkeypatch):
    """Each flag of the engine group is passed to edge.load under its own name (edge-serve passes them by name; here
    they are listed one by one, so a new one could be forgotten)."""
    import inspect

    import edge

    engine_flags = {a.dest for a in cli._parser()._actions} & set(inspect.signature(edge.load).parameters)
    seen = {}

    def load(model, **kw):
        seen.update(kw)
        return _PromptEngine()

    monkeypatch.setattr(edge, "load", load)
    assert cli.main(["--model", "x", "--prompt", "hi", "--verify", "sha256", "--threads", "1", "--context", "99"]) == 0
    assert (seen["verify"], seen["threads"], seen["context"]) == ("sha256", 1, 99)
    assert engine_flags - {"model"} <= set(seen), engine_flags - set(seen)


def test_sampling_flags_without_a_temperature_are_noted(monkeypatch, capsys):
    """--top-k/--top-p/--seed at --temp 0 (greedy) change nothing: one note says so and how to sample."""
    import edge

    monkeypatch.setattr(edge, "load", lambda *a, **kw: _PromptEngine())
    assert cli.main(["--model", "x", "--prompt", "hi", "--top-k", "5", "--seed", "3"]) == 0
    err = capsys.readouterr().err
    assert "note: --top-k/--seed only shape sampling" in err and "--temp 0.7" in err
    assert cli.main(["--model", "x", "--prompt", "hi", "--top-k", "5", "--temp", "0.7"]) == 0
    assert cli.main(["--model", "x", "--prompt", "hi"]) == 0
    assert "only shape sampling" not in capsys.readouterr().err


def test_a_value_error_while_loading_is_one_line_and_exit_2(monkeypatch, capsys):
    """A bad value found while loading (a ValueError) is one line "edge-chat: error: ..." with exit status 2, not a
    traceback."""
    import edge

    def bad(*a, **kw):
        raise ValueError("calibration.json: not a calibration")

    monkeypatch.setattr(edge, "load", bad)
    assert cli.main(["--model", "x", "--prompt", "hi"]) == 2
    assert capsys.readouterr().err.strip() == "edge-chat: error: calibration.json: not a calibration"


def test_ctrl_c_while_loading_exits_130(monkeypatch, capsys):
    """Ctrl-C while loading exits 130 (128 + SIGINT, what shells and scripts expect)."""
    import edge

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(edge, "load", interrupted)
    assert cli.main(["--model", "x", "--prompt", "hi"]) == 130
    assert "edge-chat: interrupted" in capsys.readouterr().err
