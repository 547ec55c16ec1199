"""`thunderep finetune` on a Hugging Face checkpoint: bad arguments named, and the command on 2 CPU ranks
(real processes) against the plain transformers model trained in one process on the batches the ranks
draw (AdamW on the mean of their losses), with its options (frozen parameters, gradient checkpointing,
LoRA, clipping, schedules, accumulation, mixed precision), resumed runs, dry runs, runs stopped by
SIGTERM (the same step on every rank, saved, resumed); the training data
(chat examples masked to their answers); on GPUs the same against one process."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")


TEXT = "Expert parallelism on PCIe: every rank holds its own experts and trades rows. " * 60  # > 4096 bytes


def _adamw_reference(model_dir: str, text, held_out: bool, steps: int = 3, freeze: str | None = None,
                     lora_rank: int = 0, lora_targets=None, clip: float = 0.0, schedule=None, accum: int = 1):
    """The plain model trained in one process as `thunderep finetune --ep 2 --batch 2 --seq-len 12
    --lr 1e-3` trains it: AdamW on the mean of the two ranks' losses, on the batches they draw; the
    parameters whose name matches `freeze` left out; with `lora_rank`, adapters trained instead (seed
    0, as the command draws them; the model wrapped without expert parallelism, so that its experts
    can take adapters) and merged at the end; `clip`: clip_grad_norm_ over what trains; `schedule`:
    (warm-up steps, "cosine" / "linear" / "constant") as --warmup-steps / --lr-schedule; `accum`
    micro-batches per step as --grad-accum (the mean of their losses)."""
    from hf_tiny import V
    from transformers import AutoModelForCausalLM

    from thunderep.train.data import batch_at, load_training_data, split_tokens
    from thunderep.hf.tokenizer import load_tokenizer

    tokens, _ = split_tokens(load_training_data(load_tokenizer(model_dir, V), [str(text)]), 12, 4 if held_out else 0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    params = [p for name, p in model.named_parameters() if not (freeze and re.search(freeze, name))]
    plain = model
    if lora_rank:
        from thunderep.hf import ThunderMoE
        from thunderep.train.lora import apply_lora

        model = ThunderMoE.wrap(model)
        params = apply_lora(plain, lora_targets, rank=lora_rank, seed=0)
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    for step in range(steps):
        if schedule:
            from thunderep.train.finetune import lr_factor

            for group in opt.param_groups:
                group["lr"] = 1e-3 * lr_factor(step, steps, *schedule)
        opt.zero_grad()
        for micro in range(accum):
            draw = step if accum == 1 else step * accum + micro
            batches = [batch_at(tokens, 0, r, draw, 2, 12) for r in range(2)]
            (torch.stack([model(input_ids=b[..., 0], labels=b[..., 1]).loss for b in batches]).mean()
             / accum).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
    if lora_rank:
        from thunderep.train.lora import merge_lora

        merge_lora(plain)
    return plain


def test_finetune_command_rejects_bad_arguments(tmp_path, capsys):
    from thunderep.cli import main as cli

    assert cli(["finetune", "--model", str(tmp_path), "--out", str(tmp_path), "--steps", "0", "--lr", "0",
                "--eval-batches", "-1", "--data", str(tmp_path / "missing.txt"), "--checkpoint", str(tmp_path),
                "--checkpoint-every", "0", "--freeze", "experts", "layers.(0"]) == 2
    err = capsys.readouterr().err
    for line in ("--steps must be at least 1, got 0", "--lr must be positive and finite",
                 "is not a checkpoint directory",
                 f"--out {tmp_path} holds --model {tmp_path}", "no such file", "--eval-batches must be 0 or more",
                 f"--checkpoint {tmp_path} holds --out {tmp_path}", "--checkpoint-every must be at least 1",
                 "'layers.(0' is not a regular expression"):
        assert line in err
    assert cli(["finetune", "--model", str(tmp_path), "--out", str(tmp_path / "o"), "--lr", "inf"]) == 2
    assert "--lr must be positive and finite, got inf" in capsys.readouterr().err


def test_finetune_checks_float_options_and_data_directories_up_front(tmp_path, capsys):
    """Negative, NaN or infinite float options are named before anything loads (before: --weight-decay -1
    failed in AdamW after the model had loaded), and a --data directory is called one, with what to give
    instead (before: "no such file")."""
    from thunderep.cli import main as cli

    (tmp_path / "texts").mkdir()
    assert cli(["finetune", "--model", str(tmp_path), "--out", str(tmp_path / "o"), "--weight-decay", "-1",
                "--max-grad-norm", "inf", "--lora-rank", "2", "--lora-alpha", "nan", "--timeout", "0",
                "--data", str(tmp_path / "texts"), str(tmp_path / "gone.txt")]) == 2
    err = capsys.readouterr().err
    for line in ("--weight-decay must be 0 or more and finite, got -1.0",
                 "--max-grad-norm must be 0 (off) or positive and finite, got inf",
                 "--lora-alpha must be positive and finite, got nan",
                 "--timeout must be positive and finite seconds, got 0.0",
                 f"--data {tmp_path / 'texts'} is a directory: give the files in it (e.g. --data "
                 f"{tmp_path / 'texts' / '*.txt'}", f"--data: no such file: {tmp_path / 'gone.txt'}\n"):
        assert f"thunderep finetune: {line}" in err, line
    assert cli(["finetune", "--model", str(tmp_path), "--out", str(tmp_path / "o"), "--weight-decay", "nan"]) == 2
    assert "--weight-decay must be 0 or more and finite, got nan" in capsys.readouterr().err


def test_finetune_refuses_outputs_that_would_replace_other_files(tmp_path, capsys):
    """--out and --checkpoint replace their whole directory when written, so before anything loads the
    command refuses: a directory of other files (unless --overwrite), a file, an output that holds the
    model or the data, an unwritable place, and outputs that hold each other. An empty directory, a
    checkpoint or an export of ThunderEP's may be replaced. Nothing is touched on refusal."""
    from thunderep.train.checkpoint import EXPORT_MARK, MANIFEST, destination_problem
    from thunderep.cli import main as cli

    model = tmp_path / "work" / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    data = tmp_path / "work" / "notes.txt"
    data.write_text("notes")
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "thesis.txt").write_text("x")
    (tmp_path / "a_file").write_text("x")
    base = ["finetune", "--model", str(model), "--data", str(data), "--steps", "1"]
    cases = [
        (["--out", str(tmp_path / "precious")], "--out: {t}/precious holds files that are not a ThunderEP export "
                                                  "(thesis.txt), and writing the export would replace them: "
                                                  "choose another directory, or pass --overwrite"),
        (["--out", str(tmp_path / "a_file")], "--out: {t}/a_file exists and is not a directory"),
        (["--out", str(tmp_path / "work")], "--out {t}/work holds --model {t}/work/model"),
        (["--out", str(tmp_path / "work")], "--out {t}/work holds --data {t}/work/notes.txt"),
        (["--out", str(tmp_path / "a_file" / "sub")], "cannot create {t}/a_file/sub: {t}/a_file is not a directory"),
        (["--out", str(tmp_path / "o"), "--checkpoint", str(tmp_path / "precious")],
         "--checkpoint: {t}/precious holds files that are not a ThunderEP checkpoint"),
        (["--out", str(tmp_path / "o"), "--checkpoint", str(tmp_path / "o" / "ck")], "--out {t}/o holds --checkpoint"),
    ]
    for args, message in cases:
        assert cli(base + args) == 2, args
        assert message.format(t=tmp_path) in capsys.readouterr().err, args
    assert (tmp_path / "precious" / "thesis.txt").read_text() == "x" and (tmp_path / "a_file").read_text() == "x"
    # what may be replaced; the library's callers are named its argument
    assert destination_problem(tmp_path / "precious", "export").endswith("or pass overwrite=True")
    assert destination_problem(tmp_path / "precious", "export", overwrite=True) is None
    assert destination_problem(tmp_path / "new" / "deeper", "export") is None
    for kind, mark in (("export", EXPORT_MARK), ("export", "thunderep_finetune.json"), ("checkpoint", MANIFEST)):
        ours = tmp_path / f"ours-{kind}-{mark}"
        ours.mkdir()
        (ours / mark).write_text("{}")
        (ours / "model.safetensors").write_text("")
        assert destination_problem(ours, kind) is None
    assert "not a ThunderEP checkpoint" in destination_problem(tmp_path / f"ours-export-{EXPORT_MARK}", "checkpoint")
    (tmp_path / "empty").mkdir()
    assert destination_problem(tmp_path / "empty", "checkpoint") is None


