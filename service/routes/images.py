"""POST /images: register an image (JSON base64 or multipart upload); its regions are computed and cached."""
from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.datastructures import UploadFile

from models.images import ImageError

from .. import schemas
from ..errors import ProblemError
from ..pipeline import located
from ..schemas import ImageInput
from .common import TimingsQuery, open_call, problems

router = APIRouter(tags=["images"])


class ImageTimings(BaseModel):
    """Per-stage wall time in milliseconds (only with ?timings=true): the stages registering an image runs; it
    tokenizes no text and runs no batcher, encoder or query bank, so those stages are not listed."""

    model_config = ConfigDict(from_attributes=True)  # read from the task routes' Timings (routes/common.py)

    decode: float = Field(description="body read, multipart or JSON, base64")
    regions: float = Field(description="feature store, plus image decoding and the detector on a miss")
    cache_hit: bool | None = Field(None, description="the regions came from the feature store")
    total: float


class ImageResponse(schemas.ImageResponse):  # the same answer (and schema name), with the timings of this route
    timings: ImageTimings | None = None


_UPLOAD_SCHEMA = {
    "type": "object",
    "properties": {"file": {"type": "string", "format": "binary", "description": "the image file"}},
    "required": ["file"],
    "additionalProperties": False,
}


async def image_bytes(request: Request) -> bytes:
    """The image of a multipart upload (field `file`) or of a JSON body {"image": base64}."""
    content_type = request.headers.get("content-type", "").lower()
    if content_type.startswith("multipart/form-data"):
        async with request.form(max_files=1, max_fields=4) as form:
            if not form:  # the parser found no complete part: a body cut off before its closing boundary
                raise ProblemError(400, "a broken multipart body: no complete part (is its closing boundary "
                                        "missing?)", "bad-request")
            unknown = sorted(set(form.keys()) - {"file"})
            if unknown:  # refused, as unknown fields of a JSON body are
                raise RequestValidationError([{"loc": ("body", name), "msg": "Extra inputs are not permitted",
                                               "type": "extra_forbidden"} for name in unknown])
            upload = form.get("file")
            if not isinstance(upload, UploadFile):
                raise RequestValidationError([{"loc": ("body", "file"), "msg": "a file field named 'file' is required",
                                               "type": "missing"}])
            return await upload.read()
    body = await request.body()
    if not body:  # as FastAPI answers a task route without a body (JSON that does not parse is a 400)
        raise RequestValidationError([{"loc": ("body",), "msg": "Field required", "type": "missing"}])
    try:
        return ImageInput.model_validate_json(body).image
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None


@router.post(
    "/images", response_model=ImageResponse, response_model_exclude_none=True,
    responses=problems("bad-request", "validation-error", "invalid-image", "queue-full", "not-ready",
                       "store-unavailable"),
    openapi_extra={"requestBody": {"required": True, "content": {
        "application/json": {"schema": ImageInput.model_json_schema(ref_template="#/components/schemas/{model}")},
        "multipart/form-data": {"schema": _UPLOAD_SCHEMA},
    }}},
)
async def register_image(request: Request, timings: TimingsQuery = False,
                         regions: Annotated[bool, Query(description="add the detector's regions (boxes, labels, "
                                                                    "scores)")] = False) -> ImageResponse:
    """Compute (or find in the feature store) the image's regions; answer its `image_id` for later requests."""
    call = open_call(request, timings)
    with call.timer.stage("decode"):
        data = await image_bytes(request)
    try:
        result = await call.pipeline.register(data, call.timer, regions)
    except ImageError as exc:
        multipart = request.headers.get("content-type", "").lower().startswith("multipart/form-data")
        raise located(exc, "file" if multipart else "image") from None
    return call.respond(ImageResponse, result)
