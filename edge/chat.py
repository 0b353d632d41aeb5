"""edge-chat: chat with a local model in the terminal (streaming, multi-turn, speculative decoding).

On a terminal the REPL reads lines through readline (editing, arrow keys, history; long pasted lines arrive whole);
with input piped in, each non-empty line (or multi-line block) is one turn and stdout carries only the answers.
A base model (no chat template) is used as one: what is typed is text it continues, in one running text
(`edge.Chat` on a base model), never a made-up chat format."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

from .args import (add_engine_args, add_model_arg, add_version, chat_context_problem, messages, non_empty,
                   non_negative_float, non_negative_int, plain_warnings, positive_int, unit_fraction, was_interrupted)
from .engine import DEFAULT_CONTEXT, DEFAULT_MAX_TOKENS
from .measure import peak_rss_mb

HELP = ("commands: /reset (forget the conversation)  /stats (last answer's counters; /stats json: as JSON)  /help  "
        '/quit\nmulti-line: a line starting with """ opens a message that a line ending with """ sends, as one turn')
BLOCK = '"""'  # Ollama's multi-line quotes
HISTORY_LINES = 1000  # kept in memory and in the history file
DRAFT_COLOR, RESET_COLOR = "\033[36m", "\033[0m"  # cyan for accepted draft tokens, as in llama.cpp's example
BASE_HELP = ("A base model (no chat template, such as gemma3-270m) continues text rather than answering it: what you "
             "type is added to one\nrunning text (on a new line after the model's continuation) and the model "
             "continues the whole text, as it would a\ndocument; /reset starts a new text, and --prompt is continued "
             "alone. No chat format is made up for a base model.")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="edge-chat",
        description="Chat with a local model through edgespec. With no --model, the embedded SmolLM2-135M-Instruct "
                    "is exported into the cache on first run (about two minutes) and reused afterwards.",
        epilog=HELP + "\nCtrl-C stops the current answer (or clears the line being typed) and keeps the conversation; "
                      "Ctrl-D or /quit exits.\nWith input piped in, each non-empty line (or multi-line block) is a "
                      "turn, and stdout carries only the answers\n(notes and counters go to stderr); a refused turn "
                      "makes the exit status 2, and Ctrl-C ends the session (130).\n" + BASE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arg(ap)
    add_engine_args(ap)
    # generation flags are checked here, before a model load that can take minutes on first run
    ap.add_argument("--temp", type=non_negative_float, default=0.0,
                    help="sampling temperature; 0 = greedy (default 0)")
    ap.add_argument("--top-p", type=unit_fraction, default=1.0, help="nucleus sampling mass in (0, 1] (default 1)")
    ap.add_argument("--top-k", type=non_negative_int, default=0,
                    help="sample among the k most likely tokens; 0 = off (default)")
    ap.add_argument("--seed", type=non_negative_int, default=None, help="random seed for sampling (default: random)")
    ap.add_argument("--max-tokens", type=positive_int, default=DEFAULT_MAX_TOKENS,
                    help=f"maximum tokens per answer (default {DEFAULT_MAX_TOKENS}); an answer also ends when the "
                         "context window is full")
    ap.add_argument("--stop", action="append", type=non_empty, default=[], metavar="TEXT",
                    help="stop string (repeatable)")
    ap.add_argument("--system", help="system prompt (for the REPL and --prompt); without it the model's chat "
                                     "template decides (SmolLM2's adds its own default)")
    ap.add_argument("--overflow", choices=["refuse", "drop_oldest"], default="refuse",
                    help="REPL history beyond the context: refuse the turn (default) or drop the oldest turns")
    ap.add_argument("--color", choices=["auto", "always", "never"], default="auto",
                    help="show the text of accepted draft tokens in cyan (default auto: when stdout is a terminal, "
                         "TERM is not dumb and NO_COLOR is unset or empty)")
    ap.add_argument("--no-history", action="store_true",
                    help="keep the REPL's line history in memory only (default: also in $EDGESPEC_HOME/chat_history, "
                         f"the last {HISTORY_LINES} lines, readable by you alone)")
    ap.add_argument("--plan", action="store_true",
                    help="print a report of the memory plan at the full context (drafter, K / tree nodes, predicted "
                         "peak MB for plain and speculative decoding, both lower bounds) for --device/--budget-mb/"
                         "--context (and --drafter, --calibration, --temp > 0 for sampling) and exit without loading "
                         "the model; exit "
                         "status 0 when the plan fits the budget, 3 when it does not; with --json as one JSON "
                         "object")
    ap.add_argument("--prompt", help="answer this one prompt and exit (no REPL)")
    ap.add_argument("--json", action="store_true",
                    help="with --prompt: print one JSON object (text, token ids, prefill ms, decode tokens/s, "
                         "drafted/accepted, mean accepted length, Python ms per step, peak RSS); with --plan: the "
                         "plan report as one JSON object")
    add_version(ap)
    return ap


