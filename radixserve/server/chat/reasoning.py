"""Reasoning models: split `<think>...</think>` reasoning from the answer (`--reasoning-parser`).

    qwen3        output:  [ws] <think> reasoning </think> [ws] content   (or only content)
    deepseek_r1  prompt:  ... <think>            (the chat template opens the reasoning)
                 output:  [<think>] reasoning </think> [ws] content

The streaming splitter hands each text delta back as (reasoning, content). A tag split across
deltas is held back until it is whole (or the output ends), so no tag text leaks either way.
`split` runs the same splitter over a whole text: a stream and its whole answer always agree.
Whitespace right after a tag is dropped; output without tags (qwen3) is content, unchanged.

Shared by the three chat-like APIs (chat, /v1/responses, /v1/messages): `active` (is the
output split), `grammar_after` (where a constraint starts), `answer` (a finished output as
reasoning, content and the tool calls read from the content only), `reasoning_tokens`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from radixserve.engine.outputs import Output
from radixserve.server.chat import cut_calls, harmony, tools
from radixserve.server.chat.call_stream import CallStream
from radixserve.server.chat.text_scan import partial_tail
from radixserve.server.errors import ApiError
from radixserve.server.protocol import ToolCall

if TYPE_CHECKING:
    from radixserve.server.chat.core import Plan

OPEN, CLOSE = "<think>", "</think>"
PARSERS = {"qwen3": False, "deepseek_r1": True}  # parser -> the output starts inside the reasoning
MARKER = CLOSE  # a constraint (JSON, a tool call) applies from here on: SamplingParams.grammar_after


class ThinkSplitter:
    """States: start | open? -> think_ws -> think -> content_ws -> content (start may go straight
    to content). NOTE: `_held` is text not handed out yet: it may be (the start of) a tag, or
    whitespace after one; in start and open?, the whitespace before it is in `_lead` (read once:
    an answer of spaces costs its length, not its square)."""

    def __init__(self, starts_inside: bool) -> None:
        self.state = "open?" if starts_inside else "start"
        self._held = ""
        self._lead: list[str] = []
        self.saw_reasoning = starts_inside

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of one more text delta."""
        out: dict[str, list[str]] = {"r": [], "c": []}
        if self.state in ("start", "open?") and not self._held:
            rest = text.lstrip()
            self._lead.append(text[:len(text) - len(rest)])
            text = rest
        self._held += text
        while self._held and self._step(out):
            pass
        return "".join(out["r"]), "".join(out["c"])

    def flush(self) -> tuple[str, str]:
        """What was held back, once the output has ended (an unfinished tag is plain text)."""
        held, self._held = "".join(self._lead) + self._held, ""
        self._lead = []
        return ("", held) if self.state in ("start", "content") else (held, "")

    def _step(self, out: dict[str, list[str]]) -> bool:
        """Hand out what can be decided of `_held`; False when the rest must wait for more text."""
        h, state = self._held, self.state
        if state in ("start", "open?"):  # an optional <think> first, after the whitespace in _lead
            if h.startswith(OPEN):
                self._held, self.state, self.saw_reasoning = h[len(OPEN):], "think_ws", True
                self._lead = []
                return True
            if OPEN.startswith(h):
                return False
            self._held = "".join(self._lead) + h
            self._lead = []
            self.state = "think_ws" if state == "open?" else "content"
            return True
        if state in ("think_ws", "content_ws"):
            self._held = h.lstrip()
            if self._held:
                self.state = "think" if state == "think_ws" else "content"
            return bool(self._held)
        if state == "content":
            out["c"].append(h)
            self._held = ""
            return False
        end = h.find(CLOSE)
        if end >= 0:
            out["r"].append(h[:end])
            self._held, self.state = h[end + len(CLOSE):], "content_ws"
            return True
        keep = partial_tail(h, CLOSE)
        out["r"].append(h[:len(h) - keep])
        self._held = h[len(h) - keep:]
        return False


