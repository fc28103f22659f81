"""What the transformers importers share: reading a `save_pretrained` directory and writing our checkpoint.

A source directory holds config.json and model.safetensors or pytorch_model.bin (or their sharded
`*.index.json` form). Every source tensor is either mapped, checked as a tied copy, or listed under
`import.ignored_keys` in the manifest: nothing is dropped silently. The original LXMERT importer reads its
`.pth` files through the same HFSource (lxmert_original.py).
"""
from __future__ import annotations

import json
import math
import os
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import CheckpointError, load_state_strict, load_weights, save_checkpoint
from ..config import EncoderConfig, HeadConfig, ModelConfig
from ..registry import encoder_config
from ..tokenizer import VLTokenizer
from ..vl_model import VLModel
from .keymap import KeyMap, apply_keymap, linear

CONFIG_FILE = "config.json"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # preferred first
SHARD_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_MISSING = object()
KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list",
         dict: "an object"}  # a config field's type, as an error says it


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
            raise HFImportError(f"{self.config_path}: field {name!r} is {value!r}, expected {KINDS.get(kind, kind.__name__)}")
        if kind is float and not math.isfinite(value):  # Python's json reads NaN and Infinity
            raise HFImportError(f"{self.config_path}: field {name!r} is {value!r}, expected a finite number")
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

    def shape(self, key: str, rank: int = 2) -> tuple[int, ...]:
        """The shape of source tensor `key`, which must have `rank` dimensions (2: a weight matrix, 1: a bias or a
        LayerNorm's vector); a missing tensor or one of another rank fails naming it."""
        if key not in self.state:
            raise HFImportError(f"{self.weights_path}: tensor {key} is missing")
        shape = tuple(self.state[key].shape)
        if len(shape) != rank:
            raise HFImportError(f"{self.weights_path}: tensor {key} has shape {shape}, expected a {rank}-d tensor")
        return shape

    def rows(self, key: str) -> int:
        """The rows (outputs) of the weight matrix `key`."""
        return self.shape(key)[0]

    def tensor(self, key: str, rank: int = 2) -> torch.Tensor:
        """Source tensor `key`, read as it is (not through a key map): of `rank` dimensions and checked_values."""
        self.shape(key, rank)
        return checked_values(self.weights_path, key, self.state[key])

    def take(self, keymap: KeyMap) -> dict[str, torch.Tensor]:
        """Our tensors from the key map; a source tensor it needs and the file lacks, one that cannot be fused, and
        one that is not floating point or not finite (checked_values) fails naming it."""
        try:
            out = apply_keymap(keymap, self.state)
        except (KeyError, ValueError) as exc:
            raise HFImportError(f"{self.weights_path}: {exc.args[0]}") from None
        read = {s for srcs in keymap.values() for s in srcs}
        for key in sorted(read):
            checked_values(self.weights_path, key, self.state[key])
        self.used.update(read)
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
    if path.suffix == ".safetensors":
        try:
            return load_weights(path)
        except Exception as exc:  # safetensors/IO errors, a truncated file
            raise unreadable_weights(path, exc) from None
    state = load_pickle(path)
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):  # what a training loop saves
        vl_bert = any(isinstance(k, str) and "vlbert." in k for k in state["state_dict"])
        hint = ": a VL-BERT .model file; import it with `vlserve import vl-bert`" if vl_bert else ""
        raise HFImportError(f"{path}: a training checkpoint (its tensors under 'state_dict'), not a state dict{hint}")
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise HFImportError(f"{path}: not a state dict (a dictionary of tensors by name)")
    return state




