"""POST /vqa: answer a question about an image."""
from fastapi import APIRouter

from ..schemas import VQARequest, VQAResponse
from .common import PROBLEMS, CallDep

router = APIRouter(tags=["tasks"])


@router.post("/vqa", response_model=VQAResponse, response_model_exclude_none=True, responses=PROBLEMS)
async def vqa(body: VQARequest, call: CallDep) -> VQAResponse:
    """Ranked answers (sigmoid scores of the soft-score VQA head) for `question` about the image."""
    result = await call.pipeline.vqa(body.image, body.image_id, body.question, body.top_k, call.timer)
    return call.respond(VQAResponse, result)
