"""Images and videos named by URL in API requests -> decoded pixels.

Accepted, as vLLM accepts them: `data:` URLs (base64), and local files (`file://` URLs or
paths) only under `--allowed-local-media-path`. Remote URLs are refused: a server that
fetched them would reach whatever its network reaches on a client's say-so. Every failure is
a `MediaError` whose message says what was wrong; the caller names the part.
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.parse
from pathlib import Path

import numpy as np
import PIL.Image

from oxserve.multimodal.processor import Video

MAX_MEDIA_BYTES = 64 << 20  # an encoded image or video
MAX_IMAGE_PIXELS = 64_000_000  # a decoded image (PIL's decompression-bomb guard, made an error)
MAX_VIDEO_FRAMES = 4096  # frames decoded from one video
MAX_VIDEO_PIXELS = 1 << 30  # pixels of all its decoded frames together (3 GiB as RGB)


class MediaError(ValueError):
    pass


def media_bytes(url: str, allowed_local_path: Path | None) -> bytes:
    """The bytes a URL names."""
    if not isinstance(url, str) or not url:
        raise MediaError("the URL is empty")
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise MediaError("a data URL must be base64: data:<type>;base64,<data>")
        if len(payload) > MAX_MEDIA_BYTES * 4 // 3 + 4:
            raise MediaError(f"the data is over {MAX_MEDIA_BYTES >> 20} MiB")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise MediaError("the data URL's payload is not valid base64") from None
    scheme = urllib.parse.urlsplit(url).scheme
    if scheme in ("http", "https"):
        raise MediaError("remote URLs are not fetched by this server; send the data inline as a data: URL")
    if scheme not in ("file", ""):
        raise MediaError(f"URLs of scheme {scheme!r} are not supported; use data: URLs or local files")
    return _local_file(urllib.parse.unquote(urllib.parse.urlsplit(url).path) if scheme else url, allowed_local_path)


def _local_file(name: str, allowed: Path | None) -> bytes:
    if allowed is None:
        raise MediaError("local files are off; start the server with --allowed-local-media-path DIR to allow some")
    path = Path(name).resolve()
    if not path.is_relative_to(allowed.resolve()):
        raise MediaError(f"{name} is outside the allowed media directory")
    if not path.is_file():
        raise MediaError(f"{name} is not a file")
    if path.stat().st_size > MAX_MEDIA_BYTES:
        raise MediaError(f"{name} is over {MAX_MEDIA_BYTES >> 20} MiB")
    return path.read_bytes()


def decode_image(data: bytes) -> PIL.Image.Image:
    try:
        with PIL.Image.open(io.BytesIO(data)) as image:
            if image.width * image.height > MAX_IMAGE_PIXELS:
                raise MediaError(f"the image is {image.width}x{image.height}, over {MAX_IMAGE_PIXELS:,} pixels")
            image.load()
            return image.copy()
    except MediaError:
        raise
    except (OSError, ValueError, SyntaxError, PIL.Image.DecompressionBombError) as e:
        raise MediaError(f"cannot decode the image: {e}") from None


def decode_video(data: bytes) -> Video:
    """Every frame as RGB and the stream's average frame rate."""
    import av  # PyAV: FFmpeg's decoders

    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise MediaError("the file has no video stream")
            stream = container.streams.video[0]
            rate = float(stream.average_rate or stream.guessed_rate or 0)
            frames, pixels = [], 0
            for frame in container.decode(stream):
                pixels += frame.width * frame.height
                if len(frames) == MAX_VIDEO_FRAMES or pixels > MAX_VIDEO_PIXELS:
                    raise MediaError(f"the video is over {MAX_VIDEO_FRAMES} frames or {MAX_VIDEO_PIXELS:,} pixels in all")
                if frame.width * frame.height > MAX_IMAGE_PIXELS:
                    raise MediaError(f"the video's frames are {frame.width}x{frame.height}, over {MAX_IMAGE_PIXELS:,} pixels")
                frames.append(frame.to_ndarray(format="rgb24"))
    except MediaError:
        raise
    except (av.FFmpegError, OSError, ValueError) as e:
        raise MediaError(f"cannot decode the video: {e}") from None
    if not frames:
        raise MediaError("the video has no frames")
    if not rate > 0:
        raise MediaError("the video has no frame rate")
    if len({f.shape for f in frames}) > 1:
        raise MediaError("the video's frames change size")
    return Video(np.stack(frames), rate)
