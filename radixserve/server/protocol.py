"""Wire types: msgspec Structs for every request and response body (one serializer, and the
source of /openapi.json). Request Structs forbid unknown fields, so a typo is a 400 naming it.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from radixserve.limits import (
    MAX_CACHE_SALT_CHARS,
    MAX_MESSAGES,
    MAX_METADATA_KEYS,
    MAX_RID_CHARS,
    MAX_STOP_TOKEN_IDS,
    MAX_STOPS,
    MAX_TOOLS,
)

# Caps (radixserve/limits.py) live in the types: over one is a 400 naming the field and the cap.
Stop = str | Annotated[list[str], Meta(max_length=MAX_STOPS)] | None
StopTokenIds = Annotated[list[int], Meta(max_length=MAX_STOP_TOKEN_IDS)] | None
CacheSalt = Annotated[str, Meta(max_length=MAX_CACHE_SALT_CHARS)] | None
Rid = Annotated[str, Meta(max_length=MAX_RID_CHARS)] | None
PromptCacheKey = Annotated[str, Meta(max_length=MAX_CACHE_SALT_CHARS)] | None
# How long the prompt stays cached (request.RETENTIONS): OpenAI's two values; /generate takes Anthropic's TTLs too
PromptCacheRetention = Literal["in_memory", "24h"] | None
SafetyIdentifier = Annotated[str, Meta(max_length=MAX_RID_CHARS)] | None
MAX_TEMPLATE_KWARGS = 32  # chat_template_kwargs: a handful of switches (enable_thinking, ...)
# crosses to the engine process as a msgpack int: bounded so a huge one is a 400, not an encoding error
Priority = Annotated[int, Meta(ge=-(2**31) + 1, le=2**31 - 1)] | None  # (-2**31: the server's background work)
# OpenAI's ranges (chat, completions, Responses); /generate keeps SGLang's (the engine's checks)
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)] | None
TopP = Annotated[float, Meta(ge=0.0, le=1.0)] | None


class _In(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A request body: unknown fields are rejected."""


class _Out(msgspec.Struct, omit_defaults=False):
    """A response body."""


# -- errors ----------------------------------------------------------------------------------
class ErrorDetail(_Out):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Out):
    error: ErrorDetail


# -- native /generate (SGLang's shape) -------------------------------------------------------
class NativeSamplingParams(_In):
    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: Stop = None
    stop_token_ids: StopTokenIds = None
    stop_regex: str | list[str] | None = None  # stop once the output matches one; the match is kept
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # accepted; Hugging Face's fast tokenizers decode the same either way
    n: int = 1  # samples per prompt: a single prompt with n > 1 gets a list of n responses
    seed: int | None = None
    json_schema: str | None = None  # the schema as JSON text (SGLang's convention)
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None  # JSON text: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}
    grammar_after: str | None = None  # the constraint applies once the output contains this marker
    logit_bias: dict[str, float] | None = None


class GenerateRequest(_In):
    text: str | list[str] | None = None
    input_ids: list[Any] | None = None  # token ids, or a batch of them (msgspec takes one list type per union)
    sampling_params: NativeSamplingParams | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int | None = None  # None: -1 (output only), or 0 when nothing is generated
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False  # logprob triples carry the token's text (else null, as SGLang)
    rid: Rid = None
    priority: Priority = None
    cache_salt: CacheSalt = None
    public_prefix_len: int | None = None
    lora_path: str | None = None  # SGLang's: the LoRA adapter's name (as loaded)
    prompt_cache_retention: Literal["in_memory", "5m", "1h", "24h"] | None = None


class NativeFinishReason(_Out):
    type: str  # stop | length | abort | error
    matched: int | str | None = None
    message: str | None = None


LogprobTriple = tuple[float | None, int, str | None]  # [logprob, token_id, text]


class MetaInfo(_Out):
    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: NativeFinishReason | None
    e2e_latency: float | None = None
    output_token_logprobs: list[LogprobTriple] | None = None  # streamed: the new tokens' only
    output_top_logprobs: list[list[LogprobTriple]] | None = None
    output_token_logprobs_length: int | None = None  # output logprobs so far (all of them, also when streamed)
    input_token_logprobs: list[LogprobTriple] | None = None
    input_top_logprobs: list[list[LogprobTriple]] | None = None


class GenerateResponse(_Out):
    text: str
    output_ids: list[int]
    meta_info: MetaInfo


class AbortRequest(_In):
    rid: str


class ConcatAndAppendRequest(_In):
    """SGLang's parallel-encoding join (its client's program-state ids)."""

    src_rids: Annotated[list[Annotated[str, Meta(max_length=MAX_RID_CHARS)]], Meta(max_length=1024)]
    dst_rid: Annotated[str, Meta(max_length=MAX_RID_CHARS)]


