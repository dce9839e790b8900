"""The memory-lean joint+loss equals the plain path: joiner on the full grid -> log-softmax -> RNN-T DP.

The plain path's DP here is a naive double loop over (t, u) with torch.logaddexp and autograd, written
in this file and sharing no code with asrprec.losses.
"""

import pytest
import torch
from torch import nn

from asrprec.losses.lean import lean_tile_shape, rnnt_loss_lean

torch.set_num_threads(1)


class TinyJoiner(nn.Module):
    """Stand-in with the interface of asrprec.models.joiner.Joiner (no vocab_size attribute on purpose)."""

    def __init__(self, enc_dim, dec_dim, J, V):
        super().__init__()
        self.encoder_proj = nn.Linear(enc_dim, J)
        self.decoder_proj = nn.Linear(dec_dim, J)
        self.output_linear = nn.Linear(J, V)
        self.calls = []
        self.dtypes = []

    def forward(self, encoder_out, decoder_out, project_input=True):
        if project_input:
            encoder_out = self.encoder_proj(encoder_out)
            decoder_out = self.decoder_proj(decoder_out)
        out = self.output_linear(torch.tanh(encoder_out + decoder_out))
        self.calls.append(out.shape[:-1].numel())
        self.dtypes.append(out.dtype)
        return out


def naive_rnnt_nll(logits, targets, logit_lens, target_lens, blank=0):
    """(B,) -log P by the textbook recursion, one cell at a time, differentiable by autograd."""
    logp = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32).log_softmax(-1)
    out = []
    for b in range(logits.shape[0]):
        Tb, Ub = int(logit_lens[b]), int(target_lens[b])
        alpha = {}
        for t in range(Tb):
            for u in range(Ub + 1):
                terms = []
                if t == 0 and u == 0:
                    terms.append(logp.new_zeros(()))
                if t > 0:
                    terms.append(alpha[t - 1, u] + logp[b, t - 1, u, blank])
                if u > 0:
                    terms.append(alpha[t, u - 1] + logp[b, t, u - 1, int(targets[b, u - 1])])
                alpha[t, u] = terms[0] if len(terms) == 1 else torch.logaddexp(terms[0], terms[1])
        out.append(-(alpha[Tb - 1, Ub] + logp[b, Tb - 1, Ub, blank]))
    return torch.stack(out)


def _reduce(x, reduction):
    return {"none": x, "sum": x.sum(), "mean": x.mean()}[reduction]