def _params(a) -> dict:
    return dict(max_tokens=a.max_tokens, temperature=a.temp, top_p=a.top_p, top_k=a.top_k, seed=a.seed,
                stop=tuple(a.stop))


def _stats_line(st) -> str:
    return (f"[{st.generated} tokens, {st.decode_tok_s:.1f} tok/s decode, prefill {1000 * st.prefill_s:.0f} ms "
            f"({st.reused_tokens} of {st.prompt_tokens} prompt tokens reused), drafter {st.drafter}: "
            f"{st.accepted}/{st.drafted} drafts accepted, {st.mean_accepted:.2f} tokens/step]")


def _result_json(r, st) -> dict:
    return {"text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason,
            "prefill_ms": round(1000 * st.prefill_s, 2), "decode_tok_s": round(st.decode_tok_s, 2),
            "drafter": st.drafter, "drafted": st.drafted, "accepted": st.accepted, "steps": st.steps,
            "mean_accepted_len": round(st.mean_accepted, 3), "python_ms_per_step": round(st.python_ms_per_step, 3),
            "prompt_tokens": st.prompt_tokens, "peak_rss_mb": round(peak_rss_mb(), 1)}


def _stats_info(engine, last) -> dict:
    """/stats: the last answer's counters, measured memory, and the current plan with its predicted peak."""
    import psutil

    info = {"last_answer": last.to_dict() if last else {}, "context_tokens": engine.target.cache.length,
            "context_window": engine.context,
            "memory_mb": {"measured_peak_rss": round(peak_rss_mb(), 1),
                          "measured_rss_now": round(psutil.Process().memory_info().rss / 2**20, 1)}}
    if engine.plan is not None:
        p = engine.plan
        info["plan"] = {"drafter": p.drafter, "k": p.k, "nodes": p.nodes, "tree": p.tree, "context": p.context,
                        "max_context": p.max_context, "speedup": round(p.speedup, 3), "reason": p.reason}
        info["memory_mb"].update(budget=p.budget_mb, predicted_peak=round(p.peak_mb, 1),
                                 predicted_plain_peak=round(p.plain_peak_mb, 1))
    return info


def _rows(rows) -> str:
    """(label, value) pairs as aligned lines, one fact a line."""
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"  {label:<{width}}  {value}" for label, value in rows)


def _drafts_shape(drafter: str, tree: str, nodes: int) -> str:
    if drafter == "none" or not nodes:
        return "plain decoding (no drafts)"
    return f"{drafter}, a best-first tree of {nodes} draft tokens a call" if tree == "best-first" else \
        f"{drafter}, a chain of up to {nodes} draft tokens a call"


def _stats_text(info: dict) -> str:
    """/stats for a reader: the figures of `_stats_info`, rounded (tok/s, ms and MB to one decimal)."""
    a, mem = info["last_answer"], info["memory_mb"]
    if a:
        new = a["prompt_tokens"] - a["reused_tokens"]
        rows = [("answer", f"{a['generated']:,} tokens, drafter {a['drafter']}"),
                ("decode", f"{a['decode_tok_s']:.1f} tok/s ({1000 * a['decode_s']:,.1f} ms in all)"),
                ("prefill", f"{1000 * a['prefill_s']:,.1f} ms for {new:,} new prompt tokens ({a['reused_tokens']:,} "
                            f"of {a['prompt_tokens']:,} reused from the cache)"),
                ("drafts accepted", f"{a['accepted']:,} of {a['drafted']:,}"),
                ("tokens per step", f"{a['mean_accepted']:.2f} over {a['steps']:,} target calls"),
                ("Python per step", f"{a['python_ms_per_step']:.1f} ms")]
    else:
        rows = [("answer", "none yet")]
    rows.append(("context", f"{info['context_tokens']:,} of {info['context_window']:,} tokens in use"))
    rows.append(("memory", f"peak RSS {mem['measured_peak_rss']:,.1f} MB, now {mem['measured_rss_now']:,.1f} MB"))
    p = info.get("plan")
    if p:
        rows.append(("plan", f"{_drafts_shape(p['drafter'], p['tree'], p['nodes'])}; predicted {p['speedup']:.2f}x "
                             f"plain decoding; fits the budget up to {p['max_context']:,} tokens of context"))
        rows.append(("predicted peak", f"{mem['predicted_peak']:,.1f} MB (plain decoding "
                                       f"{mem['predicted_plain_peak']:,.1f} MB) of a {mem['budget']:,.1f} MB budget"))
    return _rows(rows)


