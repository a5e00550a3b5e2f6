"""`radixserve serve` options as a dict (field name -> value, the names of the CLI flags with
underscores) and back to argv, checked by the real `radixserve serve` parser, so a replica runs
exactly the server the same flags would start, and a bad option fails in the driver, not in
every replica.

`ReplicaSpec` is what each replica is built from. A --tenants file is read where the app is
built and travels in it as JSON (a replica may run on another node); the replica hands it to its
server through a pipe (local_server.py), so no API key is written to a replica's disk. The keys
(--api-key, --metrics-key, or their files) travel in it too and reach the server in its
environment (RADIXSERVE_API_KEY, RADIXSERVE_METRICS_KEY), never on its command line, which every
local user can read. --kv-disk-dir travels apart: each replica's server gets a folder of its own
under it (disk_slot.py).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

RAY_ONLY = frozenset({"ray", "ray_address", "replicas", "host", "port", "max_replicas", "warm_replicas",
                      "autoscale_waiting", "autoscale_waiting_tokens", "autoscale_kv_usage", "autoscale_ttft_per_1k",
                      "upscale_delay_s", "downscale_delay_s"})  # not a replica's


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
    argv: tuple[str, ...]  # `radixserve serve` flags, --tenants, --kv-disk-dir and the keys left out
    tenants: bytes | None = field(default=None, repr=False)  # the --tenants file's tenants, as JSON
    secrets: tuple[tuple[str, str], ...] = field(default=(), repr=False)  # (environment variable, key)
    kv_disk_dir: str | None = None  # the user's: each replica's server takes a folder of its own under it

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> ReplicaSpec:
        """ValueError for a bad option, key file or tenants file (read here, where the app is built)."""
        import msgspec

        from radixserve.server.auth import Auth
        from radixserve.server.serve import SECRET_ENV, read_secret

        opts = dict(options)
        path, disk = opts.pop("tenants", None), opts.pop("kv_disk_dir", None)
        keys = {name: read_secret(name, opts.pop(name, None), opts.pop(f"{name}_file", None)) for name in SECRET_ENV}
        argv = tuple(to_argv(opts))
        auth = Auth.from_options(keys["api_key"], path)
        tenants = msgspec.json.encode({"tenants": auth.tenants}) if path else None
        secrets = tuple((env, key) for name, env in SECRET_ENV.items() if (key := keys[name]))
        return cls(argv, tenants, secrets, str(disk) if disk is not None else None)

    def admin_key(self) -> str | None:
        """A key /server_info shows an admin's view to (the KV stats): --api-key's, or the first
        admin tenant's; None with no keys (everyone is admin then) or no admin tenant."""
        import msgspec

        from radixserve.server.auth import Auth, Tenant
        from radixserve.server.serve import SECRET_ENV

        tenants = msgspec.json.decode(self.tenants, type=dict[str, list[Tenant]])["tenants"] if self.tenants else None
        auth = Auth(tenants) if tenants else Auth.from_options(dict(self.secrets).get(SECRET_ENV["api_key"]), None)
        return next((t.api_key for t in auth.tenants if t.admin), None)
