"""Real architectures in plain JAX with the leaf structure of the shape tables in
``benchmarks/workloads``, at their real size (`benchmarks.gpu_compile`) or narrowed
(`benchmarks.step`: depth and leaf count stay, widths shrink). A model with state (the
ResNet's BatchNorm statistics) has ``loss(params, state, batch) -> (loss, new_state)``.
"""

import dataclasses
import functools
import math
import operator
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass
class Model:
  name: str
  describe: str
  params: Any                       # numpy tree, or a tree of jax.ShapeDtypeStruct
  loss: Callable[[Any, Any], jax.Array]
  batch: Callable[[int], Any]       # global batch size -> numpy batch
  batch_like: Callable[[int], Any] | None = None  # global batch size -> ShapeDtypeStructs
  state: Any = None  # model state (numpy tree); then loss(params, state, batch) -> (loss, state)

  has_state = property(lambda self: self.state is not None)
  num_leaves = property(lambda self: len(jax.tree.leaves(self.params)))
  num_params = property(lambda self: sum(int(np.prod(np.shape(x)))
                                         for x in jax.tree.leaves(self.params)))


def _nest(flat: dict[str, Any]) -> dict:
  """``{"a/b": x}`` -> ``{"a": {"b": x}}``."""
  out: dict = {}
  for path, x in flat.items():
    *parents, last = path.split("/")
    functools.reduce(lambda d, p: d.setdefault(p, {}), parents, out)[last] = x
  return out


def _make(shapes: dict[str, tuple[tuple[int, ...], Any, str]], seed: int, abstract: bool):
  """Params from ``{path: (shape, dtype, init)}``; init is "normal", "ones" or "zeros"."""
  rng = np.random.default_rng(seed)
  flat = {}
  for path, (shape, dtype, init) in shapes.items():
    if abstract:
      flat[path] = jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
    elif init == "normal":
      # conv kernels (HWIO): H * W * I; matrices: their rows
      fan_in = math.prod(shape[:3]) if len(shape) == 4 else shape[max(0, len(shape) - 2)]
      flat[path] = (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(dtype)
    else:
      flat[path] = (np.ones if init == "ones" else np.zeros)(shape, dtype)
  return _nest(flat)


def _data(like: Callable[[int], Any], seed: int, high: int = 0):
  """``(batch, like)``: ``batch(n)`` draws ``like(n)``'s arrays in order, floats normal
  and integers in [0, high), from a stream other than the params' (``seed`` + 1)."""
  def batch(n):
    r = np.random.default_rng(seed + 1)
    return jax.tree.map(lambda s: r.integers(0, high, s.shape, dtype=s.dtype)
                        if jnp.issubdtype(s.dtype, jnp.integer)
                        else r.standard_normal(s.shape).astype(s.dtype), like(n))

  return batch, like


def _tokens(vocab: int, seq: int, seed: int):
  """Rows of ``seq`` + 1 tokens: the inputs and, shifted by one, the targets."""
  return _data(lambda n: jax.ShapeDtypeStruct((n, seq + 1), jnp.int32), seed, vocab)


def _layer_norm(x, g, b, eps=1e-5):
  mean = jnp.mean(x, -1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + eps) * g + b


def _rms_norm(x, g, eps=1e-6):
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), -1, keepdims=True) + eps) * g)


def _attention(q, k, v, heads: int, causal: bool):
  b, t, d = q.shape
  split = lambda x: x.reshape(b, t, heads, d // heads)
  logits = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k)) / np.sqrt(d // heads)
  if causal:
    logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e9)
  weights = jax.nn.softmax(logits.astype(jnp.float32), -1).astype(v.dtype)
  return jnp.einsum("bhqk,bkhd->bqhd", weights, split(v)).reshape(b, t, d)


def _cross_entropy(logits, targets):
  logits = logits.astype(jnp.float32)
  return jnp.mean(jax.nn.logsumexp(logits, -1)
                  - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0])


def _linear(p: str, a: int, b: int, w: str = "w", bias: str = "b") -> dict:
  """A dense layer's f32 params under ``p``: ``w`` (a, b) normal, ``bias`` (b,) zeros."""
  return {f"{p}/{w}": ((a, b), np.float32, "normal"), f"{p}/{bias}": ((b,), np.float32, "zeros")}