def _plan_text(rep: dict, model: str, sampling: bool, start: dict | None = None, max_tokens: int = 0) -> str:
    """`edge-chat --plan` for a reader: the report of `plan_report`, one fact a line, the verdict stated plainly.
    The report is for the full context (a chat's last turn); `start`, the plan a short first question with
    `max_tokens` gets (the engine re-plans every request for the context it can reach)."""
    p, peak = rep.get("plan"), rep.get("predicted_peak_mb") or {}
    spec = rep["min_budget_speculative_mb"]
    rows = [("model", model),
            ("device", rep["device"] + (" (simulated on the CPU)" if rep.get("simulated") else "")),
            ("calibration", rep["calibration"] or "none (built-in priors)"),
            ("answers", "sampled (--temp > 0)" if sampling else "greedy"),
            ("context", f"{rep['context']:,} tokens"),
            ("budget", f"{rep['budget_mb']:,.1f} MB"),
            ("plain decoding needs", f"at least {rep['min_budget_plain_mb']:,.1f} MB"),
            ("speculation needs", "(no speculative plan is predicted faster than plain decoding)" if spec is None
             else f"at least {spec:,.1f} MB")]
    if p:
        rows += [("plan", _drafts_shape(p["drafter"], p["tree"], p["nodes"]) + ", with the context full"),
                 ("predicted speed", f"{p['tokens_per_s']:,.1f} tok/s, {p['speedup']:.2f}x plain decoding"),
                 ("predicted peak", f"{peak['speculative']:,.1f} MB (plain decoding {peak['plain']:,.1f} MB)"),
                 ("holds up to", f"{p['max_context']:,} tokens before it re-plans")]
        if start:
            rows.append(("at a chat's start", f"{_drafts_shape(start['drafter'], start['tree'], start['nodes'])}, "
                                              f"{start['speedup']:.2f}x plain decoding (a short first question with "
                                              f"--max-tokens {max_tokens:,}; re-planned every turn as the chat grows)"))
        rows.append(("verdict", f"fits: {peak['speculative']:,.1f} MB of the {rep['budget_mb']:,.1f} MB budget"))
    else:
        rows.append(("verdict", "does not fit"))
        if rep.get("error"):
            rows.append(("why", rep["error"]))
    return (f"memory plan at the full {rep['context']:,}-token context (predicted from the manifest; the model was "
            "not loaded)\n" + _rows(rows))


# ---------------------------------------------------------------------------------------------- the terminal
def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # replaced or closed streams
        return False


def _use_color(choice: str) -> bool:
    if choice != "auto":
        return choice == "always"
    return _isatty(sys.stdout) and os.environ.get("TERM") != "dumb" and not os.environ.get("NO_COLOR")


