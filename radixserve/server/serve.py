"""`radixserve serve`: the engine on its own thread, the aiohttp app on the event loop, and a
graceful drain on SIGINT/SIGTERM (new requests get 503, running ones finish up to
--drain-timeout, then exit 0). A port already in use is refused before the model loads."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

from radixserve.cli_args import add_engine_args, add_flags, add_log_level, engine_kwargs, run_command, scalar_fields
from radixserve.config import RouterConfig, ServerConfig

log = logging.getLogger("radixserve.server")
SECRET_ENV = {"api_key": "RADIXSERVE_API_KEY", "metrics_key": "RADIXSERVE_METRICS_KEY"}  # a key's option -> its variable
LINGER_S = 2.0  # after refusing a body (413/408), read and drop what the client still sends this long, then close


def add_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    add_flags(p, scalar_fields(ServerConfig))
    add_flags(p, scalar_fields(RouterConfig))
    for name, env in SECRET_ENV.items():
        flag = name.replace("_", "-")
        p.add_argument(f"--{flag}-file", default=None, help=f"read --{flag} from this file (keep it 0600), as the "
                                                            f"{env} environment variable can give it: a key on the "
                                                            "command line is readable by every local user")
    p.add_argument("--ray", action="store_true", help="serve on a Ray Serve cluster (the one --ray-address names, else a "
                                                      "new local one): --replicas engines behind a prefix-aware request "
                                                      "router (needs radixserve[ray])")
    p.add_argument("--ray-address", default=None, help="with --ray: the Ray cluster to join (e.g. 10.0.0.5:6379, or "
                                                       "'auto' for the one `ray start` left on this machine); unset: a "
                                                       "new local cluster (RAY_ADDRESS is not read)")
    p.add_argument("--replicas", type=int, default=2, help="with --ray: engine replicas (default: 2); with "
                                                           "--max-replicas, the fewest (0: scale to zero when idle)")
    a = p.add_argument_group("autoscaling (with --ray and --max-replicas; radixserve/ray/autoscale.py)")
    a.add_argument("--max-replicas", type=int, default=None, help="autoscale between --replicas and this many replicas "
                                                                  "on requests waiting, their prompt tokens, KV usage "
                                                                  "and TTFT per 1k prompt tokens")
    a.add_argument("--warm-replicas", type=int, default=0, help="idle replicas kept beyond what the load needs (a warm "
                                                                "pool a burst finds started)")
    a.add_argument("--autoscale-waiting", type=float, default=2.0, help="target requests waiting per replica")
    a.add_argument("--autoscale-kv-usage", type=float, default=0.85, help="target KV pool usage (0 to 1)")
    a.add_argument("--autoscale-waiting-tokens", type=float, default=16384.0,
                   help="target prompt tokens of the waiting requests per replica (0: not a signal)")
    a.add_argument("--autoscale-ttft-per-1k", type=float, default=5.0,
                   help="target p90 of TTFT per 1,000 computed prompt tokens (a prompt under 1,000 counts as 1,000), "
                        "in seconds; keep it above a replica's own prefill time per 1,000 tokens (0: not a signal)")
    a.add_argument("--upscale-delay-s", type=float, default=10.0, help="how long a scale-up must be asked for")
    a.add_argument("--downscale-delay-s", type=float, default=120.0, help="how long a scale-down must be asked for")


def resolve_secrets(args: argparse.Namespace) -> None:
    """Each key (--api-key, --metrics-key) from its flag, else its --*-file, else its environment
    variable (SECRET_ENV), which is then removed from this process's environment, so that no
    child (the engine process, grammar workers, Ray's processes) inherits it."""
    for name, env in SECRET_ENV.items():
        from_env = os.environ.pop(env, None)
        if getattr(args, name):
            log.warning("--%s on the command line is readable by every local user (/proc/PID/cmdline): give it by "
                        "%s or --%s-file", name.replace("_", "-"), env, name.replace("_", "-"))
        value = read_secret(name, getattr(args, name), getattr(args, f"{name}_file", None))
        setattr(args, name, value if value is not None else from_env or None)
        setattr(args, f"{name}_file", None)


def read_secret(name: str, value: str | None, file: str | None) -> str | None:
    """A key given as a value or as a file (ValueError for both, or a file unreadable or empty)."""
    if not file:
        return value or None
    if value:
        raise ValueError(f"{name}: give --{name.replace('_', '-')} or --{name.replace('_', '-')}-file, not both")
    try:
        with open(file, encoding="utf-8") as f:
            key = f.read(64 << 10).rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{name}_file: cannot read {file} ({getattr(e, 'strerror', None) or e})") from None
    if not key.strip():
        raise ValueError(f"{name}_file: {file} is empty")
    return key


def router_config(args: argparse.Namespace) -> RouterConfig:
    cfg = RouterConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(RouterConfig)})
    cfg.check()
    return cfg


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig)})