def load_pickle(path: Path) -> Any:
    """What a torch.save file holds, unpickled with weights_only (tensors and plain containers only)."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # weights_only met a class; not a torch file at all; a truncated zip or pickle
        raise unreadable_weights(path, exc) from None


def unreadable_weights(path: Path, exc: Exception) -> HFImportError:
    """The error for a weights file that could not be read: a Git LFS pointer or an HTML page (the usual broken
    downloads) said as such, a pickled object named, anything else truncated or corrupt."""
    kind = "safetensors" if path.suffix == ".safetensors" else "PyTorch weights"
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError:
        head = b""
    if head.startswith(b"version https://git-lfs"):
        return HFImportError(f"{path}: not a {kind} file but a Git LFS pointer to one: fetch the weights with "
                             "`git lfs pull` in the repository it came from")
    if head.lstrip().startswith(b"<"):
        return HFImportError(f"{path}: not a {kind} file: it looks like an HTML page (a failed download; download "
                             "it again)")
    # torch's two wordings: a class not allow-listed, and a callable of a blocked module (os.system and the like)
    found = re.search(r"Unsupported global: GLOBAL (\S+)|unsupported GLOBAL (\S+) whose module", str(exc))
    if found:  # weights_only met a class: a pickled object, never unpickled here
        return HFImportError(f"{path}: unreadable weights: the pickle holds {found.group(1) or found.group(2)}, not only tensors "
                             "(vlserve unpickles plain tensor dictionaries only)")
    first = re.split(r"(?<=\.)\s", (str(exc).strip().splitlines() or [""])[0])[0]
    if isinstance(exc, pickle.UnpicklingError):
        return HFImportError(f"{path}: unreadable weights: not a {kind} file ({first})")
    return HFImportError(f"{path}: unreadable weights, truncated or corrupt ({type(exc).__name__}: {first})")


def checked_values(path: Path, key: str, tensor: torch.Tensor) -> torch.Tensor:
    """A source tensor a model is built from: floating point (fp16, bf16 and fp64 load as fp32; an integer, bool or
    complex tensor would be cast silently) with every value finite; else fails naming it. Returns the tensor."""
    if not tensor.is_floating_point():
        raise HFImportError(f"{path}: tensor {key} is {str(tensor.dtype).removeprefix('torch.')}, not floating point "
                            "(weights are fp32, fp16, bf16 or fp64)")
    if not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise HFImportError(f"{path}: tensor {key} holds {bad} NaN or infinite values")
    return tensor


def _load_weights(src: Path) -> tuple[dict[str, torch.Tensor], str]:
    for name in WEIGHT_FILES:
        if (src / name).is_file():
            return load_weight_file(src / name), name
    for name in SHARD_INDEXES:
        index = src / name
        if index.is_file():
            return _load_shards(index), name
    raise HFImportError(f"{src}: no weights file (looked for {', '.join(WEIGHT_FILES + SHARD_INDEXES)})")


def _load_shards(index: Path) -> dict[str, torch.Tensor]:
    """The tensors of a sharded checkpoint, each from the shard its index names (a copy in another shard fails)."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        shards = set(weight_map.values())
    except RecursionError:
        raise HFImportError(f"{index}: not a valid shard index (nested too deeply)") from None
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise HFImportError(f"{index}: not a valid shard index ({exc})") from None
    # a shard is a file beside the index: no other type, no directory part (nothing read outside SRC)
    other = next((shard for shard in shards if not isinstance(shard, str) or Path(shard).name != shard), None)
    if other is not None:
        raise HFImportError(f"{index}: not a valid shard index (weight_map gives {other!r}, not a file name "
                            "beside it)")
    state: dict[str, torch.Tensor] = {}
    found_in: dict[str, str] = {}
    for shard in sorted(shards):
        if not (index.parent / shard).is_file():
            raise HFImportError(f"{index}: lists shard {shard}, which is missing")
        for key, tensor in load_weight_file(index.parent / shard).items():
            named = weight_map.get(key)
            if key in found_in:
                raise HFImportError(f"{index}: tensor {key} is in both {found_in[key]} and {shard}"
                                    + (f"; the index names {named}" if named else ""))
            if named is not None and named != shard:
                raise HFImportError(f"{index}: tensor {key} is in {shard}, but the index names {named}")
            state[key], found_in[key] = tensor, shard
    return state


