"""Spec layer: every bad spec names `FILE:LINE: KEY: message` at the line and key the user must edit.

Spec texts are written with textwrap.dedent, so the line numbers in the tables are those of the text
as shown (its first line is line 1).
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from orchestrator.errors import SpecError
from orchestrator.launch.ssh.spec import section as ssh_section
from orchestrator.spec import ClusterSpec, Role, Strategy, load_spec, parse_spec

FILE = "spec.yaml"
LINE_RE = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+): (?P<key>\(top level\)|\S+): (?P<msg>.+)$")
REPO = Path(__file__).resolve().parents[2]


def y(text: str) -> str:
    """A spec text whose first written line is line 1."""
    return textwrap.dedent(text).lstrip("\n")


def parse(tmp_path: Path, text: str, **kw) -> ClusterSpec:
    (tmp_path / "train.py").write_text("print('hi')\n")
    return parse_spec(y(text), file=FILE, base_dir=tmp_path, **kw)


def problems_of(exc: SpecError) -> list[tuple[int, str, str]]:
    out = []
    for rendered in str(exc).splitlines():
        m = LINE_RE.match(rendered)
        assert m, f"not of the form FILE:LINE: KEY: message: {rendered!r}"
        assert m["file"] == FILE
        out.append((int(m["line"]), m["key"], m["msg"]))
    return out


MINIMAL = """
    name: demo
    hosts:
      - address: 127.0.0.1
        tasks: {worker: 2}
    job:
      script: train.py
