"""Images and video against HF transformers 5.23.0 (fp32, CPU): the processors, the vision
tower, and the decoder's logits with images and video in the prompt; the engine's encoder
cache and prefix caching with images."""

from __future__ import annotations

import ast
import math
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import PIL.Image
import pytest
import torch
import torch.nn.functional as F
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration
import transformers.models.glm5_next.processing_glm5_next as reference_processing
from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil
from transformers.models.glm5_next.processing_glm5_next import Glm5NextProcessor
from transformers.video_utils import VideoMetadata

from hf_reference import tiny_config
from oxserve import LLM, SamplingParams
from oxserve.default_model import build_checkpoint, make_text_config
from oxserve.model.loader import load_vision_tower
from oxserve.multimodal.inputs import EncoderCache
from oxserve.multimodal.processor import MediaBudget, MediaProcessor, ProcessorConfig, Video
from tiny_models import TINY_SHAPE


def _random_image(rng: np.random.Generator, height: int, width: int, mode: str) -> PIL.Image.Image:
    return PIL.Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).convert(mode)


def test_image_processor_matches_reference():
    rng = np.random.default_rng(random.SystemRandom().randrange(2**31))
    for _ in range(12):
        low = int(rng.integers(4, 40))
        budget = MediaBudget(low, low + int(rng.integers(0, 400)))
        height, width = (int(x) for x in rng.integers(1, 700, 2))
        image = _random_image(rng, height, width, str(rng.choice(["RGB", "RGBA", "L", "P", "LA"])))
        reference = Glm5NextImageProcessorPil()(images=[image], min_image_tokens=budget.min_image_tokens,
                                                max_image_tokens=budget.max_image_tokens, return_tensors="pt")  # fmt: skip
        ours = MediaProcessor(ProcessorConfig(image=budget)).image(image)
        assert ours.grid == tuple(reference["image_grid_thw"][0].tolist()), (height, width, budget)
        assert torch.equal(ours.patches, reference["pixel_values"]), (height, width, budget)


# The reference's video processor imports torchvision at module level, and torchvision's
# wheels here come only with a multi-GB CUDA torch; its torch-free functions are run from
# its source instead (the resize is torchvision's uint8 path: antialiased bicubic interpolate).
VIDEO_SOURCE = Path(reference_processing.__file__).with_name("video_processing_glm5_next.py")


def _reference_functions(*names: str) -> dict:
    source = VIDEO_SOURCE.read_text()
    wanted = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name in names:
            wanted[node.name] = ast.get_source_segment(source, node)
    namespace = {"np": np, "math": math, "torch": torch}
    for text in wanted.values():
        exec(compile("from __future__ import annotations\n" + _dedent(text), str(VIDEO_SOURCE), "exec"), namespace)
    return namespace


def _dedent(text: str) -> str:
    lines = text.splitlines()
    indent = len(lines[1]) - len(lines[1].lstrip()) - 4 if len(lines) > 1 else 0
    return "\n".join([lines[0]] + [line[indent:] for line in lines[1:]])


def test_video_frames_sampled_as_the_reference():
    ref = _reference_functions("sample_frames")
    rng = random.Random(random.SystemRandom().randrange(2**31))
    for _ in range(40):
        total, fps, target = rng.randrange(1, 400), rng.choice([1.0, 7.0, 24.0, 29.97, 60.0]), rng.choice([1, 2, 3.5])
        cfg = ProcessorConfig(fps=target, max_frames=rng.choice([2048, 8]), max_duration=rng.choice([0, 3]))
        owner = SimpleNamespace(fps=cfg.fps, max_frames=cfg.max_frames, max_duration=cfg.max_duration)
        metadata = VideoMetadata(total_num_frames=total, fps=fps, duration=total / fps)
        expected = ref["sample_frames"](owner, metadata).tolist()
        if not expected:  # too short for one frame at this rate: the reference fails later, oxserve says so here
            with pytest.raises(ValueError, match="too short"):
                MediaProcessor(cfg).sample_frames(total, fps)
            continue
        assert MediaProcessor(cfg).sample_frames(total, fps) == expected, (total, fps, cfg)


