"""StaticDecodeBatch: continuous batching over fixed cache storage (CUDA graphs on GPUs) gives the tokens
DecodeBatch gives, with no host sync in a step, on one process and on EP ranks."""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch

pytest.importorskip("transformers")

from distributed import run_ranks  # noqa: E402
from test_engine import MAX_TOKENS, PROMPTS, _run_schedule  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import thunderep.serve.static_decode as static_decode  # noqa: E402
from thunderep.serve.engine import DecodeBatch, Entry  # noqa: E402
from thunderep.errors import ConfigError, GraphDeclined  # noqa: E402
from thunderep.serve.static_decode import StaticDecodeBatch, static_reason  # noqa: E402


class _HostSyncs(TorchDispatchMode):
    """Counts the ops that make the host wait for the device (a CUDA graph cannot capture them)."""

    def __init__(self):
        super().__init__()
        self.seen = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "_local_scalar_dense" in name or "nonzero" in name or "unique" in name or name.startswith("aten.item"):
            self.seen[name] += 1
        return func(*args, **(kwargs or {}))


def _entries() -> list[Entry]:
    return [Entry(i, PROMPTS[i], MAX_TOKENS[i], (0.7, 1.0) if i == 2 else (0.0, 1.0), 7) for i in range(len(PROMPTS))]


def _syncs_of_a_step(batch: StaticDecodeBatch) -> dict:
    batch.admit([Entry(0, [5, 6, 7], 20, (0.0, 1.0), 0), Entry(1, [4, 3], 20, (0.0, 1.0), 0)])
    batch.step()
    counter = _HostSyncs()
    with counter:
        batch._forward_static(2)
    return dict(counter.seen)


def test_every_family_decodes_like_the_dynamic_batch(monkeypatch):
    """The 14 tiny families DecodeBatch serves: the same tokens (greedy and one sampled sequence) over a
    schedule of joins and leaves, with storage that starts at 4 columns, so that it grows, and cuts the
    columns only padding holds, several times."""
    from hf_tiny import FAMILIES, UNSUPPORTED, tiny_model

    monkeypatch.setattr(static_decode, "MIN_CAPACITY", 4)
    moves, move = [], StaticDecodeBatch._move

    def recorded(self, rows, start, count, by):
        moves.append(by)
        return move(self, rows, start, count, by)

    monkeypatch.setattr(StaticDecodeBatch, "_move", recorded)
    served = []
    for family in sorted(set(FAMILIES) - set(UNSUPPORTED) - {"llama"}):
        moves.clear()
        model = tiny_model(family, seed=1).eval()
        if static_reason(model) is not None:
            continue
        want = _run_schedule(DecodeBatch(model, "cpu", set(), 0), _entries())
        batch = StaticDecodeBatch(model, "cpu", set(), 0, max_batch=4)
        assert _run_schedule(batch, _entries()) == want, family
        assert batch.capacity >= 16, family  # grew from 4
        assert min(moves) < 0 < max(moves), (family, moves)  # rows moved right for a longer prompt; cut left
        served.append(family)
    assert len(served) == 14, served


def test_storage_grows_by_bucket_and_narrows_after_a_long_sequence(monkeypatch):
    """Rows grow with the batch's bucket (1, 2, 4), not to max_batch at once; columns double as a long
    sequence grows, and once the batch is empty a short prompt gets narrow storage again. The tokens
    stay those of the dynamic batch throughout."""
    from hf_tiny import tiny_model

    monkeypatch.setattr(static_decode, "MIN_CAPACITY", 4)
    model = tiny_model("mixtral", seed=1).eval()
    batch = StaticDecodeBatch(model, "cpu", set(), 0, max_batch=8)
    dynamic = DecodeBatch(model, "cpu", set(), 0)
    shapes = []

    def run(entries):
        got = [_run_schedule_once(b, entries) for b in (batch, dynamic)]
        assert got[0] == got[1]
        shapes.append((batch.row_capacity, batch.capacity))

    run([Entry(0, [5, 6], 40, (0.0, 1.0), 0)])
    run([Entry(1, [5, 6, 7], 3, (0.0, 1.0), 0)])
    run([Entry(i, [4 + i, 9], 3, (0.0, 1.0), 0) for i in range(2, 5)])
    assert shapes == [(1, 64), (1, 8), (4, 4)], shapes  # (1, 4) grew to (1, 8) within the second run


