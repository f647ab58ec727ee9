"""Encoded test media: random PNG images and MP4 videos (made with Pillow and PyAV)."""

from __future__ import annotations

import io

import av
import numpy as np
import PIL.Image


def png_bytes(rng: np.random.Generator, height: int, width: int) -> bytes:
    out = io.BytesIO()
    PIL.Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def mp4_bytes(rng: np.random.Generator, frames: int, fps: float, height: int, width: int) -> bytes:
    """An H.264 MP4 of smooth random frames (noise compresses badly and decodes far from itself)."""
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=int(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        base = rng.integers(0, 256, (height, width, 3)).astype(np.float64)
        for i in range(frames):
            frame = np.clip(base + 10 * i, 0, 255).astype(np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return out.getvalue()