def test_video_patches_as_the_reference():
    ref = _reference_functions("smart_resize", "patchify")
    rng = np.random.default_rng(random.SystemRandom().randrange(2**31))
    cfg = ProcessorConfig(video=MediaBudget(16, 300))
    for frames, height, width in [(4, 60, 90), (6, 28, 28), (3, 200, 120), (2, 500, 30)]:
        video = Video(rng.integers(0, 256, (frames, height, width, 3), dtype=np.uint8), fps=2.0)
        ours = MediaProcessor(cfg).video(video)
        # The reference's steps on the sampled frames (their sampling is tested above): its
        # smart_resize and padding rule, torchvision's resize, its patchify.
        kept = MediaProcessor(cfg).sample_frames(frames, video.fps)
        x = torch.from_numpy(video.frames[kept]).permute(0, 3, 1, 2)
        frames = len(kept)
        canvas = ref["smart_resize"](frames, height, width, 2, 28, 16, 300)
        scale = min(canvas[0] / height, canvas[1] / width)
        if frames * height * width >= 2 * 28**2 * 16:
            scale = min(1.0, scale)
        size = (max(1, min(canvas[0], math.floor(height * scale))), max(1, min(canvas[1], math.floor(width * scale))))
        if size != (height, width):
            x = F.interpolate(x, size=list(size), mode="bicubic", align_corners=False, antialias=True)
        x = F.pad(x, (0, canvas[1] - size[1], 0, canvas[0] - size[0]))
        mean, std = torch.tensor(cfg.image_mean) * 255, torch.tensor(cfg.image_std) * 255
        x = (x.float() - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)
        patches, t, h, w = ref["patchify"](None, x.unsqueeze(0), 14, 2, 2)
        assert ours.grid == (t, h, w)
        assert torch.equal(ours.patches, patches[0])


def test_placeholder_text_as_the_reference():
    """The prompt text of an image and of a video, from the reference processor's own methods."""
    rng = np.random.default_rng(0)
    media = MediaProcessor(ProcessorConfig())
    image = media.image(_random_image(rng, 90, 130, "RGB"))
    merge = SimpleNamespace(merge_size=2)
    owner = SimpleNamespace(image_processor=merge, video_processor=merge, image_token="<|image|>")
    owner.replace_frame_token_id = lambda t, num_image_tokens: Glm5NextProcessor.replace_frame_token_id(owner, t, num_image_tokens)
    assert image.placeholder == Glm5NextProcessor.replace_image_token(owner, {"image_grid_thw": [torch.tensor(image.grid)]}, 0)
    video = media.video(Video(rng.integers(0, 256, (9, 56, 84, 3), dtype=np.uint8), fps=3.0))
    indices = media.sample_frames(9, 3.0)
    metadata = VideoMetadata(total_num_frames=9, fps=3.0, frames_indices=indices)
    expected = Glm5NextProcessor.replace_video_token(owner, {"video_grid_thw": [torch.tensor(video.grid)],
                                                             "video_metadata": [metadata]}, 0)  # fmt: skip
    assert video.placeholder == expected


VISION_CONFIGS = [
    dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=24, projection_intermediate_size=20, out_hidden_size=32),
    dict(depth=3, hidden_size=32, num_heads=4, intermediate_size=40, projection_intermediate_size=48,
         out_hidden_size=24, hidden_act="gelu", swiglu_limit=0.5, attention_bias=False),
    dict(depth=2, hidden_size=24, num_heads=1, intermediate_size=16, projection_intermediate_size=16,
         out_hidden_size=16, spatial_merge_size=1, patch_size=4, temporal_patch_size=1, rms_norm_eps=1e-3),
]


