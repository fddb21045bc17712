"""A model file for ``fxoffload plan --model``, as a user writes one: a transformers language model built
from a config (random weights, nothing downloaded) that returns its own loss. The tests copy it with
ARCH and CHECKPOINTING set."""

import torch
import transformers

ARCH = "llama"  # llama, qwen2 or bert
CHECKPOINTING = False  # transformers' own gradient checkpointing, non-reentrant

CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"num_key_value_heads": 2}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"num_key_value_heads": 2}),
    "bert": ("BertConfig", "BertForMaskedLM", {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}),
}


def build(batch, seq, dtype):
    config_class, model_class, extra = CLASSES[ARCH]
    config = getattr(transformers, config_class)(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=512, **extra)
    model = getattr(transformers, model_class)(config).to(dtype)
    if CHECKPOINTING:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    return model.train(), {"input_ids": ids, "labels": ids}