def check_port(host: str, port: int) -> None:
    """Refuse a port something else listens on before the model loads (seconds): bind every
    address `host` resolves to as asyncio's create_server will (SO_REUSEADDR, IPv6-only for
    IPv6), then let go at once. Raises ValueError in one line."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port: {port} is not a TCP port (0-65535)")
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"host: cannot resolve {host!r} ({e.strerror})") from None
    for family, kind, proto, _, addr in dict.fromkeys(infos):
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(addr)
            except OSError as e:
                raise listen_error(host, port, e) from None


def listen_error(host: str, port: int, e: OSError) -> ValueError:
    if e.errno == errno.EADDRINUSE:
        return ValueError(f"port {port} on {host} is already in use (choose another with --port)")
    return ValueError(f"cannot listen on port {port} on {host}: {e.strerror or e}")


def main(argv: list[str]) -> int:
    """`radixserve serve ARGS` on its own, with `--log-level` (a Ray replica's server process,
    radixserve.ray.child)."""
    p = argparse.ArgumentParser(prog="radixserve serve")
    add_log_level(p)
    add_args(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_command(run, args)


def chat_template(given: str) -> str:
    """--chat-template: a file's text, or the template itself; refused unless Jinja compiles it."""
    import jinja2

    path = Path(given).expanduser()
    looks_like_text = "{{" in given or "{%" in given
    if not looks_like_text and not path.is_file():
        raise ValueError(f"chat_template: {given!r} is neither a file nor a Jinja template")
    text = given if looks_like_text else path.read_text()
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template: not a Jinja template: {e} (line {e.lineno})") from None
    return text


def run(args: argparse.Namespace) -> int:
    """`radixserve serve` in this process (`--ray` is the CLI's: radixserve.ray.serve.run_ray)."""
    resolve_secrets(args)
    from radixserve.engine.process import EngineProcess
    from radixserve.engine.protocol import EngineClient
    from radixserve.server.auth import Auth

    t0 = time.monotonic()
    cfg = server_config(args)
    if cfg.responses_max_stored < 1:
        raise ValueError(f"responses_max_stored: must be a positive integer, got {cfg.responses_max_stored}")
    auth = Auth.from_options(cfg.api_key, cfg.tenants)
    template = chat_template(cfg.chat_template) if cfg.chat_template is not None else None
    check_port(cfg.host, cfg.port)
    quotas = {t.id: t.max_cached_tokens for t in auth.tenants if t.max_cached_tokens is not None}
    if auth.open and cfg.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("no API key configured and listening on %s: anyone who can reach it can use it", cfg.host)
    kwargs = engine_kwargs(args)
    if len(auth.tenants) <= 1 and kwargs.get("grammar_tenant_compiles") is None:  # no other tenant to be fair to
        kwargs["grammar_tenant_compiles"] = kwargs["grammar_compile_workers"]
    routing = router_config(args)
    engine: EngineClient
    if routing.replicas > 1:  # N engine processes behind this server, requests routed by prefix and load
        from radixserve.engine.data_parallel import DataParallelEngine

        engine = DataParallelEngine(args.model, routing, **kwargs, tenant_max_cached_tokens=quotas)
    else:
        engine = EngineProcess(args.model, **kwargs, tenant_max_cached_tokens=quotas)  # the model loop in its own process
    if template is not None:
        tok = engine.tokenizer
        (tok.full() if hasattr(type(tok), "full") else tok).chat_template = template  # (a fast tokenizer's: transformers')
    try:
        if not asyncio.run(serve(engine, cfg, auth, t0)):
            return 1  # the engine process died: exit so a supervisor restarts the server
    finally:
        engine.shutdown()
    return 0


