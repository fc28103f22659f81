"""`vlserve serve`: start-up problems exit 2 with one message; SIGTERM lets an in-flight request finish."""
from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from typer.testing import CliRunner

from tests.service.conftest import free_port, wait_until_ready
from vlserve.cli import app as cli


@pytest.fixture
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("VLSERVE_"):
            monkeypatch.delenv(name)


def serve(*args: str):
    return CliRunner().invoke(cli, ["serve", *map(str, args)])


def test_half_a_model_set_exits_2_with_the_demo_message(clean_env, tiny_checkpoint):
    result = serve("--model-dir", tiny_checkpoint)  # an encoder without its detector
    assert result.exit_code == 2 and "no detector given for the encoder" in result.output
    assert "`vlserve serve` then serves the demo model set" in result.output


def cached_set(root, name: str, checkpoint, detector) -> None:
    """A built model set `name` in the cache at `root`, as training.zoo.is_built reads one: the detector, the encoder
    trained on its regions with its metrics, and the model card."""
    import shutil

    from training.zoo import CARD, is_built

    out = root / "zoo" / name
    shutil.copytree(checkpoint, out / "encoder")
    shutil.copytree(detector, out / "detector")
    (out / "encoder" / "metrics.json").write_text("{}")
    (out / CARD).write_text(f"# {name}\n")
    assert is_built(out)


@pytest.fixture
def no_build(monkeypatch):
    """A test that builds a model set (minutes) fails instead."""
    import training.zoo

    def build_zoo(*args, **kwargs):
        raise AssertionError("the test started building a model set")

    monkeypatch.setattr(training.zoo, "build_zoo", build_zoo)


def test_no_model_given_uses_the_cached_demo_set(clean_env, monkeypatch, tmp_path, tiny_checkpoint, tiny_detector,
                                                 no_build):
    """With neither directory set, serve resolves the demo model set in the cache (built there on first use)."""
    from vlserve.commands.serve import zoo_model_dirs

    monkeypatch.setenv("VLSERVE_CACHE", str(tmp_path))
    demo = tmp_path / "zoo" / "demo"
    cached_set(tmp_path, "demo", tiny_checkpoint, tiny_detector.dir)
    assert zoo_model_dirs() == {"model_dir": demo / "encoder", "detector_dir": demo / "detector"}


def test_profile_serves_that_model_set_of_the_cache(clean_env, monkeypatch, tmp_path, tiny_checkpoint, tiny_detector,
                                                    no_build):
    """--profile / VLSERVE_PROFILE picks the zoo's model set; an unknown one, or one beside explicit directories,
    exits 2 with one message before anything is built or loaded."""
    import vlserve.commands.serve as serve_command

    monkeypatch.setenv("VLSERVE_CACHE", str(tmp_path))
    full = tmp_path / "zoo" / "full"
    cached_set(tmp_path, "full", tiny_checkpoint, tiny_detector.dir)
    started = []
    monkeypatch.setattr(serve_command, "run_server", lambda settings, log_level="info": started.append(settings) or 0)
    assert serve("--profile", "full").exit_code == 0
    monkeypatch.setenv("VLSERVE_PROFILE", "full")
    assert serve().exit_code == 0
    assert [(s.model_dir, s.detector_dir) for s in started] == [(full / "encoder", full / "detector")] * 2

    unknown = serve("--profile", "huge")
    assert unknown.exit_code == 2 and "unknown profile 'huge'" in unknown.output and "demo, pretrained, full" in unknown.output
    both = serve("--profile", "full", "--model-dir", tiny_checkpoint, "--detector-dir", tiny_detector.dir)
    assert both.exit_code == 2 and "not both" in both.output and "Traceback" not in both.output
    assert len(started) == 2 and not (tmp_path / "zoo" / "huge").exists() and not (tmp_path / "zoo" / "demo").exists()


