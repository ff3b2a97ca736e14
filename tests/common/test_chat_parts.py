"""Non-text parts of a chat message (images, audio) in the rendered prompt."""

from __future__ import annotations

from kvroute.common.chat import render_chat


def _chat(url: str, text: str = "what is in this picture?") -> list[dict[str, object]]:
    parts = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]
    return [{"role": "system", "content": "you see images"}, {"role": "user", "content": parts}]


def test_two_images_are_two_prompts_and_one_image_is_one() -> None:
    """The engine caches an image's blocks under the image's hash: a router keying only
    the part's type would predict a hit for every other picture with the same words and
    pile them on one backend."""
    a, b = "data:image/png;base64,AAAA", "data:image/png;base64,BBBB"
    assert render_chat(_chat(a)) != render_chat(_chat(b))
    assert render_chat(_chat(a)) == render_chat(_chat(a))
    # the same part with its keys in another order is the same image
    swapped = _chat(a)
    swapped[1]["content"] = [
        swapped[1]["content"][0],
        {"image_url": {"url": a}, "type": "image_url"},
    ]  # type: ignore[index]
    assert render_chat(swapped) == render_chat(_chat(a))
    # the text before the image is still a shared prefix
    head = render_chat(_chat(a)).split("<image_url")[0]
    assert render_chat(_chat(b)).startswith(head) and head.endswith("what is in this picture?")
