"""torch.compile: both encoders trace without a graph break, and a compiled training run equals an eager one.

Graph breaks are counted by ``torch._dynamo.explain`` (tracing only, no code generation); the training test runs
inductor once, on the smallest model, against the eager run as the independent route.
"""

import copy
import math
import random

import pytest
import torch
import torch._dynamo

from asrprec.models import ScheduledFloat, build_transducer, set_batch_count
from asrprec.models.compile import compile_model, compiled_regions, prepare_for_tracing
from asrprec.precision import get_policy
from asrprec.training import train

from ..reliability.tiny import Tok, config

pytestmark = pytest.mark.torch_compile


# Fewer layers than the presets (tracing time grows with the layer count; every module type is still there):
# two Zipformer stacks (a downsampled stack, the output assembly) with icefall's scheduled dropout (the tiny preset
# has none), two Conformer layers.
_OVERRIDES = {"zipformer": {"downsampling_factor": (2, 4), "cnn_module_kernel": (15, 7), "dropout": None},
              "conformer": {"num_encoder_layers": 2}}


def _model(encoder: str, vocab_size: int = 16):
    torch.manual_seed(0)
    return build_transducer(encoder=encoder, size="tiny", vocab_size=vocab_size, encoder_overrides=_OVERRIDES[encoder])


def _explain(encoder: str, training: bool, autocast: bool, batch_count: float):
    model = _model(encoder)
    model.train(training)
    set_batch_count(model, batch_count)
    prepare_for_tracing(model)
    features, lens = torch.randn(2, 60, 80), torch.tensor([60, 45])
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return torch._dynamo.explain(model.encoder)(features, lens)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("encoder", ["zipformer", "conformer"])
def test_encoder_traces_without_graph_breaks(encoder, training, autocast):
    # batch 5000: every schedule still moves (dropout, layer and module skipping, balancer limits and
    # probabilities, whitening limits) and the position-score skip has reached 0 (see the next test)
    report = _explain(encoder, training, autocast, batch_count=5000.0)
    assert report.graph_break_count == 0, [str(b.reason)[:300] for b in report.break_reasons]
    assert report.graph_count == 1


@pytest.mark.slow  # one more full trace of the training graph, in pieces
def test_position_score_skip_is_the_only_eager_part():
    # while pos_emb_skip_rate > 0 its draw stays eager (a skipped call leaves linear_pos without a gradient):
    # docs/compile.md; every break is at that disabled draw
    report = _explain("zipformer", True, False, batch_count=0.0)
    reasons = [str(b.reason) for b in report.break_reasons]
    assert report.graph_break_count > 0
    assert all("disable" in r for r in reasons), reasons


def _counting_backend(graphs):
    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    return backend


def test_moving_schedules_are_read_at_run_time_not_compiled_in():
    # a layer-skipping bypass whose skip rate and scale floor move with the batch count: one graph serves every
    # count, and at each it gives what eager mode gives with the same random state (the schedule's current value,
    # not the one it had when the graph was made)
    from asrprec.models.zipformer.layers import BypassModule

    m = BypassModule(8, skip_rate=ScheduledFloat((0.0, 0.5), (4000.0, 0.02), default=0.0)).train()
    graphs = []
    torch._dynamo.reset()
    compiled = torch.compile(m, backend=_counting_backend(graphs), dynamic=False)
    a, b = torch.randn(5, 16, 8), torch.randn(5, 16, 8)
    outs = {}
    for count in (100.0, 2000.0, 3999.0):
        set_batch_count(m, count)
        for name, fn in (("eager", m), ("compiled", compiled)):
            torch.manual_seed(1)
            outs[name] = fn(a, b)
        torch.testing.assert_close(outs["compiled"], outs["eager"], rtol=0, atol=0)
    assert len(graphs) == 1
    # past the last point the schedule has settled: one more graph, specialised on its constant value
    set_batch_count(m, 5000.0)
    compiled(a, b)
    compiled(a, b)
    assert len(graphs) == 2


