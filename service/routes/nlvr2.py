"""POST /nlvr2: is a statement about a pair of images true?"""
from fastapi import APIRouter, Request

from ..schemas import NLVR2Request, NLVR2Response
from .common import PROBLEMS, ExplainQuery, StrictJSONRoute, TimingsQuery, open_call

router = APIRouter(tags=["tasks"], route_class=StrictJSONRoute)


@router.post("/nlvr2", response_model=NLVR2Response, response_model_exclude_none=True, responses=PROBLEMS)
async def nlvr2(body: NLVR2Request, request: Request, timings: TimingsQuery = False,
                explain: ExplainQuery = False) -> NLVR2Response:
    """True or false, with P(true), for `statement` about `images` [left, right]."""
    call = open_call(request, timings)
    refs = [(image.image, image.image_id) for image in body.images]
    result = await call.pipeline.nlvr2(refs, body.statement, call.timer, explain)
    return call.respond(NLVR2Response, result)
