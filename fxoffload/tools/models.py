"""Models for what-if planning: built-in presets, a ``config.json``, or a Python file.

A :class:`ModelSource` builds a training step for given sizes: a module whose
forward takes the inputs and returns the loss. Everything is meant to be
called under ``FakeTensorMode`` (shapes and dtypes only, nothing allocated),
so a 7B model costs no memory.

* Presets are well-known architectures at their published shapes (the
  ``config.json`` of each model's official Hugging Face release), built with
  ``transformers`` from a config, random weights, nothing downloaded.
* A ``config.json`` of a ``transformers`` model (or a folder holding one): the
  task comes from its ``architectures`` field, else from the model type.
* A Python file that defines ``build(batch, seq, dtype)`` returning
  ``(model, inputs)``: ``inputs`` a tensor, a tuple of positional arguments or
  a dict of keyword arguments; the model returns a scalar loss, or an output
  with a ``.loss``. ``build`` runs on the meta device (``nn.Module.to`` and
  ``torch.randn`` work, nothing is allocated); its parameters, buffers and
  inputs are then swapped for fake CPU tensors, and the model runs once on
  them to check that it returns a loss and that no matrix product is given
  matrices of two floating-point dtypes (eager refuses it; fake tensors do
  not). A failure of the file's own code
  becomes a :class:`ModelError` naming the file and the step that failed.

:func:`checkpoint_layers` wraps the layers of any of these in activation
checkpointing (``fxoffload plan --checkpointing``).

Language models get token ids and a loss computed here from the logits (next
token for causal models, every position for masked ones) rather than the
model's own loss path, which breaks some models' graphs in two. Image
classifiers get pixel values and class labels.

Limits: text and image classification tasks only; the loss is cross-entropy.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from fxoffload.passes import warn_from_user

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

__all__ = ["CHECKPOINTING", "PRESETS", "DTYPES", "ModelError", "ModelSource", "Preset", "TrainingStep",
           "alike_at", "checkpoint_layers", "from_config_file", "from_preset", "from_python_file", "layer_list",
           "layer_period", "one_line", "unlike_layers", "unpacked_sequences"]

CHECKPOINTING = ("none", "full", "selective")
TASKS = ("causal-lm", "masked-lm", "image-classification")
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


class ModelError(ValueError):
    """A model source (preset, config file, Python file) that cannot be used; the message says why."""


@dataclass(frozen=True)
class Preset:
    model_type: str  # transformers model type
    task: str
    shape: dict[str, Any]  # config fields, as published
    source: str  # where the shape comes from
    default_seq: int = 4096  # or image size, for vision models


PRESETS: dict[str, Preset] = {
    "llama-2-7b": Preset("llama", "causal-lm", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5,
    ), "meta-llama/Llama-2-7b-hf config.json"),
    "llama-3-8b": Preset("llama", "causal-lm", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_theta=500000.0,
    ), "meta-llama/Meta-Llama-3-8B config.json"),
    # Llama 3's layers with 128k positions: the long-context runs (--seq 32768) are Llama 3.1's.
    "llama-3.1-8b": Preset("llama", "causal-lm", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                               high_freq_factor=4.0, original_max_position_embeddings=8192),
    ), "meta-llama/Llama-3.1-8B config.json"),
    "mistral-7b": Preset("mistral", "causal-lm", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768, rms_norm_eps=1e-5,
        sliding_window=4096,
    ), "mistralai/Mistral-7B-v0.1 config.json"),
    "gpt2-xl": Preset("gpt2", "causal-lm", dict(
        vocab_size=50257, n_embd=1600, n_layer=48, n_head=25, n_positions=1024,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    ), "openai-community/gpt2-xl config.json (dropout off: a plan is for the graph, not the noise)", 1024),
    "bert-large": Preset("bert", "masked-lm", dict(
        vocab_size=30522, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
        intermediate_size=4096, max_position_embeddings=512, type_vocab_size=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    ), "google-bert/bert-large-uncased config.json (dropout off)", 512),
    "vit-l-16": Preset("vit", "image-classification", dict(
        hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
        image_size=224, patch_size=16, num_channels=3, num_labels=1000,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    ), "google/vit-large-patch16-224 config.json (dropout off)", 224),
}


@dataclass(frozen=True)
class ModelSource:
    """Builds ``(step, args, kwargs)`` for a batch, a sequence length (or image size) and a dtype:
    ``step(*args, **kwargs)`` is the training step's forward and returns the loss."""

    name: str
    build: Callable[[int, int, torch.dtype], tuple[torch.nn.Module, tuple, dict[str, Any]]] = field(repr=False)
    default_seq: int
    layers: int | None = None  # of the full model, when known
    origin: str = ""  # how messages name it: "model file 'net.py'"
    user_code: bool = False  # built by the user's own code, whose failures are reported in one line
    positions: int | None = None  # the longest sequence the model takes (max_position_embeddings), when known
    vocab: int | None = None  # the vocabulary's size (the logits' last dimension), when known
    # The model built does not depend on the sequence length, only its token ids do: one trace with the
    # length symbolic serves every length (``fxoffload fit``). Not known of a model file's own build.
    symbolic_length: bool = False
    # The model built does not depend on the batch (a preset's or a config's, text or image): one trace with
    # the batch symbolic serves every batch. Not known of a model file's own build.
    symbolic_batch: bool = False
    # The same model with fewer layers (a preset's or a config's), else None: ``fxoffload fit`` traces
    # four and copies them (``fxoffload.passes.copy_layers``).
    with_layers: Callable[[int], "ModelSource"] | None = field(default=None, repr=False)
    task: str | None = None  # one of TASKS (a preset's or a config's); None: a model file's own

    @property
    def image(self) -> bool:
        """An image model: its size is the image's side (``--image-size``), not a sequence's length."""
        return self.task == "image-classification"