def test_held_schedules_are_not_compiled_again_when_they_settle():
    # compile_model(schedules="tensor"): a settled schedule stays a run-time tensor in training. A skip rate that
    # settles at 0 keeps drawing its (keep-all) mask in the graph, so the outputs stay eager mode's while only the
    # torch random stream after the call differs (docs/compile.md)
    from asrprec.models.schedule import hold_schedules_in_graph
    from asrprec.models.zipformer.layers import BypassModule

    m = BypassModule(8, skip_rate=ScheduledFloat((0.0, 0.5), (4000.0, 0.0), default=0.0)).train()
    assert hold_schedules_in_graph(m) == 2  # the skip rate and the scale floor (settles at 20000)
    graphs = []
    torch._dynamo.reset()
    compiled = torch.compile(m, backend=_counting_backend(graphs), dynamic=False)
    a, b = torch.randn(5, 16, 8), torch.randn(5, 16, 8)
    for count in (100.0, 3999.0, 5000.0, 9000.0):
        set_batch_count(m, count)
        outs, after = {}, {}
        for name, fn in (("eager", m), ("compiled", compiled)):
            torch.manual_seed(1)
            outs[name] = fn(a, b)
            after[name] = torch.rand(4)
        torch.testing.assert_close(outs["compiled"], outs["eager"], rtol=0, atol=0)
        assert torch.equal(after["compiled"], after["eager"]) == (count < 4000.0)
    assert len(graphs) == 1
    # released, the settled skip rate is compiled in as a constant again: one more graph
    hold_schedules_in_graph(m, False)
    assert m.skip_rate.traced_constant == 0.0
    compiled(a, b)
    assert len(graphs) == 2


def test_held_zipformer_schedules_compile_one_training_graph_across_settling():
    # batch 5000: every schedule still moves; 60000: all have settled (the presets' last points are 4000-50000)
    from asrprec.models.schedule import hold_schedules_in_graph

    counts = {}
    for hold in (True, False):
        model = _model("zipformer").train()
        prepare_for_tracing(model)
        hold_schedules_in_graph(model.encoder, hold)
        graphs = []
        torch._dynamo.reset()
        encoder = torch.compile(model.encoder, backend=_counting_backend(graphs), dynamic=False)
        features, lens = torch.randn(2, 60, 80), torch.tensor([60, 45])
        for count in (5000.0, 60000.0):
            set_batch_count(model, count)
            out, _ = encoder(features, lens)
            out.sum().backward()
        counts[hold] = len(graphs)
    assert counts == {True: 1, False: 2}


def test_zipformer_training_graph_is_not_recompiled_as_schedules_move():
    # every ScheduledFloat moves between these counts (dropout, skipping, balancer limits, whitening limits)
    model = _model("zipformer").train()
    prepare_for_tracing(model)
    graphs = []
    torch._dynamo.reset()
    encoder = torch.compile(model.encoder, backend=_counting_backend(graphs), dynamic=False)
    features, lens = torch.randn(2, 60, 80), torch.tensor([60, 45])
    for count in (5000.0, 5001.0, 7000.0):
        set_batch_count(model, count)
        out, out_lens = encoder(features, lens)
        out.sum().backward()
    assert len(graphs) == 1


def test_zipformer_training_graph_serves_every_length_with_dynamic_shapes():
    # --compile-dynamic true: (B, T) symbolic; a Python branch on T (e.g. "is T a multiple of the downsampling
    # factor") would guard the graph and compile it again for each residue
    model = _model("zipformer").train()
    set_batch_count(model, 5000.0)
    prepare_for_tracing(model)
    graphs = []
    torch._dynamo.reset()
    encoder = torch.compile(model.encoder, backend=_counting_backend(graphs), dynamic=True)
    for b, t in ((2, 60), (3, 62), (2, 64), (3, 66), (4, 77)):  # 50 Hz lengths 26 to 29 and 35: every residue mod 4
        out, out_lens = encoder(torch.randn(b, t, 80), torch.tensor([t] + [t - 5] * (b - 1)))
        out.sum().backward()
    assert len(graphs) == 1


