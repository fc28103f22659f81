"""Settings: VLSERVE_ environment, comma-separated API keys, and invalid values rejected naming the field."""
import pytest
from pydantic import ValidationError

from service.settings import MiB, Settings, load_settings, settings_error_message


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("VLSERVE_"):
            monkeypatch.delenv(name)


def test_defaults():
    s = load_settings()
    assert s.model_dir is None and s.redis_url is None and s.runtime == "torch" and s.device == "cpu"
    assert s.cache_max_bytes == 256 * MiB and s.max_body_bytes == 10 * MiB and s.redis_ttl_s == 604800
    assert (s.max_batch_size, s.max_wait_ms, s.max_queue, s.max_queue_wait_ms) == (8, 5.0, 256, 5.0)
    assert s.api_keys == [] and (s.host, s.port) == ("127.0.0.1", 8000)
    assert s.precision == "auto" and s.detector_settle is True  # a bf16 detector chooses fp32's regions


def test_environment_with_prefix_and_overrides_win(monkeypatch, tmp_path):
    monkeypatch.setenv("VLSERVE_MAX_BATCH_SIZE", "8")
    monkeypatch.setenv("VLSERVE_MAX_WAIT_MS", "2.5")
    monkeypatch.setenv("VLSERVE_MODEL_DIR", str(tmp_path))
    monkeypatch.setenv("VLSERVE_REDIS_URL", "redis://cache:6379/1")
    monkeypatch.setenv("VLSERVE_RUNTIME", "onnxruntime")
    monkeypatch.setenv("MAX_QUEUE", "1")  # no prefix: ignored
    s = load_settings(max_queue=10)
    assert (s.max_batch_size, s.max_wait_ms, s.max_queue) == (8, 2.5, 10)
    assert s.model_dir == tmp_path and s.redis_url == "redis://cache:6379/1" and s.runtime == "onnxruntime"
    assert load_settings(max_batch_size=3).max_batch_size == 3


@pytest.mark.parametrize("raw, keys", [
    ("k1", ["k1"]),
    ("k1,k2", ["k1", "k2"]),
    (" k1 , k2 ,, k1 ", ["k1", "k2"]),
    ("", []),
])
def test_api_keys_from_a_comma_separated_variable(monkeypatch, raw, keys):
    monkeypatch.setenv("VLSERVE_API_KEYS", raw)
    s = load_settings()
    assert s.api_keys == keys
    assert "k1" not in repr(s), "keys never appear in logs of the settings"


def test_api_keys_as_a_list_and_empty_redis_url_means_off(monkeypatch):
    assert load_settings(api_keys=["a", " b "]).api_keys == ["a", "b"]
    monkeypatch.setenv("VLSERVE_REDIS_URL", "")
    assert load_settings().redis_url is None


@pytest.mark.parametrize("field, value, words", [
    ("threads", 0, "greater than or equal to 1"),
    ("max_batch_size", 0, "greater than or equal to 1"),
    ("max_wait_ms", -1, "greater than or equal to 0"),
    ("max_queue", 0, "greater than or equal to 1"),
    ("redis_ttl_s", 0, "greater than 0"),
    ("cache_max_bytes", -5, "greater than 0"),
    ("max_text_tokens", 2, "greater than or equal to 4"),
    ("port", 70000, "less than or equal to 65535"),
    ("runtime", "tensorflow", "'torch', 'onnxruntime' or 'tensorrt'"),
    ("device", "gpu", "not a device"),
    ("precision", "fp16", "'auto', 'fp32' or 'bf16'"),
    ("redis_url", "http://cache:6379", "not a Redis URL"),
    ("model_dir", "/no/such/dir", "directory not found"),
    ("detector_dir", "/no/such/dir", "directory not found"),
    ("api_keys", "good,with space", "contains whitespace"),
    ("host", " ", "must not be empty"),
    ("threads", "two", "valid integer"),
])
def test_invalid_values_are_rejected_naming_the_field(monkeypatch, field, value, words):
    monkeypatch.setenv(f"VLSERVE_{field.upper()}", str(value))
    with pytest.raises(ValidationError) as err:
        load_settings()
    message = settings_error_message(err.value)
    assert message.startswith("invalid settings: ") and f"VLSERVE_{field.upper()}" in message and words in message
    assert "\n" not in message
    if field == "api_keys":
        assert "with space" not in message, "keys are not echoed"


def test_several_errors_in_one_message_and_unknown_overrides():
    with pytest.raises(ValidationError) as err:
        load_settings(threads=0, port=-1)
    message = settings_error_message(err.value)
    assert "VLSERVE_THREADS" in message and "VLSERVE_PORT" in message
    with pytest.raises(ValidationError, match="max_batch"):
        Settings(max_batch=3)


def test_device_is_normalized():
    assert load_settings(device=" CUDA:1 ").device == "cuda:1"
