"""`oxserve serve --role encode`: a vision encoder on its own, for the router to send a
request's images and videos to before the instance that runs its prompt.

It loads only the checkpoint's vision tower and processor (no decoder, no caches).
`POST /v1/encode {"media": [{"modality": "image"|"video", "url": ...}], "send_to": "host:port",
"transfer_id": id}` fetches and decodes the media as a serving instance would, processes them,
encodes them in one tower pass and sends the embeddings, named by content hash, to the
receiving instance's `--mm-port` (`oxserve.disagg.connector`). That instance puts them in its
encoder cache, so its prompt finds them there instead of encoding (`EncoderCache.seed`).
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from oxserve.disagg.connector import KVSender, KVTransferError, Parcel, embedding_description
from oxserve.model.loader import load_vision_tower
from oxserve.model.vision import MultiModalConfig
from oxserve.multimodal.inputs import content_hash
from oxserve.multimodal.media import MediaError, decode_image, decode_video, media_bytes
from oxserve.multimodal.processor import MediaProcessor, ProcessorConfig


class Encoder:
    def __init__(self, model_path: Path, dtype: str, allowed_local_media_path: Path | None, kv_transport: str = "tcp",
                 debug: bool = False):  # fmt: skip
        mm = MultiModalConfig.from_file(model_path)
        if mm is None:
            raise ValueError(f"{model_path} has no vision tower to serve as an encode instance")
        self.torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]
        self.tower = load_vision_tower(model_path, self.torch_dtype)
        self.media = MediaProcessor(ProcessorConfig.for_model(model_path, mm.vision))
        self.allowed = allowed_local_media_path
        description = embedding_description(model_path, str(self.torch_dtype), mm.vision.out_hidden_size)
        self.sender = KVSender(description, kv_transport, debug)
        self.lock = threading.Lock()  # one tower pass at a time: they share the cores anyway
        self.encoded = 0

    def encode(self, media: list[dict], send_to: str, transfer_id: str) -> dict:
        processed = []
        for i, part in enumerate(media):
            where = f"media[{i}]"
            try:
                data = media_bytes(part.get("url"), self.allowed)
                if part.get("modality") == "video":
                    processed.append(self.media.video(decode_video(data)))
                else:
                    processed.append(self.media.image(decode_image(data)))
            except (MediaError, ValueError) as e:
                raise ValueError(f"{where}: {e}") from None
        hashes = [content_hash(p) for p in processed]
        merge = self.tower.config.spatial_merge_size**2
        with self.lock, torch.inference_mode():
            out = self.tower(torch.cat([p.patches for p in processed]).to(self.torch_dtype), [p.grid for p in processed])
        embeds = out.split([p.patches.shape[0] // merge for p in processed])
        tensors = {h.hex(): e.contiguous() for h, e in zip(hashes, embeds)}
        self.sender.send(send_to, transfer_id, Parcel({"items": len(tensors)}, tensors))
        self.encoded += len(processed)
        return {"items": [{"hash": h.hex(), "embeddings": len(e)} for h, e in zip(hashes, embeds)],
                "bytes": sum(e.numel() * e.element_size() for e in embeds)}  # fmt: skip


def build_encoder_app(encoder: Encoder) -> FastAPI:
    app = FastAPI(title="oxserve encoder", docs_url=None, redoc_url=None)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.post("/v1/encode")
    async def encode(request: Request) -> Response:
        try:
            body = await request.json()
            media, send_to, transfer_id = body["media"], body["send_to"], body["transfer_id"]
            if not isinstance(media, list) or not media:
                raise ValueError("media must be a non-empty list")
            return JSONResponse(await asyncio.to_thread(encoder.encode, media, send_to, transfer_id))
        except (ValueError, KeyError, TypeError) as e:
            return JSONResponse({"error": {"message": str(e), "type": "invalid_request_error", "param": None,
                                           "code": None}}, 400)  # fmt: skip
        except KVTransferError as e:
            return JSONResponse({"error": {"message": str(e), "type": "server_error", "param": None,
                                           "code": "kv_transfer_failed"}}, 503)  # fmt: skip

    @app.get("/v1/encode/stats")
    async def stats() -> dict:
        return {"encoded": encoder.encoded}

    return app
