"""TDT loss API and CPU backends against independent oracles.

* ``oracle``: lists every TDT path of a tiny lattice explicitly (a depth-first walk over (symbol, duration)
  arcs, no dynamic program), sums their probabilities in float64 and differentiates with autograd.
* ``one_symbol_per_frame``: with durations (1,) every emission advances one frame, so TDT is a
  frame-synchronous transducer emitting one symbol per frame; computed forward in linear probability space.
* gradcheck of the torch backend; NeMo's omega rule; every validator message.
numba-cuda runs in ``test_tdt_numba_cuda_sim.py``.
"""

from __future__ import annotations

import functools

import pytest
import torch

from asrprec.losses import available_backends, resolve_backend, rnnt_loss, tdt_loss, validate_tdt_inputs

AVAILABLE = {b["name"] for b in available_backends() if b["available"]}
CPU_BACKENDS = [b for b in ("torch", "numba") if b in AVAILABLE]
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
DURATION_SETS = [(0, 1, 2, 3, 4), (0, 1, 2), (1, 2, 4), (1,)]
# The oracle sees the same rounded logits in float64, so what is left is fp32 arithmetic (a few fp32 eps,
# relative) and, for the gradient, its rounding to the logits' dtype: half an ulp of values in [-1, 1],
# at most torch.finfo(dtype).eps / 2 (fp32 arithmetic added on top).
LOSS_RTOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 2e-6, torch.bfloat16: 2e-6}
GRAD_TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: torch.finfo(torch.float16).eps / 2 + 2e-6,
            torch.bfloat16: torch.finfo(torch.bfloat16).eps / 2 + 2e-6}


def tdt_paths(T: int, U: int, durations) -> list[list[tuple[int, int, bool, int]]]:
    """Every complete TDT path as a list of arcs (t, u, is_blank, duration index)."""
    done = []

    def walk(t, u, arcs):
        for j, d in enumerate(durations):
            if u < U and t + d < T:  # token y_{u+1}, any duration, lands before T
                walk(t + d, u + 1, arcs + [(t, u, False, j)])
            if d > 0 and t + d < T:  # blank, lands before T
                walk(t + d, u, arcs + [(t, u, True, j)])
            if d > 0 and t + d == T and u == U:  # the final blank lands exactly on T
                done.append(arcs + [(t, u, True, j)])

    walk(0, 0, [])
    return done


def oracle(x, targets, logit_lens, target_lens, durations, blank=0, sigma=0.0):
    """(costs (B,), gradients (B, T, U+1, V+D)) by enumerating paths, float64. Infeasible: inf, zero gradient."""
    x = x.detach().double().requires_grad_()
    V = x.shape[-1] - len(durations)
    costs = []
    for b in range(x.shape[0]):
        tok = torch.log_softmax(x[b, ..., :V], -1) - sigma
        dur = torch.log_softmax(x[b, ..., V:], -1)
        y = targets[b, : int(target_lens[b])].tolist()
        paths = tdt_paths(int(logit_lens[b]), len(y), durations)
        if not paths:
            costs.append(x.new_tensor(float("inf")))
            continue
        # every arc of every path, tagged with its path: score[p] = Σ its token and duration log-probs
        arcs = [(p, t, u, blank if is_blank else y[u], j) for p, path in enumerate(paths) for t, u, is_blank, j in path]
        p, t, u, k, j = torch.tensor(arcs).T
        scores = torch.zeros(len(paths), dtype=torch.float64).index_add(0, p, tok[t, u, k] + dur[t, u, j])
        costs.append(-torch.logsumexp(scores, 0))
    costs = torch.stack(costs)
    fin = torch.isfinite(costs)
    (grad,) = torch.autograd.grad(costs[fin].sum(), x) if fin.any() else (torch.zeros_like(x),)
    return costs.detach(), grad


def one_symbol_per_frame(x, targets, logit_lens, target_lens, blank=0, sigma=0.0):
    """-log P with durations (1,), as a frame-synchronous transducer in linear probability space.

    Before frame t the alignment sits in row u with probability p[u]; frame t emits either the blank (stay)
    or the next token (u+1), each also advancing the frame; the last frame must emit the blank from row U_b.
    The single duration logit has probability 1 and sigma scales every symbol by exp(-sigma).
    """
    V = x.shape[-1] - 1
    out = []
    for b in range(x.shape[0]):
        Tb, Ub = int(logit_lens[b]), int(target_lens[b])
        prob = torch.softmax(x[b, ..., :V].double(), -1) * torch.exp(torch.tensor(-sigma, dtype=torch.float64))
        p = torch.zeros(Ub + 1, dtype=torch.float64)
        p[0] = 1.0
        for t in range(Tb - 1):
            stay = p * prob[t, : Ub + 1, blank]
            move = p[:Ub] * prob[t, torch.arange(Ub), targets[b, :Ub]]
            p = stay + torch.cat([p.new_zeros(1), move])
        out.append(-torch.log(p[Ub] * prob[Tb - 1, Ub, blank]))
    return torch.stack(out)