def test_a_text_too_short_is_named():
    from thunderep.train.data import split_tokens

    tokens = torch.arange(4800)
    train, held = split_tokens(tokens, seq_len=12, eval_batches=4)
    assert torch.equal(torch.cat([train, held]), tokens) and len(held) == 240
    train, held = split_tokens(tokens, seq_len=512, eval_batches=0)
    assert len(train) == 4800 and len(held) == 0
    with pytest.raises(ValueError, match=r"4800 tokens, too few for --seq-len 512 with 5% held out \(it needs "
                                         r"10240; or --eval-batches 0\)"):
        split_tokens(tokens, seq_len=512, eval_batches=4)
    with pytest.raises(ValueError, match="4800 tokens, too few for --seq-len 5000$"):
        split_tokens(tokens, seq_len=5000, eval_batches=0)


def test_finetune_command_equals_one_process_training_and_resumes(tmp_path, capfd):
    """`thunderep finetune` on 2 ranks (AdamW, GradSync) for 2 steps with --checkpoint writes the plain
    model trained in one process on the ranks' batches, and says what it did; the same command for 3
    steps resumes at step 2 on the batches it would have drawn and writes the model of 3 such steps."""
    from hf_tiny import save_tiny
    from transformers import AutoModelForCausalLM

    from thunderep.cli import main as cli

    model_dir = save_tiny("mixtral", tmp_path / "model")
    (tmp_path / "notes.txt").write_text(TEXT)
    common = ["finetune", "--model", model_dir, "--data", str(tmp_path / "notes.txt"), "--ep", "2", "--batch", "2",
              "--seq-len", "12", "--lr", "1e-3", "--cpu", "--checkpoint", str(tmp_path / "ckpt"),
              "--checkpoint-every", "1"]
    assert cli(common + ["--steps", "2", "--eval-every", "1", "--out", str(tmp_path / "first")]) == 0
    printed = capfd.readouterr().out  # the ranks' output (spawned processes)
    assert "step 2/2 loss" in printed and f"wrote {tmp_path / 'first'}" in printed
    record = json.loads((tmp_path / "first" / "thunderep_finetune.json").read_text())
    assert record["ranks"] == 2 and len(record["train_losses"]) == len(record["step_seconds"]) == 2
    assert record["seconds"] >= sum(record["step_seconds"]) > 0 and record["steady_tokens_per_s"] > 0
    assert f"{record['steady_tokens_per_s']:,.0f} at the median step" in printed
    assert f"held-out loss {record['eval_loss_before']:.4f} -> {record['eval_loss_after']:.4f}" in printed
    (at, score), = record["eval_losses"]  # after step 1 (the last step's is eval_loss_after)
    assert at == 1 and f"step 1/2 held-out loss {score:.4f}" in printed
    assert cli(common + ["--steps", "3", "--out", str(tmp_path / "resumed")]) == 0
    printed = capfd.readouterr().out
    assert f"resuming from {tmp_path / 'ckpt'} at step 2" in printed and "step 3/3 loss" in printed
    assert "step 1/3" not in printed and "step 2/3" not in printed
    assert cli(common + ["--steps", "2", "--out", str(tmp_path / "fewer")]) == 1  # the checkpoint is at step 3
    assert (f"the checkpoint in {tmp_path / 'ckpt'} is at step 3, and --steps 2 asks for no more"
            in capfd.readouterr().err) and not (tmp_path / "fewer").exists()

    start = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    for out, steps in (("first", 2), ("resumed", 3)):
        want = _adamw_reference(model_dir, tmp_path / "notes.txt", held_out=True, steps=steps).state_dict()
        got = AutoModelForCausalLM.from_pretrained(str(tmp_path / out), dtype=torch.float32).state_dict()
        for key, value in want.items():
            # atol 1e-5 (lr 1e-3): Adam divides by sqrt(v), which magnifies the float32 rounding of a
            # near-zero gradient summed in another order into ~1e-6 of a parameter.
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{out}, {key}: {m}")
        experts = "model.layers.0.mlp.experts.gate_up_proj"
        assert not torch.equal(got[experts], start[experts])


