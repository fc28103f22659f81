"""GET /metrics: Prometheus text format, from this app's own registry."""
from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

router = APIRouter(tags=["operations"])


@router.get("/metrics", response_class=Response, responses={200: {
    "description": "Prometheus text exposition format", "content": {"text/plain": {"schema": {"type": "string"}}}}})
async def metrics(request: Request) -> Response:
    """Request counts and latency per endpoint and status, queue depth and wait, batch sizes, feature-store
    hits/misses/errors, detector and encoder time."""
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