def make_batch(durations, B=3, T=4, U=2, V=5, blank=0, seed=0, scale=2.0, lens=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, U + 1, V + len(durations), generator=g, dtype=torch.float64) * scale
    labels = torch.tensor([v for v in range(V) if v != blank])
    tg = labels[torch.randint(0, len(labels), (B, U), generator=g)]
    tl, ul = lens if lens is not None else (torch.tensor([T, T - 1, 1][:B]), torch.tensor([U, 1, 0][:B]))
    tg = torch.where(torch.arange(U)[None] < ul[:, None], tg, -1)  # padding that is not a valid id
    return x, tg, tl, ul


def run(backend, x, tg, tl, ul, **kw):
    xx = x.clone().requires_grad_()
    costs = tdt_loss(xx, tg, tl, ul, backend=backend, reduction="none", **kw)
    costs[torch.isfinite(costs)].sum().backward()
    return costs.detach().double(), xx.grad.double()


def backend_dtypes():
    return [pytest.param(b, d, id=f"{b}-{str(d).replace('torch.', '')}") for b in CPU_BACKENDS for d in DTYPES]


@functools.lru_cache(maxsize=None)
def _oracle_case(durations, sigma, dtype):
    x, tg, tl, ul = make_batch(durations, seed=len(durations))
    x = x.to(dtype)
    return (x, tg, tl, ul), oracle(x, tg, tl, ul, durations, sigma=sigma)


def _assert_matches(cost, grad, ref_cost, ref_grad, dtype):
    assert torch.equal(torch.isinf(cost), torch.isinf(ref_cost))
    fin = torch.isfinite(ref_cost)
    torch.testing.assert_close(cost[fin], ref_cost[fin], rtol=LOSS_RTOL[dtype], atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=GRAD_TOL[dtype])


# ---------------------------------------------------------------- correctness against path enumeration


@pytest.mark.parametrize("backend,dtype", backend_dtypes())
@pytest.mark.parametrize("durations", DURATION_SETS, ids=str)
@pytest.mark.parametrize("sigma", [0.0, 0.05])
def test_backend_matches_enumeration(backend, dtype, durations, sigma):
    (x, tg, tl, ul), (ref_cost, ref_grad) = _oracle_case(durations, sigma, dtype)
    cost, grad = run(backend, x, tg, tl, ul, durations=durations, sigma=sigma)
    assert tdt_loss(x, tg, tl, ul, durations=durations, backend=backend).dtype == (
        torch.float64 if dtype == torch.float64 else torch.float32
    )
    _assert_matches(cost, grad, ref_cost, ref_grad, dtype)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("blank", [0, 4])
@pytest.mark.parametrize("durations", [(0, 1, 2), (1, 2)], ids=str)
def test_empty_targets_and_one_frame(backend, blank, durations):
    """U = 0 everywhere, and T = 1: two tokens can share the only frame only when 0 is a duration."""
    g = torch.Generator().manual_seed(3)
    C = 5 + len(durations)
    cases = [
        (torch.randn(2, 5, 1, C, generator=g), torch.zeros(2, 0, dtype=torch.long), torch.tensor([5, 2]),
         torch.tensor([0, 0])),
        (torch.randn(2, 1, 3, C, generator=g), torch.tensor([[1, 2], [3, 3]]), torch.tensor([1, 1]),
         torch.tensor([2, 0])),
    ]
    for x, tg, tl, ul in cases:
        ref_cost, ref_grad = oracle(x, tg, tl, ul, durations, blank=blank)
        cost, grad = run(backend, x, tg, tl, ul, durations=durations, blank=blank)
        _assert_matches(cost, grad, ref_cost, ref_grad, torch.float32)
    assert torch.isfinite(cost[1]) and bool(torch.isfinite(cost[0])) == (0 in durations)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_infeasible_utterance_is_inf_with_zero_gradient(backend):
    durations = (1, 2, 4)  # no 0: U_b tokens need U_b + 1 frames
    x, tg, tl, ul = make_batch(durations, B=2, T=3, U=3, lens=(torch.tensor([3, 3]), torch.tensor([3, 2])))
    cost, grad = run(backend, x.float(), tg, tl, ul, durations=durations)
    assert cost[0] == float("inf") and torch.isfinite(cost[1])
    assert torch.all(grad[0] == 0) and grad[1].abs().sum() > 0