def from_preset(name: str, layers: int | None = None) -> ModelSource:
    if name not in PRESETS:
        raise ModelError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    preset = PRESETS[name]
    return _from_transformers_config(name, preset.model_type, dict(preset.shape), preset.task, layers,
                                     preset.default_seq)


def from_config_file(path: "str | Path", layers: int | None = None) -> ModelSource:
    """A ``transformers`` model from its ``config.json`` (or a folder that holds one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ModelError(f"config file not found: {str(path)!r} (give a transformers config.json or its folder)")
    try:
        fields = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelError(f"config file {str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(fields, dict):
        raise ModelError(f"config file {str(path)!r}: expected a JSON object of config fields, "
                         f"got {type(fields).__name__}")
    model_type = fields.pop("model_type", None)
    if not isinstance(model_type, str):
        raise ModelError(f"config file {str(path)!r} has no \"model_type\" field (a transformers config.json names "
                         "its model type, e.g. \"llama\")")
    task = _task_of(fields, model_type, path)
    seq = fields.get("max_position_embeddings") or fields.get("n_positions") or fields.get("image_size") or 1024
    if task != "image-classification":
        seq = min(int(seq), 4096)
    origin = f"config file {str(path)!r}"
    _warn_defaulted_sizes(origin, model_type, fields)
    # A folder's config.json is named after its folder (a model's checkpoint); any other file after itself.
    name = (path.parent.name if path.name == "config.json" else "") or path.stem
    return _from_transformers_config(name, model_type, fields, task, layers, int(seq), origin=origin)


# A config file's fields that are not its config class's: taken apart before the class is built from the rest.
NOT_CONFIG_FIELDS = ("architectures", "torch_dtype", "dtype", "attn_implementation", "_attn_implementation")
# The fields that size a model: where a config file leaves one out, transformers' default (another model's
# shape) is planned, which a warning says. (Not the KV heads: most classes derive them from the heads.)
SIZE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


def _warn_defaulted_sizes(origin: str, model_type: str, fields: dict) -> None:
    """Warn of the size fields (``SIZE_FIELDS``, or their aliases: GPT-2's ``n_embd``) a config file leaves to
    its transformers class's defaults, naming a field of the file that resembles each and that the class does not
    know: a misspelt ``num_hiden_layers`` was kept as an attribute no model reads, and the default 32 layers were
    planned, silently. Other unknown fields warn nothing: checkpoints carry fields of their own (``auto_map``,
    GPT-2's ``n_ctx``, BERT's ``position_embedding_type``, older releases' names), and what they say a model does
    not read."""
    import difflib

    from transformers import AutoConfig

    given = {k: v for k, v in fields.items() if k not in NOT_CONFIG_FIELDS}
    try:
        default, built = AutoConfig.for_model(model_type), AutoConfig.for_model(model_type, **given)
    except Exception:  # refused when the model is built, with transformers' words
        return
    known = set(default.to_dict())
    aliases = getattr(default, "attribute_map", {}) or {}  # the standard name -> the class's own (GPT-2's n_embd)
    unread = sorted(k for k in set(built.to_dict()) - known - set(aliases) if k in given)
    defaulted = [k for k in SIZE_FIELDS
                 if (k in known or k in aliases) and k not in given and aliases.get(k) not in given]
    if not defaulted:
        return
    words = []
    for key in defaulted:
        close = difflib.get_close_matches(key, unread, n=1, cutoff=0.8) or (
            difflib.get_close_matches(aliases[key], unread, n=1, cutoff=0.8) if key in aliases else [])
        words.append(f"{key}={_one_value(built, key)}" + (f" (the file's {close[0]!r} is not a field of "
                                                          f"{type(default).__name__}: misspelt?)" if close else ""))
    warn_from_user(UserWarning(f"{origin} leaves {', '.join(defaulted)} out: {type(default).__name__}'s defaults are "
                               f"planned ({', '.join(words)})"))


def from_python_file(path: "str | Path") -> ModelSource:
    """A model from a Python file that defines ``build(batch, seq, dtype) -> (model, inputs)``."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"model file not found: {str(path)!r}")
    spec = importlib.util.spec_from_file_location(f"fxoffload_model_{path.stem}", path)
    if spec is None or spec.loader is None:  # a name Python cannot import: config.json, model.txt
        config = " (a transformers config: give it with --config)" if path.suffix == ".json" else ""
        raise ModelError(f"model file {str(path)!r} is not a Python file{config}; accepted: a .py file defining "
                         "build(batch, seq, dtype) returning (model, inputs)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dynamo looks the model's globals up by module name
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[spec.name]
        raise ModelError(f"model file {str(path)!r} failed to import: {type(e).__name__}: {e}") from e
    build = getattr(module, "build", None)
    if not callable(build):
        raise ModelError(f"model file {str(path)!r} defines no function build(batch, seq, dtype) returning "
                         "(model, inputs)")

    def build_step(batch: int, seq: int, dtype: torch.dtype):
        # Built on the meta device (nothing allocated; nn.Module.to() works there, not on fake
        # parameters), then every parameter, buffer and input is swapped for a fake tensor.
        with unset_fake_temporarily(), torch.device("meta"):
            try:
                built = build(batch, seq, dtype)
            except Exception as e:
                raise ModelError(f"model file {str(path)!r}: build({batch}, {seq}, {dtype}) raised "
                                 f"{one_line(e)}") from e
        if not (isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], torch.nn.Module)):
            raise ModelError(f"model file {str(path)!r}: build() must return (model, inputs) with model an "
                             f"nn.Module; got {_shape_of(built)}")
        model, inputs = built
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        if not isinstance(inputs, (tuple, list, dict)):
            raise ModelError(f"model file {str(path)!r}: inputs must be a tuple of arguments or a dict of keyword "
                             f"arguments; got {type(inputs).__name__}")
        step = _UserStep(_with_fake_tensors(model))
        if isinstance(inputs, dict):
            args, kwargs = (), {k: _fake_like(v) for k, v in inputs.items()}
        else:
            args, kwargs = tuple(_fake_like(v) for v in inputs), {}
        _check_returns_loss(model, args, kwargs, f"model file {str(path)!r}")
        return step, args, kwargs

    return ModelSource(path.stem, build_step, getattr(module, "DEFAULT_SEQ", 1024), origin=f"model file {str(path)!r}",
                       user_code=True)


def _check_returns_loss(model: torch.nn.Module, args: tuple, kwargs: dict, origin: str) -> None:
    """Run the model once on its fake tensors (shapes only) to check that it returns a loss, and that no
    matrix product is given matrices of two floating-point dtypes (``_SameDtypeOperands``).

    Not on the meta device: there some models take data-dependent branches (transformers'
    packed-sequence test) that they skip under fake tensors or while traced."""
    try:
        with torch.no_grad(), _SameDtypeOperands():
            out = model(*args, **kwargs)
    except _DtypeMismatch as e:
        raise ModelError(f"{origin}: {e}; eager PyTorch refuses this, fake tensors (shapes only) do not. build(batch, "
                         "seq, dtype) must make the weights and the floating-point inputs in the dtype it is given "
                         "(model.to(dtype), torch.randn(..., dtype=dtype))") from e
    except Exception as e:
        raise ModelError(f"{origin}: running the model once on fake tensors (shapes only) raised {one_line(e)}"
                         + _values_read(e)) from e
    if _loss_of(out) is None:
        raise ModelError(f"{origin}: the model must return a scalar loss, or an output with a scalar .loss; got "
                         f"{type(out).__name__}" + (f" of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor)
                                                    else ""))


class _DtypeMismatch(RuntimeError):
    """A matrix product was given operands of different floating-point dtypes."""


def _operand_positions() -> dict:
    """Per op, the arguments eager PyTorch requires in one dtype (its kernels raise otherwise; fake
    convolutions and attention check their own)."""
    aten = torch.ops.aten
    return {aten.mm.default: (0, 1), aten.bmm.default: (0, 1), aten.mv.default: (0, 1), aten.dot.default: (0, 1),
            aten.addmm.default: (1, 2), aten.baddbmm.default: (1, 2), aten.addbmm.default: (1, 2),
            aten.addmv.default: (1, 2)}


class _SameDtypeOperands(TorchDispatchMode):
    """Raises :class:`_DtypeMismatch` where an op's operands differ in floating-point dtype, as eager's
    kernels do: fake tensors compute shapes and dtypes without that check, so a model file whose
    weights and inputs differ in dtype would otherwise be planned (for a step eager cannot run)."""

    def __init__(self):
        super().__init__()
        self.positions = _operand_positions()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        checked = [args[i] for i in self.positions.get(func, ()) if i < len(args)]
        dtypes = {t.dtype for t in checked if isinstance(t, torch.Tensor) and t.is_floating_point()}
        if len(dtypes) > 1:
            shown = " and ".join(f"{t.dtype} {tuple(t.shape)}" for t in checked if isinstance(t, torch.Tensor))
            raise _DtypeMismatch(f"{func.overloadpacket.__name__} was given operands of different dtypes ({shown})")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def unpacked_sequences(source: ModelSource):
    """Within: a preset's or a config's model takes its sequences as unpacked, as it finds them on real
    tensors. transformers tests the position ids for several sequences packed in one row by reading
    their values, which fake tensors do not have; it then builds a full attention mask (a batch x length
    x length tensor) that a real step of the same model skips for SDPA's causal kernel. A model file's
    step is left as it is (its position ids may be packed)."""
    if source.user_code:
        yield
        return
    import transformers.masking_utils as masking  # here: a model file's step needs no transformers

    found = masking.find_packed_sequence_indices
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = found


def one_line(error: BaseException) -> str:
    """``Kind: message``, the message cut to its first line (dynamo's and transformers' run to pages)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _loss_of(out: Any) -> torch.Tensor | None:
    loss = out if isinstance(out, torch.Tensor) else getattr(out, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.dim() == 0 else None


def _fake_like(value: Any) -> Any:
    """A fake CPU tensor shaped like ``value`` (under the active FakeTensorMode), or ``value`` if not a tensor."""
    if not isinstance(value, torch.Tensor):
        return value
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="cpu")


def _with_fake_tensors(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its parameters and buffers replaced by fake tensors; tied parameters stay tied."""
    swapped: dict[int, Any] = {}
    for module in model.modules():
        for table, make in ((module._parameters, lambda p: torch.nn.Parameter(_fake_like(p), p.requires_grad)),
                            (module._buffers, _fake_like)):
            for name, value in table.items():
                if value is not None:
                    table[name] = swapped.setdefault(id(value), make(value))
    return model


# The heads a config's "architectures" may name, by the class name's ending, and the task each is built as.
HEAD_ENDINGS = (("ForCausalLM", "causal-lm"), ("LMHeadModel", "causal-lm"), ("ForMaskedLM", "masked-lm"),
                ("ForImageClassification", "image-classification"))


def _values_read(error: Exception) -> str:
    """What a fake tensor's refusal to give its values means, in a model's words (its error names an ATen op,
    ``aten._local_scalar_dense``, that the model's code never names)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    if not isinstance(error, DataDependentOutputException):
        return ""
    return (" (the model reads a tensor's values: a branch on one, such as `if y.sum() > 0`, or .item(); fake "
            "tensors have shapes only, so fxoffload plan cannot trace past it, where torch.compile breaks the graph)")


def _shape_of(built: Any) -> str:
    """What a model file's ``build`` returned, in words: its type, or a tuple's types (a bare module was
    reported by its type alone, which read as the accepted nn.Module)."""
    if isinstance(built, tuple):
        return f"a tuple of {len(built)}: ({', '.join(type(v).__name__ for v in built)})"
    return f"a {type(built).__name__}, not a tuple"


def _task_of(fields: dict, model_type: str, path: Path) -> str:
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        import difflib  # here: this error alone needs it

        close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING.keys()), n=3)
        raise ModelError(f"config file {str(path)!r}: model_type {model_type!r} is not one transformers knows; "
                         + (f"did you mean {', '.join(map(repr, close))}? " if close else "")
                         + "accepted: a model type of transformers' CONFIG_MAPPING (its config.json's \"model_type\")")
    # By the model type's own default, not the file's field: BartForCausalLM saves is_encoder_decoder false,
    # and its num_hidden_layers is still the encoder's count.
    if fields.get("is_encoder_decoder") or _default_encoder_decoder(CONFIG_MAPPING[model_type]):
        raise _encoder_decoder(f"config file {str(path)!r}", model_type)
    architectures = fields.get("architectures")
    if architectures is not None and not (isinstance(architectures, list)
                                          and all(isinstance(name, str) for name in architectures)):
        raise ModelError(f"config file {str(path)!r}: \"architectures\" must be a list of class names, as "
                         f"[\"LlamaForCausalLM\"]; got {architectures!r}")
    heads = _heads()
    for name in architectures or ():
        task = heads.get(name) or next((task for ending, task in HEAD_ENDINGS if name.endswith(ending)), None)
        if task is not None:
            return task
    backbones = _backbones(model_type)
    if any(name not in backbones for name in architectures or ()):
        # Another head (sequence classification, question answering, GPT-2's double heads, an encoder-decoder's):
        # building a causal LM for it would plan another model, silently. (The type's own bare backbone,
        # ViTModel, gets its type's head, below.)
        raise ModelError(f"config file {str(path)!r}: architectures {list(architectures)!r} name no head fxoffload "
                         f"builds; accepted: {', '.join('...' + ending for ending, _ in HEAD_ENDINGS)}, another "
                         f"transformers head of those tasks, or the type's bare backbone ({', '.join(backbones)}) "
                         "(edit \"architectures\" to plan the model with such a head)")
    for task, names in _task_mappings().items():
        if model_type in names:
            return task
    raise ModelError(f"config file {str(path)!r}: cannot tell the task of model_type {model_type!r}; accepted: "
                     f"models with a causal LM, masked LM or image classification head ({', '.join(TASKS)})")


def _from_transformers_config(name: str, model_type: str, fields: dict, task: str, layers: int | None,
                              default_seq: int, origin: str = "") -> ModelSource:
    from transformers import AutoConfig

    architectures = fields.pop("architectures", None)
    fields.pop("torch_dtype", None)
    fields.pop("dtype", None)
    attention = _attention(origin or name, fields.pop("attn_implementation", None),
                           fields.pop("_attn_implementation", None))
    try:
        config = AutoConfig.for_model(model_type, **fields)
    except Exception as e:  # transformers' own validation errors have several types
        raise ModelError(f"{origin or name}: transformers rejected the config: {e}") from None
    # The Auto class picks the named head among a type's several (DeiT's), and iterates the list: never None.
    config.architectures = list(architectures or [])
    _check_one_stack(origin or name, model_type, config)
    _check_sizes(origin or name, config)
    if layers is not None:
        if not 1 <= layers <= config.num_hidden_layers:
            raise ModelError(f"--layers: got {layers}; {name} has {config.num_hidden_layers} layers, accepted 1 to "
                             f"{config.num_hidden_layers}")
        config.num_hidden_layers = layers
    config.use_cache = False
    config._attn_implementation = attention
    full_layers = config.num_hidden_layers
    unchanged = dict(fields, attn_implementation=attention,
                     **({"architectures": architectures} if architectures is not None else {}))

    def with_layers(count: int) -> ModelSource:
        return _from_transformers_config(name, model_type, dict(unchanged), task, count, default_seq, origin)

    def build(batch: int, seq: int, dtype: torch.dtype):
        _check_size(name, config, task, seq)
        sized = config
        if task == "image-classification" and seq != config.image_size:
            sized = copy.deepcopy(config)  # position embeddings for the image size trained at
            sized.image_size = seq
        return _build_step(sized, task, batch, seq, dtype)

    positions = getattr(config, "max_position_embeddings", None) if task != "image-classification" else None
    return ModelSource(name, build, default_seq, full_layers, origin=origin or f"preset {name}", positions=positions,
                       vocab=getattr(config, "vocab_size", None), symbolic_length=task != "image-classification",
                       symbolic_batch=True, with_layers=with_layers, task=task)


# Attention implementations a config may name that trace on fake CPU tensors: SDPA unless the config names
# "eager" (Gemma-2's classes refuse SDPA, and a file's "eager" was overridden).
ATTENTION = ("sdpa", "eager")


def _attention(origin: str, *named: Any) -> str:
    """The attention implementation to build with: the config's where it is one of ``ATTENTION``, else SDPA, with
    a warning where it named another (FlashAttention-2 needs its package and CUDA, flex attention's backward no
    CPU: a file naming either failed to build or trace); SDPA's memory is the closest of those traced here."""
    chosen = next((a for a in named if a), None)
    if chosen is None or chosen in ATTENTION:
        return chosen or "sdpa"
    warn_from_user(UserWarning(f"{origin} names attn_implementation={chosen!r}: planned with 'sdpa' instead "
                               f"(accepted: {', '.join(map(repr, ATTENTION))})"))
    return "sdpa"


def _check_one_stack(origin: str, model_type: str, config: Any) -> None:
    """Refuse a config whose model is not one stack of layers under a head: an encoder-decoder's (its
    causal LM would be the decoder alone, its layer count the encoder's) or a composite one's (CLIP:
    a text and a vision config, no layer count of its own)."""
    if getattr(config, "is_encoder_decoder", False) or _default_encoder_decoder(type(config)):
        raise _encoder_decoder(origin, model_type)
    if not isinstance(getattr(config, "num_hidden_layers", None), int):
        raise ModelError(f"{origin}: model_type {model_type!r} has no num_hidden_layers (not one stack of layers: "
                         "a composite config, such as CLIP's text and vision configs, or a convolutional network's "
                         "stages); accepted: one stack of layers (give the sub-model's own config, or a --model file)")


def _check_sizes(origin: str, config: Any) -> None:
    """Refuse a size field below 1 (transformers takes ``num_hidden_layers: -2`` and ``hidden_size: 0``, and a
    plan of them was printed as if of a model; ``vocab_size: 0`` failed in the trace with a traceback), and KV
    heads that do not divide the heads (SDPA's failure, deep in the trace). Read on the config, whose attribute
    names stand for their aliases (GPT-2's ``n_layer``)."""
    for size in (*SIZE_FIELDS, "num_key_value_heads"):
        value = _one_value(config, size)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            alias = (getattr(config, "attribute_map", None) or {}).get(size)  # the standard name -> the class's
            named = f"{size} (or {alias!r})" if alias else size
            raise ModelError(f"{origin}: {named} is {value}; accepted: an int >= 1")
    heads, kv = _one_value(config, "num_attention_heads"), _one_value(config, "num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
        raise ModelError(f"{origin}: num_key_value_heads is {kv}, which does not divide num_attention_heads {heads} "
                         "(each KV head serves a group of heads); accepted: a divisor of num_attention_heads")


def _one_value(config: Any, field: str) -> Any:
    """``config``'s ``field``, or None where it has no one value: transformers' configs of layers unlike
    (``dots3_note_text``) raise ``AmbiguousGlobalPerLayerAttributeError``, a RuntimeError, for a per-layer one."""
    try:
        return getattr(config, field, None)
    except Exception:  # noqa: BLE001 (whatever a config raises for a field it holds per layer)
        return None


def _task_mappings() -> dict[str, dict[str, str]]:
    """transformers' own model types -> head class names, by the task fxoffload builds each as."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    return {"causal-lm": MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "masked-lm": MODEL_FOR_MASKED_LM_MAPPING_NAMES,
            "image-classification": MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES}


def _heads() -> dict[str, str]:
    """Every head class transformers builds for those tasks -> its task (DeiT's ...WithTeacher, Reformer's
    ...ModelWithLMHead: heads whose names end otherwise)."""
    heads: dict[str, str] = {}
    for task, names in _task_mappings().items():
        for value in names.values():
            for name in (value,) if isinstance(value, str) else value:
                heads.setdefault(name, task)
    return heads


def _backbones(model_type: str) -> tuple[str, ...]:
    """The model type's bare backbone classes (ViTModel): a config naming one is planned with its type's head."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    names = MODEL_MAPPING_NAMES.get(model_type, ())
    return (names,) if isinstance(names, str) else tuple(names)


def _default_encoder_decoder(config_class: type) -> bool:
    """Whether a model type is an encoder-decoder model by its config class's default."""
    try:
        return bool(getattr(config_class(), "is_encoder_decoder", False))
    except Exception:  # a config that needs fields: the built config is checked (_check_one_stack)
        return False


def _encoder_decoder(origin: str, model_type: str) -> ModelError:
    return ModelError(f"{origin}: model_type {model_type!r} is an encoder-decoder model (is_encoder_decoder); "
                      "accepted: one stack of layers with a causal LM, masked LM or image classification head "
                      "(an encoder-decoder model can be planned from a --model file that builds it)")


def _check_size(name: str, config: Any, task: str, seq: int) -> None:
    if task == "image-classification":
        patch = getattr(config, "patch_size", 1)
        if seq % patch:
            raise ModelError(f"--image-size: got {seq}; {name} needs a multiple of its patch size {patch}")
        return
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and seq > limit:
        raise ModelError(f"--seq: got {seq}; {name} has {limit} positions (max_position_embeddings), "
                         f"accepted 1 to {limit}")


def _build_step(config: Any, task: str, batch: int, seq: int, dtype: torch.dtype):
    import transformers

    auto = {"causal-lm": transformers.AutoModelForCausalLM, "masked-lm": transformers.AutoModelForMaskedLM,
            "image-classification": transformers.AutoModelForImageClassification}[task]
    from transformers.initialization import no_init_weights

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are created in the training dtype
    try:
        # No weight initialisation: values do not matter to a plan, and some initialisers
        # (ViT's truncated normal) read values, which fake tensors do not have.
        with no_init_weights():
            try:
                model = auto.from_config(config)
            except (TypeError, ValueError, RuntimeError, ImportError) as e:
                hint = ("; fxoffload asks for SDPA attention: give the config file an \"attn_implementation\" "
                        "field (\"eager\") to plan another" if "scaled_dot_product_attention" in str(e) else "")
                raise ModelError(f"transformers could not build the model from the config: {type(e).__name__}: "
                                 f"{e}{hint}")
        model.tie_weights()  # init_weights, skipped above, also ties (GPT-2's head is its embedding)
    finally:
        torch.set_default_dtype(previous)
    if task == "image-classification":
        size = (batch, config.num_channels, seq, seq)
        inputs = {"pixel_values": torch.randn(size, dtype=dtype),
                  "labels": torch.randint(0, config.num_labels, (batch,))}
    else:
        ids = torch.randint(0, config.vocab_size, (batch, seq))
        inputs = {"input_ids": ids}
    return TrainingStep(model.train(), task), (), inputs


class TrainingStep(torch.nn.Module):
    """One training step's forward: the model, then a cross-entropy loss from its logits."""

    def __init__(self, model: torch.nn.Module, task: str) -> None:
        super().__init__()
        self.model, self.task = model, task

    def forward(self, input_ids=None, pixel_values=None, labels=None):
        cross_entropy = torch.nn.functional.cross_entropy
        if self.task == "image-classification":
            logits = self.model(pixel_values=pixel_values).logits
            return cross_entropy(logits.float(), labels)
        logits = self.model(input_ids=input_ids).logits
        if self.task == "causal-lm":  # predict the next token
            return cross_entropy(logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten())
        return cross_entropy(logits.flatten(0, 1).float(), input_ids.flatten())


def layer_list(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The model's layers as FSDP2 and torchtitan wrap and compile them: of the ``nn.ModuleList``s whose
    children share one class, the one holding the most parameters (None if there is none)."""
    best, best_size = None, 0
    for module in model.modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) == 0:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if size > best_size:
            best, best_size = module, size
    return best


def unlike_layers(layers: "list[torch.nn.Module]") -> str | None:
    """Why the layers after the first are not all alike, else None: each one's modules (types, names),
    parameter and buffer shapes and dtypes, and plain attributes against layer 1's (an attribute whose
    value is each layer's own position, ``layer_idx``, is an index and may differ). ``fxoffload fit``
    copies a traced layer only into layers alike (``fxoffload.passes.layer_copies``): a layer that
    attends over a sliding window every sixth layer, or a dense layer among experts, differs here."""
    later = layers[1:]
    shapes = [_structure(layer) for layer in later]
    for position, shape in enumerate(shapes[1:], start=2):
        if shape != shapes[0]:
            return f"layer {position}'s modules or tensors are not layer 1's"
    attributes = [_attributes(layer) for layer in later]
    positions = list(range(1, len(layers)))
    for key in dict.fromkeys(key for found in attributes for key in found):  # every layer's, in order
        values = [found.get(key, "(none)") for found in attributes]
        if len(set(map(repr, values))) > 1 and values != positions:
            where = next(i for i, v in enumerate(values) if repr(v) != repr(values[0])) + 1
            return f"layer {where}'s {'.'.join(p for p in key if p)} is {values[where - 1]!r}, layer 1's {values[0]!r}"
    return None


def layer_period(layers: "list[torch.nn.Module]", longest: int, start: int = 1) -> int | None:
    """The fewest ``p`` (at most ``longest``) with every layer from ``start`` on alike the one ``p`` on
    (:func:`unlike_layers`' test, at distance ``p``): 1 where all are alike, 6 for Gemma-3 (every sixth
    layer attends globally), 2 for Gemma-2; None where none is."""
    later = layers[start:]
    shapes = [_structure(layer) for layer in later]
    attributes = [_attributes(layer) for layer in later]
    positions = list(range(start, len(layers)))
    keys = dict.fromkeys(key for found in attributes for key in found)
    columns = [[repr(found.get(key, "(none)")) for found in attributes] for key in keys]
    columns = [c for c in columns if c != [repr(p) for p in positions]]  # each layer's own index: may differ
    for period in range(1, longest + 1):
        if all(shapes[i] == shapes[i + period] for i in range(len(shapes) - period)) and all(
                c[i] == c[i + period] for c in columns for i in range(len(c) - period)):
            return period
    return None


def alike_at(one: torch.nn.Module, other: torch.nn.Module, positions: tuple[int, int]) -> bool:
    """Whether two layers are built alike (modules, tensors' shapes and dtypes, plain attributes), an
    attribute that is each one's own position (``positions``: ``layer_idx``) apart."""
    if _structure(one) != _structure(other):
        return False
    a, b = _attributes(one), _attributes(other)
    return all(repr(a.get(key, "(none)")) == repr(b.get(key, "(none)"))
               or (type(a.get(key)) is int and (a.get(key), b.get(key)) == positions) for key in {**a, **b})


def _structure(layer: torch.nn.Module) -> tuple:
    return tuple((name, type(module).__qualname__,
                  tuple((key, tuple(t.shape), t.dtype) for key, t in [*module.named_parameters(recurse=False),
                                                                      *module.named_buffers(recurse=False)]))
                 for name, module in layer.named_modules())


def _attributes(layer: torch.nn.Module) -> dict:
    return {(name, key): value for name, module in layer.named_modules() for key, value in vars(module).items()
            if not key.startswith("_") and key != "training"
            and isinstance(value, (int, float, str, bool, tuple, type(None)))}


def _selective_ops() -> frozenset:
    """The ops whose outputs selective checkpointing saves: matmuls and attention, as in torchtitan's
    save list; everything else (norms, activations, elementwise) is recomputed."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_mm")
    return frozenset(getattr(aten, name).default for name in names if hasattr(aten, name))


def _selective_policy(saved: frozenset, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    # PREFER_SAVE, where torchtitan says MUST_SAVE: fxoffload keeps a MUST_SAVE on the device,
    # and a saved matmul output is exactly what a budget may need to offload.
    return CheckpointPolicy.PREFER_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_layers(model: torch.nn.Module, mode: str, origin: str) -> int:
    """Wrap each repeated layer of ``model`` in non-reentrant activation checkpointing, as torchtitan
    does (``checkpoint_wrapper``); return how many layers were wrapped.

    ``full`` recomputes each layer's whole forward in the backward, so a layer saves only its
    inputs; ``selective`` marks what :func:`_selective_ops` lists ``PREFER_SAVE`` (a hint the plan
    may override to meet a budget) and recomputes the rest."""
    if mode not in CHECKPOINTING:
        raise ModelError(f"--checkpointing: got {mode!r}; accepted: {', '.join(CHECKPOINTING)}")
    if mode == "none":
        return 0
    # Here: torch.distributed is absent from some builds, and only checkpointing needs the wrapper.
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper, checkpoint_wrapper

    if any(getattr(m, "gradient_checkpointing", False) is True or isinstance(m, ActivationWrapper)
           for m in model.modules()):
        raise ModelError(f"--checkpointing {mode}: {origin} checkpoints its layers already (transformers' "
                         "gradient checkpointing or a checkpoint wrapper); turn one of the two off")
    layers = layer_list(model)
    if layers is None:
        raise ModelError(f"--checkpointing {mode}: {origin} has no list of repeated layers (an nn.ModuleList of "
                         "one layer class) to checkpoint")
    kwargs = {}
    if mode == "selective":
        policy = functools.partial(_selective_policy, _selective_ops())
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, policy)
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer, **kwargs)
    return len(layers)


class _UserStep(torch.nn.Module):
    """A model from a file whose output is a loss, or has one (checked before tracing)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        return _loss_of(self.model(*args, **kwargs))