@pytest.mark.parametrize("vision", VISION_CONFIGS)
def test_vision_tower_matches_reference(vision, tmp_path):
    torch.manual_seed(random.SystemRandom().randrange(2**31))
    config = Glm5NextConfig(text_config=tiny_config(), vision_config=vision)
    hf = Glm5NextForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "visual" in name:
                p.add_(torch.randn_like(p) * (0.1 if p.dim() > 1 else 0.5))
    hf.save_pretrained(tmp_path)
    tower = load_vision_tower(tmp_path)
    m = vision.get("spatial_merge_size", 2)
    grids = [(1, 2 * m, 3 * m), (3, m, 2 * m), (1, m, m)]
    patch_dim = 3 * vision.get("temporal_patch_size", 2) * vision.get("patch_size", 14) ** 2
    patches = torch.randn(sum(t * h * w for t, h, w in grids), patch_dim)
    with torch.no_grad():
        expected = hf.model.visual(patches, grid_thw=torch.tensor(grids)).pooler_output
        ours = tower(patches, grids)
    assert ours.shape == expected.shape
    assert torch.allclose(ours, expected, atol=1e-5 * float(expected.abs().max()), rtol=0)


def _vision_checkpoint(path: Path, layers: int = 4) -> Path:
    """A tiny model whose every discrete choice is stable (dense MLPs; the indexer keeps every
    pool of these short prompts), with random non-trivial weights everywhere, vision included."""
    shape = {**TINY_SHAPE, "num_hidden_layers": layers, "mlp_layer_types": ["dense"] * layers, "index_topk": 64}
    build_checkpoint(path, make_text_config(**shape), seed=1, dtype=torch.float32, vision=dict(depth=2, hidden_size=32, num_heads=4))
    torch.manual_seed(random.SystemRandom().randrange(2**31))
    hf = Glm5NextForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * (0.05 if p.dim() > 1 else 0.3))
    hf.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def vision_model(tmp_path_factory) -> Path:
    return _vision_checkpoint(tmp_path_factory.mktemp("vision-model"))


def _media(seed: int):
    rng = np.random.default_rng(seed)
    images = [_random_image(rng, 50, 70, "RGB"), _random_image(rng, 90, 30, "RGBA")]
    video = Video(rng.integers(0, 256, (5, 40, 60, 3), dtype=np.uint8), fps=2.0)
    return images, video


PROMPT = ("<|begin_of_image|><|image|><|end_of_image|> and <|begin_of_video|><|video|><|end_of_video|> "
          "then <|begin_of_image|><|image|><|end_of_image|> so")  # fmt: skip


@pytest.mark.parametrize("chunk", [2048, 16])
def test_logits_with_images_and_video_match_reference(vision_model, chunk):
    images, video = _media(5)
    llm = LLM(model=str(vision_model), dtype="float32", max_num_batched_tokens=chunk, enable_prefix_caching=False)
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": images, "video": video}}
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, logprobs=1))[0]
    _assert_hf_would_say(vision_model, out, images, video)
    # The pictures matter: the same prompt with the images swapped continues differently.
    swapped = {"prompt": PROMPT, "multi_modal_data": {"image": images[::-1], "video": video}}
    other = llm.generate([swapped], SamplingParams(max_tokens=6, temperature=0, logprobs=1))[0].outputs[0]
    assert other.logprobs[0] != out.outputs[0].logprobs[0]


@pytest.fixture(scope="module")
def two_mla_vision_model(tmp_path_factory) -> Path:
    """8 layers: two MLA layers, one for each Layer Split rank."""
    return _vision_checkpoint(tmp_path_factory.mktemp("vision-two-mla"), layers=8)


@pytest.mark.slow
@pytest.mark.parametrize("tp,ls", [(2, 1), (1, 2)], ids=["tp2", "ls2"])
def test_images_and_video_on_parallel_ranks_match_reference(two_mla_vision_model, tp, ls):
    """Rank 0 encodes and broadcasts; the other ranks' placeholder rows get the same embeddings.
    Two requests with different images in one batch, prefilled in chunks of 16 (a chunk ends
    inside an image), then a third request with a new image."""
    images, video = _media(10)
    third = _random_image(np.random.default_rng(11), 60, 60, "RGB")
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": pair, "video": video}} for pair in (images, images[::-1])]
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=1)
    with LLM(model=str(two_mla_vision_model), dtype="float32", max_num_batched_tokens=16, enable_prefix_caching=False,
             tensor_parallel_size=tp, layer_split_size=ls) as llm:  # fmt: skip
        outs = llm.generate(prompts, params)
        last = llm.generate([{"prompt": "<|begin_of_image|><|image|><|end_of_image|> what", "multi_modal_data": {"image": third}}],
                            params)[0]  # fmt: skip
    for out, prompt in zip(outs, prompts):
        _assert_hf_would_say(two_mla_vision_model, out, prompt["multi_modal_data"]["image"], video)
    _assert_hf_would_say(two_mla_vision_model, last, [third], None)


