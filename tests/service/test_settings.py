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
    ("model_dir", "", "is empty"),  # not the working directory
    ("detector_dir", " ", "is empty"),
    ("engine_cache_dir", "", "is empty"),
    ("api_keys", "good,with space", "contains whitespace"),
    ("host", " ", "must not be empty"),
    ("threads", "two", "valid integer"),
    ("max_body_bytes_in_flight", 1024, "is less than max_body_bytes"),
    ("forwarded_allow_ips", "*, 10.0.0.1", "give it alone"),
    ("forwarded_allow_ips", "proxy.local", "not an IP address or network"),
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


def test_the_bodies_bound_follows_a_larger_body_limit_unless_set():
    """A deployment whose max_body_bytes is over the bound's default starts as it did: the bound is then that."""
    assert Settings().max_body_bytes_in_flight == 256 * 1024 * 1024
    assert Settings(max_body_bytes=300 << 20).max_body_bytes_in_flight == 300 << 20
    assert Settings(max_body_bytes_in_flight=0).max_body_bytes_in_flight == 0


def test_trusted_proxies_are_read_as_uvicorn_reads_them():
    """uvicorn takes "10.0.0.1/8" for a host name (trusting nothing) and trusts all only for exactly "*"."""
    assert Settings(forwarded_allow_ips=" 10.0.0.1/8, 127.0.0.1 ").forwarded_allow_ips == "10.0.0.0/8,127.0.0.1/32"
    assert Settings(forwarded_allow_ips=" * ").forwarded_allow_ips == "*"


def test_device_is_normalized():
    assert load_settings(device=" CUDA:1 ").device == "cuda:1"


FLOAT_SETTINGS = [name for name, field in Settings.model_fields.items() if field.annotation is float]


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e300"])
@pytest.mark.parametrize("field", FLOAT_SETTINGS)
def test_every_float_setting_is_finite_and_bounded(monkeypatch, field, value):
    """An infinite max_wait_ms once turned every 429 into a 500 (math.ceil(inf) in Retry-After), and 1e300 into a
    300-digit Retry-After: no float setting takes inf, nan or an absurd value."""
    monkeypatch.setenv(f"VLSERVE_{field.upper()}", value)
    with pytest.raises(ValidationError) as err:
        load_settings()
    message = settings_error_message(err.value)
    assert f"VLSERVE_{field.upper()}" in message and "\n" not in message


def test_the_time_settings_are_the_float_ones_and_their_defaults_are_within_bounds():
    assert {"max_wait_ms", "max_queue_wait_ms", "detector_max_wait_ms", "detector_max_queue_wait_s",
            "body_timeout_s", "shutdown_drain_s", "shutdown_timeout_s"} <= set(FLOAT_SETTINGS)
    load_settings(**{name: Settings.model_fields[name].default for name in FLOAT_SETTINGS})
    assert load_settings(max_wait_ms=10_000, detector_max_queue_wait_s=600).max_wait_ms == 10_000


def test_retry_after_is_a_bounded_whole_number_of_seconds_whatever_the_estimate():
    import math

    from service.batcher import QueueFullError
    from service.errors import RETRY_AFTER_MAX_S, queue_full, retry_after_s

    assert [retry_after_s(s) for s in (0.0, 0.2, 2.5, 599.5)] == [1, 1, 3, 600]
    assert retry_after_s(math.inf) == retry_after_s(1e300) == RETRY_AFTER_MAX_S and retry_after_s(math.nan) == 1
    detail, headers = queue_full(QueueFullError("vqa", "queue full", math.inf))
    assert headers == {"Retry-After": str(RETRY_AFTER_MAX_S)} and f"retry in {RETRY_AFTER_MAX_S} s" in detail


@pytest.mark.parametrize("raw", [" , ,", ",", " ,, "])
def test_api_keys_set_to_separators_only_are_refused_not_an_open_service(monkeypatch, raw):
    monkeypatch.setenv("VLSERVE_API_KEYS", raw)
    with pytest.raises(ValidationError) as err:
        load_settings()
    message = settings_error_message(err.value)
    assert "VLSERVE_API_KEYS" in message and "holds no key" in message
    with pytest.raises(ValidationError):
        load_settings(api_keys=["", " "])


