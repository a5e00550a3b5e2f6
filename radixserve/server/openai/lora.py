"""vLLM's run-time LoRA endpoints, for admins: POST /v1/load_lora_adapter {lora_name, lora_path}
and POST /v1/unload_lora_adapter {lora_name}. The adapter is read and checked by the engine
(every data-parallel replica) before it is served; a bad one is a 400 naming the field at fault,
an unknown one to unload a 404."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from radixserve.server.body import read_body
from radixserve.server.errors import ApiError
from radixserve.server.protocol import LoadLoRARequest, UnloadLoRARequest
from radixserve.server.state import ServerState


def _admin(request: web.Request, what: str) -> ServerState:
    state: ServerState = request.app["state"]
    if not state.auth.of_request(request).admin:
        raise ApiError(403, f"{what}: only an admin tenant may change the adapters every tenant is served", code="not_admin")
    return state


def _field(e: ValueError) -> str:
    """The field a ValueError names ("lora_name: ..."; the adapter's files otherwise)."""
    head = str(e).split(":", 1)[0]
    return head if head in ("lora_name", "lora_path") else "lora_path"


def _json(body: dict[str, Any]) -> web.Response:
    return web.json_response(body)


async def load_lora_adapter(request: web.Request) -> web.Response:
    state = _admin(request, "load_lora_adapter")
    b = await read_body(request, LoadLoRARequest)
    if b.lora_name == state.model_name or b.lora_name in state.loras:
        raise ApiError(400, f"lora_name: {b.lora_name!r} is already served; unload it first", param="lora_name")
    try:
        info = await state.off_loop(state.engine.load_lora, b.lora_name, b.lora_path)
    except ValueError as e:
        raise ApiError(400, str(e), param=_field(e)) from None
    state.loras[b.lora_name] = info
    return _json({"message": f"Success: LoRA adapter '{b.lora_name}' added successfully.", "adapter": info})


async def unload_lora_adapter(request: web.Request) -> web.Response:
    state = _admin(request, "unload_lora_adapter")
    b = await read_body(request, UnloadLoRARequest)
    if b.lora_name not in state.loras:
        raise ApiError(404, f"lora_name: no adapter named {b.lora_name!r} is loaded", param="lora_name",
                       code="model_not_found")
    await state.off_loop(state.engine.unload_lora, b.lora_name)
    del state.loras[b.lora_name]
    return _json({"message": f"Success: LoRA adapter '{b.lora_name}' removed successfully."})
