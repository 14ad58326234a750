"""The encode core's actions built by their own __init__ (the fields set at once) are the frozen dataclasses the
generated __init__ would build: the same signature, defaults, fields, equality, hash and immutability."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle

import pytest

from transfer.core.encode import Conclude, Progress, PushStatus, Release, StartWrite

ACTIONS = (StartWrite, PushStatus, Progress, Conclude, Release)


def _generated(cls: type) -> type:
    """`cls` as @dataclass(frozen=True) makes it, with the generated __init__."""
    return dataclasses.make_dataclass(cls.__name__, [(f.name, f.type, f) for f in dataclasses.fields(cls)],
                                      frozen=True)


@pytest.mark.parametrize("cls", ACTIONS)
def test_init_takes_every_field_in_order_with_its_default(cls):
    fields = dataclasses.fields(cls)
    parameters = inspect.signature(cls).parameters
    assert list(parameters) == [f.name for f in fields]
    assert [p.default for p in parameters.values()] == [
        inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default for f in fields]
    values = [object() for _ in fields]
    built, twin = cls(*values), _generated(cls)(*values)
    assert vars(built) == vars(twin) == dict(zip(parameters, values))
    assert vars(cls(**dict(zip(parameters, values)))) == vars(built)
    required = [f for f in fields if f.default is dataclasses.MISSING]
    assert vars(cls(*values[:len(required)])) == vars(_generated(cls)(*values[:len(required)]))
    with pytest.raises(TypeError):
        cls(*values, 1)


@pytest.mark.parametrize("cls", ACTIONS)
def test_an_action_is_an_ordinary_frozen_instance(cls):
    values = list(range(len(dataclasses.fields(cls))))
    built = cls(*values)
    assert built == cls(*values) and hash(built) == hash(cls(*values)) and built != cls(*values[:-1], -1)
    assert repr(built) == repr(_generated(cls)(*values))
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.room = 8  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        del built.room  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(built)) == built and copy.deepcopy(built) == built
    assert dataclasses.replace(built, room=8) == cls(*[8 if f.name == "room" else v for f, v in
                                                       zip(dataclasses.fields(cls), values)])
