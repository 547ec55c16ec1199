"""`thunderep serve` on every rank: load the model, prepare it so that no request pays for autotuning or
first calls, start the HTTP side on rank 0 and run the serving loop until stopped (its options and the
behaviour they select: `thunderep.cli.serve`)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..comm.launch import GRACE_S, launch, run_on_ep
from ..comm.stop import stop_on_sigterm
from ..errors import ConfigError
from ..hf import ThunderMoE
from ..hf.experts import check_implementations
from ..hf.tokenizer import load_tokenizer
from .config import ServeConfig, pick_device
from .engine import unsupported_reason
from .http_api import FAIL_WAIT_S, Server, missing_http_stack
from .loop import describe, rehearse, serve_continuous, serve_static
from .ranks import Ranks
from .stopping import StopRequest
from .tune import tune_kernels

__all__ = ["serve", "serve_on_rank"]


def serve(config: ServeConfig) -> None:
    """Serve on `config.ep` ranks: in this process for 1, else in as many launched on this host. ConfigError
    at once where the HTTP stack (the `serve` extra) is not installed."""
    problem = missing_http_stack()
    if problem is not None:
        raise ConfigError(problem)
    if config.ep == 1:
        serve_on_rank(config)
        return
    # after SIGTERM the ranks get the drain, the answers' way out, and the usual grace to end
    launch(_rank_main, config.ep, config, stop_s=config.drain_timeout + FAIL_WAIT_S + GRACE_S)


def _rank_main(rank: int, world: int, config: ServeConfig) -> None:
    """One rank started by `launch`: its EP runtime, then `serve_on_rank`."""
    run_on_ep(world, lambda ep: serve_on_rank(config, ep), timeout=config.timeout, cpu=config.cpu)


def serve_on_rank(config: ServeConfig, ep=None) -> None:
    """Load the model and serve until stopped (collective over the EP group; rank 0 answers HTTP)."""
    stop = StopRequest()
    with stop_on_sigterm(stop):
        _serve(config, ep, stop)


def _serve(config: ServeConfig, ep, stop: StopRequest) -> None:
    rank, world = (ep.groups.ep_rank, ep.groups.ep_size) if ep is not None else (0, 1)
    device = pick_device(ep, config.cpu)
    say = (lambda line: print(f"[thunderep serve] {line}", flush=True)) if rank == 0 else None
    tm, tokenizer, eos = _load(config, ep, device)
    ranks = Ranks(ep, config.timeout) if world > 1 else None
    reason = _prepare(config, tm, device, say)
    stop.serving = True  # SIGTERM from here on: finish what is being generated
    server = _listen(config, tm, tokenizer, world, device) if rank == 0 else None
    if reason is not None and rank == 0:
        print(f"[thunderep serve] batching statically: {type(tm.model).__name__} cannot be batched "
              f"continuously here, {reason}", flush=True)
    loop = serve_continuous if config.batching == "continuous" and reason is None else serve_static
    if server is not None:
        server.batching = "continuous" if loop is serve_continuous else "static"
    try:
        loop(tm, tokenizer, server, ranks, eos, device, config, stop)
        if server is not None:  # stopped by SIGTERM: the last answers leave before the process ends
            server.fail_open("the server has stopped")
            print(f"[thunderep serve] {stop.summary(config.drain_timeout)}", flush=True)
    except BaseException as exc:  # a peer died or stopped answering, or this rank is stopped: say so to clients
        if server is not None:
            server.fail_open(f"the server failed while answering ({describe(exc)}); it is stopping")
        raise
    finally:
        if server is not None:
            server.close()


def _load(config: ServeConfig, ep, device: torch.device):
    """This rank's share of the model, the tokenizer and the end-of-sequence ids."""
    tm = ThunderMoE.from_pretrained(config.model, ep, dtype=config.dtype, device=device,
                                    experts_implementation=config.experts_implementation,
                                    experts_dtype=config.experts_dtype, gpu_memory=config.gpu_memory,
                                    offload_dir=config.offload_dir)
    text_config = tm.config.get_text_config()
    tokenizer = load_tokenizer(config.model, text_config.vocab_size)
    eos = tm.model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    return tm, tokenizer, eos


def _prepare(config: ServeConfig, tm, device: torch.device, say) -> str | None:
    """Before listening: the model in eval mode, its kernels tuned for every shape the server can meet and
    (on GPUs, continuous batching) decoding rehearsed at every batch size. Returns why the model cannot be
    batched continuously (None: it can)."""
    tm.eval()
    line = check_implementations(tm.bindings.values(), device)  # not an error on every request
    if say is not None:
        say(line)
    tuned = tune_kernels(tm, config.max_batch, log=say)  # before listening: no request waits on autotuning
    if tuned is not None and say is not None:
        say(f"tuned {tuned.summary()}")
    reason = unsupported_reason(tm.model) if config.batching == "continuous" else None
    if config.batching == "continuous" and reason is None and device.type == "cuda":
        seconds = rehearse(tm, device, config, tm.config.get_text_config().vocab_size)
        if say is not None:
            say(f"rehearsed decoding at every batch size in {seconds:.1f} s")
    return reason


def _listen(config: ServeConfig, tm, tokenizer, world: int, device: torch.device) -> Server:
    """Rank 0: the HTTP side, started, and the line saying where it listens."""
    text_config = tm.config.get_text_config()
    context = getattr(text_config, "max_position_embeddings", None) or 1 << 30
    names = config.http.served_model_names or (Path(config.model).resolve().name,)
    server = Server(config, tokenizer, context, names, world)
    server.offload_stats = tm.offload_stats if tm.offload_stats() is not None else None  # /health shows them
    server.start()
    host, port = server.address
    print(f"[thunderep serve] {type(tm.model).__name__} on {world} rank(s), {device}: "
          f"{tm.load_report.summary()}\n[thunderep serve] listening on http://{host}:{port}", flush=True)
    return server