def _norm(p: str, n: int, g: str = "g", b: str = "b") -> dict:
  """A norm's f32 params under ``p``: scale ``g`` ones, shift ``b`` zeros."""
  return {f"{p}/{g}": ((n,), np.float32, "ones"), f"{p}/{b}": ((n,), np.float32, "zeros")}


def _pre_ln_shapes(p: str, width: int, names: tuple[str, str, str, str]) -> dict:
  """A pre-LN block's params (GPT-2's and ViT's) under ``p``, its dense layers ``names``."""
  qkv, proj, fc_in, fc_out = names
  return {**_norm(p + "ln_1", width), **_linear(p + f"attn/{qkv}", width, 3 * width),
          **_linear(p + f"attn/{proj}", width, width), **_norm(p + "ln_2", width),
          **_linear(p + f"mlp/{fc_in}", width, 4 * width),
          **_linear(p + f"mlp/{fc_out}", 4 * width, width)}


def _pre_ln_block(blk: dict, h: Any, names: tuple[str, str, str, str], heads: int,
                  causal: bool) -> Any:
  """``h`` through a pre-LN block of `_pre_ln_shapes`' params."""
  qkv, proj, fc_in, fc_out = names
  a = _layer_norm(h, blk["ln_1"]["g"], blk["ln_1"]["b"])
  q, k, v = jnp.split(a @ blk["attn"][qkv]["w"] + blk["attn"][qkv]["b"], 3, -1)
  h = h + _attention(q, k, v, heads, causal) @ blk["attn"][proj]["w"] + blk["attn"][proj]["b"]
  m = _layer_norm(h, blk["ln_2"]["g"], blk["ln_2"]["b"])
  m = jax.nn.gelu(m @ blk["mlp"][fc_in]["w"] + blk["mlp"][fc_in]["b"])
  return h + m @ blk["mlp"][fc_out]["w"] + blk["mlp"][fc_out]["b"]


GPT2_NAMES = ("c_attn", "c_proj", "c_fc", "c_proj")
VIT_NAMES = ("qkv", "proj", "fc1", "fc2")


def gpt2(layers: int = 12, width: int = 768, vocab: int = 50257, positions: int = 1024,
         heads: int = 12, seq: int = 128, seed: int = 0, abstract: bool = False,
         name: str = "gpt2_small", remat: bool = False) -> Model:
  """GPT-2: pre-LN decoder blocks, learned positions, the output tied to ``wte``; with
  ``remat``, each block under ``jax.checkpoint`` (recomputed in the backward pass)."""
  s: dict = {"wte": ((vocab, width), np.float32, "normal"),
             "wpe": ((positions, width), np.float32, "normal")}
  for i in range(layers):
    s.update(_pre_ln_shapes(f"h{i}/", width, GPT2_NAMES))
  s.update(_norm("ln_f", width))

  def loss(params, tokens):
    x, y = tokens[:, :-1], tokens[:, 1:]
    h = params["wte"][x] + params["wpe"][: x.shape[1]]
    block = jax.checkpoint(_pre_ln_block, static_argnums=(2, 3, 4)) if remat else _pre_ln_block
    for i in range(layers):
      h = block(params[f"h{i}"], h, GPT2_NAMES, heads, True)
    h = _layer_norm(h, params["ln_f"]["g"], params["ln_f"]["b"])
    return _cross_entropy(h @ params["wte"].T, y)

  return Model(name, f"GPT-2 decoder {layers}x{width}", _make(s, seed, abstract), loss,
               *_tokens(vocab, seq, seed))


