"""WordPiece tokenization matches transformers' BertTokenizerFast on the real bert-base-uncased vocab."""
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