def test_finetune_command_with_frozen_experts_and_gradient_checkpointing_equals_one_process(tmp_path, capfd):
    """--freeze experts --gradient-checkpointing --max-grad-norm --lr-schedule cosine on 2 ranks, on
    prompt / completion examples (JSON Lines):
    the experts come out as they went in, the rest as one process trains it with AdamW on the other
    parameters and the completions' tokens only (the recomputed layers dispatch in ep mode again; in
    the mode "auto" of after the forward these small batches would take all-gather mode). The memory
    line counts only the trainable parameters' gradients and AdamW state."""
    from hf_tiny import save_tiny
    from transformers import AutoModelForCausalLM

    from thunderep.cli import main as cli

    model_dir = save_tiny("mixtral", tmp_path / "model")
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Q{i}: which rank holds expert {i % 8}?",
                                        "completion": f" rank {i % 8 // 4}"}) + "\n" for i in range(40)))
    assert cli(["finetune", "--model", model_dir, "--data", str(data), "--ep", "2", "--batch", "2",
                "--seq-len", "12", "--lr", "1e-3", "--cpu", "--steps", "3", "--eval-batches", "0",
                "--freeze", "experts", "--gradient-checkpointing", "--max-grad-norm", "0.05", "--lr-schedule",
                "cosine", "--warmup-steps", "1", "--out", str(tmp_path / "out")]) == 0
    printed = capfd.readouterr().out
    record = json.loads((tmp_path / "out" / "thunderep_finetune.json").read_text())
    memory = record["memory"]
    assert memory["trainable"] < memory["weights"] and memory["grads"] == memory["trainable"]
    assert memory["adamw"] == 2 * memory["trainable"] and f"(of which training {memory['trainable'] / 1e9:.2f} GB)" \
        in printed
    assert record["peak_bytes"] > memory["weights"] and f"peak memory of a rank {record['peak_bytes'] / 1e9:.2f} GB" \
        in printed
    start = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    assert len(record["grad_norms"]) == 3 and min(record["grad_norms"]) > 0.05  # every step clipped
    assert "step 2/3 loss" in printed and "lr 0.001, gradient norm" in printed  # warm-up, then cosine: 1, 1, 0
    assert re.search(r"step 3/3 loss \S+ lr 0, gradient norm", printed)
    want = _adamw_reference(model_dir, data, held_out=False, steps=3, freeze="experts", clip=0.05,
                            schedule=(1, "cosine")).state_dict()
    got = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).state_dict()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")
        if ".experts." in key:
            assert torch.equal(got[key], start[key]), key
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(got[q_proj], start[q_proj])


