"""A jit-compiled data-parallel training step over a mesh (`jax.shard_map`)."""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jpack import _cpu as cpu
from jpack._collectives import (Shards, all_gather, assert_same_layout, broadcast, shard,
                                slice_axes)
from jpack._constants import on_host_where_constant
from jpack._grads import (accumulated_grads, average_state, check_accumulate, check_loss_fn,
                          with_state)
from jpack._internal import dtype_name, outside_jit
from jpack._labels import check_inner, group_fn_for, split_partition, with_extra_args
from jpack._layout import PARTITION_HINT, Layout, plan
from jpack._pack import Packed, flatten_like, pack, unpack
from jpack._placement import place, place_batch, replicate
from jpack._precision import ParamDtype, Precision, cast_params, check_precision, master_layout
from jpack._probe import checker
from jpack._sharded import (ShardedState, pads_much, params_or_masters, sharded,
                             sharded_layout)
from jpack._transforms import after, allreduce, firsts, flat

MODES = ("allreduce", "packed", "sharded", "fsdp")
SLICED = ("sharded", "fsdp")  # the modes whose optimizer runs on each device's slices
_READ_FIX = ("Read the state step() returned, or copy what you need before the step: "
             "jax.device_get(dp.unpack(state)).")


class Mode(NamedTuple):
  """What `data_parallel` keeps on each device, with the options of that choice.

  ``mode="packed"`` and ``Mode("packed")`` are the same; the options exist only here.

  Attributes:
    name: ``"packed"``, ``"allreduce"``, ``"sharded"`` or ``"fsdp"`` (see `data_parallel`).
    shard_accumulator: with ``accumulate > 1`` in ``"sharded"`` mode, reduce-scatter each
      micro-batch's gradients into this device's 1/N slice (ZeRO-2's gradient memory,
      ``accumulate`` reduce-scatters a step) instead of summing full buckets (one).
      ``"fsdp"`` always does.
    keep_gathered: in ``"fsdp"`` mode, keep the buckets gathered in the forward pass for
      the backward pass (one gather per bucket and step, ZeRO-2's memory) instead of
      gathering them again there (see `jpack.fsdp`).
    remat_policy: in ``"fsdp"`` mode, a `jax.checkpoint` policy: which values of the loss
      the backward pass keeps rather than recomputes (never the gathered buckets, unless
      ``keep_gathered``). Default: matmul outputs without batch dimensions (see
      docs/zero.md); ``jax.checkpoint_policies.everything_saveable`` recomputes least.
  """
  name: str = "packed"
  shard_accumulator: bool = False
  keep_gathered: bool = False
  remat_policy: Callable[..., Any] | None = None


class TrainState(NamedTuple):
  """What a data-parallel step carries from one step to the next.

  ``step`` donates the whole state it is given: read fields from the state it returns
  (an array read from an older state is deleted; copy it first with
  ``jax.device_get``). A donated state passed again raises a `RuntimeError`.

  Attributes:
    params: the parameters: a tree in ``"allreduce"`` mode, this device's `jpack.Shards`
      in ``"fsdp"`` mode, else a `jpack.Packed`. None in ``"fsdp"`` mode with
      ``Precision(param_dtype=)``: the optimizer's masters are the only copy, rounded
      each step (``dp.unpack(state)`` gives the params).
    opt_state: the optimizer state (its slices, split over the axis, in "sharded" mode).
    step: the number of steps taken.
    model_state: the model's state that is not trained (Flax's ``batch_stats``), as
      given to ``init``, replicated; None without one.
  """
  params: Any
  opt_state: Any
  step: jax.Array
  model_state: Any = None


class DataParallel(NamedTuple):
  """The functions `data_parallel` builds (like an optax transformation).

  ``step.lower(state, batch)`` lowers the step as its own ``jax.jit`` does (compiler
  options included) without running it, on arrays or `jax.ShapeDtypeStruct`s
  (``jax.eval_shape(dp.init, params)`` gives the state's); see docs/gpu.md.
  """
  init: Callable[..., TrainState]                  # (params[, model_state]) -> TrainState
  step: Callable[[TrainState, Any], tuple[TrainState, dict]]  # (state, batch) -> new, metrics
  unpack: Callable[[TrainState], Any]              # state -> what init took, on one device
  layout: Layout                                   # the bucket layout of the params


