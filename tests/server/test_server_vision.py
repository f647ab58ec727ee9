"""Images and video through the OpenAI chat API, with the official client, on a real server:
data: URLs and allowed local files reach the vision tower; bad parts are 400s that name the
part; the server keeps serving."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import openai
import PIL.Image
import pytest
import torch

from oxserve.default_model import build_checkpoint
from server_harness import TINY, serve
from vision_media import mp4_bytes, png_bytes


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory):
    model = build_checkpoint(tmp_path_factory.mktemp("vision-model"), TINY, seed=3, dtype=torch.float32)
    media = tmp_path_factory.mktemp("media")
    (media / "cat.png").write_bytes(png_bytes(np.random.default_rng(1), 40, 56))
    with serve(model, "--max-model-len", "512", "--allowed-local-media-path", str(media), '--limit-mm-per-prompt',
               '{"image": 2, "video": 1}', "--served-model-name", MODEL, log_dir=tmp_path_factory.mktemp("logs")) as server:  # fmt: skip
        yield server, media


MODEL = "vision"


def _data_url(kind: str, data: bytes) -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def _ask(client: openai.OpenAI, *parts: dict, **kwargs):
    content = [{"type": "text", "text": "What is this?"}, *parts]
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          max_tokens=6, temperature=0, **kwargs)  # fmt: skip


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_images_and_video_reach_the_model(vision_server):
    server, media = vision_server
    client = server.client()
    rng = np.random.default_rng(0)
    png_a, png_b = png_bytes(rng, 64, 48), png_bytes(rng, 64, 48)
    a = _ask(client, _image(_data_url("image/png", png_a)))
    b = _ask(client, _image(_data_url("image/png", png_b)))
    assert a.choices[0].finish_reason == "length" and b.choices[0].finish_reason == "length"
    # The image's placeholder tokens count as prompt tokens: at least the minimum budget (16), and its two brackets.
    text_only = client.chat.completions.create(model=MODEL, max_tokens=1, temperature=0,
                                               messages=[{"role": "user", "content": "What is this?"}])  # fmt: skip
    assert a.usage.prompt_tokens >= text_only.usage.prompt_tokens + 16 + 2
    # Same image again: the same answer (from the encoder cache and the prefix cache).
    again = _ask(client, _image(_data_url("image/png", png_a)))
    assert again.choices[0].message.content == a.choices[0].message.content
    local = _ask(client, _image(f"file://{media / 'cat.png'}"))
    assert local.usage.prompt_tokens > text_only.usage.prompt_tokens
    video = _ask(client, {"type": "video_url", "video_url": {"url": _data_url("video/mp4", mp4_bytes(rng, 8, 4.0, 56, 56))}})
    assert video.usage.prompt_tokens > text_only.usage.prompt_tokens
    streamed = "".join(c.choices[0].delta.content or "" for c in _ask(client, _image(_data_url("image/png", png_a)), stream=True))
    assert streamed == a.choices[0].message.content
    # a, b, the local file and the video encoded once each; a's first repeat from the encoder
    # cache (its second may start past the image, from a prefix checkpoint, and need neither).
    metrics = server.metrics()
    assert metrics["oxserve:mm_items_encoded_total"] == 4 and metrics["oxserve:mm_items_cached_total"] >= 1


@pytest.mark.parametrize(
    "part,where,says",
    [
        (_image("data:image/png;base64,bm90IGFuIGltYWdl"), "messages[0].content[1]", "cannot decode the image"),
        (_image("data:image/png;base64,%%%"), "messages[0].content[1]", "not valid base64"),
        (_image("https://example.com/cat.png"), "messages[0].content[1]", "remote URLs"),
        (_image("file:///etc/passwd"), "messages[0].content[1]", "outside the allowed"),
        ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}, "messages[0].content[1]", "cannot decode the video"),
        ({"type": "image_url", "image_url": "data:x"}, "messages", "needs"),
        ({"type": "audio_url", "audio_url": {"url": "data:x"}}, "messages", "not supported"),
    ],
)
def test_bad_parts_are_400s_naming_the_part(vision_server, part, where, says):
    server, _ = vision_server
    client = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        _ask(client, part)
    assert e.value.body["param"] == where and says in e.value.body["message"], e.value.body
    assert _ask(client).choices[0].finish_reason == "length"  # still serving


def test_limits_and_placeholders(vision_server):
    server, _ = vision_server
    client = server.client()
    png = _data_url("image/png", png_bytes(np.random.default_rng(2), 30, 30))
    with pytest.raises(openai.BadRequestError) as e:
        _ask(client, _image(png), _image(png), _image(png))
    assert "at most 2" in e.value.body["message"]
    # A user typing the placeholder itself does not get an image slot without an image.
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "<|image|>"}, _image(png)]}])  # fmt: skip
    assert "placeholder" in e.value.body["message"]
    tokenize = httpx.post(f"{server.base_url}/tokenize", json={"messages": [{"role": "user", "content": [_image(png)]}]})
    assert tokenize.status_code == 400 and tokenize.json()["error"]["param"] == "messages[0].content[0]"


def test_a_decoded_image_is_what_pillow_decodes():
    data = png_bytes(np.random.default_rng(4), 17, 23)
    from oxserve.multimodal.media import decode_image

    assert np.array_equal(np.array(decode_image(data)), np.array(PIL.Image.open(io.BytesIO(data))))
