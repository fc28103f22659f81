"""POST /refer: the region a referring expression describes."""
from fastapi import APIRouter, Request

from ..schemas import ReferRequest, ReferResponse
from .common import PROBLEMS, ExplainQuery, StrictJSONRoute, TimingsQuery, open_call

router = APIRouter(tags=["tasks"], route_class=StrictJSONRoute)


@router.post("/refer", response_model=ReferResponse, response_model_exclude_none=True, responses=PROBLEMS)
async def refer(body: ReferRequest, request: Request, timings: TimingsQuery = False,
                explain: ExplainQuery = False) -> ReferResponse:
    """The best region's box (pixels, x1 y1 x2 y2) with its softmax score over the image's regions, and the runners-up."""
    call = open_call(request, timings)
    result = await call.pipeline.refer(body.image, body.image_id, body.expression, call.timer, explain)
    return call.respond(ReferResponse, result)
