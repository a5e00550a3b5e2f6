"""Tenant A's abusive shapes for `radixserve bench abuse`, each sent over HTTP (or raw TCP) until
the phase's `stop` is set. Each counts its outcomes in `Attack.outcomes`: an HTTP status ("400"),
prefixed by the kind where a shape mixes several ("salt:400"), or what happened on the client
("timeout", "closed", "held", an exception's name). A shape never raises for a server's answer:
a slow or failing server is what the bench measures.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import resource
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from radixserve.bench import bearer

FN = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                       "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
OPEN_TAGS = {"mistral": "[TOOL_CALLS]", "mistral_v11": "[TOOL_CALLS]",
             "llama3_json": '{"name": "get_weather", "parameters": {"city": "'}  # else <tool_call>
SAMPLE_CHARS = 240  # of the first refusal's body, for the report
FD_RESERVE = 256  # descriptors kept for tenant B's clients and the bench's own probes
WORDS = ("agents call tools read json plan retry cache tenant prompt budget window stream token the a of and "
         "server request model answer field limit queue decode prefill").split()


@dataclass
class Attack:
    """What a shape needs: where to send, as whom, the server's numbers, and the size knobs."""

    url: str
    key: str | None
    model: str
    context_len: int
    vocab_size: int
    tool_parser: str
    sizes: Any  # the parsed arguments: bomb_blocks, regex_spaces, ... (see abuse.SIZES)
    outcomes: Counter[str] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)
    samples: dict[str, str] = field(default_factory=dict)  # outcome -> the first such answer's body (not 2xx)


Shape = Callable[[Any, Attack, asyncio.Event], Awaitable[None]]


async def _post(session: Any, a: Attack, path: str, body: dict[str, Any] | bytes, kind: str = "",
                content_type: str = "application/json") -> None:
    """One request of A's, its body read to the end (a stream too), its outcome counted."""
    import aiohttp

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": content_type, **bearer(a.key)}
    prefix = f"{kind}:" if kind else ""
    try:
        async with session.post(a.url + path, data=data, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=a.sizes.request_timeout)) as r:
            answer = await r.read()
            a.outcomes[prefix + str(r.status)] += 1
            if r.status >= 300:
                a.samples.setdefault(prefix + str(r.status), answer[:SAMPLE_CHARS].decode(errors="replace"))
    except TimeoutError:
        a.outcomes[prefix + "timeout"] += 1
    except aiohttp.ClientError as e:
        a.outcomes[prefix + type(e).__name__] += 1
        await asyncio.sleep(0.05)  # a dead server: counted, not spun on
    except asyncio.CancelledError:  # still unanswered when the phase's grace ran out
        a.outcomes[prefix + "unanswered"] += 1
        raise


async def _loop(n: int, stop: asyncio.Event, send: Callable[[int], Awaitable[None]]) -> None:
    """n senders, each sending its next request when its last is answered, until stop."""
    count = iter(range(1 << 62))

    async def sender() -> None:
        while not stop.is_set():
            await send(next(count))

    await asyncio.gather(*(sender() for _ in range(max(n, 1))))


def _words(n: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def cache_control_bomb(session: Any, a: Attack, stop: asyncio.Event) -> None:
    """/v1/messages with `bomb_blocks` content blocks, each with a cache_control breakpoint."""
    blocks = [{"type": "text", "text": f"b{i}", "cache_control": {"type": "ephemeral"}} for i in range(a.sizes.bomb_blocks)]
    body = json.dumps({"model": a.model, "max_tokens": 1, "messages": [{"role": "user", "content": blocks}]}).encode()
    a.notes.append(f"{a.sizes.bomb_blocks} marked blocks, a {len(body) / 2**20:.2f} MiB body")
    await _loop(a.sizes.bomb_concurrency, stop, lambda i: _post(session, a, "/v1/messages", body))


async def tool_regex_bomb(session: Any, a: Attack, stop: asyncio.Event) -> None:
    """A streamed chat offering tools whose `regex` forces the parser's open tag and then
    `regex_spaces` spaces, never closed: the tool-call parser's worst case, on every delta."""
    tag = OPEN_TAGS.get(a.tool_parser, "<tool_call>")
    n = a.sizes.regex_spaces
    body = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": [FN], "stream": True,
            "regex": re.escape(tag) + f" {{{n}}}", "max_tokens": max(min(n + 32, a.context_len - 256), 1), "temperature": 0}
    a.notes.append(f"{tag!r} + {n} spaces ({a.tool_parser} parser)")
    await _loop(a.sizes.bomb_concurrency, stop, lambda i: _post(session, a, "/v1/chat/completions", body))