class DraftColors:
    """Writes an answer's text with what accepted draft tokens produced in colour. A chunk's text is not simply its
    tokens' text (the engine decodes a step's tokens together and holds text back while a character or a stop string
    may be incomplete), so the same tokens are decoded again here, the drafted ones (the first `Chunk.drafted` of a
    chunk's ids; the rest are the target's own) apart from the target's, and the chunk's characters are coloured by
    the part they came from. Should the two texts ever differ (a tokenizer whose text depends on where decoding
    splits), it falls back to colouring, by chunk, the text of chunks that had accepted drafts."""

    def __init__(self, codec, eos):
        from .text import StreamDecoder

        self.dec, self.eos = StreamDecoder(codec), set(eos)
        self.pending: list[list] = []  # [text, drafted] decoded here and not yet matched with the engine's text
        self.exact = True

    def paint(self, ch) -> str:
        for ids, drafted in ((ch.token_ids[:ch.drafted], True), (ch.token_ids[ch.drafted:], False)):
            self._queue(self.dec.push([t for t in ids if t not in self.eos]), drafted)
        if ch.finish_reason is not None:
            self._queue(self.dec.flush(), bool(self.pending) and self.pending[-1][1])
        if not self.exact:
            return _colored(ch.text, ch.drafted > 0)
        out, text, i = [], ch.text, 0
        while i < len(text):
            if not self.pending or not text.startswith(self.pending[0][0][: len(text) - i], i):
                self.exact = False  # the texts parted: colour by chunk from here on
                return "".join(out) + _colored(text[i:], ch.drafted > 0)
            seg, drafted = self.pending[0]
            n = min(len(seg), len(text) - i)
            out.append(_colored(text[i:i + n], drafted))
            if n == len(seg):
                self.pending.pop(0)
            else:
                self.pending[0][0] = seg[n:]
            i += n
        return "".join(out)

    def _queue(self, text: str, drafted: bool) -> None:
        if text:
            self.pending.append([text, drafted])


def _colored(text: str, drafted: bool) -> str:
    return f"{DRAFT_COLOR}{text}{RESET_COLOR}" if drafted and text else text


class OutputError(Exception):
    """stdout refused a write (a full disk, /dev/full); main() says so in one line. A closed pipe stays
    BrokenPipeError, ended quietly."""


