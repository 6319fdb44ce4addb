"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (vLLM's request shapes):
LoRA adapters loaded and unloaded while serving, with ``--enable-lora`` (docs/lora.md).

A loaded adapter is a model: requests name it in ``model`` and ``/v1/models`` lists it with
the base model as its parent. Unloading takes it out at once for new requests (404); requests
already running with it finish with it.
"""

from __future__ import annotations

from aiohttp import web

from pagoda.engine.lora import LoRAError
from pagoda.server.errors import APIError, bad_request
from pagoda.server.protocol import Body, check_fields
from pagoda.server.serving import read_json
from pagoda.server.state import STATE_KEY, ServerState

LOAD_FIELDS = frozenset({"lora_name", "lora_path", "load_inplace"})
UNLOAD_FIELDS = frozenset({"lora_name", "lora_int_id"})


def _engine_with_lora(state: ServerState):
    if state.engine.loras is None:
        raise bad_request("LoRA adapters are off on this server (start it with --enable-lora)",
                          code="lora_disabled")
    return state.engine


def _name(b: Body) -> str:
    name = b.str_("lora_name")
    if not name:
        raise bad_request("'lora_name' is required", "lora_name")
    return name


async def load_lora_adapter(request: web.Request) -> web.Response:
    """POST /v1/load_lora_adapter: ``{"lora_name": ..., "lora_path": ...}``."""
    state = request.app[STATE_KEY]
    engine = _engine_with_lora(state)
    b = check_fields(await read_json(request), LOAD_FIELDS)
    name, path = _name(b), b.str_("lora_path")
    if not path:
        raise bad_request("'lora_path' is required", "lora_path")
    if name in state.accepted_names:
        raise bad_request(f"{name!r} is the base model's name; give the adapter another", "lora_name")
    if b.bool_("load_inplace", False) and name in engine.loras:
        engine.unload_lora_adapter(name)
    try:
        await engine.load_lora_adapter(name, path)
    except LoRAError as exc:
        raise bad_request(str(exc), "lora_path" if name not in engine.loras else "lora_name",
                          code="invalid_lora_adapter") from None
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """POST /v1/unload_lora_adapter: ``{"lora_name": ...}``."""
    state = request.app[STATE_KEY]
    engine = _engine_with_lora(state)
    b = check_fields(await read_json(request), UNLOAD_FIELDS)
    name = _name(b)
    try:
        engine.unload_lora_adapter(name)
    except LoRAError:
        raise APIError(404, f"The LoRA adapter '{name}' cannot be found.", param="lora_name",
                       code="lora_not_found") from None
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
