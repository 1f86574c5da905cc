"""numstab.integrations.torch.GradScaler against torch.amp.GradScaler, step by step (CPU)."""

from __future__ import annotations

import copy
import dataclasses
import io
import math

import pytest

torch = pytest.importorskip("torch")

import numstab  # noqa: E402
from numstab import InvalidArgumentError, LossScaler  # noqa: E402
from numstab.integrations.torch import GradScaler  # noqa: E402

INF, NAN = math.inf, math.nan
# overflow steps chosen to hit growth (interval 3), backoff, and two backoffs in a row
INJECT = {3: INF, 7: NAN, 8: INF, 13: -INF}
STEPS = 16
EPS32 = torch.finfo(torch.float32).eps
EPS16 = torch.finfo(torch.float16).eps
TORCH_CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_ multiplies by max_norm / (norm + 1e-6)


def _norm_rtol(n: int, norm_type: float) -> float:
    """Two paths' float32 norms of the same n elements: a sum of n terms is within n eps / 2
    of its value on each path (a root halves that and adds eps / 2); a max is exact."""
    return 0.0 if norm_type == INF else n * EPS32


def _clipped_rtol(n: int, norm_type: float, norm: torch.Tensor) -> float:
    """Clipped gradients against torch's: the norms' rtol, torch's epsilon relative to the
    norm, and two roundings per path (the coefficient's division, the product)."""
    return _norm_rtol(n, norm_type) + TORCH_CLIP_EPS / float(norm) + 2 * EPS32


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _batches(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)) for _ in range(n)]


OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adam_fused": lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True),  # skips in-kernel
}


def _backward(model, scaler, x, y, step, inject):
    loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    if step in inject:
        model[0].weight.grad[1, 2] = inject[step]


def _run(make_scaler, optimizer, mode, inject=INJECT, max_norm=0.05):
    """Train STEPS steps; return per-step scales, applied steps, norms, final params and
    optimizer state. mode: 'step' (step + update), 'manual_clip' (torch's documented
    unscale_ -> clip_grad_norm_ -> step -> update), 'combined' (step_and_update)."""
    model = _model()
    opt = OPTIMIZERS[optimizer](model.parameters())
    applied: list[int] = []
    opt.register_step_post_hook(lambda *_: applied.append(step))
    scaler = make_scaler()
    scales, norms, flags = [], [], []
    for step, (x, y) in enumerate(_batches()):
        opt.zero_grad()
        _backward(model, scaler, x, y, step, inject)
        if mode == "step":
            scaler.step(opt)
            scaler.update()
        elif mode == "manual_clip":
            scaler.unscale_(opt)
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
            scaler.step(opt)
            scaler.update()
        else:
            flags.append(scaler.step_and_update(opt, max_norm=max_norm))
            norms.append(scaler.last_grad_norm)
        scales.append(scaler.get_scale())
    params = [p.detach().clone() for p in model.parameters()]
    return {
        "scales": scales,
        "applied": applied,
        "flags": flags,
        "norms": norms,
        "params": params,
        "opt": opt.state_dict(),
        "scaler": scaler,
    }


def _torch_scaler(**kw):
    return lambda: torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=3, **kw)


def _numstab_scaler(**kw):
    return lambda: GradScaler("cpu", init_scale=8.0, growth_interval=3, **kw)