def _setup(dtype=torch.float64, B=3, T=5, U=3, J=8, V=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    joiner = TinyJoiner(6, 5, J, V).to(dtype)
    enc = torch.randn(B, T, J, generator=g).to(dtype).requires_grad_()
    dec = torch.randn(B, U + 1, J, generator=g).to(dtype).requires_grad_()
    targets = torch.randint(1, V, (B, U), generator=g)
    logit_lens = torch.tensor([T, T - 2, 1][:B])
    target_lens = torch.tensor([U, 1, 0][:B])
    targets[1, 1:] = -1  # padding must not matter
    return joiner, enc, dec, targets, logit_lens, target_lens


def _grads(loss_fn, joiner, enc, dec, weights=None):
    for t in [enc, dec, *joiner.parameters()]:
        t.grad = None
    loss = loss_fn()
    (loss * weights).sum().backward() if weights is not None else loss.backward()
    return loss.detach(), _collect(joiner, enc, dec)


def _collect(joiner, enc, dec):
    """enc/dec grads, then the grads of the parameters the joint uses (the projections are unused)."""
    for name, p in joiner.named_parameters():
        assert (p.grad is None) == name.startswith(("encoder_proj", "decoder_proj")), name
    return [enc.grad.clone(), dec.grad.clone()] + [p.grad.clone() for p in joiner.output_linear.parameters()]


def _plain(joiner, enc, dec, targets, ll, tl, reduction):
    logits = joiner(enc.unsqueeze(2), dec.unsqueeze(1), project_input=False)
    return _reduce(naive_rnnt_nll(logits, targets.clamp(min=0), ll, tl), reduction)


@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
@pytest.mark.parametrize("tiles", [(None, None), (2, 2), (1, 1)])
def test_lean_equals_plain_float64(reduction, tiles):
    joiner, enc, dec, targets, ll, tl = _setup()
    w = torch.tensor([0.3, -1.2, 2.0], dtype=torch.float64) if reduction == "none" else None
    ref_loss, ref_g = _grads(lambda: _plain(joiner, enc, dec, targets, ll, tl, reduction), joiner, enc, dec, w)
    loss, got_g = _grads(lambda: rnnt_loss_lean(joiner, enc, dec, targets, ll, tl, reduction=reduction,
                                                tile_t=tiles[0], tile_u=tiles[1]), joiner, enc, dec, w)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    for a, b in zip(got_g, ref_g):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_lean_equals_plain_float32():
    joiner, enc, dec, targets, ll, tl = _setup(torch.float32, B=3, T=7, U=4, J=16, V=11, seed=1)
    ref_loss, ref_g = _grads(lambda: _plain(joiner, enc, dec, targets, ll, tl, "sum"), joiner, enc, dec)
    loss, got_g = _grads(lambda: rnnt_loss_lean(joiner, enc, dec, targets, ll, tl, reduction="sum", tile_t=3),
                         joiner, enc, dec)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_g, ref_g):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_lean_clamp_matches_clamped_plain_gradient():
    joiner, enc, dec, targets, ll, tl = _setup(seed=2)
    clamp = 0.05
    for t in [enc, dec, *joiner.parameters()]:
        t.grad = None
    logits = joiner(enc.unsqueeze(2), dec.unsqueeze(1), project_input=False)
    leaf = logits.detach().requires_grad_()
    ref_loss = naive_rnnt_nll(leaf, targets.clamp(min=0), ll, tl)
    (glog,) = torch.autograd.grad(ref_loss.sum(), leaf)  # utterances are independent
    assert glog.abs().max() > clamp  # the clamp is active
    logits.backward(glog.clamp(-clamp, clamp) * 2.0)
    ref_g = _collect(joiner, enc, dec)
    loss, got_g = _grads(lambda: 2.0 * rnnt_loss_lean(joiner, enc, dec, targets, ll, tl, reduction="sum", clamp=clamp,
                                                            tile_t=2),
                         joiner, enc, dec)
    torch.testing.assert_close(loss, 2.0 * ref_loss.detach().sum())
    for a, b in zip(got_g, ref_g):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_lean_under_cpu_autocast_bf16():
    joiner, enc, dec, targets, ll, tl = _setup(torch.float32, B=2, T=6, U=3, J=16, V=9, seed=3)

    def autocast(fn):  # forward under autocast, backward outside it (as a training loop does)
        def run():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn()
        return run

    ref_loss, ref_g = _grads(autocast(lambda: _plain(joiner, enc, dec, targets, ll, tl, "sum")), joiner, enc, dec)
    joiner.dtypes.clear()
    loss, got_g = _grads(autocast(lambda: rnnt_loss_lean(joiner, enc, dec, targets, ll, tl, reduction="sum", tile_t=2)),
                         joiner, enc, dec)
    # every tile, in forward and in the backward recompute, ran in the autocast dtype
    # (one probe call for V: the stand-in has no vocab_size), 3 forward tiles, 3 backward recomputes
    assert len(joiner.dtypes) == 1 + 2 * 3 and set(joiner.dtypes) == {torch.bfloat16}
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=2e-3, atol=2e-3)
    for a, b in zip(got_g, ref_g):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_lean_bf16_cast_joiner():
    joiner, enc, dec, targets, ll, tl = _setup(torch.float32, B=2, T=6, U=3, J=16, V=9, seed=4)
    joiner = joiner.to(torch.bfloat16)
    enc = enc.detach().bfloat16().requires_grad_()
    dec = dec.detach().bfloat16().requires_grad_()
    ref_loss, ref_g = _grads(lambda: _plain(joiner, enc, dec, targets, ll, tl, "sum"), joiner, enc, dec)
    loss, got_g = _grads(lambda: rnnt_loss_lean(joiner, enc, dec, targets, ll, tl, reduction="sum", tile_t=2),
                         joiner, enc, dec)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=1e-3, atol=1e-3)
    for a, b in zip(got_g, ref_g):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2)