def bert(layers: int = 12, width: int = 768, vocab: int = 30522, positions: int = 512,
         heads: int = 12, seq: int = 128, seed: int = 0, abstract: bool = False,
         name: str = "bert_base") -> Model:
  """BERT: post-LN encoder blocks; masked-token loss on the tied word embedding, plus a
  classification loss on the pooled first token."""
  f32 = np.float32
  s: dict = {"emb/word": ((vocab, width), f32, "normal"),
             "emb/position": ((positions, width), f32, "normal"),
             "emb/token_type": ((2, width), f32, "normal"),
             **_norm("emb/ln", width)}
  for i in range(layers):
    p = f"layer{i}/"
    for n in ("q", "k", "v", "attn_out"):
      s.update(_linear(p + n, width, width))
    s.update({**_norm(p + "ln1", width), **_linear(p + "ffn_in", width, 4 * width),
              **_linear(p + "ffn_out", 4 * width, width), **_norm(p + "ln2", width)})
  s.update(_linear("pooler", width, width))

  def loss(params, tokens):
    x, y = tokens[:, :-1], tokens[:, 1:]  # predict a shifted copy: a stand-in for masking
    e = params["emb"]
    h = e["word"][x] + e["position"][: x.shape[1]] + e["token_type"][0]
    h = _layer_norm(h, e["ln"]["g"], e["ln"]["b"])
    for i in range(layers):
      blk = params[f"layer{i}"]
      lin = lambda n, a: a @ blk[n]["w"] + blk[n]["b"]
      a = _attention(lin("q", h), lin("k", h), lin("v", h), heads, False)
      h = _layer_norm(h + lin("attn_out", a), blk["ln1"]["g"], blk["ln1"]["b"])
      m = jax.nn.gelu(lin("ffn_in", h))
      h = _layer_norm(h + lin("ffn_out", m), blk["ln2"]["g"], blk["ln2"]["b"])
    pooled = jnp.tanh(h[:, 0] @ params["pooler"]["w"] + params["pooler"]["b"])
    return _cross_entropy(h @ e["word"].T, y) + jnp.mean(jnp.square(pooled))

  return Model(name, f"BERT encoder {layers}x{width}", _make(s, seed, abstract), loss,
               *_tokens(vocab, seq, seed))


def llama(layers: int = 8, width: int = 512, hidden: int = 1376, vocab: int = 32000,
          heads: int = 8, seq: int = 128, seed: int = 0, abstract: bool = False,
          name: str = "mixed_llama_tiny") -> Model:
  """A llama-like LM: RMSNorm (float32 scales), SwiGLU, untied head; bf16 weights."""
  bf16, f32 = jnp.bfloat16, np.float32
  s: dict = {"embed": ((vocab, width), bf16, "normal")}
  for i in range(layers):
    p = f"layers/{i}/"
    s.update({p + "attn_norm": ((width,), f32, "ones"),
              **{p + f"attn/{n}": ((width, width), bf16, "normal")
                 for n in ("wq", "wk", "wv", "wo")},
              p + "ffn_norm": ((width,), f32, "ones"),
              p + "ffn/w1": ((width, hidden), bf16, "normal"),
              p + "ffn/w3": ((width, hidden), bf16, "normal"),
              p + "ffn/w2": ((hidden, width), bf16, "normal")})
  s.update({"norm": ((width,), f32, "ones"), "lm_head": ((width, vocab), bf16, "normal")})

  def loss(params, tokens):
    x, y = tokens[:, :-1], tokens[:, 1:]
    h = params["embed"][x]
    for i in range(layers):
      blk = params["layers"][str(i)]
      a = _rms_norm(h, blk["attn_norm"]).astype(bf16)
      at = blk["attn"]
      h = h + _attention(a @ at["wq"], a @ at["wk"], a @ at["wv"], heads, True) @ at["wo"]
      m = _rms_norm(h, blk["ffn_norm"]).astype(bf16)
      f = blk["ffn"]
      h = h + (jax.nn.silu(m @ f["w1"]) * (m @ f["w3"])) @ f["w2"]
    h = _rms_norm(h, params["norm"]).astype(bf16)
    return _cross_entropy(h @ params["lm_head"], y)

  return Model(name, f"llama-like LM {layers}x{width}, bf16 weights",
               _make(s, seed, abstract), loss, *_tokens(vocab, seq, seed))


