"""ZeRO-3 (FSDP): a loss on each device's slices of the parameter buckets.

Each device keeps 1/N of every bucket (`jpack.Shards`). `fsdp` turns a loss of the params
tree into a loss of those slices: every bucket is all-gathered where the loss reads it,
in the params' dtype, and unpacked. Its gradient is the transpose of that gather, a
reduce-scatter, averaged over the devices in float32 (or wider), so the optimizer gets
this device's slice of the mean gradient, as `jpack.optax.sharded` takes it.

By default the gathered buckets are not kept for the backward pass: the loss runs under
`jax.checkpoint`, so the backward pass gathers each bucket again where it needs it
(FSDP's ``reshard_after_forward``). Its policy never saves the gathered buckets or cheap
views of them (slices, reshapes, transposes, casts: a weight read through one would be
saved whole); of the rest it saves what ``remat_policy`` saves, by default the outputs
of matmuls without batch dimensions (JAX's ``dots_with_no_batch_dims_saveable``), and
the rows the loss reads from a table that only its operations before the first matmul
read (a position table), and recomputes the others. Saving every other value instead
(``everything_saveable``) would keep each elementwise intermediate as a buffer of its
own: remat's backward pass reads its saved values through one optimization barrier, so
XLA can no longer fuse them away as it does in plain ``jax.grad``. ``keep_gathered=True``
keeps the gathered buckets instead: one gather per bucket and step, the memory of
ZeRO-1/2.

The gradient leaves the gather in a wider dtype than a bf16 bucket. A custom VJP's
cotangent has its primal's dtype, so the gradient is taken with respect to a zero
"carrier" in the wide dtype: the gather adds nothing from it, and its backward rule
returns the reduce-scattered mean there too (for the slices themselves, in their dtype).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import Literal

from jpack import _cpu as cpu
from jpack._collectives import Shards, axis_size, gather_bucket, mean_over, slice_axes, vary

# The names the checkpoint policy leaves out of the saved residuals, and keeps.
_GATHERED = "jpack_gathered"
_PROLOGUE = "jpack_prologue"
_MATMULS = frozenset({"dot_general", "conv_general_dilated"})


def wide_dtype(dtype: Any) -> np.dtype:
  """The dtype a gradient of ``dtype`` is reduced and kept in: at least float32."""
  d = np.dtype(dtype)
  if jnp.issubdtype(d, jnp.floating) and d.itemsize < 4:
    return np.dtype(np.float32)
  return d


def fsdp(loss_fn: Callable[..., Any], axis_name: Any, *, keep_gathered: bool = False,
         remat_policy: Callable[..., Any] | None = None) -> Callable[..., Any]:
  """``loss_fn(params, *args)`` as a function of this device's `jpack.Shards` of them.

  Use inside `jax.shard_map` over ``axis_name``. The returned ``loss(shards, *args)``
  gathers every bucket where ``loss_fn`` reads it; ``jax.grad`` of it with respect to
  ``shards`` is this device's slice of the gradient averaged over the axis (a
  reduce-scatter per bucket), in the shards' dtype. For the gradient in float32 with
  bf16 params, differentiate `gradient_carrier`'s second argument instead (what
  ``data_parallel(mode="fsdp")`` does).

  Args:
    loss_fn: ``loss_fn(params, *args)``, returning anything ``jax.grad`` takes
      (``has_aux`` pairs too).
    axis_name: the axis the buckets are sliced over, or ``(outer, inner)``: sliced over
      ``inner``, the gradient averaged over both (as `jpack.optax.sharded` takes it).
    keep_gathered: keep the gathered buckets from the forward pass for the backward
      pass (faster, the memory of ZeRO-1) instead of gathering them again.
    remat_policy: a `jax.checkpoint` policy: which of the loss's values the backward
      pass keeps (the gathered buckets never, unless ``keep_gathered``). Default: matmul
      outputs without batch dimensions; with ``keep_gathered``, everything.

  Returns:
    ``loss(shards, *args)``.

  Example::

    loss = jpack.fsdp(loss_fn, "batch")
    grads = jax.grad(loss)(shards, batch)       # Shards: this device's mean gradient
    updates, opt_state = tx.update(grads, opt_state, shards)  # jpack.optax.sharded
    shards = optax.apply_updates(shards, updates)
  """
  carried = gradient_carrier(loss_fn, axis_name, keep_gathered=keep_gathered,
                             remat_policy=remat_policy)

  @functools.wraps(loss_fn)
  def loss(shards, *args):
    _check_shards(shards)
    return carried(shards, carriers_for(shards, axis_name), *args)

  return loss


def gradient_carrier(loss_fn: Callable[..., Any], axis_name: Any, *,
                     keep_gathered: bool = False,
                     remat_policy: Callable[..., Any] | None = None) -> Callable[..., Any]:
  """``loss(shards, carriers, *args)``: `fsdp`'s loss, whose gradient with respect to
  ``carriers`` (a tuple of zero slices, one per bucket, in `wide_dtype`) is this
  device's slice of the mean gradient in that dtype."""

  def loss(shards, carriers, *args):
    return _in_order(loss_fn, shards, carriers, args, axis_name, keep_gathered)

  if not (keep_gathered and remat_policy is None):
    loss = jax.checkpoint(loss, policy=_saveable(remat_policy, keep_gathered))
  replicas = slice_axes(axis_name)[0]
  if not replicas:
    return loss

  def across_replicas(shards, carriers, *args):
    buckets, carriers = _replicated((shards.buckets, tuple(carriers)), replicas)
    return loss(Shards(buckets, shards.layout), carriers, *args)

  return across_replicas


