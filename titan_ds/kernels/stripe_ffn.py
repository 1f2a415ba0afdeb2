"""StripeFFN: a transformer MLP computed in stripes of tokens, recomputing its hidden activation in backward.

For tokens x (N, d) flattened from (..., d), an MLP ``y = out(hidden(x))`` whose ``hidden`` is ``act(fc(x))``
(GPT, GPT-2) or ``act(gate(x)) * up(x)`` (Llama) and whose ``out`` is a linear map, is computed as:

Forward (no autograd graph is kept):
1. for each stripe s of ``stripe`` rows:  h_s = hidden(x_s) (stripe x 4d, transient);  y_s = h_s W_out^T + b_out.
2. save x and W_out only: the (N, 4d) hidden tensor never exists for the whole sequence.

Backward, for each stripe s:
3. recompute h_s = hidden(x_s) with a local autograd graph (x_s a fresh leaf);
4. dW_out += dy_s^T h_s;  db_out += colsum dy_s;  dh_s = dy_s W_out;
5. (dx_s, d hidden params) = autograd.grad(h_s, (x_s, params), dh_s), accumulated over stripes.

The output projection is never recomputed (step 4 uses h_s directly), so the extra cost over eager is one
forward of ``hidden`` per stripe. An output projection that is not linear in the usual sense (nn.Linear, HF
Conv1D) -- e.g. TRD's tensor-ring layer -- is recomputed with the hidden part (steps 3-5 on the whole MLP). Children keep the names of the MLP they replace (``fc``/``out``,
``c_fc``/``c_proj``, ``gate_proj``/``up_proj``/``down_proj``), so state-dict keys are unchanged.

``saves="pre_activation"`` (``titan.mlme.stripe_ffn_saves``) trades half of that saving for the recompute's time:
step 2 also saves the input projections' outputs p_s = x_s W_in^T + b_in (the fc output; gate's and up's, gated),
and backward recomputes only the activation a_s = act(p_s) (act(g_s) * u_s, gated) from them, then
dW_out += dy_s^T a_s;  dp_s = autograd.grad(a_s, p_s, dy_s W_out);  dW_in += dp_s^T x_s;  dx_s = sum dp_s W_in.
No matmul is recomputed. Saved per token: d + 4d (plain GELU MLP; eager keeps d + 8d: fc's output and the GELU's).
Inside a ``recompute_blocks`` block with ``recompute_ffn: "replay"`` it also removes the second recompute of the
input projections (the block's replay already computed them), at the cost of one block's pre-activations alive
during that block's backward. With ``recompute_ffn: "in_backward"`` (the default) the replay computes no MLP at all
(:func:`lazy_replay`): the input is saved and the backward above (steps 3-5) computes the MLP once.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator, Optional, Union

import torch
from torch import Tensor, nn

__all__ = ["StripeFFN", "stripe_ffn", "stripe_ffn_pre", "linear_parts", "budget_stripe", "STRIPE_BUDGET_BYTES",
           "SAVES", "replay_sink", "lazy_replay"]

# ``stripe="budget"``: the largest stripe whose transient hidden activations stay within this many bytes. Every
# stripe size saves the same bytes for backward (the input only); the size bounds only the transient, and fewer
# stripes are never more work (same FLOPs, fewer loop iterations, larger matmuls). Measured on the seed shapes
# (results/mlme_speed.md, fp32, a contended 2-core machine): stripes of 256 / 512 / 1024 / 2048 tokens cost 1.24 /
# 1.11 / 1.02 / 1.04x the eager MLP's forward+backward, and the same 2048-token stripe measured again 1.34x, so
# the spread there is as large as the trend. 16 MiB is the hidden activation of one seed-GPT micro-batch (16 x 128
# tokens, width 4 x 256, fc output + GELU output, fp32): the seed shapes run in one stripe, a large model's MLP in
# stripes of at most 16 MiB.
STRIPE_BUDGET_BYTES = 16 * 2**20
SAVES = ("input", "pre_activation")  # StripeFFN's ``saves``: what backward keeps (module docstring)
_HIDDEN_COPIES = {"plain": 2, "gated": 4}  # hidden-width tensors alive per stripe: fc, act / gate, up, act, product


def budget_stripe(kind: str, hidden_width: int, dtype: torch.dtype, budget: Optional[int] = None) -> int:
    """Tokens per stripe for ``stripe="budget"``: at most ``budget`` (default :data:`STRIPE_BUDGET_BYTES`) bytes of the
    stripe's hidden activations."""
    per_token = _HIDDEN_COPIES[kind] * hidden_width * torch.empty((), dtype=dtype).element_size()
    return max(1, (STRIPE_BUDGET_BYTES if budget is None else budget) // per_token)


def linear_parts(module: nn.Module) -> tuple[Tensor, Optional[Tensor]]:
    """``(W, b)`` with W of shape (out, in) such that ``module(h) == h @ W.T + b``: nn.Linear, or HF Conv1D."""
    if isinstance(module, nn.Linear):
        return module.weight, module.bias
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):  # transformers.pytorch_utils.Conv1D: x @ W + b
        return module.weight.t(), module.bias
    raise TypeError(f"StripeFFN's output projection must be nn.Linear or transformers' Conv1D, got "
                    f"{type(module).__name__}")