def test_log_level_is_a_setting_with_uvicorns_levels(monkeypatch):
    assert load_settings().log_level == "info"
    monkeypatch.setenv("VLSERVE_LOG_LEVEL", "WARNING")
    assert load_settings().log_level == "warning"
    with pytest.raises(ValidationError) as err:
        load_settings(log_level="bogus")
    message = settings_error_message(err.value)
    assert "VLSERVE_LOG_LEVEL" in message and all(level in message for level in ("'debug'", "'warning'", "'trace'"))


def test_unknown_vlserve_variables_are_named_with_the_setting_they_resemble():
    from service.settings import unknown_variables

    environ = {"VLSERVE_MAX_BACH_SIZE": "1", "VLSERVE_PORT": "80", "VLSERVE_CACHE": "/c", "VLSERVE_PROFILE": "demo",
               "VLSERVE_PACK_CPU_WEIGHTS": "0", "VLSERVE_FROBNICATE": "1", "PATH": "/bin", "MAX_QUEUE": "1"}
    assert unknown_variables(environ) == [
        "VLSERVE_FROBNICATE is not a setting and is ignored",
        "VLSERVE_MAX_BACH_SIZE is not a setting and is ignored; did you mean VLSERVE_MAX_BATCH_SIZE?"]


def test_every_vlserve_variable_the_project_reads_is_a_setting_or_a_known_other_one():
    """The known non-setting variables (OTHER_VARIABLES) are those the project's code, scripts and docs name (the
    tests' own misspelt ones aside): none of them is warned about, and a new one shows up here."""
    import re
    from pathlib import Path

    from service.settings import OTHER_VARIABLES

    root = Path(__file__).resolve().parents[2]
    names = set()
    for path in root.rglob("*"):
        if {".git", "tests"} & set(path.relative_to(root).parts) or not path.is_file() or path.stat().st_size > 1 << 20:
            continue
        if path.suffix in (".py", ".sh", ".md", ".yaml", ".yml", ".toml", ".cfg") or path.name in ("Dockerfile", "Makefile"):
            names |= set(re.findall(r"\bVLSERVE_([A-Z0-9_]*[A-Z0-9])\b", path.read_text(errors="replace")))
    assert {"CACHE", "PROFILE", "PACK_CPU_WEIGHTS", "MAX_WAIT_MS"} <= names
    assert {n for n in names if n.lower() not in Settings.model_fields} <= OTHER_VARIABLES


@pytest.mark.parametrize("url, option", [
    ("redis://:secret@localhost:6379/0?foo=1", "'foo'"),
    ("redis://:secret@localhost:6379/0?decode_responses=True", "'decode_responses'"),  # would arrive as text
    ("redis://:secret@localhost:6379/0?connection_class=x", "'connection_class'"),
    ("rediss://:secret@localhost:6379/0?socket_timeout=2&bogus=1&other=2", "'bogus', 'other'"),
    ("unix:///run/redis.sock?password=secret&socket_keepalive=1", "'socket_keepalive'"),  # TCP only
])
def test_a_redis_url_query_option_redis_py_does_not_take_is_an_invalid_setting(url, option):
    """An unknown option passed redis-py's parse_url and failed at the first connection, a traceback at start-up."""
    with pytest.raises(ValidationError) as err:
        load_settings(redis_url=url)
    message = settings_error_message(err.value)
    assert message.startswith("invalid settings: VLSERVE_REDIS_URL: ") and "\n" not in message
    assert "redis-py takes no query option" in message and option in message and "socket_timeout" in message
    assert "secret" not in message and "***" in message


@pytest.mark.parametrize("url", [
    "redis://:secret@localhost:6379/0?socket_timeout=2&socket_connect_timeout=1&health_check_interval=30",
    "redis://localhost:6379?db=2&client_name=pod&retry_on_timeout=yes&max_connections=8",
    "rediss://localhost:6380/0?ssl_cert_reqs=none&ssl_ca_certs=/etc/ca.pem&ssl_check_hostname=false",
    "unix:///run/redis.sock?db=1&password=secret",
])
def test_the_query_options_redis_py_takes_are_valid_and_connect_as_given(url):
    from redis.asyncio import BlockingConnectionPool

    assert load_settings(redis_url=url).redis_url == url
    BlockingConnectionPool.from_url(url).make_connection()  # every option reaches a connection class that takes it