def _in_order(loss_fn: Callable[..., Any], shards: Shards, carriers: tuple[Any, ...],
              args: tuple[Any, ...], axis_name: Any, keep_gathered: bool) -> Any:
  """``loss_fn(params, *args)``, each bucket gathered where the loss first reads it.

  The loss is traced to a jaxpr and evaluated equation by equation. A bucket is gathered
  before the equation that first reads one of its leaves, and its gather is made to
  wait (an optimization barrier) for the equation where an earlier bucket was first
  read (`_waits`): XLA can then overlap it with about one bucket's worth of compute, but
  cannot gather everything at the start (which it does with independent gathers, and
  which holds every parameter for the whole forward pass). Equations that hold their
  own jaxprs (a ``jax.jit``, ``jax.checkpoint`` or ``lax.scan`` of the user's) read
  their buckets whole."""
  layout = shards.layout
  # Stand-ins with the gathered leaves' types (varying over the axis), for tracing only.
  stand_ins = vary([jnp.zeros(s.shape, b.dtype) for s, b in
                    ((s, layout.buckets[s.bucket]) for s in layout.slots)], axis_name)
  closed, out_shape = jax.make_jaxpr(
      lambda leaves, *a: loss_fn(layout.treedef.unflatten(leaves), *a),
      return_shape=True)(stand_ins, *args)
  jaxpr = closed.jaxpr
  leaf_vars = jaxpr.invars[:len(layout.slots)]
  bucket_of = {v: layout.slots[i].bucket for i, v in enumerate(leaf_vars)}
  first = {}  # bucket -> index of the first equation reading it
  for i, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:
      if not isinstance(v, Literal) and v in bucket_of:
        first.setdefault(bucket_of[v], i)
  order = sorted(first, key=first.get)
  after = _waits(jaxpr.eqns, first, order)
  handed = set() if keep_gathered else _prologue(jaxpr, bucket_of)

  env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts))
  env.update(zip(jaxpr.invars[len(layout.slots):], jax.tree.leaves(args)))

  def gather(bs, wait=None):
    """Gather buckets ``bs`` (of one dtype) after ``wait`` (an equation's output
    variable) is computed: the rest of the loss reads ``wait`` through the barrier,
    which keeps it there."""
    # Typed as varying over every data axis, as ``wait`` is: the barrier would make it
    # so anyway, out of the custom VJP's sight (`_gather_bwd` accounts for this one).
    pieces = [vary(shards.buckets[b], axis_name) for b in bs]
    if wait is not None:
      pieces, env[wait] = lax.optimization_barrier((pieces, env[wait]))
    for b, full in zip(bs, _gather_together(pieces, [carriers[b] for b in bs], axis_name)):
      if not keep_gathered:
        full = checkpoint_name(full, _GATHERED)
      for i, piece in _split(full, layout, b):
        leaf = piece.reshape(layout.slots[i].shape)
        env[leaf_vars[i]] = leaf if keep_gathered else checkpoint_name(leaf, _GATHERED)

  if order:
    gather([order[0]])
  for i, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:  # read before its turn (not expected): gathered now
      if not isinstance(v, Literal) and v in bucket_of and v not in env:
        gather([bucket_of[v]])
    params = eqn.primitive.get_bind_params(eqn.params)
    with eqn.ctx.manager:
      out = eqn.primitive.bind(*[v.val if isinstance(v, Literal) else env[v]
                                 for v in eqn.invars], **params)
    out = out if eqn.primitive.multiple_results else [out]
    env.update(zip(eqn.outvars, out))
    for v in handed.intersection(eqn.outvars):
      env[v] = checkpoint_name(env[v], _PROLOGUE)
    for bs in _siblings(after.get(i, ()), shards.buckets, first):
      gather(bs, wait=eqn.outvars[0])
  for v in jaxpr.outvars:  # a leaf returned as it is
    if not isinstance(v, Literal) and v in bucket_of and v not in env:
      gather([bucket_of[v]])
  outs = [v.val if isinstance(v, Literal) else env[v] for v in jaxpr.outvars]
  return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


