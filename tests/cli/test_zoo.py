"""`vlserve zoo build` options: --root moves every cache the build writes, unknown profiles exit 2."""
import os

from typer.testing import CliRunner

import training.zoo
from training.data.shapes_cache import cache_root
from vlserve.cli import app

runner = CliRunner()


def test_root_is_the_cache_root_of_the_whole_build(tmp_path, monkeypatch):
    seen = {}

    def build_zoo(profile, root, force=False, threads=2, progress=True):
        seen.update(profile=profile, root=root, cache=cache_root())  # where data and region features will go
        return root / "zoo" / profile

    monkeypatch.delenv("VLSERVE_CACHE", raising=False)
    monkeypatch.setattr(training.zoo, "build_zoo", build_zoo)
    result = runner.invoke(app, ["zoo", "build", "--root", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert seen == {"profile": "demo", "root": tmp_path, "cache": tmp_path}
    monkeypatch.delenv("VLSERVE_CACHE", raising=False)  # the command set it for its own process
    assert "VLSERVE_CACHE" not in os.environ


def test_unknown_profile_exits_2():
    result = runner.invoke(app, ["zoo", "build", "--profile", "huge"])
    assert result.exit_code == 2 and "unknown profile 'huge'" in result.output
