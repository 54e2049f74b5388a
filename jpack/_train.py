"""A jit-compiled data-parallel training step over a mesh (shard_map) or with pmap."""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jpack import _cpu as cpu
from jpack._collectives import all_gather, assert_same_layout, broadcast, shard
from jpack._grads import (accumulated_grads, average_state, check_accumulate, check_loss_fn,
                          with_state)
from jpack._internal import dtype_name, outside_jit
from jpack._labels import Labels, check_inner, group_fn_for, multi_transform, with_extra_args
from jpack._layout import PARTITION_HINT, Layout, plan
from jpack._pack import Packed, flatten_like, pack, unpack
from jpack._placement import (check_micro_batches, check_splits, place, place_batch,
                              replicate)
from jpack._precision import ParamDtype, cast_params, master_layout
from jpack._probe import checker
from jpack._sharded import ShardedState, sharded, sharded_layout
from jpack._transforms import after, allreduce, firsts, flat

MODES = ("allreduce", "packed", "sharded")
_READ_FIX = ("Read the state step() returned, or copy what you need before the step: "
             "jax.device_get(dp.params(state)).")


class TrainState(NamedTuple):
  """What a data-parallel step carries from one step to the next.

  ``step`` donates the whole state it is given, every field (``params``, ``opt_state``,
  ``step`` and ``model_state``): their buffers hold the new state, and the old arrays
  are deleted, so read fields from the state ``step`` returns. An array read from a
  state before a later ``step`` (``stats = state.model_state``) is deleted by that step
  too, and JAX then raises ``Array has been deleted``: copy it first
  (``jax.device_get(state.model_state)``, ``jnp.copy``). Passing a donated state to
  ``step`` or ``params`` raises a `RuntimeError` that says so. ``init`` donates nothing.

  Attributes:
    params: the parameters: a tree, or a `jpack.Packed` in the "packed" and "sharded"
      modes.
    opt_state: the optimizer state (its slices, split over the axis, in "sharded" mode).
    step: the number of steps taken.
    model_state: with ``has_state=True``, the model's state that is not trained (Flax's
      ``batch_stats``), replicated; otherwise None.
  """
  params: Any
  opt_state: Any
  step: jax.Array
  model_state: Any = None


class DataParallel(NamedTuple):
  """The pair of functions `data_parallel` builds (like an optax transformation).

  ``step.lower(state, batch)`` lowers the step as its own ``jax.jit`` does (compiler
  options included) without running it, on arrays or on `jax.ShapeDtypeStruct`s
  (``jax.eval_shape(dp.init, params)`` gives the state's): ``.compile().as_text()`` is
  the program XLA runs, also for a mesh of devices that are not attached (see
  docs/gpu.md).
  """
  init: Callable[[Any], TrainState]                # params -> replicated TrainState
  step: Callable[[TrainState, Any], tuple[TrainState, dict]]  # (state, batch) -> new, metrics
  params: Callable[[TrainState], Any]              # state -> params as the original tree
  layout: Layout                                   # the bucket layout of the params