def _assert_trees_equal(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_trees_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_trees_equal(x, y)
    else:
        assert a == b


# -- trajectories --------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_trajectory_equals_torch_grad_scaler(optimizer):
    ref = _run(_torch_scaler(), optimizer, "step")
    got = _run(_numstab_scaler(), optimizer, "step")
    assert ref["scales"] == [8, 8, 16, 8, 8, 8, 16, 8, 4, 4, 4, 8, 8, 4, 4, 4]
    assert got["scales"] == ref["scales"]
    if optimizer != "adam_fused":  # a fused optimizer runs its step and skips in the kernel
        assert ref["applied"] == [s for s in range(STEPS) if s not in INJECT]
    assert got["applied"] == ref["applied"]
    _assert_trees_equal(got["params"], ref["params"])
    _assert_trees_equal(got["opt"], ref["opt"])
    state = got["scaler"].state
    assert int(state.growth_tracker) == ref["scaler"]._get_growth_tracker()
    assert state.scale.dtype == torch.float32 and state.growth_tracker.dtype == torch.int32


def test_state_machine_is_loss_scaler_update():
    """Hysteresis, floor and cap come from LossScaler.update, fed the same finite flags."""
    config = LossScaler.preset("deepspeed", init_scale=8.0, growth_interval=3, max_scale=16.0)
    got = _run(lambda: GradScaler(scaler=config), "sgd_momentum", "step")
    state = config.init(backend="torch")
    expected = []
    for step in range(STEPS):
        state = config.update(state, step not in INJECT)
        expected.append(float(state.scale))
    assert got["scales"] == expected
    final = got["scaler"].state
    assert [int(final.growth_tracker), int(final.hysteresis_left)] == [
        int(state.growth_tracker),
        int(state.hysteresis_left),
    ]
    # hysteresis 2: the first overflow (step 3) is absorbed, so step 3 did not back off
    assert expected[3] == expected[2] and got["applied"] == [
        s for s in range(STEPS) if s not in INJECT
    ]


def test_combined_step_clips_after_unscaling_like_torch_manual_sequence():
    ref = _run(_torch_scaler(), "sgd_momentum", "manual_clip")
    got = _run(_numstab_scaler(), "sgd_momentum", "combined")
    assert got["scales"] == ref["scales"]
    assert got["applied"] == ref["applied"]
    assert got["flags"] == [s not in INJECT for s in range(STEPS)]
    n = sum(p.numel() for p in ref["params"])
    atol = 0.0  # on the params, accumulated over the applied steps
    for step, (a, b) in enumerate(zip(got["norms"], ref["norms"], strict=True)):
        if step in INJECT:
            assert not torch.isfinite(a) and not torch.isfinite(b)
            continue
        # the unscaled norm (a scaled one would be ~8x larger), and it does clip; the bound counts
        # the norms' rounding, not the trajectories' divergence (ulps here, atol below)
        torch.testing.assert_close(a, b, rtol=_norm_rtol(n, 2.0), atol=0)
        assert b > 0.05
        # torch divides by norm + 1e-6, numstab by max(norm, max_norm): the clipped gradients
        # (norm max_norm 0.05) differ by 0.05 * _clipped_rtol, which SGD(lr 0.05, momentum 0.9)
        # carries into every later step, lr / (1 - 0.9) in all; each step rounds the params once
        max_norm, lr, momentum = 0.05, 0.05, 0.9
        step_error = max_norm * _clipped_rtol(n, 2.0, b) * lr / (1 - momentum)
        atol += step_error + EPS32 * max(p.abs().max().item() for p in ref["params"])
    for a, b in zip(got["params"], ref["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)


def test_clip_grad_norm_equals_core_clip_by_global_norm_exactly():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler(init_scale=2.0**10)
    x, y = _batches(1)[0]
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    unscaled = [p.grad / 2.0**10 for p in model.parameters()]  # exact: power of two
    expected, expected_norm = numstab.clip_by_global_norm(unscaled, 0.01)
    norm = scaler.clip_grad_norm_(opt, 0.01)
    assert torch.equal(norm, expected_norm) and norm > 0.01
    _assert_trees_equal([p.grad for p in model.parameters()], expected)
    assert scaler.last_grad_norm is norm
    # below max_norm: exactly unchanged (no epsilon)
    before = [p.grad.clone() for p in model.parameters()]
    scaler.clip_grad_norm_(opt, 1e6)
    _assert_trees_equal([p.grad for p in model.parameters()], before)


@pytest.mark.parametrize("optimizer", ["adam", "adam_fused"])
@pytest.mark.parametrize("bad", [INF, NAN])
def test_skipped_step_leaves_params_and_optimizer_state_unchanged(optimizer, bad):
    model = _model()
    opt = OPTIMIZERS[optimizer](model.parameters())
    scaler = GradScaler(init_scale=4.0)
    (x, y), (x2, y2) = _batches(2)
    opt.zero_grad()
    _backward(model, scaler, x, y, 0, {})
    assert scaler.step_and_update(opt, max_norm=1.0) is True
    params = copy.deepcopy([p.detach() for p in model.parameters()])
    state = copy.deepcopy(opt.state_dict())
    opt.zero_grad()
    _backward(model, scaler, x2, y2, 1, {1: bad})
    assert scaler.step_and_update(opt, max_norm=1.0) is False
    _assert_trees_equal([p.detach() for p in model.parameters()], params)
    _assert_trees_equal(opt.state_dict(), state)
    assert scaler.get_scale() == 2.0
    assert not torch.isfinite(scaler.last_grad_norm)


@pytest.mark.parametrize("norm_type", [2.0, INF])
@pytest.mark.parametrize("bad", [INF, NAN])
def test_clip_leaves_unscaled_gradients_untouched_when_the_step_will_skip(norm_type, bad):
    """A non-finite gradient: clip_grad_norm_ scales nothing (a tiny max_norm would clip any
    finite norm) and the step is skipped; the gradients stay as unscale_ left them."""
    scaler, twin = GradScaler(init_scale=8.0), GradScaler(init_scale=8.0)
    model, opt = _scaled_backward(scaler)
    next(iter(model.parameters())).grad.view(-1)[1] = bad
    twins = _params_with_grads([p.grad.clone() for p in model.parameters()])
    twin.scale(torch.ones(()))
    twin.unscale_(torch.optim.SGD(twins, lr=0.1))
    norm = scaler.clip_grad_norm_(opt, 1e-6, norm_type=norm_type)
    assert not torch.isfinite(norm)
    for p, t in zip(model.parameters(), twins, strict=True):
        torch.testing.assert_close(p.grad, t.grad, rtol=0, atol=0, equal_nan=True)
    assert scaler.step(opt) is None and not next(iter(model.parameters())).isnan().any()


def test_overflow_while_unscaling_below_scale_one_is_skipped_by_the_combined_step():
    # torch's kernel checks before unscaling: 3e38 * 4 = inf passes its check
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=1.0)
    scaler = GradScaler(init_scale=0.25)
    scaler.scale(param.sum()).backward()
    param.grad.fill_(3e38)
    assert scaler.step_and_update(opt, max_norm=1.0) is False
    assert torch.equal(param.detach(), torch.ones(2))
    assert scaler.get_scale() == 0.125


def test_two_optimizers_share_one_update_like_torch():
    def run(make):
        model = _model()
        opts = [
            torch.optim.SGD(model[0].parameters(), lr=0.1),
            torch.optim.Adam(model[2].parameters(), lr=0.01),
        ]
        scaler, scales = make(), []
        for step, (x, y) in enumerate(_batches(8)):
            for o in opts:
                o.zero_grad()
            _backward(model, scaler, x, y, step, {2: INF})
            scaler.step(opts[0])
            scaler.step(opts[1])
            scaler.update()
            scales.append(scaler.get_scale())
        return scales, [p.detach() for p in model.parameters()]

    ref, got = run(_torch_scaler()), run(_numstab_scaler())
    assert got[0] == ref[0]
    _assert_trees_equal(got[1], ref[1])


def test_update_with_new_scale_keeps_tracker():
    ref, got = _torch_scaler()(), _numstab_scaler()()
    for scaler in (ref, got):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = _batches(1)[0]
        _backward(model, scaler, x, y, 0, {})
        scaler.step(opt)
        scaler.update(128.0)
        assert scaler.get_scale() == 128.0
        scaler.update(torch.tensor(32.0))
        assert scaler.get_scale() == 32.0
    assert int(got.state.growth_tracker) == ref._get_growth_tracker() == 0


def test_scale_nested_outputs_and_dtypes():
    scaler = GradScaler(init_scale=4.0)
    a, b = torch.ones(2), torch.ones(3, dtype=torch.float16)
    out = scaler.scale([a, (b, a)])
    assert isinstance(out, list) and isinstance(out[1], tuple)
    assert torch.equal(out[0], 4 * a) and out[1][0].dtype == torch.float16
    assert torch.equal(out[1][0], 4 * b)
    assert [t.tolist() for t in scaler.scale(iter([a]))] == [[4.0, 4.0]]
    assert scaler.state.scale.device == a.device


def test_works_under_another_global_backend():
    numstab.set_backend("numpy")
    got = _run(_numstab_scaler(), "sgd_momentum", "combined")
    assert got["flags"] == [s not in INJECT for s in range(STEPS)]


# -- state dict ----------------------------------------------------------------------------
NON_DEFAULT = {
    "init_scale": 1024.0,
    "growth_factor": 4.0,
    "backoff_factor": 0.25,
    "growth_interval": 7,
    "hysteresis": 3,
    "min_scale": 2.0,
    "max_scale": 2.0**20,
    "consecutive_hysteresis": True,
}
if "growth_delay_after_overflow" in {f.name for f in dataclasses.fields(LossScaler)}:
    NON_DEFAULT["growth_delay_after_overflow"] = 2  # a newer LossScaler field


@pytest.mark.parametrize("dynamic", [True, False])
@pytest.mark.parametrize("initialized", [True, False])
def test_state_dict_round_trip_non_default_everywhere(dynamic, initialized):
    config = LossScaler(**NON_DEFAULT, dynamic=dynamic)
    defaults = [
        f.name for f in dataclasses.fields(LossScaler) if getattr(config, f.name) == f.default
    ]
    assert defaults == ([] if not dynamic else ["dynamic"])  # both values of dynamic are run
    src = GradScaler(scaler=config)
    values = {"scale": 96.0, "growth_tracker": 5, "hysteresis_left": 1}  # none is initial
    src.load_state_dict({"numstab": {"config": dataclasses.asdict(config), "state": values}})
    if initialized:
        src.scale(torch.ones(()))
    sd = src.state_dict()
    assert sd["numstab"] == {"config": dataclasses.asdict(config), "state": values}
    assert sd["scale"] == 96.0 and sd["_growth_tracker"] == 5 and sd["growth_factor"] == 4.0
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    dst = GradScaler()
    if initialized:
        dst.scale(torch.ones(()))
    dst.load_state_dict(loaded)
    assert dst.loss_scaler == config
    assert dst.state_dict() == sd
    assert dst.get_scale() == 96.0
    # and both continue identically
    for scaler in (src, dst):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step, (x, y) in enumerate(_batches(4)):
            opt.zero_grad()
            _backward(model, scaler, x, y, step, {1: INF})
            scaler.step_and_update(opt)
    assert dst.state_dict() == src.state_dict()


def test_state_dict_interoperates_with_torch_grad_scaler():
    ours = GradScaler(init_scale=64.0, growth_factor=3.0, backoff_factor=0.125, growth_interval=9)
    ours.scale(torch.ones(()))
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(ours.state_dict())
    assert theirs.get_scale() == 64.0 and theirs.get_growth_factor() == 3.0
    theirs.scale(torch.ones(()))
    theirs._growth_tracker.fill_(4)
    back = GradScaler()
    back.load_state_dict(theirs.state_dict())
    assert back.get_scale() == 64.0 and back.get_growth_interval() == 9
    assert back.get_backoff_factor() == 0.125
    assert back.state_dict()["_growth_tracker"] == 4
    back.scale(torch.ones(()))
    assert back.state.scale.item() == 64.0 and int(back.state.growth_tracker) == 4


# -- misuse --------------------------------------------------------------------------------
def _scaled_backward(scaler, model=None):
    model = model or _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batches(1)[0]
    _backward(model, scaler, x, y, 0, {})
    return model, opt


def test_unscale_twice_raises_and_changes_nothing():
    scaler = GradScaler(init_scale=8.0)
    model, opt = _scaled_backward(scaler)
    scaler.unscale_(opt)
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(InvalidArgumentError, match="already been called"):
        scaler.unscale_(opt)
    _assert_trees_equal([p.grad for p in model.parameters()], grads)
    assert scaler.step(opt) is None  # SGD returns None; the step still runs after the error
    with pytest.raises(InvalidArgumentError, match="after step"):
        scaler.unscale_(opt)
    with pytest.raises(InvalidArgumentError, match="already been called"):
        scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 8.0
    scaler.unscale_(opt)  # a new iteration may unscale again


def test_fp16_and_integer_gradients_raise_and_change_nothing():
    scaler = GradScaler()
    scaler.scale(torch.ones(()))
    good = torch.nn.Parameter(torch.ones(2))
    good.grad = torch.full((2,), 4.0)
    half = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    half.grad = torch.ones(2, dtype=torch.float16)
    opt = torch.optim.SGD([good, half], lr=0.1)
    with pytest.raises(InvalidArgumentError, match=r"float16"):
        scaler.unscale_(opt)
    assert good.grad.tolist() == [4.0, 4.0]
    whole = torch.nn.Parameter(torch.ones(2, dtype=torch.int64), requires_grad=False)
    whole.grad = torch.ones(2, dtype=torch.int64)
    opt = torch.optim.SGD([good], lr=0.1)
    opt.param_groups[0]["params"].append(whole)
    with pytest.raises(InvalidArgumentError, match="floating-point gradients"):
        scaler.step(opt)
    assert good.grad.tolist() == [4.0, 4.0]
    with pytest.raises(InvalidArgumentError):
        scaler.scale(torch.ones(2, dtype=torch.int64))
    with pytest.raises(InvalidArgumentError):
        scaler.scale("loss")


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda s, o: s.step_and_update(o, max_norm=0.0), "max_norm"),
        (lambda s, o: s.step_and_update(o, max_norm=math.nan), "max_norm"),
        (lambda s, o: s.clip_grad_norm_(o, 1.0, norm_type=-1.0), "norm_type"),
        (lambda s, o: s.clip_grad_norm_(o, 1.0, norm_type="fro"), "norm_type"),
        (lambda s, o: s.step(o, closure=lambda: 0.0), "Closure"),
        (lambda s, o: s.update(new_scale=-1.0), "new_scale"),
        (lambda s, o: s.update(new_scale=torch.ones(2)), "new_scale"),
        (lambda s, o: s.update(new_scale=1e39), "new_scale"),  # torch.full raised its own
        (lambda s, o: s.update(new_scale=1e-50), "new_scale"),  # 0 in float32
        (lambda s, o: s.load_state_dict({}), "non-empty"),
        (lambda s, o: s.load_state_dict({"scale": 1.0}), "missing"),
        (lambda s, o: s.load_state_dict({"numstab": {"state": {}}}), "state dict"),
        (lambda s, o: s.set_growth_factor(0.5), "growth_factor"),
    ],
)
def test_bad_arguments_raise_and_change_nothing(call, match):
    scaler = GradScaler(init_scale=8.0)
    model, opt = _scaled_backward(scaler)
    grads = [p.grad.clone() for p in model.parameters()]
    before = scaler.state_dict()
    with pytest.raises(InvalidArgumentError, match=match):
        call(scaler, opt)
    _assert_trees_equal([p.grad for p in model.parameters()], grads)
    assert scaler.state_dict() == before
    scaler.step(opt)  # still usable, still at the start of the iteration
    scaler.update()


