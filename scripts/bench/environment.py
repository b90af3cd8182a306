"""Issue 38: what `environment:` costs, in one run (needs root: the namespace lab of tests/lab.py).

- First run on 2 and on 4 lab hosts whose Python (Debian's /usr/bin/python3) has no TensorFlow
  and no route to any index: `orchestrate up` of a 2-step MWMS job (one worker a host) with
  `environment: {requirements: [tensorflow-cpu==<this checkout's>]}` resolved from the tests'
  wheelhouse (tests/wheelhouse.py, no index): time to training (spawn -> first step), MB sent to
  each host, and the phases (resolve, download, send, build) from the run's record.
- Second run, same spec (environments ready) vs the same job without `environment:` on hosts
  whose Python has TensorFlow (this checkout's): the difference of the median spawn -> first
  step (alternated, --runs each; each side's own interpreter also differs), and the environment
  step's own time in the record (every host asked once, in parallel). Goal: <= 0.2 s added.
- The build itself, pip vs uv, on this machine, the same wheels and the same work (both compile
  the bytecode): a fresh venv each time; uv with its cache empty (a first environment) and warm (a
  changed requirement: the rest linked); uv without bytecode (its default, before issue 53) apart.
- `import tensorflow` in an environment made as `environment:` makes it, against a pip-made venv
  and uv without bytecode, the same interpreter (HOST_PYTHON), with PYTHONDONTWRITEBYTECODE=1 and
  without (issue 53).

    .venv/bin/python scripts/bench/environment.py [--runs 5] [--hosts 2,4] [--only build,imports]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from common import median, spread  # noqa: E402

from tests import wheelhouse  # noqa: E402
from tests.lab import NetnsLab  # noqa: E402
from worker.host.environment import install_argv  # noqa: E402

HOST_PYTHON = "/usr/bin/python3"
JOB = """
import time
import tensorflow as tf
import worker
strategy = tf.distribute.MultiWorkerMirroredStrategy()
with strategy.scope():
    v = tf.Variable(0.0, aggregation=tf.VariableAggregation.SUM)
step = tf.function(lambda: strategy.run(lambda: v.assign_add(1.0)))
for i in range(1, 3):
    step()
    if i == 1:
        print("FIRST_STEP", time.time(), flush=True)
    worker.report(step=i)
