"""Images and video frames -> patches for the vision tower, and the prompt text that holds
their places, as transformers 5.23.0's glm5_next processors make them.

Images follow `Glm5NextImageProcessorPil` (PIL's bicubic resize, NumPy arithmetic); video
follows `Glm5NextVideoProcessor` (frames sampled at `fps`, torch's antialiased bicubic resize
on uint8, rescale fused into the normalisation). Both resize to a canvas that is a multiple of
patch x merge and fits a token budget, pad right and bottom with black, normalise with CLIP's
mean and std, and cut patches in merge-block order. An image is one temporal patch (its frame
repeated); a video pairs its frames.

In the prompt, `<|image|>` becomes one image token per embedding; `<|video|>` becomes, per
temporal patch, `<|begin_of_image|>` + its image tokens + `<|end_of_image|>` + "{t:.1f} seconds".
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import PIL.Image
import torch
import torch.nn.functional as F

from oxserve.model.vision import VisionConfig

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGE_PLACEHOLDER = "<|image|>"
VIDEO_PLACEHOLDER = "<|video|>"


@dataclass(frozen=True)
class MediaBudget:
    """Tokens one image (or one video) may become: its canvas is scaled to fit."""

    min_image_tokens: int
    max_image_tokens: int


@dataclass(frozen=True)
class ProcessorConfig:
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image: MediaBudget = MediaBudget(16, 8000)
    video: MediaBudget = MediaBudget(16, 240000)
    fps: float = 2.0  # video frames sampled per second
    max_frames: int = 2048
    max_duration: float = 0.0  # seconds of video kept (0: all)
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def for_model(cls, path: str | Path, vision: VisionConfig) -> ProcessorConfig:
        """The vision tower's patch geometry, with the checkpoint's processor settings
        (preprocessor_config.json, video_preprocessor_config.json) where it has them."""
        cfg = cls(vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size)
        path = Path(path)
        image = _json(path / "preprocessor_config.json")
        video = _json(path / "video_preprocessor_config.json")
        common = {k: tuple(v) if isinstance(v, list) else v for k, v in image.items()
                  if k in ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std", "rescale_factor")}  # fmt: skip
        return replace(
            cfg, **common,
            image=MediaBudget(image.get("min_image_tokens", cfg.image.min_image_tokens),
                              image.get("max_image_tokens", cfg.image.max_image_tokens)),
            video=MediaBudget(video.get("min_image_tokens", cfg.video.min_image_tokens),
                              video.get("max_image_tokens", cfg.video.max_image_tokens)),
            fps=video.get("fps", cfg.fps), max_frames=video.get("max_frames", cfg.max_frames),
            max_duration=video.get("max_duration", cfg.max_duration),
        )  # fmt: skip


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


@dataclass(frozen=True)
class Video:
    """Decoded frames [T, H, W, 3] uint8 and the rate they were recorded at."""

    frames: np.ndarray
    fps: float


@dataclass
class ProcessedMedia:
    """One image or video, ready for the tower: patches [t*h*w, patch_dim] (fp32) of grid
    (t, h, w) in patches, and the prompt text that stands for it."""

    modality: str  # "image" | "video"
    patches: torch.Tensor
    grid: tuple[int, int, int]
    placeholder: str
    timestamps: list[float] = field(default_factory=list)  # video: seconds of each temporal patch

    def num_embeddings(self, merge_size: int) -> int:
        t, h, w = self.grid
        return t * h * w // merge_size**2


def smart_resize(num_frames: int, height: int, width: int, temporal_factor: int, factor: int,
                 min_tokens: int, max_tokens: int) -> tuple[int, int]:  # fmt: skip
    """The canvas (height, width), multiples of `factor`, whose pixels over `num_frames` (rounded
    to temporal patches) fit the token budget; the reference's search, step for step."""
    pixels_per_token = temporal_factor * factor**2
    min_pixels, max_pixels = min_tokens * pixels_per_token, max_tokens * pixels_per_token

    def align(value: float) -> int:
        return math.ceil(value / factor) * factor

    frames = max(temporal_factor, round(num_frames / temporal_factor) * temporal_factor)
    h, w = align(height), align(width)
    if frames * h * w < min_pixels:
        scale = math.sqrt(min_pixels / (num_frames * height * width))
        h, w = align(max(1, math.ceil(height * scale))), align(max(1, math.ceil(width * scale)))
    if frames * h * w > max_pixels:
        if max_pixels < frames * factor**2:
            raise ValueError(f"max_image_tokens={max_tokens} is too small for one aligned patch")
        low, high = 1, height
        h, w = factor, factor
        while low <= high:  # the tallest content whose aligned canvas fits
            content = (low + high) // 2
            ch, cw = align(content), align(max(1, math.floor(width * content / height)))
            if frames * ch * cw <= max_pixels:
                h, w = ch, cw
                low = content + 1
            else:
                high = content - 1
    return h, w


