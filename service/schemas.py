"""Request and response bodies of the HTTP API (pydantic v2), with the examples shown at /docs.

Requests are strict about shape (unknown fields, nulls and type coercion are refused, images are strict
base64); the limits that depend on settings (text length, top_k, candidate counts) are checked by the
pipeline, which answers 422 in the same problem+json format. The JSON schema of every request states
each of these rules: `x-setting` names the setting that bounds a field (the app's OpenAPI schema turns it
into maxLength / maximum / maxItems), and `json_schema_rules` state which fields go together.
"""
from __future__ import annotations

import base64
import binascii
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator, WithJsonSchema, model_validator
from pydantic_core import PydanticCustomError

from .errors import MAX_LISTED_ERRORS, shown
from .settings import MAX_CANDIDATES

IMAGE_ID_PATTERN = r"^[0-9a-f]{64}$"
_WS = " \t\r\n"  # the whitespace base64 may carry (line-wrapped MIME base64); other characters are refused
_DATA_URL = re.compile(r"^data:[\w/+.-]*(;[\w=.-]+)*;base64,", re.IGNORECASE | re.ASCII)
# What decode_base64 accepts, as a JSON-schema pattern (tests check the two agree on every short string): optional
# whitespace and data-URL prefix, then base64 digits of either alphabet in whole quads, the last one possibly
# short (2 or 3 digits, with or without its padding), whitespace allowed anywhere after the prefix.
_W, _D = r"[ \t\r\n]*", "[A-Za-z0-9+/_-]"
BASE64_PATTERN = (
    f"^{_W}(?:[Dd][Aa][Tt][Aa]:[A-Za-z0-9_/+.-]*(?:;[A-Za-z0-9_=.-]+)*;[Bb][Aa][Ss][Ee]64,)?{_W}"
    f"(?:(?:{_D}{_W}){{4}})*(?:(?:{_D}{_W}){{4}}|(?:{_D}{_W}){{2}}(?:={_W}){{0,2}}|(?:{_D}{_W}){{3}}(?:={_W})?)$"
)
_NO_WS = str.maketrans("", "", _WS)


def decode_base64(value: Any) -> bytes:
    """Strict base64 (standard or URL-safe alphabet, line breaks and a `data:...;base64,` prefix allowed) -> bytes."""
    if not isinstance(value, str):
        raise ValueError("must be a base64 string")
    text = _DATA_URL.sub("", value.strip(_WS), count=1).translate(_NO_WS)
    if not text:
        raise ValueError("is empty")
    if "-" in text or "_" in text:
        text = text.replace("-", "+").replace("_", "/")
    digits = text.rstrip("=")
    # whole quads, the last one possibly of 2 or 3 digits, with at most the padding it lacks
    if not digits or len(digits) % 4 == 1 or len(text) - len(digits) > -len(digits) % 4:
        raise ValueError("is not valid base64")
    try:
        return base64.b64decode(digits + "=" * (-len(digits) % 4), validate=True)
    except (binascii.Error, ValueError):  # a character outside both alphabets
        raise ValueError("is not valid base64") from None


# Decoded once at validation; documented as a base64 string. The pattern refuses the empty string (it needs two
# digits at least); a minLength beside it would only restate that, and made schemathesis' coverage phase search
# for a matching string of that exact length for over a minute.
Base64Image = Annotated[
    bytes,
    PlainValidator(decode_base64),
    WithJsonSchema({"type": "string", "pattern": BASE64_PATTERN, "contentEncoding": "base64",
                    "contentMediaType": "image/*",
                    "description": "image file bytes (JPEG, PNG, WebP, BMP, GIF or TIFF) in base64"}),
]
# The lengths restate the pattern for validators whose `$` also matches before a final newline (Python's re).
ImageId = Annotated[str, Field(pattern=IMAGE_ID_PATTERN, min_length=64, max_length=64,
                               description="sha256 of the image bytes, from POST /images or an earlier response")]
# Not only whitespace (the pipeline's check; `pattern` here only documents it, so the pipeline's message stands),
# at most max_text_chars characters. Texts the tokenizer reads no word of are refused too, which no schema can state.
Text = Annotated[str, Field(min_length=1, json_schema_extra={"pattern": r"\S", "x-setting": "max_text_chars"})]
# JSON has one number type: 8.0 is the integer 8 to a JSON schema, so it is to the service (strict mode refuses floats).
TopK = Annotated[int, Field(ge=1, description="how many results to return (1..max_top_k)",
                            json_schema_extra={"x-setting": "max_top_k"}),
                 BeforeValidator(lambda v: int(v) if isinstance(v, float) and v.is_integer() else v)]


