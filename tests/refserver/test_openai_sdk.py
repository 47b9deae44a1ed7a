"""The official `openai` Python SDK, unchanged, drives the reference server (vLLM-Omni 0.30 shape) through
chat completions with flat `extra_body` parameters, images.generate and images.edit with several images."""

from __future__ import annotations

import base64
import io

import pytest
from refserver_helpers import STEPS, Server, chat_body, chat_pngs, decode, make_ref, png_uri

openai = pytest.importorskip("openai")  # the dev extra installs it

REFS = [make_ref(i) for i in range(3)]


def png_file(i: int) -> tuple[str, bytes, str]:
    buf = io.BytesIO()
    REFS[i].save(buf, format="PNG")
    return (f"ref-{i + 1}.png", buf.getvalue(), "image/png")


@pytest.fixture(scope="module")
def client(device_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=device_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


# The SDK types a message's content as a string; vLLM-Omni answers with a list of parts, which model_dump() warns
# about and still returns (read below): the shape is the server's contract, the warning is the SDK's typing.
@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings:UserWarning")
def test_chat_completions_flat_extra_body(client: openai.OpenAI, device_server: Server) -> None:
    params = {"num_inference_steps": STEPS, "height": 128, "width": 96, "true_cfg_scale": 4.0,
              "negative_prompt": " ", "return_stage_metrics": True}
    content = [{"type": "text", "text": "put the shapes together"},
               *({"type": "image_url", "image_url": {"url": png_uri(r)}} for r in REFS[:2])]
    # the SDK merges extra_body into the top level of the JSON body: the flat form 0.30 reads
    resp = client.chat.completions.create(model="refserver", messages=[{"role": "user", "content": content}],
                                          seed=2301, extra_body=params)
    parts = resp.model_dump()["choices"][0]["message"]["content"]
    assert isinstance(parts, list) and (resp.model_extra or {})["metrics"]["peak_memory_mb"] > 0
    png = base64.b64decode(parts[0]["image_url"]["url"].split(",", 1)[1])
    assert decode(png).size == (96, 128)  # the flat height/width were honoured
    # ... and the same parameters nested under a literal extra_body key give the same image
    (nested,) = chat_pngs(device_server.chat(chat_body(prompt="put the shapes together", refs=REFS[:2],
                                                       seed=2301, height=128, width=96, true_cfg_scale=4.0)))
    assert nested == png
    # the literal-key form through the SDK (what the Dec-2025 snapshot needed) still works
    again = client.chat.completions.create(model="refserver", messages=[{"role": "user", "content": content}],
                                           extra_body={"extra_body": {**params, "seed": 2301}})
    url = again.model_dump()["choices"][0]["message"]["content"][0]["image_url"]["url"]
    assert base64.b64decode(url.split(",", 1)[1]) == png
    with pytest.raises(openai.BadRequestError, match="provided more than once"):
        client.chat.completions.create(model="refserver", messages=[{"role": "user", "content": content}],
                                       seed=1, extra_body={"extra_body": {"seed": 2}})


def test_images_generate(client: openai.OpenAI) -> None:
    out = client.images.generate(model="refserver", prompt="a lighthouse", size="64x96", n=2,
                                 response_format="b64_json",
                                 extra_body={"num_inference_steps": STEPS, "seed": 7, "negative_prompt": " ",
                                             "return_stage_metrics": True})
    assert len(out.data) == 2
    assert all(decode(base64.b64decode(d.b64_json)).size == (64, 96) for d in out.data)
    assert (out.model_extra or {})["metrics"]["peak_memory_mb"] > 0
    with pytest.raises(openai.BadRequestError, match="Model mismatch"):
        client.images.generate(model="someone-else", prompt="x", extra_body={"num_inference_steps": 1})


def test_images_edit_several_images(client: openai.OpenAI) -> None:
    def edit(images: list[tuple[str, bytes, str]], seed: int = 5) -> bytes:
        out = client.images.edit(model="refserver", prompt="combine them", image=images, size="128x128",
                                 extra_body={"num_inference_steps": STEPS, "seed": seed, "true_cfg_scale": 4.0,
                                             "negative_prompt": " ", "return_stage_metrics": True})
        assert (out.model_extra or {})["metrics"]["peak_memory_mb"] > 0
        return base64.b64decode(out.data[0].b64_json)

    three = edit([png_file(0), png_file(1), png_file(2)])
    assert decode(three).size == (128, 128)
    assert edit([png_file(0), png_file(1), png_file(2)]) == three  # deterministic: the seed reached the server
    assert edit([png_file(2), png_file(1), png_file(0)]) != three  # order and count of images reached it
    assert edit([png_file(0), png_file(1)]) != three
    assert edit([png_file(0), png_file(1), png_file(2)], seed=6) != three
    with pytest.raises(openai.BadRequestError, match="Failed to open uploaded file"):
        edit([png_file(0), ("bad.png", b"not an image", "image/png")])