def test_graph_breaks_of_the_position_score_skip_serve_every_length():
    # while the skip's rate is above 0 its eager draw splits the encoder into frames; a downsampled padding mask that
    # crosses a frame boundary as a strided view made dynamo guard on whether the factor divides T (a graph per
    # parity, seen in the embedded recipe with TORCH_LOGS=recompiles)
    model = _model("zipformer").train()
    for m in model.modules():
        if hasattr(m, "pos_emb_skip_rate"):
            m.pos_emb_skip_rate = ScheduledFloat((0.0, 1.0))  # always skipped: the break stays, the draws are fixed
    set_batch_count(model, 5000.0)
    prepare_for_tracing(model)
    graphs = []
    torch._dynamo.reset()
    encoder = torch.compile(model.encoder, backend=_counting_backend(graphs), dynamic=True)
    with torch.no_grad():
        encoder(torch.randn(2, 60, 80), torch.tensor([60, 55]))
        first = len(graphs)
        for b, t in ((3, 62), (2, 64), (3, 66), (4, 77)):  # every residue of the 50 Hz length mod 4
            encoder(torch.randn(b, t, 80), torch.tensor([t] + [t - 5] * (b - 1)))
    assert first > 1  # the breaks are there
    assert len(graphs) == first


@pytest.mark.parametrize("ds", [2, 4])
def test_downsampling_forward_and_backward_serve_every_length(ds):
    # at AOTAutograd's level (forward and backward traced, as inductor gets them): a tensor sized by the padding,
    # which is 1 for some T, made the graph guard on T mod ds
    from torch._dynamo.testing import CompileCounterWithBackend

    from asrprec.models.zipformer.layers import SimpleDownsample

    torch.manual_seed(0)
    m = SimpleDownsample(ds)
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    step = torch.compile(lambda x: m(x).square().sum(), backend=counter, dynamic=True)
    for t in range(9, 9 + 2 * ds):  # every residue of T mod ds, twice
        x = torch.randn(t, 2, 3, requires_grad=True)
        step(x).backward()
        x_ref = x.detach().clone().requires_grad_(True)
        m(x_ref).square().sum().backward()  # eager mode's path
        torch.testing.assert_close(x.grad, x_ref.grad)
    assert counter.frame_count == 1


@pytest.mark.slow
def test_front_end_keeps_lengths_symbolic_under_inductor():
    # inductor's own lowering of convolution_backward fixed the input gradient's strides, hence T, to numbers:
    # each new T compiled again, or a saved output's stride was fixed (the next T failed its check). The front-end's
    # convs are asrprec's op now: the graphs of the first length serve the next two.
    from torch._dynamo.testing import CompileCounterWithBackend

    from asrprec.models.zipformer.frontend import ZipformerConv2dSubsampling

    torch.manual_seed(0)
    m = ZipformerConv2dSubsampling(80, 64, layer1_channels=4, layer2_channels=8, layer3_channels=16,
                                   dropout=0.0).train()
    set_batch_count(m, 5000.0)
    prepare_for_tracing(m)
    counter = CompileCounterWithBackend("inductor")
    torch._dynamo.reset()

    def loss(x, n):
        if x.shape[-1] != 80:  # as the encoder checks its input: the feature dimension is a constant, (B, T) vary
            raise ValueError("80 features expected")
        return m(x, n)[0].square().sum()

    step = torch.compile(loss, backend=counter, dynamic=True)
    frames = []
    for t in (40, 47, 53):  # each call's compiled backward checks the strides of what forward saved
        step(torch.randn(2, t, 80), torch.tensor([t, t - 3])).backward()  # features need no gradient
        frames.append(counter.frame_count)
    assert frames[1:] == frames[:1] * 2, frames  # nothing compiled again for a new T


