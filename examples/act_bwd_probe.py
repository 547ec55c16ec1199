"""What the backward's dhu kernel (`act_bwd_kernel`: dhu = dy[tok] @ Wd[e] with the activation backward in
its epilogue) costs per config, for the DeepSeek-V3 shape under uniform random top-8 routing, beside the
forward's down kernel (`rows_kernel`, the same FLOPs and weight bytes) at the config autotuning picks.

    python examples/act_bwd_probe.py [T]        (a CUDA GPU; default T = 4096)

A config is (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, TAIL, GROUP_M[, GATHER]); GATHER False
reads dy already gathered into expert order. Each config is timed twice; ms, medians
(`triton.testing.do_bench`)."""
import sys, torch, triton
from triton.testing import do_bench
from thunderep.kernels import sorted_mlp
from thunderep.kernels import tiles as tile_tables
D, I, E, k = 7168, 2048, 256, 8
T = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
dev, dt = "cuda", torch.bfloat16
g = torch.Generator(device=dev).manual_seed(0)
w_d = torch.randn(E, D, I, device=dev, dtype=dt, generator=g) * I**-0.5
N = T * k
ids = torch.rand(T, E, device=dev, generator=g).topk(k, dim=-1).indices
flat = ids.flatten()
order = torch.sort(flat, stable=True).indices.to(torch.int32)
counts = torch.bincount(flat, minlength=E).to(torch.int32)
dy = torch.randn(T, D, device=dev, dtype=dt, generator=g)
dy_rows = dy[order.long() // k].contiguous()
gu = torch.randn(N, 2 * I, device=dev, dtype=dt, generator=g)
dgu = torch.empty_like(gu)
hw = gu.new_empty(N, I)
wts = torch.rand(N, device=dev, dtype=dt, generator=g)
tiles = triton.cdiv(I, 16)
dwp = torch.zeros(N, tiles, dtype=torch.float32, device=dev)


def act_bwd(bm, bn, bk, warps, stages, tail, group, gather=True):
    grid = sorted_mlp.row_grid(N, E, I)  # the launch grid ops uses
    src = dy if gather else dy_rows
    return lambda: tile_tables.ACT_BWD_PLAIN[grid](
        dy_ptr=src, w_ptr=w_d, gu_ptr=gu, dgu_ptr=dgu, dwp_ptr=dwp, hw_ptr=hw, order_ptr=order, weight_ptr=wts,
        counts_ptr=counts, n_rows=N, I=I, D=D, E=E, top_k=k, stride_dym=D, stride_we=w_d.stride(0),
        stride_wd=I, stride_gm=2 * I, stride_dwp=tiles, m_class=128, m_fill=1, ACT=0, INTERLEAVED=False, GATHER=gather,
        WEIGHTED=True, PRECISION="tf32", BLOCK_E=256, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group,
        TAIL=tail, num_warps=warps, num_stages=stages)


def rows(bm, bn, bk, warps, stages, tail, group):
    h = torch.randn(N, I, device=dev, dtype=dt, generator=g)
    out = dy.new_empty(N, D)
    grid = sorted_mlp.row_grid(N, E, D)  # the launch grid ops uses
    return lambda: tile_tables.ROWS_PLAIN[grid](
        a_ptr=h, b_ptr=w_d, c_ptr=out, order_ptr=order, weight_ptr=wts, counts_ptr=counts, n_rows=N, N=D, K=I,
        E=E, stride_am=I, stride_be=w_d.stride(0), stride_bn=I, stride_bk=1, stride_cm=D, m_class=128, m_fill=1,
        SCATTER=True, WEIGHTED=True, PRECISION="tf32", BLOCK_E=256, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        GROUP_M=group, TAIL=tail, num_warps=warps, num_stages=stages)


cases = [("rows", rows, (128, 256, 64, 8, 3, False, 8))] + [("act_bwd", act_bwd, c) for c in [
    (128, 128, 64, 8, 4, True, 8), (128, 128, 64, 8, 4, True, 8, False), (128, 128, 64, 8, 3, True, 8),
    (128, 128, 64, 8, 4, False, 8), (128, 128, 128, 8, 3, True, 8), (128, 64, 128, 4, 4, True, 8),
    (128, 128, 64, 8, 4, True, 1), (128, 128, 64, 8, 4, True, 32), (128, 256, 64, 8, 3, False, 8),
    (64, 128, 64, 4, 4, False, 8), (64, 256, 64, 8, 3, False, 8), (128, 128, 32, 8, 6, True, 8),
]]
for name, mk, c in cases:
    try:
        f = mk(*c)
        ms = [do_bench(f, warmup=25, rep=200, return_mode="median") for _ in range(2)]
    except Exception as e:  # noqa: BLE001 - a config that does not compile or fit is reported, not fatal
        ms = [float("nan")] * 2
        print(name, c, type(e).__name__, str(e)[:100])
    print(name, c, [round(v, 3) for v in ms], flush=True)
