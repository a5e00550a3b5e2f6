"""`radixserve serve` options as a dict (field name -> value, the names of the CLI flags with
underscores) and back to argv, checked by the real `radixserve serve` parser, so a replica runs
exactly the server the same flags would start, and a bad option fails in the driver, not in
every replica.

`ReplicaSpec` is what each replica is built from. A --tenants file is read where the app is
built and travels in it as JSON (a replica may run on another node); the replica hands it to its
server through a pipe (local_server.py), so no API key is written to a replica's disk.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

RAY_ONLY = frozenset({"ray", "replicas", "host", "port", "max_replicas", "warm_replicas", "autoscale_waiting",
                      "autoscale_kv_usage", "autoscale_ttft_p90", "upscale_delay_s", "downscale_delay_s"})  # not a replica's


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(message)


def serve_parser() -> argparse.ArgumentParser:
    from radixserve.server.serve import add_args

    p = _Parser(prog="radixserve serve", add_help=False)
    add_args(p)
    return p


def serve_defaults() -> dict[str, Any]:
    return vars(serve_parser().parse_args([]))


def options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The options of a parsed `radixserve serve` command line that differ from the defaults."""
    defaults = serve_defaults()
    return {k: getattr(args, k) for k, v in defaults.items() if k not in RAY_ONLY and getattr(args, k, v) != v}


def to_argv(options: Mapping[str, Any]) -> list[str]:
    """`radixserve serve` flags for these options (ValueError naming an unknown or bad one)."""
    defaults = serve_defaults()
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise ValueError(f"unknown radixserve serve option(s): {', '.join(unknown)}")
    refused = sorted(set(options) & RAY_ONLY)
    if refused:
        raise ValueError(f"{', '.join(refused)}: not a replica option (the Ray proxy's host and port are set apart)")
    argv: list[str] = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is None or value == defaults[name]:
            continue
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    parse(argv)
    return argv


def parse(argv: list[str]) -> argparse.Namespace:
    return serve_parser().parse_args(argv)


@dataclass(frozen=True)
class ReplicaSpec:
    argv: tuple[str, ...]  # `radixserve serve` flags, --tenants left out
    tenants: bytes | None = None  # the --tenants file's tenants, as JSON

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> ReplicaSpec:
        """ValueError for a bad option or tenants file (read here, where the app is built)."""
        import msgspec

        from radixserve.server.auth import Auth

        opts = dict(options)
        path = opts.pop("tenants", None)
        argv = tuple(to_argv(opts))
        auth = Auth.from_options(parse(list(argv)).api_key, path)
        tenants = msgspec.json.encode({"tenants": auth.tenants}) if path else None
        return cls(argv, tenants)

    def admin_key(self) -> str | None:
        """A key /server_info shows an admin's view to (the KV stats): --api-key's, or the first
        admin tenant's; None with no keys (everyone is admin then) or no admin tenant."""
        import msgspec

        from radixserve.server.auth import Auth, Tenant

        tenants = msgspec.json.decode(self.tenants, type=dict[str, list[Tenant]])["tenants"] if self.tenants else None
        auth = Auth(tenants) if tenants else Auth.from_options(parse(list(self.argv)).api_key, None)
        return next((t.api_key for t in auth.tenants if t.admin), None)
