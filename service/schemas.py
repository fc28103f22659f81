"""Request and response bodies of the HTTP API (pydantic v2), with the examples shown at /docs.

Requests are strict about shape (unknown fields are refused, images are strict base64); the limits that
depend on settings (text length, top_k, candidate counts) are checked by the pipeline, which answers 422
in the same problem+json format.
"""
from __future__ import annotations

import base64
import binascii
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, WithJsonSchema, model_validator

IMAGE_ID_PATTERN = r"^[0-9a-f]{64}$"
_DATA_URL = re.compile(r"^data:[\w/+.-]*(;[\w=.-]+)*;base64,", re.IGNORECASE)


def decode_base64(value: Any) -> bytes:
    """Strict base64 (standard or URL-safe alphabet, whitespace and a `data:...;base64,` prefix allowed) -> bytes."""
    if not isinstance(value, str):
        raise ValueError("must be a base64 string")
    text = "".join(_DATA_URL.sub("", value.strip(), count=1).split())
    if not text:
        raise ValueError("is empty")
    if "-" in text or "_" in text:
        text = text.replace("-", "+").replace("_", "/")
    try:
        data = base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("is not valid base64") from None
    if not data:
        raise ValueError("decodes to 0 bytes")
    return data


# Decoded once at validation; documented as a base64 string.
Base64Image = Annotated[
    bytes,
    PlainValidator(decode_base64),
    WithJsonSchema({"type": "string", "contentEncoding": "base64", "contentMediaType": "image/*",
                    "description": "image file bytes (JPEG, PNG, WebP, BMP, GIF or TIFF) in base64"}),
]
ImageId = Annotated[str, Field(pattern=IMAGE_ID_PATTERN, description="sha256 of the image bytes, from POST /images or an earlier response")]
Text = Annotated[str, Field(min_length=1)]
TopK = Annotated[int, Field(ge=1, description="how many results to return (1..max_top_k)")]


