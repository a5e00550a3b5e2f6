"""gpt-oss's harmony output: messages on channels, each marked by special tokens (so the
answer is decoded with them: `tools.keeps_markers`). After the prompt's `<|start|>assistant`:

    <|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>commentary<|message|>A PREAMBLE<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{ARGS}<|call|>
    <|start|>assistant<|channel|>final<|message|>THE ANSWER<|return|>

The recipient may also come before the channel (` to=functions.NAME<|channel|>commentary
json<|message|>`, as gpt-oss's chat template writes calls back). `analysis` is reasoning (until
the first content: an answer is its reasoning, then its content, so an analysis after that is
content too); `final` and a commentary without a recipient are content; a commentary to
`functions.NAME` is a call of NAME (one of the offered tools, its arguments a JSON object;
anything else there stays content). Two messages of one kind are joined by a blank line.
`<|call|>` and `<|return|>` end the output (they are stop tokens, so not in its text); a
message the model ended with `<|start|>` alone ends there. An output that does not start like
a message (or whose header runs past HEAD_MAX) is plain content, its markers as written.

`Splitter` reads a stream as reasoning.ThinkSplitter does, the calls as each message ends; every
delta is read in time linear in itself (a header is at most HEAD_MAX characters)."""

from __future__ import annotations

from typing import Any

from radixserve.server.chat.text_scan import loads, partial_tail
from radixserve.server.protocol import ToolCall, new_call

START, END, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"
CALL, RETURN = "<|call|>", "<|return|>"
FINAL = CHANNEL + "final" + MESSAGE  # a constraint on the answer (a JSON schema) starts after it
ENDS = (END, CALL, RETURN, START)  # (a message the model ended with <|start|> alone: the next one's header)
HEADS = (START, CHANNEL, " to=", "to=")  # how a message's header may start
HEAD_MAX = 256  # a longer header is no header: the rest is plain content
SEPARATOR = START + "assistant"  # between two messages of one answer, after the first one's <|end|>


class Splitter:
    """One answer's (reasoning, content) as its text comes, its calls (`take_calls`) as each
    call message ends; `tools` are the callable ones by name (none: a call is content)."""

    def __init__(self, tools: dict[str, Any]) -> None:
        self.tools = tools
        self.state = "head"  # head (a header, up to <|message|>) | body | plain (not harmony: all content)
        self.kind = "c"  # the body's: r (reasoning), c (content) or call
        self.recipient = ""
        self.saw_reasoning = False
        self.calls: list[ToolCall] = []
        self._new = 0  # calls[_new:] not taken yet
        self._held = ""  # text not handed out yet: a header, or what may be the start of an end marker
        self._args: list[str] = []  # the call being read
        self._wrote = {"r": False, "c": False}  # a message of this kind has text: the next one starts on a new paragraph
        self._fresh = False  # the open message has written nothing yet

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of one more text delta."""
        out: dict[str, list[str]] = {"r": [], "c": []}
        self._held += text
        while self._held and self._step(out):
            pass
        return "".join(out["r"]), "".join(out["c"])

    def flush(self) -> tuple[str, str]:
        """What was held back, once the output has ended: the last message's end (its stop token
        is not in the text), or a header cut short (dropped)."""
        out: dict[str, list[str]] = {"r": [], "c": []}
        held, self._held = self._held, ""
        if self.state == "body":
            self._emit(out, held)
            self._close(out)
        elif self.state == "plain" or not _may_head(held.lstrip()):
            out["c"].append(held)
        return "".join(out["r"]), "".join(out["c"])

    def take_calls(self) -> list[ToolCall]:
        """The calls read since the last take."""
        new, self._new = self.calls[self._new:], len(self.calls)
        return new

    def _step(self, out: dict[str, list[str]]) -> bool:
        """Hand out what can be decided of `_held`; False when the rest must wait for more text."""
        h = self._held
        if self.state == "plain":
            out["c"].append(h)
            self._held = ""
            return False
        if self.state == "head":
            at = h.find(MESSAGE)
            if at < 0 or at > HEAD_MAX or not _may_head(h[:at].lstrip()):  # (text before a header: no header)
                if not _may_head(h.lstrip()) or len(h) > HEAD_MAX or at >= 0:
                    self.state = "plain"
                    return True
                return False
            self._open(h[:at])
            self._held, self.state = h[at + len(MESSAGE):], "body"
            return True
        found = [(i, m) for m in ENDS if (i := h.find(m)) >= 0]
        if found:
            end, marker = min(found)
            self._emit(out, h[:end])
            self._close(out)
            self._held, self.state = h[end + (0 if marker == START else len(marker)):], "head"
            return True
        keep = max(partial_tail(h, m) for m in ENDS)
        self._emit(out, h[:len(h) - keep])
        self._held = h[len(h) - keep:]
        return False

    def _open(self, header: str) -> None:
        """A message's header: its channel and recipient."""
        channel = _word(header, CHANNEL)
        self.recipient = _word(header, "to=")
        if channel == "analysis" and not self._wrote["c"] and not self.calls:
            self.kind, self.saw_reasoning = "r", True
        else:
            self.kind = "call" if self.recipient else "c"
        self._args, self._fresh = [], True

    def _emit(self, out: dict[str, list[str]], text: str) -> None:
        if self.kind == "call":
            self._args.append(text)
        elif text:
            if self._fresh and self._wrote[self.kind]:
                out[self.kind].append("\n\n")
            self._fresh, self._wrote[self.kind] = False, True
            out[self.kind].append(text)

    def _close(self, out: dict[str, list[str]]) -> None:
        """The end of a message: a call message is a call, or (a tool not offered, arguments
        that are not a JSON object) content."""
        if self.kind != "call":
            return
        args = "".join(self._args)
        name = self.recipient.removeprefix("functions.")
        obj = loads(args) if self.recipient.startswith("functions.") and name in self.tools else None
        self._args = []
        if isinstance(obj, dict):
            self.calls.append(new_call(name, obj))
        elif args.strip():
            self.kind = "c"
            self._emit(out, args)


def _may_head(text: str) -> bool:
    """`text` starts like a message header (or is the start of one)."""
    return any(text.startswith(m) or m.startswith(text) for m in HEADS)


def _word(header: str, after: str) -> str:
    """The word after `after` in a header: up to a space or the next marker ("" if none)."""
    at = header.find(after)
    if at < 0:
        return ""
    rest = header[at + len(after):]
    end = len(rest)
    for stop in (" ", "\n", "<|"):
        if (i := rest.find(stop)) >= 0:
            end = min(end, i)
    return rest[:end]


def read(text: str, tools: dict[str, Any]) -> tuple[str | None, str | None, list[ToolCall]]:
    """A whole answer as (reasoning or None, content or None, calls)."""
    s = Splitter(tools)
    r, c = s.feed(text)
    r2, c2 = s.flush()
    reasoning, content = r + r2, (c + c2).strip()
    return (reasoning if s.saw_reasoning else None), (content or None), s.calls


def parse(text: str, tools: dict[str, Any]) -> tuple[str | None, list[ToolCall]]:
    """tool_parsers' reading of an answer: (content left, calls); the reasoning is not content."""
    _, content, calls = read(text, tools)
    return content, calls

