"""edge-chat in a terminal and in a pipe: readline input (long pasted lines whole), \"\"\" blocks, stdout carrying only
answers, accepted drafts in colour, the readable --plan and /stats, and the note when the context cuts an answer."""
import json
import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from edge import chat as cli
from edge.engine import Chunk, Stats

ROOT = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _env(**kw) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "HF_HUB_OFFLINE": "1", **kw}


def _asker(lines):
    """An `ask(prompt)` that answers from `lines`, then raises EOFError; records the prompts it was asked with."""
    feed, asked = iter(lines), []

    def ask(prompt):
        asked.append(prompt)
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None
    ask.asked = asked
    return ask


# ----------------------------------------------------------------------------- \"\"\" blocks (read_turn)

@pytest.mark.parametrize("lines,turn", [
    (["hello there"], ("hello there", False)),
    (["", "   ", "hi"], ("hi", False)),  # blank lines are no turn
    (['"""', "line one", "line two", '"""'], ("line one\nline two", True)),
    (['"""first', 'second"""'], ("first\nsecond", True)),  # text beside the quotes belongs to the message
    (['"""one line"""'], ("one line", True)),
    (['  """', "  def f():", "      pass", '"""'], ("  def f():\n      pass", True)),  # indentation is kept
    (['"""', "/quit", '"""'], ("/quit", True)),  # a block is a message, never a command
    (['"""', "", "a", "", '"""'], ("a", True)),  # the line breaks just inside the quotes are not the message's
    (['"""\nx\ny\n"""'], ("x\ny", True)),  # a paste readline returned as one string with its line breaks
    (['x"""'], ('x"""', False)),  # only a line that starts with the quotes opens a block
])
def test_read_turn_lines_and_blocks(lines, turn):
    ask = _asker(lines)
    assert cli.read_turn(ask) == turn
    assert ask.asked[0] == "> " and ("... " in ask.asked) == (turn[1] and len(lines) > 1)  # continuation prompt


def test_read_turn_at_the_end_of_input():
    with pytest.raises(EOFError):
        cli.read_turn(_asker(["", "  "]))


def test_a_block_the_input_ends_inside_is_sent_with_a_note(capsys):
    assert cli.read_turn(_asker(['"""', "a", "b"])) == ("a\nb", True)
    assert 'input ended inside a """ block' in capsys.readouterr().err


# ----------------------------------------------------------------------------- the REPL with a stand-in engine

class _Chat:
    def __init__(self, engine, system, overflow):
        self.engine, self.overflow, self.sends = engine, overflow, []

    def reset(self):
        pass

    def send(self, text, **kw):
        self.sends.append(text)
        yield from self.engine.chunks


class _Engine:
    """What _repl uses of an Engine: its answers are `chunks`; the KV cache holds `length` of `context` slots."""

    def __init__(self, chunks=(Chunk("ok", [7], 0, "stop"),), context=200, length=17, max_len=256):
        self.manifest = SimpleNamespace(name="fake", target=SimpleNamespace(max_len=max_len))
        self.default_drafter, self.plan, self.context, self.chunks = "lookup", None, context, list(chunks)
        self.target = SimpleNamespace(cache=SimpleNamespace(length=length))
        self.last_stats = Stats(prompt_tokens=30, reused_tokens=12, generated=9, steps=4, drafted=6, accepted=5,
                                prefill_s=0.01234, decode_s=0.56789, drafter="lookup")
        self.chats = []

    def chat(self, system=None, overflow="refuse"):
        self.chats.append(_Chat(self, system, overflow))
        return self.chats[-1]


def _repl(monkeypatch, engine, lines, *argv, tty=False):
    ask = _asker(lines)
    monkeypatch.setattr("builtins.input", lambda prompt="": ask(prompt))
    if tty:  # stdin and stdout a terminal (readline imported; input() itself is the stand-in above)
        monkeypatch.setattr(cli, "_isatty", lambda stream: True)
    rc = cli._repl(engine, cli._parser().parse_args(["--no-history", "--color", "never", *argv]))
    return rc, ask.asked


