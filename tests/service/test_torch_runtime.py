"""Torch runtime on a saved tiny checkpoint: equals the model, batching equals one request at a time, clear errors."""
import numpy as np
import pytest
import torch

from models import create_model
from models.checkpoint import load_checkpoint, save_checkpoint
from models.inputs import VLInputs
from models.layers import cpu_has_native_bf16
from models.region_features import RegionFeatures
from models.tokenizer import VLTokenizer
from service.collate import pad_and_concat, pad_and_stack, pad_to_shape, split_rows
from service.runtime import Runtime, UnknownTaskError, create_runtime
from service.runtime.torch_runtime import TorchRuntime
from service.settings import load_settings
from tests.service.conftest import random_regions

HEADS = {"vqa": {"kind": "vqa", "num_labels": 5}, "refer": {"kind": "refer"}, "itm": {"kind": "itm"},
         "nlvr2": {"kind": "nlvr2"}}
LABELS = {"heads": {"vqa": ["red", "blue", "yes", "no", "2"]}, "objects": ["circle"], "attributes": ["red"]}
TEXTS = ["what colour is the circle?", "is there a red square", "how many shapes"]


@pytest.fixture(scope="module")
def tokenizer():
    return VLTokenizer.pretrained_minilm()


@pytest.fixture(scope="module", params=["lxmert", "visualbert"])
def saved(request, tmp_path_factory, tokenizer):
    """(reference model, checkpoint loaded from disk) of a tiny preset with four task heads."""
    torch.manual_seed(0)
    model = create_model(request.param, "tiny", heads=HEADS).eval()
    path = save_checkpoint(model, tmp_path_factory.mktemp(request.param), tokenizer, labels=LABELS)
    return model, load_checkpoint(path)


def item(tokenizer: VLTokenizer, text: str, *images: RegionFeatures) -> dict[str, np.ndarray]:
    """One request as the pipeline builds it: 1-D token arrays and per-image region arrays (stacked for pairs)."""
    enc = {k: v[0] for k, v in tokenizer.encode([text]).items()}
    parts = {"region_features": [rf.features for rf in images], "region_boxes": [rf.normalized_boxes() for rf in images],
             "region_mask": [rf.region_mask() for rf in images]}
    if len(images) == 1:
        return {**enc, **{k: v[0] for k, v in parts.items()}}
    return {**enc, **{k: np.stack(v) for k, v in parts.items()}}


def requests(tokenizer, task: str) -> list[dict[str, np.ndarray]]:
    if task == "nlvr2":
        return [item(tokenizer, t, random_regions(i, 3 + i), random_regions(10 + i, 8 - i)) for i, t in enumerate(TEXTS)]
    return [item(tokenizer, t, random_regions(i, 3 + 2 * i)) for i, t in enumerate(TEXTS)]


@pytest.mark.parametrize("task", list(HEADS))
def test_runtime_equals_the_model(saved, tokenizer, task):
    model, checkpoint = saved
    runtime = TorchRuntime(checkpoint, device="cpu", threads=1)
    batch = pad_and_stack(requests(tokenizer, task))
    logits = runtime.run(task, batch)
    inputs = VLInputs(**{k: torch.from_numpy(v.astype(np.float32 if v.dtype.kind == "f" else np.int64)) for k, v in batch.items()})
    with torch.no_grad():
        expected = model(inputs, task).logits.numpy()
    assert isinstance(logits, np.ndarray) and logits.dtype == np.float32
    np.testing.assert_array_equal(logits, expected)
    assert logits.shape[0] == len(TEXTS)


@pytest.mark.parametrize("task", ["vqa", "refer", "nlvr2"])
def test_a_batch_answers_as_requests_one_at_a_time(saved, tokenizer, task):
    _, checkpoint = saved
    runtime = TorchRuntime(checkpoint, threads=1)
    reqs = requests(tokenizer, task)
    together = split_rows(runtime.run(task, pad_and_stack(reqs)), len(reqs))
    for req, row in zip(reqs, together):
        alone = runtime.run(task, pad_and_stack([req]))[0]
        if task == "refer":  # per-region scores: compare the real regions (padding rows are masked)
            n = int(req["region_mask"].sum())
            alone, row = alone[:n], row[:n]
        np.testing.assert_allclose(row, alone, rtol=1e-4, atol=1e-5)


def test_tasks_and_errors(saved, tokenizer):
    _, checkpoint = saved
    runtime = create_runtime(load_settings(runtime="torch", threads=1), checkpoint)
    assert isinstance(runtime, Runtime) and runtime.name == "torch"
    assert runtime.tasks == {"vqa": "vqa", "refer": "refer", "itm": "itm", "nlvr2": "nlvr2"}
    batch = pad_and_stack(requests(tokenizer, "vqa"))
    with pytest.raises(UnknownTaskError, match="no task 'grounding'"):
        runtime.run("grounding", batch)
    with pytest.raises(ValueError, match="missing.*region_mask"):
        runtime.run("vqa", {k: v for k, v in batch.items() if k != "region_mask"})
    with pytest.raises(ValueError, match="unknown.*labels"):
        runtime.run("vqa", {**batch, "labels": batch["input_ids"]})
    with pytest.raises(ValueError, match="disagree on the batch size"):
        runtime.run("vqa", {**batch, "region_mask": batch["region_mask"][:1]})


