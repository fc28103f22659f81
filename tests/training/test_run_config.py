"""Run configs are the one source of the training commands' options: every field an option, its default and help."""
import dataclasses

import pytest
import typer.main

from models.config import HEAD_POOLS
from training.run_config import FinetuneConfig, PretrainConfig, RunConfig, field_choices, parse_curriculum, parse_tasks
from vlserve.cli import app


def options(*path: str) -> dict:
    """The options of `vlserve PATH...`, by parameter name."""
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    return {p.name: p for p in command.params if p.param_type_name == "option"}


@pytest.mark.parametrize("command, cls", [("finetune", FinetuneConfig), ("pretrain", PretrainConfig)])
def test_every_field_is_an_option_with_the_fields_default_and_help(command, cls):
    generated = options("train", command)
    fields = dataclasses.fields(cls)
    assert set(generated) == {f.name for f in fields}
    for f in fields:
        option, default = generated[f.name], f.default if f.default is not dataclasses.MISSING else f.default_factory()
        assert option.help.startswith(f.metadata["help"]) and f.metadata["help"]
        if f.name in ("out", "detector_dir"):
            assert option.required
        elif f.metadata["show"]:
            assert f.metadata["parse"](option.default) == default  # given as a string, read back to the field
        else:
            assert option.default == default
    assert "--detector" in generated["detector_dir"].opts  # a field may name its option


def test_choices_come_from_the_literal_types():
    assert field_choices(FinetuneConfig, "vqa_pool") == HEAD_POOLS  # the VQA head's pools, as the model knows them
    assert field_choices(FinetuneConfig, "rank_pool") == ("pooled", "regions")
    assert "(one of visualbert, vl-bert, vilbert, lxmert, u-visualbert)" in options("train", "finetune")["preset"].help


def test_eval_and_zoo_take_the_shared_options_from_run_config():
    for path in (("eval", "encoder"), ("eval", "detector"), ("zoo", "build")):
        threads = options(*path)["threads"]
        assert (threads.default, threads.help) == (RunConfig.threads, "torch threads")
    assert options("zoo", "build")["device"].default == RunConfig.device


def test_list_options_read_back_what_they_show():
    assert parse_tasks("vqa:1, itm_rank:0.5") == {"vqa": 1.0, "itm_rank": 0.5}
    assert parse_curriculum("positions_one_side=200,refer+positions=100") == \
        ((200, ("positions_one_side",)), (100, ("refer", "positions")))
    with pytest.raises(ValueError, match="is not TASKS=STEPS"):
        parse_curriculum("positions")
    with pytest.raises(ValueError, match="is not a task:weight list"):
        parse_tasks("vqa")
