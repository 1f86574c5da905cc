"""torch ``check_numerics(mode="sentinel")``: a parameter gradient's record is named by the
parameter (``"1.weight (Linear)"``), as module outputs are named by the module
(``"1 (Linear)"``): weight and bias could not be told apart."""

import pytest

import numstab
from numstab.errors import NonFiniteError

torch = pytest.importorskip("torch")


def _backward_nan(model, x):
    sentinel = numstab.check_numerics(mode="sentinel", backend="torch")
    with pytest.raises(NonFiniteError) as info, sentinel:
        torch.sqrt(model(x) * 0).sum().backward()  # d sqrt(0) = inf, times 0: NaN
    return info.value


def test_gradient_records_are_named_by_parameter():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    err = _backward_nan(model, torch.ones(1, 2))
    assert err.phase == "backward"
    assert sorted(err.paths) == sorted(
        ["0.weight (Linear)", "0.bias (Linear)", "1.weight (Linear)", "1.bias (Linear)"]
    )
    assert err.op in ("1.weight (Linear)", "1.bias (Linear)")  # the layer nearest the fault
    assert len(set(err.paths)) == len(err.paths)
    # module outputs keep the module's name
    with torch.no_grad():
        model[1].weight[0, 0] = float("inf")
    sentinel = numstab.check_numerics(mode="sentinel", backend="torch")
    with pytest.raises(NonFiniteError) as info, sentinel:
        model(torch.ones(1, 2))
    assert info.value.op == "1 (Linear)" and info.value.phase == "forward"


def test_root_module_gradients_are_named_by_parameter_alone():
    err = _backward_nan(torch.nn.Linear(2, 1), torch.ones(1, 2))
    assert sorted(err.paths) == ["bias (Linear)", "weight (Linear)"]