def test_unavailable_runtimes_and_devices_fail_clearly(saved):
    _, checkpoint = saved
    for name in ("onnxruntime", "tensorrt"):  # a checkpoint, not an export
        with pytest.raises(ValueError, match=f"runtime '{name}' serves a model repository"):
            create_runtime(load_settings(runtime=name), checkpoint)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            TorchRuntime(checkpoint, device="cuda")
    with pytest.raises(ValueError, match="threads"):
        TorchRuntime(checkpoint, threads=0)


def test_precision_resolution(monkeypatch):
    from models import layers
    from service.runtime.torch_runtime import resolve_precision

    cpu = torch.device("cpu")
    assert resolve_precision("fp32", cpu) == "fp32"
    assert resolve_precision("auto", cpu) == ("bf16" if cpu_has_native_bf16() else "fp32")
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        resolve_precision("fp8", cpu)
    monkeypatch.setattr(layers, "PACK_CPU_WEIGHTS", False)  # the bf16 CPU path needs the packed weights
    assert resolve_precision("auto", cpu) == "fp32"
    reason = "VLSERVE_PACK_CPU_WEIGHTS=0" if cpu_has_native_bf16() else "no native bfloat16"
    with pytest.raises(ValueError, match=f"precision 'bf16' on cpu: .*{reason}"):
        resolve_precision("bf16", cpu)


@pytest.mark.parametrize("task", list(HEADS))
def test_bf16_runtime_is_close_to_fp32_and_batches_consistently(saved, tokenizer, task):
    from models import layers

    _, checkpoint = saved
    reqs = requests(tokenizer, task)
    batch = pad_and_stack(reqs)
    ref = TorchRuntime(checkpoint, threads=1).run(task, batch)
    if not cpu_has_native_bf16():  # emulated bfloat16 would be slower than float32: refused, float32 stays
        with pytest.raises(ValueError, match="no native bfloat16"):
            TorchRuntime(checkpoint, threads=1, precision="bf16")
        np.testing.assert_array_equal(TorchRuntime(checkpoint, threads=1).run(task, batch), ref)
        return
    bf16 = TorchRuntime(checkpoint, threads=1, precision="bf16")  # runs the checkpoint's model in bf16 from now on
    assert bf16.precision == "bf16"
    out = bf16.run(task, batch)
    assert out.dtype == np.float32 and not np.array_equal(out, ref)  # it really ran in bfloat16
    np.testing.assert_allclose(out, ref, atol=0.1, rtol=0.05)
    for req, row in zip(reqs, split_rows(out, len(reqs))):
        alone = bf16.run(task, pad_and_stack([req]))[0]
        n = int(req["region_mask"].sum()) if task == "refer" else None
        np.testing.assert_allclose(row[:n], alone[:n], atol=0.1, rtol=0.05)
    layers.set_cpu_gemm_dtype(checkpoint.model, torch.float32)  # float32 again for the other tests


# --- collate helpers --------------------------------------------------------------------------------


def test_pad_and_stack_pads_every_axis_with_the_key_pad_value():
    items = [{"input_ids": np.array([101, 7, 102]), "region_features": np.ones((2, 3)), "tag_ids": np.array([4, 5])},
             {"input_ids": np.array([101, 102]), "region_features": np.ones((4, 3)), "tag_ids": np.array([6, 7, 8, 9])}]
    batch = pad_and_stack(items)
    assert batch["input_ids"].tolist() == [[101, 7, 102], [101, 102, 0]]
    assert batch["region_features"].shape == (2, 4, 3) and batch["region_features"][0, 2:].sum() == 0
    assert batch["tag_ids"].tolist() == [[4, 5, -1, -1], [6, 7, 8, 9]]
    with pytest.raises(ValueError, match="keys"):
        pad_and_stack([items[0], {"input_ids": np.array([1])}])
    with pytest.raises(ValueError, match="dimensions"):
        pad_and_stack([{"a": np.zeros(2)}, {"a": np.zeros((2, 2))}])
    with pytest.raises(ValueError, match="no items"):
        pad_and_stack([])


def test_pad_and_concat_and_split_rows():
    items = [{"input_ids": np.array([[1, 2, 3], [1, 2, 0]])}, {"input_ids": np.array([[5, 6]])}]
    batch = pad_and_concat(items)
    assert batch["input_ids"].tolist() == [[1, 2, 3], [1, 2, 0], [5, 6, 0]]
    parts = split_rows(np.arange(6).reshape(3, 2), [2, 1])
    assert [p.tolist() for p in parts] == [[[0, 1], [2, 3]], [[4, 5]]]
    assert [r.tolist() for r in split_rows(np.arange(3), 3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="3 rows"):
        split_rows(np.arange(3), [1, 1])
    with pytest.raises(ValueError, match="expected 2"):
        split_rows(np.arange(3), 2)
    with pytest.raises(ValueError, match="smaller"):
        pad_to_shape(np.zeros(3), [2])