def test_piped_input_keeps_prompts_and_banner_off_stdout(monkeypatch, capsys):
    """Piped in, stdout carries the answers alone (input("> ") wrote the prompt there), and a \"\"\" block is one
    turn."""
    e = _Engine()
    rc, asked = _repl(monkeypatch, e, ["first question", '"""', "two", "lines", '"""', "/quit"])
    out, err = capsys.readouterr()
    assert rc == 0 and out == "ok\nok\n", out
    assert set(asked) == {""} and "edgespec ·" not in err  # no prompt text, no banner
    assert e.chats[0].sends == ["first question", "two\nlines"]


def test_interactive_prompt_and_banner(monkeypatch, capsys):
    e = _Engine()
    rc, asked = _repl(monkeypatch, e, ["hi", '"""', "a", '"""'], tty=True)
    assert rc == 0 and asked == ["> ", "> ", "... ", "... ", "> "]
    err = capsys.readouterr().err
    assert "edgespec · fake" in err and '"""' in err  # the banner shows HELP, which tells of blocks


def test_ctrl_c_at_the_prompt_clears_the_line_and_keeps_the_chat(monkeypatch, capsys):
    """Ctrl-C while typing used to end edge-chat (and the conversation); now it drops the line being typed."""
    e = _Engine()
    calls = iter([KeyboardInterrupt, "still here", "/quit"])

    def fake_input(prompt=""):
        x = next(calls)
        if x is KeyboardInterrupt:
            raise KeyboardInterrupt
        return x

    monkeypatch.setattr("builtins.input", fake_input)
    monkeypatch.setattr(cli, "_isatty", lambda stream: True)
    assert cli._repl(e, cli._parser().parse_args(["--no-history", "--color", "never"])) == 0
    assert e.chats[0].sends == ["still here"] and "Ctrl-D or /quit exits" in capsys.readouterr().err


def test_an_invalid_byte_in_piped_input_is_replaced_and_every_line_answered(monkeypatch, capsys):
    """Piped input with one byte that is not UTF-8, under a locale whose stdin decodes strictly (en_US.UTF-8): the
    byte becomes U+FFFD, as in --prompt's text, and each line is a turn; the UnicodeDecodeError used to end the
    session before any answer (the decoder reads ahead)."""
    import io

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hello there\nsecond \xff line\nthird line\n"),
                                                       encoding="utf-8", errors="strict"))
    e = _Engine()
    rc = cli._repl(e, cli._parser().parse_args(["--no-history", "--color", "never"]))  # input() reads sys.stdin
    assert rc == 0 and e.chats[0].sends == ["hello there", "second \ufffd line", "third line"]
    assert capsys.readouterr().out == "ok\n" * 3


class _Interrupted:
    """An answer stream that shows some text, then meets Ctrl-C."""

    def __iter__(self):
        yield Chunk("partial", [7], 0)
        raise KeyboardInterrupt


def test_ctrl_c_in_an_answer_on_a_terminal_keeps_the_chat(monkeypatch, capsys):
    e = _Engine()
    e.chunks = _Interrupted()
    rc, _ = _repl(monkeypatch, e, ["first", "second", "/quit"], tty=True)
    out, err = capsys.readouterr()
    assert rc == 0 and e.chats[0].sends == ["first", "second"] and out == "partial" * 2
    assert err.count("(stopped)") == 2


def test_ctrl_c_in_an_answer_ends_a_piped_session(monkeypatch, capsys):
    """Piped in, Ctrl-C ends the session (main exits 130), as it ends --prompt, keeping what was shown on a line of
    its own; it used to say "(stopped)" and go on with the next line."""
    e = _Engine()
    e.chunks = _Interrupted()
    with pytest.raises(KeyboardInterrupt):
        _repl(monkeypatch, e, ["first", "second", "/quit"])
    out, err = capsys.readouterr()
    assert e.chats[0].sends == ["first"] and out == "partial\n" and "(stopped)" not in err


def test_help_tells_of_blocks():
    assert '"""' in cli.HELP and '"""' in cli._parser().format_help()


# ----------------------------------------------------------------------------- /stats