"""

# (id, spec text, line, key, part of the message)
BAD_SPECS = [
    (
        "yaml-syntax-bad-indent",
        """
        name: demo
        hosts:
          - address: 127.0.0.1
             tasks: {worker: 2}
        job:
          script: train.py
        """,
        4,
        "(top level)",
        "YAML syntax error",
    ),
    (
        "yaml-syntax-tab",
        "name: demo\nhosts:\n\t- address: 127.0.0.1\n",
        3,
        "(top level)",
        "YAML syntax error",
    ),
    (
        "yaml-unclosed-quote-points-at-its-start",
        """
        name: demo
        job:
          script: "train.py
        hosts:
          - address: 127.0.0.1
            tasks: {worker: 2}
        """,
        3,
        "(top level)",
        "quoted scalar",
    ),
    (
        "yaml-unclosed-bracket-at-eof",
        """
        name: demo
        job:
          script: train.py
        hosts: [a, b
        """,
        4,
        "(top level)",
        "flow sequence",
    ),
    (
        "wrong-type-float",
        MINIMAL
        + """\
    health:
      heartbeat_timeout_s: fast
    """,
        8,
        "health.heartbeat_timeout_s",
        "valid number",
    ),
    (
        "wrong-type-list",
        """
        name: demo
        hosts: 127.0.0.1
        job:
          script: train.py
        """,
        2,
        "hosts",
        "valid list",
    ),
    (
        "wrong-type-count",
        """
        name: demo
        hosts:
          - address: 127.0.0.1
            tasks: {worker: two}
        job:
          script: train.py
        """,
        4,
        "hosts[0].tasks.worker",
        "valid integer",
    ),
    (
        "unknown-top-level-key",
        """
        name: demo
        hots:
          - address: 127.0.0.1
        hosts:
          - address: 127.0.0.1
            tasks: {worker: 2}
        job:
          script: train.py
        """,
        2,
        "hots",
        "unknown key",
    ),
    (
        "unknown-role",
        """
        name: demo
        hosts:
          - address: 127.0.0.1
            tasks: {wroker: 2}
        job:
          script: train.py
        """,
        4,
        "hosts[0].tasks.wroker",
        "'worker'",
    ),
    (
        "unknown-nested-key",
        MINIMAL
        + """\
    health:
      heartbeat_timout_s: 3
    """,
        8,
        "health.heartbeat_timout_s",
        "unknown key",
    ),
    (
        "unknown-host-key",
        """
        name: demo
        hosts:
          - address: 127.0.0.1
            tasks: {worker: 2}
            base_prot: 20000
        job:
          script: train.py
        """,
        5,
        "hosts[0].base_prot",
        "unknown key",
    ),
    (
        "zero-workers",
        """
        name: demo
        hosts:
          - address: 127.0.0.1
            tasks: {worker: 0}
        job:
          script: train.py
        """,
        4,
        "hosts[0].tasks.worker",
        "at least 1",
    ),
    (
        "empty-tasks",
        """
        name: demo
        hosts:
          - address: 127.0.0.1
            tasks: {}
        job:
          script: train.py
        """,
        4,
        "hosts[0].tasks",
        "no task",
    ),
    (
        "tasks-missing",
        """
        name: demo
        hosts:
          - address: 127.0.0.1
        job:
          script: train.py
        """,
        3,
        "hosts[0].tasks",
        "this host runs no task; give e.g. {worker: 1} (or spare: true",
    ),
    (
        "no-hosts",
        """
        name: demo
        hosts: []
        job:
          script: train.py
        """,
        2,
        "hosts",
        "give at least one host",
    ),
    (
        "only-evaluator-no-training-task",
        """
        name: demo
        hosts:
          - address: 127.0.0.1
            tasks: {evaluator: 1}
        job:
          script: train.py
        """,
        2,
        "hosts",
        "no chief or worker",
    ),
    (
        "two-chiefs-across-hosts",
        """
        name: demo
        hosts:
          - address: 10.0.0.1
            tasks: {chief: 1, worker: 1}
          - address: 10.0.0.2
            tasks: {chief: 1, worker: 1}
        job:
          script: train.py
        """,
        6,
        "hosts[1].tasks.chief",
        "at most one chief",
    ),
    (
        "two-evaluators",
        """
        name: demo
        hosts:
          - address: 127.0.0.1
            tasks: {worker: 2, evaluator: 2}
        job:
          script: train.py
        """,
        4,
        "hosts[0].tasks.evaluator",
        "at most one evaluator",
    ),
    (
        "overlapping-base-ports-local",
        """
        name: demo
        backend: local
        hosts:
          - address: 10.0.0.1
            tasks: {worker: 2}
            base_port: 20000
          - address: 10.0.0.2
            tasks: {worker: 2}
            base_port: 20001
        job:
          script: train.py
        """,
        9,
        "hosts[1].base_port",
        "port 20001 on 127.0.0.1 is already used by hosts[0]",
    ),
    (
        "overlapping-base-ports-ssh-same-address",
        """
        name: demo
        backend: ssh
        hosts:
          - address: 10.0.0.1
            tasks: {worker: 1}
            base_port: 20000
          - address: 10.0.0.1
            tasks: {worker: 1}
            base_port: 20000
        job:
          script: train.py
        """,
        9,
        "hosts[1].base_port",
        "port 20000 on 10.0.0.1",
    ),
    (
        "base-port-overflow",
        """
        name: demo
        hosts:
          - address: 127.0.0.1
            tasks: {worker: 2}
            base_port: 65535
        job:
          script: train.py
        """,
        5,
        "hosts[0].base_port",
        "do not fit",
    ),
    (
        "missing-script-file",
        """
        name: demo
        hosts:
          - address: 127.0.0.1
            tasks: {worker: 2}
        job:
          script: nope.py
        """,
        6,
        "job.script",
        "no such file",
    ),
    (
        "script-and-loop",
        """
        name: demo
        hosts:
          - address: 127.0.0.1
            tasks: {worker: 2}
        job:
          script: train.py
          loop: train.py
        train:
          steps: 10
        """,
        5,
        "job",
        "exactly one of job.script",
    ),
    (
        "neither-script-nor-loop",
        """
        name: demo
        hosts:
          - address: 127.0.0.1
            tasks: {worker: 2}
        job:
          args: [--fast]
        """,
        5,
        "job",
        "exactly one of job.script",
    ),
    (
        "job-missing",
        """
        name: demo
        hosts:
          - address: 127.0.0.1
            tasks: {worker: 2}
        """,
        1,
        "job",
        "required key is missing",
    ),
    (
        "loop-without-train",
        """
        name: demo
        hosts:
          - address: 127.0.0.1
            tasks: {worker: 2}
        job:
          loop: train.py
        """,
        1,
        "train",
        "needs a train: section",
    ),
    (
        "train-with-script",
        MINIMAL
        + """\
    train:
      steps: 10
    """,
        7,
        "train",
        "job.loop only",
    ),
    (
        "train-steps-and-epochs",
        """
        name: demo
        hosts:
          - address: 127.0.0.1
            tasks: {worker: 2}
        job:
          loop: train.py
        train:
          steps: 10
          epochs: 2
        """,
        7,
        "train",
        "exactly one of train.steps or train.epochs",
    ),
    (
        "ps-under-mwms",
        """
        name: demo
        strategy: multi_worker_mirrored
        hosts:
          - address: 127.0.0.1
            tasks: {worker: 2, ps: 1}
        job:
          script: train.py
        """,
        5,
        "hosts[0].tasks.ps",
        "multi_worker_mirrored has no parameter servers",
    ),
    (
        "mirrored-with-two-workers",
        """
        name: demo
        strategy: mirrored
        hosts:
          - address: 127.0.0.1
            tasks: {worker: 2}
        job:
          script: train.py
        """,
        2,
        "strategy",
        "mirrored runs one task",
    ),
    (
        "mirrored-with-ps",
        """
        name: demo
        strategy: mirrored
        hosts:
          - address: 127.0.0.1
            tasks: {worker: 1, ps: 1}
        job:
          script: train.py
        """,
        5,
        "hosts[0].tasks.ps",
        "mirrored has no parameter servers",
    ),
    (
        "parameter-server-without-ps",
        """
        name: demo
        strategy: parameter_server
        hosts:
          - address: 127.0.0.1
            tasks: {chief: 1, worker: 2}
        job:
          script: train.py
        """,
        2,
        "strategy",
        "at least one ps",
    ),
    (
        "parameter-server-without-chief",
        """
        name: demo
        strategy: parameter_server
        hosts:
          - address: 127.0.0.1
            tasks: {worker: 2, ps: 1}
        job:
          script: train.py
        """,
        2,
        "strategy",
        "exactly one chief",
    ),
    (
        "parameter-server-without-worker",
        """
        name: demo
        strategy: parameter_server
        hosts:
          - address: 127.0.0.1
            tasks: {chief: 1, ps: 1}
        job:
          script: train.py
        """,
        2,
        "strategy",
        "at least one worker",
    ),
    (
        "unknown-strategy",
        """
        name: demo
        strategy: horovod
        hosts:
          - address: 127.0.0.1
            tasks: {worker: 2}
        job:
          script: train.py
        """,
        2,
        "strategy",
        "multi_worker_mirrored",
    ),
    (
        "reserved-env-in-job",
        MINIMAL
        + """\
      env:
        FOO: bar
        TF_CONFIG: "{}"
    """,
        9,
        "job.env.TF_CONFIG",
        "set by orchestrate",
    ),
    (
        "reserved-env-in-host",
        """
        name: demo
        hosts:
          - address: 127.0.0.1
            tasks: {worker: 2}
            env:
              ORCHESTRATE_TOKEN: hunter2
        job:
          script: train.py
        """,
        6,
        "hosts[0].env.ORCHESTRATE_TOKEN",
        "set by orchestrate",
    ),
    (
        "duplicate-top-level-key",
        MINIMAL + "    name: other\n",
        7,
        "name",
        "duplicate key",
    ),
    (
        "duplicate-nested-key",
        """
        name: demo
        hosts:
          - address: 127.0.0.1
            tasks: {worker: 2}
        job:
          script: train.py
          args: []
          script: train.py
        """,
        8,
        "job.script",
        "duplicate key",
    ),
    ("empty-file", "", 1, "(top level)", "empty"),
    ("only-a-comment", "# nothing yet\n", 1, "(top level)", "empty"),
    ("top-level-list", "- name: demo\n- hosts: []\n", 1, "(top level)", "must be a mapping"),
    ("top-level-scalar", "demo\n", 1, "(top level)", "must be a mapping"),
    (
        "bool-env-value",
        MINIMAL
        + """\
      env:
        TF_USE_LEGACY_KERAS: yes
    """,
        8,
        "job.env.TF_USE_LEGACY_KERAS",
        "quote it",
    ),
    (
        "bad-env-name",
        MINIMAL
        + """\
      env:
        1BAD: x
    """,
        8,
        "job.env.1BAD",
        "pattern",
    ),
    (
        "uppercase-name",
        """
        hosts:
          - address: 127.0.0.1
            tasks: {worker: 2}
        name: Demo
        job:
          script: train.py
        """,
        4,
        "name",
        "pattern",
    ),
    (
        "name-missing",
        """
        hosts:
          - address: 127.0.0.1
            tasks: {worker: 2}
        job:
          script: train.py
        """,
        1,
        "name",
        "required key is missing",
    ),
    (
        "heartbeat-timeout-below-twice-interval",
        MINIMAL
        + """\
    health:
      heartbeat_interval_s: 2
      heartbeat_timeout_s: 3
    """,
        7,
        "health",
        "at least twice",
    ),
    (
        "bad-host-key-policy",
        MINIMAL
        + """\
    ssh:
      host_key_policy: yolo
    """,
        8,
        "ssh.host_key_policy",
        "strict",
    ),
    (
        "coordinator-address-with-scheme",
        MINIMAL
        + """\
    ssh:
      coordinator_address: http://10.0.0.5
    """,
        8,
        "ssh.coordinator_address",
        "pattern",
    ),
    (
        "mwms-task-cannot-restart-alone",
        MINIMAL
        + """\
    policy:
      worker: {on_failure: restart_task}
    """,
        8,
        "policy.worker.on_failure",
        "cannot be restarted alone",
    ),
    (
        "policy-for-a-role-not-in-the-spec",
        MINIMAL
        + """\
    policy:
      ps: {on_failure: restart_job}
    """,
        8,
        "policy.ps",
        "no ps task",
    ),
    (
        "policy-bad-on-failure-value",
        MINIMAL
        + """\
    policy:
      worker: {on_failure: retry}
    """,
        8,
        "policy.worker.on_failure",
        "restart_job",
    ),
    (
        "ps-servers-cannot-decide",
        """
        name: demo
        strategy: parameter_server
        hosts:
          - address: 127.0.0.1
            tasks: {chief: 1, worker: 1, ps: 1}
        job:
          script: train.py
        policy:
          ps: {decides: true}
        """,
        9,
        "policy.ps.decides",
        "only the chief decides",
    ),
    (
        "parameter-server-needs-steps",
        """
        name: demo
        strategy: parameter_server
        hosts:
          - address: 127.0.0.1
            tasks: {chief: 1, worker: 1, ps: 1}
        job:
          loop: train.py
        train:
          epochs: 3
        """,
        9,
        "train.epochs",
        "give train.steps",
    ),
    (
        "cpu-replicas-only-for-mirrored",
        """
        name: demo
        hosts:
          - address: 127.0.0.1
            tasks: {worker: 2}
        job:
          loop: train.py
        train:
          steps: 3
          cpu_replicas: 2
        """,
        9,
        "train.cpu_replicas",
        "mirrored only",
    ),
    (
        "job-files-missing-folder",
        """
        name: demo
        hosts:
          - address: 127.0.0.1
            tasks: {worker: 1}
        job:
          script: train.py
          files: no-such-folder
        """,
        7,
        "job.files",
        "no such folder",
    ),
    (
        "mode-1-checkpoint-dir-in-a-loop-job",
        """
        name: demo
        hosts:
          - address: 127.0.0.1
            tasks: {worker: 1}
        job:
          loop: train.py
          checkpoint_dir: /nfs/ckpt
        train: {steps: 10}
        """,
        7,
        "job.checkpoint_dir",
        "train.checkpoint_dir",
    ),
    (
        "shared-dir-not-absolute",
        """
        name: demo
        hosts:
          - address: 127.0.0.1
            tasks: {worker: 1}
        job:
          script: train.py
        ssh:
          shared_dirs: [data/shared]
        """,
        8,
        "ssh.shared_dirs",
        "absolute path",
    ),
    (
        "spare-with-tasks",
        """
        name: demo
        backend: ssh
        hosts:
          - {address: 10.0.0.1, tasks: {worker: 1}}
          - address: 10.0.0.2
            spare: true
            tasks: {worker: 1}
        job:
          script: train.py
        """,
        6,
        "hosts[1].spare",
        "a spare host runs no task until a host is lost",
    ),
    (
        "spare-same-machine",
        """
        name: demo
        backend: ssh
        hosts:
          - {address: Lab-1.example.org, tasks: {worker: 1}}
          - {address: lab-1.example.org., port: 2222, spare: true}
        job:
          script: train.py
        """,
        5,
        "hosts[1].address",
        "this spare is the same machine as hosts[0]",
    ),
    (
        "spare-on-local",
        """
        name: demo
        hosts:
          - {address: 127.0.0.1, tasks: {worker: 1}}
          - {address: 10.0.0.2, spare: true}
        job:
          script: train.py
        """,
        4,
        "hosts[1].spare",
        "spare hosts are for backend ssh",
    ),
    (
        "min-workers-above-workers",
        """
        name: demo
        backend: ssh
        hosts:
          - {address: 10.0.0.1, tasks: {worker: 1}}
          - {address: 10.0.0.2, tasks: {worker: 1}}
        job:
          script: train.py
        restart: {shrink: true, min_workers: 3}
        """,
        8,
        "restart.min_workers",
        "3 is more than the spec's 2 worker task(s)",
    ),
    (
        "shrink-mirrored",
        """
        name: demo
        strategy: mirrored
        backend: ssh
        hosts:
          - {address: 10.0.0.1, tasks: {worker: 1}}
        job:
          script: train.py
        restart:
          shrink: true
        """,
        9,
        "restart.shrink",
        "mirrored runs one task on one host",
    ),
    (
        "shrink-ps-chief",
        """
        name: demo
        strategy: parameter_server
        backend: ssh
        hosts:
          - {address: 10.0.0.1, tasks: {chief: 1, worker: 1}}
          - {address: 10.0.0.2, tasks: {ps: 1, worker: 1}}
        job:
          script: train.py
        restart:
          shrink: true
        """,
        10,
        "restart.shrink",
        "no host could be left out",
    ),
    (
        "shrink-local",
        """
        name: demo
        hosts:
          - {address: 127.0.0.1, tasks: {worker: 2}}
        job:
          script: train.py
        restart:
          shrink: true
        """,
        7,
        "restart.shrink",
        "backend local runs on one machine",
    ),
]


@pytest.mark.parametrize(
    ("text", "line", "key", "message"), [c[1:] for c in BAD_SPECS], ids=[c[0] for c in BAD_SPECS]
)
def test_bad_spec_names_line_and_key(tmp_path: Path, text: str, line: int, key: str, message: str) -> None:
    with pytest.raises(SpecError) as info:
        parse(tmp_path, text)
    found = problems_of(info.value)
    assert any((ln, k) == (line, key) and message in msg for ln, k, msg in found), (
        f"expected {FILE}:{line}: {key}: …{message}…, got:\n{info.value}"
    )
    assert info.value.exit_code == 2


def test_job_files_must_hold_the_script(tmp_path: Path) -> None:
    (tmp_path / "lib").mkdir()
    with pytest.raises(SpecError) as info:
        parse(tmp_path, MINIMAL + "      files: lib\n")
    assert [(ln, k) for ln, k, _ in problems_of(info.value)] == [(7, "job.files")]
    assert "must be inside this folder" in str(info.value)
    assert parse(tmp_path, MINIMAL + "      files: .\n").job.files == tmp_path


def test_every_problem_is_reported_sorted_by_line(tmp_path: Path) -> None:
    text = """
        name: Demo
        hosts:
          - address: 127.0.0.1
            tasks: {worker: 0}
        job:
          script: nope.py
        hots: 1
    """
    with pytest.raises(SpecError) as info:
        parse(tmp_path, text)
    # pydantic errors come first (a spec that does not parse is not cross-checked), in line order
    found = [(ln, k) for ln, k, _ in problems_of(info.value)]
    assert found == sorted(found)
    assert (1, "name") in found and (7, "hots") in found


def test_cross_checks_report_several_problems(tmp_path: Path) -> None:
    text = """
        name: demo
        hosts:
          - address: 127.0.0.1
            tasks: {worker: 0, ps: 1}
        job:
          script: nope.py
          env:
            TF_CONFIG: x
    """
    with pytest.raises(SpecError) as info:
        parse(tmp_path, text)
    found = {(ln, k) for ln, k, _ in problems_of(info.value)}
    assert {
        (4, "hosts[0].tasks.worker"),
        (4, "hosts[0].tasks.ps"),
        (6, "job.script"),
        (8, "job.env.TF_CONFIG"),
    } <= found


# ---------------------------------------------------------------- good paths


def test_minimal_spec_loads_with_defaults(tmp_path: Path) -> None:
    spec = parse(tmp_path, MINIMAL)
    assert spec.name == "demo"
    assert spec.strategy is Strategy.MULTI_WORKER_MIRRORED
    assert spec.backend == "local"
    assert spec.hosts[0].tasks == {Role.WORKER: 2}
    assert spec.role_count(Role.WORKER) == 2 and spec.role_count(Role.CHIEF) == 0
    assert spec.job.script == tmp_path / "train.py"
    assert spec.job.loop is None and spec.train is None
    # docs/architecture.md §3 defaults
    assert spec.health.heartbeat_interval_s == 1.0
    assert spec.health.heartbeat_timeout_s == 10
    assert spec.health.stall_timeout_s == 120
    assert spec.health.startup_timeout_s == 120
    assert spec.restart.max_restarts == 3
    assert spec.restart.backoff_s == 2
    assert ssh_section(spec).host_key_policy.value == "strict"
    assert ssh_section(spec).connect_timeout_s == 10


def test_spec_is_frozen(tmp_path: Path) -> None:
    spec = parse(tmp_path, MINIMAL)
    with pytest.raises(Exception):  # noqa: B017 - pydantic raises ValidationError on frozen models
        spec.name = "other"  # type: ignore[misc]
    assert spec.name == "demo"


GOOD_SPECS = [
    (
        "full-mode-2",
        """
        name: digits-2
        strategy: multi_worker_mirrored
        backend: local
        hosts:
          - address: 127.0.0.1
            tasks: {chief: 1, worker: 1}
            gpus: [0, 1]
        job:
          loop: train.py
          args: [--lr, "0.1"]
          env: {TF_USE_LEGACY_KERAS: 1, RATE: 0.5}
        train:
          epochs: 2
          global_batch_size: 32
          checkpoint_every: 5
        health:
          heartbeat_interval_s: 0.5
          heartbeat_timeout_s: 3
        restart:
          max_restarts: 0
          backoff_s: 0
        ssh:
          host_key_policy: accept-new
        """,
    ),
    (
        "parameter-server",
        """
        name: ps
        strategy: parameter_server
        hosts:
          - address: 127.0.0.1
            tasks: {chief: 1, worker: 2, ps: 1, evaluator: 1}
        job:
          script: train.py
        """,
    ),
    (
        "mirrored-single",
        """
        name: one
        strategy: mirrored
        hosts:
          - address: 127.0.0.1
            tasks: {worker: 1}
        job:
          script: train.py
        """,
    ),
    (
        "ssh-distinct-addresses-same-base-port",
        """
        name: two-hosts
        backend: ssh
        hosts:
          - address: 10.0.0.1
            tasks: {worker: 2}
            base_port: 20000
          - address: 10.0.0.2
            tasks: {worker: 2}
            base_port: 20000
        job:
          script: train.py
        """,
    ),
    (
        "local-disjoint-base-ports",
        """
        name: two-hosts
        hosts:
          - address: 10.0.0.1
            tasks: {worker: 2}
            base_port: 20000
          - address: 10.0.0.2
            tasks: {worker: 2}
            base_port: 20002
        job:
          script: train.py
        """,
    ),
]


@pytest.mark.parametrize("text", [c[1] for c in GOOD_SPECS], ids=[c[0] for c in GOOD_SPECS])
def test_good_specs_load(tmp_path: Path, text: str) -> None:
    spec = parse(tmp_path, text)
    assert isinstance(spec, ClusterSpec)
    assert sum(sum(h.tasks.values()) for h in spec.hosts) >= 1


def test_full_spec_values(tmp_path: Path) -> None:
    spec = parse(tmp_path, GOOD_SPECS[0][1])
    assert spec.job.loop == tmp_path / "train.py"
    assert spec.job.args == ["--lr", "0.1"]
    # YAML numbers in env become strings (TF_USE_LEGACY_KERAS: 1 means "1")
    assert spec.job.env == {"TF_USE_LEGACY_KERAS": "1", "RATE": "0.5"}
    assert spec.train is not None and spec.train.epochs == 2 and spec.train.steps is None
    assert spec.train.global_batch_size == 32 and spec.train.checkpoint_every == 5
    assert spec.health.heartbeat_timeout_s == 3
    assert spec.restart.max_restarts == 0
    assert spec.hosts[0].gpus == [0, 1]


def test_relative_paths_resolve_against_spec_folder_not_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec_dir = tmp_path / "project"
    (spec_dir / "jobs").mkdir(parents=True)
    (spec_dir / "jobs" / "fit.py").write_text("")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    spec_file = spec_dir / "cluster.yaml"
    spec_file.write_text(
        y(
            """
            name: demo
            hosts:
              - address: 127.0.0.1
                tasks: {worker: 1}
                identity_file: keys/id_ed25519
            job:
              script: jobs/fit.py
            """
        )
    )
    monkeypatch.chdir(elsewhere)
    spec = load_spec(Path("..") / "project" / "cluster.yaml")
    assert spec.job.script == spec_dir.resolve() / "jobs" / "fit.py"
    assert spec.hosts[0].identity_file == spec_dir.resolve() / "keys" / "id_ed25519"
    # and the same file next to cwd would not be found
    (elsewhere / "cluster.yaml").write_text(spec_file.read_text())
    with pytest.raises(SpecError) as info:
        load_spec("cluster.yaml")
    assert problems_of_file(info.value, "cluster.yaml") == [(7, "job.script")]


def problems_of_file(exc: SpecError, file: str) -> list[tuple[int, str]]:
    out = []
    for rendered in str(exc).splitlines():
        m = LINE_RE.match(rendered)
        assert m and m["file"] == file, rendered
        out.append((int(m["line"]), m["key"]))
    return out


def test_load_spec_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(SpecError) as info:
        load_spec(missing)
    assert str(info.value).startswith(f"{missing}:1: (top level): cannot read the spec")


@pytest.mark.parametrize(
    ("written", "override", "expected"),
    [
        ("local", None, "local"),
        ("local", "ssh", "ssh"),
        ("ssh", "local", "local"),
        ("ssh", None, "ssh"),
    ],
)
def test_backend_override(tmp_path: Path, written: str, override: str | None, expected: str) -> None:
    (tmp_path / "train.py").write_text("")
    path = tmp_path / "spec.yaml"
    path.write_text(y(MINIMAL) + f"backend: {written}\n")
    assert load_spec(path, backend=override).backend == expected


def test_backend_override_changes_port_check(tmp_path: Path) -> None:
    # Same base_port on two different addresses: fine over ssh, a clash when simulated locally.
    text = GOOD_SPECS[3][1]
    assert parse(tmp_path, text).backend == "ssh"
    with pytest.raises(SpecError) as info:
        parse(tmp_path, text, backend="local")
    assert [(ln, k) for ln, k, _ in problems_of(info.value)] == [(9, "hosts[1].base_port")]


def test_an_evaluator_on_another_host_than_the_checkpoints_is_fine(tmp_path: Path) -> None:
    # the ssh backend ships every checkpoint to it (lab machines share no disk)
    spec = parse(
        tmp_path,
        """
        name: demo
        backend: ssh
        hosts:
          - address: 10.0.0.1
            tasks: {worker: 2}
          - address: 10.0.0.2
            tasks: {evaluator: 1}
        job:
          loop: train.py
        train:
          steps: 3
        """,
    )
    assert spec.role_count(Role.EVALUATOR) == 1


@pytest.mark.parametrize(
    ("written", "mode"), [("off", "off"), ("on", "on"), ("auto", "auto"), ("'off'", "off")]
)
def test_restart_standby_reads_yamls_bare_on_and_off(tmp_path, written, mode):
    (tmp_path / "job.py").write_text("")
    text = "name: t\nhosts: [{address: 127.0.0.1, tasks: {worker: 1}}]\njob: {script: job.py}\n"
    spec = parse_spec(text + f"restart: {{standby: {written}}}\n", file="s.yaml", base_dir=tmp_path)
    assert spec.restart.standby.value == mode