def _waits(eqns: list[Any], first: dict[int, int], order: list[int]
           ) -> dict[int, list[int]]:
  """Each equation's buckets, gathered once it is computed: every bucket but the first
  read (``order``: the buckets by ``first``, the equation that first reads each) waits
  for the equation that first reads the latest bucket its own first reader depends on,
  else the bucket read before it.

  Matmuls that read the same input (BERT's query, key and value, llama's gate and up
  projections) then have their gathers started together, before the first of them: made
  to wait for each other's matmul, a gather would have nothing to overlap."""
  readers: dict[int, list[int]] = {}  # equation -> the positions in order it reads first
  for k, b in enumerate(order):
    readers.setdefault(first[b], []).append(k)
  after: dict[int, list[int]] = {}
  depends: dict[Any, int] = {}  # variable -> the readers it depends on, a bit per position
  for i, eqn in enumerate(eqns):
    bits = 0
    for v in eqn.invars:
      if not isinstance(v, Literal):
        bits |= depends.get(v, 0)
    firsts = readers.get(i, ())
    for k in firsts:
      if k:
        j = bits.bit_length() - 1 if bits else k - 1
        after.setdefault(first[order[j]], []).append(order[k])
    bits |= sum(1 << k for k in firsts)
    for v in eqn.outvars:
      depends[v] = bits
  return after


def _prologue(jaxpr: Any, bucket_of: dict[Any, int]) -> set[Any]:
  """The values that the loss computes, before its first matmul, from one bucket that
  nothing reads after it (the position table's rows), where they meet values of other
  buckets (the token embeddings). They are saved for the backward pass: recomputed,
  they would need that bucket gathered again where the backward pass starts, with
  nothing yet to overlap that gather."""
  eqns = jaxpr.eqns
  m = next((i for i, e in enumerate(eqns) if _has_matmul(e)), len(eqns))
  later = {bucket_of[v] for e in eqns[m:] for v in e.invars
           if not isinstance(v, Literal) and v in bucket_of}
  later.update(bucket_of[v] for v in jaxpr.outvars
               if not isinstance(v, Literal) and v in bucket_of)
  deps = {v: frozenset([b]) for v, b in bucket_of.items()}  # value -> buckets it reads
  saved = set()
  for i, eqn in enumerate(eqns):
    ins = [v for v in eqn.invars if not isinstance(v, Literal) and v in deps]
    if i >= m:  # read after the first matmul: saved if it reads one early bucket only
      saved.update(v for v in ins if len(deps[v]) == 1 and not deps[v] & later)
      continue
    out = frozenset().union(*(deps[v] for v in ins))
    saved.update(v for v in ins if len(deps[v]) == 1 and not deps[v] & later
                 and deps[v] != out)
    if out:
      deps.update((v, out) for v in eqn.outvars)
  return saved - set(bucket_of)  # not a leaf itself: a leaf is saved where it is read