def content_size(frames: int, height: int, width: int, canvas: tuple[int, int], temporal_factor: int, factor: int,
                 min_tokens: int) -> tuple[int, int]:  # fmt: skip
    """The size the picture is resized to inside its canvas (the rest is black padding):
    aspect kept, never enlarged unless the picture is below the minimum budget."""
    scale = min(canvas[0] / height, canvas[1] / width)
    if frames * height * width >= temporal_factor * factor**2 * min_tokens:
        scale = min(1.0, scale)
    return max(1, min(canvas[0], math.floor(height * scale))), max(1, min(canvas[1], math.floor(width * scale)))


class MediaProcessor:
    def __init__(self, cfg: ProcessorConfig):
        self.cfg = cfg

    # ---- images ------------------------------------------------------------------------------
    def image(self, image: PIL.Image.Image) -> ProcessedMedia:
        cfg = self.cfg
        pixels = np.moveaxis(np.array(to_rgb(image)), -1, 0)  # [3, H, W] uint8
        height, width = pixels.shape[-2:]
        canvas = smart_resize(cfg.temporal_patch_size, height, width, cfg.temporal_patch_size, cfg.factor,
                              cfg.image.min_image_tokens, cfg.image.max_image_tokens)  # fmt: skip
        size = content_size(cfg.temporal_patch_size, height, width, canvas, cfg.temporal_patch_size, cfg.factor,
                            cfg.image.min_image_tokens)  # fmt: skip
        if size != (height, width):
            resized = PIL.Image.fromarray(np.moveaxis(pixels, 0, -1)).resize(size[::-1], PIL.Image.Resampling.BICUBIC)
            pixels = np.moveaxis(np.array(resized), -1, 0)
        pixels = np.pad(pixels, ((0, 0), (0, canvas[0] - size[0]), (0, canvas[1] - size[1])))
        scaled = (pixels.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
        mean, std = np.array(cfg.image_mean, np.float32), np.array(cfg.image_std, np.float32)
        normalized = ((scaled.T - mean) / std).T
        frame = torch.from_numpy(np.ascontiguousarray(normalized))
        patches, grid = self._patchify(frame.unsqueeze(0).expand(cfg.temporal_patch_size, -1, -1, -1))
        return ProcessedMedia("image", patches, grid, IMAGE_PLACEHOLDER * (grid[0] * grid[1] * grid[2] // cfg.merge_size**2))

    # ---- video -------------------------------------------------------------------------------
    def video(self, video: Video) -> ProcessedMedia:
        cfg = self.cfg
        indices = self.sample_frames(len(video.frames), video.fps)
        frames = torch.from_numpy(np.ascontiguousarray(video.frames[indices])).permute(0, 3, 1, 2)  # [T, 3, H, W] uint8
        num, height, width = frames.shape[0], frames.shape[2], frames.shape[3]
        canvas = smart_resize(num, height, width, cfg.temporal_patch_size, cfg.factor,
                              cfg.video.min_image_tokens, cfg.video.max_image_tokens)  # fmt: skip
        size = content_size(num, height, width, canvas, cfg.temporal_patch_size, cfg.factor, cfg.video.min_image_tokens)
        if size != (height, width):
            frames = F.interpolate(frames, size=list(size), mode="bicubic", align_corners=False, antialias=True)
        frames = F.pad(frames, (0, canvas[1] - size[1], 0, canvas[0] - size[0]))
        # Rescale folded into the normalisation: (x - mean/r) / (std/r), as the reference fuses them.
        mean = torch.tensor(cfg.image_mean) * (1.0 / cfg.rescale_factor)
        std = torch.tensor(cfg.image_std) * (1.0 / cfg.rescale_factor)
        frames = (frames.float() - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)
        if pad := -num % cfg.temporal_patch_size:  # an odd frame out: repeat the last
            frames = torch.cat((frames, frames[-1:].expand(pad, -1, -1, -1)))
        patches, grid = self._patchify(frames)
        stamps = [float(i) / video.fps for i in indices][:: cfg.temporal_patch_size]
        stamps = (stamps + [stamps[-1] if stamps else 0.0] * grid[0])[: grid[0]]
        per_frame = grid[1] * grid[2] // cfg.merge_size**2
        text = "".join(f"<|begin_of_image|>{IMAGE_PLACEHOLDER * per_frame}<|end_of_image|>{t:.1f} seconds" for t in stamps)
        return ProcessedMedia("video", patches, grid, text, stamps)

    def sample_frames(self, total: int, fps: float) -> list[int]:
        """Frame indices kept: `cfg.fps` a second (linearly spaced where the video is short),
        each once, an even count."""
        cfg = self.cfg
        if total < 1 or not fps > 0:
            raise ValueError("a video needs at least one frame and a positive frame rate")
        duration = total / fps  # as the reference's video readers report it
        max_seconds = int(duration)
        if cfg.max_duration > 0:
            duration = min(duration, cfg.max_duration)
        wanted = min(int(duration * cfg.fps), cfg.max_frames)
        if total < wanted:
            picks = np.linspace(0, total - 1, wanted, dtype=int).tolist()
        else:
            picks, second, frame_seconds = [], 0.0, 1 / fps
            for i in range(total):
                if i * frame_seconds >= second:  # as the reference times frames: i / fps can differ in the last bit
                    second += 1 / cfg.fps
                    picks.append(i)
                    if second >= max_seconds:
                        break
        if len(picks) < wanted:
            start, end = (picks[0], picks[-1]) if picks else (0, max(total - 1, 0))
            picks = np.linspace(start, end, wanted, dtype=int).tolist()
        elif len(picks) > wanted:
            picks = np.linspace(0, total - 1, wanted, dtype=int).tolist()
        unique = list(dict.fromkeys(picks))
        if not unique:  # the reference would fail further on: say why here
            raise ValueError(f"the video is {total / fps:.2f} s long, too short to sample at {cfg.fps:g} frames a second")
        if len(unique) % 2:
            unique.append(unique[-1])
        return unique

    # ---- shared ------------------------------------------------------------------------------
    def _patchify(self, frames: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """frames [T, C, H, W] (T a multiple of the temporal patch) -> patches in merge-block
        order, each flattened as (channel, time, row, column)."""
        cfg = self.cfg
        p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
        num, channels, height, width = frames.shape
        gt, gh, gw = num // tp, height // p, width // p
        x = frames.reshape(gt, tp, channels, gh // m, m, p, gw // m, m, p)
        x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # gt, gh/m, gw/m, m, m, C, tp, p, p
        return x.reshape(gt * gh * gw, channels * tp * p * p).contiguous(), (gt, gh, gw)


def to_rgb(image: PIL.Image.Image) -> PIL.Image.Image:
    """RGB, any transparency composited onto white (as the reference does)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return PIL.Image.alpha_composite(PIL.Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


_PLACEHOLDERS = re.compile(re.escape(IMAGE_PLACEHOLDER) + "|" + re.escape(VIDEO_PLACEHOLDER))


def expand_placeholders(text: str, media: list[ProcessedMedia]) -> str:
    """Each `<|image|>` / `<|video|>` of `text`, in order, replaced by the text of the next
    image / video of `media`; ValueError when the counts differ."""
    images = [m for m in media if m.modality == "image"]
    videos = [m for m in media if m.modality == "video"]
    for name, placeholder, items in (("image", IMAGE_PLACEHOLDER, images), ("video", VIDEO_PLACEHOLDER, videos)):
        if (found := text.count(placeholder)) != len(items):
            raise ValueError(f"the prompt has {found} {placeholder} placeholder(s) for {len(items)} {name}(s)")
    queues = {IMAGE_PLACEHOLDER: iter(images), VIDEO_PLACEHOLDER: iter(videos)}
    return _PLACEHOLDERS.sub(lambda match: next(queues[match[0]]).placeholder, text)