def test_stats_is_readable_and_stats_json_is_json(monkeypatch, capsys):
    e = _Engine()
    _repl(monkeypatch, e, ["hi", "/stats", "/stats json", "/quit"])
    err = capsys.readouterr().err
    text = err[: err.index("{")]
    assert "{" not in text and "0.0123" not in text  # rounded, not a dump of floats
    assert re.search(r"decode\s+14\.1 tok/s \(567\.9 ms in all\)", text), text  # (9 - 1) / 0.56789 s
    assert re.search(r"prefill\s+12\.3 ms for 18 new prompt tokens \(12 of 30 reused", text), text
    assert re.search(r"drafts accepted\s+5 of 6", text) and re.search(r"context\s+17 of 200 tokens in use", text)
    assert re.search(r"memory\s+peak RSS \d[\d,]*\.\d MB, now \d[\d,]*\.\d MB", text), text
    info = json.loads(err[err.index("{"): err.rindex("}") + 1])
    assert info["context_tokens"] == 17 and info["last_answer"]["generated"] == 9


def test_stats_rows_are_aligned():
    info = {"last_answer": Stats(generated=3, steps=2, decode_s=0.5, drafter="none").to_dict(), "context_tokens": 4,
            "context_window": 64, "memory_mb": {"measured_peak_rss": 100.04, "measured_rss_now": 99.96}}
    lines = cli._stats_text(info).splitlines()
    starts = {len(m.group(1)) for m in (re.match(r"(  \S.*?\s{2,})\S", ln) for ln in lines)}
    assert len(starts) == 1, lines  # every value starts in the same column
    assert any("100.0 MB, now 100.0 MB" in ln for ln in lines)


# ----------------------------------------------------------------------------- the context cut an answer

def test_an_answer_the_context_cut_says_so_and_how_to_get_room(monkeypatch, capsys):
    """finish_reason "length" before --max-tokens: the window, not the limit, ended the answer."""
    e = _Engine([Chunk("cut", [7, 8], 0, "length")])
    _repl(monkeypatch, e, ["hi", "/quit"], "--max-tokens", "50")
    err = capsys.readouterr().err
    note = next(ln for ln in err.splitlines() if ln.startswith("note:"))
    assert "context window (200 tokens) is full" in note and "at 2 tokens" in note
    assert "/reset" in note and "--overflow drop_oldest" in note and "--context" in note and "256" in note


def test_the_note_leaves_out_what_is_already_on_and_what_cannot_help(monkeypatch, capsys):
    e = _Engine([Chunk("cut", [7, 8], 0, "length")], context=256, max_len=256)
    _repl(monkeypatch, e, ["hi", "/quit"], "--max-tokens", "50", "--overflow", "drop_oldest")
    note = next(ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("note:"))
    assert "--overflow" not in note and "larger --context" not in note and "holds no more" in note, note


@pytest.mark.parametrize("chunks,length,max_tokens,cut", [
    ([Chunk("ab", [7, 8], 0, "length")], 17, 2, False),  # --max-tokens ended it
    ([Chunk("ab", [7, 8], 0, "length")], 199, 2, True),  # ... with the cache full as well
    ([Chunk("ab", [7, 8], 0, "stop")], 17, 50, False),  # the model ended it
    ([Chunk("a", [7], 0), Chunk("b", [8], 1, "length")], 17, 50, True),
])
def test_context_cut_is_told_apart_from_the_token_limit(monkeypatch, capsys, chunks, length, max_tokens, cut):
    _repl(monkeypatch, _Engine(chunks, length=length), ["hi", "/quit"], "--max-tokens", str(max_tokens))
    assert ("note: the context window" in capsys.readouterr().err) is cut


# ----------------------------------------------------------------------------- colour

class _Codec:
    """A byte-level codec whose token i is the bytes of WORDS[i]."""
    byte_level = True
    WORDS = ["", " the", " cat", " sat", " on", " mat", "é".encode()[:1], "é".encode()[1:], "!"]

    def token_bytes(self, i):
        w = self.WORDS[i]
        return w if isinstance(w, bytes) else w.encode()


def _paint(chunks, eos=()):
    p = cli.DraftColors(_Codec(), eos)
    return "".join(p.paint(c) for c in chunks)


def _colored_text(painted: str) -> str:
    return "".join(re.findall(re.escape(cli.DRAFT_COLOR) + r"(.*?)" + re.escape(cli.RESET_COLOR), painted, re.S))


def test_accepted_drafts_are_coloured_token_by_token():
    # step 1: the target's " the"; step 2: drafts " cat sat" accepted, the target's " on"; step 3: EOS (id 0)
    chunks = [Chunk(" the", [1], 0), Chunk(" cat sat on", [2, 3, 4], 2), Chunk("", [0], 0, "stop")]
    painted = _paint(chunks, eos=(0,))
    assert ANSI.sub("", painted) == " the cat sat on"
    assert _colored_text(painted) == " cat sat"


