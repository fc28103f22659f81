"""Query-bank normalisation (models.query_bank): hand-computed priors and scores, and the bank in labels.json."""
import json
import math

import numpy as np
import pytest

from models import create_model
from models.checkpoint import CONFIG, LABELS, WEIGHTS, CheckpointError, load_checkpoint, save_checkpoint, write_manifest
from models.query_bank import BANK_KEY, QueryBank, image_prior, normalised
from models.tokenizer import TOKENIZER_FILES, VLTokenizer


def test_prior_and_normalised_scores_by_hand():
    bank = np.array([[0.0, 2.0], [math.log(3), 2.0]])  # 2 bank captions x 2 images
    prior = image_prior(bank, 1.0)
    assert prior == pytest.approx([math.log(1 + 3), 2 + math.log(2)])
    # image 0: exp(s) = 4 against the bank's 1 + 3 -> a half; image 1: exp(s) = e^2 against 2 e^2 -> a third
    assert normalised(np.array([math.log(4), 2.0]), prior, 1.0) == pytest.approx([math.log(1 / 2), math.log(1 / 3)])
    # temperature 2 halves every score first
    assert image_prior(bank[:, 0], 2.0) == pytest.approx(math.log(1 + math.sqrt(3)))
    assert normalised(np.array(math.log(9)), image_prior(bank[:, 0], 2.0), 2.0) == pytest.approx(
        math.log(3 / (1 + math.sqrt(3) + 3)))


def test_a_hub_image_loses_its_lead():
    """Raw scores put the hub (image 0) first; its high scores with the bank put the true image first after."""
    bank = np.array([[5.0, 0.0], [5.0, 0.0], [4.0, -1.0]])
    scores = np.array([3.0, 2.0])
    assert scores.argmax() == 0 and normalised(scores, image_prior(bank, 1.0), 1.0).argmax() == 1


def test_large_scores_stay_finite():
    prior = image_prior(np.array([[900.0], [1000.0]]), 1.0)
    out = normalised(np.array([[1000.0], [-1000.0]]), prior, 1.0)
    assert np.isfinite(out).all() and out[0, 0] == pytest.approx(math.log(1 / 2), abs=1e-9)  # e^900 is nothing beside e^1000


@pytest.mark.parametrize("entry, message", [
    ({"texts": [], "temperature": 1.0}, "at least one caption"),
    ({"texts": ["a red circle", "  "], "temperature": 1.0}, "non-empty string"),
    ({"texts": ["a red circle"], "temperature": 0}, "positive number"),
    ({"texts": "a red circle"}, "list of texts"),
])
def test_bad_banks_are_refused(entry, message):
    with pytest.raises(ValueError, match=message):
        QueryBank.from_labels({BANK_KEY: entry})


def test_the_bank_travels_in_labels_json_and_a_bad_one_fails_the_load(tmp_path):
    model = create_model("visualbert", "tiny", visual_feat_dim=8, heads={"itm": {"kind": "itm"}})
    bank = QueryBank(("a red circle", "two blue squares"), 0.5)
    out = save_checkpoint(model, tmp_path / "ckpt", VLTokenizer.pretrained_minilm(), labels={BANK_KEY: bank.to_labels()})
    assert QueryBank.from_labels(load_checkpoint(out).labels) == bank
    assert QueryBank.from_labels({}) is None
    with pytest.raises(CheckpointError, match="at least one caption"):  # the writer refuses it too
        save_checkpoint(model, tmp_path / "bad", VLTokenizer.pretrained_minilm(), labels={BANK_KEY: {"texts": []}})
    manifest = json.loads((out / "manifest.json").read_text())
    (out / LABELS).write_text(json.dumps({BANK_KEY: {"texts": ["a"], "temperature": -1}}))
    write_manifest(out, [CONFIG, WEIGHTS, LABELS, *TOKENIZER_FILES], {k: v for k, v in manifest.items() if k not in (
        "files", "format_version", "code_version", "torch_version")})
    with pytest.raises(CheckpointError, match=r"labels.json: a query bank's temperature must be a positive number"):
        load_checkpoint(out)
