"""`thunderep generate`: the byte-level tokenizer, argument checks, and a real launch of its own ranks."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from thunderep.cli.generate import main  # noqa: E402
from thunderep.hf.tokenizer import ByteTokenizer, encode_batch  # noqa: E402


def test_byte_tokenizer_round_trip_and_left_padding():
    tok = ByteTokenizer(vocab_size=256)
    assert tok.decode(tok.encode("MoE, PCIe!")) == "MoE, PCIe!"
    assert ByteTokenizer(vocab_size=96).encode("a") == [ord("a") % 96]
    assert tok.decode([7, 300]) == "<7><300>"
    ids, mask = encode_batch(tok, ["ab", "abcd"])
    assert ids.tolist() == [[0, 0, 97, 98], [97, 98, 99, 100]]
    assert mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]


def test_a_checkpoint_without_tokenizer_files_is_warned_of(tmp_path):
    """Without tokenizer files text falls back to bytes, which a model of another vocabulary was not trained
    on: a warning says so; a byte-level model (256 ids) gets none."""
    import warnings

    from thunderep.hf.tokenizer import load_tokenizer

    with pytest.warns(UserWarning, match=r"has no tokenizer files .* each id the byte modulo the vocabulary of 1000"):
        assert isinstance(load_tokenizer(tmp_path, 1000), ByteTokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert isinstance(load_tokenizer(tmp_path, 256), ByteTokenizer)


def test_bad_arguments_exit_with_2(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    assert main(["--model", str(tmp_path), "--prompt", "x", "--ep", "0"]) == 2
    assert main(["--model", str(tmp_path), "--prompt", "x", "--ep", "2", "--mode", "ep"]) == 2
    assert main(["--model", str(tmp_path), "--prompt", "x", "--ep", "2", "--mode", "allgather"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "at least 1" in err and "one prompt per rank" in err
    assert "--mode allgather needs as many prompts on every rank: a multiple of --ep 2, got 1" in err
    assert main(["--model", str(tmp_path), "--prompt", "", "--max-new-tokens", "0", "--temperature", "-1",
                 "--dtype", "f16", "--timeout", "0"]) == 2
    err = capsys.readouterr().err
    for line in ("--max-new-tokens must be at least 1, got 0", "--temperature must be a number in [0, 10], got -1.0",
                 "--dtype must be auto, float32, bfloat16 or float16, got 'f16'", "--prompt must not be empty",
                 "--timeout must be a positive number of seconds, got 0.0"):
        assert line in err, line
    # the limits a request to `thunderep serve` has (before: any temperature, seeds torch could not take)
    assert main(["--model", str(tmp_path), "--prompt", "x", "--temperature", "10.5", "--top-p", "0",
                 "--seed", "-1"]) == 2
    err = capsys.readouterr().err
    for line in ("--temperature must be a number in [0, 10], got 10.5", "--top-p must be a number in (0, 1], got 0.0",
                 "--seed must be an integer from 0 to 2**63 - 1, got -1"):
        assert f"thunderep generate: {line}\n" in err, line
    assert main(["--model", str(tmp_path), "--prompt", "x", "--temperature", "nan", "--top-p", "1.5",
                 "--seed", str(2**63)]) == 2
    err = capsys.readouterr().err
    for line in ("--temperature must be a number in [0, 10], got nan", "--top-p must be a number in (0, 1], got 1.5",
                 f"--seed must be an integer from 0 to 2**63 - 1, got {2**63}"):
        assert line in err, line
    from thunderep.cli import main as cli

    assert cli(["serve", "--model", str(tmp_path), "--request-timeout", "0", "--dtype", "f16"]) == 2
    err = capsys.readouterr().err
    assert "--request-timeout must be a positive number of seconds, got 0.0" in err and "got 'f16'" in err


def test_generate_samples_as_serve_does_with_top_p_and_no_top_k(tmp_path, capfd):
    """--temperature samples from the tokens --top-p keeps, and no top-k cuts them (before: transformers'
    default top-k of 50, or the checkpoint's: with top_k 1 there, every sample was the greedy answer)."""
    import json

    from hf_tiny import save_tiny

    path = save_tiny("mixtral", tmp_path / "ckpt", seed=1)
    config = tmp_path / "ckpt" / "generation_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "top_k": 1}))
    args = ["--model", path, "--prompt", "Hello", "--max-new-tokens", "8", "--cpu"]

    def answer(*extra) -> str:
        assert main(args + list(extra)) == 0
        return next(line for line in capfd.readouterr().out.splitlines() if line.startswith("[0] "))

    greedy = answer()
    assert answer("--temperature", "10", "--top-p", "1e-6") == greedy  # only the most likely token is kept
    assert answer("--temperature", "10") != greedy


@pytest.mark.world_size(2)
def test_generate_launches_its_own_ranks_and_streams(tmp_path, capfd):
    """--ep 2 spawns two ranks (gloo), each loading half of the experts; output equals --ep 1."""
    from hf_tiny import save_tiny

    path = save_tiny("mixtral", tmp_path / "ckpt", seed=1)
    args = ["--model", path, "--prompt", "Hello", "--prompt", "MoE", "--max-new-tokens", "5", "--cpu"]
    assert main(args) == 0
    one = capfd.readouterr().out
    assert main(args + ["--ep", "2"]) == 0
    two = capfd.readouterr().out
    assert "ep=2, mode=auto" in two and "tokens/s" in two
    # One prompt per rank, padded to its own length: 2 MoE layers, the prefill and 4 decode steps. On CPU
    # ranks mode "auto"'s rule picks ep mode at every size (docs/benchmarks/2026-12-05-auto-mode.md).
    assert "MoE layer calls: ep 10" in two
    completions = [[line for line in out.splitlines() if line.startswith("[0] ") or line.startswith("[1] ")]
                   for out in (one, two)]
    assert completions[0] == completions[1] and len(completions[0]) == 2
    assert torch.cuda.is_available() or "device=cpu" in two
    # --mode allgather: prompts of 5 and 3 bytes, each rank's batch padded to the longest (before, the
    # ranks held different token counts and all-gather mode refused them)
    assert main(args + ["--ep", "2", "--mode", "allgather"]) == 0
    gathered = capfd.readouterr().out
    assert "MoE layer calls: allgather 10\n" in gathered, gathered
    assert [line for line in gathered.splitlines() if line[:4] in ("[0] ", "[1] ")] == completions[0]
    # past the model's context (64 positions): an error before any token, on one rank and on two
    from thunderep.cli import main as cli

    for ep in ("1", "2"):
        assert cli(["generate", *args, "--ep", ep, "--max-new-tokens", "70"]) == 1
        assert "and --max-new-tokens 70 exceed the model's context of 64 tokens" in capfd.readouterr().err
    assert cli(["finetune", "--model", path, "--out", str(tmp_path / "out"), "--seq-len", "65"]) == 2
    assert "--seq-len 65 is longer than the model's context of 64 tokens" in capfd.readouterr().err


def test_generate_with_thunderep_kernels_equals_default(tmp_path, capfd):
    """--experts-implementation triton: the same completions through ThunderEP's kernels (without a GPU,
    in Triton's interpreter); a name transformers does not know is a clear error."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the interpreter case; tests/hf/test_hf_kernels.py has the GPU test")
    from hf_tiny import save_tiny

    from thunderep.cli import main as cli_main

    path = save_tiny("qwen3_moe", tmp_path / "ckpt", seed=2)
    args = ["--model", path, "--prompt", "Hello", "--max-new-tokens", "4", "--cpu"]
    assert main(args) == 0
    default = capfd.readouterr().out
    assert main(args + ["--experts-implementation", "triton"]) == 0
    kernels = capfd.readouterr().out
    pick = lambda out: [line for line in out.splitlines() if line.startswith("[0] ")]  # noqa: E731
    assert pick(default) == pick(kernels) and len(pick(default)) == 1
    assert cli_main(["generate"] + args + ["--experts-implementation", "fastest"]) != 0
    assert "experts_implementation 'fastest' is not registered" in capfd.readouterr().err


def test_generate_leaves_cudnn_out_of_attention_unless_asked():
    """ThunderMoE.generate runs the model's generate with every attention backend but cuDNN's allowed
    (cuDNN plans each new decode shape), and as before with cudnn_attention=True; the flags are restored."""
    from hf_tiny import tiny_model

    from thunderep.hf import ThunderMoE

    tm = ThunderMoE.wrap(tiny_model("mixtral", seed=1), None)
    seen, generate = [], tm.model.generate

    def recording(*args, **kwargs):
        b = torch.backends.cuda
        seen.append((b.cudnn_sdp_enabled(), b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled()))
        return generate(*args, **kwargs)

    tm.model.generate = recording
    before = torch.backends.cuda.cudnn_sdp_enabled()
    ids = torch.tensor([[3, 5, 7]])
    default = tm.generate(ids, max_new_tokens=3, do_sample=False)
    with_cudnn = tm.generate(ids, max_new_tokens=3, do_sample=False, cudnn_attention=True)
    assert seen == [(False, True, True, True), (before, True, True, True)]
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    assert torch.equal(default, with_cudnn)


def test_a_rank_count_that_cannot_split_the_experts_is_refused_before_loading_for_training(tmp_path, capsys):
    """finetune reads the expert count from config.json and refuses --ep 3 for 8 experts at once (before, ranks
    started and loaded the model first: about a minute for 16 ranks); generate and serve take it (the last
    slots hold copies of the first experts: tests/hf/test_every_family.py checks 7 experts on 2 ranks)."""
    import json

    from thunderep.cli import command_parser
    from thunderep.cli import generate, serve
    from thunderep.cli import main as cli

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral", "num_local_experts": 8}))
    message = "--ep 3 does not divide the model's 8 routed experts: fine-tuning places each expert on one rank"
    assert cli(["finetune", "--model", str(tmp_path), "--ep", "3", "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert generate.problems(command_parser("generate").parse_args(
        ["--model", str(tmp_path), "--ep", "3", "--prompt", "hi"])) == []
    assert not [p for p in serve.problems(command_parser("serve").parse_args(["--model", str(tmp_path), "--ep", "3",
                                                                               "--port", "0"])) if "--ep" in p]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "x", "text_config": {"n_routed_experts": 6}}))
    from thunderep.hf.load import ep_size_problem

    assert ep_size_problem(tmp_path, 4) and ep_size_problem(tmp_path, 3) is None


def test_generate_with_offloaded_experts_equals_default_and_prints_the_tiers(tmp_path, capfd):
    """--gpu-memory holding a quarter of each rank's experts (host memory standing in for the device's), on
    one rank and on two: the same completions as without it, and the tiers' summary line."""
    from hf_tiny import offload_budget, save_tiny

    path = save_tiny("qwen3_moe", tmp_path / "ckpt", seed=2)
    args = ["--model", path, "--prompt", "Hello", "--prompt", "MoE", "--max-new-tokens", "5", "--cpu"]
    assert main(args) == 0
    pick = lambda out: [line for line in out.splitlines() if line[:4] in ("[0] ", "[1] ")]  # noqa: E731
    want = pick(capfd.readouterr().out)
    for ep in (1, 2):
        budget = offload_budget(path, 0.25, ranks=ep)
        assert main(args + ["--ep", str(ep), "--gpu-memory", str(budget)]) == 0
        captured = capfd.readouterr()
        assert pick(captured.out) == want and len(want) == 2
        assert "expert offload:" in captured.out + captured.err