def test_colour_follows_the_text_when_the_engine_holds_text_back():
    """With a stop string the engine holds the last characters back and sends them with a later chunk; a character
    split over tokens comes whole. The colour still marks exactly the drafted tokens' characters."""
    chunks = [Chunk(" the ca", [1, 2], 1), Chunk("t sat", [3], 0), Chunk("", [6], 1), Chunk("é on", [7, 4], 1),
              Chunk("!", [8], 0, "stop")]
    painted = _paint(chunks)
    assert ANSI.sub("", painted) == "".join(c.text for c in chunks) == " the cat saté on!"
    assert _colored_text(painted) == " the" + "é"  # id 6 (drafted) starts the character id 7 (drafted) ends


def test_colour_falls_back_to_whole_chunks_when_the_texts_part():
    chunks = [Chunk(" the", [1], 0), Chunk("XYZ", [2, 3], 1), Chunk(" on", [4], 0, "stop")]
    painted = _paint(chunks)
    assert ANSI.sub("", painted) == " theXYZ on"
    assert _colored_text(painted) == "XYZ"  # the chunk that had a draft, whole


@pytest.mark.parametrize("choice,tty,env,on", [
    ("always", False, {}, True), ("never", True, {}, False), ("auto", True, {}, True), ("auto", False, {}, False),
    ("auto", True, {"NO_COLOR": "1"}, False), ("auto", True, {"TERM": "dumb"}, False),
])
def test_color_choice(monkeypatch, choice, tty, env, on):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(cli, "_isatty", lambda stream: tty)
    assert cli._use_color(choice) is on


# ----------------------------------------------------------------------------- --plan