def data_parallel(loss_fn: Callable[[Any, Any], jax.Array],
                  optimizer: optax.GradientTransformation | dict[Any, optax.GradientTransformation],
                  params_like: Any, mesh: Mesh | None = None, *, axis_name: str = "batch",
                  mode: str = "packed", labels: Labels = None, comm_dtype: Any = None,
                  root: int = 0, use_pmap: bool = False, has_aux: bool = False,
                  has_state: bool = False, param_dtype: ParamDtype = None, accumulate: int = 1,
                  accumulator: str = "local", **plan_options: Any) -> DataParallel:
  """Build a jit-compiled data-parallel training step.

  The batch is split over ``axis_name`` (leading dimension), gradients are averaged
  across devices, and every device applies the same update. Initial parameters are
  broadcast from device ``root`` so all replicas start equal (even if each process
  initialised its own).

  ``step`` takes the batch as a `jax.Array` already split over ``axis_name`` (used as
  is), or as host values (numpy) or arrays on other devices, which it places: in a
  single process they are the global batch, in a multi-process run this process's rows
  of it. Each batch leaf's leading dimension must split evenly over the devices.
  Every param leaf must be floating (or complex): it gets a gradient. On several CPU
  devices ``step`` waits for the step 4 calls back before returning: XLA:CPU's
  in-process collectives deadlock when ~40 steps are queued (jax 0.10.2).

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar loss`` on one device's batch slice
      (with ``has_aux`` and ``has_state``, see there). A signature or a return value
      that does not fit these flags raises a `TypeError` naming the flag to set.
    optimizer: the optax optimizer (without any all-reduce: the step adds it, and a
      `jpack.optax.allreduce` in it is refused), or a dict ``{label: optimizer}`` with
      ``labels``.
    params_like: the params tree, or a tree of `jax.ShapeDtypeStruct`; fixes the layout.
    mesh: a 1-D `jax.sharding.Mesh` whose axis is ``axis_name`` (default: all devices);
      other axes of size 1 are allowed, larger ones are refused.
    axis_name: the data-parallel axis.
    mode: which optax transformation the step runs:
      ``"packed"`` (default): params live as a `jpack.Packed`; the loss unpacks them, so
      gradients arrive packed (no per-step pack), and the step runs
      ``optax.chain(jpack.optax.allreduce(axis_name, grad_norm=True),
      jpack.optax.flat(optimizer))`` on the buckets.
      ``"allreduce"``: params stay a tree, and the step runs
      ``optax.chain(jpack.optax.allreduce(axis_name, grad_norm=True), optimizer)``,
      which packs the gradients, reduces them bucket by bucket and unpacks them for the
      optimizer.
      ``"sharded"``: ZeRO-1, ``jpack.optax.sharded(optimizer, axis_name)`` on packed
      params; each device updates its slice and the new params are all-gathered. The
      parts of the optimizer that need whole leaves (adafactor, muon, sm3) run on each
      device's own whole leaves, and ``layout`` is then planned so that no leaf crosses
      a shard; lamb's trust ratio and a static ``mask=`` are computed leaf by leaf on
      the slices.
    labels: per-leaf labels (a tree like the params or a prefix of it, or
      ``params -> tree``) choosing
      each leaf's optimizer from the dict ``optimizer``, as in
      `optax.multi_transform`: no weight decay on biases and norms, frozen leaves
      (``optax.set_to_zero()``). Each label gets its own buckets, so this works in the
      packed and ZeRO-1 modes too, where an ``optax.masked`` mask would see buckets.
    comm_dtype: wire dtype of the gradient collectives (see `jpack.psum`).
    root: the device whose initial parameters everyone gets.
    use_pmap: build the step with `jax.pmap` instead of `jax.shard_map` (the state then
      carries a leading device axis; ``step`` still takes the global batch and adds
      the device axis itself). shard_map is faster and preferred.
    has_aux: ``loss_fn`` returns ``(loss, aux)``, as with ``jax.value_and_grad``;
      ``aux`` (a tree of arrays or Python scalars, e.g. accuracy) is averaged over the
      devices like the loss and returned as ``metrics["aux"]``; integers and bools are
      averaged as float32 (a mean taken in uint8 would wrap), PRNG keys are refused.
    has_state: the model has state that is not trained (Flax's ``batch_stats``):
      ``loss_fn(params, model_state, batch)`` returns ``(loss, new_model_state)``, or
      ``(loss, (new_model_state, aux))`` with ``has_aux``, like Flax's
      ``model.apply(..., mutable=["batch_stats"])``; ``init(params, model_state)``
      takes its first value, and `TrainState` carries it (replicated, broadcast from
      ``root``). Floating leaves of the new state that differ between devices (batch
      statistics of each device's own rows) are averaged over the axis every step;
      leaves the model already keeps equal (``nn.BatchNorm(axis_name=axis_name)``
      computes its statistics over the whole batch) are kept as they are. With
      ``accumulate``, each micro-batch sees the state the previous one left.
    param_dtype: mixed precision, in the "packed" and "sharded" modes: the params are
      kept, and the loss sees them, in this dtype (``jnp.bfloat16``; a tree of dtypes,
      with None for leaves to keep, or a function of the params, as in
      `jpack.cast_params`). The optimizer updates master copies in the dtype of
      ``params_like`` (float32), replicated in "packed" mode and sharded 1/N like the
      moments in "sharded" mode; gradients are reduced in the masters' dtype (or
      ``comm_dtype``), and in "sharded" mode the new params are all-gathered in
      ``param_dtype``. ``init`` takes the full-precision params.
    accumulate: micro-batches per step. Each device splits its rows of every batch leaf
      into ``accumulate`` equal, consecutive micro-batches and runs them one after the
      other (`jax.lax.scan`), adding their gradients in float32 (or the masters'
      dtype) buckets; the sum is reduced once per step, so the step computes the update
      of the whole batch with the activation memory of one micro-batch. The loss and
      aux are the means over the micro-batches.
    accumulator: where the accumulated gradients live with ``accumulate > 1``:
      ``"local"`` (default): full buckets on every device, one reduction per step.
      ``"sharded"`` (mode "sharded" only, ZeRO-2's gradient memory): every micro-step's
      gradients are reduce-scattered into this device's 1/N slice, ``accumulate``
      reduce-scatters per step instead of one, for 1/N of the accumulator's memory.
    **plan_options: options for `jpack.plan`.

  Returns:
    `DataParallel` with ``init(params) -> TrainState``,
    ``step(state, batch) -> (state, {"loss", "grad_norm"[, "aux"]})`` (which donates
    the state it is given: see `TrainState`),
    ``params(state) -> tree``
    and the params ``layout``.
  """
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
  check_accumulate(accumulate, accumulator, mode)
  check_loss_fn(loss_fn, has_aux, has_state)
  if param_dtype is not None and mode == "allreduce":
    raise ValueError("param_dtype= needs mode='packed' or mode='sharded', where the "
                     "optimizer keeps master copies of the packed params; mode='allreduce' "
                     "runs the optimizer on the params tree as given.")
  mesh = _check_mesh(mesh, axis_name)
  check_inner(optimizer, labels)
  _check_not_flax_variables(params_like)
  if "group_fn" in plan_options:
    raise TypeError("data_parallel takes labels=, not group_fn=: it groups the buckets by "
                    "label itself (pass labels= with a dict of optimizers, or a plain "
                    "optimizer).")
  defaults, compiler_options = step_options(mesh, axis_name, sharded=mode == "sharded")
  plan_options = {**defaults, **plan_options}
  narrow_like = params_like if param_dtype is None else cast_params(params_like, param_dtype)
  layout = plan(narrow_like, group_fn=group_fn_for(narrow_like, labels), **plan_options)
  _check_trainable(layout)
  # The gradients' dtypes as the optimizer takes them: the masters', or the params'.
  # On a miniature of the params: the optimizer on buckets or slices against the tree,
  # and no collective over the axis where every device holds the whole gradient.
  where = f"inside data_parallel's optimizer (mode={mode!r})"
  if mode == "sharded":  # whole leaves on each device, where the optimizer needs them
    layout = sharded_layout(optimizer, layout, axis_name, where, **plan_options)
  masters = layout if param_dtype is None else master_layout(layout, params_like)
  if mode != "sharded":
    checker(optimizer, on="buckets" if mode == "packed" else "tree", axis_name=axis_name,
            where=where, instead="mode='allreduce', which runs it on the params tree")(masters)
  tx = _transformation(mode, optimizer, labels, axis_name, comm_dtype, param_dtype,
                       plan_options)
  packed_params = mode in ("packed", "sharded")

  def local_init(params, model_state=None):
    if model_state is not None:
      model_state = broadcast(model_state, axis_name, root=root)
    if param_dtype is not None:  # the optimizer keeps the full-precision masters
      params = broadcast(params, axis_name, root=root)
      return TrainState(pack(cast_params(params, param_dtype), layout), tx.init(params),
                        jnp.zeros((), jnp.int32), model_state)
    if isinstance(params, Packed):  # packed on the host (`_packed_on_host`)
      params = broadcast(params, axis_name, root=root)
    else:
      params = broadcast(params, axis_name, root=root, layout=layout)
      if packed_params:
        params = pack(params, layout)
    return TrainState(params, tx.init(params), jnp.zeros((), jnp.int32), model_state)

  grads_fn = accumulated_grads(with_state(loss_fn, has_aux, has_state), packed_params,
                                axis_name, masters, accumulate, accumulator, comm_dtype)
  local_step = _per_device_step(grads_fn, tx, mode, axis_name, has_aux)

  def to_tree(state):
    return unpack(state.params) if packed_params else state.params

  # What init takes: the params as params_like describes them (full precision).
  init_layout = layout if param_dtype is None else plan(params_like, **plan_options)
  # Params that init's program takes packed: a few buckets, not an input, a broadcast,
  # a slice and a pack per leaf (with 4000 leaves that program took a minute to compile).
  host_packed = packed_params and param_dtype is None
  if use_pmap:
    dp = _build_pmap(local_init, local_step, to_tree, params_like, init_layout, axis_name,
                     mesh, mode, accumulate, has_state, host_packed)
  else:
    dp = _build_shard_map(local_init, local_step, to_tree, params_like, init_layout,
                          axis_name, mesh, mode, accumulate, has_state, compiler_options,
                          host_packed)
  return dp._replace(layout=layout)