def test_calls_before_scale_and_bad_constructor_arguments():
    scaler = GradScaler()
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    for call in (lambda: scaler.unscale_(opt), lambda: scaler.step(opt), scaler.update):
        with pytest.raises(InvalidArgumentError, match="before scale"):
            call()
    assert scaler.get_scale() == 2.0**16 and scaler.state is None
    with pytest.raises(InvalidArgumentError, match="not both"):
        GradScaler(init_scale=2.0, scaler=LossScaler())
    with pytest.raises(InvalidArgumentError, match="LossScaler"):
        GradScaler(scaler={"init_scale": 2.0})
    with pytest.raises(InvalidArgumentError, match="backoff_factor"):
        GradScaler(backoff_factor=1.5)
    scaler.scale(torch.ones(()))
    with pytest.raises(InvalidArgumentError, match="No inf checks"):
        scaler.update()


def test_sparse_gradients_unscale_but_do_not_clip():
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    scaler = GradScaler(init_scale=4.0)
    scaler.scale(emb(torch.tensor([1, 2])).sum()).backward()
    with pytest.raises(InvalidArgumentError, match="sparse"):
        scaler.clip_grad_norm_(opt, 1.0)
    assert torch.equal(emb.weight.grad._values(), torch.full((2, 3), 4.0))
    assert scaler.step_and_update(opt) is True