def thinking_on(template_kwargs: dict[str, Any] | None) -> bool:
    """False when the client turned thinking off in the chat template (Qwen3's enable_thinking,
    DeepSeek V3.1's thinking): the template then closes the reasoning in the prompt itself."""
    kw = template_kwargs or {}
    return kw.get("enable_thinking") is not False and kw.get("thinking") is not False


def active(parser: str | None, template_kwargs: dict[str, Any] | None) -> str | None:
    """The parser that splits this request's output: none when thinking is off in the template."""
    return parser if thinking_on(template_kwargs) else None


def grammar_after(parser: str | None, constrained: bool) -> str | None:
    """Where a constraint (JSON, a required tool call) starts: after the reasoning, when it is
    split (in a harmony answer: where its final message starts)."""
    if not (parser and constrained):
        return None
    return harmony.FINAL if parser == "harmony" else MARKER


def splitter(parser: str | None, tools: Sequence[Any] = ()) -> ThinkSplitter | harmony.Splitter | None:
    """A fresh splitter for one choice, or None when there is nothing to split; a harmony
    answer's also reads the calls of `tools` (harmony.Splitter.take_calls)."""
    if parser == "harmony":
        return harmony.Splitter({t.name: t for t in tools})
    return None if parser is None else ThinkSplitter(PARSERS[parser])


def feed(s: ThinkSplitter | harmony.Splitter | None, text: str, final: bool = False) -> tuple[str, str]:
    """(reasoning, content) of one delta; `final`: the output ends with it."""
    if s is None:
        return "", text
    r, c = s.feed(text)
    if final:
        r2, c2 = s.flush()
        r, c = r + r2, c + c2
    return r, c


class LiveParts:
    """One streamed answer's parts as its text comes, opened lazily and in order: the reasoning
    part once the splitter sees reasoning, the content part at its first content (closing the
    reasoning), and with tools (`calls`, auto mode) each call as it completes (closing what is
    open); text from where a call may start is held (`call_stream.CallStream`), and what of it
    is content reaches the client at `finish`. `parts` are the streamed parts' keys in stream
    order ("reasoning", "content", "call:<id>"); each API's stream (Responses items, Anthropic
    blocks) says how a part starts, grows and ends. `live` False: nothing streams (a required
    call, parsed whole at the end)."""

    def __init__(self, parser: str | None, live: bool, calls: CallStream | None = None,
                 offered: Sequence[tools.Tool] = ()) -> None:
        self.split, self.live, self.calls = splitter(parser, offered), live, calls
        self.parts: list[str] = []
        self.open_key: str | None = None
        self._sent: list[str] = []  # the content streamed so far, in pieces (joined when asked for)

    async def feed(self, text: str, final: bool) -> None:
        if not self.live:
            return
        thought, content = feed(self.split, text, final)
        if self.split is not None and self.split.saw_reasoning and "reasoning" not in self.parts:
            await self._open("reasoning")
        if thought:
            await self.reasoning_delta(thought)
        new = self.split.take_calls() if isinstance(self.split, harmony.Splitter) else []
        if self.calls is not None:
            content, new = self.calls.feed(content)
        if content:
            if self.open_key != "content":
                await self._open("content")
            self._sent.append(content)
            await self.content_delta(self.parts.index("content"), content)
        for call in new:
            await self._close_open()
            self.parts.append("call:" + call.id)
            await self.tool_call(len(self.parts) - 1, call)

    def streamed_calls(self) -> list[ToolCall]:
        if isinstance(self.split, harmony.Splitter):
            return self.split.calls
        return self.calls.calls if self.calls is not None else []

    @property
    def sent(self) -> str:
        """The content streamed so far."""
        if len(self._sent) > 1:
            self._sent = ["".join(self._sent)]
        return self._sent[0] if self._sent else ""

    def rest(self, content: str) -> str:
        """What of the final content the stream has not sent yet."""
        sent = self.sent
        if content.startswith(sent):
            return content[len(sent):]
        return content.lstrip()[len(sent):] if content.lstrip().startswith(sent) else ""

    async def _open(self, key: str) -> None:
        await self._close_open()
        self.parts.append(key)
        self.open_key = key
        await (self.open_reasoning() if key == "reasoning" else self.open_content(len(self.parts) - 1))

    async def _close_open(self) -> None:
        key, self.open_key = self.open_key, None
        if key == "reasoning":
            await self.close_reasoning()
        elif key == "content":
            await self.close_content(self.parts.index("content"))

    async def open_reasoning(self) -> None: ...

    async def reasoning_delta(self, text: str) -> None: ...

    async def close_reasoning(self) -> None: ...

    async def open_content(self, index: int) -> None: ...

    async def content_delta(self, index: int, text: str) -> None: ...

    async def close_content(self, index: int) -> None: ...

    async def tool_call(self, index: int, call: ToolCall) -> None: ...


