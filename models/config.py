"""Typed configuration of an encoder and its heads: the only constructor arguments of every module."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

FORMAT_VERSION = 1  # bump when config.json or the weight layout changes incompatibly

PRESETS = ("visualbert", "vl-bert", "vilbert", "lxmert", "u-visualbert")
TWO_STREAM = ("vilbert", "lxmert")
BOX_EMBEDDINGS = ("linear", "normalized")  # EncoderConfig.box_embedding (u-visualbert)
VLBERT_EMBEDDINGS = ("concat", "reference", "volta")  # EncoderConfig.vlbert_embedding (vl-bert)
EMBEDDING_STYLES = ("vlserve", "published")  # EncoderConfig.embedding_style (u-visualbert)
HEAD_POOLS = ("pooled", "answer_slot", "answer_segment", "regions", "regions_film")  # HeadConfig.pool; which heads read each: below
REMOVED_POOLS = ("regions_geometry", "regions_count")  # VQA pools no recipe used (regions_film reads both their features)
ANSWER_POOLS = ("answer_slot", "answer_segment")  # pools that read a [MASK] answer slot: the text layout needs one
TEXT_LAYOUTS = ("plain", "answer_slot", "answer_segment")  # HeadConfig.text_layout
ANSWER_SCORES = ("sigmoid", "softmax")  # HeadConfig.score
ANSWER_KINDS = ("vqa", "image_qa")  # heads that score an answer vocabulary (HeadConfig.score)
HEAD_KINDS = (
    # task heads
    "vqa", "nlvr2", "refer", "itm", "multiple_choice", "grounding",
    # pretraining heads
    "mlm", "mrfr", "mrc", "image_qa", "tag",
)
# EncoderConfig fields that must be at least 1:
POSITIVE_FIELDS = ("vocab_size", "hidden_size", "num_heads", "intermediate_size", "max_position_embeddings",
                   "type_vocab_size", "visual_feat_dim")
# EncoderConfig fields that may be 0: a stream without layers, or 0 = derived from another field:
COUNT_FIELDS = ("num_layers", "num_image_layers", "num_cross_layers", "image_hidden_size", "image_num_heads",
                "image_intermediate_size", "coattention_hidden_size", "coattention_num_heads", "pooler_size",
                "geometry_dim", "task_tokens")
PROBABILITY_FIELDS = ("dropout", "attention_dropout")  # EncoderConfig fields in [0, 1]
RANK_HEAD = "rank"  # the name of an itm-kind head trained to rank (listwise) beside the ITM classifier: /retrieve and
# retrieval R@K read it where a model has it, ITM accuracy reads the head named itm


@dataclass
class EncoderConfig:
    preset: str  # one of PRESETS
    size: str = "custom"  # name of the size this config was built from (informational)
    vocab_size: int = 30522  # bert-base-uncased WordPiece vocabulary
    hidden_size: int = 768  # text-stream (and single-stream) width
    num_layers: int = 12  # single-stream layers; text layers (ViLBERT); language layers NL (LXMERT)
    num_heads: int = 12  # attention heads of the text / single stream
    intermediate_size: int = 3072  # feed-forward width of the text / single stream
    max_position_embeddings: int = 512  # learned absolute positions
    type_vocab_size: int = 2  # segments (VL-BERT uses 3: A, B and C for the image)
    layer_norm_eps: float = 1e-12  # as BERT
    dropout: float = 0.1  # hidden dropout
    attention_dropout: float = 0.1  # dropout on attention probabilities
    visual_feat_dim: int = 2048  # D of the region features the detector produces
    feature_norm: bool = False  # standardise region features per dimension (statistics fitted on training regions, saved as buffers)
    image_hidden_size: int = 0  # image-stream width (two-stream; 0 = hidden_size)
    image_num_heads: int = 0  # image-stream heads (0 = num_heads)
    image_intermediate_size: int = 0  # image-stream FFN width (0 = intermediate_size)
    num_image_layers: int = 0  # ViLBERT image-stream layers; LXMERT object-relationship layers NR
    num_cross_layers: int = 0  # LXMERT cross-modality layers NX; ViLBERT co-attention layers
    coattention_text_layers: tuple[int, ...] = ()  # ViLBERT: text layers run before each co-attention layer
    coattention_image_layers: tuple[int, ...] = ()  # ViLBERT: image layers run before each co-attention layer
    # (its v_biattention_id; () = 0, 1, 2, ...: one more image layer before each co-attention layer after the first)
    task_tokens: int = 0  # ViLBERT 12-in-1: rows of its task-token table (a learned token after [CLS] that names
    # the task; HeadConfig.task_token picks it per head); 0 = no task token
    img_from_regions: bool = False  # ViLBERT: [IMG]'s feature is the mean of the real regions' features even where the
    # detector gives a whole-image feature, as vilbert-multi-task's feature reader builds it; False: the detector's
    # whole-image feature when it has one
    coattention_hidden_size: int = 0  # ViLBERT bi-attention width (0 = image_hidden_size)
    coattention_num_heads: int = 0  # ViLBERT bi-attention heads (0 = image_num_heads)
    pooler_size: int = 0  # ViLBERT: width of each stream's pooler and of the fused pooled vector (0 = the
    # bi-attention width; VOLTA's ctrl_vilbert pools to 1024 from 768-wide streams and bi-attention); LXMERT and
    # VisualBERT with pooler_style "relu" or "relu_mul": the pooled width (0 = hidden_size)
    pooler_style: str = "tanh"  # lxmert, visualbert: "tanh" = tanh(FC(h_CLS)), as BERT; "relu" = ReLU(FC(h_CLS)), as
    # VOLTA's conversion of LXMERT; "relu_mul" = ReLU(FC(h_CLS)) * ReLU(FC(h_IMG)), as VOLTA's controlled models
    whole_image_region: bool = False  # lxmert, visualbert: the whole image (the mean real-region feature, box 0 0 1 1)
    # leads the regions, as ViLBERT's [IMG] (VOLTA's controlled models); never the detector's whole-image feature,
    # which VOLTA's feature readers do not read
    box_dims: int = 4  # lxmert: location values the object embedding reads: 4 (x1 y1 x2 y2) or 5 (and the
    # area, VOLTA's controlled LXMERT)
    geometry_dim: int = 0  # VL-BERT sin/cos box embedding width (0 = 4 * 64)
    visual_scale_init: float = 0.0  # VL-BERT: initial weight of the LayerNorms on the visual embeddings added to the
    # text tokens and to the regions (its visual_ln_text / visual_ln_object, 0 in its configs): the image enters the
    # language model gradually instead of swamping its word embeddings at the first step
    vlbert_embedding: str = "concat"  # vl-bert visual embedding (VLBERT_EMBEDDINGS): "reference" = jackroos/VL-BERT's
    # (its released checkpoints and new builds); "concat" = vlserve's first version, which its trained checkpoints keep;
    # "volta" = e-bug/volta's VL-BERT-style one (its last region slot is [END] and lends the text its visual feature)
    pooler: bool = True  # a tanh pooler over the first token; without one (VL-BERT's released configs) `pooled` is the
    # first token's hidden state itself
    box_embedding: str = "linear"  # u-visualbert: "linear" = Linear(4, H)(box) summed with the feature projection;
    # "normalized" = LN(FC(feature)) + LN(FC(sin/cos box)), each half layer-normalised so the box is not drowned
    # by the features (as LXMERT's and UNITER's region embeddings); the published embedding_style takes "linear" only:
    # its box is Linear(4, H) of the 4 coordinates, then layer-normalised (the reference's), never sin/cos geometry
    region_tags: bool = False  # u-visualbert fine-tuned with tags: every region also carries its detector class word
    # (tag_ids), in fine-tuning and at inference alike, as its pretraining does
    embedding_style: str = "vlserve"  # u-visualbert: "vlserve" = VisualBERT's embeddings (one LayerNorm over text and
    # regions, region segment and position, box_embedding) with each region's tags summed into it, as vlserve trains;
    # "published" = the embeddings of the authors' code (uclanlp/visualbert, unsupervised_visualbert), which its
    # published checkpoints need: text LN(word + position) (segments ignored), regions LN(FC(feature)) + LN(FC(4-d
    # box)), and every tag sub-word (tag_ids (B, N, K)) a token of its own, LN(word) + its region's LN(FC(box)),
    # after the regions; no segment or position on regions and tags
    img_token_id: int = 1  # VL-BERT [IMG] / U-VisualBERT region token: reuses [unused0]
    end_token_id: int = 2  # VL-BERT [END]: reuses [unused1]
    pad_token_id: int = 0  # [PAD]
    cls_token_id: int = 101  # [CLS]
    sep_token_id: int = 102  # [SEP]
    mask_token_id: int = 103  # [MASK]

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {', '.join(PRESETS)}")
        self._check_ranges()
        self.coattention_text_layers = tuple(self.coattention_text_layers)
        self.coattention_image_layers = tuple(self.coattention_image_layers)
        if self.box_embedding not in BOX_EMBEDDINGS:
            raise ValueError(f"unknown box_embedding {self.box_embedding!r}; choose one of {', '.join(BOX_EMBEDDINGS)}")
        if self.box_embedding != "linear" and self.preset != "u-visualbert":
            raise ValueError(f"box_embedding {self.box_embedding!r} is u-visualbert's; {self.preset} embeds boxes as its paper does")
        if (self.task_tokens or self.coattention_image_layers or self.img_from_regions) and self.preset != "vilbert":
            raise ValueError(f"task_tokens, coattention_image_layers and img_from_regions are vilbert's; {self.preset} "
                             "has no [IMG] region or task token")
        if self.vlbert_embedding not in VLBERT_EMBEDDINGS:
            raise ValueError(f"unknown vlbert_embedding {self.vlbert_embedding!r}; choose one of {', '.join(VLBERT_EMBEDDINGS)}")
        if self.region_tags and self.preset != "u-visualbert":
            raise ValueError(f"region_tags is u-visualbert's; {self.preset} has no detector-tag embedding")
        if (self.pooler_style, self.whole_image_region, self.box_dims) != ("tanh", False, 4):
            volta_vlbert = self.preset == "vl-bert" and self.vlbert_embedding == "volta"
            if (self.preset not in ("lxmert", "visualbert") and not volta_vlbert) or (self.box_dims != 4 and self.preset != "lxmert"):
                raise ValueError("pooler_style and whole_image_region are lxmert's, visualbert's and vl-bert's with "
                                 "vlbert_embedding 'volta'; box_dims lxmert's")
            if self.pooler_style not in ("tanh", "relu", "relu_mul") or self.box_dims not in (4, 5):
                raise ValueError("pooler_style is one of tanh, relu, relu_mul; box_dims 4 or 5")
            if self.pooler_style == "relu_mul" and not self.whole_image_region:
                raise ValueError("pooler_style relu_mul pools the whole-image region: it needs whole_image_region")
        if self.embedding_style not in EMBEDDING_STYLES:
            raise ValueError(f"unknown embedding_style {self.embedding_style!r}; choose one of {', '.join(EMBEDDING_STYLES)}")
        if self.embedding_style != "vlserve" and self.preset != "u-visualbert":
            raise ValueError(f"embedding_style {self.embedding_style!r} is u-visualbert's")
        if self.embedding_style == "published" and self.box_embedding != "linear":
            raise ValueError("box_embedding applies to the vlserve embedding style (embedding_style 'vlserve'): the "
                             "published one embeds the 4-d box as its authors' code does, LN(Linear(4, H)), and takes "
                             f"box_embedding 'linear', not {self.box_embedding!r}")
        widths = [("hidden_size", self.hidden_size, self.num_heads),
                  ("image_hidden_size", self.image_width, self.image_heads)]
        if self.preset == "vilbert":  # its co-attention splits its own width into its own heads (two_stream.py)
            widths.append(("coattention_hidden_size", self.coattention_width,
                           self.coattention_num_heads or self.image_heads))
        for name, width, heads in widths:
            if width % heads:
                raise ValueError(f"{name}={width} is not a multiple of its number of heads ({heads})")
        if self.preset == "vilbert":
            if len(self.coattention_text_layers) != self.num_cross_layers:
                raise ValueError("vilbert needs one coattention_text_layers index per co-attention layer")
            if self.coattention_image_layers:
                image_ids = list(self.coattention_image_layers)
                if (len(image_ids) != self.num_cross_layers or image_ids != sorted(image_ids) or image_ids[0] < 0
                        or image_ids[-1] > self.num_image_layers):
                    raise ValueError("coattention_image_layers must be one non-decreasing count of image layers "
                                     "(0 to num_image_layers) per co-attention layer")
            elif self.num_image_layers < self.num_cross_layers:
                raise ValueError("vilbert needs at least one image layer before each co-attention layer")
            if any(not 0 <= i <= self.num_layers for i in self.coattention_text_layers) or list(
                self.coattention_text_layers
            ) != sorted(self.coattention_text_layers):
                raise ValueError("coattention_text_layers must be non-decreasing counts of text layers (0 to num_layers)")

    def _check_ranges(self) -> None:
        """Sizes, counts and dropout probabilities a model can be built with; the first one out of range fails naming
        its field (before any module divides by a head count or allocates a negative dimension)."""
        for names, lowest in ((POSITIVE_FIELDS, 1), (COUNT_FIELDS, 0)):
            for name in names:
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool):
                    raise ValueError(f"{name}={value!r} is not an integer")
                if value < lowest:
                    raise ValueError(f"{name}={value} must be at least {lowest}")
        for name in PROBABILITY_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1:
                raise ValueError(f"{name}={value!r} is not a probability in [0, 1]")

    @property
    def is_two_stream(self) -> bool:
        return self.preset in TWO_STREAM

    @property
    def image_width(self) -> int:
        if self.preset == "vilbert":
            return self.image_hidden_size or self.hidden_size
        return self.hidden_size  # LXMERT and single-stream presets share one width

    @property
    def image_heads(self) -> int:
        return (self.image_num_heads or self.num_heads) if self.preset == "vilbert" else self.num_heads

    @property
    def image_ffn(self) -> int:
        if self.preset == "vilbert":
            return self.image_intermediate_size or self.intermediate_size
        return self.intermediate_size

    @property
    def coattention_width(self) -> int:
        return self.coattention_hidden_size or self.image_width

    @property
    def pooled_size(self) -> int:
        """Width of the fused pooled vector the classification heads read."""
        if self.preset == "vilbert":
            return self.pooler_size or self.coattention_width
        if self.preset in ("lxmert", "visualbert", "vl-bert") and self.pooler_style != "tanh":
            return self.pooler_size or self.hidden_size
        return self.hidden_size

    @property
    def geometry_width(self) -> int:
        return self.geometry_dim or 256

    @property
    def text_positions(self) -> int:
        """The longest text row (word pieces, specials included) the position table can place: every row, less the
        two positions VL-BERT gives the regions and [END] right after the text."""
        return self.max_position_embeddings - (2 if self.preset == "vl-bert" else 0)


@dataclass
class HeadConfig:
    kind: str  # one of HEAD_KINDS
    num_labels: int = 0  # answers (vqa, image_qa), object classes (mrc); ignored where fixed
    pool: str = "pooled"  # vqa: "pooled" (CLS / fused), "answer_slot" (the [MASK] before the final [SEP]: text
    #                       `[CLS] q [MASK] [SEP]`), "answer_segment" (the same slot as VL-BERT lays it out: `[CLS] q
    #                       [SEP] [MASK] [SEP]`, the last two in segment 1) or
    #                       "regions" (pooled + question-guided attention pooling of the regions) or "regions_film"
    #                       (regions + counts + located boxes, modulated by the question); itm and nlvr2
    #                       (each image): "pooled" or "regions"
    classifier: str = "mlp"  # vqa/nlvr2/image_qa: "mlp" (Linear-GELU-LN-Linear, LXMERT/ViLBERT) or "linear" or
    #                          "bert" (BERT's prediction transform Linear-GELU-LN, then Linear: VL-BERT's VQA "mlm"
    #                          classifier); refer/mrc: "dense_gelu" puts VL-BERT's Linear-GELU transform (no LN)
    #                          before the scores (refer otherwise scores with one Linear, mrc with Linear-GELU-LN)
    classifier_hidden: int = 0  # the "mlp" classifier's hidden width (0 = twice what it reads; VOLTA's task heads
    #                             use a fixed clf_hidden_size, 1536)
    task_token: int = -1  # ViLBERT 12-in-1: the task token every input of this head carries (its task_id in
    #                       vilbert_tasks.yml, a row of EncoderConfig.task_tokens); -1 = none
    nlvr2_mode: str = "pair"  # nlvr2: "pair" (two passes, concatenated pooled) or "joint" (one pass, both images)
    mrc_loss: str = "ce"  # mrc: "ce" against the detector's top class or "kl" to its distribution
    vqa_loss: str = "bce"  # vqa: "bce" on soft scores (bottom-up attention, LXMERT) or "ce": softmax cross-entropy
    #                        against the normalised soft scores (learns single-answer datasets much faster)
    # What a server needs to know, declared so that it never reads training choices; "" = derived in __post_init__
    # from the fields above (configs written without them load with the semantics they were trained with):
    score: str = ""  # vqa, image_qa: answer scores from the logits, "sigmoid" per answer (derived from vqa_loss
    #                  "bce") or "softmax" over the answers (vqa_loss "ce"); other heads: ""
    text_layout: str = ""  # the text the head reads: "plain" `[CLS] text [SEP]`, "answer_slot" `[CLS] text [MASK]
    #                        [SEP]` or "answer_segment" `[CLS] text [SEP] [MASK] [SEP]` (derived: pool's slot or plain)

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or self.kind not in HEAD_KINDS:
            raise ValueError(f"unknown head kind {self.kind!r}; choose one of {', '.join(HEAD_KINDS)}")
        # each field of its type (num_labels=13.0 or "13" would fail deep in torch), the counts not negative
        _check_fields(HeadConfig, dataclasses.asdict(self), f"head {self.kind}", f"head {self.kind}: ")
        for name in ("num_labels", "classifier_hidden"):
            if getattr(self, name) < 0:
                raise ValueError(f"head {self.kind}: {name}={getattr(self, name)} must be at least 0")
        if self.pool in REMOVED_POOLS:
            raise ValueError(f"head {self.kind}: pool={self.pool!r} was removed from vlserve (no recipe used it); "
                             f"retrain the head with pool 'regions_film', which reads the same features")
        if not self.score and self.kind in ANSWER_KINDS:
            self.score = "softmax" if self.vqa_loss == "ce" else "sigmoid"
        if not self.text_layout:
            self.text_layout = self.pool if self.pool in ANSWER_POOLS else "plain"
        checks = {
            "pool": (self.pool, HEAD_POOLS),
            "classifier": (self.classifier, ("mlp", "linear", "bert", "dense_gelu")),
            "nlvr2_mode": (self.nlvr2_mode, ("pair", "joint")),
            "mrc_loss": (self.mrc_loss, ("ce", "kl")),
            "vqa_loss": (self.vqa_loss, ("bce", "ce")),
            "score": (self.score, ANSWER_SCORES if self.kind in ANSWER_KINDS else ("",)),
            "text_layout": (self.text_layout, TEXT_LAYOUTS),
        }
        for name, (value, allowed) in checks.items():
            if value not in allowed:
                raise ValueError(f"head {self.kind}: {name}={value!r} is not one of {allowed}")
        readers = {"answer_slot": ("vqa", "image_qa"), "answer_segment": ("vqa", "image_qa"), "regions": ("vqa", "image_qa", "itm", "nlvr2"),
                   "regions_film": ("vqa", "image_qa")}
        if self.pool in readers and self.kind not in readers[self.pool]:
            raise ValueError(f"head {self.kind}: pool={self.pool!r} is for {', '.join(readers[self.pool])} heads only")
        if self.pool in ANSWER_POOLS and self.text_layout != self.pool:
            raise ValueError(f"head {self.kind}: pool={self.pool!r} reads the answer slot of text_layout "
                             f"{self.pool!r}, not {self.text_layout!r}")
        classifier_readers = {"bert": ("vqa", "image_qa", "nlvr2"), "dense_gelu": ("refer", "mrc")}
        if self.classifier in classifier_readers and self.kind not in classifier_readers[self.classifier]:
            raise ValueError(f"head {self.kind}: classifier={self.classifier!r} is for "
                             f"{', '.join(classifier_readers[self.classifier])} heads only")
        if self.kind in ("vqa", "image_qa", "mrc") and self.num_labels <= 0:
            raise ValueError(f"head {self.kind} needs num_labels > 0")
        if self.task_token < -1:
            raise ValueError(f"head {self.kind}: task_token={self.task_token} is neither a task id (>= 0) nor -1 (none)")

    @property
    def answer_slot(self) -> bool | str:
        """The tokenizer's answer_slot argument for this head's text layout: False for plain text."""
        return False if self.text_layout == "plain" else self.text_layout


@dataclass
class ModelConfig:
    encoder: EncoderConfig
    heads: dict[str, HeadConfig] = field(default_factory=dict)  # task name -> head
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.heads, dict) or not all(isinstance(h, HeadConfig) for h in self.heads.values()):
            raise TypeError("heads must be a dict of task name -> HeadConfig")
        for name, head in self.heads.items():
            if self.encoder.task_tokens and head.task_token < 0:  # its inputs would carry no task: not 12-in-1's
                raise ValueError(f"head {name!r}: task_token={head.task_token}, but every head of an encoder with task "
                                 f"tokens runs with one: give a task id from 0 to {self.encoder.task_tokens - 1}")
            if head.task_token >= self.encoder.task_tokens:
                have = (f"its {self.encoder.task_tokens} task tokens" if self.encoder.task_tokens
                        else f"no task tokens (a {self.encoder.preset} encoder)" if self.encoder.preset != "vilbert"
                        else "no task tokens (task_tokens=0)")
                raise ValueError(f"head {name!r}: task_token={head.task_token} but the encoder has {have}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """The config of a config.json; ValueError naming the field whose key or value type is wrong (the file's
        reader adds the file), never an AttributeError or TypeError of a half-built config."""
        if not isinstance(data, dict):
            raise ValueError(f"the config must be a JSON object, not {json_type(data)}")
        enc = data.get("encoder")
        if not isinstance(enc, dict):
            raise ValueError("config field 'encoder' is missing or not an object")
        _check_fields(EncoderConfig, enc, "config field 'encoder'", "")
        heads = data.get("heads", {})
        if not isinstance(heads, dict):
            raise ValueError(f"config field 'heads' is {json_type(heads)}, not an object of task name -> head")
        for name, head in heads.items():
            if not isinstance(head, dict):
                raise ValueError(f"config head {name!r} is {json_type(head)}, not an object")
            _check_fields(HeadConfig, head, f"config head {name!r}", f"config head {name!r}: ")
        version = data.get("format_version", FORMAT_VERSION)
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"config field 'format_version' is {json_type(version)}, not an integer")
        return cls(
            encoder=EncoderConfig(**enc),
            heads={name: HeadConfig(**head) for name, head in heads.items()},
            format_version=version,
        )


def json_type(value: Any) -> str:
    """How a JSON value's type reads in a message: "a list", "a string", "null"."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


