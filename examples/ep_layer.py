"""An expert-parallel MoE layer across processes; checks itself against one process.

    torchrun --nproc_per_node=2 examples/ep_layer.py          # CPU (gloo) or one GPU per rank (NCCL)
    torchrun --nproc_per_node=4 examples/ep_layer.py --waves 4 --compression bf16

Every rank builds the same full layer (same seed), keeps its share of the experts, runs its own
tokens, and compares with the full layer run on all ranks' tokens.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from thunderep import EPConfig, ExpertParallel, LayerConfig, ThunderMoELayer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64, help="tokens per rank")
    parser.add_argument("--waves", type=int, default=1)
    parser.add_argument("--compression", default="none", choices=("none", "bf16", "fp8"))
    args = parser.parse_args()

    ep = ExpertParallel.init(config=EPConfig(waves=args.waves, compression=args.compression))
    rank, world, device = ep.groups.rank, ep.groups.world_size, ep.groups.device
    config = LayerConfig.build(family="mixtral", hidden_size=128, intermediate_size=256, num_experts=8, top_k=2)

    torch.manual_seed(0)
    full = ThunderMoELayer(config).to(device)
    layer = ThunderMoELayer(config, ep=ep)
    layer.load_state_dict(layer.shard_state_dict(full.state_dict()))

    torch.manual_seed(1)
    x_all = torch.randn(world * args.tokens, 128, device=device)
    mine = slice(rank * args.tokens, (rank + 1) * args.tokens)
    y = layer(x_all[mine])
    error = (y - full(x_all)[mine]).abs().max().item()
    stats = ep.stats.snapshot()
    print(f"rank {rank}/{world}: experts {layer.local_experts}, max |EP - single| = {error:.2e}, "
          f"bytes sent to peers {stats['remote_bytes']}, control plane {ep.control.kind}")
    ep.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
