"""What uneven rows per expert cost the fused expert kernels: forward and forward+backward of one MoE
layer's experts (`routed_moe_mlp`, autotuned) under uniform random top-K routing and under balanced
routing (every expert exactly T * K / E rows: at DeepSeek-V3's 128 rows per expert, no partly filled
row tile), the same weights. Prints the rows per expert, the median ms, and the configs chosen.

    python examples/routing_balance.py [deepseek|qwen3|mixtral] [T] [random,balanced]    (a CUDA GPU)
"""
import sys, json, torch
from triton.testing import do_bench
from thunderep.kernels.ops import routed_moe_mlp, kernel_configs

shape = sys.argv[1] if len(sys.argv) > 1 else "deepseek"
T = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
D, I, E, K = {"deepseek": (7168, 2048, 256, 8), "qwen3": (2048, 768, 128, 8), "mixtral": (4096, 14336, 8, 2)}[shape]
dev, dt = "cuda", torch.bfloat16
g = torch.Generator(device=dev).manual_seed(0)
w_gu = torch.nn.Parameter(torch.randn(E, 2 * I, D, device=dev, dtype=dt, generator=g) * D**-0.5)
w_d = torch.nn.Parameter(torch.randn(E, D, I, device=dev, dtype=dt, generator=g) * I**-0.5)
x = torch.randn(T, D, device=dev, dtype=dt, generator=g, requires_grad=True)
dy = torch.randn(T, D, device=dev, dtype=dt, generator=g)
w = torch.softmax(torch.randn(T, K, device=dev, generator=g), -1).to(dt).requires_grad_()
routings = {
    "random": torch.rand(T, E, device=dev, generator=g).topk(K, dim=-1).indices,
    "balanced": (torch.arange(T, device=dev)[:, None] * K + torch.arange(K, device=dev)[None, :]) % E,
}
only = sys.argv[3].split(",") if len(sys.argv) > 3 else list(routings)
for name, ids in ((n, routings[n]) for n in only):
    counts = torch.bincount(ids.flatten(), minlength=E)
    with torch.no_grad():
        fwd = do_bench(lambda: routed_moe_mlp(x, w_gu, w_d, ids, w), warmup=25, rep=300, return_mode="median")
    def step():
        y = routed_moe_mlp(x, w_gu, w_d, ids, w)
        torch.autograd.grad(y, (x, w_gu, w_d, w), dy)
    fb = do_bench(step, warmup=10, rep=600, return_mode="median")
    print(f"{shape} T={T} {name:8s} rows/expert min {counts.min().item()} mean {counts.float().mean().item():.0f} "
          f"max {counts.max().item()}: fwd {fwd:.3f} ms, fwd+bwd {fb:.3f} ms", flush=True)
print(json.dumps({k: v for k, v in kernel_configs().items() if k in ("up", "rows", "act_bwd")}))
