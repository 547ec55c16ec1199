"""The MoE layer: router, experts, the expert-parallel forward they share, and plain-PyTorch references."""