def _has_matmul(eqn: Any) -> bool:
  """Whether ``eqn`` is a matmul or holds one (a block under the model's checkpoint)."""
  return eqn.primitive.name in _MATMULS or any(
      _has_matmul(e) for inner in _inner_jaxprs(eqn) for e in inner.eqns)


def _inner_jaxprs(eqn: Any) -> Iterator[Any]:
  """The jaxprs ``eqn`` holds (a ``jax.jit``'s, ``jax.checkpoint``'s, custom VJP's...)."""
  for value in eqn.params.values():
    for sub in value if isinstance(value, (tuple, list)) else (value,):
      inner = sub if hasattr(sub, "eqns") else getattr(sub, "jaxpr", None)
      if inner is not None:
        yield getattr(inner, "jaxpr", inner)


def _siblings(bs: list[int], buckets: tuple[Any, ...], first: dict[int, int]
              ) -> list[list[int]]:
  """Buckets ``bs`` (gathered at the same point) in the groups `_gather_together` takes:
  those of one dtype first read by different operations (sibling matmuls) together,
  every other bucket alone. (Buckets that one operation reads, a block under the
  model's own ``jax.checkpoint``, stay apart: gathered together, the copies out of the
  merged buffer would hold a second copy of the block's weights.)"""
  groups: dict[Any, list[int]] = {}
  for b in bs:
    groups.setdefault(buckets[b].dtype, []).append(b)
  out = []
  for group in groups.values():
    if len({first[b] for b in group}) == len(group):
      out.append(group)
    else:
      out.extend([b] for b in group)
  return out


def _gather_together(pieces: list[jax.Array], carriers: list[jax.Array], axis_name: Any
                     ) -> list[jax.Array]:
  """Each full bucket of slices ``pieces`` (one dtype, gathered at the same point).

  More buckets than collectives in flight (`cpu.FSDP_IN_FLIGHT`: BERT's query, key and
  value, which XLA then runs as one matmul) are gathered in one all-gather of their
  concatenation: one at a time, the last would start when the first is done, with
  nothing left to overlap it. Each bucket is then a strided copy of the result."""
  if len(pieces) <= cpu.FSDP_IN_FLIGHT:
    return [_gather(p, c, axis_name) for p, c in zip(pieces, carriers)]
  sizes = [p.shape[0] for p in pieces]
  full = _gather(jnp.concatenate(pieces), jnp.concatenate(carriers), axis_name)
  rows = full.reshape(-1, sum(sizes))  # a row per device: its slice of every bucket
  starts = np.cumsum([0, *sizes])
  return [rows[:, a:b].reshape(-1) for a, b in zip(starts[:-1], starts[1:])]


def _split(full: jax.Array, layout: Any, b: int) -> list[tuple[int, jax.Array]]:
  """``(slot index, 1-D piece)`` of each leaf of bucket ``b``, by one split at the leaves'
  offsets: its transpose is one concatenate (a slice per leaf would transpose to a pad of
  the whole bucket per leaf)."""
  slots = sorted(layout.buckets[b].slots, key=lambda i: layout.slots[i].offset)
  sizes, owners, at = [], [], 0
  for i in slots:
    s = layout.slots[i]
    if s.offset > at:  # padding before this leaf
      sizes.append(s.offset - at)
      owners.append(None)
    sizes.append(s.size)
    owners.append(i)
    at = s.offset + s.size
  if full.shape[0] > at:
    sizes.append(full.shape[0] - at)
    owners.append(None)
  pieces = lax.split(full, sizes) if len(sizes) > 1 else [full]
  return [(i, p) for i, p in zip(owners, pieces) if i is not None]


# Outputs of these are recomputed in the backward pass rather than saved: they are cheap,
# and a weight read through them (``w.T``, a slice of a bucket, a cast) would otherwise be
# saved whole in their output, keeping the gathered buckets' bytes alive.
_VIEWS = frozenset({"reshape", "transpose", "convert_element_type", "broadcast_in_dim",
                    "squeeze", "expand_dims", "slice", "split", "pvary", "copy", "rev",
                    "bitcast_convert_type", "reduce_precision"})