def split(text: str, parser: str | None) -> tuple[str | None, str | None]:
    """A whole output as (reasoning_content, content): (None, text) when there is no reasoning;
    content None when the output was all reasoning (e.g. cut off by max_tokens)."""
    s = splitter(parser)
    r, c = feed(s, text, final=True)
    if s is None or not s.saw_reasoning:
        return None, text
    return r, c or None


@dataclass
class Answer:
    """A finished output as a client sees it. `reasoning` None: none was split off; `content`
    None: nothing after it (e.g. cut off while reasoning, or all of it a tool call). `cut`: the
    last call was cut short by max_tokens (server.cut_calls): its arguments are as written so
    far, not valid JSON."""

    reasoning: str | None
    content: str | None
    calls: list[ToolCall] = field(default_factory=list)
    cut: bool = False
    thought: int = 0  # output tokens that were reasoning (read_answer, given the tokenizer)


def answer(text: str, finish_reason: str, parser: str | None, mode: str = "none",
           offered: list[tools.Tool] | None = None, tool_format: str = "hermes", one_call: bool = False,
           streamed: list[ToolCall] | None = None) -> Answer:
    """Tool calls (mode required: the constrained JSON; auto: calls in `tool_format`, see
    server.chat.tool_parsers) are read from the content only: a call written inside the reasoning is
    not one. `one_call` (parallel_tool_calls false): the first call only. An output cut off by
    max_tokens keeps the calls it completed, as a stream sent them, and the call it was writing
    is a call cut short (server.cut_calls), not text; `streamed`: the calls a stream sent, whose
    ids the same calls keep."""
    if parser == "harmony":  # its calls are messages of their own, read with its channels
        thought, content, read = harmony.read(text, {t.name: t for t in offered or []} if mode != "none" else {})
        read = read[:1] if one_call else read
        for i, sent in enumerate((streamed or [])[: len(read)]):
            read[i] = sent if sent.function == read[i].function else read[i]
        return Answer(thought, content, read)
    thought, content = split(text, parser)
    calls: list[ToolCall] = []
    cut: ToolCall | None = None
    if finish_reason in ("stop", "length") and content is not None and mode == "required":
        calls = tools.calls_from_json(content)
        if not calls and finish_reason == "length":
            content, calls, was_cut = cut_calls.required(content, offered or [])
            cut = calls[-1] if was_cut else None
        content = None if calls else content
    elif finish_reason in ("stop", "length") and content is not None and mode == "auto":
        content, calls = tools.parse_calls(content, offered or [], tool_format)
        if finish_reason == "length":
            content, more, was_cut = cut_calls.in_format(tool_format, content, offered or [])
            calls, cut = calls + more, more[-1] if was_cut else None
        calls = calls[:1] if one_call else calls
        for i, sent in enumerate((streamed or [])[: len(calls)]):
            if sent.function == calls[i].function:
                calls[i] = sent
    return Answer(thought, content, calls, cut is not None and bool(calls) and calls[-1] is cut)


def finish_reason(out: Output) -> str:
    """The output's finish reason; an engine error is a 500, an abort a 503 (ended_early)."""
    if (err := ended_early(out)) is not None:
        raise err
    return out.finish_reason