"""


def up(lab: NetnsLab, root: Path, cache: Path, *, environment: bool) -> dict[str, object]:
    """One `orchestrate up`; spawn -> first step (worker-0's), and the record's environment."""
    root.mkdir(parents=True)
    (root / "job.py").write_text(JOB)
    hosts = [
        lab.host_spec(i, python=HOST_PYTHON if environment else sys.executable) for i in range(len(lab.hosts))
    ]
    spec = {
        "name": "bench-env",
        "backend": "ssh",
        "hosts": hosts,
        "job": {"script": "job.py", "env": {"TF_CPP_MIN_LOG_LEVEL": "2"}},
        "ssh": lab.ssh_spec(),
        "restart": {"max_restarts": 0, "standby": "off"},
        "health": {"startup_timeout_s": 300},
    }
    if environment:
        wanted = wheelhouse.requirements()[:1]
        links = [str(wheelhouse.ensure())]
        spec["environment"] = {"requirements": wanted, "find_links": links, "no_index": True}
    (root / "spec.yaml").write_text(json.dumps(spec))
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    t0 = time.time()
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "up", "spec.yaml", "--run-dir", "run", "--plain"],
        cwd=root, env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    total = time.time() - t0
    if done.returncode != 0:
        raise SystemExit(f"orchestrate up failed:\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}")
    log = (root / "run" / "logs" / "worker-0.log").read_text()
    first = next(float(line.split()[1]) for line in log.splitlines() if line.startswith("FIRST_STEP"))
    record = json.loads((root / "run" / "backend.json").read_text())
    return {"first_step_s": first - t0, "total_s": total, "environment": record.get("environment")}


def first_runs(count: int, root: Path) -> dict[str, object]:
    lab = NetnsLab(root / f"lab{count}", count)
    try:
        run = up(lab, root / f"first{count}", root / f"cache{count}", environment=True)
        hosts = run["environment"]
        assert isinstance(hosts, list)
        return {
            "hosts": count,
            "time_to_training_s": round(float(run["first_step_s"]), 2),  # type: ignore[arg-type]
            "mb_sent_per_host": [round(h["to_send"] / 1e6, 1) for h in hosts],
            "phases_s": {
                "resolve": hosts[0]["seconds"].get("resolve"),
                "download": hosts[0]["seconds"].get("download"),
                "send (per host)": [h["seconds"].get("send") for h in hosts],
                "build (per host)": [h["seconds"].get("build") for h in hosts],
            },
        }
    finally:
        lab.close()


def second_runs(runs: int, root: Path) -> dict[str, object]:
    lab = NetnsLab(root / "lab-second", 2)
    try:
        cache = root / "cache-second"
        up(lab, root / "warm-up", cache, environment=True)  # the environments built
        made, plain, step = [], [], []
        for i in range(runs):
            run = up(lab, root / f"made{i}", cache, environment=True)
            made.append(float(run["first_step_s"]))  # type: ignore[arg-type]
            step.append(float(run["environment"][0]["seconds"]["step"]))  # type: ignore[index]
            plain.append(float(up(lab, root / f"plain{i}", cache, environment=False)["first_step_s"]))  # type: ignore[arg-type]
        return {
            "first_step_s_with_environment": round(median(made), 3),
            "first_step_s_without": round(median(plain), 3),
            "difference_s": round(median(made) - median(plain), 3),
            "environment_step_s (asked, nothing to do)": round(median(step), 3),
            "runs": runs,
        }
    finally:
        lab.close()


def _wheels_and_uv(root: Path) -> tuple[list[str], Path]:
    """Every wheel tensorflow-cpu needs (the wheelhouse's), and uv's binary unpacked."""
    links = wheelhouse.ensure()
    wheels = sorted(str(p) for p in links.glob("*.whl") if not p.name.startswith("uv-"))
    tools = root / "tools"
    with zipfile.ZipFile(next(links.glob("uv-*.whl"))) as z:
        member = next(n for n in z.namelist() if n.endswith(".data/scripts/uv"))
        z.extract(member, tools)
    (tools / member).chmod(0o755)
    return wheels, tools / member


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_", "PYTHONDONTWRITE"))}
    return {**env, "UV_NO_CONFIG": "1", "UV_PYTHON_DOWNLOADS": "never", "UV_OFFLINE": "1"}


def make_venv(kind: str, target: Path, wheels: list[str], uv: Path, cache: Path, pip_wheel: Path) -> None:
    """A venv of HOST_PYTHON with `wheels`: `pip` (pip compiles bytecode by default), `uv` as
    `environment:` makes it (worker/host/environment.py install_argv: bytecode compiled), `uv, no
    bytecode` (uv's default: before issue 53)."""
    env = _clean_env()
    if kind == "pip":
        subprocess.run([HOST_PYTHON, "-m", "venv", "--without-pip", target], check=True)
        install = [
            str(target / "bin" / "python"),
            f"{pip_wheel}/pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
        ]
        subprocess.run([*install, *wheels], check=True, env=env)
        return
    subprocess.run([uv, "venv", "-q", "--relocatable", "--python", HOST_PYTHON, target], check=True, env=env)
    argv = install_argv(str(uv), str(cache), str(target / "bin" / "python"))
    if kind == "uv, no bytecode":
        argv.remove("--compile-bytecode")
    subprocess.run([*argv, *wheels], check=True, env=env)


def builds(runs: int, root: Path) -> dict[str, object]:
    """pip vs uv, a fresh venv each time, every wheel tensorflow-cpu needs, the same work on both
    sides (bytecode compiled by both); uv with its cache empty (a first environment) and warm (a
    changed requirement: the rest linked), and uv without bytecode (what it did before) apart."""
    wheels, uv = _wheels_and_uv(root)
    pip_wheel = _pip_wheel(root)
    kinds = ("pip", "uv (cache empty)", "uv (cache warm)", "uv, no bytecode (cache empty)")
    timings: dict[str, list[float]] = {k: [] for k in kinds}
    warm = root / "uv-cache"
    make_venv("uv", root / "fill", wheels, uv, warm, pip_wheel)  # the warm cache's first fill: not timed
    shutil.rmtree(root / "fill")
    for i in range(runs):
        for kind in kinds:
            target, cache = root / f"venv-{i}", (warm if "warm" in kind else root / f"uvc-{i}")
            t0 = time.perf_counter()
            make_venv(
                "uv, no bytecode" if "no bytecode" in kind else kind.split(" (")[0],
                target,
                wheels,
                uv,
                cache,
                pip_wheel,
            )
            timings[kind].append(time.perf_counter() - t0)
            shutil.rmtree(target)
            if cache != warm:
                shutil.rmtree(cache, ignore_errors=True)
    out: dict[str, object] = {k: spread(v, 2) for k, v in timings.items()}
    pip = median(timings["pip"])
    out["ratios to pip (medians)"] = {k: round(median(v) / pip, 2) for k, v in timings.items() if k != "pip"}
    out["wheels"] = len(wheels)
    return out


def imports(runs: int, root: Path) -> dict[str, object]:
    """`import tensorflow` (a fresh process each time) in three venvs of the same interpreter and
    wheels: `uv` as `environment:` makes it, `pip`, and `uv, no bytecode` (before issue 53); each
    with PYTHONDONTWRITEBYTECODE=1 (as on this machine and in many images: nothing is ever
    written) and without (the first import may write the bytecode into the environment: `first`
    apart). Alternated within each round; ratios to pip's median in the same run."""
    wheels, uv = _wheels_and_uv(root)
    pip_wheel = _pip_wheel(root)
    kinds = ("uv", "pip", "uv, no bytecode")
    venvs = {k: root / f"imp-{i}" for i, k in enumerate(kinds)}
    for kind, target in venvs.items():
        make_venv(kind, target, wheels, uv, root / f"imp-cache-{kind[:2]}", pip_wheel)
    report: dict[str, object] = {}
    for flag in ("PYTHONDONTWRITEBYTECODE=1", "bytecode written where missing"):
        env = _clean_env() | ({"PYTHONDONTWRITEBYTECODE": "1"} if flag.startswith("PYTHON") else {})
        env["TF_CPP_MIN_LOG_LEVEL"] = "2"
        seen: dict[str, list[float]] = {k: [] for k in kinds}
        for _ in range(runs + (0 if flag.startswith("PYTHON") else 1)):
            for kind, target in venvs.items():
                t0 = time.perf_counter()
                subprocess.run([target / "bin" / "python", "-c", "import tensorflow"], check=True, env=env)
                seen[kind].append(time.perf_counter() - t0)
        part: dict[str, object] = {}
        for kind, xs in seen.items():
            if not flag.startswith("PYTHON"):  # the first import, that may write: apart
                part[f"{kind}: first"] = round(xs.pop(0), 2)
            part[kind] = spread(xs, 2)
        pip = median(seen["pip"])
        part["ratios to pip (medians)"] = {
            k: round(median(v) / pip, 2) for k, v in seen.items() if k != "pip"
        }
        report[flag] = part
    return report


def _pip_wheel(root: Path) -> Path:
    folder = root / "pip"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            folder,
            "pip",
        ],
        check=True,
    )
    return next(folder.glob("pip-*.whl"))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--hosts", default="2,4")
    parser.add_argument("--only", default="first,second,build,imports", help="which parts, comma-separated")
    args = parser.parse_args()
    only = set(args.only.split(","))
    with tempfile.TemporaryDirectory(prefix="bench-env-") as tmp:
        root = Path(tmp)
        report: dict[str, object] = {}
        if "first" in only:
            report["first run"] = [first_runs(int(n), root) for n in args.hosts.split(",")]
        if "second" in only:
            report["second run"] = second_runs(args.runs, root)
        if "build" in only:
            report["build"] = builds(max(2, args.runs // 2 + 1), root)
        if "imports" in only:
            report["import tensorflow"] = imports(args.runs, root)
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