def _run_schedule_once(batch, entries) -> dict:
    """Admit `entries` at once and decode until the batch is empty: {key: tokens}."""
    got = {e.key: [] for e in entries}
    events = batch.admit(entries)
    while True:
        for key, token, _ in events:
            if token is not None:
                got[key].append(token)
        if not len(batch):
            return got
        events = batch.step()


def test_a_step_has_no_host_sync():
    """No op in a static step waits for the device, in any of the 14 families: transformers' mask check
    is skipped (4D mask) and the experts' computation has fixed shapes. (The dynamic step has one: the
    mask check.)"""
    from hf_tiny import FAMILIES, UNSUPPORTED, tiny_model

    checked = 0
    for family in sorted(set(FAMILIES) - set(UNSUPPORTED) - {"llama"}):
        model = tiny_model(family, seed=1).eval()
        if static_reason(model) is None:
            assert _syncs_of_a_step(StaticDecodeBatch(model, "cpu", set(), 0, max_batch=4)) == {}, family
            checked += 1
    assert checked == 14
    dynamic = DecodeBatch(tiny_model("mixtral", seed=1).eval(), "cpu", set(), 0)
    dynamic.admit([Entry(0, [5, 6, 7], 20, (0.0, 1.0), 0)])
    counter = _HostSyncs()
    with counter:
        dynamic.step()
    assert counter.seen  # the detector sees what it should


def test_a_failed_capture_turns_graphs_off_and_decoding_goes_on(capsys, monkeypatch):
    """A step's capture fails (as a step that syncs with the host fails it): the batch says so once and
    runs the same steps eagerly. (On CPU, with graphs set on as on CUDA; the GPU test below fails a real
    capture.) Asking for graphs on a CPU device is refused."""
    from hf_tiny import tiny_model

    @contextlib.contextmanager
    def failing(graph, pool=None):
        raise RuntimeError("operation not permitted when stream is capturing")
        yield

    model = tiny_model("mixtral", seed=1).eval()
    want = _run_schedule(DecodeBatch(model, "cpu", set(), 0), _entries())
    with pytest.raises(ConfigError, match="graphs=True needs a CUDA device"):
        StaticDecodeBatch(model, "cpu", set(), 0, max_batch=4, graphs=True)
    batch = StaticDecodeBatch(model, "cpu", set(), 0, max_batch=4)
    assert not batch.graphs
    batch.graphs = True
    monkeypatch.setattr(static_decode, "capture", failing)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)  # CPU-only builds have no pools
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: None)
    assert _run_schedule(batch, _entries()) == want
    assert not batch.graphs
    assert capsys.readouterr().err.count("CUDA graphs off for decoding") == 1


def test_a_declined_batch_size_decodes_eagerly_and_keeps_graphs_on(capsys, monkeypatch):
    """A capture that declines its batch size (GraphDeclined, as offloaded experts whose tokens would share
    slots do): that size decodes eagerly from then on, said once per size, with no second capture tried; graphs
    stay on for the others; the tokens are the dynamic batch's. (On CPU, graphs set on as on CUDA.)"""
    from hf_tiny import tiny_model

    tried = []

    @contextlib.contextmanager
    def declining(graph, pool=None):
        tried.append(1)
        raise GraphDeclined("model.layers.0.mlp.experts: its tokens would share slots")
        yield

    model = tiny_model("mixtral", seed=1).eval()
    want = _run_schedule(DecodeBatch(model, "cpu", set(), 0), _entries())
    batch = StaticDecodeBatch(model, "cpu", set(), 0, max_batch=4)
    batch.graphs = True
    monkeypatch.setattr(static_decode, "capture", declining)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: None)
    assert _run_schedule(batch, _entries()) == want
    assert batch.graphs and batch._eager_sizes and len(tried) == len(batch._eager_sizes)
    err = capsys.readouterr().err
    assert err.count("eagerly: model.layers.0.mlp.experts: its tokens would share slots") == len(batch._eager_sizes)
    assert "CUDA graphs off" not in err


