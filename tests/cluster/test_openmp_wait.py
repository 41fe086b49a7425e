"""OpenMP's wait policy as `cleave` sets it: before torch loads libgomp, never over a user's own."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cluster.openmp_wait import SPIN_POLICY, set_spin_policy


def test_sets_the_policy_where_the_user_set_none():
    environ = {"PATH": "/bin"}
    assert set_spin_policy(environ) is True
    assert environ == {"PATH": "/bin", "OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"}


@pytest.mark.parametrize("name", sorted(SPIN_POLICY))
def test_a_users_own_setting_wins(name):
    environ = {name: "PASSIVE" if name == "OMP_WAIT_POLICY" else "10"}
    before = dict(environ)
    assert set_spin_policy(environ) is False
    assert environ == before


def test_after_torch_loaded_it_refuses_and_says_why(monkeypatch):
    import torch  # noqa: F401 -- the state under test: libgomp already read its variables

    for name in SPIN_POLICY:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="before torch is imported"):
        set_spin_policy()
    assert not any(name in os.environ for name in SPIN_POLICY)


def test_the_cli_sets_it_before_anything_imports_torch():
    code = ("import os, sys\nfrom cluster.cli import main\ntry:\n    main(['--help'])\n"
            "except SystemExit:\n    pass\nimport torch\n"
            "print(os.environ['OMP_WAIT_POLICY'], os.environ['GOMP_SPINCOUNT'])")
    env = {k: v for k, v in os.environ.items() if k not in SPIN_POLICY}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.split()[-2:] == ["ACTIVE", "300000"]