def _assert_hf_would_say(model: Path, out, images, video) -> None:
    """Each greedy token is HF's argmax, its logprob HF's (fp32), for the prompt with these media."""
    tokens = out.prompt_token_ids + out.outputs[0].token_ids
    media = MediaProcessor(ProcessorConfig())
    pics = [media.image(i) for i in images]
    videos = {}
    if video is not None:
        clip = media.video(video)
        videos = dict(pixel_values_videos=clip.patches, video_grid_thw=torch.tensor([clip.grid]))
    hf = Glm5NextForConditionalGeneration.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([tokens]), pixel_values=torch.cat([p.patches for p in pics]),
                    image_grid_thw=torch.tensor([p.grid for p in pics]), **videos).logits[0]  # fmt: skip
    n = len(out.prompt_token_ids)
    for i, token in enumerate(out.outputs[0].token_ids):
        row = logits[n - 1 + i]
        assert float(row.max() - row[token]) <= 1e-4 * float(row.abs().max()), f"step {i}: not HF's argmax"
        assert abs(out.outputs[0].logprobs[i][token] - float(row.log_softmax(-1)[token])) < 1e-4


def test_prefix_cache_and_encoder_cache_keep_images_apart(vision_model):
    images, _ = _media(6)
    other = _random_image(np.random.default_rng(7), 50, 70, "RGB")  # same size as images[0]: same tokens
    text = "<|begin_of_image|><|image|><|end_of_image|> describe it in detail please"
    params = SamplingParams(max_tokens=5, temperature=0, logprobs=1)
    fresh = LLM(model=str(vision_model), dtype="float32", enable_prefix_caching=False, block_size=16)
    expected = {i: fresh.generate([{"prompt": text, "multi_modal_data": {"image": img}}], params)[0].outputs[0]
                for i, img in enumerate([images[0], other])}  # fmt: skip
    cached = LLM(model=str(vision_model), dtype="float32", block_size=16)
    for i, img in [(0, images[0]), (1, other)] * 3:  # (a prompt's end is checkpointed from its second time on)
        got = cached.generate([{"prompt": text, "multi_modal_data": {"image": img}}], params)[0].outputs[0]
        assert got.token_ids == expected[i].token_ids
        for token, a, b in zip(got.token_ids, got.logprobs, expected[i].logprobs):
            assert abs(a[token] - b[token]) < 1e-4
    stats = cached.engine.stats()
    assert stats.prefix_hits > 0  # the repeats hit the prefix cache, each its own image's
    cache = cached.engine.runner.embedder.cache
    assert len(cache) == 2 and cache.misses == 2  # two images, each encoded once