def data_parallel(loss_fn: Callable[..., Any], optimizer: optax.GradientTransformation,
                  params_like: Any, mesh: Mesh | None = None, *,
                  mode: str | Mode | None = None, has_aux: bool = False,
                  precision: Precision | None = None, accumulate: int = 1) -> DataParallel:
  """Build a jit-compiled data-parallel training step over ``mesh``.

  The batch's leading dimension is split over the mesh's axis, gradients are averaged
  in buckets, and every device applies the same update. ``init(params)`` broadcasts
  device 0's params; ``init(params, model_state)`` also carries a model state (Flax's
  ``batch_stats``): ``loss_fn`` is then called as ``loss_fn(params, model_state,
  batch)`` and returns ``(loss, new_model_state)``. Modes (docs/zero.md):
  ``"packed"`` keeps the params in buckets; ``"allreduce"`` keeps them a tree;
  ``"sharded"`` (ZeRO-1) splits the optimizer state 1/N over the devices;
  ``"fsdp"`` (ZeRO-3) splits the params too, each bucket gathered where the loss reads it.

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss`` on one device's slice of the batch.
    optimizer: an optax transformation (no all-reduce in it), or
      `jpack.optax.partition` of several by label.
    params_like: the params tree, or a tree of `jax.ShapeDtypeStruct`.
    mesh: a mesh with one data-parallel axis (default: all devices, axis "batch").
    mode: ``"packed"``, ``"allreduce"``, ``"sharded"``, ``"fsdp"``, or a `jpack.Mode`.
      Default: ``"packed"``, or ``"sharded"`` for an optimizer with parts that need
      whole leaves (adafactor, muon, lamb's trust ratio, masks), which ZeRO-1 runs on
      each device's own leaves: 1/N of that work per device.
    has_aux: ``loss_fn`` returns ``(loss, aux)``; aux is averaged into ``metrics``.
    precision: a `jpack.Precision`: bf16 params with f32 masters, a narrow wire.
    accumulate: micro-batches per step, their gradients summed before one reduction.

  Returns:
    `DataParallel`: ``init``, ``step(state, batch) -> (state, metrics)`` (metrics
    ``"loss"``, ``"grad_norm"`` and ``"aux"``), ``unpack(state)`` (what ``init`` took:
    the params tree, or ``(params, model_state)``, as arrays on one device) and the
    ``layout``.

  Example::

    dp = jpack.data_parallel(loss_fn, optax.adamw(1e-3), params)
    state = dp.init(params)
    state, metrics = dp.step(state, batch)
  """
  chosen = mode is None  # the default: "packed", or ZeRO-1 for parts that need leaves
  mode = _check_mode("packed" if chosen else mode)
  param_dtype, comm_dtype = check_precision(precision)
  inner, labels = split_partition(optimizer)
  check_accumulate(accumulate)
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
  if param_dtype is not None and mode.name == "allreduce":
    raise ValueError("Precision(param_dtype=...) needs mode='packed' or mode='sharded', "
                     "where the optimizer keeps master copies of the packed params; "
                     "mode='allreduce' runs the optimizer on the params tree as given.")
  mesh, axis_name = _check_mesh(mesh)
  slice_axis = slice_axes(axis_name)[1]  # ZeRO slices: within a node on a (node, gpu) mesh
  check_inner(inner, labels)
  _check_not_flax_variables(params_like)
  narrow_like = params_like if param_dtype is None else cast_params(params_like, param_dtype)
  group_fn = group_fn_for(narrow_like, labels)
  plan_options, compiler_options = _defaults(mesh, axis_name, mode)
  layout = plan(narrow_like, group_fn=group_fn, **plan_options)
  _check_trainable(layout)
  where = f"inside data_parallel's optimizer (mode={mode.name!r})"
  if mode.name in SLICED:  # whole leaves on each device, where the optimizer needs them
    layout = sharded_layout(inner, layout, slice_axis, where, **plan_options)
  # The gradients' dtypes as the optimizer takes them: the masters', or the params'.
  masters = layout if param_dtype is None else master_layout(layout, params_like)
  if mode.name not in SLICED:
    needs_leaves = checker(inner, on="buckets" if mode.name == "packed" else "tree",
                           axis_name=axis_name, where=where,
                           instead="mode='allreduce', which runs it on the params tree")(masters)
    sliced = (_zero1_layout(inner, narrow_like, group_fn, mesh, axis_name)
              if chosen and needs_leaves else None)
    if sliced is not None:
      mode, layout = Mode("sharded"), sliced
      plan_options, compiler_options = _defaults(mesh, axis_name, mode)
      masters = layout if param_dtype is None else master_layout(layout, params_like)
  tx = _transformation(mode.name, optimizer, axis_name, comm_dtype, param_dtype, plan_options)
  packed_params = mode.name != "allreduce"
  params_as = {"allreduce": "tree", "fsdp": "shards"}.get(mode.name, "packed")

  def local_init(params, model_state=None):
    if model_state is not None:
      model_state = broadcast(model_state, axis_name)
    if param_dtype is not None:  # the optimizer keeps the full-precision masters
      params = broadcast(params, axis_name)
      # ZeRO-3 keeps the masters only: each step rounds their slices for the loss.
      narrow = None if params_as == "shards" else pack(cast_params(params, param_dtype), layout)
      return TrainState(narrow, tx.init(params), jnp.zeros((), jnp.int32), model_state)
    if isinstance(params, Packed):  # packed on the host (`_packed_on_host`)
      params = broadcast(params, axis_name)
    else:
      params = broadcast(params, axis_name, layout=layout)
      if packed_params:
        params = pack(params, layout)
    params = kept(params)
    return TrainState(params, tx.init(params), jnp.zeros((), jnp.int32), model_state)

  def kept(params):  # ZeRO-3 keeps this device's slices only
    return shard(params, slice_axis) if params_as == "shards" else params

  accumulator = "sharded" if mode.shard_accumulator else "local"
  grads_fn = accumulated_grads(with_state(loss_fn, has_aux), params_as, axis_name,
                                masters, accumulate, accumulator, comm_dtype,
                                mode.keep_gathered, mode.remat_policy)
  local_step = _per_device_step(grads_fn, tx, mode.name, axis_name, has_aux)

  # What init takes: the params as params_like describes them (full precision).
  init_layout = layout if param_dtype is None else plan(params_like, **plan_options)
  # Params that init's program takes packed: a few buckets, not an input, a broadcast,
  # a slice and a pack per leaf, which compiles slowly for thousands of leaves.
  host_packed = packed_params and param_dtype is None
  dp = _build(local_init, local_step, params_as, params_like, init_layout, axis_name,
              mesh, mode.name, accumulate, compiler_options, host_packed,
              functools.partial(check_loss_fn, loss_fn))
  return dp._replace(layout=layout)