class _StripeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w_out: Tensor, b_out: Optional[Tensor], stripe: int,
                hidden: Callable[[Tensor], Tensor], *hparams: Tensor) -> Tensor:
        n = x.shape[0]
        y = None
        for s in range(0, n, stripe):
            h = hidden(x[s:s + stripe])
            ys = h if w_out is None else torch.nn.functional.linear(h, w_out, b_out)
            if y is None:
                y = x.new_empty(n, ys.shape[-1], dtype=ys.dtype)
            y[s:s + stripe] = ys
            del h, ys  # the stripe's hidden activation is dropped here: this is the memory StripeFFN saves
        ctx.save_for_backward(x, w_out)
        ctx.stripe, ctx.hidden, ctx.has_bias = stripe, hidden, b_out is not None
        ctx.hparams = hparams  # parameters (not activations): held by the modules anyway
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w_out = ctx.saved_tensors
        hparams = ctx.hparams
        trainable = [i for i, p in enumerate(hparams) if p.requires_grad]
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        dw_out = None if w_out is None else torch.zeros_like(w_out, dtype=torch.float32)
        dh_params: list[Optional[Tensor]] = [None] * len(hparams)
        for s in range(0, x.shape[0], ctx.stripe):
            dys = dy[s:s + ctx.stripe]
            with torch.enable_grad():
                xs = x[s:s + ctx.stripe].detach().requires_grad_(dx is not None)
                h = ctx.hidden(xs)
            if w_out is None:  # generic out module: hidden() is the whole MLP, recomputed with out
                dh = dys
            else:
                dw_out += (dys.t() @ h.detach()).float()
                dh = dys @ w_out
            inputs = ([xs] if dx is not None else []) + [hparams[i] for i in trainable]
            if not inputs:
                continue
            grads = torch.autograd.grad(h, inputs, dh, allow_unused=True)
            if dx is not None:
                dx[s:s + ctx.stripe] = grads[0]
                grads = grads[1:]
            for i, g in zip(trainable, grads):
                if g is not None:
                    if dh_params[i] is None:
                        dh_params[i] = g
                    else:
                        dh_params[i].add_(g)  # in place: one parameter-sized buffer, not one per stripe
        db_out = dy.sum(0) if ctx.has_bias else None
        return (dx, None if dw_out is None else dw_out.to(w_out.dtype), db_out, None, None, *dh_params)


class _StripeLazyFn(_StripeFn):
    """The replay of a recomputed block (:func:`lazy_replay`): saves what :class:`_StripeFn` saves and returns zeros
    of the output's shape and dtype without computing anything; its backward (``_StripeFn``'s) computes the MLP from
    the saved input. Right only where the output's value is never read in the replay (checked by the caller)."""

    @staticmethod
    def forward(ctx, x: Tensor, w_out: Tensor, b_out: Optional[Tensor], stripe: int,
                hidden: Callable[[Tensor], Tensor], *hparams: Tensor) -> Tensor:
        ctx.save_for_backward(x, w_out)
        ctx.stripe, ctx.hidden, ctx.has_bias = stripe, hidden, b_out is not None
        ctx.hparams = hparams
        dev = x.device.type
        try:
            autocast = torch.is_autocast_enabled(dev)
        except RuntimeError:  # a device type autocast does not know (meta): nothing is autocast there
            autocast = False
        dtype = torch.get_autocast_dtype(dev) if autocast else w_out.dtype
        return x.new_zeros(x.shape[0], tuple(getattr(w_out, "ds_shape", w_out.shape))[0], dtype=dtype)


# The replay of a block that titan.mlme.recompute_blocks recomputes, while titan_ds.inject.recompute runs it with
# recompute_ffn "in_backward": a list that collects the autograd nodes of the StripeFFN outputs left uncomputed.
_REPLAY: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("titan_stripe_replay", default=None)