def _saveable(policy: Callable[..., Any] | None, keep_gathered: bool
              ) -> Callable[..., bool]:
  """``policy`` (JAX's ``dots_with_no_batch_dims_saveable`` if None), never saving the
  gathered buckets (`_gather`'s outputs and the names on them) or views of them."""
  policy = policy or jax.checkpoint_policies.dots_with_no_batch_dims_saveable
  if keep_gathered:
    return policy

  def saveable(prim: Any, *args: Any, **params: Any) -> bool:
    if prim.name == "name" and params["name"] in (_GATHERED, _PROLOGUE):
      return params["name"] == _PROLOGUE
    if prim.name == "custom_vjp_call" and _all_gathers(params["call_jaxpr"].jaxpr):
      return False
    return prim.name not in _VIEWS and policy(prim, *args, **params)

  return saveable


def _all_gathers(jaxpr: Any) -> bool:
  """Whether ``jaxpr`` (or one inside it) all-gathers: `_gather`'s custom VJP call."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name.startswith("all_gather") or any(map(_all_gathers,
                                                              _inner_jaxprs(eqn))):
      return True
  return False


def carriers_for(shards: Shards, axis_name: Any) -> tuple[jax.Array, ...]:
  """The zero carriers of ``shards``: one slice per bucket in `wide_dtype`, varying over
  the axis as the gradient that comes back in them does."""
  return vary(tuple(jnp.zeros(b.shape, wide_dtype(b.dtype)) for b in shards.buckets),
              slice_axes(axis_name)[1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gather(bucket: jax.Array, carrier: jax.Array, axis_name: Any) -> jax.Array:
  del carrier
  # Typed as varying: each device holds its own copy, so the loss's cotangent comes back
  # per device (an invariant copy would have it summed over the axis first).
  return vary(gather_bucket(bucket, slice_axes(axis_name)[1]), axis_name)


def _gather_fwd(bucket, carrier, axis_name):
  return _gather(bucket, carrier, axis_name), None


def _gather_bwd(axis_name, residuals, ct):
  del residuals
  wide = wide_dtype(ct.dtype)
  axis = slice_axes(axis_name)[1]  # the replicas average once, later: `_replicated`
  n = axis_size(axis)
  if ct.size == 0:
    return vary(jnp.zeros((0,), ct.dtype), axis_name), vary(jnp.zeros((0,), wide), axis_name)
  # Scaled before the reduce-scatter: the division fuses into the kernel that makes the
  # gradient, not a kernel of its own after the collective.
  mean = lax.psum_scatter(ct.astype(wide) / n, axis, scatter_dimension=0, tiled=True)
  return mean.astype(ct.dtype), mean


_gather.defvjp(_gather_fwd, _gather_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _replicated(slices: Any, replicas: tuple[Any, ...]) -> Any:
  """``slices`` typed as varying over ``replicas``; the backward pass averages their
  gradient over the replicas, every bucket in one reduction at its end. Averaged in each
  bucket's backward instead, the cross-node all-reduces land at the end anyway, and XLA
  keeps more of the recomputed activations alive around them."""
  return vary(slices, replicas)


def _replicated_fwd(slices, replicas):
  return _replicated(slices, replicas), None


def _replicated_bwd(replicas, residuals, cts):
  del residuals
  leaves, tree = jax.tree.flatten(cts)
  wide = mean_over(tuple(x.astype(wide_dtype(x.dtype)) for x in leaves), replicas)
  return (tree.unflatten([w.astype(x.dtype) for w, x in zip(wide, leaves)]),)


_replicated.defvjp(_replicated_fwd, _replicated_bwd)


def _check_shards(shards: Any) -> None:
  if not isinstance(shards, Shards):
    raise TypeError(f"jpack.fsdp's loss takes this device's jpack.Shards of the params "
                    f"(jpack.shard(jpack.pack(params, layout), axis)), got "
                    f"{type(shards).__name__}.")