def test_disabled_is_a_pass_through():
    scaler = GradScaler(enabled=False)
    model, opt = _scaled_backward(scaler)
    loss = torch.ones(())
    assert scaler.scale(loss) is loss and not scaler.is_enabled()
    scaler.unscale_(opt)
    before = [p.detach().clone() for p in model.parameters()]
    assert scaler.step_and_update(opt, max_norm=1e-3) is True
    assert not torch.equal(before[0], model[0].weight)
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {}
    scaler.load_state_dict({})
    scaler.update()


def test_cuda_device_without_cuda_disables_with_a_warning():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available")
    with pytest.warns(UserWarning, match="CUDA is not available"):
        scaler = GradScaler("cuda")
    assert not scaler.is_enabled()


def test_no_host_reads_in_unscale_clip_update(monkeypatch):
    """A CPU proxy for CUDA's sync-debug mode: no tensor is read on the host by unscale_,
    clip_grad_norm_, update, nor by a fused optimizer's step (benchmarks/loss_scaling_torch.py
    --device cuda runs the real check)."""
    scaler = GradScaler(init_scale=8.0)
    model, opt = _scaled_backward(scaler)
    fused = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)

    def host_read(*_, **__):
        raise AssertionError("host read of a tensor")

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
            m.setattr(torch.Tensor, name, host_read)
        scaler.unscale_(opt)
        scaler.clip_grad_norm_(opt, 0.01)
        scaler.update()
        scaler.step(fused)
        scaler.update()
        with pytest.raises(AssertionError, match="host read"):
            scaler.step(opt)  # a plain optimizer: one read decides whether to step


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_host_device_sync_on_cuda():
    """The real check: CUDA's sync-debug mode raises on any host-device synchronisation in
    the functional core (unscale, clip, update) and in the GradScaler's unscale_, clip and
    fused step."""
    device = torch.device("cuda")
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    scaler = GradScaler(init_scale=2.0**10)
    core = LossScaler(init_scale=2.0**10)
    state = core.init(like=next(model.parameters()))
    scaler.scale(model(torch.randn(8, 16, device=device)).square().mean()).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        unscaled, finite = core.unscale(grads, state)
        clipped, _ = numstab.clip_by_global_norm(unscaled, 1.0)
        state = core.update(state, finite)
        numstab.all_finite(clipped)
        scaler.unscale_(opt)
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    assert state.scale.device.type == "cuda"


