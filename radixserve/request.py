"""Per-request state: sampling parameters, the request's own progress counters, finish reasons.

Token layout of a request (`token_ids` = prompt + output so far):

    |<------------- token_ids ------------->|
    |<-- prompt_len -->|<--- output_ids --->|
    |<-- computed_len (KV stored) -->|      |  the rest is fed by the next extend
    |<- cached_len ->|                         prefix held (locked) in the prefix cache

The prefix cache key is the namespace (tenant, cache_salt), cache_salt a digest of the client's
salt and the tenant's credential (cache.prefix.salt_key); the first public_prefix_len tokens
are looked up in, and offered to, the shared public namespace instead.
"""

from __future__ import annotations

import enum
import json
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from grammars.spec import GrammarError, GrammarSpec
from radixserve import stop_regex
from radixserve.limits import MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS, MAX_STOPS, TooDeep, loads

MAX_LOGIT_BIAS = 300  # OpenAI's cap on logit_bias entries
LOGIT_BIAS_RANGE = 100.0  # |bias| at most this (OpenAI's range)


BACKGROUND = -(2**31)  # the server's own background work (a history precompute): below every request (whose
# priorities start one above), and out of the cache-hit counters (it is mostly cached by design)


class InvalidParam(ValueError):
    """A request parameter the engine refuses: `field` names it (in the engine's names),
    `message` says why; str() reads 'field: message'. Crosses the engine boundary as is."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_new_tokens reached
    ABORT = "abort"  # aborted by the caller (or a vanished client)
    ERROR = "error"  # an internal error hit this request; the engine goes on


class ReqStatus(enum.StrEnum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"



GREEDY_BELOW = 1e-5  # a temperature under this is greedy (vLLM's _SAMPLING_EPS): dividing by 1e-229 makes inf


@dataclass
class SamplingParams:
    """SGLang's names. `temperature=0` (or below 1e-5) is greedy."""

    max_new_tokens: int | None = None  # None: the engine's default
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None  # stop once the output matches one (the match is kept)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # -1: no prompt logprobs; k: logprobs of prompt tokens k..end
    json_schema: str | None = None  # constrain the output (at most one of these three)
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None  # JSON: tagged regions of constrained JSON inside free text
    grammar_after: str | None = None  # the constraint starts once the output contains this (e.g. "</think>")
    strict_json_schema: bool = True  # reject schema keywords no backend enforces (False: enforce what can be)
    # token id -> bias added to its logit before penalties, temperature, filters and the grammar mask;
    # ids may be given as decimal strings (JSON object keys, OpenAI's convention)
    logit_bias: dict[int | str, float] | None = None

    def grammar_spec(self) -> GrammarSpec | None:
        """The output constraint, or None; raises GrammarError (a ValueError) naming the field."""
        kinds = (("json_schema", self.json_schema), ("regex", self.regex), ("ebnf", self.ebnf),
                 ("structural_tag", self.structural_tag))
        given = [(k, v) for k, v in kinds if v is not None]
        if len(given) > 1:
            raise GrammarError(given[1][0], "give at most one of json_schema, regex, ebnf, structural_tag")
        if not given:
            return None
        kind, source = given[0]
        if not isinstance(source, str) or not source:
            raise GrammarError(kind, "expected a non-empty string")
        if kind == "json_schema":
            return GrammarSpec.json_schema(_json_text(kind, source), strict=self.strict_json_schema)
        if kind == "structural_tag":
            return GrammarSpec.structural_tag(_json_text(kind, source))
        return GrammarSpec(kind, source)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def stop_strs(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the first bad parameter."""
        _check_int(self, "min_new_tokens", lo=0)
        if self.max_new_tokens is not None:
            _check_int(self, "max_new_tokens", lo=0)
            if self.min_new_tokens > self.max_new_tokens:
                raise InvalidParam("min_new_tokens", f"{self.min_new_tokens} is more than max_new_tokens ({self.max_new_tokens})")
        _check_float(self, "temperature", lo=0.0)
        _check_float(self, "top_p", lo=0.0, lo_open=True, hi=1.0)
        _check_int(self, "top_k", lo=-1)
        _check_float(self, "min_p", lo=0.0, hi=1.0)
        _check_float(self, "frequency_penalty", lo=-2.0, hi=2.0)
        _check_float(self, "presence_penalty", lo=-2.0, hi=2.0)
        _check_float(self, "repetition_penalty", lo=0.0, lo_open=True, hi=2.0)
        _check_int(self, "top_logprobs_num", lo=0, hi=vocab_size)
        _check_int(self, "logprob_start_len", lo=-1)
        if self.seed is not None:
            _check_int(self, "seed", lo=0, hi=2**63 - 1)
        if self.stop is not None:
            stops = self.stop_strs
            if not all(isinstance(s, str) and s for s in stops):
                raise InvalidParam("stop", "every stop string must be a non-empty string")
            if len(stops) > MAX_STOPS or sum(len(s) for s in stops) > MAX_STOP_CHARS:
                raise InvalidParam("stop", f"at most {MAX_STOPS} stop strings of {MAX_STOP_CHARS} characters in all")
        try:
            stop_regex.validate(self.stop_regex)
        except stop_regex.StopRegexError as e:
            raise InvalidParam("stop_regex", str(e)) from None
        if self.grammar_after is not None and (not isinstance(self.grammar_after, str) or not self.grammar_after):
            raise InvalidParam("grammar_after", "expected a non-empty string")
        if self.stop_token_ids is not None and len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidParam("stop_token_ids", f"{len(self.stop_token_ids)} ids, more than the limit of {MAX_STOP_TOKEN_IDS}")
        for t in self.stop_token_ids or []:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise InvalidParam("stop_token_ids", f"{t!r} is not a token id in [0, {vocab_size})")
        _check_logit_bias(self.logit_bias, vocab_size)

    def token_bias(self) -> tuple[list[int], list[float]]:
        """logit_bias as (token ids, biases), keys parsed; empty without one. Call after validate."""
        items = (self.logit_bias or {}).items()
        return [int(k) for k, _ in items], [float(v) for _, v in items]


def _check_logit_bias(bias: Any, vocab_size: int) -> None:
    """At most MAX_LOGIT_BIAS entries; keys are token ids (ints, or their decimal strings) in
    [0, vocab_size), values numbers in [-100, 100]."""
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise InvalidParam("logit_bias", f"expected an object mapping token ids to biases, got {bias!r}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidParam("logit_bias", f"{len(bias)} entries, more than the limit of {MAX_LOGIT_BIAS}")
    seen: set[int] = set()
    for key, value in bias.items():
        tok = _token_key(key)
        if tok is None or not 0 <= tok < vocab_size:
            raise InvalidParam("logit_bias", f"key {key!r} is not a token id in [0, {vocab_size})")
        if tok in seen:
            raise InvalidParam("logit_bias", f"token {tok} is given twice")
        seen.add(tok)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or abs(value) > LOGIT_BIAS_RANGE:
            raise InvalidParam("logit_bias", f"the bias of token {tok} is {value!r}, not a number in "
                                             f"[-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]")


def _token_key(key: Any) -> int | None:
    """A logit_bias key as a token id: an int, or a string of ASCII digits ("123"); else None."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12:
        return int(key)
    return None


def _json_text(kind: str, source: str) -> Any:
    """An embedded JSON text (a schema, a structural tag), parsed under the nesting cap."""
    try:
        return loads(source)
    except TooDeep as e:
        raise GrammarError(kind, str(e)) from None
    except json.JSONDecodeError as e:
        raise GrammarError(kind, f"not valid JSON: {e}") from None


def _check_int(p: SamplingParams, name: str, lo: int | None = None, hi: int | None = None) -> None:
    v = getattr(p, name)
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidParam(name, f"expected an integer, got {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise InvalidParam(name, f"{v} is out of range [{lo}, {hi if hi is not None else 'inf'}]")


def _check_float(
    p: SamplingParams, name: str, lo: float, hi: float | None = None, lo_open: bool = False
) -> None:
    v = getattr(p, name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise InvalidParam(name, f"expected a finite number, got {v!r}")
    if v < lo or (lo_open and v == lo) or (hi is not None and v > hi):
        left = "(" if lo_open else "["
        raise InvalidParam(name, f"{v} is out of range {left}{lo}, {hi if hi is not None else 'inf'}]")


RETENTIONS = {"in_memory": 0, "5m": 300, "1h": 3600, "24h": 86400}  # what the APIs' retention names ask, in seconds


@dataclass(frozen=True)
class Retention:
    """Keep a request's prompt cached for `seconds` from its arrival (OpenAI's
    prompt_cache_retention, Anthropic's cache_control TTLs): its first `tokens` prompt tokens
    (0: all of them). With a disk tier the blocks stay on disk until then whatever the bound's
    pressure; in the pool, a retained prefix is evicted after every unretained one."""

    seconds: int
    tokens: int = 0

    @classmethod
    def named(cls, name: str | None, field_name: str, tokens: int = 0) -> Retention | None:
        """From an API's retention name; raises InvalidParam naming `field_name` for another."""
        if name is None:
            return None
        if name not in RETENTIONS:
            raise InvalidParam(field_name, f"{name!r} is not one of {', '.join(map(repr, RETENTIONS))}")
        return cls(RETENTIONS[name], tokens) if RETENTIONS[name] else None


@dataclass(frozen=True)
class KVPages:
    """A prompt's KV for tokens [start, upto), handed from the engine that computed it to the one
    that continues the request (prefill/decode disaggregation; engine/kv_connector.py): `key`
    names the pages at `location`, the producer's connector ("" when asking a producer to publish)."""

    key: str
    start: int
    upto: int
    location: str = ""


@dataclass
class TokenLogprob:
    """One position's log-probability, with the top alternatives (logprob, token_id)."""

    token_id: int
    logprob: float | None  # None for the first prompt token, which has no context
    top: list[tuple[float, int]] = field(default_factory=list)


def new_rid() -> str:
    """Random: a rid says nothing about how many requests anyone else sent."""
    return f"req-{uuid.uuid4().hex}"


class Req:
    """One generation request and its progress. Mutated only on the engine thread."""

    def __init__(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        rid: str | None = None,
        priority: int = 0,
        max_new_tokens: int = 128,
        tenant: str | None = None,
        cache_salt: str | None = None,
        public_prefix_len: int = 0,
        retention: Retention | None = None,
        lora: str | None = None,
    ) -> None:
        self.rid = rid or new_rid()
        self.token_ids: list[int] = list(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.params = params
        self.priority = priority
        self.tenant = tenant  # None: the default tenant
        self.cache_salt = cache_salt  # the namespace's key under the tenant (a salt_key digest from make_req)
        self.public_prefix_len = public_prefix_len
        self.retention = retention
        self.retain_until = time.time() + retention.seconds if retention is not None else 0.0  # epoch seconds
        self.disk_tokens = 0  # prompt tokens a lower tier put back into the pool for it (while it waited)
        self.kv_export: KVPages | None = None  # publish these pages of its prompt once computed (a prefill replica)
        self.kv_import: KVPages | None = None  # take these pages from another engine before it runs (a decode replica)
        self.lora = lora  # the LoRA adapter it names (None: the base model)
        self.adapter: Any = None  # its weights (models.lora.Adapter), given by the engine (engine/lora.py)
        self.max_new_tokens = params.max_new_tokens if params.max_new_tokens is not None else max_new_tokens
        self.arrival = time.monotonic()
        self.status = ReqStatus.WAITING
        self.computed_len = 0  # tokens whose KV is in the pool
        self.cached_len = 0  # of those, held in the prefix cache (matched at admission or adopted since)
        self.cached_tokens = 0  # prompt tokens served from the cache at first admission (reported)
        self.finish_reason: FinishReason | None = None
        self.finish_matched: int | str | None = None
        self.error: str | None = None
        self.retractions = 0
        self.held_for_prefix = False  # the sibling gate held it for a leader's prefix (sched/siblings.py)
        self.stop_ids = frozenset(params.stop_token_ids or ())  # checked at every token: a set, built once
        self.grammar_spec: GrammarSpec | None = params.grammar_spec()
        self.grammar: Any = None  # its grammars.base.Matcher once compiled; constrains every sample once active
        self.grammar_active = params.grammar_after is None
        self.bias_ids, self.bias_values = params.token_bias()  # logit_bias, parsed once
        self.output_logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob] = []

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def output_len(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def retained_tokens(self) -> int:
        """How many leading prompt tokens its retention keeps cached (until `retain_until`)."""
        r = self.retention
        return min(r.tokens or self.prompt_len, self.prompt_len) if r is not None else 0

    @property
    def extend_len(self) -> int:
        """Tokens still to be fed to the model before the next sample."""
        return len(self.token_ids) - self.computed_len

    @property
    def remaining_new_tokens(self) -> int:
        return max(self.max_new_tokens - self.output_len, 0)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs of tokens logprob_start_len .. prompt_len-1 are still to compute."""
        start = self.params.logprob_start_len
        return 0 <= start < self.prompt_len and start + len(self.prompt_logprobs) < self.prompt_len

    def append_token(self, tok: int, eos_ids: set[int], context_len: int) -> None:
        """Append a sampled token and finish on EOS, a stop token, max_new_tokens or the context."""
        if self.max_new_tokens == 0:
            self.finish(FinishReason.LENGTH)
            return
        self.token_ids.append(tok)
        p = self.params
        if self.output_len > p.min_new_tokens:  # the first min_new_tokens were sampled with stops banned
            if (tok in eos_ids and not p.ignore_eos) or tok in self.stop_ids:
                self.finish(FinishReason.STOP, tok)
                return
        if self.output_len >= self.max_new_tokens or len(self.token_ids) >= context_len:
            self.finish(FinishReason.LENGTH)

    def finish(self, reason: FinishReason, matched: int | str | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self.finish_matched = matched

    def __repr__(self) -> str:
        return (
            f"Req({self.rid!r}, {self.status.value}, prompt={self.prompt_len}, out={self.output_len}/"
            f"{self.max_new_tokens}, computed={self.computed_len}, cached={self.cached_len}, "
            f"prio={self.priority})"
        )


def distinct_prompts(reqs: Sequence[Req]) -> list[Req]:
    """The requests whose prompt differs from the one before (n samples of a prompt are consecutive)."""
    out: list[Req] = []
    for r in reqs:
        if not out or out[-1].token_ids[: out[-1].prompt_len] != r.token_ids[: r.prompt_len]:
            out.append(r)
    return out