def _zero1_layout(inner: Any, like: Any, group_fn: Any, mesh: Mesh, axis_name: Any
                  ) -> Layout | None:
  """ZeRO-1's layout for an optimizer with parts that need whole leaves: "packed" runs
  them on all the leaves on every device, ZeRO-1 on each device's own. None where ZeRO-1
  refuses it, or pads the owned buckets much (`pads_much`): the default stays packed."""
  options = _defaults(mesh, axis_name, Mode("sharded"))[0]
  try:
    sliced = sharded_layout(inner, plan(like, group_fn=group_fn, **options),
                            slice_axes(axis_name)[1], "", **options)
  except TypeError:
    return None
  return None if pads_much(sliced) else sliced


def step_options(mesh: Mesh | None = None, mode: str | Mode = "packed"
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
  """The plan options and XLA compiler options `data_parallel` uses on ``mesh``.

  For a hand-written step, so that it compiles to `data_parallel`'s program: pass the
  first to `jpack.plan` (or as ``plan_options=`` to `jpack.optax`'s transformations)
  and the second to your ``jax.jit``. On CPU
  devices (and TPUs) the compiler options are empty; on GPUs they merge the buckets'
  all-reduces without copies and keep every matrix in a bucket of its own (docs/gpu.md).

  Args:
    mesh: the data-parallel mesh (default: all devices, axis "batch").
    mode: the mode the step runs, as in `data_parallel`.

  Returns:
    ``(plan_options, compiler_options)``, two dicts.

  Example::

    plan_options, compiler_options = jpack.step_options(mesh)
    step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=..., out_specs=...),
                   compiler_options=compiler_options)
  """
  mesh, axis_name = _check_mesh(mesh)
  return _defaults(mesh, axis_name, _check_mode(mode))


def _defaults(mesh: Mesh, axis_name: Any, mode: Mode) -> tuple[dict[str, Any],
                                                               dict[str, Any]]:
  replicas, axis = slice_axes(axis_name)
  slices = mesh.shape[axis] if mode.name in SLICED else 1
  return cpu.step_defaults(mesh.devices.flat, math.prod(mesh.shape[a] for a in (*replicas, axis)),
                           slices, fsdp=mode.name == "fsdp")


def _check_mode(mode: str | Mode) -> Mode:
  if isinstance(mode, str):
    mode = Mode(mode)
  if not isinstance(mode, Mode):
    raise TypeError(f"mode must be one of {MODES} or a jpack.Mode, got "
                    f"{type(mode).__name__}.")
  if mode.name not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode.name!r}.")
  if mode.shard_accumulator and mode.name != "sharded":
    raise ValueError("Mode(shard_accumulator=True) reduce-scatters every micro-batch's "
                     "gradients into this device's slice, which only mode 'sharded' "
                     f"chooses (mode 'fsdp' always does); got Mode({mode.name!r}, "
                     "shard_accumulator=True).")
  if mode.keep_gathered and mode.name != "fsdp":
    raise ValueError("Mode(keep_gathered=True) keeps gathered parameter buckets for the "
                     "backward pass, which only mode 'fsdp' gathers; got "
                     f"Mode({mode.name!r}, keep_gathered=True).")
  if mode.remat_policy is not None and mode.name != "fsdp":
    raise ValueError("Mode(remat_policy=...) chooses what the backward pass of mode "
                     "'fsdp' recomputes; for another mode, apply jax.checkpoint in the "
                     f"loss instead. Got Mode({mode.name!r}, remat_policy=...).")
  if mode.remat_policy is not None and not callable(mode.remat_policy):
    raise TypeError("Mode.remat_policy must be a jax.checkpoint policy (such as "
                    "jax.checkpoint_policies.dots_saveable), got "
                    f"{type(mode.remat_policy).__name__}.")
  return mode


