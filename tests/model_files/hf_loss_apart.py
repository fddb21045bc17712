"""A model file for ``fxoffload plan --model``, as a user writes one: a transformers Llama built from a
config (random weights, nothing downloaded) whose loss is computed apart, on the logits it returns,
after a graph break: the loss is a compiled region of its own, handed the logits. CHECKPOINTING turns
on transformers' own gradient checkpointing (non-reentrant); the tests copy the file with it set."""

import torch
import transformers

CHECKPOINTING = True


class LossApart(torch.nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, labels):
        logits = self.lm(input_ids=input_ids).logits
        torch._dynamo.graph_break()  # the loss: a region of its own
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def build(batch, seq, dtype):
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=4096, use_cache=False)
    lm = transformers.LlamaForCausalLM(config).to(dtype)
    if CHECKPOINTING:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    return LossApart(lm).train(), {"input_ids": ids, "labels": ids}