# -- module-level clip_grad_norm_ (drop-in for torch.nn.utils.clip_grad_norm_) ----------------
def _params_with_grads(grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.zeros_like(g, dtype=torch.float32)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    return params


@pytest.mark.parametrize("norm_type", [2.0, 1.0, INF])
def test_clip_grad_norm_matches_torch_up_to_its_epsilon(norm_type):
    from numstab.integrations.torch import clip_grad_norm_

    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(7, 5, generator=g) * 4, torch.randn(11, generator=g), torch.ones(2, 2)]
    ours, theirs = _params_with_grads(grads), _params_with_grads(grads)
    norm = clip_grad_norm_(ours, 0.5, norm_type)
    norm_t = torch.nn.utils.clip_grad_norm_(theirs, 0.5, norm_type, foreach=True)
    n = sum(g.numel() for g in grads)
    torch.testing.assert_close(norm, norm_t, rtol=_norm_rtol(n, norm_type), atol=0)
    for a, b in zip(ours, theirs, strict=True):  # torch divides by norm + 1e-6
        torch.testing.assert_close(a.grad, b.grad, rtol=_clipped_rtol(n, norm_type, norm_t), atol=0)
    clipped, _ = numstab.clip_by_global_norm(grads, 0.5, norm_type=norm_type)
    for a, b in zip(ours, clipped, strict=True):
        assert torch.equal(a.grad, b)