def _check_mesh(mesh: Mesh | None) -> tuple[Mesh, Any]:
  """The mesh to run on (all devices by default) and its data-parallel axes: one name,
  or ``(outer, inner)`` for a two-level mesh (nodes x devices), whose ZeRO slices are
  taken over the inner axis."""
  if mesh is None:
    mesh = jax.make_mesh((len(jax.devices()),), ("batch",),
                         axis_types=(jax.sharding.AxisType.Explicit,))
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
  names = [a for a, k in mesh.shape.items() if k > 1] or list(mesh.axis_names[-1:])
  if len(names) > 2:
    # The batch and state specs name the data axes: the step would run replicated over
    # the others, computing the same step several times.
    raise ValueError(f"data_parallel takes a mesh of one data-parallel axis, or two "
                     f"(nodes x devices, e.g. jax.make_mesh((nodes, per_node), ('node', "
                     f"'gpu'))); the mesh {dict(mesh.shape)} has {len(names)} axes of size "
                     "> 1. Pass a mesh of the data-parallel devices only.")
  if len(names) == 1:
    return mesh, names[0]
  _check_axis_order(mesh, *names)
  return mesh, tuple(names)


def _check_axis_order(mesh: Mesh, outer: str, inner: str) -> None:
  """The inner axis must not cross processes where the outer one stays in one: ZeRO
  slices over the inner axis, and its collectives should run within a node."""
  procs = np.vectorize(lambda d: d.process_index)(mesh.devices)
  procs = np.moveaxis(procs, [mesh.axis_names.index(outer), mesh.axis_names.index(inner)],
                      [-2, -1]).reshape(-1, mesh.shape[outer], mesh.shape[inner])
  inner_crosses = any(len(set(row)) > 1 for grid in procs for row in grid)
  outer_stays = any(len(set(col)) == 1 for grid in procs for col in grid.T)
  if inner_crosses and outer_stays:
    raise ValueError(
        f"The mesh's inner data axis {inner!r} spans processes while its outer axis "
        f"{outer!r} stays within one: data_parallel slices ZeRO state over the inner (last) "
        f"axis, which should be a node's devices. Give the axis across processes first, e.g. "
        f"jax.make_mesh((jax.process_count(), jax.local_device_count()), ('node', 'gpu')).")