def vit(layers: int = 12, width: int = 768, patch: int = 16, image: int = 224,
        classes: int = 1000, heads: int = 12, seed: int = 0, abstract: bool = False,
        name: str = "vit_b16") -> Model:
  """A ViT encoder (ViT-B/16 at the defaults): conv patch embedding, class token,
  learned positions, GPT-2's blocks without the causal mask, a head on the class token."""
  f32 = np.float32
  tokens = (image // patch) ** 2 + 1
  s: dict = {"patch_embed/kernel": ((patch, patch, 3, width), f32, "normal"),
             "patch_embed/bias": ((width,), f32, "zeros"),
             "cls_token": ((1, width), f32, "zeros"),
             "pos_embed": ((tokens, width), f32, "normal")}
  for i in range(layers):
    s.update(_pre_ln_shapes(f"block{i}/", width, VIT_NAMES))
  s.update({**_norm("ln_f", width), **_linear("head", width, classes)})

  def loss(params, batch):
    images, labels = batch
    x = jax.lax.conv_general_dilated(images, params["patch_embed"]["kernel"], (patch, patch),
                                     "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    x = (x + params["patch_embed"]["bias"]).reshape(x.shape[0], -1, width)
    cls = jnp.broadcast_to(params["cls_token"], (x.shape[0], 1, width))
    h = jnp.concatenate([cls, x], 1) + params["pos_embed"]
    for i in range(layers):
      h = _pre_ln_block(params[f"block{i}"], h, VIT_NAMES, heads, False)
    h = _layer_norm(h[:, 0], params["ln_f"]["g"], params["ln_f"]["b"])
    return _cross_entropy(h @ params["head"]["w"] + params["head"]["b"], labels)

  return Model(name, f"ViT encoder {layers}x{width}, {patch}x{patch} patches of "
               f"{image}x{image}", _make(s, seed, abstract), loss, *_images(image, classes, seed))


def _images(image: int, classes: int, seed: int):
  return _data(lambda n: (jax.ShapeDtypeStruct((n, image, image, 3), jnp.float32),
                          jax.ShapeDtypeStruct((n,), jnp.int32)), seed, classes)


RESNET50_BLOCKS = (3, 4, 6, 3)
RESNET18_BLOCKS = (2, 2, 2, 2)
BN_MOMENTUM = 0.9  # running statistics: momentum * old + (1 - momentum) * batch's


def resnet(blocks: tuple[int, ...] = RESNET50_BLOCKS, width: int = 64, classes: int = 1000,
           image: int = 64, block: str = "bottleneck", bn_state: bool = False,
           seed: int = 0, abstract: bool = False, name: str = "resnet50") -> Model:
  """A ResNet, BatchNorm over each device's batch: bottleneck blocks (ResNet-50 at the
  defaults) or ``block="basic"`` ones (ResNet-18 with `RESNET18_BLOCKS`); no max-pool.
  With ``bn_state``, running statistics (``mean``, ``var``) are the model's ``state``."""
  if block not in ("bottleneck", "basic"):
    raise ValueError(f"block must be 'bottleneck' or 'basic', got {block!r}")
  f32 = np.float32
  s: dict = {"stem/conv/kernel": ((7, 7, 3, width), f32, "normal"),
             **_norm("stem/bn", width, "scale", "bias")}
  bns = {"stem/bn": width}  # BatchNorm key path -> channels
  cin = width
  for si, n in enumerate(blocks):
    mid = width * 2 ** si
    out = 4 * mid if block == "bottleneck" else mid
    for bi in range(n):
      p = f"stage{si}/block{bi}/"
      convs = (((1, cin, mid), (3, mid, mid), (1, mid, out)) if block == "bottleneck"
               else ((3, cin, mid), (3, mid, out)))
      for j, (k, a, b) in enumerate(convs):
        s[p + f"conv{j}/kernel"] = ((k, k, a, b), f32, "normal")
        s.update(_norm(p + f"bn{j}", b, "scale", "bias"))
        bns[p + f"bn{j}"] = b
      if bi == 0 and (cin != out or si > 0):
        s[p + "proj/kernel"] = ((1, 1, cin, out), f32, "normal")
        s.update(_norm(p + "proj_bn", out, "scale", "bias"))
        bns[p + "proj_bn"] = out
      cin = out
  s.update(_linear("head", cin, classes, "kernel", "bias"))
  stats = {f"{path}/{stat}": ((c,), f32, "zeros" if stat == "mean" else "ones")
           for path, c in bns.items() for stat in ("mean", "var")}
  state = _make(stats, seed, abstract) if bn_state else None

  def conv(x, k, stride=1):  # in the kernel's dtype (bf16 params: bf16 convolutions)
    return jax.lax.conv_general_dilated(x.astype(k.dtype), k, (stride, stride), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))

  def forward(params, running, images):
    """Logits, and the new running statistics when ``running`` is a dict."""
    new: dict = {}

    def bn(x, path):
      mean = jnp.mean(x, (0, 1, 2))
      var = jnp.mean(jnp.square(x - mean), (0, 1, 2))
      if running is not None:
        old = functools.reduce(operator.getitem, path.split("/"), running)
        for stat, batch_stat in (("mean", mean), ("var", var)):
          new[f"{path}/{stat}"] = (BN_MOMENTUM * old[stat]
                                   + (1 - BN_MOMENTUM) * jax.lax.stop_gradient(batch_stat))
      p = functools.reduce(operator.getitem, path.split("/"), params)
      return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]

    h = jax.nn.relu(bn(conv(images, params["stem"]["conv"]["kernel"], 2), "stem/bn"))
    for si, n in enumerate(blocks):
      for bi in range(n):
        p = f"stage{si}/block{bi}"
        blk = params[f"stage{si}"][f"block{bi}"]
        stride = 2 if (bi == 0 and si > 0) else 1
        convs = len([k for k in blk if k.startswith("conv")])
        y = h
        for j in range(convs):
          # The stride: on the 3x3 convolution (the bottleneck's second, the basic's first).
          y = bn(conv(y, blk[f"conv{j}"]["kernel"], stride if j == convs - 2 else 1),
                 f"{p}/bn{j}")
          y = jax.nn.relu(y) if j < convs - 1 else y
        if "proj" in blk:
          h = bn(conv(h, blk["proj"]["kernel"], stride), f"{p}/proj_bn")
        h = jax.nn.relu(h + y)
    logits = jnp.mean(h, (1, 2)) @ params["head"]["kernel"] + params["head"]["bias"]
    return logits, (_nest(new) if running is not None else None)

  def loss_and_stats(params, running, batch):
    logits, new = forward(params, running, batch[0])
    return _cross_entropy(logits, batch[1]), new

  loss = loss_and_stats if bn_state else lambda p, b: loss_and_stats(p, None, b)[0]
  return Model(name, f"ResNet {'-'.join(map(str, blocks))} ({block} blocks), width {width}, "
               f"{image}x{image} images" + (", BatchNorm running stats as model state"
                                             if bn_state else ""), _make(s, seed, abstract),
               loss, *_images(image, classes, seed), state)


