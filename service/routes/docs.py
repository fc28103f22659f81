"""GET /docs: the schema's interactive page (Swagger UI), with its script and style served by the service itself, so
it works where the service cannot reach a CDN (air-gapped clusters, this project's machines). The assets are the ones
the fastapi-offline package ships (Swagger UI 5, which reads OpenAPI 3.1); the page is FastAPI's own. No /redoc:
ReDoc's bundle still fetches its logo from its CDN. Like /openapi.json, /docs is behind the API key when keys are
set. Like the page at /, it is sent with a Content-Security-Policy that lets it run its own code only."""
from __future__ import annotations

import base64
import hashlib
from importlib.resources import files
from pathlib import Path

from fastapi import APIRouter
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse

from .static_file import StaticFile

ASSETS = Path(str(files("fastapi_offline") / "static"))
ASSET_TYPES = {"swagger-ui-bundle.js": "text/javascript; charset=utf-8", "swagger-ui.css": "text/css; charset=utf-8",
               "favicon.png": "image/png"}
OPENAPI_URL = "openapi.json"

router = APIRouter(include_in_schema=False)


def content_security_policy(html: str) -> str:
    """The page may run its bundle and, by its hash, the one inline script that starts it; nothing from elsewhere.
    Swagger UI sets style attributes (hence the styles' 'unsafe-inline', which runs no code), draws its icons as
    data: images and sends "Try it out" requests to this origin."""
    inline = html.split("<script>", 1)[1].split("</script>", 1)[0]
    digest = base64.b64encode(hashlib.sha256(inline.encode()).digest()).decode()
    return (f"default-src 'self'; script-src 'self' 'sha256-{digest}'; style-src 'self' 'unsafe-inline'; "
            "img-src 'self' data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'")


# URLs relative to /docs, so the page works under any prefix a proxy strips ("/vlserve/docs" loads
# "/vlserve/docs/swagger-ui.css" and "/vlserve/openapi.json")
PAGE = get_swagger_ui_html(openapi_url=OPENAPI_URL, title="vlserve API", swagger_js_url="docs/swagger-ui-bundle.js",
                           swagger_css_url="docs/swagger-ui.css", swagger_favicon_url="docs/favicon.png").body.decode()
HEADERS = {"Content-Security-Policy": content_security_policy(PAGE), "X-Content-Type-Options": "nosniff"}


@router.get("/docs")
async def swagger_ui() -> HTMLResponse:
    return HTMLResponse(PAGE, headers=HEADERS)


def _asset(name: str):
    async def serve() -> StaticFile:
        return StaticFile(ASSETS / name, media_type=ASSET_TYPES[name],
                          headers={"Cache-Control": "max-age=86400", "X-Content-Type-Options": "nosniff"})

    serve.__name__ = "docs_" + name.replace("-", "_").replace(".", "_")
    return serve


for _name in ASSET_TYPES:
    router.add_api_route(f"/docs/{_name}", _asset(_name), methods=["GET"])