def test_a_function_past_the_recompile_limit_is_named_in_the_epoch_log(caplog):
    # a graph per shape (dynamic=False) until dynamo gives up on the function and runs it eager; the epoch's log
    # names it. Distinct graphs of different functions (graph breaks) are not a recompile and do not warn.
    import torch._dynamo.config as dynamo_config

    from asrprec.training.hooks import CompileReport

    def shaped(x):
        return x * 2

    torch._dynamo.reset()
    f = torch.compile(shaped, backend="eager", dynamic=False)
    report, stats = CompileReport(), {}
    report.epoch_started(1)
    for n in range(1, dynamo_config.recompile_limit):
        f(torch.ones(n))
    with caplog.at_level("INFO"):
        report.epoch_ended(1, stats)
    assert stats["compiled_graphs"] == dynamo_config.recompile_limit - 1
    assert "recompile_limit" not in caplog.text
    report.epoch_started(2)
    for n in range(dynamo_config.recompile_limit, dynamo_config.recompile_limit + 3):
        f(torch.ones(n))
    with caplog.at_level("INFO"):
        report.epoch_ended(2, {})
    warning = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "epoch 2" in r.getMessage()]
    assert len(warning) == 1, warning
    assert "'shaped'" in warning[0] and "test_compile.py" in warning[0] and "TORCH_LOGS=recompiles" in warning[0]


def test_recompile_limit_is_per_compiled_model():
    # compile_model(recompile_limit=N): the model's functions may have N graphs (torch.compile's per-region limit),
    # other compiled code keeps dynamo's global limit
    import torch._dynamo.config as dynamo_config

    from asrprec.models.compile import recompile_limit_hits

    model = _model("conformer")
    torch._dynamo.reset()
    limit = dynamo_config.recompile_limit + 4
    compile_model(model, parts=("joiner",), dynamic="false", backend="eager", recompile_limit=limit)
    hits = len(recompile_limit_hits())
    for n in range(1, limit):  # a graph per shape: limit - 1 of them
        model.joiner(torch.randn(n, model.joiner.encoder_proj.in_features),
                     torch.randn(n, model.joiner.decoder_proj.in_features))
    assert len(recompile_limit_hits()) == hits
    model.joiner(torch.randn(limit, model.joiner.encoder_proj.in_features),
                 torch.randn(limit, model.joiner.decoder_proj.in_features))
    model.joiner(torch.randn(limit + 1, model.joiner.encoder_proj.in_features),
                 torch.randn(limit + 1, model.joiner.decoder_proj.in_features))
    assert len(recompile_limit_hits()) == hits + 1
    with pytest.raises(ValueError, match="recompile_limit must be >= 1"):
        compile_model(model, recompile_limit=0)


def test_layers_of_one_shape_share_their_compiled_code():
    # regions="layers": the front-end and each layer are compiled on their own, and dynamo reuses a layer's graph
    # for every layer of the same shape. Two stacks of two layers with different kernels: 2 layer graphs + the
    # front-end's for 5 regions; the encoder's output and gradients are eager mode's (same random state).
    torch.manual_seed(0)
    overrides = dict(_OVERRIDES["zipformer"], num_encoder_layers=2)
    eager = build_transducer(encoder="zipformer", size="tiny", vocab_size=16, encoder_overrides=overrides).train()
    compiled = copy.deepcopy(eager)
    graphs = []
    torch._dynamo.reset()
    compile_model(compiled, dynamic="true", backend=_counting_backend(graphs), regions="layers")
    regions = compiled.encoder.compile_regions()
    assert len(regions) == 5 and compiled_regions(compiled.encoder) == 5 and compiled_regions(eager.encoder) == 0
    assert all(r._compiled_call_impl is not None for r in regions)
    features = torch.randn(2, 60, 80)
    for count, t in ((5000.0, 60), (5001.0, 52)):  # schedules move and T changes: no new graph
        outs, grads = [], []
        for model in (eager, compiled):
            set_batch_count(model, count)
            torch.manual_seed(1)
            random.seed(1)
            x = features[:, :t].clone().requires_grad_()
            out, _ = model.encoder(x, torch.tensor([t, t - 7]))
            out.square().sum().backward()
            outs.append(out)
            grads.append(x.grad)
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)
    assert len(graphs) == 3, [len(g.graph.nodes) for g in graphs]
    # the joiner has no regions: compiled whole
    compile_model(compiled, parts=("joiner",), backend="eager", regions="layers")
    assert compiled_regions(compiled.joiner) == 1