def test_engine_cache_dir_option_is_documented_and_reaches_the_settings(clean_env, monkeypatch, tmp_path, tiny_checkpoint,
                                                                        tiny_detector):
    import vlserve.commands.serve as serve_command

    monkeypatch.setenv("COLUMNS", "200")
    help_text = serve("--help").output
    assert "--engine-cache-dir" in help_text and "VLSERVE_ENGINE_CACHE_DIR" in help_text

    started = []
    monkeypatch.setattr(serve_command, "run_server", lambda settings, log_level="info": started.append(settings) or 0)
    models = ("--model-dir", tiny_checkpoint, "--detector-dir", tiny_detector.dir)
    assert serve(*models, "--engine-cache-dir", tmp_path / "engines").exit_code == 0
    monkeypatch.setenv("VLSERVE_ENGINE_CACHE_DIR", str(tmp_path / "from-env"))
    assert serve(*models).exit_code == 0
    assert [s.engine_cache_dir for s in started] == [tmp_path / "engines", tmp_path / "from-env"]
    assert "--precision" in help_text and "bfloat16" in help_text
    assert serve(*models, "--precision", "fp32").exit_code == 0 and started[-1].precision == "fp32"
    assert started[0].precision == "auto"


def test_each_option_states_the_default_the_settings_define():
    """The defaults in `vlserve serve --help` are read from Settings, so they cannot drift from what serves (the help
    once said --max-batch-size defaults to 32 when Settings said 8)."""
    import typer

    from service.settings import MiB, Settings

    command = typer.main.get_command(cli).commands["serve"]
    stated = 0
    for param in command.params:
        field = Settings.model_fields.get(param.name)
        if field is None or field.default is None or field.default_factory is not None:
            continue
        value = field.default
        text = ("on" if value else "off") if isinstance(value, bool) else \
            f"{value // MiB} MiB" if isinstance(value, int) and value >= MiB and value % MiB == 0 else \
            f"{value:g}" if isinstance(value, float) else str(value)
        assert param.help.endswith(f"(default {text})"), (param.name, param.help)
        assert param.help.count("(default") == 1, param.help
        stated += 1
    options = {param.name for param in command.params}
    assert set(Settings.model_fields) <= options, set(Settings.model_fields) - options  # every setting is an option
    assert stated >= 25
    assert "(default 8)" in command.params[[p.name for p in command.params].index("max_batch_size")].help


def test_invalid_settings_exit_2_naming_each_field(clean_env, tmp_path):
    result = serve("--threads", "0", "--redis-url", "http://nope", "--model-dir", tmp_path / "missing")
    assert result.exit_code == 2
    for name in ("VLSERVE_THREADS", "VLSERVE_REDIS_URL", "VLSERVE_MODEL_DIR"):
        assert name in result.output
    assert "Traceback" not in result.output


def test_checkpoint_for_another_detector_exits_2(clean_env, tmp_path, tiny_checkpoint, make_detector):
    other = make_detector(tmp_path / "other", seed=3)
    result = serve("--model-dir", tiny_checkpoint, "--detector-dir", other.dir, "--port", "0", "--log-level", "critical")
    assert result.exit_code == 2 and other.fingerprint in result.output and "Traceback" not in result.output


