"""What a compile that did not produce a grammar tells its request (every one a GrammarError,
a 400 naming the limit). Cached with the grammar: a timeout and the memory cap (the grammar
would do it again). Not cached (NotCompiled): the rest, which are not the grammar's fault."""

from __future__ import annotations

from grammars.spec import GrammarError, GrammarSpec


class NotCompiled(GrammarError):
    """The compile did not finish for a reason that is not the grammar's (no worker free in
    time, a worker crash, shutdown): callers should not cache it."""


def timeout(spec: GrammarSpec, timeout_s: float) -> GrammarError:
    return GrammarError(spec.kind, "compiling the grammar took longer than the grammar_compile_timeout of "
                                   f"{timeout_s:g} s")


def memory(spec: GrammarSpec, memory_mb: int) -> GrammarError:
    return GrammarError(spec.kind, f"compiling the grammar used more than the grammar_compile_memory_mb of {memory_mb} MiB")


def busy(spec: GrammarSpec, timeout_s: float, per_tenant: int) -> NotCompiled:
    return NotCompiled(f"{spec.kind}: every grammar compiler is busy with slow grammars; its compile did not start within the "
                       f"grammar_compile_timeout of {timeout_s:g} s (one tenant may run {per_tenant} at once)", spec.kind)


def crashed(spec: GrammarSpec, reason: str) -> NotCompiled:
    return NotCompiled(f"{spec.kind}: the grammar compiler process crashed while compiling this grammar ({reason}); "
                       "it was not cached", spec.kind)


def other(spec: GrammarSpec, why: str) -> NotCompiled:
    """Could not start a worker, shut down, an internal error: `why` says which."""
    return NotCompiled(f"{spec.kind}: {why}", spec.kind)