@contextlib.contextmanager
def lazy_replay() -> Iterator[list]:
    """Inside, a StripeFFN with a linear output projection, called with grad enabled, computes nothing in forward
    (:class:`_StripeLazyFn`: zeros; the MLP is computed once, in its backward) and appends its output's autograd
    node to the yielded list, which the caller must check (:func:`titan_ds.inject.recompute`): the replay is right
    only if no op reads those outputs' values."""
    sink: list = []
    token = _REPLAY.set(sink)
    try:
        yield sink
    finally:
        _REPLAY.reset(token)


def replay_sink() -> Optional[list]:
    """The list of :func:`lazy_replay` when inside one, else None."""
    return _REPLAY.get()


class _StripePreFn(torch.autograd.Function):
    """``saves="pre_activation"``: the input projections' outputs are saved, only the activation is recomputed."""

    @staticmethod
    def forward(ctx, x: Tensor, w_out: Tensor, b_out: Optional[Tensor], stripe: int,
                combine: Callable[..., Tensor], n_in: int, *wb: Optional[Tensor]) -> Tensor:
        ws, bs = wb[:n_in], wb[n_in:]
        n = x.shape[0]
        y, saved = None, [None] * n_in
        for s in range(0, n, stripe):
            pres = [torch.nn.functional.linear(x[s:s + stripe], w, b) for w, b in zip(ws, bs)]
            for i, pre in enumerate(pres):
                if saved[i] is None:
                    saved[i] = pre.new_empty(n, pre.shape[-1])
                saved[i][s:s + stripe] = pre
            ys = torch.nn.functional.linear(combine(*pres), w_out, b_out)
            if y is None:
                y = x.new_empty(n, ys.shape[-1], dtype=ys.dtype)
            y[s:s + stripe] = ys
            del pres, ys  # the activation (and, gated, the product) is dropped: recomputed in backward
        ctx.save_for_backward(x, w_out, *saved)
        ctx.stripe, ctx.combine, ctx.n_in, ctx.has_bias = stripe, combine, n_in, b_out is not None
        ctx.ws, ctx.bs = ws, bs  # parameters (not activations): held by the modules anyway
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w_out, *saved = ctx.saved_tensors
        n_in, need = ctx.n_in, ctx.needs_input_grad
        f32 = lambda t: torch.zeros_like(t, dtype=torch.float32)  # noqa: E731  (fp32 sums over stripes)
        dx = torch.empty_like(x) if need[0] else None
        dw_out = f32(w_out) if need[1] else None
        dws = [f32(w) if need[6 + i] else None for i, w in enumerate(ctx.ws)]
        dbs = [torch.zeros(saved[i].shape[-1], dtype=torch.float32, device=x.device)
               if ctx.bs[i] is not None and need[6 + n_in + i] else None for i in range(n_in)]
        for s in range(0, x.shape[0], ctx.stripe):
            dys, xs = dy[s:s + ctx.stripe], x[s:s + ctx.stripe]
            with torch.enable_grad():
                leaves = [p[s:s + ctx.stripe].detach().requires_grad_() for p in saved]
                a = ctx.combine(*leaves)
            if dw_out is not None:
                dw_out += (dys.t() @ a.detach()).float()
            dpres = torch.autograd.grad(a, leaves, dys @ w_out)
            for i, dp in enumerate(dpres):
                if dws[i] is not None:
                    dws[i] += (dp.t() @ xs).float()
                if dbs[i] is not None:
                    dbs[i] += dp.sum(0).float()
                if dx is not None:
                    if i == 0:
                        dx[s:s + ctx.stripe] = dp @ ctx.ws[0]
                    else:
                        dx[s:s + ctx.stripe] += dp @ ctx.ws[i]
        db_out = dy.sum(0) if ctx.has_bias and need[2] else None
        cast = lambda g, like: None if g is None else g.to(like.dtype)  # noqa: E731
        return (dx, cast(dw_out, w_out), db_out, None, None, None, *[cast(g, w) for g, w in zip(dws, ctx.ws)],
                *[cast(g, b) for g, b in zip(dbs, ctx.bs)])


