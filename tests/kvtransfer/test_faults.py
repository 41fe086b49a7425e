"""The fault-injection switch: off unless the process was started with it, exact when armed."""

import asyncio

import pytest

from kvtransfer import faults


def test_arming_is_refused_when_the_switch_is_off(monkeypatch):
    monkeypatch.setattr(faults, "ENABLED", False)
    with pytest.raises(RuntimeError, match="CLEAVE_FAULT_INJECTION=1"):
        faults.arm("engine.step", "raise")
    faults.hit("engine.step")  # nothing armed: passes


def test_an_armed_point_fires_the_given_number_of_times(monkeypatch):
    monkeypatch.setattr(faults, "ENABLED", True)
    faults.arm("kv.pull", "raise", times=2)
    try:
        for _ in range(2):
            with pytest.raises(faults.InjectedFault, match="kv.pull"):
                asyncio.run(faults.ahit("kv.pull"))
        asyncio.run(faults.ahit("kv.pull"))  # spent
        faults.hit("engine.step")  # another point: untouched
    finally:
        faults.disarm()


def test_a_bad_action_names_the_choices(monkeypatch):
    monkeypatch.setattr(faults, "ENABLED", True)
    with pytest.raises(ValueError, match="'explode'.*raise"):
        faults.arm("engine.step", "explode")
