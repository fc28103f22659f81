"""GET /healthz (the process is alive) and GET /readyz (models loaded and warmed up)."""
from typing import Annotated

from fastapi import APIRouter, Depends

from ..schemas import ModelInfo, Problem
from .common import Services, get_services

router = APIRouter(tags=["operations"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """Always 200 while the process serves HTTP (liveness)."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"model": Problem, "description": "loading, warming up or shutting down"}})
async def readyz(services: Annotated[Services, Depends(get_services)]) -> dict[str, str | ModelInfo]:
    """200 once the models are loaded and warmed up (readiness); 503 before that and while shutting down."""
    return {"status": "ready", "model": services.model}
