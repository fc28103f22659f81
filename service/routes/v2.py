"""The Open Inference Protocol (KServe v2, REST) beside the task routes, so KServe, Triton's clients and Seldon can call
vlserve: one model per served task, each request run by the same Pipeline (and batchers) as its task route.

  GET  /v2                          server metadata          GET /v2/health/live, /v2/health/ready
  GET  /v2/models/{name}            model metadata           GET /v2/models/{name}/ready
  POST /v2/models/{name}/infer      inference                (each also under /v2/models/{name}/versions/1/...)

Models: vlserve-vqa, vlserve-refer, vlserve-retrieve, vlserve-nlvr2 (those whose head the loaded model has). Inputs
and outputs are named as the task routes' JSON fields. Texts are BYTES (UTF-8); an image is BYTES: its file bytes
in the binary tensor data extension (what tritonclient sends by default), base64 in a JSON `data` array. Outputs come
as JSON, or in the binary extension where the request asks for it (`binary_data_output`, or an output's
`binary_data`), as tritonclient does. Errors are the protocol's body `{"error": "..."}`: 400 for a malformed request
(and for what the task routes answer 422), 404 for an unknown model, 429 / 503 with Retry-After as on the task routes.
These routes follow the protocol's own REST specification and are not in /openapi.json (docs/API.md).
"""
from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from models.images import ImageError

from ..batcher import BatcherClosedError, QueueFullError
from ..errors import InvalidInput, JSONAnswer, NoHeadError, queue_full, retry_after_s, shown
from ..feature_store import StoreUnavailableError
from ..pipeline import Timer
from ..regions import UnknownImageError
from ..schemas import IMAGE_ID_PATTERN, decode_base64

router = APIRouter(prefix="/v2", tags=["open-inference-protocol"], include_in_schema=False)
HEADER_LENGTH = "inference-header-content-length"  # the binary tensor data extension's header
VERSION = "1"  # each model's one version: the loaded checkpoint (GET /readyz names it)
_IMAGE_ID = re.compile(IMAGE_ID_PATTERN)
MAX_DIMENSION = 2**31 - 1  # of a shape: the protocol's int64 dimensions, bounded as Triton bounds them
MAX_NESTING = 8  # levels of a JSON `data` array: every input here is one-dimensional, nested as its shape at most
_END = object()  # _flatten's end of a row
_NUMERIC = {"BOOL": "?", "INT8": "<i1", "INT16": "<i2", "INT32": "<i4", "INT64": "<i8", "UINT8": "<u1",
            "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8", "FP16": "<f2", "FP32": "<f4", "FP64": "<f8"}