def test_compile_options_are_checked():
    model = _model("conformer")
    with pytest.raises(ValueError, match="regions must be one of"):
        compile_model(model, regions="blocks")
    with pytest.raises(ValueError, match="compile_regions must be one of"):
        config("unused", compile=True, compile_regions="blocks")
    with pytest.raises(ValueError, match="schedules must be one of"):
        compile_model(model, schedules="frozen")
    with pytest.raises(ValueError, match="compile_schedules must be one of"):
        config("unused", compile=True, compile_schedules="frozen")
    with pytest.raises(ValueError, match="cannot compile 'decoder'"):
        compile_model(model, parts=("decoder",))
    with pytest.raises(ValueError, match="dynamic must be one of"):
        compile_model(model, dynamic="sometimes")
    with pytest.raises(ValueError, match="unknown torch.compile backend 'inductr'"):
        compile_model(model, backend="inductr")
    with pytest.raises(ValueError, match="mode must be one of"):
        compile_model(model, mode="fastest")
    with pytest.raises(ValueError, match="compile_optimizer compiles ScaledAdam's update.*--optimizer scaled_adam"):
        config("unused", compile=True, compile_optimizer=True)  # the test config's optimizer is AdamW


def _batches(shapes=((2, 46), (2, 46), (2, 46))):
    g = torch.Generator().manual_seed(0)
    texts = ["abc", "de", "ea", "bcd", "a", "ed"]
    return [{"features": torch.randn(b, t, 80, generator=g), "feature_lens": torch.tensor([t] + [t - 6] * (b - 1)),
             "texts": [texts[(i + k) % 6] for k in range(b)], "cut_ids": [f"c{i}-{k}" for k in range(b)]}
            for i, (b, t) in enumerate(shapes)]


def _model_for_training(encoder: str):
    model = _model(encoder, vocab_size=Tok.vocab_size)
    # the position-score skip's eager boundary is covered above; without it the encoder is one graph from the
    # first batch
    for m in model.modules():
        if hasattr(m, "pos_emb_skip_rate"):
            m.pos_emb_skip_rate = ScheduledFloat((0.0, 0.0))  # settled at 0 from the first batch
    return model


def test_train_holds_the_schedules_it_is_asked_to(tmp_path):
    # --compile-schedules tensor reaches the compiled encoder's schedules; the default leaves them to settle
    for schedules in ("tensor", "constant"):
        model = _model_for_training("zipformer")
        torch._dynamo.reset()
        train(model=model, policy=get_policy("fp32", "cpu"), tokenizer=Tok(), train_dl=_batches(((2, 46),)),
              valid_dl=[], cfg=config(tmp_path / schedules, num_epochs=1, compile=True, compile_backend="eager",
                                      compile_dynamic="false", compile_schedules=schedules))
        held = {m.hold_in_graph for m in model.encoder.modules() if isinstance(m, ScheduledFloat)}
        assert held == {schedules == "tensor"}


# aot_eager traces forward and backward exactly as inductor does (dynamo, AOTAutograd, the partitioner) and runs the
# graphs with eager kernels: what can make a compiled run differ from an eager one in what it computes (replayed
# Python draws, schedules read from tensors, masks instead of branches, the closed-form Whiten gradient, in-graph
# asserts, state carried across a resume) is all there. inductor's generated kernels add only rounding; on 2 cores
# its compile of even this small model takes ~10 minutes, so that run is in the slow tier. One static shape keeps
# the default tier to one training graph and one validation graph per run (the dynamic-shape graph is checked by
# the test above, at dynamo's level, and by the slow runs).
# "scaled_adam": ScaledAdam, compiled too (--compile-optimizer) in the compiled runs. "layers": the encoder's front-end
# and layers compiled one by one (--compile-regions layers); the Conformer's warm-up, which moves every batch, must
# then reach its layers as a tensor or each batch would compile them again (epoch 2 would compile graphs).
@pytest.mark.parametrize("encoder,backend,optimizer,regions", [
    ("zipformer", "aot_eager", "adamw", "model"), ("conformer", "aot_eager", "adamw", "model"),
    ("conformer", "aot_eager", "scaled_adam", "model"), ("conformer", "aot_eager", "adamw", "layers"),
    pytest.param("zipformer", "aot_eager", "adamw", "layers", marks=pytest.mark.slow),
    pytest.param("zipformer", "inductor", "adamw", "model", marks=pytest.mark.slow),
    pytest.param("conformer", "inductor", "scaled_adam", "model", marks=pytest.mark.slow)])
