"""vLLM's classification API (``POST /classify``, also under ``/v1``) for sequence-
classification models (``*ForSequenceClassification``: classifiers, reward models).

``input`` takes the forms of ``/v1/embeddings`` (a text, texts, token ids, lists of them), or
``messages`` a conversation rendered with the chat template (vLLM's chat form); every
input's ids go to one decode worker in one ``Embed`` call, which returns the model's head on the
final hidden state at the input's last token as probabilities over its labels (softmax; sigmoid
with one label), or its logits with ``activation: false``. Each result names its most probable
label (the model's ``id2label``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from baton_gateway.embeddings import PoolingOptions
from baton_gateway.protocol import (
    ChatPrompt,
    OpenAIBaseModel,
    PromptInput,
    UsageInfo,
    check_prompt,
)

if TYPE_CHECKING:
    from baton_gateway.codec import Embedded


class _ClassificationOptions(PoolingOptions):
    activation: bool | None = None  # probabilities (None: yes), else the head's logits
    user: str | None = None


class ClassificationRequest(_ClassificationOptions):
    input: PromptInput
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _check_input(self) -> ClassificationRequest:
        check_prompt(self.input)
        return self


class ClassificationChatRequest(_ClassificationOptions, ChatPrompt):
    add_generation_prompt: bool = False  # (as for embeddings: the conversation as it is)


def classification_request(body: Any) -> ClassificationRequest | ClassificationChatRequest:
    """A ``/classify`` body: a conversation when it has ``messages``, else inputs (as vLLM).
    Raises pydantic's ValidationError."""
    if isinstance(body, dict) and "messages" in body:
        return ClassificationChatRequest.model_validate(body)
    return ClassificationRequest.model_validate(body)


class ClassificationData(OpenAIBaseModel):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassificationResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassificationData]
    usage: UsageInfo


def response(
    req_id: str, model: str, labels: Sequence[str], classified: Sequence[Embedded]
) -> ClassificationResponse:
    """The response to a request whose inputs were classified as ``classified`` (in order):
    each input's label is its most probable class's (the first of equals)."""
    num_prompt_tokens = sum(c.num_prompt_tokens for c in classified)
    return ClassificationResponse(
        id=req_id,
        model=model,
        data=[
            ClassificationData(
                index=i,
                label=labels[max(range(len(c.values)), key=c.values.__getitem__)],
                probs=c.values,
                num_classes=len(c.values),
            )
            for i, c in enumerate(classified)
        ],
        usage=UsageInfo(prompt_tokens=num_prompt_tokens, total_tokens=num_prompt_tokens),
    )
