"""The text side of every preset at hidden size 384 starts from the pretrained MiniLM-L6 BERT, offline."""
import pytest
import torch
from transformers import BertModel

from models import PRESETS, create_model
from models.text_init import init_text_from_minilm
from models.tokenizer import VLTokenizer, minilm_dir


@pytest.fixture(scope="module")
def minilm():
    return BertModel.from_pretrained(str(minilm_dir())).eval()


@pytest.mark.parametrize("preset", PRESETS)
def test_every_small_preset_takes_minilm_weights(preset, minilm):
    model = create_model(preset, "small")
    keys = init_text_from_minilm(model)
    own = model.state_dict()
    ref = minilm.state_dict()
    assert torch.equal(own["encoder.embeddings.word_embeddings.weight"], ref["embeddings.word_embeddings.weight"])
    q = ref["encoder.layer.5.attention.self.query.weight"]
    assert torch.equal(own["encoder.layer.5.attention.qkv.weight"][: q.shape[0]], q)
    assert len(keys) > 70


def test_a_shallower_encoder_takes_minilms_first_layers(minilm):
    model = create_model("u-visualbert", "small", num_layers=4)
    init_text_from_minilm(model)
    own, ref = model.state_dict(), minilm.state_dict()
    for i in range(4):
        q = ref[f"encoder.layer.{i}.attention.self.query.weight"]
        assert torch.equal(own[f"encoder.layer.{i}.attention.qkv.weight"][: q.shape[0]], q)
    assert not any(k.startswith("encoder.layer.4.") for k in own)


def test_text_stream_reproduces_minilm(minilm):
    """LXMERT with no object or cross layers is exactly MiniLM on the text."""
    model = create_model("lxmert", "small", num_image_layers=0, num_cross_layers=0).eval()
    init_text_from_minilm(model)
    enc = VLTokenizer.pretrained_minilm().encode(["a red circle left of a square", "what shape?"])
    ids, mask, seg = (torch.tensor(enc[k]) for k in ("input_ids", "attention_mask", "token_type_ids"))
    with torch.no_grad():
        ref = minilm(input_ids=ids, attention_mask=mask, token_type_ids=seg)
        out = model.encoder(ids, mask, seg, torch.zeros(2, 1, 512), torch.zeros(2, 1, 4), torch.ones(2, 1))
    real = mask.bool()
    assert torch.allclose(out.text[real], ref.last_hidden_state[real], atol=1e-5)
    assert torch.allclose(out.pooled, ref.pooler_output, atol=1e-5)


def test_width_mismatch_is_refused():
    with pytest.raises(ValueError, match="MiniLM has hidden size 384"):
        init_text_from_minilm(create_model("visualbert", "tiny"))