class V2Error(Exception):
    """An answer in the protocol's error body."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONAnswer({"error": message}, status_code=status, headers=headers)


@dataclass(frozen=True)
class Tensor:
    name: str
    datatype: str
    shape: tuple[int, ...]  # -1: any length
    optional: bool = False
    image: bool = False  # BYTES holding image files: base64 in JSON


@dataclass(frozen=True)
class Model:
    name: str
    kind: str  # the pipeline's head kind
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    # async (pipeline, inputs: name -> flat list of values, timer) -> output name -> (datatype, shape, values)
    run: Callable[..., Any]


def _one(inputs: dict[str, list], name: str, default: Any = None) -> Any:
    values = inputs.get(name)
    return default if values is None else values[0]


def _text(value: bytes, name: str) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise V2Error(400, f"input '{name}' is not UTF-8 text") from None


def _image_id(value: bytes, name: str) -> str:
    text = value.decode("latin-1")
    if not _IMAGE_ID.fullmatch(text):
        raise V2Error(400, f"input '{name}': an image_id is the sha256 of the image bytes, 64 lowercase hex digits")
    return text


def _image_ref(inputs: dict[str, list]) -> tuple[bytes | None, str | None]:
    """(image bytes, image_id): exactly one of the inputs `image` and `image_id`."""
    if ("image" in inputs) == ("image_id" in inputs):
        raise V2Error(400, "send exactly one of the inputs 'image' (the image file) and 'image_id'")
    if "image" in inputs:
        return _one(inputs, "image"), None
    return None, _image_id(_one(inputs, "image_id"), "image_id")


def _top_k(inputs: dict[str, list]) -> int:
    return int(_one(inputs, "top_k", 5))


def _bytes(values: list[str]) -> tuple[str, tuple[int, ...], list[str]]:
    return "BYTES", (len(values),), values


def _fp32(values: list[float]) -> tuple[str, tuple[int, ...], list[float]]:
    return "FP32", (len(values),), values


async def _vqa(pipeline, inputs, timer) -> dict[str, tuple]:
    data, image_id = _image_ref(inputs)
    result = await pipeline.vqa(data, image_id, _text(_one(inputs, "question"), "question"), _top_k(inputs), timer)
    return {"answers": _bytes([a["answer"] for a in result["answers"]]),
            "scores": _fp32([a["score"] for a in result["answers"]]), "image_id": _bytes([result["image_id"]])}


async def _refer(pipeline, inputs, timer) -> dict[str, tuple]:
    data, image_id = _image_ref(inputs)
    result = await pipeline.refer(data, image_id, _text(_one(inputs, "expression"), "expression"), timer)
    runners = result["runner_up"]
    return {"box": ("FP32", (4,), result["box"]), "score": _fp32([result["score"]]),
            "index": ("INT32", (1,), [result["region"]["index"]]),
            "runner_up_boxes": ("FP32", (len(runners), 4), [v for r in runners for v in r["box"]]),
            "runner_up_scores": _fp32([r["score"] for r in runners]),
            "image_size": ("INT32", (2,), result["image_size"]), "image_id": _bytes([result["image_id"]])}


async def _retrieve(pipeline, inputs, timer) -> dict[str, tuple]:
    to_images = "text" in inputs or "image_ids" in inputs
    to_texts = "texts" in inputs or "image" in inputs or "image_id" in inputs
    if to_images == to_texts:
        raise V2Error(400, "send either 'text' and 'image_ids' (rank images for a text) or 'image' or 'image_id' and "
                           "'texts' (rank texts for an image)")
    if to_images:
        if "text" not in inputs or "image_ids" not in inputs:
            raise V2Error(400, "ranking images for a text needs both inputs 'text' and 'image_ids'")
        if not inputs["image_ids"]:
            raise V2Error(400, "input 'image_ids' is empty")
        ids = [_image_id(v, "image_ids") for v in inputs["image_ids"]]
        result = await pipeline.text_to_images(_text(_one(inputs, "text"), "text"), ids, _top_k(inputs), timer,
                                               bool(_one(inputs, "query_bank", True)))
        hits = result["results"]
        out = {"image_ids": _bytes([h["image_id"] for h in hits]), "scores": _fp32([h["score"] for h in hits]),
               "probabilities": _fp32([h["probability"] for h in hits])}
        if hits and "bank_score" in hits[0]:
            out["bank_scores"] = _fp32([h["bank_score"] for h in hits])
        return out
    if "texts" not in inputs or not inputs["texts"]:
        raise V2Error(400, "ranking texts for an image needs the input 'texts'")
    if "query_bank" in inputs:
        raise V2Error(400, "input 'query_bank' applies to ranking images for a text only")
    data, image_id = _image_ref(inputs)
    texts = [_text(v, "texts") for v in inputs["texts"]]
    result = await pipeline.image_to_texts(data, image_id, texts, _top_k(inputs), timer)
    hits = result["results"]
    return {"indices": ("INT32", (len(hits),), [h["index"] for h in hits]), "texts": _bytes([h["text"] for h in hits]),
            "scores": _fp32([h["score"] for h in hits]), "probabilities": _fp32([h["probability"] for h in hits]),
            "image_id": _bytes([result["image_id"]])}


async def _nlvr2(pipeline, inputs, timer) -> dict[str, tuple]:
    if ("images" in inputs) == ("image_ids" in inputs):
        raise V2Error(400, "send exactly one of the inputs 'images' (two image files) and 'image_ids' (two ids)")
    if "images" in inputs:
        refs = [(data, None) for data in inputs["images"]]
    else:
        refs = [(None, _image_id(v, "image_ids")) for v in inputs["image_ids"]]
    result = await pipeline.nlvr2(refs, _text(_one(inputs, "statement"), "statement"), timer)
    return {"answer": ("BOOL", (1,), [result["answer"]]), "probability": _fp32([result["probability"]]),
            "image_ids": _bytes(result["image_ids"])}


IMAGE = Tensor("image", "BYTES", (1,), optional=True, image=True)
IMAGE_ID = Tensor("image_id", "BYTES", (1,), optional=True)
TOP_K = Tensor("top_k", "INT32", (1,), optional=True)
MODELS: dict[str, Model] = {m.name: m for m in (
    Model("vlserve-vqa", "vqa", (IMAGE, IMAGE_ID, Tensor("question", "BYTES", (1,)), TOP_K),
          (Tensor("answers", "BYTES", (-1,)), Tensor("scores", "FP32", (-1,)), Tensor("image_id", "BYTES", (1,))),
          _vqa),
    Model("vlserve-refer", "refer", (IMAGE, IMAGE_ID, Tensor("expression", "BYTES", (1,))),
          (Tensor("box", "FP32", (4,)), Tensor("score", "FP32", (1,)), Tensor("index", "INT32", (1,)),
           Tensor("runner_up_boxes", "FP32", (-1, 4)), Tensor("runner_up_scores", "FP32", (-1,)),
           Tensor("image_size", "INT32", (2,)), Tensor("image_id", "BYTES", (1,))),
          _refer),
    Model("vlserve-retrieve", "itm",
          (Tensor("text", "BYTES", (1,), optional=True), Tensor("image_ids", "BYTES", (-1,), optional=True),
           IMAGE, IMAGE_ID, Tensor("texts", "BYTES", (-1,), optional=True), TOP_K,
           Tensor("query_bank", "BOOL", (1,), optional=True)),
          # text -> images: image_ids, scores, probabilities (+ bank_scores with a query bank);
          # image -> texts: indices, texts, scores, probabilities, image_id
          (Tensor("image_ids", "BYTES", (-1,)), Tensor("indices", "INT32", (-1,)), Tensor("texts", "BYTES", (-1,)),
           Tensor("scores", "FP32", (-1,)), Tensor("probabilities", "FP32", (-1,)),
           Tensor("bank_scores", "FP32", (-1,)), Tensor("image_id", "BYTES", (1,))),
          _retrieve),
    Model("vlserve-nlvr2", "nlvr2",
          (Tensor("images", "BYTES", (2,), optional=True, image=True),
           Tensor("image_ids", "BYTES", (2,), optional=True),
           Tensor("statement", "BYTES", (1,))),
          (Tensor("answer", "BOOL", (1,)), Tensor("probability", "FP32", (1,)), Tensor("image_ids", "BYTES", (2,))),
          _nlvr2),
)}


# ---- request decoding ---------------------------------------------------------------------------------

def _flatten(data: Any, name: str) -> list:
    """A JSON `data` array, flat or nested (row-major), as a flat list; nested at most MAX_NESTING deep (a tensor of
    the served models has at most two dimensions), without recursion, so any depth gets a 400."""
    if not isinstance(data, list):
        raise V2Error(400, f"input '{name}': data must be a JSON array (flat, or nested as its shape)")
    out: list = []
    rows = [iter(data)]
    while rows:
        item = next(rows[-1], _END)
        if item is _END:
            rows.pop()
        elif not isinstance(item, list):
            out.append(item)
        elif len(rows) == MAX_NESTING:
            raise V2Error(400, f"input '{name}': data nested deeper than {MAX_NESTING} levels")
        else:
            rows.append(iter(item))
    return out


def _laid_out_as(data: list, shape: list[int]) -> bool:
    """Whether a JSON `data` array is flat, or nested exactly as `shape` (rows of equal length at every level)."""
    if not any(isinstance(item, list) for item in data):
        return True
    level = [data]
    for size in shape:
        if not all(isinstance(row, list) and len(row) == size for row in level):
            return False
        level = [item for row in level for item in row]
    return not any(isinstance(item, list) for item in level)


def _from_binary(raw: bytes, datatype: str, name: str) -> list:
    if datatype == "BYTES":  # each element: 4-byte little-endian length, then the bytes
        values, at = [], 0
        while at < len(raw):
            if at + 4 > len(raw):
                raise V2Error(400, f"input '{name}': binary BYTES data is cut short")
            (size,) = struct.unpack_from("<I", raw, at)
            if at + 4 + size > len(raw):
                raise V2Error(400, f"input '{name}': binary BYTES data is cut short")
            values.append(raw[at + 4:at + 4 + size])
            at += 4 + size
        return values
    dtype = np.dtype(_NUMERIC[datatype])
    if len(raw) % dtype.itemsize:
        raise V2Error(400, f"input '{name}': {len(raw)} bytes are not a whole number of {datatype} elements")
    return np.frombuffer(raw, dtype).tolist()


def _from_json(data: Any, spec: Tensor) -> list:
    values = _flatten(data, spec.name)
    if spec.datatype == "BYTES":
        if not all(isinstance(v, str) for v in values):
            raise V2Error(400, f"input '{spec.name}': BYTES data must be strings in JSON")
        if spec.image:
            try:
                return [decode_base64(v) for v in values]
            except ValueError:
                raise V2Error(400, f"input '{spec.name}': an image in JSON data is base64 of the image file") from None
        try:
            return [v.encode("utf-8") for v in values]
        except UnicodeEncodeError:  # a lone surrogate, which JSON's \u escapes can write
            raise V2Error(400, f"input '{spec.name}' is not UTF-8 text") from None
    if spec.datatype == "BOOL":
        if not all(isinstance(v, bool) for v in values):
            raise V2Error(400, f"input '{spec.name}': BOOL data must be true or false")
        return values
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise V2Error(400, f"input '{spec.name}': {spec.datatype} data must be integers")
    return values


def _check_shape(spec: Tensor, shape: Any, count: int) -> None:
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise V2Error(400, f"input '{spec.name}': shape must be a list of non-negative integers")
    if len(shape) > MAX_NESTING:
        raise V2Error(400, f"input '{spec.name}': shape has {len(shape)} dimensions; at most {MAX_NESTING}")
    if any(d > MAX_DIMENSION for d in shape):  # no body holds more; and a product too long to print is a ValueError
        raise V2Error(400, f"input '{spec.name}': a dimension of its shape is over {MAX_DIMENSION}")
    if math.prod(shape) != count:
        raise V2Error(400, f"input '{spec.name}': shape {shown(str(shape))} holds {math.prod(shape)} elements but the "
                           f"data has {count}")
    want = math.prod(spec.shape) if -1 not in spec.shape else None
    if want is not None and count != want:
        raise V2Error(400, f"input '{spec.name}' takes {want} element{'s' * (want != 1)}, got {count}")


def parse_request(model: Model, body: bytes, header_length: str | None) -> tuple[dict[str, list], dict[str, Any]]:
    """(input name -> flat list of values, the request's JSON header) of an inference request, or a 400."""
    if header_length is not None:
        try:
            size = int(header_length)
        except ValueError:
            raise V2Error(400, "Inference-Header-Content-Length is not a number") from None
        if not 0 < size <= len(body):
            raise V2Error(400, f"Inference-Header-Content-Length {size} does not fit the body of {len(body)} bytes")
        head, binary = body[:size], body[size:]
    else:
        head, binary = body, b""
    try:
        request = json.loads(head)
    except (UnicodeDecodeError, ValueError) as exc:
        raise V2Error(400, f"the request is not valid JSON: {exc}") from None
    except RecursionError:
        raise V2Error(400, "the request is not valid JSON: nested too deeply") from None
    if not isinstance(request, dict) or not isinstance(request.get("inputs"), list) or not request["inputs"]:
        raise V2Error(400, "the request must be a JSON object with a non-empty 'inputs' list")
    if "id" in request and not isinstance(request["id"], str):
        raise V2Error(400, "'id' must be a string (it is echoed in the response)")
    parameters = request.get("parameters", {})
    if not isinstance(parameters, dict) or not isinstance(parameters.get("binary_data_output", False), bool):
        raise V2Error(400, "'parameters' must be an object, and its 'binary_data_output' true or false")
    specs = {t.name: t for t in model.inputs}
    inputs: dict[str, list] = {}
    at = 0
    for tensor in request["inputs"]:
        if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
            raise V2Error(400, "each input must be an object with a 'name', 'shape', 'datatype' and 'data'")
        name = tensor["name"]
        spec = specs.get(name)
        if spec is None:
            raise V2Error(400, f"model {model.name} has no input '{shown(name)}'; its inputs: {', '.join(specs)}")
        if name in inputs:
            raise V2Error(400, f"input '{name}' is given twice")
        if tensor.get("datatype") != spec.datatype:
            raise V2Error(400, f"input '{name}' has datatype {spec.datatype}, got {shown(repr(tensor.get('datatype')))}")
        parameters = tensor.get("parameters") or {}
        if not isinstance(parameters, dict):
            raise V2Error(400, f"input '{name}': parameters must be an object")
        size = parameters.get("binary_data_size")
        if size is not None and "data" in tensor:
            raise V2Error(400, f"input '{name}' has both 'data' and a binary_data_size: give one")
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0 or at + size > len(binary):
                raise V2Error(400, f"input '{name}': binary_data_size {shown(repr(size))} does not fit the binary data")
            values = _from_binary(binary[at:at + size], spec.datatype, name)
            at += size
        elif "data" in tensor:
            values = _from_json(tensor["data"], spec)
        else:
            raise V2Error(400, f"input '{name}' has no 'data'")
        _check_shape(spec, tensor.get("shape"), len(values))
        if "data" in tensor and not _laid_out_as(tensor["data"], tensor["shape"]):
            raise V2Error(400, f"input '{name}': data is nested otherwise than its shape {shown(str(tensor['shape']))}; "
                               "give it flat (row-major) or nested as its shape")
        inputs[name] = values
    if at != len(binary):
        raise V2Error(400, f"{len(binary) - at} bytes of binary data follow that no input claims")
    missing = [t.name for t in model.inputs if not t.optional and t.name not in inputs]
    if missing:
        raise V2Error(400, f"model {model.name} needs the input{'s' * (len(missing) > 1)} {', '.join(missing)}")
    wanted = request.get("outputs")
    if wanted is not None:
        if not isinstance(wanted, list) or not wanted or not all(isinstance(o, dict) and isinstance(o.get("name"), str)
                                                                 for o in wanted):
            raise V2Error(400, "'outputs' must be a non-empty list of objects with a 'name' (leave it out for every "
                               "output)")
        known = [t.name for t in model.outputs]
        asked: set[str] = set()
        for o in wanted:
            if o["name"] not in known:
                raise V2Error(400, f"model {model.name} has no output '{shown(o['name'])}'; its outputs: "
                                   f"{', '.join(known)}")
            if o["name"] in asked:
                raise V2Error(400, f"output '{o['name']}' is asked for twice")
            asked.add(o["name"])
            options = o.get("parameters", {})
            if not isinstance(options, dict) or not isinstance(options.get("binary_data", False), bool):
                raise V2Error(400, f"output '{o['name']}': 'parameters' must be an object, and its 'binary_data' "
                                   "true or false")
    return inputs, request


# ---- response encoding --------------------------------------------------------------------------------

def _to_binary(datatype: str, values: list) -> bytes:
    if datatype == "BYTES":
        parts = [v.encode("utf-8") if isinstance(v, str) else v for v in values]
        return b"".join(struct.pack("<I", len(p)) + p for p in parts)
    return np.asarray(values, _NUMERIC[datatype]).tobytes()


def encode_response(model: Model, request: dict[str, Any], outputs: dict[str, tuple]) -> Response:
    """The outputs the request names (all of them when it names none), in JSON or in the binary extension."""
    wanted = request.get("outputs")
    parameters = request.get("parameters") if isinstance(request.get("parameters"), dict) else {}
    binary_all = parameters.get("binary_data_output") is True
    if wanted is None:
        selected = [(name, binary_all) for name in outputs]
    else:  # names checked by parse_request
        selected = []
        for o in wanted:
            if o["name"] not in outputs:
                raise V2Error(400, f"output '{o['name']}' is not produced by this request")
            options = o.get("parameters") if isinstance(o.get("parameters"), dict) else {}
            selected.append((o["name"], options.get("binary_data", binary_all) is True))
    tensors, chunks = [], []
    for name, binary in selected:
        datatype, shape, values = outputs[name]
        tensor = {"name": name, "datatype": datatype, "shape": list(shape)}
        if binary:
            raw = _to_binary(datatype, values)
            tensor["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            tensor["data"] = values
        tensors.append(tensor)
    body: dict[str, Any] = {"model_name": model.name, "model_version": VERSION, "outputs": tensors}
    if isinstance(request.get("id"), str):
        body["id"] = request["id"]
    head = json.dumps(body, separators=(",", ":")).encode()
    if not chunks:
        return Response(head, media_type="application/json")
    return Response(head + b"".join(chunks), media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(len(head))})


# ---- routes -------------------------------------------------------------------------------------------

def _services(request: Request):
    services = getattr(request.app.state, "services", None)
    if services is None or not request.app.state.ready:
        raise V2Error(503, "the models are still loading and warming up, or the service is shutting down",
                      {"Retry-After": "1"})
    return services


def _model(request: Request, name: str, version: str | None = None) -> tuple[Any, Model]:
    services = _services(request)
    model = MODELS.get(name)
    if model is None or model.kind not in services.pipeline.specs:
        served = [m.name for m in MODELS.values() if m.kind in services.pipeline.specs]
        raise V2Error(404, f"no model '{shown(name)}'; this server serves: {', '.join(served) or 'nothing'}")
    if version not in (None, "", VERSION):
        raise V2Error(404, f"model '{name}' has no version '{shown(version)}'; its versions: {VERSION}")
    return services, model


@router.get("")
@router.get("/")  # the protocol's REST spec (open_inference_rest.yaml) names it /v2/, its text v2
async def server_metadata() -> dict[str, Any]:
    from ..app import package_version  # the app module imports this one

    return {"name": "vlserve", "version": package_version(), "extensions": ["binary_tensor_data"]}


@router.get("/health/live")
async def live() -> dict[str, bool]:
    return {"live": True}


@router.get("/health/ready")
async def ready(request: Request) -> Response:
    state = request.app.state
    if getattr(state, "services", None) is None or not state.ready or state.draining:
        return error_response(503, "not ready: loading, warming up or shutting down", {"Retry-After": "1"})
    return JSONResponse({"ready": True})


@router.get("/models/{name}")
@router.get("/models/{name}/versions/{version}")
async def model_metadata(request: Request, name: str, version: str | None = None) -> Response:
    try:
        _, model = _model(request, name, version)
    except V2Error as exc:
        return error_response(exc.status, exc.message, exc.headers)

    def tensors(items: tuple[Tensor, ...]) -> list[dict[str, Any]]:
        return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape),
                 **({"parameters": {"optional": True}} if t.optional else {})} for t in items]

    return JSONResponse({"name": model.name, "versions": [VERSION], "platform": "vlserve",
                         "inputs": tensors(model.inputs), "outputs": tensors(model.outputs)})


