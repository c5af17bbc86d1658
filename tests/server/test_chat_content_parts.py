"""A chat message's content parts as the server takes them: text parts joined into one
string; any other part a 400 naming the part, an image's saying the vision tower is not served
(ember serves a multimodal checkpoint's text model only)."""

from __future__ import annotations

import pytest

from ember.server.errors import BadRequestError
from ember.server.prompts import _message_dict
from ember.server.protocol import ChatMessage

IMAGE_URL = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


def test_text_parts_are_joined():
    parts = [{"type": "text", "text": "Say"}, {"type": "text", "text": "hello."}]
    message = _message_dict(ChatMessage(role="user", content=parts), 0)
    assert message == {"role": "user", "content": "Say\nhello."}


@pytest.mark.parametrize(
    "part", [IMAGE_URL, {"type": "input_image", "image_url": "https://example.com/cat.png"}]
)
def test_an_image_is_refused_saying_the_vision_tower_is_not_served(part):
    content = [{"type": "text", "text": "What is in this picture?"}, part]
    with pytest.raises(BadRequestError) as refused:
        _message_dict(ChatMessage(role="user", content=content), 2)
    error = refused.value
    assert error.status_code == 400 and error.param == "messages.2.content"
    assert error.message.startswith("messages[2].content[1]: image inputs are not supported")
    assert "vision tower" in error.message


@pytest.mark.parametrize(
    "part", [{"type": "input_audio", "input_audio": {}}, {"type": "text"}, {"type": ["text"]}]
)
def test_other_parts_are_refused_by_type(part):
    with pytest.raises(BadRequestError, match=r"content\[0\]: only text parts are supported"):
        _message_dict(ChatMessage(role="user", content=[part]), 0)