class RequestBody(BaseModel):
    """Every request body: unknown fields are refused, and so are values of another JSON type ("5" for 5, 1 for
    true) and nulls, as the JSON schema states. A field declared `= Field(None)` may be left out (None: not
    given) but not sent as null; its schema shows no null default."""

    model_config = ConfigDict(extra="forbid", strict=True)
    # Rules across fields, in JSON-schema terms, added to the model's schema (the model validators enforce them).
    json_schema_rules: ClassVar[dict[str, Any]] = {}

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema, handler):
        schema = handler.resolve_ref_schema(handler(core_schema))
        for prop in schema.get("properties", {}).values():
            if "default" in prop and prop["default"] is None:
                del prop["default"]
        schema.update(cls.json_schema_rules)
        return schema

    @model_validator(mode="before")
    @classmethod
    def _many_unknown_fields(cls, data: Any) -> Any:
        """More unknown fields than a 422 lists are one error naming a few, not one error each: a body of a million
        made-up keys would be a million errors to build and answer."""
        if isinstance(data, dict) and len(data) > MAX_LISTED_ERRORS:
            unknown = [name for name in data if name not in cls.model_fields]
            if len(unknown) > MAX_LISTED_ERRORS:
                raise PydanticCustomError(
                    "extra_forbidden", "{count} unknown fields ({named}, ...); the fields are {fields}",
                    {"count": len(unknown), "named": ", ".join(repr(shown(str(name))) for name in unknown[:3]),
                     "fields": ", ".join(cls.model_fields)})
        return data


class ImageRef(RequestBody):
    """An image given inline (`image`, base64) or by the `image_id` the service returned for it earlier."""

    image: Base64Image = Field(None)
    image_id: ImageId = Field(None)

    json_schema_rules = {"oneOf": [{"required": ["image"]}, {"required": ["image_id"]}]}  # exactly one

    @model_validator(mode="after")
    def _one_image(self) -> ImageRef:
        if (self.image is None) == (self.image_id is None):
            raise ValueError("give exactly one of image (base64) or image_id")
        return self


class ImageInput(RequestBody):
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

    text: Text = Field(None)
    image_ids: list[ImageId] = Field(None, min_length=1, max_length=MAX_CANDIDATES, json_schema_extra={"x-setting": "max_candidates"})
    image: Base64Image = Field(None)
    image_id: ImageId = Field(None)
    texts: list[Text] = Field(None, min_length=1, max_length=MAX_CANDIDATES, json_schema_extra={"x-setting": "max_candidates"})
    top_k: TopK = 5
    query_bank: bool = Field(True, description="text -> images: rank by the query-bank normalised score (bank_score) "
                             "where the model has a query bank; false ranks by the raw score")

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"text": "a red circle next to a blue square", "image_ids": ["3f" * 32, "a0" * 32], "top_k": 1},
        {"image_id": "3f" * 32, "texts": ["a red circle", "two green triangles"], "top_k": 2},
    ]})

    # text -> images, image -> texts with an inline image, image -> texts with an image_id; `false`: not allowed
    json_schema_rules = {"oneOf": [
        {"required": ["text", "image_ids"], "properties": {"image": False, "image_id": False, "texts": False}},
        {"required": ["texts", "image"],
         "properties": {"text": False, "image_ids": False, "image_id": False, "query_bank": False}},
        {"required": ["texts", "image_id"],
         "properties": {"text": False, "image_ids": False, "image": False, "query_bank": False}},
    ]}

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


class ReadyResponse(BaseModel):
    """GET /readyz once the service is ready: the model loaded, and the task endpoints its heads answer."""

    status: Literal["ready"] = "ready"
    model: ModelInfo
    endpoints: list[str] = Field(description=(
        "the task endpoints this model answers, in the order /vqa, /refer, /retrieve, /nlvr2; the others answer "
        "404 `/problems/no-head` (the checkpoint has no head of their kind)"), examples=[["/vqa", "/retrieve"]])


class Timings(BaseModel):
    """Per-stage wall time in milliseconds (only with ?timings=true). `regions` covers all of a request's images at
    once (looked up and detected together)."""

    decode: float = 0.0  # base64 / upload handling
    regions: float = 0.0  # feature store lookup, and the detector on a miss
    cache_hit: bool | None = None  # every image's regions came from the feature store
    tokenize: float = 0.0
    queue: float = 0.0  # waiting in the task's batcher
    encoder: float = 0.0  # the batch this request ran in
    query_bank: float | None = None  # /retrieve text -> images, where it scored the bank for images first ranked
    total: float = 0.0