def stripe_ffn(x: Tensor, hidden: Callable[[Tensor], Tensor], hidden_params: list[Tensor],
               w_out: Optional[Tensor], b_out: Optional[Tensor], stripe: int) -> Tensor:
    """``hidden(x) @ w_out.T + b_out`` in stripes of ``stripe`` tokens over the leading dims of ``x``.

    With ``w_out=None``, ``hidden`` is the whole map (output projection included, e.g. a tensor-ring layer)
    and is recomputed whole in backward; ``hidden_params`` must then hold every parameter it uses.
    Inside :func:`lazy_replay` (grad enabled, ``w_out`` given) forward computes nothing: see there.
    """
    if stripe < 1:
        raise ValueError(f"stripe must be >= 1 tokens, got {stripe}")
    lead = x.shape[:-1]
    sink = replay_sink() if w_out is not None and torch.is_grad_enabled() else None
    if sink is not None and not any(t is not None and t.requires_grad for t in (x, w_out, b_out, *hidden_params)):
        sink = None  # no graph to carry the computation into backward: compute it now
    fn = _StripeFn if sink is None else _StripeLazyFn
    y = fn.apply(x.reshape(-1, x.shape[-1]), w_out, b_out, stripe, hidden, *hidden_params)
    if sink is not None:
        sink.append(y.grad_fn)
    return y.reshape(*lead, y.shape[-1])


def stripe_ffn_pre(x: Tensor, in_parts: list[tuple[Tensor, Optional[Tensor]]], combine: Callable[..., Tensor],
                   w_out: Tensor, b_out: Optional[Tensor], stripe: int) -> Tensor:
    """``combine(*[x @ W_i.T + b_i]) @ w_out.T + b_out`` in stripes, saving the input projections' outputs for
    backward (``saves="pre_activation"``): backward recomputes ``combine`` (the activation) but no matmul."""
    if stripe < 1:
        raise ValueError(f"stripe must be >= 1 tokens, got {stripe}")
    lead = x.shape[:-1]
    ws, bs = [w for w, _ in in_parts], [b for _, b in in_parts]
    y = _StripePreFn.apply(x.reshape(-1, x.shape[-1]), w_out, b_out, stripe, combine, len(in_parts), *ws, *bs)
    return y.reshape(*lead, y.shape[-1])