def step_options(mesh: Mesh | None = None, axis_name: str = "batch", *,
                 sharded: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
  """The plan options and XLA compiler options `data_parallel` uses on ``mesh``.

  For a hand-written step, so that it compiles to `data_parallel`'s program: pass the
  first to `jpack.plan` and the second to your ``jax.jit``. On CPU devices (and TPUs)
  the compiler options are empty. On GPUs they let XLA merge the buckets' all-reduces
  without copying them into one buffer, and keep ZeRO-1's reduce-scatters apart; the
  plan options keep every matrix in a bucket of its own (docs/gpu.md).

  Args:
    mesh: the data-parallel mesh (default: all devices).
    axis_name: its data-parallel axis.
    sharded: options for ZeRO-1 (`jpack.optax.sharded`): buckets padded into equal
      shards on every backend.

  Returns:
    ``(plan_options, compiler_options)``, two dicts.

  Example::

    plan_options, compiler_options = jpack.step_options(mesh)
    layout = jpack.plan(params, **plan_options)
    step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=..., out_specs=...),
                   compiler_options=compiler_options)
  """
  mesh = _check_mesh(mesh, axis_name)
  return cpu.step_defaults(mesh.devices.flat, sharded, mesh.shape[axis_name])


def _check_mesh(mesh: Mesh | None, axis_name: str) -> Mesh:
  """The mesh to run on (all devices by default): a 1-D mesh over ``axis_name``."""
  if mesh is None:
    mesh = jax.make_mesh((len(jax.devices()),), (axis_name,),
                         axis_types=(jax.sharding.AxisType.Explicit,))
  if axis_name not in mesh.axis_names:
    raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {mesh.axis_names}.")
  others = {a: k for a, k in mesh.shape.items() if a != axis_name and k > 1}
  if others:
    # The step would run replicated over the other axes, and the batch and state specs
    # would name only one of them: refuse rather than compute the same step k times.
    raise ValueError(f"data_parallel needs a 1-D mesh over {axis_name!r}; the mesh "
                     f"{dict(mesh.shape)} also has axes {others} of size > 1. Pass a mesh "
                     f"of the data-parallel devices only, e.g. jax.make_mesh((n,), "
                     f"({axis_name!r},)).")
  return mesh


def _per_device_step(grads_of: Callable[[Any, Any], tuple[Any, Any, Any]],
                     tx: optax.GradientTransformationExtraArgs, mode: str, axis_name: str,
                     has_aux: bool) -> Callable[[TrainState, Any], tuple[TrainState, dict]]:
  """One device's step: loss -> gradient -> the mode's transformation -> apply."""

  def local_step(state, batch):
    loss, aux, grads, model_state = grads_of(state.params, state.model_state, batch)
    model_state = average_state(model_state, axis_name)
    loss, aux = lax.pmean((loss, aux), axis_name)
    # Metrics may read the params: computed before any update (the transformations
    # order their updates after the gradients and the loss), no donated param is copied.
    grads = after(grads, *firsts(aux))
    # ZeRO-1 updates this device's slice of the params, then gathers the new params.
    target = shard(state.params, axis_name) if mode == "sharded" else state.params
    updates, opt_state = tx.update(grads, state.opt_state, target, value=loss)
    params = optax.apply_updates(target, updates)
    if mode == "sharded":
      params = all_gather(params, axis_name)
    metrics = {"loss": loss, "grad_norm": _grad_norm(opt_state)}
    if has_aux:
      metrics["aux"] = aux
    return TrainState(params, opt_state, state.step + 1, model_state), metrics

  return local_step


def _packed_on_host(params: Any, layout: Layout, host_packed: bool) -> Any:
  """``params`` packed with numpy, when ``host_packed`` and every leaf is on this host
  (numpy, or a jax.Array this process holds whole), else as they are: init's program
  then takes the buckets. A bucket is the leaves' bytes at their offsets and zeros
  between them, as `jpack.pack` makes it, without compiling a program per layout."""
  leaves = flatten_like(params, layout)  # before device_put would make float64 float32
  if not host_packed or not all(
      isinstance(x, (np.ndarray, np.generic)) or (isinstance(x, jax.Array) and not
                                                  isinstance(x, jax.core.Tracer)
                                                  and x.is_fully_addressable)
      for x in leaves):
    return params
  leaves = jax.device_get(leaves)
  buckets = [np.zeros(b.size, b.dtype) for b in layout.buckets]
  for slot, x in zip(layout.slots, leaves):
    buckets[slot.bucket][slot.offset:slot.offset + slot.size] = np.reshape(x, -1)
  return Packed(tuple(buckets), layout)


def _packed_like(layout: Layout) -> Packed:
  return Packed(tuple(jax.ShapeDtypeStruct((b.size,), b.dtype) for b in layout.buckets),
                layout)


def _build_shard_map(local_init, local_step, to_tree, params_like, layout, axis_name, mesh,
                     mode, accumulate, has_state, compiler_options,
                     host_packed) -> DataParallel:
  """`DataParallel` running the per-device functions under `jax.shard_map`: the state
  replicated over the mesh (ZeRO-1 slices split over it), the batch split over it."""
  replicated = NamedSharding(mesh, P())
  state_shapes = jax.eval_shape(
      jax.shard_map(local_init, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False),
      _packed_like(layout) if host_packed else
      jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)),
                   params_like))
  state_specs = _state_specs(state_shapes, axis_name, mode)
  if has_state:  # replicated, whatever its structure (known only at init)
    state_specs = state_specs._replace(model_state=P())

  init_sm = jax.jit(jax.shard_map(local_init, mesh=mesh, in_specs=P(), out_specs=state_specs))
  step_sm = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(state_specs, P(axis_name)),
                                  out_specs=(state_specs, P())), donate_argnums=0,
                    compiler_options=compiler_options or None)

  def init(params, model_state=None):
    _check_model_state(model_state, has_state)
    _check_same_layout(params, layout)
    params = _packed_on_host(params, layout, host_packed)
    return init_sm(*jax.tree.map(lambda x: replicate(x, replicated), (params, model_state)))

  batch_sharding = NamedSharding(mesh, P(axis_name))

  bounded = cpu.bound_in_flight(list(mesh.devices.flat))

  specs_shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), state_specs,
                                 is_leaf=lambda x: isinstance(x, P))

  def shardings_of(state):
    return specs_shardings._replace(model_state=jax.tree.map(lambda _: replicated,
                                                             state.model_state))

  def step(state, batch):
    _check_state(state, mode)
    counter = state.step
    if not (isinstance(counter, jax.core.Tracer) or
            (isinstance(counter, jax.Array) and counter.sharding == replicated)):
      # A host copy of the state, or one restored onto a single device: place it all
      # (checked on the counter alone, so a placed state costs nothing per leaf).
      state = jax.tree.map(place, state, shardings_of(state))
    elif mode == "sharded":  # a restored or host copy of the slices: split them again
      state = state._replace(opt_state=jax.tree.map(place, state.opt_state,
                                                    specs_shardings.opt_state))
    batch = place_batch(batch, batch_sharding, axis_name, accumulate)
    try:
      out = step_sm(state, batch)
    except ValueError:
      # Part of a state restored onto one device (opt_state, with a placed counter): jit
      # refuses it before running (nothing donated yet). Placing every leaf is checked
      # only here, so a placed state costs nothing per leaf.
      misplaced = jax.tree.leaves(jax.tree.map(
          lambda x, sh: (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
                         and x.is_fully_addressable and x.sharding != sh),
          state, shardings_of(state)))
      if not any(misplaced):
        raise
      out = step_sm(jax.tree.map(place, state, shardings_of(state)), batch)
    bounded(out[1]["loss"])
    return out

  def lower(state, batch):
    # The step's own jit (with its compiler options), on abstract values or arrays.
    batch = jax.tree.map(lambda x: x if isinstance(x, jax.ShapeDtypeStruct) and x.sharding
                         else jax.ShapeDtypeStruct(np.shape(x), x.dtype,
                                                   sharding=batch_sharding), batch)
    return step_sm.lower(state, batch)

  step.lower = lower
  # Called outside jit, `unpack` copies CPU buckets' leaves out with no compilation
  # (elsewhere it compiles one program); jit(to_tree) would compile a kernel per leaf.
  tree_of = to_tree if mode != "allreduce" else jax.jit(to_tree)

  def params(state):
    _check_not_donated(state, _READ_FIX)
    return tree_of(state)

  return DataParallel(init, step, params, layout)