def test_finetune_command_with_offloaded_experts_equals_one_process(tmp_path, capfd):
    """--gpu-memory holding half of each rank's experts on the device, on 2 ranks, full fine-tuning: the
    offloaded experts train frozen (said on the console), everything else as one process trains it with
    the routed experts frozen; the written checkpoint holds the experts as they went in."""
    from hf_tiny import save_tiny
    from transformers import AutoModelForCausalLM

    from hf_tiny import offload_budget

    from thunderep.cli import main as cli

    model_dir = save_tiny("mixtral", tmp_path / "model")
    (tmp_path / "notes.txt").write_text(TEXT)
    budget = offload_budget(model_dir, 0.5, ranks=2)
    assert cli(["finetune", "--model", model_dir, "--data", str(tmp_path / "notes.txt"), "--ep", "2", "--batch", "2",
                "--seq-len", "12", "--lr", "1e-3", "--cpu", "--steps", "2", "--eval-batches", "0",
                "--gpu-memory", str(budget), "--out", str(tmp_path / "out")]) == 0
    printed = capfd.readouterr().out
    assert "expert offload (--gpu-memory" in printed and "the offloaded experts train frozen" in printed
    # the sync-tax report (printed, and in thunderep_finetune.json) counts the expert tiers' rows: rank 0's
    offload = json.loads((tmp_path / "out" / "thunderep_finetune.json").read_text())["sync_tax"]["offload"]
    rows = offload["rows_hot"] + offload["rows_host"] + offload["rows_streamed"]
    assert offload["hot_slots"] * 2 == offload["slots"] and rows > 0 and offload["rows_hot"] > 0
    assert offload["hot_share"] == pytest.approx(offload["rows_hot"] / rows)
    assert "sync-tax report: 2 steps" in printed and f"{100 * offload['hot_share']:.1f}% of expert rows served hot" \
        in printed
    start = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    want = _adamw_reference(model_dir, tmp_path / "notes.txt", held_out=False, steps=2,
                            freeze=r"mlp\.experts\.").state_dict()
    got = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).state_dict()
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")
        assert torch.equal(got[key], start[key]) == (".mlp.experts." in key), key


def test_finetune_command_with_lora_equals_one_process_and_resumes(tmp_path, capfd):
    """--lora-rank 4 --lora-targets self_attn experts --grad-accum 2 --balance (a spare slot per rank:
    replicated experts and their adapters) on 2 ranks, on chat examples through the
    checkpoint's own tokenizer and chat template: 2 steps with --checkpoint, then the same command for 3
    steps resumes there; the written checkpoint is the plain family (adapters merged), carries the
    tokenizer and its chat template, and equals one process training the same adapters on the same
    answers (the experts' adapters live on the ranks holding their experts); only attention weights and
    experts changed."""
    from hf_tiny import save_tiny
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from thunderep.cli import main as cli

    model_dir = save_tiny("qwen3_moe", tmp_path / "model")
    _chat_tokenizer().save_pretrained(model_dir)
    data = tmp_path / "chat.jsonl"
    words = ["hello", "there", "hi", "how", "are", "you", "fine"]
    data.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": " ".join(words[(i + j) % 7] for j in range(3))},
        {"role": "assistant", "content": " ".join(words[(2 * i + j) % 7] for j in range(1 + i % 4))}]}) + "\n"
        for i in range(40)))
    common = ["finetune", "--model", model_dir, "--data", str(data), "--ep", "2", "--batch", "2",
              "--seq-len", "12", "--lr", "1e-3", "--cpu", "--eval-batches", "0", "--lora-rank", "4",
              "--lora-targets", "self_attn", "experts", "--grad-accum", "2", "--balance",
              "--checkpoint", str(tmp_path / "ckpt"), "--checkpoint-every", "1", "--quiet"]
    assert cli(common + ["--steps", "2", "--out", str(tmp_path / "first")]) == 0
    assert cli(common + ["--steps", "3", "--out", str(tmp_path / "resumed")]) == 0
    start = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    for out, steps in (("first", 2), ("resumed", 3)):
        want = _adamw_reference(model_dir, data, held_out=False, steps=steps, lora_rank=4,
                                lora_targets=["self_attn", "experts"], accum=2).state_dict()
        got = AutoModelForCausalLM.from_pretrained(str(tmp_path / out), dtype=torch.float32).state_dict()
        assert got.keys() == want.keys() == start.keys()
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{out}, {key}: {m}")
            adapted = ("self_attn" in key and "norm" not in key) or ".experts." in key
            assert torch.equal(got[key], start[key]) != adapted, (out, key)
        tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / out))
        assert tokenizer.chat_template == _chat_tokenizer().chat_template