class RequestBody(BaseModel):
    """Every request body: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")


class ImageRef(RequestBody):
    """An image given inline (`image`, base64) or by the `image_id` the service returned for it earlier."""

    image: Base64Image | None = None
    image_id: ImageId | None = None

    @model_validator(mode="after")
    def _one_image(self) -> ImageRef:
        if (self.image is None) == (self.image_id is None):
            raise ValueError("give exactly one of image (base64) or image_id")
        return self


class ImageInput(ImageRef):
    """POST /images with a JSON body."""

    image: Base64Image


class VQARequest(ImageRef):
    question: Text
    top_k: TopK = 5

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"image_id": "3f" * 32, "question": "what color is the circle?", "top_k": 3},
    ]})


class ReferRequest(ImageRef):
    expression: Text

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"image_id": "3f" * 32, "expression": "the small red circle on the left"},
    ]})


class RetrieveRequest(RequestBody):
    """Text -> images: `text` + `image_ids`. Image -> texts: `image` or `image_id` + `texts`."""

    text: Text | None = None
    image_ids: list[ImageId] | None = Field(None, min_length=1)
    image: Base64Image | None = None
    image_id: ImageId | None = None
    texts: list[Text] | None = Field(None, min_length=1)
    top_k: TopK = 5
    query_bank: bool = Field(True, description="text -> images: rank by the query-bank normalised score (bank_score) "
                             "where the model has a query bank; false ranks by the raw score")

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"text": "a red circle next to a blue square", "image_ids": ["3f" * 32, "a0" * 32], "top_k": 1},
        {"image_id": "3f" * 32, "texts": ["a red circle", "two green triangles"], "top_k": 2},
    ]})

    @property
    def direction(self) -> Literal["text_to_images", "image_to_texts"]:
        return "text_to_images" if self.text is not None else "image_to_texts"

    @model_validator(mode="after")
    def _one_direction(self) -> RetrieveRequest:
        text_side = self.text is not None or self.image_ids is not None
        image_side = self.image is not None or self.image_id is not None or self.texts is not None
        if text_side == image_side:
            raise ValueError("give either {text, image_ids} (text -> images) or {image | image_id, texts} (image -> texts)")
        if text_side and (self.text is None or self.image_ids is None):
            raise ValueError("text -> images needs both text and image_ids")
        if image_side and (self.texts is None or (self.image is None) == (self.image_id is None)):
            raise ValueError("image -> texts needs texts and exactly one of image or image_id")
        if image_side and "query_bank" in self.model_fields_set:
            raise ValueError("query_bank applies to text -> images only")
        return self


class PairImage(ImageRef):
    """One image of an NLVR2 pair."""


class NLVR2Request(RequestBody):
    images: list[PairImage] = Field(min_length=2, max_length=2, description="[left, right]")
    statement: Text

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"images": [{"image_id": "3f" * 32}, {"image_id": "a0" * 32}], "statement": "the left image has more circles"},
    ]})


# ---- responses -----------------------------------------------------------------------------------------

class ModelInfo(BaseModel):
    """Which model answered."""

    preset: str = Field(examples=["lxmert"])
    size: str = Field(examples=["small"])
    checkpoint: str = Field(description="first 12 hex digits of the weights' sha256", examples=["9c1f0e2d4b7a"])
    detector: str = Field(description="detector fingerprint (the feature-cache namespace)", examples=["5d0c2e11aa9f3b04"])
    runtime: str = Field(examples=["torch"])
    precision: str = Field("fp32", description="the encoder's arithmetic: fp32, bf16, fp16 or int8", examples=["bf16"])


class Timings(BaseModel):
    """Per-stage wall time in milliseconds (only with ?timings=true). Stages run for several images add up."""

    decode: float = 0.0  # base64 / upload handling
    regions: float = 0.0  # feature store lookup, and the detector on a miss
    cache_hit: bool | None = None  # every image's regions came from the feature store
    tokenize: float = 0.0
    queue: float = 0.0  # waiting in the task's batcher
    encoder: float = 0.0  # the batch this request ran in
    query_bank: float = 0.0  # /retrieve text -> images: scoring the bank's captions with images first ranked
    total: float = 0.0


class TaskResponse(BaseModel):
    """Every task answer: which model answered, and timings when asked for."""

    model: ModelInfo
    timings: Timings | None = None


class Answer(BaseModel):
    answer: str
    score: float = Field(description="sigmoid of the answer logit (soft-score VQA head), or the softmax over the answers (head trained with cross-entropy)")


class VQAResponse(TaskResponse):
    image_id: str
    answers: list[Answer] = Field(description="best first")


class Region(BaseModel):
    index: int = Field(description="region index in the detector output")
    box: list[float] = Field(min_length=4, max_length=4, description="x1, y1, x2, y2 in image pixels")
    score: float = Field(description="softmax over the image's real regions")


class ReferResponse(TaskResponse):
    image_id: str
    box: list[float] = Field(min_length=4, max_length=4, description="best region: x1, y1, x2, y2 in image pixels")
    score: float
    region: Region
    runner_up: list[Region] = Field(description="the next best regions, best first")
    image_size: list[int] = Field(description="height, width in pixels")


class ImageHit(BaseModel):
    image_id: str
    score: float = Field(description="logit(match) - logit(no match) of the ranking head (rank) where the model has one, else of the itm head")
    probability: float = Field(description="softmax probability of match")
    bank_score: float | None = Field(None, description=(
        "where the model has a query bank: log of exp(score / T) over itself plus exp(s / T) of the image with "
        "every bank caption (an inverted softmax: an image that matches every caption well ranks lower); the "
        "results are ranked by it unless the request sets query_bank to false"))


class TextHit(BaseModel):
    index: int = Field(description="position in the request's texts")
    text: str
    score: float = Field(description="logit(match) - logit(no match) of the ranking head (rank) where the model has one, else of the itm head")
    probability: float = Field(description="softmax probability of match")


class RetrieveResponse(TaskResponse):
    direction: Literal["text_to_images", "image_to_texts"]
    image_id: str | None = Field(None, description="the query image (image -> texts)")
    results: list[ImageHit] | list[TextHit] = Field(description="best first, at most top_k")


class NLVR2Response(TaskResponse):
    image_ids: list[str] = Field(min_length=2, max_length=2)
    answer: bool
    probability: float = Field(description="P(statement is true)")


class ImageResponse(TaskResponse):
    image_id: str
    num_boxes: int
    image_size: list[int] = Field(description="height, width in pixels")
    cached: bool = Field(description="regions were already in the feature store")


class Problem(BaseModel):
    """RFC 9457 problem details; every 4xx and 5xx answer has this body (application/problem+json)."""

    type: str = Field(examples=["/problems/unknown-image"])
    title: str = Field(examples=["Unknown image"])
    status: int = Field(examples=[404])
    detail: str = Field(examples=["no image with id 3f3f... is known; POST /images first or send the image"])
    instance: str = Field(examples=["/vqa"])
    request_id: str | None = None
    errors: list[dict[str, Any]] | None = Field(None, description="422: one entry per invalid field (loc, msg, type)")
