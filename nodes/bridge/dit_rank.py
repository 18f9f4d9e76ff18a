"""The rank side of sequence-, CFG- and batch-parallel sampling, through ComfyUI 0.3.64's own extension points.

Runs in the rank processes (imported by :mod:`.ksampler_rank` after ComfyUI is importable). Nothing in ComfyUI is
edited or replaced process-wide; everything is installed on the rank's model for one sampling run and removed after.

* **Sequence (DiT)** — a DIFFUSION_MODEL wrapper (around ``Flux._forward``, ``WanModel._forward``, ...) sets the
  token grid of the call (and, for joint-attention rows, the text tokens every rank gets a slice of: cut where the
  row's ``text_tokens`` site makes the text stream, the RoPE cut to the rank's text slice and image band, the
  attentions exchanging text and image K/V as one sharded set; the text stream is dropped by the model before the
  gather site, so only image tokens are gathered); the row of :mod:`.families` says where to cut the image tokens to this rank's band
  (library styles ``ShardTokens``/``GatherTokens`` on the named modules, a pre-hook where the tokens first exist as a
  block's input), where to cut the RoPE table, and where to put the tokens back in order. Every attention call goes
  through ``transformer_options["optimized_attention_override"]`` (ComfyUI calls it around each attention of each
  model) into the library's :class:`SequenceAttention`; which calls are self/joint and which are cross is known from
  the module the call happens in (forward pre/post hooks on the row's attention classes push and pop the kind).
* **CFG** — a CALC_COND_BATCH wrapper gives each CFG group its share of the conditionings (cond on one group,
  uncond on the other), runs ComfyUI's own batching on it, and exchanges the outputs with the peer group: one
  all-gather per step. With one live conditioning (cfg = 1) every group evaluates it (no exchange).
* **Batch** — a DIFFUSION_MODEL wrapper splits the rows of each model call across the ranks and all-gathers the
  outputs. Every rank runs the sampler on the whole batch, so noise (initial, ancestral, SDE) is the stock
  KSampler's exactly, whatever the sampler.

All branches depend on what every rank shares (shapes, the layout, the conditionings), so every rank makes the same
collective calls.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, List, Optional

import torch

__all__ = ["SEQ_KEY", "CFG_KEY", "BATCH_KEY", "make_groups", "sequence_parallel", "cfg_parallel", "batch_parallel", "agree_min"]

SEQ_KEY = "patchray.sequence_parallel"
CFG_KEY = "patchray.cfg_parallel"
BATCH_KEY = "patchray.batch_parallel"


def _comm():
    from ...distributed import comm

    return comm


def _seq():
    from ...distributed.parallel import sequence

    return sequence


# --------------------------------------------------------------------------------------------------- groups


def make_groups(ctx, cfg_groups: int, seq_ranks: int):
    """This rank's :class:`~patchray.distributed.sampling.split.GroupLayout` for ``cfg_groups`` x ``seq_ranks``:
    ``inner`` (its CFG group's sequence ranks), ``across`` (the peers holding the same position in every CFG group).
    A collective the first time (every rank calls it with the same layout); the library's ``RankGroups`` is kept in
    the rank cache for the cluster's lifetime, so later runs make no new groups."""
    from ...distributed.cluster import rank_cache
    from ...distributed.sampling.split import RankGroups

    if cfg_groups * seq_ranks != ctx.world_size:
        raise ValueError(f"layout {cfg_groups} x {seq_ranks} does not match the {ctx.world_size} ranks")
    cache = rank_cache().setdefault("patchray.dit.groups", {})
    key = (cfg_groups, ctx.world_size, ctx.global_ranks)
    if key not in cache:
        cache[key] = RankGroups(ctx, cfg_groups)
    return cache[key].layout


def agree_min(ctx, value: float) -> float:
    """The minimum of ``value`` over ``ctx``'s ranks (one tiny all-gather)."""
    comm = _comm()
    if ctx.world_size == 1:
        return float(value)
    t = torch.tensor([[float(value)]], dtype=torch.float64, device=ctx.device)
    return float(comm.all_gather_padded(t, ctx, dim=0, sizes=[1] * ctx.world_size).min().item())


class Agree:
    """``agree_min`` bound to a context, for :func:`ksampler_rank.agreed_batching`."""

    def __init__(self, ctx):
        self.ctx = ctx

    def agree_min(self, value: float) -> float:
        return agree_min(self.ctx, value)


# --------------------------------------------------------------------------------------------------- counting


class Counter:
    """Model calls begun and completed through PatchRay's wrappers, written to the run's session (the driver refuses
    a run in which none went through them; a failure after one began marks the group out of step)."""

    def __init__(self, session):
        self.session = session

    @contextlib.contextmanager
    def call(self):
        if self.session is not None:
            self.session.entered += 1
        yield
        if self.session is not None:
            self.session.calls += 1


def _bind(executor, x, args, kwargs) -> inspect.BoundArguments:
    """The model call's arguments by name (the diffusion models' ``_forward`` signatures differ per family)."""
    sig = inspect.signature(executor.original)
    bound = sig.bind(x, *args, **kwargs)
    return bound


# --------------------------------------------------------------------------------------------------- sequence


class _Scopes:
    """Which attention kind the running code is inside (a stack: modules nest)."""

    def __init__(self):
        self.stack: List[tuple] = []

    def hooks(self, dm, attends) -> List[Any]:
        handles = []
        for path, module in dm.named_modules():
            kind = attends.get(_comm().base_class(module).__name__)  # a sharded block's class is FSDP2's subclass
            if kind is None:
                continue

            def pre(mod, args, kind=kind, path=path):
                self.stack.append((kind, path))

            def post(mod, args, out):
                self.stack.pop()

            handles.append(module.register_forward_pre_hook(pre))
            handles.append(module.register_forward_hook(post))
        return handles


class DitSequence:
    """Sequence parallelism for one sampling run of one ComfyUI DiT (a row of :mod:`.families`).

    :meth:`apply` installs the row's token, RoPE and gather sites and the attention scopes on ``dm``; :meth:`remove`
    takes them off (the model is exactly as before). :meth:`wrapper` is the DIFFUSION_MODEL wrapper.
    """

    def __init__(self, ctx, row, dm, *, attention: str = "auto", counter: Optional[Counter] = None, config=None,
                 shard_text: Optional[bool] = None, linear_rows: Optional[Callable] = None):
        from ...distributed.sampling.comm_manager import CommManager, Traffic
        from ...distributed.sampling.config import LayerMode, OutputMode
        from ...distributed.sampling.dit import TokenOtil, dit_exchange

        seq = _seq()
        self.ctx, self.row, self.dm, self.counter = ctx, row, dm, counter
        # how the host's linear layers give rows of their weight (ComfyUI's per-call casts: ``ksampler_rank``); None:
        # torch's own Linear only (``distributed/parallel/seq_modulation.py``)
        self.linear_rows = linear_rows
        # a low-traffic preset (displaced, otil, balanced, compressed): stale/compressed K/V through the stale memory,
        # one logical step per model call of a stream (cond/uncond may come in separate calls), as for the UNet
        self.config = config
        self.stepwise = config is not None and (config.layer_mode is not LayerMode.FULL_SYNC or config.output is not OutputMode.GATHER)
        # joint-attention rows shard their text tokens too (each rank a slice), unless a call must keep them whole. By
        # default (None) in the exact modes only: under a stale preset the remote text K/V would be stale too, which
        # raised the final-latent error by about 4% (1-8%) on tiny FLUX.1 and Qwen-Image (results/cpu-warmup); True
        # shards it there as well (each stream keeps its own shard table and stale memory, so cond and uncond prompts
        # may differ in length)
        self.shard_text = (not self.stepwise) if shard_text is None else bool(shard_text)
        kv = dit_exchange(config, attention) if config is not None else None
        checkpoint = config.comm_checkpoint if config is not None else 60
        memory = (lambda c, rows, t: CommManager(c, rows, t, checkpoint)) if self.stepwise else None
        self.state = seq.SequenceState(ctx, Traffic(), memory=memory)
        if self.stepwise and config.output is OutputMode.OTIL and ctx.world_size > 1:
            self.state.output_exchange = TokenOtil(self.state, config)
        # stale presets: ``attention`` (auto) picks the exact mode of the warm-up steps that do not refill the stale
        # memory (dit_exchange refuses 'ulysses' with them); every other step is gathered
        self.attn = seq.SequenceAttention(self.state, attention, **({"kv": kv} if kv is not None else {}))
        self._steps: dict = {}
        self.scopes = _Scopes()
        self._applied: list = []
        self._handles: list = []

    # ---------------------------------------------------------------- sites

    def apply(self) -> None:
        from ...distributed.parallel.plan import apply_plan
        from .families import sequence_plan, sites_of

        row = self.row
        plan = sequence_plan(row, self.linear_rows)
        for site in sites_of(row):
            try:
                self.dm.get_submodule(site.module)
            except AttributeError:
                raise NotImplementedError(
                    f"PatchRay ({row.family}): this {type(self.dm).__name__} has no module "
                    f"{site.module!r} where the table expects one (a ComfyUI version PatchRay does not know?)"
                ) from None
        try:
            self._applied = apply_plan([("", self.dm)], plan, self.state, strict=False)
            if row.tokens.where == "input":
                self._handles.append(self.dm.get_submodule(row.tokens.module).register_forward_pre_hook(self._shard_input))
            self._handles.extend(self.scopes.hooks(self.dm, row.attends))
            if row.hooks is not None:
                self._handles.extend(row.hooks(self))
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        from ...distributed.parallel.plan import undo_all

        self.state.finish()
        self.state.output_exchange = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        undo_all(self._applied)

    def _shard_input(self, module, args):
        seq = _seq()
        if self.ctx.world_size == 1:
            return None
        i = self.row.tokens.arg
        shards = self.state.require_shards()
        # a joint sequence that reaches the site whole (Lumina 2: the text first): its text is kept on every rank
        extra = args[i].shape[1] - shards.total
        before, after = (extra, 0) if self.row.text.side == "before" else (0, extra)
        cut = seq.shard_tokens(args[i], shards, self.ctx.rank, dim=1, before=before, after=after)
        return tuple(cut if j == i else a for j, a in enumerate(args))

    # ---------------------------------------------------------------- attention

    def override(self, inner: Optional[Callable]):
        """An ``optimized_attention_override``: ComfyUI's attention over every rank's tokens (``inner``: an override
        that was already there, called in place of ComfyUI's function)."""

        def call(func, *args, **kwargs):
            if not self.scopes.stack:
                raise NotImplementedError(
                    f"PatchRay ({self.row.family}): an attention call outside the modules the DiT "
                    f"table names ({sorted(self.row.attends)}); this model variant is not covered by sequence parallelism"
                )
            kind, path = self.scopes.stack[-1]
            q, k, v = args[:3]
            rest = list(args[3:])
            heads = rest.pop(0) if rest else kwargs.pop("heads")
            # optimized_attention_masked(q, k, v, heads, mask, ...) passes the mask positionally (Qwen-Image, LTX)
            mask = rest.pop(0) if rest else kwargs.pop("mask", None)
            if rest:
                raise TypeError(f"{path}: unexpected positional attention arguments {len(rest)}")
            bhld = bool(kwargs.get("skip_reshape", False))
            if not bhld and v.dim() == 4 and q.dim() == 3:
                # SD3's MMDiT passes q and k as [B, L, H * D] and v as [B, L, H, D] (ComfyUI's kernels view all three
                # per head alike): the same tokens, laid out as q
                v = v.reshape(v.shape[0], v.shape[1], -1)
            keep_heads = bool(kwargs.pop("skip_output_reshape", False))
            # an attention kernel the user chose (another node's override, or a ComfyUI attention other than PyTorch's,
            # e.g. --use-sage-attention): auto keeps it rather than overlapping with PyTorch's kernel
            custom = inner is not None or getattr(func, "__name__", "attention_pytorch") != "attention_pytorch"

            def attn_fn(q_, k_, v_, mask_, heads_):
                kw = dict(kwargs, mask=mask_, skip_output_reshape=bhld)  # BHLD in, BHLD out; BLC in, BLC out
                if inner is not None:
                    return inner(func, q_, k_, v_, heads_, **kw)
                return func(q_, k_, v_, heads_, **kw)

            if kind == "cross":
                out = self.attn(q, k, v, attn_fn, layout="BHLD" if bhld else "BLC", heads=heads, cross=True, mask=mask, key=path,
                                custom=custom)
            elif self.state.require_shards().text_sharded:
                if kind == "self":  # backstop: only rows whose attentions are joint have a text site
                    raise ValueError(f"{path}: an image-only self-attention in a model whose text is sharded")
                # the rank's joint sequence: its text slice and image band, nothing replicated
                out = self.attn(q, k, v, attn_fn, layout="BHLD" if bhld else "BLC", heads=heads, mask=mask, key=path,
                                custom=custom)
            else:
                n_me = self.state.require_shards().counts[self.ctx.rank]
                extra = q.shape[2 if bhld else 1] - n_me
                before, after = (extra, 0) if self.row.text.side == "before" else (0, extra)
                if kind == "self" and extra:
                    raise ValueError(f"{path}: self-attention over {q.shape[2 if bhld else 1]} tokens, this rank holds {n_me}")
                out = self.attn(q, k, v, attn_fn, layout="BHLD" if bhld else "BLC", heads=heads, before=before, after=after, mask=mask, key=path,
                                custom=custom)
            if bhld and not keep_heads:
                b, h, l, d = out.shape
                out = out.transpose(1, 2).reshape(b, l, h * d)
            return out

        return call

    # ---------------------------------------------------------------- the wrapper

    def wrapper(self, executor, x, *args, **kwargs):
        from ...distributed.sampling.dit import refills
        from .dit_models import call_refusal, text_tokens, token_grid

        bound = _bind(executor, x, args, kwargs)
        why = call_refusal(self.row, bound.arguments)
        if why:
            raise NotImplementedError(why)
        text = text_tokens(self.row, bound.arguments, self.ctx.world_size) if self.shard_text else 0
        side = self.row.text.side or "before"
        # where the call carries its transformer options: a parameter of its own, or inside ``**kwargs`` (Lumina 2's
        # NextDiT): the override must reach the model either way, or its attentions would run on the band alone
        params = bound.signature.parameters
        holder = bound.arguments
        if "transformer_options" not in params:
            var = next((n for n, p in params.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
            if var is None:
                raise NotImplementedError(f"PatchRay ({self.row.family}): the model call takes no transformer options")
            holder = bound.arguments.setdefault(var, {})
        to = dict(holder.get("transformer_options") or {})
        stream = tuple(to.get("cond_or_uncond", ()))
        if self.stepwise:  # the stream's own stale memory and shard table (its text length may differ)
            self.state.select_stream(stream)
        self.state.begin_call()
        if self.state.modulation is not None:
            # a node that replaces blocks (ComfyUI's "dit" patches) may hand a block another embedding: every
            # modulation layer then runs whole on every rank (the same decision on every rank: the same options)
            self.state.modulation.enabled = not (to.get("patches_replace") or {}).get("dit")
        self.state.set_grid(*token_grid(self.row, self.dm, x.shape), text=text, text_side=side)
        to["optimized_attention_override"] = self.override(to.get("optimized_attention_override"))
        holder["transformer_options"] = to
        with self.counter.call() if self.counter is not None else contextlib.nullcontext():
            if not self.stepwise:
                return executor(*bound.args, **bound.kwargs)
            step = self._steps.get(stream, 0)
            self.state.begin_step(step, self.config.is_sync_step(step), refills(self.config, step))
            try:
                return executor(*bound.args, **bound.kwargs)
            finally:
                self.state.end_step()
                self._steps[stream] = step + 1

    def finalize(self, latent):
        """The exact final latent: each rank's own rows, gathered (with OTIL's output exchange the ranks' copies
        differ outside their bands; otherwise every rank already holds it and this returns it as is)."""
        from ...distributed.sampling.config import OutputMode
        from ...distributed.sampling.dit import finalize_rows

        if not self.stepwise or self.config.output is not OutputMode.OTIL or self.ctx.world_size == 1:
            return latent
        if self.state.shards is None:  # no model call ran (an empty part of a schedule): every rank holds the latent
            return latent
        self.state.finish()
        return finalize_rows(self.state, latent, row_dim=-2)


def sequence_parallel(ctx, row, dm, *, attention: str = "auto", counter: Optional[Counter] = None, config=None,
                      shard_text: Optional[bool] = None, linear_rows: Optional[Callable] = None) -> DitSequence:
    """:class:`DitSequence` applied to ``dm`` (call ``remove()`` when the run ends); ``config``: the node's preset
    (a ``PatchConfig``; full_sync or ``None``: exact); ``shard_text``: joint-attention rows split their text tokens
    over the ranks too (False: whole on every rank; None: in the exact modes only); ``linear_rows``: the weight rows
    of the host's linear layers for the shared modulation (``seq_modulation.RowsFn``)."""
    seq = DitSequence(ctx, row, dm, attention=attention, counter=counter, config=config, shard_text=shard_text,
                      linear_rows=linear_rows)
    seq.apply()
    return seq


# --------------------------------------------------------------------------------------------------- batch


def batch_parallel(ctx, counter: Optional[Counter] = None):
    """A model-call wrapper (the rank installs it around ``BaseModel.apply_model``, which every model class goes
    through; it works around a diffusion model's forward as well): each rank runs its share of the call's rows, the
    outputs are all-gathered (the
    library's ``split.batch_parallel``: every tensor argument whose first dimension is the call's row count — the
    latent, timesteps, text context, pooled vectors, guidance, CLIP features, masks — is cut like the latent; the
    model is per-row independent)."""
    from ...distributed.sampling.split import GroupLayout, batch_parallel as split_batch
    from ...distributed.context import ParallelContext

    layout = GroupLayout(ctx.rank, ctx.world_size, ParallelContext.single(ctx.device), ctx)  # one rank per group

    def wrapper(executor, x, *args, **kwargs):
        bound = _bind(executor, x, args, kwargs)
        with counter.call() if counter is not None else contextlib.nullcontext():
            return split_batch(lambda *a, **k: executor(*a, **k), bound.args[0], layout, *bound.args[1:], **bound.kwargs)

    return wrapper


# --------------------------------------------------------------------------------------------------- CFG


def cfg_parallel(layout):
    """A CALC_COND_BATCH wrapper: this rank's CFG group evaluates its share of the live conditionings (ComfyUI's own
    ``calc_cond_batch`` with the others set to ``None``), and the groups exchange their outputs: the library's
    ``evaluate_split``, one all-gather over ``layout.across`` per call. With one live conditioning (cfg = 1) every
    group evaluates it and nothing is exchanged."""
    from ...distributed.sampling.split import evaluate_split

    def wrapper(executor, model, conds, x_in, *args, **kwargs):
        live = [i for i, c in enumerate(conds) if c is not None]
        if len(live) < 2:
            return executor(model, conds, x_in, *args, **kwargs)
        result = {}

        def evaluate(items):
            if not items:
                return x_in.new_zeros((0, *x_in.shape))
            mine = {live[j] for j in items}
            out = executor(model, [c if i in mine else None for i, c in enumerate(conds)], x_in, *args, **kwargs)
            result["out"] = out
            return torch.stack([out[live[j]] for j in items])

        every = evaluate_split(evaluate, len(live), layout, allow_empty=True)
        out = list(result["out"]) if "out" in result else [torch.zeros_like(x_in) for _ in conds]
        for j, i in enumerate(live):
            out[i] = every[j]
        return out

    return wrapper
