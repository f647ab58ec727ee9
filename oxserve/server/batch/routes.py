"""OpenAI's Files and Batch APIs over the durable store (see `store` and `runner`).

    POST   /v1/files                 multipart: file (JSONL), purpose "batch"
    GET    /v1/files, /v1/files/{id}, /v1/files/{id}/content;  DELETE /v1/files/{id}
    POST   /v1/batches               {input_file_id, endpoint, completion_window, metadata?}
    GET    /v1/batches, /v1/batches/{id};  POST /v1/batches/{id}/cancel
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.responses import Response

from oxserve.server import openapi
from oxserve.server.batch.lines import ENDPOINTS, parse_lines
from oxserve.server.batch.runner import BatchRunner
from oxserve.server.batch.store import ENDED, BatchStore, StoreError
from oxserve.server.protocol import APIError, bad_request, parse_body, read_body

COMPLETION_WINDOWS = ("24h",)


class CreateBatchRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(None, max_length=16)


def add_batch_routes(app: FastAPI, store: BatchStore, runner: BatchRunner) -> None:
    def not_found(what: str, name: str) -> APIError:
        return APIError(404, f"no {what} with id {name!r}", "invalid_request_error", None, "not_found")

    async def stored(method, *args):
        """`method(*args)` on the store's thread; a write the store cannot make is a 507."""
        try:
            return await store.call(method, *args)
        except StoreError as e:
            raise APIError(507, f"{e}; retry later", "server_error", None, "insufficient_storage") from None

    @app.post("/v1/files", openapi_extra=openapi.multipart({"file": {"type": "string", "format": "binary"},
                                                             "purpose": {"type": "string", "enum": ["batch"]}}, ["file", "purpose"]))  # fmt: skip
    async def upload(request: Request) -> dict[str, Any]:
        body = await read_body(request)
        form = await _multipart(request, body)
        file, purpose = form.get("file"), form.get("purpose")
        if not isinstance(file, UploadFile):
            raise bad_request("send the file as multipart/form-data field 'file'", "file")
        if purpose != "batch":
            raise bad_request(f"purpose must be 'batch' (the only use of files here), got {purpose!r}", "purpose")
        content = await file.read()
        return await stored(store.add_file, content, file.filename or "upload.jsonl", purpose)

    @app.get("/v1/files")
    async def list_files(purpose: str | None = None, limit: int = 10_000, after: str | None = None,
                         order: str = "desc") -> dict[str, Any]:  # fmt: skip
        _check_limit(limit, 10_000)
        if order not in ("asc", "desc"):
            raise bad_request("order must be 'asc' or 'desc'", "order")
        return _listing(await stored(store.files, purpose, limit + 1, after, order == "desc"), limit)

    @app.get("/v1/files/{file_id}")
    async def retrieve_file(file_id: str) -> dict[str, Any]:
        if (found := await stored(store.file, file_id)) is None:
            raise not_found("file", file_id)
        return found

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str) -> Response:
        if (content := await stored(store.file_content, file_id)) is None:
            raise not_found("file", file_id)
        return Response(content, media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str) -> dict[str, Any]:
        if not await stored(store.delete_file, file_id):
            raise not_found("file", file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    @app.post("/v1/batches", openapi_extra=openapi.body(CreateBatchRequest))
    async def create_batch(request: Request) -> dict[str, Any]:
        req: CreateBatchRequest = parse_body(CreateBatchRequest, await read_body(request))
        if req.endpoint not in ENDPOINTS:
            raise bad_request(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {req.endpoint!r}", "endpoint")
        if req.completion_window not in COMPLETION_WINDOWS:
            raise bad_request(f"completion_window must be one of {', '.join(COMPLETION_WINDOWS)}", "completion_window")
        content = await stored(store.file_content, req.input_file_id)
        if content is None:
            raise not_found("file", req.input_file_id)
        lines, errors = await asyncio.to_thread(parse_lines, content, req.endpoint)  # up to 32 MiB of JSON
        batch = await stored(store.add_batch, req.endpoint, req.input_file_id, req.completion_window, req.metadata, lines, errors)
        runner.poke()
        return batch

    @app.get("/v1/batches")
    async def list_batches(limit: int = 20, after: str | None = None) -> dict[str, Any]:
        _check_limit(limit, 100)
        return _listing(await stored(store.batches, limit + 1, after), limit)

    @app.get("/v1/batches/{batch_id}")
    async def retrieve_batch(batch_id: str) -> dict[str, Any]:
        if (batch := await stored(store.batch, batch_id)) is None:
            raise not_found("batch", batch_id)
        return batch

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str) -> dict[str, Any]:
        if (batch := await stored(store.batch, batch_id)) is None:
            raise not_found("batch", batch_id)
        if batch["status"] in ENDED:
            raise APIError(409, f"the batch is already {batch['status']}", "invalid_request_error", None, "batch_ended")
        if batch["status"] != "cancelling":
            await stored(store.set_status, batch_id, "cancelling")
            runner.poke()
        return await stored(store.batch, batch_id)


def _check_limit(limit: int, most: int) -> None:
    if not 1 <= limit <= most:
        raise bad_request(f"limit must be 1 to {most}", "limit")


def _listing(rows: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    """OpenAI's cursor page from `limit` + 1 rows (the extra one: there is more)."""
    data = rows[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit}  # fmt: skip


async def _multipart(request: Request, body: bytes):
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise bad_request("a file upload is multipart/form-data (fields 'file' and 'purpose')")

    async def chunks() -> AsyncIterator[bytes]:
        yield body

    try:
        return await MultiPartParser(request.headers, chunks()).parse()
    except MultiPartException as e:
        raise bad_request(f"the multipart body does not parse: {e.message}") from None
