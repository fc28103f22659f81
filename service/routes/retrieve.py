"""POST /retrieve: rank known images for a text, or candidate texts for an image (image-text matching head)."""
from fastapi import APIRouter, Request

from ..schemas import RetrieveRequest, RetrieveResponse
from .common import PROBLEMS, ExplainQuery, StrictJSONRoute, TimingsQuery, open_call

router = APIRouter(tags=["tasks"], route_class=StrictJSONRoute)


@router.post("/retrieve", response_model=RetrieveResponse, response_model_exclude_none=True, responses=PROBLEMS)
async def retrieve(body: RetrieveRequest, request: Request, timings: TimingsQuery = False,
                   explain: ExplainQuery = False) -> RetrieveResponse:
    """`{text, image_ids}` ranks images the service knows; `{image | image_id, texts}` ranks captions. Best first."""
    call = open_call(request, timings)
    if body.direction == "text_to_images":
        result = await call.pipeline.text_to_images(body.text, body.image_ids, body.top_k, call.timer, body.query_bank, explain)
    else:
        result = await call.pipeline.image_to_texts(body.image, body.image_id, body.texts, body.top_k, call.timer, explain)
    return call.respond(RetrieveResponse, result)