def _transformation(mode: str, optimizer: Any, labels: Labels, axis_name: str,
                    comm_dtype: Any, param_dtype: ParamDtype, plan_options: Mapping[str, Any]
                    ) -> optax.GradientTransformationExtraArgs:
  """The mode's optax transformation."""
  if mode == "sharded":
    return sharded(optimizer, axis_name, labels=labels, comm_dtype=comm_dtype,
                   param_dtype=param_dtype, **plan_options)
  if mode == "packed":  # packed gradients: the optimizer runs on their buckets
    update = flat(optimizer, labels=labels, param_dtype=param_dtype, **plan_options)
  elif isinstance(optimizer, Mapping):
    update = multi_transform(optimizer, labels)
  else:
    update = with_extra_args(optimizer)
  reduce = allreduce(axis_name, comm_dtype=comm_dtype, grad_norm=True, **plan_options)
  return optax.chain(reduce, update)


def _grad_norm(opt_state: Any) -> jax.Array:
  """The global norm of the mean gradient, kept by `sharded` or by `allreduce`."""
  return opt_state.grad_norm if isinstance(opt_state, ShardedState) else opt_state[0].grad_norm


def _check_not_flax_variables(params_like: Any) -> None:
  """Flax's ``model.init`` returns variables: params next to collections that are not
  trained (``batch_stats``); an optimizer over all of them would change running
  statistics as if they were weights."""
  if isinstance(params_like, Mapping) and "params" in params_like and len(params_like) > 1:
    others = sorted(map(str, set(params_like) - {"params"}))
    raise ValueError(
        f"params_like looks like Flax variables (what model.init returns): next to 'params' "
        f"it has the collections {others}. data_parallel trains every leaf it is given "
        f"with the optimizer, and these are not parameters. Pass variables[\"params\"] and "
        "apply the model with {'params': params, ...} in loss_fn.")