def test_plan_is_a_readable_report_with_a_plain_verdict(tiny_dir, capsys):
    assert cli.main(["--model", str(tiny_dir), "--plan", "--context", "128", "--budget-mb", "4096"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("memory plan") and "{" not in out and "None" not in out, out
    rows = [re.match(r"  (\S.*?)\s{2,}(\S.*)", ln) for ln in lines[1:]]
    assert all(rows), lines
    assert len({m.start(2) for m in rows}) == 1  # the values line up
    facts = {m.group(1): m.group(2) for m in rows}
    assert facts["verdict"].startswith("fits") and facts["context"] == "128 tokens"
    assert facts["budget"] == "4,096.0 MB" and re.fullmatch(r"at least [\d,]+\.\d MB", facts["plain decoding needs"])
    assert cli.main(["--model", str(tiny_dir), "--plan", "--context", "128", "--budget-mb", "1"]) == 3
    facts = dict(re.match(r"  (\S.*?)\s{2,}(\S.*)", ln).groups() for ln in capsys.readouterr().out.splitlines()[1:])
    assert facts["verdict"] == "does not fit" and "raise --budget-mb" in facts["why"]


def test_plan_says_it_is_for_the_full_context_and_what_a_chat_starts_with(tiny_dir, capsys, monkeypatch):
    """--plan plans for a full context, where drafting may not pay; a run re-plans each request for the context it
    can reach, so a first question may run another plan (SmolLM2 at --budget-mb 400: plain decoding in the report,
    hybrid in the run). The report says which context it is for, and what a short first question gets."""
    import edge.planning

    real, seen = edge.planning.plan_report, []

    def plan_report(*args, at=None, **kw):  # the plan at a chat's start drafts, as SmolLM2's does
        seen.append(at)
        rep = real(*args, at=at, **kw)
        if at is not None:
            rep["plan"].update(drafter="hybrid", tree="chain", nodes=1, speedup=1.14)
        return rep

    monkeypatch.setattr(edge.planning, "plan_report", plan_report)
    assert cli.main(["--model", str(tiny_dir), "--plan", "--context", "128", "--budget-mb", "4096",
                     "--max-tokens", "16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("memory plan at the full 128-token context"), lines[0]
    facts = dict(re.match(r"  (\S.*?)\s{2,}(\S.*)", ln).groups() for ln in lines[1:])
    # which drafter the full context gets follows the tiny export's measured latencies: only say which context
    assert facts["plan"].endswith(", with the context full"), facts
    assert facts["at a chat's start"].startswith("hybrid, a chain of up to 1 draft tokens a call, 1.14x plain "
                                                 "decoding (a short first question with --max-tokens 16"), facts
    assert seen == [None, 16] and facts["verdict"].startswith("fits")
    assert cli.main(["--model", str(tiny_dir), "--plan", "--json", "--context", "128"]) == 0
    assert seen == [None, 16, None]  # the JSON report is as it was: the full context's


# ----------------------------------------------------------------------------- end to end on the tiny export

def _chat(model, *flags, stdin, **kw):
    return subprocess.run([sys.executable, "-m", "edge.chat", "--model", str(model), "--context", "256", *flags],
                          input=stdin, capture_output=True, text=True, timeout=240, env=_env(**kw))


def test_piped_session_stdout_is_the_answers_alone(tiny_dir):
    flags = ["--max-tokens", "4", "--drafter", "none"]
    r = _chat(tiny_dir, *flags, stdin='hello there\n"""\nsay\nsomething\n"""\n/stats\n/quit\n')
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("tok/s decode") == 2  # two turns: the block was one
    assert "edgespec ·" not in r.stdout + r.stderr and "decode" not in r.stdout
    one = _chat(tiny_dir, *flags, "--prompt", "hello there", stdin=None)  # greedy: the same first answer
    assert one.returncode == 0 and r.stdout.startswith(one.stdout), (r.stdout, one.stdout)  # no "> " before it


def test_colour_changes_no_text(tiny_dir):
    """--color always wraps accepted drafts in colour codes and nothing else: without them it is the plain answer;
    auto with stdout piped adds none."""
    q = "the quick brown fox jumps over the lazy dog the quick brown fox"
    flags = ["--max-tokens", "24", "--drafter", "lookup", "--prompt", q]
    plain, colored = _chat(tiny_dir, *flags, stdin=None), _chat(tiny_dir, *flags, "--color", "always", stdin=None)
    auto = _chat(tiny_dir, *flags, stdin=None, TERM="xterm")
    assert plain.returncode == colored.returncode == auto.returncode == 0, colored.stderr
    assert ANSI.sub("", colored.stdout) == plain.stdout == auto.stdout and "\x1b" not in auto.stdout
    accepted = int(re.search(r"drafter lookup: (\d+)/", colored.stderr).group(1))
    assert (cli.DRAFT_COLOR in colored.stdout) is (accepted > 0), colored.stderr


def test_prompt_cut_by_the_context_says_so(tiny_dir):
    r = _chat(tiny_dir, "--max-tokens", "500", "--drafter", "none", "--prompt", "hi", stdin=None)
    assert r.returncode == 0, r.stderr
    note = next(ln for ln in r.stderr.splitlines() if ln.startswith("note:"))
    assert "context window (256 tokens) is full" in note and "holds no more" in note, note


# ----------------------------------------------------------------------------- a real terminal (pty)

def _pty_child(code: str, stdout=None, **env):
    """Runs `code` in a Python whose stdin (and stderr, and stdout unless given) is a new pty it controls, as a
    terminal's shell would; returns (process, master fd)."""
    import fcntl
    import pty
    import signal
    import termios

    master, slave = pty.openpty()

    def controlling_tty():
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a test run in the background inherits Ctrl-C ignored

    p = subprocess.Popen([sys.executable, "-c", code], stdin=slave, stdout=stdout or slave, stderr=slave,
                         env=_env(TERM="xterm", **env), start_new_session=True, preexec_fn=controlling_tty,
                         close_fds=True)
    os.close(slave)
    return p, master


class _Screen:
    def __init__(self, master):
        self.master, self.seen, self.mark = master, b"", 0  # mark: how much had been seen when we last typed

    def read(self, seconds: float) -> None:
        end = time.time() + seconds
        while time.time() < end:
            r, _, _ = select.select([self.master], [], [], 0.05)
            if r:
                try:
                    self.seen += os.read(self.master, 65536)
                except OSError:  # the child closed the pty
                    return

    def wait_for(self, needle: bytes, start: int = 0, seconds: float = 120) -> int:
        """Waits until `needle` shows at or after `start`; returns where it ends."""
        end = time.time() + seconds
        while self.seen.find(needle, start) < 0 and time.time() < end:
            self.read(0.1)
        assert self.seen.find(needle, start) >= 0, self.seen[-2000:]
        return self.seen.find(needle, start) + len(needle)

    def type(self, text: str) -> None:
        self.mark = len(self.seen)
        data = text.encode()
        for i in range(0, len(data), 512):  # as a terminal delivers a paste: in pieces, echo drained meanwhile
            os.write(self.master, data[i:i + 512])
            self.read(0.01)

    def answer(self, prompt: bytes, text: str, after: int | None = None) -> None:
        """Types `text` once `prompt` shows (after `after`, default: after what was typed last). Waiting for each
        prompt, as a person does: readline may lose what is typed ahead while it hands the terminal back between
        lines."""
        self.wait_for(prompt, self.mark if after is None else after)
        self.type(text)


LONG = " ".join(f"w{i % 10}" for i in range(3000))  # 8,999 characters: more than the tty's 4,095-byte line


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pty and the 4,095-byte canonical line are Linux's")
@pytest.mark.parametrize("interactive", [True, False])
def test_a_long_pasted_line_arrives_whole_through_readline(tmp_path, interactive):
    """edge-chat's line reader on a terminal is readline, which reads the terminal in raw mode: a pasted line of
    8,999 characters arrives whole. Plain reading (the piped path, here on a terminal) gets the kernel's canonical
    line, cut at 4,095 bytes: what input() without readline did."""
    out = tmp_path / "got.json"
    p, master = _pty_child(f"import json; from edge.chat import Lines, read_turn; "
                           f"open({str(out)!r}, 'w').write(json.dumps(read_turn(Lines({interactive}, None).ask)))")
    screen = _Screen(master)
    try:
        if interactive:
            screen.wait_for(b"> ")  # readline has the terminal (typed ahead, the text would meet canonical mode)
        screen.type(LONG + "\r")
        p.wait(60)
    finally:
        p.kill()
        os.close(master)
    line, block = json.loads(out.read_text())
    assert block is False
    if interactive:
        assert line == LONG
    else:
        assert len(line.encode()) == 4095 and LONG.startswith(line)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pty")
def test_terminal_session_with_answers_redirected(tiny_dir, tmp_path):
    """edge-chat on a terminal with stdout redirected to a file (`edge-chat > answers.txt`): the prompt and the line
    being edited show on the terminal, the file gets only the answers, a long pasted question arrives whole, Ctrl-C
    drops the line being typed and the chat goes on, and the history file is written for its owner alone."""
    home = tmp_path / "home"
    answers = open(tmp_path / "answers.txt", "w")
    code = (f"import sys; from edge.chat import main; sys.exit(main(['--model', {str(tiny_dir)!r}, '--context', "
            "'256', '--max-tokens', '3', '--drafter', 'none']))")
    p, master = _pty_child(code, stdout=answers, EDGESPEC_HOME=str(home))
    screen = _Screen(master)
    try:
        screen.answer(b"> ", LONG + "\r")
        screen.answer(b"> ", "half typed", after=screen.wait_for(b"error: this question is", screen.mark))
        screen.wait_for(b"half typed", screen.mark)  # readline is reading (a Ctrl-C just before it does is not seen
        screen.type("\x03")                          # until the next key: Python's readline loop)
        screen.answer(b"> ", '"""\r', after=screen.wait_for(b"Ctrl-D or /quit exits", screen.mark))
        for line in ("hello", "there", '"""'):
            screen.answer(b"... ", line + "\r")
        screen.answer(b"> ", "\x04", after=screen.wait_for(b"tok/s decode", screen.mark))
        p.wait(60)
        screen.read(0.2)
    finally:
        p.kill()
        os.close(master)
        answers.close()
    seen = screen.seen.decode(errors="replace")
    assert p.returncode == 0, seen[-2000:]
    n = int(re.search(r"this question is (\d+) tokens", seen).group(1))
    assert n > 3000, n  # every "wN" is a token or more: the whole line (4,095 bytes hold only 1,365 of them)
    text = (tmp_path / "answers.txt").read_text()
    assert "> " not in text and "error" not in text and text.endswith("\n") and text.strip(), text
    hist = home / "chat_history"
    assert hist.stat().st_mode & 0o777 == 0o600
    saved = hist.read_text()
    assert LONG in saved and "hello" in saved and "half typed" not in saved
