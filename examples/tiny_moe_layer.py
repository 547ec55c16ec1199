"""Build a tiny Mixtral-shaped MoE layer, check it against the slow reference, train it a few steps.

    python examples/tiny_moe_layer.py
"""

from __future__ import annotations

import torch

from thunderep import LayerConfig, ThunderMoELayer
from thunderep.moe.reference import reference_layer


def main() -> None:
    torch.manual_seed(0)
    config = LayerConfig.build(family="mixtral", hidden_size=64, intermediate_size=128, num_experts=8, top_k=2)
    layer = ThunderMoELayer(config)

    x = torch.randn(4, 16, 64)  # [batch, sequence, hidden]
    y, routing = layer(x, return_routing=True)
    print("output", tuple(y.shape), "tokens per expert", routing.counts_E.tolist())

    error = (y - reference_layer(layer, x)).abs().max().item()
    print(f"max |layer - slow reference| = {error:.2e}")

    # A few steps fitting a random target: the layer, router included, trains like any nn.Module.
    target = torch.randn_like(x)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=3e-3)
    for step in range(20):
        loss = torch.nn.functional.mse_loss(layer(x), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 5 == 0 or step == 19:
            print(f"step {step:2d} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