def _check_trainable(layout: Layout) -> None:
  """Every leaf gets a gradient, so every leaf must be floating (or complex)."""
  for slot in layout.slots:
    if not jnp.issubdtype(slot.dtype, jnp.inexact):
      raise TypeError(
          f"Param leaf at {slot.path or '<root>'} has dtype {dtype_name(slot.dtype)}; "
          "data_parallel differentiates the loss with respect to every param leaf, so each "
          "must be a floating (or complex) array. An integer, bool or PRNG-key leaf in "
          "the params looks like model state that is not trained (a BatchNorm counter, "
          "Haiku's state from hk.transform_with_state, Flax's batch_stats): pass it apart, "
          "as model_state, with data_parallel(..., has_state=True), "
          "loss_fn(params, model_state, batch) -> (loss, new_model_state) and "
          "dp.init(params, model_state). Other counters, masks and PRNG keys: close over "
          "them in loss_fn or pass them in the batch. " + PARTITION_HINT)


def _state_specs(state_shapes: TrainState, axis_name: str, mode: str) -> TrainState:
  """Replicated everywhere, except ZeRO-1 optimizer slices, which are split over the axis."""
  def opt_spec(x):
    return P(axis_name) if (mode == "sharded" and x.ndim >= 1) else P()

  return TrainState(jax.tree.map(lambda _: P(), state_shapes.params),
                    jax.tree.map(opt_spec, state_shapes.opt_state),
                    P())


