"""WordPiece tokenization matches transformers' BertTokenizerFast on the real bert-base-uncased vocab."""
import json
import re

import pytest
from transformers import BertTokenizerFast

from models.tokenizer import VLTokenizer, minilm_dir

TEXTS = [
    "What colour is the LARGE circle?",
    "Is there a blue triangle left of the  square?",
    "naïve café 12,345 don't ÀÉÎ 北京 🙂 tab\there",
    "the left image has more circles than the right image",
    "",
]


@pytest.fixture(scope="module")
def ours():
    return VLTokenizer.pretrained_minilm()


@pytest.fixture(scope="module")
def reference():
    return BertTokenizerFast.from_pretrained(str(minilm_dir()))


@pytest.mark.parametrize("text", TEXTS)
def test_matches_bert_tokenizer(ours, reference, text):
    assert ours.encode([text])["input_ids"][0].tolist() == reference(text)["input_ids"]


def test_pairs_match_bert_tokenizer(ours, reference):
    enc = ours.encode(["what is it?"], pairs=["a red circle"])
    ref = reference("what is it?", "a red circle")
    assert enc["input_ids"][0].tolist() == ref["input_ids"]
    assert enc["token_type_ids"][0].tolist() == ref["token_type_ids"]


def test_answer_slot_sits_before_the_last_sep(ours):
    enc = ours.encode(["what colour?", "is it red or blue or green?"], answer_slot=True)
    for ids, mask in zip(enc["input_ids"], enc["attention_mask"]):
        n = int(mask.sum())
        assert ids[n - 2] == ours.mask_id and ids[n - 1] == ours.sep_id and ids[0] == ours.cls_id


def test_padding_and_truncation(ours):
    enc = ours.encode(["a", "a b c d e f g h i j k l m n o p"], max_length=8)
    assert enc["input_ids"].shape == (2, 8)
    assert enc["attention_mask"][0].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert enc["input_ids"][1, -1] == ours.sep_id
    with pytest.raises(ValueError, match="leaves no room"):
        ours.encode(["a"], pairs=["b c d e f g"], max_length=3)


def test_save_and_reload(ours, tmp_path):
    ours.save(tmp_path)
    again = VLTokenizer.from_dir(tmp_path)
    assert again.encode(TEXTS)["input_ids"].tolist() == ours.encode(TEXTS)["input_ids"].tolist()


def test_word_id_of_a_tag(ours):
    assert ours.word_id("circle") == ours.token_ids("circle")[0]
    assert ours.word_id("") == ours.vocab["[UNK]"]


OPTION_TEXTS = ["café naïve ÀÉÎ Straße", "北京 is a city", "Ünïcödé 東京タワー"]


@pytest.mark.parametrize("options", [
    {"do_lower_case": True, "strip_accents": False},
    {"do_lower_case": False, "strip_accents": True},
    {"do_lower_case": False},
    {"do_lower_case": True, "tokenize_chinese_chars": False},
    {"do_lower_case": True, "strip_accents": None, "tokenize_chinese_chars": True},
])
def test_a_checkpoints_tokenizer_options_give_bert_tokenizers_ids(options, tmp_path):
    """A checkpoint's tokenizer_config.json decides lowercasing, accent stripping and CJK splitting, as it does for
    BertTokenizer: other ids than the checkpoint was trained on would be read otherwise."""
    (tmp_path / "vocab.txt").write_bytes((minilm_dir() / "vocab.txt").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(options))
    ours = VLTokenizer.from_dir(tmp_path)
    reference = BertTokenizerFast(str(tmp_path / "vocab.txt"), **options)
    for text in OPTION_TEXTS:
        assert ours.encode([text])["input_ids"][0].tolist() == reference(text)["input_ids"], text
    ours.save(tmp_path / "saved")
    again = VLTokenizer.from_dir(tmp_path / "saved")
    assert again.encode(OPTION_TEXTS)["input_ids"].tolist() == ours.encode(OPTION_TEXTS)["input_ids"].tolist()


@pytest.mark.parametrize("options, message", [
    ({"do_lower_case": "false"}, 'do_lower_case must be bool, not "false"'),
    ({"strip_accents": 1}, "strip_accents must be bool or null, not 1"),
    ({"tokenize_chinese_chars": None}, "tokenize_chinese_chars must be bool, not null"),
    ({"max_length": True}, "max_length must be int, not true"),
    ({"max_length": 0}, "max_length must be >= 1, not 0"),
])
def test_tokenizer_options_of_the_wrong_type_name_the_key(options, message, tmp_path):
    (tmp_path / "vocab.txt").write_bytes((minilm_dir() / "vocab.txt").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(options))
    with pytest.raises(ValueError, match=re.escape(f"tokenizer_config.json: {message}")):
        VLTokenizer.from_dir(tmp_path)
