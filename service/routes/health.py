"""GET /healthz (the process is alive) and GET /readyz (models loaded and warmed up)."""
from typing import Annotated

from fastapi import APIRouter, Depends, Request

from ..errors import ProblemError
from ..schemas import ReadyResponse
from .common import Services, get_services, problems

router = APIRouter(tags=["operations"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """Always 200 while the process serves HTTP (liveness)."""
    return {"status": "ok"}


@router.get("/readyz", responses=problems("not-ready"))
async def readyz(request: Request, services: Annotated[Services, Depends(get_services)]) -> ReadyResponse:
    """200 once the models are loaded and warmed up (readiness), with the task endpoints the model answers; 503
    before that and while shutting down.

    After SIGTERM, 503 already during the drain period, while task requests are still served: load balancers
    stop routing here before the listener closes (service/shutdown.py)."""
    if request.app.state.draining:
        raise ProblemError(503, "the service is shutting down; requests are still served until it stops accepting",
                           "not-ready", headers={"Retry-After": "1"})
    return ReadyResponse(model=services.model, endpoints=services.pipeline.endpoints)