def _check_same_layout(params: Any, layout: Layout) -> None:
  """`assert_same_layout`, except under ``jax.eval_shape(dp.init, ...)``: nothing runs
  there and the processes cannot exchange fingerprints (a restore checks that shape
  against the checkpoint's fingerprint instead)."""
  if outside_jit(jax.tree.leaves(params)):
    assert_same_layout(layout)


def _check_model_state(model_state: Any, has_state: bool) -> None:
  if has_state and model_state is None:
    raise TypeError("data_parallel(..., has_state=True) carries a model state: pass its "
                    "first value, init(params, model_state) (e.g. "
                    "variables['batch_stats']).")
  if not has_state and model_state is not None:
    raise TypeError("init got a model_state, but the step was built without "
                    "has_state=True, so loss_fn would never see it.")


def _check_state(state: TrainState, mode: str) -> None:
  """What ``step`` can tell about a state before it traces: a tree where the packed
  modes keep a `Packed` (``fresh._replace(params=tree)`` when restoring; shard_map's own
  error is a pytree-prefix mismatch), and a state already passed to ``step``, which
  donated it: on several CPU devices jax 0.10.2 kills the process (segfault) when a
  deleted buffer is donated again."""
  if mode in ("packed", "sharded") and not isinstance(state.params, Packed):
    raise TypeError(
        f"TrainState.params is a {type(state.params).__name__}, but data_parallel("
        f"mode={mode!r}) keeps the params as a jpack.Packed: use dp.init(params) for a "
        "new state, or jpack.pack(params, dp.layout) when restoring "
        "(state._replace(params=jpack.pack(tree, dp.layout))).")
  _check_not_donated(state, "Use the state step() returned: state, metrics = "
                     "dp.step(state, batch).")