def test_sigterm_finishes_the_request_in_flight(clean_env, tiny_checkpoint, tiny_detector, image_png):
    port = free_port()
    cmd = [sys.executable, "-m", "vlserve.cli", "serve", "--model-dir", str(tiny_checkpoint), "--detector-dir",
           str(tiny_detector.dir), "--port", str(port), "--threads", "1", "--log-level", "warning",
           "--shutdown-drain-s", "0.3"]  # the drain ends while the request is still arriving: it finishes in uvicorn's shutdown
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(proc, base, proc.stdout.read)
        answer = {}
        body = json.dumps({"image": base64.b64encode(image_png).decode(), "question": "what color?"}).encode()

        def slow_body():  # the request is in flight while its body arrives (an idle encoder never keeps it waiting)
            yield body[:100]
            time.sleep(1.5)
            yield body[100:]

        request = threading.Thread(target=lambda: answer.update(r=httpx.post(
            f"{base}/vqa", content=slow_body(), headers={"content-type": "application/json"}, timeout=30)))
        request.start()
        time.sleep(0.7)  # the service has the request's first bytes and waits for the rest
        proc.send_signal(signal.SIGTERM)
        request.join(30)
        assert answer["r"].status_code == 200, answer["r"].text
        assert answer["r"].elapsed.total_seconds() >= 1.4, "the request was still arriving when SIGTERM came"
        assert proc.wait(30) == 0
        with pytest.raises(httpx.TransportError):  # no longer accepting
            httpx.get(f"{base}/healthz", timeout=1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_cache_root_that_cannot_hold_the_demo_set_exits_2_before_building(clean_env, monkeypatch, tmp_path):
    """No model given and VLSERVE_CACHE a file (or under one): one line naming it and exit 2, nothing built."""
    import training.zoo

    built = []

    def build_zoo(*args, **kwargs):
        built.append(args)
        raise NotADirectoryError(20, "Not a directory")  # what building under a file ends in

    monkeypatch.setattr(training.zoo, "build_zoo", build_zoo)
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    for root in (afile, afile / "below"):
        monkeypatch.setenv("VLSERVE_CACHE", str(root))
        result = serve("--port", "0")
        assert result.exit_code == 2, result.output
        assert f"VLSERVE_CACHE={root}: not a writable directory" in result.output and "Traceback" not in result.output
        assert len(result.output.strip().splitlines()) == 1
    assert built == []


def test_log_level_is_validated_and_read_from_the_environment_as_every_option(clean_env, monkeypatch,
                                                                             tiny_checkpoint, tiny_detector):
    import vlserve.commands.serve as serve_command

    started = []
    monkeypatch.setattr(serve_command, "run_server", lambda settings, log_level=None: started.append(settings) or 0)
    models = ("--model-dir", tiny_checkpoint, "--detector-dir", tiny_detector.dir)
    bogus = serve(*models, "--log-level", "bogus")
    assert bogus.exit_code == 2 and "Traceback" not in bogus.output
    assert "VLSERVE_LOG_LEVEL" in bogus.output and "'critical', 'error', 'warning', 'info', 'debug' or 'trace'" in bogus.output
    monkeypatch.setenv("VLSERVE_LOG_LEVEL", "bogus")
    assert serve(*models).exit_code == 2 and not started
    monkeypatch.setenv("VLSERVE_LOG_LEVEL", "warning")
    assert serve(*models).exit_code == 0
    assert serve(*models, "--log-level", "debug").exit_code == 0
    assert [s.log_level for s in started] == ["warning", "debug"]


def test_unknown_vlserve_variables_are_warned_about_at_start_up(clean_env, monkeypatch, tiny_checkpoint, tiny_detector):
    import vlserve.commands.serve as serve_command

    monkeypatch.setattr(serve_command, "run_server", lambda settings, log_level=None: 0)
    monkeypatch.setenv("VLSERVE_MAX_BACH_SIZE", "1")
    monkeypatch.setenv("VLSERVE_PACK_CPU_WEIGHTS", "0")  # read by the model code: no warning
    monkeypatch.setenv("VLSERVE_MAX_QUEUE", "4")
    result = serve("--model-dir", tiny_checkpoint, "--detector-dir", tiny_detector.dir)
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.output.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: VLSERVE_MAX_BACH_SIZE is not a setting and is ignored; did you mean "
                        "VLSERVE_MAX_BATCH_SIZE?"]


def test_api_keys_of_separators_only_exit_2_rather_than_serve_an_open_service(clean_env, monkeypatch, tiny_checkpoint,
                                                                            tiny_detector):
    import vlserve.commands.serve as serve_command

    started = []
    monkeypatch.setattr(serve_command, "run_server", lambda settings, log_level=None: started.append(settings) or 0)
    monkeypatch.setenv("VLSERVE_API_KEYS", " , ,")
    result = serve("--model-dir", tiny_checkpoint, "--detector-dir", tiny_detector.dir)
    assert result.exit_code == 2 and "VLSERVE_API_KEYS" in result.output and "holds no key" in result.output
    assert not started and "Traceback" not in result.output


def test_serve_raises_its_open_files_limit_to_the_hard_one(caplog):
    """Every connection is a file descriptor; where they ran out at a soft limit of 64 (1024 is common) the event
    loop closed new connections without a word, with a hard limit of 20,000 unused."""
    import logging
    import resource

    from vlserve.commands.serve import raise_open_files_limit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
    try:
        with caplog.at_level(logging.INFO, logger="vlserve.app"):
            raise_open_files_limit()
        raised = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert raised == (hard if hard != resource.RLIM_INFINITY else 1 << 20) > 64
    assert "soft limit raised from 64" in caplog.text
