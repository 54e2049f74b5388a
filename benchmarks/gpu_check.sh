#!/usr/bin/env bash
# jpack on one GPU in under five minutes: the machine and a GPU smoke test, the optimizer,
# step and pack benchmarks, the fast unit tests (on the CPU), and a table of the goals read
# back from the JSON. Needs python3 with jax (CUDA), optax and pytest (torch adds a column);
# installs nothing. Writes logs, JSON and Markdown under $OUT (else a temp dir).
#
#   bash benchmarks/gpu_check.sh
#   GPU_CHECK_STEPS="optimizer summary" bash benchmarks/gpu_check.sh    # some steps only
#   GPU_CHECK_QUICK=1 bash benchmarks/gpu_check.sh     # tiny sizes: a smoke run on a CPU
#
# Each step has a time limit, all together GPU_CHECK_BUDGET_S (default 285 s); one that
# would start too late is skipped. Exit status: the number of steps failed or skipped.
# GPU_CHECK_WORKLOADS overrides the optimizer's workloads, PYTHON the interpreter.

set -u
cd "$(dirname "$0")/.." || exit 1

export OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/jpack-gpu-check.XXXXXX")}
mkdir -p "$OUT" || exit 1
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX and torch share the GPU in one process
export GPU_CHECK_QUICK=${GPU_CHECK_QUICK:-}
PYTHON=${PYTHON:-python3}
STEPS=" ${GPU_CHECK_STEPS:-smoke optimizer step pack tests summary} "
DEADLINE=$((SECONDS + ${GPU_CHECK_BUDGET_S:-285}))
RESERVE=25  # kept for the summary and for a step's grace period after its limit
FAILED=()

if [[ -n $GPU_CHECK_QUICK ]]; then
  # XLA:CPU takes minutes to compile per-leaf adam over 4000 leaves: not in a quick run.
  OPT_WORKLOADS=${GPU_CHECK_WORKLOADS:-gpt2_small,bert_base,resnet50}
  OPT_ARGS=(--scale 0.01 --runs 2)
  STEP_ARGS=(--models mlp_4x32 --steps 2 --blocks 1)
else
  # Per-leaf adam over many_small_4000's 4000 leaves compiles for minutes on a GPU too.
  OPT_WORKLOADS=${GPU_CHECK_WORKLOADS:-gpt2_small,bert_base,resnet50}
  OPT_ARGS=(--runs 10)
  STEP_ARGS=(--models mlp_40x256,resnet50 --steps 10 --blocks 5)
fi
STEP_ARGS+=(--variants per_leaf,allreduce,packed,sharded,grad_only)

# run_step NAME LIMIT_S COMMAND...: COMMAND within LIMIT_S and the budget, logged to
# $OUT/NAME.log; a failure is recorded, not fatal.
run_step() {
  local name=$1 limit=$2
  shift 2
  [[ $STEPS == *" $name "* ]] || return 0
  local left=$((DEADLINE - SECONDS))
  [[ $name == summary ]] && ((left < 10)) && left=10  # the table is always printed
  [[ $name == summary ]] || left=$((left - RESERVE))
  if ((left < 10)); then
    echo -e "\n=== $name: skipped, the time budget is spent"
    FAILED+=("$name (skipped: out of time)")
    return 0
  fi
  ((limit > left)) && limit=$left
  echo -e "\n=== $name (limit ${limit} s)"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  ((rc == 124 || rc == 137)) && FAILED+=("$name (timed out after ${limit} s)")
  ((rc != 0 && rc != 124 && rc != 137)) && FAILED+=("$name (exit $rc)")
  echo "=== $name: exit $rc after $((SECONDS - start)) s"
}

echo "jpack GPU check: outputs in $OUT"
command -v nvidia-smi >/dev/null && timeout 20 nvidia-smi -L

# On the GPU, against numpy: pack / unpack, the collectives, data_parallel in every mode.
run_step smoke 60 "$PYTHON" - <<'EOF'
import os
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import PartitionSpec as P
import jpack
from benchmarks import harness as c
from jpack._reference import per_leaf_step

jax.config.update("jax_default_matmul_precision", "highest")  # not TF32: compared at 1e-5
print("machine:", c.machine())
assert jax.devices()[0].platform == "gpu" or os.environ["GPU_CHECK_QUICK"], jax.devices()

rng = np.random.default_rng(0)
host = {"w": rng.normal(size=(64, 48)).astype(jnp.bfloat16),
        "h": rng.normal(size=(7,)).astype(np.float16),
        "b": rng.normal(size=(48,)).astype(np.float32),
        "n": np.arange(5, dtype=np.int32), "s": np.float32(3.5)}
host.update({k: c.random_numpy(s.shape, s.dtype, rng)
             for k, s in c.load_workload("resnet50").shapes.items()})
tree = jax.device_put(host)
for name, f in (("eager", lambda t: jpack.unpack(jpack.pack(t))),
                ("jit", jax.jit(lambda t: jpack.unpack(jpack.pack(t))))):
  out = f(tree)
  for k, x in host.items():
    y = np.asarray(out[k])
    assert y.dtype == x.dtype and y.shape == np.shape(x) and y.tobytes() == x.tobytes(), (name, k)
  print(f"pack / unpack ({name}): {len(host)} leaves bit-exact")

mesh = jax.make_mesh((1,), ("batch",))
floats = {k: v for k, v in host.items() if k != "n"}
def reduce(t):
  return (jpack.pmean(t, "batch"), jpack.psum(t, "batch"),
          jpack.unpack(jpack.pmean(jpack.pack(t), "batch")),
          jpack.pmean(t, "batch", comm_dtype=jnp.bfloat16))