class ModelInfo(_Out):
    """GET /model_info (and SGLang's older /get_model_info)."""

    model_path: str
    served_model_name: str
    tokenizer_path: str
    is_generation: bool
    max_context_len: int
    has_image_understanding: bool = False
    has_audio_understanding: bool = False
    model_type: str | None = None
    architectures: list[str] | None = None
    preferred_sampling_params: dict[str, Any] | None = None


# -- OpenAI ------------------------------------------------------------------------------------
class ContentPart(_In):
    type: str
    text: str | None = None
    image_url: Any = None


class ChatMessage(_In):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None  # accepted so a returned message can be sent back; ignored
    reasoning_content: str | None = None  # likewise: earlier reasoning is not rendered again
    function_call: Any = None
    audio: Any = None


class StreamOptions(_In):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _OpenAISampling(_In):
    """Fields shared by chat and completions, with radixserve's extras (SGLang's names)."""

    model: str = ""
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = None
    n: int = 1
    seed: int | None = None
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Temperature = None
    top_p: TopP = None
    user: str | None = None
    metadata: Annotated[dict[str, str], Meta(max_length=MAX_METADATA_KEYS)] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: PromptCacheKey = None  # a routing hint (RequestOptions.prompt_cache_key), not a cache namespace
    prompt_cache_retention: PromptCacheRetention = None
    safety_identifier: SafetyIdentifier = None  # accepted; not used
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted; not used
    # extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: StopTokenIds = None
    skip_special_tokens: bool = True
    priority: Priority = None
    cache_salt: CacheSalt = None
    public_prefix_len: int | None = None
    rid: Rid = None
    regex: str | None = None
    ebnf: str | None = None
    grammar_after: str | None = None


class ChatCompletionRequest(_OpenAISampling):
    messages: Annotated[list[ChatMessage], Meta(max_length=MAX_MESSAGES)] = []
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    response_format: dict[str, Any] | None = None
    tools: Annotated[list[Any], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: Annotated[dict[str, Any], Meta(max_length=MAX_TEMPLATE_KWARGS)] | None = None


class CompletionRequest(_OpenAISampling):
    prompt: str | list[Any] = ""  # text, a batch of texts, token ids, or a batch of token ids
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(_Out):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_Out):
    content: list[TokenLogprobOut] | None


class FunctionCall(_Out):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Out):
    id: str
    function: FunctionCall
    type: str = "function"


def new_call(name: str, arguments: Any) -> ToolCall:
    """A call as a model wrote it: a fresh id, its arguments as JSON text."""
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", FunctionCall(name, json.dumps(arguments)))


class ToolCallDelta(_Out):
    index: int
    id: str
    function: FunctionCall
    type: str = "function"


class AssistantMessage(_Out):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None  # with --reasoning-parser: the <think> part, apart from content


class ChatChoice(_Out):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class PromptTokensDetails(_Out):
    cached_tokens: int


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ChatCompletionResponse(_Out):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"


class ChatDelta(_Out, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(_Out):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(_Out):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class CompletionLogprobs(_Out):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Out):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(_Out):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: Literal["text_completion"] = "text_completion"


class ModelCard(_Out):
    id: str
    created: int
    owned_by: str = "radixserve"
    max_model_len: int | None = None
    object: Literal["model"] = "model"
    root: str | None = None  # a LoRA adapter's folder (vLLM's)
    parent: str | None = None  # a LoRA adapter's base model


class LoadLoRARequest(_In):
    """vLLM's POST /v1/load_lora_adapter."""

    lora_name: str
    lora_path: str


class UnloadLoRARequest(_In):
    """vLLM's POST /v1/unload_lora_adapter."""

    lora_name: str
    lora_int_id: int | None = None


class ModelList(_Out):
    data: list[ModelCard]
    object: Literal["list"] = "list"


REQUEST_TYPES: dict[str, type] = {
    "/generate": GenerateRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/load_lora_adapter": LoadLoRARequest,
    "/v1/unload_lora_adapter": UnloadLoRARequest,
    "/v1/completions": CompletionRequest,
    "/abort_request": AbortRequest,
    "/concate_and_append_request": ConcatAndAppendRequest,
}
RESPONSE_TYPES: dict[str, Any] = {
    "/generate": GenerateResponse | list[GenerateResponse],  # a batch of prompts gets a list
    "/v1/chat/completions": ChatCompletionResponse,
    "/v1/completions": CompletionResponse,
    "/v1/models": ModelList,
    "/model_info": ModelInfo,
}
