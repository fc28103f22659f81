"""The Open Inference Protocol (KServe v2) through a real client: tritonclient's HTTP client against a real
`vlserve serve` process with the tiny model, every task it serves, in the binary tensor extension (tritonclient's
default) and in plain JSON; each answer equals the task route's. Malformed requests get the protocol's 400 body."""
from __future__ import annotations

import base64
import json
import os
import struct
import subprocess
import sys

import httpx
import numpy as np
import pytest
import tritonclient.http as tritonclient_http  # tritonclient[http]: a test dependency (pyproject.toml)
from fastapi.testclient import TestClient
from tritonclient.utils import InferenceServerException

from service.app import create_app
from tests.service.conftest import free_port, wait_until_ready, while_the_encoder_is_held

MODELS = ("vlserve-vqa", "vlserve-refer", "vlserve-retrieve", "vlserve-nlvr2")
TOL = 1e-5  # the tiny model runs in fp32: the same example gives the same score whichever route ran it


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_checkpoint, tiny_detector):
    """(base URL, tritonclient) of a real `vlserve serve` process, ready."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLSERVE_")}
    cmd = [sys.executable, "-m", "vlserve.cli", "serve", "--model-dir", str(tiny_checkpoint), "--detector-dir",
           str(tiny_detector.dir), "--port", str(port), "--threads", "1", "--log-level", "warning"]
    log_path = tmp_path_factory.mktemp("v2") / "serve.log"
    log = log_path.open("w")
    proc = subprocess.Popen(cmd, env={**env, "VLSERVE_PRECISION": "fp32"}, stdout=log, stderr=subprocess.STDOUT,
                            text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(proc, base, log_path.read_text)
        client = tritonclient_http.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=60)
        yield base, client
        client.close()
    finally:
        proc.kill()
        proc.wait()
        log.close()


def bytes_input(name: str, values: list[bytes | str], binary: bool = True):
    tensor = tritonclient_http.InferInput(name, [len(values)], "BYTES")
    tensor.set_data_from_numpy(np.array(values, dtype=np.object_), binary_data=binary)
    return tensor


def int_input(name: str, value: int, datatype: str = "INT32"):
    tensor = tritonclient_http.InferInput(name, [1], datatype)
    tensor.set_data_from_numpy(np.array([value], dtype=np.int32 if datatype == "INT32" else np.bool_))
    return tensor


def strings(array: np.ndarray) -> list[str]:
    return [v.decode() if isinstance(v, bytes) else str(v) for v in array.reshape(-1)]


def register(base: str, png: bytes) -> str:
    response = httpx.post(f"{base}/images", json={"image": base64.b64encode(png).decode()}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["image_id"]


def task(base: str, path: str, body: dict) -> dict:
    response = httpx.post(f"{base}{path}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_health_and_metadata(server):
    base, client = server
    assert client.is_server_live() and client.is_server_ready()
    assert client.get_server_metadata()["name"] == "vlserve"
    for name in MODELS:
        assert client.is_model_ready(name), name
        meta = client.get_model_metadata(name)
        assert meta["name"] == name and meta["inputs"] and meta["outputs"]
        for tensor in meta["inputs"] + meta["outputs"]:
            assert tensor["datatype"] in {"BYTES", "FP32", "INT32", "BOOL"} and isinstance(tensor["shape"], list)
    vqa = {t["name"]: t["datatype"] for t in client.get_model_metadata("vlserve-vqa")["inputs"]}
    assert vqa == {"image": "BYTES", "image_id": "BYTES", "question": "BYTES", "top_k": "INT32"}
    assert not client.is_model_ready("vlserve-nope")
    assert client.is_model_ready("vlserve-vqa", "1") and not client.is_model_ready("vlserve-vqa", "2")
    assert client.get_model_metadata("vlserve-vqa", "1")["versions"] == ["1"]
    with pytest.raises(InferenceServerException, match="no model 'vlserve-nope'"):
        client.get_model_metadata("vlserve-nope")
    assert httpx.get(f"{base}/v2/models/vlserve-nope").status_code == 404


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_vqa(server, image_png, binary):
    base, client = server
    image = image_png if binary else base64.b64encode(image_png).decode()  # JSON: base64 of the file
    inputs = [bytes_input("image", [image], binary), bytes_input("question", ["what color is it?"], binary),
              int_input("top_k", 3)]
    outputs = None if binary else [tritonclient_http.InferRequestedOutput(n, binary_data=False)
                                   for n in ("answers", "scores", "image_id")]
    result = client.infer("vlserve-vqa", inputs, outputs=outputs, request_id="r1")
    assert result.get_response()["id"] == "r1"
    expected = task(base, "/vqa", {"image": base64.b64encode(image_png).decode(), "question": "what color is it?",
                                   "top_k": 3})
    assert strings(result.as_numpy("answers")) == [a["answer"] for a in expected["answers"]]
    assert result.as_numpy("scores").dtype == np.float32
    np.testing.assert_allclose(result.as_numpy("scores"), [a["score"] for a in expected["answers"]], atol=TOL)
    assert strings(result.as_numpy("image_id")) == [expected["image_id"]]
    by_id = client.infer("vlserve-vqa", [bytes_input("image_id", [expected["image_id"]]),
                                         bytes_input("question", ["what color is it?"])])
    assert len(by_id.as_numpy("answers")) == 5  # the default top_k, as on /vqa


def test_refer(server, image_png):
    base, client = server
    result = client.infer("vlserve-refer", [bytes_input("image", [image_png]),
                                            bytes_input("expression", ["the red one"])], model_version="1")
    expected = task(base, "/refer", {"image": base64.b64encode(image_png).decode(), "expression": "the red one"})
    np.testing.assert_allclose(result.as_numpy("box"), expected["box"], atol=1e-3)
    np.testing.assert_allclose(result.as_numpy("score"), [expected["score"]], atol=TOL)
    assert result.as_numpy("index").tolist() == [expected["region"]["index"]]
    assert result.as_numpy("runner_up_boxes").shape == (len(expected["runner_up"]), 4)
    np.testing.assert_allclose(result.as_numpy("runner_up_scores"), [r["score"] for r in expected["runner_up"]],
                               atol=TOL)
    assert result.as_numpy("image_size").tolist() == expected["image_size"]


def test_retrieve_both_directions(server, image_png, make_png):
    base, client = server
    ids = [register(base, image_png), register(base, make_png(seed=3))]
    result = client.infer("vlserve-retrieve", [bytes_input("text", ["a red square"]), bytes_input("image_ids", ids),
                                               int_input("query_bank", True, "BOOL")])
    expected = task(base, "/retrieve", {"text": "a red square", "image_ids": ids})
    assert strings(result.as_numpy("image_ids")) == [h["image_id"] for h in expected["results"]]
    np.testing.assert_allclose(result.as_numpy("scores"), [h["score"] for h in expected["results"]], atol=TOL)
    np.testing.assert_allclose(result.as_numpy("probabilities"), [h["probability"] for h in expected["results"]],
                               atol=TOL)

    texts = ["a red square", "two blue circles", "a dog"]
    result = client.infer("vlserve-retrieve", [bytes_input("image", [image_png]), bytes_input("texts", texts),
                                               int_input("top_k", 2)])
    expected = task(base, "/retrieve", {"image": base64.b64encode(image_png).decode(), "texts": texts, "top_k": 2})
    assert result.as_numpy("indices").tolist() == [h["index"] for h in expected["results"]]
    assert strings(result.as_numpy("texts")) == [h["text"] for h in expected["results"]]
    np.testing.assert_allclose(result.as_numpy("scores"), [h["score"] for h in expected["results"]], atol=TOL)


def test_nlvr2(server, image_png, make_png):
    base, client = server
    pair = [image_png, make_png(seed=5)]
    result = client.infer("vlserve-nlvr2", [bytes_input("images", pair), bytes_input("statement", ["both are red"])])
    expected = task(base, "/nlvr2", {"images": [{"image": base64.b64encode(p).decode()} for p in pair],
                                     "statement": "both are red"})
    assert result.as_numpy("answer").tolist() == [expected["answer"]]
    np.testing.assert_allclose(result.as_numpy("probability"), [expected["probability"]], atol=TOL)
    assert strings(result.as_numpy("image_ids")) == expected["image_ids"]


def test_a_client_error_comes_back_as_the_protocols_error(server):
    _, client = server
    with pytest.raises(InferenceServerException, match="needs the input question"):
        client.infer("vlserve-vqa", [bytes_input("image_id", ["ab" * 32])])
    with pytest.raises(InferenceServerException, match="no model"):
        client.infer("vlserve-ocr", [bytes_input("question", ["q"])])


def v2_json(tensors: list[dict]) -> bytes:
    return json.dumps({"inputs": tensors}).encode()


def q(text: str = "what is it?") -> dict:
    return {"name": "question", "datatype": "BYTES", "shape": [1], "data": [text]}


A = "ab" * 32
MALFORMED = [  # (body, headers, a fragment of the error message)
    (b"{not json", {}, "not valid JSON"),
    (b"\xff\xfe", {}, "not valid JSON"),
    (b"[]", {}, "non-empty 'inputs' list"),
    (json.dumps({"inputs": []}).encode(), {}, "non-empty 'inputs' list"),
    (json.dumps({"inputs": [5]}).encode(), {}, "each input must be an object"),
    (v2_json([q()]), {}, "exactly one of the inputs 'image'"),
    (v2_json([{"name": "image_id", "datatype": "BYTES", "shape": [1], "data": [A]}]), {}, "needs the input question"),
    (v2_json([q(), {"name": "colour", "datatype": "BYTES", "shape": [1], "data": ["x"]}]), {}, "has no input 'colour'"),
    (v2_json([q(), q()]), {}, "given twice"),
    (v2_json([{**q(), "datatype": "FP32"}]), {}, "has datatype BYTES"),
    (v2_json([{**q(), "shape": [2]}]), {}, "holds 2 elements"),
    (v2_json([{**q(), "shape": "1"}]), {}, "shape must be a list"),
    (v2_json([{**q(), "data": [5]}]), {}, "must be strings"),
    (v2_json([{"name": "question", "datatype": "BYTES", "shape": [1]}]), {}, "has no 'data'"),
    (v2_json([q(), {"name": "image", "datatype": "BYTES", "shape": [1], "data": ["not base64!"]}]), {}, "base64"),
    (v2_json([q(), {"name": "image", "datatype": "BYTES", "shape": [1], "data": [base64.b64encode(b"GIF8").decode()]}]),
     {}, "image"),
    (v2_json([q(), {"name": "image_id", "datatype": "BYTES", "shape": [1], "data": ["xyz"]}]), {}, "64 lowercase hex"),
    (v2_json([q(), {"name": "image_id", "datatype": "BYTES", "shape": [1], "data": [A]},
              {"name": "top_k", "datatype": "INT32", "shape": [1], "data": [0]}]), {}, "top_k"),
    (v2_json([q(), {"name": "image_id", "datatype": "BYTES", "shape": [1], "data": [A]},
              {"name": "top_k", "datatype": "INT32", "shape": [1], "data": [1.5]}]), {}, "must be integers"),
    (v2_json([q(" "), {"name": "image_id", "datatype": "BYTES", "shape": [1], "data": [A]}]), {}, "question"),
    (v2_json([q(), {"name": "image", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 10}}]),
     {}, "does not fit the binary data"),
    (v2_json([q()]) + b"xx", {"Inference-Header-Content-Length": "many"}, "not a number"),
    (v2_json([q()]), {"Inference-Header-Content-Length": "100000"}, "does not fit the body"),
    (v2_json([q(), {"name": "image_id", "datatype": "BYTES", "shape": [1], "data": [A]}]) + b"\x00",
     {"Inference-Header-Content-Length": str(len(v2_json([q(), {"name": "image_id", "datatype": "BYTES", "shape": [1],
                                                                 "data": [A]}])))}, "no input claims"),
    (lambda h: h + struct.pack("<I", 99) + b"short", "binary-image", "cut short"),
    (json.dumps({"inputs": [q(), {"name": "image_id", "datatype": "BYTES", "shape": [1], "data": [A]}],
                 "outputs": [{"name": "colour"}]}).encode(), {}, "has no output 'colour'"),
    # a lone surrogate: JSON's escapes can write one, UTF-8 cannot
    (v2_json([q("\ud800 what?"), {"name": "image_id", "datatype": "BYTES", "shape": [1], "data": [A]}]), {},
     "input 'question' is not UTF-8 text"),
    # nesting: deeper than a tensor of ours, and deeper than a recursive parser goes
    (v2_json([{**q(), "data": json.loads("[" * 20 + '"what?"' + "]" * 20)}]), {}, "nested deeper than 8 levels"),
    (b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", {}, "nested too deeply"),
    # nested otherwise than the shape says: a row too many, ragged rows
    (v2_json([{**q(), "data": [["what?"]]}]), {}, "nested otherwise than its shape [1]"),
    (v2_json([{**q(), "shape": [1, 1], "data": [[], ["what?"]]}]), {}, "nested otherwise than its shape [1, 1]"),
    (v2_json([{**q(), "shape": [1, 1], "data": [[["what?"]]]}]), {}, "nested otherwise than its shape [1, 1]"),
    # dimensions whose product has more digits than Python turns into text (a ValueError, a 500 before)
    (b'{"inputs": [{"name": "question", "datatype": "BYTES", "shape": [' + b"9" * 4000 + b", " + b"9" * 4000
     + b'], "data": ["what?"]}]}', {}, "a dimension of its shape is over 2147483647"),
]


@pytest.mark.parametrize("shape,data", [([1], ["what is it?"]), ([1, 1], [["what is it?"]]), ([1, 1], ["what is it?"])])
def test_data_flat_or_nested_as_its_shape_is_read(server, image_png, shape, data):
    base, _ = server
    image_id = task(base, "/images", {"image": base64.b64encode(image_png).decode()})["image_id"]
    body = v2_json([{**q(), "shape": shape, "data": data},
                    {"name": "image_id", "datatype": "BYTES", "shape": [1], "data": [image_id]}])
    response = httpx.post(f"{base}/v2/models/vlserve-vqa/infer", content=body, timeout=60)
    assert response.status_code == 200, response.text


def _binary_image_request(fn) -> tuple[bytes, dict[str, str]]:
    payload = fn(b"")
    head = v2_json([q(), {"name": "image", "datatype": "BYTES", "shape": [1],
                          "parameters": {"binary_data_size": len(payload)}}])
    return head + payload, {"Inference-Header-Content-Length": str(len(head))}


@pytest.mark.parametrize("body,headers,message", MALFORMED, ids=[f"{i}-{m}" for i, (_, _, m) in enumerate(MALFORMED)])
def test_a_malformed_request_gets_the_protocols_400(server, body, headers, message):
    base, _ = server
    if headers == "binary-image":
        body, headers = _binary_image_request(body)
    response = httpx.post(f"{base}/v2/models/vlserve-vqa/infer", content=body,
                          headers={"content-type": "application/json", **headers}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()
    assert set(error) == {"error"} and message in error["error"], error


def test_unknown_model_and_unknown_image_and_wrong_method(server):
    base, _ = server
    response = httpx.post(f"{base}/v2/models/vlserve-ocr/infer", content=v2_json([q()]), timeout=60)
    assert response.status_code == 404 and set(response.json()) == {"error"}
    response = httpx.post(f"{base}/v2/models/vlserve-vqa/infer", timeout=60,
                          content=v2_json([q(), {"name": "image_id", "datatype": "BYTES", "shape": [1], "data": [A]}]))
    assert response.status_code == 404 and set(response.json()) == {"error"}, response.text  # an id never registered
    response = httpx.get(f"{base}/v2/models/vlserve-vqa/infer", timeout=60)
    assert response.status_code == 405 and set(response.json()) == {"error"}, response.text


def test_api_keys_guard_v2_inference_but_not_its_health_probes(make_settings, image_png):
    with TestClient(create_app(make_settings(api_keys=["k1"]))) as client:
        assert client.get("/v2/health/live").status_code == 200
        assert client.get("/v2/health/ready").status_code == 200
        denied = client.post("/v2/models/vlserve-vqa/infer", content=v2_json([q()]))
        assert denied.status_code == 401 and set(denied.json()) == {"error"}, denied.text
        assert client.get("/v2/models/vlserve-vqa").status_code == 401
        image = {"name": "image", "datatype": "BYTES", "shape": [1], "data": [base64.b64encode(image_png).decode()]}
        served = client.post("/v2/models/vlserve-vqa/infer", content=v2_json([q(), image]), headers={"X-API-Key": "k1"})
        assert served.status_code == 200, served.text
        assert [o["name"] for o in served.json()["outputs"]] == ["answers", "scores", "image_id"]


def test_a_model_without_the_head_is_not_served(tmp_path, make_settings, make_checkpoint, tiny_detector):
    vqa_only = make_checkpoint(tmp_path / "vqa", tiny_detector.fingerprint,
                               heads={"vqa": {"kind": "vqa", "num_labels": 5}})
    with TestClient(create_app(make_settings(model_dir=vqa_only))) as client:
        assert client.get("/v2/models/vlserve-vqa/ready").status_code == 200
        for name in ("vlserve-refer", "vlserve-retrieve", "vlserve-nlvr2"):
            response = client.get(f"/v2/models/{name}/ready")
            assert response.status_code == 404 and "serves: vlserve-vqa" in response.json()["error"], response.text


def test_not_ready_answers_503_in_the_protocols_body(make_settings):
    client = TestClient(create_app(make_settings()))  # no `with`: the lifespan has not run
    assert client.get("/v2/health/live").status_code == 200
    for response in (client.get("/v2/health/ready"), client.get("/v2/models/vlserve-vqa/ready"),
                     client.post("/v2/models/vlserve-vqa/infer", content=v2_json([q()]))):
        assert response.status_code == 503 and set(response.json()) == {"error"}, response.text
        assert response.headers["Retry-After"] == "1"


def test_admission_refuses_a_v2_request_the_queue_cannot_take(make_settings, image_png):
    """The admission middleware keys on the v2 infer path as on /vqa: 429 in the protocol's body, Retry-After."""
    app = create_app(make_settings(max_batch_size=1, max_queue=1, max_wait_ms=0.0, detector_max_batch_size=1))
    with TestClient(app) as client:
        image_id = client.post("/images", json={"image": base64.b64encode(image_png).decode()}).json()["image_id"]
        batcher = client.app.state.services.pipeline.batchers["vqa"]
        body = v2_json([q(), {"name": "image_id", "datatype": "BYTES", "shape": [1], "data": [image_id]}])
        responses, _ = while_the_encoder_is_held(
            batcher, lambda: client.post("/v2/models/vlserve-vqa/infer", content=body))
    limited = [r for r in responses if r.status_code == 429]
    assert limited and {r.status_code for r in responses} <= {200, 429}, [r.status_code for r in responses]
    for response in limited:
        assert set(response.json()) == {"error"} and int(response.headers["Retry-After"]) >= 1
