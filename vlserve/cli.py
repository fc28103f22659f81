"""The `vlserve` console script: one entry point, one module per subcommand under vlserve/commands/."""
from __future__ import annotations

import inspect
import logging

import typer

from service.settings import LOG_TEXT_FORMAT
from vlserve import __version__
from vlserve.commands.analyze import app as analyze_app
from vlserve.commands.import_cmd import app as import_app
from vlserve.commands.eval import app as eval_app
from vlserve.commands.export import export
from vlserve.commands.extract import extract
from vlserve.commands.info import info
from vlserve.commands.serve import serve
from vlserve.commands.train import app as train_app
from vlserve.commands.zoo import app as zoo_app

def reflowed(text: str | None) -> str | None:
    """A help text with each paragraph's lines joined, for the terminal to wrap: Typer's rich help keeps the source's
    line breaks after the first paragraph, which would break a docstring's lines twice, at its width and the
    terminal's. A paragraph that begins with \b (click's mark for text kept as written) is left alone."""
    if not text:
        return text
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(p if p.startswith("\b") else " ".join(line.strip() for line in p.splitlines())
                       for p in paragraphs)


def reflow_help(command) -> None:
    """Reflow the help of `command` and of every command under it."""
    command.help = reflowed(command.help)
    for sub in getattr(command, "commands", {}).values():
        reflow_help(sub)


class App(typer.Typer):
    """The CLI, its help texts reflowed."""

    def __call__(self, *args, **kwargs):
        try:
            command = typer.main.get_command(self)
        except KeyboardInterrupt:  # Ctrl-C before the command runs (which Typer's own handling covers)
            raise SystemExit(130) from None
        reflow_help(command)
        return command(*args, **kwargs)


app = App(
    help="vlserve: serve VisualBERT, VL-BERT, ViLBERT, LXMERT and U-VisualBERT models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def main(quiet: bool = typer.Option(False, "--quiet", "-q", help="only warnings and errors in the log")) -> None:
    """Log progress (evaluations, checkpoints) to stderr."""
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, format=LOG_TEXT_FORMAT)


app.add_typer(import_app, name="import")  # its help: import_cmd.app's, written once there
app.command("info")(info)
app.command("extract")(extract)
app.command("export")(export)
app.add_typer(train_app, name="train")
app.add_typer(zoo_app, name="zoo")
app.add_typer(eval_app, name="eval")
app.add_typer(analyze_app, name="analyze")
app.command("serve")(serve)


@app.command("version")
def version() -> None:
    """Print the vlserve version."""
    typer.echo(__version__)


if __name__ == "__main__":
    app()