def test_clip_grad_norm_under_the_limit_is_exact_and_fp16_is_not_zeroed():
    from numstab.integrations.torch import clip_grad_norm_

    small = [torch.full((3,), 0.1), torch.full((2, 2), -0.2)]
    params = _params_with_grads(small)
    param = params[0]
    clip_grad_norm_(param, 10.0)  # a single tensor is accepted, like torch
    clip_grad_norm_(params, 10.0)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, small, strict=True))

    # float16 gradients of norm ~1e5: torch's per-tensor fp16 norm overflows to inf
    big = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    big.grad = torch.full((4,), 60000.0, dtype=torch.float16)
    norm = clip_grad_norm_([big], 1.0)
    # exact: 60000**2 * 4 and its root 120000 are float32 numbers (< 2**24 significant bits)
    assert norm.dtype == torch.float32 and norm.item() == 120000.0
    # 60000 * (1 / 120000) in float32 (2 eps32), rounded toward zero to float16: at most one
    # float16 spacing below 0.5, 2**-12 = 0.5 * eps16 / 2
    rtol = EPS16 / 2 + 2 * EPS32
    torch.testing.assert_close(big.grad.float(), torch.full((4,), 0.5), rtol=rtol, atol=0)


def test_clip_grad_norm_leaves_gradients_untouched_on_a_nonfinite_norm():
    from numstab.integrations.torch import clip_grad_norm_

    grads = [torch.tensor([1.0, INF, 3.0]), torch.tensor([4.0, 5.0])]
    params = _params_with_grads(grads)
    norm = clip_grad_norm_(params, 1.0)
    assert math.isinf(norm.item())
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads, strict=True))