def _per_device_step(grads_of: Callable[[Any, Any], tuple[Any, Any, Any]],
                     tx: optax.GradientTransformationExtraArgs, mode: str, axis_name: str,
                     has_aux: bool) -> Callable[[TrainState, Any], tuple[TrainState, dict]]:
  """One device's step: loss -> gradient -> the mode's transformation -> apply."""

  slice_axis = slice_axes(axis_name)[1]

  def local_step(state, batch):
    # ZeRO-3 with masters: the params are the masters' slices, rounded before the gather.
    params = params_or_masters(state.params, state.opt_state)
    loss, aux, grads, model_state = grads_of(params, state.model_state, batch)
    model_state = average_state(model_state, axis_name)
    loss, aux = lax.pmean((loss, aux), axis_name)
    # Metrics may read the params: computed before any update (the transformations
    # order their updates after the gradients and the loss), no donated param is copied.
    grads = after(grads, *firsts(aux))
    # ZeRO-1 updates this device's slice of the params, then gathers the new params;
    # ZeRO-3 keeps the slice, gathered by the next step's forward pass.
    target = shard(params, slice_axis) if mode == "sharded" else params
    updates, opt_state = tx.update(grads, state.opt_state, target, value=loss)
    # With masters only (ZeRO-3), the update of the masters in opt_state is the update.
    params = None if state.params is None else optax.apply_updates(target, updates)
    if mode == "sharded":
      params = all_gather(params, slice_axis)
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


def _traced_once(local_init: Callable[..., Any]) -> Callable[..., Any]:
  """``local_init`` traced once per argument types, then replayed: the state's shapes
  and ``init`` both trace it, and ZeRO-1's owned leaves trace the optimizer more than once."""
  traced: dict[Any, Any] = {}

  def replay(params, model_state=None):
    leaves, tree = jax.tree.flatten((params, model_state))
    key = (tree, tuple(jax.typeof(x) for x in leaves))
    if key not in traced:
      traced[key] = jax.make_jaxpr(lambda *xs: local_init(*tree.unflatten(xs)),
                                   return_shape=True)(*leaves)
    closed, shapes = traced[key]
    outs = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *leaves)
    return jax.tree.unflatten(jax.tree.structure(shapes), outs)

  return replay


def _packed_like(layout: Layout) -> Packed:
  return Packed(tuple(jax.ShapeDtypeStruct((b.size,), b.dtype) for b in layout.buckets),
                layout)


def _build(local_init, local_step, params_as, params_like, layout, axis_name, mesh,
           mode, accumulate, compiler_options, host_packed, check_loss) -> DataParallel:
  """`DataParallel` running the per-device functions under `jax.shard_map`: the state
  replicated over the mesh (ZeRO-1 slices split over it), the batch split over it."""
  replicated = NamedSharding(mesh, P())
  local_init = _traced_once(local_init)
  state_shapes = jax.eval_shape(
      jax.shard_map(local_init, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False),
      _packed_like(layout) if host_packed else
      jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)),
                   params_like))
  # The model state is replicated, whatever its structure (known only at init).
  state_specs = _state_specs(state_shapes, axis_name, mode)._replace(model_state=P())

  # Unchecked, as the shapes' trace above: both replay the one jaxpr `_traced_once` made.
  init_sm = on_host_where_constant(jax.shard_map(
      local_init, mesh=mesh, in_specs=P(), out_specs=state_specs, check_vma=False), mesh)
  step_sm = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(state_specs, P(axis_name)),
                                  out_specs=(state_specs, P())), donate_argnums=0,
                    compiler_options=compiler_options or None)

  def init(params, model_state=None):
    check_loss(model_state is not None)
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
    elif mode in SLICED:  # a restored or host copy of slices: split again
      state = state._replace(**{f: jax.tree.map(place, getattr(state, f),
                                                getattr(specs_shardings, f))
                                for f in ("params", "opt_state")})
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
  # Outside jit, `unpack` copies CPU buckets' leaves out with no compilation (elsewhere
  # it compiles one program); jit(unpack) would compile a kernel per leaf.
  def unpack_state(state):
    _check_not_donated(state, _READ_FIX)
    local = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
    if params_as == "shards":  # this process's copy of the whole buckets, gathered
      shards = params_or_masters(state.params, state.opt_state)
      whole = tuple(_whole_on(b, local) for b in shards.buckets)
      params = unpack(Packed(whole, shards.layout))
    else:
      tree = unpack(state.params) if params_as == "packed" else state.params
      params = jax.tree.map(lambda x: _on_one_device(x, local), tree)
    if state.model_state is None:
      return params
    return params, jax.tree.map(lambda x: _on_one_device(x, local), state.model_state)

  return DataParallel(init, step, unpack_state, layout)


