"""orchestrator/launch/registry.py: backends found by name — the built-in ones, imported only when
asked for, and those an installed package registers under the entry-point group (a real
distribution's metadata on sys.path, read by importlib.metadata: no mock)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from orchestrator.errors import RunDirError
from orchestrator.launch import reattach, registry
from orchestrator.launch.kind import Kind

REPO = Path(__file__).resolve().parents[2]


def test_the_built_in_backends_are_registered_and_each_says_its_name() -> None:
    assert registry.names()[:3] == ["local", "ssh", "slurm"]
    for name in ("local", "ssh", "slurm"):
        kind = registry.get(name)
        assert kind.name == name and isinstance(kind, Kind)
        assert registry.get(name) is kind  # loaded once


def test_local_and_a_preview_of_ssh_never_load_paramiko() -> None:
    code = textwrap.dedent(
        """
        import sys
        from pathlib import Path
        from orchestrator.launch import registry
        from orchestrator.spec.load import parse_spec
        registry.get("local")
        spec = parse_spec(
            "name: t\\nbackend: ssh\\nhosts: [{address: 10.0.0.1, tasks: {worker: 2}}]\\n"
            "job: {script: digits_fit.py}\\n",
            file="s.yaml", base_dir=Path(sys.argv[1]),
        )
        registry.get("ssh").preview(spec, "t-1", Path("/tmp/run"), Path(sys.argv[1]))
        print(sorted(m for m in ("paramiko", "fabric", "invoke") if m in sys.modules))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(REPO / "examples")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_an_unknown_name_is_an_error_naming_the_likely_one_never_a_fall_through() -> None:
    with pytest.raises(
        registry.UnknownBackend,
        match=r"no backend 'sluurm' \(did you mean 'slurm'\?\); registered: local, ssh, slurm",
    ):
        registry.get("sluurm")
    with pytest.raises(RunDirError, match="unknown backend 'carrier-pigeon'"):
        reattach({"backend": "carrier-pigeon"}, {}, {})


def distribution(root: Path, package: str, entry_points: str, module: str) -> None:
    """An installed distribution, as pip leaves one: its module and its .dist-info metadata."""
    (root / f"{package}.py").write_text(textwrap.dedent(module))
    info = root / f"{package}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{registry.GROUP}]\n{textwrap.dedent(entry_points)}")


