"""Text the server does not control is read in linear time: a model's output (which a client
steers with its own regex, logit_bias or prompt) and a request's body. Every parser and pattern
that reads it gets 100k-character adversarial inputs, whole and streamed in 1-4 character
deltas, each in bounded time (milliseconds, where the backtracking regexes they replaced took
minutes and stalled every tenant on the event loop); and each scanner reads exactly what the
regex it replaced matched, checked against that regex on random text."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import signal
import time

import pytest

from radixserve.engine.outputs import Output
from radixserve.server.chat import call_stream, reasoning, tool_parsers
from radixserve.server.chat.core import Plan
from radixserve.server.chat.tools import CHAT_PARAMS, Tool

N = 100_000
LIMIT = 0.25  # seconds for one whole 100k-character text: they take milliseconds (a loaded 2-core machine: tens)
STREAM_LIMIT = 2.0  # seconds for one 100k-character text streamed in ~40k deltas of 1-4 characters
FORMATS = ("hermes", "qwen3_coder", "mistral", "mistral_v11", "llama3_json")
FN = {"type": "object", "properties": {"x": {"type": "integer"}, "s": {"type": "string"}}}
TOOLS = [Tool("f", "", FN), Tool("g", "", FN)]


@contextlib.contextmanager
def bounded(limit: float):
    """The block must finish within `limit` seconds; a super-linear one is stopped at 8x (SIGALRM:
    the re module checks for signals) so it fails instead of hanging the suite."""

    def stop(*_):
        raise TimeoutError(f"still running after {8 * limit:g} s")

    old = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, 8 * limit)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert time.perf_counter() - t0 < limit, f"took {time.perf_counter() - t0:.3f} s"


HOSTILE = {  # what a model can be made to write: unclosed, repeated and nested markup, and JSON bombs
    "open tag, spaces": "<tool_call>" + " " * N,
    "open tag, spaces in the arguments": '<tool_call>{"name": "f", "arguments": {"x": ' + " " * N,
    "open tag, newlines and tabs": "<tool_call>" + "\n\t " * (N // 3),
    "repeated open tags": "<tool_call>" * (N // 11),
    "empty calls": "<tool_call></tool_call>" * (N // 23),
    "calls": '<tool_call>{"name": "f", "arguments": {}}</tool_call>' * (N // 52),
    "fence not closed": "```json\n" + " " * N,
    "fence line not ended": "```json" + " \t" * (N // 2),
    "fence marks": "```\n" * (N // 4),
    "fence marks with backticks": "```x`" * (N // 5),
    "fenced calls": '```json\n{"name": "f", "arguments": {}}\n```' * (N // 44),
    "function not closed": "<tool_call><function=f>" + " " * N,
    "function closes, call does not": "<tool_call><function=f></function>" + " " * N,
    "function closes again and again": "<tool_call><function=f>" + "</function> x" * (N // 13),
    "function names": "<tool_call>" + "<function=" * (N // 10) + "\n",
    "parameters not closed": "<tool_call><function=f>" + "<parameter=x>" * (N // 13),
    "parameter names": "<tool_call><function=f>" + "<parameter=" * (N // 11) + "\n</function></tool_call>",
    "markers": "[TOOL_CALLS]" * (N // 12),
    "marker, open list": "[TOOL_CALLS][" + "{" * N,
    "marker, names": "[TOOL_CALLS]f[ARGS]" * (N // 19),
    "python tag, spaces": "<|python_tag|>" + " " * N,
    "objects": "{};" * (N // 3),
    "open braces": "{" * N,
    "open brackets in a call": "<tool_call>" + "[" * N + "</tool_call>",
    "a long number in a call": '<tool_call>{"name": "f", "arguments": {"x": ' + "1" * N + "}}</tool_call>",
    "think not closed": "<think>" + " " * N,
    "think, partial closes": "<think>" + "</think" * (N // 7),
    "spaces before think": " " * N + "<think>",
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_whole_answer_is_read_in_bounded_time_in_every_format(name):
    """The reading of a finished answer (reasoning split, whole calls, a call max_tokens cut) in
    each format and mode, and the JSON a required call is."""
    text = HOSTILE[name]
    for fmt in FORMATS:
        for reason in ("stop", "length"):
            with bounded(LIMIT):
                reasoning.answer(text, reason, "qwen3", "auto", TOOLS, fmt)
    with bounded(LIMIT):
        reasoning.answer(text, "length", None, "required", TOOLS)


STREAMED = {  # (format, text): each format's own markup
    "hermes": ["open tag, spaces", "open tag, spaces in the arguments", "repeated open tags", "fence not closed",
               "fence line not ended", "fence marks", "fence marks with backticks", "calls"],
    "qwen3_coder": ["open tag, spaces", "function not closed", "function closes, call does not",
                    "function closes again and again", "function names"],
    "mistral": ["markers", "marker, open list"],
    "llama3_json": ["python tag, spaces", "open braces"],
}


def _pieces(text: str, seed: int = 0) -> list[str]:
    rng, out, at = random.Random(seed), [], 0
    while at < len(text):
        k = rng.randint(1, 4)
        out.append(text[at:at + k])
        at += k
    return out


@pytest.mark.parametrize(("fmt", "name"), [(f, n) for f, names in STREAMED.items() for n in names])
def test_a_streamed_answer_costs_each_delta_its_own_length(fmt, name):
    pieces = _pieces(HOSTILE[name])
    stream = call_stream.CallStream(fmt, TOOLS, False)
    with bounded(STREAM_LIMIT):
        for p in pieces:
            stream.feed(p)


@pytest.mark.parametrize("text", [HOSTILE["think not closed"], HOSTILE["think, partial closes"], " " * (3 * N) + "<think>"],
                         ids=["think not closed", "think, partial closes", "spaces before think"])
def test_a_streamed_reasoning_split_costs_each_delta_its_own_length(text):
    split = reasoning.ThinkSplitter(False)
    with bounded(STREAM_LIMIT / 4):  # tens of ms (spaces before a tag were read again at each delta: seconds)
        for p in _pieces(text):
            split.feed(p)
        split.flush()


def test_a_stream_that_sends_a_long_answer_keeps_what_it_sent_in_linear_time():
    parts = reasoning.LiveParts("qwen3", True, call_stream.CallStream("hermes", TOOLS, False))
    pieces = _pieces("word " * (N // 5))

    async def run() -> None:
        for p in pieces:
            await parts.feed(p, False)
        await parts.feed("", True)

    with bounded(STREAM_LIMIT):
        asyncio.run(run())
    assert parts.sent == "word " * (N // 5 - 1) + "word"  # the last space held, then released at the end
    assert parts.rest(parts.sent + " more") == " more"


def test_a_long_answer_is_read_off_the_event_loop():
    import threading

    where = []

    async def run(size: int) -> None:
        out = Output("r", "x" * size, [], "stop", 3, 5, 0)
        a = await reasoning.read_long([out], Plan([], CHAT_PARAMS), lambda a: where.append(threading.current_thread()) or a)
        assert a.content == out.text

    asyncio.run(run(reasoning.OFF_LOOP_CHARS))
    asyncio.run(run(reasoning.OFF_LOOP_CHARS + 1))
    assert where[0] is threading.main_thread() and where[1] is not threading.main_thread()


def test_a_request_body_is_read_in_bounded_time():
    """A msgspec error names the client's own key (a path regex was quadratic on it), and a body
    too deep is scanned for its field (a string regex was quadratic on one cut by the scan)."""
    from radixserve.server.errors import ApiError, decode_body
    from radixserve.server.protocol import ChatCompletionRequest

    key = " - at `$" * (N // 8) + "\n"
    deep = b'{"messages": [{"role": "user", "content": "' + b'\\"' * 40_000 + b'"}], "tools": ' + b"[" * 5000
    deep += b"]" * 5000 + b"}"
    for body in (json.dumps({"messages": [], key: 1}).encode(), deep):
        with bounded(LIMIT), pytest.raises(ApiError) as e:
            decode_body(body, ChatCompletionRequest)
        assert e.value.status == 400


def test_a_stop_regex_that_backtracks_on_a_long_output_ends_its_request_in_bounded_time():
    """A client's own stop_regex stays a backtracking pattern (Python's syntax, as SGLang's): it
    is searched over a bounded tail with a time limit, so it costs its own request only."""
    from radixserve import stop_regex

    searcher = stop_regex.Searcher(stop_regex.validate(r"(a|aa)+b"))
    with bounded(LIMIT), pytest.raises(stop_regex.StopRegexTimeout):
        searcher.find("a" * N, N - 1)


# -- the scanners read what the regexes they replaced matched ---------------------------------------
REGEX = {
    "tagged": re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S),
    "fenced": re.compile(r"```(?:json)?[ \t]*\n(.*?)\n?[ \t]*```", re.S),
    "any_fence": re.compile(r"```[^\n`]*\n.*?```", re.S),
    "xml_calls": re.compile(r"<tool_call>\s*(<function=.*?</function>)\s*</tool_call>", re.S),
    "function": re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S),
    "params": re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S),
    "args_at": re.compile(r"#/(?:anyOf/(\d+)/)?properties/arguments"),  # in a grammar's error message
}
CALL = '{"name": "f", "arguments": {"x": 1}}'
FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool", "_call>", "```", "json", "\n", " ", "\t", "`", "x", "\xa0", "\x1c",
             "<function=f>", "<function=", "</function>", "<parameter=x>", "<parameter=", "</parameter>", ">", "1",
             CALL, "{", "}", "[TOOL_CALLS]", "[", "<|python_tag|>", "<think>", "</think>", "\u2028"]


def _random_text(rng: random.Random) -> str:
    return "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 24)))


def test_each_scanner_reads_what_the_regex_it_replaced_matched():
    from radixserve.server.chat.text_scan import fenced, tagged, xml_calls, xml_function, xml_params

    rng = random.Random(44)
    for _ in range(4000):
        t = _random_text(rng)
        assert list(tagged(t)) == [(m.start(), m.end(), m.group(1)) for m in REGEX["tagged"].finditer(t)], t
        assert list(fenced(t)) == [(m.start(), m.end(), m.group(1)) for m in REGEX["fenced"].finditer(t)], t
        assert list(xml_calls(t)) == [(m.start(), m.end(), m.group(1)) for m in REGEX["xml_calls"].finditer(t)], t
        f = REGEX["function"].search(t)
        assert xml_function(t) == (f.groups() if f else None), t
        assert xml_params(t) == REGEX["params"].findall(t), t
    from radixserve.server.chat.tools import _args_at

    pieces = ["#/", "anyOf/", "1", "12", "/", "properties/arguments", "x", "#", "properties/", "\u0663"]
    for _ in range(4000):
        t = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        want = [(m.start(), m.end(), m.group(1) and int(m.group(1))) for m in REGEX["args_at"].finditer(t)]
        assert list(_args_at(t)) == want, t


def _released_then(fmt: str, text: str) -> tuple[int, list[str]]:
    """What the call stream held and found before it was incremental: recomputed from the whole
    text with the regexes (how much is content whatever comes next; the calls closed so far)."""
    from radixserve.server.chat.text_scan import partial_tail

    calls = []
    if fmt in ("hermes", "qwen3_coder"):
        for m in REGEX["tagged" if fmt == "hermes" else "xml_calls"].finditer(text):
            calls += [c.function.name for c in tool_parsers.parse(fmt, m.group(0), TOOLS)[1]]
    head = text.lstrip()
    if fmt == "llama3_json" and (not head or head[0] == "{" or head.startswith("<|python_tag|>")
                                 or "<|python_tag|>".startswith(head)):
        return 0, calls
    if tool_parsers.FORMATS[fmt].special_tokens and head[:1] == "[":
        return 0, calls
    cut = len(text)
    for marker in tool_parsers.FORMATS[fmt].markers:
        at = text.find(marker) if marker != "```" else _fence_hold(text)
        cut = min(cut, at if at >= 0 else len(text) - partial_tail(text, marker))
    return len(text[:cut].rstrip()), calls


def _fence_hold(text: str) -> int:
    skip = 0
    for m in REGEX["any_fence"].finditer(text):
        if tool_parsers.parse("hermes", m.group(0), TOOLS)[1]:
            return m.start()
        skip = m.end()
    return text.find("```", skip)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_call_stream_releases_and_finds_what_a_reading_of_the_whole_text_does(fmt):
    rng = random.Random(fmt)
    for _ in range(600):
        text = "".join(rng.choice([*FRAGMENTS, f"```json\n{CALL}\n```", f"<tool_call>{CALL}</tool_call>",
                                   "<tool_call><function=f><parameter=x>1</parameter></function></tool_call>"])
                       for _ in range(rng.randint(0, 16)))
        stream, released, calls, so_far = call_stream.CallStream(fmt, TOOLS, False), "", [], ""
        for piece in _pieces(text, rng.randint(0, 9)):
            out, new = stream.feed(piece)
            released, so_far = released + out, so_far + piece
            calls += [c.function.name for c in new]
            want, want_calls = _released_then(fmt, so_far)
            assert released == so_far[:max(len(released), want)] and calls == want_calls, (fmt, so_far)