@router.get("/models/{name}/ready")
@router.get("/models/{name}/versions/{version}/ready")
async def model_ready(request: Request, name: str, version: str | None = None) -> Response:
    try:
        _model(request, name, version)
    except V2Error as exc:
        return error_response(exc.status, exc.message, exc.headers)
    if request.app.state.draining:
        return error_response(503, "the service is shutting down", {"Retry-After": "1"})
    return JSONResponse({"name": name, "ready": True})


@router.post("/models/{name}/infer")
@router.post("/models/{name}/versions/{version}/infer")
async def infer(request: Request, name: str, version: str | None = None) -> Response:
    try:
        services, model = _model(request, name, version)
        inputs, parsed = parse_request(model, await request.body(), request.headers.get(HEADER_LENGTH))
        outputs = await model.run(services.pipeline, inputs, Timer())
        return encode_response(model, parsed, outputs)
    except V2Error as exc:
        return error_response(exc.status, exc.message, exc.headers)
    except (InvalidInput, ImageError) as exc:  # a 422 on the task routes; the protocol knows 400
        return error_response(400, str(exc))
    except UnknownImageError as exc:
        return error_response(404, str(exc))
    except NoHeadError as exc:
        return error_response(404, str(exc))
    except QueueFullError as exc:
        detail, headers = queue_full(exc)
        return error_response(429, detail, headers)
    except StoreUnavailableError as exc:
        return error_response(503, str(exc), {"Retry-After": str(retry_after_s(exc.retry_after_s))})
    except BatcherClosedError:
        return error_response(503, "the service is shutting down; retry on another replica", {"Retry-After": "1"})