def test_finetune_dry_run_takes_one_step_and_writes_nothing(tmp_path, capfd):
    from hf_tiny import save_tiny

    from thunderep.cli import main as cli

    model_dir = save_tiny("mixtral", tmp_path / "model")
    (tmp_path / "notes.txt").write_text(TEXT)
    assert cli(["finetune", "--model", model_dir, "--data", str(tmp_path / "notes.txt"), "--ep", "2", "--batch", "2",
                "--seq-len", "12", "--cpu", "--steps", "50", "--grad-accum", "2", "--dry-run",
                "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]) == 0
    printed = capfd.readouterr().out
    assert "memory per rank (rank 0, cpu)" in printed and "step 1/50 loss" in printed and "step 2/50" not in printed
    assert re.search(r"dry run: one step of 96 tokens \(2 ranks x 2 x 2 x 12\) took \S+ s; peak memory of a rank "
                     r"\S+ GB; nothing written", printed)
    assert not (tmp_path / "out").exists() and not (tmp_path / "ckpt").exists()


def test_learning_rate_schedules():
    from thunderep.train.finetune import lr_factor

    assert [lr_factor(s, 6, 2, "constant") for s in range(6)] == [0.5, 1, 1, 1, 1, 1]
    assert [lr_factor(s, 6, 2, "linear") for s in range(6)] == pytest.approx([0.5, 1, 1, 2 / 3, 1 / 3, 0])
    cosine = [lr_factor(s, 7, 2, "cosine") for s in range(7)]
    assert cosine[:3] == [0.5, 1, 1] and cosine[4] == pytest.approx(0.5) and cosine[6] == pytest.approx(0)
    assert lr_factor(0, 1, 0, "cosine") == 1.0  # one step: nothing to decay over


def test_freeze_patterns_and_memory_shortfall_are_named():
    from hf_tiny import tiny_model

    from thunderep.errors import ConfigError
    from thunderep.train.trainable import memory_plan, select_trainable
    from thunderep.hf import ThunderMoE

    tm = ThunderMoE.wrap(tiny_model("mixtral"))
    with pytest.raises(ConfigError, match=r"--freeze nothing_like_this matches no parameter; names look like "
                                          r"model\.embed_tokens\.weight"):
        select_trainable(tm, ["experts", "nothing_like_this"])
    with pytest.raises(ConfigError, match="freezes every parameter: nothing would train"):
        select_trainable(tm, ["."])
    trainable = select_trainable(tm, ["experts", "embed_tokens"])
    names = {name for name, p in tm.model.named_parameters() if p.requires_grad}
    assert names and not any("experts" in n or "embed_tokens" in n for n in names)
    assert len(trainable) == len(names)
    size = sum(p.numel() * 4 for p in trainable)
    plan = memory_plan(tm, torch.device("cpu"), free=10 * size)
    assert (plan.grads, plan.adamw, plan.short) == (size, 2 * size, 0)
    plan.check()
    plan = memory_plan(tm, torch.device("cpu"), free=size)
    assert plan.short == plan.need - size > 0
    with pytest.raises(ConfigError, match=rf"a rank needs {plan.short / 1e9:.2f} GB more than it has free .*--freeze "
                                          r"experts.*--dtype bfloat16.*--ep"):
        plan.check()
    from thunderep.cli.finetune import parse_args
    from thunderep.train.trainable import memory_hint

    args = parse_args(["--model", "m", "--out", "o", "--batch", "3", "--seq-len", "40"])
    with pytest.raises(ConfigError, match=r"out of memory in training step 5 on rank 0 \(cpu\), 3 x 40 tokens per "
                                          r"rank; before training: memory per rank.*--gradient-checkpointing.*"
                                          r"CUDA out of memory. Tried"):
        with memory_hint(args.batch, args.seq_len, 4, plan):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_finetune_command_mixed_precision_keeps_small_steps(tmp_path):
    """--dtype mixed (the GPU default; autocast bfloat16 on CPU here) on 2 ranks writes the input
    checkpoint's bfloat16, config included. Its float32 weights keep AdamW's small steps: after 8 steps
    of lr 1e-5 far more of the written weights moved than with bfloat16 weights (--dtype bfloat16),
    where a step below half a bfloat16 spacing is lost each time (docs/BENCHMARKS.md)."""
    from hf_tiny import tiny_model
    from transformers import AutoModelForCausalLM

    from thunderep.cli import main as cli

    tiny_model("mixtral").to(torch.bfloat16).save_pretrained(str(tmp_path / "model"))
    (tmp_path / "notes.txt").write_text(TEXT)
    common = ["finetune", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "notes.txt"), "--ep", "2",
              "--steps", "8", "--batch", "2", "--seq-len", "12", "--lr", "1e-5", "--cpu", "--eval-batches", "0",
              "--quiet"]
    assert cli(common + ["--dtype", "mixed", "--out", str(tmp_path / "mixed")]) == 0
    assert cli(common + ["--dtype", "bfloat16", "--out", str(tmp_path / "bf16")]) == 0
    key = "model.layers.0.mlp.experts.gate_up_proj"
    source = AutoModelForCausalLM.from_pretrained(str(tmp_path / "model")).state_dict()[key]
    mixed = AutoModelForCausalLM.from_pretrained(str(tmp_path / "mixed"))
    bf16 = AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16")).state_dict()[key]
    assert mixed.config.dtype == torch.bfloat16
    assert json.loads((tmp_path / "mixed" / "config.json").read_text())["dtype"] == "bfloat16"
    moved = {name: (t != source).float().mean().item() for name, t in (("mixed", mixed.state_dict()[key]),
                                                                       ("bf16", bf16))}
    assert mixed.state_dict()[key].dtype == torch.bfloat16
    print(f"weights of {key} moved after 8 steps of lr 1e-5: mixed {100 * moved['mixed']:.1f}%, "
          f"bfloat16 {100 * moved['bf16']:.1f}%")  # docs/BENCHMARKS.md quotes this line (pytest -s)
    assert moved["mixed"] > 2.5 * moved["bf16"] > 0, moved


def _chat_tokenizer():
    from hf_tiny import chat_tokenizer

    return chat_tokenizer()


def test_training_data_masks_prompts_and_names_bad_examples(tmp_path):
    """JSON Lines examples: "text" trains every token, "prompt"/"completion" and "messages" only the
    answer (labels -100 elsewhere), each example ended by EOS (which trains; a newline for bytes); text
    files train every token; bad lines are named with file and line."""
    from thunderep.train.data import IGNORE, batch_at, load_training_data
    from thunderep.hf.tokenizer import ByteTokenizer

    bt = ByteTokenizer(256)
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "ab"}) + "\n\n"
                                      + json.dumps({"prompt": "Q", "completion": "A"}) + "\n")
    (tmp_path / "b.txt").write_text("xy")
    got = load_training_data(bt, [str(tmp_path / "a.jsonl"), str(tmp_path / "b.txt")])
    nl = ord("\n")
    assert got[:, 0].tolist() == [97, 98, nl, 81, 65, nl, 120, 121, nl]
    assert got[:, 1].tolist() == [97, 98, nl, IGNORE, 65, nl, 120, 121, nl]

    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hello there"},
                                             {"role": "assistant", "content": "hi how are you"}]}) + "\n")
    got = load_training_data(_chat_tokenizer(), [str(chat)])
    assert got[:, 0].tolist() == [3, 5, 6, 4, 7, 8, 9, 10, 1]  # <user> hello there <assistant> hi how are you </s>
    assert got[:, 1].tolist() == [IGNORE] * 4 + [7, 8, 9, 10, 1]

    for line, message in ((json.dumps({"prompt": "Q"}), r"line 2: an example needs .* it has \['prompt'\]"),
                          ("{not json", "line 2: not JSON"), ("[1]", "line 2: an example is a JSON object, got list")):
        (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "ok"}) + "\n" + line + "\n")
        with pytest.raises(ValueError, match=message):
            load_training_data(bt, [str(tmp_path / "bad.jsonl")])
    with pytest.raises(ValueError, match="need the checkpoint's tokenizer with a chat template"):
        load_training_data(bt, [str(chat)])
    (tmp_path / "user_last.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match="must be the assistant's; it is user"):
        load_training_data(_chat_tokenizer(), [str(tmp_path / "user_last.jsonl")])

    stream = torch.tensor([[5, IGNORE]] * 50 + [[6, 6]] * 2)  # almost nothing trains
    windows = batch_at(stream, 0, 0, 0, 2, 4)
    assert windows.shape == (2, 4, 2) and (windows[:, 1:, 1] != IGNORE).any()
    with pytest.raises(ValueError, match="found no token that trains"):
        batch_at(torch.tensor([[5, IGNORE]] * 50), 0, 0, 0, 2, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_finetune_command_on_gpus_equals_one_process(tmp_path, world):
    """The small-card options on `world` GPUs (NCCL; float32 so that the comparison is tight): LoRA on
    attention and experts, gradient checkpointing, 2 accumulated micro-batches, clipping and a cosine
    schedule, against the same training in one CPU process. Then --dtype mixed runs and writes the
    checkpoint's bfloat16."""
    from hf_tiny import save_tiny
    from transformers import AutoModelForCausalLM

    from thunderep.cli import main as cli

    if torch.cuda.device_count() < max(world, 1):
        pytest.skip(f"needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    model_dir = save_tiny("qwen3_moe", tmp_path / "model")
    (tmp_path / "notes.txt").write_text(TEXT)
    common = ["finetune", "--model", model_dir, "--data", str(tmp_path / "notes.txt"), "--ep", str(world),
              "--batch", "2", "--seq-len", "12", "--lr", "1e-3", "--steps", "3", "--eval-batches", "0", "--quiet"]
    assert cli(common + ["--dtype", "float32", "--lora-rank", "4", "--lora-targets", "self_attn", "experts",
                         "--gradient-checkpointing", "--grad-accum", "2", "--max-grad-norm", "0.05",
                         "--lr-schedule", "cosine", "--warmup-steps", "1", "--out", str(tmp_path / "lora")]) == 0
    if world == 2:
        want = _adamw_reference(model_dir, tmp_path / "notes.txt", held_out=False, steps=3, lora_rank=4,
                                lora_targets=["self_attn", "experts"], clip=0.05, schedule=(1, "cosine"),
                                accum=2).state_dict()
        got = AutoModelForCausalLM.from_pretrained(str(tmp_path / "lora"), dtype=torch.float32).state_dict()
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-4, msg=lambda m: f"{key}: {m}")
    bf16 = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(model_dir).to(torch.bfloat16).save_pretrained(str(bf16))
    assert cli(common[:2] + [str(bf16)] + common[3:] + ["--out", str(tmp_path / "mixed")]) == 0
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "mixed")).dtype == torch.bfloat16