def test_a_failed_admission_leaves_the_running_sequences_whole(monkeypatch):
    """Storage that cannot grow (out of memory) fails the admission that needed it; the sequences being
    decoded keep their rows and get the tokens they get alone."""
    from hf_tiny import tiny_model

    model = tiny_model("mixtral", seed=1).eval()
    alone = _run_schedule_once(DecodeBatch(model, "cpu", set(), 0), [Entry(0, [5, 6, 7], 8, (0.0, 1.0), 0)])
    batch = StaticDecodeBatch(model, "cpu", set(), 0, max_batch=4)
    got = {0: [t for _, t, _ in batch.admit([Entry(0, [5, 6, 7], 8, (0.0, 1.0), 0)])]}
    got[0] += [t for _, t, _ in batch.step()]

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("out of memory (simulated)")

    monkeypatch.setattr(batch, "_allocate", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        batch.admit([Entry(1, [9, 9], 8, (0.0, 1.0), 0), Entry(2, [4], 8, (0.0, 1.0), 0)])  # 3 rows: a new bucket
    assert len(batch) == 1
    while len(batch):
        got[0] += [t for _, t, _ in batch.step() if t is not None]
    assert got == alone


def test_admitting_past_max_batch_is_refused_and_close_releases_the_storage():
    from hf_tiny import tiny_model

    batch = StaticDecodeBatch(tiny_model("mixtral", seed=1).eval(), "cpu", set(), 0, max_batch=2)
    batch.admit([Entry(0, [5, 6], 5, (0.0, 1.0), 0), Entry(1, [5], 5, (0.0, 1.0), 0)])
    with pytest.raises(ConfigError, match=r"2 \+ 1 sequences exceed max_batch \(2\): admit at most 0 now"):
        batch.admit([Entry(2, [5], 5, (0.0, 1.0), 0)])
    assert len(batch) == 2
    batch.close()
    assert len(batch) == 0 and batch.keys is None and batch.capacity == 0
    alone = _run_schedule_once(DecodeBatch(batch.model, "cpu", set(), 0), [Entry(3, [5, 6], 4, (0.0, 1.0), 0)])
    assert _run_schedule_once(batch, [Entry(3, [5, 6], 4, (0.0, 1.0), 0)]) == alone  # usable after close


def _on_ranks(rank, world, family):
    from hf_tiny import tiny_model

    from thunderep import EPConfig
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel
    from thunderep.hf import ThunderMoE

    ep = ExpertParallel(init_expert_parallel(world), EPConfig(control="collective"))
    tm = ThunderMoE.wrap(tiny_model(family, seed=1), ep).eval()
    got = _run_schedule(StaticDecodeBatch(tm, "cpu", set(), 0, max_batch=4), _entries())
    return got, _syncs_of_a_step(StaticDecodeBatch(tm, "cpu", set(), 0, max_batch=4))


@pytest.mark.parametrize("world", [2, 4])
def test_ep_ranks_decode_like_one_process(world):
    """Every rank of 2 and 4 (latency mode, capturable: each rank's experts take every pair at a fixed
    shape, other ranks' pairs masked out) gets the tokens one process gets from the dynamic batch, and
    its steps have no host sync."""
    from hf_tiny import tiny_model

    want = _run_schedule(DecodeBatch(tiny_model("qwen3_moe", seed=1).eval(), "cpu", set(), 0), _entries())
    for got, syncs in run_ranks(_on_ranks, world, "qwen3_moe", timeout=180):
        assert got == want
        assert syncs == {}


def _graphs_against_eager(model, device) -> tuple[dict, dict, bool, list]:
    """Tokens of the schedule with steps replayed from CUDA graphs and with the same steps run eagerly."""
    eager = _run_schedule(StaticDecodeBatch(model, device, set(), 0, max_batch=4, graphs=False), _entries())
    batch = StaticDecodeBatch(model, device, set(), 0, max_batch=4, graphs=True)
    return _run_schedule(batch, _entries()), eager, batch.graphs, sorted(batch._graphs)


@pytest.mark.gpu
def test_gpu_graph_steps_equal_eager_steps():
    """On a GPU (bfloat16; transformers' grouped_mm, and ThunderEP's Triton kernels) the steps replay from
    captured CUDA graphs, one per batch size met, and give the tokens of the same steps run eagerly."""
    from hf_tiny import tiny_model

    from thunderep.hf import ThunderMoE

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    device = torch.device("cuda")
    for model in (tiny_model("qwen3_moe", seed=1).to(device, torch.bfloat16).eval(),
                  ThunderMoE.wrap(tiny_model("mixtral", seed=1).to(device, torch.bfloat16),
                                  experts_implementation="triton").eval()):
        got, want, graphs, sizes = _graphs_against_eager(model, device)
        assert got == want
        assert graphs and len(sizes) >= 2, sizes


@pytest.mark.gpu
def test_gpu_a_failed_capture_leaves_the_devices_random_draws_working():
    """transformers' `eager` experts sync with the host, so the step's capture fails: decoding goes on
    eagerly with the same tokens, and the device's default generator still draws afterwards (a failed
    capture left it in capture mode, and every draw failed, before `thunderep.kernels.graphs`)."""
    from hf_tiny import tiny_model

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    device = torch.device("cuda")
    model = tiny_model("mixtral", seed=1).to(device, torch.bfloat16).eval()
    model.set_experts_implementation("eager")
    got, want, graphs, sizes = _graphs_against_eager(model, device)
    assert not graphs and not sizes
    assert got == want
    assert torch.rand(4, device=device).shape == (4,)
    assert torch.nn.functional.dropout(torch.ones(8, device=device), 0.5, training=True).isfinite().all()


def _gpu_ranks(rank, world):
    from hf_tiny import tiny_model

    from thunderep import EPConfig
    from thunderep.comm.groups import init_expert_parallel
    from thunderep.comm.runtime import ExpertParallel
    from thunderep.hf import ThunderMoE

    ep = ExpertParallel(init_expert_parallel(world), EPConfig())
    tm = ThunderMoE.wrap(tiny_model("qwen3_moe", seed=1).to(torch.bfloat16), ep).eval()
    return _graphs_against_eager(tm, ep.groups.device)


@pytest.mark.gpu
def test_gpu_graph_steps_on_two_ranks_equal_eager_steps():
    """2 GPUs with NCCL: the latency-mode all-reduces are captured in the graphs, and every rank gets the
    tokens of the same steps run eagerly."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    for got, want, graphs, sizes in run_ranks(_gpu_ranks, 2, timeout=300, dist_timeout=120, backend="nccl"):
        assert got == want
        assert graphs and len(sizes) >= 2, sizes


def test_offloaded_experts_decode_without_graphs_where_no_host_job_can_take_them_and_say_why(tmp_path, capsys):
    """Expert tiers whose host experts run in line (here: on a CPU, no host jobs) wait for the host in every
    layer, which no CUDA graph can capture, and so do tiers with host jobs whose hot experts are not on the
    pair kernels: serve's continuous batch with graphs on is the eager one, with a line naming the offload
    and why (tests/moe/test_tier_graphs.py and the GPU test in
    tests/hf/test_expert_tiers.py cover tiers that a graph takes)."""
    from hf_tiny import offload_budget, save_tiny

    from thunderep.hf import ThunderMoE
    from thunderep.moe import host_native
    from thunderep.moe.tiers import TierConfig
    from thunderep.serve.config import ServeConfig
    from thunderep.serve.loop import decode_batch

    path = save_tiny("mixtral", tmp_path / "m")
    tm = ThunderMoE.from_pretrained(path, gpu_memory=offload_budget(path, 0.5))
    batch = decode_batch(tm, "cuda", {0}, 0, ServeConfig(cuda_graphs="on"), server=object())
    assert type(batch) is DecodeBatch
    assert ("decoding without CUDA graphs: its experts are offloaded (--gpu-memory) and its host experts run in "
            "line here (no host jobs") in capsys.readouterr().out
    if host_native.available():  # host jobs, but hot experts on the model's own function (no pair kernels here)
        tm = ThunderMoE.from_pretrained(path, gpu_memory=offload_budget(path, 0.5),
                                        offload=TierConfig(host_thread="on", host_engine="native"))
        assert type(decode_batch(tm, "cuda", {0}, 0, ServeConfig(cuda_graphs="on"), server=object())) is DecodeBatch
        assert "its hot experts wait for the host's counts" in capsys.readouterr().out