def test_bad_multimodal_prompts_are_clear_errors(vision_model):
    images, _ = _media(8)
    llm = LLM(model=str(vision_model), dtype="float32", limit_mm_per_prompt='{"image": 1, "video": 0}')
    cases = [
        ({"prompt": "no placeholder", "multi_modal_data": {"image": images[0]}}, "placeholder"),
        ({"prompt": "<|image|> <|image|>", "multi_modal_data": {"image": images[0]}}, "placeholder"),
        ({"prompt": "<|image|> <|image|>", "multi_modal_data": {"image": images}}, "at most 1"),
        ({"prompt": "<|video|>", "multi_modal_data": {"video": Video(np.zeros((2, 28, 28, 3), np.uint8), 1.0)}}, "at most 0"),
        ({"prompt": "<|image|>", "multi_modal_data": {"audio": 1}}, "keys"),
        ({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": images[0]}}, "'prompt'"),
    ]
    for prompt, says in cases:
        with pytest.raises(ValueError, match=says):
            llm.engine.add_request(None, prompt)
    assert not llm.engine.has_unfinished_requests()
    text_only = LLM(model=str(vision_model), dtype="float32", limit_mm_per_prompt='{"image": 0}')
    with pytest.raises(ValueError, match="allows none"):
        text_only.engine.add_request(None, {"prompt": "<|image|>", "multi_modal_data": {"image": images[0]}})
    placed = llm.engine.check_prompt({"prompt": "<|image|>", "multi_modal_data": {"image": images[0]}}).as_prompt()
    with pytest.raises(ValueError, match="allows none"):  # images already placed (a server's handover) too
        text_only.engine.add_request(None, placed)
    assert text_only.engine.runner.embedder is None


def test_encoder_cache_drops_least_recently_used():
    cache = EncoderCache(capacity=10)
    for key, rows in [(b"a", 4), (b"b", 4)]:
        cache.put(key, torch.zeros(rows, 2))
    assert cache.get(b"a") is not None  # a is now the most recent
    cache.put(b"c", torch.zeros(4, 2))
    assert cache.get(b"b") is None and cache.get(b"a") is not None and cache.rows == 8
    cache.put(b"huge", torch.zeros(11, 2))
    assert cache.get(b"huge") is None and len(cache) == 2


def test_images_survive_preemption(vision_model):
    """Requests preempted for room recompute their prompts, images included, and answer as alone."""
    images, video = _media(9)
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": pair, "video": video}} for pair in (images, images[::-1])]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = [LLM(model=str(vision_model), dtype="float32", block_size=16).generate([p], params)[0] for p in prompts]
    n = len(alone[0].prompt_token_ids) + 24
    tight = LLM(model=str(vision_model), dtype="float32", block_size=16, num_blocks=2 * (-(-n // 16)) - 1,
                enable_prefix_caching=False)  # fmt: skip
    together = tight.generate(prompts, params)
    assert tight.engine.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]


def test_parallel_ranks_get_the_positions_of_images_not_their_pixels():
    from oxserve.engine.interface import NewRequestData, SchedulerOutput
    from oxserve.multimodal.inputs import MultiModalItem

    item = MultiModalItem("image", b"h" * 16, torch.randn(16, 8), (1, 4, 4), (3, 4, 5, 6))
    out = SchedulerOutput([NewRequestData("a", [1] * 8, SamplingParams(), mm_items=(item,)), NewRequestData("b", [2], SamplingParams())], [])
    bare = out.without_pixels()
    [sent] = bare.new_requests[0].mm_items
    assert sent.patches.numel() == 0 and (sent.positions, sent.grid, sent.content_hash) == (item.positions, item.grid, item.content_hash)
    assert out.new_requests[0].mm_items[0].patches.shape == (16, 8)  # rank 0's own step keeps them
    text_only = SchedulerOutput([NewRequestData("b", [2], SamplingParams())], [])
    assert text_only.without_pixels() is text_only


@pytest.mark.slow
def test_an_image_that_breaks_the_tower_fails_alone_on_parallel_ranks(two_mla_vision_model):
    """Rank 0 encodes a step's images before the other ranks start the step: a failure there
    fails its request, as in one process, and the ranks go on serving."""
    images, video = _media(12)
    bad = _random_image(np.random.default_rng(13), 84, 84, "RGB")  # a size no other image here has
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with LLM(model=str(two_mla_vision_model), dtype="float32", tensor_parallel_size=2) as llm:
        tower = llm.engine.runner.embedder.tower
        bad_rows = llm.engine.media.image(bad).patches.shape[0]
        original = tower.forward

        def breaks_on_the_bad_image(patches, grids):
            if any(g == tuple(llm.engine.media.image(bad).grid) for g in grids) and patches.shape[0] >= bad_rows:
                raise RuntimeError("planted: the vision tower fails on this image")
            return original(patches, grids)

        tower.forward = breaks_on_the_bad_image
        prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": images, "video": video}},
                   {"prompt": "<|begin_of_image|><|image|><|end_of_image|> what", "multi_modal_data": {"image": bad}}]
        outs = llm.generate(prompts, params)
        assert [o.outputs[0].finish_reason for o in outs] == ["length", "error"]
        again = llm.generate([prompts[0]], params)[0].outputs[0]  # the ranks still serve
        assert again.token_ids == outs[0].outputs[0].token_ids