def many_small(sizes: list[int], features: int = 16, seed: int = 0, abstract: bool = False,
               name: str = "many_small_4000") -> Model:
  """A mixture of ``len(sizes)`` tiny experts: expert i maps the input through
  ``tanh(x[:, i % features] * p_i)``, and the loss pulls their mean to a target."""
  s = {f"m{i:05d}/p": ((n,), np.float32, "normal") for i, n in enumerate(sizes)}

  def loss(params, batch):
    x, y = batch
    leaves = [params[f"m{i:05d}"]["p"] for i in range(len(sizes))]
    out = sum(jnp.mean(jnp.tanh(x[:, i % features, None] * p[None]), -1)
              for i, p in enumerate(leaves)) / len(leaves)
    return jnp.mean(jnp.square(out - y))

  return Model(name, f"{len(sizes)} tiny experts", _make(s, seed, abstract), loss,
               *_data(lambda n: (jax.ShapeDtypeStruct((n, features), jnp.float32),
                                 jax.ShapeDtypeStruct((n,), jnp.float32)), seed))


def full_size(name: str, *, abstract: bool = True) -> Model:
  """Workload ``name`` at the size of its shape table (``benchmarks/workloads``)."""
  simple = {"gpt2_small": gpt2, "bert_base": bert, "mixed_llama_tiny": llama,
            "resnet50": lambda abstract: resnet(image=224, abstract=abstract)}
  if name in simple:
    return simple[name](abstract=abstract)
  if name in LARGE:  # the ZeRO-3 workload, at half depth, and with each block rematted
    return gpt2(layers=12 if name == "gpt_1p3b_12" else 24, width=2048, vocab=50257,
                positions=1024, heads=16, seq=1024, abstract=abstract, name=name,
                remat=name == "gpt_1p3b_remat")
  if name == "many_small_4000":
    from benchmarks import harness
    doc = harness.load_workload_doc(name)
    return many_small([int(np.prod(l["shape"])) for l in doc["leaves"]], abstract=abstract)
  raise ValueError(f"no model for workload {name!r}")


FULL_SIZE = ("gpt2_small", "bert_base", "resnet50", "mixed_llama_tiny", "many_small_4000")
# Models without a shape table in benchmarks/workloads, compiled for GPUs by name.
LARGE = ("gpt_1p3b", "gpt_1p3b_12", "gpt_1p3b_remat")