def test_reference_gradcheck():
    durations = (0, 1, 2)
    x, tg, tl, ul = make_batch(durations, B=3, T=3, U=2, V=4)
    x = x.requires_grad_()
    # fast mode: the analytical Jacobian against finite differences along random directions (the
    # enumeration tests above check every entry of the gradient)
    assert torch.autograd.gradcheck(
        lambda z: tdt_loss(z, tg, tl, ul, durations=durations, sigma=0.05, backend="torch", reduction="none"),
        (x,), eps=1e-6, atol=1e-7, fast_mode=True,
    )


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("sigma", [0.0, 0.05])
def test_one_duration_is_a_one_symbol_per_frame_transducer(backend, sigma):
    x, tg, tl, ul = make_batch((1,), B=3, T=7, U=3, V=6, seed=9,
                               lens=(torch.tensor([7, 5, 2]), torch.tensor([3, 2, 1])))
    xx = x.clone().requires_grad_()
    ref = one_symbol_per_frame(xx, tg, tl, ul, sigma=sigma)
    (ref_grad,) = torch.autograd.grad(ref.sum(), xx)
    cost, grad = run(backend, x, tg, tl, ul, durations=(1,), sigma=sigma)
    torch.testing.assert_close(cost, ref.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-12)
    assert torch.all(grad[..., -1] == 0)  # a lone duration logit has probability 1 whatever its value


# ---------------------------------------------------------------- agreement at a larger size


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_numba_matches_reference_medium(dtype):
    if "numba" not in AVAILABLE:
        pytest.skip("numba missing")
    durations = (0, 1, 2, 3, 4)
    x, tg, tl, ul = make_batch(durations, B=3, T=30, U=12, V=40, seed=7,
                               lens=(torch.tensor([30, 21, 9]), torch.tensor([12, 5, 0])))
    x = x.to(dtype)
    ref_cost, ref_grad = run("torch", x.double(), tg, tl, ul, durations=durations, sigma=0.05)
    cost, grad = run("numba", x, tg, tl, ul, durations=durations, sigma=0.05)
    torch.testing.assert_close(cost, ref_cost, rtol=2e-6, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=GRAD_TOL[dtype])


# ---------------------------------------------------------------- omega (NeMo's sampled RNN-T loss)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_omega_one_is_the_rnnt_loss_of_the_token_logits(backend):
    durations = (0, 1, 2)
    x, tg, tl, ul = make_batch(durations, seed=4)
    x = x.float()
    cost, grad = run(backend, x, tg, tl, ul, durations=durations, sigma=0.05, omega=1.0)
    V = x.shape[-1] - len(durations)
    xr = x[..., :V].clone().requires_grad_()
    ref = rnnt_loss(xr, tg, tl, ul, backend="torch", reduction="none")  # no sigma in the RNN-T branch
    ref.sum().backward()
    torch.testing.assert_close(cost, ref.detach().double(), rtol=2e-6, atol=0)
    torch.testing.assert_close(grad[..., :V], xr.grad.double(), rtol=0, atol=2e-6)
    assert torch.all(grad[..., V:] == 0)


def test_omega_rule_one_draw_per_call():
    """NeMo's GPUTDT.compute_cost_and_score: u ~ U(0, 1) once per call; RNN-T when u < omega, else TDT."""
    durations = (0, 1, 2)
    x, tg, tl, ul = make_batch(durations, seed=5)
    x = x.float()
    tdt = tdt_loss(x, tg, tl, ul, durations=durations, backend="torch", reduction="none")
    rnnt = rnnt_loss(x[..., : x.shape[-1] - 3], tg, tl, ul, backend="torch", reduction="none")
    seen = set()
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        u = float(torch.rand((), generator=torch.Generator().set_state(g.get_state())))
        got = tdt_loss(x, tg, tl, ul, durations=durations, backend="torch", reduction="none", omega=0.4, generator=g)
        expected = rnnt if u < 0.4 else tdt
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        seen.add(u < 0.4)
    assert seen == {True, False}
    # omega = 0 draws nothing: the generator is untouched
    state = g.get_state()
    tdt_loss(x, tg, tl, ul, durations=durations, backend="torch", generator=g)
    assert torch.equal(g.get_state(), state)