def _check_not_donated(state: TrainState, fix: str) -> None:
  """A state whose buffers ``step`` donated: every array in it is deleted, and JAX's own
  error names none of this. The step counter is donated with the rest, so it tells
  without flattening the state (one cheap call)."""
  counter = state.step
  if (isinstance(counter, jax.Array) and not isinstance(counter, jax.core.Tracer)
      and counter.is_deleted()):
    raise RuntimeError(
        "This TrainState was already passed to step(), which donates the whole state "
        "(params, opt_state, step and model_state): its buffers are reused for the new "
        f"state, and these are deleted. {fix}")


def _build_pmap(local_init, local_step, to_tree, params_like, layout, axis_name, mesh,
                mode, accumulate, has_state, host_packed) -> DataParallel:
  """`DataParallel` running the per-device functions under `jax.pmap`: the state carries a
  leading device axis, and the global batch is split into it."""
  del params_like
  n = mesh.shape[axis_name]
  devices = list(mesh.devices.flat)
  init_p = jax.pmap(local_init, axis_name=axis_name, devices=devices)
  step_p = jax.pmap(local_step, axis_name=axis_name, devices=devices, donate_argnums=0)

  def init(params, model_state=None):
    _check_model_state(model_state, has_state)
    _check_same_layout(params, layout)
    params = _packed_on_host(params, layout, host_packed)
    def stack(x):  # a tracer when init itself is traced (jax.eval_shape, jit)
      if isinstance(x, jax.core.Tracer):
        return jnp.broadcast_to(x, (n,) + x.shape)
      return np.broadcast_to(np.asarray(x), (n,) + np.shape(x))

    return init_p(*jax.tree.map(stack, (params, model_state)))

  def split(path, x):
    check_splits(path, np.shape(x), n, axis_name)
    if isinstance(x, jax.Array):  # PRNG key arrays have no numpy form
      return x.reshape((n, -1) + x.shape[1:])
    return np.reshape(np.asarray(x), (n, -1) + np.shape(x)[1:])

  bounded = cpu.bound_in_flight(list(mesh.devices.flat))

  def on_fewer_devices(x):  # restored onto one device: pmap takes host rows, not these
    return (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
            and len(x.sharding.device_set) != len(devices))

  def as_host_rows(state):
    return jax.tree.map(lambda x: np.asarray(x) if on_fewer_devices(x) else x, state)

  def step(state, batch):
    _check_state(state, mode)
    check_micro_batches(batch, n, accumulate)
    if on_fewer_devices(state.step):  # a whole state restored onto one device
      state = as_host_rows(state)
    batch = jax.tree_util.tree_map_with_path(split, batch)
    try:
      state, metrics = step_p(state, batch)
    except ValueError:
      # Part of the state (opt_state) restored onto one device, with a placed counter:
      # pmap refuses it before running (nothing donated); checked only here, so a placed
      # state costs nothing per leaf.
      if not any(on_fewer_devices(x) for x in jax.tree.leaves(state)):
        raise
      state, metrics = step_p(as_host_rows(state), batch)
    bounded(metrics["loss"])
    return state, jax.tree.map(lambda m: m[0], metrics)

  def params(state):
    _check_not_donated(state, _READ_FIX)
    return to_tree(jax.tree.map(lambda x: x[0], state))

  return DataParallel(init, step, params, layout)
