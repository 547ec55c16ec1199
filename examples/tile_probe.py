"""What a row tile costs: the gate/up kernel (`up_kernel`) and the down kernel (`rows_kernel`) of the
DeepSeek-V3 shape, each launched with fixed configs (no autotuning), under uniform random top-8 routing
(at 4096 tokens, 99 to 162 rows per expert) and balanced routing (every expert exactly T * 8 / 256 rows).

    python examples/tile_probe.py [T]        (a CUDA GPU; default T = 4096)

A config is (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, TAIL]). Each routing is timed twice,
alternating, and each line prints the medians in ms (`triton.testing.do_bench`)."""
import sys, torch
from triton.testing import do_bench
from thunderep.kernels import sorted_mlp, tiles
D, I, E, k = 7168, 2048, 256, 8
T = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
dev, dt = "cuda", torch.bfloat16
g = torch.Generator(device=dev).manual_seed(0)
w_gu = torch.randn(E, 2 * I, D, device=dev, dtype=dt, generator=g) * D**-0.5
w_d = torch.randn(E, D, I, device=dev, dtype=dt, generator=g) * I**-0.5
x = torch.randn(T, D, device=dev, dtype=dt, generator=g)
N = T * k
routings = {"random": torch.rand(T, E, device=dev, generator=g).topk(k, dim=-1).indices,
            "balanced": (torch.arange(T, device=dev)[:, None] * k + torch.arange(k, device=dev)[None, :]) % E}
def up(ids, bm, bn, bk, warps, stages, tail=False):
    flat = ids.flatten()
    order = torch.sort(flat, stable=True).indices.to(torch.int32)
    counts = torch.bincount(flat, minlength=E).to(torch.int32)
    h = x.new_empty(N, I)
    grid = sorted_mlp.row_grid(N, E, I)  # the launch grid ops uses
    f = lambda: tiles.UP_PLAIN[grid](x_ptr=x, w_ptr=w_gu, h_ptr=h, gu_ptr=h, order_ptr=order, counts_ptr=counts,
        n_rows=N, I=I, D=D, E=E, top_k=k, stride_xm=D, stride_we=w_gu.stride(0), stride_wn=D, stride_hm=I,
        stride_gm=2 * I, m_class=128, m_fill=1, ACT=0, INTERLEAVED=False, GATHER=True, SAVE_GU=False, PRECISION="tf32",
        BLOCK_E=256, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, TAIL=tail, num_warps=warps, num_stages=stages)
    return f, h
def rows(ids, bm, bn, bk, warps, stages, tail=False):
    flat = ids.flatten()
    order = torch.sort(flat, stable=True).indices.to(torch.int32)
    counts = torch.bincount(flat, minlength=E).to(torch.int32)
    a = torch.randn(N, I, device=dev, dtype=dt, generator=g)
    out = x.new_empty(N, D)
    wts = torch.rand(N, device=dev, dtype=dt, generator=g)
    grid = sorted_mlp.row_grid(N, E, D)  # the launch grid ops uses
    f = lambda: tiles.ROWS_PLAIN[grid](a_ptr=a, b_ptr=w_d, c_ptr=out, order_ptr=order, weight_ptr=wts,
        counts_ptr=counts, n_rows=N, N=D, K=I, E=E, stride_am=I, stride_be=w_d.stride(0), stride_bn=I,
        stride_bk=1, stride_cm=D, m_class=128, m_fill=1, SCATTER=True, WEIGHTED=True, PRECISION="tf32",
        BLOCK_E=256, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, TAIL=tail, num_warps=warps, num_stages=stages)
    return f, out
cfgs = {"up": [(128, 128, 64, 8, 4), (128, 128, 64, 8, 4, True), (128, 128, 64, 8, 3, True), (128, 64, 64, 4, 4, True),
               (128, 64, 64, 8, 4, True)],
        "rows": [(128, 256, 64, 8, 3), (128, 256, 64, 8, 3, True), (128, 128, 64, 8, 4, True),
                 (128, 128, 64, 8, 3, True)]}
res = {}
for name, mk in (("up", up), ("rows", rows)):
    for c in cfgs[name]:
        for rname in ("random", "balanced", "random", "balanced"):
            try:
                f, _ = mk(routings[rname], *c)
                ms = do_bench(f, warmup=25, rep=200, return_mode="median")
            except Exception as e:
                ms = float("nan"); print(name, c, type(e).__name__, str(e)[:100])
            res.setdefault((name, c, rname), []).append(ms)
        print(name, c, {r: [round(v, 3) for v in res[(name, c, r)]] for r in ("random", "balanced")}, flush=True)