def test_finetune_stops_on_a_loss_that_is_not_finite(tmp_path, capfd):
    """A learning rate that blows the weights up ends the run at the first non-finite loss on every rank,
    with an error that says so, and writes no output (before, a NaN model was written and the command
    succeeded); the checkpoint holds the last finite step."""
    from hf_tiny import save_tiny

    from thunderep.train.checkpoint import MANIFEST
    from thunderep.cli import main as cli

    model_dir = save_tiny("mixtral", tmp_path / "model")
    (tmp_path / "notes.txt").write_text(TEXT)
    assert cli(["finetune", "--model", model_dir, "--data", str(tmp_path / "notes.txt"), "--ep", "2", "--batch", "2",
                "--seq-len", "12", "--cpu", "--steps", "6", "--lr", "1e20", "--eval-batches", "0", "--quiet",
                "--checkpoint", str(tmp_path / "ckpt"), "--checkpoint-every", "1", "--out", str(tmp_path / "out")]) == 1
    err = capfd.readouterr().err
    found = re.search(r"the training loss is (?:nan|inf) at step (\d): .*nothing was written; the checkpoint "
                      r"in \S+ is the last good one\. Lower --lr \(now 1e\+20\)", err)
    assert found, err
    assert not (tmp_path / "out").exists()
    if int(found.group(1)) > 1:
        assert json.loads((tmp_path / "ckpt" / MANIFEST).read_text())["step"] == int(found.group(1)) - 1


# SIGTERM: the ranks finish their step, agree through the step's loss all-reduce, save it with --checkpoint
# and stop; the command exits with 143. Real processes: `thunderep finetune` in a session of its own.

ROOT = Path(__file__).resolve().parents[2]
_SIGTERM_RUN = ["--ep", "2", "--batch", "2", "--seq-len", "12", "--lr", "1e-3", "--cpu", "--eval-batches", "0"]


