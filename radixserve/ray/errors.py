"""Errors the ingress answers itself, in the shape of the API the request was for: Anthropic's
under /v1/messages, OpenAI's (as the server writes it) elsewhere. A stream that already began
ends with an error event of its API instead: `event: error` for /v1/messages and
/v1/responses, a `data: {"error": ...}` chunk and `data: [DONE]` for the others (the OpenAI
clients raise on such a chunk)."""

from __future__ import annotations

import msgspec

from radixserve.server.anthropic import protocol as anthropic_protocol
from radixserve.server.errors import ERROR_TYPES
from radixserve.server.protocol import ErrorDetail, ErrorResponse


class ReplicaGone(RuntimeError):
    """Raised by a replica that cannot serve: its radixserve server or engine is gone, or the
    connection to it broke. The ingress sends the request to another replica when none of the
    answer went out yet."""

    def __init__(self, replica: str, why: str) -> None:
        super().__init__(replica, why)
        self.replica, self.why = replica, why

    def __str__(self) -> str:
        return f"replica {self.replica}: {self.why}"


def _anthropic(path: str) -> bool:
    return path == "/v1/messages" or path.startswith(("/v1/messages/", "/v1/messages?"))


def error_json(path: str, status: int, message: str, code: str) -> bytes:
    if _anthropic(path):
        return msgspec.json.encode(anthropic_protocol.error_body(status, message))
    return msgspec.json.encode(ErrorResponse(ErrorDetail(message, ERROR_TYPES.get(status, "error"), None, code)))


def stream_error(path: str, message: str, code: str, events_sent: int) -> bytes:
    """The last bytes of an SSE stream that broke off after `events_sent` events went out."""
    if _anthropic(path):
        return b"event: error\ndata: " + error_json(path, 500, message, code) + b"\n\n"
    if path.startswith("/v1/responses"):
        event = {"type": "error", "sequence_number": events_sent, "message": message, "code": code, "param": None}
        return b"event: error\ndata: " + msgspec.json.encode(event) + b"\n\n"
    return b"data: " + error_json(path, 500, message, code) + b"\n\ndata: [DONE]\n\n"