# a dataclass field's annotation -> the JSON values it takes, and how a message names them
_FIELD_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "str": ((str,), "a string"), "int": ((int,), "an integer"), "float": ((int, float), "a number"),
    "bool": ((bool,), "a boolean"), "tuple[int, ...]": ((list, tuple), "a list of integers")}


def _check_fields(kind: type, values: dict[str, Any], name_of: str, prefix: str) -> None:
    """ValueError unless `values` are keyword arguments of the dataclass `kind` (`name_of` in the config): known
    keys, the required ones present, each value of its field's JSON type (a boolean is no number; a tuple field is
    a list of integers), messages about a field after `prefix` as the dataclass's own checks word them."""
    fields = {f.name: f for f in dataclasses.fields(kind)}
    unknown = set(values) - set(fields)
    if unknown:
        raise ValueError(f"{name_of} has unknown keys: {', '.join(sorted(unknown))}")
    for name, f in fields.items():
        if name not in values:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(f"{name_of} lacks the required key {name!r}")
            continue
        if f.type not in _FIELD_TYPES:
            continue
        value, (allowed, expected) = values[name], _FIELD_TYPES[f.type]
        items = value if f.type == "tuple[int, ...]" and isinstance(value, (list, tuple)) else [value]
        item_types = (int,) if f.type == "tuple[int, ...]" else allowed
        if not isinstance(value, allowed) or any(
                not isinstance(v, item_types) or (isinstance(v, bool) and bool not in item_types) for v in items):
            raise ValueError(f"{prefix}{name}={value!r} is not {expected}")