def test_lean_never_runs_the_joiner_on_the_whole_grid():
    B, T, U, J, V = 2, 12, 5, 8, 7
    joiner, enc, dec, targets, ll, tl = _setup(torch.float32, B=B, T=T, U=U, J=J, V=V, seed=5)
    joiner.calls.clear()
    rnnt_loss_lean(joiner, enc, dec, targets, ll, tl, tile_t=3, tile_u=4).backward()
    assert max(joiner.calls) <= B * 3 * 4 < B * T * (U + 1)
    assert lean_tile_shape(8, 200, 101, 512, 500) == (2, 101)
    assert lean_tile_shape(32, 200, 201, 512, 1024, tile_elems=2**20) == (1, 21)


def test_lean_frozen_joiner_and_no_grad():
    joiner, enc, dec, targets, ll, tl = _setup(seed=6)
    joiner.requires_grad_(False)
    loss = rnnt_loss_lean(joiner, enc, dec, targets, ll, tl)  # the default reduction: the mean over B
    loss.backward()
    assert enc.grad is not None and all(p.grad is None for p in joiner.parameters())
    with torch.no_grad():
        l2 = rnnt_loss_lean(joiner, enc, dec, targets, ll, tl, reduction="none")
    torch.testing.assert_close(l2.mean(), loss.detach())


def test_lean_bad_inputs():
    joiner, enc, dec, targets, ll, tl = _setup()
    with pytest.raises(ValueError, match="decoder_proj_out"):
        rnnt_loss_lean(joiner, enc, dec[:, :, :3], targets, ll, tl)
    with pytest.raises(ValueError, match="blank"):
        rnnt_loss_lean(joiner, enc, dec, torch.zeros_like(targets), ll, tl)
    with pytest.raises(ValueError, match="logit_lens"):
        rnnt_loss_lean(joiner, enc, dec, targets, ll + 10, tl)


def test_lean_with_the_real_joiner_matches_the_torch_backend():
    """Cross-check with the library's Joiner and the ``torch`` reference backend (a second DP)."""
    from asrprec.models.joiner import Joiner

    from asrprec.losses import reference
    torch.manual_seed(7)
    B, T, U, J, V = 2, 6, 3, 8, 10
    joiner = Joiner(5, 4, J, V).double()
    enc_raw, dec_raw = torch.randn(B, T, 5, dtype=torch.float64), torch.randn(B, U + 1, 4, dtype=torch.float64)
    targets = torch.randint(1, V, (B, U))
    ll, tl = torch.tensor([6, 4]), torch.tensor([3, 2])

    def run(lean):
        joiner.zero_grad(set_to_none=True)
        enc, dec = joiner.encoder_proj(enc_raw), joiner.decoder_proj(dec_raw)  # projections get gradients too
        if lean:
            loss = rnnt_loss_lean(joiner, enc, dec, targets, ll, tl, reduction="sum", tile_t=4)
        else:
            logits = joiner(enc.unsqueeze(2), dec.unsqueeze(1), project_input=False)
            loss = reference.rnnt_loss_torch(logits, targets, ll, tl).sum()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in joiner.parameters()]

    ref_loss, ref_g = run(False)
    loss, got_g = run(True)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    for a, b in zip(got_g, ref_g):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