async def serve(engine: Any, cfg: ServerConfig, auth: Any, t0: float) -> bool:
    """Serve until SIGINT/SIGTERM (True) or until the engine process dies (False)."""
    from aiohttp import web

    from radixserve.server.app import build_app
    from radixserve.server.chat.tool_parsers import for_server
    from radixserve.server.connections import ConnectionLimits, GuardedRunner, fit_fd_limit
    from radixserve.server.state import ServerState

    template = getattr(engine.tokenizer, "chat_template", None)
    state = ServerState(engine, cfg, auth, cfg.served_model_name or engine.model_name,
                        tool_format=for_server(template if isinstance(template, str) else None, cfg.tool_call_parser))
    await state.build_token_table()  # before listening (decoded while the engine loaded): a first request's CPU is its own
    state.connections = ConnectionLimits(fit_fd_limit(cfg.max_connections), cfg.max_connections_per_client,
                                         on_refuse=state.metrics.rejected.labels("too_many_connections").inc,
                                         hold=cfg.keepalive_timeout)
    runner = GuardedRunner(build_app(state), state.connections, handler_cancellation=True, access_log=None,
                           keepalive_timeout=cfg.keepalive_timeout, lingering_time=LINGER_S)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    try:
        await site.start()
    except OSError as e:  # taken since check_port looked
        await runner.cleanup()
        state.executor.shutdown(wait=False)
        raise listen_error(cfg.host, cfg.port, e) from None
    host, port = runner.addresses[0][:2]
    kv = engine.snapshot().kv_total_slots
    log.info("radixserve ready at http://%s:%d | model %s | weights %.0f MiB (%s, %s activations) loaded in %.1f s, "
             "peak RSS %.0f MiB | CPU kernels %s | KV cache %d tokens | auth %s | ready in %.1f s", host, port,
             state.model_name, engine.weight_bytes / 2**20, engine.quantization, engine.activations, engine.load_seconds,
             engine.load_peak_rss / 2**20,
             engine.cpu_kernels or "none", kv, "off" if auth.open else f"{len(auth.tenants)} tenant(s)", time.monotonic() - t0)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if hasattr(engine, "on_death"):
        engine.on_death = lambda why: loop.call_soon_threadsafe(stop.set)
        if getattr(engine, "dead", None) is not None:  # it died before the hook was set
            stop.set()
    await stop.wait()
    await drain(state, cfg.drain_timeout)
    await runner.cleanup()
    state.executor.shutdown(wait=False, cancel_futures=True)
    return state.engine_down() is None


async def drain(state: Any, timeout: float) -> None:
    """Refuse new requests, let running ones finish, abort what is left at the deadline."""
    adm = state.admission
    adm.draining = True
    if state.history is not None:  # precomputing the next turns of a server that is going: no more
        state.history.stop()
    log.info("draining: %d requests in flight, up to %.0f s", adm.in_flight, timeout)
    deadline = time.monotonic() + timeout
    while adm.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if adm.in_flight:
        log.warning("drain timeout: aborting %d requests", adm.in_flight)
        for rid in list(state.active):
            state.engine.abort(rid)
        end = time.monotonic() + 5
        while adm.in_flight and time.monotonic() < end:
            await asyncio.sleep(0.05)
    log.info("drained; exiting")