# ---------------------------------------------------------------- reductions, padding, dispatch


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_reductions_and_grad_output_scaling(backend):
    durations = (0, 1, 2, 3, 4)
    x, tg, tl, ul = make_batch(durations, seed=6)
    x = x.float()
    ref_cost, ref_grad = oracle(x, tg, tl, ul, durations)
    for reduction, scale in (("sum", 1.0), ("mean", 1.0 / x.shape[0])):
        xx = x.clone().requires_grad_()
        loss = tdt_loss(xx, tg, tl, ul, durations=durations, backend=backend, reduction=reduction)
        assert loss.shape == () and loss.dtype == torch.float32
        torch.testing.assert_close(loss.double(), ref_cost.sum() * scale, rtol=2e-6, atol=0)
        (loss * 3.0).backward()
        torch.testing.assert_close(xx.grad.double(), ref_grad * 3.0 * scale, rtol=0, atol=1e-5)


@pytest.mark.parametrize("backend,dtype", backend_dtypes())
def test_padding_gradient_exactly_zero(backend, dtype):
    durations = (0, 1, 2)
    x, tg, tl, ul = make_batch(durations, B=3, T=6, U=4, V=7, seed=2,
                               lens=(torch.tensor([6, 4, 1]), torch.tensor([4, 2, 0])))
    _, grad = run(backend, x.to(dtype), tg, tl, ul, durations=durations)
    for b in range(3):
        assert torch.all(grad[b, int(tl[b]):] == 0)
        assert torch.all(grad[b, :, int(ul[b]) + 1:] == 0)
        assert grad[b, : int(tl[b]), : int(ul[b]) + 1].abs().sum() > 0


BIG = {torch.float32: 1e4, torch.float16: 65504.0, torch.bfloat16: 1e4}  # entries near each dtype's range


@pytest.mark.parametrize("dtype", list(BIG), ids=str)
def test_numba_extreme_logits_are_finite(dtype):
    if "numba" not in AVAILABLE:
        pytest.skip("numba missing")
    durations = (0, 1, 2, 3)
    g = torch.Generator().manual_seed(4)
    x = ((torch.randint(0, 3, (2, 5, 4, 6 + 4), generator=g).double() - 1.0) * BIG[dtype]).to(dtype)
    tg = torch.randint(1, 6, (2, 3), generator=g)
    tl, ul = torch.tensor([5, 4]), torch.tensor([3, 2])
    cost, grad = run("numba", x, tg, tl, ul, durations=durations)
    assert torch.isfinite(cost).all() and torch.isfinite(grad).all()
    ref_cost, _ = run("torch", x.double(), tg, tl, ul, durations=durations)
    torch.testing.assert_close(cost, ref_cost, rtol=1e-5, atol=0)


def test_numba_second_backward_refuses():
    if "numba" not in AVAILABLE:
        pytest.skip("numba missing")
    durations = (0, 1, 2)
    x, tg, tl, ul = make_batch(durations)
    x = x.float().requires_grad_()
    loss = tdt_loss(x, tg, tl, ul, durations=durations, backend="numba")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError):
        loss.backward()  # the kept gradient was scaled in place; reuse is detected, not silent


def test_auto_backend_and_refusals():
    assert resolve_backend("auto", "cpu", torch.float32, loss="tdt").name == (
        "numba" if "numba" in AVAILABLE else "torch")
    with pytest.raises(ValueError, match="does not implement the TDT loss"):
        resolve_backend("torchaudio", "cpu", torch.float32, loss="tdt")
    with pytest.raises(ValueError, match="cuda"):
        resolve_backend("numba-cuda", "cpu", torch.float32, loss="tdt")
    with pytest.raises(ValueError, match="unknown TDT loss backend"):
        resolve_backend("warp", "cpu", torch.float32, loss="tdt")
    info = {b["name"]: b for b in available_backends()}
    assert {n for n, b in info.items() if b["tdt"]} >= {"torch", "numba", "numba-cuda"}
    assert not info["torchaudio"]["tdt"]


# ---------------------------------------------------------------- validation


def _good():
    x = torch.randn(2, 4, 3, 5 + 5)  # V = 5 tokens, D = 5 durations
    return x, torch.tensor([[1, 2], [3, 0]]), torch.tensor([4, 3]), torch.tensor([2, 1])


