"""POST /vqa: answer a question about an image."""
from fastapi import APIRouter, Request

from ..schemas import VQARequest, VQAResponse
from .common import PROBLEMS, ExplainQuery, StrictJSONRoute, TimingsQuery, open_call

router = APIRouter(tags=["tasks"], route_class=StrictJSONRoute)


@router.post("/vqa", response_model=VQAResponse, response_model_exclude_none=True, responses=PROBLEMS)
async def vqa(body: VQARequest, request: Request, timings: TimingsQuery = False,
              explain: ExplainQuery = False) -> VQAResponse:
    """Ranked answers (sigmoid scores of the soft-score VQA head) for `question` about the image."""
    call = open_call(request, timings)
    result = await call.pipeline.vqa(body.image, body.image_id, body.question, body.top_k, call.timer, explain)
    return call.respond(VQAResponse, result)
