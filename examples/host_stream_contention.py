"""Whether the two paths of offloaded experts slow each other down: the host path reads an expert's weights
from host memory for its products, the stream path copies another's from the same host memory over PCIe.
One expert of a shape (bfloat16, gated: gate/up [2I, D] and down [D, I]), one token.

    python examples/host_stream_contention.py [--shape mixtral] [--experts 4] [--threads 8]

Prints milliseconds per expert of the host's products alone (x @ W.t(), as the host path holds its
weights, on --threads torch threads), of the copy to the device alone (pinned host memory, one stream),
and of both at once (the products on a thread, the copies on the launching thread), each the best of three
passes over --experts different experts, and each path's time at once over its time alone. The offload
cost model (moe/offload_cost.py) times each path alone and splits a call's cold experts between them as if
they shared nothing.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch
import torch.nn.functional as F

from thunderep.bench.kernels import SHAPES


def _host_pass(x, experts) -> float:
    """Seconds for the host's products of x with every expert's weights, in order."""
    started = time.perf_counter()
    for gate_up, down in experts:
        g, u = (x @ gate_up.t()).chunk(2, dim=-1)
        (F.silu(g) * u) @ down.t()
    return time.perf_counter() - started


def _copy_pass(experts, slot) -> float:
    """Seconds for copying every expert's weights into the device slot, in order (stream-synchronized)."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    for gate_up, down in experts:
        slot[0].copy_(gate_up, non_blocking=True)
        slot[1].copy_(down, non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - started


def _together(x, host_experts, copy_experts, slot) -> tuple[float, float]:
    """(host seconds, copy seconds) with the host's products on a thread while the copies run here."""
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("host", _host_pass(x, host_experts)))
    worker.start()
    copy_s = _copy_pass(copy_experts, slot)
    worker.join()
    return result["host"], copy_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="mixtral", choices=sorted(SHAPES))
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--threads", type=int, default=8)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this example needs a CUDA GPU (the stream path copies to it)")
    torch.set_num_threads(args.threads)
    D, I = SHAPES[args.shape][:2]

    def expert():
        return (torch.randn(2 * I, D, dtype=torch.bfloat16).pin_memory(),
                torch.randn(D, I, dtype=torch.bfloat16).pin_memory())

    host_experts = [expert() for _ in range(args.experts)]
    copy_experts = [expert() for _ in range(args.experts)]
    slot = (torch.empty(2 * I, D, dtype=torch.bfloat16, device="cuda"),
            torch.empty(D, I, dtype=torch.bfloat16, device="cuda"))
    x = torch.randn(1, D, dtype=torch.bfloat16)
    mb = 2 * 3 * I * D / 1e6
    _host_pass(x, host_experts[:1])
    _copy_pass(copy_experts[:1], slot)
    alone_host = min(_host_pass(x, host_experts) for _ in range(3)) / args.experts
    alone_copy = min(_copy_pass(copy_experts, slot) for _ in range(3)) / args.experts
    together = [_together(x, host_experts, copy_experts, slot) for _ in range(3)]
    both_host = min(t[0] for t in together) / args.experts
    both_copy = min(t[1] for t in together) / args.experts
    print(f"{args.shape}: one expert {mb:.1f} MB, {args.experts} experts a pass, {args.threads} torch threads")
    print("| path | alone ms | at once ms | at once / alone | GB/s alone | GB/s at once |")
    print("|---|---|---|---|---|---|")
    for name, alone, both in (("host products", alone_host, both_host), ("copy to the device", alone_copy,
                                                                          both_copy)):
        print(f"| {name} | {alone * 1e3:.2f} | {both * 1e3:.2f} | {both / alone:.2f}x | {mb / alone / 1e3:.1f} | "
              f"{mb / both / 1e3:.1f} |")


if __name__ == "__main__":
    main()
