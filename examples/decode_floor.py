"""What a decode step's expert MLP can reach at T = 1 on this GPU, whatever its arithmetic: kernels that
only read the step's expert-weight bytes, timed under CUDA-graph replay as the kernel benchmark's
fwd-graph rows are (`thunderep bench kernels`).

    python examples/decode_floor.py [--shapes qwen3,mixtral,deepseek]

One token with K experts reads K x 3 x D x I x 2 bytes (bf16): 2/3 in the gate/up pass, 1/3 in the
down pass, which needs the gate/up pass's whole output first. Rows, per shape:
- copy: one device-to-device copy moving those bytes (read + written), the benchmark's reference;
- one read: one kernel reads all of them (the floor of a one-launch design);
- two reads: one kernel reads the gate/up share, a second the down share, launched after it;
- two reads, PDL: the second launched as a programmatic dependent (sm_90 and later), as the decode
  down pass is: its programs load their first chunk, wait for the first kernel (griddepcontrol.wait),
  then read the rest.
Each read kernel's (programs, block, warps) is swept alone, and the best kept; the best time per
program count is printed too (the grain of the work, at fixed bytes). Four buffer sets
rotate, so L2 holds none of the bytes. "HBM frac" is bytes read per second over the copy bandwidth
of a 2 GiB copy measured in the same run (the benchmark's definition).
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
import triton
import triton.language as tl

from thunderep.bench.kernels import ROTATE, SHAPES, _bench, copy_bandwidth
from thunderep.cli.bench import parse_shapes
from thunderep.kernels.pairs import gdc_launch_dependents, gdc_wait

PROGRAMS = (264, 528, 1056, 2112, 4224, 8448)
BLOCKS = (512, 1024, 2048, 4096)
WARPS = (4, 8)


@triton.jit
def _read_kernel(src_ptr, out_ptr, n, per_program, BLOCK: tl.constexpr, WAIT: tl.constexpr,
                 LAUNCH_DEPENDENTS: tl.constexpr):
    """Sum program_id's `per_program` elements (a multiple of BLOCK; the last program's masked at n)
    into out[program_id]."""
    if LAUNCH_DEPENDENTS:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * per_program + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    if WAIT:  # as the decode down pass: first chunk loaded, then wait for the kernel before
        acc += tl.load(src_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        gdc_wait()
    for i in range(BLOCK * WAIT, per_program, BLOCK):
        acc += tl.load(src_ptr + offs + i, mask=offs + i < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


def _reader(buffers, cfg, wait=False, launch_dependents=False):
    """A function reading buffers[i % ROTATE] on call i; the bytes each call reads."""
    programs, block, warps = cfg
    n = buffers[0].numel()
    per_program = triton.cdiv(triton.cdiv(n, programs), block) * block  # all n elements are read
    out = torch.empty(programs, dtype=torch.float32, device=buffers[0].device)
    it = itertools.count()

    def fn():
        _read_kernel[(programs,)](buffers[next(it) % ROTATE], out, n, per_program, BLOCK=block, WAIT=int(wait),
                                  LAUNCH_DEPENDENTS=launch_dependents, num_warps=warps,
                                  **({"launch_pdl": True} if wait else {}))
    return fn, n * buffers[0].element_size()


def capture(fns) -> torch.cuda.CUDAGraph:
    """ROTATE steps (each the `fns` in order) captured in one CUDA graph, after one run outside it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(ROTATE):
            for fn in fns:
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(ROTATE):
            for fn in fns:
                fn()
    return graph


def graph_us(fns) -> float:
    """Microseconds per step: `capture(fns)` replayed."""
    graph = capture(fns)
    us = _bench(graph.replay, 100.0) * 1e3 / ROTATE
    del graph
    return us


_NOTES: list[str] = []  # lines printed under a shape's row


def best_reader(buffers, label):
    """(us, config, bytes) of the fastest config reading one buffer per step. Prints the best time per
    program count: how the time depends on the grain of the work, at a fixed number of bytes."""
    found = []
    for cfg in itertools.product(PROGRAMS, BLOCKS, WARPS):
        fn, n = _reader(buffers, cfg)
        found.append((graph_us([fn]), cfg, n))
    by_programs = {p: min(us for us, cfg, _ in found if cfg[0] == p) for p in PROGRAMS}
    _NOTES.append(f"  ({label}, best us by programs: " + ", ".join(f"{p}: {us:.1f}" for p, us in by_programs.items())
                  + ")")
    return min(found)


def step_buffers(name, device):
    """(whole, up, down, bytes, copy) for one decode step of shape `name` at T = 1: ROTATE buffers of the
    step's expert-weight elements (bf16), their gate/up and down shares, the step's bytes, and a
    function copying those bytes (half read, half written), a different buffer pair each call."""
    D, I, _, K = SHAPES[name]
    n_up, n_down = K * 2 * I * D, K * I * D  # elements
    whole = [torch.randn(n_up + n_down, device=device, dtype=torch.bfloat16) for _ in range(ROTATE)]
    up, down = [b[:n_up] for b in whole], [b[n_up:] for b in whole]
    total = (n_up + n_down) * 2
    halves = [(torch.empty(total // 2, dtype=torch.uint8, device=device),
               torch.empty(total // 2, dtype=torch.uint8, device=device)) for _ in range(ROTATE)]
    copies = itertools.count()

    def copy():
        src, dst = halves[next(copies) % ROTATE]
        dst.copy_(src)
    return whole, up, down, total, copy


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3")
    args = ap.parse_args(argv)
    shapes = parse_shapes(ap, args.shapes)
    if not torch.cuda.is_available():
        print("decode_floor needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    bw = copy_bandwidth(device)
    pdl = torch.cuda.get_device_capability()[0] >= 9
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
    print("| shape | bytes MB | copy us | one read us | two reads us | two reads, PDL us | 80% of copy bw us | "
          "HBM frac: copy / one / two / two PDL |\n|---|---|---|---|---|---|---|---|")
    for name in shapes:
        whole, up, down, total, copy = step_buffers(name, device)
        copy_us = graph_us([copy])
        one_us, one_cfg, one_bytes = best_reader(whole, f"{name} one read")
        up_us, up_cfg, up_bytes = best_reader(up, f"{name} gate/up share")
        down_us, down_cfg, down_bytes = best_reader(down, f"{name} down share")
        two_bytes = up_bytes + down_bytes
        two_us = graph_us([_reader(up, up_cfg)[0], _reader(down, down_cfg)[0]])
        pdl_us = graph_us([_reader(up, up_cfg, launch_dependents=True)[0], _reader(down, down_cfg, wait=True)[0]]) \
            if pdl else float("nan")
        frac = [total / (copy_us * 1e-6) / bw, one_bytes / (one_us * 1e-6) / bw, two_bytes / (two_us * 1e-6) / bw,
                two_bytes / (pdl_us * 1e-6) / bw]
        print(f"| {name} | {total / 1e6:.1f} | {copy_us:.1f} | {one_us:.1f} | {two_us:.1f} | {pdl_us:.1f} | "
              f"{total / (0.8 * bw) * 1e6:.1f} | " + " / ".join(f"{f:.0%}" for f in frac) + " |")
        print(f"  (best configs, (programs, block, warps): one {one_cfg}; gate/up share {up_cfg} {up_us:.1f} us "
              f"alone; down share {down_cfg} {down_us:.1f} us alone)")
        print("\n".join(_NOTES))
        _NOTES.clear()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