class TaskResponse(BaseModel):
    """Every task answer: which model answered, and timings when asked for."""

    model: ModelInfo
    timings: Timings | None = None


class HeadAttention(BaseModel):
    layer: int = Field(ge=1, description="layer (from 1) of the explanation's layer_kind")
    head: int = Field(ge=1, description="attention head (from 1) in that layer")
    weights: list[list[float]] = Field(description=(
        "tokens x regions: the attention of each text token (rows, as `tokens`) on each region (columns, as "
        "`regions`), in [0, 1], rounded to 3 decimals. Single-stream presets share a token's attention between "
        "text and regions, so a row sums to its share on the regions; two-stream presets' cross-attention rows sum "
        "to 1 over the regions"))


class Explanation(BaseModel):
    """Where the model looked (only with ?explain=true): the attention of the text's tokens over one image's regions
    at every layer where text meets regions (single-stream: every layer; two-stream: the cross-modality layers).
    Bounded: at most 48 heads, each tokens (<= max_text_tokens) x regions (the detector's boxes)."""

    text: str = Field(description="the text explained")
    image_id: str
    tokens: list[str] = Field(description="the word pieces of the text as the model read it, specials included")
    regions: list[int] = Field(description="region index (detector output) of each weights column")
    boxes: list[list[float]] = Field(description="x1, y1, x2, y2 in image pixels of each region, as `regions`")
    image_size: list[int] = Field(description="height, width in pixels")
    layer_kind: str = Field(examples=["layer", "cross-modality layer"])
    layers: int
    heads_per_layer: int
    ranked_by: Literal["grounding", "layer"] = Field(description=(
        "grounding: heads best first by the checkpoint's grounding analysis (entity-grounding accuracy); layer: "
        "in layer, head order (the checkpoint carries no analysis)"))
    attention: list[HeadAttention] = Field(description="at most 48 heads, in the order ranked_by says")


class Answer(BaseModel):
    answer: str
    score: float = Field(description="sigmoid of the answer logit (soft-score VQA head), or the softmax over the answers (head trained with cross-entropy)")


class VQAResponse(TaskResponse):
    image_id: str
    answers: list[Answer] = Field(description="best first")
    explain: list[Explanation] | None = Field(None, description="?explain=true: the question over the image")


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
    explain: list[Explanation] | None = Field(None, description="?explain=true: the expression over the image")


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
    explain: list[Explanation] | None = Field(None, description=(
        "?explain=true: the text over the best image (text -> images), or the best text over the image (image -> texts)"))


class NLVR2Response(TaskResponse):
    image_ids: list[str] = Field(min_length=2, max_length=2)
    answer: bool
    probability: float = Field(description="P(statement is true)")
    explain: list[Explanation] | None = Field(None, description=(
        "?explain=true: the statement over the left image, then over the right one"))


class DetectedRegion(BaseModel):
    index: int = Field(description="region index in the detector output (as /refer and explain number them)")
    box: list[float] = Field(min_length=4, max_length=4, description="x1, y1, x2, y2 in image pixels")
    label: str = Field(description="the detector's object class")
    score: float = Field(description="the detector's confidence in the class")
    attribute: str = Field(description="the detector's most likely attribute")
    attribute_score: float


class ImageResponse(TaskResponse):
    image_id: str
    num_boxes: int
    image_size: list[int] = Field(description="height, width in pixels")
    cached: bool = Field(description="regions were already in the feature store")
    regions: list[DetectedRegion] | None = Field(None, description="?regions=true: every region the detector found")


class Problem(BaseModel):
    """RFC 9457 problem details; every 4xx and 5xx answer has this body (application/problem+json)."""

    type: str = Field(examples=["/problems/unknown-image"])
    title: str = Field(examples=["Unknown image"])
    status: int = Field(examples=[404])
    detail: str = Field(examples=["no image with id 3f3f... is known; POST /images first or send the image"])
    instance: str = Field(examples=["/vqa"])
    request_id: str | None = None
    errors: list[dict[str, Any]] | None = Field(None, description=(
        "422: one entry per invalid field (loc, msg, type); an entry of type `limit` (a count or length over a "
        "setting: max_top_k, max_candidates, max_text_chars, max_text_tokens) gives the setting's value in ctx.limit"))
    image_ids: list[str] | None = Field(None, description=(
        "404 unknown-image: every well-formed image_id of the request that the feature store does not hold, in "
        "request order (what to register again)"))