@pytest.mark.parametrize(
    "durations,match",
    [
        ((), "durations is empty"),
        ((0,), "do not contain 1"),
        ((0, 2, 3, 4, 5), "do not contain 1"),
        ((0, 1, 1, 2, 3), "strictly increasing"),
        ((1, 0, 2, 3, 4), "strictly increasing"),
        ((-1, 1, 2, 3, 4), "≥ 0"),
        ((0, 1.0, 2, 3, 4), "must be ints"),
        ((0, True, 2, 3, 4), "must be ints"),
        ("01234", "sequence of ints"),
        (5, "sequence of ints"),
    ],
)
def test_bad_durations(durations, match):
    x, tg, tl, ul = _good()
    with pytest.raises(ValueError, match=match):
        validate_tdt_inputs(x, tg, tl, ul, durations=durations)
    with pytest.raises(ValueError, match=match):
        tdt_loss(x, tg, tl, ul, durations=durations)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda a: (a[0][..., :5], *a[1:]), "last dimension is 5.*V ≥ 1 token logits"),  # duration columns only
        (lambda a: (a[0][..., :3], *a[1:]), "last dimension is 3"),
        (lambda a: (a[0][0], *a[1:]), "shape \\(B, T, U\\+1, V\\+D\\)"),
        (lambda a: (a[0].int(), *a[1:]), "float64, float32"),
        (lambda a: (a[0], torch.tensor([[1, 7], [3, 0]]), *a[2:]), "outside \\[0, V = 5\\)"),  # a duration column
        (lambda a: (a[0], torch.tensor([[1, 0], [3, 0]]), *a[2:]), "blank"),
        (lambda a: (a[0], a[1][:, :1], *a[2:]), "U\\+1"),
        (lambda a: (a[0], a[1], torch.tensor([5, 3]), a[3]), "exceeds T"),
        (lambda a: (a[0], a[1], a[2], torch.tensor([3, 1])), "exceeds U"),
    ],
)
def test_validator_messages(mutate, match):
    args = mutate(_good())
    with pytest.raises(ValueError, match=match):
        validate_tdt_inputs(*args, durations=(0, 1, 2, 3, 4))
    with pytest.raises(ValueError, match=match):
        tdt_loss(*args)


def test_option_errors():
    x, tg, tl, ul = _good()
    with pytest.raises(ValueError, match="blank = 5 is out of range for V = 5"):
        tdt_loss(x, tg, tl, ul, blank=5)
    for sigma in (-0.1, float("nan"), float("inf"), "0.05"):
        with pytest.raises(ValueError, match="sigma"):
            tdt_loss(x, tg, tl, ul, sigma=sigma)
    for omega in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="omega"):
            tdt_loss(x, tg, tl, ul, omega=omega)
    with pytest.raises(ValueError, match="reduction"):
        tdt_loss(x, tg, tl, ul, reduction="mean_volume")
    # padding beyond target_lens may hold anything, a duration column's index included
    tdt_loss(x, torch.tensor([[1, 2], [3, 9]]), tl, ul)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("column", ["token", "duration"])
def test_nan_logits_give_a_nan_cost(backend, column):
    """A NaN logit within an utterance's T_b x (U_b+1) lattice makes its cost NaN (as the RNN-T losses do), not +inf
    (the reading of "no alignment"); a NaN beyond its lengths changes nothing, nor the other utterances' costs."""
    durations = (0, 1, 2)
    x, tg, tl, ul = make_batch(durations, B=3, T=4, U=2, V=5)  # lengths (4, 3, 1) frames, (2, 1, 0) tokens
    clean, _ = run(backend, x.float(), tg, tl, ul, durations=durations)
    assert torch.isfinite(clean).all()
    v = 2 if column == "token" else 5 + 1
    bad = x.float().clone()
    bad[0, 1, 1, v] = float("nan")  # inside utterance 0
    bad[1, 3, 0, v] = float("nan")  # frame 3 of utterance 1, which has 3 frames: padding
    bad[2, 0, 1, v] = float("nan")  # row 1 of utterance 2, which has no token: padding
    cost, _ = run(backend, bad, tg, tl, ul, durations=durations)
    assert torch.isnan(cost[0]) and torch.equal(cost[1:], clean[1:])
    assert torch.isnan(tdt_loss(bad, tg, tl, ul, durations=durations, backend=backend))  # the mean says so too
