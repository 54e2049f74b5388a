"""Save every n steps with Orbax and resume after a crash: docs/howto/checkpoints.md shows
it, tests/test_crash_resume.py kills it (mid-run, and while a save is in flight) and
checks that the resumed run ends bit-identical to an uninterrupted one.

    python train_resume.py --mode sharded --steps 30              # saves steps 10, 20, 30
    python train_resume.py --mode sharded --steps 60 --devices 4  # resumes at 30, on 4
"""

# --8<-- [start:setup]
import argparse
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from sklearn.datasets import load_digits

import jpack
# --8<-- [end:setup]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Train the digits MLP, saving every n steps.")
    p.add_argument("--mode", default="packed", choices=["packed", "sharded", "fsdp", "allreduce"])
    p.add_argument("--steps", type=int, default=60, help="train until this step")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--keep", type=int, default=3, help="keep the last KEEP checkpoints")
    p.add_argument("--dir", default="checkpoints")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--out", help="write the final params and optimizer state (.npz)")
    p.add_argument("--hold-save", type=int, metavar="STEP",
                   help="(tests) keep the save of STEP in flight until killed")
    return p.parse_args(argv)


# --8<-- [start:model]
def load_data():
    """scikit-learn's 8x8 digits (bundled, no download), standardized."""
    digits = load_digits()
    x = digits.data.astype(np.float32)
    return (x - x.mean(0)) / (x.std(0) + 1e-6), digits.target.astype(np.int32)


def init_params(key, width=64, depth=4):
    """The demo's MLP: an input layer, `depth` residual blocks, a 10-class head."""
    keys = jax.random.split(key, depth + 2)

    def dense(k, fan_in, fan_out):
        return {"w": jax.random.normal(k, (fan_in, fan_out)) / np.sqrt(fan_in),
                "b": jnp.zeros(fan_out)}

    return {"embed": dense(keys[0], 64, width),
            "blocks": [dense(k, width, width) for k in keys[1:-1]],
            "head": dense(keys[-1], width, 10)}


def loss_fn(params, batch):
    """Cross-entropy with dropout; every example brings its own dropout key."""
    h = batch["x"] @ params["embed"]["w"] + params["embed"]["b"]
    for i, block in enumerate(params["blocks"]):
        z = jax.nn.gelu(h @ block["w"] + block["b"])
        keep = jax.vmap(lambda k: jax.random.bernoulli(jax.random.fold_in(k, i), 0.9,
                                                       z.shape[1:]))(batch["key"])
        h = h + jnp.where(keep, z / 0.9, 0.0)
    logits = h @ params["head"]["w"] + params["head"]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
# --8<-- [end:model]


# --8<-- [start:batches]
def batch_at(step, key, x, y, size=128):
    """The batch of `step`: its examples and its dropout keys are functions of the step
    (no iterator to save), so a resumed run sees the batches the first run would have."""
    epoch, i = divmod(step, len(x) // size)
    order = np.random.default_rng(epoch).permutation(len(x))   # a new order every epoch
    rows = order[i * size:(i + 1) * size]
    keys = jax.random.split(jax.random.fold_in(key, step), size)  # one per example
    return {"x": x[rows], "y": y[rows], "key": keys}
# --8<-- [end:batches]


# --8<-- [start:manager]
def open_manager(directory, save_every, keep, **options):
    """Saves every `save_every`-th step, asynchronously, and keeps the last `keep`."""
    options = ocp.CheckpointManagerOptions(
        save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(save_every),
        preservation_policy=ocp.checkpoint_managers.LatestN(keep),
        cleanup_tmp_directories=True,  # what a save killed midway left behind
        enable_async_checkpointing=True, **options)
    return ocp.CheckpointManager(directory, options=options)
# --8<-- [end:manager]


# --8<-- [start:train]
def train(manager, dp, params, steps, x, y, log_every=10):
    """Train until `steps`, from the last finished checkpoint if there is one."""
    if manager.latest_step() is None:  # nothing finished yet: a fresh run
        state, key = dp.init(params), jax.random.key(1)
    else:  # the last finished checkpoint, whatever device count and mode saved it
        like = jax.eval_shape(dp.init, params)  # structure only, computes nothing
        state, key = jpack.checkpoint.restore(manager, like)
    start = int(state.step)
    print(f"{jax.device_count()} devices, from step {start}", flush=True)
    for step in range(start, steps):
        state, metrics = dp.step(state, batch_at(step, key, x, y))
        if (step + 1) % log_every == 0:
            print(f"step {step + 1} loss {float(metrics['loss']):.4f}", flush=True)
        # Returns at once on the other steps; on a save step, once the state is copied
        # to the host: the files are written while the next steps run.
        if jpack.checkpoint.save(manager, step + 1, state, key=key,
                                 force=step + 1 == steps):
            print(f"saving step {step + 1}", flush=True)
    manager.wait_until_finished()
    return state
# --8<-- [end:train]


# --8<-- [start:main]
def main(argv=None):
    args = parse_args(argv)
    jax.config.update("jax_num_cpu_devices", args.devices)  # drop this on GPUs
    x, y = load_data()
    params = init_params(jax.random.key(0))
    dp = jpack.data_parallel(loss_fn, optax.adamw(1e-3, weight_decay=1e-4), params,
                             mode=args.mode)
    directory = pathlib.Path(args.dir).absolute()
    hold = {} if args.hold_save is None else {
        "async_options": hold_save(directory, args.hold_save)}
    with open_manager(directory, args.save_every, args.keep, **hold) as manager:
        state = train(manager, dp, params, args.steps, x, y, args.log_every)
    if args.out:
        write_final(args.out, dp, state)
    print(f"done at step {int(state.step)}", flush=True)
# --8<-- [end:main]


def hold_save(directory, step):
    """For tests/test_crash_resume.py: Orbax calls this when a save's files are written,
    before it finalizes the step's directory; for `step`, it never returns, so the save
    stays in flight until the process is killed."""
    def hold():
        if any(directory.glob(f"{step}.orbax-checkpoint-tmp*")):
            # One write, as this thread's line can land inside the training loop's.
            sys.stdout.write(f"save of step {step} in flight\n")
            sys.stdout.flush()
            time.sleep(3600)
    return ocp.AsyncOptions(post_finalization_callback=hold)


def write_final(path, dp, state):
    """The final params and optimizer state, to compare runs leaf by leaf."""
    tree = {"params": dp.unpack(state),
            "opt_state": jpack.checkpoint.gather_state(state.opt_state),
            "step": state.step}
    np.savez(path, **{jax.tree_util.keystr(p): np.asarray(v)
                      for p, v in jax.tree_util.tree_leaves_with_path(tree)})


if __name__ == "__main__":
    main()