def _emit(text: str) -> None:
    """Writes `text` to stdout at once (OutputError when it cannot be written)."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as e:
        raise OutputError(e.strerror or str(e)) from None


def _show(chunks, painter=None) -> tuple[str | None, int]:
    """Streams an answer to stdout; (its finish reason, its token count)."""
    finish, n = None, 0
    for ch in chunks:
        _emit(painter.paint(ch) if painter else ch.text)
        finish, n = ch.finish_reason or finish, n + len(ch.token_ids)
    return finish, n


def _context_cut(engine, finish: str | None, n: int, max_tokens: int) -> bool:
    """The answer ended because the context window was full: "length" before max_tokens, or with the cache full."""
    return finish == "length" and (n < max_tokens or engine.target.cache.length + 2 > engine.context)


def _context_note(engine, n: int, repl: bool, overflow: str = "refuse") -> str:
    most = engine.manifest.target.max_len
    larger = (f"{'restart edge-chat' if repl else 'run again'} with a larger --context (this export holds up to "
              f"{most:,})" if engine.context < most else
              "re-export with a larger --max-len (this export holds no more)")
    if not repl:
        return (f"note: the context window ({engine.context:,} tokens) is full: it cut the answer at {n:,} tokens; "
                f"for more room shorten the prompt or {larger}")
    ways = ["/reset to start over"] + (["restart with --overflow drop_oldest to drop the oldest turns"]
                                       if overflow != "drop_oldest" else []) + [larger]
    return (f"note: the context window ({engine.context:,} tokens) is full: it cut this answer at {n:,} tokens; for "
            f"more room: {'; '.join(ways)}")


def _history_path():
    import edge

    return edge.home() / "chat_history"


class Lines:
    """Where the REPL's lines come from. On a terminal: GNU readline (editing, arrow keys, a history kept in memory
    and, unless `history` is None, in that file), which reads the terminal in raw mode, so a pasted line longer than
    the tty's 4,095-byte canonical-mode line arrives whole. Piped in: plain lines, no prompt (stdout carries only
    answers)."""

    def __init__(self, interactive: bool, history=None):
        self.interactive, self.history, self.readline = interactive, history, None
        _replacing_stdin(interactive)
        if not interactive:
            return
        try:
            import readline
        except ImportError:  # a Python built without it: plain input(), still interactive
            return
        self.readline = readline
        readline.set_history_length(HISTORY_LINES)
        if history is not None:
            try:
                readline.read_history_file(history)
            except OSError:  # none yet, or unreadable: start empty
                pass

    def ask(self, prompt: str) -> str:
        """The next line (EOFError at the end of input, KeyboardInterrupt on Ctrl-C)."""
        if not self.interactive:
            return input()
        if _isatty(sys.stdout):
            return input(prompt)
        if not _isatty(sys.stderr):
            return input()  # no terminal to show the prompt on
        # Python hands input() to readline only when stdout is the terminal too; with answers redirected, point fd 1
        # at the terminal (stderr) while the line is read, so the prompt and the editing show there
        sys.stdout.flush()
        saved = os.dup(1)
        try:
            os.dup2(2, 1)
            return input(prompt)
        finally:
            os.dup2(saved, 1)
            os.close(saved)

    def close(self) -> None:
        """Saves the history (best effort: a read-only home only loses the history)."""
        if self.readline is None or self.history is None:
            return
        try:
            self.history.parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(self.history, os.O_WRONLY | os.O_CREAT, 0o600))  # what you typed is yours alone
            os.chmod(self.history, 0o600)  # (a file an older run left)
            self.readline.write_history_file(self.history)
        except OSError as e:
            print(f"edge-chat: note: history not saved to {self.history} ({e.strerror or e})", file=sys.stderr)


def _replacing_stdin(interactive: bool) -> None:
    """An invalid byte read becomes U+FFFD, as in --prompt's text, instead of a UnicodeDecodeError that ended the
    session under a strict locale (en_US.UTF-8): piped input is read as UTF-8 in every locale, a terminal in its own."""
    try:
        if interactive:
            sys.stdin.reconfigure(errors="replace")
        else:
            sys.stdin.reconfigure(encoding="utf-8", errors="replace")
    except (AttributeError, ValueError, OSError):  # a replaced stdin, or one already read from: left as it is
        pass


def read_turn(ask) -> tuple[str, bool]:
    """The next turn from `ask(prompt)`: (text, is_block). A line whose text starts with \"\"\" opens a block that
    ends at a line ending with \"\"\" (Ollama's multi-line input); the block, without the quotes and the line breaks
    right inside them, is one message, never a command. Blank lines are skipped. EOFError when input ends before a
    turn; a block the input ends inside is returned as it was typed, with a note."""
    line = ""
    while not line.strip():
        line = ask("> ")
    first = line.lstrip()
    if not first.startswith(BLOCK):
        return line, False
    parts, rest = [], first[len(BLOCK):]
    while not rest.rstrip().endswith(BLOCK):
        parts.append(rest)
        try:
            rest = ask("... ")
        except EOFError:
            print(f'edge-chat: note: input ended inside a {BLOCK} block; sending it as it is', file=sys.stderr)
            return "\n".join(parts).strip("\n"), True
    parts.append(rest.rstrip()[: -len(BLOCK)])
    return "\n".join(parts).strip("\n"), True


def _command(cmd: str, engine, chat, last) -> bool:
    """Runs a /command; False when `cmd` is none (a question that starts with a slash)."""
    if cmd == "/reset":
        chat.reset()
        print("(conversation cleared)", file=sys.stderr)
    elif cmd == "/help":
        print(HELP, file=sys.stderr)
    elif cmd in ("/stats", "/stats json"):
        info = _stats_info(engine, last)
        print(json.dumps(info, indent=2) if cmd.endswith("json") else _stats_text(info), file=sys.stderr)
    elif re.fullmatch(r"/[A-Za-z]+(\s+\S+)?", cmd):  # a mistyped command is not sent to the model as a question
        print(f"unknown command {cmd}; {HELP}", file=sys.stderr)
    else:
        return False
    return True


def _answer(engine, chat, a, line: str, color: bool, interactive: bool = True):
    """One turn: the answer streamed to stdout, then a note if the context cut it and the stats line (stderr).
    The Stats of the turn, or None when it was refused (nothing generated). Ctrl-C stops the answer and keeps the
    chat on a terminal; with input piped in it ends the session (KeyboardInterrupt), as it ends --prompt."""
    stream = chat.send(line, **_params(a), drafter=a.drafter)
    try:
        finish, n = _show(stream, DraftColors(engine.codec, engine.eos) if color else None)
        _emit("\n")
    except KeyboardInterrupt:
        stream.close()  # the chat keeps what was shown; the KV cache is rolled back to it
        if not interactive:
            _emit("\n")  # what was shown stays shown, on a line of its own
            raise
        print("\n(stopped)", file=sys.stderr)
        finish = n = None
    except Exception as e:  # keep the session alive on a bad request
        from . import ContextFull, EngineError

        if isinstance(e, ContextFull):
            most = engine.manifest.target.max_len
            bigger = (f"restart edge-chat with a larger --context (this export holds up to {most})"
                      if e.context < most else "this export holds no more")
            if e.alone:  # nothing earlier to drop: only a shorter question or a larger window helps
                what = (f"question is {e.n} tokens with the chat template" if engine.has_chat_template else
                        f"text is {e.n} tokens")
                print(f"error: this {what} but the context holds {e.context}: shorten it, or {bigger}",
                      file=sys.stderr)
            elif chat.overflow != "drop_oldest":
                print(f"error: the conversation is {e.n} tokens but the context holds {e.context}: /reset to start "
                      "over, or restart edge-chat with --overflow drop_oldest", file=sys.stderr)
            else:
                print(f"error: {e}", file=sys.stderr)
            return None
        if not isinstance(e, EngineError):
            raise
        print(f"error: {e}", file=sys.stderr)
        return None  # nothing was generated: no stats line for this turn
    if n is not None and _context_cut(engine, finish, n, a.max_tokens):
        print(_context_note(engine, n, True, chat.overflow), file=sys.stderr)
    print(_stats_line(engine.last_stats), file=sys.stderr)
    return engine.last_stats


def _repl(engine, a) -> int:
    chat = engine.chat(system=a.system, overflow=a.overflow)
    interactive = _isatty(sys.stdin)
    color = _use_color(a.color)
    lines = Lines(interactive, None if a.no_history else _history_path())
    if interactive:
        legend = f" · {DRAFT_COLOR}accepted drafts in cyan{RESET_COLOR}" if color else ""
        print(f"edgespec · {engine.manifest.name} · drafter {engine.default_drafter}{legend}\n{HELP}",
              file=sys.stderr)
    last, failed = None, False
    try:
        while True:
            try:
                line, block = read_turn(lines.ask)
                cmd = "" if block else line.strip()
                if cmd in ("/quit", "/exit"):
                    return 2 if failed else 0
                if cmd.startswith("/") and _command(cmd, engine, chat, last):
                    continue
                if line.strip():
                    st = _answer(engine, chat, a, line, color, interactive)
                    # piped in, a refused turn is said on stderr and the session goes on, but it exits 2 (as
                    # --prompt does) so a script sees it
                    failed = failed or (st is None and not interactive)
                    last = st or last
            except EOFError:
                if interactive:
                    print(file=sys.stderr)
                return 2 if failed else 0
            except KeyboardInterrupt:  # on a terminal, Ctrl-C outside an answer clears the line, as in a shell
                if not interactive:
                    raise
                print("\n(Ctrl-D or /quit exits)", file=sys.stderr)
    finally:
        lines.close()


def _print_plan(a) -> int:
    import edge
    from edge.manifest import ModelDirError, load_manifest, require_drafter_graph
    from edge.planning import plan_report, profile_for

    d = edge.resolve_model(a.model)
    try:
        profile = profile_for(a.device, a.simulate, a.calibration, d)
    except Exception as e:  # ProfileError / ProviderUnavailable / CalibrationError: say what to do
        print(f"edge-chat: error: {e}", file=sys.stderr)
        return 2
    m = load_manifest(d, verify="none")
    if a.drafter == "model":  # as loading with it would refuse, instead of planning without it
        try:
            require_drafter_graph(d, m)
        except ModelDirError as e:
            print(f"edge-chat: error: {e}", file=sys.stderr)
            return 2
    if a.context and a.context > m.target.max_len:  # as edge.load says it
        print(f"edge-chat: error: --context {a.context} is more than the {m.target.max_len} tokens {d} was exported "
              "for", file=sys.stderr)
        return 2
    context = a.context or min(DEFAULT_CONTEXT, m.target.max_len)
    rep = plan_report(m, profile, context, a.budget_mb, drafter=a.drafter,
                      sampling=a.temp > 0)  # the plan the engine would run for these flags, at the full context
    if a.json:
        _emit(json.dumps(rep) + "\n")
    else:
        start = None
        if rep["plan"]:  # a first request plans for its prompt plus --max-tokens (Engine._plan_request)
            start = plan_report(m, profile, context, a.budget_mb, at=min(rep["plan"]["context"], a.max_tokens),
                                drafter=a.drafter, sampling=a.temp > 0)["plan"]
        _emit(_plan_text(rep, m.name, a.temp > 0, start, a.max_tokens) + "\n")
    return 0 if rep["fits"] else 3


def main(argv=None) -> int:
    ap = _parser()
    a = ap.parse_args(argv)
    plain_warnings("edge-chat")
    if a.json and a.prompt is None and not a.plan:
        ap.error("--json needs --prompt (or --plan)")
    if a.simulate and a.device is None:
        ap.error("--simulate runs a --device profile on the CPU: give --device")
    if a.prompt is not None and not a.prompt.strip():
        ap.error("--prompt is empty")
    unused = [f for f, on in (("--top-k", a.top_k), ("--top-p", a.top_p != 1.0), ("--seed", a.seed is not None)) if on]
    if unused and a.temp == 0 and not a.plan:
        print(f"edge-chat: note: {'/'.join(unused)} only shape sampling, and --temp 0 (the default) decodes greedily; "
              "add --temp, e.g. --temp 0.7", file=sys.stderr)
    try:
        return _main(a)
    except BrokenPipeError:  # stdout closed early (edge-chat ... | head): stop quietly, as a SIGPIPE'd tool would
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at interpreter exit
        return 141
    except OutputError as e:  # a full disk, /dev/full
        print(f"edge-chat: error: cannot write the output: {e}", file=sys.stderr)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # what is unwritten is not retried at exit
        return 1
    except (KeyboardInterrupt, ImportError) as e:
        if not was_interrupted(e):
            raise
        print("\nedge-chat: interrupted", file=sys.stderr)
        return 130


def _main(a) -> int:
    import edge
    from edge import EngineError

    from .engine import base_model

    try:
        if a.plan:
            return _print_plan(a)
        t = time.perf_counter()
        engine = edge.load(a.model, drafter=a.drafter, device=a.device, budget_mb=a.budget_mb, threads=a.threads,
                           context=a.context, simulate=a.simulate, calibration=a.calibration, verify=a.verify)
        load_s = time.perf_counter() - t
        problem = chat_context_problem(engine, a.system)
        if problem:
            print(f"edge-chat: error: {problem}", file=sys.stderr)
            return 2
        if not engine.has_chat_template:  # said once, before anything is continued
            print(f"edge-chat: note: {base_model(engine.manifest.name)}; "
                  + ("the prompt is continued as it is" if a.prompt is not None else
                     "what you type joins one running text, which it continues (/reset starts a new text)"),
                  file=sys.stderr)
        if a.prompt is None:
            return _repl(engine, a)
        if a.json:
            return _answer_json(engine, a, load_s)
        stream = engine.stream(_question(engine, a), **_params(a), drafter=a.drafter)
        try:
            finish, n = _show(stream, DraftColors(engine.codec, engine.eos) if _use_color(a.color) else None)
        except KeyboardInterrupt:
            stream.close()  # the KV cache rolls back; what was shown stays shown, on a line of its own
            _emit("\n")
            raise
        _emit("\n")  # a closed pipe shows here, inside main(), not at interpreter exit
        if _context_cut(engine, finish, n, a.max_tokens):
            print(_context_note(engine, n, False), file=sys.stderr)
        print(_stats_line(engine.last_stats), file=sys.stderr)
        return 0
    except (EngineError, ValueError) as e:  # ModelDirError is an EngineError
        print(f"edge-chat: error: {e}", file=sys.stderr)
        return 2


def _question(engine, a):
    """--prompt as the engine takes it: after the --system prompt through the chat template, or for a base model
    the text itself, which it continues."""
    return messages(a.prompt, a.system) if engine.has_chat_template else a.prompt


def _answer_json(engine, a, load_s: float) -> int:
    """--prompt --json: one JSON object; after Ctrl-C it still comes, with what was generated so far and
    finish_reason "interrupted" (exit status 130)."""
    from .engine import GenerationResult, collect

    r, rc = GenerationResult("", [], "length"), 0
    stream = engine.stream(_question(engine, a), **_params(a), drafter=a.drafter)
    try:
        collect(stream, engine, r)
    except KeyboardInterrupt:
        stream.close()  # rolls the KV cache back and fills in the counters of what ran
        r.finish_reason, rc = "interrupted", 130
        print("\nedge-chat: interrupted", file=sys.stderr)
    out = _result_json(r, r.stats)
    out["load_s"] = round(load_s, 2)
    _emit(json.dumps(out) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