def ended_early(out: Output) -> ApiError | None:
    """The error of an answer the server did not let finish, None for one that finished. An
    abort (the server shutting down, POST /abort_request, a stream its client stopped reading)
    is no finish reason of the OpenAI or Anthropic APIs: a client must not take the cut answer
    for a whole one, so it is an error (a stream's last event), a 503 the client may retry."""
    if out.finish_reason == "error" and out.error_field == "model":  # e.g. its LoRA adapter unloaded meanwhile
        return ApiError(404, out.error or "model: not served", param="model", code="model_not_found")
    if out.finish_reason == "error" and out.error_field is not None:
        return ApiError(400, out.error or f"{out.error_field}: refused", param=out.error_field)
    if out.finish_reason == "error":
        return ApiError(500, f"internal error while generating: {out.error}", code="internal_error")
    if out.finish_reason == "abort":
        why = out.error or "the server is shutting down, or the request was aborted (POST /abort_request)"
        return ApiError(503, f"the request was aborted before it finished: {why}", code="aborted",
                        headers={"Retry-After": "1"})
    return None


def read(out: Output, plan: Plan, streamed: list[ToolCall] | None = None) -> Answer:
    """A finished output as its plan reads it (`answer`; an engine error is a 500: finish_reason);
    `streamed`: the calls a stream sent, whose ids they keep."""
    return answer(out.text, finish_reason(out), plan.parser, plan.mode, plan.offered, plan.tool_format, plan.one_call,
                  streamed)


T = TypeVar("T")
OFF_LOOP_CHARS = 4096  # a longer finished output is read in a worker thread (see read_long)


async def read_long(outs: Sequence[Output], plan: Plan, build: Callable[..., T], streamed: list[ToolCall] | None = None) -> T:
    """build(*answers): each finished output read as its plan reads it (`read`), and the reply
    built from the answers, on the event loop when the outputs are short, in a worker thread when
    they are long. The reading is linear, but an answer dense with markup (thousands of calls or
    fences: a client can make the model write them) costs up to ~1 µs a character of Python,
    which would stall every other request for tens of milliseconds."""
    def work() -> T:
        return build(*(read(o, plan, streamed) for o in outs))

    return work() if sum(len(o.text) for o in outs) <= OFF_LOOP_CHARS else await asyncio.to_thread(work)


async def read_answer(out: Output, plan: Plan, streamed: list[ToolCall] | None = None, tok: Any = None) -> Answer:
    """One output read as read_long reads it, for a reply that is cheap to build from its answer
    on the event loop (a Responses object's items, a stream's last delta); with the tokenizer,
    its reasoning tokens counted there too (`thought`: a tokenizer without a </think> token
    decodes the output a few times)."""
    def counted(a: Answer) -> Answer:
        if tok is not None and a.reasoning is not None:
            a.thought = min(reasoning_tokens(tok, out.token_ids, harmony.END if plan.parser == "harmony" else CLOSE),
                            out.completion_tokens)
        return a

    return await read_long([out], plan, counted, streamed)


def reasoning_tokens(tok: Any, ids: list[int], end: str = CLOSE) -> int:
    """How many output tokens were reasoning, its tags included: those up to the first `end`
    (`</think>`; a harmony answer's first <|end|>, which ends its analysis), all of them when
    none closed it. Counted on the tokens the model wrote, not re-tokenized: at the `end` token
    when the vocabulary has one, else at the shortest prefix whose text holds the tag."""
    close = tok.convert_tokens_to_ids(end)
    if isinstance(close, int) and close != getattr(tok, "unk_token_id", None) and close in ids:
        return ids.index(close) + 1
    lo, hi = 1, len(ids)
    if not ids or end not in tok.decode(ids, skip_special_tokens=end == CLOSE):
        return len(ids)
    while lo < hi:  # the text of ids[:k] holds the tag from some k on
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if end in tok.decode(ids[:mid], skip_special_tokens=end == CLOSE) else (mid + 1, hi)
    return lo
