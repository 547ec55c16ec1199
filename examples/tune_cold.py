"""A cold `tune_kernels` on one GPU with THUNDEREP_COMPILE_THREADS=1 against N: each tuning in a fresh
process with an empty Triton cache, as a server's first start on a machine. The model is tests/hf_tiny.py's
two-layer Mixtral (8 experts, top 2) at hidden size 1024 and intermediate size 3584, bf16, wrapped with
the kernels; `tune_kernels(model, 8)` tunes every kernel a server of at most 8 sequences launches.
Run from the repository root.

    python examples/tune_cold.py N [ORDER] [ROUNDS] [MAX_CALLS]

N: the threads to compare with 1 (default 8); ORDER: the thread counts of one round, comma-separated,
in the order they run (default "1,N"); ROUNDS: default 2; MAX_CALLS: the autotuner's timed calls per
config (`thunderep.kernels.tuning.TUNING_MAX_CALLS`; "none": as many as fit in its time budget).
Prints each tuning's report line (its seconds per kind of call among them: `thunderep.serve.tune.TuneReport`)
and, from the second tuning on, how many of its tuning keys chose the same config as the first tuning's.
"""
import json, os, subprocess, sys, tempfile
CHILD = r'''
import json, sys, time, torch
sys.path.insert(0, "tests")
from hf_tiny import tiny_model
from thunderep.hf import ThunderMoE
from thunderep.serve.tune import tune_kernels
from thunderep.kernels import tuning
if len(sys.argv) > 1:
    tuning.TUNING_MAX_CALLS = None if sys.argv[1] == "none" else int(sys.argv[1])
m = tiny_model("mixtral", seed=1, hidden_size=1024, intermediate_size=3584).to("cuda", torch.bfloat16)
tm = ThunderMoE.wrap(m, experts_implementation="triton").eval()
r = tune_kernels(tm, 8)
print("REPORT", r.seconds, r.summary())
print("CONFIGS", json.dumps(tuning.kernel_configs()))
'''
first = None
n = sys.argv[1] if len(sys.argv) > 1 else "8"
order = sys.argv[2].split(",") if len(sys.argv) > 2 else ["1", n]
for rnd in range(int(sys.argv[3]) if len(sys.argv) > 3 else 2):
    for threads in order:
        with tempfile.TemporaryDirectory() as c:
            env = dict(os.environ, TRITON_CACHE_DIR=c, THUNDEREP_COMPILE_THREADS=threads)
            out = subprocess.run([sys.executable, "-c", CHILD, *sys.argv[4:5]], env=env, capture_output=True,
                                 text=True)
            line = [l for l in out.stdout.splitlines() if l.startswith("REPORT")]
            print(f"round {rnd+1}, threads {threads}: {line[0] if line else out.stderr[-1500:]}", flush=True)
            configs = [json.loads(l[len("CONFIGS "):]) for l in out.stdout.splitlines() if l.startswith("CONFIGS ")]
            if not configs:
                continue
            chosen = {(kernel, key): c for kernel, keys in configs[0].items() for key, c in keys.items()}
            if first is None:
                first = chosen
            else:
                same = sum(first.get(k) == c for k, c in chosen.items())
                print(f"  same config as the first tuning: {same} of {len(chosen)} keys", flush=True)