def test_clip_grad_norm_bad_arguments_change_nothing():
    from numstab.integrations.torch import clip_grad_norm_

    params = _params_with_grads([torch.full((3,), 5.0)])
    for kwargs, match in (({"max_norm": 0.0}, "max_norm"), ({"max_norm": -1.0}, "max_norm")):
        with pytest.raises(InvalidArgumentError, match=match):
            clip_grad_norm_(params, **kwargs)
    with pytest.raises(InvalidArgumentError, match="norm_type"):
        clip_grad_norm_(params, 1.0, norm_type=0.0)
    assert torch.equal(params[0].grad, torch.full((3,), 5.0))


@pytest.mark.parametrize("norm_type", ["inf", "Infinity", INF, "2", 2])
def test_clip_grad_norm_reads_norm_type_as_torch_does(norm_type):
    """torch documents norm_type 'inf' and reads it with float(): the drop-in and
    GradScaler.clip_grad_norm_ accept what torch accepts and clip like torch."""
    from numstab.integrations.torch import clip_grad_norm_

    grads = [torch.tensor([3.0, -4.0, 0.5]), torch.tensor([[1.0, -6.0]])]
    ours, theirs = _params_with_grads(grads), _params_with_grads(grads)
    norm = clip_grad_norm_(ours, 0.5, norm_type, error_if_nonfinite=True, foreach=None)
    norm_t = torch.nn.utils.clip_grad_norm_(theirs, 0.5, norm_type)
    n, p = sum(g.numel() for g in grads), float(norm_type)
    torch.testing.assert_close(norm, norm_t, rtol=_norm_rtol(n, p), atol=0)
    for a, b in zip(ours, theirs, strict=True):  # torch divides by norm + 1e-6
        torch.testing.assert_close(a.grad, b.grad, rtol=_clipped_rtol(n, p, norm_t), atol=0)

    scaler = GradScaler(init_scale=8.0)
    model, opt = _scaled_backward(scaler)
    want = [p.grad.clone() / 8.0 for p in model.parameters()]
    norm = scaler.clip_grad_norm_(opt, 1e-3, norm_type=norm_type)
    expected, _ = numstab.clip_by_global_norm(want, 1e-3, norm_type=float(norm_type))
    for p, e in zip(model.parameters(), expected, strict=True):  # the same ops: exact
        assert torch.equal(p.grad, e)