def read_config(path: Path) -> dict[str, Any]:
    """A JSON object file (config.json, bert_config.json), a UTF-8 byte-order mark skipped (as Windows editors write
    one); not JSON, not UTF-8 or nested too deeply for the parser fails naming the file."""
    try:
        config = json.loads(path.read_text(encoding="utf-8-sig"))
    except RecursionError:
        raise HFImportError(f"{path}: invalid JSON (nested too deeply)") from None
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
        layer_norm_eps=layer_norm_eps if layer_norm_eps is not None else stated_layer_norm_eps(source),
        dropout=source.get("hidden_dropout_prob", float, default=0.1),
        attention_dropout=source.get("attention_probs_dropout_prob", float, default=0.1),
    )


def stated_layer_norm_eps(source: HFSource) -> float:
    """config.json's layer_norm_eps (BERT's 1e-12 when absent), which must be above 0: LayerNorm divides by
    sqrt(variance + eps)."""
    eps = source.get("layer_norm_eps", float, default=1e-12)
    if eps <= 0:
        raise HFImportError(f"{source.config_path}: field 'layer_norm_eps' is {eps!r}, expected a number above 0")
    return eps


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
    """Answer names from config.json's id2label when it covers every answer, else "0", "1", ... (also where it holds
    only the placeholders "LABEL_0", "LABEL_1", ... that transformers writes for a head it was given no names for)."""
    id2label = source.config.get("id2label")
    if isinstance(id2label, dict) and len(id2label) == count:
        names = [id2label.get(str(i)) for i in range(count)]
        # a null or missing label would be served as "None"
        if all(isinstance(name, str) for name in names) and names != [f"LABEL_{i}" for i in range(count)]:
            return names
    return [str(i) for i in range(count)]


def read_answers(path: str | Path) -> list[str]:
    """Answer names by output index from an answer table: a JSON list of answers (VQA's and GQA's
    trainval_label2ans.json), LXMERT's all_ans.json (a list of {"ans": ...}, its 9500-way pretraining head), an
    answer -> index object (trainval_ans2label.json) whose indices are 0..N-1, or a `.txt` file of one answer a line
    (Pythia's answers_vqa.txt, which transformers' VisualBERT demo reads)."""
    path = Path(path)
    if path.suffix.lower() in (".pkl", ".pickle"):  # LXMERT's and others' trainval_label2ans.pkl
        raise HFImportError(f"{path}: a pickled answer table, which vlserve does not unpickle; give its JSON twin "
                            "(the same data's trainval_label2ans.json), or write it as a JSON list yourself if you "
                            "trust the file")
    try:
        text = path.read_text(encoding="utf-8-sig")  # skips a byte-order mark, as Windows editors write
        if path.suffix.lower() == ".txt":
            return answer_lines(path, text)
        table = json.loads(text)
    except RecursionError:
        raise HFImportError(f"{path}: unreadable answer table (JSON nested too deeply)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HFImportError(f"{path}: unreadable answer table ({exc}); a table is JSON (a list of answers, or an "
                            "answer -> index object) or a .txt file of one answer a line") from None
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
    vocab = source.path / "vocab.txt"
    try:
        tok = VLTokenizer.from_dir(source.path) if os.path.lexists(vocab) else VLTokenizer.pretrained_minilm()
    except RecursionError:
        raise HFImportError(f"{source.path / 'tokenizer_config.json'}: invalid JSON (nested too deeply)") from None
    except OSError as exc:  # a vocab.txt that is a directory, a dangling link, unreadable
        raise HFImportError(f"{exc.filename or vocab}: cannot read the vocabulary ({exc.strerror or exc})") from None
    except ValueError as exc:  # names the file: not UTF-8, not JSON, without the special tokens
        raise HFImportError(str(exc)) from None
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
    """Build our model from the mapped tensors (strictly) and save it with an `import` record in the manifest. The
    tensors' shapes are checked against the config's first, on a model without memory: a config size the weights
    do not have (max_position_embeddings 10**8) fails naming the tensor instead of allocating it."""
    with torch.device("meta"):
        shapes = VLModel(config).state_dict()
    source.check_shapes(shapes)
    model = VLModel(config)
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