def _whole_on(x: jax.Array, device: Any) -> jax.Array:
  """A bucket split over the devices, whole on ``device`` (gathered from every process's
  devices when this one holds only some of it)."""
  if not x.is_fully_addressable:
    from jax.experimental import multihost_utils  # collective: every process calls it
    x = multihost_utils.process_allgather(x, tiled=True)
  return jax.device_put(x, device)


def _on_one_device(x: Any, device: Any) -> Any:
  """A replicated array as one device's copy (no copy made): usable outside jit with
  arrays the user made, which live on one device, as a mesh-sharded array is not."""
  if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
    return x
  if len(x.sharding.device_set) == 1:
    return x
  for piece in x.addressable_shards:
    if piece.device == device and piece.data.shape == x.shape:
      return piece.data
  return x


def _transformation(mode: str, optimizer: Any, axis_name: str, comm_dtype: Any,
                    param_dtype: ParamDtype, plan_options: Mapping[str, Any]
                    ) -> optax.GradientTransformationExtraArgs:
  """The mode's optax transformation."""
  if mode in SLICED:
    return sharded(optimizer, axis_name, comm_dtype=comm_dtype, param_dtype=param_dtype,
                   plan_options=plan_options)
  if mode == "packed":  # packed gradients: the optimizer runs on their buckets
    update = flat(optimizer, param_dtype=param_dtype, plan_options=plan_options)
  else:
    update = with_extra_args(optimizer)
  reduce = allreduce(axis_name, comm_dtype=comm_dtype, grad_norm=True,
                     plan_options=plan_options)
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
          "as the model state: dp.init(params, model_state), and "
          "loss_fn(params, model_state, batch) -> (loss, new_model_state). Other counters, masks and PRNG keys: close over "
          "them in loss_fn or pass them in the batch. " + PARTITION_HINT)


def _state_specs(state_shapes: TrainState, axis_name: str, mode: str) -> TrainState:
  """Replicated everywhere, except the optimizer's slices (ZeRO-1 and -3) and the params'
  (ZeRO-3), which are split over the axis."""
  sliced = P(slice_axes(axis_name)[1])

  def split(x):
    return sliced if (mode in SLICED and x.ndim >= 1) else P()

  return TrainState(jax.tree.map(split if mode == "fsdp" else (lambda _: P()),
                                 state_shapes.params),
                    jax.tree.map(split, state_shapes.opt_state),
                    P())


def _check_same_layout(params: Any, layout: Layout) -> None:
  """`assert_same_layout`, except under ``jax.eval_shape(dp.init, ...)``: nothing runs
  there and the processes cannot exchange fingerprints (a restore checks that shape
  against the checkpoint's fingerprint instead)."""
  if outside_jit(jax.tree.leaves(params)):
    assert_same_layout(layout)


def _check_state(state: TrainState, mode: str) -> None:
  """What ``step`` can tell about a state before it traces: a tree where the packed
  modes keep a `Packed` (``fresh._replace(params=tree)`` when restoring; shard_map's own
  error is a pytree-prefix mismatch), and a state already passed to ``step``, which
  donated it: on several CPU devices jax 0.10.2 kills the process (segfault) when a
  deleted buffer is donated again."""
  masters_only = state.params is None and getattr(state.opt_state, "master", None) is not None
  if mode == "fsdp" and not (isinstance(state.params, Shards) or masters_only):
    raise TypeError(
        f"TrainState.params is a {type(state.params).__name__}, but data_parallel("
        "mode='fsdp') keeps this device's slices of the params as jpack.Shards: use "
        "dp.init(params) for a new state, or jpack.checkpoint.restore when restoring.")
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
