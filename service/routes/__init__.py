"""One router per resource; routes speak HTTP only and hand validated requests to the pipeline."""
from . import docs, health, images, metrics, nlvr2, page, refer, retrieve, v2, vqa

ROUTERS = (vqa.router, refer.router, retrieve.router, nlvr2.router, images.router, health.router, metrics.router,
           v2.router, page.router, docs.router)

__all__ = ["ROUTERS"]
