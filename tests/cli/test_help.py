"""The console script's help as a terminal shows it: each paragraph of a command's description flows at the
terminal's width (Typer's rich help kept the docstring's own line breaks after the first paragraph, so lines broke
twice: at the docstring's width and the terminal's)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("command,words", [
    ("serve", "The port answers while the models load (/healthz 200, /readyz 503)"),
    ("export", "or another export is writing --out. SIGTERM, as Ctrl-C, removes what was started"),
])
def test_a_commands_paragraphs_flow_at_the_terminals_width(command, words):
    env = {**os.environ, "COLUMNS": "250", "TERM": "dumb", "NO_COLOR": "1"}
    shown = subprocess.run([sys.executable, "-m", "vlserve.cli", command, "--help"], env=env, capture_output=True,
                           text=True, check=True).stdout
    assert words in shown, shown