def test_clip_grad_norm_refuses_what_is_not_a_norm_and_raises_if_asked():
    from numstab.errors import NonFiniteError
    from numstab.integrations.torch import clip_grad_norm_

    params = _params_with_grads([torch.tensor([1.0, float("nan")])])
    for bad in ("fro", "-inf", -1.0, 0, "nan"):
        with pytest.raises(InvalidArgumentError, match="norm_type"):
            clip_grad_norm_(params, 1.0, norm_type=bad)
    with pytest.raises(NonFiniteError, match="error_if_nonfinite"):
        clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
    assert params[0].grad[0] == 1.0 and torch.isnan(params[0].grad[1])  # untouched


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("norm_type", [2.0, "inf"])
def test_clip_grad_norm_16bit_tiny_max_norm_stays_under_it(dtype, norm_type):
    """Scaled into the 16-bit subnormal range, gradients round toward zero: the clipped norm
    never exceeds max_norm by more than float32's rounding (to nearest it reached 1.19x)."""
    from numstab.integrations.torch import clip_grad_norm_

    gen = torch.Generator().manual_seed(0)
    grads = [(torch.randn(64, generator=gen) * 5).to(dtype), torch.tensor([9.0], dtype=dtype)]
    for max_norm in (1e-4, 3e-7, 1e-7, 1e-9):
        for use_scaler in (False, True):
            params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            if use_scaler:
                opt = torch.optim.SGD(params, lr=1.0)
                GradScaler(enabled=False).clip_grad_norm_(opt, max_norm, norm_type)
            else:
                clip_grad_norm_(params, max_norm, norm_type)
            norm = numstab.global_norm([p.grad for p in params], float(norm_type)).item()
            assert norm <= max_norm * (1 + 70 * 2.0**-23) + 2.0**-149


def test_parameters_that_are_not_tensors_are_typed_errors():
    """clip_grad_norm_, ZClip.step and agc_ raised Python's TypeError (None) or
    AttributeError (another framework's arrays, a string); agc_ checked clip_factor and
    layout only once gradients existed."""
    from numstab.integrations.torch import ZClip, agc_, clip_grad_norm_

    jnp = pytest.importorskip("jax.numpy")
    calls = [lambda p: clip_grad_norm_(p, 1.0), lambda p: ZClip().step(p), agc_]
    for call in calls:
        for bad in (None, "x", [jnp.ones(2)]):
            with pytest.raises(InvalidArgumentError, match="parameters"):
                call(bad)
    fresh = torch.nn.Linear(2, 2)  # no .grad yet
    with pytest.raises(InvalidArgumentError, match="clip_factor"):
        agc_(fresh, clip_factor=0.0)
    with pytest.raises(InvalidArgumentError, match="layout"):
        agc_(fresh, layout="xx")