def test_a_package_registers_a_backend_through_the_entry_point_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    distribution(
        tmp_path,
        "carrier_pigeon_backend",
        """\
        pigeon = carrier_pigeon_backend:KIND
        pigeon-broken = carrier_pigeon_backend:MISSING
        pigeon-wrong = carrier_pigeon_backend:WRONG
        """,
        """\
        from orchestrator.launch.local import LocalKind

        class PigeonKind(LocalKind):  # the local backend under another name, for the registry's sake
            name = "pigeon"

        KIND = PigeonKind()
        WRONG = object()
        """,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert registry.names()[3:] == ["pigeon", "pigeon-broken", "pigeon-wrong"]
    assert registry.get("pigeon").name == "pigeon"
    with pytest.raises(
        registry.UnknownBackend, match=r"cannot load carrier_pigeon_backend:MISSING .*AttributeError"
    ):
        registry.get("pigeon-broken")
    with pytest.raises(registry.UnknownBackend, match="is not a backend kind named 'pigeon-wrong'"):
        registry.get("pigeon-wrong")
    with pytest.raises(registry.UnknownBackend, match=r"did you mean 'pigeon'\?"):
        registry.get("pidgeon")


def test_the_specs_backend_takes_the_registered_names_and_says_a_typo_at_its_line(tmp_path: Path) -> None:
    from orchestrator.errors import SpecError
    from orchestrator.spec.load import parse_spec

    (tmp_path / "job.py").write_text("")
    text = (
        "name: t\nbackend: sluurm\nhosts: [{address: 127.0.0.1, tasks: {worker: 2}}]\njob: {script: job.py}\n"
    )
    with pytest.raises(SpecError) as caught:
        parse_spec(text, file="s.yaml", base_dir=tmp_path)
    assert (
        "s.yaml:2: backend: no backend 'sluurm' (did you mean 'slurm'?); registered: local, ssh, slurm"
        in str(caught.value)
    )
    assert parse_spec(text.replace("sluurm", "local"), file="s.yaml", base_dir=tmp_path).backend == "local"


PLUGINS = REPO / "tests" / "plugins"


@pytest.fixture()
def pigeon(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(PLUGINS))  # where an installed package's files are found


SPEC = (
    "name: t\nbackend: {backend}\nhosts: [{{address: 127.0.0.1, tasks: {{worker: 2}}}}]\n"
    "job: {{script: job.py}}\n"
)


def test_a_backends_section_is_validated_by_it_at_its_lines(tmp_path: Path, pigeon: None) -> None:
    """A top-level key named after a registered backend is its section: a package's too, with its
    errors at their lines and a typo of its keys answered with the likely one."""
    from orchestrator.errors import SpecError
    from orchestrator.spec.load import parse_spec

    (tmp_path / "job.py").write_text("")
    text = SPEC.format(backend="pigeon") + "pigeon:\n  message: hello\n"
    spec = parse_spec(text, file="s.yaml", base_dir=tmp_path)
    found = spec.section("pigeon")
    assert found is not None and found.model_dump() == {"message": "hello"}
    assert spec.section("ssh") is None
    for section, line, wanted in (
        ("pigeon:\n  message: Hello!\n", 6, "s.yaml:6: pigeon.message: String should match pattern"),
        ("pigeon:\n  mesage: hi\n", 6, "s.yaml:6: pigeon.mesage: unknown key; did you mean `message`?"),
        ("pigoen:\n  message: hi\n", 5, "s.yaml:5: pigoen: unknown key; did you mean `pigeon`?"),
        ("slurm: {nodes: 0, tasks_per_node: {worker: 1}}\n", 5, "s.yaml:5: slurm.nodes: Input should be"),
        ("local: {isolate_network: maybe}\n", 5, "s.yaml:5: local.isolate_network: String should match"),
    ):
        with pytest.raises(SpecError) as caught:
            parse_spec(SPEC.format(backend="pigeon") + section, file="s.yaml", base_dir=tmp_path)
        assert wanted in str(caught.value), (line, str(caught.value))


def test_a_section_for_a_backend_that_has_none_is_said_at_its_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from orchestrator.errors import SpecError
    from orchestrator.launch.local import LocalKind
    from orchestrator.spec.load import parse_spec

    (tmp_path / "job.py").write_text("")
    monkeypatch.setattr(LocalKind, "section", None)  # a backend that adds nothing to the spec
    with pytest.raises(SpecError) as caught:
        parse_spec(SPEC.format(backend="ssh") + "local: {}\n", file="s.yaml", base_dir=tmp_path)
    assert "s.yaml:5: local: backend local has no section of its own; remove it" in str(caught.value)


def test_another_backends_section_is_kept_for_a_run_on_it(tmp_path: Path) -> None:
    """The same spec run with --backend: each backend's section validated, the chosen one read."""
    from orchestrator.launch.ssh.spec import section as ssh_section
    from orchestrator.spec.load import parse_spec

    (tmp_path / "job.py").write_text("")
    text = SPEC.format(backend="ssh") + "ssh: {connect_timeout_s: 3}\n"
    on_ssh = parse_spec(text, file="s.yaml", base_dir=tmp_path)
    on_local = parse_spec(text, file="s.yaml", base_dir=tmp_path, backend="local")
    assert ssh_section(on_ssh).connect_timeout_s == 3 and on_local.backend == "local"
    assert ssh_section(on_local).connect_timeout_s == 3  # kept: the spec is the same


def test_a_spec_with_sections_goes_round_the_python_api(tmp_path: Path) -> None:
    """`ClusterSpec.as_data()` gives data that validates to the same spec (sections and the hosts
    a backend's section placed included)."""
    from orchestrator.spec.load import parse_spec

    (tmp_path / "job.py").write_text("")
    text = (
        "name: t\nbackend: slurm\njob: {script: job.py}\n"
        "slurm: {nodes: 3, tasks_per_node: {worker: 2}, spare_nodes: 1}\nssh: {connect_timeout_s: 3}\n"
    )
    spec = parse_spec(text, file="s.yaml", base_dir=tmp_path)
    assert [h.address for h in spec.hosts] == ["<node 1>", "<node 2>"]
    data = spec.as_data()
    assert "hosts" not in data and data["slurm"]["nodes"] == 3 and data["ssh"]["connect_timeout_s"] == 3
    again = parse_spec(yaml.safe_dump(data), file="again.yaml", base_dir=tmp_path)
    assert again == spec


def test_the_specs_schema_has_every_registered_backends_section(pigeon: None) -> None:
    from orchestrator.spec.sections import json_schema

    schema = json_schema()
    assert {"ssh", "slurm", "pigeon"} <= set(schema["properties"])
    assert schema["properties"]["pigeon"]["properties"]["message"]["pattern"] == "^[a-z]+$"
    assert "HostKeyPolicy" in schema["$defs"]
    assert schema["properties"]["local"]["properties"]["isolate_network"]["default"] == "auto"