def test_compiled_training_equals_eager_and_resumes_exactly(tmp_path, one_thread, encoder, backend, optimizer,
                                                           regions):
    policy = get_policy("fp32", "cpu")
    slow = backend == "inductor"  # (B, T) varying as under the bucketing sampler, one dynamic graph
    batches = _batches(((2, 40), (3, 52), (2, 46)) if slow else ((2, 46),) * 3)
    opts = dict(compile_backend=backend, compile_dynamic="true" if slow else "false", optimizer=optimizer,
                compile_regions=regions)
    if optimizer == "scaled_adam":
        opts.update(compile_optimizer=True, base_lr=0.02)
    torch._dynamo.reset()  # the graph counts below start from nothing (another test may have compiled this encoder)
    runs = {}
    for name, compiled in (("eager", False), ("compiled", True)):
        state = train(model=_model_for_training(encoder), policy=policy, tokenizer=Tok(), train_dl=batches,
                      valid_dl=batches[:1], cfg=config(tmp_path / name, num_epochs=2, compile=compiled, **opts))
        runs[name] = (state, torch.load(tmp_path / name / "epoch-2.pt", weights_only=False)["model"])
    (eager, w_eager), (comp, w_comp) = runs["eager"], runs["compiled"]
    assert [h["epoch"] for h in comp.history] == [1, 2]
    # the training and the validation graph in epoch 1; epoch 2's schedules, shapes and modes are served by them
    # (with dynamic shapes epoch 1 may add one graph when a size first differs from the one it saw)
    graphs = [h["compiled_graphs"] for h in comp.history]
    assert graphs[0] >= (3 if optimizer == "scaled_adam" else 2) and graphs[1] == 0, graphs  # + the optimizer's
    assert "compiled_graphs" not in eager.history[0]
    for he, hc in zip(eager.history, comp.history):
        assert math.isclose(he["train_loss"], hc["train_loss"], rel_tol=1e-5), (he, hc)
        assert math.isclose(he["valid_loss"], hc["valid_loss"], rel_tol=1e-5), (he, hc)
    assert list(w_comp) == list(w_eager)  # no _orig_mod. in the names
    # weights: Adam divides by the gradient's RMS, so rounding differences in near-zero gradients (the closed-form
    # Whiten gradient, BiasNorm through plain ops) move a weight by up to a fraction of the step size (lr 3e-3): at
    # most half a step here, where a wrong gradient would move weights by several steps (6 steps of up to 3e-3).
    # The attention's in_proj.bias is left out: its key part has an exactly-zero gradient (a softmax does not change
    # when the same q.b is added to every score), so Adam takes full-size steps along whatever rounding leaves there;
    # the in_proj.weight's key rows get near-zero gradients for the same reason.
    diffs = {k: float((w_comp[k].double() - w_eager[k].double()).abs().max()) for k in w_eager
             if w_eager[k].numel() and not k.endswith("in_proj.bias")}
    worst = sorted(diffs.items(), key=lambda kv: -kv[1])[:5]
    assert worst[0][1] < 0.5 * 3e-3, worst

    # a compiled run resumed from the compiled run's epoch-1 checkpoint ends where the uninterrupted one did
    resumed = train(model=_model_for_training(encoder), policy=policy, tokenizer=Tok(), train_dl=batches,
                    valid_dl=batches[:1], cfg=config(tmp_path / "resumed", num_epochs=2, compile=True, **opts,
                                                     resume=str(tmp_path / "compiled" / "epoch-1.pt")))
    w_res = torch.load(tmp_path / "resumed" / "epoch-2.pt", weights_only=False)["model"]
    assert resumed.batch_idx_train == comp.batch_idx_train
    for k in w_comp:
        assert torch.equal(w_res[k], w_comp[k]), k
