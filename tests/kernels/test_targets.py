"""The kernels' default path builds for RTX 4090 / 5090 without Hopper-only instructions (no GPU needed).

The build runs in a child process: the kernel tests may have put Triton in interpreter mode here,
and interpreted kernels cannot be compiled.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

_SCRIPT = """
import json, dataclasses, sys
from thunderep.kernels.targets import compile_kernels
print(json.dumps([dataclasses.asdict(b) for b in compile_kernels(int(sys.argv[1]))]))
"""


@pytest.fixture(scope="module")
def builds():
    """Every kernel built for sm_89, sm_90 and sm_120, one process per target, side by side."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    procs = {arch: subprocess.Popen([sys.executable, "-c", _SCRIPT, str(arch)], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for arch in (89, 90, 120)}
    out = {}
    for arch, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-2000:]
        out[arch] = json.loads(stdout.strip().splitlines()[-1])
    return out


GEMM_KERNELS = {"up", "rows", "act_bwd", "wgrad", "up_tail", "rows_tail", "act_bwd_tail"}
# decode: matrix-vector products, no tensor cores
PAIR_KERNELS = {"up_pairs", "up_pairs_ahead", "up_pairs_x_rows", "down_pairs", "down_pairs_split",
                "down_pairs_split_ahead", "down_pairs_split_x_rows", "down_pairs_all_slots"}
PAIR_DOT_KERNELS = {"up_pairs_dot"}  # decode with 16-row tensor-core tiles
SORT_KERNELS = {"route"}  # the one-program sort of small inference batches
FP8_GEMM_KERNELS = {"up_fp8", "rows_fp8", "up_pairs_dot_fp8", "up_fp8rows"}  # FP8 weights (fp8.py), tensor cores
FP8_PAIR_KERNELS = {"up_pairs_fp8", "up_pairs_ahead_fp8", "down_pairs_split_ahead_fp8", "down_pairs_all_slots_fp8",
                    "up_pairs_ahead_fp8rows", "down_pairs_all_slots_fp8rows"}
W8A8_KERNELS = {"up_w8a8", "up_w8a8_blocks", "rows_w8a8", "rows_w8a8_blocks"}  # FP8 inputs too: FP8 tensor cores
INT4_PAIR_KERNELS = {"up_pairs4", "down_pairs4", "up_pairs4_gptoss", "down_pairs4_gptoss",  # 4-bit (pairs4.py)
                     "up_pairs4_half", "down_pairs4_half",  # float16-pair products (inline PTX)
                     "up_pairs4_half2", "down_pairs4_half2"}  # two words a float16 chain
SORTED4_KERNELS = {"up4", "rows4", "up4_scaled", "rows4_scaled"}  # 4-bit weights (sorted4.py), tensor cores
PDL_KERNELS = {"up_pairs_pdl", "down_pairs_pdl", "down_pairs_split_pdl",  # decode with dependent launch (sm_90+)
               "down_pairs_all_slots_pdl"}


@pytest.mark.parametrize("arch", [89, 120])
def test_consumer_targets_have_no_hopper_only_instructions(builds, arch):
    pdl = PDL_KERNELS if arch >= 90 else set()
    assert {b["name"] for b in builds[arch]} == (GEMM_KERNELS | PAIR_KERNELS | PAIR_DOT_KERNELS | SORT_KERNELS | pdl
                                                 | FP8_GEMM_KERNELS | FP8_PAIR_KERNELS | W8A8_KERNELS
                                                 | INT4_PAIR_KERNELS | SORTED4_KERNELS)
    for b in builds[arch]:
        assert b["hopper_only"] == [], f"{b['name']} on sm_{arch} uses {b['hopper_only']}"
        if b["name"] in GEMM_KERNELS | PAIR_DOT_KERNELS | FP8_GEMM_KERNELS | W8A8_KERNELS | SORTED4_KERNELS:
            assert b["uses_mma_sync"], f"{b['name']} on sm_{arch} has no tensor-core instructions"
        assert b["fp8_products"] == (b["name"] in W8A8_KERNELS), f"{b['name']} on sm_{arch}"
        assert b["shared_bytes"] <= 99 * 1024, f"{b['name']} needs {b['shared_bytes']} B of shared memory"


@pytest.mark.parametrize("arch", [89, 90, 120])
def test_w8a8_up_kernel_keeps_its_sums_in_registers_at_the_fp8_tile(builds, arch):
    """At the 128 x 64 tile on 8 warps that the row kernels offer FP8 weights alone (tiles.FP8_ROW_TILES)
    the W8A8 kernels spill nothing, with 128 x 128 scale blocks too, whose chunk sums sit beside the
    accumulators (at 128 x 128 the up kernel spilled: docs/BENCHMARKS.md, "W8A8 FP8 experts")."""
    w8a8 = {b["name"]: b for b in builds[arch] if b["name"] in W8A8_KERNELS}
    if any(b["stack_bytes"] is None for b in w8a8.values()):
        pytest.skip("cuobjdump is not available to read the builds' resource usage")
    for name, b in w8a8.items():
        assert b["stack_bytes"] == 0 and 0 < b["registers"] <= 255, (name, b["registers"], b["stack_bytes"])


def test_detector_sees_hopper_instructions(builds):
    """On sm_90 Triton lowers tl.dot to wgmma: the same check must report it (it is not blind)."""
    for b in builds[90]:
        if b["name"] in GEMM_KERNELS | W8A8_KERNELS:
            assert b["uses_wgmma"] and "wgmma." in b["hopper_only"], b["name"]
        elif b["name"] in PAIR_KERNELS | SORT_KERNELS | FP8_PAIR_KERNELS | INT4_PAIR_KERNELS:
            assert not b["uses_wgmma"] and b["hopper_only"] == [], b["name"]


def test_dependent_launch_only_where_it_runs(builds):
    """Programmatic dependent launch (griddepcontrol) is in the decode kernels built for it, on sm_90 and
    sm_120 (paths.pdl_applies), and in no other build: sm_89 has no such instruction."""
    for arch, arch_builds in builds.items():
        for b in arch_builds:
            assert b["dependent_launch"] == (b["name"] in PDL_KERNELS), (arch, b["name"])
    assert {b["name"] for b in builds[90]} >= PDL_KERNELS and {b["name"] for b in builds[120]} >= PDL_KERNELS
