"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: vLLM's runtime LoRA
updating, behind an explicit flag (`--allow-runtime-lora-updating`; vLLM reads
the environment variable VLLM_ALLOW_RUNTIME_LORA_UPDATING). Without it the
routes do not exist (404), as in vLLM.

Bodies and answers are vLLM's: `{"lora_name", "lora_path"}` to load,
`{"lora_name"}` (or `lora_int_id`) to unload; 200 with a plain-text "Success:
..." line; 400 InvalidUserInput for a missing field or a name already loaded,
400 BadRequestError for an adapter that cannot run on this model (the message
names the field), 404 NotFoundError "Loading lora <name> failed: No adapter
found for <path>" for a directory that does not exist or holds no
adapter_config.json (alike, as vLLM: a key holder cannot tell them apart to map
the server's directories), and for an unload of a name not served. A load is
checked against the checkpoint in the API process, off its event loop
(a thread, with a deadline; the header's size is bounded) and announced to every prefill and decode worker, which read it in
the background (`LoRAUpdate`); an unload makes them forget it. The registry
(`ApiSettings.loras`) is the API process's own, or with --api-servers above 1
a file all of them share (epd/shared_lora_registry.py): a load or unload sent
to any process holds for every one.
"""
from __future__ import annotations

import asyncio
import os

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from epd.api.orchestrator_like import OrchestratorLike
from epd.api.settings import ApiSettings
from epd.lora_modules import LoRAModule
from epd.requests import RequestError
from epd.transport.weights.lora_files import AdapterNotFoundError

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
STAT_TIMEOUT_S = 10.0  # whether the path is a directory (a hung network mount must not hang the route)


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = ""
    lora_path: str = ""


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = ""
    lora_int_id: int | None = None


def _invalid(message: str) -> RequestError:
    return RequestError(message, status=400, type="InvalidUserInput")


def add_lora_routes(app: FastAPI, orchestrator: OrchestratorLike, settings: ApiSettings) -> None:
    loras = settings.loras

    @app.post(LOAD_PATH)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        if not body.lora_name or not body.lora_path:
            raise _invalid("Both 'lora_name' and 'lora_path' must be provided.")
        if loras.get(body.lora_name) is not None or body.lora_name == settings.served_model_name:
            raise _invalid(f"The lora adapter '{body.lora_name}' has already been loaded.")
        not_found = RequestError(f"Loading lora {body.lora_name} failed: No adapter found for {body.lora_path}",
                                 status=404, type="NotFoundError")  # no directory and no adapter in it alike
        try:
            is_dir = await asyncio.wait_for(asyncio.to_thread(os.path.isdir, body.lora_path), STAT_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise RequestError(f"{body.lora_path}: no answer from the file system within {STAT_TIMEOUT_S:g} s",
                               status=503, type="service_unavailable", retry_after_s=5) from None
        if not is_dir:
            raise not_found
        lora = loras.make(body.lora_name, body.lora_path)
        try:
            await orchestrator.update_lora(lora, is_load=True)  # checked off the loop, then announced
        except AdapterNotFoundError:
            raise not_found from None
        except ValueError as exc:
            raise RequestError(str(exc), status=400, type="BadRequestError") from None
        try:
            loras.add(LoRAModule(body.lora_name, lora.lora_path), lora)
        except ValueError as exc:  # loaded meanwhile by a concurrent request (another API process)
            raise _invalid(str(exc)) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post(UNLOAD_PATH)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        name = body.lora_name or next((n for n in loras.names if loras.get(n).lora_int_id == body.lora_int_id), "")
        if not body.lora_name and body.lora_int_id is None:
            raise _invalid("either 'lora_name' and 'lora_int_id' needs to be provided.")
        if loras.get(name) is None:
            raise RequestError(f"The lora adapter '{body.lora_name or body.lora_int_id}' cannot be found.",
                               status=404, type="NotFoundError")
        try:
            lora = loras.remove(name)  # requests that name it now are 404s; those running finish with it
        except KeyError:  # unloaded meanwhile by a concurrent request (another API process)
            raise RequestError(f"The lora adapter '{name}' cannot be found.", status=404,
                               type="NotFoundError") from None
        await orchestrator.update_lora(lora, is_load=False)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