class StripeFFN(nn.Module):
    """An MLP computed by :func:`stripe_ffn`, holding the replaced MLP's submodules under their original names.

    Build with :meth:`plain` (``out(act(fc(x)))``) or :meth:`gated` (``down(act(gate(x)) * up(x))``).
    ``dropout`` (a child name, optional) is applied to the output, outside the recomputed region. ``stripe``: tokens
    per stripe, or ``"budget"`` (:func:`budget_stripe` of the activations' dtype, decided at each call).
    ``saves``: what backward keeps, ``"input"`` (x only; the hidden part is recomputed, one extra matmul per input
    projection) or ``"pre_activation"`` (x and the input projections' outputs; only the activation is recomputed).
    ``pre_activation`` needs linear input and output projections and a parameter-free activation; a module without
    them keeps ``"input"`` (:attr:`saves_used` says which it uses).
    """

    def __init__(self, children: dict[str, nn.Module], kind: str, roles: dict[str, str], stripe: Union[int, str],
                 dropout: Optional[str] = None, saves: str = "input"):
        super().__init__()
        if kind not in ("plain", "gated"):
            raise ValueError(f"unknown StripeFFN kind {kind!r}; choose one of ['gated', 'plain']")
        if stripe != "budget" and not (isinstance(stripe, int) and stripe >= 1):
            raise ValueError(f"stripe must be >= 1 tokens or 'budget', got {stripe!r}")
        for name, child in children.items():
            self.add_module(name, child)
        if saves not in SAVES:
            raise ValueError(f"unknown StripeFFN saves {saves!r}; choose one of {list(SAVES)}")
        self.kind, self.roles, self.stripe, self.dropout_name = kind, dict(roles), stripe, dropout
        try:
            linear_parts(self._role("out"))
            self.out_is_linear = True
        except TypeError:  # e.g. a tensor-ring layer from TRD: recompute it with the hidden part
            self.out_is_linear = False
        self.saves = saves

    @classmethod
    def plain(cls, fc: nn.Module, act: Callable[[Tensor], Tensor], out: nn.Module, stripe: Union[int, str],
              names: tuple[str, str, str] = ("fc", "act", "out"), dropout: Optional[tuple[str, nn.Module]] = None,
              saves: str = "input") -> "StripeFFN":
        children = {names[0]: fc, names[2]: out}
        if isinstance(act, nn.Module):
            children[names[1]] = act
        ffn = cls._build(children, "plain", {"fc": names[0], "act": names[1], "out": names[2]}, stripe, dropout,
                         saves)
        if not isinstance(act, nn.Module):
            ffn._act_fn = act  # a plain function (F.gelu): no state, nothing for the state dict
        return ffn

    @classmethod
    def gated(cls, gate: nn.Module, up: nn.Module, down: nn.Module, act: nn.Module, stripe: Union[int, str],
              names: tuple[str, str, str, str] = ("gate_proj", "up_proj", "down_proj", "act_fn"),
              saves: str = "input") -> "StripeFFN":
        children = {names[0]: gate, names[1]: up, names[2]: down, names[3]: act}
        return cls._build(children, "gated", {"gate": names[0], "up": names[1], "out": names[2], "act": names[3]},
                          stripe, None, saves)

    @classmethod
    def _build(cls, children, kind, roles, stripe, dropout, saves) -> "StripeFFN":
        drop_name = None
        if dropout is not None:
            drop_name, drop_mod = dropout
            children = {**children, drop_name: drop_mod}
        return cls(children, kind, roles, stripe, drop_name, saves)

    def _role(self, role: str):
        name = self.roles[role]
        if role == "act" and name not in self._modules:
            return self._act_fn
        return getattr(self, name)

    def hidden(self, x: Tensor) -> Tensor:
        """The activation that is recomputed: ``act(fc(x))`` or ``act(gate(x)) * up(x)``."""
        return self._combine(*[self._role(r)(x) for r in self._in_roles()])

    @property
    def saves_used(self) -> str:
        """What backward keeps: :attr:`saves`, or ``"input"`` where ``"pre_activation"`` cannot apply."""
        return "pre_activation" if self.saves == "pre_activation" and self._pre_parts() is not None else "input"

    def _in_roles(self) -> tuple[str, ...]:
        return ("fc",) if self.kind == "plain" else ("gate", "up")

    def _pre_parts(self) -> Optional[list[tuple[Tensor, Optional[Tensor]]]]:
        """``[(W, b)]`` of the input projections when ``pre_activation`` applies (linear in and out projections,
        an activation without parameters), else None."""
        act = self._role("act")
        if not self.out_is_linear or (isinstance(act, nn.Module) and next(act.parameters(), None) is not None):
            return None
        try:
            return [linear_parts(self._role(r)) for r in self._in_roles()]
        except TypeError:
            return None

    def _combine(self, *pres: Tensor) -> Tensor:
        """The activation of the input projections' outputs: ``act(h)`` or ``act(g) * u``."""
        return self._role("act")(pres[0]) if self.kind == "plain" else self._role("act")(pres[0]) * pres[1]

    def _hidden_params(self) -> list[Tensor]:
        out_name = self.roles["out"]
        return [p for name, p in self.named_parameters() if not name.startswith(out_name + ".")]

    def _whole(self, x: Tensor) -> Tensor:
        return self._role("out")(self.hidden(x))

    def stripe_for(self, dtype: torch.dtype) -> int:
        """Tokens per stripe for activations of ``dtype`` (``stripe="budget"``: :func:`budget_stripe`)."""
        if self.stripe != "budget":
            return self.stripe
        out = self._role("out")
        # the hidden width: the output projection's input features (nn.Linear and TRD's layer: in_features; HF
        # Conv1D: nx), read from the module, not from a weight that ZeRO-3 may have partitioned to size 0
        hidden = getattr(out, "in_features", None) or getattr(out, "nx", None)
        if hidden is None:
            raise TypeError(f"stripe_ffn \"budget\" needs the output projection's input width; "
                            f"{type(out).__name__} has neither in_features nor nx: give stripe_ffn in tokens")
        return budget_stripe(self.kind, int(hidden), dtype)

    def forward(self, x: Tensor) -> Tensor:
        stripe = self.stripe_for(x.dtype)
        pre = self._pre_parts() if self.saves == "pre_activation" and torch.is_grad_enabled() else None
        if pre is not None and replay_sink() is not None and self.out_is_linear:
            pre = None  # a lazy replay computes the MLP once, in backward: cheaper than saving pre-activations
        if pre is not None:
            w_out, b_out = linear_parts(self._role("out"))
            y = stripe_ffn_pre(x, pre, self._combine, w_out, b_out, stripe)
        elif self.out_is_linear:
            w_out, b_out = linear_parts(self._role("out"))
            y = stripe_ffn(x, self.hidden, self._hidden_params(), w_out, b_out, stripe)
        else:
            y = stripe_ffn(x, self._whole, list(self.parameters()), None, None, stripe)
        if self.dropout_name is not None:
            y = getattr(self, self.dropout_name)(y)
        return y

    def extra_repr(self) -> str:
        return f"kind={self.kind}, stripe={self.stripe}, saves={self.saves_used}"
