"""What the transformers importers share: reading a `save_pretrained` directory and writing our checkpoint.

A source directory holds config.json and model.safetensors or pytorch_model.bin (or their sharded
`*.index.json` form). Every source tensor is either mapped, checked as a tied copy, or listed under
`import.ignored_keys` in the manifest: nothing is dropped silently. The original LXMERT importer reads its
`.pth` files through the same HFSource (lxmert_original.py).
"""
from __future__ import annotations

import json
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from ..checkpoint import CheckpointError, load_state_strict, save_checkpoint
from ..config import EncoderConfig, HeadConfig, ModelConfig
from ..registry import encoder_config
from ..tokenizer import VLTokenizer
from ..vl_model import VLModel
from .keymap import KeyMap, apply_keymap, linear

CONFIG_FILE = "config.json"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # preferred first
SHARD_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_MISSING = object()


class HFImportError(CheckpointError):
    """A public checkpoint (or its answer table) that cannot be imported; the message names the file or field."""


@dataclass
class HFSource:
    """A transformers checkpoint directory, read: its config.json and every tensor of its weights."""

    path: Path
    config: dict[str, Any]
    state: dict[str, torch.Tensor]
    weights_file: str  # the file (or shard index) the tensors came from
    used: set[str] = field(default_factory=set)  # source keys consumed so far
    keymap: KeyMap = field(default_factory=dict)  # every mapping taken so far (our key -> source keys)
    config_file: str = CONFIG_FILE  # the file `config` came from, named in errors

    @property
    def config_path(self) -> Path:
        return self.path / self.config_file

    @property
    def weights_path(self) -> Path:
        return self.path / self.weights_file

    def get(self, name: str, kind: type = int, default: Any = _MISSING, least: int | None = None) -> Any:
        """A typed config.json field; a missing (without default) or ill-typed one fails naming it, and so does a
        number below `least` (a size the model reads 0 of as "derived from another field" needs least=1)."""
        value = self.config.get(name)
        if value is None:
            if default is _MISSING:
                raise HFImportError(f"{self.config_path}: field {name!r} is missing")
            return default
        numeric = (int, float) if kind is float else kind  # JSON writes 0.0 as 0
        if not isinstance(value, numeric) or (isinstance(value, bool) and kind is not bool):
            raise HFImportError(f"{self.config_path}: field {name!r} is {value!r}, expected {kind.__name__}")
        if least is not None and value < least:
            raise HFImportError(f"{self.config_path}: field {name!r} is {value!r}, expected at least {least}")
        return float(value) if kind is float else value

    def architecture(self, supported: tuple[str, ...], fmt: str) -> str | None:
        """The first architecture config.json names (None when it names none); one we do not read fails."""
        names = self.get("architectures", list, default=[])
        if not names:
            return None
        if names[0] not in supported:
            raise HFImportError(
                f"{self.config_path}: unsupported architecture {names[0]!r}; {fmt} reads {', '.join(supported)}"
            )
        return names[0]

    def prefix(self, base: str) -> str:
        """'base.' when the tensors sit under the backbone's attribute (task models), '' for the bare backbone."""
        return f"{base}." if any(k.startswith(f"{base}.") for k in self.state) else ""

    def has(self, key: str) -> bool:
        return key in self.state

    def rows(self, key: str) -> int:
        if key not in self.state:
            raise HFImportError(f"{self.weights_path}: tensor {key} is missing")
        return int(self.state[key].shape[0])

    def take(self, keymap: KeyMap) -> dict[str, torch.Tensor]:
        """Our tensors from the key map; a source tensor it needs and the file lacks fails naming both."""
        try:
            out = apply_keymap(keymap, self.state)
        except (KeyError, ValueError) as exc:
            raise HFImportError(f"{self.weights_path}: {exc.args[0]}") from None
        self.used.update(s for srcs in keymap.values() for s in srcs)
        self.keymap |= keymap
        return out

    def check_shapes(self, target: dict[str, torch.Tensor]) -> None:
        """Each mapped source tensor has the shape its share of our tensor needs (fused ones split dim 0 evenly);
        a wrong one fails naming the source tensor."""
        for dst, srcs in self.keymap.items():
            if dst not in target:
                continue  # load_state_strict names a tensor our model lacks
            want = (target[dst].shape[0] // len(srcs), *target[dst].shape[1:])
            for src in srcs:
                if tuple(self.state[src].shape) != want:
                    raise HFImportError(
                        f"{self.weights_path}: tensor {src} has shape {tuple(self.state[src].shape)}, the model needs {want}"
                    )

    def tied(self, key: str, to: str) -> None:
        """A tensor transformers saves as a copy of another (a tied decoder): accept it only if it is one."""
        if key not in self.state:
            return
        if to not in self.state or not torch.equal(self.state[key], self.state[to]):
            raise HFImportError(
                f"{self.weights_path}: {key} is not tied to {to}; vlserve's masked-LM decoder shares that tensor"
            )
        self.used.add(key)

    def ignored(self) -> list[str]:
        return sorted(set(self.state) - self.used)


def load_weight_file(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file, or a torch.save pickle read with weights_only: it may hold tensors and containers only."""
    try:
        if path.suffix == ".safetensors":
            return load_file(str(path), device="cpu")
        state = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:  # weights_only met a class: a pickled object, never unpickled here
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        what = found.group(1) if found else "an object weights_only loading refuses"
        raise HFImportError(
            f"{path}: unreadable weights: the pickle holds {what}, not only tensors (vlserve unpickles plain "
            "tensor dictionaries only)"
        ) from None
    except Exception as exc:  # safetensors/IO errors, a truncated zip or pickle
        first = re.split(r"(?<=\.)\s", (str(exc).strip().splitlines() or [""])[0])[0]
        raise HFImportError(f"{path}: unreadable weights, truncated or corrupt ({type(exc).__name__}: {first})") from None
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise HFImportError(f"{path}: not a state dict (a dictionary of tensors by name)")
    return state


def _load_weights(src: Path) -> tuple[dict[str, torch.Tensor], str]:
    for name in WEIGHT_FILES:
        if (src / name).is_file():
            return load_weight_file(src / name), name
    for name in SHARD_INDEXES:
        index = src / name
        if index.is_file():
            try:
                shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
            except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
                raise HFImportError(f"{index}: not a valid shard index ({exc})") from None
            # a shard is a file beside the index: no other type, no directory part (nothing read outside SRC)
            other = next((shard for shard in shards if not isinstance(shard, str) or Path(shard).name != shard), None)
            if other is not None:
                raise HFImportError(f"{index}: not a valid shard index (weight_map gives {other!r}, not a file name "
                                    "beside it)")
            state: dict[str, torch.Tensor] = {}
            for shard in sorted(shards):
                if not (src / shard).is_file():
                    raise HFImportError(f"{index}: lists shard {shard}, which is missing")
                state.update(load_weight_file(src / shard))
            return state, name
    raise HFImportError(f"{src}: no weights file (looked for {', '.join(WEIGHT_FILES + SHARD_INDEXES)})")


def read_config(path: Path) -> dict[str, Any]:
    """A JSON object file (config.json, bert_config.json)."""
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HFImportError(f"{path}: invalid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise HFImportError(f"{path}: expected a JSON object")
    return config


def read_source(src: str | Path, model_type: str) -> HFSource:
    """Read a transformers checkpoint directory whose config.json has `model_type` (when it states one)."""
    src = Path(src)
    if not src.is_dir():
        raise HFImportError(f"{src}: not a directory (expected a transformers save_pretrained directory)")
    cfg_path = src / CONFIG_FILE
    if not cfg_path.is_file():
        raise HFImportError(f"{src}: missing file {CONFIG_FILE}")
    config = read_config(cfg_path)
    found = config.get("model_type")
    if found is not None and found != model_type:
        raise HFImportError(f"{cfg_path}: model_type is {found!r}, this importer reads {model_type!r}")
    state, weights_file = _load_weights(src)
    return HFSource(path=src, config=config, state=state, weights_file=weights_file)


def tensor_shape(source: HFSource, key: str) -> tuple[int, ...]:
    source.rows(key)  # fails naming a missing tensor
    return tuple(source.state[key].shape)


def layer_count(source: HFSource, stack: str) -> int:
    """Layers of a ModuleList from its keys (`{stack}.{i}.`): the highest index + 1. A layer with no tensor below
    the highest fails naming it, so a stray high index cannot make a model of that many layers."""
    pattern = re.compile(re.escape(stack) + r"\.(\d+)\.")
    found = {int(m.group(1)) for key in source.state if (m := pattern.match(key))}
    count = max(found, default=-1) + 1
    if len(found) != count:
        gap = next(i for i in range(count) if i not in found)
        raise HFImportError(f"{source.weights_path}: tensors of {stack}.{count - 1} but none of {stack}.{gap}")
    return count


def stated_layers(source: HFSource, name: str, stack: str, default: Any = _MISSING) -> int:
    """The layer count a config field states, which must be the count the weights hold under `stack`: checked before
    any model is built, so that a config with fewer layers drops none silently and one with more fails at once."""
    stated = source.get(name, default=default)
    held = layer_count(source, stack)
    if stated != held:
        raise HFImportError(f"{source.config_path}: {name} is {stated}, but the weights have {held} ({stack}.*)")
    return stated


def bert_fields(source: HFSource, layer_norm_eps: float | None = None) -> dict[str, Any]:
    """EncoderConfig fields of a BERT-style transformers config (sizes, dropout, LayerNorm eps)."""
    act = source.get("hidden_act", str, default="gelu")
    if act != "gelu":
        raise HFImportError(f"{source.config_path}: hidden_act {act!r} is not supported (vlserve layers use exact GELU)")
    return dict(
        vocab_size=source.get("vocab_size"),
        hidden_size=source.get("hidden_size"),
        num_heads=source.get("num_attention_heads"),
        intermediate_size=source.get("intermediate_size"),
        max_position_embeddings=source.get("max_position_embeddings", default=512),
        type_vocab_size=source.get("type_vocab_size", default=2),
        layer_norm_eps=layer_norm_eps if layer_norm_eps is not None else source.get("layer_norm_eps", float, default=1e-12),
        dropout=source.get("hidden_dropout_prob", float, default=0.1),
        attention_dropout=source.get("attention_probs_dropout_prob", float, default=0.1),
    )


def build_encoder_config(source: HFSource, preset: str, fields: dict[str, Any]) -> EncoderConfig:
    """Size "base" when the transformer sizes equal our registered BERT-base preset, else "custom"."""
    base = encoder_config(preset, "base")
    sizes = ("hidden_size", "num_layers", "num_heads", "intermediate_size", "num_image_layers", "num_cross_layers")
    size = "base" if all(fields.get(s, getattr(base, s)) == getattr(base, s) for s in sizes) else "custom"
    try:
        return EncoderConfig(preset=preset, size=size, **fields)
    except ValueError as exc:
        raise HFImportError(f"{source.config_path}: {exc}") from None


def pretraining_heads(source: HFSource, word_embeddings: str, p: str = "") -> tuple[dict[str, HeadConfig], KeyMap]:
    """BERT pretraining heads under `{p}cls.`: masked LM (decoder tied to the word embeddings) and ITM."""
    heads: dict[str, HeadConfig] = {}
    keymap: KeyMap = {}
    cls = f"{p}cls"
    if source.has(f"{cls}.predictions.transform.dense.weight"):
        heads["mlm"] = HeadConfig(kind="mlm")
        keymap |= linear("heads.mlm.transform.dense", f"{cls}.predictions.transform.dense")
        keymap |= linear("heads.mlm.transform.LayerNorm", f"{cls}.predictions.transform.LayerNorm")
        keymap["heads.mlm.bias"] = [f"{cls}.predictions.bias"]
        source.tied(f"{cls}.predictions.decoder.weight", word_embeddings)
        source.tied(f"{cls}.predictions.decoder.bias", f"{cls}.predictions.bias")
    if source.has(f"{cls}.seq_relationship.weight"):
        heads["itm"] = HeadConfig(kind="itm")
        keymap |= linear("heads.itm.seq_relationship", f"{cls}.seq_relationship")
    return heads, keymap


def answer_labels(source: HFSource, count: int) -> list[str]:
    """Answer names from config.json's id2label when it covers every answer, else "0", "1", ..."""
    id2label = source.config.get("id2label")
    if isinstance(id2label, dict) and len(id2label) == count:
        names = [id2label.get(str(i)) for i in range(count)]
        if all(isinstance(name, str) for name in names):  # a null or missing label would be served as "None"
            return names
    return [str(i) for i in range(count)]


def read_answers(path: str | Path) -> list[str]:
    """Answer names by output index from an answer table: a JSON list of answers (VQA's and GQA's
    trainval_label2ans.json), LXMERT's all_ans.json (a list of {"ans": ...}, its 9500-way pretraining head), an
    answer -> index object (trainval_ans2label.json) whose indices are 0..N-1, or a `.txt` file of one answer a line
    (Pythia's answers_vqa.txt, which transformers' VisualBERT demo reads)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")  # skips a byte-order mark, as Windows editors write
        if path.suffix.lower() == ".txt":
            return answer_lines(path, text)
        table = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HFImportError(f"{path}: unreadable answer table ({exc})") from None
    if isinstance(table, list) and all(isinstance(a, dict) and isinstance(a.get("ans"), str) for a in table):
        table = [a["ans"] for a in table]
    if isinstance(table, list) and table and all(isinstance(a, str) for a in table):
        return table
    if isinstance(table, dict) and table and all(isinstance(i, int) and not isinstance(i, bool) for i in table.values()):
        names = {i: a for a, i in table.items()}
        if sorted(names) != list(range(len(table))):
            raise HFImportError(f"{path}: the answer -> index object's indices are not 0..{len(table) - 1}, each once")
        return [names[i] for i in range(len(table))]
    raise HFImportError(
        f"{path}: not an answer table (expected a JSON list of answers, LXMERT's all_ans.json, "
        "or an answer -> index object)"
    )


def answer_lines(path: Path, text: str) -> list[str]:
    """The answers of a text file, one a line, surrounding spaces dropped. A blank line is an answer: VQA's own table
    names one output "" (the count check against the head catches a stray blank line)."""
    lines = [line.strip() for line in text.splitlines()]
    if not lines:
        raise HFImportError(f"{path}: no answers (one answer a line expected)")
    return lines


def repeated_answers(names: list[str]) -> dict[str, list[int]]:
    """The answers named by more than one output, with those outputs' indices (an answer table with repeats is
    likely not the head's own: /vqa would list one answer twice)."""
    where: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        where.setdefault(name, []).append(i)
    return {name: idx for name, idx in where.items() if len(idx) > 1}


def name_answers(source: HFSource, heads: dict[str, HeadConfig], labels: dict[str, Any], answers: Path | None) -> None:
    """labels["heads"][task] of the answer head (vqa, else the image_qa pretraining head): the names of the
    `answers` table when given (its size must equal the head's), else config.json's id2label, else numbers."""
    task = next((t for t in ("vqa", "image_qa") if t in heads), None)
    if task is None:
        if answers is not None:
            raise HFImportError(f"{answers}: the checkpoint has no answer head (vqa or image_qa) to name")
        return
    count = heads[task].num_labels
    names = answer_labels(source, count) if answers is None else read_answers(answers)
    if len(names) != count:
        raise HFImportError(f"{answers}: {len(names)} answers, but the checkpoint's {task} head has {count} outputs")
    labels.setdefault("heads", {})[task] = names


def source_tokenizer(source: HFSource, vocab_size: int) -> VLTokenizer:
    """The source's vocab.txt when it ships one, else our bert-base-uncased vocab (the public checkpoints' vocab)."""
    try:
        tok = VLTokenizer.from_dir(source.path) if (source.path / "vocab.txt").is_file() else VLTokenizer.pretrained_minilm()
    except (ValueError, OSError, json.JSONDecodeError) as exc:
        raise HFImportError(f"{source.path / 'vocab.txt'}: {exc}") from None
    if len(tok.vocab) > vocab_size:
        raise HFImportError(
            f"{tok.vocab_file}: {len(tok.vocab)} tokens, more than the model's vocab_size {vocab_size} "
            f"(put the checkpoint's own vocab.txt in {source.path})"
        )
    return tok


def write_checkpoint(
    source: HFSource,
    out: str | Path,
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    labels: dict[str, Any],
    fmt: str,
    architecture: str | None,
    answers: Path | None = None,
) -> Path:
    """Build our model from the mapped tensors (strictly) and save it with an `import` record in the manifest."""
    model = VLModel(config)
    source.check_shapes(model.state_dict())
    load_state_strict(model, weights, source.weights_path)
    tokenizer = source_tokenizer(source, config.encoder.vocab_size)
    record = {
        "format": fmt,
        "source": str(source.path.resolve()),
        "architecture": architecture,
        "weights_file": source.weights_file,
        "ignored_keys": source.ignored(),
        "answers": str(Path(answers).resolve()) if answers is not None else None,
    }
    return save_checkpoint(model.eval(), out, tokenizer, labels=labels, extra={"import": record})