def _rank_processes(launcher):
    """The ranks a `thunderep` process started (forked by its fork server, or spawned), in start order."""
    ranks = []
    for child in launcher.children():
        command = " ".join(child.cmdline())
        ranks += child.children() if "forkserver" in command else [child] if "spawn_main" in command else []
    return sorted(ranks, key=lambda p: p.create_time())


def _finetune_signalled(tmp_path, extra: list[str], act) -> tuple[int, str, str, float]:
    """(exit code, stdout, stderr, seconds from `act` to the end) of `thunderep finetune` on the tiny Mixtral
    for 100000 steps (it never gets there) with `extra`, once it has printed its first step:
    `act(launcher, ranks)` (psutil processes) signals it. Killed after 120 s: the test cannot hang."""
    import threading

    import psutil
    from hf_tiny import save_tiny

    model_dir = tmp_path / "model"
    if not model_dir.exists():
        save_tiny("mixtral", model_dir)
        (tmp_path / "notes.txt").write_text(TEXT)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "thunderep.cli", "finetune", "--model", str(model_dir),
                                 "--data", str(tmp_path / "notes.txt"), "--steps", "100000", *_SIGTERM_RUN,
                                 "--out", str(tmp_path / "out"), *extra],
                                stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True)

    def kill() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    watchdog = threading.Timer(120.0, kill)
    watchdog.start()
    try:
        printed = ""
        for line in proc.stdout:
            printed += line
            if line.startswith("step 1/"):
                break
        assert proc.poll() is None, printed + (tmp_path / "stderr.txt").read_text()
        ranks = _rank_processes(psutil.Process(proc.pid))
        assert len(ranks) == 2, ranks
        acted = time.monotonic()
        act(proc, ranks)
        printed += proc.stdout.read()
        code = proc.wait(timeout=60)
        took = time.monotonic() - acted
        deadline = time.monotonic() + 15
        while any(map(_running, ranks)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_running, ranks)), "a rank still runs"
    finally:
        watchdog.cancel()
        kill()
        proc.wait()
        proc.stdout.close()
    return code, printed, (tmp_path / "stderr.txt").read_text(), took


def _running(process) -> bool:
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


_STOPPED = re.compile(r"\[thunderep\] stopped by SIGTERM after step (\d+)/100000: ")


def test_sigterm_saves_the_step_and_the_same_command_resumes_from_it(tmp_path, capfd):
    """SIGTERM to the command alone (as `docker stop` sends it) with --checkpoint: the ranks finish their
    step, save it, say so with the flag to resume with, and the command exits with 143 without writing
    --out. The same command resumes from that step and writes, bit for bit, the model that the command
    run uninterrupted for as many steps writes (--steps lowered from 100000 to 2 more than the saved
    step: with the constant learning rate those steps are the same). That run's equality with one
    process's training is test_finetune_command_equals_one_process_training_and_resumes's: compared
    here after a step count that depends on the signal's timing, the one-process reference's other
    summation order, which Adam magnifies for near-zero gradients, can exceed any fixed tolerance."""
    from transformers import AutoModelForCausalLM

    from thunderep.train.checkpoint import MANIFEST
    from thunderep.cli import main as cli

    ckpt = tmp_path / "ckpt"
    code, out, err, took = _finetune_signalled(tmp_path, ["--checkpoint", str(ckpt)],
                                               lambda launcher, ranks: launcher.send_signal(signal.SIGTERM))
    found = _STOPPED.search(out)
    assert code == 143 and found, out + err
    step = int(found.group(1))
    assert f"saved the checkpoint of step {step} in {ckpt}; the same command (--checkpoint {ckpt}) resumes from " \
           f"step {step}" in out, out
    assert f"step {step}/100000 loss" in out and err.endswith("thunderep finetune: stopped by SIGTERM\n"), out + err
    assert json.loads((ckpt / MANIFEST).read_text())["step"] == step
    assert not (tmp_path / "out").exists() and took < 30, took

    model_dir = str(tmp_path / "model")
    assert cli(["finetune", "--model", model_dir, "--data", str(tmp_path / "notes.txt"), "--steps", str(step + 2),
                *_SIGTERM_RUN, "--out", str(tmp_path / "out"), "--checkpoint", str(ckpt)]) == 0
    assert f"resuming from {ckpt} at step {step}" in capfd.readouterr().out
    assert cli(["finetune", "--model", model_dir, "--data", str(tmp_path / "notes.txt"), "--steps", str(step + 2),
                *_SIGTERM_RUN, "--out", str(tmp_path / "whole")]) == 0
    want = AutoModelForCausalLM.from_pretrained(str(tmp_path / "whole"), dtype=torch.float32).state_dict()
    got = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).state_dict()
    start = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    assert want.keys() == got.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    experts = "model.layers.0.mlp.experts.gate_up_proj"
    assert not torch.equal(got[experts], start[experts])


def test_sigterm_to_every_process_without_a_checkpoint_writes_nothing(tmp_path):
    """SIGTERM to every process of the command at once (as systemd and job schedulers send it; the fork
    server the ranks come from survives it) without --checkpoint: the ranks stop after a step, nothing is
    written, and the line says that --checkpoint would have kept the progress."""
    code, out, err, _ = _finetune_signalled(tmp_path, [], lambda launcher, ranks: os.killpg(launcher.pid,
                                                                                            signal.SIGTERM))
    found = _STOPPED.search(out)
    assert code == 143 and found, out + err
    assert (f"nothing was saved and --out was not written (no --checkpoint; with --checkpoint DIR this run would "
            f"have saved step {found.group(1)} and the same command would resume from it)") in out, out
    assert "stopped by SIGTERM" in err and not (tmp_path / "out").exists()


