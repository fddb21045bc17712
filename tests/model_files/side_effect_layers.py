"""A model file for ``fxoffload plan --model`` whose layers set a module-level value while their forward
runs and restore it after, as transformers 5.25's layers do: its `kernels` package routes a layer's
functions through a context variable that each attention forward sets and resets, a plain attribute
under torch.compile. Inside a checkpointed region Dynamo refuses that change unless told to skip it in
the recompute (``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint``): it then breaks
the graph at the region and runs the layer eagerly. Shaped as transformers' language models are: a body
(embedding, layers) inside the model that computes the loss."""

import torch


class Active:
    """What the layer running now left here (``None`` between layers)."""

    layer = None


ACTIVE = Active()


class Layer(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x):
        previous, ACTIVE.layer = ACTIVE.layer, self
        try:
            return x + self.down(torch.nn.functional.silu(self.up(x)))
        finally:
            ACTIVE.layer = previous


class Body(torch.nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(width, width)  # the layers' inputs then need gradients, as an embedding's do
        self.layers = torch.nn.ModuleList(Layer(width) for _ in range(layers))

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x


class Model(torch.nn.Module):
    def __init__(self, width: int = 64, layers: int = 3) -> None:
        super().__init__()
        self.body = Body(width, layers)
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x):
        return self.head(self.body(x)).square().mean()


def build(batch, seq, dtype):
    return Model().to(dtype).train(), {"x": torch.randn(batch, seq, 64, dtype=dtype)}