async def retention_flood(session: Any, a: Attack, stop: asyncio.Event) -> None:
    """Distinct long prompts, each asking `prompt_cache_retention: "24h"`."""
    rng = random.Random(1)

    def body(i: int) -> dict[str, Any]:
        words = min(a.sizes.retention_words, a.context_len // 2)  # within the window: a refusal is about retention
        text = f"[{uuid.uuid4().hex}] " + _words(words, rng) + " Summarise."
        return {"messages": [{"role": "user", "content": text}], "max_tokens": 1, "prompt_cache_retention": "24h"}

    await _loop(a.sizes.a_concurrency, stop, lambda i: _post(session, a, "/v1/chat/completions", body(i)))


async def max_context(session: Any, a: Attack, stop: asyncio.Event) -> None:
    """A's legitimate heavy load: distinct prompts (random token ids) filling the context window
    but for a few tokens, at the default priority, `a_concurrency` at a time."""
    rng = random.Random(2)
    n = a.sizes.context_tokens or a.context_len - 40
    lo = min(100, a.vocab_size // 4)
    hi = max(lo + 1, a.vocab_size // 2)  # clear of the special tokens at the vocabulary's end
    a.notes.append(f"{n}-token prompts of a {a.context_len}-token window")

    def body(i: int) -> dict[str, Any]:
        return {"prompt": [rng.randrange(lo, hi) for _ in range(n)], "max_tokens": 8, "ignore_eos": True}

    await _loop(a.sizes.a_concurrency, stop, lambda i: _post(session, a, "/v1/completions", body(i)))


def _fd_room(want: int) -> int:
    """How many sockets this process may still open, after raising its soft fd limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return max(min(want, soft - FD_RESERVE), 0)


def _sources(url: str, n: int) -> list[str | None]:
    """A's source addresses: on a loopback server 127.0.0.2... (B connects from 127.0.0.1, so the
    server tells them apart as it would two machines); elsewhere the machine's own."""
    if urlparse(url).hostname not in ("127.0.0.1", "localhost"):
        return [None]
    return [f"127.0.0.{2 + i}" for i in range(max(n, 1))]


async def _open(url: str, source: str | None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    u = urlparse(url)
    return await asyncio.open_connection(u.hostname, u.port or 80, local_addr=(source, 0) if source else None, limit=256)


async def _hold(reader: asyncio.StreamReader, stop: asyncio.Event) -> str:
    """Until stop: what the server did with a connection A keeps quiet ("held": nothing)."""
    read = asyncio.ensure_future(reader.read(256))
    waiting = asyncio.ensure_future(stop.wait())
    await asyncio.wait({read, waiting}, return_when=asyncio.FIRST_COMPLETED)
    waiting.cancel()
    if not read.done():
        read.cancel()
        return "held"
    if read.exception() is not None:
        return type(read.exception()).__name__
    m = re.match(rb"HTTP/1\.[01] (\d{3})", read.result())
    return m.group(1).decode() if m else "closed"  # closed by the server (its idle or header timeout)


async def idle_connections(session: Any, a: Attack, stop: asyncio.Event) -> None:
    """`idle_connections` TCP connections (as many as the fd limit allows), from `idle_sources`
    addresses: half send nothing, half a request line and one header, never finished. Each is
    opened again when the server closes or refuses it (a second later), until the phase ends."""
    n = _fd_room(a.sizes.idle_connections)
    if n < a.sizes.idle_connections:
        a.notes.append(f"{n} of {a.sizes.idle_connections} connections (this client's fd limit)")
    sources = _sources(a.url, a.sizes.idle_sources)
    if sources == [None]:
        a.notes.append("not a loopback server: A and B share this machine's address, and its per-client connection cap")
    gate = asyncio.Semaphore(128)  # connects in flight: a burst past the listen backlog measures the client

    async def hold_one(i: int) -> str:
        kind = "silent" if i % 2 else "partial"
        try:
            async with gate:
                reader, writer = await asyncio.wait_for(_open(a.url, sources[i % len(sources)]), 10)
        except (OSError, TimeoutError) as e:
            return f"{kind}:{type(e).__name__}"
        try:
            if kind == "partial":
                writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            return f"{kind}:{await _hold(reader, stop)}"
        finally:
            writer.close()

    async def one(i: int) -> None:
        while not stop.is_set():
            outcome = await hold_one(i)
            a.outcomes[outcome] += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)

    await asyncio.gather(*(one(i) for i in range(n)))


async def unread_streams(session: Any, a: Attack, stop: asyncio.Event) -> None:
    """`unread_streams` streamed chats of `unread_tokens` tokens whose client reads the status
    line and nothing more, until the phase ends (then it hangs up)."""
    body = json.dumps({"messages": [{"role": "user", "content": "Tell a very long story."}], "stream": True,
                       "max_tokens": min(a.sizes.unread_tokens, a.context_len - 64), "ignore_eos": True}).encode()
    host = urlparse(a.url).netloc
    auth = "".join(f"{k}: {v}\r\n" for k, v in bearer(a.key).items())
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{auth}"
            f"Content-Length: {len(body)}\r\n\r\n").encode()

    async def one(i: int) -> None:
        try:
            reader, writer = await asyncio.wait_for(_open(a.url, None), 10)
        except (OSError, TimeoutError) as e:
            a.outcomes[type(e).__name__] += 1
            return
        try:
            writer.write(head + body)
            status = await asyncio.wait_for(reader.readline(), a.sizes.request_timeout)
            m = re.match(rb"HTTP/1\.[01] (\d{3})", status)
            a.outcomes[m.group(1).decode() if m else "closed"] += 1
            await stop.wait()
        except (OSError, TimeoutError) as e:
            a.outcomes[type(e).__name__] += 1
        finally:
            writer.close()

    await asyncio.gather(*(one(i) for i in range(a.sizes.unread_streams)))


async def malformed(session: Any, a: Attack, stop: asyncio.Event) -> None:
    """Cheap bad shapes in turn: a distinct `salt_bytes` cache_salt, a JSON body sent as
    text/plain, and temperature 5 (OpenAI's range is 0 to 2)."""
    user = [{"role": "user", "content": "Name three colours."}]

    async def send(i: int) -> None:
        kind = ("salt", "content_type", "temperature")[i % 3]
        if kind == "salt":
            salt = uuid.uuid4().hex + "s" * max(a.sizes.salt_bytes - 32, 0)
            await _post(session, a, "/v1/chat/completions", {"messages": user, "max_tokens": 2, "cache_salt": salt}, kind)
        elif kind == "content_type":
            await _post(session, a, "/v1/chat/completions", {"messages": user, "max_tokens": 2}, kind, "text/plain")
        else:
            await _post(session, a, "/v1/chat/completions", {"messages": user, "max_tokens": 2, "temperature": 5}, kind)

    await _loop(a.sizes.a_concurrency, stop, send)


SHAPES: dict[str, Shape] = {"cache_control_bomb": cache_control_bomb, "tool_regex_bomb": tool_regex_bomb,
                            "retention_flood": retention_flood, "max_context": max_context,
                            "idle_connections": idle_connections, "unread_streams": unread_streams, "malformed": malformed}



def attack_main(a: Attack, shape: str, stop: Any, ready: Any, results: Any, grace: float) -> None:
    """A phase's tenant A in a process of its own (its client-side work, a bomb's JSON or
    thousands of sockets, never delays B's timings): runs `shape` until `stop` is set, gives its
    last requests `grace` seconds, and puts (outcomes, notes, samples) on `results`."""
    asyncio.run(_attack(a, SHAPES[shape], stop, ready, grace))
    results.put((dict(a.outcomes), a.notes, a.samples))


async def _attack(a: Attack, shape: Shape, stop_set: Any, ready: Any, grace: float) -> None:
    import os

    import aiohttp

    stop = asyncio.Event()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        task = asyncio.ensure_future(shape(session, a, stop))
        ready.set()
        parent = os.getppid()
        while not await asyncio.to_thread(stop_set.wait, 0.5) and os.getppid() == parent and not task.done():
            pass
        stop.set()
        try:
            await asyncio.wait_for(task, grace)
        except TimeoutError:
            pass
        except Exception as e:  # a fault of the bench's own: reported, not raised
            a.outcomes[f"bench error {type(e).__name__}: {e}"] += 1