def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """SIGTERM to rank 1 alone: rank 0, never signalled, learns it from the step's loss all-reduce, and
    both save the same step (the save is collective) and stop; the command says so and exits with 143."""
    from thunderep.train.checkpoint import MANIFEST

    code, out, err, _ = _finetune_signalled(tmp_path, ["--checkpoint", str(tmp_path / "ckpt")],
                                            lambda launcher, ranks: ranks[1].send_signal(signal.SIGTERM))
    found = _STOPPED.search(out)
    assert code == 143 and found, out + err
    assert json.loads((tmp_path / "ckpt" / MANIFEST).read_text())["step"] == int(found.group(1))
    line = out[found.start() + len("[thunderep] "):].splitlines()[0]
    assert f"thunderep finetune: {line}\n" in err, err  # a rank's Stopped: the command's own SIGTERM exit


@pytest.mark.parametrize("how", ["second SIGTERM", "stop timeout"])
def test_a_step_that_cannot_finish_ends_at_a_second_sigterm_or_the_stop_timeout(tmp_path, how):
    """Rank 1 suspended (SIGSTOP), so the step in progress never ends: after SIGTERM the command ends at
    once at a second SIGTERM, or --stop-timeout seconds after the first, with 143 and nothing saved."""
    def act(launcher, ranks):
        ranks[1].suspend()
        launcher.send_signal(signal.SIGTERM)
        if how == "second SIGTERM":
            time.sleep(1.0)
            launcher.send_signal(signal.SIGTERM)

    code, out, err, took = _finetune_signalled(
        tmp_path, ["--checkpoint", str(tmp_path / "ckpt"), "--stop-timeout", "600" if how == "second SIGTERM" else "2"],
        act)
    assert code == 143 and "thunderep finetune: stopped by SIGTERM" in err and not _STOPPED.search(out), out + err
    assert took < 20, took
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "out").exists()


def _agree(rank, world, asked_on):
    from thunderep.train.stopping import mean_loss_and_stop

    return [mean_loss_and_stop(torch.tensor(float(rank + 1), dtype=torch.bfloat16), rank in asked_on, world)
            for _ in range(2)]


def test_ranks_asked_at_different_steps_agree_on_the_step(monkeypatch):
    """`mean_loss_and_stop`: the mean loss, and a stop when any rank was asked, the same on every rank.
    `StopAtStep`: before training SIGTERM raises `Stopped` at once; from the first step it only marks
    the request, and SIGTERM again changes nothing."""
    from distributed import run_ranks

    from thunderep.errors import Stopped
    from thunderep.train.stopping import StopAtStep

    assert run_ranks(_agree, 2, ()) == [[(1.5, False)] * 2] * 2
    assert run_ranks(_agree, 2, (1,)) == [[(1.5, True)] * 2] * 2
    stop = StopAtStep()
    with pytest.raises(Stopped, match="stopped by SIGTERM"):
        stop(signal.SIGTERM, None)
    assert not stop.asked
    stop.training = True
    stop(signal.SIGTERM, None)
    stop(signal.SIGTERM, None)
    assert stop.asked


def test_finetune_without_ep_takes_one_rank_per_gpu_that_the_experts_divide(tmp_path, monkeypatch, capsys):
    """--ep left out: one rank per GPU where the experts split over them, fewer (and one line that says why)
    where they do not, 2 CPU ranks without GPUs or with --cpu; an explicit --ep stays."""
    import json

    from hf_tiny import save_tiny

    from thunderep.cli import finetune

    model = save_tiny("mixtral", tmp_path / "m")
    experts = json.loads((tmp_path / "m" / "config.json").read_text())["num_local_experts"]
    argv = ["--model", model, "--out", str(tmp_path / "o")]
    capsys.readouterr()  # what saving the model printed
    for gpus, extra, ranks in ((0, [], 2), (experts, [], experts), (experts, ["--cpu"], 2), (1, [], 1),
                               (experts, ["--ep", "1"], 1)):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        args = finetune.parse_args(argv + extra)
        assert (args.ep if args.ep is not None else finetune.default_ranks(args)) == ranks
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: experts + 1)
    assert finetune.default_ranks(finetune.parse_args(argv)) == experts
    assert capsys.readouterr().err == (f"thunderep finetune: {experts} ranks on this host's {experts + 1} GPUs: "
                                       f"the model's {experts} experts split over at most {experts} (--ep sets the "
                                       "count)\n")


@pytest.mark.parametrize("how", ["stopped", "killed"])
def test_a_stopped_or_killed_rank_ends_finetune_within_its_timeout_naming_it(tmp_path, how):
    """Rank 1 suspended (SIGSTOP) or killed: the command exits non-zero within 2 s of --timeout (a stopped
    rank) or at once (a killed one), with one line naming the rank."""
    def act(launcher, ranks):
        ranks[1].suspend() if how == "stopped" else ranks[1].kill()

    code, out, err, took = _finetune_signalled(tmp_path, ["--timeout", "5"], act)
    lines = [line for line in err.splitlines() if line.startswith("thunderep finetune: error:")]
    assert code == 1 and len(lines) == 1 and re.search(r"rank 1 \(pid \d+\)", lines[0]), err
    assert took < (5 + 2 if how == "stopped" else 3), took