outs = jax.jit(jax.shard_map(reduce, mesh=mesh, in_specs=P(), out_specs=P()))(floats)
for i, out in enumerate(outs):
  for k, x in floats.items():
    tol = 1e-2 if (i == 3 or np.dtype(x.dtype).itemsize < 4) else 0
    np.testing.assert_allclose(np.asarray(out[k], np.float64), np.asarray(x, np.float64),
                               rtol=tol, atol=tol, err_msg=k)
print("pmean / psum / packed pmean / bf16-wire pmean on a 1-device mesh: match numpy")

params = {"w": rng.normal(size=(32, 16)).astype(np.float32),
          "b": np.zeros(16, np.float32), "v": rng.normal(size=(16,)).astype(jnp.bfloat16)}
batch = jax.device_put(rng.normal(size=(8, 32)).astype(np.float32),
                       jax.NamedSharding(mesh, P("batch")))
def loss(p, x):
  h = jnp.tanh(x * p["w"][:, 0] @ p["w"] + p["b"]) * p["v"].astype(jnp.float32)
  return jnp.mean(h ** 2)
tx = optax.adam(1e-2)
def three_steps(dp):
  state = dp.init(params)
  for _ in range(3):
    state, metrics = dp.step(state, batch)
  return dp.unpack(state)
ref = three_steps(per_leaf_step(loss, tx, params, mesh))
for mode in ("allreduce", "packed", "sharded", "fsdp"):
  got = three_steps(jpack.data_parallel(loss, tx, params, mesh, mode=mode))
  for k in params:
    tol = 2e-2 if k == "v" else 1e-5
    np.testing.assert_allclose(np.asarray(got[k], np.float64), np.asarray(ref[k], np.float64),
                               rtol=tol, atol=tol, err_msg=f"{mode} {k}")
  print(f"data_parallel(mode={mode!r}): 3 steps match per-leaf optax")
print("smoke test passed")
EOF

run_step optimizer 120 "$PYTHON" -m benchmarks optimizer --workloads "$OPT_WORKLOADS" \
  "${OPT_ARGS[@]}" --json "$OUT/optimizer.json" --markdown "$OUT/optimizer.md"
run_step step 60 "$PYTHON" -m benchmarks step --devices 1 "${STEP_ARGS[@]}" \
  --json "$OUT/step.json" --markdown "$OUT/step.md"
run_step pack 45 "$PYTHON" -m benchmarks pack --quick \
  --workloads resnet50,gpt2_small,many_small_4000 --json "$OUT/pack.json" --markdown "$OUT/pack.md"

# On the CPU (tests/conftest.py), with this machine's jax; the slowest tests left out;
# pytest-benchmark, where installed, would refuse to run beside xdist.
run_step tests 60 env HYPOTHESIS_PROFILE=dev "$PYTHON" -m pytest -p no:cacheprovider -p no:benchmark -x -q \
  tests/test_gpu_path.py tests/test_pack.py tests/test_layout.py \
  -k "not sharing_kernels and not every_float4 and not every_bit_pattern and not backward_of_unpack"

run_step summary 15 "$PYTHON" - <<'EOF'
"""The goals, from the JSON the benchmarks wrote under $OUT."""
import json, os, pathlib

rows = []
def add(goal, what, value, limit, ok):
  rows.append((goal, what, "-" if value is None else f"{value:.3f}", limit,
               "-" if value is None else ("PASS" if ok else "MISS")))

def values(name):
  """Every row's values in $OUT/NAME.json; none where the file is missing."""
  path = pathlib.Path(os.environ["OUT"]) / f"{name}.json"
  if not path.exists():
    print(f"{path.name}: missing (the step failed or did not run)")
    return []
  doc = json.loads(path.read_text())
  print(f"{path.name}: {doc['machine']['device_count']} {doc['machine']['platform']} device(s)")
  return [r["values"] for t in doc["tables"] for r in t["rows"]]

for v in values("step"):
  if v.get("key") in ("allreduce", "packed", "sharded") and v.get("speedup_vs_per_leaf"):
    r = 1 / v["speedup_vs_per_leaf"]  # their baseline is per_leaf, timed in the same run
    add("step time: jpack / per-leaf", f"{v['model']} {v['key']}", r, "<= 1.05", r <= 1.05)

for v in values("optimizer"):
  if "jpack_over_per_leaf" in v:  # the times table, not the goals
    r = v["jpack_over_per_leaf"]
    add("adam update: jpack / per-leaf optax", v["workload"], r, "< 1", r is not None and r < 1)
    r = v["jpack_over_torch"] if v["torch_adam"].startswith("fused") else None
    add("adam update: jpack / torch fused Adam", v["workload"], r, "<= 1",
        r is not None and r <= 1)
    r = v.get("one_bucket_speedup_vs_torch")
    r = 1 / r if r else None
    add("adam update: jpack, one bucket / torch fused Adam", v["workload"], r, "<= 1",
        r is not None and r <= 1)

print("\n| goal | model / workload | value | limit | result |\n|---|---|---:|---|---|")
for row in rows:
  print("| " + " | ".join(row) + " |")
EOF

echo -e "\njpack GPU check: ${#FAILED[@]} step(s) failed or skipped; outputs: $OUT"
((${#FAILED[@]})) && printf '  %s\n' "${FAILED[@]}"
exit "${#FAILED[@]}"
